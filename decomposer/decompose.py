"""``decompose(model, example_inputs) -> LayerGraph``: trace, cut, relay, generate, bind."""

from __future__ import annotations

import contextlib

import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.func import functional_call
from torch.utils import _pytree as pytree

from harmony.decomposer import batching, codegen, grad_mode, partition, tracing
from harmony.decomposer.layer_graph import LayerGraph, LayerSpec, StateSpec, ValueSpec
from harmony.decomposer.gradient_check import check_gradients
from harmony.decomposer.metamemo import MetaMemo
from harmony.errors import DecomposeError

log = logging.getLogger(__name__)


def _as_inputs(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)) and example_inputs:
        bad = [type(x).__name__ for x in example_inputs if not isinstance(x, torch.Tensor)]
        if bad:
            raise DecomposeError(
                f"example_inputs must be tensors; got {', '.join(bad)}. Pass the model's positional "
                "tensor inputs, e.g. (input_ids,) or (images,)"
            )
        return tuple(example_inputs)
    raise DecomposeError(
        f"example_inputs must be a tensor or a non-empty tuple of tensors, got {type(example_inputs).__name__}"
    )


class _MetaProp(fx.Interpreter):
    """Runs the graph once to learn every value's shape, without touching the model's state.

    Parameters, buffers and leaf modules are swapped for copies, so batch-norm statistics and the
    RNG of the real model are left untouched. The copies are meta tensors (no data, no time) unless
    ``real``: opaque modules may branch on data, which meta tensors do not have.
    """

    def __init__(self, gm: fx.GraphModule, real: bool):
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}
        self.convert = _to_real_copy if real else _to_meta
        self.memo = None if real else MetaMemo()

    def run_node(self, n: fx.Node) -> Any:
        with grad_mode.run_marked(n):
            result = super().run_node(n)
        self.values[n] = result
        return result

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        return self.convert(value) if isinstance(value, torch.Tensor) else value

    def call_function(self, target, args, kwargs):
        if target is tracing.device_of:
            return torch.device("cpu") if self.convert is _to_real_copy else torch.device("meta")
        if self.memo is None or not self.memo.memoizable_function(target):
            return super().call_function(target, args, kwargs)
        return self.memo.call_function(target, args, kwargs, lambda: target(*args, **kwargs))

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        state = {k: self.convert(v) for k, v in {**dict(module.named_parameters()), **dict(module.named_buffers())}.items()}
        if self.memo is None or not self.memo.memoizable(module):
            return functional_call(module, state, args, kwargs)
        return self.memo.call(module, state, args, kwargs, lambda: functional_call(module, state, args, kwargs))


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    meta = t.detach().to("meta")
    if t.requires_grad:
        meta.requires_grad_(True)
    return meta


def _to_real_copy(t: torch.Tensor) -> torch.Tensor:
    copy = t.detach().clone()
    if t.requires_grad:
        copy.requires_grad_(True)
    return copy


def _value_spec(name: str, value: Any, fact: batching.BatchFact | None, batch: int) -> ValueSpec:
    """The spec of a boundary value; ``fact`` None means the batch could not be probed, and a
    tensor of dim 0 equal to the example batch is then taken to hold the samples there."""
    coupled = fact is not None and fact.kind in (batching.COUPLED, batching.AFFINE)
    if isinstance(value, torch.Tensor):
        if fact is None:
            batch_dim = 0 if value.dim() > 0 and value.shape[0] == batch else None
        else:
            batch_dim = fact.dim if fact.kind == batching.BATCHED else None
        return ValueSpec(
            name=name, kind="tensor", shape=list(value.shape), dtype=str(value.dtype),
            nbytes=value.numel() * value.element_size(), requires_grad=value.requires_grad,
            batch_dim=batch_dim, coupled=coupled,
        )
    return ValueSpec(name=name, kind="object", text=repr(value)[:200], coupled=coupled)


def _propagate(gm: fx.GraphModule, inputs: tuple, real: bool) -> dict[fx.Node, Any]:
    prop = _MetaProp(gm, real)
    try:
        with torch.random.fork_rng(devices=[]):
            prop.run(*[prop.convert(x) for x in inputs])
    except Exception as exc:
        node = next((n for n in gm.graph.nodes if n not in prop.values and n.op != "placeholder"), None)
        where = f" at {node.format_node()}" if node is not None else ""
        raise DecomposeError(
            f"running the traced model on example inputs of shapes {[tuple(x.shape) for x in inputs]} failed{where}: "
            f"{type(exc).__name__}: {exc}. Check that example_inputs match what forward() expects."
        ) from exc
    return prop.values


def _propagate_shapes(gm: fx.GraphModule, model: torch.nn.Module, inputs: tuple,
                      opaque: set[str]) -> tuple[dict[fx.Node, Any], bool]:
    """Every node's value at the example batch, and whether they came from real tensors.

    Meta tensors cost nothing, but opaque modules may branch on data, and some operators have no
    meta kernel (``unique_consecutive``, in Hugging Face BART's check that every sample holds as
    many end tokens): where the model has real weights, those run on real copies instead."""
    can_be_real = not any(t.is_meta for t in list(model.parameters()) + list(inputs))
    real = bool(opaque) and can_be_real
    try:
        return _propagate(gm, inputs, real), real
    except DecomposeError as exc:
        if real or not can_be_real or not isinstance(exc.__cause__, NotImplementedError):
            raise
        log.info("an operator has no meta kernel (%s); propagating shapes on real tensors",
                 str(exc.__cause__).splitlines()[0])
        return _propagate(gm, inputs, True), True


def _ties(model: torch.nn.Module) -> dict[str, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {group[0]: group[1:] for group in names.values() if len(group) > 1}


def _state_spec(name: str, kind: str, t: torch.Tensor, persistent: bool) -> StateSpec:
    return StateSpec(
        name=name, kind=kind, shape=list(t.shape), dtype=str(t.dtype), nbytes=t.numel() * t.element_size(),
        requires_grad=bool(t.requires_grad) if kind == "parameter" else False, persistent=persistent,
    )


def _layer_name(seg: partition.Segment, index: int) -> str:
    if not seg.module_paths:
        return f"layer{index}"
    if len(seg.module_paths) <= 3:
        return "+".join(seg.module_paths)
    return f"{seg.module_paths[0]}+…+{seg.module_paths[-1]}"


def decompose(
    model: torch.nn.Module,
    example_inputs: Any,
    depth: int | None = None,
    modules: Sequence[str] | None = None,
    opaque_modules: Sequence[str] = (),
    method: str = "auto",
) -> LayerGraph:
    """Cut ``model`` into a chain of layers that, run in sequence, compute exactly ``model(*inputs)``.

    The layers share the model's parameters and buffers. ``depth``/``modules`` choose the
    granularity (default: one block of each ModuleList/Sequential); ``opaque_modules`` keeps modules
    that cannot be traced whole; ``method`` forces "fx" or "export" tracing.
    """
    if not isinstance(model, torch.nn.Module):
        raise DecomposeError(f"decompose() needs a torch.nn.Module, got {type(model).__name__}")
    inputs = _as_inputs(example_inputs)
    gran = partition.Granularity(depth=depth, modules=list(modules) if modules is not None else None)
    opaque = set(opaque_modules)
    with _without_autocast():  # the model as written: mixed precision applies when its layers run
        traced = tracing.trace(model, inputs, opaque=opaque, method=method)
    with tracing.lifted_on(model, traced.lifted):
        graph = _decompose_traced(model, traced, inputs, gran, traced.opaque)
    if traced.inlined_functions:
        _check_inlined(model, graph, inputs, traced.inlined_functions)
    return graph


def _check_inlined(model: torch.nn.Module, graph: LayerGraph, inputs: tuple, functions: list[str]) -> None:
    """Accept custom autograd Functions torch.export inlined only where the layers' gradients equal
    eager autograd's on the example inputs (their backward is then their forward's derivative);
    refuse, naming them, where they differ or cannot be compared."""
    names = ", ".join(functions)
    if any(t.is_meta for t in list(model.parameters()) + list(inputs)):
        raise DecomposeError(
            f"torch.export inlined the custom autograd Function(s) {names} (torch.fx cannot trace this model), which "
            "is exact only where their backward is their forward's derivative, and a model on the meta device "
            "cannot be run to check it: decompose the model with its weights")
    try:
        check_gradients(model, graph, inputs, None, None)
    except DecomposeError as exc:
        raise DecomposeError(
            f"torch.export inlined the custom autograd Function(s) {names}, since torch.fx cannot trace this model "
            f"even with their modules kept whole, and the layers' gradients then differ from eager autograd's: "
            f"their own backward is not their forward's derivative. Make the model traceable by torch.fx (the "
            f"modules calling them are then kept whole and run eagerly). {exc}") from exc
    log.info("torch.export inlined %s; the layers' gradients equal eager autograd's", names)


def _decompose_traced(model: torch.nn.Module, traced: tracing.TracedModel, inputs: tuple,
                      gran: partition.Granularity, opaque: set[str]) -> LayerGraph:
    gm = traced.gm
    if len(traced.input_names) != len(inputs):
        raise DecomposeError(f"the traced model takes {len(traced.input_names)} inputs but {len(inputs)} example inputs were given")
    values, real = _propagate_shapes(gm, model, inputs, opaque)
    facts, fixed_batch = batching.probe(gm, inputs, values, lambda resized: _propagate(gm, resized, real))
    batch = batching.batch_size_of(inputs)
    segments = partition.segment(gm, model, gran)
    boundaries = partition.live_sets(gm, segments)
    if batching.rederive_sizes(gm, segments, boundaries, facts):
        boundaries = partition.live_sets(gm, segments)
    graphs = codegen.layer_graphs(gm, segments, boundaries)
    ties = _ties(model)
    unused = _unused_state(model, graphs, ties)

    def describe(node: fx.Node) -> ValueSpec:
        return _value_spec(node.name, values.get(node), facts.get(node) if facts else None, batch)

    specs, sources, value_specs = _layer_specs(model, traced, segments, boundaries, graphs, opaque, unused, describe)
    for leaf in pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args[0]):
        if isinstance(leaf, fx.Node):
            value_specs.setdefault(leaf.name, describe(leaf))

    graph = LayerGraph(
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        tracer=traced.tracer, training=model.training, inputs=list(traced.input_names), layers=specs,
        values=value_specs, state={}, ties=ties, output_spec=_out_spec_text(traced.out_spec), sources=sources,
        batch_sizes=[batch] if fixed_batch else [], batch_note=fixed_batch,
    )
    graph._out_spec = traced.out_spec
    layer_modules = graph.build_modules(device="meta", source=model)
    _record_state(graph, layer_modules, model, ties)
    return graph


def _unused_state(model: torch.nn.Module, graphs: list[fx.Graph], ties: dict[str, list[str]]) -> list[str]:
    """Parameters and buffers no layer reads (tied aliases aside): the last layer carries them as
    extra state so that the layers' state still covers the model's whole state_dict."""
    used: set[str] = set()
    for g in graphs:
        for n in g.nodes:
            if n.op in ("get_attr", "call_module"):
                used.add(n.target)
    tied_aliases = {a for aliases in ties.values() for a in aliases}

    def is_used(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:k]) in used for k in range(1, len(parts) + 1))

    return [
        n for n, _ in list(model.named_parameters()) + list(model.named_buffers())
        if not is_used(n) and n not in tied_aliases
    ]


def _layer_specs(
    model: torch.nn.Module, traced: tracing.TracedModel, segments: list[partition.Segment],
    boundaries: list[list[fx.Node]], graphs: list[fx.Graph],
    opaque: set[str], unused: list[str], describe: Callable[[fx.Node], ValueSpec],
) -> tuple[list[LayerSpec], dict[str, str], dict[str, ValueSpec]]:
    """(layer specs, generated sources by file name, value specs) of every segment, in order.

    A layer's inputs are the values live at its boundary and its outputs those live at the next
    (the model's outputs for the last); a value live across a layer that does not use it is
    relayed, so that each layer hands its successor everything later layers need.
    """
    total = len(segments)
    specs: list[LayerSpec] = []
    sources: dict[str, str] = {}
    value_specs: dict[str, ValueSpec] = {}
    for i, (seg, g) in enumerate(zip(segments, graphs)):
        inputs_i = [v.name for v in boundaries[i]]
        out_node = next(n for n in g.nodes if n.op == "output")
        if i == total - 1:
            outputs_i = [a.name if isinstance(a, fx.Node) else repr(a) for a in out_node.args[0]]
        else:
            outputs_i = [v.name for v in boundaries[i + 1]]
        used_here = {a.name for node in seg.nodes for a in node.all_input_nodes}
        relayed = [v.name for v in boundaries[i] if v in boundaries[i + 1] and v.name not in used_here] if i < total - 1 else []
        for v in boundaries[i] + (boundaries[i + 1] if i < total - 1 else []):
            value_specs.setdefault(v.name, describe(v))
        name = _layer_name(seg, i)
        code = codegen.generate(
            i, total, g, model, opaque, name, traced.tracer,
            extra_state=unused if i == total - 1 else [], relayed=relayed,
        )
        sources[code.file_name] = code.source
        specs.append(LayerSpec(
            index=i, name=name, modules=list(seg.module_paths), inputs=inputs_i, outputs=outputs_i,
            relayed=relayed, state=[], code_file=code.file_name, class_name=code.class_name, code_sha256=code.sha256,
        ))
    return specs, sources, value_specs


def _out_spec_text(out_spec: pytree.TreeSpec) -> str:
    """The output structure serialized for graph files, or "" (with a warning) when a custom output
    class has no serialized name: decomposing still works, only a saved graph cannot rebuild it."""
    try:
        return pytree.treespec_dumps(out_spec)
    except Exception as exc:  # custom output classes without a serialized name
        log.warning("output structure %s cannot be serialized (%s); saved graphs will not rebuild it", out_spec, exc)
        return ""


def _without_autocast() -> contextlib.ExitStack:
    """Autocast off while tracing: torch.export would bake a caller's autocast casts (and checks of
    their dtypes) into the graph, which then fails, or casts twice, where the runtime applies it."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", enabled=False))
    if torch.cuda.is_available():
        stack.enter_context(torch.autocast("cuda", enabled=False))
    return stack


def _record_state(graph: LayerGraph, layer_modules: list[torch.nn.Module], model: torch.nn.Module, ties) -> None:
    """Fill each layer's owned tensors and the graph's state table from the bound layer modules."""
    for spec, module in zip(graph.layers, layer_modules):
        for name, p in module.named_parameters(remove_duplicate=False):
            graph.state.setdefault(name, _state_spec(name, "parameter", p, True))
            spec.state.append(name)
        for name, b in module.named_buffers(remove_duplicate=False):
            kind, _, persistent = codegen.tensor_kind(model, name)
            graph.state.setdefault(name, _state_spec(name, kind, b, persistent))
            spec.state.append(name)
            # constants and non-persistent buffers are not in a state_dict: the graph carries them
            if (kind == "constant" or not persistent) and b.device.type != "meta":
                graph.constants[name] = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    # tied aliases that no layer names directly still belong to the state table
    for canon, aliases in ties.items():
        if canon in graph.state:
            for alias in aliases:
                graph.state.setdefault(alias, StateSpec(**{**graph.state[canon].__dict__, "name": alias}))
    # in the model's own order (its state_dict's, so its parameters' in model.parameters() order):
    # whatever sums over every parameter (a clipped gradient's norm) adds them up as eager code does
    order = {name: i for i, name in enumerate(model.state_dict(keep_vars=True))}
    graph.state = dict(sorted(graph.state.items(), key=lambda item: order.get(item[0], len(order))))
