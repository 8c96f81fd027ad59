"""Timed devices: emulated devices whose work takes the time the plan's cost model gives it.

On an emulated CPU device a run's time is set as much by how busy the host's cores are as by the
runtime's order and waits, so an estimate that misses a run cannot say which of the two it missed.
A ``TimedDevice`` computes and copies for real (small tensors, the arithmetic is checked as on any
emulated device), then sleeps until the work has taken what the cost model
(``scheduler/costs.py``) says: a compute unit its ``unit_seconds``, a copy its bytes over the
machine's bandwidth. Sleeping threads use no core, so four or eight timed devices run on two cores,
and a run's time is that of the plan as the runtime plays it: what the estimator simulates.

The device behaves as an asynchronous accelerator would, so that the host's Python, which shares
two cores with every worker's threads, is not taken for the device's time:

- work issued inside a unit (``TimedDevice.unit``) is done at the unit's modelled end, so a copy
  ordered after it (``mark``/``wait``, as a GPU's copy streams wait for an event on the compute
  stream) starts then;
- a unit starts when the unit before it ended and what the compute thread waited for was done
  (``ready``: a stream job's modelled end, ``Job.ended``; a message's sending; another worker's
  task, ``Shared.done_at``), as a kernel queued behind an event starts when the event fires. The
  host's Python between two units is hidden behind the first, as a GPU's launch queue hides it,
  as long as it takes less than that unit;
- a stream's copy starts when its job was queued and the stream's copies before it were done
  (``job_begins``), not when its thread got round to it; a job the compute thread queues between
  two units counts as queued where the unit before it ended (``issued_at``), the host's Python
  that ends one task and begins the next hidden behind that unit as it is for the next unit.

What a run then adds to the simulation is the runtime's order and waits, and the host only where it
falls behind the devices.

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
        self._last_end = 0.0  # when the compute stream's last unit ended
        self._last_length = 0.0  # how long it lasted: the time the host had to issue the next one
        self._started: dict[tuple[int, int], float] = {}  # (task, unit) -> when it began
        self._local = threading.local()  # per thread: when its last copy ends, when what it waited for was done

    @contextlib.contextmanager
    def unit(self, task: int, unit: int) -> Iterator[None]:
        """The compute thread runs unit ``unit`` of ``task``: it starts once the unit before it has
        ended and what the thread waited for is done (``ready``, its own copies), and lasts its
        modelled time (or what the real work takes, if more).

        The host's Python between two units is hidden behind the first of them, as a GPU's queue
        hides it: the host issues a unit while the one before it still runs, so a unit starts late
        only by what the host took beyond the length of the unit before it."""
        self._local.computes = True
        start = max(self._last_end, self._host_ahead(time.perf_counter()))
        length = self.timing.units.get((task, unit), 0.0)
        self._started[(task, unit)] = start
        self._unit_end = start + length
        finished = None
        try:
            yield
            finished = time.perf_counter()
            sleep_until(self._unit_end)
        finally:
            # it ended at its modelled end, or where the real work took longer; not when this thread
            # woke up from sleeping until then, which is the host's scheduling, not the device's
            self._last_end = max(self._unit_end, finished or time.perf_counter())
            self._last_length = length
            self._unit_end = None
            self.ready(self._last_end)  # what the thread does next comes after the unit

    def ready(self, at: float) -> None:
        """The calling thread's next unit depends on something done at ``at``: it starts no
        earlier."""
        self._local.ready = max(getattr(self._local, "ready", 0.0), at)

    def _ready(self) -> float:
        """When what the calling thread waited for, and the copies it made itself, were done."""
        return max(getattr(self._local, "ready", 0.0), getattr(self._local, "clock", 0.0))

    def take_unit_starts(self) -> dict[tuple[int, int], float]:
        started, self._started = self._started, {}
        return started

    def mark(self) -> float | None:
        """When the compute issued so far is done: the running unit's modelled end."""
        return self._unit_end

    def wait(self, event: object | None) -> None:
        if isinstance(event, float):
            self.ready(event)
            sleep_until(event)

    def issued_at(self) -> float:
        """On the compute thread, work queued between two units counts as issued where the host
        would have reached it had it run ahead of the device, as it does on a GPU: once the unit
        before it ended and what the thread waited for was done (``ready``), and late only by what
        the host took beyond that unit's length, as a unit's start is (``unit``). Otherwise a copy
        the program starts as the next task starts would start late by the Python that ends one task
        and begins the next."""
        now = time.perf_counter()
        if not getattr(self._local, "computes", False):
            return now
        return min(now, self._host_ahead(now))

    def _host_ahead(self, now: float) -> float:
        """Where the calling thread's next work counts as issued at ``now`` by a host running ahead
        of the device: once what the thread waited for was done (``ready``, the unit before among
        it), late only by what the host took beyond that unit's length."""
        return max(self._ready(), now - self._last_length)

    def job_begins(self, queued: float) -> None:
        """A stream job's copies start once it was queued and the stream's copies before it are
        done, not when its thread, sharing the cores, got round to it. When it was queued bounds
        its copies only: a job that copies nothing (a marker) is done with the jobs before it."""
        self._local.queued = queued

    def work_done(self) -> float:
        """The calling thread's work (a stream job's included) was done with its last unit or copy,
        or what it waited for, if that was later."""
        return self._ready()

    def transferred(self, nbytes: int, began: float) -> None:
        """A copy of ``nbytes`` lasts its modelled time from when the calling thread could start it:
        after its copy before it and what it waited for (``ready``, ``job_begins``). The Python
        between a thread's copies (a state, tensor by tensor) and the thread's hand-offs are the
        host's, not the copy engine's, and are not added to what the copies take. On a thread that
        is neither the compute thread nor a stream's, the copy starts when it ``began``."""
        local = self._local
        known = hasattr(local, "ready") or hasattr(local, "queued")
        start = max(self._ready(), getattr(local, "queued", 0.0) if known else began)
        self._local.clock = start + self.timing.copy_seconds(nbytes)
        sleep_until(self._local.clock)

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
