"""Which weights travel in low precision (``profiling/casts.py``): those whose every use under
autocast is a cast to the low dtype (a linear layer's), not one an op reads in float32 (a
LayerNorm's, an embedding table), not a tied one, and none in float32 plans; a trainable one only
in the profile of plans whose host steps it (``Profile.for_update``)."""

from __future__ import annotations

import torch
from torch import nn

import harmony
from harmony.profiling.casts import low_copies
from harmony.profiling.profiles import LayerProfile, LayerSample, PackSample, Profile


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


def test_weights_that_autocast_only_casts_travel_in_bf16_and_the_rest_in_float32():
    copies = low_copies(graph_of(model()), "cpu", torch.bfloat16)
    # the host casts a trainable copy after each step of it (timed here); a frozen one once
    assert all((c.cast_time > 0) == c.trainable for c in copies)
    assert {c.name: (c.layer, c.dtype, c.saved, c.trainable) for c in copies} == {
        "1.weight": (1, "bfloat16", 8 * 8 * 2, False), "1.bias": (1, "bfloat16", 8 * 2, False),
        "4.weight": (4, "bfloat16", 8 * 8 * 2, False), "4.bias": (4, "bfloat16", 8 * 2, False),
        "5.weight": (5, "bfloat16", 8 * 4 * 2, True), "5.bias": (5, "bfloat16", 4 * 2, True),
    }


def test_a_trainable_copy_is_counted_low_only_in_the_profile_of_host_updates():
    copies = low_copies(graph_of(model(), trainable=("1.", "5.")), "cpu", torch.float16)
    assert {c.dtype for c in copies} == {"float16"}
    profile = Profile(source="analytic", device="test", capacity=1 << 20, u_fmax=1, u_bmax=1, layers=[
        LayerProfile(index=i, name=str(i), w_bytes=1000, dw_bytes=1000, k_bytes=0, b_bytes=0, upd_time_device=0.0,
                     upd_time_host=0.0, fwd_samples=[LayerSample(1, 0.0, 0.0, 0.0, 5000, 6000, 8, 8, 8)],
                     bwd_samples=[LayerSample(1, 0.0, 0.0, 0.0, 5000, 6000, 8, 8, 8)]) for i in range(6)])
    profile.carry(copies)
    device, host = profile.for_update("device"), profile.for_update("host")
    assert device is profile and host is profile.for_update("host")  # made once
    assert [c.name for c in device.low_copies] == ["4.bias", "4.weight"]
    assert sorted(c.name for c in host.low_copies) == ["1.bias", "1.weight", "4.bias", "4.weight", "5.bias", "5.weight"]
    saved = {layer: sum(c.saved for c in copies if c.layer == layer) for layer in range(6)}
    # the host update of a trainable copy's layer casts it anew
    cast = {layer: sum(c.cast_time for c in copies if c.layer == layer) for layer in range(6)}
    assert [layer.upd_time_host for layer in device.layers] == [0.0] * 6
    assert [layer.upd_time_host for layer in host.layers] == [cast[i] for i in range(6)] and cast[1] > 0
    assert [layer.w_bytes for layer in device.layers] == [1000 - saved[i] * (i == 4) for i in range(6)]
    assert [layer.w_bytes for layer in host.layers] == [1000 - saved[i] for i in range(6)]
    assert [layer.bwd_samples[0].bwd_peak for layer in host.layers] == [6000 - saved[i] for i in range(6)]
    profile.add_packs([PackSample(first=4, last=5, u=1, fwd_peak=9000, bwd_peak=9000)])  # measured in float32
    assert (device.packs[0].bwd_peak, host.packs[0].bwd_peak) == (9000 - saved[4], 9000 - saved[4] - saved[5])
    assert profile.for_graph(type("G", (), {"low_copies": {"4.weight": "float16"}})) is device
    assert profile.for_graph(type("G", (), {"low_copies": {c.name: c.dtype for c in host.low_copies}})) is host
    # a host-updated plan stepping layer 1 on its device: layer 5's copies travel low, layer 1's not
    mixed = profile.for_update("host", frozenset({1}))
    assert mixed is profile.for_update("host", frozenset({1})) and mixed is not host
    assert sorted(c.name for c in mixed.low_copies) == ["4.bias", "4.weight", "5.bias", "5.weight"]
    assert [layer.w_bytes for layer in mixed.layers] == [1000 - saved[i] * (i != 1) for i in range(6)]
    assert profile.for_graph(type("G", (), {"low_copies": {c.name: c.dtype for c in mixed.low_copies}})) is mixed
    assert profile.for_update("host", frozenset({1, 5})) is device  # every trainable copy stepped on a device


def test_an_analytic_plan_prices_the_hosts_casts_at_its_memory_bandwidth():
    copies = low_copies(graph_of(model()), "cpu", torch.bfloat16, host_bandwidth=1e9)
    assert {c.name: c.cast_time for c in copies if c.trainable} == {"5.weight": 32 * 6 / 1e9, "5.bias": 4 * 6 / 1e9}


def test_a_float32_plan_carries_nothing_low():
    assert low_copies(graph_of(model()), "cpu", None) == []


def test_a_tied_frozen_weight_keeps_float32():
    torch.manual_seed(0)
    tied = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False))
    tied[2].weight = tied[0].weight
    graph = graph_of(tied, trainable=("1.",))
    assert graph.ties
    assert [c.name for c in low_copies(graph, "cpu", torch.bfloat16)] == ["1.bias", "1.weight"]
