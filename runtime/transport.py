"""Transport: the activations and gradients the lowered program's edges move (``scheduler/lower.py``,
``Program.out_of`` and ``Program.into``): a forward's outputs (X) and stashes (Xs), a backward's
input gradients (dY), and the minibatch's inputs from host memory.

A producer cuts each microbatch into its edges' pieces (along the batch dims the decomposer
recorded) and routes each by its channel: LOCAL stays on the device; P2P goes through the
shared-memory slabs or a ``DistTransport`` (``p2p.py``); SWAP and MSG park in host memory. A
consumer takes the pieces of its microbatch, joins them (a copy the plan does not count, made only
where it fits: ``_joined``), and may prefetch the next microbatch's on the swap-in or p2p-in stream.
Every move is logged in program terms (``DeviceContext.moved``), and ``tests/runtime/test_program_agreement.py``
holds that log equal to the program. A P2P message received ahead of its consumer waits for room
like a prefetch (``p2p_buffers``), unless the compute thread waits on its sender.

One of the executor's parts (``executor.py``); copies into the device go through ``admission.py``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from concurrent.futures import Future
from typing import Any, Hashable, Iterator

import torch

from harmony.decomposer import batching
from harmony.runtime import rng
from harmony.runtime.admission import Admission, on_compute_thread
from harmony.runtime.channels import (Mailbox, Slabs, shared_copy, state_bytes, state_tensor, storage_bytes, tensor_bytes,
                                      wait_until)
from harmony.runtime.context import DeviceContext
from harmony.runtime.p2p import DistTransport, Received
from harmony.scheduler.lower import IN_STREAM, OUT_STREAM, Edge, ranges
from harmony.scheduler.tasks import Channel, Task

log = logging.getLogger(__name__)

Values = list  # a boundary: tensors and plain objects, in the layer graph's value order


class Transport:
    """Activations and gradients along the program's edges; see the module docs."""

    def __init__(self, ctx: DeviceContext, admission: Admission, mailbox: Mailbox, peers: list[Any],
                 slabs: Slabs | None, dist: DistTransport | None, prefetch: bool = True) -> None:
        self.ctx = ctx
        self.admission = admission
        self.mailbox = mailbox  # this worker's inbox
        self.peers = peers  # per device, its inbox
        self.slabs = slabs  # shared-memory P2P buffers; None: each message its own segments
        self.dist = dist  # P2P over torch.distributed; None: through shared memory
        self.prefetch = prefetch  # off: only a task's first microbatch's inputs are queued ahead
        self._batch_dims = self._batch_value_dims()
        self._awaited: dict[tuple[int, bool], int] = {}  # (sender, on the compute thread) -> P2P waits
        self._awaited_lock = threading.Lock()

    def _batch_value_dims(self) -> dict[int, list[int | None]]:
        """Per layer boundary, the dim along which each value holds its samples (None: passed
        whole), as the decomposer probed it, for cutting and joining microbatches."""
        return {spec.index: self.ctx.layers.input_batch_dims(spec.index) for spec in self.ctx.layers.layers}

    def _cut(self, values: Values, boundary: int, start: int, stop: int) -> Values:
        return batching.cut(list(values), self._batch_dims.get(boundary, []), start, stop)

    def _join(self, parts: list[Values], boundary: int) -> Values:
        return batching.join(parts, self._batch_dims.get(boundary, []))

    def _joined(self, parts: list[Values], boundary: int, owner: Hashable) -> Values:
        """A microbatch's pieces joined on the device. The join is a copy the plan does not count
        (it counts the microbatch's input once): while it is made, the pieces and their join are
        both live. Made ahead of need (a prefetch on an inbound stream), it waits for room like
        any copy made ahead, so that the moment both live never takes the device past its
        planned peak; the compute thread waiting for it makes it at once."""
        if len(parts) == 1:
            return parts[0]
        dims = self._batch_dims.get(boundary, [])
        nbytes = sum(tensor_bytes([p[i] for p in parts]) for i, d in enumerate(dims)
                     if d is not None and isinstance(parts[0][i], torch.Tensor))
        return self.admission.with_room(nbytes, lambda: self._join(parts, boundary), self.admission.compute_blocked,
                                        room=0, owner=owner)

    def _key(self, consumer: int, stream: str, start: int) -> tuple:
        return (self.ctx.iteration, consumer, stream, start)

    def send(self, task: Task, mb: int, edges: list[Edge], values: Values, state: torch.Tensor | None) -> None:
        """Hand microbatch ``mb`` of a boundary to the program's edges out of it, each cut to its
        piece of the consumer's microbatch."""
        mb_start, mb_size = ranges(task)[mb]
        if edges:
            self.ctx.ledger.hold(values, (task.id, mb))  # the unit's until it ends, then beside its successors
        for e in edges:
            part = values
            if (e.start, e.stop) != (mb_start, mb_start + mb_size):
                part = self._cut(values, e.layer, e.start - mb_start, e.stop - mb_start)
            key = self._key(e.consumer, e.stream, e.start)
            tensor = {"X": "Y", "dY": "dX", "As": "As"}.get(e.stream, "Xs")
            self._route(key, self.ctx.by_id[e.consumer], Channel(e.channel), part, state, tensor)

    def _route(self, key: tuple, consumer: Task, channel: Channel, values: Values, state, tensor: str) -> None:
        self.ctx.moved(OUT_STREAM[channel], "SEND", key[1:], tensor_bytes(values))
        if channel == Channel.LOCAL:
            self.ctx.local[key] = (values, state)
            return
        dst = consumer.device
        if channel == Channel.P2P:
            if self.dist is not None:
                self.ctx.after_compute(self.ctx.p2p_out, f"{tensor} to dev{dst}", self.dist.send, key, values, state, dst)
                return

            def send() -> None:
                self._to_peer(key, values, state, dst)

            if self.ctx.device.synchronous:  # nothing to order against: the compute thread's work is done
                self.ctx.p2p_out.run_here(send, f"{tensor} to dev{dst}", self.ctx.task)
            else:
                self.ctx.after_compute(self.ctx.p2p_out, f"{tensor} to dev{dst}", send)
            return
        # SWAP / MSG: park in host memory; a consumer in another worker reads it from there

        def park() -> None:
            self.ctx.counters.add(channel.value, "out", tensor, tensor_bytes(values))
            if dst == self.ctx.rank:
                host = [self.ctx.device.to_host(v) if isinstance(v, torch.Tensor) else v for v in values]
                self.mailbox.put_local(key, (host, state, self.ctx.device.work_done()))
            else:
                self._to_peer(key, values, state, dst)

        self.ctx.after_compute(self.ctx.swap_out, f"{tensor} out", park)

    def _to_peer(self, key: tuple, values: Values, state, dst: int) -> None:
        """A message into ``dst``'s inbox: its values encoded, the generator state, the sender and
        when it was sent (``Device.work_done``: the receiver's copy starts from then)."""
        self.peers[dst].put((key, (self._encode(values, dst), state_bytes(state), self.ctx.rank,
                                   self.ctx.device.work_done())))

    def _encode(self, values: Values, dst: int) -> list:
        with self.ctx.device.host_side():
            if self.slabs is None:
                return [("tensor", shared_copy(v)) if isinstance(v, torch.Tensor) else ("obj", v) for v in values]
            return self.slabs.encode(values, self.ctx.rank, dst)

    def _receive(self, key: tuple, what: str) -> tuple[Values, torch.Tensor | None, bool]:
        """A message from the inbox: its values, the state, and whether the tensors are on the
        device already (received by the ``DistTransport``) or in host memory (slab views or own
        segments)."""
        began = time.perf_counter()
        with self.ctx.waiting_for(what):
            message = self.mailbox.take(key, what, self.ctx.timeout)
        if on_compute_thread():  # not prefetched: the compute thread waited for it
            self.ctx.waits.append(("compute", self.ctx.task, f"wait: {what.split(' (')[0]}", began, time.perf_counter()))
        if isinstance(message, Received):
            self.ctx.device.ready(time.perf_counter())
            return message.values, message.state, True
        self.ctx.device.ready(message[-1])  # when it was sent (the sender's ``Device.work_done``)
        if len(message) == 3:  # parked by this worker for itself
            return *message[:2], False
        items, state, src, _ = message
        if self.slabs is None:
            return [item[1] for item in items], state_tensor(state), False
        return self.slabs.decode(items, src, self.ctx.rank), state_tensor(state), False

    def _fetch(self, task: Task, stream: str, mb: int) -> tuple[Values, torch.Tensor | None]:
        """Microbatch ``mb`` of an input stream on the device, with its generator state: the
        program's edges into it, joined."""
        edges = self.ctx.program.into(task.id, stream, mb)
        start, size = ranges(task)[mb]
        if not edges:
            raise RuntimeError(f"task {task.id} ({task}) has no input for {stream}; the plan is incomplete")
        if edges[0].producer is None:  # the minibatch, in host memory
            values = [slice_samples(v, start, size) for v in self.ctx.batch.inputs]
            self.ctx.moved("swap-in", "RECV", (task.id, stream, start), tensor_bytes(values))
            values = self.admission.values_to_device(values, "SWAP", "X", owner=(task.id, mb))
            seed = rng.microbatch_seed(self.ctx.batch.seed, self.ctx.iteration, start)
            return values, rng.seeded(self.ctx.device.torch_device, seed)
        parts, state = [], None
        for e in edges:
            key = self._key(task.id, stream, e.start)
            what = f"{stream} of task {task.id} (samples {e.start}-{e.stop}) from task {e.producer} on dev{e.src_device}"
            channel = Channel(e.channel)
            if channel == Channel.LOCAL:
                values, piece_state = self._take_local(key, what)
            else:
                label = "P2P" if channel == Channel.P2P else channel.value
                tensor = {"X": "X", "dY": "dY", "As": "As"}.get(stream, "Xs")
                dist = label == "P2P" and self.dist is not None
                with self._awaiting(e.src_device) if dist else contextlib.nullcontext():
                    host, piece_state, on_device = self._receive(key, what)
                if on_device:  # counted here, not on arrival: the counters restart every iteration
                    values = self.ctx.adopt(host)
                    self.ctx.counters.add(label, "in", tensor, tensor_bytes(host))
                else:
                    values = self.admission.values_to_device(host, label, tensor, owner=(task.id, mb))
                del host
            self.ctx.moved(IN_STREAM[channel], "RECV", key[1:], tensor_bytes(values))
            state = piece_state if state is None else state
            parts.append(values)
        values = self._joined(parts, edges[0].layer, (task.id, mb))
        self.ctx.ledger.hold(values, (task.id, mb))  # the unit's now, however it came (LOCAL, received)
        return values, state

    def _take_local(self, key: tuple, what: str) -> tuple[Values, torch.Tensor | None]:
        """A LOCAL piece (kept on the device by a task of this worker), once its producer left it."""
        if key not in self.ctx.local:
            with self.ctx.waiting_for(what):
                wait_until(lambda: key in self.ctx.local, self.ctx.shared.aborted, self.ctx.timeout,
                           f"{what} to become resident")
            self.ctx.device.ready(time.perf_counter())
        return self.ctx.local.pop(key)

    def keep(self, task: Task, mb: int, edges: list[Edge], kept: Any) -> None:
        """A forward microbatch's activations kept on the device for its pack's backward (the ``A``
        edge; ``kept.KeptForward``), counted by the ledger from now until the backward lets
        them go: the tensors they hold are what the plan's kept bytes stand for."""
        self.ctx.ledger.hold(kept.held, (task.id, mb))
        for e in edges:
            key = self._key(e.consumer, e.stream, e.start)
            self.ctx.moved("compute", "SEND", key[1:], storage_bytes(kept.held))
            self.ctx.local[key] = (kept.held, kept)

    def _kept_key(self, task: Task, mb: int) -> tuple[tuple, Edge]:
        """The key of microbatch ``mb``'s kept activations (its one ``A`` edge), and the edge."""
        (e,) = self.ctx.program.into(task.id, "A", mb)
        return self._key(task.id, "A", e.start), e

    def claim_kept(self, task: Task, mb: int) -> None:
        """Count microbatch ``mb``'s kept activations as ``task``'s before its unit is reserved
        (the unit's planned bytes count them), not as the forward's beside it."""
        piece = self.ctx.local.get(self._kept_key(task, mb)[0])
        if piece is not None:
            self.ctx.ledger.hold(piece[0], (task.id, mb))

    def take_kept(self, task: Task, mb: int) -> Any:
        """Microbatch ``mb``'s activations its forward kept (``keep``), now the unit's."""
        key, e = self._kept_key(task, mb)
        held, kept = self._take_local(key, f"activations of task {task.id} (samples {e.start}-{e.stop}) kept by "
                                           f"task {e.producer}")
        self.ctx.moved("compute", "RECV", key[1:], storage_bytes(held))
        self.ctx.ledger.hold(held, (task.id, mb))
        return kept

    def stream_prefetch(self, task: Task, streams: list[str], mb: int) -> dict[str, Future]:
        """Queue microbatch ``mb``'s inputs on their inbound stream (swap-in or p2p-in), as the
        program lists them: a task's first microbatch's as the task starts (behind its state, on
        swap-in), each later one's while the microbatch before computes; LOCAL pieces are on the
        device already. Without prefetching (``prefetch=False``) only the first microbatch's are
        queued."""
        out = {}
        if mb >= len(task.microbatches) or (mb > 0 and not self.prefetch):
            return out
        for name in streams:
            edges = self.ctx.program.into(task.id, name, mb)
            channel = Channel(edges[0].channel) if edges else Channel.SWAP
            if channel == Channel.LOCAL:
                continue
            stream = self.ctx.p2p_in if channel == Channel.P2P else self.ctx.swap_in
            out[name] = stream.submit(self._fetch, task, name, mb, label=f"{name} in (mb {mb})", task=task.id)
        return out

    def inputs(self, task: Task, streams: list[str], mb: int, ready: dict[str, Future]) -> dict[str, tuple]:
        """Microbatch ``mb``'s inputs: those not prefetched fetched now, then the prefetched ones
        waited for (a stash copied in while a gradient is still on its way, not after it came)."""
        got = {name: self._fetch(task, name, mb) for name in streams if name not in ready}
        for name in streams:
            if name in ready:
                got[name] = self.ctx.wait(ready[name], f"{name} (mb {mb})")
        return {name: got[name] for name in streams}

    def p2p_buffers(self, src: int, specs: list[tuple[list[int], torch.dtype]]) -> list[torch.Tensor]:
        """Receive buffers on the device for a P2P message from ``src`` (the transport's receiving
        thread, inside the device's memory scope): received ahead of its consumer, a message waits
        for room like a prefetch, unless the compute thread waits for a message from ``src`` (this
        one, or one behind it in the sender's order)."""
        nbytes = sum(dtype.itemsize * math.prod(shape) for shape, dtype in specs)
        where = self.ctx.device.torch_device

        def make() -> list[torch.Tensor]:
            return [torch.empty(shape, dtype=dtype, device=where) for shape, dtype in specs]

        start = time.perf_counter()
        buffers = self.admission.with_room(nbytes, make, lambda: self._awaits(src))  # nobody's until its consumer fetches it
        waited = time.perf_counter() - start
        if waited > 0.001:
            log.debug("dev%d: a P2P message of %d bytes from dev%d waited %.3f s for room", self.ctx.rank, nbytes, src,
                      waited)
        return buffers

    def _awaits(self, src: int) -> bool:
        """Whether the compute thread is blocked on a P2P message from ``src``."""
        with self._awaited_lock:
            return self._awaited.get((src, True), 0) > 0 or (self.ctx.waiting and self._awaited.get((src, False), 0) > 0)

    @contextlib.contextmanager
    def _awaiting(self, src: int) -> Iterator[None]:
        """Mark a wait for a P2P message from ``src`` (see ``_awaits``)."""
        key = (src, on_compute_thread())
        with self._awaited_lock:
            self._awaited[key] = self._awaited.get(key, 0) + 1
        try:
            yield
        finally:
            with self._awaited_lock:
                self._awaited[key] -= 1


def slice_samples(v: Any, start: int, size: int) -> Any:
    """Samples ``start`` to ``start + size`` of a batch-first value; anything else passes whole."""
    return v[start:start + size] if isinstance(v, torch.Tensor) else v
