"""The cold-call benchmark: every condition timed on every layer, the process left as it was."""

from __future__ import annotations

import os

import torch

from bench import cold_calls


def test_every_condition_times_every_layer_and_the_cores_and_threads_are_given_back():
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    result = cold_calls.measure(8)
    expected = {"back to back", "after a 1 ms sleep"} | {f"after a 1 ms sleep, neighbour: {k}" for k in cold_calls.NEIGHBOURS}
    assert set(result) == expected
    assert all(len(times) == 3 and all(t > 0 for t in times) for times in result.values())
    assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == threads
