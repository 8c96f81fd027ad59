"""Which frozen weights travel in low precision (``profiling/casts.py``): those whose every use
under autocast is a cast to the low dtype (a linear layer's), not one an op reads in float32 (a
LayerNorm's, an embedding table), not a trainable or tied one, and none in float32 plans."""

from __future__ import annotations

import torch
from torch import nn

import harmony
from harmony.profiling.casts import low_copies


class Transposed(nn.Module):
    """A weight read through a view (``w.t()``) before the matmul casts it: not a plain cast."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def graph_of(model: nn.Module, trainable: tuple[str, ...] = ("5.",)):
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(trainable))
    return harmony.decompose(model, (torch.zeros(2, 5, dtype=torch.long),))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), Transposed(), nn.Linear(8, 8),
                         nn.Linear(8, 4))


def test_frozen_weights_that_autocast_only_casts_travel_in_bf16_and_the_rest_in_float32():
    copies = low_copies(graph_of(model()), "cpu", torch.bfloat16)
    assert {c.name: (c.layer, c.dtype, c.saved) for c in copies} == {
        "1.weight": (1, "bfloat16", 8 * 8 * 2), "1.bias": (1, "bfloat16", 8 * 2),
        "4.weight": (4, "bfloat16", 8 * 8 * 2), "4.bias": (4, "bfloat16", 8 * 2),
    }


def test_a_trainable_linear_keeps_its_float32_copy():
    copies = low_copies(graph_of(model(), trainable=("1.", "5.")), "cpu", torch.float16)
    assert sorted(c.name for c in copies) == ["4.bias", "4.weight"]
    assert {c.dtype for c in copies} == {"float16"}


def test_a_float32_plan_carries_nothing_low():
    assert low_copies(graph_of(model()), "cpu", None) == []


def test_a_tied_frozen_weight_keeps_float32():
    torch.manual_seed(0)
    tied = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False))
    tied[2].weight = tied[0].weight
    graph = graph_of(tied, trainable=("1.",))
    assert graph.ties
    assert [c.name for c in low_copies(graph, "cpu", torch.bfloat16)] == []
