"""Models built on the meta device skip their initialisers and come out as they would with them."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harmony.decomposer.meta_init import on_meta


class _Ops(TorchDispatchMode):
    """The names of the aten ops dispatched meanwhile."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _Initialised(torch.nn.Module):
    """Standard layers plus the initialisation a Hugging Face model writes itself."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.scale = torch.nn.Parameter(torch.empty(8))
        self.linear.weight.data.normal_(mean=0.0, std=0.02)
        torch.nn.init.trunc_normal_(self.scale, std=0.02)
        torch.nn.init.xavier_uniform_(self.linear.weight)


def _described(model: torch.nn.Module) -> list[tuple]:
    return [(name, t.device.type, tuple(t.shape), t.stride(), t.dtype, t.requires_grad, type(t).__name__)
            for name, t in list(model.named_parameters()) + list(model.named_buffers())]


def test_a_model_built_on_meta_without_initialisers_equals_one_built_with_them():
    with torch.device("meta"):
        initialised = _Initialised()
    with on_meta():
        skipped = _Initialised()
    assert _described(skipped) == _described(initialised)
    assert repr(skipped) == repr(initialised)


def test_no_random_fill_runs_on_meta():
    with _Ops() as ops, on_meta():
        _Initialised()
    assert not [name for name in ops.names if name.split(".")[0] in ("normal_", "uniform_", "normal", "uniform")]
    with _Ops() as ops, torch.device("meta"):
        _Initialised()
    assert [name for name in ops.names if name.split(".")[0] in ("normal_", "uniform_")]


def test_a_tensor_off_the_meta_device_is_still_initialised():
    with on_meta():
        real = torch.zeros(64, device="cpu")
        torch.nn.init.normal_(real)
        meta = torch.empty(64)
    assert real.abs().sum() > 0
    assert meta.is_meta
