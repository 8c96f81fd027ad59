"""Admission: whether a copy or an allocation may take device memory now (docs/architecture.md,
"The memory model", how the runtime keeps the plan's promise).

- A copy made ahead of need (a state prefetch, the next microbatch's inputs, a P2P receive buffer,
  a join of pieces) may take the device only up to the plan's peak for it (``_prefetch_limit``),
  counted by the ledger (``ledger.py``: the running unit's planned bytes, the buffers beside it,
  outputs still leaving), and must leave free what the running task's later units may still grow
  to: its ``headroom``, the plan's reserve for it less the running unit's planned bytes.
- A copy the compute thread is blocked on is *urgent*: it may use the margin, and fails with
  ``DeviceOutOfMemoryError`` only once it has found no room for a second (``with_room``).
- On emulated devices checking their memory the tracker calls back here: past the plan's peak
  for the device (``let_outputs_leave``) and before it refuses an allocation of the compute
  thread (``reclaim``), outputs still leaving the device go first, since the plan counts them as
  gone.

One of the executor's parts (``executor.py``); the others copy into the device through it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, Callable, Hashable, Iterator

import torch

from harmony.errors import DeviceOutOfMemoryError
from harmony.runtime.channels import Aborted
from harmony.runtime.context import DeviceContext
from harmony.runtime.ledger import STATE
from harmony.scheduler.tasks import MemoryPlan

URGENT_STALL = 1.0  # seconds an urgent allocation keeps finding no room before it is out of memory
RETRY = 0.001  # seconds between tries of an allocation that found no room


class NoRoom(Exception):
    """A prefetch that would not fit now (and was told not to wait)."""


def on_compute_thread() -> bool:
    """Stream threads are named ``harmony-...`` (``streams.Stream``); the compute thread is not."""
    return not threading.current_thread().name.startswith("harmony-")


class Admission:
    """Room on the device for what is copied in and allocated; see the module docs."""

    def __init__(self, ctx: DeviceContext, plan: MemoryPlan) -> None:
        self.ctx = ctx
        self._budget = plan.devices.get(ctx.rank)  # the plan's peak for this device; None: it has no task
        self._memory = plan  # the plan's promise (scheduler/memory.py)
        self._reserves = plan.reserves  # per task, the most it holds at once
        self.headroom = 0  # bytes the running task may still allocate: copies made ahead leave them free
        self._gave_up_waiting: int | None = None  # the task whose outputs would not leave in time

    def to_device(self, t: torch.Tensor, channel: str, tensor: str, wait: bool = True, count: bool = True,
                  room: int | None = None, owner: Hashable = None) -> torch.Tensor:
        """A counted copy into device memory that waits while memory is short and work that can
        free it is still running; gives up (out of memory) once the compute thread is blocked on
        it and nothing was freed for a second. Without ``wait`` (a prefetch that gives up rather
        than hold its stream) it is never urgent: it fits beside the running task or not at all.
        ``room``: what it must leave free for the running task (default: the task's headroom).
        ``owner``: whose it is in the ledger (default: the running task's state)."""
        return self.many_to_device([t], wait, room, owner, tensor if count else None, channel)[0]

    def many_to_device(self, tensors: list[torch.Tensor], wait: bool = True, room: int | None = None,
                       owner: Hashable = None, counted: str | None = None,
                       channel: str = "SWAP") -> list[torch.Tensor]:
        """``to_device`` of several tensors at once, such as a whole pack state: one admission and
        one entry into the ledger for all of it, as the plan reserves a state whole. Tensor by
        tensor, each would pay the admission's and the ledger's Python, on a stream thread that
        shares the interpreter lock with the compute thread. ``counted``: the kind of tensor (W, dW,
        K) the bytes are counted as on ``channel``; None for a caller that counts them itself (a
        pack state, once all of it is in)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        urgent = self.compute_blocked if wait else on_compute_thread
        owner = (self.ctx.task, STATE) if owner is None else owner
        to_device = self.ctx.device.to_device
        out = self.with_room(nbytes, lambda: [to_device(t) for t in tensors], urgent, wait, room, owner)
        if counted is not None:
            self.ctx.counters.add(channel, "in", counted, nbytes)
        return out

    def values_to_device(self, values: list, channel: str, tensor: str, owner: Hashable) -> list:
        """A microbatch's inputs copied in. They come one microbatch ahead, as the plan counts them
        (beside the running microbatch's work): they keep no more room free."""
        return [self.to_device(v, channel, tensor, room=0, owner=owner) if isinstance(v, torch.Tensor) else v
                for v in values]

    def ledger_unit(self, task: int, unit: int) -> None:
        """Unit ``unit`` of ``task`` starts: the ledger reserves what the plan says the task holds
        while it computes. Where the device counts every op (an emulated one), the real memory is
        compared with the ledger's count here, where the unit before has let go of its work."""
        planned = self._memory.unit_bytes(task, unit)
        self.ctx.ledger.run(((task, STATE), (task, unit)), planned, self.kept)
        self.headroom = max(0, self._reserves.get(task, 0) - planned)
        if getattr(self.ctx.device, "tracker", None) is not None:
            self.ctx.ledger.compare(self.ctx.device.allocated)

    def kept(self) -> Iterator[Any]:
        """What stays on the device for a later task once its unit ends (not leaving): LOCAL
        outputs and states kept resident."""
        for values, _state in self.ctx.local.values():
            yield from values
        for state in self.ctx.resident.values():
            yield from state.values()

    def _in_use(self) -> int:
        """Bytes in use, for messages: measured where the device measures, else the ledger's."""
        return self.ctx.device.allocated() if self.ctx.device.measures_memory else self.ctx.ledger.occupied

    def compute_blocked(self) -> bool:
        """Whether the copy being made is one the compute thread waits for (or makes itself)."""
        return self.ctx.waiting or on_compute_thread()

    def with_room(self, nbytes: int, make: Callable[[], Any], urgent: Callable[[], bool], wait: bool = True,
                  room: int | None = None, owner: Hashable = None) -> Any:
        """``make()`` (an allocation of ``nbytes`` on the device, held in the ledger under ``owner``)
        once there is room: while it is not ``urgent`` it leaves ``room`` (default: what the running
        task still allocates) and waits while memory is short; once urgent (the compute thread waits
        for it) it takes what there is, and gives up (out of memory) when nothing was freed for a
        second. The ledger counts the copy from its admission (``Ledger.admit``), so that a copy
        being made on another thread is never missing from what admission and the check read.

        Not ``channels.wait_until``: each try is the allocation itself (the allocator, or on an
        emulated device the tracker, says whether it fits), and a copy may become urgent between
        tries."""
        stalled_since = None  # when an urgent try first failed (reset while the copy is not urgent)
        waited = False
        while True:
            try:
                if not self.ctx.ledger.admit(nbytes, None if urgent() else self._ahead_limit(room), owner):
                    # a copy made ahead of need that would take the plan's room waits as if refused
                    raise DeviceOutOfMemoryError(self.ctx.device.name, nbytes, self._in_use(), self.ctx.device.capacity)
                if waited:  # the copy depends on the room it waited for, found when the ledger last let go
                    self.ctx.device.ready(self.ctx.ledger.freed_at)
                try:
                    out = make()
                except BaseException:
                    self.ctx.ledger.made(nbytes, owner=owner)
                    raise
                self.ctx.ledger.made(nbytes, out, owner)
                return out
            except (DeviceOutOfMemoryError, torch.cuda.OutOfMemoryError) as exc:
                if not wait:
                    raise NoRoom from None
                if self.ctx.shared.aborted():
                    raise Aborted("the run was aborted by another worker's failure") from None
                if urgent():
                    now = time.monotonic()
                    stalled_since = stalled_since or now
                    if now - stalled_since > URGENT_STALL:
                        if isinstance(exc, DeviceOutOfMemoryError):
                            raise
                        raise DeviceOutOfMemoryError(self.ctx.device.name, nbytes, self._in_use(),
                                                     self.ctx.device.capacity) from exc
                else:
                    stalled_since = None
                time.sleep(RETRY)
                waited = True

    def _ahead_limit(self, room: int | None) -> int:
        """What the ledger's count (the running unit's planned bytes, the buffers beside it, outputs
        still leaving, copies being made) may reach with a copy made ahead of need: the prefetch
        limit, less ``room`` left free (default: the running task's headroom)."""
        return self._prefetch_limit() - (self.headroom if room is None else room)

    def _prefetch_limit(self) -> int:
        """Bytes a copy made ahead of need may take the device to: the plan's peak for it (the rest
        of the device is the margin left for noise), or the device's capacity where the plan gives
        it no task."""
        if self._budget is None:
            return self.ctx.device.capacity
        return min(self._budget, self.ctx.device.capacity)

    def let_outputs_leave(self) -> None:
        """An allocation would take the device past the plan's peak for it: the plan does not count
        outputs still leaving the device (queued swap-outs and sends; see the estimator's module
        docs), so let them go first. A job that cannot finish within a second (a send whose
        receiver is short of room) is not waited for again in this task; nor do the outbound
        streams wait for themselves."""
        if self._gave_up_waiting == self.ctx.task or self._on_outbound_stream():
            return
        for stream in (self.ctx.swap_out, self.ctx.p2p_out):
            if not stream.busy():
                continue
            try:
                stream.submit(lambda: None).result(timeout=1.0)
            except concurrent.futures.TimeoutError:  # not the builtin one before Python 3.11
                self._gave_up_waiting = self.ctx.task
                return
            except Exception:  # noqa: BLE001 - a failed job reports itself where it is awaited
                return

    def _on_outbound_stream(self) -> bool:
        name = threading.current_thread().name
        return name in (f"harmony-{self.ctx.swap_out.name}", f"harmony-{self.ctx.p2p_out.name}")

    def reclaim(self) -> bool:
        """The memory manager's last resort before out-of-memory on the compute thread: outputs
        still on their way to the host (and the device tensors they hold) are waited for."""
        if not on_compute_thread():
            return False
        for stream in (self.ctx.p2p_out, self.ctx.swap_out):
            try:
                stream.submit(lambda: None).result(timeout=self.ctx.timeout)
            except Exception:  # noqa: BLE001 - a failed job reports itself where it is awaited
                return False
        return True
