"""Kept activations in the scheduler: which packs may keep them, the graphs and programs that carry
them, what they cost and hold, and the search's choice between keeping and recomputing."""

import dataclasses

import pytest

from harmony.scheduler.estimator import estimate, promise
from harmony.scheduler.lower import lower
from harmony.scheduler.machine import Machine
from harmony.scheduler.memory import task_memory
from harmony.scheduler.modes import generate
from harmony.scheduler.search import search
from harmony.scheduler.taskgraph import keepable_packs
from harmony.scheduler.tasks import Channel, Configuration, Kind, TaskGraph

PACKS4 = [(0, 0), (1, 1), (2, 2), (3, 5)]


def machine() -> Machine:
    return Machine.from_spec("1080ti", 2)


def test_every_pack_but_the_loss_pack_may_keep_on_two_devices():
    config = Configuration(2, PACKS4, 2, PACKS4)
    assert keepable_packs("pp", config, 2) == ((0, 0), (1, 1), (2, 2))
    assert keepable_packs("dp", config, 2) == ((0, 0), (1, 1), (2, 2))


def test_pp_keeps_only_packs_whose_forward_and_backward_share_a_device():
    """On three devices forward pack i runs on i mod 3 and the backward at chain position j on
    j mod 3: with four packs, the chain is F0 F1 F2 L3 B2 B1 B0 on devices 0 1 2 0 1 2 0."""
    config = Configuration(2, PACKS4, 2, PACKS4)
    assert keepable_packs("pp", config, 3) == ((0, 0),)


def test_no_pack_keeps_across_microbatch_sizes_other_packs_or_ungrouped_tasks():
    assert keepable_packs("pp", Configuration(2, PACKS4, 3, PACKS4), 2) == ()
    assert keepable_packs("pp", Configuration(2, [(0, 1), (2, 2), (3, 5)], 2, PACKS4), 2) == ((2, 2),)
    assert keepable_packs("pp", Configuration(2, PACKS4, 2, PACKS4), 2, grouping=False) == ()
    assert keepable_packs("1f1b-swap", Configuration(2, PACKS4, 2, PACKS4), 2) == ()


def test_a_pack_that_cannot_keep_is_refused(uniform):
    with pytest.raises(ValueError, match="cannot keep the activations"):
        generate("pp", uniform(), Configuration(2, PACKS4, 2, PACKS4, keep=((1, 1),)), 3, 6)


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_a_kept_backward_reads_its_forwards_state_and_activations_and_no_stash(mode, uniform):
    profile = uniform()
    graph = generate(mode, profile, Configuration(2, PACKS4, 2, PACKS4, keep=((0, 0), (2, 2))), 2, 6)
    by_id = {t.id: t for t in graph.tasks}
    for task in graph.tasks:
        if task.kind == Kind.BWD and (task.first, task.last) in ((0, 0), (2, 2)):
            assert task.keep
            (w,) = [t for t in task.inputs if t.tensor == "W"]
            forward = by_id[w.task]
            assert w.channel == Channel.LOCAL and forward.kind == Kind.FWD and forward.keep
            assert forward.device == task.device
            kept = [t for t in task.inputs if t.tensor == "A"]
            assert [t.microbatch for t in kept] == list(range(len(task.microbatches)))
            assert [t.nbytes for t in kept] == [profile.pack_kept_bytes(task.first, task.last, u) for u in task.microbatches]
            assert not [t for t in task.inputs if t.tensor in ("X", "Xs", "B")]
        elif task.kind == Kind.BWD and not task.loss and (task.first, task.last) == (1, 1):
            assert not task.keep and [t for t in task.inputs if t.tensor == "Xs"]


def test_the_choice_travels_with_the_plan(uniform):
    graph = generate("pp", uniform(), Configuration(2, PACKS4, 2, PACKS4, keep=((1, 1),)), 2, 6)
    again = TaskGraph.from_dict(graph.to_dict())
    assert again.config == graph.config and [t.keep for t in again.tasks] == [t.keep for t in graph.tasks]
    assert str(graph.config).endswith("keep=[L1]")
    assert graph.config.choices() == [((0, 0), "recompute"), ((1, 1), "keep"), ((2, 2), "recompute"),
                                      ((3, 5), "loss")]


def test_keeping_saves_the_recompute_and_holds_the_activations(uniform):
    profile = uniform()
    packs = [(0, 2), (3, 5)]
    recompute = generate("dp", profile, Configuration(3, packs, 3, packs), 2, 6)
    kept = generate("dp", profile, Configuration(3, packs, 3, packs, keep=((0, 2),)), 2, 6)
    slow = estimate(recompute, profile, machine())
    fast = estimate(kept, profile, machine())
    # each device runs one microbatch of 3 through each pack, in parallel: one recompute saved (the
    # uniform profile's forward records for autograd in the time it runs without)
    saved = profile.pack_time(0, 2, 3, "recompute_time")
    assert slow.iteration_time - fast.iteration_time == pytest.approx(saved, rel=0.05)
    assert max(fast.peak_memory.values()) > max(slow.peak_memory.values())
    by_kind = {(t.kind, t.keep): task_memory(t, profile) for t in kept.tasks if t.first == 0 and t.device == 0}
    forward = by_kind[(Kind.FWD, True)]
    assert min(forward.work) >= profile.pack_kept_bytes(0, 2, 3)


def test_the_program_keeps_activations_on_the_compute_stream(uniform):
    profile = uniform()
    packs = [(0, 2), (3, 5)]
    graph = generate("pp", profile, Configuration(3, packs, 3, packs, keep=((0, 2),)), 2, 6)
    graph.memory = promise(graph, profile, machine(), profile.capacity)
    program = lower(graph, profile)
    kept = [a for a in program.streams[0]["compute"] if a.tensor == "A"]
    assert [a.op for a in kept] == ["SEND", "SEND", "RECV", "RECV"]
    assert all(a.nbytes == profile.pack_kept_bytes(0, 2, 3) for a in kept)


def test_the_search_keeps_with_memory_to_spare_and_recomputes_without(uniform):
    """With room, every keepable pack keeps; at a capacity where the kept activations of a whole
    minibatch do not fit, the search recomputes. Either way its plan is no slower than the best
    plan that recomputes every pack."""
    profile = uniform(layers=6, w=100_000, x_per_sample=50_000)
    m = dataclasses.replace(machine(), cpu_cores=None)
    sizes = {"sizes": lambda limit: [s for s in (2, 3, 6) if s <= limit]}
    roomy = search(profile, m, "pp", 2, 6, capacity=10**9, **sizes)
    assert roomy.config.keep
    recompute_only = search(profile, m, "pp", 2, 6, capacity=10**9, keep_candidates=True, **sizes)
    best_recompute = min(t for t, c in recompute_only.candidates if not c.keep)
    assert roomy.estimate.iteration_time <= best_recompute
    tight = max(search(profile, m, "pp", 2, 6, capacity=10**9, **sizes).estimate.peak_memory.values()) // 2
    pressed = search(profile, m, "pp", 2, 6, capacity=tight, keep_candidates=True, **sizes)
    recomputing = [t for t, c in pressed.candidates if not c.keep]
    assert pressed.estimate.iteration_time <= min(recomputing)
    assert max(pressed.estimate.peak_memory.values()) <= tight


def test_a_swapping_backward_brings_all_but_the_packs_input_and_output_through_host_memory(uniform):
    profile = uniform()
    graph = generate("pp", profile, Configuration(2, PACKS4, 2, PACKS4, keep=((0, 0),), swap=((1, 1),)), 2, 6)
    (backward,) = [t for t in graph.tasks if t.kind == Kind.BWD and (t.first, t.last) == (1, 1)]
    kept = [t for t in backward.inputs if t.tensor == "A"]
    swapped = [t for t in backward.inputs if t.tensor == "As"]
    assert backward.keep and [t.channel for t in swapped] == [Channel.SWAP] * 3
    x, y = profile.layers[1].at("x_bytes", 2), profile.layers[1].at("y_bytes", 2)
    assert [t.nbytes for t in kept] == [x + y] * 3
    assert [t.nbytes for t in swapped] == [profile.pack_kept_bytes(1, 1, 2) - x - y] * 3
    assert graph.config.choices()[:2] == [((0, 0), "keep"), ((1, 1), "swap")]
    assert TaskGraph.from_dict(graph.to_dict()).config == graph.config


def test_a_pack_cannot_both_keep_and_swap(uniform):
    with pytest.raises(ValueError, match="both keeps and swaps"):
        generate("pp", uniform(), Configuration(2, PACKS4, 2, PACKS4, keep=((1, 1),), swap=((1, 1),)), 2, 6)


def test_the_search_swaps_what_it_cannot_keep_where_the_link_has_room(uniform):
    """Recomputing a pack costs its forward again; swapping its activations costs the host link,
    which is idle here: at a capacity where the kept activations no longer fit, the search swaps
    them, and its plan is faster than the best that recomputes."""
    profile = uniform(layers=6, w=100_000, x_per_sample=50_000)
    m = dataclasses.replace(machine(), cpu_cores=None)
    sizes = {"sizes": lambda limit: [s for s in (2, 3, 6) if s <= limit]}
    roomy = search(profile, m, "pp", 2, 6, capacity=10**9, **sizes)
    capacity = int(0.8 * max(roomy.estimate.peak_memory.values()))
    pressed = search(profile, m, "pp", 2, 6, capacity=capacity, keep_candidates=True, **sizes)
    assert pressed.config.swap and not pressed.config.keep
    recomputing = [t for t, c in pressed.candidates if not c.keep and not c.swap]
    assert pressed.estimate.iteration_time < min(recomputing)
    assert max(pressed.estimate.peak_memory.values()) <= capacity


def test_what_a_plan_parks_in_host_memory_is_its_stashes_and_swapped_activations_once(uniform):
    """``parked_bytes``: each stashed input and swapped activation sent over SWAP, counted once (the
    graph's swap bytes count them out and back in); a plan that keeps everything parks nothing."""
    profile = uniform()
    swapped = generate("pp", profile, Configuration(2, PACKS4, 2, PACKS4, swap=((0, 0), (2, 2))), 2, 6)
    assert swapped.swap_bytes("As") > 0 and swapped.swap_bytes("Xs") > 0
    assert swapped.parked_bytes() * 2 == swapped.swap_bytes("As") + swapped.swap_bytes("Xs")
    kept = generate("dp", profile, Configuration(2, PACKS4, 2, PACKS4, keep=((0, 0), (1, 1), (2, 2))), 2, 6)
    assert kept.parked_bytes() == 0


def test_a_stash_for_another_device_is_not_parked_in_its_senders_memory(uniform):
    """On three devices the chain F0 F1 F2 L3 B2 B1 B0 runs on 0 1 2 0 1 2 0: pack 1's stash goes
    from dev1 to dev2 through the message slabs, which a launch checks as shared memory."""
    graph = generate("pp", uniform(), Configuration(2, PACKS4, 2, PACKS4), 3, 6)
    device = {t.id: t.device for t in graph.tasks}
    stashes = [(task.device, device[t.task], t.nbytes) for task in graph.tasks for t in task.outputs
               if t.tensor == "Xs" and t.channel == Channel.SWAP]
    assert any(src != dst for src, dst, _ in stashes)
    assert graph.parked_bytes() == sum(n for src, dst, n in stashes if src == dst)
