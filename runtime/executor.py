"""The per-device executor (§4.4): one worker's tasks of one iteration, in plan order.

The compute thread runs FWD, BWD and UPD tasks; four stream threads beside it move data (see
``streams.py``): swap-in (host -> device, prefetching the next task's weights and the next
microbatch's inputs while the current one computes), swap-out (device -> host: updated weights and
optimizer state, buffers, gradients, stashes), p2p-in (receiving activations and gradients from
other devices) and p2p-out (sending them). P2P messages travel through shared memory
(``channels.Slabs``) or, with a ``DistTransport`` (``p2p.py``), as torch.distributed sends
straight into the receiver's device memory.

``Executor`` here is the orchestrator of an iteration: each task in turn (``run_iteration``,
``_run_task``), marked done once every output it queued has left (``_finish``), and the waits: on
a stream's job (``_wait``), on other workers' tasks (``_wait_done``), published for stall reports
(``_waiting_for``). Each other concern is one module, mixed into ``Executor``:

- ``admission.py``: whether a copy may take device memory now (the plan's peak for the device, the
  running task's headroom, urgent copies, outputs let go first when memory is short);
- ``ledger.py``: the device's memory as the plan counts it, once per buffer, which admission reads
  (where the device checks its memory op by op, compared with the real count at every unit's
  start);
- ``packstate.py``: a pack's state (W, B) loaded, prefetched, kept resident, written back or
  evicted; gradients in from and out to host slots (dW);
- ``transport.py``: activations and gradients along the lowered program's edges (send, route,
  receive, prefetch the next microbatch's), and P2P receive buffers;
- ``compute.py``: a pack's forward and backward (FWD, BWD, the loss task);
- ``updates.py``: optimizer steps on the device (jit-update, UPD tasks and their replicas) and on
  the host (``host_update``).

Every task computes what one-process eager training computes (``reference.py``): ``compute.py``
and ``updates.py`` say how. The cross-process flags the waits read (``Shared``) are in
``flags.py``.
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
from harmony.runtime.admission import Admission
from harmony.runtime.channels import Aborted, Counters, Mailbox, Slabs, wait_until
from harmony.runtime.compute import Compute
from harmony.runtime.device import Device
from harmony.runtime.flags import Shared
from harmony.runtime.hoststore import HostStore
from harmony.runtime.ledger import Ledger
from harmony.runtime.p2p import DistTransport
from harmony.runtime.packstate import PackState
from harmony.runtime.routes import Routes
from harmony.runtime.lr_schedule import Rates
from harmony.runtime.streams import Stream
from harmony.runtime.transport import Transport
from harmony.runtime.updates import Updates
from harmony.scheduler.tasks import Kind, Task

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """One minibatch in host memory: the model's inputs and the loss target, batch first."""

    inputs: list[Any]
    target: Any
    size: int
    seed: int = 0  # the run's seed: microbatch random streams derive from it


@dataclass
class IterationResult:
    loss: float  # this worker's share of the minibatch's mean loss (sum over workers = the loss)
    seconds: float
    peak: int  # device bytes at most: measured, or where the device measures nothing the ledger's peak
    bytes_by_channel: dict[str, int] = field(default_factory=dict)
    bytes_by_tensor: dict[str, int] = field(default_factory=dict)
    task_seconds: dict[int, float] = field(default_factory=dict)
    task_peaks: dict[int, int] = field(default_factory=dict)  # device bytes at most while each task ran
    # (stream, task, label, start, end) in time.perf_counter seconds: the compute thread's tasks and
    # the side streams' timed jobs, for the run's timeline (runtime/timeline.py)
    events: list[tuple[str, int | None, str, float, float]] = field(default_factory=list)
    # what this worker moved, per program stream, in the order it moved it: (op, what, bytes) with
    # ``what`` an edge's key (consumer, stream, first sample) or (task, state tensor); compared with
    # the lowered program's actions (``scheduler/lower.py``) by the tests
    transfers: dict[str, list[tuple[str, tuple, int]]] = field(default_factory=dict)
    # the ledger's view (runtime/ledger.py): its peak, and by how much the real memory exceeded it at
    # the start of a unit (0 where the plan's count holds; compared only where the device counts
    # every op, an emulated one)
    ledger_peak: int = 0
    ledger_shortfall: int = 0
    peak_measured: bool = True  # False: an emulated device not checking its memory; ``peak`` is the ledger's


class Executor(Admission, PackState, Transport, Compute, Updates):
    """Runs one device's share of every iteration; see the module docs. The state every concern
    shares is set here, in ``__init__`` (grouped by the module that uses it); each mixin lists
    what it reads of it."""

    def __init__(self, rank: int, device: Device, layers: LayerGraph, routes: Routes, store: HostStore,
                 shared: Shared, mailbox: Mailbox, peers: list[Any], loss_fn: Callable,
                 build_optimizer: Callable, seed: int, timeout: float = 600.0, slabs: Slabs | None = None,
                 prefetch: bool = True, transport: DistTransport | None = None) -> None:
        self.rank = rank
        self.prefetch = prefetch  # off only to measure what prefetching buys (bench, Fig. 14)
        self.device = device
        self.layers = layers
        self.modules = layers.modules
        self.routes = routes
        self.store = store
        self.shared = shared
        self.mailbox = mailbox
        self.peers = peers
        self.loss_fn = loss_fn
        self.build_optimizer = build_optimizer
        self.rates: Rates | None = None
        self.loss_scale: float | None = None
        self.seed = seed
        self.timeout = timeout
        self.tasks = [t for t in routes.graph.tasks if t.device == rank]
        self.counters = Counters()
        self.minibatch = routes.graph.minibatch
        self._task: int | None = None  # the task the compute thread runs (what side-stream jobs serve)
        self._waiting = False  # the compute thread is blocked on a stream's job (``_wait``)
        self._waits: list[tuple[str, int | None, str, float, float]] = []  # the compute thread's, this iteration
        self._transfers: dict[str, list[tuple[str, tuple, int]]] = {}  # see IterationResult.transfers
        self._activity: dict[int, str] = {}  # thread -> what it waits for, published to shared.status
        self._activity_lock = threading.Lock()
        # admission.py: the plan's promise (scheduler/memory.py): what no prefetch may take this
        # device past, and per task the most it holds at once (the launcher refuses a plan without one)
        plan = routes.graph.memory
        self._budget = plan.devices.get(rank)  # None: a device the plan gives no task
        self._memory = plan
        # leaving outputs counted as the estimator counts them; where the device counts every op,
        # the ledger follows its tracker's releases
        self.ledger = Ledger(count_leaving=device.kind == "cuda", tracker=getattr(device, "tracker", None))
        self._reserves = plan.reserves
        self._headroom = 0  # bytes the running task may still allocate (planned): prefetches leave them free
        self._gave_up_waiting: int | None = None  # the task whose outputs would not leave in time
        # packstate.py
        self.resident: dict[int, dict[str, torch.Tensor]] = {}  # task -> pack state kept for a later task
        self._prefetched: dict[int, Future] = {}
        self._prefetches = dict(plan.prefetch)  # the states loaded ahead, and at which unit of the task before
        self._next: Task | None = None  # the next task, while its state may still be prefetched
        self._zeros: dict[torch.dtype, torch.Tensor] = {}  # the one element every gradient sink broadcasts
        self.kept_state: dict[str, torch.Tensor] = {}  # state kept across iterations (scheduler/keep.py)
        self.kept_optim: dict[str, dict[str, torch.Tensor]] = {}
        # transport.py
        self.local: dict[Any, Any] = {}  # LOCAL outputs waiting on the device for their consumer
        self.slabs = slabs
        self.dist = transport  # P2P over torch.distributed; None: through shared memory
        self._awaited: dict[tuple[int, bool], int] = {}  # (sender, on the compute thread) -> P2P waits
        self._batch_dims = self._batch_value_dims()
        # compute.py
        self._out_spec = layers.out_spec()
        threads = torch.get_num_threads()
        scope = device.memory_scope

        def setup() -> None:
            torch.set_num_threads(threads)
            device.stream_setup()

        self.swap_in = Stream(f"dev{rank}-swap-in", scope, setup, device.stream_sync)
        self.swap_out = Stream(f"dev{rank}-swap-out", scope, setup, device.stream_sync)
        self.p2p_in = Stream(f"dev{rank}-p2p-in", scope, setup, device.stream_sync)
        self.p2p_out = Stream(f"dev{rank}-p2p-out", scope, setup, device.stream_sync)
        tracker = getattr(device, "tracker", None)
        if tracker is not None:
            tracker.reclaim = self._reclaim
            tracker.budget = self._budget
            tracker.over_budget = self._let_outputs_leave
        device.pin_host(store.buffer)
        for slab in (slabs.buffers.values() if slabs is not None else ()):
            device.pin_host(slab)
        if transport is not None:
            transport.start(self._p2p_buffers, setup)

    def close(self) -> None:
        """Stop the transport and the stream threads; unpin host memory."""
        if self.dist is not None:
            self.dist.close()
        for stream in (self.swap_in, self.swap_out, self.p2p_in, self.p2p_out):
            stream.close()
        self.device.unpin_host()

    @contextlib.contextmanager
    def _waiting_for(self, what: str) -> Iterator[None]:
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

    # ================================================================ iteration
    def run_iteration(self, iteration: int, batch: Batch, rates: Rates | None = None,
                      loss_scale: float | None = None) -> IterationResult:
        """This device's tasks of one iteration, in plan order, until their outputs have left;
        updates at the learning-rate schedule's ``rates`` when there is one (``schedule.py``); the
        loss multiplied by ``loss_scale`` before its backward (fp16, ``lossscale.py``)."""
        self.iteration = iteration
        self.batch = batch
        self.rates = rates
        self.loss_scale = loss_scale
        self.counters.reset()
        self._transfers = {}
        if self.slabs is not None:
            self.slabs.reset()
        self.device.reset_peak()
        self.ledger.reset()
        loss = 0.0
        task_seconds: dict[int, float] = {}
        task_peaks: dict[int, int] = {}
        events: list[tuple[str, int | None, str, float, float]] = []
        start = time.perf_counter()
        with self.device.memory_scope():
            for i, task in enumerate(self.tasks):
                t0 = time.perf_counter()
                self.shared.set_current(self.rank, task.id)
                self._task = task.id
                self.device.reset_peak()
                self._next = self.tasks[i + 1] if self.prefetch and i + 1 < len(self.tasks) else None
                # the task's first unit is reserved before its state loads (the state counts inside it)
                # and before the next task's state may be prefetched beside it
                self._ledger_unit(task.id, 0)
                loss += self._run_task(task)
                self.ledger.idle(self._kept)
                self._next = None
                self._headroom = 0
                t1 = time.perf_counter()
                task_seconds[task.id] = t1 - t0
                if self.device.measures_memory:
                    task_peaks[task.id] = self.device.peak()
                events.append(("compute", task.id, str(task), t0, t1))
            self.shared.set_current(self.rank, None)
            with self._waiting_for("the last swap-outs and messages of the iteration to leave"):
                self._drain()
        # a stream's job that failed (a send whose transport broke) raised the abort flag, not an
        # exception here; nor does a drain that finds its markers done check it: without this a
        # worker whose last send failed would report its iteration done, and the launcher would hear
        # only that another worker had stopped (test_p2p_dist)
        if self.shared.aborted():
            raise Aborted("the run was aborted while this device finished its iteration")
        self.device.synchronize()
        seconds = time.perf_counter() - start
        by_channel, by_tensor = self.counters.snapshot()
        leftover = [k for k in self.local]
        if leftover:
            raise RuntimeError(f"dev{self.rank}: LOCAL values nobody read: {leftover[:3]}")
        self.resident.clear()
        measured = self.device.measures_memory
        peak = max([self.device.peak(), *task_peaks.values()]) if measured else self.ledger.peak
        events += self._waits
        self._waits = []
        for stream in (self.swap_in, self.swap_out, self.p2p_in, self.p2p_out):
            kind = stream.name.split("-", 1)[1]
            events.extend((kind, *event) for event in stream.take_events())
        return IterationResult(loss=loss, seconds=seconds, peak=peak, bytes_by_channel=by_channel,
                               bytes_by_tensor=by_tensor, task_seconds=task_seconds, task_peaks=task_peaks,
                               events=events, transfers=self._transfers, ledger_peak=self.ledger.peak,
                               ledger_shortfall=self.ledger.shortfall, peak_measured=measured)

    def _run_task(self, task: Task) -> float:
        """Run one task on the compute thread; returns its share of the loss (0 but for a loss task)."""
        log.debug("dev%d runs %s", self.rank, task)
        if task.kind == Kind.FWD:
            self._forward(task)
            loss = 0.0
        elif task.kind == Kind.BWD:
            loss = self._backward(task)
        else:
            self._update_task(task)
            loss = 0.0
        self._finish(task)
        return loss

    def _finish(self, task: Task) -> None:
        """Mark the task done once every output it queued has left (stream order guarantees it:
        a no-op queued behind them on both outbound streams). Marked from whichever of the two
        finishes last, never by a job that blocks one stream on the other: a swap-out stream held
        by a send that waits for a peer's room would hold back this device's gradient deposits,
        which its own compute thread may wait for while the peer waits for it (a deadlock seen on
        gloo in 1f1b-swap on 4 devices)."""
        iteration = self.iteration
        busy = [stream for stream in (self.p2p_out, self.swap_out) if stream.busy()]
        if not busy:  # nothing of it is still leaving: done now, without waking a stream thread
            self.shared.mark_done(task.id, iteration)
            return
        lock = threading.Lock()
        pending = [len(busy)]

        def one_left(marker: Future) -> None:
            if marker.cancelled():
                return
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                self.shared.mark_done(task.id, iteration)

        for stream in busy:
            stream.submit(lambda: None).add_done_callback(one_left)

    # ================================================================ streams and waits
    def _moved(self, stream: str, op: str, what: tuple, nbytes: int) -> None:
        """Log one transfer in program terms (a list append per transfer; streams are FIFO, so a
        stream's log is in the order its thread ran them)."""
        self._transfers.setdefault(stream, []).append((op, what, nbytes))

    def _drain(self) -> None:
        """Wait until every job queued on the four streams has finished: a marker on each stream
        still busy, waited for together. Only the compute thread, which is here, queues real jobs,
        so none can join a stream behind its marker, and an idle stream stays idle. Markers on all
        four, one after another, would cost a thread wake-up each."""
        streams = (self.swap_out, self.p2p_out, self.swap_in, self.p2p_in)
        markers = [stream.submit(lambda: None) for stream in streams if stream.busy()]
        for marker in markers:
            self._wait(marker)

    def _wait(self, future: Future, what: str | None = None) -> Any:
        """Block the compute thread on a stream's job; while blocked, a prefetch that is short of
        memory knows nothing else can free it. A wait for ``what`` that blocked goes into the
        timeline, inside the running task's span."""
        self._waiting = True
        blocked = time.perf_counter() if what is not None and not future.done() else None
        try:
            while not future.done():
                futures_wait([future], timeout=0.2)
                if self.shared.aborted():
                    raise Aborted("the run was aborted by another worker's failure")
            if blocked is not None:
                self._waits.append(("compute", self._task, f"wait: {what}", blocked, time.perf_counter()))
            return self._adopt(future.result())
        finally:
            self._waiting = False

    def _after_compute(self, stream: Stream, what: str, fn: Callable, *args: Any) -> Future:
        """Queue ``fn`` on an outbound stream, ordered after the compute work issued so far (on a GPU
        the copy must not read a tensor the compute stream is still writing); ``what`` names it in
        the timeline."""
        event = self.device.mark()

        def job() -> Any:
            self.device.wait(event)
            return fn(*args)

        return stream.submit(job, label=what, task=self._task)

    def _adopt(self, value: Any) -> Any:
        """Tensors a side stream made, now used by the compute stream: on a GPU their memory must
        not be reused before the compute stream is done with them."""
        if self.device.kind == "cuda":
            for leaf in pytree.tree_leaves(value):
                if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                    leaf.record_stream(torch.cuda.current_stream(self.device.torch_device))
        return value

    def _wait_done(self, task_ids: list[int], before: str) -> None:
        """Wait until tasks (of any worker) are done this iteration, naming them in this worker's
        status while it waits."""
        if all(self.shared.is_done(t, self.iteration) for t in task_ids):
            return
        names = ", ".join(describe(self.routes.by_id[t]) for t in task_ids)
        with self._waiting_for(f"{names} to finish, before {before}"):
            self.shared.wait_done(task_ids, self.iteration, before, self.timeout)

    def _wait_replicas(self, replicas: list[int]) -> None:
        """The writer of a replicated update waits until every replica has read the master it is
        about to overwrite."""
        names = ", ".join(describe(self.routes.by_id[t]) for t in replicas)
        with self._waiting_for(f"the replicas {names} to read the update's inputs"):
            wait_until(lambda: all(self.shared.has_read(t, self.iteration) for t in replicas), self.shared.aborted,
                       self.timeout, f"the replicas {names} to read their inputs")


def describe(task: Task) -> str:
    """A task in a few words for messages: ``task 7 (dev1 BWD+loss L3-4 u=4)``."""
    return f"task {task.id} ({str(task).split(' in:')[0]})"
