"""The hardware bound of one training iteration, and how close a measured run comes to it.

No system trains a minibatch faster than its arithmetic runs at the device's peak, nor faster than
the bytes it must move cross the host link. So

    bound = max(FLOPs / peak FLOP/s, bytes in / host->device rate, bytes out / device->host rate,
                (bytes in + bytes out) / both directions' combined rate)

and a run's *fraction of the bound* is ``bound / measured`` (1.0: at the hardware's limit). The
FLOPs are the model's own, one forward and one backward of the minibatch, counted by
``torch.utils.flop_counter`` on the meta device (no memory, no GPU): a system that recomputes
does more work than this, and is charged for it. Two byte counts give two bounds:

- *own*: the bytes the system moved (its run report, or the copies in a torch.profiler trace): how
  well it overlaps what it chose to move;
- *floor*: what any system that steps the optimizer on the host must move at least: every
  trainable weight in once, at the compute precision, and its gradient out once. It holds whenever
  the optimizer state cannot stay on the device (the benchmark caps the device at a quarter of the
  training footprint, and Adam's float32 state alone is three quarters of the weights' part).

The peak and the link rates are measured on the device (``measure_hardware``: a large matrix
product and pinned copies, best of several), or read from a device spec (``spec_hardware``) where
there is no GPU, as for ``python -m bench.gpu --dry-run``.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from harmony.modelfile import ModelFile
from harmony.runtime.precision import compute_dtype
from harmony.scheduler.devicespec import load_spec

log = logging.getLogger(__name__)



def dtype_of(precision: str) -> torch.dtype:
    """The dtype a run at ``precision`` multiplies in (``runtime/precision.py``'s table)."""
    return compute_dtype(precision) or torch.float32


@dataclass(frozen=True)
class Hardware:
    """What bounds a training iteration on one device: its matmul peak at the compute dtype and the
    host link's rates (B/s), with where each figure came from."""

    name: str
    dtype: str
    peak_flops: float
    host_to_device: float
    device_to_host: float
    duplex: float  # both directions at once, bytes per second counted over both
    source: str  # "measured" or "spec <name>"


@dataclass(frozen=True)
class Bound:
    """The bound of one iteration, its parts, and what limits it."""

    flops: float
    bytes_in: int
    bytes_out: int
    compute_s: float
    transfer_s: float
    seconds: float
    limit: str  # "compute" or "transfer"

    def fraction(self, measured_s: float) -> float:
        """How close a measured iteration came to the bound (1.0: at the hardware's limit)."""
        return self.seconds / measured_s


def bound(flops: float, bytes_in: int, bytes_out: int, hardware: Hardware) -> Bound:
    """The iteration's bound on ``hardware`` for ``flops`` of work and the given traffic."""
    compute_s = flops / hardware.peak_flops
    transfer_s = max(bytes_in / hardware.host_to_device, bytes_out / hardware.device_to_host,
                     (bytes_in + bytes_out) / hardware.duplex)
    seconds = max(compute_s, transfer_s)
    return Bound(flops=flops, bytes_in=bytes_in, bytes_out=bytes_out, compute_s=compute_s,
                 transfer_s=transfer_s, seconds=seconds, limit="compute" if compute_s >= transfer_s else "transfer")


def training_flops(model_file: ModelFile, minibatch: int) -> tuple[float, int, int]:
    """(FLOPs of one forward and backward of a minibatch, parameters, trainable parameters), counted
    on the meta device: the model file's model and batch, no memory allocated."""
    with torch.device("meta"):
        model = model_file.build_model()
    inputs, target = model_file.get_batch(minibatch, 0)
    inputs = tuple(t.to("meta") for t in (inputs if isinstance(inputs, tuple) else (inputs,)))
    target = target.to("meta")
    with FlopCounterMode(display=False) as counter:
        loss = model_file.loss_fn(model(*inputs), target)
        loss.backward()
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return float(counter.get_total_flops()), params, trainable


def floor_traffic(trainable: int, precision: str) -> tuple[int, int]:
    """(bytes in, bytes out) that a host-stepped iteration cannot avoid: each trainable weight in
    once and its gradient out once, both at the compute precision."""
    size = torch.empty((), dtype=dtype_of(precision)).element_size()
    return trainable * size, trainable * size


def spec_hardware(spec: str, precision: str) -> Hardware:
    """The bound's figures from a device spec (``scheduler/devicespec.py``): the dense tensor-core
    peak and the derated PCIe rates, for planning without the device."""
    s = load_spec(spec)
    dtype = str(dtype_of(precision)).removeprefix("torch.")
    return Hardware(name=s.name, dtype=dtype, peak_flops=s.flops_for(dtype_of(precision)),
                    host_to_device=s.host_to_device, device_to_host=s.device_to_host,
                    duplex=s.host_to_device + s.device_to_host, source=f"spec {s.name}")


def measure_hardware(precision: str, size: int = 8192, copy_bytes: int = 1 << 30, repeats: int = 5) -> Hardware:
    """The GPU's figures, measured: a ``size``-cubed matrix product at the compute dtype (three
    warm-ups, then the best of ``repeats``), and pinned copies of ``copy_bytes`` each way and both
    ways at once on two streams (the best of ``repeats``). The best, not the median: the bound is
    what the hardware can do."""
    dtype = dtype_of(precision)
    matmul_s = _matmul_seconds(size, dtype, repeats)
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    h2d = _best_time(lambda: dev.copy_(host, non_blocking=True), repeats)
    d2h = _best_time(lambda: back.copy_(dev, non_blocking=True), repeats)
    both = _best_time(lambda: _both_ways(dev, dev2, host, back), repeats)
    return Hardware(name=torch.cuda.get_device_name(), dtype=str(dtype).removeprefix("torch."),
                    peak_flops=2 * size**3 / matmul_s, host_to_device=copy_bytes / h2d,
                    device_to_host=copy_bytes / d2h, duplex=2 * copy_bytes / both, source="measured")


def _matmul_seconds(size: int, dtype: torch.dtype, repeats: int) -> float:
    """The best time of a ``size``-cubed matrix product on random data, after three warm-ups."""
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    return _best_time(lambda: torch.mm(a, b), repeats, warmups=3)


def _both_ways(dev: torch.Tensor, dev2: torch.Tensor, host: torch.Tensor, back: torch.Tensor) -> None:
    """A host-to-device and a device-to-host copy at once, on two streams."""
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(main)
    with torch.cuda.stream(streams[0]):
        dev.copy_(host, non_blocking=True)
    with torch.cuda.stream(streams[1]):
        back.copy_(dev2, non_blocking=True)
    for s in streams:
        main.wait_stream(s)


def _best_time(fn, repeats: int, warmups: int = 1) -> float:
    """The fastest of ``repeats`` calls of ``fn``, timed with CUDA events."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


class CopyCounter:
    """Counts the bytes a CUDA program copies between host and device, from torch.profiler's own
    trace (its ``gpu_memcpy`` events carry their bytes), split by direction and by whether the host
    side was pinned: a pageable copy is one a system should not make.

        with CopyCounter() as copies:
            train_one_iteration()
        copies.totals  # {"HtoD": ..., "DtoH": ..., "HtoD pageable": ..., ...}
    """

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA])

    def __enter__(self) -> "CopyCounter":
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self._profiler.__exit__(*exc)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            self._profiler.export_chrome_trace(str(path))
            self.totals = copy_bytes_in_trace(json.loads(path.read_text()))


def copy_bytes_in_trace(trace: dict[str, Any]) -> dict[str, int]:
    """Host-device copy bytes in a Chrome trace written by torch.profiler, by direction ("HtoD",
    "DtoH"), with the pageable part of each also under "<direction> pageable"."""
    totals = {"HtoD": 0, "DtoH": 0, "HtoD pageable": 0, "DtoH pageable": 0}
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "gpu_memcpy":
            continue
        name, nbytes = event.get("name", ""), int(event.get("args", {}).get("bytes", 0))
        for direction in ("HtoD", "DtoH"):
            if direction in name:
                totals[direction] += nbytes
                if "Pageable" in name:
                    totals[f"{direction} pageable"] += nbytes
    return totals


def describe(hardware: Hardware) -> str:
    """One line for a report: the figures the bound uses and where they came from."""
    return (f"{hardware.name}, {hardware.source}: {hardware.peak_flops / 1e12:.0f} TFLOP/s {hardware.dtype}, "
            f"host->device {hardware.host_to_device / 1e9:.1f} GB/s, device->host {hardware.device_to_host / 1e9:.1f} GB/s, "
            f"both at once {hardware.duplex / 1e9:.1f} GB/s")
