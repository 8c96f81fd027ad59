"""Shared helpers for the decomposer tests: tiny model factories and the equivalence check (a
module of its own name, not conftest: other test folders have a conftest too, and
``from conftest import`` would take whichever was loaded last).

The reference for every check is the original model run eagerly (a deep copy taken before
decomposition, so batch-norm statistics start from the same values); the layered run goes through
``LayerGraph.run_sequential`` on layers that share the decomposed model's parameters.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import harmony
from harmony.models import bert, gpt2, resnet, vgg

OUR_MODELS = {"gpt2": gpt2, "bert": bert, "vgg": vgg, "resnet": resnet}

RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


# --------------------------------------------------------------------------- model factories
# Each factory: (dtype, dropout: bool) -> (model, example inputs tuple). Models come back in
# train() mode; tests choose eval()/train() themselves.

def our_model(name: str) -> Callable[[torch.dtype, bool], tuple[nn.Module, tuple]]:
    module = OUR_MODELS[name]

    def build(dtype: torch.dtype, dropout: bool) -> tuple[nn.Module, tuple]:
        dtype_name = str(dtype).removeprefix("torch.")
        kwargs: dict[str, Any] = {}
        if name != "resnet":  # ResNet has no dropout layers
            kwargs["dropout"] = 0.2 if dropout else 0.0
        torch.manual_seed(0)
        model = module.build_model(preset="tiny", dtype=dtype_name, **kwargs)
        inputs, _ = module.get_batch(2, 0, preset="tiny", dtype=dtype_name)
        return model, (inputs,)

    return build


def _images(dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 3, 32, 32, generator=g, dtype=dtype),)


def tv_resnet18(dtype: torch.dtype, dropout: bool) -> tuple[nn.Module, tuple]:
    torchvision = pytest.importorskip("torchvision")

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).to(dtype), _images(dtype)


def tv_vgg(dtype: torch.dtype, dropout: bool) -> tuple[nn.Module, tuple]:
    vgg_module = pytest.importorskip("torchvision.models.vgg")
    VGG, make_layers = vgg_module.VGG, vgg_module.make_layers

    torch.manual_seed(0)
    p = 0.3 if dropout else 0.0
    model = VGG(make_layers([8, "M", 16, "M", 16, "M"], batch_norm=True), num_classes=10, dropout=p)
    # torchvision's head expects 512x7x7 features; shrink it to the toy feature map
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.classifier = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(True), nn.Dropout(p), nn.Linear(32, 32), nn.ReLU(True), nn.Dropout(p),
        nn.Linear(32, 10),
    )
    return model.to(dtype), _images(dtype)


def tv_vit(dtype: torch.dtype, dropout: bool) -> tuple[nn.Module, tuple]:
    VisionTransformer = pytest.importorskip("torchvision.models.vision_transformer").VisionTransformer

    torch.manual_seed(0)
    p = 0.2 if dropout else 0.0
    model = VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=10,
        dropout=p, attention_dropout=p,
    )
    nn.init.normal_(model.heads.head.weight, std=0.1)  # torchvision zero-initializes the head
    return model.to(dtype), _images(dtype)


def _tokens(vocab: int, batch: int = 2, length: int = 8) -> tuple:
    g = torch.Generator().manual_seed(2)
    return (torch.randint(0, vocab, (batch, length), generator=g),)


def hf_gpt2(dtype: torch.dtype, dropout: bool) -> tuple[nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel

    p = 0.2 if dropout else 0.0
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, use_cache=False,
        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(dtype), _tokens(64)


def hf_bert(dtype: torch.dtype, dropout: bool) -> tuple[nn.Module, tuple]:
    from transformers import BertConfig, BertForMaskedLM

    p = 0.2 if dropout else 0.0
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=p, attention_probs_dropout_prob=p,
    )
    torch.manual_seed(0)
    return BertForMaskedLM(config).to(dtype), _tokens(64)


FACTORIES: dict[str, Callable[[torch.dtype, bool], tuple[nn.Module, tuple]]] = {
    "gpt2": our_model("gpt2"),
    "bert": our_model("bert"),
    "vgg": our_model("vgg"),
    "resnet": our_model("resnet"),
    "tv_resnet18": tv_resnet18,
    "tv_vgg": tv_vgg,
    "tv_vit": tv_vit,
    "hf_gpt2": hf_gpt2,
    "hf_bert": hf_bert,
}


# --------------------------------------------------------------------------- comparisons
def tensor_leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of a model output: a tensor, a (nested) tuple/dict, or a HF ModelOutput."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (absolute when expected is all zeros)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    if actual.numel() == 0:
        return 0.0
    a, e = actual.detach().double(), expected.detach().double()
    if not e.is_floating_point():
        return 0.0 if torch.equal(a, e) else float("inf")
    scale = e.abs().max().item()
    err = (a - e).abs().max().item()
    return err / scale if scale > 0 else err


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    err = rel_error(actual, expected)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


def _loss(out: Any) -> torch.Tensor:
    """A scalar mixing every floating output with fixed random weights, so every gradient is exercised."""
    g = torch.Generator().manual_seed(123)
    total = None
    for t in tensor_leaves(out):
        if not t.is_floating_point() or not t.requires_grad:
            continue
        w = torch.randn(t.shape, generator=g, dtype=t.dtype)
        term = (t * w).sum()
        total = term if total is None else total + term
    assert total is not None, "the model produced no differentiable output"
    return total


def _forward_backward(fn: Callable[..., Any], inputs: tuple, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    out = fn(*inputs)
    _loss(out).backward()
    return [t.detach() for t in tensor_leaves(out)]


def assert_layers_match_model(
    model: nn.Module,
    inputs: tuple,
    rtol: float,
    *,
    seed: int = 0,
    lg: "harmony.LayerGraph | None" = None,
    **decompose_kwargs: Any,
) -> "harmony.LayerGraph":
    """Decompose ``model`` and check that the layers, run in sequence, reproduce it exactly.

    Compares the outputs, the gradient of every parameter (tied parameters once) and every buffer
    (batch-norm running statistics) after one forward+backward in the model's current mode, with
    the RNG seeded identically before each run. Returns the layer graph.
    """
    inputs = tuple(inputs)
    reference = copy.deepcopy(model)
    if lg is None:
        lg = harmony.decompose(model, inputs, **decompose_kwargs)
    assert len(lg) >= 1

    ref_out = _forward_backward(reference, inputs, seed)
    model.zero_grad(set_to_none=True)
    out = _forward_backward(lg.run_sequential, inputs, seed)

    assert len(out) == len(ref_out), f"{len(out)} outputs from the layers, {len(ref_out)} from the model"
    for i, (a, e) in enumerate(zip(out, ref_out)):
        assert_close(a, e, rtol, f"output {i}")

    ref_params = dict(reference.named_parameters())
    params = dict(model.named_parameters())
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        ref_grad = ref_params[name].grad
        if ref_grad is None:
            assert p.grad is None, f"{name} has a gradient from the layers but none from the model"
            continue
        assert p.grad is not None, f"{name} got no gradient from the layers"
        assert_close(p.grad, ref_grad, rtol, f"gradient of {name}")

    ref_buffers = dict(reference.named_buffers())
    buffers = dict(model.named_buffers())
    assert buffers.keys() == ref_buffers.keys()
    for name, b in buffers.items():
        assert_close(b, ref_buffers[name], rtol, f"buffer {name}")
    return lg
