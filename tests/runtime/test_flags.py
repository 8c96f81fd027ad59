"""The cross-process flags (``runtime/flags.py``): a wait that times out names what it still lacks."""

import pytest

from harmony.runtime.flags import Shared


def test_a_timed_out_wait_names_only_the_tasks_still_missing():
    shared = Shared.create(4)
    shared.mark_done(1, iteration=0)
    shared.mark_done(3, iteration=0)
    with pytest.raises(TimeoutError, match=r"task\(s\) \[0, 2\] before the update"):
        shared.wait_done([0, 1, 2, 3], iteration=0, what="the update", timeout=0.01)


def test_a_wait_ends_when_another_worker_aborts():
    from harmony.runtime.channels import Aborted

    shared = Shared.create(2)
    shared.set_abort()
    with pytest.raises(Aborted):
        shared.wait_done([0], iteration=0, what="the update", timeout=5)


def _ringing(tasks: int) -> Shared:
    import multiprocessing

    return Shared.create(tasks, bell=multiprocessing.get_context("fork").Semaphore(0))


def test_the_host_asleep_on_the_bell_wakes_when_the_task_it_waits_for_is_marked_done(monkeypatch):
    import threading
    import time

    from harmony.runtime import flags

    monkeypatch.setattr(flags, "BELL_PAUSE", 30.0)  # a wake-up by the bound would take the whole test
    shared = _ringing(3)
    threading.Timer(0.05, shared.mark_done, args=(2, 0)).start()
    began = time.monotonic()
    shared.wait_done([2], iteration=0, what="the update", timeout=60, ring=True)
    assert time.monotonic() - began < 5
    assert not shared._listening[0]  # nobody rings for a host that stopped listening


def test_the_host_asleep_on_the_bell_wakes_when_a_worker_aborts(monkeypatch):
    import threading

    from harmony.runtime import flags
    from harmony.runtime.channels import Aborted

    monkeypatch.setattr(flags, "BELL_PAUSE", 30.0)
    shared = _ringing(1)
    threading.Timer(0.05, shared.set_abort).start()
    with pytest.raises(Aborted):
        shared.wait_done([0], iteration=0, what="the update", timeout=60, ring=True)


def test_a_ring_the_host_missed_costs_it_the_bells_bound_not_a_hang(monkeypatch):
    """The done flag seen late by the host, and the host's listening seen late by the worker: no
    ring, and the host looks again after ``BELL_PAUSE``."""
    import time

    from harmony.runtime import flags

    monkeypatch.setattr(flags, "BELL_PAUSE", 0.05)
    shared = _ringing(1)
    looks = []

    def ready_late() -> bool:
        looks.append(time.monotonic())
        if len(looks) == 2:
            shared._done[0] = 1  # set without a ring, as if the worker had read ``listening`` stale
        return len(looks) > 2

    began = time.monotonic()
    shared._wait_on_bell(ready_late, timeout=5, what=lambda: "a test")
    assert len(looks) == 3 and looks[2] - began >= 0.05
