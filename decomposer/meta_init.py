"""Building a module on the meta device without running its initialisers.

A module built under ``torch.device("meta")`` has parameters with shapes and dtypes but no values,
so the random numbers its initialisers draw land nowhere. Yet they still run: ``nn.init.normal_``
on a meta tensor goes through a Python decomposition (``torch._refs.normal_``) whose first call
imports ``torch._dynamo``, and GPT-2 1.5B's constructor spent longer in its initialisers than in
everything else. ``on_meta`` skips them: an initialiser or in-place random fill whose tensor is on
the meta device returns that tensor as it is, which leaves exactly what running it would
(shape, stride, dtype, ``requires_grad``: an in-place fill changes none of them).

Only meta tensors are spared: a tensor built elsewhere inside the block (an explicit
``device="cpu"``) is initialised as usual, since its values are real and may be read.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["on_meta"]

# the in-place fills of Tensor that draw random numbers, which torch.nn.init and models' own
# ``_init_weights`` (``module.weight.data.normal_(...)``) call
RANDOM_FILLS = ("normal_", "uniform_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_", "bernoulli_")


def _initialisers() -> frozenset:
    """Every public ``torch.nn.init`` function (each fills its first argument in place and returns
    it) and the Tensor methods of ``RANDOM_FILLS``."""
    init = {f for name, f in vars(torch.nn.init).items()
            if name.endswith("_") and not name.startswith("_") and callable(f)}
    return frozenset(init | {getattr(torch.Tensor, name) for name in RANDOM_FILLS})


_INITIALISERS = _initialisers()


class _SkipMetaInit(TorchFunctionMode):
    """Returns the meta tensor an initialiser was given instead of filling it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[Any]:
    """``torch.device("meta")`` whose modules are built without running their initialisers."""
    with torch.device("meta"), _SkipMetaInit():
        yield
