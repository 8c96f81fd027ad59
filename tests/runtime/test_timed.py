"""Timed devices (``runtime/timed.py``): work lasts what the cost model says, so a run's time is the
runtime's order and waits, comparable with the simulation of the plan's program
(``scheduler/simulator.py``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bench import timed as bench_timed
from harmony.runtime.timed import ITERATION, TimedDevice, Timing, scale_for, timed_machine
from harmony.scheduler.machine import nominal_machine


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
    simulation plays, and the runtime's own Python (a millisecond or two a task on this machine,
    which the timed machine does not model) is what separates them (``python -m bench.timed``)."""
    plan = bench_timed.compile_case("gpt2", mode, 2, "h100")
    case = bench_timed.run_case(bench_timed.Case("gpt2", mode, 2), plan, steps=2)
    assert abs(case.relative) < 0.03, (case.estimated, case.measured, case.worst_unit)
