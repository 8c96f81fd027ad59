"""Kept state (``scheduler/keep.py``): which layers a graph keeps on their devices, what a kept
graph moves, and what the estimate counts for it."""

from __future__ import annotations

import dataclasses

import torch

from harmony.profiling.profiles import TiedWeight
from harmony.scheduler.estimator import estimate, promise
from harmony.scheduler.keep import keep_state, keepable_layers
from harmony.scheduler.lower import lower
from harmony.scheduler.memory import kept_bytes, kept_on
from harmony.scheduler.search import search
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import Channel, Configuration
from tests.scheduler.test_estimator import machine as machine_of

W = 1000  # weight bytes per layer of the uniform profile; its optimizer state is 2 W


def config(packs_f, packs_b, u: int = 4) -> Configuration:
    return Configuration(u_f=u, packs_f=packs_f, u_b=u, packs_b=packs_b)


ONE_PACK = config([(0, 5)], [(0, 5)])
TWO_PACKS = config([(0, 2), (3, 5)], [(0, 2), (3, 5)])


def test_one_device_stepping_its_packs_keeps_every_layer_and_moves_no_state(uniform):
    profile = uniform()
    graph = generate("pp", profile, TWO_PACKS, 1, 8, update="device")
    kept = keep_state(graph, profile, capacity=None)
    assert kept_on(kept) == {0: set(range(6))}
    moved = {(t.tensor, t.channel) for task in kept.tasks for t in (*task.inputs, *task.outputs)}
    assert not {(tensor, Channel.SWAP) for tensor in ("W", "K")} & moved
    assert all(t.nbytes == 0 for task in kept.tasks for t in (*task.inputs, *task.outputs) if t.channel == Channel.KEEP)
    assert kept_bytes(kept, profile) == {0: 6 * (W + 2 * W)}
    assert not kept_on(graph), "keep_state must not change the graph it is given"


def test_state_stepped_on_the_host_or_read_by_two_devices_is_not_kept(uniform):
    profile = uniform()
    assert keep_state(generate("pp", profile, ONE_PACK, 1, 8, update="host"), profile, None) is None
    assert keep_state(generate("gpipe-swap", profile, TWO_PACKS, 2, 8), profile, None) is None


def test_a_task_over_kept_and_unkept_layers_lets_them_all_go(uniform):
    """pp on 2 devices with different packs per pass: L0-1's forward runs on dev0 (pack L0-3) and
    its backward on dev1, so L0-1 cannot be kept; L2-3 run only on dev0, but the forward task over
    L0-3 loads them with L0-1, so they are let go too. L4-5 (dev1's loss pack) stay kept."""
    profile = uniform()
    graph = generate("pp", profile, config([(0, 3), (4, 5)], [(0, 1), (2, 3), (4, 5)]), 2, 8, update="device")
    keep = keepable_layers(graph, profile)
    assert keep == {4: {1}, 5: {1}}
    for layer, devices in keep.items():
        assert {t.device for t in graph.tasks if t.first <= layer <= t.last} == devices
    for task in graph.tasks:
        span = set(range(task.first, task.last + 1))
        assert span <= set(keep) or not span & set(keep), str(task)


def test_a_tied_weight_is_kept_only_with_all_of_its_layers_on_one_device_and_counted_once(uniform):
    tied = dataclasses.replace(uniform(), ties=[TiedWeight(layers=[0, 5], w_bytes=W, dw_bytes=W, k_bytes=2 * W)])
    one = keep_state(generate("pp", tied, TWO_PACKS, 1, 8, update="device"), tied, None)
    assert kept_on(one) == {0: set(range(6))}
    assert kept_bytes(one, tied) == {0: 5 * (3 * W)}  # six layers, the tied weight once
    two = generate("pp", tied, TWO_PACKS, 2, 8, update="device")  # L0-2 on dev0, L3-5 on dev1
    kept_two = keep_state(two, tied, None)
    assert kept_two is None or not {0, 5} & set().union(*kept_on(kept_two).values())


def test_kept_state_the_device_has_no_room_for_is_not_tried(uniform):
    profile = uniform()
    graph = generate("pp", profile, ONE_PACK, 1, 8, update="device")
    assert keep_state(graph, profile, capacity=6 * 3 * W) is None  # the kept state alone, no room to compute
    assert keep_state(graph, profile, capacity=10**9) is not None


def test_the_estimate_holds_the_kept_state_from_the_start_and_moves_only_activations(uniform):
    profile = uniform()
    machine = machine_of(devices=1)
    graph = generate("pp", profile, TWO_PACKS, 1, 8, update="device")
    kept = keep_state(graph, profile, None)
    moved, still = estimate(graph, profile, machine), estimate(kept, profile, machine)
    assert still.peak_memory[0] >= kept_bytes(kept, profile)[0]
    assert set(still.bytes_by_channel) <= {"SWAP in"}  # the minibatch in; nothing out
    assert still.bytes_by_channel["SWAP in"] < moved.bytes_by_channel["SWAP in"]
    assert still.iteration_time < moved.iteration_time
    kept.memory = promise(kept, profile, machine)
    loads = [a for stream in lower(kept, profile).streams[0].values() for a in stream if a.op == "LOAD"]
    assert all(a.tensor not in ("W", "B", "K") for a in loads)


def test_the_search_keeps_state_where_it_fits_and_not_when_told_not_to(uniform):
    profile = uniform()
    machine = machine_of(devices=1)
    kept = search(profile, machine, "pp", 1, 8, capacity=10**9, update="device")
    moved = search(profile, machine, "pp", 1, 8, capacity=10**9, update="device", keep=False)
    assert kept_on(kept.graph) and not kept_on(moved.graph)
    assert kept.estimate.iteration_time < moved.estimate.iteration_time


def test_a_device_short_of_room_for_all_its_packs_keeps_those_that_fit(uniform):
    from harmony.scheduler.memory import cached_task_memory

    profile = uniform()
    graph = generate("pp", profile, TWO_PACKS, 1, 8, update="device")
    full = keep_state(graph, profile, capacity=None)
    room = kept_bytes(full, profile)[0] + max(cached_task_memory(t, profile).peak for t in full.tasks)
    assert keep_state(graph, profile, capacity=room) is not None
    assert keep_state(graph, profile, capacity=room - 1) is None  # all or nothing
    partial = keep_state(graph, profile, capacity=room - 1, partial=True)
    assert partial is not None and kept_on(partial)[0] in ({0, 1, 2}, {3, 4, 5})  # one pack of the two
    held = kept_bytes(partial, profile)[0]
    assert all(held + cached_task_memory(t, profile).peak <= room - 1 for t in partial.tasks)


def test_a_one_device_host_updated_plan_steps_its_boundary_packs_on_the_device_where_that_is_faster():
    """GPT-2 medium on a modelled H100 at a quarter of its training footprint: stepped on the host,
    the first pack's gradients go out, are stepped and come back between one iteration's last
    backward and the next one's first forward. The search steps that pack and the head, which holds
    the embedding's tied weight, on the device, keeping their state there."""
    import functools

    import harmony
    from harmony.compiler import CompileOptions, profile_graph
    from harmony.models import gpt2
    from harmony.scheduler.estimator import estimate
    from harmony.scheduler.memory import kept_on
    from harmony.scheduler.modes import generate
    from harmony.scheduler.search import boundary_steps, search
    from harmony.scheduler.tasks import HOST, Kind

    with torch.device("meta"):
        model = gpt2.build_model("medium")
    get_batch = functools.partial(gpt2.get_batch, preset="medium")
    graph = harmony.decompose(model, get_batch(1, 0)[0])

    def profiled(cap):
        options = CompileOptions(minibatch=16, devices=1, device_memory=cap, analytic="h100", precision="bf16",
                                 compare=False, probe=False)
        return profile_graph(graph, get_batch, lambda ps: torch.optim.AdamW(ps), options)

    uncapped, _ = profiled(None)
    footprint = int(sum(l.w_bytes + l.dw_bytes + l.k_bytes + l.at("act_bytes", 16) for l in uncapped.layers))
    profile, machine = profiled(footprint // 4)
    result = search(profile, machine, "pp", 1, 16)
    steps = boundary_steps(profile, result.config)
    assert steps[0][0] == 0 and steps[-1][1] == len(profile.layers) - 1
    assert kept_on(result.graph) == {0: {layer for first, last in steps for layer in range(first, last + 1)}}
    hosted = [(t.first, t.last) for t in result.graph.tasks if t.kind == Kind.UPD and t.device == HOST]
    assert hosted and not set(hosted) & set(steps)
    all_host = generate("pp", profile, result.config, 1, 16, update="host")
    assert result.estimate.iteration_time < estimate(all_host, profile, machine, capacity=footprint // 4).iteration_time
