"""Streams: ordered queues of work beside the compute thread (§4.4).

On a GPU each stream is a CUDA stream; work is issued in order and ordered against other streams
with events. On an emulated CPU device a stream is a thread that runs its jobs one after another,
so that swaps and p2p transfers overlap compute as they would on a GPU. A job's result (or its
exception) comes back through a ``Future``; the thread enters the device's memory scope, so what it
allocates is counted against the device. A thread about to block on a job that no thread has taken
yet runs it itself, with the jobs queued ahead of it, in order and as the stream's
(``Stream.help``, ``current_stream``): on an emulated device's shared cores the compute thread would
otherwise wait for two thread wake-ups a job.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

log = logging.getLogger(__name__)

STREAMS = ("compute", "swap-in", "swap-out", "p2p-in", "p2p-out")

# seconds between forced GIL hand-overs in a process with stream threads: the default 5 ms would
# hold a stream thread that long behind a compute thread running Python (set by every worker)
SWITCH_INTERVAL = 0.0002


_running_here = threading.local()  # .stream: the stream whose job this thread runs now


def current_stream() -> Stream | None:
    """The stream whose job the calling thread is running: a stream's own thread, or a thread that
    runs a job while waiting on it (``Stream.help``). A job behaves as its stream's wherever it
    runs (a prefetch that gives up when short of room does so on a helper as on its thread)."""
    return getattr(_running_here, "stream", None)


class StreamFuture(Future):
    """A job's future that knows its stream, so that whoever waits on it can run the jobs queued
    ahead of it itself (``Stream.help``)."""

    def __init__(self, stream: Stream) -> None:
        super().__init__()
        self.stream = stream


class Stream:
    """One in-order queue of jobs run by its own thread, one job at a time. Jobs submitted with a
    ``label`` are timed (``take_events``) for the run's measured timeline. ``helpable``: a thread
    that waits on one of its jobs may run the jobs still queued ahead of it, in order (``help``)."""

    def __init__(self, name: str, scope: Callable[[], AbstractContextManager] = nullcontext,
                 setup: Callable[[], None] = lambda: None, sync: Callable[[], None] = lambda: None,
                 helpable: bool = False) -> None:
        self.name = name
        self.helpable = helpable
        self._sync = sync
        self._jobs: collections.deque = collections.deque()
        self._ready = threading.Condition()  # guards the queue and ``_running``
        self._running = False  # a job has been taken and has not finished (by the thread or a helper)
        self._scope = scope
        self._setup = setup
        self._events: list[tuple[int | None, str, float, float]] = []
        self._pending = 0  # jobs submitted and not yet finished
        self._thread = threading.Thread(target=self._run, name=f"harmony-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, label: str | None = None, task: int | None = None) -> Future:
        """Queue ``fn(*args)``; with a ``label``, its span is recorded as work of ``task``."""
        future = StreamFuture(self)
        with self._ready:
            self._pending += 1
            self._jobs.append((fn, args, future, label, task))
            self._ready.notify()
        return future

    def run_here(self, fn: Callable[[], Any], label: str, task: int | None = None) -> None:
        """Run ``fn()`` on the calling thread, timed as this stream's job, where nothing is queued
        on the stream (else queued behind it, in order). For work too small to pay a thread
        hand-off: a shared-memory send on an emulated device is a copy of a few kilobytes and a
        pipe write, and waking the stream's thread for it took 0.3-1.8 ms on two busy cores."""
        if self.busy():
            self.submit(fn, label=label, task=task)
            return
        start = time.perf_counter()
        fn()
        self._events.append((task, label, start, time.perf_counter()))

    def help(self, future: Future) -> None:
        """Run, on the calling thread and in queue order, the jobs queued ahead of ``future``'s and
        its own, until it is done or the stream's thread has taken the next one. The caller was
        about to block on ``future``, so the jobs ahead of it had to finish first anyway; running
        them here saves two thread hand-offs each (the stream's thread woken for the job, the
        caller woken for its result), which on an emulated device's busy cores cost 0.1-0.5 ms a
        job (``bench.stream_lag``). Only on a ``helpable`` stream and for its own futures: on a
        GPU a stream's copies belong on its CUDA stream, not the caller's."""
        if not self.helpable or getattr(future, "stream", None) is not self:
            return
        while not future.done():
            with self._ready:
                if self._running or not self._jobs or self._jobs[0] is None:
                    return  # the thread runs the job ahead (the caller waits for it), or it closes
                item = self._jobs.popleft()
                self._running = True
            outer, _running_here.stream = current_stream(), self
            try:
                self._execute(item)
            finally:
                _running_here.stream = outer
                del item  # its arguments (device tensors, maybe) are let go before it counts as finished
                self._finished()

    def busy(self) -> bool:
        """Whether a job submitted earlier has not finished yet."""
        return self._pending > 0

    def take_events(self) -> list[tuple[int | None, str, float, float]]:
        """(task, label, start, end) of the labelled jobs run since the last call, in
        ``time.perf_counter`` seconds (one clock for every process of a host)."""
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        with self._ready:
            self._jobs.append(None)
            self._ready.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        self._setup()
        _running_here.stream = self
        with self._scope():
            while True:
                with self._ready:
                    while not self._jobs or self._running:
                        self._ready.wait()
                    item = self._jobs.popleft()
                    if item is None:
                        return
                    self._running = True
                self._execute(item)
                del item  # its arguments (device tensors, maybe) are let go before it counts as finished
                self._finished()

    def _execute(self, item: tuple) -> None:
        """Run one job taken from the queue (``_running`` set by the taker, who calls ``_finished``
        after it) and hand its result or exception to its future."""
        fn, args, future, label, task = item
        if not future.set_running_or_notify_cancel():
            return
        start = time.perf_counter()
        try:
            result = fn(*args)
            self._sync()  # its copies are complete (CUDA) before anyone uses the result
            if label is not None:
                self._events.append((task, label, start, time.perf_counter()))
            future.set_result(result)
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)

    def _finished(self) -> None:
        with self._ready:
            self._running = False
            self._pending -= 1
            self._ready.notify()
