"""What a task holds and when (scheduler/memory.py), and how the estimator adds it up: each cause of a
plan falling below a run's peak as one small case on a synthetic profile."""

from __future__ import annotations

import pytest

from harmony.scheduler import memory
from harmony.scheduler.estimator import estimate
from harmony.scheduler.machine import Machine
from harmony.profiling.profiles import LayerProfile, LayerSample, LossSample, PackSample, Profile
from harmony.scheduler.tasks import Channel, Configuration, Kind, MemoryPlan, Task, TaskGraph, Transfer

W = 1_000_000  # weight bytes per layer
X = 1_000  # activation bytes per sample
U = 4


def _layer(i: int) -> LayerProfile:
    samples = [LayerSample(u=u, fwd_time=1e-3 * u, bwd_time=2e-3 * u, recompute_time=1e-3 * u,
                           fwd_peak=W + 3 * X * u, bwd_peak=2 * W + 8 * X * u + W // 2, bwd_first_peak=2 * W + 8 * X * u,
                           x_bytes=X * u, y_bytes=X * u, dx_bytes=X * u, act_bytes=2 * X * u)
               for u in (1, 8)]
    return LayerProfile(index=i, name=f"L{i}", w_bytes=W, dw_bytes=W, k_bytes=2 * W, b_bytes=0,
                        upd_time_device=1e-4, upd_time_host=1e-3, fwd_samples=samples, bwd_samples=samples,
                        upd_bytes=W // 4)


@pytest.fixture
def profile() -> Profile:
    return Profile(source="measured", device="test", capacity=1 << 30, u_fmax=8, u_bmax=8,
                   layers=[_layer(i) for i in range(4)], update_growth=0.0)


def machine(kind: str = "analytic") -> Machine:
    return Machine(kind=kind, device_name="test", devices=2, capacity=1 << 30, h2d=1e9, d2h=1e9, d2d=2e9,
                   host_link_shared=False, h2d_all=2e9, d2h_all=2e9, msg=1e9, latency=0.0)


def graph(tasks: list[Task], mode: str = "test") -> TaskGraph:
    config = Configuration(u_f=U, packs_f=[(0, 0)], u_b=U, packs_b=[(0, 0)])
    return TaskGraph(mode=mode, devices=1, minibatch=2 * U, config=config, tasks=tasks)


def bwd(tid: int, first: int, last: int, mbs=(U,), update: str = "none", inputs=(), outputs=(), loss=False) -> Task:
    return Task(id=tid, device=0, kind=Kind.BWD, first=first, last=last, microbatches=list(mbs), update=update,
                inputs=list(inputs), outputs=list(outputs), loss=loss)


def test_a_fused_update_holds_the_optimizer_state_after_the_backward_not_beside_it(profile):
    k = 4 * W
    task = bwd(0, 0, 1, update="device", inputs=[Transfer("W", Channel.SWAP, 2 * W), Transfer("K", Channel.SWAP, k)])
    held = memory.task_memory(task, profile)
    assert held.state == 4 * W  # W and dW of two layers
    assert held.work[-1] == k + profile.pack_update_memory(0, 1)  # the update unit: K and the temporaries
    est = estimate(graph([task]), profile, machine())
    assert est.peak_memory[0] == held.peak == held.state + max(held.work)
    assert est.peak_memory[0] < held.state + held.work[0] + held.work[-1]  # not the backward's plus K


def test_an_updates_temporaries_grow_with_the_pack_as_the_optimizer_steps_it(profile):
    assert profile.pack_update_memory(0, 2) == W // 4  # one parameter at a time: the largest layer's
    profile.update_growth = 1.0
    assert profile.pack_update_memory(0, 2) == 3 * W // 4  # the whole group at once


def test_a_stashed_input_is_counted_while_the_next_layer_runs_not_to_the_packs_end(profile):
    # a 4-layer forward peaking in its last layer, stashing the inputs of layers 1 and 2
    peaks = [W + 9 * X, W + 5 * X, W + 4 * X, W + 20 * X]
    profile.add_packs([PackSample(first=0, last=3, u=U, fwd_peak=max(peaks), bwd_peak=0, fwd_layer_peaks=peaks)])
    x = X * U  # one stashed input
    assert profile.pack_fwd_memory(0, 3, U) == W + 20 * X
    assert profile.pack_fwd_memory(0, 3, U, stashes=(2,)) == W + 20 * X + x  # layer 3 runs beside it
    assert profile.pack_fwd_memory(0, 3, U, stashes=(1,)) == max(W + 20 * X, W + 4 * X + x)  # gone by layer 3
    assert profile.pack_fwd_memory(0, 3, U, stashes=(1, 2)) == W + 20 * X + x  # not both: one at a time


def test_a_pack_measured_without_its_peak_per_layer_adds_its_largest_stash(profile):
    profile.add_packs([PackSample(first=0, last=3, u=U, fwd_peak=W, bwd_peak=0)])
    assert profile.pack_fwd_memory(0, 3, U, stashes=(1, 2)) == W + X * U


def test_a_groups_first_microbatch_makes_the_gradient_buffers_and_later_ones_add_a_temporary(profile):
    task = bwd(0, 0, 0, mbs=(U, U))
    first, later = memory.task_memory(task, profile).work
    assert later - first == W // 2  # the fresh gradient added to the buffer
    running = bwd(0, 0, 0, mbs=(U,), inputs=[Transfer("dW", Channel.SWAP, W, task=9)])
    assert memory.task_memory(running, profile).work == (later,)  # a running gradient came in


def test_a_pack_measured_whole_replaces_its_composition(profile):
    composed = profile.pack_bwd_memory(0, 1, U)
    profile.add_packs([PackSample(first=0, last=1, u=U, fwd_peak=2 * W, bwd_peak=composed - 1234)])
    assert profile.pack_bwd_memory(0, 1, U) == composed - 1234
    assert profile.pack_fwd_memory(0, 1, U) == 2 * W
    assert profile.pack_bwd_memory(1, 2, U) > 0  # others still composed


def test_the_loss_task_is_its_last_layers_loss_task_measured_alone_above_the_activations_before_it(profile):
    last = len(profile.layers) - 1
    profile.loss_samples = [LossSample(u=1, nbytes=2 * W - 3 * X), LossSample(u=8, nbytes=2 * W + 4 * X)]
    resident = 2 * 2 * W
    x_first = X * U
    acts_before = 2 * X * U
    assert profile.loss_memory(U) == 2 * W
    assert profile.pack_bwd_memory(last - 1, last, U) == resident + x_first + acts_before + 2 * W


def test_a_pack_state_left_for_a_later_update_on_the_device_is_held_until_that_update(profile):
    """dp with device updates: a backward's weights stay on the device for the UPD task."""
    back = bwd(0, 0, 0, inputs=[Transfer("W", Channel.SWAP, W)], outputs=[Transfer("dW", Channel.SWAP, W)])
    other = Task(id=1, device=0, kind=Kind.FWD, first=1, last=1, microbatches=[U], inputs=[Transfer("W", Channel.SWAP, W)])
    upd = Task(id=2, device=0, kind=Kind.UPD, first=0, last=0, microbatches=[],
               inputs=[Transfer("W", Channel.LOCAL, 0, task=0), Transfer("K", Channel.SWAP, 2 * W)])
    est = estimate(graph([back, other, upd]), profile, machine())
    fwd_alone = profile.pack_fwd_memory(1, 1, U)
    assert est.task_peaks[1] >= W + fwd_alone  # the first pack's weights beside the forward
    assert est.task_peaks[2] >= W + 2 * W  # and beside its update's state


def test_a_microbatchs_input_counts_from_one_microbatch_ahead_not_from_the_previous_task(profile):
    big = 100 * W  # the second task's inputs, slow to come and huge
    first = bwd(0, 0, 0, mbs=(U,), inputs=[Transfer("W", Channel.SWAP, W)])
    second = Task(id=1, device=0, kind=Kind.FWD, first=1, last=1, microbatches=[U, U],
                  inputs=[Transfer("X", Channel.SWAP, big, microbatch=0), Transfer("X", Channel.SWAP, big, microbatch=1)])
    est = estimate(graph([first, second]), profile, machine())
    assert est.task_peaks[0] < big  # not under the previous task
    # the next microbatch's beside the running one's (whose work counts its own input)
    assert est.task_peaks[1] == big + profile.pack_fwd_memory(1, 1, U)


def test_outputs_still_leaving_an_emulated_device_are_outside_its_promised_peak(profile):
    out = [Transfer("dX", Channel.SWAP, 50 * W, microbatch=j) for j in range(2)]
    task = bwd(0, 1, 1, mbs=(U, U), outputs=out)
    counted = estimate(graph([task]), profile, machine("analytic")).peak_memory[0]
    promised = estimate(graph([task]), profile, machine("cpu")).peak_memory[0]
    assert counted >= 100 * W > promised == memory.task_memory(task, profile).peak


def test_the_estimate_says_which_states_load_during_which_unit_of_the_task_before(profile):
    a = Task(id=0, device=0, kind=Kind.FWD, first=0, last=0, microbatches=[U, U], inputs=[Transfer("W", Channel.SWAP, W)])
    b = Task(id=1, device=0, kind=Kind.FWD, first=1, last=1, microbatches=[U], inputs=[Transfer("W", Channel.SWAP, W)])
    est = estimate(graph([a, b]), profile, machine())
    assert est.prefetched == {1: 0}
    plan = memory.memory_plan(graph([a, b]), est.peak_memory, est.task_peaks, est.prefetched, profile)
    assert plan.prefetch == {1: 0} and plan.reserves[0] == memory.task_memory(a, profile).peak
    tight = estimate(graph([a, b]), profile, machine(), capacity=memory.task_memory(a, profile).peak)
    assert tight.prefetched == {}  # no room beside the first task: loaded once it has ended


def test_a_task_wide_stream_input_counts_from_the_task_start_not_from_the_lookahead(profile):
    """One microbatch's stash (microbatch None) is copied in as its task starts, like any first
    microbatch's input, not beside the task before (which would make a plan promise too much)."""
    big = 100 * W
    first = bwd(0, 0, 0, mbs=(U,), inputs=[Transfer("W", Channel.SWAP, W)])
    second = bwd(1, 1, 1, mbs=(U,), inputs=[Transfer("W", Channel.SWAP, W), Transfer("Xs", Channel.SWAP, big)])
    est = estimate(graph([first, second]), profile, machine())
    assert est.task_peaks[0] < big


def test_a_task_continuing_anothers_buffers_loads_its_state_once_that_one_is_done(profile):
    """BatchNorm statistics are updated in microbatch order: the runtime loads the next writer's
    weights and buffers together only after the writer before is done, so neither is prefetched."""
    def writer(tid, layer=0):
        return Task(id=tid, device=0, kind=Kind.FWD, first=layer, last=layer, microbatches=[U],
                    inputs=[Transfer("W", Channel.SWAP, W), Transfer("B", Channel.SWAP, 8, task=tid - 1 if tid else None)],
                    outputs=[Transfer("B", Channel.SWAP, 8, task=tid + 1)])
    tasks = [writer(0), writer(1)]
    est = estimate(graph(tasks), profile, machine())
    assert est.prefetched == {}  # the second writer waits for the first (with the chain removed: {1: 0})
    assert est.task_peaks[0] == memory.task_memory(tasks[0], profile).peak
    # the same two tasks writing different layers' buffers form no chain: the second is prefetched
    apart = estimate(graph([writer(0), writer(1, layer=1)]), profile, machine())
    assert apart.prefetched == {1: 0}


def test_a_pack_state_is_prefetched_whole_or_not_at_all(profile):
    """The runtime loads a pack's weights and buffers together: where the weights alone would fit
    beside the running task but not with the buffers, nothing is prefetched (a plan that counted
    the weights alone was passed by the buffers' bytes)."""
    a = Task(id=0, device=0, kind=Kind.FWD, first=0, last=0, microbatches=[U], inputs=[Transfer("W", Channel.SWAP, W)])
    b = Task(id=1, device=0, kind=Kind.FWD, first=1, last=1, microbatches=[U],
             inputs=[Transfer("W", Channel.SWAP, W), Transfer("B", Channel.SWAP, 100)])
    running = memory.task_memory(a, profile).peak
    roomy = estimate(graph([a, b]), profile, machine(), capacity=running + W + 100)
    assert roomy.prefetched == {1: 0}
    tight = estimate(graph([a, b]), profile, machine(), capacity=running + W + 50)
    assert tight.prefetched == {} and tight.peak_memory[0] <= running + W + 50


def test_a_memory_plan_travels_with_its_task_graph():
    plan = MemoryPlan(devices={0: 10, 1: 20}, tasks={3: 5}, reserves={3: 4}, prefetch={4: 1})
    g = graph([])
    g.memory = plan
    assert TaskGraph.from_dict(g.to_dict()).memory == plan
    g.memory = None
    assert TaskGraph.from_dict(g.to_dict()).memory is None
