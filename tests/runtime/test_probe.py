"""The bandwidth probe measures real copies: on the emulated cpu backend in spawned worker processes
(alone, all at once, and the runtime's p2p path between two of them), on CUDA with pinned buffers; and it never
leaves a process behind, even when a worker hangs."""

from __future__ import annotations

import math
import multiprocessing

import pytest
import torch

from harmony.errors import HarmonyError
from harmony.runtime.probe import ProbeError, probe_machine
from harmony.scheduler.machine import Machine

MiB = 1 << 20


@pytest.fixture(scope="module")
def cpu_machine() -> Machine:
    return probe_machine("cpu", 2, 64 * MiB, size=4 * MiB, repeats=1)


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
