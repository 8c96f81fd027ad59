"""The comparison's note tells a user when Harmony's other mode is estimated faster than the compiled one."""

import dataclasses

import pytest
import torch

import harmony


@pytest.fixture(scope="module")
def plan():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def get_batch(batch_size, step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

    return harmony.compile(model, torch.nn.functional.cross_entropy, get_batch, minibatch_size=8, devices=2,
                           device_memory="64KiB", mode="pp", probe=False, compare=False)


def _rows(**times):
    return [{"mode": mode.replace("_", "-"), "iteration_time": t, "config": "", "swap_bytes": 0, "peak_memory": 0}
            for mode, t in times.items()]


def test_a_faster_dp_is_named_with_how_to_compile_it(plan):
    compared = dataclasses.replace(plan, comparison=_rows(pp=0.012, dp=0.010, dp_swap=0.005))
    assert compared.faster_mode() == ("dp", pytest.approx(1.2))
    assert "dp is estimated 1.20x faster than pp here: compile with `--mode dp`" in compared.comparison_note()
    assert "--mode dp" in compared.summary()


def test_baselines_and_near_ties_are_not_recommended(plan):
    # a per-GPU-swap baseline is a comparison, not a mode to train with; 3% is within the estimate's noise
    assert dataclasses.replace(plan, comparison=_rows(pp=0.010, dp=0.0097, dp_swap=0.005)).faster_mode() is None
    assert dataclasses.replace(plan, comparison=_rows(pp=0.010, dp=None)).faster_mode() is None
    assert dataclasses.replace(plan, comparison=_rows(pp=0.010, dp=0.012)).comparison_note() == ""
