"""Timed devices: emulated devices whose work takes the time the plan's cost model gives it.

On an emulated CPU device a run's time is set as much by how busy the host's cores are as by the
runtime's order and waits, so an estimate that misses a run cannot say which of the two it missed.
A ``TimedDevice`` computes and copies for real (small tensors, the arithmetic is checked as on any
emulated device), then sleeps until the work has taken what the cost model
(``scheduler/costs.py``) says: a compute unit its ``unit_seconds``, a copy its bytes over the
machine's bandwidth. Sleeping threads use no core, so four or eight timed devices run on two cores,
and a run's time is that of the plan as the runtime plays it: what the estimator simulates.

The device behaves as an asynchronous accelerator would: work issued inside a unit
(``TimedDevice.unit``) is done at the unit's modelled end, so a copy ordered after it
(``mark``/``wait``, as a GPU's copy streams wait for an event on the compute stream) starts then.

``Timing`` is plain data built where the plan is (``Timing.of``) and handed to every worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from harmony.profiling.profiles import Profile
from harmony.runtime.device import UncheckedCpuDevice
from harmony.scheduler.costs import unit_seconds
from harmony.scheduler.machine import Machine
from harmony.scheduler.tasks import TaskGraph

ITERATION = 1.0  # seconds an estimated iteration is scaled to: the runtime's own costs stay small beside it


@dataclass(frozen=True)
class Timing:
    """What a timed device's work takes: per (task, unit) the compute's seconds, and the bytes per
    second of every copy. ``scale`` is the factor applied to the cost model's times."""

    units: dict[tuple[int, int], float]
    bandwidth: float
    scale: float = 1.0

    @classmethod
    def of(cls, tasks: TaskGraph, profile: Profile, machine: Machine, scale: float = 1.0) -> "Timing":
        """The cost model's times of ``tasks`` on ``machine`` (whose copies all run at one rate:
        ``timed_machine``), times ``scale`` (``scale_for``)."""
        units = {(t.id, j): s * scale for t in tasks.tasks for j, s in enumerate(unit_seconds(t, profile, machine))}
        return cls(units, machine.h2d / scale, scale)

    def copy_seconds(self, nbytes: int) -> float:
        return nbytes / self.bandwidth


def scale_for(estimated: float, seconds: float = ITERATION) -> float:
    """The factor that makes an iteration estimated at ``estimated`` seconds last ``seconds``: a
    plan of small layers on a modelled GPU computes in microseconds, which the runtime's own
    Python per unit (a few hundred microseconds) would swamp."""
    return max(1.0, seconds / estimated)


def timed_machine(machine: Machine) -> Machine:
    """``machine`` as timed devices play it: every copy at its host-to-device rate, alone on its
    link (each worker sleeps for its own copies), no latency, and none of the runtime's measured
    overheads, which a timed run keeps small beside its scaled units rather than models."""
    rate = machine.h2d
    return dataclasses.replace(machine.without_overheads(), h2d=rate, d2h=rate, d2d=rate, msg=rate,
                               h2d_all=rate * machine.devices, d2h_all=rate * machine.devices, host_link_shared=False,
                               latency=0.0, p2p_latency=None, cpu_cores=None, compute_scale=1.0,
                               compute_scale_range=None, compute_interference=0.0)


SPIN = 0.0003  # seconds before a deadline where sleeping stops and the clock is watched: a sleep overshoots


def sleep_until(deadline: float) -> None:
    """Return at ``deadline`` (``time.perf_counter``): a sleep that releases the interpreter, then
    the last fraction of a millisecond watched, since a sleep wakes up to a tenth of a millisecond
    late and a state moved tensor by tensor would add that up."""
    left = deadline - time.perf_counter()
    if left > SPIN:
        time.sleep(left - SPIN)
    while time.perf_counter() < deadline:
        pass


class TimedDevice(UncheckedCpuDevice):
    """An emulated device whose compute units and copies last what ``timing`` says; see the module
    docs."""

    synchronous = False  # copies are ordered after the compute issued before them (``mark``)

    def __init__(self, name: str, capacity: int | None, timing: Timing) -> None:
        super().__init__(name, capacity)
        self.timing = timing
        self._unit_end: float | None = None  # the running unit's modelled end (the compute thread's)
        self._started: dict[tuple[int, int], float] = {}  # (task, unit) -> when it began
        self._copies = threading.local()  # per thread, when its last copy ends (``transferred``)

    @contextlib.contextmanager
    def unit(self, task: int, unit: int) -> Iterator[None]:
        """The compute thread runs unit ``unit`` of ``task``: it lasts the modelled time from now
        (or what the real work takes, if more)."""
        now = time.perf_counter()
        self._started[(task, unit)] = now
        self._unit_end = now + self.timing.units.get((task, unit), 0.0)
        try:
            yield
            sleep_until(self._unit_end)
        finally:
            self._unit_end = None

    def take_unit_starts(self) -> dict[tuple[int, int], float]:
        started, self._started = self._started, {}
        return started

    def mark(self) -> float | None:
        """When the compute issued so far is done: the running unit's modelled end."""
        return self._unit_end

    def wait(self, event: object | None) -> None:
        if isinstance(event, float):
            sleep_until(event)

    def transferred(self, nbytes: int, began: float) -> None:
        """A copy of ``nbytes`` that began at ``began`` lasts its modelled time. Copies one thread
        makes back to back (a state, tensor by tensor) follow one another on its clock, so that
        the Python between them is not added to what they take."""
        clock = getattr(self._copies, "clock", 0.0)
        start = clock if began - clock < SPIN else began
        self._copies.clock = start + self.timing.copy_seconds(nbytes)
        sleep_until(self._copies.clock)

    def to_device(self, t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        began = time.perf_counter()
        out = super().to_device(t, non_blocking)
        self.transferred(t.numel() * t.element_size(), began)
        return out

    def to_host(self, t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
        began = time.perf_counter()
        out = super().to_host(t, pinned)
        self.transferred(t.numel() * t.element_size(), began)
        return out
