"""Device backends behind one interface, so that the profiler and the executor measure and run work
the same way on real GPUs and on emulated CPU devices (docs/architecture.md, "Devices").

- ``CudaDevice``: one GPU. Memory numbers come from PyTorch's caching allocator; a capacity below
  the GPU's memory is enforced by the allocator (``set_per_process_memory_fraction``); CUDA's
  out-of-memory error becomes ``DeviceOutOfMemoryError`` inside ``memory_scope``; timing uses events.
- ``CpuDevice``: a region of host memory with a capacity that ``MemoryTracker`` enforces per op, so
  that a plan made for small devices runs, swaps and runs out of memory on a machine without a GPU.
  Copies to it are real copies counted against its capacity, so swaps move and time real bytes.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from harmony.errors import DeviceOutOfMemoryError

from .memory import MemoryTracker

log = logging.getLogger(__name__)

__all__ = ["Device", "CpuDevice", "CudaDevice", "Timer", "UncheckedCpuDevice", "check_gpus", "memory_checked",
           "cpu_device", "cuda_device", "gpus_shared", "make_devices", "parse_bytes", "torch_threads"]

CHECK_MEMORY_ENV = "HARMONY_CHECK_MEMORY"  # "1": check every run's memory op by op (the test suite sets it)


@contextmanager
def torch_threads(n: int | None):
    """Run with ``n`` torch intra-op threads (None: leave as is), restoring the count afterwards.

    N emulated devices share the host's cores, each worker with its share; measuring one device
    with all the cores would time a device faster than the runtime will have, and on a shared
    machine two threads contending also make timings several times noisier.
    """
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Timer(ABC):
    """Wall time of work issued between ``start()`` and ``stop()``, in seconds."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> float: ...


class _PerfCounterTimer(Timer):
    """Host clock; ``synchronize`` is called at both ends so queued device work is included."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self._t0: float | None = None

    def start(self) -> None:
        self._device.synchronize()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self._t0 is None:
            raise RuntimeError("Timer.stop() called before start()")
        self._device.synchronize()
        return time.perf_counter() - self._t0


class _CudaEventTimer(Timer):
    """CUDA events on the current stream: measures GPU time without stalling the host at start."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._started = False

    def start(self) -> None:
        with torch.cuda.device(self._device):
            self._start.record()
        self._started = True

    def stop(self) -> float:
        if not self._started:
            raise RuntimeError("Timer.stop() called before start()")
        with torch.cuda.device(self._device):
            self._end.record()
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000.0


class Device(ABC):
    """One device the runtime places work on.

    ``memory_scope()`` is the one place where allocations are tracked and the capacity enforced:
    work run inside it raises ``DeviceOutOfMemoryError`` rather than a backend-specific error.
    A backend whose own error surfaces inside the scope (CUDA's, raised by the allocator) is turned
    into ours only at the scope's exit; code inside a scope that must tell an out-of-memory from
    other failures wraps that part in ``oom_converted()``.
    """

    name: str
    kind: str  # "cpu" | "cuda"
    capacity: int  # bytes
    measures_memory = True  # whether ``allocated`` and ``peak`` are measured (not on an unchecked emulated device)
    synchronous = True  # work is done when its call returns: a copy needs no ordering after the compute before it
    torch_device: torch.device  # where its tensors live
    native_oom: tuple[type[BaseException], ...] = ()  # the backend's own out-of-memory errors

    @contextmanager
    def oom_converted(self) -> Iterator[None]:
        """The backend's out-of-memory error raised in this block becomes ``DeviceOutOfMemoryError``
        here (the emulated device's tracker raises ours already)."""
        try:
            yield
        except self.native_oom as e:
            raise DeviceOutOfMemoryError(self.name, _requested_bytes(str(e)), self.allocated(), self.capacity) from e

    @abstractmethod
    def memory_scope(self) -> AbstractContextManager: ...

    @abstractmethod
    def allocated(self) -> int:
        """Bytes in use now."""

    @abstractmethod
    def peak(self) -> int:
        """Most bytes in use since the last ``reset_peak``."""

    @abstractmethod
    def reset_peak(self) -> None: ...

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all work queued on the device."""

    @abstractmethod
    def timer(self) -> Timer: ...

    @abstractmethod
    def to_device(self, t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """A copy of ``t`` on this device, counted in its memory; differentiable like ``Tensor.to``."""

    @abstractmethod
    def to_host(self, t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
        """A copy of ``t`` in host memory, not counted in the device's memory."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Give cached, unused memory back (between profiling runs)."""

    def pin_host(self, region: torch.Tensor) -> bool:
        """Page-lock a host region that copies go to and from all run long (the host store, the
        message slabs), so that they are DMA transfers overlapping compute; False where there is
        nothing to do (an emulated device) or it failed."""
        return False

    def unpin_host(self) -> None:
        """Undo every ``pin_host`` (before the regions are unmapped)."""

    def host_side(self) -> AbstractContextManager:
        """A block whose ops touch host memory only (copies into the host store or a message slab):
        nothing to count on a GPU, whose allocator sees device memory only."""
        return nullcontext()

    def warm_up(self, within_capacity: bool) -> int:
        """Have the libraries allocate what they keep for the process's life now; the bytes kept
        (none on an emulated device). ``CudaDevice.warm_up`` says more."""
        return 0

    def release(self) -> None:
        """Lift what this device imposed on its process (a GPU's memory limit), once done with it:
        the profiler's device lives in the user's own process."""

    def stream_setup(self) -> None:
        """Called once on each stream thread: give the thread a stream of its own (CUDA)."""

    def stream_sync(self) -> float:
        """Called at the end of each stream job: its copies are complete before its result is used.
        Returns when the job's work was done (``work_done``)."""
        return self.work_done()

    def work_done(self) -> float:
        """When the work the calling thread issued was done (``time.perf_counter``): now, but on a
        device that models it (a timed device's modelled end)."""
        return time.perf_counter()

    def issued_at(self) -> float:
        """When work the calling thread queues on a stream now counts as issued
        (``time.perf_counter``): now, but on a device that models the host running ahead of it
        (a timed device, ``timed.py``)."""
        return time.perf_counter()

    def job_begins(self, queued: float) -> None:
        """Called on a stream's thread before each job, with when the job was queued
        (``time.perf_counter``): its work cannot have started before (a timed device starts its
        copies no earlier, and no later for the thread's own hand-off, ``timed.py``)."""

    def mark(self) -> object | None:
        """An event on the calling thread's stream (CUDA), for another stream to wait on."""
        return None

    def unit(self, task: int, unit: int) -> AbstractContextManager:
        """The compute thread runs unit ``unit`` of ``task`` inside this block (a timed device
        makes it last its modelled time, ``timed.py``)."""
        return nullcontext()

    def ready(self, at: float) -> None:
        """The calling thread waited for something done at ``at`` (``time.perf_counter``): the next
        unit it runs depends on it (a timed device starts that unit no earlier, ``timed.py``)."""

    def take_unit_starts(self) -> dict[tuple[int, int], float]:
        """When each (task, unit) the device timed began (``time.perf_counter``) since the last
        call; nothing on a device that times none."""
        return {}

    def transferred(self, nbytes: int, began: float) -> None:
        """A copy of ``nbytes`` the device did not make itself (into host memory the store owns),
        begun at ``began`` (``time.perf_counter``), is done."""

    def wait(self, event: object | None) -> None:
        """Make the calling thread's stream wait for ``event`` (work issued before ``mark``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, capacity={self.capacity})"


def _host_memory_bytes() -> int:
    """Physical memory of the host: the capacity of an emulated device nobody sized."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return sys.maxsize


class CpuDevice(Device):
    """An emulated device: host memory with a capacity enforced by a ``MemoryTracker``.

    ``capacity=None`` means the host's physical memory. Tensors live on ``cpu``; the device's memory
    is the set of storages made inside ``memory_scope()`` or copied in with ``to_device``.
    """

    kind = "cpu"

    def __init__(self, name: str, capacity: int | None = None) -> None:
        self.name = name
        self.capacity = _host_memory_bytes() if capacity is None else int(capacity)
        self.torch_device = torch.device("cpu")
        self.tracker = MemoryTracker(self.capacity, name)

    def memory_scope(self) -> AbstractContextManager:
        """Track and enforce the allocations of the current thread's ops (backward included when
        ``backward()`` is called inside). Enter it on every thread that allocates for this device."""
        return self.tracker

    def allocated(self) -> int:
        return self.tracker.current

    def peak(self) -> int:
        return self.tracker.peak

    def reset_peak(self) -> None:
        self.tracker.reset_peak()

    def synchronize(self) -> None:
        """CPU ops run synchronously: nothing is queued."""

    def timer(self) -> Timer:
        return _PerfCounterTimer(self)

    def to_device(self, t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """A real copy (``clone``), counted until dropped; refused before copying if it won't fit.
        A tensor already in the device's memory is returned as is, like ``Tensor.to``.
        ``non_blocking`` is accepted for interface parity; CPU copies are synchronous."""
        if self.tracker.is_tracked(t):
            return t
        nbytes = t.numel() * t.element_size()
        self.tracker.check(nbytes)
        with self.tracker.paused():  # counted once, by register, whether or not a scope is entered
            out = t.clone(memory_format=torch.contiguous_format)
        return self.tracker.register(out)

    def to_host(self, t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
        """A real copy outside the device's memory. ``pinned`` is ignored: pinning needs a GPU and
        means nothing between two regions of host memory."""
        with self.tracker.paused():
            return t.clone(memory_format=torch.contiguous_format)

    def empty_cache(self) -> None:
        """Nothing is cached: a freed storage leaves the device at once."""

    def host_side(self) -> AbstractContextManager:
        """Ops in this block touch host memory only (copies into the host store or a message
        slab): not counted, and run without the tracker's Python dispatch."""
        return self.tracker.paused()


class UncheckedCpuDevice(CpuDevice):
    """An emulated device that does not watch its ops: what a run of a plan needs when its memory is
    not being checked (``check_memory=False``, the default outside tests). The plan's reservations
    (the executor's ledger, ``ledger.py``) then say what is on it; nothing counts allocations or
    refuses one, so the tracker's Python dispatch on every op (the overhead benchmark's
    ``--check-memory`` column shows its cost) is gone. It measures no peak."""

    measures_memory = False

    def __init__(self, name: str, capacity: int | None = None) -> None:
        self.name = name
        self.capacity = _host_memory_bytes() if capacity is None else int(capacity)
        self.torch_device = torch.device("cpu")
        self.tracker = None

    def memory_scope(self) -> AbstractContextManager:
        return nullcontext()

    def allocated(self) -> int:
        return 0

    def peak(self) -> int:
        return 0

    def reset_peak(self) -> None:
        """Nothing is measured."""

    def to_device(self, t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """A real copy (``clone``): the device's memory is host memory."""
        return t.clone(memory_format=torch.contiguous_format)

    def to_host(self, t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
        return t.clone(memory_format=torch.contiguous_format)

    def host_side(self) -> AbstractContextManager:
        return nullcontext()


def memory_checked(asked: bool | None) -> bool:
    """Whether a run checks its emulated devices' memory op by op: as asked, else as the
    environment says (``HARMONY_CHECK_MEMORY=1``), else not."""
    if asked is not None:
        return asked
    return os.environ.get(CHECK_MEMORY_ENV, "0").lower() in ("1", "true", "yes", "on")


def cpu_device(name: str, capacity: int | None, check_memory: bool) -> CpuDevice:
    """An emulated device that checks every op against its capacity, or one that does not."""
    return CpuDevice(name, capacity) if check_memory else UncheckedCpuDevice(name, capacity)


# per GPU, the workspace bytes a first ``CudaDevice.warm_up`` in this process saw allocated
_LIBRARY_BYTES: dict[int, int] = {}

_CUDA_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) ?([KMGT]?i?B)")


def _requested_bytes(message: str) -> int | None:
    """The bytes an allocator's out-of-memory message says were asked for, if it says."""
    match = _CUDA_REQUEST.search(message)
    if match is None:
        return None
    try:
        return parse_bytes(f"{match.group(1)}{match.group(2)}")
    except ValueError:
        return None


class CudaDevice(Device):
    """One GPU. ``capacity=None`` takes the GPU's free memory now; a given capacity below the GPU's
    total is enforced by the caching allocator for this process.

    cuBLAS keeps workspaces, allocated through the caching allocator at the first matrix products
    (forward on the calling thread, backward on autograd's) and kept for the process's life: by
    PyTorch's defaults, 32 MiB per thread and stream on Hopper, not split out here.
    ``warm_up`` has them allocated up front and measures them; ``allocated`` and ``peak`` leave them
    out, so that a plan's bytes are compared with the bytes its tensors take. See ``warm_up`` for
    whether they come out of ``capacity`` or on top of it."""

    kind = "cuda"
    synchronous = False
    native_oom = (torch.cuda.OutOfMemoryError,)

    def __init__(self, index: int, capacity: int | None = None, name: str | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice needs a CUDA GPU; use the cpu backend on this machine")
        self.index = index
        self.torch_device = torch.device("cuda", index)
        self.name = name or f"cuda:{index}"
        free, self._total = torch.cuda.mem_get_info(self.torch_device)
        self.capacity = free if capacity is None else int(capacity)
        self.reserved = 0  # bytes the libraries keep for the process's life (``warm_up``)
        self._warm = False
        self._pinned: list[tuple[int, int]] = []  # page-locked host regions: [start, end) addresses
        self._limit(self.capacity)
        log.debug("%s: capacity %d of %d bytes (%d free)", self.name, self.capacity, self._total, free)

    def _limit(self, nbytes: int) -> None:
        """Have the caching allocator refuse more than ``nbytes`` in this process."""
        if nbytes < self._total:
            torch.cuda.set_per_process_memory_fraction(nbytes / self._total, self.torch_device)

    def warm_up(self, within_capacity: bool) -> int:
        """Run a small forward and backward on this thread's current stream so that cuBLAS (and
        cuBLASLt) allocate their workspaces for it and for the autograd thread now, not inside the
        first measured or planned layer. Returns the bytes they keep.

        ``within_capacity``: the profiler's device, whose capacity is all the user gives, plans the
        rest (``capacity`` shrinks by the workspaces). Otherwise (a worker, whose capacity is what its
        plan uses) the allocator's limit grows by them, so the plan keeps all of its bytes.
        """
        if self._warm:
            return 0
        self._warm = True
        before = torch.cuda.memory_allocated(self.torch_device)
        with torch.cuda.device(self.torch_device):
            for dtype in (torch.float32, torch.float64):
                x = torch.ones(8, 8, dtype=dtype, device=self.torch_device, requires_grad=True)
                w = torch.ones(8, 8, dtype=dtype, device=self.torch_device, requires_grad=True)
                b = torch.ones(8, dtype=dtype, device=self.torch_device, requires_grad=True)
                torch.nn.functional.linear(x, w, b).sum().backward()
                del x, w, b
            torch.cuda.current_stream(self.torch_device).synchronize()
        kept = max(0, torch.cuda.memory_allocated(self.torch_device) - before)
        if kept:
            _LIBRARY_BYTES[self.index] = kept
        else:  # warmed up before in this process (an earlier device of this GPU): they are still there
            kept = _LIBRARY_BYTES.get(self.index, 0)
        self.reserved += kept
        if within_capacity:
            self.capacity = max(0, self.capacity - kept)
        else:
            self._limit(self.capacity + self.reserved)
        if kept:
            log.info("%s: the BLAS libraries keep %d bytes of workspace (%s)", self.name, kept,
                     "out of the capacity" if within_capacity else "beyond the plan's capacity")
        return kept

    def release(self) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0, self.torch_device)
        torch.cuda.empty_cache()

    @contextmanager
    def memory_scope(self) -> Iterator[CudaDevice]:
        """Turn CUDA out-of-memory into ``DeviceOutOfMemoryError``; the allocator tracks the rest."""
        with self.oom_converted(), torch.cuda.device(self.torch_device):
            yield self

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.torch_device) - self.reserved

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device) - self.reserved

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def timer(self) -> Timer:
        return _CudaEventTimer(self.torch_device)

    def to_device(self, t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        # from page-locked memory the copy is asynchronous on the calling thread's stream; a stream
        # job synchronizes its stream before its result is used (stream_sync)
        return t.to(self.torch_device, non_blocking=non_blocking or self._is_pinned(t))

    def _is_pinned(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu" or not self._pinned:
            return False
        ptr = t.data_ptr()
        return any(start <= ptr < end for start, end in self._pinned)

    def pin_host(self, region: torch.Tensor) -> bool:
        """The pool of pinned host memory is the run's own shared regions, registered once
        (cudaHostRegister, as torch.distributed.checkpoint pins shared memory): no per-copy
        staging buffer, no pinned allocation per swap."""
        nbytes = region.numel() * region.element_size()
        if nbytes == 0:
            return False
        code = int(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), nbytes, 1))  # portable
        if code != 0:
            log.warning("%s: could not page-lock %d bytes of host memory (cudaError %d); copies to and from it "
                        "will be staged by the driver and not overlap compute", self.name, nbytes, code)
            return False
        self._pinned.append((region.data_ptr(), region.data_ptr() + nbytes))
        return True

    def unpin_host(self) -> None:
        for start, _ in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(start)
        self._pinned.clear()

    def to_host(self, t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
        if not pinned:
            return t.to("cpu")
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def stream_setup(self) -> None:
        torch.cuda.set_device(self.torch_device)
        torch.cuda.set_stream(torch.cuda.Stream(self.torch_device))

    def stream_sync(self) -> float:
        torch.cuda.current_stream(self.torch_device).synchronize()
        return self.work_done()

    def mark(self) -> object | None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.torch_device))
        return event

    def wait(self, event: object | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.torch_device).wait_event(event)


SHARE_GPUS = "HARMONY_SHARE_GPUS"


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_shared(count: int) -> bool:
    """Whether ``count`` CUDA workers share GPUs: more workers than GPUs, allowed only with
    ``HARMONY_SHARE_GPUS=1`` (to run or test a plan for N devices on fewer GPUs; each worker's
    capacity is still enforced, but they compete for the GPU's time and NCCL cannot link them)."""
    return count > visible_gpus() and os.environ.get(SHARE_GPUS, "") not in ("", "0")


def check_gpus(count: int) -> None:
    """Refuse more CUDA workers than GPUs unless sharing was asked for."""
    available = visible_gpus()
    if count > available and not (available and gpus_shared(count)):
        raise ValueError(
            f"asked for {count} CUDA devices but {available} are visible; use fewer, or --device cpu"
            + (f", or set {SHARE_GPUS}=1 to run several workers on each GPU" if available else "")
        )


def make_devices(kind: str, count: int, capacity: int | None) -> list[Device]:
    """``count`` devices of one kind, each with ``capacity`` bytes (None: free GPU memory, or the
    host's memory for emulated devices)."""
    if count < 1:
        raise ValueError(f"need at least one device, got count={count}")
    if kind == "cpu":
        return [CpuDevice(f"cpu{i}", capacity) for i in range(count)]
    if kind == "cuda":
        return [cuda_device(rank, count, capacity) for rank in range(count)]
    raise ValueError(f"unknown device kind {kind!r}; expected 'cpu' or 'cuda'")


def cuda_device(rank: int, count: int, capacity: int | None) -> CudaDevice:
    """Worker ``rank``'s GPU among ``count`` workers: its own, or the GPUs in turn when shared
    (``gpus_shared``)."""
    check_gpus(count)
    index = rank % visible_gpus()
    shared = count > visible_gpus()
    return CudaDevice(index, capacity, name=f"dev{rank}@cuda:{index}" if shared else None)


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Bytes in a size such as ``"8GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``"1000"``.

    KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000 (units are case-insensitive);
    a fractional result is rounded down to whole bytes.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a memory size cannot be negative: {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"a memory size must be text such as '8GiB', got {text!r}")
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size; write a number with an optional unit: "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '8GiB'"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"memory size {text!r} is too large")
    return int(value)
