"""The accuracy benchmark's reading of its own repeatability."""

import pytest

from bench.estimate_accuracy import repeat_error


def test_repeat_error_compares_interleaved_halves_of_the_runs_without_their_warm_ups():
    # runs 1 and 3 (one half) at 10 ms, runs 2 and 4 at 12.5 ms; the first iteration of each is dropped
    runs = [[1.0, 0.010, 0.010], [1.0, 0.0125, 0.0125], [1.0, 0.010, 0.010], [1.0, 0.0125, 0.0125]]
    assert repeat_error(runs) == pytest.approx(-0.2)


def test_repeat_error_needs_two_runs():
    assert repeat_error([[1.0, 0.01, 0.01]]) is None
