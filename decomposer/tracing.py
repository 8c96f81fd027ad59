"""Turning a model into one flat FX graph whose parameters are `get_attr`s by their original names.

Symbolic tracing (torch.fx) is tried first: it keeps standard torch.nn modules as `call_module`
nodes, so dropout and batch norm keep following the module's train/eval flag and the generated code
stays readable. Models that symbolic tracing cannot follow (data-dependent Python control flow,
Hugging Face models) go through torch.export, whose non-functional training IR is normalized to the
same shape: parameter and buffer placeholders become `get_attr` nodes named by their fully
qualified names. Either way the graph's output is a flat tuple, with the original output structure
kept as a pytree spec.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import operator
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from harmony.decomposer import autograd_guard, grad_mode
from harmony.decomposer.meta_init import on_meta
from harmony.errors import DecomposeError

log = logging.getLogger(__name__)

CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


@dataclass
class TracedModel:
    """A traced model: the graph module (sharing the model's tensors) and how it was obtained."""

    gm: fx.GraphModule
    tracer: str  # "fx" or "export"
    out_spec: pytree.TreeSpec
    input_names: list[str]
    # tensors torch.export lifted out of forward() (``torch.tensor(...)`` written there) under names
    # the model has no attribute for, e.g. ``transformer.h.0.self_attention.lifted_tensor_0``
    lifted: dict[str, torch.Tensor] = field(default_factory=dict)
    # the modules kept whole: those asked for, and those whose forward does what only an eager run
    # keeps (``autograd_guard``)
    opaque: set[str] = field(default_factory=set)
    # custom autograd Functions torch.export inlined: the decomposition must be checked against eager
    inlined_functions: list[str] = field(default_factory=list)


def _plain_attrs(module: torch.nn.Module) -> dict[str, Any]:
    simple = (int, float, bool, str, tuple, type(None))
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training" and isinstance(v, simple)}


_CONSTRUCTOR_CACHE: dict[tuple, str | None] = {}


def constructor_source(module: torch.nn.Module) -> str | None:
    """Source text that rebuilds ``module`` (a torch.nn leaf) from its repr, or None if it cannot.

    Most torch.nn modules print as a valid constructor call. We accept one only when the rebuilt
    module has the same repr, the same plain attributes and the same parameter and buffer shapes,
    so generated code never silently builds a different layer.
    """
    cls = type(module)
    if getattr(torch.nn, cls.__name__, None) is not cls or any(True for _ in module.children()):
        return None
    source = f"torch.nn.{cls.__name__}({module.extra_repr()})"
    key = (cls, source, tuple(sorted(_plain_attrs(module).items(), key=lambda kv: kv[0])))
    try:
        hash(key)
    except TypeError:
        return None
    if key in _CONSTRUCTOR_CACHE:
        return _CONSTRUCTOR_CACHE[key]
    result = None
    try:
        with on_meta():
            rebuilt = eval(source, {"torch": torch, "inf": math.inf, "nan": math.nan})  # noqa: S307 - our own repr
        shapes = lambda m: [(n, tuple(t.shape)) for n, t in list(m.named_parameters()) + list(m.named_buffers())]  # noqa: E731
        if (
            type(rebuilt) is cls
            and repr(rebuilt) == repr(module)
            and _plain_attrs(rebuilt) == _plain_attrs(module)
            and shapes(rebuilt) == shapes(module)
        ):
            result = source
    except Exception:  # any failure just means "inline this module instead"
        result = None
    _CONSTRUCTOR_CACHE[key] = result
    return result


class HarmonyTracer(fx.Tracer):
    """Keeps rebuildable torch.nn leaves and user-chosen opaque modules whole; inlines the rest.

    The leaves are found before tracing starts: during tracing every module attribute access goes
    through FX's proxying, which makes inspecting modules then quadratic in the model size.
    """

    def __init__(self, model: torch.nn.Module, opaque: set[str]):
        super().__init__()
        self.leaves = {name for name, m in model.named_modules() if name in opaque or constructor_source(m) is not None}

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        grad_mode.mark_if_no_grad(node)
        return node


def _concrete_defaults(model: torch.nn.Module, n_inputs: int) -> dict[str, Any]:
    """Fix forward() arguments beyond the example inputs to their defaults (HF-style signatures)."""
    params = list(inspect.signature(model.forward).parameters.values())
    concrete = {}
    for p in params[n_inputs:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is inspect.Parameter.empty:
            raise DecomposeError(
                f"{type(model).__name__}.forward() takes argument {p.name!r} with no default, but only "
                f"{n_inputs} example input(s) were given; pass every required input in example_inputs"
            )
        concrete[p.name] = p.default
    return concrete


def _flatten_output(graph: fx.Graph) -> pytree.TreeSpec:
    """Make the graph return a flat tuple; return the spec that rebuilds the original structure."""
    out = next(n for n in graph.nodes if n.op == "output")
    leaves, spec = pytree.tree_flatten(out.args[0])
    out.args = (tuple(leaves),)
    return spec


def _symbolic(model: torch.nn.Module, n_inputs: int, opaque: set[str]) -> TracedModel:
    tracer = HarmonyTracer(model, opaque)
    try:
        with torch.enable_grad():
            graph = tracer.trace(model, concrete_args=_concrete_defaults(model, n_inputs) or None)
    except DecomposeError:
        raise
    except Exception as exc:
        stack = list(tracer.module_stack.values())
        exc.harmony_module = stack[-1] if stack else ("", type(model))  # type: ignore[attr-defined]
        raise
    _drop_specialized_inputs(graph, n_inputs)
    spec = _flatten_output(graph)
    gm = fx.GraphModule(tracer.root, graph)
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    return TracedModel(gm=gm, tracer="fx", out_spec=spec, input_names=names, opaque=set(opaque))


_SPECIALIZATION_CHECKS = (torch._assert, fx._symbolic_trace._assert_is_none)


def _drop_specialized_inputs(graph: fx.Graph, n_inputs: int) -> None:
    """fx keeps a placeholder for every argument fixed to its default (``_concrete_defaults``: a
    ``forward(x, scale=1.0)`` called with ``x`` alone), read only by checks that the caller passed
    that value. Nobody passes it (the model is called with its example inputs' count), so the
    placeholders and their checks go; a placeholder read by anything else stays, and the input
    count then says so."""
    for node in [n for n in graph.nodes if n.op == "placeholder"][n_inputs:]:
        checks = []
        for user in node.users:
            if user.target is operator.eq and len(user.users) == 1:
                checks += [next(iter(user.users)), user]
            else:
                checks.append(user)
        if all(c.target in (*_SPECIALIZATION_CHECKS, operator.eq) for c in checks):
            for check in checks:
                graph.erase_node(check)
            graph.erase_node(node)


def _dynamic_shapes(model: torch.nn.Module, example_inputs: tuple) -> tuple | dict:
    """torch.export's ``dynamic_shapes`` keeping every input's batch dimension symbolic (the
    profiler and the runtime run other microbatch sizes), by argument name: a ``forward(*args,
    **kwargs)`` (a wrapper's, e.g. peft's) takes the inputs as one tuple, which a plain tuple of
    specs would not match."""
    def batch(x: Any) -> dict | None:
        return {0: torch.export.Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() > 0 else None

    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*example_inputs)
    except TypeError:
        return tuple(batch(x) for x in example_inputs)
    return {name: tuple(batch(v) for v in value) if signature.parameters[name].kind == inspect.Parameter.VAR_POSITIONAL
            else batch(value) for name, value in bound.arguments.items()}


_METADATA_CHECKS = tuple(op for op in (getattr(torch.ops.aten, "_assert_tensor_metadata", None),)
                         if op is not None for op in (op.default,))


def _subgraph_error(model: torch.nn.Module, node: fx.Node) -> str:
    """Why a graph holding a subgraph (a higher-order op's body) cannot be cut into layer code."""
    users = [u for u in node.users if u.op == "call_function"]
    op = getattr(users[0].target, "__name__", str(users[0].target)) if users else "a higher-order op"
    stack = next((u.meta.get("nn_module_stack") for u in users if u.meta.get("nn_module_stack")), None) or {}
    where = list(stack.values())[-1][0] if stack else ""
    inside = f" in {where!r}" if where else ""
    return (f"torch.export made part of {type(model).__name__}{inside} a subgraph ({op}: a control-flow op such as "
            "torch.cond), which Harmony's generated layer code cannot hold. Keep the module computing it whole "
            "(--opaque MODULE, opaque_modules=[...]) so that it runs eagerly")


def _export(model: torch.nn.Module, example_inputs: tuple) -> TracedModel:
    from torch.export.graph_signature import InputKind, OutputKind

    ep = torch.export.export(model, example_inputs, dynamic_shapes=_dynamic_shapes(model, example_inputs),
                             strict=False)
    sig = ep.graph_signature
    gm = ep.graph_module
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root = torch.nn.Module()
    specs = {spec.arg.name: spec for spec in sig.input_specs}
    lifted: dict[str, torch.Tensor] = {}
    regions = grad_mode.region_modules(gm)

    def copy(node: fx.Node, arg: Callable[[fx.Node], Any]) -> fx.Node | None:
        """One node of export's graph in the flat graph, with the fixes layer code needs (None for
        export's checks that a value keeps the dtype and device it had while tracing: under
        autocast, mixed precision, or on another device the layers legitimately differ)."""
        if node.target in _METADATA_CHECKS:
            return None
        new = graph.node_copy(node, arg)
        if node.target is torch.ops.aten.view.default:
            # export can drop a contiguous() it judged a no-op for the symbolic batch size
            # (torch 2.11, torchvision's ViT attention: permute then view fails at batch 2);
            # reshape is that same view wherever a view exists, and a copy elsewhere
            new.target = torch.ops.aten.reshape.default
        if isinstance(node.kwargs.get("device"), torch.device) or any(isinstance(a, torch.device) for a in node.args):
            # export bakes the tracing device in (as a keyword, or positionally as in
            # aten.to.device for Hugging Face's attention masks); ask the running layer for its own
            with graph.inserting_before(new):
                dev = graph.call_function(device_of, ())
            new.args = tuple(dev if isinstance(a, torch.device) else a for a in new.args)
            if isinstance(new.kwargs.get("device"), torch.device):
                new.kwargs = {**new.kwargs, "device": dev}
        return new

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = specs[node.name]
            if spec.kind == InputKind.USER_INPUT:
                env[node] = graph.placeholder(node.name)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                fx.graph_module._copy_attr(model, root, spec.target)
                env[node] = graph.get_attr(spec.target)
            elif spec.kind in (InputKind.CONSTANT_TENSOR,):
                fx.graph_module._assign_attr(ep.constants[spec.target], root, spec.target)
                env[node] = graph.get_attr(spec.target)
                if not _has_tensor(model, spec.target):
                    lifted[spec.target] = ep.constants[spec.target]
            else:
                raise DecomposeError(f"torch.export produced an input of kind {spec.kind} that Harmony cannot place")
            env[node].meta.update(node.meta)
        elif node.op == "output":
            outs = list(node.args[0])
            user = []
            for value, spec in zip(outs, sig.output_specs):
                if spec.kind == OutputKind.USER_OUTPUT:
                    user.append(env[value] if isinstance(value, fx.Node) else value)
                elif spec.kind == OutputKind.BUFFER_MUTATION:
                    target = graph.get_attr(spec.target)
                    graph.call_function(torch.ops.aten.copy_.default, (target, env[value]))
                else:
                    raise DecomposeError(f"torch.export produced an output of kind {spec.kind} that Harmony cannot place")
            graph.output(tuple(user))
        elif node.op == "get_attr" and node.target in regions:
            continue
        elif grad_mode.is_region(node):
            env[node] = grad_mode.inline_region(gm, node, graph, [env[a] for a in node.args[2:]], copy)
        elif node.target is operator.getitem and isinstance(env.get(node.args[0]), tuple):
            env[node] = env[node.args[0]][node.args[1]]
        elif node.op == "get_attr":
            if isinstance(getattr(gm, node.target), torch.nn.Module):
                raise DecomposeError(_subgraph_error(model, node))
            fx.graph_module._assign_attr(getattr(gm, node.target), root, node.target)
            env[node] = graph.node_copy(node, lambda n: env[n])
        else:
            env[node] = copy(node, lambda n: env[n])
    graph.lint()
    new_gm = fx.GraphModule(root, graph)
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in graph.nodes if n.op == "output")
    leaves = list(out_node.args[0])
    spec = ep.call_spec.out_spec
    if spec is None or spec.num_leaves != len(leaves):
        spec = pytree.tree_flatten(tuple(leaves))[1]
    return TracedModel(gm=new_gm, tracer="export", out_spec=spec, input_names=names, lifted=lifted)


def _has_tensor(model: torch.nn.Module, path: str) -> bool:
    module_path, _, name = path.rpartition(".")
    try:
        owner = model.get_submodule(module_path) if module_path else model
    except AttributeError:
        return False
    return isinstance(getattr(owner, name, None), torch.Tensor)


@contextlib.contextmanager
def lifted_on(model: torch.nn.Module, lifted: dict[str, torch.Tensor]):
    """The tensors export lifted, set on ``model`` as plain attributes while it is decomposed (code
    generation and layer binding read every tensor the graph names from the model, and record a
    constant's value in the layer graph), and taken off after: the user's model is left as it was."""
    placed = []
    try:
        for path, value in lifted.items():
            module_path, _, name = path.rpartition(".")
            owner = model.get_submodule(module_path) if module_path else model
            object.__setattr__(owner, name, value)
            placed.append((owner, name))
        yield
    finally:
        for owner, name in placed:
            object.__delattr__(owner, name)


def device_of(*values):
    """The device a layer runs on: that of its first tensor input (torch.export bakes devices in).

    The traced graph calls it without arguments; code generation passes each layer's inputs.
    """
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch: the line of the model that tracing choked on."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {f.line}"


def trace(
    model: torch.nn.Module, example_inputs: tuple, opaque: set[str] | None = None, method: str = "auto"
) -> TracedModel:
    """Trace ``model`` called on ``example_inputs``; symbolic tracing first, torch.export second.

    ``method`` is "auto", "fx" or "export". On failure the error names the module and the line
    that could not be traced and the options that avoid it.
    """
    opaque = set(opaque or ())
    if method not in ("auto", "fx", "export"):
        raise DecomposeError(f"unknown tracing method {method!r}; use 'auto', 'fx' or 'export'")
    hooked = autograd_guard.check_model(model, opaque)
    for path in sorted(hooked):
        log.warning("keeping module %r whole (it runs eagerly): it has a backward hook", path)
    opaque |= hooked
    before = autograd_guard.snapshot(model)
    with _without_kv_cache(model):
        traced = _trace_keeping_autograd(model, example_inputs, opaque, method)
    autograd_guard.check_unchanged(model, before)
    return traced


_MOST_KEPT_WHOLE = 16  # modules kept whole for what only eager runs keep, before the compile gives up


def _trace_keeping_autograd(model: torch.nn.Module, example_inputs: tuple, opaque: set[str],
                            method: str) -> TracedModel:
    """Trace, keeping whole (opaque) each module whose forward does what only an eager run keeps
    (``autograd_guard``: a tensor hook registered in forward(), a custom autograd Function that
    torch.export would inline), and tracing again."""
    guard = autograd_guard.Guard(model)
    while True:
        try:
            traced = _trace(model, example_inputs, opaque, method, guard)
            traced.inlined_functions = sorted(set(guard.inlined))
            for path in sorted(traced.opaque & set(guard.reasons)):
                log.warning("keeping module %r whole (it runs eagerly): %s", path, guard.reasons[path])
            return traced
        except Exception as exc:
            if not guard.needs_eager:
                raise
            try:
                opaque = _kept_whole(guard, opaque, method, exc)
            except DecomposeError:
                if guard.inline_functions or not all(found.function for found in guard.needs_eager):
                    raise
                log.info("no module kept whole lets torch.fx trace %s; torch.export inlines %s, and the layers' "
                         "gradients are checked against eager", type(model).__name__,
                         ", ".join(sorted({found.function for found in guard.needs_eager})))
                guard.inline_functions = True


def _kept_whole(guard: autograd_guard.Guard, opaque: set[str], method: str, exc: Exception) -> set[str]:
    """The modules to keep whole for what the last trace met that only an eager run keeps, and the
    one torch.fx could not trace if torch.export met it (export is no option for such a model);
    a ``DecomposeError`` where that is no way out."""
    found = guard.needs_eager
    root = next((f for f in found if not f.module), None)
    if root is not None:
        raise DecomposeError(
            f"the model's own forward() uses {root.what}, which the traced layers cannot keep and no module can be "
            "kept whole for: move it into a submodule (Harmony then runs that module eagerly), or remove it") from exc
    wanted = {f.module for f in found} | ({guard.fx_module} if guard.fx_module else set())
    first = found[0]
    if guard.fx_failed and not guard.fx_module:
        raise DecomposeError(
            f"module {first.module!r} uses {first.what}, which the traced layers cannot keep: torch.fx would keep "
            "it by running that module whole, but torch.fx cannot trace this model at all, and torch.export loses "
            "it") from exc
    if method == "export" or wanted <= opaque or len(opaque | wanted) > _MOST_KEPT_WHOLE:
        raise DecomposeError(
            f"module {first.module!r} uses {first.what}, which the traced layers cannot keep; trace with torch.fx "
            f"(method='auto') keeping that module whole (opaque_modules=[{first.module!r}], CLI --opaque "
            f"{first.module}): {type(exc).__name__}: {exc}") from exc
    for f in found:
        guard.reasons.setdefault(f.module, f"its forward uses {f.what}")
    if guard.fx_module:
        guard.reasons.setdefault(guard.fx_module, "torch.fx cannot trace it, and torch.export would lose what "
                                                  "another module kept whole uses")
    return opaque | wanted


@contextlib.contextmanager
def _without_kv_cache(model: torch.nn.Module):
    """Trace a Hugging Face model with its ``config.use_cache`` off, and put it back after.

    ``from_pretrained`` and a fresh config both leave ``use_cache`` on, so a causal LM's forward
    builds a key/value cache object and returns it beside the logits. Neither tracer can carry it
    (torch.export: "DynamicCache in output, which is not a known type"; fx fails earlier in the
    generated forward), and training has no use for it: it serves generation, and would otherwise
    be relayed between layers as dead output. The user's own model is left as it was.
    """
    candidates = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
                  and getattr(c, "use_cache", None) is True}
    switched = []
    for c in candidates.values():
        try:
            c.use_cache = False
        except (AttributeError, TypeError):  # a frozen config of someone else's: trace as it is
            continue
        switched.append(c)
    if switched:
        log.info("tracing %s with config.use_cache=False: a key/value cache serves generation, not training",
                 type(model).__name__)
    try:
        yield
    finally:
        for c in switched:
            c.use_cache = True


def _trace(model: torch.nn.Module, example_inputs: tuple, opaque: set[str], method: str,
           guard: autograd_guard.Guard) -> TracedModel:
    fx_error: Exception | None = None
    guard.fx_module, guard.fx_failed = "", False
    if method in ("auto", "fx"):
        try:
            with guard.watching("fx"):
                return _symbolic(model, len(example_inputs), opaque)
        except DecomposeError:
            raise
        except Exception as exc:
            if guard.refused is not None:
                raise guard.refused from exc
            if guard.needs_eager:
                raise
            fx_error = exc
            guard.fx_module, guard.fx_failed = getattr(exc, "harmony_module", ("", None))[0], True
            log.info("symbolic tracing failed (%s); trying torch.export", exc)
            if method == "fx":
                raise _trace_error(model, fx_error, None) from exc
    try:
        with guard.watching("export"):
            traced = _export(model, example_inputs)
    except DecomposeError:
        raise
    except Exception as exc:
        if guard.refused is not None:
            raise guard.refused from exc
        if guard.needs_eager:
            raise
        raise _trace_error(model, fx_error, exc) from exc
    if guard.needs_eager:
        raise autograd_guard.NeedsEagerError(f"torch.export met {guard.needs_eager[0].what}")
    return traced  # torch.export keeps no module whole


def _trace_error(model: torch.nn.Module, fx_error: Exception | None, export_error: Exception | None) -> DecomposeError:
    lines = [f"cannot trace {type(model).__name__} into a graph."]
    if fx_error is not None:
        path, mtype = getattr(fx_error, "harmony_module", ("", type(model)))
        where = f"module {path!r} ({getattr(mtype, '__name__', mtype)})" if path else "the model's own forward()"
        lines.append(f"torch.fx symbolic tracing failed in {where}: {type(fx_error).__name__}: {fx_error}")
        frame = _user_frame(fx_error)
        if frame:
            lines.append(f"  at {frame}")
        if path:
            lines.append(
                f"Keep that module whole inside one layer with opaque_modules=['{path}'] "
                f"(CLI: --opaque {path}); it then runs eagerly and is not split further."
            )
    if export_error is not None:
        first = str(export_error).strip().splitlines()[0] if str(export_error).strip() else ""
        lines.append(f"torch.export failed too: {type(export_error).__name__}: {first}")
        frame = _user_frame(export_error)
        if frame:
            lines.append(f"  at {frame}")
    lines.append("Data-dependent Python control flow must be rewritten (e.g. torch.where or torch.cond) to be traced.")
    return DecomposeError("\n".join(lines))
