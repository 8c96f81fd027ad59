"""The event-driven runtime estimator on hand-made task graphs and a synthetic profile: prefetch,
microbatch streaming, p2p, host-link contention, memory peaks and capacity, host updates,
deadlocks, and speed."""

from __future__ import annotations

import dataclasses

import json
import math
import time

import pytest

from harmony.scheduler.estimator import STREAMS, chrome_trace, estimate
from harmony.scheduler.machine import Machine
from harmony.profiling.profiles import LayerProfile, LayerSample, Profile
from harmony.scheduler.tasks import HOST, Channel, Configuration, Kind, Task, TaskGraph, Transfer

MS = 1e-3
FWD_PER_SAMPLE = 0.5 * MS  # a layer's forward: 0.5 ms per sample, so u=4 takes 2 ms
BWD_PER_SAMPLE = 1.0 * MS
W = 1_000_000  # weight bytes per layer: 1 ms at 1 GB/s
UPD_DEVICE, UPD_HOST = 0.3 * MS, 3 * MS


def _layer(i: int) -> LayerProfile:
    samples = [
        LayerSample(
            u=u, fwd_time=FWD_PER_SAMPLE * u, bwd_time=BWD_PER_SAMPLE * u, recompute_time=FWD_PER_SAMPLE * u,
            fwd_peak=W + 3000 * u, bwd_peak=2 * W + 8000 * u,
            x_bytes=1000 * u, y_bytes=1000 * u, dx_bytes=1000 * u, act_bytes=2000 * u,
        )
        for u in (1, 2, 4, 8)
    ]
    return LayerProfile(
        index=i, name=f"layer{i}", w_bytes=W, dw_bytes=W, k_bytes=2 * W, b_bytes=0,
        upd_time_device=UPD_DEVICE, upd_time_host=UPD_HOST, fwd_samples=samples, bwd_samples=samples,
    )


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile(source="analytic", device="test", capacity=1 << 30, u_fmax=8, u_bmax=8,
                   layers=[_layer(i) for i in range(8)])


def machine(shared: bool = True, latency: float = 0.0, devices: int = 4, **kw) -> Machine:
    fields = dict(
        kind="analytic", device_name="test", devices=devices, capacity=1 << 30,
        h2d=1e9, d2h=1e9, d2d=2e9, host_link_shared=shared,
        h2d_all=1e9 if shared else devices * 1e9, d2h_all=1e9 if shared else devices * 1e9,
        msg=0.5e9, latency=latency,
    )
    fields.update(kw)
    return Machine(**fields)


def graph(tasks: list[Task], devices: int = 1) -> TaskGraph:
    config = Configuration(u_f=4, packs_f=[(0, 0)], u_b=4, packs_b=[(0, 0)])
    return TaskGraph(mode="test", devices=devices, minibatch=4, config=config, tasks=tasks)


def fwd(tid, device, layer, inputs=(), outputs=(), mbs=(4,), last=None) -> Task:
    return Task(id=tid, device=device, kind=Kind.FWD, first=layer, last=layer if last is None else last,
                microbatches=list(mbs), inputs=list(inputs), outputs=list(outputs))


def swap_w(nbytes=W, **kw) -> Transfer:
    return Transfer("W", Channel.SWAP, nbytes, **kw)


# ------------------------------------------------------------------------------------ time
def test_single_device_chain_is_compute_plus_the_first_swap_in(profile):
    tasks = [fwd(0, 0, 0, [swap_w()], [Transfer("Y", Channel.LOCAL, 4000, task=1)])]
    tasks.append(fwd(1, 0, 1, [swap_w(), Transfer("X", Channel.LOCAL, 4000, task=0)],
                     [Transfer("Y", Channel.LOCAL, 4000, task=2)]))
    tasks.append(fwd(2, 0, 2, [swap_w(), Transfer("X", Channel.LOCAL, 4000, task=1)]))
    est = estimate(graph(tasks), profile, machine())
    compute = 3 * 4 * FWD_PER_SAMPLE  # 2 ms each; each later swap-in (1 ms) hides under one
    assert est.deadlock is None and est.fits
    assert est.iteration_time == pytest.approx(1 * MS + compute)
    assert est.busy[0]["compute"] == pytest.approx(compute)
    assert est.busy[0]["swap-in"] == pytest.approx(3 * MS)
    assert est.bytes_by_channel == {"SWAP in": 3 * W}
    assert est.bytes_by_device[0]["SWAP in"] == 3 * W


def test_the_launchers_iteration_overhead_is_paid_once_per_iteration(profile):
    tasks = [fwd(0, 0, 0, [swap_w()], [Transfer("Y", Channel.LOCAL, 4000, task=1)]),
             fwd(1, 0, 1, [swap_w(), Transfer("X", Channel.LOCAL, 4000, task=0)])]
    plain = estimate(graph(tasks), profile, machine())
    launched = estimate(graph(tasks), profile, machine(iteration_overhead=3 * MS))
    assert launched.iteration_time == pytest.approx(plain.iteration_time + 3 * MS)
    assert launched.busy == plain.busy


def test_a_pack_state_pays_the_runtimes_cost_per_tensor_and_an_activation_does_not(profile):
    layers = [_layer(i) for i in range(2)]
    for layer in layers:
        layer.w_tensors = 12
    counted = Profile(source="analytic", device="test", capacity=1 << 30, u_fmax=8, u_bmax=8, layers=layers)
    one = [fwd(0, 0, 0, [swap_w()])]
    pack = [fwd(0, 0, 0, [swap_w()], last=1)]
    stash = [fwd(0, 0, 0, [Transfer("X", Channel.SWAP, W)])]
    for tasks, tensors in ((one, 12), (pack, 24), (stash, 0)):
        plain = estimate(graph(tasks), counted, machine()).iteration_time
        costed = estimate(graph(tasks), counted, machine(tensor_overhead=0.1 * MS)).iteration_time
        assert costed - plain == pytest.approx(tensors * 0.1 * MS), tensors
    # a profile that did not count its tensors (made before it did, or analytic) pays nothing extra
    assert estimate(graph(one), profile, machine(tensor_overhead=0.1 * MS)).iteration_time == \
        pytest.approx(estimate(graph(one), profile, machine()).iteration_time)


def test_prefetch_overlaps_the_next_swap_in_with_compute(profile):
    # swaps of 4 ms, computes of 2 ms: the next task's weights come in while this one computes
    tasks = [fwd(i, 0, i, [swap_w(4 * W)]) for i in range(3)]
    est = estimate(graph(tasks), profile, machine())
    serial = 3 * (4 * MS + 2 * MS)
    assert est.iteration_time < serial
    assert est.iteration_time == pytest.approx(3 * 4 * MS + 2 * MS)  # swap-bound: swaps back to back
    starts = sorted(e.start for e in est.events if e.stream == "swap-in")
    assert starts == pytest.approx([0.0, 4 * MS, 8 * MS])
    # one task of lookahead only: task 2's swap-in waits for task 1 to start computing
    computes = sorted((e.start, e.end) for e in est.events if e.stream == "compute")
    assert computes[1][0] == pytest.approx(8 * MS)


def test_microbatch_inputs_stream_under_the_previous_microbatch(profile):
    x = [Transfer("X", Channel.SWAP, 2_000_000, microbatch=j) for j in range(2)]  # 2 ms each
    est = estimate(graph([fwd(0, 0, 0, x, mbs=(4, 4))]), profile, machine())
    # X0 [0, 2], mb0 [2, 4] while X1 [2, 4], mb1 [4, 6]
    assert est.iteration_time == pytest.approx(6 * MS)
    assert est.busy[0]["compute"] == pytest.approx(4 * MS)


def test_p2p_between_two_devices_holds_both_p2p_streams(profile):
    n = 4_000_000  # 2 ms at 2 GB/s
    a = fwd(0, 0, 0, outputs=[Transfer("Y", Channel.P2P, n, peer=1, task=1)])
    b = fwd(1, 1, 1, inputs=[Transfer("X", Channel.P2P, n, peer=0, task=0)])
    est = estimate(graph([a, b], devices=2), profile, machine())
    assert est.iteration_time == pytest.approx(2 * MS + 2 * MS + 2 * MS)
    assert est.busy[0]["p2p-out"] == pytest.approx(2 * MS)
    assert est.busy[1]["p2p-in"] == pytest.approx(2 * MS)
    assert est.busy[0]["p2p-in"] == 0 and est.busy[1]["p2p-out"] == 0
    assert est.bytes_by_channel == {"P2P": n}  # the send and the receive are one transfer
    assert est.bytes_by_device[0]["P2P out"] == n and est.bytes_by_device[1]["P2P in"] == n
    # the sender holds Y until it has left; the receiver holds X from the start of the copy
    p2p = [e for e in est.events if e.stream in ("p2p-in", "p2p-out")]
    assert {(e.device, e.stream) for e in p2p} == {(0, "p2p-out"), (1, "p2p-in")}
    assert all(e.start == pytest.approx(2 * MS) for e in p2p)


def test_per_microbatch_p2p_pipelines_the_two_devices(profile):
    n = 2_000_000  # 1 ms
    outs = [Transfer("Y", Channel.P2P, n, peer=1, task=1, microbatch=j) for j in range(2)]
    ins = [Transfer("X", Channel.P2P, n, peer=0, task=0, microbatch=j) for j in range(2)]
    a = fwd(0, 0, 0, outputs=outs, mbs=(4, 4))
    b = fwd(1, 1, 1, inputs=ins, mbs=(4, 4))
    est = estimate(graph([a, b], devices=2), profile, machine())
    # dev0 mb0 [0,2] mb1 [2,4]; copies [2,3] [4,5]; dev1 mb0 [3,5] mb1 [5,7]
    assert est.iteration_time == pytest.approx(7 * MS)


def test_an_emulated_sender_computes_its_next_microbatch_after_handing_its_message_over(profile):
    n = 2_000_000  # 1 ms
    outs = [Transfer("Y", Channel.P2P, n, peer=1, task=1, microbatch=j) for j in range(2)]
    ins = [Transfer("X", Channel.P2P, n, peer=0, task=0, microbatch=j) for j in range(2)]
    a = fwd(0, 0, 0, outputs=outs, mbs=(4, 4))
    b = fwd(1, 1, 1, inputs=ins, mbs=(4, 4))
    est = estimate(graph([a, b], devices=2), profile, machine(p2p_send_overhead=0.5 * MS))
    # dev0 mb0 [0,2.5] (its send's hand-off on its compute) mb1 [2.5,5]; copies [2.5,3.5] [5,6];
    # dev1 mb0 [3.5,5.5] mb1 [6,8]
    assert est.iteration_time == pytest.approx(8 * MS)
    spans = sorted((e.start, e.end) for e in est.events if e.stream == "compute" and e.device == 0)
    assert [end - start for start, end in spans] == [pytest.approx(2.5 * MS)] * 2
    # the receiver's compute pays nothing: its microbatches are 2 ms each
    spans = sorted((e.start, e.end) for e in est.events if e.stream == "compute" and e.device == 1)
    assert [end - start for start, end in spans] == [pytest.approx(2 * MS)] * 2


@pytest.mark.parametrize("latency", [0.0, 20e-6])
def test_host_link_contention_only_on_a_shared_link(profile, latency):
    tasks = [fwd(0, 0, 0, [swap_w(4 * W)]), fwd(1, 1, 1, [swap_w(4 * W)])]
    compute = 2 * MS
    shared_machine = machine(shared=True, latency=latency)
    own_machine = machine(shared=False, latency=latency)
    shared = estimate(graph(tasks, devices=2), profile, shared_machine)
    own = estimate(graph(tasks, devices=2), profile, own_machine)
    assert own.iteration_time == pytest.approx(own_machine.transfer_time(4 * W, "h2d") + compute)
    assert shared.iteration_time == pytest.approx(shared_machine.transfer_time(4 * W, "h2d", concurrent=2) + compute)
    assert shared.iteration_time - compute == pytest.approx(2 * (own.iteration_time - compute), rel=0.01)


def test_contention_rates_change_when_a_copy_joins_or_leaves(profile):
    # dev0 copies 4 MB from t=0; dev1 copies 2 MB from t=0. Shared at 0.5 GB/s each until dev1's
    # copy ends at 4 ms (dev0 has 2 MB left), then dev0 alone at 1 GB/s: ends at 6 ms.
    tasks = [fwd(0, 0, 0, [swap_w(4 * W)]), fwd(1, 1, 1, [swap_w(2 * W)])]
    est = estimate(graph(tasks, devices=2), profile, machine(shared=True))
    ends = {e.device: e.end for e in est.events if e.stream == "swap-in"}
    assert ends[1] == pytest.approx(4 * MS)
    assert ends[0] == pytest.approx(6 * MS)
    # swap-out and swap-in use separate directions and do not contend with each other
    tasks = [fwd(0, 0, 0, [swap_w(4 * W)]), fwd(1, 1, 1, outputs=[Transfer("Y", Channel.SWAP, 4 * W)])]
    est = estimate(graph(tasks, devices=2), profile, machine(shared=True))
    assert est.iteration_time == pytest.approx(6 * MS)


def test_bwd_with_loss_and_device_update_and_host_update(profile):
    u = 4
    fused = Task(id=0, device=0, kind=Kind.BWD, first=0, last=1, microbatches=[u, u], loss=True, update="device",
                 inputs=[swap_w(2 * W), Transfer("K", Channel.SWAP, 4 * W)],
                 outputs=[swap_w(2 * W), Transfer("K", Channel.SWAP, 4 * W)])
    est = estimate(graph([fused]), profile, machine(shared=False))
    compute = 2 * 2 * u * (FWD_PER_SAMPLE + BWD_PER_SAMPLE) + 2 * UPD_DEVICE
    assert est.busy[0]["compute"] == pytest.approx(compute)
    # W and K (6 MB) come in on one swap-in stream, then the compute, then 6 MB go out
    assert est.iteration_time == pytest.approx(6 * MS + compute + 6 * MS)
    # recompute + backward without the loss; the dW goes to the host, which updates
    bwd = Task(id=1, device=0, kind=Kind.BWD, first=0, last=0, microbatches=[u], update="host",
               inputs=[swap_w(W)], outputs=[Transfer("dW", Channel.SWAP, W, task=2)])
    upd = Task(id=2, device=HOST, kind=Kind.UPD, first=0, last=0, microbatches=[],
               inputs=[Transfer("dW", Channel.SWAP, W, task=1), Transfer("W", Channel.SHM, W)],
               outputs=[Transfer("W", Channel.SHM, W)])
    est = estimate(graph([bwd, upd]), profile, machine())
    assert est.iteration_time == pytest.approx(1 * MS + u * (FWD_PER_SAMPLE + BWD_PER_SAMPLE) + 1 * MS + UPD_HOST)
    assert est.busy[HOST]["compute"] == pytest.approx(UPD_HOST)
    # the host reads dW where the swap-out left it: one copy, not two
    assert est.bytes_by_channel == {"SWAP in": W, "SWAP out": W}
    assert HOST not in est.peak_memory


def test_swap_in_of_a_swapped_out_tensor_waits_for_the_swap_out(profile):
    xs = 3 * W  # 3 ms each way
    a = fwd(0, 0, 0, outputs=[Transfer("Xs", Channel.SWAP, xs)])  # to the host store, no consumer named
    b = Task(id=1, device=1, kind=Kind.BWD, first=0, last=0, microbatches=[4],
             inputs=[Transfer("Xs", Channel.SWAP, xs, task=0)])
    est = estimate(graph([a, b], devices=2), profile, machine(shared=False))
    assert est.iteration_time == pytest.approx(2 * MS + 3 * MS + 3 * MS + 4 * (FWD_PER_SAMPLE + BWD_PER_SAMPLE))


# ------------------------------------------------------------------------------------ memory
def test_peak_memory_is_the_task_peak_and_capacity_is_checked(profile):
    tasks = [fwd(0, 0, 0, [swap_w(), Transfer("X", Channel.SWAP, 4000)], [Transfer("Y", Channel.SWAP, 4000)])]
    peak = profile.pack_fwd_memory(0, 0, 4)
    est = estimate(graph(tasks), profile, machine())
    assert est.peak_memory == {0: peak}
    assert est.fits
    assert estimate(graph(tasks), profile, machine(), capacity=peak).fits
    over = estimate(graph(tasks), profile, machine(), capacity=peak - 1)
    assert not over.fits and over.peak_memory == {0: peak}
    assert over.iteration_time == pytest.approx(est.iteration_time)  # flagged, still simulated


def test_outputs_are_held_until_swapped_out_and_prefetch_adds_the_next_inputs(profile):
    p0 = profile.pack_fwd_memory(0, 0, 4)
    big = 10 * W  # the second task's weights: fetched while the first computes
    tasks = [fwd(0, 0, 0, [swap_w()]), fwd(1, 0, 1, [swap_w(big)])]
    est = estimate(graph(tasks), profile, machine())
    assert est.peak_memory[0] == p0 + big
    # a capacity below that holds the prefetch back until the first task is done: serial, but fits
    tight = estimate(graph(tasks), profile, machine(), capacity=p0 + big - 1)
    assert tight.fits and tight.peak_memory[0] <= p0 + big - 1
    assert tight.iteration_time == pytest.approx(1 * MS + 2 * MS + 10 * MS + 2 * MS)
    assert est.iteration_time == pytest.approx(1 * MS + 10 * MS + 2 * MS)
    # a BWD holds each microbatch's dX until it has left: mb0's (1 ms out) under mb1's compute (6 ms)
    def bwd(nbytes):
        out = [Transfer("dX", Channel.SWAP, nbytes, microbatch=j) for j in range(2)]
        return Task(id=0, device=0, kind=Kind.BWD, first=0, last=0, microbatches=[4, 4], outputs=out)

    est = estimate(graph([bwd(W)]), profile, machine())
    assert est.peak_memory[0] == profile.pack_bwd_memory(0, 0, 4) + W
    # 50 ms copies outlast the compute: both dX are still on the device when the task ends
    est = estimate(graph([bwd(50 * W)]), profile, machine())
    assert est.peak_memory[0] == 100 * W
    assert est.iteration_time == pytest.approx(6 * MS + 100 * MS)


# ------------------------------------------------------------------------------------ deadlock
def test_a_cycle_across_devices_is_reported_as_a_deadlock(profile):
    n = 1000
    # dev0: A reads from B; dev1: C (reads from A), then B. B cannot run before C, C not before A.
    a = fwd(10, 0, 0, inputs=[Transfer("X", Channel.P2P, n, peer=1, task=12)],
            outputs=[Transfer("Y", Channel.P2P, n, peer=1, task=11)])
    c = fwd(11, 1, 1, inputs=[Transfer("X", Channel.P2P, n, peer=0, task=10)])
    b = fwd(12, 1, 2, outputs=[Transfer("Y", Channel.P2P, n, peer=0, task=10)])
    est = estimate(graph([a, c, b], devices=2), profile, machine())
    assert est.deadlock is not None
    assert est.iteration_time == float("inf")
    text = est.deadlock
    assert "dev0 waits to run task 10" in text and "from task 12 on dev1" in text
    assert "dev1 waits to run task 11" in text and "from task 10 on dev0" in text
    assert "not yet computed" in text


def test_a_missing_producer_on_the_same_device_later_in_order_deadlocks(profile):
    a = fwd(0, 0, 0, inputs=[Transfer("X", Channel.LOCAL, 10, task=1)])
    b = fwd(1, 0, 1, outputs=[Transfer("Y", Channel.LOCAL, 10, task=0)])
    est = estimate(graph([a, b]), profile, machine())
    assert est.deadlock and "task 0" in est.deadlock and "from task 1 on dev0" in est.deadlock


# ------------------------------------------------------------------------------------ output
def test_events_trace_and_record_events_off(profile):
    tasks = [fwd(0, 0, 0, [swap_w()], [Transfer("Y", Channel.P2P, 1000, peer=1, task=1)]),
             fwd(1, 1, 1, [swap_w(), Transfer("X", Channel.P2P, 1000, peer=0, task=0)],
                 [Transfer("Y", Channel.SWAP, 1000)])]
    g = graph(tasks, devices=2)
    est = estimate(g, profile, machine())
    assert {e.stream for e in est.events} == set(STREAMS)
    assert max(e.end for e in est.events) == pytest.approx(est.iteration_time)
    for e in est.events:
        assert e.end >= e.start
    quiet = estimate(g, profile, machine(), record_events=False)
    assert quiet.events == [] and quiet.iteration_time == est.iteration_time
    assert quiet.peak_memory == est.peak_memory and quiet.busy == est.busy
    trace = json.loads(json.dumps(chrome_trace(est)))
    assert sum(1 for t in trace["traceEvents"] if t["ph"] == "X") == len(est.events)
    # swap bytes agree with the graph's own count
    ours = est.bytes_by_channel
    theirs = g.bytes_by_channel()
    assert ours["SWAP in"] == theirs["SWAP in"] and ours["SWAP out"] == theirs["SWAP out"]
    assert ours["P2P"] == theirs["P2P in"]


# ------------------------------------------------------------------------------------ speed
def _pipeline(tasks_per_device: int, devices: int, mbs: int) -> TaskGraph:
    """A wrap-around pipeline: task i on device i mod N, W swapped in, X/Y per microbatch over p2p."""
    tasks = []
    n = tasks_per_device * devices
    for i in range(n):
        layer = i % 8
        ins = [swap_w()]
        outs = []
        if i > 0:
            ins += [Transfer("X", Channel.P2P, 4000, peer=(i - 1) % devices, task=i - 1, microbatch=j) for j in range(mbs)]
        if i < n - 1:
            outs += [Transfer("Y", Channel.P2P, 4000, peer=(i + 1) % devices, task=i + 1, microbatch=j) for j in range(mbs)]
        outs.append(Transfer("Xs", Channel.SWAP, 4000))
        tasks.append(fwd(i, i % devices, layer, ins, outs, mbs=[4] * mbs))
    return graph(tasks, devices=devices)


def test_a_thousand_task_graph_estimates_fast(profile):
    g = _pipeline(250, 4, 2)
    m = machine(shared=True, latency=10e-6)
    first = estimate(g, profile, m, record_events=False)
    assert first.deadlock is None and first.fits
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        est = estimate(g, profile, m, record_events=False)
        best = min(best, time.perf_counter() - t0)
    assert est.iteration_time == first.iteration_time
    # a guard against a quadratic blow-up (about 0.15 s alone on two cores), not a speed target:
    # bench/search_time.py measures the search's speed
    assert best < 0.5, f"1000 tasks took {best:.3f} s"
    # the pipeline really overlaps: far below the serial sum of everything
    serial = sum(sum(d.values()) for d in est.busy.values())
    assert est.iteration_time < serial


def _training_graph(packs: int, devices: int, mbs: int) -> TaskGraph:
    """Forward and backward over ``packs`` one-layer packs on a wrap-around of devices, X/Y and
    dY/dX over p2p per microbatch, stashes to the host and back, dW to host updates."""
    tasks, n, act = [], packs, 4000
    fwd_id = {p: p for p in range(n - 1)}
    bwd_id = {p: n - 1 + (n - 1 - p) for p in range(n)}
    upd_id = {p: 2 * n - 1 + p for p in range(n)}
    dev = {p: p % devices for p in range(n)}
    per = range(mbs)
    for p in range(n - 1):  # the last pack runs its forward inside its loss BWD
        ins = [swap_w()] + ([Transfer("X", Channel.P2P, act, peer=dev[p - 1], task=fwd_id[p - 1], microbatch=j) for j in per] if p else [])
        nxt = fwd_id.get(p + 1, bwd_id[n - 1])
        outs = [Transfer("Y", Channel.P2P, act, peer=dev[p + 1], task=nxt, microbatch=j) for j in per]
        outs += [Transfer("Xs", Channel.SWAP, act, microbatch=j) for j in per]
        tasks.append(fwd(fwd_id[p], dev[p], p, ins, outs, mbs=[4] * mbs))
    for p in reversed(range(n)):
        ins = [swap_w()]
        if p == n - 1:
            ins += [Transfer("X", Channel.P2P, act, peer=dev[p - 1], task=fwd_id[p - 1], microbatch=j) for j in per]
            ins += [Transfer("T", Channel.SWAP, 100, microbatch=j) for j in per]
        else:
            ins += [Transfer("Xs", Channel.SWAP, act, task=fwd_id[p], microbatch=j) for j in per]
            ins += [Transfer("dY", Channel.P2P, act, peer=dev[p + 1], task=bwd_id[p + 1], microbatch=j) for j in per]
        outs = [Transfer("dW", Channel.SWAP, W, task=upd_id[p])]
        if p:
            outs += [Transfer("dX", Channel.P2P, act, peer=dev[p - 1], task=bwd_id[p - 1], microbatch=j) for j in per]
        tasks.append(Task(id=bwd_id[p], device=dev[p], kind=Kind.BWD, first=p, last=p, microbatches=[4] * mbs,
                          loss=p == n - 1, update="host", inputs=ins, outputs=outs))
    for p in range(n):
        tasks.append(Task(id=upd_id[p], device=HOST, kind=Kind.UPD, first=p, last=p, microbatches=[],
                          inputs=[Transfer("dW", Channel.SWAP, W, task=bwd_id[p])]))
    return graph(tasks, devices=devices)


@pytest.mark.parametrize("capacity", [None, 3_000_000])
def test_a_training_iteration_finishes_and_adds_up(profile, capacity):
    g = _training_graph(8, 2, 4)
    g.validate()
    est = estimate(g, profile, machine(), capacity=capacity)
    assert est.deadlock is None
    for d in (0, 1, HOST):
        for stream, busy in est.busy[d].items():
            assert busy <= est.iteration_time + 1e-12, (d, stream)
    ours, theirs = est.bytes_by_channel, g.bytes_by_channel()
    assert ours["SWAP out"] == theirs["SWAP out"]
    # the host's dW reads are not copies of their own
    assert ours["SWAP in"] == theirs["SWAP in"] - 8 * W
    # every stashed X comes back only after it went out
    went = {(e.task, e.label.split(" (")[0]): e for e in est.events if e.stream == "swap-out"}
    came = {(e.task, e.label.split(" (")[0]): e for e in est.events if e.stream == "swap-in"}
    checked = 0
    for task in g:
        for t in task.inputs:
            if t.tensor == "Xs":
                out = went[(t.task, f"Xs->SWAP mb{t.microbatch}")]
                assert came[(task.id, f"Xs<-SWAP mb{t.microbatch}")].start >= out.end
                checked += 1
    assert checked == 7 * 4
    # and the host updates each pack only after its dW has left the device
    for task in g:
        if task.device == HOST:
            (dw,) = task.inputs
            upd = next(e for e in est.events if e.task == task.id and e.stream == "compute")
            assert upd.start >= went[(dw.task, "dW->SWAP")].end
    if capacity is not None:
        free = estimate(g, profile, machine())
        assert est.fits and max(est.peak_memory.values()) <= capacity < max(free.peak_memory.values())
        assert est.iteration_time >= free.iteration_time


def test_a_simulation_given_a_time_to_beat_stops_once_its_clock_passes_it(profile):
    g = _training_graph(8, 2, 4)
    full = estimate(g, profile, machine(), record_events=False)
    assert full.cut is None
    same = estimate(g, profile, machine(), record_events=False, beat=full.iteration_time * 1.01)
    assert same.cut is None and same.iteration_time == full.iteration_time and same.peak_memory == full.peak_memory
    beat = full.iteration_time / 2
    cut = estimate(g, profile, machine(), record_events=False, beat=beat)
    assert cut.cut == "slower" and beat < cut.iteration_time < full.iteration_time


def test_a_simulation_given_a_time_to_beat_stops_at_the_first_overflow(profile):
    g = _training_graph(8, 2, 4)
    free = estimate(g, profile, machine(), record_events=False)
    capacity = max(free.peak_memory.values()) // 4
    whole = estimate(g, profile, machine(), capacity=capacity, record_events=False)
    assert not whole.fits and whole.cut is None
    cut = estimate(g, profile, machine(), capacity=capacity, record_events=False, beat=math.inf)
    assert cut.cut == "over capacity" and not cut.fits and cut.iteration_time == math.inf
    assert capacity < max(cut.peak_memory.values()) <= max(whole.peak_memory.values())


# ------------------------------------------------------------------------------------ runtime costs
def test_the_runtime_overheads_are_charged_per_task_and_per_microbatch(profile):
    tasks = [fwd(i, 0, i, mbs=(4, 4)) for i in range(3)]  # 3 tasks of 2 microbatches, 4 ms each
    plain = estimate(graph(tasks), profile, machine())
    costly = estimate(graph(tasks), profile, machine(task_overhead=1 * MS, microbatch_overhead=0.25 * MS))
    assert plain.iteration_time == pytest.approx(3 * 4 * MS)
    assert costly.iteration_time == pytest.approx(3 * 4 * MS + 3 * 1 * MS + 6 * 0.25 * MS)
    assert costly.busy[0]["compute"] == pytest.approx(costly.iteration_time)
    # the first unit of each task carries the task's cost
    first = sorted((e.start, e.end) for e in costly.events if e.stream == "compute")[0]
    assert first[1] - first[0] == pytest.approx(2 * MS + 1 * MS + 0.25 * MS)


def test_an_update_pays_the_update_overhead_fused_on_the_device_or_not(profile):
    m = machine(shared=False, task_overhead=1 * MS, update_overhead=2 * MS)
    upd = Task(id=0, device=0, kind=Kind.UPD, first=0, last=0, microbatches=[])
    assert estimate(graph([upd]), profile, m).iteration_time == pytest.approx(UPD_DEVICE + 1 * MS + 2 * MS)
    host = Task(id=0, device=HOST, kind=Kind.UPD, first=0, last=0, microbatches=[])
    assert estimate(graph([host]), profile, m).iteration_time == pytest.approx(UPD_HOST)
    fused = Task(id=0, device=0, kind=Kind.BWD, first=0, last=0, microbatches=[4], update="device",
                 inputs=[Transfer("K", Channel.SWAP, 8)])  # it brings its optimizer state: it steps its pack
    compute = 4 * (FWD_PER_SAMPLE + BWD_PER_SAMPLE) + UPD_DEVICE
    assert estimate(graph([fused]), profile, m).iteration_time >= compute + 1 * MS + 2 * MS
    assert estimate(graph([fused]), profile, m, record_events=False).busy[0]["compute"] == pytest.approx(
        compute + 1 * MS + 2 * MS)


def test_the_models_cost_per_compute_task_falls_on_forwards_and_backwards_not_on_updates(profile):
    # the model's calibration reads a cost per FWD or BWD task beside its scale (the caches a task
    # starts on); a device update, which that calibration never runs, pays only the update's costs
    m = machine(shared=False, compute_task_overhead=0.5 * MS, update_overhead=2 * MS)
    tasks = [fwd(i, 0, i, mbs=(4, 4)) for i in range(3)]
    assert estimate(graph(tasks), profile, m).iteration_time == pytest.approx(3 * 4 * MS + 3 * 0.5 * MS)
    backward = Task(id=0, device=0, kind=Kind.BWD, first=0, last=0, microbatches=[4, 4])
    assert estimate(graph([backward]), profile, m).iteration_time == pytest.approx(
        8 * (FWD_PER_SAMPLE + BWD_PER_SAMPLE) + 0.5 * MS)
    upd = Task(id=0, device=0, kind=Kind.UPD, first=0, last=0, microbatches=[])
    assert estimate(graph([upd]), profile, m).iteration_time == pytest.approx(UPD_DEVICE + 2 * MS)


def test_a_dp_backward_stepped_by_a_later_update_task_steps_nothing_itself(profile):
    # dp's replicated update: the backward leaves its gradient, the UPD task steps (``Task.jit_update``)
    m = machine(shared=False, task_overhead=1 * MS, update_overhead=2 * MS)
    leaves = Task(id=0, device=0, kind=Kind.BWD, first=0, last=0, microbatches=[4], update="device")
    assert not leaves.jit_update()
    compute = 4 * (FWD_PER_SAMPLE + BWD_PER_SAMPLE)
    assert estimate(graph([leaves]), profile, m).iteration_time == pytest.approx(compute + 1 * MS)


def test_an_update_on_the_host_pays_the_hosts_cost_fixed_and_per_parameter_not_the_devices():
    profile = Profile(source="analytic", device="test", capacity=1 << 30, u_fmax=8, u_bmax=8,
                      layers=[dataclasses.replace(_layer(i), dw_tensors=3) for i in range(2)])
    m = machine(shared=False, task_overhead=1 * MS, update_overhead=2 * MS, host_update_overhead=0.5 * MS,
                host_tensor_overhead=0.1 * MS)
    host = Task(id=0, device=HOST, kind=Kind.UPD, first=0, last=1, microbatches=[])
    assert estimate(graph([host]), profile, m).iteration_time == pytest.approx(2 * UPD_HOST + 0.5 * MS + 6 * 0.1 * MS)
    device = Task(id=0, device=0, kind=Kind.UPD, first=0, last=1, microbatches=[])
    assert estimate(graph([device]), profile, m).iteration_time == pytest.approx(2 * UPD_DEVICE + 1 * MS + 2 * MS)


def test_a_device_update_loads_its_inputs_after_the_previous_task_not_under_it(profile):
    # the runtime loads W, dW and K when it starts the UPD task: 3 ms of copies after the 2 ms FWD
    a = fwd(0, 0, 0)
    upd = Task(id=1, device=0, kind=Kind.UPD, first=0, last=0, microbatches=[],
               inputs=[swap_w(), Transfer("dW", Channel.SWAP, W), Transfer("K", Channel.SWAP, W)])
    est = estimate(graph([a, upd]), profile, machine())
    assert est.iteration_time == pytest.approx(2 * MS + 3 * MS + UPD_DEVICE)
    # a FWD's weights still come in under the previous task
    b = fwd(1, 0, 1, [swap_w()])
    assert estimate(graph([a, b]), profile, machine()).iteration_time == pytest.approx(4 * MS)


def test_a_replicated_update_waits_for_every_device_backward_of_its_pack(profile):
    # dp-swap: dev0's UPD names only its own backward, but steps the gradient summed over both
    # devices, so (as the runtime does) it waits for dev1's slower backward (4 samples vs 1)
    def bwd(tid, device, samples):
        return Task(id=tid, device=device, kind=Kind.BWD, first=0, last=0, microbatches=[samples],
                    outputs=[Transfer("dW", Channel.SWAP, 0)])

    upd = Task(id=2, device=0, kind=Kind.UPD, first=0, last=0, microbatches=[],
               inputs=[Transfer("dW", Channel.SWAP, 0, task=0)])
    est = estimate(graph([bwd(0, 0, 1), bwd(1, 1, 4), upd], devices=2), profile, machine())
    assert est.iteration_time == pytest.approx(4 * (BWD_PER_SAMPLE + FWD_PER_SAMPLE) + UPD_DEVICE)  # with recompute


@pytest.mark.parametrize("cores, expected", [(None, 2 * MS), (2.0, 2 * MS), (1.0, 4 * MS), (1.5, 8 / 3 * MS)])
def test_devices_computing_at_once_share_the_cores(profile, cores, expected):
    tasks = [fwd(0, 0, 0), fwd(1, 1, 1)]  # 2 ms each on two devices at the same time
    est = estimate(graph(tasks, devices=2), profile, machine(devices=2, cpu_cores=cores))
    assert est.iteration_time == pytest.approx(expected)


def test_shared_cores_speed_up_the_rest_when_one_unit_ends(profile):
    # 2 ms and 4 ms of compute on one core: both at half speed until 4 ms, then the rest alone
    tasks = [fwd(0, 0, 0), fwd(1, 1, 1, mbs=(8,))]
    est = estimate(graph(tasks, devices=2), profile, machine(devices=2, cpu_cores=1.0))
    ends = sorted(e.end for e in est.events if e.stream == "compute")
    assert ends == pytest.approx([4 * MS, 6 * MS])
    assert est.busy[0]["compute"] == pytest.approx(4 * MS) and est.busy[1]["compute"] == pytest.approx(6 * MS)


@pytest.mark.parametrize("cores", [None, 2.0])
def test_units_computing_at_once_slow_each_other_by_the_interference(profile, cores):
    # 2 ms and 4 ms on two devices, 25% slower each while both compute: both at 1/1.25 until the
    # first ends at 2.5 ms (2 ms of work), then the other alone for its last 2 ms
    tasks = [fwd(0, 0, 0), fwd(1, 1, 1, mbs=(8,))]
    est = estimate(graph(tasks, devices=2), profile, machine(devices=2, cpu_cores=cores, compute_interference=0.25))
    ends = sorted(e.end for e in est.events if e.stream == "compute")
    assert ends == pytest.approx([2.5 * MS, 4.5 * MS])


def test_a_unit_computing_alone_is_not_slowed_by_the_interference(profile):
    est = estimate(graph([fwd(0, 0, 0)], devices=1), profile, machine(devices=1, compute_interference=0.5))
    assert est.iteration_time == pytest.approx(2 * MS)


def test_device_compute_is_scaled_to_the_runtimes_and_host_compute_is_not(profile):
    plain = estimate(graph([fwd(0, 0, 0)], devices=1), profile, machine(devices=1))
    scaled = estimate(graph([fwd(0, 0, 0)], devices=1), profile, machine(devices=1, compute_scale=1.5))
    assert scaled.iteration_time == pytest.approx(1.5 * plain.iteration_time)
