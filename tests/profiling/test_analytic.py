"""Analytic profiles: FLOP counts on meta tensors, the roofline, memory, and the microbatch maxima."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import harmony
from harmony.compiler import tied_weights
from harmony.errors import HarmonyError
from harmony.models import bert, gpt2, resnet
from harmony.profiling.analytic import OPTIMIZERS, analytic_profile, layer_cost_models, optimizer_name
from harmony.profiling.attention import causal_tiles
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
        # 2 * 12 * d^2 * T FLOPs per sample for the matmuls of a block, plus attention's 4 * T^2 * d;
        # backward twice the matmuls' and 2.5 times attention's (the fused kernel recomputes the scores)
        d, t = 4096, 1024
        block = layer_cost_models(graph, "v100")[1].at(1)
        assert block.fwd_flops == pytest.approx(24 * d * d * t + 4 * t * t * d, rel=1e-6)
        assert block.bwd_flops == pytest.approx(48 * d * d * t + 10 * t * t * d, rel=1e-6)


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


# ---- attention, counted as the target runs it -------------------------------------------------------
HEADS, KV_HEADS, SEQ, HEAD_DIM = 4, 2, 32, 16
FLASH = "aten._scaled_dot_product_flash_attention.default"


class _Attend(nn.Module):
    """Self-attention over a projected (B, SEQ, (HEADS + 2 * kv) * HEAD_DIM) input, nothing else."""

    def __init__(self, kv_heads: int, dropout: float, causal: bool = True) -> None:
        super().__init__()
        self.kv_heads, self.dropout, self.causal = kv_heads, dropout, causal

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        b, seq = qkv.shape[:2]
        q, k, v = qkv.split([HEADS * HEAD_DIM, self.kv_heads * HEAD_DIM, self.kv_heads * HEAD_DIM], dim=-1)
        q = q.view(b, seq, HEADS, HEAD_DIM).transpose(1, 2)
        k = k.view(b, seq, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = v.view(b, seq, self.kv_heads, HEAD_DIM).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                           dropout_p=self.dropout if self.training else 0.0,
                                           enable_gqa=self.kv_heads != HEADS)
        return y.transpose(1, 2).reshape(b, seq, HEADS * HEAD_DIM)


def _attention_graph(kv_heads: int = HEADS, dropout: float = 0.0, dtype: torch.dtype = torch.float32,
                     seq: int = SEQ, causal: bool = True):
    """Two layers: the projection, and attention alone (whose input needs a gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HEADS * HEAD_DIM, (HEADS + 2 * kv_heads) * HEAD_DIM),
                          _Attend(kv_heads, dropout, causal))
    model = model.to(dtype)
    return harmony.decompose(model, (torch.randn(2, seq, HEADS * HEAD_DIM, dtype=dtype),), modules=["0", "1"])


def _per_sample(model, field: str) -> float:
    """What one more sample adds to ``field`` of the layer's cost (exact: the counts are affine in u)."""
    return getattr(model.at(3), field) - getattr(model.at(2), field)


def test_a_gpu_counts_flash_attention_at_4bhs2d_forward_and_two_and_a_half_times_that_backward():
    attend = layer_cost_models(_attention_graph(dtype=torch.bfloat16), "h100")[1]
    assert FLASH in attend.counts(2).fwd_names
    for u in (1, 3, 8):
        c = attend.at(u)
        assert c.fwd_flops == 4 * u * HEADS * SEQ * SEQ * HEAD_DIM
        assert c.bwd_flops == 10 * u * HEADS * SEQ * SEQ * HEAD_DIM


def test_causal_tiles_are_those_on_or_below_the_diagonal():
    assert causal_tiles(1024, 1024, 128, 128) == 36 / 64
    assert causal_tiles(100, 100, 128, 128) == 1.0  # one tile, computed whole
    assert causal_tiles(256, 1024, 128, 128) == 3 / 16  # top-left: the first queries see the first keys
    assert causal_tiles(1024, 256, 128, 128) == (1 + 2 * 7) / 16


def test_a_causal_flash_kernel_takes_the_time_of_the_tiles_it_computes_and_counts_every_flop():
    seq = 1024  # eight 128-wide tiles a side: compute-bound on an H100
    causal, full = (layer_cost_models(_attention_graph(dtype=torch.bfloat16, seq=seq, causal=c), "h100")[1].at(1)
                    for c in (True, False))
    assert causal.fwd_flops == full.fwd_flops == 4 * HEADS * seq * seq * HEAD_DIM
    assert causal.bwd_flops == full.bwd_flops
    spec = load_spec("h100")
    peak = spec.flops_for(torch.bfloat16) * spec.efficiency
    # the kernels are compute-bound here; the layer's copies (the heads' transposes) are not skipped
    assert full.fwd_time - causal.fwd_time == pytest.approx(full.fwd_flops / peak * 28 / 64)
    assert full.bwd_time - causal.bwd_time == pytest.approx(full.bwd_flops / peak * 28 / 64)


def test_flash_attention_keeps_its_output_and_a_log_sum_exp_per_query_row_not_the_scores():
    attend = layer_cost_models(_attention_graph(dtype=torch.bfloat16), "h100")[1]
    output, log_sum_exp = HEADS * SEQ * HEAD_DIM * 2, HEADS * SEQ * 4  # bf16; float32
    assert _per_sample(attend, "act_bytes") == output + log_sum_exp
    # it reads Q, K and V once and writes the output and the log-sum-exp
    assert _per_sample(attend, "fwd_bytes") == 3 * output + output + log_sum_exp
    # the math path, which a GPU runs in float64, saves the SEQ x SEQ scores for the backward
    math = layer_cost_models(_attention_graph(dtype=torch.float64), "h100")[1]
    assert FLASH not in math.counts(2).fwd_names
    assert _per_sample(math, "act_bytes") >= HEADS * SEQ * SEQ * 8 + 2 * HEADS * SEQ * HEAD_DIM * 8


def test_grouped_query_attention_reads_each_key_value_head_once_and_counts_every_query_heads_flops():
    attend = layer_cost_models(_attention_graph(kv_heads=KV_HEADS, dtype=torch.bfloat16), "h100")[1]
    assert attend.at(1).fwd_flops == 4 * HEADS * SEQ * SEQ * HEAD_DIM
    q_bytes, kv_bytes = HEADS * SEQ * HEAD_DIM * 2, KV_HEADS * SEQ * HEAD_DIM * 2
    assert _per_sample(attend, "fwd_bytes") == q_bytes + 2 * kv_bytes + q_bytes + HEADS * SEQ * 4


def test_float32_on_a_gpu_is_counted_as_memory_efficient_attention_and_autocast_as_flash():
    graph = _attention_graph()
    fp32 = layer_cost_models(graph, "h100")[1].counts(2)
    assert "aten._scaled_dot_product_efficient_attention.default" in fp32.fwd_names
    amp = layer_cost_models(graph, "h100", compute=torch.bfloat16)[1]
    # CUDA autocast casts the op's float32 inputs to bf16, and bf16 runs the flash kernel
    assert FLASH in amp.counts(2).fwd_names
    assert amp.at(2).fwd_flops == 4 * 2 * HEADS * SEQ * SEQ * HEAD_DIM


class _Dispatched(TorchDispatchMode):
    """The aten ops a real run dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _attention_ops(names: list[str]) -> list[str]:
    return [n for n in names if "attention" in n or "bmm" in n or "softmax" in n or "bernoulli" in n]


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_the_cpu_is_counted_with_the_attention_kernels_torch_runs_there(dropout):
    """The CPU's fused kernel without dropout; with dropout in training its math path, which keeps
    the SEQ x SEQ attention weights for the backward."""
    graph = _attention_graph(dropout=dropout)
    attend = layer_cost_models(graph, "h100", device_type="cpu")[1]
    qkv = torch.randn(2, SEQ, 3 * HEADS * HEAD_DIM, requires_grad=True)
    with _Dispatched() as ran:
        graph.modules[1](qkv)[0].sum().backward()
    counted = attend.counts(2)
    assert _attention_ops(counted.bwd_names) == _attention_ops(ran.names)  # recompute and backward
    assert _attention_ops(counted.fwd_names) == _attention_ops(counted.bwd_names[:counted.bwd_start])
    assert attend.at(1).fwd_flops == 4 * HEADS * SEQ * SEQ * HEAD_DIM  # the flop counter lacks the CPU kernel's
    if dropout:
        assert _per_sample(attend, "act_bytes") >= 2 * HEADS * SEQ * SEQ * 4
    else:
        assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in counted.fwd_names
        assert _per_sample(attend, "act_bytes") < HEADS * SEQ * SEQ * 4


def test_a_padding_mask_is_counted_as_memory_efficient_attention_with_a_bias():
    torch.manual_seed(0)
    model = bert.build_model("tiny", dropout=0.0)
    ids, _ = bert.get_batch(2, 0, preset="tiny")
    graph = harmony.decompose(model, (ids, torch.ones_like(ids)))
    block = layer_cost_models(graph, "h100", compute=torch.bfloat16)[1].counts(2)
    assert "aten._scaled_dot_product_efficient_attention.default" in block.fwd_names
    unmasked = layer_cost_models(harmony.decompose(model, (ids,)), "h100", compute=torch.bfloat16)[1].counts(2)
    assert FLASH in unmasked.fwd_names


def test_an_unknown_device_type_is_refused_naming_the_ones_counted(linear_graph):
    with pytest.raises(HarmonyError, match="device type 'tpu'.*cuda, cpu"):
        layer_cost_models(linear_graph, "h100", device_type="tpu")
