"""The comparison of modes (``scheduler/comparison.py``): the same table searched in worker
processes as one after the other, and modes that fit nothing last."""

from __future__ import annotations

import logging
import pickle

import pytest

from harmony.profiling.profiles import Profile
from harmony.scheduler.comparison import DOES_NOT_FIT, compare_modes, comparing
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import pack_doublings, search
from harmony.scheduler.modes import MODES

from test_search import skewed_profile

MODES_COMPARED = ["dp", "dp-swap", "gpipe-swap", "1f1b-swap"]


def test_modes_compared_in_worker_processes_give_the_table_of_one_process():
    profile = skewed_profile(capacity=12_000_000)
    machine = Machine.from_spec("1080ti", 2)
    serial = compare_modes(MODES_COMPARED, profile, machine, 2, 6, profile.capacity, False, workers=1)
    progress = []
    parallel = compare_modes(MODES_COMPARED, profile, machine, 2, 6, profile.capacity, False, workers=2,
                             on_done=lambda done, total: progress.append((done, total)))

    def table(rows):
        return [{k: v for k, v in r.items() if k != "search_seconds"} for r in rows]

    assert table(parallel) == table(serial)
    assert [r["mode"] for r in serial] == MODES_COMPARED
    assert all(r["iteration_time"] > 0 and r["config"] != DOES_NOT_FIT for r in serial)
    assert progress == [(i, len(MODES_COMPARED)) for i in range(1, len(MODES_COMPARED) + 1)]


def test_the_workers_search_the_profile_they_inherit_unpickled_while_the_caller_searches_it(monkeypatch):
    """A profile pickled to the workers while the compile's own search filled its caches raced with
    that search ("dictionary changed size during iteration"): the workers inherit it at their fork."""
    profile = skewed_profile(capacity=12_000_000)
    machine = Machine.from_spec("1080ti", 2)
    serial = compare_modes(MODES_COMPARED, profile, machine, 2, 6, profile.capacity, False, workers=1)

    def refuse(self):
        raise pickle.PicklingError("the profile was pickled")

    monkeypatch.setattr(Profile, "__getstate__", refuse, raising=False)
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(profile)
    with comparing(MODES_COMPARED, profile, machine, 2, 6, profile.capacity, False, workers=2) as rows:
        search(profile, machine, "pp", 2, 6)  # fills the profile's caches meanwhile
        parallel = rows()
    assert [{k: v for k, v in r.items() if k != "search_seconds"} for r in parallel] == \
        [{k: v for k, v in r.items() if k != "search_seconds"} for r in serial]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_mode_that_fits_nothing_is_a_row_saying_so_after_the_others(workers, caplog):
    profile = skewed_profile(capacity=6_000_000)  # room for most modes; gpipe-swap's microbatches do not fit
    machine = Machine.from_spec("1080ti", 2)
    with caplog.at_level(logging.INFO, logger="harmony.scheduler.comparison"):
        rows = compare_modes(list(MODES), profile, machine, 2, 6, profile.capacity, False, workers=workers)
    assert sorted(r["mode"] for r in rows) == sorted(MODES)
    fitting = [r for r in rows if r["config"] != DOES_NOT_FIT]
    refused = [r for r in rows if r["config"] == DOES_NOT_FIT]
    assert fitting and refused and rows == fitting + refused
    assert all(r["iteration_time"] is None for r in refused)
    # why, logged by this process (a forked worker logs nothing: see the module docs)
    assert all(any(f"no {r['mode']} configuration fits" in m for m in caplog.messages) for r in refused)


def _compare_in_a_daemon(out) -> None:
    profile = skewed_profile(capacity=12_000_000)
    rows = compare_modes(["dp", "dp-swap"], profile, Machine.from_spec("1080ti", 2), 2, 6, profile.capacity, False,
                         workers=2)
    out.put([r["mode"] for r in rows])


def test_a_daemonic_process_compares_the_modes_itself():
    """A daemonic process may not start children (a compile inside another tool's worker)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    worker = ctx.Process(target=_compare_in_a_daemon, args=(out,), daemon=True)
    worker.start()
    assert out.get(timeout=60) == ["dp", "dp-swap"]
    worker.join(timeout=10)
    assert worker.exitcode == 0


def test_coarse_rows_search_no_more_pack_counts_never_beat_the_full_search_and_say_so():
    """The table's baselines are searched over a subset of the pack counts a compile of that mode
    tries (``search.pack_doublings``): never faster than the full search, and marked coarse."""
    profile = skewed_profile(times=(1.0, 3.0, 1.0, 2.0, 1.5, 1.0, 2.5, 1.0, 1.5, 2.0, 1.0, 3.0), capacity=12_000_000)
    machine = Machine.from_spec("1080ti", 2)
    modes = ["dp", "dp-swap", "gpipe-swap-r", "1f1b-swap"]
    coarse = compare_modes(modes, profile, machine, 2, 8, profile.capacity, False, workers=1)
    full = compare_modes(modes, profile, machine, 2, 8, profile.capacity, False, workers=1, coarse=False)
    assert [r["mode"] for r in coarse] == [r["mode"] for r in full] == modes
    assert [r["coarse"] for r in coarse] == [False, True, True, True]  # dp's search is the same either way
    assert not any(r["coarse"] for r in full)
    for c, f in zip(coarse, full):
        assert f["iteration_time"] <= c["iteration_time"]
    # no more candidates (on twelve layers the ladders nearly meet), no more simulations
    assert sum(r["candidates"] for r in coarse) <= sum(r["candidates"] for r in full)
    assert sum(r["explored"] for r in coarse) <= sum(r["explored"] for r in full)
    assert full[0] == {**coarse[0], "search_seconds": full[0]["search_seconds"]}


def test_pack_doublings_of_a_coarse_search_are_a_subset_of_the_full_one():
    for mode in MODES:
        (cb, cf), (fb, ff) = pack_doublings(mode, coarse=True), pack_doublings(mode)
        assert cb <= fb and cf <= ff
        if mode in ("pp", "dp"):
            assert (cb, cf) == (fb, ff)
