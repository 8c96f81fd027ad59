"""bench/tv_models: a torchvision network that trains on no fewer than two samples (BatchNorm over
a 1x1 map, in-place activations after memoized BatchNorms) trains like eager, and its row says so."""

from __future__ import annotations

import pytest

pytest.importorskip("torchvision")

from bench import tv_models  # noqa: E402


@pytest.mark.slow
def test_mobilenet_v3_on_cifar_sized_images_trains_like_eager_on_microbatches_of_two_or_more():
    row = tv_models.run("mobilenet_v3_small", "pp")
    assert "error" not in row, row.get("error")
    assert row["u_min"] == 2
    assert row["loss_error"] <= 1e-9 and row["param_error"] <= 1e-9
    assert 0 < row["peak"] <= row["capacity"]
    tv_models.table([row])  # renders
