"""The layer graph: a chain of layers, what flows between them, and what each one owns.

The data half (specs) is plain and serializes to ``graph.msgpack``; the live half (``modules``)
holds the generated layer modules when the graph was made in this process or loaded with its code.
Every later stage reads the specs: the profiler runs ``modules`` one at a time, the scheduler only
needs names and sizes, the runtime loads the code in each worker.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
import sys
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils import _pytree as pytree

from harmony import serialization
from harmony.decomposer.layer_support import function_class
from harmony.decomposer.meta_init import on_meta
from harmony.errors import DecomposeError, FormatError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: values record their batch dim; the graph the batch sizes its layers run at
KIND = "layer-graph"
GRAPH_FILE = "graph.msgpack"
CODE_DIR = "layers"

_DTYPES = {str(d): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)}


_NOT_DATA = ("modules", "_out_spec", "sources")  # the graph's fields that ``to_dict`` leaves out


def _plain(value: Any) -> Any:
    """``value`` as ``asdict`` copies a field: dataclasses as dicts, lists and dicts copied, the
    rest (strings, numbers, bytes) as it is."""
    if is_dataclass(value):
        return asdict(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def dtype_from_str(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise FormatError(f"unknown dtype {name!r}") from None


@dataclass
class ValueSpec:
    """A value crossing a layer boundary, with its shape at the example batch size."""

    name: str
    kind: str  # "tensor" or "object" (a Python value such as a size, relayed as a message)
    shape: list[int] = field(default_factory=list)
    dtype: str = ""
    nbytes: int = 0
    requires_grad: bool = False
    text: str = ""  # repr, for objects
    # the dim holding one entry per sample, along which microbatches are cut and joined; None: the
    # value is the same for every microbatch size (a causal mask, a sequence length)
    batch_dim: int | None = None
    # varies with the microbatch size in a way that cannot be cut or joined: the backward must then
    # see exactly the forward's microbatches (U_F = U_B)
    coupled: bool = False


@dataclass
class StateSpec:
    """A parameter, buffer or tensor constant, under the original model's qualified name."""

    name: str
    kind: str  # "parameter", "buffer" or "constant"
    shape: list[int]
    dtype: str
    nbytes: int
    requires_grad: bool = False
    persistent: bool = True


@dataclass
class LayerSpec:
    index: int
    name: str
    modules: list[str]
    inputs: list[str]
    outputs: list[str]
    relayed: list[str]  # inputs passed through to outputs without being used here
    state: list[str]  # parameters, buffers and constants this layer owns (names in StateSpec)
    code_file: str
    class_name: str
    code_sha256: str = ""


@dataclass
class LayerGraph:
    model_class: str
    tracer: str
    training: bool
    inputs: list[str]
    layers: list[LayerSpec]
    values: dict[str, ValueSpec]
    state: dict[str, StateSpec]
    ties: dict[str, list[str]]  # canonical parameter name -> other names of the same tensor
    output_spec: str  # torch.utils._pytree treespec, serialized; "" if not serializable
    constants: dict[str, bytes] = field(default_factory=dict)  # values of constants and non-persistent buffers
    # the microbatch sizes the layers run at, when the trace specialised the batch (empty: every size),
    # and why
    batch_sizes: list[int] = field(default_factory=list)
    batch_note: str = ""
    sources: dict[str, str] = field(default_factory=dict, repr=False)  # code_file -> source
    modules: list[torch.nn.Module] | None = field(default=None, repr=False, compare=False)
    _out_spec: Any = field(default=None, repr=False, compare=False)

    # ---------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self.layers)

    def layer_parameters(self, index: int) -> list[StateSpec]:
        return [self.state[n] for n in self.layers[index].state if self.state[n].kind == "parameter"]

    def layer_buffers(self, index: int) -> list[StateSpec]:
        return [self.state[n] for n in self.layers[index].state if self.state[n].kind != "parameter"]

    def parameter_bytes(self, index: int | None = None) -> int:
        layers = range(len(self.layers)) if index is None else [index]
        seen: set[str] = set()
        total = 0
        for i in layers:
            for spec in self.layer_parameters(i):
                canon = self.canonical(spec.name)
                if canon not in seen:
                    seen.add(canon)
                    total += spec.nbytes
        return total

    def parameter_layers(self) -> dict[str, list[int]]:
        """Each trainable parameter (by canonical name, in the model's order of parameters) and the
        layers holding it: what a program needs to say who steps it (``scheduler.lower.ownership``).
        The model's order is the one a sum over all of them (a clipped gradient's norm) follows, as
        eager code over ``model.parameters()`` does."""
        holders: dict[str, list[int]] = {}
        for spec in self.layers:
            for name in spec.state:
                state = self.state[name]
                if state.kind == "parameter" and state.requires_grad:
                    layers = holders.setdefault(self.canonical(name), [])
                    if spec.index not in layers:
                        layers.append(spec.index)
        ordered = dict.fromkeys(self.canonical(name) for name in self.state)
        return {name: holders[name] for name in ordered if name in holders}

    def canonical(self, name: str) -> str:
        for canon, aliases in self.ties.items():
            if name in aliases:
                return canon
        return name

    def fingerprint(self) -> str:
        """SHA-256 of the graph's structure and code: profiles and plans record it, so a file made
        for another decomposition of the model is recognized and refused."""
        import msgpack

        return hashlib.sha256(msgpack.packb(self.to_dict(), use_bin_type=True)).hexdigest()

    def input_batch_dims(self, index: int) -> list[int | None]:
        """Per input of layer ``index``, the dim its samples lie along (None: the same for every
        microbatch, passed whole): where the runtime cuts and joins microbatches."""
        return [self.values[n].batch_dim if self.values[n].kind == "tensor" else None for n in self.layers[index].inputs]

    def coupled_inputs(self) -> list[tuple[int, str]]:
        """(layer, value) of every layer input that depends on the microbatch size in a way that
        can be neither cut nor joined, so the backward must see the forward's microbatches."""
        return [(spec.index, n) for spec in self.layers for n in spec.inputs if self.values[n].coupled]

    def relays(self) -> dict[int, list[str]]:
        return {spec.index: spec.relayed for spec in self.layers if spec.relayed}

    def out_spec(self) -> pytree.TreeSpec:
        if self._out_spec is None:
            if not self.output_spec:
                raise DecomposeError("this layer graph's output structure could not be saved; decompose the model again")
            self._out_spec = _load_treespec(self.output_spec)
        return self._out_spec

    # ---------------------------------------------------------------- running
    def _require_modules(self) -> list[torch.nn.Module]:
        if self.modules is None:
            raise DecomposeError("this layer graph has no layer modules; use LayerGraph.load(dir) or harmony.decompose()")
        return self.modules

    def run_layer(self, index: int, *values: Any) -> tuple:
        """Run one layer on the values of its input boundary; returns its output boundary."""
        out = self._require_modules()[index](*values)
        return tuple(out)

    def run_sequential(self, *inputs: Any) -> Any:
        """Run every layer in turn; equals calling the original model on ``inputs``."""
        modules = self._require_modules()
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)) and len(self.inputs) != 1:
            inputs = tuple(inputs[0])
        if len(inputs) != len(self.inputs):
            raise DecomposeError(f"the model takes {len(self.inputs)} input(s) ({', '.join(self.inputs)}), got {len(inputs)}")
        values: tuple = tuple(inputs)
        for module in modules:
            values = tuple(module(*values))
        return pytree.tree_unflatten(list(values), self.out_spec())

    def parameters(self):
        """Every parameter once (tied parameters once), for an optimizer over the whole graph."""
        seen: set[int] = set()
        for module in self._require_modules():
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state_dict keys, tied names included, from the layers' tensors."""
        out: dict[str, torch.Tensor] = {}
        for module in self._require_modules():
            for name, tensor in module.state_dict(keep_vars=True).items():
                if name in self.state and self.state[name].kind != "constant":
                    out[name] = tensor.detach()
        for canon, aliases in self.ties.items():
            for alias in aliases:
                if canon in out and alias not in out:
                    out[alias] = out[canon]
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy tensors by original name into the layers (as the original model's load_state_dict).

        A tied parameter may arrive under any of its names.
        """
        def lookup(name: str) -> torch.Tensor | None:
            canon = self.canonical(name)
            for candidate in (name, canon, *self.ties.get(canon, [])):
                if candidate in state_dict:
                    return state_dict[candidate]
            return None

        missing = [n for n, s in self.state.items() if s.kind != "constant" and s.persistent and lookup(n) is None]
        if missing:
            raise DecomposeError(f"state_dict lacks {len(missing)} tensor(s) of the model, e.g. {missing[:3]}")
        with torch.no_grad():
            for module in self._require_modules():
                for name, tensor in module.state_dict(keep_vars=True).items():
                    src = lookup(name)
                    if src is not None:
                        tensor.copy_(src)

    # ---------------------------------------------------------------- files
    def to_dict(self) -> dict:
        """The data half as plain Python: what ``graph.msgpack`` holds and ``fingerprint`` hashes.
        Field by field, as ``asdict`` would give them, leaving out the live half and the sources
        (``asdict`` of the whole graph would deep-copy its layer modules only to drop them)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name not in _NOT_DATA}

    def save(self, directory: str | Path) -> Path:
        """Write ``graph.msgpack`` and the generated code under ``layers/``; returns the directory."""
        directory = Path(directory)
        code_dir = directory / CODE_DIR
        code_dir.mkdir(parents=True, exist_ok=True)
        for file_name, source in self.sources.items():
            serialization.atomic_write_bytes(code_dir / file_name, source.encode())
        serialization.atomic_write_bytes(code_dir / "__init__.py", b'"""Generated by harmony.decomposer; one module per layer."""\n')
        serialization.save(directory / GRAPH_FILE, KIND, SCHEMA_VERSION, self.to_dict())
        return directory

    @classmethod
    def from_dict(cls, body: dict) -> "LayerGraph":
        """The graph of ``to_dict``'s plain data; a body of the wrong shape is a FormatError naming the
        field, not a KeyError later (files come from outside)."""
        check = serialization.check_fields
        try:
            check(LayerGraph, body, "layer graph")
            graph = cls(
                model_class=body["model_class"],
                tracer=body["tracer"],
                training=body["training"],
                inputs=list(body["inputs"]),
                layers=[LayerSpec(**check(LayerSpec, spec, f"layer {i}")) for i, spec in enumerate(body["layers"])],
                values={k: ValueSpec(**check(ValueSpec, v, f"value {k}")) for k, v in body["values"].items()},
                state={k: StateSpec(**check(StateSpec, v, f"state {k}")) for k, v in body["state"].items()},
                ties={k: list(v) for k, v in body["ties"].items()},
                output_spec=body["output_spec"],
                constants=dict(body.get("constants", {})),
                batch_sizes=list(body.get("batch_sizes", [])),
                batch_note=body.get("batch_note", ""),
            )
        except serialization.MALFORMED as exc:
            raise FormatError(f"layer graph is malformed ({type(exc).__name__}: {exc})") from exc
        for i, spec in enumerate(graph.layers):
            if spec.index != i or Path(spec.code_file).name != spec.code_file or not spec.code_file.endswith(".py"):
                raise FormatError(f"layer graph is malformed (layer {i} is numbered {spec.index} with code file "
                                  f"{spec.code_file!r})")
        return graph

    @classmethod
    def load(
        cls,
        directory: str | Path,
        device: str | torch.device = "cpu",
        source: torch.nn.Module | None = None,
        with_code: bool = True,
    ) -> "LayerGraph":
        """Read a graph directory; with ``with_code``, import and build its layers on ``device``.

        Without ``source`` the layers get fresh (uninitialized) tensors and tied parameters are
        re-tied; load weights with ``load_state_dict``. With ``source`` they share its tensors.
        """
        directory = Path(directory)
        body = serialization.load(directory / GRAPH_FILE, KIND, SCHEMA_VERSION)
        with serialization.decoding(str(directory / GRAPH_FILE), "layer graph"):
            graph = cls.from_dict(body)
        if not with_code:
            return graph
        for spec in graph.layers:
            path = directory / CODE_DIR / spec.code_file
            if not path.is_file():
                raise FormatError(f"{path} is missing; the layer code of this graph is incomplete")
            text = path.read_text()
            if spec.code_sha256 and hashlib.sha256(text.encode()).hexdigest() != spec.code_sha256:
                raise FormatError(f"{path} does not match {directory / GRAPH_FILE} (the code was modified, or the graph "
                                  "comes from another decomposition); decompose the model again")
            graph.sources[spec.code_file] = text
        graph.build_modules(device=device, source=source, origin=directory / CODE_DIR)
        return graph

    def build_modules(
        self, device: str | torch.device = "cpu", source: torch.nn.Module | None = None, origin: Path | None = None
    ) -> list[torch.nn.Module]:
        """Instantiate every layer from its generated source, as the graph's own (``modules``)."""
        self.modules = self.layer_modules(device, source, origin)
        return self.modules

    def opaque_modules(self) -> dict[str, torch.nn.Module]:
        """The modules the layers keep whole (no generated code), by path, from the built layers."""
        found = {}
        for spec, module in zip(self.layers, self._require_modules()):
            for path in _OPAQUE_CALL.findall(self.sources[spec.code_file]):
                found[path] = module.get_submodule(path)
        return found

    def functions(self) -> dict[tuple[str, str], type]:
        """The custom autograd Function classes the layers call, by (module, qualified name)."""
        return {(module, qualname): function_class(module, qualname)
                for source in self.sources.values() for module, qualname in _FUNCTION_CALL.findall(source)}

    def layer_modules(
        self, device: str | torch.device = "cpu", source: torch.nn.Module | None = None, origin: Path | None = None
    ) -> list[torch.nn.Module]:
        """Every layer instantiated from its generated source (sharing ``source``'s tensors where
        given), leaving the graph's own modules as they are."""
        modules = []
        for spec in self.layers:
            cls = _import_layer_class(spec, self.sources[spec.code_file], origin)
            with on_meta() if torch.device(device).type == "meta" else torch.device(device):
                modules.append(cls(source=source))
        if source is None:
            _retie(modules, self.ties)
            self._fill_constants(modules)
            for module in modules:
                module.train(self.training)
        return modules

    def constant_value(self, name: str) -> torch.Tensor:
        """A constant's (or non-persistent buffer's) value, from the bytes the graph keeps of it."""
        spec = self.state[name]
        array = np.frombuffer(self.constants[name], dtype=np.uint8).copy()
        return torch.from_numpy(array).view(dtype_from_str(spec.dtype)).reshape(spec.shape)

    def _fill_constants(self, modules: list[torch.nn.Module]) -> None:
        for module in modules:
            for name, buf in module.named_buffers():
                if name in self.constants:
                    with torch.no_grad():
                        buf.copy_(self.constant_value(name))


_OPAQUE_CALL = re.compile(r"attach_opaque\(self, '([^']+)'")  # as codegen writes them
_FUNCTION_CALL = re.compile(r"function_apply\('([^']+)', '([^']+)'\)")


def _serialized_types(node: Any) -> set[str]:
    """Every ``"type"`` name in a serialized treespec's JSON body."""
    found: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            found.add(node["type"])
        for child in node.get("children_spec", ()):
            found |= _serialized_types(child)
    return found


def _import_defining_module(type_name: str) -> None:
    """Import the longest importable module prefix of ``type_name``.

    Output classes such as Hugging Face's ``ModelOutput`` subclasses register themselves with
    pytree when their module is imported; a spawned worker that never imported it could not
    rebuild the model's output structure otherwise.
    """
    parts = type_name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:k]))
            return
        except ImportError:
            continue


def _load_treespec(text: str) -> pytree.TreeSpec:
    """``pytree.treespec_loads``, importing first the modules that register the output's classes."""
    try:
        return pytree.treespec_loads(text)
    except NotImplementedError:  # a class registered at import time, by a module not imported here
        import json

        _, body = json.loads(text)
        for name in sorted(_serialized_types(body)):
            _import_defining_module(name)
        return pytree.treespec_loads(text)


def _import_layer_class(spec: LayerSpec, source: str, origin: Path | None) -> type:
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    module_name = f"harmony_layers_{digest}_{spec.index}"
    module = sys.modules.get(module_name)
    if module is None:
        filename = str(origin / spec.code_file) if origin is not None else f"<harmony layer {spec.index}>"
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(module_name, loader=None, origin=filename))
        code = compile(source, filename, "exec")
        exec(code, module.__dict__)  # noqa: S102 - our own generated code
        if origin is None:
            import linecache

            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        sys.modules[module_name] = module
    return getattr(module, spec.class_name)


def _retie(modules: Sequence[torch.nn.Module], ties: dict[str, list[str]]) -> None:
    """Make every alias of a tied parameter the same Parameter object, across layers."""
    for canon, aliases in ties.items():
        names = [canon, *aliases]
        holder = None
        for module in modules:
            for name in names:
                try:
                    param = module.get_parameter(name)
                except AttributeError:
                    continue
                if holder is None:
                    holder = param
                else:
                    parent_path, _, attr = name.rpartition(".")
                    parent = module.get_submodule(parent_path) if parent_path else module
                    parent.register_parameter(attr, holder)
