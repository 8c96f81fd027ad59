"""The bandwidth probe measures real copies: on the emulated cpu backend in spawned worker processes
(alone, all at once, and the runtime's p2p path between two of them), on CUDA with pinned buffers; and it never
leaves a process behind, even when a worker hangs."""

from __future__ import annotations

import math
import multiprocessing

import pytest
import torch

from harmony.errors import HarmonyError
from harmony.profiling.overheads import _estimated_spans, _host_update_cost, _message_cost, _tensor_cost
from harmony.profiling.probe import ProbeError, probe_machine
from harmony.scheduler.estimator import estimate
from harmony.scheduler.machine import Machine
from harmony.profiling.profiles import LayerProfile, LayerSample, Profile
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import HOST, Configuration, Kind

MiB = 1 << 20


@pytest.fixture(scope="module")
def cpu_machine() -> Machine:
    return probe_machine("cpu", 2, 64 * MiB, size=4 * MiB, repeats=1)


@pytest.mark.slow
def test_cpu_probe_measures_positive_finite_bandwidths(cpu_machine):
    m = cpu_machine
    assert m.kind == "cpu" and m.source == "measured" and m.devices == 2
    assert m.capacity == 64 * MiB
    for name in ("h2d", "d2h", "d2d", "h2d_all", "d2h_all", "msg"):
        value = getattr(m, name)
        assert math.isfinite(value) and value > 0, name
    assert m.h2d_all > 0 and m.host_link_shared is True
    assert m.d2d == m.msg  # one mechanism (shared memory handed over a queue) on the cpu backend
    assert 0 < m.latency < 1.0
    assert m.p2p_latency is not None and m.p2p_latency > m.latency  # a message costs more than a copy
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_cpu_probe_measures_the_runtime_costs_on_its_own_path(cpu_machine):
    m = cpu_machine
    # the executor does real work around every task: a one-microbatch task costs something, and
    # less than 100 ms even on a busy two-core machine
    assert m.task_overhead + m.microbatch_overhead > 0
    for name in ("task_overhead", "microbatch_overhead", "update_overhead", "host_update_overhead"):
        assert 0 <= getattr(m, name) < 0.1, name
    # an update on the host does work around its step (summing slots, building the optimizer)
    assert m.host_update_overhead + m.host_tensor_overhead > 0
    assert m.cpu_cores is not None and 0 < m.cpu_cores <= m.devices + 1
    assert m.p2p_latency < 0.05
    assert "overheads" in m.notes and "cpu_cores" in m.notes
    # the runtime computes no faster than the profile (noise aside: other work sharing the cores
    # can push it below 1) and not wildly slower
    assert 0.6 < m.compute_scale < 5 and 0 <= m.compute_interference < 2
    assert "compute_scale" in m.notes and "compute_interference" in m.notes


def test_the_runtime_costs_can_be_left_out():
    m = probe_machine("cpu", 2, 64 * MiB, size=1 * MiB, repeats=1, runtime=False)
    assert (m.task_overhead, m.microbatch_overhead, m.update_overhead, m.cpu_cores) == (0.0, 0.0, 0.0, None)
    assert (m.compute_scale, m.compute_interference) == (1.0, 0.0)
    assert multiprocessing.active_children() == []


def _profile(layers: int = 4) -> Profile:
    samples = [LayerSample(u=u, fwd_time=1e-4 * u, bwd_time=2e-4 * u, recompute_time=1e-4 * u, fwd_peak=1000,
                           bwd_peak=2000, x_bytes=100 * u, y_bytes=100 * u, dx_bytes=100 * u) for u in (1, 2, 4)]
    return Profile(source="analytic", device="test", capacity=1 << 30, u_fmax=4, u_bmax=4, layers=[
        LayerProfile(index=i, name=f"l{i}", w_bytes=100, dw_bytes=100, k_bytes=0, b_bytes=0, upd_time_device=1e-5,
                     upd_time_host=1e-5, fwd_samples=samples, bwd_samples=samples) for i in range(layers)])


def test_the_message_cost_is_the_one_that_reproduces_the_pipelines_time():
    profile = _profile()
    packs = [(i, i) for i in range(4)]
    tasks = generate("pp", profile, Configuration(u_f=1, packs_f=packs, u_b=1, packs_b=packs), 2, 8)
    m = Machine(kind="cpu", device_name="t", devices=2, capacity=1 << 30, h2d=1e9, d2h=1e9, d2d=1e9,
                host_link_shared=True, h2d_all=1e9, d2h_all=1e9, msg=1e9, latency=1e-5, p2p_latency=1e-4)
    slow = Machine(**{**m.to_dict(), "p2p_latency": 2e-3})
    measured = estimate(tasks, profile, slow, record_events=False).iteration_time
    assert _message_cost(tasks, profile, m, measured) == pytest.approx(2e-3, rel=1e-3)
    # a run faster than the probed cost explains keeps the probed cost
    assert _message_cost(tasks, profile, m, 1e-6) == 1e-4


def _counted(tensors: list[int]) -> Profile:
    """``_profile`` whose layers have ``tensors`` parameters each, and Adam's two state tensors per parameter."""
    profile = _profile(len(tensors))
    for layer, n in zip(profile.layers, tensors):
        layer.w_tensors = layer.dw_tensors = n
        layer.k_tensors, layer.k_bytes = 2 * n, 200
    return profile


def test_the_cost_per_state_tensor_is_what_separates_updates_of_few_and_many_tensors():
    base = Machine(kind="cpu", device_name="t", devices=2, capacity=1 << 30, h2d=1e9, d2h=1e9, d2d=1e9,
                   host_link_shared=True, h2d_all=1e9, d2h_all=1e9, msg=1e9, latency=1e-5)
    slow = Machine(**{**base.to_dict(), "tensor_overhead": 8e-6, "update_overhead": 3e-4})
    packs = [(i, i) for i in range(4)]
    config = Configuration(u_f=1, packs_f=packs, u_b=1, packs_b=packs)
    profile = _counted([2, 12, 2, 12])
    tasks = generate("dp-swap", profile, config, 2, 8)
    measured = _estimated_spans(tasks, profile, slow)
    assert _tensor_cost([(tasks, measured)], profile, base) == pytest.approx(8e-6, rel=0.05)
    # updates that all move as many tensors say nothing about the cost of one
    same = _counted([2, 2, 2, 2])
    tasks = generate("dp-swap", same, config, 2, 8)
    assert _tensor_cost([(tasks, _estimated_spans(tasks, same, slow))], same, base) == 0.0


def test_a_host_updates_own_cost_is_its_span_beyond_its_step_fixed_and_per_parameter():
    packs = [(i, i) for i in range(4)]
    profile = _counted([2, 12, 2, 12])
    tasks = generate("dp", profile, Configuration(u_f=1, packs_f=packs, u_b=1, packs_b=packs), 2, 8)
    host = [t for t in tasks.tasks if t.device == HOST and t.kind == Kind.UPD]
    assert len(host) == 4
    # each span: the step the profile timed (1e-5 s a layer), 0.3 ms, 20 us per parameter
    spans = {t.id: 1e-5 + 3e-4 + 2e-5 * profile.layers[t.first].dw_tensors for t in host}
    fixed, per = _host_update_cost(tasks, spans, profile)
    assert fixed == pytest.approx(3e-4) and per == pytest.approx(2e-5)
    # with one kind of layer the line is not determined: the whole residual is the fixed cost
    same = _counted([2, 2, 2, 2])
    tasks = generate("dp", same, Configuration(u_f=1, packs_f=packs, u_b=1, packs_b=packs), 2, 8)
    spans = {t.id: 1e-5 + 3e-4 for t in tasks.tasks if t.device == HOST}
    assert _host_update_cost(tasks, spans, same) == (pytest.approx(3e-4), 0.0)
    # a graph without host updates (dp-swap) has none to measure
    assert _host_update_cost(generate("dp-swap", same, Configuration(u_f=1, packs_f=packs, u_b=1, packs_b=packs), 2,
                                      8), {}, same) == (0.0, 0.0)


@pytest.mark.slow
def test_cpu_probe_result_round_trips(cpu_machine, tmp_path):
    cpu_machine.save(tmp_path / "machine")
    assert Machine.load(tmp_path / "machine") == cpu_machine


def test_a_hung_worker_is_named_and_reaped():
    # no worker can import torch within 10 ms: the probe gives up, names the step, and kills them
    with pytest.raises(ProbeError, match=r"hung .*worker 0 starting"):
        probe_machine("cpu", 2, None, size=4 * MiB, repeats=1, timeout=0.01)
    assert multiprocessing.active_children() == []


def test_bad_arguments_are_refused():
    with pytest.raises(HarmonyError, match="kind"):
        probe_machine("tpu", 2, None)
    with pytest.raises(HarmonyError, match="device"):
        probe_machine("cpu", 0, None)
    with pytest.raises(HarmonyError, match="repeats"):
        probe_machine("cpu", 1, None, repeats=0)
    with pytest.raises(HarmonyError, match="too small"):
        probe_machine("cpu", 1, 100, size=4 * MiB)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_probe():
    n = torch.cuda.device_count()
    m = probe_machine("cuda", n, None, size=16 * MiB, repeats=2)
    assert m.kind == "cuda" and m.source == "measured" and m.devices == n
    for name in ("h2d", "d2h", "d2d", "h2d_all", "d2h_all", "msg"):
        value = getattr(m, name)
        assert math.isfinite(value) and value > 0, name
    assert m.capacity > 0 and 0 < m.latency < 1.0
    assert multiprocessing.active_children() == []


def test_shared_cores_never_exceed_the_machine_cores():
    """Processes started one after another by fork overlap only in part; counted in one window after
    a barrier, the work of more processes than cores is at most the cores' worth (noise aside)."""
    import os

    from harmony.profiling.overheads import measure_cores

    cores = measure_cores(os.cpu_count() or 1, repeats=1)
    assert 0 < cores <= (os.cpu_count() or 1) * 1.25
    assert multiprocessing.active_children() == []
