"""A plan states the range its estimate cannot narrow: the iteration time at the fastest and the
slowest round of the machine's calibration (``Machine.compute_scale_range``), and a run says
whether it fell in it."""

from __future__ import annotations

import dataclasses

import torch

import harmony
from harmony.scheduler.machine import nominal_machine
import harmony.compiler as compiler
from harmony.cli import _estimate_range_text, _range_verdict
from harmony.running import _within_range


def _get_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def _compile(monkeypatch, scale_range):
    def calibrated(kind, devices, capacity):
        return dataclasses.replace(nominal_machine(kind, devices, capacity), compute_scale=1.5,
                                   compute_scale_range=scale_range)

    monkeypatch.setattr(compiler, "nominal_machine", calibrated)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    return harmony.compile(model, torch.nn.functional.cross_entropy, _get_batch, minibatch_size=8, devices=2,
                           device_memory="64KiB", mode="pp", probe=False, compare=False)


def test_a_plan_states_its_time_at_the_calibrations_fastest_and_slowest_rounds(monkeypatch, tmp_path):
    plan = _compile(monkeypatch, [1.2, 2.0])
    low, high = plan.estimate["iteration_time_range"]
    assert low < plan.estimate["iteration_time"] < high
    assert "at the 10th and 90th percentiles of the calibration's task readings" in _estimate_range_text(plan)
    plan.save(tmp_path / "plan")
    loaded = harmony.load_plan(tmp_path / "plan")
    assert loaded.estimate["iteration_time_range"] == [low, high]
    assert "10th and 90th percentiles of the calibration's task readings" in (tmp_path / "plan" / "summary.md").read_text()


def test_a_plan_whose_machine_read_one_scale_states_no_range(monkeypatch):
    plan = _compile(monkeypatch, None)
    assert "iteration_time_range" not in plan.estimate and _estimate_range_text(plan) == ""


def test_a_run_says_whether_it_fell_within_the_plans_range():
    inside = _within_range([0.010, 0.014], 0.012)
    assert inside == {"estimated_iteration_range": [0.010, 0.014], "within_estimated_range": True}
    assert _within_range([0.010, 0.014], 0.015)["within_estimated_range"] is False
    assert _within_range(None, 0.012) == {}
    assert "outside its range 10.0-14.0 ms" in _range_verdict(_within_range([0.010, 0.014], 0.015))
    assert _range_verdict({}) == ""
