"""P2P over torch.distributed: device -> device messages as ``send``/``recv`` between workers,
NCCL on GPUs and gloo on emulated CPU devices (the same code; only the backend differs).

The shared-memory transport (``channels.Slabs``) bounces every activation and gradient through
host memory; this one moves device tensors directly. A message is split in two:

- a small **header** (the message's key, each value's shape and dtype or the value itself when it
  is not a tensor, the random-generator state) that travels through the receiver's inbox like any
  other message, so the inboxes' abort and timeout handling (``Mailbox``, ``spmd.StoreMailbox``)
  serve it too. Headers from one sender to one receiver are numbered, and the receiver takes them
  in that order;
- the tensors, each a ``dist.send`` on the process group of that ordered (sender, receiver) pair.

One process group per *ordered* pair: NCCL runs a communicator's operations in order on one
stream, so a receive posted before a send on one two-rank communicator, on both sides, would wait
for each other forever; a communicator per direction is a plain FIFO from sender to receiver.
Every rank creates the groups in the same order (``pair_groups``), for the pairs the task graph
sends P2P messages between (``p2p_pairs``: every worker holds the same graph).

The sender is the executor's p2p-out stream (one thread: per pair, the send order is the order the
executor sends in). The receiver runs one thread per sender that takes that sender's headers in
order, allocates the receive buffers on its device (through the executor, which counts them in the
device's memory and waits while memory is short, as a prefetch does), receives into them and hands
the device tensors to the mailbox under the message's key. The executor counts their bytes when
the consumer takes them (``P2P in``, as for shared memory), so a run's bytes per channel are the
plan's whichever transport carried them.

On CUDA each receiving thread has a stream of its own; a received message is complete (its stream
synchronized) before it is handed over, and its consumer records its own streams on the tensors
(``DeviceContext.adopt``) so that their memory is not reused while it reads them. NCCL keeps a sent
tensor alive until the send completed, and the p2p-out stream is synchronized at the end of each
job, so a task is marked done only once its messages have arrived.

A failure (a peer that died, a timeout of the process group, a receive buffer that never fits)
stops the run like any worker failure: the transport records it and raises the shared abort flag;
the worker then reports the transport's error as its own. A peer's death is left to the launcher
to report (it names the dead worker) when it notices it within two seconds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist

from harmony.decomposer.layer_graph import dtype_from_str
from harmony.errors import HarmonyError
from harmony.runtime.channels import Aborted, state_bytes, state_tensor
from harmony.runtime.device import SHARE_GPUS, Device, gpus_shared
from harmony.scheduler.tasks import HOST, Channel, TaskGraph

log = logging.getLogger(__name__)

CHOICES = ("auto", "shm", "dist")
PEER_GONE_GRACE = 2.0  # seconds a transport waits for the launcher to report a dead peer itself


def resolve(p2p: str, device_type: str, devices: int = 1) -> str:
    """The transport for ``p2p`` ("auto", "shm" or "dist") on ``devices`` devices of
    ``device_type``: "auto" is torch.distributed on GPUs (NCCL; shared memory would bounce through
    the host) and shared memory on emulated CPU devices (a copy between two regions of host memory,
    no sockets: gloo over loopback makes each iteration of small models longer), and on workers
    sharing GPUs (NCCL refuses two ranks on one GPU)."""
    if p2p not in CHOICES:
        raise HarmonyError(f"unknown p2p transport {p2p!r}; choose one of {', '.join(CHOICES)}")
    shared = device_type == "cuda" and gpus_shared(devices)
    if p2p == "dist" and shared:
        raise HarmonyError(f"{devices} workers share fewer GPUs ({SHARE_GPUS}), which NCCL cannot link; use --p2p shm")
    if p2p == "auto":
        return "dist" if device_type == "cuda" and not shared else "shm"
    return p2p


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def p2p_pairs(tasks: TaskGraph) -> list[tuple[int, int]]:
    """The ordered (sender, receiver) pairs of devices that exchange P2P messages, sorted: every
    worker derives the same list from the same task graph."""
    device = {t.id: t.device for t in tasks.tasks}
    pairs = set()
    for task in tasks.tasks:
        for t in task.inputs:
            if t.channel != Channel.P2P or t.task is None:
                continue
            src = device[t.task]
            if src != task.device and HOST not in (src, task.device):
                pairs.add((src, task.device))
    return sorted(pairs)


def pair_groups(pairs: list[tuple[int, int]], backend: str, timeout: float) -> dict[tuple[int, int], Any]:
    """One process group per ordered pair, created by every rank in the same order (``new_group``
    is collective over the default group); a rank keeps the groups it belongs to. ``timeout``:
    how long a send or receive may take (gloo raises, NCCL's watchdog aborts) before the run fails."""
    groups = {}
    for src, dst in pairs:
        group = dist.new_group([src, dst], backend=backend, timeout=timedelta(seconds=timeout))
        if dist.get_rank() in (src, dst):
            groups[(src, dst)] = group
    return groups


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo``, ``lo0``), for gloo between the workers of one host:
    gloo otherwise binds to the address the host name resolves to, which may not be reachable."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def start_default_group(timeout: float, **rendezvous: Any) -> None:
    """Start this process's default process group (gloo) with ``init_process_group(**rendezvous)``,
    after importing ``torch.distributed.nn``: its functions take ``group=group.WORLD`` as a default
    argument, so importing it once the group exists (torch._dynamo does, and loading a plan imports
    torch._dynamo) keeps the group alive past ``destroy_process_group``. The group's gloo threads
    then drop tensors while the interpreter shuts down, and the process aborts at exit ("terminate
    called without an active exception", SIGABRT), about one run in fifty under load."""
    import torch.distributed.nn  # noqa: F401  (before the group exists; see above)

    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout), **rendezvous)


def init_local(rank: int, world: int, path: str, device_type: str, pairs: list[tuple[int, int]],
               timeout: float) -> dict[tuple[int, int], Any]:
    """In a worker of the launcher (all on one host): meet the others at the ``FileStore`` at
    ``path``, start the default process group (gloo over loopback, used only to create the others)
    and the pair groups."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        name = loopback_interface()
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    wait = timedelta(seconds=timeout)
    store = dist.FileStore(path, world)
    store.set_timeout(wait)
    start_default_group(timeout, store=store, rank=rank, world_size=world)
    return pair_groups(pairs, backend_for(device_type), timeout)


def header_key(src: int, seq: int) -> tuple:
    """The inbox key of the ``seq``-th header from ``src`` (never a message key: those start with
    the iteration, a number)."""
    return ("p2p", src, seq)


@dataclass
class Received:
    """A message received into device memory, in the mailbox under its key."""

    values: list
    state: torch.Tensor | None


Allocate = Callable[[int, list[tuple[list[int], torch.dtype]]], list[torch.Tensor]]


class DistTransport:
    """One worker's end of P2P over torch.distributed; see the module docs."""

    def __init__(self, rank: int, device: Device, groups: dict[tuple[int, int], Any], peers: list[Any],
                 mailbox: Any, aborted: Callable[[], bool], abort: Callable[[], None], idle_poll: float = 0.0) -> None:
        """``peers``: per rank, the ``put`` end of its inbox; ``idle_poll``: 0 where the mailbox
        wakes a waiting ``take`` when a message arrives (``Mailbox``), else the longest pause between
        two looks for the next header of an idle sender (``StoreMailbox`` polls a store)."""
        self.rank = rank
        self.device = device
        self.groups = groups
        self.peers = peers
        self.mailbox = mailbox
        self.aborted = aborted
        self.abort = abort
        self.idle_poll = idle_poll
        self.sources = sorted(src for src, dst in groups if dst == rank)
        self._sent: dict[int, int] = {}  # per receiver: headers sent so far
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failure: BaseException | None = None
        self.failure_traceback = ""

    def start(self, allocate: Allocate, setup: Callable[[], None] = lambda: None) -> None:
        """Start receiving: ``allocate(src, [(shape, dtype), ...])`` gives the receive buffers on
        the device; ``setup`` runs first on each receiving thread (threads, CUDA stream)."""
        for src in self.sources:
            thread = threading.Thread(target=self._receive_from, args=(src, allocate, setup),
                                      name=f"harmony-p2p-recv-{src}", daemon=True)
            thread.start()
            self._threads.append(thread)

    # ------------------------------------------------------------ sending
    def send(self, key: Hashable, values: list, state: torch.Tensor | None, dst: int) -> None:
        """Send one message to ``dst``: its header through the inbox, then its tensors (run on the
        p2p-out stream, after the compute that made them)."""
        seq = self._sent.get(dst, 0)
        self._sent[dst] = seq + 1
        items: list[tuple] = [("key", list(key))]
        tensors = []
        for v in values:
            if isinstance(v, torch.Tensor):
                t = v.detach()
                if t.device != self.device.torch_device:
                    t = t.to(self.device.torch_device)
                items.append(("dist", list(t.shape), str(t.dtype)))
                if t.numel():
                    tensors.append(t.contiguous())
            else:
                items.append(("obj", v))
        try:
            # as every message does, the header says when it was sent
            self.peers[dst].put((header_key(self.rank, seq), (items, state_bytes(state), self.rank,
                                                               self.device.work_done())))
            group = self.groups[(self.rank, dst)]
            for t in tensors:
                dist.send(t, dst=dst, group=group)
        except BaseException as exc:
            self._failed(exc, f"sending {key} to dev{dst}")
            raise

    # ------------------------------------------------------------ receiving
    def _receive_from(self, src: int, allocate: Allocate, setup: Callable[[], None]) -> None:
        """The receiving thread of one sender: its messages in the order it sent them."""
        try:
            setup()
            with self.device.memory_scope():
                seq = 0
                while True:
                    header = self._next_header(src, seq)
                    if header is None:
                        return
                    seq += 1
                    self._receive_one(src, header, allocate)
        except Aborted:
            return
        except BaseException as exc:  # recorded for the worker's report; the run stops
            self._failed(exc, f"receiving from dev{src}")

    def _next_header(self, src: int, seq: int) -> tuple | None:
        """The ``seq``-th header from ``src``, or None once the transport is closed."""
        key = header_key(src, seq)
        what = f"message {seq} from dev{src}"
        pause = 0.0005
        while not self._stop.is_set():
            try:
                return self.mailbox.take(key, what, 0.2 if not self.idle_poll else 0.0)
            except TimeoutError:
                if self.idle_poll:
                    time.sleep(pause)
                    pause = min(pause * 2, self.idle_poll)
        return None

    def _receive_one(self, src: int, header: tuple, allocate: Allocate) -> None:
        items, state, *_ = header  # (the sender and when it sent: the receiver's copy is dist.recv itself)
        key = tuple(items[0][1])
        specs = [(list(item[1]), dtype_from_str(item[2])) for item in items[1:] if item[0] == "dist"]
        buffers = iter(allocate(src, specs))
        group = self.groups[(src, self.rank)]
        values = []
        for item in items[1:]:
            if item[0] != "dist":
                values.append(item[1])
                continue
            buffer = next(buffers)
            if buffer.numel():
                dist.recv(buffer, src=src, group=group)
            values.append(buffer)
        self.device.stream_sync()  # (CUDA) the tensors are complete before anyone reads them
        self.mailbox.put_local(key, Received(values, state_tensor(state)))

    # ------------------------------------------------------------ failure and shutdown
    def _failed(self, exc: BaseException, doing: str) -> None:
        """Stop the run for a transport error, unless another worker's failure caused it (its own
        report says why) or a peer died (the launcher names it when it notices, within seconds)."""
        if isinstance(exc, Aborted) or self.aborted():
            return
        if peer_gone(exc):
            deadline = time.monotonic() + PEER_GONE_GRACE
            while time.monotonic() < deadline and not self._stop.is_set():
                if self.aborted():
                    return
                time.sleep(0.05)
        if self.failure is None:
            self.failure = exc
            self.failure_traceback = "".join(traceback.format_exception(exc))
            log.error("dev%d: p2p failed while %s: %s", self.rank, doing, exc)
        self.abort()

    def close(self) -> None:
        """Stop the receiving threads (each notices within 0.2 s unless it is inside a receive,
        which only a failed run leaves it in: the threads are daemons)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)

    @property
    def idle(self) -> bool:
        """Every receiving thread has stopped."""
        return not any(t.is_alive() for t in self._threads)


def peer_gone(exc: BaseException) -> bool:
    """A send or receive failed because the other process went away."""
    text = str(exc)
    return "Connection closed by peer" in text or "Connection reset by peer" in text


def shutdown() -> None:
    """Destroy this process's process groups (after the transport closed)."""
    if dist.is_initialized():
        dist.destroy_process_group()
