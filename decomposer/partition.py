"""Cutting a traced graph into a chain of layers, and relaying tensors that skip layers (§4.1, Fig. 7).

A node belongs to the module that called it (its ``nn_module_stack``); the granularity decides
which level of that stack is a layer. Walking the nodes in execution order, a new layer starts
whenever the owning unit changes, so every layer is a contiguous slice of a valid topological
order and the result is a chain. The values crossing each boundary are the live set there: a
tensor made in layer i and consumed in layer j > i+1 crosses every boundary between, and the
layers in between pass it through unchanged (p2p relaying).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Hashable

import torch
import torch.fx as fx

from harmony.decomposer.tracing import CONTAINERS, constructor_source
from harmony.errors import DecomposeError

FREE = None  # a node no unit owns (functional code between modules): joins the current layer
GROUP = ("group",)  # consecutive standard leaves outside containers (embeddings, stems, heads)

log = logging.getLogger(__name__)


@dataclass
class Granularity:
    """How coarse a layer is.

    ``auto``: one element of a ModuleList/Sequential (a transformer block, a residual block, a conv
    block), with runs of plain torch.nn modules outside containers grouped (embeddings, a head),
    and parameterless slivers merged into their neighbour. ``depth=k``: one module k levels below
    the root. ``modules=[...]``: exactly the named modules.
    """

    depth: int | None = None
    modules: list[str] | None = None

    def __post_init__(self) -> None:
        if self.depth is not None and self.modules is not None:
            raise DecomposeError("choose either a module depth or a list of module names, not both")
        if self.depth is not None and self.depth < 1:
            raise DecomposeError(f"layer depth must be at least 1, got {self.depth}")

    @property
    def merges_parameterless(self) -> bool:
        return self.modules is None


@dataclass
class Segment:
    key: Hashable
    nodes: list[fx.Node] = field(default_factory=list)
    module_paths: list[str] = field(default_factory=list)


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """(key, path) of each module in the node's call stack, outermost first, root excluded."""
    stack = node.meta.get("nn_module_stack") or {}
    entries = [(key, value[0]) for key, value in stack.items()]
    # torch.export adds bookkeeping entries (e.g. "_empty_nn_module_stack_from_metadata_hook")
    return [(k, p) for k, p in entries if p and not p.startswith("_empty_nn_module_stack")]


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class _AutoRule:
    """Decides, per module path, whether a module is split further in ``auto`` granularity."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._splittable: dict[str, bool] = {}

    def module(self, path: str) -> torch.nn.Module | None:
        try:
            return self.model.get_submodule(path)
        except AttributeError:
            return None

    def splittable(self, path: str) -> bool:
        if path not in self._splittable:
            m = self.module(path)
            self._splittable[path] = m is not None and (isinstance(m, CONTAINERS) or self._holds_container(m))
        return self._splittable[path]

    @staticmethod
    def _holds_container(m: torch.nn.Module) -> bool:
        """True if most of ``m``'s parameters sit in a container of several modules below it."""
        total = _param_count(m)
        for sub in m.modules():
            if sub is not m and isinstance(sub, CONTAINERS) and len(sub) > 1:
                if total == 0 or 2 * _param_count(sub) >= total:
                    return True
        return False

    def in_container(self, path: str) -> bool:
        parent = path.rpartition(".")[0]
        return isinstance(self.module(parent) if parent else self.model, CONTAINERS)

    def unit(self, stack: list[tuple[str, str]]) -> tuple[Hashable, str | None]:
        for key, path in stack:
            if self.splittable(path):
                continue
            m = self.module(path)
            if not self.in_container(path) and m is not None and constructor_source(m) is not None:
                return GROUP, path
            return key, path
        return FREE, None


def _unit(node: fx.Node, gran: Granularity, auto: _AutoRule) -> tuple[Hashable, str | None]:
    stack = _stack(node)
    if gran.modules is not None:
        wanted = set(gran.modules)
        for key, path in stack:
            if path in wanted:
                return key, path
        return FREE, None
    if gran.depth is not None:
        if not stack:
            return FREE, None
        key, path = stack[min(gran.depth, len(stack)) - 1]
        return key, path
    return auto.unit(stack)


def segment(gm: fx.GraphModule, model: torch.nn.Module, gran: Granularity) -> list[Segment]:
    """Split the compute nodes of ``gm`` into contiguous segments, one per layer.

    ``auto`` on a model without containers (PyTorch's tutorial CNN: conv1, conv2, fc1… as plain
    attributes) groups every module into one layer, which nothing can pipeline or swap; it then
    cuts one layer per child module instead (``depth=1``)."""
    segments = _segment(gm, model, gran)
    if len(segments) == 1 and gran.depth is None and gran.modules is None:
        children = _segment(gm, model, Granularity(depth=1))
        if len(children) > 1:
            log.info("no container of modules to cut %s at; one layer per child module", type(model).__name__)
            return children
    return segments


def _segment(gm: fx.GraphModule, model: torch.nn.Module, gran: Granularity) -> list[Segment]:
    if gran.modules is not None:
        known = {name for name, _ in model.named_modules()}
        unknown = [m for m in gran.modules if m not in known]
        if unknown:
            raise DecomposeError(f"no module named {', '.join(map(repr, unknown))} in {type(model).__name__}")
        lists = [m for m in gran.modules if isinstance(model.get_submodule(m), (torch.nn.ModuleList, torch.nn.ModuleDict))]
        if lists:
            raise DecomposeError(
                f"{', '.join(map(repr, lists))} is a ModuleList/ModuleDict, which is never called itself, so it cannot "
                f"be one layer; name its elements (e.g. '{lists[0]}.0') or choose a depth"
            )
    auto = _AutoRule(model)
    segments: list[Segment] = []
    prefix: list[fx.Node] = []  # free nodes before the first unit
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        key, path = _unit(node, gran, auto)
        if key is FREE:
            (segments[-1].nodes if segments else prefix).append(node)
            continue
        if not segments or segments[-1].key != key:
            segments.append(Segment(key=key))
        seg = segments[-1]
        seg.nodes.append(node)
        if path is not None and path not in seg.module_paths:
            seg.module_paths.append(path)
    if not segments:
        segments = [Segment(key=FREE, module_paths=[])]
    segments[0].nodes[:0] = prefix
    if gran.merges_parameterless:
        segments = _merge_parameterless(segments, model)
    return _mutations_with_producers(segments, gm)


def mutated_input(node: fx.Node, gm: fx.GraphModule) -> fx.Node | None:
    """The input ``node`` changes in place, if it does: a module built with ``inplace=True``
    (``ReLU``, ``Hardswish``, ``Dropout``), a functional call given ``inplace=True``, a trailing-
    underscore op (``torch.relu_``, ``x.mul_``) or an item assignment."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    target = node.target
    if node.op == "call_module":
        inplace = getattr(gm.get_submodule(target), "inplace", False) is True
    elif node.op in ("call_function", "call_method"):
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        inplace = (node.kwargs.get("inplace") is True or name == "setitem"
                   or (name.endswith("_") and not name.startswith("_")))
    else:
        inplace = False
    return node.args[0] if inplace else None


def _mutations_with_producers(segments: list[Segment], gm: fx.GraphModule) -> list[Segment]:
    """A layer must not start by changing its input in place: at run time a layer's inputs are
    autograd leaves (what collects the gradient for the layer before), and autograd refuses an
    in-place op on a leaf that requires grad. So an in-place op that opens a layer on a value the
    layer before made (torchvision's RegNet: a block's ``ReLU(inplace=True)`` after its residual
    sum, cut from the block) moves to the end of that layer, where the value is an op's output,
    and the same op's order in the whole graph is kept. A layer that was nothing but such ops
    (named alone with ``modules=``) is left empty and dropped."""
    producer = {n: i for i, seg in enumerate(segments) for n in seg.nodes}
    for i in range(1, len(segments)):
        seg, before = segments[i], segments[i - 1]
        while seg.nodes:
            node = seg.nodes[0]
            value = mutated_input(node, gm)
            if value is None or producer.get(value) != i - 1 or any(producer.get(a, -1) >= i for a in node.all_input_nodes):
                break
            before.nodes.append(seg.nodes.pop(0))
            producer[node] = i - 1
            if node.op == "call_module" and node.target in seg.module_paths:
                if not any(n.op == "call_module" and n.target == node.target for n in seg.nodes):
                    seg.module_paths.remove(node.target)
                if node.target not in before.module_paths:
                    before.module_paths.append(node.target)
        if not seg.nodes:  # the layer was nothing but that op (a layer named on its own): it joins the one before
            before.module_paths.extend(p for p in seg.module_paths if p not in before.module_paths)
    return [seg for seg in segments if seg.nodes]


def _uses_tensor_state(seg: Segment, model: torch.nn.Module) -> bool:
    """Whether a segment owns parameters or buffers: through a get_attr or a stateful leaf module."""
    for node in seg.nodes:
        if node.op == "call_module":
            module = model.get_submodule(node.target)
            if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
                return True
            continue
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                return True
    return False


def _merge_parameterless(segments: list[Segment], model: torch.nn.Module) -> list[Segment]:
    """Fold segments without parameters (activations, pooling, reshapes) into the one before."""
    merged: list[Segment] = []
    pending: list[Segment] = []
    for seg in segments:
        if not _uses_tensor_state(seg, model):
            if merged:
                merged[-1].nodes.extend(seg.nodes)
                merged[-1].module_paths.extend(p for p in seg.module_paths if p not in merged[-1].module_paths)
            else:
                pending.append(seg)
            continue
        for p in reversed(pending):
            seg.nodes[:0] = p.nodes
            seg.module_paths[:0] = [m for m in p.module_paths if m not in seg.module_paths]
        pending = []
        merged.append(seg)
    if not merged:  # a model without parameters: one layer
        whole = Segment(key=FREE)
        for p in pending:
            whole.nodes.extend(p.nodes)
            whole.module_paths.extend(p.module_paths)
        merged = [whole]
    return merged


def live_sets(gm: fx.GraphModule, segments: list[Segment]) -> list[list[fx.Node]]:
    """The values crossing each of the ``len(segments) + 1`` boundaries, in definition order.

    Boundary 0 holds the model inputs; boundary i the values defined before layer i and used at or
    after it; the last boundary the model's flat outputs (any of which may be relayed from earlier).
    """
    n = len(segments)
    layer_of: dict[fx.Node, int] = {}
    order: dict[fx.Node, int] = {node: i for i, node in enumerate(gm.graph.nodes)}
    for i, seg in enumerate(segments):
        for node in seg.nodes:
            layer_of[node] = i
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    for node in placeholders:
        layer_of[node] = -1
    last_use: dict[fx.Node, int] = {}
    for i, seg in enumerate(segments):
        for node in seg.nodes:
            for arg in node.all_input_nodes:
                if arg.op != "get_attr":
                    last_use[arg] = max(last_use.get(arg, -1), i)
    output = next(node for node in gm.graph.nodes if node.op == "output")
    for arg in output.all_input_nodes:
        if arg.op == "get_attr":
            raise DecomposeError("the model returns one of its own parameters or buffers; Harmony cannot relay it")
        last_use[arg] = n  # consumed after the last layer
    boundaries: list[list[fx.Node]] = []
    for b in range(n):
        live = [v for v, last in last_use.items() if layer_of[v] < b <= last]
        boundaries.append(sorted(live, key=lambda v: (layer_of[v], order[v])))
    boundaries.append(list(output.all_input_nodes))
    if set(boundaries[0]) != set(placeholders):
        boundaries[0] = placeholders  # unused model inputs still enter layer 0 (and are dropped there)
    return boundaries
