"""Cross-process flags in shared memory (``Shared``): which tasks finished this iteration, which
replicas of an update read their inputs, whether the run was aborted, and per worker the task it runs
and what it waits for. Every worker of a run maps the same flags: a task waits here for the tasks it
depends on in other workers, and the launcher reads them to name what a failed, dead or stalled
worker was doing (``runtime/replication.py`` keeps them in step across hosts).

A wait polls the flags every half millisecond, but for the host's (``wait_done(ring=True)``: the
host's program of offloaded updates and norms), which waits a whole iteration for the gradients it
steps: polled so often for so long, it takes a share of the cores that emulated devices compute on.
Where the flags have a bell (``create(bell=...)``, a ``multiprocessing`` semaphore: the launcher's
workers, not torchrun's, which are not started by one parent), the host sleeps on it instead, and
whoever sets a flag while the host listens rings it. The listener's flag and the done flag are each
written before the other is read, and either write can be seen late: a ring so missed is made up for
by the sleep's bound (``BELL_PAUSE``), not by a hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from harmony.runtime.channels import wait_until

MAX_WORKERS = 64  # worker status rows in the shared flags
BELL_PAUSE = 0.01  # seconds the host sleeps on the bell at most before it looks at the flags again
STATUS_BYTES = 512  # per worker: what it is doing or waiting for, UTF-8, for stall and failure reports


@dataclass
class Shared:
    """Cross-process flags in shared memory: which tasks finished this iteration, which replicas
    of an update read their inputs, whether the run was aborted, and per worker the task it runs
    and what it waits for (read by the launcher when a worker fails, dies or stalls)."""

    done: torch.Tensor  # int64 [tasks]: iteration + 1 once the task and all its outputs finished
    reads: torch.Tensor  # int64 [tasks]: iteration + 1 once a replicated UPD read its inputs
    abort: torch.Tensor  # int64 [1]: nonzero once any worker failed
    current: torch.Tensor | None = None  # int64 [MAX_WORKERS]: task id + 1 running now, 0 between tasks
    status: torch.Tensor | None = None  # uint8 [MAX_WORKERS, STATUS_BYTES]: NUL-padded text
    skips: torch.Tensor | None = None  # int64 [1]: iteration + 1 once fp16's check skips that iteration's step
    # int64 [tasks]: when each task's work was done (``time.perf_counter`` in ns, one clock for every
    # process of a host), which can precede its flag: a timed device's modelled end
    done_ns: torch.Tensor | None = None
    reads_ns: torch.Tensor | None = None  # int64 [tasks]: when a replicated UPD read its inputs, alike
    listening: torch.Tensor | None = None  # int64 [1]: nonzero while the host sleeps on the bell
    bell: Any = None  # a multiprocessing semaphore rung when a flag is set while the host listens

    def __post_init__(self) -> None:
        # numpy views of the same shared memory: polled from threads inside a device's memory scope,
        # they must not go through torch's dispatcher (and its tracking mode) thousands of times
        self._done = self.done.numpy()
        self._reads = self.reads.numpy()
        self._abort = self.abort.numpy()
        self._current = self.current.numpy() if self.current is not None else None
        self._status = self.status.numpy() if self.status is not None else None
        self._skips = self.skips.numpy() if self.skips is not None else np.zeros(1, dtype=np.int64)
        self._done_ns = self.done_ns.numpy() if self.done_ns is not None else np.zeros(len(self._done), dtype=np.int64)
        self._reads_ns = (self.reads_ns.numpy() if self.reads_ns is not None
                          else np.zeros(len(self._done), dtype=np.int64))
        self._listening = self.listening.numpy() if self.listening is not None else np.zeros(1, dtype=np.int64)

    def __getstate__(self) -> dict:
        return {"done": self.done, "reads": self.reads, "abort": self.abort, "current": self.current,
                "status": self.status, "skips": self.skips, "done_ns": self.done_ns, "reads_ns": self.reads_ns,
                "listening": self.listening, "bell": self.bell}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def is_done(self, task: int, iteration: int) -> bool:
        return int(self._done[task]) == iteration + 1

    def mark_done(self, task: int, iteration: int, at: float | None = None) -> None:
        """``task`` finished ``iteration``; its work was done ``at`` (``time.perf_counter``; default
        now), written before the flag that shows it."""
        self._done_ns[task] = round((time.perf_counter() if at is None else at) * 1e9)
        self._done[task] = iteration + 1
        self._ring()

    def done_at(self, task_ids: list[int]) -> float:
        """When the last of ``task_ids``, all done, had done its work (``time.perf_counter``; 0.0
        for none)."""
        return max((int(self._done_ns[t]) for t in task_ids), default=0) / 1e9

    def skip_step(self, iteration: int) -> None:
        """No update of ``iteration`` steps: its fp16 gradient overflowed (set before the NORM task
        is marked done, so every update that waited for it sees it)."""
        self._skips[0] = iteration + 1

    def step_skipped(self, iteration: int) -> bool:
        return int(self._skips[0]) == iteration + 1

    def mark_read(self, task: int, iteration: int, at: float | None = None) -> None:
        """Replica ``task`` read its inputs for ``iteration``, ``at`` (as ``mark_done``'s)."""
        self._reads_ns[task] = round((time.perf_counter() if at is None else at) * 1e9)
        self._reads[task] = iteration + 1
        self._ring()

    def read_at(self, task_ids: list[int]) -> float:
        """When the last of ``task_ids``, all read, had read its inputs (0.0 for none)."""
        return max((int(self._reads_ns[t]) for t in task_ids), default=0) / 1e9

    def has_read(self, task: int, iteration: int) -> bool:
        return int(self._reads[task]) == iteration + 1

    def set_abort(self) -> None:
        self._abort[0] = 1
        self._ring()

    def _ring(self) -> None:
        """Wake the host if it sleeps on the bell (see the module docs)."""
        if self.bell is not None and self._listening[0]:
            self.bell.release()

    # ------------------------------------------------------------ worker status
    def set_current(self, rank: int, task: int | None) -> None:
        if self._current is not None and rank < MAX_WORKERS:
            self._current[rank] = 0 if task is None else task + 1

    def current_task(self, rank: int) -> int | None:
        if self._current is None or rank >= MAX_WORKERS:
            return None
        value = int(self._current[rank])
        return value - 1 if value else None

    def set_status(self, rank: int, text: str) -> None:
        if self._status is None or rank >= MAX_WORKERS:
            return
        data = np.frombuffer(text.encode()[:STATUS_BYTES], dtype=np.uint8)
        row = self._status[rank]
        row[:len(data)] = data
        row[len(data):] = 0

    def get_status(self, rank: int) -> str:
        if self._status is None or rank >= MAX_WORKERS:
            return ""
        return bytes(self._status[rank]).rstrip(b"\0").decode(errors="replace")

    @classmethod
    def create(cls, tasks: int, path: str | None = None, create: bool = True, bell: Any = None) -> "Shared":
        """Flags for ``tasks`` tasks; with ``path``, in that file (mapped by every process that
        names it: torchrun's workers are not forked from one parent); with ``bell`` (a
        ``multiprocessing`` semaphore of the context that starts the workers), the host sleeps on
        it rather than polling (see the module docs)."""
        n = max(tasks, 1)
        status_words = MAX_WORKERS * STATUS_BYTES // 8
        skips = 2 * n + 1 + MAX_WORKERS + status_words  # where each part starts in one flat int64 buffer
        size = skips + 1 + 2 * n + 1
        if path is None:
            flat = torch.zeros(size, dtype=torch.int64).share_memory_()
        else:
            flat = torch.from_file(path, shared=True, size=size, dtype=torch.int64)
        status = flat[2 * n + 1 + MAX_WORKERS:skips].view(torch.uint8).view(MAX_WORKERS, STATUS_BYTES)
        return cls(flat[:n], flat[n:2 * n], flat[2 * n:2 * n + 1], flat[2 * n + 1:2 * n + 1 + MAX_WORKERS], status,
                   flat[skips:skips + 1], flat[skips + 1:skips + 1 + n], flat[skips + 1 + n:skips + 1 + 2 * n],
                   flat[skips + 1 + 2 * n:], bell)

    def aborted(self) -> bool:
        return bool(self._abort[0])

    def wait_done(self, task_ids: list[int], iteration: int, what: str, timeout: float, ring: bool = False) -> float:
        """Wait until ``task_ids`` are done this iteration; returns when the last did its work
        (``done_at``). ``ring``: the host's wait, asleep on the bell where there is one."""
        pending = list(task_ids)

        def ready() -> bool:
            pending[:] = [t for t in pending if not self.is_done(t, iteration)]
            return not pending

        def missing() -> str:
            return f"task(s) {pending} before {what}"

        if ring and self.bell is not None:
            self._wait_on_bell(ready, timeout, missing)
        else:
            wait_until(ready, self.aborted, timeout, missing)
        return self.done_at(task_ids)

    def _wait_on_bell(self, ready: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
        """``channels.wait_until``, asleep on the bell between looks (one listener: the host)."""
        self._listening[0] = 1
        try:
            wait_until(ready, self.aborted, timeout, what, nap=lambda: self.bell.acquire(timeout=BELL_PAUSE))
        finally:
            self._listening[0] = 0
            while self.bell.acquire(block=False):  # rings for the flags this wait has seen
                pass

