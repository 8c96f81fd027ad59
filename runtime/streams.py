"""Streams: ordered queues of work beside the compute thread (§4.4).

On a GPU each stream is a CUDA stream; work is issued in order and ordered against other streams
with events. On an emulated CPU device a stream is a thread that runs its jobs one after another,
so that swaps and p2p transfers overlap compute as they would on a GPU. A job's result (or its
exception) comes back through a ``Future``; the thread enters the device's memory scope, so what it
allocates is counted against the device.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

from harmony.scheduler.lower import STREAMS  # the program's streams, named once (re-exported here)

log = logging.getLogger(__name__)


# seconds between forced GIL hand-overs in a process with stream threads: the default 5 ms would
# hold a stream thread that long behind a compute thread running Python (set by every worker)
SWITCH_INTERVAL = 0.0002


class Job(Future):
    """A stream job's future, with when the job ended (``time.perf_counter``): whoever waits on it
    depends on what was done then, not on when it woke up to see it."""

    ended: float | None = None


class Stream:
    """One in-order queue of jobs run by its own thread. Jobs submitted with a ``label`` are timed
    (``take_events``) for the run's measured timeline."""

    def __init__(self, name: str, scope: Callable[[], AbstractContextManager] = nullcontext,
                 setup: Callable[[], None] = lambda: None, sync: Callable[[], float] = time.perf_counter,
                 begin: Callable[[float], None] = lambda queued: None,
                 issued: Callable[[], float] = time.perf_counter) -> None:
        """``setup`` runs once on the stream's thread; ``begin(queued)`` before each job, with when
        it was queued (``issued()`` on the submitting thread: a timed device's modelled issue,
        ``Device.issued_at``); ``sync()`` after it, returning when its work was done (a timed
        device's modelled end, ``Device.stream_sync``)."""
        self.name = name
        self._sync = sync
        self._begin = begin
        self._issued = issued
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._scope = scope
        self._setup = setup
        self._events: list[tuple[int | None, str, float, float]] = []
        self._pending = 0  # jobs submitted and not yet finished
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"harmony-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, label: str | None = None, task: int | None = None) -> Job:
        """Queue ``fn(*args)``; with a ``label``, its span is recorded as work of ``task``."""
        future = Job()
        with self._pending_lock:
            self._pending += 1
        self._jobs.put((fn, args, future, label, task, self._issued()))
        return future

    def run_here(self, fn: Callable[[], Any], label: str, task: int | None = None) -> None:
        """Run ``fn()`` on the calling thread, timed as this stream's job, where nothing is queued
        on the stream (else queued behind it, in order). For work too small to pay a thread
        hand-off: a shared-memory send on an emulated device is a copy of a few kilobytes and a
        pipe write, and waking the stream's thread for it costs more than that on busy cores."""
        if self.busy():
            self.submit(fn, label=label, task=task)
            return
        start = time.perf_counter()
        fn()
        self._events.append((task, label, start, time.perf_counter()))

    def busy(self) -> bool:
        """Whether a job submitted earlier has not finished yet."""
        return self._pending > 0

    def take_events(self) -> list[tuple[int | None, str, float, float]]:
        """(task, label, start, end) of the labelled jobs run since the last call, in
        ``time.perf_counter`` seconds (one clock for every process of a host)."""
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        self._setup()
        with self._scope():
            while True:
                item = self._jobs.get()
                if item is None:
                    return
                fn, args, future, label, task, queued = item
                if not future.set_running_or_notify_cancel():
                    self._finished()
                    continue
                start = time.perf_counter()
                try:
                    self._begin(queued)
                    result = fn(*args)
                    future.ended = self._sync()  # its copies are complete (CUDA) before anyone uses the result
                    if label is not None:
                        self._events.append((task, label, start, time.perf_counter()))
                    future.set_result(result)
                except BaseException as exc:  # handed to whoever waits on the future
                    future.set_exception(exc)
                result = None
                del fn, args, future, item
                self._finished()  # after its arguments (device tensors, maybe) are let go

    def _finished(self) -> None:
        with self._pending_lock:
            self._pending -= 1
