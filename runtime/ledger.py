"""The ledger: a device's memory as the plan counts it, kept at run time once per buffer, not per op.

The memory promise (``scheduler/memory.py``, ``MemoryPlan``) says what the running task holds
while each of its units computes (``MemoryPlan.units``) and what may lie beside it. The ledger
keeps the same kinds of bytes:

- **Buffers**: every tensor the runtime puts on the device outside a unit's compute (a state or
  an input copied in, a P2P receive buffer, a joined microbatch, an output handed to a stream), each
  counted once, by weak reference to its storage, from the action that makes it until it is freed.
  Each has an *owner*: ``(task, unit)`` for what a unit reads or sends, ``(task, STATE)`` for a
  task's pack state, ``None`` for a buffer no unit has claimed yet.
- **The running unit's reservation**: its planned bytes, which count its own buffers (its state,
  its inputs, the outputs it is making) and everything it computes. Its owners' buffers are counted
  inside it: the unit holds ``max(planned, its buffers)``.
- **Leaving**: what a unit still holds once it has ended is on its way out (an output queued on an
  outbound stream, a gradient being deposited, weights being evicted), unless the executor keeps it
  on the device for a later task (``keep``: a LOCAL output, a state kept resident). The plan counts
  leaving outputs on a GPU but not on an emulated device, whose memory manager lets them go before
  it lets an allocation past the plan's peak (the estimator's module docs); ``count_leaving`` says
  which.

``current`` is then what the plan says the device holds now, without watching any op, and
``occupied`` what the ledger knows is on it (``current``, leaving bytes the plan does not count,
and copies admitted and being made, ``admit``/``made``): admission reads ``occupied``. Where every op is counted too (an emulated device checking
its memory), the executor compares the real count with ``occupied`` at every unit's start and
records by how much it exceeded it (``shortfall``), which the tests hold at zero. There the ledger
lets a freed buffer go only once the tracker has (``tracker``): both learn of a free from a weak
reference to the same storage, and Python calls the later-registered one, the ledger's, first, so a
comparison between the two callbacks would see the tracker still counting what the ledger had let
go.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any, Callable, Hashable

import torch

__all__ = ["KEPT", "Ledger", "LEAVING", "STATE"]

STATE = "state"  # the unit name of a task's pack state: held by every unit of the task
KEPT = ("kept", STATE)  # the owner of state kept on the device across iterations: no task's, never leaving
LEAVING = "leaving"  # the owner of what an ended unit still holds and nobody keeps


class Ledger:
    """Planned bytes on one device; see the module docs."""

    def __init__(self, count_leaving: bool = False, tracker: Any = None) -> None:
        """``tracker``: the device's ``MemoryTracker`` where it counts every op; the ledger then
        releases a freed buffer after the tracker does (module docs)."""
        self.count_leaving = count_leaving  # whether the plan counts outputs until they have left
        self._lock = threading.RLock()  # a storage freed while it is held releases itself
        self._entries: dict[int, tuple[int, Hashable, weakref.ref]] = {}  # storage -> (bytes, owner, ref)
        self._tracker = tracker
        self._freeing: set[int] = set()  # freed storages the tracker still counts: released when it lets go
        if tracker is not None:
            tracker.on_release = self._tracker_released
        self._by_owner: dict[Hashable, int] = {}
        self._running: frozenset = frozenset()
        self._planned = 0
        self._making: dict[Hashable, int] = {}  # per owner, bytes of copies admitted and being made, not held yet
        # when the count last went down or a unit changed (``time.perf_counter``): a copy that waited for
        # room found it then, not when its next try came round
        self.freed_at = 0.0
        self._peak = 0
        self.shortfall = 0  # the most the real memory exceeded the ledger where it was compared

    # ----------------------------------------------------------- buffers
    def hold(self, values: Any, owner: Hashable = None) -> None:
        """Count the storages of the tensors among ``values`` (a tensor or a sequence) under
        ``owner``; a storage held already changes owner (a unit claims what a stream received)."""
        tensors = [values] if isinstance(values, torch.Tensor) else [v for v in values if isinstance(v, torch.Tensor)]
        with self._lock:
            for t in tensors:
                st = t.untyped_storage()
                key, nbytes = st._cdata, st.nbytes()
                if key in self._entries:
                    self._move(key, owner)
                    continue
                self._entries[key] = (nbytes, owner, weakref.ref(st, functools.partial(self._release, key)))
                self._add(owner, nbytes)
            self._note_peak()

    def admit(self, nbytes: int, limit: int | None, owner: Hashable = None) -> bool:
        """A copy of ``nbytes`` for ``owner`` is about to be made: if ``occupied`` stays within
        ``limit`` (None: no limit, a copy that must be made) it counts as being made until
        ``made``, and True. A copy for a running owner (the running task's state, loaded late)
        counts inside the unit's planned bytes, as what it holds does. The test and the count are
        one step, so two threads admitting at once both see each other."""
        with self._lock:
            self._making[owner] = self._making.get(owner, 0) + nbytes
            if limit is not None and self._occupied() > limit:
                self._making_done(owner, nbytes)
                return False
            return True

    def made(self, nbytes: int, values: Any = (), owner: Hashable = None) -> None:
        """The copy admitted for ``nbytes`` under ``owner`` is made (``values``, held under it) or
        given up (no values): it is no longer being made. In one step, so that nobody sees it twice
        or not at all."""
        with self._lock:
            self.hold(values, owner)
            self._making_done(owner, nbytes)

    def _making_done(self, owner: Hashable, nbytes: int) -> None:
        self.freed_at = time.perf_counter()
        left = self._making[owner] - nbytes
        if left:
            self._making[owner] = left
        else:
            del self._making[owner]

    def _release(self, key: int, _ref: weakref.ref | None = None) -> None:
        with self._lock:
            if self._tracker is not None and self._tracker.counts(key):
                self._freeing.add(key)  # the tracker's own callback comes next: release then
                return
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._add(entry[1], -entry[0])

    def _tracker_released(self, key: int) -> None:
        with self._lock:
            if key in self._freeing:
                self._freeing.discard(key)
                self._release(key)

    def _move(self, key: int, owner: Hashable) -> None:
        nbytes, old, ref = self._entries[key]
        self._add(old, -nbytes)
        self._entries[key] = (nbytes, owner, ref)
        self._add(owner, nbytes)

    def _add(self, owner: Hashable, nbytes: int) -> None:
        if nbytes < 0:
            self.freed_at = time.perf_counter()
        left = self._by_owner.get(owner, 0) + nbytes
        if left:
            self._by_owner[owner] = left
        else:
            self._by_owner.pop(owner, None)

    # ----------------------------------------------------------- the running unit
    def run(self, owners: Iterable[Hashable], planned: int, keep: Callable[[], Iterable[Any]] | None = None) -> None:
        """A unit starts: it holds ``planned`` bytes, its ``owners``' buffers counted inside them.
        What the owners that stop running still hold is leaving, but for the tensors ``keep()``
        returns (what the executor keeps on the device for a later task)."""
        with self._lock:
            self.freed_at = time.perf_counter()
            owners = frozenset(owners)
            ended = self._running - owners
            if ended:
                self._retire(ended, keep)
            self._running = owners
            self._planned = planned
            self._note_peak()

    def idle(self, keep: Callable[[], Iterable[Any]] | None = None) -> None:
        """No unit runs: only buffers count."""
        self.run((), 0, keep)

    def _retire(self, ended: frozenset, keep: Callable[[], Iterable[Any]] | None) -> None:
        held = [key for key, entry in self._entries.items() if entry[1] in ended]
        if not held:
            return
        kept = set()
        if keep is not None:
            kept = {t.untyped_storage()._cdata for t in keep() if isinstance(t, torch.Tensor)}
        for key in held:
            if key not in kept:
                self._move(key, LEAVING)

    # ----------------------------------------------------------- reading
    @property
    def current(self) -> int:
        with self._lock:
            return self._current()

    @property
    def occupied(self) -> int:
        """Bytes the ledger knows are on the device: ``current``, the leaving bytes it leaves out,
        and copies being made."""
        with self._lock:
            return self._occupied()

    @property
    def peak(self) -> int:
        return self._peak

    def reset(self) -> None:
        """Start a new iteration's figures: the peak from what is held now, no shortfall."""
        with self._lock:
            self._peak = self._current()
            self.shortfall = 0

    def compare(self, real: Callable[[], int]) -> None:
        """Record by how much the bytes in use (``real()``) exceed what the ledger knows is on the
        device (nothing if they do not). ``real`` is read under the ledger's lock: a buffer freed
        on another thread between the two readings would otherwise leave the ledger after the real
        count was taken and show as a shortfall that never was."""
        with self._lock:
            self.shortfall = max(self.shortfall, real() - self._occupied())

    def _occupied(self) -> int:
        making = sum(n for owner, n in self._making.items() if owner not in self._running)
        return self._current(True) + making + (0 if self.count_leaving else self._by_owner.get(LEAVING, 0))

    def _current(self, making: bool = False) -> int:
        """What is held: the running unit's planned bytes (or what its owners hold, if more) and
        everything else; with ``making``, the running owners' copies being made count inside."""
        inside = outside = 0
        for owner, n in self._by_owner.items():
            if owner == LEAVING and not self.count_leaving:
                continue
            if owner in self._running:
                inside += n
            else:
                outside += n
        if making:
            inside += sum(n for owner, n in self._making.items() if owner in self._running)
        return outside + max(self._planned, inside)

    def _note_peak(self) -> None:
        self._peak = max(self._peak, self._current())
