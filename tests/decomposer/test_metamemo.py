"""The meta propagation's memo of standard module and functional calls: same metadata out, each
distinct call run once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import harmony
from harmony.decomposer.metamemo import MetaMemo


def _counted(module, state, args, kwargs, memo, calls):
    def run():
        calls.append(1)
        return torch.func.functional_call(module, state, args, kwargs)
    return memo.call(module, state, args, kwargs, run)


def _meta_state(module):
    return {k: v.detach().to("meta").requires_grad_(v.requires_grad) for k, v in module.named_parameters()}


def test_a_repeated_call_runs_once_and_returns_fresh_tensors_of_the_same_metadata():
    memo, calls = MetaMemo(), []
    linear = torch.nn.Linear(8, 4)
    x = torch.empty(3, 5, 8, device="meta")
    first = _counted(linear, _meta_state(linear), (x,), {}, memo, calls)
    second = _counted(torch.nn.Linear(8, 4), _meta_state(linear), (torch.empty(3, 5, 8, device="meta"),), {}, memo,
                      calls)
    assert len(calls) == 1
    assert second is not first
    assert (second.shape, second.stride(), second.dtype, second.requires_grad) == \
        (first.shape, first.stride(), first.dtype, first.requires_grad)


def test_another_configuration_or_shape_runs_again():
    memo, calls = MetaMemo(), []
    x = torch.empty(2, 8, device="meta")
    norm = torch.nn.LayerNorm(8)
    state = _meta_state(norm)
    _counted(norm, state, (x,), {}, memo, calls)
    _counted(torch.nn.LayerNorm(8, eps=1e-3), state, (x,), {}, memo, calls)  # repr differs
    _counted(norm, state, (torch.empty(4, 8, device="meta"),), {}, memo, calls)
    _counted(norm, state, (x.requires_grad_(True),), {}, memo, calls)
    _counted(norm, state, (x,), {}, memo, calls)  # the last call again
    assert len(calls) == 4


def test_real_tensors_and_mutable_arguments_are_not_memoized():
    memo, calls = MetaMemo(), []
    relu = torch.nn.ReLU()
    for _ in range(2):
        _counted(relu, {}, (torch.zeros(2),), {}, memo, calls)
    assert len(calls) == 2
    assert not MetaMemo.memoizable(type("Mine", (torch.nn.Module,), {})())
    assert MetaMemo.memoizable(relu)


def _counted_function(fn, args, kwargs, memo, calls):
    def run():
        calls.append(1)
        return fn(*args, **kwargs)
    return memo.call_function(fn, args, kwargs, run)


def test_a_repeated_functional_call_runs_once():
    memo, calls = MetaMemo(), []
    q = torch.empty(2, 4, 16, 8, device="meta", requires_grad=True)
    first = _counted_function(F.scaled_dot_product_attention, (q, q, q), {"is_causal": True}, memo, calls)
    q2 = torch.empty(2, 4, 16, 8, device="meta", requires_grad=True)
    second = _counted_function(F.scaled_dot_product_attention, (q2, q2, q2), {"is_causal": True}, memo, calls)
    _counted_function(F.scaled_dot_product_attention, (q2, q2, q2), {"is_causal": False}, memo, calls)
    assert len(calls) == 2
    assert second is not first
    assert (second.shape, second.stride(), second.dtype, second.requires_grad) == \
        (first.shape, first.stride(), first.dtype, first.requires_grad)
    assert MetaMemo.memoizable_function(F.scaled_dot_product_attention) and MetaMemo.memoizable_function(F.softmax)
    assert not MetaMemo.memoizable_function(lambda x: x)


def test_an_in_place_functional_call_is_not_remembered_and_returns_its_own_input():
    memo, calls = MetaMemo(), []
    for _ in range(2):
        x = torch.empty(3, 5, device="meta")
        out = _counted_function(F.relu, (x,), {"inplace": True}, memo, calls)
        assert out is x
    assert len(calls) == 2


class _Blocks(torch.nn.Module):
    def __init__(self, width=16, depth=4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                torch.nn.Linear(2 * width, width)) for _ in range(depth))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
            b, t, c = x.shape
            q = x.view(b, t, 2, c // 2).transpose(1, 2)
            x = x + F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = F.relu(x.clone(), inplace=True)
        return self.head(x)


def test_decomposing_on_meta_describes_every_value_as_without_the_memo(monkeypatch):
    """Modules and functionals (attention, an in-place ReLU) alike."""
    with torch.device("meta"):
        model = _Blocks()
    x = torch.empty(4, 7, 16, device="meta")
    with_memo = harmony.decompose(model, (x,))
    monkeypatch.setattr(MetaMemo, "memoizable", staticmethod(lambda module: False))
    monkeypatch.setattr(MetaMemo, "memoizable_function", staticmethod(lambda fn: False))
    without = harmony.decompose(model, (x,))
    assert with_memo.values == without.values
    assert [layer.inputs for layer in with_memo.layers] == [layer.inputs for layer in without.layers]
