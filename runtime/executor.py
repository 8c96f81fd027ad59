"""The per-device executor (§4.4): one worker's tasks of one iteration, in plan order.

The compute thread runs FWD, BWD and UPD tasks; four stream threads beside it move data (see
``streams.py``): swap-in (host -> device, prefetching the next task's weights and the next
microbatch's inputs while the current one computes), swap-out (device -> host: updated weights and
optimizer state, buffers, gradients, stashes), p2p-in (receiving activations and gradients from
other devices) and p2p-out (sending them). P2P messages travel through shared memory
(``channels.Slabs``) or, with a ``DistTransport`` (``p2p.py``), as torch.distributed sends
straight into the receiver's device memory.

Semantics, each matching one-process eager training (``reference.py``):

- **FWD**: the pack's forward for each microbatch of its group, without autograd; the inputs of
  the layers a later recompute starts from are stashed to host memory with the random-generator
  state they had (``rng.py``); buffers (BatchNorm statistics) are updated and written back once.
- **BWD**: per microbatch, the recompute from the stash (buffers on throwaway copies, so running
  statistics are not updated twice; the generator state restored, so dropout masks repeat), then
  the backward with the gradient arriving from the next pack. The pack's gradient buffer stays on
  the device across its microbatches (input-batch grouping). A ``loss`` task runs the last pack's
  forward, the loss scaled by u/D and the backward together.
- **Updates**: jit-update on the device right after a pack's last backward (``update="device"``),
  or the gradient is left in a host slot for an update elsewhere (an offloaded host update, the
  baselines' UPD tasks, or the owner of a tied weight). A parameter is stepped exactly once per
  iteration, by the task that owns it, with the sum of every gradient of it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch.func import functional_call
from torch.utils import _pytree as pytree

from harmony.decomposer import batching
from harmony.decomposer.layer_graph import LayerGraph
from harmony.errors import DeviceOutOfMemoryError
from harmony.runtime import rng
from harmony.runtime.channels import (Aborted, Counters, Mailbox, Slabs, shared_copy, state_bytes, state_tensor,
                                      tensor_bytes, wait_until)
from harmony.runtime.device import Device
from harmony.runtime.hoststore import HostStore
from harmony.runtime.p2p import DistTransport, Received
from harmony.runtime.routes import Routes
from harmony.runtime.streams import Stream
from harmony.scheduler.lower import IN_STREAM, OUT_STREAM, Edge, ranges, stash_layers
from harmony.scheduler.tasks import Channel, Kind, Task

log = logging.getLogger(__name__)

Values = list  # a boundary: tensors and plain objects, in the layer graph's value order


MAX_WORKERS = 64  # worker status rows in the shared flags
STATUS_BYTES = 512  # per worker: what it is doing or waiting for, UTF-8, for stall and failure reports


@dataclass
class Shared:
    """Cross-process flags in shared memory: which tasks finished this iteration, which replicas
    of an update read their inputs, whether the run was aborted, and per worker the task it runs
    and what it waits for (read by the launcher when a worker fails, dies or stalls)."""

    done: torch.Tensor  # int64 [tasks]: iteration + 1 once the task and all its outputs finished
    reads: torch.Tensor  # int64 [tasks]: iteration + 1 once a replicated UPD read its inputs
    abort: torch.Tensor  # int64 [1]: nonzero once any worker failed
    current: torch.Tensor | None = None  # int64 [MAX_WORKERS]: task id + 1 running now, 0 between tasks
    status: torch.Tensor | None = None  # uint8 [MAX_WORKERS, STATUS_BYTES]: NUL-padded text

    def __post_init__(self) -> None:
        # numpy views of the same shared memory: polled from threads inside a device's memory scope,
        # they must not go through torch's dispatcher (and its tracking mode) thousands of times
        self._done = self.done.numpy()
        self._reads = self.reads.numpy()
        self._abort = self.abort.numpy()
        self._current = self.current.numpy() if self.current is not None else None
        self._status = self.status.numpy() if self.status is not None else None

    def __getstate__(self) -> dict:
        return {"done": self.done, "reads": self.reads, "abort": self.abort, "current": self.current,
                "status": self.status}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def is_done(self, task: int, iteration: int) -> bool:
        return int(self._done[task]) == iteration + 1

    def mark_done(self, task: int, iteration: int) -> None:
        self._done[task] = iteration + 1

    def mark_read(self, task: int, iteration: int) -> None:
        self._reads[task] = iteration + 1

    def has_read(self, task: int, iteration: int) -> bool:
        return int(self._reads[task]) == iteration + 1

    def set_abort(self) -> None:
        self._abort[0] = 1

    # ------------------------------------------------------------ worker status
    def set_current(self, rank: int, task: int | None) -> None:
        if self._current is not None and rank < MAX_WORKERS:
            self._current[rank] = 0 if task is None else task + 1

    def current_task(self, rank: int) -> int | None:
        if self._current is None or rank >= MAX_WORKERS:
            return None
        value = int(self._current[rank])
        return value - 1 if value else None

    def set_status(self, rank: int, text: str) -> None:
        if self._status is None or rank >= MAX_WORKERS:
            return
        data = np.frombuffer(text.encode()[:STATUS_BYTES], dtype=np.uint8)
        row = self._status[rank]
        row[:len(data)] = data
        row[len(data):] = 0

    def get_status(self, rank: int) -> str:
        if self._status is None or rank >= MAX_WORKERS:
            return ""
        return bytes(self._status[rank]).rstrip(b"\0").decode(errors="replace")

    @classmethod
    def create(cls, tasks: int, path: str | None = None, create: bool = True) -> "Shared":
        """Flags for ``tasks`` tasks; with ``path``, in that file (mapped by every process that
        names it: torchrun's workers are not forked from one parent)."""
        n = max(tasks, 1)
        status_words = MAX_WORKERS * STATUS_BYTES // 8
        size = 2 * n + 1 + MAX_WORKERS + status_words
        if path is None:
            flat = torch.zeros(size, dtype=torch.int64).share_memory_()
        else:
            flat = torch.from_file(path, shared=True, size=size, dtype=torch.int64)
        status = flat[2 * n + 1 + MAX_WORKERS:].view(torch.uint8).view(MAX_WORKERS, STATUS_BYTES)
        return cls(flat[:n], flat[n:2 * n], flat[2 * n:2 * n + 1], flat[2 * n + 1:2 * n + 1 + MAX_WORKERS], status)

    def aborted(self) -> bool:
        return bool(self._abort[0])

    def wait_done(self, task_ids: list[int], iteration: int, what: str, timeout: float) -> None:
        pending = list(task_ids)

        def ready() -> bool:
            pending[:] = [t for t in pending if not self.is_done(t, iteration)]
            return not pending

        wait_until(ready, self.aborted, timeout, f"task(s) {pending} before {what}")


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
    peak: int
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


class _NoRoom(Exception):
    """A prefetch that would not fit now (and was told not to wait)."""


class Executor:
    """Runs one device's share of every iteration; see the module docs."""

    def __init__(self, rank: int, device: Device, layers: LayerGraph, routes: Routes, store: HostStore,
                 shared: Shared, mailbox: Mailbox, peers: list[Any], loss_fn: Callable,
                 build_optimizer: Callable, seed: int, timeout: float = 600.0,
                 working_memory: dict[int, int] | None = None, slabs: Slabs | None = None,
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
        self.seed = seed
        self.timeout = timeout
        self.tasks = [t for t in routes.graph.tasks if t.device == rank]
        self.counters = Counters()
        self.minibatch = routes.graph.minibatch
        self.local: dict[Any, Any] = {}  # LOCAL outputs waiting on the device for their consumer
        self.resident: dict[int, dict[str, torch.Tensor]] = {}  # task -> pack state kept for a later task
        self._prefetched: dict[int, Future] = {}
        self._waiting = False
        self._headroom = 0  # bytes the running task may still allocate (planned): prefetches leave them free
        self._task: int | None = None  # the task the compute thread runs (what side-stream jobs serve)
        self._waits: list[tuple[str, int | None, str, float, float]] = []  # the compute thread's, this iteration
        self._transfers: dict[str, list[tuple[str, tuple, int]]] = {}  # see IterationResult.transfers
        self.working_memory = working_memory or {}
        # the plan's promise (scheduler/memory.py): what no prefetch may take this device past, and
        # per task the most it holds at once
        plan = routes.graph.memory
        self._budget = plan.devices.get(rank) if plan is not None else None
        self._reserves = plan.reserves if plan is not None else {}
        self._prefetches = dict(plan.prefetch) if plan is not None else None  # states loaded ahead, and when
        self._next: Task | None = None  # the next task, while its state may still be prefetched
        self.slabs = slabs
        self.transport = transport  # P2P over torch.distributed; None: through shared memory
        self._awaited: dict[tuple[int, bool], int] = {}  # (sender, on the compute thread) -> P2P waits
        threads = torch.get_num_threads()
        scope = device.memory_scope

        def setup() -> None:
            torch.set_num_threads(threads)
            device.stream_setup()

        self.swap_in = Stream(f"dev{rank}-swap-in", scope, setup, device.stream_sync)
        self.swap_out = Stream(f"dev{rank}-swap-out", scope, setup, device.stream_sync)
        self.p2p_in = Stream(f"dev{rank}-p2p-in", scope, setup, device.stream_sync)
        self.p2p_out = Stream(f"dev{rank}-p2p-out", scope, setup, device.stream_sync)
        self._batch_dims = self._batch_value_dims()
        tracker = getattr(device, "tracker", None)
        if tracker is not None:
            tracker.reclaim = self._reclaim
            tracker.budget = self._budget
            tracker.over_budget = self._let_outputs_leave
        self._gave_up_waiting: int | None = None  # the task whose outputs would not leave in time
        self._out_spec = layers.out_spec()
        self._activity: dict[int, str] = {}  # thread -> what it waits for, published to shared.status
        self._activity_lock = threading.Lock()
        device.pin_host(store.buffer)
        for slab in (slabs.buffers.values() if slabs is not None else ()):
            device.pin_host(slab)
        if transport is not None:
            transport.start(self._p2p_buffers, setup)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        for stream in (self.swap_in, self.swap_out, self.p2p_in, self.p2p_out):
            stream.close()
        self.device.unpin_host()

    @contextlib.contextmanager
    def _waiting_for(self, what: str):
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
    def run_iteration(self, iteration: int, batch: Batch) -> IterationResult:
        self.iteration = iteration
        self.batch = batch
        self.counters.reset()
        self._transfers = {}
        if self.slabs is not None:
            self.slabs.reset()
        self.device.reset_peak()
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
                # the task's room is reserved before the next task's state may be prefetched beside it
                self._headroom = self._reserve(task)
                self.device.reset_peak()
                self._next = self.tasks[i + 1] if self.prefetch and i + 1 < len(self.tasks) else None
                loss += self._run_task(task)
                self._next = None
                self._headroom = 0
                t1 = time.perf_counter()
                task_seconds[task.id] = t1 - t0
                task_peaks[task.id] = self.device.peak()
                events.append(("compute", task.id, str(task), t0, t1))
            self.shared.set_current(self.rank, None)
            with self._waiting_for("the last swap-outs and messages of the iteration to leave"):
                self._drain()
        self.device.synchronize()
        seconds = time.perf_counter() - start
        by_channel, by_tensor = self.counters.snapshot()
        leftover = [k for k in self.local]
        if leftover:
            raise RuntimeError(f"dev{self.rank}: LOCAL values nobody read: {leftover[:3]}")
        self.resident.clear()
        peak = max([self.device.peak(), *task_peaks.values()])
        events += self._waits
        self._waits = []
        for stream in (self.swap_in, self.swap_out, self.p2p_in, self.p2p_out):
            kind = stream.name.split("-", 1)[1]
            events.extend((kind, *event) for event in stream.take_events())
        return IterationResult(loss=loss, seconds=seconds, peak=peak, bytes_by_channel=by_channel,
                               bytes_by_tensor=by_tensor, task_seconds=task_seconds, task_peaks=task_peaks,
                               events=events, transfers=self._transfers)

    def _moved(self, stream: str, op: str, what: tuple, nbytes: int) -> None:
        """Log one transfer in program terms (a list append per transfer; streams are FIFO, so a
        stream's log is in the order its thread ran them)."""
        self._transfers.setdefault(stream, []).append((op, what, nbytes))

    def _drain(self) -> None:
        for stream in (self.swap_out, self.p2p_out, self.swap_in, self.p2p_in):
            self._wait(stream.submit(lambda: None))

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

    def _let_outputs_leave(self) -> None:
        """An allocation would take the device past the plan's peak for it: the plan does not count
        outputs still leaving the device (queued swap-outs and sends; see the estimator's module
        docs), so let them go first. A job that cannot finish within a second (a send whose
        receiver is short of room) is not waited for again in this task; nor do the outbound
        streams wait for themselves."""
        if self._gave_up_waiting == self._task or self._on_outbound_stream():
            return
        for stream in (self.swap_out, self.p2p_out):
            if not stream.busy():
                continue
            try:
                stream.submit(lambda: None).result(timeout=1.0)
            except TimeoutError:
                self._gave_up_waiting = self._task
                return
            except Exception:  # noqa: BLE001 - a failed job reports itself where it is awaited
                return

    def _on_outbound_stream(self) -> bool:
        name = threading.current_thread().name
        return name in (f"harmony-{self.swap_out.name}", f"harmony-{self.p2p_out.name}")

    def _reclaim(self) -> bool:
        """The memory manager's last resort before out-of-memory on the compute thread: outputs
        still on their way to the host (and the device tensors they hold) are waited for."""
        if not _on_compute_thread():
            return False
        for stream in (self.p2p_out, self.swap_out):
            try:
                stream.submit(lambda: None).result(timeout=self.timeout)
            except Exception:  # noqa: BLE001 - a failed job reports itself where it is awaited
                return False
        return True

    def _run_task(self, task: Task) -> float:
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
        """Mark the task done once every output it queued has left (stream order guarantees it)."""
        sent = self.p2p_out.submit(lambda: None)

        def mark() -> None:
            sent.result()
            self.shared.mark_done(task.id, self.iteration)

        self.swap_out.submit(mark)

    # ================================================================ copies
    def _to_device(self, t: torch.Tensor, channel: str, tensor: str, wait: bool = True, count: bool = True,
                   room: int | None = None) -> torch.Tensor:
        """A counted copy into device memory that waits while memory is short and work that can
        free it is still running; gives up (out of memory) once the compute thread is blocked on
        it and nothing was freed for a second. Without ``wait`` (a prefetch that gives up rather
        than hold its stream) it is never urgent: it fits beside the running task or not at all.
        ``room``: what it must leave free for the running task (default: the task's headroom)."""
        nbytes = t.numel() * t.element_size()
        urgent = self._compute_blocked if wait else _on_compute_thread
        out = self._with_room(nbytes, lambda: self.device.to_device(t), urgent, wait, room)
        if count:
            self.counters.add(channel, "in", tensor, nbytes)
        return out

    def _compute_blocked(self) -> bool:
        """Whether the copy being made is one the compute thread waits for (or makes itself)."""
        return self._waiting or _on_compute_thread()

    def _with_room(self, nbytes: int, make: Callable[[], Any], urgent: Callable[[], bool], wait: bool = True,
                   room: int | None = None) -> Any:
        """``make()`` (an allocation of ``nbytes`` on the device) once there is room: while it is not
        ``urgent`` it leaves ``room`` (default: what the running task still allocates) and waits while
        memory is short; once urgent (the compute thread waits for it) it takes what there is, and
        gives up (out of memory) when nothing was freed for a second."""
        stalled_since = None
        while True:
            try:
                free = self._headroom if room is None else room
                if not urgent() and self.device.allocated() + nbytes + free > self._prefetch_limit():
                    raise DeviceOutOfMemoryError(self.device.name, nbytes, self.device.allocated(), self.device.capacity)
                return make()
            except (DeviceOutOfMemoryError, torch.cuda.OutOfMemoryError) as exc:
                if not wait:
                    raise _NoRoom from None
                if self.shared.aborted():
                    raise Aborted("the run was aborted by another worker's failure") from None
                if urgent():
                    now = time.monotonic()
                    stalled_since = stalled_since or now
                    if now - stalled_since > 1.0:
                        if isinstance(exc, DeviceOutOfMemoryError):
                            raise
                        raise DeviceOutOfMemoryError(self.device.name, nbytes, self.device.allocated(),
                                                     self.device.capacity) from exc
                else:
                    stalled_since = None
                time.sleep(0.001)

    def _prefetch_limit(self) -> int:
        """Bytes a copy made ahead of need may take the device to: the plan's peak for it (the rest
        of the device is the margin left for noise), or the device's capacity without one."""
        if self._budget is None:
            return self.device.capacity
        return min(self._budget, self.device.capacity)

    def _reserve(self, task: Task) -> int:
        """Room the running task needs before its state is in: the plan's reserve (the most it
        holds at once), or, for a plan without one, its planned working memory."""
        if task.id in self._reserves:
            return self._reserves[task.id]
        return self.working_memory.get(task.id, 0)

    def _p2p_buffers(self, src: int, specs: list[tuple[list[int], torch.dtype]]) -> list[torch.Tensor]:
        """Receive buffers on the device for a P2P message from ``src`` (the transport's receiving
        thread, inside the device's memory scope): received ahead of its consumer, a message waits
        for room like a prefetch, unless the compute thread waits for a message from ``src`` (this
        one, or one behind it in the sender's order)."""
        nbytes = sum(torch.empty((), dtype=dtype).element_size() * math.prod(shape) for shape, dtype in specs)
        where = self.device.torch_device

        def make() -> list[torch.Tensor]:
            return [torch.empty(shape, dtype=dtype, device=where) for shape, dtype in specs]

        start = time.perf_counter()
        buffers = self._with_room(nbytes, make, lambda: self._awaits(src))
        waited = time.perf_counter() - start
        if waited > 0.001:
            log.debug("dev%d: a P2P message of %d bytes from dev%d waited %.3f s for room", self.rank, nbytes, src, waited)
        return buffers

    def _awaits(self, src: int) -> bool:
        """Whether the compute thread is blocked on a P2P message from ``src``."""
        with self._activity_lock:
            return self._awaited.get((src, True), 0) > 0 or (self._waiting and self._awaited.get((src, False), 0) > 0)

    @contextlib.contextmanager
    def _awaiting(self, src: int):
        """Mark a wait for a P2P message from ``src`` (see ``_awaits``)."""
        key = (src, _on_compute_thread())
        with self._activity_lock:
            self._awaited[key] = self._awaited.get(key, 0) + 1
        try:
            yield
        finally:
            with self._activity_lock:
                self._awaited[key] -= 1

    def _values_to_device(self, values: Values, channel: str, tensor: str) -> Values:
        """A microbatch's inputs copied in. Under a memory plan they come one microbatch ahead, as the
        plan counts them (beside the running microbatch's work): they keep no more room free."""
        room = 0 if self._prefetches is not None else None
        return [self._to_device(v, channel, tensor, room=room) if isinstance(v, torch.Tensor) else v for v in values]

    def _to_host_into(self, dst: torch.Tensor, src: torch.Tensor, tensor: str) -> None:
        with torch.no_grad(), self.device.host_side():
            dst.copy_(src.detach())
        self.counters.add("SWAP", "out", tensor, src.numel() * src.element_size())

    # ================================================================ pack state
    def _state_names(self, task: Task) -> list[str]:
        names: list[str] = []
        for layer in range(task.first, task.last + 1):
            for name in self.layers.layers[layer].state:
                if name not in names:
                    names.append(name)
        return names

    def _unit_starts(self, unit: int) -> None:
        """Unit ``unit`` of the running task (a microbatch, or its update) is about to compute: the
        moment the plan may load the next task's state (``MemoryPlan.prefetch``), its memory counted
        beside this unit's."""
        nxt = self._next
        if nxt is None or self._prefetches is None or self._prefetches.get(nxt.id, -1) != unit:
            return
        self._next = None
        self._prefetch_state(nxt)

    def _prefetch_state(self, task: Task) -> None:
        """Load the next task's state while the running one computes: where the plan does (its
        memory counts it beside the running task), or, for a plan without a memory plan, wherever
        it fits beside the running task's planned working memory."""
        if task.kind == Kind.UPD or any(t.tensor == "W" and t.channel == Channel.LOCAL for t in task.inputs):
            return
        before = self.routes.buffers_after.get(task.id)
        if before is not None and not self.shared.is_done(before, self.iteration):
            # its buffers are still being updated (maybe by the task running now): a prefetch would
            # hold the swap-in stream, and the running task's inputs queued behind it, until then
            return
        self._prefetched[task.id] = self.swap_in.submit(self._try_load_state, task, label="state in", task=task.id)

    def _try_load_state(self, task: Task) -> dict[str, torch.Tensor] | None:
        """A prefetch of the next task's state that gives up, rather than wait, when it does not
        fit beside the running task: waiting would hold the swap-in stream, and the running task's
        inputs behind it. The task then loads its state when it starts."""
        try:
            # a prefetch the plan makes was counted beside the running task: it needs no room kept
            return self._load_state(task, wait=False, room=0 if self._prefetches is not None else None)
        except _NoRoom:
            return None

    def _load_state(self, task: Task, wait: bool = True, room: int | None = None) -> dict[str, torch.Tensor]:
        """The pack's parameters and buffers on the device, by original name (a tied parameter's
        names share one copy)."""
        local = next((t for t in task.inputs if t.tensor == "W" and t.channel == Channel.LOCAL), None)
        if local is not None:
            return self.resident.pop(local.task)
        before = self.routes.buffers_after.get(task.id)
        if before is not None:
            self._wait_done([before], f"task {task.id} reads the buffers task {before} updates")
        state: dict[str, torch.Tensor] = {}
        copies: dict[str, torch.Tensor] = {}
        for name in self._state_names(task):
            spec = self.layers.state[name]
            if spec.kind == "parameter":
                canon = self.layers.canonical(name)
                if canon not in copies:
                    copies[canon] = self._to_device(self.store.weight(canon), "SWAP", "W", wait, count=False, room=room)
                state[name] = copies[canon]
            else:
                state[name] = self._to_device(self.store.view(f"B/{name}"), "SWAP", "B", wait, count=False, room=room)
        # counted once the whole state is in (an abandoned prefetch moved nothing the plan counts)
        buffers = [t for n, t in state.items() if self.layers.state[n].kind != "parameter"]
        for tensor, group in (("B", buffers), ("W", list(copies.values()))):
            for t in group:
                self.counters.add("SWAP", "in", tensor, t.numel() * t.element_size())
        for tensor, group in (("W", list(copies.values())), ("B", buffers)):
            if group:
                self._moved("swap-in", "LOAD", (task.id, tensor), tensor_bytes(group))
        return state

    def _pack_state(self, task: Task) -> dict[str, torch.Tensor]:
        future = self._prefetched.pop(task.id, None)
        state = self._wait(future, "state") if future is not None else None
        if state is None:
            state = self._load_state(task)
        if task.id in self._reserves:  # the state is in: the task's room is what it has yet to allocate
            loaded = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in state.values()}
            self._headroom = max(0, self._reserves[task.id] - sum(loaded.values()))
        if task.id in self.routes.kept_resident:
            self.resident[task.id] = state
        self._prefetch_unplanned()
        return state

    def _prefetch_unplanned(self) -> None:
        """Without a memory plan, the next task's state loads once this task's is in, wherever it
        fits (``lower.py`` lists it there)."""
        if self._prefetches is None and self._next is not None:
            nxt, self._next = self._next, None
            self._prefetch_state(nxt)

    def _params(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical name -> device tensor of the trainable parameters in a pack state."""
        out = {}
        for name, t in state.items():
            spec = self.layers.state[name]
            if spec.kind == "parameter" and spec.requires_grad:
                out.setdefault(self.layers.canonical(name), t)
        return out

    def _write_buffers(self, task: Task, state: dict[str, torch.Tensor]) -> None:
        """B -> SWAP: buffers changed by the forward (running statistics) go back to the host."""
        if not any(t.tensor == "B" for t in task.outputs):
            return
        buffers = {name: t for name, t in state.items() if self.layers.state[name].kind != "parameter"}

        def write() -> None:
            for name, t in buffers.items():
                self._to_host_into(self.store.view(f"B/{name}"), t, "B")

        self._after_compute(self.swap_out, "B out", write)

    # ================================================================ running layers
    def _run_layer(self, index: int, state: dict[str, torch.Tensor], values: Values) -> Values:
        names = self.layers.layers[index].state
        return list(functional_call(self.modules[index], {n: state[n] for n in names}, tuple(values)))

    def _run_pack(self, task: Task, state: dict[str, torch.Tensor], values: Values) -> Values:
        for layer in range(task.first, task.last + 1):
            values = self._run_layer(layer, state, values)
        return values

    # ================================================================ streams of activations
    def _batch_value_dims(self) -> dict[int, list[int | None]]:
        """Per layer boundary, the dim along which each value holds its samples (None: passed
        whole), as the decomposer probed it, for cutting and joining microbatches."""
        return {spec.index: self.layers.input_batch_dims(spec.index) for spec in self.layers.layers}

    def _cut(self, values: Values, boundary: int, start: int, stop: int) -> Values:
        return batching.cut(list(values), self._batch_dims.get(boundary, []), start, stop)

    def _join(self, parts: list[Values], boundary: int) -> Values:
        return batching.join(parts, self._batch_dims.get(boundary, []))

    def _key(self, consumer: int, stream: str, start: int) -> tuple:
        return (self.iteration, consumer, stream, start)

    def _send(self, task: Task, mb: int, edges: list[Edge], values: Values, state: torch.Tensor | None) -> None:
        """Hand microbatch ``mb`` of a boundary to the program's edges out of it, each cut to its
        piece of the consumer's microbatch."""
        mb_start, mb_size = ranges(task)[mb]
        for e in edges:
            part = values
            if (e.start, e.stop) != (mb_start, mb_start + mb_size):
                part = self._cut(values, e.layer, e.start - mb_start, e.stop - mb_start)
            key = self._key(e.consumer, e.stream, e.start)
            tensor = {"X": "Y", "dY": "dX"}.get(e.stream, "Xs")
            self._route(key, self.routes.by_id[e.consumer], Channel(e.channel), part, state, tensor)

    def _route(self, key: tuple, consumer: Task, channel: Channel, values: Values, state, tensor: str) -> None:
        self._moved(OUT_STREAM[channel], "SEND", key[1:], tensor_bytes(values))
        if channel == Channel.LOCAL:
            self.local[key] = (values, state)
            return
        dst = consumer.device
        if channel == Channel.P2P:
            if self.transport is not None:
                self._after_compute(self.p2p_out, f"{tensor} to dev{dst}", self.transport.send, key, values, state, dst)
                return

            def send() -> None:
                self.peers[dst].put((key, (self._encode(values, dst), state_bytes(state), self.rank)))

            self._after_compute(self.p2p_out, f"{tensor} to dev{dst}", send)
            return
        # SWAP / MSG: park in host memory; a consumer in another worker reads it from there

        def park() -> None:
            self.counters.add(channel.value, "out", tensor, tensor_bytes(values))
            if dst == self.rank:
                host = [self.device.to_host(v) if isinstance(v, torch.Tensor) else v for v in values]
                self.mailbox.put_local(key, (host, state))
            else:
                self.peers[dst].put((key, (self._encode(values, dst), state_bytes(state), self.rank)))

        self._after_compute(self.swap_out, f"{tensor} out", park)

    def _encode(self, values: Values, dst: int) -> list:
        with self.device.host_side():
            if self.slabs is None:
                return [("tensor", shared_copy(v)) if isinstance(v, torch.Tensor) else ("obj", v) for v in values]
            return self.slabs.encode(values, self.rank, dst)

    def _receive(self, key: tuple, what: str) -> tuple[Values, torch.Tensor | None, bool]:
        """A message from the inbox: its values, the state, and whether the tensors are on the
        device already (received by the ``DistTransport``) or in host memory (slab views or own
        segments)."""
        began = time.perf_counter()
        with self._waiting_for(what):
            message = self.mailbox.take(key, what, self.timeout)
        if _on_compute_thread():  # not prefetched: the compute thread waited for it
            self._waits.append(("compute", self._task, f"wait: {what.split(' (')[0]}", began, time.perf_counter()))
        if isinstance(message, Received):
            return message.values, message.state, True
        if len(message) == 2:  # parked by this worker for itself
            return *message, False
        items, state, src = message
        if self.slabs is None:
            return [item[1] for item in items], state_tensor(state), False
        return self.slabs.decode(items, src, self.rank), state_tensor(state), False

    def _fetch(self, task: Task, stream: str, mb: int) -> tuple[Values, torch.Tensor | None]:
        """Microbatch ``mb`` of an input stream on the device, with its generator state: the
        program's edges into it, joined."""
        edges = self.routes.program.into(task.id, stream, mb)
        start, size = ranges(task)[mb]
        if not edges:
            raise RuntimeError(f"task {task.id} ({task}) has no input for {stream}; the plan is incomplete")
        if edges[0].producer is None:  # the minibatch, in host memory
            values = [self._slice(v, start, size) for v in self.batch.inputs]
            self._moved("swap-in", "RECV", (task.id, stream, start), tensor_bytes(values))
            values = self._values_to_device(values, "SWAP", "X")
            return values, rng.seeded(self.device.torch_device, rng.microbatch_seed(self.batch.seed, self.iteration, start))
        parts, state = [], None
        for e in edges:
            key = self._key(task.id, stream, e.start)
            what = f"{stream} of task {task.id} (samples {e.start}-{e.stop}) from task {e.producer} on dev{e.src_device}"
            channel = Channel(e.channel)
            if channel == Channel.LOCAL:
                values, piece_state = self._take_local(key, what)
            else:
                label = "P2P" if channel == Channel.P2P else channel.value
                tensor = {"X": "X", "dY": "dY"}.get(stream, "Xs")
                dist = label == "P2P" and self.transport is not None
                with self._awaiting(e.src_device) if dist else contextlib.nullcontext():
                    host, piece_state, on_device = self._receive(key, what)
                if on_device:  # counted here, not on arrival: the counters restart every iteration
                    values = self._adopt(host)
                    self.counters.add(label, "in", tensor, tensor_bytes(host))
                else:
                    values = self._values_to_device(host, label, tensor)
                del host
            self._moved(IN_STREAM[channel], "RECV", key[1:], tensor_bytes(values))
            state = piece_state if state is None else state
            parts.append(values)
        return self._join(parts, edges[0].layer), state

    def _take_local(self, key: tuple, what: str):
        if key not in self.local:
            with self._waiting_for(what):
                wait_until(lambda: key in self.local, self.shared.aborted, self.timeout, f"{what} to become resident")
        return self.local.pop(key)

    def _slice(self, v: Any, start: int, size: int) -> Any:
        return v[start:start + size] if isinstance(v, torch.Tensor) else v

    def _stream_prefetch(self, task: Task, streams: list[str], mb: int) -> dict[str, Future]:
        out = {}
        if mb >= len(task.microbatches) or (mb > 0 and not self.prefetch):
            return out
        for name in streams:
            edges = self.routes.program.into(task.id, name, mb)
            channel = Channel(edges[0].channel) if edges else Channel.SWAP
            if channel == Channel.LOCAL:
                continue
            stream = self.p2p_in if channel == Channel.P2P else self.swap_in
            out[name] = stream.submit(self._fetch, task, name, mb, label=f"{name} in (mb {mb})", task=task.id)
        return out

    def _inputs(self, task: Task, streams: list[str], mb: int, ready: dict[str, Future]) -> dict[str, tuple]:
        got = {}
        for name in streams:
            future = ready.get(name)
            got[name] = self._wait(future, f"{name} (mb {mb})") if future is not None else self._fetch(task, name, mb)
        return got

    # ================================================================ FWD
    def _forward(self, task: Task) -> None:
        state = self._pack_state(task)
        device = self.device.torch_device
        ready = self._stream_prefetch(task, ["X"], 0)
        for mb in range(len(task.microbatches)):
            got = self._inputs(task, ["X"], mb, ready)
            ready = self._stream_prefetch(task, ["X"], mb + 1)
            self._unit_starts(mb)
            values, gen = got["X"]
            if gen is not None:
                rng.restore(device, gen)
            at = self._sends_by_layer(task, mb)
            with torch.no_grad():
                for layer in range(task.first, task.last + 1):
                    if layer in at:
                        self._send(task, mb, at[layer], values, rng.capture(device))
                    values = self._run_layer(layer, state, values)
            self._send(task, mb, at.get(task.last + 1, []), values, rng.capture(device))
            del values, got
        self._write_buffers(task, state)
        self._evict_weights(task, state)

    def _sends_by_layer(self, task: Task, mb: int) -> dict[int, list[Edge]]:
        """A forward microbatch's sends by the layer boundary each is taken at (stashes before a
        layer of the pack, outputs after its last)."""
        at: dict[int, list[Edge]] = {}
        for e in self.routes.program.out_of(task.id, mb):
            if not task.first <= e.layer <= task.last + 1:
                raise RuntimeError(f"task {task.id} ({task}) is to send {e.stream} at layer {e.layer}, outside its pack")
            at.setdefault(e.layer, []).append(e)
        return at

    # ================================================================ BWD
    def _backward(self, task: Task) -> float:
        state = self._pack_state(task)
        params = self._params(state)
        for p in params.values():
            p.requires_grad_(True)
        overwrite = self._load_running_gradient(task, params)
        layers = stash_layers(task)
        streams = ["X"] if task.loss else ["dY"] + [f"Xs{l}" for l in layers]
        if task.loss and task.first == 0:
            streams = ["X"]
        device = self.device.torch_device
        loss_total = 0.0
        ready = self._stream_prefetch(task, streams, 0)
        for mb, (start, size) in enumerate(ranges(task)):
            got = self._inputs(task, streams, mb, ready)
            ready = self._stream_prefetch(task, streams, mb + 1)
            self._unit_starts(mb)
            if task.loss:
                xs, gen = got["X"]
                xs = _leaves(xs)
                if gen is not None:
                    rng.restore(device, gen)
                outputs = self._run_pack(task, state, xs)
                target = self._target(start, size)
                loss = self.loss_fn(pytree.tree_unflatten(outputs, self._out_spec), target) * (size / self.minibatch)
                del outputs
                loss.backward()
                loss_total += float(loss.detach())
                del loss, target
            else:
                # the pack's incoming gradient is the last layer's alone: let go once its gradient moved
                # on (a plan stepping layer by layer counts it in that layer's step, not in earlier ones)
                grads = got.pop("dY")[0]
                scratch = {n: (t.clone() if self.layers.state[n].kind != "parameter" else t) for n, t in state.items()}
                for layer in reversed(layers):
                    xs, gen = got[f"Xs{layer}"]
                    xs = _leaves(xs)
                    if gen is not None:
                        rng.restore(device, gen)
                    stop = task.last if len(layers) == 1 else layer
                    values = xs
                    for l in range(layer, stop + 1):
                        values = self._run_layer(l, scratch, values)
                    _backward(values, grads)
                    del values
                    grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in xs]
                    # a later layer's stash is done with once its gradient moved on; the first's gives dX
                    got[f"Xs{layer}"] = (xs, None) if layer == layers[0] else None
                xs = got[f"Xs{layers[0]}"][0]
                del scratch
            if task.first > 0:
                dx = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in xs]
                self._send(task, mb, [e for e in self.routes.program.out_of(task.id, mb) if e.stream == "dY"], dx, None)
                del dx
            # nothing of this microbatch outlives it but what its sends hold until they have left (the
            # plan counts its gradients gone then, not alive into the next microbatch)
            del xs, got
            grads = None
        if task.loss:
            self._write_buffers(task, state)
        self._after_backward(task, state, params, overwrite)
        return loss_total

    def _target(self, start: int, size: int) -> Any:
        target = self._slice(self.batch.target, start, size)
        if isinstance(target, torch.Tensor):
            target = self.device.to_device(target)
            self.counters.add("TARGET", "in", "T", target.numel() * target.element_size())
        return target

    def _load_running_gradient(self, task: Task, params: dict[str, torch.Tensor]) -> bool:
        """dW <- SWAP: the gradient accumulated so far (per-GPU-swap baselines) becomes the
        starting value of this task's gradient buffer; says whether it did."""
        same_pack = (task.first, task.last)
        if not any(t.tensor == "dW" and t.channel == Channel.SWAP and t.task is not None
                   and (self.routes.by_id[t.task].first, self.routes.by_id[t.task].last) == same_pack
                   for t in task.inputs):
            return False  # (a tied weight's gradient handed over by another pack is added at the step)
        # every earlier deposit into this device's slots (a tied weight's slot takes two packs'
        # deposits) is queued on this device's swap-out stream: wait until it has drained
        self._wait(self.swap_out.submit(lambda: None), "gradient deposits")
        for name, p in params.items():
            if self.store.slot_written(self.rank, name, self.iteration):
                p.grad = self._to_device(self.store.grad_slot(self.rank, name), "SWAP", "dW")
        return True

    def _after_backward(self, task: Task, state: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
                        overwrite: bool) -> None:
        self._unit_starts(len(task.microbatches))  # the plan's update unit (a step here or none)
        deposits = self.routes.deposits.get(task.id, [])
        if deposits:
            grads = {name: params[name].grad for name in deposits if params[name].grad is not None}
            self._after_compute(self.swap_out, "dW out", self._deposit, grads, overwrite)
        if task.id in self.routes.jit:
            owned = {name: params[name] for name in self.routes.updates.get(task.id, [])}
            self._step(task, owned, write=True)
        self._evict_weights(task, state)
        for p in params.values():
            p.grad = None

    def _deposit(self, grads: dict[str, torch.Tensor], overwrite: bool) -> None:
        """dW -> SWAP: leave gradients in this device's host slots (added to what an earlier task
        of this iteration left there, unless this task started from it)."""
        for name, g in grads.items():
            slot = self.store.grad_slot(self.rank, name)
            if overwrite or not self.store.slot_written(self.rank, name, self.iteration):
                self._to_host_into(slot, g, "dW")
            else:
                host = self.device.to_host(g)
                self.counters.add("SWAP", "out", "dW", host.numel() * host.element_size())
                slot.add_(host)
            self.store.stamp_slot(self.rank, name, self.iteration)

    def _evict_weights(self, task: Task, state: dict[str, torch.Tensor]) -> None:
        """W -> SWAP without an update (per-GPU-swap baselines evict their weights): the copy is
        made, as the baseline makes it, into a scratch buffer, since the master is unchanged."""
        if task.id in self.routes.jit or not any(t.tensor == "W" for t in task.outputs):
            return
        params = {self.layers.canonical(n): t for n, t in state.items() if self.layers.state[n].kind == "parameter"}

        def evict() -> None:
            for t in params.values():
                host = self.device.to_host(t)
                self.counters.add("SWAP", "out", "W", host.numel() * host.element_size())

        self._after_compute(self.swap_out, "W out", evict)

    # ================================================================ updates
    def _update_task(self, task: Task) -> None:
        """A UPD task on this device: weights, the summed gradient and the state in, step, out.
        Replicas of one update (data parallel with per-GPU swap) all compute it; the lowest one
        writes the master after every replica has read it."""
        local = next((t for t in task.inputs if t.tensor == "W" and t.channel == Channel.LOCAL), None)
        state = self.resident.pop(local.task) if local is not None else None
        owned = self.routes.updates.get(task.id, [])
        params = {}
        for name in owned:
            if state is not None:
                params[name] = next(t for n, t in state.items() if self.layers.canonical(n) == name)
            else:
                params[name] = self._to_device(self.store.weight(name), "SWAP", "W")
        if state is None and params:
            self._moved("swap-in", "LOAD", (task.id, "W"), sum(t.numel() * t.element_size() for t in params.values()))
        self._prefetch_unplanned()
        replicas = self.routes.replicas.get(task.id, [task.id])
        writer = min(replicas, key=lambda t: self.routes.by_id[t].device)
        self._unit_starts(0)
        self._step(task, params, write=task.id == writer, replicas=replicas)

    def _gradient(self, name: str, own: torch.Tensor | None) -> torch.Tensor | None:
        """The full gradient of a parameter: this task's own (on the device) plus every host slot
        written this iteration, summed on the host and copied in once."""
        host = self.store.gradient_sum(name, self.iteration)
        if host is None:
            return own
        g = self._to_device(host, "SWAP", "dW")
        return g if own is None else own.add_(g)

    def _step(self, task: Task, params: dict[str, torch.Tensor], write: bool, replicas: list[int] | None = None) -> None:
        if not params:
            self._write_state(task, {}, {}, write)
            return
        sources = sorted({s for name in params for s in self.routes.sources.get(name, []) if s != task.id})
        self._wait_done(sources, f"updating task {task.id}")
        leaves = {}
        for name, p in params.items():
            leaf = p.detach().requires_grad_(True)
            leaf.grad = self._gradient(name, p.grad)
            leaves[name] = leaf
        opt = self.build_optimizer(list(leaves.values()))
        for name, leaf in leaves.items():
            if self.store.state_initialized(name):
                opt.state[leaf] = {k: (self._to_device(v, "SWAP", "K") if v.dim() > 0 else v.clone())
                                   for k, v in self.store.state(name).items()}
            else:  # the first step starts from an empty state; the (zero) slots still come in
                for v in self.store.state(name).values():
                    if v.dim() > 0:
                        self._to_device(v, "SWAP", "K")
        if replicas and len(replicas) > 1:
            self.shared.mark_read(task.id, self.iteration)
            if write:
                self._wait_replicas(replicas)
        opt.step()
        new_state = {name: dict(opt.state[leaf]) for name, leaf in leaves.items()}
        weights = {name: leaf.detach() for name, leaf in leaves.items()}
        for leaf in leaves.values():
            leaf.grad = None
        self._write_state(task, weights, new_state, write)

    def _wait_done(self, task_ids: list[int], before: str) -> None:
        if all(self.shared.is_done(t, self.iteration) for t in task_ids):
            return
        names = ", ".join(describe(self.routes.by_id[t]) for t in task_ids)
        with self._waiting_for(f"{names} to finish, before {before}"):
            self.shared.wait_done(task_ids, self.iteration, before, self.timeout)

    def _wait_replicas(self, replicas: list[int]) -> None:
        names = ", ".join(describe(self.routes.by_id[t]) for t in replicas)
        with self._waiting_for(f"the replicas {names} to read the update's inputs"):
            wait_until(lambda: all(self.shared.has_read(t, self.iteration) for t in replicas), self.shared.aborted,
                       self.timeout, f"the replicas {names} to read their inputs")

    def _write_state(self, task: Task, weights: dict, states: dict, write: bool) -> None:
        """W, K -> SWAP after a step: into the master (the writer) or a scratch copy (a replica)."""

        def out() -> None:
            for name, w in weights.items():
                if write:
                    self._to_host_into(self.store.weight(name), w, "W")
                else:
                    self.counters.add("SWAP", "out", "W", tensor_bytes(self.device.to_host(w)))
            for name, values in states.items():
                slots = self.store.state(name)
                for key, v in values.items():
                    if not isinstance(v, torch.Tensor):
                        continue
                    if v.dim() == 0:
                        if write:
                            slots[key].copy_(v)
                        continue
                    if write:
                        self._to_host_into(slots[key], v, "K")
                    else:
                        self.counters.add("SWAP", "out", "K", tensor_bytes(self.device.to_host(v)))
                if write:
                    self.store.mark_state_initialized(name)

        self._after_compute(self.swap_out, "W K out", out)


def host_update(task: Task, layers: LayerGraph, routes: Routes, store: HostStore, shared: Shared,
                build_optimizer: Callable, iteration: int, timeout: float) -> float:
    """A UPD task bound to the host (an offloaded update): the optimizer steps the master weights
    in shared memory in place, with the gradients the devices left in their slots. Returns when
    (``time.perf_counter``) its gradients were all there and the update began."""
    owned = routes.updates.get(task.id, [])
    shared.wait_done(sorted({s for name in owned for s in routes.sources.get(name, [])}), iteration,
                     f"the host update of task {task.id}", timeout)
    began = time.perf_counter()
    leaves = {}
    for name in owned:
        grad = store.gradient_sum(name, iteration)
        if grad is None:
            continue
        leaf = torch.nn.Parameter(store.weight(name), requires_grad=True)
        leaf.grad = grad
        leaves[name] = leaf
    if leaves:
        opt = build_optimizer(list(leaves.values()))
        for name, leaf in leaves.items():
            if store.state_initialized(name):
                opt.state[leaf] = dict(store.state(name))  # in place: the state lives in the slots
        opt.step()
        for name, leaf in leaves.items():
            slots = store.state(name)
            for key, v in opt.state[leaf].items():
                if isinstance(v, torch.Tensor) and v.data_ptr() != slots[key].data_ptr():
                    slots[key].copy_(v)
            store.mark_state_initialized(name)
    shared.mark_done(task.id, iteration)
    return began


def describe(task: Task) -> str:
    """A task in a few words for messages: ``task 7 (dev1 BWD+loss L3-4 u=4)``."""
    return f"task {task.id} ({str(task).split(' in:')[0]})"


def _leaves(values: Values) -> Values:
    """Inputs of a recompute or a loss task: floating tensors become leaves that collect their
    gradient (what flows back to the previous pack)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.detach().requires_grad_(True)
        out.append(v)
    return out


def _backward(outputs: Values, grads: Values) -> None:
    pairs = [(y, g) for y, g in zip(outputs, grads)
             if isinstance(y, torch.Tensor) and y.requires_grad and isinstance(g, torch.Tensor)]
    if pairs:
        torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])


def _on_compute_thread() -> bool:
    """Stream threads are named ``harmony-...`` (``streams.Stream``); the compute thread is not."""
    return not threading.current_thread().name.startswith("harmony-")
