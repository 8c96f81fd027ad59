"""The comparison of modes a compile prints: every mode searched on the same profile, for the table
beside the chosen plan (``harmony compile`` without ``--no-compare``).

The searches are independent, and those of the per-GPU-swap baselines are nearly all of a
compile's time (searched as their own compile would, their task graphs hold hundreds of tasks
where pp's hold a few). So the table searches
them over fewer pack counts (``coarse``, measured in ``search.pack_doublings``; the table says which
rows), and in worker processes, one per core. Each worker
answers the table's row, not the search's task graph and estimate. Workers are forked (Linux):
a spawned one would re-run a user's script that calls ``harmony.compile`` without a main guard.
They log nothing (``_start_worker``); the compiling process logs what they found.
Elsewhere, with one core, in a daemonic process (which may not start children) or with
``workers=1``, the modes are searched one after the other.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import sys
from typing import Any, Callable, Iterator

from harmony.profiling.profiles import Profile
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import NoFeasibleConfiguration, SearchResult, freeze_heap, pack_doublings, search

log = logging.getLogger(__name__)

__all__ = ["compare_modes", "comparing", "row", "usable_cores"]

DOES_NOT_FIT = "does not fit"


def row(mode: str, result: SearchResult) -> dict[str, Any]:
    """The comparison table's row of one mode's search."""
    return {"mode": mode, "iteration_time": result.estimate.iteration_time, "swap_bytes": result.graph.swap_bytes(),
            "peak_memory": max(result.estimate.peak_memory.values(), default=0), "config": str(result.config),
            "explored": result.explored, "candidates": result.explored + result.pruned,
            "search_seconds": result.seconds}


def usable_cores() -> int:
    """Cores this process may run on (its affinity where the platform tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_SEARCH: tuple = ()  # a worker's arguments of ``_search_row`` after the mode, inherited at its fork


def _worker_row(mode: str) -> tuple[dict[str, Any], str | None]:
    return _search_row(mode, *_SEARCH)


def _search_row(mode: str, profile: Profile, machine: Machine, devices: int, minibatch: int, capacity: int,
                same_u: bool, gated: bool = False, coarse: bool = False) -> tuple[dict[str, Any], str | None]:
    """The mode's row, and why it fits nothing (None where it fits)."""
    try:
        options = {"gated": True} if gated else {}
        result = search(profile, machine, mode, devices, minibatch, capacity=capacity, same_u=same_u,
                        coarse=coarse, timeline=False, **options)
        return {**row(mode, result), "coarse": coarse and pack_doublings(mode, True) != pack_doublings(mode)}, None
    except NoFeasibleConfiguration as exc:
        return {"mode": mode, "iteration_time": None, "config": DOES_NOT_FIT}, str(exc)


def _start_worker(search_args: tuple) -> None:
    """A forked worker keeps the search's arguments it inherited (the profile is not pickled to it:
    a pickle taken while the compile's own search fills the profile's caches would race with it).
    It logs nothing: a handler writing to a console (rich's) may have been locked by another
    thread of the parent at the fork, and would stay locked in the child for good. And its
    collector leaves the parent's heap alone (``search.freeze_heap``): the search's task graphs
    trigger collections, which would otherwise walk torch's and the model's objects each time."""
    global _SEARCH
    _SEARCH = search_args
    logging.disable(logging.CRITICAL)
    freeze_heap()


def compare_modes(modes: list[str], profile: Profile, machine: Machine, devices: int, minibatch: int, capacity: int,
                  same_u: bool, workers: int | None = None,
                  on_done: Callable[[int, int], None] = lambda done, total: None, gated: bool = False,
                  coarse: bool = True) -> list[dict[str, Any]]:
    """One row per mode, in ``modes``' order, the modes that fit nothing last (``comparing``)."""
    with comparing(modes, profile, machine, devices, minibatch, capacity, same_u, workers, on_done, gated,
                   coarse) as rows:
        return rows()


@contextlib.contextmanager
def comparing(modes: list[str], profile: Profile, machine: Machine, devices: int, minibatch: int, capacity: int,
              same_u: bool, workers: int | None = None,
              on_done: Callable[[int, int], None] = lambda done, total: None, gated: bool = False,
              coarse: bool = True) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """Starts searching ``modes`` in worker processes and yields ``rows()``, which waits for them:
    what the ``with`` body does (a compile's own search) runs beside the workers. ``rows()`` gives
    one row per mode, in ``modes``' order, the modes that fit nothing last. ``workers``: processes to
    search in (None: one per usable core, at most one per mode); ``on_done(done, total)`` after each;
    ``gated``: plans whose updates wait for the whole gradient (``taskgraph.with_norm``); ``coarse``:
    the per-GPU-swap baselines searched over fewer pack counts (``search.pack_doublings``). Leaving
    the block early (an error) cancels the searches not started yet."""
    args = (profile, machine, devices, minibatch, capacity, same_u, gated, coarse)
    workers = min(len(modes), usable_cores() if workers is None else max(1, workers))
    rows: dict[str, dict[str, Any]] = {}

    def done(mode: str, answer: tuple[dict[str, Any], str | None]) -> None:
        rows[mode], refusal = answer
        if refusal is not None:
            log.info("%s", refusal)
        on_done(len(rows), len(modes))

    def ordered() -> list[dict[str, Any]]:
        table = [rows[m] for m in modes]
        return [r for r in table if r["config"] != DOES_NOT_FIT] + [r for r in table if r["config"] == DOES_NOT_FIT]

    if workers <= 1 or sys.platform != "linux" or multiprocessing.current_process().daemon:  # a daemon has no children
        def serially() -> list[dict[str, Any]]:
            for mode in modes:
                done(mode, _search_row(mode, *args))
            return ordered()
        yield serially
        return
    # forked, the workers receive the initializer's arguments as they are in memory, unpickled
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                                  initializer=_start_worker, initargs=(args,))
    try:
        futures = {pool.submit(_worker_row, mode): mode for mode in modes}

        def collected() -> list[dict[str, Any]]:
            for future in concurrent.futures.as_completed(futures):
                done(futures[future], future.result())
            return ordered()
        yield collected
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
