"""Timed devices (``runtime/timed.py``): work lasts what the cost model says, so a run's time is the
runtime's order and waits, comparable with the simulation of the plan's program
(``scheduler/simulator.py``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bench import timed as bench_timed
from bench.common import with_tasks
from harmony.runtime.flags import Shared
from harmony.runtime.streams import Stream
from harmony.runtime.timed import ITERATION, TimedDevice, Timing, scale_for, timed_machine
from harmony.scheduler.machine import nominal_machine
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import Configuration


SIMPLE = 0.6  # of an uncapped plan's device peak: one pack per device


def _device(units: dict, bandwidth: float = 1e6) -> TimedDevice:
    return TimedDevice("timed0", 1 << 30, Timing(units, bandwidth))


def test_a_unit_lasts_its_modelled_time_and_a_copy_ordered_after_it_starts_at_its_end():
    device = _device({(3, 0): 0.2})
    began = time.perf_counter()
    copied: list[float] = []
    with device.unit(3, 0):
        event = device.mark()
        waiter = threading.Thread(target=lambda: (device.wait(event), copied.append(time.perf_counter())))
        waiter.start()
    ended = time.perf_counter()
    waiter.join()
    assert 0.2 <= ended - began < 0.3
    assert copied[0] >= began + 0.2


def test_a_copy_lasts_its_bytes_over_the_bandwidth_and_moves_the_values():
    device = _device({}, bandwidth=8_000 / 0.1)  # 8,000 bytes in 0.1 s
    t = torch.arange(1000, dtype=torch.float64)
    began = time.perf_counter()
    out = device.to_device(t)
    assert 0.1 <= time.perf_counter() - began < 0.2
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    assert device.mark() is None  # outside a unit nothing is pending


def test_the_hosts_python_between_two_units_is_hidden_behind_the_first():
    device = _device({(1, 0): 0.2, (1, 1): 0.05})
    with device.unit(1, 0):
        pass
    first = device.take_unit_starts()[(1, 0)]
    time.sleep(0.03)  # the host's work between the units, shorter than the first unit
    with device.unit(1, 1):
        pass
    assert device.take_unit_starts()[(1, 1)] == pytest.approx(first + 0.2, abs=1e-9)


def test_a_unit_starts_late_by_what_the_host_took_beyond_the_unit_before_it():
    device = _device({(1, 0): 0.01, (1, 1): 0.01})
    with device.unit(1, 0):
        pass
    first = device.take_unit_starts()[(1, 0)]
    time.sleep(0.1)
    with device.unit(1, 1):
        pass
    assert device.take_unit_starts()[(1, 1)] >= first + 0.01 + 0.09


def test_a_unit_starts_no_earlier_than_what_its_thread_waited_for():
    device = _device({(1, 0): 0.05, (1, 1): 0.05})
    with device.unit(1, 0):
        pass
    first = device.take_unit_starts()[(1, 0)]
    device.ready(first + 0.08)  # an input that arrived after the first unit ended
    with device.unit(1, 1):
        pass
    assert device.take_unit_starts()[(1, 1)] == pytest.approx(first + 0.08, abs=1e-9)


def test_a_stream_job_copies_from_when_it_was_queued_and_ends_at_its_modelled_end():
    device = _device({}, bandwidth=8_000 / 0.1)
    stream = Stream("timed-test", setup=lambda: None, sync=device.stream_sync, begin=device.job_begins)
    try:
        t = torch.zeros(1000, dtype=torch.float64)
        before = time.perf_counter()
        first = stream.submit(device.to_device, t)
        second = stream.submit(device.to_device, t)  # behind the first: starts at its end
        after = time.perf_counter()
        first.result(), second.result()
    finally:
        stream.close()
    assert before + 0.1 <= first.ended <= after + 0.1
    assert second.ended == pytest.approx(first.ended + 0.1, abs=1e-9)


def test_a_job_that_copies_nothing_is_done_with_the_copies_before_it_not_when_it_was_queued():
    device = _device({}, bandwidth=8_000 / 0.05)
    stream = Stream("timed-test", setup=lambda: None, sync=device.stream_sync, begin=device.job_begins)
    try:
        copy = stream.submit(device.to_device, torch.zeros(1000, dtype=torch.float64))
        copy.result()
        time.sleep(0.05)
        marker = stream.submit(lambda: None)
        marker.result()
    finally:
        stream.close()
    assert marker.ended == copy.ended


def test_a_task_marked_done_says_when_its_work_was_done():
    shared = Shared.create(3)
    shared.mark_done(0, 0, at=12.5)
    shared.mark_done(2, 0, at=13.25)
    assert shared.done_at([0, 2]) == pytest.approx(13.25)
    assert shared.wait_done([0, 2], 0, "a test", timeout=1.0) == pytest.approx(13.25)
    before = time.perf_counter()
    shared.mark_done(1, 0)  # no time given: now
    assert before <= shared.done_at([1]) <= time.perf_counter()


def test_a_copy_queued_between_two_units_counts_as_queued_where_the_first_ended():
    """The host's Python that ends one task and begins the next is hidden behind the unit before it,
    for the copies it queues as for the next unit: the program starts them as the unit ends."""
    device = _device({(1, 0): 0.2}, bandwidth=8_000 / 0.05)
    stream = Stream("timed-test", setup=lambda: None, sync=device.stream_sync, begin=device.job_begins,
                    issued=device.issued_at)
    try:
        with device.unit(1, 0):
            pass
        first_end = device.take_unit_starts()[(1, 0)] + 0.2
        time.sleep(0.03)  # the host's work after the unit, shorter than it
        copy = stream.submit(device.to_device, torch.zeros(1000, dtype=torch.float64))
        copy.result()
    finally:
        stream.close()
    assert copy.ended == pytest.approx(first_end + 0.05, abs=1e-9)


def test_a_copy_queued_off_the_compute_thread_counts_as_queued_when_it_was():
    device = _device({(1, 0): 0.2})
    with device.unit(1, 0):
        pass
    before = time.perf_counter()
    queued: list[float] = []
    other = threading.Thread(target=lambda: queued.append(device.issued_at()))
    other.start()
    other.join()
    assert before <= queued[0] <= time.perf_counter()


def test_a_replica_marked_read_says_when_it_read():
    shared = Shared.create(3)
    shared.mark_read(0, 0, at=7.5)
    shared.mark_read(1, 0, at=8.0)
    assert shared.has_read(0, 0) and shared.has_read(1, 0) and not shared.has_read(2, 0)
    assert shared.read_at([0, 1]) == pytest.approx(8.0)
    assert shared.done_at([0, 1]) == 0.0  # reads and completions are kept apart


def test_a_timing_scales_every_unit_and_copy_alike_to_make_an_iteration_last_a_second():
    machine = timed_machine(nominal_machine("cpu", 2, 1 << 20))
    assert machine.d2h == machine.h2d == machine.d2d == machine.msg and not machine.host_link_shared
    assert machine.task_overhead == machine.iteration_overhead == machine.latency == 0.0
    plan = bench_timed.compile_case("gpt2", "pp", 2, "h100", memory=SIMPLE)
    machine = timed_machine(plan.profile.machine)
    plain, scaled = (Timing.of(plan.tasks, plan.profile, machine, scale) for scale in (1.0, 4.0))
    assert scaled.units == pytest.approx({k: 4 * s for k, s in plain.units.items()})
    assert scaled.copy_seconds(1000) == pytest.approx(4 * plain.copy_seconds(1000))
    assert scale_for(0.25) == pytest.approx(4 * ITERATION) and scale_for(100 * ITERATION) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_a_two_device_timed_run_takes_its_simulated_time_within_three_percent(mode):
    """Packs that swap their state in and out of two devices: the run plays the program the
    simulation plays (``python -m bench.timed``)."""
    plan = bench_timed.compile_case("gpt2", mode, 2, "h100")
    case = bench_timed.run_case(bench_timed.Case("gpt2", mode, 2), plan, steps=2)
    assert abs(case.relative) < 0.03, (case.estimated, case.measured, case.worst_unit)


@pytest.mark.slow
def test_a_timed_run_with_kept_activations_takes_its_simulated_time_within_three_percent():
    """The forward keeps its activations on the device and the backward recomputes nothing: the
    run holds and times them as the simulation of its program does."""
    plan = bench_timed.compile_case("resnet", "pp", 2, "h100")
    last = len(plan.profile.layers) - 1
    packs = [(0, 1), (2, last)]
    config = Configuration(2, packs, 2, packs, keep=((0, 1),))
    kept = with_tasks(plan, generate("pp", plan.profile, config, 2, plan.tasks.minibatch))
    kept.options.update(planned_memory=4 * plan.options["planned_memory"], device_memory=4 * plan.options["device_memory"])
    kept.promise_memory()
    case = bench_timed.run_case(bench_timed.Case("resnet", "pp", 2), kept, steps=2)
    assert abs(case.relative) < 0.03, (case.estimated, case.measured, case.worst_unit)
