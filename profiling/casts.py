"""Which weights may travel in low precision: those autocast only ever casts.

Under ``torch.autocast`` an op on autocast's lower-precision list (a linear layer, a matmul, a
convolution) casts its float32 weight to bf16/fp16 before it runs. If every use of a weight is such
a cast, the device never needs the float32 copy: a copy cast on the host (round to nearest even,
the same rounding) gives the op the very values eager autocast gives it, at half the bytes to move
and hold. A weight any op reads as it is (a LayerNorm's, which autocast runs in float32; an
embedding table) keeps its float32 copy.

A frozen weight (``requires_grad=False``) always travels so. A trainable one (``LowCopy.trainable``)
does only where the host steps it (``Profile.for_update``): a device step needs the float32 master
on the device. Its gradient then reaches float32 as eager's does, through the backward of the cast
(``runtime/compute.py``'s ``_GradInFloat32``), and adds up in a float32 buffer. Tied weights keep
float32 (their bytes are accounted once per pack, in ``TiedWeight``).

The uses are found by running each layer once on fake tensors (no memory, no arithmetic) of the plan's
device type under autocast, recording the ops that read each weight with a ``TorchDispatchMode``:
the dispatch mode sits below autocast, so it sees autocast's casts as ``aten._to_copy`` ops.
"""

from __future__ import annotations

import logging

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from harmony.decomposer.layer_graph import LayerGraph
from harmony.profiling.analytic import _LayerRunner
from harmony.profiling.measure import measure_cast
from harmony.profiling.profiles import LowCopy

log = logging.getLogger(__name__)

# ops that read a tensor's metadata, not its values
_METADATA = {torch.ops.prim.device.default}


class _Uses(TorchDispatchMode):
    """Per watched tensor, whether every op reading it so far was a cast to ``dtype``."""

    def __init__(self, watched: dict[int, str], dtype: torch.dtype) -> None:
        super().__init__()
        self.watched, self.dtype = watched, dtype
        self.cast: dict[str, bool] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA:
            is_cast = func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == self.dtype
            for t in pytree.tree_leaves((args, kwargs)):
                name = self.watched.get(id(t)) if isinstance(t, torch.Tensor) else None
                if name is not None:
                    self.cast[name] = self.cast.get(name, True) and is_cast
        return func(*args, **kwargs)


def low_copies(graph: LayerGraph, device_type: str, dtype: torch.dtype | None,
               host_bandwidth: float | None = None) -> list[LowCopy]:
    """The weights of ``graph`` that every use casts to ``dtype`` under autocast on ``device_type``
    (none for float32), frozen and trainable (``LowCopy.trainable``). Where that device type cannot
    run here (an analytic CUDA plan on a machine without CUDA), CPU autocast's op lists stand in.

    A trainable copy's ``cast_time`` (the host casts it after each step) is measured on this host,
    or for an analytic plan (``host_bandwidth``, bytes/s of the modelled host's memory) the cast's
    traffic at that bandwidth."""
    if dtype is None:
        return []
    if device_type == "cuda" and not torch.cuda.is_available():
        device_type = "cpu"
    tied = {graph.canonical(n) for canon, aliases in graph.ties.items() for n in (canon, *aliases)}
    copies: dict[str, LowCopy] = {}
    for index, module in enumerate(graph.modules):
        weights = {name: p for name, p in module.named_parameters(remove_duplicate=False)
                   if p.is_floating_point() and p.dtype.itemsize > dtype.itemsize and graph.canonical(name) not in tied}
        if not weights:
            continue
        try:
            cast = _cast_only(graph, index, module, device_type, dtype, set(weights))
        except Exception as exc:  # a layer fake tensors cannot run: its weights keep float32
            log.info("layer %d (%s): uses of its weights unknown (%s: %s); they travel in %s",
                     index, graph.layers[index].name, type(exc).__name__, exc, str(next(iter(weights.values())).dtype))
            continue
        for name in sorted(n for n, only in cast.items() if only):
            p = weights[name]
            cast_time = 0.0
            if p.requires_grad:
                cast_time = (p.numel() * (p.element_size() + dtype.itemsize) / host_bandwidth if host_bandwidth
                             else measure_cast(p, dtype))
            copies.setdefault(graph.canonical(name), LowCopy(
                name=graph.canonical(name), layer=index, dtype=str(dtype).removeprefix("torch."),
                saved=p.numel() * (p.element_size() - dtype.itemsize), trainable=p.requires_grad,
                cast_time=cast_time, kept_cast=p.numel() * dtype.itemsize if p.dim() >= 2 else 0))
    return list(copies.values())


def _cast_only(graph: LayerGraph, index: int, module: torch.nn.Module, device_type: str, dtype: torch.dtype,
               names: set[str]) -> dict[str, bool]:
    """Per named weight of the layer, whether its forward under autocast only casts it to ``dtype``."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = _LayerRunner(graph, index, module, None, None, device=device_type)
        state = layer.meta_state()
        inputs = layer.meta_inputs(1, grad=False)
        uses = _Uses({id(state[n]): n for n in names}, dtype)
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype), uses:
            functional_call(module, state, tuple(inputs))
    return uses.cast
