"""The program played (``scheduler/simulator.py``): each stream runs its actions in the program's
order, each action after what it reads, for as long as the cost model says; a program that cannot
finish says where it is stuck."""

import dataclasses

import pytest

from harmony.scheduler.costs import copy_seconds, unit_seconds
from harmony.scheduler.lower import lower
from harmony.scheduler.modes import MODES
from harmony.scheduler.simulator import simulate, stream_order, unit_starts

from conftest import uniform_profile
from test_lower import MACHINE, promised


@pytest.mark.parametrize("mode", MODES)
def test_every_stream_runs_its_actions_in_the_program_order(uniform, mode):
    graph = promised(uniform, mode)
    program = lower(graph, uniform(layers=4))
    ran = stream_order(program, graph, uniform(layers=4), MACHINE)
    for device, per in program.streams.items():
        for stream, actions in per.items():
            assert ran.get(device, {}).get(stream, []) == actions, f"dev{device} {stream}"


@pytest.mark.parametrize("mode", MODES)
def test_a_program_plays_to_its_end_with_each_action_after_what_it_reads(uniform, mode):
    graph = promised(uniform, mode)
    profile = uniform(layers=4)
    program = lower(graph, profile)
    est = simulate(program, graph, profile, MACHINE)
    assert est.deadlock is None
    ends = {}
    for e in est.events:
        ends.setdefault(e.label, e.end)
    starts = {e.label: e.start for e in est.events}
    for device, per in program.streams.items():
        for stream, actions in per.items():
            for before, after in zip(actions, actions[1:]):  # one stream, one action at a time
                if stream != "compute" or after.op not in ("SEND", "RECV"):
                    assert starts[str(after)] >= ends[str(before)] - 1e-12
    for e in program.edges:  # a piece is received once sent
        if e.producer is not None:
            send = next(str(a) for per in program.streams.values() for acts in per.values() for a in acts
                        if a.op == "SEND" and a.edge == e.id)
            recv = next(str(a) for per in program.streams.values() for acts in per.values() for a in acts
                        if a.op == "RECV" and a.edge == e.id)
            assert starts[recv] >= ends[send] - 1e-12
    assert est.iteration_time == pytest.approx(max(e.end for e in est.events))


def test_one_device_takes_its_state_load_its_inputs_and_its_units_back_to_back(uniform):
    """pp on one device, state never prefetched ahead: the first unit starts once its state and
    input are in, and each later unit as the one before ends (inputs come in meanwhile)."""
    profile = uniform(layers=4)
    graph = promised(uniform, "pp")
    program = lower(graph, profile)
    est = simulate(program, graph, profile, MACHINE)
    starts = unit_starts(est)
    first = graph.device_tasks(0)[0]
    state = sum(a.nbytes for a in program.actions(0, "swap-in") if a.op == "LOAD" and a.task == first.id)
    x = next(a for a in program.actions(0, "swap-in") if a.op == "RECV" and a.task == first.id)
    assert starts[(first.id, 0)] == pytest.approx(copy_seconds(state, "h2d", MACHINE)
                                                  + copy_seconds(x.nbytes, "h2d", MACHINE))
    units = unit_seconds(first, profile, MACHINE)
    for j in range(1, len(first.microbatches)):
        assert starts[(first.id, j)] >= starts[(first.id, j - 1)] + units[j - 1] - 1e-12


def test_an_update_waits_for_every_backward_whose_gradients_it_steps(uniform):
    profile = uniform(layers=4)
    graph = promised(uniform, "dp")
    program = lower(graph, profile)
    est = simulate(program, graph, profile, MACHINE)
    ends: dict[int, float] = {}
    for e in est.events:
        ends[e.task] = max(ends.get(e.task, 0.0), e.end)
    starts = unit_starts(est)
    updates = [t for t in graph.tasks if t.kind.value == "UPD"]
    assert updates
    for task in updates:
        assert program.gathers[task.id]
        for b in program.gathers[task.id]:
            assert starts[(task.id, 0)] >= ends[b] - 1e-12


def test_a_program_that_cannot_finish_names_the_unit_stuck_and_what_it_waits_for(uniform):
    """dev0 set to run a backward before the forwards whose outputs it waits for."""
    profile = uniform(layers=4)
    graph = promised(uniform, "pp")
    program = lower(graph, profile)
    order = program.issue_order(0)
    fwd = next(a for a in order if a.op == "FWD")
    bwd = next(a for a in order if a.op.startswith("BWD"))
    swapped = {fwd.seq: bwd.seq, bwd.seq: fwd.seq}
    for stream, actions in program.streams[0].items():
        moved = [dataclasses.replace(a, seq=swapped.get(a.seq, a.seq)) for a in actions]
        program.streams[0][stream] = sorted(moved, key=lambda a: a.seq)
    est = simulate(program, graph, profile, MACHINE)
    assert est.iteration_time == float("inf")
    assert f"dev0 waits to run {bwd}" in est.deadlock


def test_a_receive_naming_no_send_is_refused():
    profile = uniform_profile(layers=4)
    graph = promised(lambda layers: uniform_profile(layers=layers), "pp")
    program = lower(graph, profile)
    recv = next(a for a in program.actions(1, "p2p-in") if a.op == "RECV")
    for per in program.streams.values():
        for stream, actions in per.items():
            per[stream] = [a for a in actions if not (a.op == "SEND" and a.edge == recv.edge)]
    with pytest.raises(ValueError, match=f"e{recv.edge}"):
        simulate(program, graph, profile, MACHINE)
