"""bench/hf_models: a Hugging Face architecture trains like eager and its row says so; a failing one
is a row with its error, in the table and in the markdown."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench import hf_models  # noqa: E402


@pytest.mark.slow
def test_an_architecture_row_reports_errors_against_eager_and_the_peak():
    row = hf_models.run("albert", "pp")
    assert "error" not in row, row.get("error")
    assert row["loss_error"] <= 1e-9 and row["param_error"] <= 1e-9
    assert 0 < row["peak"] <= row["capacity"]


def test_a_failing_architecture_is_a_row_with_its_error():
    rows = [{"model": "m", "mode": "pp", "error": "HarmonyError: " + "x" * 300, "seconds": 1.0}]
    text = hf_models.markdown(rows, "header")
    assert "| m | pp | - | - | - | HarmonyError: xxx" in text and "…" in text
    hf_models.table(rows)  # renders
