"""Layers whose code mixes samples across the batch keep the forward's microbatches the backward's.

Harmony may run a forward at microbatch size U_F and the recompute/backward at U_B. That is exact
only for layers that treat samples independently; ``x - x.mean(0)`` in a layer makes a sample's
output depend on the rest of its microbatch, so with U_F != U_B training would silently differ
from eager training. ``decomposer/sample_mixing.py`` finds such layers by running them with one
sample changed, and ``compiler.batch_coupled`` then keeps U_F = U_B. These tests hold:

* every way of mixing (mean, norm, softmax, broadcast sum, cumsum over the batch, a hand-written
  batch normalisation, a whole-batch statistic handed to the next layer) is reported by layer;
* per-sample code (LayerNorm, InstanceNorm, GroupNorm, attention with a padding mask or with a
  mask broadcast over the batch, embeddings, dropout) is not;
* BatchNorm keeps its own reason, and the check leaves buffers, modes and the RNG as they were;
* a centering model compiles with U_F = U_B and trains like eager, while a plan with U_F != U_B
  forced on it does not (what the check prevents).
"""

from __future__ import annotations

import copy
import logging
from typing import Callable

import pytest
import torch
from torch import nn

import harmony
from harmony.compiler import batch_coupled
from harmony.decomposer.sample_mixing import sample_mixing_layers
from harmony.plan import Plan
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train
from harmony.scheduler.search import search
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import Configuration

MINIBATCH = 8
D_IN, WIDTH, CLASSES = 6, 16, 3
MIXING_BLOCK = 2
MIXES = "mixes samples across the batch (an output of one sample changes with another sample's input)"


# --------------------------------------------------------------------------- models
def center(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(0, keepdim=True)


def batch_statistics_norm(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(0)) / (x.var(0, unbiased=False) + 1e-5).sqrt()


MIXING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mean": center,
    "norm": lambda x: x / x.norm(dim=0),
    "softmax": lambda x: torch.softmax(x, dim=0),
    "broadcast sum": lambda x: x * x.sum(0, keepdim=True),
    "cumsum": lambda x: torch.cumsum(x, 0),
    "batch statistics": batch_statistics_norm,
}


class Block(nn.Module):
    def __init__(self, width: int, mix: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.mix = mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return x + (self.mix(h) if self.mix is not None else h)


class BlockNet(nn.Module):
    """A stem, residual blocks (block ``MIXING_BLOCK`` applying ``mix``), a head."""

    def __init__(self, mix: Callable[[torch.Tensor], torch.Tensor] | None = None, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(D_IN, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, mix if i == MIXING_BLOCK else None) for i in range(depth))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class StatisticBlock(nn.Module):
    """Hands the next block the batch's mean square, a value with no batch dim."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, h.pow(2).mean()


class ScaleBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(x / scale.sqrt())


class StatisticNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([StatisticBlock(D_IN), ScaleBlock(D_IN)])
        self.head = nn.Linear(D_IN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, scale = self.blocks[0](x)
        return self.head(self.blocks[1](h, scale))


class PerSampleNet(nn.Module):
    """Embedding, LayerNorm MLP, attention with a padding mask, InstanceNorm and GroupNorm: every
    sample's output is its own, whatever the batch."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)),
            nn.MultiheadAttention(width, 2, batch_first=True),
            nn.InstanceNorm1d(width, affine=True),
            nn.GroupNorm(2, width),
        ])
        self.head = nn.Linear(width, CLASSES)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.blocks[0](x)
        x = x + self.blocks[1](x, x, x, key_padding_mask=padding, need_weights=False)[0]
        x = self.blocks[2](x.transpose(1, 2))
        x = self.blocks[3](x).transpose(1, 2)
        return self.head(x.mean(1))


class MaskedTransformer(nn.Module):
    """Attention blocks under a (T, T) mask that the model takes as an input, the same for every
    sample (broadcast over the batch)."""

    def __init__(self, vocab: int = 13, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.MultiheadAttention(width, 2, batch_first=True) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x, x, x, attn_mask=mask, need_weights=False)[0]
        return self.head(x)


def block_net(mix=None, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    net = BlockNet(mix).double()
    if dropout:
        net.head = nn.Sequential(nn.Dropout(dropout), net.head)
    return net


def features(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    inputs = torch.randn(batch_size, D_IN, generator=g, dtype=torch.float64)
    return inputs, torch.randint(0, CLASSES, (batch_size,), generator=g)


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2, eps=1e-6)


def decompose(model: nn.Module, inputs: tuple | None = None) -> harmony.LayerGraph:
    return harmony.decompose(model, inputs if inputs is not None else (features(2, 0)[0],))


def layer_named(graph: harmony.LayerGraph, name: str) -> int:
    return next(spec.index for spec in graph.layers if spec.name == name)


def train_both(model: nn.Module, plan: Plan, steps: int = 2) -> tuple[list[float], list[float], float]:
    """(Harmony's losses, eager's over the plan's microbatches, the largest relative weight error)."""
    reference = copy.deepcopy(model)
    batches = [features(MINIBATCH, step) for step in range(steps)]
    with harmony.Trainer(plan, optimizer=adam, timeout=60) as trainer:
        losses = [trainer.step(*batch) for batch in batches]
        state = trainer.state_dict()
    expected = reference_train(reference, cross_entropy, adam, batches, microbatches_of(plan.tasks))
    error = max(float((state[name] - want).abs().max() / want.abs().max().clamp_min(1e-3))
                for name, want in reference.state_dict().items())
    return losses, expected, error


# --------------------------------------------------------------------------- which layers are reported
@pytest.mark.parametrize("kind", sorted(MIXING))
def test_each_way_of_mixing_samples_is_reported_with_the_layer_index_and_name(kind):
    graph = decompose(block_net(MIXING[kind]))
    index = layer_named(graph, f"blocks.{MIXING_BLOCK}")
    assert [layer[:2] for layer in sample_mixing_layers(graph)] == [(index, f"blocks.{MIXING_BLOCK}")]
    assert batch_coupled(graph) == f"layer {index} (blocks.{MIXING_BLOCK}) {MIXES}"


def test_a_whole_batch_statistic_handed_to_the_next_layer_is_reported():
    torch.manual_seed(0)
    graph = decompose(StatisticNet().double())
    mixing = sample_mixing_layers(graph)
    assert [layer.name for layer in mixing] == ["blocks.0"]
    assert graph.values[mixing[0].output].batch_dim is None  # the statistic, not the activation


def test_layers_that_treat_samples_independently_are_not_reported():
    torch.manual_seed(0)
    model = PerSampleNet().double()
    ids = torch.randint(0, 11, (2, 5))
    padding = torch.tensor([[False, False, False, True, True], [False, False, False, False, True]])
    graph = harmony.decompose(model, (ids, padding))
    assert graph.values[graph.inputs[1]].batch_dim == 0  # the padding mask is cut with its samples
    assert sample_mixing_layers(graph) == []
    assert sample_mixing_layers(graph, (ids, padding)) == []
    assert batch_coupled(graph) == ""
    assert batch_coupled(decompose(block_net())) == ""


def test_a_transformer_with_an_attention_mask_broadcast_over_the_batch_is_not_reported():
    torch.manual_seed(0)
    model = MaskedTransformer().double()
    ids = torch.randint(0, 13, (2, 6))
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    graph = harmony.decompose(model, (ids, causal))
    assert graph.values[graph.inputs[1]].batch_dim is None  # never changed per sample
    assert sample_mixing_layers(graph, (ids, causal)) == []
    assert sample_mixing_layers(graph) == []
    assert batch_coupled(graph) == ""


def test_token_ids_are_changed_within_the_ids_the_sample_holds():
    """Mixing right after an embedding of two tokens: the changed sample must still index it."""

    class Embedded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(2, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(center(self.embed(ids)))

    torch.manual_seed(0)
    graph = harmony.decompose(Embedded().double(), (torch.tensor([[0, 1, 1], [1, 0, 0]]),))
    assert [layer.index for layer in sample_mixing_layers(graph)] == [0]


def test_dropout_is_not_mistaken_for_mixing():
    graph = decompose(block_net(dropout=0.5))
    assert sample_mixing_layers(graph) == []
    assert batch_coupled(graph) == "layers draw random numbers (Dropout)"


def test_batchnorm_keeps_its_own_reason_and_the_check_leaves_buffers_modes_and_rng_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, CLASSES)).double()
    graph = harmony.decompose(model, (features(2, 0)[0],), depth=1)
    buffers = copy.deepcopy(dict(model.named_buffers()))
    model[2].eval()  # a mode of the user's, put back after the check
    rng = torch.get_rng_state()
    mixing = sample_mixing_layers(graph)
    assert [layer.name for layer in mixing] == ["1"]  # found, as any batch statistic would be
    assert batch_coupled(graph) == "BatchNorm1d normalizes over the microbatch"
    assert all(torch.equal(buffers[name], b) for name, b in model.named_buffers())
    assert [m.training for m in model] == [True, True, False]
    assert torch.equal(torch.get_rng_state(), rng)
    model.eval()
    assert batch_coupled(harmony.decompose(model, (features(2, 0)[0],), depth=1)) == ""


def test_layers_on_the_meta_device_are_skipped_and_the_log_says_so(caplog):
    with torch.device("meta"):
        model = BlockNet(center)
    graph = harmony.decompose(model, (torch.randn(2, D_IN),))
    with caplog.at_level(logging.INFO, logger="harmony.decomposer.sample_mixing"):
        assert sample_mixing_layers(graph) == []
    assert "skipped: the layers are on the meta device" in caplog.text


# --------------------------------------------------------------------------- compile and train
@pytest.fixture(scope="module")
def centering_plan() -> tuple[nn.Module, Plan]:
    model = block_net(center)
    plan = harmony.compile(copy.deepcopy(model), cross_entropy, features, minibatch_size=MINIBATCH, devices=2,
                           build_optimizer=adam, probe=False)
    return model, plan


def test_a_layer_centering_over_the_batch_compiles_with_equal_microbatch_sizes(centering_plan):
    _, plan = centering_plan
    index = layer_named(plan.graph, f"blocks.{MIXING_BLOCK}")
    assert plan.options["same_u"] == f"layer {index} (blocks.{MIXING_BLOCK}) {MIXES}"
    assert plan.tasks.config.u_f == plan.tasks.config.u_b
    free = search(plan.profile, plan.profile.machine, "pp", 2, MINIBATCH, capacity=plan.options["planned_memory"],
                  keep_candidates=True)
    assert any(config.u_f != config.u_b for _, config in free.candidates), "the capacity leaves U_F != U_B possible"


def test_a_layer_centering_over_the_batch_trains_like_eager_with_the_same_microbatches(centering_plan):
    model, plan = centering_plan
    losses, expected, error = train_both(model, plan)
    assert losses == pytest.approx(expected, rel=1e-9)
    assert error <= 1e-9


def test_unequal_microbatch_sizes_forced_on_a_centering_model_train_unlike_eager(centering_plan):
    """What the check prevents: forward microbatches of 4, recompute and backward of 2."""
    model, plan = centering_plan
    n = len(plan.graph.layers)
    config = Configuration(u_f=4, packs_f=[(0, 2), (3, n - 1)], u_b=2, packs_b=[(0, 1), (2, 2), (3, n - 1)])
    tasks = generate("pp", plan.profile, config, 2, MINIBATCH, update="device")
    forced = Plan(graph=plan.graph, profile=plan.profile, tasks=tasks, estimate={},
                  options={**plan.options, "device_memory": 10**9})
    forced.loss_fn = cross_entropy
    _, _, error = train_both(model, forced, steps=1)
    assert error > 1e-6


# --------------------------------------------------------------------------- the fewest samples a model trains on
class NormedMLP(nn.Module):
    """BatchNorm1d after each hidden layer: in training it refuses a microbatch of one sample."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(D_IN if i == 0 else WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU()) for i in range(3))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_a_model_that_cannot_train_on_one_sample_trains_like_eager_on_microbatches_of_two_or_more(mode):
    torch.manual_seed(0)
    model = NormedMLP().double()
    minibatch = 33  # odd: no size may leave a last microbatch of one sample
    graph = harmony.decompose(copy.deepcopy(model), (features(2, 0)[0],))
    capacity = training_footprint(graph, features, minibatch) // 3
    plan = harmony.compile(copy.deepcopy(model), cross_entropy, features, minibatch_size=minibatch, devices=2,
                           device_memory=capacity, mode=mode, build_optimizer=adam, probe=False)
    assert plan.profile.u_min == 2
    sizes = [u for task in plan.tasks.tasks for u in task.microbatches]
    assert min(sizes) >= 2 and max(sizes) < minibatch, plan.tasks.config
    reference = copy.deepcopy(model)
    batches = [features(minibatch, step) for step in range(2)]
    with harmony.Trainer(plan, optimizer=adam, timeout=60) as trainer:
        losses = [trainer.step(*batch) for batch in batches]
        state = trainer.state_dict()
    assert losses == pytest.approx(reference_train(reference, cross_entropy, adam, batches, microbatches_of(plan.tasks)),
                                   rel=1e-9)
    for name, want in reference.state_dict().items():
        assert torch.allclose(state[name], want, rtol=1e-9, atol=1e-9), name


# --------------------------------------------------------------------------- random draws no name gives away
def keep_most(x: torch.Tensor) -> torch.Tensor:
    """Stochastic depth's way: a function fx keeps whole (``torch.fx.wrap``), so the layer's code
    shows a call to it and no random op."""
    return x * torch.empty(x.shape[0], 1, dtype=x.dtype, device=x.device).bernoulli_(0.8) / 0.8


torch.fx.wrap("keep_most")


class StochasticNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D_IN if i == 0 else WIDTH, WIDTH) for i in range(3))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = keep_most(torch.tanh(block(x))) if i == 1 else torch.tanh(block(x))
        return self.head(x)


def test_a_layer_drawing_random_numbers_through_a_call_no_name_gives_away_is_reported():
    torch.manual_seed(0)
    graph = decompose(StochasticNet().double())
    assert "keep_most" in graph.sources[graph.layers[layer_named(graph, "blocks.1")].code_file]
    assert batch_coupled(graph, (features(2, 0)[0],)) == f"layers draw random numbers (layer {layer_named(graph, 'blocks.1')} (blocks.1))"
