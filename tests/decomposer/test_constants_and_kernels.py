"""Tensors that are neither parameters nor buffers of the user's model, and operators without a meta
kernel, as outside models have them (found on Hugging Face Gemma, Falcon and BART):

* a 0-dim non-persistent buffer (Gemma's embedding normalizer) is recorded in the layer graph;
* a tensor written in ``forward`` (Falcon's attention) is lifted by torch.export under a name the
  model has no attribute for; the layers carry it, and the user's model is left without it;
* an operator with no meta kernel (BART's ``unique_consecutive``) makes shape propagation run on
  real tensors where the model has real weights, and a clear error where it has none;
* a Hugging Face config's `use_cache` is switched off while tracing (see `tracing._without_kv_cache`),
  but a config that refuses assignment is traced as it is.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import harmony
from harmony.errors import DecomposeError
from zoo import assert_layers_match_model

RTOL = 1e-10


class ScaledEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.register_buffer("normalizer", torch.tensor(8.0 ** 0.5), persistent=False)  # 0-dim
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, idx):
        x = self.embed(idx) * self.normalizer
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.sum(-1)


class ConstantInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * torch.tensor([0.5, 2.0] * 4, dtype=x.dtype)  # export lifts this tensor
        return x


class CheckWithoutMetaKernel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        runs = torch.unique_consecutive((x > 0).sum(1)).numel()  # no meta kernel in torch
        for block in self.blocks:
            x = torch.relu(block(x))
        return x * (runs > 0)


def test_a_zero_dim_non_persistent_buffer_is_kept_with_its_value():
    torch.manual_seed(0)
    model = ScaledEmbedding().double()
    lg = assert_layers_match_model(model, (torch.randint(0, 16, (4, 3)),), RTOL)
    value = lg.constant_value("normalizer")
    assert value.shape == () and float(value) == pytest.approx(8.0 ** 0.5)


def test_a_tensor_written_in_forward_travels_with_the_layers_and_not_with_the_model():
    torch.manual_seed(0)
    model = ConstantInForward().double()
    lg = assert_layers_match_model(model, (torch.randn(4, 8, dtype=torch.float64),), RTOL, method="export")
    assert lg.tracer == "export"
    lifted = [name for name in lg.constants if "lifted" in name]
    assert lifted, f"no lifted constant among {sorted(lg.constants)}"
    assert torch.equal(lg.constant_value(lifted[0]), torch.tensor([0.5, 2.0] * 4, dtype=torch.float64))
    assert not any("lifted" in name for name, _ in model.named_modules() for name in vars(_).keys())


def test_an_operator_without_a_meta_kernel_propagates_on_real_tensors():
    torch.manual_seed(0)
    model = CheckWithoutMetaKernel().double()
    lg = assert_layers_match_model(model, (torch.randn(4, 8, dtype=torch.float64),), RTOL)
    assert len(lg) > 1


def test_an_operator_without_a_meta_kernel_on_a_meta_model_is_a_clear_error():
    with torch.device("meta"):
        model = CheckWithoutMetaKernel()
    with pytest.raises(DecomposeError, match="unique_consecutive"):
        harmony.decompose(model, (torch.empty(4, 8, device="meta"),))


class FrozenConfig:
    """A config of someone else's that refuses assignment, with a ``use_cache`` field."""

    use_cache = True

    def __setattr__(self, name, value):
        raise AttributeError(f"{name} is read-only")


class WithFrozenConfig(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = FrozenConfig()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_a_config_that_refuses_assignment_is_traced_as_it_is():
    torch.manual_seed(0)
    model = WithFrozenConfig().double()
    assert_layers_match_model(model, (torch.randn(4, 8, dtype=torch.float64),), RTOL)
    assert model.config.use_cache is True
