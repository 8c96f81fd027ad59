"""The machine-steadiness benchmark: its summary of a kind's samples, and one short pass over the cores."""

from __future__ import annotations

import os

import pytest

from bench import machine_drift


def test_the_summary_counts_the_slow_samples_and_how_much_slower_they_are():
    times = [1.0] * 8 + [1.9, 2.1]  # two samples in a slow spell, about twice the median
    median, share, ratio = machine_drift.summary(times)
    assert median == 1.0 and share == pytest.approx(0.2) and ratio == pytest.approx(2.0)
    assert machine_drift.summary([1.0, 1.1, 0.9]) == (1.0, 0.0, 1.0)  # a steady machine: no slow share


def test_one_pass_times_every_kind_on_every_core_and_gives_the_affinity_back():
    before = os.sched_getaffinity(0)
    samples = machine_drift.measure(0.0)
    assert set(samples) == {(core, kind) for core in before for kind in ("python", "small ops", "matmul", "memory")}
    assert all(len(times) == 1 and times[0] > 0 for times in samples.values())
    assert os.sched_getaffinity(0) == before
