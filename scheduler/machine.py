"""What the scheduler knows about the machine a plan runs on: how many devices, how much memory each
has, and how fast bytes move between host and devices, between devices, and between workers.

A ``Machine`` is plain data. It comes from one of three places (``source``):

- ``"measured"``: ``harmony.profiling.probe.probe_machine`` timed real copies on this machine;
- ``"analytic"``: :meth:`Machine.from_spec` read a :class:`~harmony.scheduler.devicespec.DeviceSpec`
  preset or JSON file (hardware we do not have);
- ``"given"``: a person wrote the numbers (a file edited by hand, a test).

Channels (all bandwidths in bytes per second, one direction):

- ``h2d`` / ``d2h``: swap-in / swap-out of one device while the others are idle;
- ``h2d_all`` / ``d2h_all``: the *aggregate* rate when every device swaps at once. On a shared host
  link (``host_link_shared``) this is what contention leaves: with ``k`` devices copying at the same
  time each gets ``min(h2d, h2d_all / k)``;
- ``d2d``: point-to-point between two devices (NVLink/PCIe peer copies on CUDA; gloo between worker
  processes on the emulated ``cpu`` backend);
- ``msg``: host memory of one worker to host memory of another (gloo on loopback). On the ``cpu``
  backend device memory *is* host memory, so ``d2d`` and ``msg`` are the same mechanism there.

``latency`` is the fixed cost of one transfer (seconds), added once per transfer.

What the runtime itself costs beyond compute and transfers (measured by running the real executor
on layers of near-zero compute, ``harmony.profiling.overheads``; zero when nobody measured them):

- ``task_overhead``: seconds per task on a device's compute stream (loading its state, queueing its
  outputs, marking it done, the hand-overs between the compute and stream threads);
- ``microbatch_overhead``: seconds per microbatch of a task (fetching its inputs from a stream,
  generator states, sending its outputs);
- ``update_overhead``: seconds per optimizer step on a device beyond the step itself (the optimizer built for
  the task, the state and summed gradient handed to it, the write-back queued);
- ``iteration_overhead``: seconds per iteration outside every device's tasks (the launcher handing
  the minibatch to the workers, their results coming back);
- ``tensor_overhead``: seconds per tensor of a pack's state (W, dW, K, B) the runtime moves between
  the host store and a device, beyond the transfer's ``latency`` and bytes: a state comes in with
  one admission, but each of its tensors is still a copy, a host-store view and a ledger entry (a
  GPT-2 block's Adam step moves about a hundred; measured on updates: ``profiling/overheads._tensor_cost``);
- ``host_update_overhead`` and ``host_tensor_overhead``: seconds per offloaded update (a UPD task
  on the host) beyond its optimizer step, fixed and per parameter it steps: the gradient slots the
  devices wrote summed into one, each weight wrapped as a leaf holding it, an optimizer built for
  the task and handed the state in shared memory, the state written back (measured on the
  launcher's host updates of layers of few and of many tensors; ``update_overhead``, fitted on the
  devices' updates, leaves them out);
- ``p2p_send_overhead``: seconds of a device's compute thread per P2P message it sends: an emulated
  device's compute thread sends through shared memory itself when its p2p-out stream is idle
  (``runtime/transport``), so the message's hand-off delays its next unit (measured: the p2p-out
  spans of the overheads probe's pipeline). Zero on GPUs, whose sends are issued to a stream;
- ``compute_task_overhead``: on the emulated ``cpu`` backend, seconds each FWD or BWD task of the
  model takes beyond its scaled compute and the costs above: the intercept of the model's own
  calibration, read beside ``compute_scale`` on the same tasks (``profiling/overheads._scaling``).
  A task starts on layers whose weights and code another pack's task has just pushed out of the
  caches; the near-zero layers the overheads above are read on have nothing to push out. Folded
  into one scale instead, it would make the calibration's short tasks (two microbatches) read a
  model well above the profile where its plans' longer tasks run close to it, and those plans
  would come out over their runs. Not charged to UPD tasks, which the calibration does not
  run on a device.
- ``cpu_cores``: on the emulated ``cpu`` backend every device computes on the host's cores, and so
  do the host's offloaded updates: the number of cores they get between them (measured: a fixed
  single-threaded loop run in more processes than cores). ``None``: each device has its own
  hardware (GPUs), no sharing.
- ``compute_scale``: on the emulated ``cpu`` backend, a device's compute in the runtime over the
  profiler's for the same layers, one device computing alone: the worker's compute thread shares
  the interpreter lock with its stream threads, and dispatch-bound layers feel it (measured: the real
  launcher's tasks on transformer blocks against the same blocks profiled). 1: as profiled.
- ``compute_interference``: on the emulated ``cpu`` backend, devices computing at once slow each
  other down beyond sharing cores (the memory bus and caches, the other workers' copies): each of
  ``k`` units computing at once runs ``1 + compute_interference * (k - 1)`` times slower than the
  profile, which timed one layer alone (measured: the real launcher's tasks on all devices at once
  against the same layers profiled alone). Zero: no interference (GPUs, or nobody measured it).
- ``compute_scale_range``: the 10th and 90th percentiles of the calibration's one-device task
  readings over all its rounds, never narrower than its rounds' medians (``overheads._range``): how
  differently the runtime computed this model's tasks, and how much that moved while it was
  measured, which a plan's estimate states as its range (``Plan.estimate["iteration_time_range"]``)
  rather than promise a precision the machine does not have. None: one reading, or nobody measured it.

The scheduler must not import the runtime, so this module imports only the standard library,
``harmony.errors``, ``harmony.serialization`` and the device specs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from harmony import serialization
from harmony.errors import FormatError, HarmonyError

from .devicespec import DeviceSpec, load_spec

log = logging.getLogger(__name__)

__all__ = ["Machine", "MachineError", "KIND", "VERSION", "CHANNELS", "ANALYTIC_LATENCY"]

KIND = "machine"
VERSION = 8  # 2: task_overhead, microbatch_overhead, update_overhead, cpu_cores; 3: compute_scale, compute_interference;
# 4: iteration_overhead; 5: tensor_overhead; 6: host_update_overhead, host_tensor_overhead, p2p_send_overhead;
# 7: compute_scale_range; 8: compute_task_overhead
_OLDER = (7, 6, 5, 4, 3, 2, 1)  # versions read with the fields they lack at their defaults (not measured)

CHANNELS = ("h2d", "d2h", "d2d", "msg")
_KINDS = ("cpu", "cuda", "analytic")
_SOURCES = ("measured", "analytic", "given")
_BANDWIDTHS = ("h2d", "d2h", "d2d", "h2d_all", "d2h_all", "msg")
_OVERHEADS = ("task_overhead", "microbatch_overhead", "update_overhead", "iteration_overhead", "tensor_overhead",
              "host_update_overhead", "host_tensor_overhead", "p2p_send_overhead", "compute_task_overhead")

# The fixed cost of one host<->device copy when nobody measured it: a cudaMemcpyAsync launch plus its
# completion is about 5-10 us on PCIe systems (CUDA bandwidthTest / nvbandwidth at small sizes).
ANALYTIC_LATENCY = 10e-6


class MachineError(HarmonyError):
    """A machine description with missing, unknown or impossible values."""


def _seconds(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _positive_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


@dataclass
class Machine:
    """The devices of one server and the speeds of the links between them (see the module docs)."""

    kind: str  # "cpu" | "cuda" | "analytic"
    device_name: str  # e.g. "NVIDIA H100 80GB HBM3", "Intel(R) Xeon(R) ...", "1080ti"
    devices: int  # number of devices the plan may use
    capacity: int  # bytes of memory per device
    h2d: float  # B/s, one device swapping in alone
    d2h: float  # B/s, one device swapping out alone
    d2d: float  # B/s, point-to-point between two devices
    host_link_shared: bool  # whether the devices' host copies contend for one link / memory bus
    h2d_all: float  # B/s, aggregate over all devices swapping in at once
    d2h_all: float  # B/s, aggregate over all devices swapping out at once
    msg: float  # B/s, host memory of one worker to another's
    latency: float  # s, fixed cost of one transfer
    source: str = "given"  # "measured" | "analytic" | "given"
    p2p_latency: float | None = None  # s, fixed cost of one d2d/msg transfer when it differs (None: latency)
    notes: dict[str, str] = field(default_factory=dict)  # how the numbers were obtained
    task_overhead: float = 0.0  # s, the runtime's fixed cost per task on a device
    microbatch_overhead: float = 0.0  # s, the runtime's fixed cost per microbatch of a task
    update_overhead: float = 0.0  # s, per optimizer step, beyond the step's own compute
    iteration_overhead: float = 0.0  # s, per iteration: the minibatch to the workers, their results back
    tensor_overhead: float = 0.0  # s, per tensor of a pack's state moved between the host store and a device
    host_update_overhead: float = 0.0  # s, per update on the host, beyond its optimizer step
    host_tensor_overhead: float = 0.0  # s, per parameter an update on the host steps, beyond the step
    p2p_send_overhead: float = 0.0  # s, of the sender's compute thread per P2P message (emulated devices)
    cpu_cores: float | None = None  # cores the devices' compute shares (cpu backend); None: no sharing
    compute_scale: float = 1.0  # the runtime's compute over the profile's, one device alone (cpu backend)
    compute_interference: float = 0.0  # slowdown per other unit computing at once (cpu backend)
    compute_scale_range: list[float] | None = None  # [low, high] of the calibration's task readings; None: one reading
    compute_task_overhead: float = 0.0  # s, per FWD or BWD task beyond its scaled compute (the calibration's intercept)

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in _KINDS:
            problems.append(f"kind must be one of {', '.join(_KINDS)}, got {self.kind!r}")
        if not isinstance(self.device_name, str):
            problems.append(f"device_name must be text, got {self.device_name!r}")
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            problems.append(f"devices must be a whole number >= 1, got {self.devices!r}")
        if not _positive_number(self.capacity):
            problems.append(f"capacity must be a positive number of bytes, got {self.capacity!r}")
        for name in _BANDWIDTHS:
            value = getattr(self, name)
            if not _positive_number(value):
                problems.append(f"{name} must be a positive, finite bandwidth in B/s, got {value!r}")
        if (
            isinstance(self.latency, bool)
            or not isinstance(self.latency, (int, float))
            or not math.isfinite(self.latency)
            or self.latency < 0
        ):
            problems.append(f"latency must be a finite number of seconds >= 0, got {self.latency!r}")
        if self.p2p_latency is not None and (
            isinstance(self.p2p_latency, bool) or not isinstance(self.p2p_latency, (int, float))
            or not math.isfinite(self.p2p_latency) or self.p2p_latency < 0
        ):
            problems.append(f"p2p_latency must be a finite number of seconds >= 0 or null, got {self.p2p_latency!r}")
        for name in _OVERHEADS:
            if not _seconds(getattr(self, name)):
                problems.append(f"{name} must be a finite number of seconds >= 0, got {getattr(self, name)!r}")
        if self.cpu_cores is not None and not _positive_number(self.cpu_cores):
            problems.append(f"cpu_cores must be a positive number or null, got {self.cpu_cores!r}")
        if not _positive_number(self.compute_scale):
            problems.append(f"compute_scale must be a positive number, got {self.compute_scale!r}")
        if self.compute_scale_range is not None and not (
                isinstance(self.compute_scale_range, (list, tuple)) and len(self.compute_scale_range) == 2
                and all(_positive_number(v) for v in self.compute_scale_range)
                and self.compute_scale_range[0] <= self.compute_scale_range[1]):
            problems.append(f"compute_scale_range must be [lowest, highest] positive numbers or null, got "
                            f"{self.compute_scale_range!r}")
        if not _seconds(self.compute_interference):
            problems.append(f"compute_interference must be a finite number >= 0, got {self.compute_interference!r}")
        if not isinstance(self.host_link_shared, bool):
            problems.append(f"host_link_shared must be true or false, got {self.host_link_shared!r}")
        if self.source not in _SOURCES:
            problems.append(f"source must be one of {', '.join(_SOURCES)}, got {self.source!r}")
        if not isinstance(self.notes, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.notes.items()
        ):
            problems.append(f"notes must map text to text, got {self.notes!r}")
        if problems:
            raise MachineError(f"machine description {self.device_name!r}: " + "; ".join(problems))
        self.capacity = int(self.capacity)
        for name in _BANDWIDTHS:
            setattr(self, name, float(getattr(self, name)))
        self.latency = float(self.latency)
        for name in _OVERHEADS:
            setattr(self, name, float(getattr(self, name)))
        if self.cpu_cores is not None:
            self.cpu_cores = float(self.cpu_cores)
        self.compute_scale = float(self.compute_scale)
        self.compute_interference = float(self.compute_interference)
        if self.compute_scale_range is not None:
            self.compute_scale_range = [float(v) for v in self.compute_scale_range]
        self.notes = dict(self.notes)

    # ------------------------------------------------------------------ transfer model
    def bandwidth(self, channel: str, concurrent: int = 1) -> float:
        """Bytes per second one transfer on ``channel`` gets while ``concurrent`` devices (itself
        included) copy on the same channel at once. Only host copies (``h2d``, ``d2h``) on a shared
        host link contend: each gets ``min(single, aggregate / concurrent)``."""
        if channel not in CHANNELS:
            raise ValueError(f"unknown channel {channel!r}; expected one of {', '.join(CHANNELS)}")
        if isinstance(concurrent, bool) or not isinstance(concurrent, int) or concurrent < 1:
            raise ValueError(f"concurrent must be a whole number >= 1, got {concurrent!r}")
        single = getattr(self, channel)
        if concurrent > 1 and self.host_link_shared and channel in ("h2d", "d2h"):
            aggregate = self.h2d_all if channel == "h2d" else self.d2h_all
            return min(single, aggregate / concurrent)
        return single

    def transfer_time(self, nbytes: int, channel: str, concurrent: int = 1) -> float:
        """Seconds to move ``nbytes`` on ``channel``: ``latency + nbytes / bandwidth``, the bandwidth
        shared as :meth:`bandwidth` says. Zero bytes is no transfer and takes no time."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
            raise ValueError(f"nbytes must be a number >= 0, got {nbytes!r}")
        bandwidth = self.bandwidth(channel, concurrent)
        if nbytes == 0:
            return 0.0
        fixed = self.p2p_latency if channel in ("d2d", "msg") and self.p2p_latency is not None else self.latency
        return fixed + nbytes / bandwidth

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_spec(cls, spec: DeviceSpec | str, devices: int, latency: float = ANALYTIC_LATENCY) -> Machine:
        """A machine of ``devices`` copies of an analytic device spec (a ``DeviceSpec``, a preset
        name or a JSON file). On a shared host link every device's swaps go through one link, so the
        aggregate equals one device's rate; otherwise each device has its own link and the aggregate
        is ``devices`` times it. ``msg`` is a copy between two workers' host memory: one read and one
        write of host memory, so half the host memory bandwidth."""
        spec = load_spec(spec)
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise MachineError(f"devices must be a whole number >= 1, got {devices!r}")
        links = 1 if spec.host_link_shared else devices
        return cls(
            kind="analytic",
            device_name=spec.name,
            devices=devices,
            capacity=spec.capacity,
            h2d=spec.host_to_device,
            d2h=spec.device_to_host,
            d2d=spec.device_to_device,
            host_link_shared=spec.host_link_shared,
            h2d_all=spec.host_to_device * links,
            d2h_all=spec.device_to_host * links,
            msg=spec.host_memory_bandwidth / 2,
            latency=latency,
            source="analytic",
            notes={
                "spec": spec.name,
                "h2d_all": "one shared host link" if spec.host_link_shared else f"{devices} independent host links",
                "msg": "half the host memory bandwidth (one read, one write)",
                "latency": f"assumed {latency:g} s per transfer (not measured)",
            },
        )

    def without_overheads(self) -> Machine:
        """This machine with none of the runtime's own costs measured (every ``_OVERHEADS`` field 0):
        what a calibration models its runs on before it reads them."""
        return dataclasses.replace(self, **dict.fromkeys(_OVERHEADS, 0.0))

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, body: Any, source: str = "machine description") -> Machine:
        if not isinstance(body, dict):
            raise MachineError(f"{source} must be a mapping with the fields {', '.join(FIELD_NAMES)}")
        required = [
            f.name for f in fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [f for f in required if f not in body]
        unknown = sorted(str(k) for k in set(body) - set(FIELD_NAMES))
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing field(s) {', '.join(missing)}")
            if unknown:
                parts.append(f"unknown field(s) {', '.join(unknown)}")
            raise MachineError(f"{source}: {'; '.join(parts)}. A machine has the fields {', '.join(FIELD_NAMES)}")
        return cls(**body)

    def save(self, path: str | Path) -> None:
        serialization.save(path, KIND, VERSION, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> Machine:
        """A machine file of this version, or of an older one (``_OLDER``) whose missing fields take
        their defaults: the runtime's overheads count as not measured (zero), as they were then."""
        try:
            body = serialization.load(path, KIND, VERSION)
        except FormatError as exc:
            body = _load_older(path, exc)
        try:
            return cls.from_dict(body, source=str(path))
        except MachineError as exc:
            raise FormatError(f"{path} is not a valid machine description: {exc}") from exc

    def describe(self) -> str:
        """A few lines for people: the device, its memory and the link speeds in GB/s."""
        gb = 1e9
        lines = [
            f"{self.devices} x {self.device_name} ({self.kind}, {self.source}), "
            f"{_binary(self.capacity)} each",
            f"  h2d {self.h2d / gb:.2f} GB/s, d2h {self.d2h / gb:.2f} GB/s (one device)",
            f"  h2d {self.h2d_all / gb:.2f} GB/s, d2h {self.d2h_all / gb:.2f} GB/s (all devices at once, "
            f"host link {'shared' if self.host_link_shared else 'per device'})",
            f"  d2d {self.d2d / gb:.2f} GB/s, msg {self.msg / gb:.2f} GB/s, latency {self.latency * 1e6:.1f} us"
            + (f" (p2p message {self.p2p_latency * 1e6:.0f} us)" if self.p2p_latency is not None else ""),
        ]
        if (any(getattr(self, name) for name in _OVERHEADS) or self.cpu_cores is not None
                or self.compute_scale != 1.0 or self.compute_interference):
            lines.append(
                f"  runtime overhead {self.task_overhead * 1e3:.2f} ms per task, "
                f"{self.microbatch_overhead * 1e3:.2f} ms per microbatch, {self.update_overhead * 1e3:.2f} ms per update, "
                f"{self.iteration_overhead * 1e3:.2f} ms per iteration, {self.tensor_overhead * 1e6:.1f} us per state tensor"
                + (f", {self.host_update_overhead * 1e3:.2f} ms and {self.host_tensor_overhead * 1e6:.1f} us per "
                   "parameter per host update" if self.host_update_overhead or self.host_tensor_overhead else "")
                + (f", {self.p2p_send_overhead * 1e3:.2f} ms of the sender's compute per p2p message"
                   if self.p2p_send_overhead else "")
                + (f"; {self.cpu_cores:.2f} cores shared by the devices' compute" if self.cpu_cores is not None else "")
                + (f"; compute {self.compute_scale:.2f}x the profile" if self.compute_scale != 1.0 else "")
                + (f" and {self.compute_task_overhead * 1e3:.2f} ms per compute task" if self.compute_task_overhead else "")
                + (" ({:.2f}-{:.2f} across the calibration's tasks, 10th-90th percentile)".format(*self.compute_scale_range)
                   if self.compute_scale_range else "")
                + (f"; each other device computing at once slows one by {self.compute_interference:.0%}"
                   if self.compute_interference else "")
            )
        return "\n".join(lines)


FIELD_NAMES = tuple(f.name for f in fields(Machine))


def nominal_machine(kind: str, devices: int, capacity: int) -> Machine:
    """A machine described without probing: the memory-copy speeds of a typical host. Its source and
    notes say so, and every estimate made with it carries them."""
    return Machine(
        kind=kind, device_name="unprobed", devices=devices, capacity=capacity,
        h2d=5e9, d2h=5e9, d2d=5e9, host_link_shared=True, h2d_all=5e9, d2h_all=5e9, msg=2e9, latency=20e-6,
        source="given", notes={"why": "compiled with probing off; bandwidths are nominal, not measured"},
    )


def _load_older(path: str | Path, newer: FormatError) -> Any:
    """The body of a machine file of an older schema version; ``newer`` (the error reading it as
    this version) is raised when it is none of them."""
    for version in _OLDER:
        try:
            body = serialization.load(path, KIND, version)
        except FormatError:
            continue
        log.info("%s is machine schema version %d: read with the runtime overheads unmeasured (zero)", path, version)
        return body
    raise newer


def _binary(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
