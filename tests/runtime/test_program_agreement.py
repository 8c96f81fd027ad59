"""Three players of one program agree: the executor moves exactly what the lowered program says
(per device and stream, the same edges by key, the same bytes, in the same order; the same
pack-state loads and stores, in the same order), and the simulation (``scheduler/simulator.py``)
starts each stream's actions in the program's order.

Plans come from the search and from a configuration with U_F != U_B and different packs in the two
passes (pieces cross microbatch boundaries); each runs under its memory promise (the Trainer
estimates one for the second), so the next task's state loads at the unit the promise chose."""

from __future__ import annotations

import functools

import pytest
import torch

import harmony
from harmony.models import gpt2
from harmony.plan import Plan
from harmony.scheduler.lower import Program, lower
from harmony.scheduler.simulator import stream_order
from harmony.scheduler.machine import nominal_machine
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import Configuration

from test_training import MINIBATCH, adam, compiled, plan_for

STREAMS_COMPARED = ("swap-in", "swap-out", "p2p-in", "p2p-out", "compute")


def uneven_plan(mode: str) -> Plan:
    _, _, base = compiled("gpt2")
    last = len(base.profile.layers) - 1
    config = Configuration(u_f=3, packs_f=[(0, 1), (2, last)], u_b=2, packs_b=[(0, 0), (1, 1), (2, last)])
    tasks = generate(mode, base.profile, config, 2, MINIBATCH)
    roomy = 4 * base.options["device_memory"]  # a configuration nobody searched: room, not fit, is not the point
    return Plan(graph=base.graph, profile=base.profile, tasks=tasks, estimate={},
                options={**base.options, "mode": mode, "device_memory": roomy})


def executor_transfers(plan: Plan) -> dict[int, dict[str, list[tuple]]]:
    get_batch = functools.partial(gpt2.get_batch, preset="tiny", dtype="float64")
    with harmony.Trainer(plan, optimizer=adam, loss_fn=gpt2.loss_fn, timeout=30) as trainer:
        trainer.step(*get_batch(MINIBATCH, 0))
        return {d: w.transfers for d, w in enumerate(trainer.history[-1].workers)}


def listed(program: Program, per: dict[str, list]) -> dict[str, list[tuple]]:
    """A device's actions per stream as the executor logs them: (op, edge key or (task, tensor),
    bytes); a store's or a running gradient's bytes are the runtime's tensors', which the profile's
    sizes need not be."""
    out: dict[str, list[tuple]] = {}
    backward = {a.task for acts in program.streams.values() for a in acts.get("compute", []) if a.op.startswith("BWD")}
    for stream, actions in per.items():
        items = []
        for a in actions:
            if a.edge is not None:
                items.append((a.op, program.edges[a.edge].key, a.nbytes))
            elif a.op == "LOAD" and a.tensor in ("W", "B"):
                items.append((a.op, (a.task, a.tensor), a.nbytes))
            elif a.op == "LOAD" and a.tensor == "dW" and a.task in backward:  # a backward's running gradient
                items.append((a.op, (a.task, a.tensor), None))
            elif a.op == "STORE":
                items.append((a.op, (a.task, a.tensor), None))
        if items:
            out[stream] = items
    return out


def program_transfers(plan: Plan) -> dict[int, dict[str, list[tuple]]]:
    program = lower(plan.tasks, plan.profile)
    return {device: listed(program, per) for device, per in program.streams.items()}


def simulated_transfers(plan: Plan) -> dict[int, dict[str, list[tuple]]]:
    program = lower(plan.tasks, plan.profile)
    machine = plan.profile.machine or nominal_machine("cpu", plan.tasks.devices, plan.profile.capacity)
    return {device: listed(program, per)
            for device, per in stream_order(program, plan.tasks, plan.profile, machine).items()}


def assert_agree(plan: Plan) -> None:
    ran, planned, simulated = executor_transfers(plan), program_transfers(plan), simulated_transfers(plan)
    for device in set(ran) | set(planned):
        for stream in STREAMS_COMPARED:
            got = [tuple(None if n == 2 and (item[0] == "STORE" or item[1][1:] == ("dW",))
                         else tuple(x) if isinstance(x, list) else x
                         for n, x in enumerate(item))
                   for item in ran.get(device, {}).get(stream, [])]
            want = planned.get(device, {}).get(stream, [])
            assert got == want, f"dev{device} {stream}:\n ran     {got}\n planned {want}"
            played = simulated.get(device, {}).get(stream, [])
            assert played == want, f"dev{device} {stream}:\n simulated {played}\n planned   {want}"


@pytest.mark.parametrize("mode", ["pp", "dp", "gpipe-swap", "dp-swap", "1f1b-swap-r"])
def test_the_executor_moves_what_the_searched_plan_program_says(mode):
    torch.manual_seed(0)
    _, _, plan = plan_for("gpt2", mode, 2)
    assert_agree(plan)


@pytest.mark.parametrize("mode", ["pp", "dp", "gpipe-swap"])
def test_the_executor_moves_what_the_program_says_when_microbatch_sizes_differ(mode):
    torch.manual_seed(0)
    assert_agree(uneven_plan(mode))
