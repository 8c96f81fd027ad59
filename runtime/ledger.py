"""The ledger: a device's memory as the plan counts it, kept at run time once per buffer, not per op.

The memory promise (``scheduler/memory.py``, ``MemoryPlan``) says what the running task holds
while each of its units computes (``MemoryPlan.units``) and what may lie beside it. The ledger
keeps the same two kinds of bytes:

- **Buffers**: every tensor the runtime puts on the device outside a unit's compute (a state or
  an input copied in, a P2P receive buffer, a joined microbatch, an output handed to a stream), each
  counted once, by weak reference to its storage, from the action that makes it until it is freed.
  Each has an *owner*: ``(task, unit)`` for what a unit reads or sends, ``(task, STATE)`` for a
  task's pack state, ``None`` for a buffer no unit has claimed yet.
- **The running unit's reservation**: its planned bytes, which count its own buffers (its state,
  its inputs, the outputs it is making) and everything it computes. Its owners' buffers are counted
  inside it: the unit holds ``max(planned, its buffers)``.

``current`` is then what the plan says the device holds now, without watching any op. Admission
will read it instead of the per-op tracker (issue 15); until then the executor keeps it beside the
tracker, and at every unit's start records by how much the real memory exceeded it
(``shortfall``), which the tests hold at zero.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterable
from typing import Any, Hashable

import torch

__all__ = ["Ledger", "STATE"]

STATE = "state"  # the unit name of a task's pack state: held by every unit of the task


class Ledger:
    """Planned bytes on one device; see the module docs."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a storage freed while it is held releases itself
        self._entries: dict[int, tuple[int, Hashable, weakref.ref]] = {}  # storage -> (bytes, owner, ref)
        self._by_owner: dict[Hashable, int] = {}
        self._running: frozenset = frozenset()
        self._planned = 0
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
                old = self._entries.get(key)
                if old is not None:
                    self._add(old[1], -old[0])
                    ref = old[2]
                else:
                    ref = weakref.ref(st, functools.partial(self._release, key))
                self._entries[key] = (nbytes, owner, ref)
                self._add(owner, nbytes)
            self._note_peak()

    def _release(self, key: int, _ref: weakref.ref | None = None) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._add(entry[1], -entry[0])

    def _add(self, owner: Hashable, nbytes: int) -> None:
        left = self._by_owner.get(owner, 0) + nbytes
        if left:
            self._by_owner[owner] = left
        else:
            self._by_owner.pop(owner, None)

    # ----------------------------------------------------------- the running unit
    def run(self, owners: Iterable[Hashable], planned: int) -> None:
        """A unit starts: it holds ``planned`` bytes, its ``owners``' buffers counted inside them."""
        with self._lock:
            self._running = frozenset(owners)
            self._planned = planned
            self._note_peak()

    def idle(self) -> None:
        """No unit runs: only buffers count."""
        self.run((), 0)

    # ----------------------------------------------------------- reading
    @property
    def current(self) -> int:
        with self._lock:
            return self._current()

    @property
    def peak(self) -> int:
        return self._peak

    def reset(self) -> None:
        """Start a new iteration's figures: the peak from what is held now, no shortfall."""
        with self._lock:
            self._peak = self._current()
            self.shortfall = 0

    def compare(self, real: int) -> None:
        """Record by how much ``real`` bytes in use exceed the ledger now (nothing if they do not)."""
        with self._lock:
            self.shortfall = max(self.shortfall, real - self._current())

    def _current(self) -> int:
        inside = outside = 0
        for owner, n in self._by_owner.items():
            if owner in self._running:
                inside += n
            else:
                outside += n
        return outside + max(self._planned, inside)

    def _note_peak(self) -> None:
        self._peak = max(self._peak, self._current())
