"""Channels (§4.3.2): how tensors travel between host memory, devices and worker processes, and
how many bytes each moved.

- SWAP: host memory <-> device memory (the master state in the host store, stashes, activations
  parked in host memory, the minibatch).
- P2P: device -> device, by one of two transports behind the executor's send and receive. Through
  shared memory (the default on emulated CPU devices): the sender copies into a shared-memory slab
  (``Slabs``) and hands its place to the receiver's inbox (``Inbox``, a pipe); the
  receiver copies it into its device memory. Over torch.distributed (``p2p.py``; the default on
  GPUs): NCCL between GPUs, gloo between emulated devices, straight into the receiver's device
  memory, with only a small header through the inbox.
- MSG: host -> host between worker processes (activations parked in one worker's host memory and
  read by another worker), through the same inboxes.
- SHM: shared host memory read in place (the master state, gradient slots): no copy, no bytes.
- LOCAL: stays resident on the device.

``Counters`` keep bytes per channel and direction, the way ``TaskGraph.bytes_by_channel`` plans
them, so a run can be checked byte for byte against its plan. ``Mailbox`` is a worker's inbox:
a thread drains the queue into a table that the executor waits on by key.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Hashable

import torch

from harmony.decomposer.layer_graph import dtype_from_str
from harmony.runtime.hostroom import check_room, shared_zeros

log = logging.getLogger(__name__)


class Counters:
    """Bytes moved, by ``"<CHANNEL> in|out"`` and, for diagnosis, by tensor kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_channel: Counter[str] = Counter()
        self.by_tensor: Counter[str] = Counter()

    def add(self, channel: str, direction: str, tensor: str, nbytes: int) -> None:
        with self._lock:
            self.by_channel[f"{channel} {direction}"] += nbytes
            self.by_tensor[f"{tensor} {channel} {direction}"] += nbytes

    def reset(self) -> None:
        with self._lock:
            self.by_channel.clear()
            self.by_tensor.clear()

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.by_channel), dict(self.by_tensor)


def tensor_bytes(values: Any) -> int:
    """Bytes of the tensors among ``values`` (a tensor, or a sequence with tensors and objects)."""
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under ``tensors``: what they hold in memory, views and
    aliases of one storage counted once."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def shared_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in a fresh shared-memory segment: one copy, and the queue then passes only
    its handle to the other process."""
    out = torch.empty(t.shape, dtype=t.dtype).share_memory_()
    out.copy_(t)
    return out


class Aborted(RuntimeError):
    """Another worker failed; this one stops waiting."""


def wait_until(ready: Callable[[], bool], aborted: Callable[[], bool], timeout: float,
               what: str | Callable[[], str], pause: float = 0.0005,
               nap: Callable[[], object] | None = None) -> None:
    """Poll ``ready`` (a flag in shared memory another process sets) until it holds, sleeping
    ``pause`` seconds between looks (or ``nap()``: a sleep someone may cut short, ``flags.py``'s
    bell). Every wait of a worker goes through here, so that each one ends when another worker
    fails (``Aborted``) or after ``timeout`` seconds (``TimeoutError`` naming ``what``, called then
    if a function: what is still missing is known only at the end), never in a hang."""
    deadline = time.monotonic() + timeout
    while not ready():
        if aborted():
            raise Aborted("the run was aborted by another worker's failure")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what() if callable(what) else what}")
        if nap is None:
            time.sleep(pause)
        else:
            nap()


class Inbox:
    """A worker's inbox: one pipe that every process writes whole pickled messages into, under a
    shared lock, and one thread of the worker reads (``Mailbox``).

    Not a ``multiprocessing.Queue``: its ``put`` hands the message to a feeder thread that pickles
    and writes it, one more thread hand-off on a message's way from the sender's stream to the
    receiver's compute thread. On two cores, with both workers computing, each hand-off waits for a
    core and the interpreter lock. Messages are
    small (a slab's offsets, shared-memory handles): a writer never waits long on the pipe. They
    are pickled as ``multiprocessing`` pickles them, so tensors travel as shared memory
    (``torch.multiprocessing``'s reductions)."""

    def __init__(self, context: Any) -> None:
        self._reader, self._writer = context.Pipe(duplex=False)
        self._lock = context.Lock()

    def put(self, item: Any) -> None:
        data = ForkingPickler.dumps(item)
        with self._lock:
            self._writer.send_bytes(data)

    def get(self, timeout: float) -> Any:
        """The next message; ``queue.Empty`` after ``timeout`` seconds without one."""
        if not self._reader.poll(timeout):
            raise queue.Empty
        return ForkingPickler.loads(self._reader.recv_bytes())

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


class Mailbox:
    """Messages for this worker, by key; filled by a thread that drains its ``Inbox``."""

    def __init__(self, inbox: Any, aborted: Callable[[], bool]) -> None:
        self._inbox = inbox
        self._aborted = aborted
        self._items: dict[Hashable, Any] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._drain, name="harmony-inbox", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop:
            try:
                item = self._inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            if item is None:
                return
            key, payload = item
            with self._cond:
                self._items[key] = payload
                self._cond.notify_all()

    def put_local(self, key: Hashable, payload: Any) -> None:
        with self._cond:
            self._items[key] = payload
            self._cond.notify_all()

    def take(self, key: Hashable, what: str, timeout: float) -> Any:
        """The message under ``key``, waiting for it; raises ``Aborted`` if the run was aborted and
        ``TimeoutError`` naming ``what`` if nothing came for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                if self._aborted():
                    raise Aborted("the run was aborted by another worker's failure")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"waited {timeout:.0f} s for {what}; its sender never sent it")
                self._cond.wait(min(left, 0.2))
            return self._items.pop(key)

    def pending(self) -> int:
        with self._cond:
            return len(self._items)

    def close(self) -> None:
        self._stop = True
        try:
            self._inbox.put(None)
        except (ValueError, OSError, AssertionError):
            pass
        self._thread.join(timeout=2)


_ALIGN = 64


class Slabs:
    """Shared-memory regions, one per (sender, receiver) pair of workers, that carry the tensors of
    the messages between them.

    Made once, before the workers start, and sized from the plan's bytes per iteration on that pair
    (with room to spare), so a message is a copy into the slab plus a few numbers through the queue:
    no shared-memory segment to create and no file descriptor to hand over per message. A sender
    fills its slab from the start every iteration; the launcher starts an iteration only once every
    worker finished the last one, so every message of the last one was read. A message that does not
    fit (the plan's sizes are interpolated) travels in a segment of its own.
    """

    def __init__(self, sizes: dict[tuple[int, int], int], prefix: str | None = None, create: bool = True,
                 spill: Callable[[torch.Tensor], torch.Tensor] = shared_copy) -> None:
        """``prefix``: the slabs are the files ``<prefix>-slab-<src>-<dst>`` (torchrun's workers,
        which are not forked from one parent, map them by name). ``spill``: what a tensor without
        room in a slab (or without a slab: a pair on two hosts) travels as; a shared-memory copy
        by default, the tensor itself where the message is serialized at once (torchrun)."""
        def make(pair: tuple[int, int], n: int) -> torch.Tensor:
            size = max(int(n), _ALIGN)
            if prefix is None:
                return shared_zeros(size)
            return torch.from_file(f"{prefix}-slab-{pair[0]}-{pair[1]}", shared=True, size=size, dtype=torch.uint8)

        if create:
            check_room(sum(max(int(n), _ALIGN) for n in sizes.values() if n > 0),
                       f"the message slabs between {len([n for n in sizes.values() if n > 0])} pairs of devices")
        self.buffers = {pair: make(pair, n) for pair, n in sizes.items() if n > 0}
        self.spill = spill
        self._used: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"buffers": self.buffers}  # (spawned workers) each process keeps its own counts

    def __setstate__(self, state: dict) -> None:
        self.buffers = state["buffers"]
        self.spill = shared_copy
        self._used = {}
        self._lock = threading.Lock()

    def reset(self) -> None:
        """A new iteration: the sender's slabs are free again."""
        with self._lock:
            self._used.clear()

    def _claim(self, pair: tuple[int, int], nbytes: int) -> int | None:
        buffer = self.buffers.get(pair)
        if buffer is None:
            return None
        with self._lock:
            offset = self._used.get(pair, 0)
            end = offset + -(-nbytes // _ALIGN) * _ALIGN
            if end > buffer.numel():
                return None
            self._used[pair] = end
            return offset

    def encode(self, values: list, src: int, dst: int) -> list:
        """The message items for ``values``: tensors copied into the slab of (src, dst)."""
        items = []
        for v in values:
            if not isinstance(v, torch.Tensor):
                items.append(("obj", v))
                continue
            nbytes = v.numel() * v.element_size()
            offset = self._claim((src, dst), nbytes)
            if offset is None:
                items.append(("tensor", self.spill(v)))
                continue
            view = self.buffers[(src, dst)][offset:offset + nbytes].view(v.dtype).view(v.shape)
            with torch.no_grad():
                view.copy_(v.detach())
            items.append(("slab", offset, list(v.shape), str(v.dtype)))
        return items

    def decode(self, items: list, src: int, dst: int) -> list:
        """Host tensors (views of the slab; copy them out before the next iteration) and objects."""
        out = []
        for item in items:
            if item[0] == "slab":
                _, offset, shape, name = item
                dtype = dtype_from_str(name)
                n = dtype.itemsize
                for s in shape:
                    n *= s
                out.append(self.buffers[(src, dst)][offset:offset + n].view(dtype).view(shape))
            else:
                out.append(item[1])
        return out


def state_bytes(state: torch.Tensor | None) -> bytes | None:
    """A generator state as bytes, for a message."""
    return None if state is None else state.numpy().tobytes()


def state_tensor(data: bytes | None) -> torch.Tensor | None:
    return None if data is None else torch.frombuffer(bytearray(data), dtype=torch.uint8)
