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
    ledger.idle()
    assert ledger.current == 550
    assert ledger.peak == 1_050


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
    ledger.run([(1, STATE), (1, 0)], planned=500)
    ledger.compare(400)
    assert ledger.shortfall == 0
    ledger.compare(530)
    ledger.compare(510)
    assert ledger.shortfall == 30


def test_a_memory_plan_keeps_per_unit_bytes_through_msgpack_and_falls_back_to_the_reserve():
    plan = MemoryPlan(devices={0: 900}, tasks={3: 800}, reserves={3: 700}, prefetch={}, units={3: (600, 700)})
    again = MemoryPlan.from_dict(plan.to_dict())
    assert again == plan
    assert again.unit_bytes(3, 1) == 700
    assert again.unit_bytes(3, 5) == 700  # a unit the plan does not list: the reserve
    old = {k: v for k, v in plan.to_dict().items() if k != "units"}  # a plan written before units
    assert MemoryPlan.from_dict(old).unit_bytes(3, 0) == 700
