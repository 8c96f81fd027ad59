"""The ledger (``runtime/ledger.py``): a device's memory as the plan counts it, once per buffer."""

from __future__ import annotations

import gc

import torch

from harmony.runtime.ledger import STATE, Ledger
from harmony.scheduler.tasks import MemoryPlan


def _bytes(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def test_a_held_buffer_counts_until_it_is_freed():
    ledger = Ledger()
    t = _bytes(100)
    ledger.hold(t, owner=(1, 0))
    assert ledger.current == 100
    del t
    gc.collect()
    assert ledger.current == 0
    assert ledger.peak == 100


def test_views_of_one_storage_count_once():
    ledger = Ledger()
    t = _bytes(100)
    ledger.hold([t, t[:10], t[50:]], owner=(1, 0))
    assert ledger.current == 100


def test_the_running_unit_holds_its_planned_bytes_with_its_own_buffers_inside_them():
    ledger = Ledger()
    state, inputs, beside = _bytes(300), _bytes(200), _bytes(50)
    ledger.hold(state, (1, STATE))
    ledger.hold(inputs, (1, 0))
    ledger.hold(beside, (1, 1))  # the next microbatch's inputs, prefetched: beside the running unit
    ledger.run([(1, STATE), (1, 0)], planned=1_000)
    assert ledger.current == 1_000 + 50
    ledger.run([(1, STATE), (1, 0)], planned=400)  # its buffers exceed the plan: they count as they are
    assert ledger.current == 500 + 50
    assert ledger.peak == 1_050


def test_what_an_ended_unit_still_holds_is_leaving_unless_kept():
    ledger = Ledger()  # an emulated device's plan: outputs leaving are not counted
    state, sent, kept, nxt = _bytes(300), _bytes(200), _bytes(40), _bytes(50)
    ledger.hold(state, (1, STATE))
    ledger.hold([sent, kept], (1, 0))
    ledger.hold(nxt, (1, 1))
    ledger.run([(1, STATE), (1, 0)], planned=600)
    ledger.run([(1, STATE), (1, 1)], planned=600, keep=lambda: [kept])  # unit 0 ends: its send leaves
    assert ledger.current == 600 + 40  # the kept LOCAL output lies beside the running unit
    assert ledger.occupied == 600 + 40 + 200  # the send is still on the device until it has left
    ledger.idle(keep=lambda: [kept])  # the task ends: its state (weights evicted) leaves too
    assert ledger.current == 40
    assert ledger.occupied == 40 + 200 + 300 + 50
    del sent
    gc.collect()
    assert ledger.occupied == 40 + 300 + 50


def test_a_gpu_plan_counts_outputs_until_they_have_left():
    ledger = Ledger(count_leaving=True)
    sent = _bytes(200)
    ledger.hold(sent, (1, 0))
    ledger.run([(1, STATE), (1, 0)], planned=500)
    ledger.idle()
    assert ledger.current == ledger.occupied == 200


def test_a_buffer_claimed_by_another_owner_moves_into_its_unit():
    ledger = Ledger()
    received = _bytes(80)
    ledger.hold(received)  # a receive buffer nobody has claimed yet
    ledger.run([(2, STATE), (2, 0)], planned=500)
    assert ledger.current == 580
    ledger.hold(received, (2, 0))  # its consumer fetched it: inside the unit's plan now
    assert ledger.current == 500


def test_compare_records_only_what_the_real_memory_held_beyond_the_ledger():
    ledger = Ledger()
    leaving = _bytes(20)
    ledger.hold(leaving, (0, 0))
    ledger.run([(0, STATE), (0, 0)], planned=100)
    ledger.run([(1, STATE), (1, 0)], planned=500)  # task 0's output is leaving: the plan leaves it out
    assert ledger.current == 500
    ledger.compare(lambda: 400)
    assert ledger.shortfall == 0
    ledger.compare(lambda: 550)
    ledger.compare(lambda: 510)
    assert ledger.shortfall == 30  # against what the ledger knows is there: 500 + 20


def test_a_copy_admitted_counts_as_being_made_until_it_is_held():
    ledger = Ledger()
    ledger.run([(1, STATE), (1, 0)], planned=500)
    assert ledger.admit(300, limit=1_000, owner=(1, 1))
    assert not ledger.admit(300, limit=1_000, owner=(1, 1)), "a second copy must see the first one being made"
    assert ledger.occupied == 800 and ledger.current == 500
    copy = _bytes(300)
    ledger.made(300, copy, (1, 1))
    assert ledger.occupied == ledger.current == 800
    assert ledger.admit(10_000, limit=None)  # a copy that must be made is admitted regardless
    ledger.made(10_000)  # and given up: nothing held
    assert ledger.occupied == 800


def test_a_copy_for_the_running_unit_counts_inside_its_planned_bytes():
    """A prefetch of a task's state that runs only once the task started is the task's own load,
    which its unit's planned bytes already hold: counted outside, it would be refused."""
    ledger = Ledger()
    ledger.run([(2, STATE), (2, 0)], planned=800)  # the unit's 800 bytes include its 300-byte state
    assert ledger.admit(300, limit=900, owner=(2, STATE))
    assert ledger.occupied == 800
    assert not ledger.admit(300, limit=900, owner=(3, STATE)), "another task's copy still counts beside the unit"
    ledger.made(300, _bytes(300), (2, STATE))
    assert ledger.occupied == ledger.current == 800


def test_a_memory_plan_keeps_per_unit_bytes_through_msgpack_and_falls_back_to_the_reserve():
    plan = MemoryPlan(devices={0: 900}, tasks={3: 800}, reserves={3: 700}, prefetch={}, units={3: (600, 700)})
    again = MemoryPlan.from_dict(plan.to_dict())
    assert again == plan
    assert again.unit_bytes(3, 1) == 700
    assert again.unit_bytes(3, 5) == 700  # a unit the plan does not list: the reserve
    old = {k: v for k, v in plan.to_dict().items() if k != "units"}  # a plan written before units
    assert MemoryPlan.from_dict(old).unit_bytes(3, 0) == 700


def test_a_freed_buffer_leaves_the_ledger_only_after_the_tracker_stops_counting_it():
    """Both learn of a free from weak references to one storage, and Python calls the later one
    (the ledger's) first: a comparison made between the two callbacks must not find the tracker
    counting bytes the ledger has let go (a shortfall of exactly one buffer, seen in the suite)."""
    import weakref

    from harmony.runtime.memory import MemoryTracker

    tracker = MemoryTracker(None, "emu")
    ledger = Ledger(tracker=tracker)
    with tracker:
        t = torch.zeros(512, dtype=torch.float32)
    seen = []
    between = weakref.ref(t.untyped_storage(), lambda _: seen.append((tracker.current, ledger.occupied)))
    ledger.hold(t, (1, STATE))
    assert tracker.current == ledger.occupied == 2048
    del t
    gc.collect()
    assert seen == [(2048, 2048)], "between the two callbacks the ledger had let go while the tracker still counted"
    assert tracker.current == ledger.occupied == 0
    assert between() is None


def test_a_buffer_freed_on_another_thread_while_the_ledger_compares_is_no_shortfall():
    """The real count and the ledger's are read as one: a buffer freed between the two readings
    would show as a shortfall of that buffer though the device never held more than the ledger
    knew."""
    import threading

    ledger = Ledger()
    box = [_bytes(1000)]
    ledger.hold(box[0], (1, STATE))
    freer = threading.Thread(target=box.clear)  # drops the last reference: the ledger's release

    def real() -> int:
        counted = 1000  # the device holds the buffer when its count is read
        freer.start()
        freer.join(timeout=0.2)  # the free comes now, while the comparison is under way
        return counted

    ledger.compare(real)
    freer.join()
    assert ledger.shortfall == 0
    assert ledger.current == 0  # the free went through once the comparison was done
