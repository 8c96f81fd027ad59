"""Per-layer code generation: one readable, importable Python module per layer.

Each layer becomes an FX graph of its own (placeholders for the values entering it, the model's
nodes in their original order, a tuple of the values leaving it) and then Python source: a
``torch.nn.Module`` subclass whose ``__init__`` installs exactly the layer's parameters, buffers
and torch.nn leaf modules under the original qualified names, and whose ``forward`` is FX's code.
"""

from __future__ import annotations

import builtins
import hashlib
import math
import textwrap
import types
from dataclasses import dataclass

import torch
import torch.fx as fx

from harmony.decomposer import grad_mode
from harmony.decomposer.layer_support import grad_off
from harmony.decomposer.partition import Segment
from harmony.decomposer.tracing import constructor_source, device_of
from harmony.errors import DecomposeError


@dataclass
class LayerCode:
    index: int
    class_name: str
    file_name: str
    source: str
    sha256: str


def layer_graphs(
    gm: fx.GraphModule, segments: list[Segment], boundaries: list[list[fx.Node]]
) -> list[fx.Graph]:
    """One FX graph per segment, taking boundary i and returning boundary i+1."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    graphs = []
    for i, seg in enumerate(segments):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        placeholders = []
        for value in boundaries[i]:
            ph = g.placeholder(value.name)
            ph.meta.update(value.meta)
            env[value] = ph
            placeholders.append(ph)
        attrs: dict[str, fx.Node] = {}

        def arg(node: fx.Node) -> fx.Node:
            if node.op == "get_attr":
                if node.target not in attrs:
                    attrs[node.target] = g.get_attr(node.target)
                    attrs[node.target].meta.update(node.meta)
                return attrs[node.target]
            return env[node]

        for node in seg.nodes:
            new = g.node_copy(node, arg)
            if node.target is device_of:
                new.args = tuple(placeholders)
            env[node] = new
        if i == len(segments) - 1:
            result = tuple(arg(a) if isinstance(a, fx.Node) else a for a in output.args[0])
        else:
            result = tuple(arg(v) for v in boundaries[i + 1])
        g.output(result)
        grad_mode.bracket(g)
        g.lint()
        graphs.append(g)
    return graphs


def _import_line(name: str, value) -> str | None:
    """An import (or assignment) that binds ``name`` to ``value`` in a generated module."""
    if getattr(builtins, name, None) is value:
        return None
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return f"{name} = float({repr(str(value))})"
    if value is type(None):
        return f"{name} = type(None)"
    cls = getattr(value, "autograd_function", None)
    if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):  # kept whole (autograd_guard)
        return f"{name} = function_apply({cls.__module__!r}, {cls.__qualname__!r})"
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__}" if name == value.__name__ else f"import {value.__name__} as {name}"
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        head, *rest = qualname.split(".")
        if not rest:
            return f"from {module} import {head} as {name}" if head != name else f"from {module} import {name}"
        return f"import {module} as _{name}_module\n{name} = _{name}_module.{qualname}"
    raise DecomposeError(f"generated layer code needs the global {name!r} ({value!r}), which cannot be imported by name")


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.float32"


def _init_lines(graph: fx.Graph, model: torch.nn.Module, opaque: set[str]) -> list[str]:
    lines: list[str] = []
    modules = sorted({n.target for n in graph.nodes if n.op == "call_module"})
    for path in modules:
        if path in opaque:
            lines.append(f"attach_opaque(self, {path!r}, source)")
            continue
        module = model.get_submodule(path)
        ctor = constructor_source(module)
        if ctor is None:
            raise DecomposeError(f"module {path!r} ({type(module).__name__}) was kept whole but cannot be rebuilt from code")
        dtypes = {t.dtype for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()}
        dtype = _dtype_text(dtypes.pop()) if len(dtypes) == 1 else "None"
        lines.append(f"attach_module(self, {path!r}, lambda: {ctor}, {dtype}, source)")
    covered = tuple(p + "." for p in modules)
    attrs = sorted({n.target for n in graph.nodes if n.op == "get_attr"})
    for target in attrs:
        if target.startswith(covered):
            continue
        lines.append(_tensor_line(model, target))
    return lines


def tensor_kind(model: torch.nn.Module, target: str) -> tuple[str, torch.Tensor, bool]:
    """("parameter" | "buffer" | "constant", the tensor, persistent) of an attribute path."""
    module_path, _, name = target.rpartition(".")
    owner = model.get_submodule(module_path) if module_path else model
    value = getattr(owner, name)
    if not isinstance(value, torch.Tensor):
        raise DecomposeError(f"{target} is read by the model as a tensor but is a {type(value).__name__}")
    if name in owner._parameters:
        return "parameter", value, True
    if name in owner._buffers:
        return "buffer", value, name not in owner._non_persistent_buffers_set
    return "constant", value, False


def _tensor_line(model: torch.nn.Module, target: str) -> str:
    kind, value, persistent = tensor_kind(model, target)
    shape = tuple(value.shape)
    dtype = _dtype_text(value.dtype)
    if kind == "parameter":
        return f"attach_parameter(self, {target!r}, {shape}, {dtype}, {value.requires_grad}, source)"
    return f"attach_buffer(self, {target!r}, {shape}, {dtype}, {persistent}, source)"


HEADER = '''"""Layer {index} of {total} of {model}: {name}.

Generated by harmony.decomposer from a {tracer} trace; do not edit (the graph records a hash).
Inputs:  {inputs}
Outputs: {outputs}
Relayed: {relayed}
"""
'''


_WRAP = "torch.fx._symbolic_trace.wrap("


def _module_level_wraps(src: str) -> tuple[list[str], str]:
    """The ``torch.fx.wrap`` registrations fx writes above ``forward`` (a traced call to a function
    its library wrapped, torchvision's ``stochastic_depth``), and the code without them: ``wrap``
    must run at a module's top level, not in the generated class's body."""
    lines = src.split("\n")
    wraps = [line.strip() for line in lines if line.strip().startswith(_WRAP)]
    return wraps, "\n".join(line for line in lines if not line.strip().startswith(_WRAP))


def generate(
    index: int,
    total: int,
    graph: fx.Graph,
    model: torch.nn.Module,
    opaque: set[str],
    name: str,
    tracer: str,
    extra_state: list[str] = (),  # type: ignore[assignment]
    relayed: list[str] = (),  # type: ignore[assignment]
) -> LayerCode:
    """Python source of one layer module."""
    class_name = f"Layer{index:03d}"
    code = graph.python_code(root_module="self")
    imports = ["import torch", "from harmony.decomposer.layer_support import attach_buffer, attach_module, attach_opaque, "
               "attach_parameter, function_apply"]
    for gname, value in sorted(code.globals.items()):
        if gname == "torch":
            continue
        line = _import_line(gname, value)
        if line:
            imports.append(line)
    init = _init_lines(graph, model, opaque) + [_tensor_line(model, t) for t in extra_state]
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in graph.nodes if n.op == "output")
    outputs = [a.name if isinstance(a, fx.Node) else repr(a) for a in out_node.args[0]]
    header = HEADER.format(
        index=index, total=total, model=type(model).__name__, name=name, tracer=tracer,
        inputs=", ".join(placeholders) or "-", outputs=", ".join(outputs) or "-", relayed=", ".join(relayed) or "-",
    )
    wraps, src = _module_level_wraps(code.src)
    imports += wraps
    src = src.strip("\n")
    if any(n.target is grad_off for n in graph.nodes):
        imports.append("from harmony.decomposer.layer_support import keeps_grad_mode")
        src = "@keeps_grad_mode\n" + src
    body = textwrap.indent(src, "    ")
    init_body = "\n".join("        " + line for line in init) if init else "        pass"
    source = (
        f"{header}\n" + "\n".join(imports) + "\n\n\n"
        f"class {class_name}(torch.nn.Module):\n"
        f"    def __init__(self, source: torch.nn.Module | None = None):\n"
        f"        super().__init__()\n"
        f"{init_body}\n\n"
        f"{body}\n"
    )
    file_name = f"layer_{index:03d}.py"
    return LayerCode(index, class_name, file_name, source, hashlib.sha256(source.encode()).hexdigest())
