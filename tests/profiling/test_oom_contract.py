"""The profiler on a device whose own out-of-memory error surfaces inside the memory scope, as CUDA's
does: the allocator raises ``torch.OutOfMemoryError`` from within an op, and the device turns it
into ``DeviceOutOfMemoryError`` only where it converts (``Device.oom_converted``, the scope's exit).
The emulated device raises ours from the op itself, so the CPU suite alone cannot see the difference:
on a GPU a backward that did not fit could pass as the forward's failure and escape the plan's pack
measurement. Here both contracts give the same figures, and a failed attempt leaves nothing behind.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from harmony.profiling.measure import measure_pack
from harmony.profiling.sweep import Profiler
from harmony.runtime.device import CpuDevice
from harmony.runtime.memory import MemoryTracker

import harmony
from harmony.errors import DeviceOutOfMemoryError

WIDTH = 32


class _RaisingAsCuda(MemoryTracker):
    """The emulated tracker refusing as CUDA's allocator does: with torch's own error, from the op."""

    def _refuse_if_over(self, requested: int, op: object = "check") -> None:
        if self.capacity is not None and self._current + requested > self.capacity:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {requested / 2**20:.2f} MiB")


class GpuLike(CpuDevice):
    """An emulated device with CUDA's error contract (``CudaDevice.memory_scope``: converted at exit)."""

    native_oom = (torch.OutOfMemoryError,)

    def __init__(self, name: str, capacity: int | None = None) -> None:
        super().__init__(name, capacity)
        self.tracker = _RaisingAsCuda(self.capacity, name)

    @contextmanager
    def memory_scope(self) -> Iterator[GpuLike]:
        with self.oom_converted(), self.tracker:
            yield self


def _layer() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 8 * WIDTH), torch.nn.GELU(), torch.nn.Linear(8 * WIDTH, WIDTH))


def _peaks(u: int) -> tuple[int, int]:
    m, _ = measure_pack([_layer()], (torch.randn(u, WIDTH),), CpuDevice("unlimited"), trials=0)
    return m.fwd_peak, m.bwd_peak


@pytest.mark.parametrize("device_type", [CpuDevice, GpuLike])
def test_a_backward_that_does_not_fit_is_recorded_beside_the_forwards_figures(device_type):
    fwd_peak, bwd_peak = _peaks(64)
    assert fwd_peak < bwd_peak
    device = device_type("capped", (fwd_peak + bwd_peak) // 2)
    m, _ = measure_pack([_layer()], (torch.randn(64, WIDTH),), device, trials=0)
    assert "out of memory" in m.bwd_error
    assert m.fwd_peak == fwd_peak and m.y_bytes == 64 * WIDTH * 4
    assert device.allocated() == 0


@pytest.mark.parametrize("device_type", [CpuDevice, GpuLike])
def test_a_forward_that_does_not_fit_raises_ours_naming_the_device(device_type):
    fwd_peak, _ = _peaks(64)
    device = device_type("capped", fwd_peak // 2)
    with pytest.raises(DeviceOutOfMemoryError, match="capped: out of memory"):
        measure_pack([_layer()], (torch.randn(64, WIDTH),), device, trials=0)
    assert device.allocated() == 0


def _graph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 8 * WIDTH), torch.nn.GELU(), torch.nn.Linear(8 * WIDTH, WIDTH),
                                torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 10))
    return harmony.decompose(model, _get_batch(2, 0)[0])


def _get_batch(batch_size: int, step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, WIDTH, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def _profiler(device) -> Profiler:
    return Profiler(_graph(), _get_batch, lambda p: torch.optim.Adam(p), device, trials=0,
                    loss_fn=torch.nn.functional.cross_entropy)


def test_the_sweep_finds_the_same_largest_microbatches_under_either_contract():
    capacity = 200_000
    found = []
    for device in (CpuDevice("emulated", capacity), GpuLike("gpu-like", capacity)):
        profiler = _profiler(device)
        u_f = profiler.slow_start(backward=False, cap=512)
        found.append((u_f, profiler.slow_start(backward=True, cap=u_f)))
    assert found[0] == found[1]
    assert found[0][1] < found[0][0] < 512  # both sweeps ran out of memory somewhere


@pytest.mark.parametrize("device_type", [CpuDevice, GpuLike])
def test_a_plans_pack_that_does_not_fit_is_left_out_of_the_measurement_not_fatal(device_type):
    profiler = _profiler(device_type("capped", 200_000))
    last = len(profiler.graph.modules) - 1
    samples = profiler.measure_packs([(0, last, 1), (0, last, 4096)])
    assert [(s.first, s.last, s.u) for s in samples] == [(0, last, 1)]


class _Cyclic(torch.nn.Module):
    """A layer whose code leaves an intermediate in a reference cycle, then asks for too much."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.weight
        ring: list = [y]
        ring.append(ring)
        return torch.cat([y] * 64)


@pytest.mark.parametrize("device_type", [CpuDevice, GpuLike])
def test_a_failed_measurement_leaves_no_device_memory_behind_in_reference_cycles(device_type):
    x = torch.randn(256, WIDTH)
    device = device_type("capped", 8 * x.numel() * x.element_size())
    enabled = gc.isenabled()
    gc.disable()  # as on a GPU, where little Python allocation means the collector rarely runs
    try:
        with pytest.raises(DeviceOutOfMemoryError):
            measure_pack([_Cyclic()], (x,), device, trials=0, backward=False)
        assert device.allocated() == 0
    finally:
        if enabled:
            gc.enable()


def test_a_compile_on_devices_with_cudas_contract_makes_the_emulated_devices_plan(monkeypatch):
    """The whole compile (sweep, layers, updates, the plan's packs) on GPU-like devices measures the
    memory the emulated devices measure."""
    from harmony import compiler

    def compile_on(device_type):
        monkeypatch.setattr(compiler, "make_devices",
                            lambda kind, count, capacity: [device_type(f"d{i}", capacity) for i in range(count)])
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 8 * WIDTH), torch.nn.GELU(),
                                    torch.nn.Linear(8 * WIDTH, WIDTH), torch.nn.Linear(WIDTH, 10))
        return harmony.compile(model, torch.nn.functional.cross_entropy, _get_batch, minibatch_size=64, devices=2,
                               mode="pp", device_memory=120_000, probe=False,
                               build_optimizer=lambda p: torch.optim.Adam(p))

    def memory(plan):  # the profile's memory figures (its times, and so the plan chosen, vary run to run)
        p = plan.profile
        return (p.u_fmax, p.u_bmax, [[(s.u, s.fwd_peak, s.bwd_peak, s.bwd_first_peak, s.act_bytes, s.x_bytes)
                                       for s in layer.fwd_samples] for layer in p.layers],
                [(layer.upd_bytes, layer.upd_time_device == float("inf")) for layer in p.layers])

    emulated, gpu_like = compile_on(CpuDevice), compile_on(GpuLike)
    assert memory(gpu_like) == memory(emulated)
    assert emulated.profile.u_bmax < 64  # the sweep ran out of memory on the way
