"""Activations kept from a pack's forward to its backward (``Configuration.keep``), or sent to host
memory in between and brought back (``Configuration.swap``): the backward recomputes nothing, and
training still equals eager training on one process (float64), within the plan's memory, with the
ledger knowing of every byte the kept activations hold.

Configurations are fixed rather than searched, so that every pack but the loss task's keeps (and, in
the mixed case, one keeps while another recomputes); the capacity is roomy, since what is checked is
that the run keeps the promise the estimator made for it, not that the plan fits a small device.
"""

from __future__ import annotations

import copy

import pytest
import torch

import harmony
from bench import timed as bench_timed
from harmony.plan import Plan
from harmony.runtime.reference import microbatches_of, reference_train
from harmony.scheduler.modes import generate
from harmony.scheduler.taskgraph import keepable_packs
from harmony.scheduler.tasks import Configuration

from test_program_agreement import assert_agree
from test_training import MINIBATCH, MODELS, adam, compiled

STEPS = 3


def kept_plan(name: str, mode: str, update: str, how: str = "keep") -> Plan:
    """A plan of three packs on two devices whose two first packs keep their activations
    (``how="keep"``), swap them (``"swap"``), or the first keeps, the second swaps, and the second's
    backward recomputes nothing either (``"mixed"``; ``"first"``: the first keeps, the second
    recomputes)."""
    _, _, base = compiled(name)
    last = len(base.profile.layers) - 1
    packs = [(0, 1), (2, 3), (4, last)]
    first, second = keepable_packs(mode, Configuration(2, packs, 2, packs), 2)
    chosen = {"keep": {"keep": (first, second)}, "swap": {"swap": (first, second)},
              "mixed": {"keep": (first,), "swap": (second,)}, "first": {"keep": (first,)}}[how]
    tasks = generate(mode, base.profile, Configuration(2, packs, 2, packs, **chosen), 2, MINIBATCH, update=update)
    plan = Plan(graph=base.graph, profile=base.profile, tasks=tasks, estimate={},
                options={**base.options, "mode": mode, "devices": 2, "device_memory": 4 * base.options["device_memory"]})
    plan.loss_fn = MODELS[name].loss_fn
    plan.build_optimizer = adam
    return plan


def train_and_compare(name: str, plan: Plan) -> None:
    model, get_batch, _ = compiled(name)
    reference = copy.deepcopy(model)
    batches = [get_batch(MINIBATCH, step) for step in range(STEPS)]
    with harmony.Trainer(plan, optimizer=adam, loss_fn=plan.loss_fn, timeout=30, check_memory=True) as trainer:
        losses = [trainer.step(*batch) for batch in batches]
        state = trainer.state_dict()
        history = trainer.history
    expected = reference_train(reference, plan.loss_fn, adam, batches, microbatches_of(plan.tasks))
    assert losses == pytest.approx(expected, rel=1e-9)
    for key, want in reference.state_dict().items():
        assert torch.allclose(state[key], want, rtol=1e-9, atol=1e-9), key
    promised = plan.tasks.memory.devices
    for device in range(2):
        peak = max(step.workers[device].peak for step in history)
        assert peak <= promised[device], f"dev{device} peaked at {peak:,} bytes, planned {promised[device]:,}"
        shortfall = max(step.workers[device].ledger_shortfall for step in history)
        assert shortfall == 0, f"dev{device} held {shortfall:,} bytes its ledger did not count"
        # and the ledger counts nothing twice (what admission reads, and an unchecked run's peak)
        counted = max(step.workers[device].ledger_peak for step in history)
        assert counted <= promised[device], f"dev{device}'s ledger counted {counted:,} bytes, planned {promised[device]:,}"


@pytest.mark.parametrize("how", ["keep", "swap"])
@pytest.mark.parametrize("mode,update", [("pp", "device"), ("pp", "host"), ("dp", "device"), ("dp", "host")])
def test_kept_and_swapped_activations_train_as_eager_within_the_plan(mode, update, how):
    torch.manual_seed(0)
    plan = kept_plan("gpt2", mode, update, how)
    assert all(t.keep for t in plan.tasks.tasks if t.kind.value == "BWD" and not t.loss)
    train_and_compare("gpt2", plan)


@pytest.mark.parametrize("how,choices", [("first", ["keep", "recompute", "loss"]), ("mixed", ["keep", "swap", "loss"])])
def test_a_plan_mixing_the_choices_trains_as_eager(how, choices):
    torch.manual_seed(0)
    plan = kept_plan("gpt2", "pp", "device", how)
    assert [choice for _, choice in plan.tasks.config.choices()] == choices
    train_and_compare("gpt2", plan)


@pytest.mark.parametrize("how", ["keep", "swap"])
def test_kept_activations_of_a_model_with_batchnorm_train_as_eager(how):
    """ResNet's BatchNorm statistics are updated once, by the forward: the backward reads the
    activations it recorded (or brought back from host memory) and runs no forward again."""
    torch.manual_seed(0)
    train_and_compare("resnet", kept_plan("resnet", "dp", "host", how))


def test_swapped_activations_move_the_bytes_the_plan_says():
    """What a swapping forward sends to host memory are the storages its autograd graph saved but
    the pack's input and output: as many bytes as the profile says (``pack_swapped_bytes``)."""
    torch.manual_seed(0)
    plan = kept_plan("gpt2", "pp", "device", "swap")
    model, get_batch, _ = compiled("gpt2")
    with harmony.Trainer(plan, optimizer=adam, loss_fn=plan.loss_fn, timeout=30) as trainer:
        trainer.step(*get_batch(MINIBATCH, 0))
        moved = trainer.history[-1].bytes_by_channel()
    assert moved == plan.tasks.bytes_by_channel()
    assert plan.tasks.swap_bytes("As") > 0


@pytest.mark.parametrize("how", ["keep", "swap"])
@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_the_executor_moves_what_a_program_with_kept_activations_says(mode, how):
    torch.manual_seed(0)
    assert_agree(kept_plan("gpt2", mode, "device", how))


@pytest.mark.slow
@pytest.mark.parametrize("mode,how", [("pp", "swap"), ("pp", "mixed"), ("dp", "swap")])
def test_a_timed_run_with_swapped_activations_takes_its_simulated_time(mode, how):
    """On timed devices (every copy as long as the cost model says) a plan that swaps activations
    runs in its program's simulated time: the swaps are where the program puts them. The profile is
    measured, so the bytes the forward saves are the profile's (an analytic profile's are the
    modelled GPU's, which the CPU's kernels do not save alike)."""
    torch.manual_seed(0)
    plan = kept_plan("gpt2", mode, "device", how)
    plan.promise_memory()
    case = bench_timed.run_case(bench_timed.Case("gpt2", mode, 2), plan, steps=2)
    assert abs(case.relative) < 0.02, (case.estimated, case.measured, case.worst_unit)
