"""bench/pattern_models: models written as outside scripts write them train like eager in pp and dp."""

from __future__ import annotations

import pytest

from bench import pattern_models


@pytest.mark.parametrize("name", ["lstm", "tutorial_cnn", "two_heads"])
def test_a_pattern_model_trains_like_eager_within_capacity(name):
    row = pattern_models.run(name, "pp")
    assert "error" not in row, row.get("error")
    assert row["loss_error"] <= 1e-12 and row["param_error"] <= 1e-12
    assert 0 < row["peak"] <= row["capacity"]
