"""Grad-mode regions inside a model's forward (``no_grad``, ``set_grad_enabled(False)``,
``inference_mode``) kept as eager runs them.

A value computed under ``torch.no_grad()`` carries no gradient: a statistic, a target, an update
of a running estimate. Neither tracer writes the region into the code it produces: torch.fx only
sees grad mode flip while it traces (the calls inside are recorded like any other), and
torch.export wraps the region in a ``wrap_with_set_grad_enabled`` subgraph that layer code cannot
hold. Both are brought to one form, a mark on every node computed with grad off (``NO_GRAD`` in
the node's meta):

- torch.fx: the tracer marks each node it creates while grad mode is off (``mark_if_no_grad``);
- torch.export: each region's subgraph is inlined into the flat graph with its nodes marked
  (``inline_region``).

Whatever runs the flat graph runs a marked node under ``no_grad`` (``run_marked``), and code
generation brackets each run of marked nodes in a layer with ``grad_off`` / ``grad_restore``
(``bracket``), so a region cut by a layer boundary is closed and reopened around it, and the
mode the caller had (a forward without autograd, a recompute with it) comes back after the run.
Regions that turn grad mode on inside forward() need no mark: the layers run with the caller's
mode, which for a training forward is on.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from harmony.decomposer.layer_support import grad_off, grad_restore

NO_GRAD = "harmony_no_grad"

def is_region(node: fx.Node) -> bool:
    """Whether ``node`` is torch.export's subgraph for a grad-mode region."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "wrap_with_set_grad_enabled"


def mark_if_no_grad(node: fx.Node) -> None:
    """torch.fx: mark a node created while the tracer runs with grad mode off."""
    if not torch.is_grad_enabled():
        node.meta[NO_GRAD] = True


def is_region_body(node: fx.Node) -> bool:
    """Whether ``node`` reads a submodule that only grad-mode regions use (inlined, not kept)."""
    return node.op == "get_attr" and bool(node.users) and all(is_region(u) for u in node.users)


def region_modules(gm: fx.GraphModule) -> set[str]:
    """The submodule names that only grad-mode regions read."""
    return {node.target for node in gm.graph.nodes if is_region_body(node)}


def inline_region(gm: fx.GraphModule, node: fx.Node, graph: fx.Graph, operands: list[Any],
                  copy: Callable[[fx.Node, Callable[[fx.Node], Any]], fx.Node], no_grad: bool = False) -> tuple:
    """Copy the body of the region ``node`` (``wrap_with_set_grad_enabled(enabled, body, *args)``)
    into ``graph`` on ``operands``, its nodes marked where grad is off; returns its outputs.
    ``copy`` copies one node as the caller does (``fx.Graph.node_copy`` plus the caller's fixes)."""
    enabled, body_ref = node.args[0], node.args[1]
    body: fx.GraphModule = getattr(gm, body_ref.target)
    off = no_grad or not enabled
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for placeholder, operand in zip(placeholders, operands):
        env[placeholder] = operand
    for inner in body.graph.nodes:
        if inner.op == "placeholder":
            continue
        if inner.op == "output":
            return tuple(env[v] if isinstance(v, fx.Node) else v for v in inner.args[0])
        if is_region_body(inner):
            continue
        if is_region(inner):
            env[inner] = inline_region(body, inner, graph, [env[a] for a in inner.args[2:]], copy, off)
            continue
        if inner.target is operator.getitem and isinstance(env.get(inner.args[0]), tuple):
            env[inner] = env[inner.args[0]][inner.args[1]]
            continue
        new = copy(inner, lambda n: env[n])
        if off:
            new.meta[NO_GRAD] = True
        else:
            new.meta.pop(NO_GRAD, None)
        env[inner] = new
    raise AssertionError("a grad-mode region's body has no output")


def run_marked(node: fx.Node) -> contextlib.AbstractContextManager:
    """The grad mode to run ``node`` in, for whatever interprets the flat graph."""
    return torch.no_grad() if node.meta.get(NO_GRAD) else contextlib.nullcontext()


_COMPUTE = ("call_function", "call_method", "call_module")


def bracket(graph: fx.Graph) -> bool:
    """Put ``grad_off()`` before and ``grad_restore(...)`` after every run of marked nodes of one
    layer's graph; returns whether it has any (its forward then restores the mode on an error too:
    ``layer_support.keeps_grad_mode``)."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in graph.nodes:
        if node.op in _COMPUTE and node.meta.get(NO_GRAD):
            current.append(node)
        elif node.op in _COMPUTE or node.op == "output":
            if current:
                runs.append(current)
            current = []
    for run in runs:
        with graph.inserting_before(run[0]):
            previous = graph.call_function(grad_off, ())
        with graph.inserting_after(run[-1]):
            graph.call_function(grad_restore, (previous,))
    return bool(runs)
