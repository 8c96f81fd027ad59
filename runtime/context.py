"""What every part of one device's executor shares: who it is, what it moves data with, the
iteration in progress, and how the compute thread waits.

The executor's concerns (``admission.py``, ``packstate.py``, ``transport.py``, ``compute.py``,
``updates.py``) are separate objects; each receives this context and the few other parts it calls.
Only the executor writes the iteration fields (``iteration``, ``batch``, ``task``); the waits here
publish what the compute thread is blocked on, for stall reports and the run's timeline.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree

from harmony.decomposer.layer_graph import LayerGraph
from harmony.runtime.channels import Aborted, Counters, wait_until
from harmony.runtime.device import Device
from harmony.runtime.flags import Shared
from harmony.runtime.hoststore import HostStore
from harmony.runtime.ledger import Ledger
from harmony.runtime.streams import Job, Stream
from harmony.scheduler.lower import Program
from harmony.scheduler.tasks import Task, TaskGraph

log = logging.getLogger(__name__)

Event = tuple[str, "int | None", str, float, float]  # (stream, task, label, start, end), perf_counter seconds


@dataclass
class Batch:
    """One minibatch in host memory: the model's inputs and the loss target, batch first."""

    inputs: list[Any]
    target: Any
    size: int
    seed: int = 0  # the run's seed: microbatch random streams derive from it


def describe(task: Task) -> str:
    """A task in a few words for messages: ``task 7 (dev1 BWD+loss L3-4 u=4)``."""
    return f"task {task.id} ({str(task).split(' in:')[0]})"


@dataclass(eq=False)
class DeviceContext:
    """One device's worker as its executor's parts see it; see the module docs."""

    rank: int
    device: Device
    layers: LayerGraph
    graph: TaskGraph  # the plan's tasks, every device's
    program: Program  # the plan's program (``scheduler/lower.py``): what moves where, who steps what
    store: HostStore
    shared: Shared  # flags between processes: tasks done, abort, status
    timeout: float
    swap_in: Stream  # host -> device
    swap_out: Stream  # device -> host
    p2p_in: Stream  # from other devices
    p2p_out: Stream  # to other devices
    ledger: Ledger  # the device's memory as the plan counts it
    counters: Counters = field(default_factory=Counters)  # bytes moved, per channel and tensor
    # values held on the device for a later task of this worker, which admission counts as kept:
    # LOCAL outputs (transport.py) and pack states kept resident (packstate.py)
    local: dict[Any, Any] = field(default_factory=dict)
    resident: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    # the iteration in progress (written by the executor)
    iteration: int = -1
    batch: Batch | None = None
    task: int | None = None  # the task the compute thread runs (what side-stream jobs serve)
    waiting: bool = False  # the compute thread is blocked on a stream's job (``wait``)
    waits: list[Event] = field(default_factory=list)  # the compute thread's blocked spans, this iteration
    # what this worker moved, per program stream, in order: see ``IterationResult.transfers``
    transfers: dict[str, list[tuple[str, tuple, int]]] = field(default_factory=dict)
    by_id: dict[int, Task] = field(init=False)
    _activity: dict[int, str] = field(default_factory=dict)  # thread -> what it waits for
    _activity_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.by_id = {t.id: t for t in self.graph.tasks}

    @property
    def streams(self) -> tuple[Stream, Stream, Stream, Stream]:
        return (self.swap_in, self.swap_out, self.p2p_in, self.p2p_out)

    @contextlib.contextmanager
    def waiting_for(self, what: str) -> Iterator[None]:
        """Publish what this thread waits for while it waits: the launcher shows it when a worker
        fails, dies or stalls, so a hang names the message or task it hangs on."""
        ident = threading.get_ident()
        with self._activity_lock:
            self._activity[ident] = what
            self.shared.set_status(self.rank, "; ".join(self._activity.values()))
        try:
            yield
        finally:
            with self._activity_lock:
                self._activity.pop(ident, None)
                self.shared.set_status(self.rank, "; ".join(self._activity.values()))

    def moved(self, stream: str, op: str, what: tuple, nbytes: int) -> None:
        """Log one transfer in program terms (a list append per transfer; streams are FIFO, so a
        stream's log is in the order its thread ran them)."""
        self.transfers.setdefault(stream, []).append((op, what, nbytes))

    def wait(self, future: Future, what: str | None = None) -> Any:
        """Block the compute thread on a stream's job; while blocked, a prefetch that is short of
        memory knows nothing else can free it. A wait for ``what`` that blocked goes into the
        timeline, inside the running task's span."""
        self.waiting = True
        blocked = time.perf_counter() if what is not None and not future.done() else None
        try:
            while not future.done():
                futures_wait([future], timeout=0.2)
                if self.shared.aborted():
                    raise Aborted("the run was aborted by another worker's failure")
            if blocked is not None:
                self.waits.append(("compute", self.task, f"wait: {what}", blocked, time.perf_counter()))
            self.device.ready(future.ended if isinstance(future, Job) and future.ended is not None
                              else time.perf_counter())
            return self.adopt(future.result())
        finally:
            self.waiting = False

    def after_compute(self, stream: Stream, what: str, fn: Callable, *args: Any) -> Future:
        """Queue ``fn`` on an outbound stream, ordered after the compute work issued so far (on a GPU
        the copy must not read a tensor the compute stream is still writing); ``what`` names it in
        the timeline."""
        event = self.device.mark()

        def job() -> Any:
            self.device.wait(event)
            return fn(*args)

        return stream.submit(job, label=what, task=self.task)

    def adopt(self, value: Any) -> Any:
        """Tensors a side stream made, now used by the compute stream: on a GPU their memory must
        not be reused before the compute stream is done with them."""
        if self.device.kind == "cuda":
            for leaf in pytree.tree_leaves(value):
                if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                    leaf.record_stream(torch.cuda.current_stream(self.device.torch_device))
        return value

    def wait_done(self, task_ids: list[int], before: str) -> None:
        """Wait until tasks (of any worker) are done this iteration, naming them in this worker's
        status while it waits."""
        if not all(self.shared.is_done(t, self.iteration) for t in task_ids):
            names = ", ".join(describe(self.by_id[t]) for t in task_ids)
            with self.waiting_for(f"{names} to finish, before {before}"):
                self.shared.wait_done(task_ids, self.iteration, before, self.timeout)
        self.device.ready(self.shared.done_at(task_ids))

    def wait_replicas(self, replicas: list[int]) -> None:
        """The writer of a replicated update waits until every replica has read the master it is
        about to overwrite."""
        names = ", ".join(describe(self.by_id[t]) for t in replicas)
        with self.waiting_for(f"the replicas {names} to read the update's inputs"):
            wait_until(lambda: all(self.shared.has_read(t, self.iteration) for t in replicas), self.shared.aborted,
                       self.timeout, f"the replicas {names} to read their inputs")
        self.device.ready(self.shared.read_at(replicas))
