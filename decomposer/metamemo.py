"""What a standard ``torch.nn`` module or functional returns on meta tensors, remembered by what it was given.

Shape propagation runs the traced model three times on meta tensors (``decompose._propagate``,
``batching.probe``), and on the meta device most ops run as Python decompositions (a LayerNorm is
a dozen ``torch._refs`` calls): for GPT-2 1.5B that was about a second per run, nearly all of it
the same Linear, LayerNorm and Dropout called with the same shapes in each of 48 blocks. A
``torch.nn`` module's output metadata is a function of its configuration (its ``repr``), its state's
metadata and its inputs' metadata, so each distinct call runs once and later ones get fresh meta
tensors of the same shapes, strides, dtypes and ``requires_grad``.

The functions of ``torch.nn.functional`` are remembered the same way: on meta tensors
``F.scaled_dot_product_attention`` runs its math decomposition (scores, mask, softmax) on every
call, the dearest op of a propagation of GPT-2's blocks. Such a function's output is a function of its
inputs' metadata and its other arguments. A result that is one of its inputs (``inplace=True``) or a
view of one is not remembered, so a later call makes its own alias as the first did.

Only meta propagation is memoized (real tensors carry data a module may branch on), and only
modules whose class ``torch.nn`` defines (a user's module may keep Python state between calls)
and functions ``torch.nn.functional`` defines (a user's function may too).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

__all__ = ["MetaMemo"]

_IMMUTABLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)
# where the functions of torch.nn.functional are defined: there in Python, or in its C module
_FUNCTIONAL_MODULES = ("torch.nn.functional", "torch._C._nn")


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

    @staticmethod
    def memoizable_function(fn: Any) -> bool:
        return getattr(fn, "__module__", None) in _FUNCTIONAL_MODULES

    def call(self, module: torch.nn.Module, state: dict[str, torch.Tensor], args: tuple, kwargs: dict,
             run: Callable[[], Any]) -> Any:
        """``run()``'s result, or a copy of the result of an earlier call with the same metadata."""
        try:
            key = (type(module), repr(module), module.training, tuple((name, _leaf_key(t)) for name, t in state.items()),
                   *self._arguments_key(args, kwargs))
        except _Unmemoizable:
            return run()
        return self._remembered(key, args, kwargs, run)

    def call_function(self, fn: Callable, args: tuple, kwargs: dict, run: Callable[[], Any]) -> Any:
        """``call`` for a function of ``torch.nn.functional`` (``memoizable_function``)."""
        try:
            key = (fn, *self._arguments_key(args, kwargs))
        except _Unmemoizable:
            return run()
        return self._remembered(key, args, kwargs, run)

    def _remembered(self, key: tuple, args: tuple, kwargs: dict, run: Callable[[], Any]) -> Any:
        if key in self._outputs:
            leaves, spec = self._outputs[key]
            return pytree.tree_unflatten([_rebuild(m) for m in leaves], spec)
        result = run()
        leaves, spec = pytree.tree_flatten(result)
        if _aliases(leaves, args, kwargs):
            return result
        try:
            self._outputs[key] = ([_leaf_key(x) for x in leaves], spec)
        except _Unmemoizable:
            pass
        return result

    @staticmethod
    def _arguments_key(args: tuple, kwargs: dict) -> tuple:
        """What besides the callee decides the outputs' metadata: the arguments' and the modes'
        (grad mode: ``requires_grad``; autocast: dtypes)."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        autocast = tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                         for device in ("cpu", "cuda"))
        return torch.is_grad_enabled(), autocast, tuple(_leaf_key(x) for x in leaves), str(spec)


def _aliases(outputs: list, args: tuple, kwargs: dict) -> bool:
    """Whether an output is an input or a view of one's storage (an in-place call, a view), which a
    later call must make from its own input."""
    inputs = {id(_root(x)) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
    return any(isinstance(x, torch.Tensor) and id(_root(x)) in inputs for x in outputs)


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` views (``t`` itself if it is no view)."""
    return t if t._base is None else t._base
