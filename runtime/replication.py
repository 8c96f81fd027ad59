"""One host store per node: a torchrun job on more than one host keeps a replica of the host store
(master weights, buffers, optimizer state, gradient slots and their flags) and of the shared task
flags on every node, and ships every write to the other nodes' replicas at task granularity.

Why this is enough: the executor already announces each of its host-store writes before anyone
reads them. A task writes its regions, then marks itself done; a reader on another device waits for
that flag (gradient sums, the buffer chain); whatever is read in a later iteration is ordered by the
collective that ends every iteration. So each node replicates write-through:

- ``task_writes`` derives from the plan which regions of the store (and which flag entries) each
  task writes; exactly what the executor writes (``PackState.write_buffers``, ``PackState.deposit``, ``Updates._write_state``,
  ``host_update``).
- ``ReplicatedShared`` is ``Shared`` whose ``mark_done`` and ``mark_read`` also hand the task's
  regions, as they are now, and then the flag to a ``Replicator``. A sender thread per process
  pushes them, in order, to one FIFO queue per receiving node in the rendezvous store (msgpack);
  one applier thread per node (in its lowest rank) writes them into the node's replica in that
  order, the flag last, so a flag seen on any node is never ahead of its data.
- ``Replicator.flush`` (before the collective that ends an iteration) waits until every other node
  applied everything this process sent: no iteration reads a stale weight.
- A failure is published once, with its rank and cause, under one store key and as a message to
  every node (``fail``); ``PeerWatch`` notices a node whose process ended without a word (a TCP
  connection between node leaders closes with the process). Either sets every node's abort flag,
  so every worker stops waiting within moments.

Transitivity is what two nodes get for free: with three or more, a reader that depends on a region
only through another node's flag (not the writer's own) could see it late; the plans' readers wait
for the writers themselves (gradient sources, the previous buffer writer).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import msgpack
import numpy as np

from harmony.decomposer.layer_graph import LayerGraph
from harmony.runtime.channels import Aborted
from harmony.runtime.flags import Shared
from harmony.runtime.hoststore import HostStore
from harmony.scheduler import memory
from harmony.scheduler.lower import Program
from harmony.scheduler.tasks import HOST, Kind, Task, TaskGraph

log = logging.getLogger(__name__)

ABORT_KEY = "harmony/abort"
IDLE_LIMIT = timedelta(days=7)  # an applier may wait this long for the next message


@dataclass
class Writes:
    """What one task writes in the host store: byte spans of the buffer and flag entries."""

    spans: list[tuple[int, int]]  # (offset, nbytes), adjacent spans merged
    flags: list[int]  # indices into HostStore.flags


def task_writes(task: Task, program: Program, graph: TaskGraph, layers: LayerGraph, store: HostStore) -> Writes:
    """The regions ``task`` writes, as the executor writes them: buffers (a forward or loss task with
    B outputs), its device's gradient slots and their stamps (deposits), and weights, optimizer
    state (and a host update's low-precision copies of them) and state-initialized flags of the
    parameters it steps (jit-update, the writing replica of an update, a host update); a NORM task
    (``clipping.host_norm``) every slot and stamp of every gradient, since which slot holds the sum
    is known only at run time."""
    layout = store.layout
    keys: list[str] = []
    flags: list[int] = []
    index = {name: i for i, name in enumerate(layout.params)}
    kept = memory.is_kept(task)  # its state stays on the device: written back only by ``kept_writes``
    writes_buffers = task.kind == Kind.FWD or (task.kind == Kind.BWD and task.loss)
    if writes_buffers and not kept and any(t.tensor == "B" for t in task.outputs):
        keys += _buffer_keys(task, layers)
    if task.kind == Kind.NORM:  # sums each gradient's slots into the first written, clips it, unstamps the rest
        for name in program.owner:
            for device in range(layout.devices):
                if f"G/{device}/{name}" in layout.entries:
                    keys.append(f"G/{device}/{name}")
                    flags.append(_stamp_index(layout.params, index, device, name))
    for name in program.deposits.get(task.id, []):
        if f"G/{task.device}/{name}" in layout.entries:
            keys.append(f"G/{task.device}/{name}")
            flags.append(_stamp_index(layout.params, index, task.device, name))
    if _steps_master(task, program, graph) and not kept:
        stepped = program.updates.get(task.id, [])
        keys += _master_keys(stepped, layout)
        flags += [index[name] for name in stepped]
    return _writes(keys, flags, layout)


def kept_writes(rank: int, program: Program, graph: TaskGraph, layers: LayerGraph, store: HostStore) -> Writes:
    """The regions ``Executor.sync_kept`` writes on device ``rank``: the buffers, and the weights and
    optimizer state its tasks step, of every pack it keeps (``scheduler/keep.py``)."""
    layout = store.layout
    index = {name: i for i, name in enumerate(layout.params)}
    keys: list[str] = []
    flags: list[int] = []
    for task in graph.tasks:
        if task.device != rank or not memory.is_kept(task):
            continue
        keys += _buffer_keys(task, layers)
    stepped = program.kept_writes(graph, rank)
    keys += _master_keys(stepped, layout)
    flags += [index[name] for name in stepped]
    return _writes(list(dict.fromkeys(keys)), sorted(set(flags)), layout)


def _buffer_keys(task: Task, layers: LayerGraph) -> list[str]:
    """The host-store entries of the buffers of the task's layers."""
    return list(dict.fromkeys(f"B/{name}" for layer in range(task.first, task.last + 1)
                              for name in layers.layers[layer].state if layers.state[name].kind != "parameter"))


def _master_keys(names: list[str], layout) -> list[str]:
    """The host-store entries of the weights ``names``: masters, low-precision copies, optimizer state."""
    keys: list[str] = []
    for name in names:
        keys.append(f"W/{name}")
        keys += [f"L/{name}"] if f"L/{name}" in layout.entries else []
        keys += [f"K/{name}/{key}" for key in layout.state_keys.get(name, [])]
    return keys


def _writes(keys: list[str], flags: list[int], layout) -> Writes:
    spans = sorted((layout.entries[k].offset, layout.entries[k].nbytes) for k in keys if layout.entries[k].nbytes)
    return Writes(spans=_merge(spans), flags=flags)


def _steps_master(task: Task, program: Program, graph: TaskGraph) -> bool:
    """Whether the task writes the master weights and state of what it updates (a replica of a
    replicated update other than the lowest device's writes a scratch copy)."""
    if task.jit_update() or (task.kind == Kind.UPD and task.device == HOST):
        return True
    if task.kind != Kind.UPD:
        return False
    replicas = program.replicas.get(task.id, [task.id])
    device = {t.id: t.device for t in graph.tasks}
    return task.id == min(replicas, key=lambda t: device[t])


def _stamp_index(params: list[str], index: dict[str, int], device: int, name: str) -> int:
    """Where HostStore keeps the stamp of G/<device>/<name>: its flags are P state-initialized
    entries, then P stamps per device (``HostStore._stamp_index``; a test checks they agree)."""
    return len(params) * (1 + device) + index[name]


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for offset, n in spans:
        if out and out[-1][0] + out[-1][1] >= offset:
            start, size = out[-1]
            out[-1] = (start, max(size, offset + n - start))
        else:
            out.append((offset, n))
    return out


class ReplicatedShared(Shared):
    """``Shared`` whose announcements reach every node: done and read flags travel, after the
    regions the task wrote, through the attached ``Replicator``."""

    replicator: "Replicator | None" = None

    def attach(self, replicator: "Replicator") -> None:
        self.replicator = replicator

    def mark_done(self, task: int, iteration: int, at: float | None = None) -> None:
        super().mark_done(task, iteration, at)
        if self.replicator is not None:
            self.replicator.done(task, iteration)

    def mark_read(self, task: int, iteration: int, at: float | None = None) -> None:
        super().mark_read(task, iteration, at)
        if self.replicator is not None:
            self.replicator.read(task, iteration)

    def set_abort(self) -> None:
        super().set_abort()
        if self.replicator is not None:
            self.replicator.fail(f"rank {self.replicator.rank} stopped")


class Replicator:
    """Ships this process's host-store writes and flags to the other nodes and, in a node's lowest
    rank, applies the other nodes' to this node's replica; see the module docs."""

    def __init__(self, store: Any, rank: int, node: int, nodes: list[list[int]], host: HostStore,
                 shared: ReplicatedShared, writes: dict[int, Writes], timeout: float) -> None:
        self.rank = rank
        self.node = node
        self.others = [n for n in range(len(nodes)) if n != node]
        self.store = store
        self.host = host
        self.shared = shared
        self.writes = writes
        self.timeout = timeout
        self._buffer = host.buffer.numpy()
        self._flags = host.flags.numpy()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._queued = 0
        self._pushed = 0
        self._error: BaseException | None = None
        self._reason: str | None = None  # the first failure reported: by this process or in a message
        self._lost: str | None = None  # a node that ended without a report (PeerWatch)
        self._closing = False
        self._sender = threading.Thread(target=self._send_loop, args=(store.clone(),), name="harmony-repl-send",
                                        daemon=True)
        self._sender.start()
        self._applier: threading.Thread | None = None
        if rank == min(nodes[node]):
            self._applier = threading.Thread(target=self._apply_loop, args=(store.clone(),), name="harmony-repl-apply",
                                             daemon=True)
            self._applier.start()

    # ------------------------------------------------------------ sending
    def done(self, task: int, iteration: int) -> None:
        """Task ``task`` finished: its regions as they are now, then its flag, to every other node,
        with whether the iteration's step is skipped (an fp16 overflow the NORM task found; it is
        set before that task's flag)."""
        w = self.writes.get(task)
        spans = [[o, self._buffer[o:o + n].tobytes()] for o, n in w.spans] if w else []
        flags = [[i, int(self._flags[i])] for i in w.flags] if w else []
        skipped = Shared.step_skipped(self.shared, iteration)
        self._queue(["done", self.rank, task, iteration, spans, flags, skipped])

    def read(self, task: int, iteration: int) -> None:
        self._queue(["read", self.rank, task, iteration])

    def synced(self, writes: Writes) -> None:
        """This rank wrote its kept state back (``kept_writes``): those regions, as they are now, to
        every other node (``flush`` waits until they are applied)."""
        spans = [[o, self._buffer[o:o + n].tobytes()] for o, n in writes.spans]
        self._queue(["sync", self.rank, spans, [[i, int(self._flags[i])] for i in writes.flags]])

    def _queue(self, message: list) -> None:
        with self._cond:
            self._queued += 1
        self._outbox.put(message)

    def _send_loop(self, store: Any) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                data = msgpack.packb(message, use_bin_type=True)
                for node in self.others:
                    store.queue_push(_queue_key(node), data)
            except Exception as exc:  # noqa: BLE001 - the store is gone: handed to flush and the abort flag
                self._error = exc
                self._set_reason(f"rank {self.rank} lost the rendezvous store ({exc}); is node 0 still running?")
                Shared.set_abort(self.shared)
            with self._cond:
                self._pushed += 1
                self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every other node applied every message this process sent (the end of an
        iteration: the next one must not read a stale weight, buffer or flag)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while self._pushed < self._queued:
                self._check(deadline, "to send its host-store writes to the other nodes")
                self._cond.wait(0.05)
            target = self._pushed
        pause = 0.0002
        for node in self.others:
            while int(self.store.add(_ack_key(self.rank, node), 0)) < target:
                self._check(deadline, f"node {node} to apply its host-store writes")
                time.sleep(pause)
                pause = min(pause * 2, 0.005)

    def _check(self, deadline: float, what: str) -> None:
        if self._error is not None or self.shared.aborted():
            raise Aborted(self.reason() or "the run was aborted by another worker's failure")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {self.rank} waited {self.timeout:.0f} s for {what}")

    # ------------------------------------------------------------ failures
    def fail(self, reason: str) -> None:
        """Stop every node: the local abort flag, the reason under one key (the first failure's
        wins) and an abort message to every other node's applier."""
        first = self._set_reason(reason)
        Shared.set_abort(self.shared)
        if not first:
            return
        try:
            self.store.compare_set(ABORT_KEY, "", reason)
            data = msgpack.packb(["abort", self.rank, reason], use_bin_type=True)
            for node in self.others:
                self.store.queue_push(_queue_key(node), data)
        except Exception as exc:  # noqa: BLE001 - the store may be gone with the node that hosted it
            log.warning("rank %d could not publish its failure: %s", self.rank, exc)

    def lost(self, peer: int, cause: str) -> None:
        """``PeerWatch``: another node's process ended without finishing. Its own report, if it
        made one, arrives through the store and is preferred (``reason``)."""
        log.info("rank %d: the connection to rank %d failed: %s", self.rank, peer, cause)
        self._lost = self._lost or (f"rank {peer} ended without finishing the run and without reporting an error "
                                    "(its process died or was killed; see that node's output)")
        Shared.set_abort(self.shared)

    def _set_reason(self, reason: str) -> bool:
        with self._cond:
            if self._reason is not None:
                return False
            self._reason = reason
            return True

    def reason(self, wait: float = 0.0) -> str | None:
        """Why the run stopped: the first failure published in the store (any node's), else what
        this process learned; waits up to ``wait`` seconds for one to arrive."""
        deadline = time.monotonic() + wait
        while True:
            try:
                if self.store.check([ABORT_KEY]):
                    published = self.store.get(ABORT_KEY).decode()
                    if published:
                        return published
            except Exception:  # noqa: BLE001 - the store may be gone; fall back to what we know
                pass
            if self._reason is not None or time.monotonic() >= deadline:
                return self._reason or self._lost
            time.sleep(0.05)

    # ------------------------------------------------------------ applying
    def _apply_loop(self, store: Any) -> None:
        store.set_timeout(IDLE_LIMIT)  # waiting for the next message is not a stall: stalls are timed elsewhere
        key = _queue_key(self.node)
        while True:
            try:
                message = msgpack.unpackb(store.queue_pop(key), raw=False)
                if message[0] == "stop":
                    return
                self._apply(message)
            except Exception as exc:  # noqa: BLE001 - the store is gone (its node stopped), or a bad message
                if not self._closing and not self.shared.aborted():
                    self._set_reason(f"node {self.node} could not apply the other nodes' writes ({exc}); "
                                     "did node 0 stop?")
                    Shared.set_abort(self.shared)
                return
            if message[0] in ("done", "read", "sync"):
                try:
                    store.add(_ack_key(message[1], self.node), 1)
                except Exception:  # noqa: BLE001 - reported by the next pop
                    pass

    def _apply(self, message: list) -> None:
        kind = message[0]
        if kind == "done":
            _, _, task, iteration, spans, flags, skipped = message
            for offset, data in spans:
                self._buffer[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            for i, value in flags:
                self._flags[i] = value
            if skipped:
                Shared.skip_step(self.shared, iteration)
            Shared.mark_done(self.shared, task, iteration)
        elif kind == "read":
            Shared.mark_read(self.shared, message[2], message[3])
        elif kind == "sync":
            _, _, spans, flags = message
            for offset, data in spans:
                self._buffer[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            for i, value in flags:
                self._flags[i] = value
        elif kind == "abort":
            self._set_reason(message[2])
            Shared.set_abort(self.shared)

    def close(self) -> None:
        """Stop the threads: after the last flush and collective (nothing is in flight), or after a
        failure (a thread left inside a store call when the process exits aborts the exit)."""
        self._closing = True
        self._outbox.put(None)
        self._sender.join(timeout=10)
        if self._applier is not None:
            try:
                self.store.queue_push(_queue_key(self.node), msgpack.packb(["stop"]))
            except Exception as exc:  # noqa: BLE001 - the store is gone, and the applier's wait on it with it
                log.debug("rank %d could not stop its applier: %s", self.rank, exc)
                return
            self._applier.join(timeout=10)


def _queue_key(node: int) -> str:
    return f"harmony/repl/to/{node}"


def _ack_key(src: int, node: int) -> str:
    return f"harmony/repl/ack/{src}/{node}"


class PeerWatch:
    """Notices the moment another node's process ends: each pair of node leaders holds a plain TCP
    connection, which the kernel closes when a process ends however abruptly (killed, crashed), so
    the other side's blocked read returns at once. A clean end sends one byte first.

    Plain sockets rather than a pending gloo receive: a process group destroyed with a receive
    still pending aborts the process at exit, which every failure path would hit."""

    BYE = b"\x01"

    def __init__(self, store: Any, rank: int, peers: list[int], on_lost: Callable[[int, str], None],
                 timeout: float) -> None:
        self.rank = rank
        self._on_lost = on_lost
        self._closing = False
        self._sockets: dict[int, socket.socket] = {}
        with socket.create_server((_reachable_address(), 0)) as server:
            host, port = server.getsockname()[:2]
            store.set(f"harmony/watch/{rank}", f"{host}:{port}")
            for peer in [p for p in peers if p < rank]:  # the higher rank of a pair connects
                address, _, port_text = store.get(f"harmony/watch/{peer}").decode().rpartition(":")
                conn = socket.create_connection((address, int(port_text)), timeout=timeout)
                conn.sendall(rank.to_bytes(4, "little"))
                self._sockets[peer] = conn
            server.settimeout(timeout)
            for _ in [p for p in peers if p > rank]:
                conn, _ = server.accept()
                conn.settimeout(timeout)
                self._sockets[int.from_bytes(_read_exactly(conn, 4), "little")] = conn
        self._threads = []
        for peer, conn in self._sockets.items():
            conn.settimeout(None)
            thread = threading.Thread(target=self._watch, args=(peer, conn), name=f"harmony-watch-{peer}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _watch(self, peer: int, conn: socket.socket) -> None:
        try:
            said = conn.recv(1)
            cause = "its connection closed"
        except OSError as exc:
            said, cause = b"", str(exc)
        if said != self.BYE and not self._closing:
            self._on_lost(peer, cause)

    def close(self) -> None:
        """A clean end: say goodbye to every peer and wait for theirs."""
        for peer, conn in self._sockets.items():
            try:
                conn.sendall(self.BYE)
            except OSError as exc:
                log.warning("rank %d ended before the run's last handshake: %s", peer, exc)
        for thread in self._threads:
            thread.join(timeout=10)
        self._closing = True
        for conn in self._sockets.values():
            conn.close()


def _reachable_address() -> str:
    """This host's address on the interface that reaches the rendezvous host (what the other nodes
    can connect to); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))))
        return probe.getsockname()[0]


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("a peer closed its watch connection while introducing itself")
        data += chunk
    return data
