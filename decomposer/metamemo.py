"""What a standard ``torch.nn`` module returns on meta tensors, remembered by what it was given.

Shape propagation runs the traced model three times on meta tensors (``decompose._propagate``,
``batching.probe``), and on the meta device most ops run as Python decompositions (a LayerNorm is
a dozen ``torch._refs`` calls): for GPT-2 1.5B that was about a second per run, nearly all of it
the same Linear, LayerNorm and Dropout called with the same shapes in each of 48 blocks. A
``torch.nn`` module's output metadata is a function of its configuration (its ``repr``), its state's
metadata and its inputs' metadata, so each distinct call runs once and later ones get fresh meta
tensors of the same shapes, strides, dtypes and ``requires_grad``.

Only meta propagation is memoized (real tensors carry data a module may branch on), and only
modules whose class ``torch.nn`` defines (a user's module may keep Python state between calls).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

__all__ = ["MetaMemo"]

_IMMUTABLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


class _Unmemoizable(Exception):
    """A value whose metadata does not say everything about it (a list, a user object)."""


def _tensor_meta(t: torch.Tensor) -> tuple:
    return ("tensor", tuple(t.shape), t.stride(), t.dtype, t.requires_grad)


def _leaf_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if not x.is_meta:
            raise _Unmemoizable
        return _tensor_meta(x)
    if isinstance(x, _IMMUTABLE):
        return (type(x), x)
    raise _Unmemoizable


def _rebuild(key: tuple) -> Any:
    """The value ``_leaf_key`` described: a fresh meta tensor, or the immutable value itself."""
    if key[0] == "tensor":
        _, shape, stride, dtype, requires_grad = key
        if requires_grad:
            return _op_output(shape, stride, dtype)
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return key[1]


def _op_output(shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor that requires grad as a module's output does: made by an op, not a leaf, so
    that an in-place op after it (``ReLU(inplace=True)`` after a BatchNorm, torchvision's
    ShuffleNet and MobileNet) is as legal as on the real output. A clone keeps the strides of a
    dense layout; any other is a view of a cloned flat storage."""
    out = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=True).clone()
    if out.stride() == tuple(stride):
        return out
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    return torch.empty(span, dtype=dtype, device="meta", requires_grad=True).clone().as_strided(shape, stride)


class MetaMemo:
    """Remembers each standard module call's output metadata during one propagation."""

    def __init__(self) -> None:
        self._outputs: dict[tuple, tuple[list, pytree.TreeSpec]] = {}

    @staticmethod
    def memoizable(module: torch.nn.Module) -> bool:
        return type(module).__module__.startswith("torch.nn.")

    def call(self, module: torch.nn.Module, state: dict[str, torch.Tensor], args: tuple, kwargs: dict,
             run: Callable[[], Any]) -> Any:
        """``run()``'s result, or a copy of the result of an earlier call with the same metadata."""
        try:
            key = self._key(module, state, args, kwargs)
        except _Unmemoizable:
            return run()
        if key in self._outputs:
            leaves, spec = self._outputs[key]
            return pytree.tree_unflatten([_rebuild(m) for m in leaves], spec)
        result = run()
        leaves, spec = pytree.tree_flatten(result)
        try:
            self._outputs[key] = ([_leaf_key(x) for x in leaves], spec)
        except _Unmemoizable:
            pass
        return result

    @staticmethod
    def _key(module: torch.nn.Module, state: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> tuple:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return (type(module), repr(module), module.training, torch.is_grad_enabled(),
                tuple((name, _leaf_key(t)) for name, t in state.items()),
                tuple(_leaf_key(x) for x in leaves), str(spec))
