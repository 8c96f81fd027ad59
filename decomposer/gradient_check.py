"""The decomposition checked against eager autograd: the layers' output and every parameter's
gradient on the example batch equal the original model's.

A tracer can lose part of what a model's forward means to autograd without an error (a custom
``autograd.Function``'s backward, a tensor hook, a grad-mode region): the loss comes out right and
the gradients do not. ``autograd_guard`` keeps or refuses every such construct Harmony knows of;
this check is there for the ones it does not. It runs the model once as written and once as its
layers, one forward and one backward each, on a copy of the model (float64 where the model
allows, so that only a real difference shows), from the same random state, and refuses a
decomposition whose output or gradients differ, naming where.

The backward runs from the last layer to the first, and a wrong backward in one layer spreads to
every parameter before it: the layer named is the last one whose parameters' gradients differ.
Models on the meta device (built without weights) cannot run and are not checked.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from harmony.decomposer.layer_graph import LayerGraph
from harmony.errors import DecomposeError

log = logging.getLogger(__name__)

SEED = 0
# relative and absolute tolerance by the dtype the check computes in; float64 leaves room only for
# the order of summation (torch.export's aten ops against the model's own calls)
TOLERANCE = {torch.float64: (1e-7, 1e-10), torch.float32: (1e-3, 1e-6)}
LOW_PRECISION = (1e-1, 1e-3)
HOST_SHARE = 0.25  # the most of the host's free memory the copies may take


@dataclass
class Mismatch:
    """What differs: the output, or a parameter's gradient (and its layer)."""

    what: str
    layer: int | None
    error: float
    scale: float


def check_gradients(model: torch.nn.Module, graph: LayerGraph, inputs: tuple, target: Any,
                    loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> None:
    """Refuse ``graph`` (a ``DecomposeError`` naming where) unless its layers give ``model``'s
    output and parameter gradients on ``inputs``; ``loss_fn(output, target)`` makes the loss (a
    fixed random projection of the outputs without it)."""
    why = _cannot_check(model, inputs)
    if why:
        log.warning("gradient check skipped: %s", why)
        return
    try:
        mismatch, dtype = _compare(model, graph, inputs, target, loss_fn, torch.float64), torch.float64
    except _CannotRun as exc:
        log.info("the gradient check cannot run the model in float64 (%s); checking in its own precision", exc)
        try:
            mismatch, dtype = _compare(model, graph, inputs, target, loss_fn, None), None
        except _CannotRun as again:
            log.warning("gradient check skipped: the model does not run on a copy (%s)", again)
            return
    if mismatch is not None:
        raise DecomposeError(_message(graph, mismatch, dtype))
    log.info("gradient check: the layers give the model's output and gradients")


class _CannotRun(Exception):
    """The model (or the loss) could not run on the check's copy."""


def _cannot_check(model: torch.nn.Module, inputs: tuple) -> str:
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.is_meta for t in tensors) or any(isinstance(x, torch.Tensor) and x.is_meta for x in inputs):
        return "the model is on the meta device (built without weights); its layers were not compared with it"
    if any(t.device.type != "cpu" for t in tensors):
        return "the model is not on the host"
    return too_large_to_copy(model, 8)


def too_large_to_copy(model: torch.nn.Module, itemsize: int | None = None) -> str:
    """Why a copy of ``model`` (at ``itemsize`` bytes an element, its own without) should not be
    made on the host for a check, or "": it would take more than ``HOST_SHARE`` of the free memory."""
    size = sum(t.numel() * (itemsize or t.element_size()) for t in list(model.parameters()) + list(model.buffers()))
    free = _free_host_memory()
    if free is not None and size > HOST_SHARE * free:
        return f"a copy of the model ({size / 2**30:.1f} GiB) would take more than {HOST_SHARE:.0%} of the host's free memory"
    return ""


def _free_host_memory() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cast(x: Any, dtype: torch.dtype | None) -> Any:
    if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(dtype)
    return x


def _compare(model: torch.nn.Module, graph: LayerGraph, inputs: tuple, target: Any,
             loss_fn: Callable | None, dtype: torch.dtype | None) -> Mismatch | None:
    reference = copy.deepcopy(model)
    if dtype is not None:
        reference = reference.to(dtype)
    inputs = tuple(_cast(x, dtype) for x in inputs)
    target = pytree.tree_map(lambda x: _cast(x, dtype), target)
    buffers = {name: b.clone() for name, b in reference.named_buffers()}
    params = dict(reference.named_parameters())
    try:
        eager_out, eager_grads = _run(lambda: reference(*inputs), params, target, loss_fn)
    except Exception as exc:  # noqa: BLE001 - whatever fails, the check cannot run in this precision
        raise _CannotRun(f"{type(exc).__name__}: {exc}") from exc
    with torch.no_grad():
        for name, b in reference.named_buffers():
            b.copy_(buffers[name])
    _place_constants(reference, graph)
    layers = graph.layer_modules(device="cpu", source=reference)

    def layered() -> Any:
        values: tuple = inputs
        for module in layers:
            values = tuple(module(*values))
        return pytree.tree_unflatten(list(values), graph.out_spec())

    try:
        layer_out, layer_grads = _run(layered, params, target, loss_fn)
    except Exception as exc:  # noqa: BLE001
        if dtype is not None:  # the trace fixed a dtype (torch.export bakes a cast's target in): not in float64
            raise _CannotRun(f"the layers: {type(exc).__name__}: {exc}") from exc
        raise DecomposeError(f"the decomposed layers fail on the example batch where the model runs: "
                             f"{type(exc).__name__}: {exc}") from exc
    precision = next((p.dtype for p in params.values() if p.is_floating_point()), torch.float32)
    rtol, atol = TOLERANCE.get(precision, LOW_PRECISION)
    return _first_difference(graph, eager_out, layer_out, eager_grads, layer_grads, rtol, atol)


def _place_constants(model: torch.nn.Module, graph: LayerGraph) -> None:
    """Tensors torch.export lifted out of forward() (``tracing.lifted_on``), set on the copy the
    layers bind to: the model itself has no attribute for them."""
    for name in graph.constants:
        module_path, _, attr = name.rpartition(".")
        owner = model.get_submodule(module_path) if module_path else model
        if not isinstance(getattr(owner, attr, None), torch.Tensor):
            object.__setattr__(owner, attr, graph.constant_value(name))


def _run(forward: Callable[[], Any], params: dict[str, torch.nn.Parameter], target: Any,
         loss_fn: Callable | None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The output's tensors and every trainable parameter's gradient after one forward and backward."""
    for p in params.values():
        p.grad = None
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(SEED)
        output = forward()
        loss = loss_fn(output, target) if loss_fn is not None else _projection(output)
        loss.backward()
    outputs = [x.detach() for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]
    grads = {name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for name, p in params.items() if p.requires_grad}
    for p in params.values():
        p.grad = None
    return outputs, grads


def _projection(output: Any) -> torch.Tensor:
    """A loss without the user's: each floating output against fixed random weights."""
    total = None
    generator = torch.Generator().manual_seed(SEED)
    for x in pytree.tree_leaves(output):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
            weights = torch.rand(x.shape, generator=generator, dtype=x.dtype)
            term = (x * weights).sum()
            total = term if total is None else total + term
    if total is None:
        raise _CannotRun("the model's output has no floating tensor that requires grad")
    return total


def _difference(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[float, float] | None:
    """(largest error, scale) where ``a`` and ``b`` differ beyond the tolerance, else None."""
    if a.shape != b.shape:
        return float("inf"), 0.0
    if not a.is_floating_point():
        return None if torch.equal(a, b) else (float("inf"), 0.0)
    scale = float(b.abs().max()) if b.numel() else 0.0
    error = float((a - b).abs().max()) if a.numel() else 0.0
    if error != error or error > atol * max(1.0, scale) + rtol * scale:
        return error, scale
    return None


def _first_difference(graph: LayerGraph, eager_out: list[torch.Tensor], layer_out: list[torch.Tensor],
                      eager_grads: dict[str, torch.Tensor], layer_grads: dict[str, torch.Tensor],
                      rtol: float, atol: float) -> Mismatch | None:
    for i, (a, b) in enumerate(zip(layer_out, eager_out)):
        found = _difference(a, b, rtol, atol)
        if found:
            return Mismatch(f"output {i} of the model", None, *found)
    owner = {name: spec.index for spec in graph.layers for name in spec.state}
    worst: Mismatch | None = None
    for name, eager in eager_grads.items():
        found = _difference(layer_grads[name], eager, rtol, atol)
        layer = owner.get(name, owner.get(graph.canonical(name)))
        if found and (worst is None or (layer or -1) > (worst.layer or -1)):
            worst = Mismatch(f"the gradient of parameter {name!r}", layer, *found)
    return worst


def _message(graph: LayerGraph, mismatch: Mismatch, dtype: torch.dtype | None) -> str:
    where = ""
    if mismatch.layer is not None:
        spec = graph.layers[mismatch.layer]
        where = (f" It is the last layer whose gradients differ, layer {spec.index} ({spec.name}): the backward "
                 f"goes wrong there or in a later layer without parameters.")
    precision = "float64 copies" if dtype is torch.float64 else "a copy in the model's own precision"
    return (f"the decomposed layers do not train as the model does: on the example batch ({precision}), "
            f"{mismatch.what} differs from eager autograd's by {mismatch.error:.3g} (of {mismatch.scale:.3g}).{where} "
            "Either the model uses something the traced layers lose (a construct in forward() that torch.fx or "
            "torch.export cannot see): keep the module doing it whole (opaque_modules=[...], CLI --opaque), and "
            "please report it; or its forward does not compute the same twice (state kept between calls, such as "
            "a counter in a module or a Function, which Harmony's recompute would change): keep such state out of "
            "forward(). The check can be turned off (check_gradients=False, CLI --no-gradient-check), at the risk "
            "of training with wrong gradients")
