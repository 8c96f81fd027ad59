"""Counting the bytes that live on an emulated device, and refusing allocations past its capacity.

On the ``cpu`` backend every "device" is a region of host memory, so nothing stops a worker from
using more than the capacity the plan was made for. ``MemoryTracker`` makes that capacity real: while
it is entered (``with tracker:``) a ``TorchDispatchMode`` sees every ATen op the current thread runs,
including the ops of ``loss.backward()`` when backward is *called* inside it (the autograd engine
captures the dispatch-mode stack at the call, not where the forward ran). Each op's outputs are
counted by their untyped storage, once per storage, and released when that storage is freed (a
weak reference on the storage object, which PyTorch keeps alive exactly as long as the storage).

What is exact and what is not:

- ``current`` is exact to the byte: the sum of ``nbytes`` of the live storages this tracker counts.
  Views and in-place ops share their input's storage and add nothing; an op that grows a counted
  storage (``resize_``, ``out=``) adds the growth.
- ``peak`` is exact at op granularity: the largest ``current`` seen after any op. Scratch memory a
  kernel allocates and frees inside one op (below the dispatcher) is not seen.
- The capacity check is per op. A dispatch mode only sees an output after the kernel made it, so
  the check runs right after the op: if the new storages would take ``current`` past ``capacity``,
  they are not counted, dropped, and ``DeviceOutOfMemoryError`` is raised. ``current`` therefore never
  exceeds ``capacity`` and, once the caller drops what it held, returns to its value before the
  failed work (the device is left clean).
- A storage is only counted if an op made it under the tracker, or if it is ``register``-ed
  (e.g. parameters resident on the device). An op whose output shares an *uncounted* input's
  storage (``weight.t()`` of a host parameter) allocates nothing and is not counted.
- A soft limit (``budget``, the plan's peak for the device) may sit below the capacity: an
  allocation past it calls ``over_budget`` first (the executor waits there for outputs still
  leaving the device, as the plan expected them gone), then is counted as usual.
- ``torch.tensor(data)`` under the tracker is counted (its ``aten.lift_fresh`` output is new memory);
  ``torch.from_numpy`` goes through the same op and is counted too, although it shares the array.

Tracking is per thread (dispatch modes are thread-local): every thread that should count enters the
tracker itself; all threads add to the same totals, which a lock protects (storages may be freed,
and their finalizers run, on any thread).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harmony.errors import DeviceOutOfMemoryError

log = logging.getLogger(__name__)

__all__ = ["MemoryTracker", "storage_bytes"]


def _tensors(obj: Any, out: list[torch.Tensor]) -> None:
    """The tensors in an op's args, kwargs or outputs: nested tuples, lists and dicts (a plain
    walk: ``tree_flatten`` cost half of the tracker's time per op)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)


def _storages(obj: Any) -> list[torch.UntypedStorage]:
    """The untyped storages of the dense tensors in an op's args, kwargs or outputs."""
    leaves: list[torch.Tensor] = []
    _tensors(obj, leaves)
    out = []
    for leaf in leaves:
        if leaf.is_meta:
            continue
        try:
            out.append(leaf.untyped_storage())
        except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage
            continue
    return out


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (what the device holds for it, views included)."""
    return t.untyped_storage().nbytes()


class _OverBudget(Exception):
    """An allocation would take the device past its soft limit (``MemoryTracker.budget``)."""


class _Entry:
    """One counted storage: its size as last seen, and the weak reference whose callback uncounts
    it when freed (a plain ``weakref.ref``: ``weakref.finalize`` costs far more per
    allocation, and an entry that is no longer counted needs no detaching: ``_release`` checks)."""

    __slots__ = ("nbytes", "ref")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.ref: weakref.ref | None = None


class _TrackingMode(TorchDispatchMode):
    """The per-entry dispatch mode; one instance per ``with tracker:`` because mode objects keep
    per-thread enter/exit state and must not be shared between threads."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tracker = self.tracker
        if tracker._paused():
            return out
        outputs = _storages(out)
        if not outputs:
            return out
        # lift_fresh turns a tensor made outside the dispatcher (torch.tensor) into a fresh value:
        # its output is new memory although it is the input.
        if func is torch.ops.aten.lift_fresh.default:
            inputs: set[int] = set()
        else:
            inputs = {st._cdata for st in _storages((args, kwargs))}
        try:
            tracker._account(outputs, inputs, op=func)  # formatted only if logged
        except DeviceOutOfMemoryError:
            # Drop our references so that the refused outputs die with the caller's references,
            # not with the traceback that keeps this frame alive.
            out = outputs = None
            raise
        return out


class MemoryTracker:
    """Live-storage accounting with an enforced capacity for one emulated device.

    ``with tracker:`` tracks what the current thread allocates; ``register`` counts tensors made
    elsewhere; ``current``/``peak`` are in bytes. ``capacity_bytes=None`` means unlimited.
    """

    def __init__(self, capacity_bytes: int | None, device_name: str) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"{device_name}: capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.device_name = device_name
        self._lock = threading.RLock()  # re-entrant: a finalizer may fire while we hold it
        self._entries: dict[int, _Entry] = {}  # StorageImpl address -> entry
        self._current = 0
        self._peak = 0
        self._local = threading.local()  # per thread: stack of entered modes, pause depth
        # called (without the lock) with a counted storage's key once it is freed and no longer
        # counted: the ledger follows the tracker's releases, never ahead of them (ledger.py)
        self.on_release: Callable[[int], None] | None = None
        # called (without the lock) when an allocation does not fit: returns True after waiting for
        # memory that other threads were about to free, so the allocation is tried once more
        self.reclaim: Callable[[], bool] | None = None
        # a soft limit below the capacity (the plan's peak for the device): an allocation past it
        # first calls ``over_budget`` (without the lock), which may wait for memory other threads
        # are about to free, and is then counted; the capacity stays the hard limit
        self.budget: int | None = None
        self.over_budget: Callable[[], None] | None = None

    # ----------------------------------------------------------------- totals
    @property
    def current(self) -> int:
        """Bytes of the live counted storages."""
        return self._current

    @property
    def peak(self) -> int:
        """Largest ``current`` seen after any op or registration since creation or ``reset_peak``."""
        return self._peak

    def reset_peak(self) -> None:
        """Start a new peak measurement from the present ``current``."""
        with self._lock:
            self._peak = self._current

    def __len__(self) -> int:
        """Number of counted storages."""
        return len(self._entries)

    def is_tracked(self, t: torch.Tensor) -> bool:
        """Whether the storage behind ``t`` is counted."""
        return t.untyped_storage()._cdata in self._entries

    # ----------------------------------------------------------- registration
    def register(self, t: torch.Tensor) -> torch.Tensor:
        """Count the storage of a tensor made outside the tracker (e.g. a resident parameter) until
        it is freed or unregistered. Raises ``DeviceOutOfMemoryError`` past capacity; counting the
        same storage twice is a no-op. Returns ``t``."""
        self._account([t.untyped_storage()], set(), op="register")
        return t

    def unregister(self, t: torch.Tensor) -> None:
        """Stop counting the storage of ``t`` (it left the device while still alive on the host)."""
        st = t.untyped_storage()
        with self._lock:
            entry = self._entries.pop(st._cdata, None)
            if entry is None:
                return
            self._current -= entry.nbytes

    def check(self, requested: int) -> None:
        """Raise ``DeviceOutOfMemoryError`` if ``requested`` more bytes would not fit now; lets a
        caller refuse a copy before making it."""
        with self._lock:
            self._refuse_if_over(requested)

    # ----------------------------------------------------------- entering
    def __enter__(self) -> MemoryTracker:
        mode = _TrackingMode(self)
        stack = self._stack()
        mode.__enter__()
        stack.append(mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack().pop().__exit__(*exc)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run in this block (on this thread) are not counted: for host-side copies made while
        the tracker is entered. They skip Python dispatch altogether (``_DisableTorchDispatch``, a
        C++ guard): a copy then holds the GIL only for its call, not for the Python of a dispatch
        mode around it. A stream thread copying back to back slows a dispatch-bound compute thread
        of its process less that way, though the hand-overs of the lock remain."""
        self._local.paused = getattr(self._local, "paused", 0) + 1
        try:
            with torch._C._DisableTorchDispatch():
                yield
        finally:
            self._local.paused -= 1

    # ----------------------------------------------------------- internals
    def _stack(self) -> list[_TrackingMode]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _paused(self) -> bool:
        return getattr(self._local, "paused", 0) > 0

    def _refuse_if_over(self, requested: int, op: Any = "check") -> None:
        if self.capacity is not None and self._current + requested > self.capacity:
            log.debug(
                "%s: refusing %d bytes for %s (%d in use, capacity %d)",
                self.device_name, requested, op, self._current, self.capacity,
            )
            raise DeviceOutOfMemoryError(self.device_name, requested, self._current, self.capacity)

    def _account(self, storages: list[torch.UntypedStorage], exclude: set[int], op: Any) -> None:
        """Count the new storages among ``storages`` (not counted yet, not in ``exclude``) and the
        growth of counted ones, all or nothing. Past capacity, ``reclaim`` (if set) may first wait
        for memory that is about to be freed (copies in flight on other threads), once."""
        try:
            try:
                self._account_once(storages, exclude, op, soft=self.over_budget is not None)
            except _OverBudget:
                self.over_budget()
                self._account_once(storages, exclude, op)
        except DeviceOutOfMemoryError:
            if self.reclaim is None or not self.reclaim():
                raise
            self._account_once(storages, exclude, op)

    def _account_once(self, storages: list[torch.UntypedStorage], exclude: set[int], op: Any,
                      soft: bool = False) -> None:
        with self._lock:
            new: dict[int, tuple[torch.UntypedStorage, int]] = {}
            grown: list[tuple[_Entry, int]] = []
            requested = 0
            for st in storages:
                key = st._cdata
                nbytes = st.nbytes()
                entry = self._entries.get(key)
                if entry is not None:
                    if nbytes != entry.nbytes:
                        grown.append((entry, nbytes))
                        requested += nbytes - entry.nbytes
                elif key not in exclude and key not in new and nbytes > 0:
                    new[key] = (st, nbytes)
                    requested += nbytes
            if not new and not grown:
                return
            if soft and self.budget is not None and self._current + requested > self.budget:
                raise _OverBudget
            self._refuse_if_over(requested, op)
            for entry, nbytes in grown:
                entry.nbytes = nbytes
            for key, (st, nbytes) in new.items():
                entry = _Entry(nbytes)
                self._entries[key] = entry
                entry.ref = weakref.ref(st, functools.partial(self._release, key, entry))
            self._current += requested
            if self._current > self._peak:
                self._peak = self._current

    def _release(self, key: int, entry: _Entry, _ref: weakref.ref | None = None) -> None:
        """Callback of a counted storage's weak reference: it was freed."""
        with self._lock:
            if self._entries.get(key) is not entry:
                return
            del self._entries[key]
            self._current -= entry.nbytes
        if self.on_release is not None:
            self.on_release(key)

    def counts(self, key: int) -> bool:
        """Whether the storage at ``key`` (``UntypedStorage._cdata``) is counted now."""
        return key in self._entries

    def __repr__(self) -> str:
        cap = "unlimited" if self.capacity is None else f"{self.capacity}"
        return f"MemoryTracker({self.device_name!r}, current={self._current}, peak={self._peak}, capacity={cap})"
