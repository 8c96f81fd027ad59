"""Analytic profiles: FLOP counts on meta tensors, the roofline, memory, and the microbatch maxima."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch import nn

import harmony
from harmony.compiler import tied_weights
from harmony.errors import HarmonyError
from harmony.models import gpt2, resnet
from harmony.profiling.analytic import OPTIMIZERS, analytic_profile, layer_cost_models, optimizer_name
from harmony.scheduler.taskgraph import Sizes
from harmony.scheduler.devicespec import load_spec
from harmony.profiling.profiles import Profile

IN, OUT, BATCH = 64, 96, 4


@pytest.fixture(scope="module")
def linear_graph():
    """Two Linear layers: the second one's input needs a gradient, the first one's does not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT), nn.Linear(OUT, OUT, bias=False))
    graph = harmony.decompose(model, (torch.randn(BATCH, IN),))
    assert len(graph.layers) == 2
    return graph


@pytest.fixture(scope="module")
def tiny_gpt2():
    torch.manual_seed(0)
    model = gpt2.build_model(preset="tiny")
    inputs, _ = gpt2.get_batch(2, 0, preset="tiny")
    return harmony.decompose(model, (inputs,))


def test_linear_flops_are_exact(linear_graph):
    first, second = layer_cost_models(linear_graph, "v100")
    for u in (1, 3, 4, 17, 1000):
        c1, c2 = first.at(u), second.at(u)
        assert c1.fwd_flops == 2 * u * IN * OUT
        assert c2.fwd_flops == 2 * u * OUT * OUT
        # backward: dW only where the input needs no gradient, dW and dX otherwise
        assert c1.bwd_flops == 2 * u * IN * OUT
        assert c2.bwd_flops == 2 * (2 * u * OUT * OUT)


def test_sizes_of_values(linear_graph):
    first, second = layer_cost_models(linear_graph, "v100")
    c1, c2 = first.at(5), second.at(5)
    assert (c1.x_bytes, c1.y_bytes, c1.dx_bytes) == (5 * IN * 4, 5 * OUT * 4, 0)
    assert (c2.x_bytes, c2.y_bytes, c2.dx_bytes) == (5 * OUT * 4, 5 * OUT * 4, 5 * OUT * 4)


def test_time_follows_roofline(linear_graph):
    spec = load_spec("v100")
    u = 64
    # compute-bound: memory infinitely fast
    fast_memory = dataclasses.replace(spec, memory_bandwidth=1e30)
    c = layer_cost_models(linear_graph, fast_memory)[1].at(u)
    assert c.fwd_time == pytest.approx(c.fwd_flops / (spec.peak_flops * spec.efficiency))
    assert c.bwd_time == pytest.approx(c.bwd_flops / (spec.peak_flops * spec.efficiency))
    assert c.recompute_time == c.fwd_time
    # bandwidth-bound: arithmetic infinitely fast; the matmul reads W and X and writes Y
    fast_math = dataclasses.replace(spec, peak_flops=1e30, dtype_flops={})
    c = layer_cost_models(linear_graph, fast_math)[1].at(u)
    assert c.fwd_bytes >= 4 * (OUT * OUT + 2 * u * OUT)
    assert c.fwd_time == pytest.approx(c.fwd_bytes / spec.memory_bandwidth)
    # the real spec: at least each bound, at most their sum
    c = layer_cost_models(linear_graph, spec)[1].at(u)
    compute, memory = c.fwd_flops / (spec.peak_flops * spec.efficiency), c.fwd_bytes / spec.memory_bandwidth
    assert max(compute, memory) <= c.fwd_time * (1 + 1e-9) and c.fwd_time <= (compute + memory) * (1 + 1e-9)
    # twice the peak FLOP/s never makes a layer slower, and a compute-bound one faster
    faster = dataclasses.replace(spec, peak_flops=2 * spec.peak_flops, dtype_flops={}, memory_bandwidth=1e30)
    assert layer_cost_models(linear_graph, faster)[1].at(u).fwd_time == pytest.approx(
        layer_cost_models(linear_graph, fast_memory)[1].at(u).fwd_time / 2)


def test_dtype_changes_peak_and_sizes(linear_graph):
    fp32 = analytic_profile(linear_graph, "a100", optimizer="sgd", max_microbatch=64)
    bf16 = analytic_profile(linear_graph, "a100", optimizer="sgd", dtype=torch.bfloat16, max_microbatch=64)
    assert bf16.layers[1].w_bytes * 2 == fp32.layers[1].w_bytes
    assert bf16.layers[1].at("x_bytes", 8) * 2 == fp32.layers[1].at("x_bytes", 8)
    assert bf16.notes["dtype"] == "bfloat16"
    c32 = layer_cost_models(linear_graph, "a100")[1].at(4096)
    c16 = layer_cost_models(linear_graph, "a100", dtype="bfloat16")[1].at(4096)
    assert c16.fwd_flops == c32.fwd_flops and c16.fwd_time < c32.fwd_time


def test_a_mixed_precision_profile_counts_the_layers_as_autocast_runs_them(linear_graph):
    fp32 = analytic_profile(linear_graph, "a100", optimizer="sgd", max_microbatch=64)
    amp = analytic_profile(linear_graph, "a100", optimizer="sgd", compute=torch.bfloat16, max_microbatch=64)
    u = 8
    # masters stay float32; the linear layer's output is bf16 under autocast; its input as traced
    assert amp.layers[1].w_bytes == fp32.layers[1].w_bytes
    assert amp.layers[1].at("y_bytes", u) * 2 == fp32.layers[1].at("y_bytes", u) == 4 * u * OUT
    assert amp.layers[1].at("x_bytes", u) == fp32.layers[1].at("x_bytes", u)
    # the forward holds the weight's bf16 cast and the bf16 input's cast beside a bf16 output:
    # W + X + cast(W) + cast(X) + Y
    w, x = 4 * OUT * OUT, 4 * u * OUT
    assert amp.layers[1].at("fwd_peak", u) == w + x + w // 2 + x // 2 + 2 * u * OUT
    # at a large batch the bf16 peak and the halved output win over the weight's cast
    c32 = layer_cost_models(linear_graph, "a100")[1].at(4096)
    c16 = layer_cost_models(linear_graph, "a100", compute=torch.bfloat16)[1].at(4096)
    assert c16.fwd_flops == c32.fwd_flops and c16.fwd_time < c32.fwd_time


def test_state_sizes_and_optimizers(linear_graph):
    w = 4 * (IN * OUT + OUT)
    for name, (states, _) in OPTIMIZERS.items():
        layer = analytic_profile(linear_graph, "v100", optimizer=name, max_microbatch=8).layers[0]
        assert layer.w_bytes == w and layer.dw_bytes == w and layer.b_bytes == 0
        assert layer.k_bytes == states * w
        if states or name in ("sgd",):
            assert layer.upd_time_device > 0 and layer.upd_time_host > layer.upd_time_device
    with pytest.raises(HarmonyError, match="unknown optimizer 'lamb'.*adam"):
        analytic_profile(linear_graph, "v100", optimizer="lamb")


def test_memory_positive_and_monotone(tiny_gpt2):
    profile = analytic_profile(tiny_gpt2, "1080ti", microbatch_sizes=[1, 2, 3, 8, 32, 100])
    for layer in profile.layers:
        for samples in (layer.fwd_samples, layer.bwd_samples):
            assert [s.u for s in samples] == [1, 2, 3, 8, 32, 100]
            for field in ("fwd_peak", "bwd_peak", "x_bytes", "y_bytes", "fwd_time", "bwd_time"):
                values = [getattr(s, field) for s in samples]
                assert all(v > 0 for v in values), (layer.name, field)
                assert values == sorted(values), (layer.name, field)
            for s in samples:
                # a forward holds at least W, B, X and Y; a backward at least W, dW, X, dX
                assert s.fwd_peak >= layer.w_bytes + layer.b_bytes + s.x_bytes + s.y_bytes - _shared(tiny_gpt2, layer)
                assert s.bwd_peak >= layer.w_bytes + layer.dw_bytes + s.x_bytes + s.dx_bytes
                assert s.bwd_peak > s.fwd_peak


def _shared(graph, layer) -> int:
    """Bytes of outputs that are inputs passed through (counted once in the peak)."""
    spec = graph.layers[layer.index]
    return sum(graph.values[n].nbytes for n in spec.relayed)


def test_tiny_gpt2_profile(tiny_gpt2, tmp_path):
    profile = analytic_profile(tiny_gpt2, "h100")
    assert profile.source == "analytic" and profile.device == "analytic:h100"
    assert len(profile.layers) == len(tiny_gpt2.layers)
    assert [layer.index for layer in profile.layers] == list(range(len(tiny_gpt2.layers)))
    assert [layer.name for layer in profile.layers] == [spec.name for spec in tiny_gpt2.layers]
    assert profile.capacity == load_spec("h100").capacity
    assert profile.u_bmax >= 1 and profile.u_bmax <= profile.u_fmax
    assert profile.layers[0].fwd_samples[-1].u == profile.u_fmax
    assert profile.layers[0].bwd_samples[-1].u == profile.u_bmax
    # lm_head is tied to wte: its weight and optimizer state in both layers (as a measured profile
    # counts them, and the task graph counts them once per pack), its update's time in the first
    first, last = profile.layers[0], profile.layers[-1]
    wte = tiny_gpt2.state["wte.weight"].nbytes
    assert first.w_bytes >= wte and last.w_bytes >= wte
    assert first.k_bytes >= wte and last.k_bytes >= wte
    assert last.upd_time_host < first.upd_time_host
    # identical blocks get identical numbers from one shared cost model
    models = layer_cost_models(tiny_gpt2, "h100")
    assert models[2] is models[3]
    assert profile.layers[2].fwd_samples == profile.layers[3].fwd_samples
    # samples are dense at small u, where the roofline bends; the fit of memory is exact
    assert [s.u for s in first.fwd_samples][:9] == [1, 2, 3, 4, 5, 6, 7, 8, 12]
    errors = profile.fit_errors()
    assert errors["x_bytes"] < 1e-9 and errors["dx_bytes"] < 1e-9
    path = tmp_path / "profile.msgpack"
    profile.save(path)
    assert Profile.load(path) == profile


def test_maxima_respect_capacity(tiny_gpt2):
    spec = load_spec("v100")
    models = layer_cost_models(tiny_gpt2, spec)
    u = 37
    fwd_need = max(m.peaks(u + 1)[0] for m in models)
    bwd_need = max(m.peaks(u + 1)[1] for m in models)
    p = analytic_profile(tiny_gpt2, dataclasses.replace(spec, capacity=fwd_need - 1))
    assert p.u_fmax == u
    assert max(layer.at("fwd_peak", u) for layer in p.layers) <= p.capacity
    assert p.layers[0].fwd_samples[-1].u == u
    p = analytic_profile(tiny_gpt2, dataclasses.replace(spec, capacity=bwd_need - 1), microbatch_sizes=[1, 2, 64])
    assert p.u_bmax == u
    assert max(s.bwd_peak for layer in p.layers for s in layer.bwd_samples) <= p.capacity
    assert [s.u for s in p.layers[0].bwd_samples] == [1, 2]  # sizes past the maximum are left out


def test_graph_without_bound_modules(tiny_gpt2):
    """A graph read back with its code but no modules is built on meta for counting."""
    unbound = dataclasses.replace(tiny_gpt2, modules=None)
    unbound.sources = tiny_gpt2.sources
    a = analytic_profile(unbound, "a100", max_microbatch=16)
    b = analytic_profile(tiny_gpt2, "a100", max_microbatch=16)
    assert a.layers == b.layers and (a.u_fmax, a.u_bmax) == (b.u_fmax, b.u_bmax) == (16, 16)


def test_layer_that_never_fits_is_named(tiny_gpt2):
    spec = dataclasses.replace(load_spec("v100"), capacity=20_000)
    with pytest.raises(HarmonyError, match=r"layer \d+ \(.*\) needs .* at microbatch size 1"):
        analytic_profile(tiny_gpt2, spec)


@pytest.mark.slow
@pytest.mark.parametrize("module,preset", [(gpt2, "10b"), (resnet, "resnet1k")])
def test_big_models_on_meta_are_fast(module, preset):
    with torch.device("meta"):
        model = module.build_model(preset=preset)
    inputs, _ = module.get_batch(1, 0, preset=preset)
    graph = harmony.decompose(model, (inputs,))
    started = time.perf_counter()
    profile = analytic_profile(graph, "v100")
    elapsed = time.perf_counter() - started
    assert elapsed < 30, f"{preset}: analytic profile took {elapsed:.1f} s"
    assert len(profile.layers) == len(graph.layers)
    assert profile.u_fmax >= 1 and profile.u_bmax >= 1
    if preset == "10b":
        # 2 * 12 * d^2 * T FLOPs per sample for the matmuls of a block, plus attention's 4 * T^2 * d
        d, t = 4096, 1024
        block = layer_cost_models(graph, "v100")[1].at(1)
        assert block.fwd_flops == pytest.approx(24 * d * d * t + 4 * t * t * d, rel=0.01)
        assert block.bwd_flops == pytest.approx(2 * block.fwd_flops, rel=0.01)


def test_a_pack_holding_a_tied_weight_it_does_not_own_moves_no_negative_optimizer_state(tiny_gpt2):
    profile = analytic_profile(tiny_gpt2, "h100")
    profile.ties = tied_weights(tiny_gpt2, gpt2.build_optimizer)
    assert profile.ties, "tiny gpt2 ties lm_head to wte"
    sizes, last = Sizes(profile), len(profile.layers) - 1
    for first in range(1, last + 1):  # every pack holding lm_head but not wte
        assert sizes.owned_k(first, last) >= 0
        assert sizes.owned_k(first, last) == sizes.k(first, last) - profile.ties[0].k_bytes


@pytest.mark.parametrize("make, name", [
    (lambda ps: torch.optim.Adam(ps), "adam"), (lambda ps: torch.optim.AdamW(ps), "adamw"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "sgd"), (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "sgd-momentum"),
    (lambda ps: torch.optim.RMSprop(ps), "rmsprop"), (lambda ps: torch.optim.Adamax(ps), "adam")])
def test_an_analytic_profile_sizes_the_optimizer_state_the_model_file_builds(make, name):
    """Adamax is no entry of its own: two state tensors per parameter, as Adam's."""
    assert optimizer_name(make) == name


def test_a_compile_on_an_analytic_gpu_sizes_sgd_momentum_state_at_one_tensor_per_parameter():
    torch.manual_seed(0)
    model = resnet.build_model("tiny")
    plan = harmony.compile(model, resnet.loss_fn, lambda n, step: resnet.get_batch(n, step, preset="tiny"),
                           minibatch_size=4, devices=1, analytic="h100", probe=False, compare=False,
                           check_gradients=False, build_optimizer=resnet.build_optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    assert sum(layer.k_bytes for layer in plan.profile.layers) == sum(p.numel() * 4 for p in params)
