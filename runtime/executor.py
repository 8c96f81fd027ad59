"""The per-device executor (§4.4): one worker's tasks of one iteration, in plan order.

The compute thread runs FWD, BWD and UPD tasks; four stream threads beside it move data (see
``streams.py``): swap-in (host -> device, prefetching the next task's weights and the next
microbatch's inputs while the current one computes), swap-out (device -> host: updated weights and
optimizer state, buffers, gradients, stashes), p2p-in (receiving activations and gradients from
other devices) and p2p-out (sending them). P2P messages travel through shared memory
(``channels.Slabs``) or, with a ``DistTransport`` (``p2p.py``), as torch.distributed sends
straight into the receiver's device memory.

``Executor`` here is the orchestrator of an iteration: each task in turn (``run_iteration``,
``_run_task``), marked done once every output it queued has left (``_finish``). What all of its
parts share, and the waits (on a stream's job, on other workers' tasks, published for stall
reports), is ``context.py``'s ``DeviceContext``. Each other concern is one object, given the
context and the few other parts it calls:

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
- ``kept.py``: the activations a forward keeps for its pack's backward, on the device or through
  host memory;
- ``updates.py``: optimizer steps on the device (jit-update, UPD tasks and their replicas) and on
  the host (``host_update``).

Every task computes what one-process eager training computes (``reference.py``): ``compute.py``
and ``updates.py`` say how. The cross-process flags the waits read (``Shared``) are in
``flags.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harmony.decomposer.layer_graph import LayerGraph
from harmony.runtime.admission import Admission
from harmony.runtime.channels import Aborted, Mailbox, Slabs
from harmony.runtime.compute import Compute
from harmony.runtime.context import Batch, DeviceContext, Event
from harmony.runtime.device import Device
from harmony.runtime.flags import Shared
from harmony.runtime.hoststore import HostStore
from harmony.runtime.ledger import Ledger
from harmony.runtime.lr_schedule import Rates
from harmony.runtime.p2p import DistTransport
from harmony.runtime.packstate import PackState
from harmony.runtime.streams import Job, Stream
from harmony.runtime.transport import Transport
from harmony.runtime.updates import Updates
from harmony.scheduler.lower import Program
from harmony.scheduler.tasks import Task, TaskGraph

log = logging.getLogger(__name__)


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
    events: list[Event] = field(default_factory=list)
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
    # (task, unit) -> when it began computing, on a device that times its units (``timed.py``)
    unit_starts: dict[tuple[int, int], float] = field(default_factory=dict)


class Executor:
    """Runs one device's share of every iteration; see the module docs."""

    def __init__(self, rank: int, device: Device, layers: LayerGraph, graph: TaskGraph, program: Program, store: HostStore,
                 shared: Shared, mailbox: Mailbox, peers: list[Any], loss_fn: Callable,
                 build_optimizer: Callable, seed: int, timeout: float = 600.0, slabs: Slabs | None = None,
                 prefetch: bool = True, transport: DistTransport | None = None) -> None:
        self.prefetch = prefetch  # off only to measure what prefetching buys (bench, Fig. 14)
        threads = torch.get_num_threads()

        def setup() -> None:
            torch.set_num_threads(threads)
            device.stream_setup()

        def stream(kind: str) -> Stream:
            return Stream(f"dev{rank}-{kind}", device.memory_scope, setup, device.stream_sync, device.job_begins,
                          device.issued_at)

        # leaving outputs counted as the estimator counts them; where the device counts every op,
        # the ledger follows its tracker's releases
        tracker = getattr(device, "tracker", None)
        ledger = Ledger(count_leaving=device.kind == "cuda", tracker=tracker)
        self.ctx = ctx = DeviceContext(rank, device, layers, graph, program, store, shared, timeout, stream("swap-in"),
                                       stream("swap-out"), stream("p2p-in"), stream("p2p-out"), ledger)
        # the tasks in the order of the device's compute program, each with the op its first unit runs
        self._ops: dict[int, str] = {}
        for action in program.actions(rank, "compute"):
            if action.op not in ("SEND", "RECV"):
                self._ops.setdefault(action.task, action.op)
        self.tasks = [ctx.by_id[t] for t in self._ops]
        # the plan's promise (scheduler/memory.py): what no prefetch may take this device past, and
        # per task the most it holds at once (the launcher refuses a plan without one)
        plan = graph.memory
        self.admission = Admission(ctx, plan)
        self.packs = PackState(ctx, self.admission)
        self.packs.prefetching = prefetch
        self.transport = Transport(ctx, self.admission, mailbox, peers, slabs, transport, prefetch)
        self.updates = Updates(ctx, self.admission, self.packs, build_optimizer)
        self.compute = Compute(ctx, self.packs, self.transport, self.updates, loss_fn)
        self._handlers: dict[str, Callable[[Task], float]] = {
            "FWD": self._forward, "BWD": self.compute.backward, "BWD+loss": self.compute.backward, "UPD": self._update}
        if tracker is not None:
            tracker.reclaim = self.admission.reclaim
            tracker.budget = plan.devices.get(rank)
            tracker.over_budget = self.admission.let_outputs_leave
        device.pin_host(store.buffer)
        for slab in (slabs.buffers.values() if slabs is not None else ()):
            device.pin_host(slab)
        if transport is not None:
            transport.start(self.transport.p2p_buffers, setup)

    def close(self) -> None:
        """Stop the transport and the stream threads; unpin host memory."""
        if self.transport.dist is not None:
            self.transport.dist.close()
        for stream in self.ctx.streams:
            stream.close()
        self.ctx.device.unpin_host()

    def sync_kept(self) -> None:
        """Write the state kept on the device across iterations back to the host store
        (``PackState.sync_kept``)."""
        self.packs.sync_kept()

    def drop_kept(self, optimizer: bool = True) -> None:
        """Let the kept state go after the host store was written (``PackState.drop_kept``)."""
        self.packs.drop_kept(optimizer)

    # ================================================================ iteration
    def run_iteration(self, iteration: int, batch: Batch, rates: Rates | None = None,
                      loss_scale: float | None = None) -> IterationResult:
        """This device's tasks of one iteration, in plan order, until their outputs have left;
        updates at the learning-rate schedule's ``rates`` when there is one (``lr_schedule.py``);
        the loss multiplied by ``loss_scale`` before its backward (fp16, ``lossscale.py``)."""
        ctx, device = self.ctx, self.ctx.device
        ctx.iteration = iteration
        ctx.batch = batch
        self.updates.rates = rates
        self.compute.loss_scale = loss_scale
        ctx.counters.reset()
        ctx.transfers = {}
        if self.transport.slabs is not None:
            self.transport.slabs.reset()
        device.reset_peak()
        ctx.ledger.reset()
        loss = 0.0
        task_seconds: dict[int, float] = {}
        task_peaks: dict[int, int] = {}
        events: list[Event] = []
        start = time.perf_counter()
        device.ready(start)  # the iteration's first unit waits for the iteration to be handed out
        with device.memory_scope():
            for task in self.tasks:
                t0 = time.perf_counter()
                ctx.shared.set_current(ctx.rank, task.id)
                ctx.task = task.id
                device.reset_peak()
                # the task's first unit is reserved before its state loads (the state counts inside it)
                # and before the next task's state may be prefetched beside it
                self.compute.claim(task)
                self.admission.ledger_unit(task.id, 0)
                loss += self._run_task(task)
                ctx.ledger.idle(self.admission.kept)
                self.admission.headroom = 0
                t1 = time.perf_counter()
                task_seconds[task.id] = t1 - t0
                if device.measures_memory:
                    task_peaks[task.id] = device.peak()
                events.append(("compute", task.id, str(task), t0, t1))
            ctx.shared.set_current(ctx.rank, None)
            with ctx.waiting_for("the last swap-outs and messages of the iteration to leave"):
                self._drain()
        # a stream's job that failed (a send whose transport broke) raised the abort flag, not an
        # exception here; nor does a drain that finds its markers done check it: without this a
        # worker whose last send failed would report its iteration done, and the launcher would hear
        # only that another worker had stopped (test_p2p_dist)
        if ctx.shared.aborted():
            raise Aborted("the run was aborted while this device finished its iteration")
        device.synchronize()
        seconds = time.perf_counter() - start
        by_channel, by_tensor = ctx.counters.snapshot()
        leftover = list(ctx.local)
        if leftover:
            raise RuntimeError(f"dev{ctx.rank}: LOCAL values nobody read: {leftover[:3]}")
        ctx.resident.clear()
        measured = device.measures_memory
        peak = max([device.peak(), *task_peaks.values()]) if measured else ctx.ledger.peak
        events += ctx.waits
        ctx.waits = []
        for stream in ctx.streams:
            kind = stream.name.split("-", 1)[1]
            events.extend((kind, *event) for event in stream.take_events())
        return IterationResult(loss=loss, seconds=seconds, peak=peak, bytes_by_channel=by_channel,
                               bytes_by_tensor=by_tensor, task_seconds=task_seconds, task_peaks=task_peaks,
                               events=events, transfers=ctx.transfers, ledger_peak=ctx.ledger.peak,
                               ledger_shortfall=ctx.ledger.shortfall, peak_measured=measured,
                               unit_starts=device.take_unit_starts())

    def _run_task(self, task: Task) -> float:
        """Run one task's units on the compute thread, by the op the program gives its first (one
        handler per op); returns its share of the loss (0 but for a loss task)."""
        log.debug("dev%d runs %s", self.ctx.rank, task)
        handler = self._handlers.get(self._ops[task.id])
        if handler is None:
            raise RuntimeError(f"dev{self.ctx.rank}'s program runs {self._ops[task.id]} for {task}, which a device "
                               "does not run")
        loss = handler(task)
        self._finish(task)
        return loss

    def _forward(self, task: Task) -> float:
        self.compute.forward(task)
        return 0.0

    def _update(self, task: Task) -> float:
        self.updates.update_task(task)
        return 0.0

    def _finish(self, task: Task) -> None:
        """Mark the task done once every output it queued has left (stream order guarantees it:
        a no-op queued behind them on both outbound streams). Marked from whichever of the two
        finishes last, never by a job that blocks one stream on the other: a swap-out stream held
        by a send that waits for a peer's room would hold back this device's gradient deposits,
        which its own compute thread may wait for while the peer waits for it (a deadlock seen on
        gloo in 1f1b-swap on 4 devices)."""
        ctx = self.ctx
        iteration = ctx.iteration
        busy = [stream for stream in (ctx.p2p_out, ctx.swap_out) if stream.busy()]
        if not busy:  # nothing of it is still leaving: done now, without waking a stream thread
            ctx.shared.mark_done(task.id, iteration, ctx.device.work_done())
            return
        lock = threading.Lock()
        pending = [len(busy)]
        ended = [0.0]  # when the markers' streams had done the task's work (``Job.ended``)

        def one_left(marker: Job) -> None:
            if marker.cancelled():
                return
            with lock:
                pending[0] -= 1
                ended[0] = max(ended[0], marker.ended)
                last = pending[0] == 0
            if last:
                ctx.shared.mark_done(task.id, iteration, ended[0])

        for stream in busy:
            stream.submit(lambda: None).add_done_callback(one_left)

    def _drain(self) -> None:
        """Wait until every job queued on the four streams has finished: a marker on each stream
        still busy, waited for together. Only the compute thread, which is here, queues real jobs,
        so none can join a stream behind its marker, and an idle stream stays idle. Markers on all
        four, one after another, would cost a thread wake-up each."""
        ctx = self.ctx
        streams = (ctx.swap_out, ctx.p2p_out, ctx.swap_in, ctx.p2p_in)
        markers = [stream.submit(lambda: None) for stream in streams if stream.busy()]
        for marker in markers:
            ctx.wait(marker)
