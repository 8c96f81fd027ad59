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
