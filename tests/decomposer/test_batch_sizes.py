"""Generated layers are correct at every microbatch size, and so are the values between them.

A plan runs each layer on microbatches of sizes other than the example the model was decomposed
at, and with U_F != U_B the runtime cuts and joins the values crossing a boundary. Nothing may
keep the example's batch size: not a size traced as a constant, not a size computed in one layer
and read in another (torch.export's ``sym_size``; ``nn.MultiheadAttention``'s B * heads), not a
tensor whose samples lie along another dim than 0 (batch_first=False), not a mask broadcast over
the batch. Each model is decomposed at batch 2 (as ``compile`` does) and then

* run layer by layer at batch sizes 1, 3, 5 and 8, outputs and every gradient against eager;
* at every boundary, the values of 8 samples are cut into microbatches of 3 and 5 and the rest of
  the layers run on each (a forward microbatch recomputed in smaller backward ones), and values of
  microbatches of 3, 2 and 3 are joined and the rest run on all 8 (the other way round): outputs
  against eager on the same samples, and the gradients of the layers after the boundary.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from torch import nn

import harmony
from harmony.compiler import batch_coupled
from harmony.decomposer import batching
from zoo import assert_close, assert_layers_match_model, tensor_leaves

RTOL = 1e-9
SIZES = (1, 3, 5, 8)
EXAMPLE = 2


# --------------------------------------------------------------------------- models
class Block(nn.Module):
    def __init__(self, width: int, heads: int, batch_first: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=batch_first)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPTLike(nn.Module):
    """Token embedding, a learned position parameter of shape (1, T, W), blocks of LayerNorm +
    nn.MultiheadAttention + GELU MLP, a linear head. With
    ``batch_first=False`` the blocks pass (T, B, W) between them."""

    def __init__(self, vocab: int = 32, seq: int = 8, width: int = 16, blocks: int = 2, heads: int = 4,
                 batch_first: bool = True):
        super().__init__()
        self.batch_first = batch_first
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(0.02 * torch.randn(1, seq, width))
        self.blocks = nn.ModuleList([Block(width, heads, batch_first) for _ in range(blocks)])
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos
        if not self.batch_first:
            x = x.transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        if not self.batch_first:
            x = x.transpose(0, 1)
        return self.head(x)


class SizeRelay(nn.Module):
    """Symbolically traceable (torch.fx): the batch size read once at the top and used in every
    block, so the number crosses layer boundaries."""

    def __init__(self, width: int = 12, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        for block in self.blocks:
            x = torch.tanh(block(x)).reshape(n, 2, -1).flip(1).reshape(n, -1)
        return x


class ShapeRelay(nn.Module):
    """A whole ``x.shape`` (batch included) read at the top and used three layers later: a value
    that cannot be cut, so plans must keep U_F = U_B."""

    def __init__(self, width: int = 12):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        for block in self.blocks:
            x = block(x).flatten()
            x = x.reshape(shape)
        return x


def _tokens(vocab: int, seq: int) -> Callable[[int], tuple]:
    def make(batch: int) -> tuple:
        g = torch.Generator().manual_seed(batch)
        return (torch.randint(0, vocab, (batch, seq), generator=g),)

    return make


def gpt_like(batch_first: bool) -> tuple[nn.Module, Callable[[int], tuple]]:
    torch.manual_seed(0)
    return GPTLike(batch_first=batch_first).double(), _tokens(32, 8)


def hf_bert_masked() -> tuple[nn.Module, Callable[[int], tuple]]:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).double()

    def make(batch: int) -> tuple:
        ids = _tokens(64, 12)(batch)[0]
        lengths = torch.arange(batch) % 5 + 8  # every sample padded differently
        mask = (torch.arange(12)[None, :] < lengths[:, None]).long()
        return ids, mask

    return model, make


def hf_gpt2() -> tuple[nn.Module, Callable[[int], tuple]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).double(), _tokens(64, 12)


def size_relay() -> tuple[nn.Module, Callable[[int], tuple]]:
    torch.manual_seed(0)

    def make(batch: int) -> tuple:
        return (torch.randn(batch, 12, generator=torch.Generator().manual_seed(batch), dtype=torch.float64),)

    return SizeRelay().double(), make


MODELS = {
    "gpt_like": lambda: gpt_like(batch_first=True),
    "gpt_like_seq_first": lambda: gpt_like(batch_first=False),
    "hf_bert_masked": hf_bert_masked,
    "hf_gpt2": hf_gpt2,
    "fx_size_relay": size_relay,
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def decomposed(request):
    model, make = MODELS[request.param]()
    model.eval()  # no dropout in any of them; eval keeps HF from warning
    graph = harmony.decompose(model, make(EXAMPLE))
    return request.param, model, make, graph


# --------------------------------------------------------------------------- helpers
def _run(graph: harmony.LayerGraph, first: int, last: int, values: list) -> list:
    for index in range(first, last + 1):
        values = list(graph.run_layer(index, *values))
    return values


def _output(graph: harmony.LayerGraph, values: list) -> list[torch.Tensor]:
    return tensor_leaves(torch.utils._pytree.tree_unflatten(values, graph.out_spec()))


def _eager(model: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    return tensor_leaves(model(*inputs))


def _slice(inputs: tuple, start: int, stop: int) -> tuple:
    return tuple(x[start:stop] for x in inputs)


def _owned_after(graph: harmony.LayerGraph, boundary: int) -> set[str]:
    """Parameters that only layers at or after ``boundary`` hold (a tied one may be held earlier)."""
    before = {graph.canonical(n) for spec in graph.layers[:boundary] for n in spec.state}
    return {graph.canonical(n) for spec in graph.layers[boundary:] for n in spec.state
            if graph.state[n].kind == "parameter" and graph.canonical(n) not in before}


def _gradients(model: nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {n: params[n].grad.clone() for n in names if params[n].grad is not None}


def _loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    return sum((t.double() * (1 + torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape) % 7)).sum()
               for t in outputs if t.is_floating_point())


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("batch", SIZES)
def test_layers_equal_the_model_at_other_batch_sizes(decomposed, batch):
    _, model, make, graph = decomposed
    assert_layers_match_model(model, make(batch), RTOL, lg=graph)


def test_no_batch_dependent_number_crosses_a_boundary(decomposed):
    """Sizes made from the batch are re-derived in the layer that reads them."""
    _, _, _, graph = decomposed
    crossing = {n for spec in graph.layers[1:] for n in spec.inputs}
    assert not [n for n in crossing if graph.values[n].kind != "tensor" and graph.values[n].coupled]
    assert not graph.coupled_inputs()
    assert graph.batch_sizes == []


def test_cut_boundary_values_run_on_as_smaller_microbatches(decomposed):
    """Forward at 8 samples, the rest of the model on microbatches of 3 and 5 (U_F > U_B)."""
    _, model, make, graph = decomposed
    inputs = make(8)
    last = len(graph) - 1
    for boundary in range(1, len(graph)):
        with torch.no_grad():
            values = _run(graph, 0, boundary - 1, list(inputs))
        dims = graph.input_batch_dims(boundary)
        for start, stop in ((0, 3), (3, 8)):
            piece = [v.detach() if isinstance(v, torch.Tensor) else v
                     for v in batching.cut(values, dims, start, stop)]
            model.zero_grad(set_to_none=True)
            out = _output(graph, _run(graph, boundary, last, piece))
            _loss(out).backward()
            got = _gradients(model, _owned_after(graph, boundary))
            reference = copy.deepcopy(model)
            expected_out = _eager(reference, _slice(inputs, start, stop))
            _loss(expected_out).backward()
            expected = _gradients(reference, _owned_after(graph, boundary))
            for i, (a, e) in enumerate(zip(out, expected_out)):
                assert_close(a, e, RTOL, f"boundary {boundary}, samples {start}-{stop}: output {i}")
            assert got.keys() == expected.keys()
            for name in got:
                assert_close(got[name], expected[name], RTOL, f"boundary {boundary}, samples {start}-{stop}: {name}")


def test_joined_boundary_values_run_on_as_one_larger_microbatch(decomposed):
    """Forward on microbatches of 3, 2 and 3 samples, the rest of the model on all 8 (U_F < U_B)."""
    _, model, make, graph = decomposed
    inputs = make(8)
    last = len(graph) - 1
    expected = _eager(model, inputs)
    for boundary in range(1, len(graph)):
        with torch.no_grad():
            parts = [_run(graph, 0, boundary - 1, list(_slice(inputs, a, b))) for a, b in ((0, 3), (3, 5), (5, 8))]
            joined = batching.join(parts, graph.input_batch_dims(boundary))
            out = _output(graph, _run(graph, boundary, last, joined))
        for i, (a, e) in enumerate(zip(out, expected)):
            assert_close(a, e.detach(), RTOL, f"boundary {boundary}: output {i}")


def test_a_symbolic_trace_rederives_the_batch_size_in_each_layer():
    _, _, _, graph = _decompose("fx_size_relay")
    assert graph.tracer == "fx"
    for spec in graph.layers[1:]:
        assert all(graph.values[n].kind == "tensor" for n in spec.inputs)
        assert "sym_size.int(" in graph.sources[spec.code_file]


def test_multihead_attention_seq_first_is_cut_along_dim_1():
    _, _, _, graph = _decompose("gpt_like_seq_first")
    inner = [graph.values[n] for spec in graph.layers[1:-1] for n in spec.inputs]
    assert inner and all(v.batch_dim == 1 for v in inner), [(v.name, v.shape, v.batch_dim) for v in inner]


def test_hf_bert_attention_mask_is_cut_with_its_samples():
    _, _, _, bert = _decompose("hf_bert_masked")
    masks = [v for v in bert.values.values() if v.kind == "tensor" and len(v.shape) == 4]
    assert masks and all(v.batch_dim == 0 for v in masks)


def test_a_whole_shape_crossing_layers_keeps_forward_and_backward_microbatches_equal():
    torch.manual_seed(0)
    model = ShapeRelay().double()
    graph = harmony.decompose(model, (torch.randn(2, 12, dtype=torch.float64),))
    assert graph.coupled_inputs()
    assert "cannot be cut" in batch_coupled(graph)
    for batch in (1, 5):
        assert_layers_match_model(model, (torch.randn(batch, 12, dtype=torch.float64),), RTOL, lg=graph)


def test_a_trace_fixed_to_its_example_batch_is_recorded_and_refused_by_compile():
    """torch.export specialises a batch of 1: the layers then run at that size only, and compiling
    for a larger minibatch is refused up front instead of failing in a task."""
    model, make = gpt_like(batch_first=True)  # nn.MultiheadAttention: traced by torch.export
    graph = harmony.decompose(model, make(1))
    assert graph.tracer == "export"
    assert graph.batch_sizes == [1] and graph.batch_note
    from harmony.compiler import _check_batch_sizes
    from harmony.errors import HarmonyError

    _check_batch_sizes(graph, 1)
    with pytest.raises(HarmonyError, match="batch size 1 only"):
        _check_batch_sizes(graph, 4)


def test_classify_tells_batch_dims_affine_sizes_and_the_rest():
    sizes = batching.probe_sizes(2)
    t = lambda *shape: torch.empty(shape)  # noqa: E731
    assert batching.classify(sizes, [t(4, b, 3) for b in sizes]) == batching.BatchFact(batching.BATCHED, dim=1)
    assert batching.classify(sizes, [t(1, 1, 5, 5)] * 3).kind == batching.CONSTANT
    assert batching.classify(sizes, [t(4 * b, 3) for b in sizes]).kind == batching.COUPLED
    assert batching.classify(sizes, [4 * b + 1 for b in sizes]) == batching.BatchFact(batching.AFFINE, coef=4, offset=1)
    assert batching.classify(sizes, [b * b for b in sizes]).kind == batching.COUPLED
    assert batching.classify(sizes, [(b, 3) for b in sizes]).kind == batching.COUPLED
    assert batching.classify(sizes, [16, 16, 16]).kind == batching.CONSTANT


def _decompose(name: str):
    model, make = MODELS[name]()
    return name, model, make, harmony.decompose(model.eval(), make(EXAMPLE))
