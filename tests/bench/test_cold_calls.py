"""The cold-call benchmark: every condition timed on every layer, the process left as it was."""

from __future__ import annotations

import os

import pytest
import torch

from bench import cold_calls


def test_every_condition_times_every_layer_and_the_cores_and_threads_are_given_back():
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    result = cold_calls.measure(8)
    expected = {"back to back", "after a 1 ms sleep"} | {f"after a 1 ms sleep, neighbour: {k}" for k in cold_calls.NEIGHBOURS}
    assert set(result) == expected
    assert all(len(times) == 3 and all(t > 0 for t in times) for times in result.values())
    assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == threads


def test_a_neighbour_that_never_starts_is_an_error_not_a_row_measured_without_it(monkeypatch):
    monkeypatch.setattr(cold_calls, "_neighbour", lambda kind, stop, ready: None)  # exits at once, never ready
    monkeypatch.setattr(cold_calls, "_layers", lambda: [lambda: None])
    # no minute-long wait for a process that is gone: the readiness is read once
    monkeypatch.setattr(cold_calls.multiprocessing.synchronize.Event, "wait", lambda self, timeout=None: self.is_set())
    with pytest.raises(RuntimeError, match="neighbour process did not start"):
        cold_calls.measure(8)
