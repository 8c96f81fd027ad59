"""The host store: master weights, buffers, optimizer state and gradient slots, once, in shared memory.

Every worker reads and writes the same bytes (docs/architecture.md, "Host store and channels").
The store is one flat shared ``uint8`` tensor and a layout table of plain data (name -> offset,
shape, dtype), so a worker needs one file descriptor and the layout to see all of it, and a
checkpoint is the layout plus the bytes.

What lives here, by key:

- ``W/<name>``: a parameter, under its canonical name (a tied parameter once).
- ``B/<name>``: a buffer or constant (BatchNorm statistics, masks), as the layers hold them.
- ``K/<name>/<key>``: one tensor of a parameter's optimizer state (``exp_avg``, ``step``...).
  The layout of the state is found by a dry step on a copy of each parameter; ``initialized``
  says whether the real state has been written (the first real step runs with an empty state,
  so optimizers that initialize from the first gradient, such as SGD's momentum, stay exact).
- ``G/<device>/<name>``: the gradient a device left in host memory for a parameter (dp's
  reduction, the per-GPU-swap baselines' running gradient, a tied weight's share). ``stamp``
  marks which iteration wrote a slot, so stale slots read as zero without being cleared.
- ``L/<name>``: the low-precision copy a bf16/fp16 plan moves of a weight (``TaskGraph.low_copies``),
  cast from ``W/<name>`` whenever that changes: when weights are loaded, and by the host update
  that steps it. A swap-in then copies it as it is, from the same pinned buffer, instead of casting
  the master anew each time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from harmony.decomposer.layer_graph import LayerGraph, dtype_from_str
from harmony.runtime.hostroom import check_room, gib, shared_zeros

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: every tensor starts on a cache line


@dataclass
class Entry:
    offset: int
    shape: list[int]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_str(self.dtype).itemsize


@dataclass
class Layout:
    """Where each tensor of the store lives in the flat buffer; plain data."""

    entries: dict[str, Entry] = field(default_factory=dict)
    params: list[str] = field(default_factory=list)  # canonical parameter names, in a fixed order
    state_keys: dict[str, list[str]] = field(default_factory=dict)  # parameter -> optimizer state keys
    devices: int = 1
    size: int = 0

    def add(self, key: str, shape: Iterable[int], dtype: torch.dtype | str) -> None:
        dtype = str(dtype)
        entry = Entry(offset=self.size, shape=list(shape), dtype=dtype)
        self.entries[key] = entry
        self.size += -(-max(entry.nbytes, 1) // ALIGN) * ALIGN

    @classmethod
    def for_graph(cls, graph: LayerGraph, devices: int, build_optimizer: Callable,
                  low_copies: dict[str, str] | None = None,
                  slots: Iterable[tuple[int, str]] | None = None) -> "Layout":
        """The layout of a store for ``graph`` (see ``HostStore.create``), found without allocating
        it: a compile reports its size, a run checks there is room before mapping it. ``slots``:
        the (device, parameter) gradient slots the plan deposits into (``Program.gradient_slots``);
        None: one per device for every trainable parameter."""
        wanted = None if slots is None else set(slots)
        layout = cls(devices=devices)
        for name, spec in graph.state.items():
            canon = graph.canonical(name)
            if spec.kind == "parameter":
                if canon in layout.params:
                    continue
                layout.params.append(canon)
                layout.add(f"W/{canon}", spec.shape, dtype_from_str(spec.dtype))
            else:
                layout.add(f"B/{name}", spec.shape, dtype_from_str(spec.dtype))
        stepped: dict[tuple, dict] = {}  # (shape, dtype) -> its state: one throwaway step per kind of weight
        for canon in layout.params:
            spec = graph.state[canon]
            kind = (tuple(spec.shape), spec.dtype)
            if spec.requires_grad and kind not in stepped:
                sample = torch.empty(spec.shape, dtype=dtype_from_str(spec.dtype), device="meta")
                stepped[kind] = state_layout(sample, build_optimizer)
            keys = stepped[kind] if spec.requires_grad else {}
            layout.state_keys[canon] = list(keys)
            for key, (shape, dtype) in keys.items():
                layout.add(f"K/{canon}/{key}", shape, dtype)
            if spec.requires_grad:
                for d in range(devices):
                    if wanted is None or (d, canon) in wanted:
                        layout.add(f"G/{d}/{canon}", spec.shape, dtype_from_str(spec.dtype))
        for canon, dtype in (low_copies or {}).items():
            layout.add(f"L/{canon}", graph.state[canon].shape, dtype_from_str(f"torch.{dtype}"))
        return layout

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes per kind of entry: W (weights), B (buffers), K (optimizer state), G (gradient
        slots, one per device), L (low-precision copies)."""
        out: dict[str, int] = {}
        for key, entry in self.entries.items():
            kind = key.split("/", 1)[0]
            out[kind] = out.get(kind, 0) + -(-max(entry.nbytes, 1) // ALIGN) * ALIGN
        return out

    def describe(self) -> str:
        return describe_kinds(self.bytes_by_kind())

    def to_dict(self) -> dict:
        return {
            "entries": {k: [e.offset, e.shape, e.dtype] for k, e in self.entries.items()},
            "params": self.params, "state_keys": self.state_keys, "devices": self.devices, "size": self.size,
        }

    @classmethod
    def from_dict(cls, body: dict) -> "Layout":
        return cls(
            entries={k: Entry(offset=v[0], shape=list(v[1]), dtype=v[2]) for k, v in body["entries"].items()},
            params=list(body["params"]), state_keys={k: list(v) for k, v in body["state_keys"].items()},
            devices=body["devices"], size=body["size"],
        )


def state_layout(param: torch.Tensor, build_optimizer: Callable) -> dict[str, tuple[list[int], torch.dtype]]:
    """The optimizer state one parameter will have: found by one step on a throwaway copy, on the
    meta device where the optimizer allows it (no memory, no arithmetic: a large embedding takes
    seconds on the CPU), else on the CPU (an optimizer that reads a value, such as ASGD or Adafactor
    calling ``.item()``, cannot step on meta)."""
    try:
        return _stepped_state(param, build_optimizer, "meta")
    except (RuntimeError, NotImplementedError):
        return _stepped_state(param, build_optimizer, "cpu")


def _stepped_state(param: torch.Tensor, build_optimizer: Callable, device: str) -> dict[str, tuple[list[int], torch.dtype]]:
    copy = torch.nn.Parameter(torch.zeros_like(param, device=device))
    copy.grad = torch.zeros_like(copy)
    opt = build_optimizer([copy])
    opt.step()
    out = {}
    for key, value in opt.state[copy].items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"optimizer {type(opt).__name__} keeps {key!r} as a {type(value).__name__}; Harmony keeps "
                "optimizer state in shared memory and needs every state value to be a tensor"
            )
        out[key] = (list(value.shape), value.dtype)
    return out


def describe_kinds(by_kind: dict[str, int]) -> str:
    """``Layout.bytes_by_kind`` in words, e.g. "weights 1.2 GiB, optimizer state 2.4 GiB, ..."."""
    names = {"W": "weights", "B": "buffers", "K": "optimizer state", "G": "gradient slots",
             "L": "low-precision copies"}
    return ", ".join(f"{names.get(k, k)} {gib(n)}" for k, n in by_kind.items())


class HostStore:
    """The flat shared buffer and its layout; views by key."""

    def __init__(self, layout: Layout, buffer: torch.Tensor, flags: torch.Tensor) -> None:
        self.layout = layout
        self.buffer = buffer
        # flags[0 : P]: optimizer state initialized per parameter; flags[P : P + D*P]: gradient
        # slot stamps (iteration + 1 that wrote the slot)
        self.flags = flags
        self._flags = flags.numpy()  # polled by stream threads: kept out of torch's dispatcher
        self._index = {name: i for i, name in enumerate(layout.params)}
        self._views: dict[str, torch.Tensor] = {}

    def __getstate__(self) -> dict:
        return {"layout": self.layout, "buffer": self.buffer, "flags": self.flags}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["layout"], state["buffer"], state["flags"])

    # ------------------------------------------------------------ building
    @classmethod
    def create(cls, graph: LayerGraph, devices: int, build_optimizer: Callable,
               tensors: dict[str, torch.Tensor], path: str | None = None,
               low_copies: dict[str, str] | None = None,
               slots: Iterable[tuple[int, str]] | None = None) -> "HostStore":
        """A store for ``graph`` filled from ``tensors`` (original names -> values: parameters,
        buffers and constants), with optimizer-state and gradient slots for ``devices`` devices
        and the low-precision copies ``low_copies`` names (canonical name -> dtype); ``slots``: only
        these (device, parameter) gradient slots (``Layout.for_graph``).
        With ``path``, the store is the files ``<path>-store`` and ``<path>-flags`` (in /dev/shm),
        which processes not forked from this one map with ``open``."""
        layout = Layout.for_graph(graph, devices, build_optimizer, low_copies, slots)
        flags = max(1, len(layout.params) * (1 + devices))
        check_room(max(layout.size, ALIGN) + flags * 8, f"the host store ({layout.describe()})")
        store = cls.open(layout, path) if path else cls(layout, shared_zeros(max(layout.size, ALIGN), torch.uint8),
                                                        shared_zeros(flags, torch.int64))
        store.load_tensors(graph, tensors)
        return store

    @classmethod
    def open(cls, layout: Layout, path: str) -> "HostStore":
        """The store in the files at ``path`` (made by ``create(..., path=)``), mapped shared."""
        buffer = torch.from_file(f"{path}-store", shared=True, size=max(layout.size, ALIGN), dtype=torch.uint8)
        flags = torch.from_file(f"{path}-flags", shared=True, size=max(1, len(layout.params) * (1 + layout.devices)),
                                dtype=torch.int64)
        return cls(layout, buffer, flags)

    def load_tensors(self, graph: LayerGraph, tensors: dict[str, torch.Tensor]) -> None:
        """Copy parameters and buffers in by original name (any alias of a tied parameter)."""
        missing = []
        with torch.no_grad():
            for name, spec in graph.state.items():
                key = f"W/{graph.canonical(name)}" if spec.kind == "parameter" else f"B/{name}"
                source = tensors.get(name)
                if source is None:
                    for alias in [graph.canonical(name), *graph.ties.get(graph.canonical(name), [])]:
                        source = tensors.get(alias, source)
                if source is None and name in graph.constants:  # constants and non-persistent buffers
                    source = graph.constant_value(name)
                if source is None:
                    if spec.kind == "parameter" or spec.persistent:
                        missing.append(name)
                    continue
                self.view(key).copy_(source.detach().reshape(spec.shape))
        if missing:
            raise KeyError(f"no value for {len(missing)} tensor(s) of the model, e.g. {missing[:3]}")
        self.refresh_low_copies()

    def refresh_low_copies(self, names: Iterable[str] | None = None) -> None:
        """Cast the masters of ``names`` (all with a copy, by default) into their low-precision
        copies: round to nearest even, as autocast's cast on a device rounds."""
        names = self.layout.params if names is None else names
        with torch.no_grad():
            for name in names:
                if f"L/{name}" in self.layout.entries:
                    self.view(f"L/{name}").copy_(self.weight(name))

    # ------------------------------------------------------------ access
    def view(self, key: str) -> torch.Tensor:
        view = self._views.get(key)
        if view is None:
            e = self.layout.entries[key]
            dtype = dtype_from_str(e.dtype)
            raw = self.buffer[e.offset:e.offset + e.nbytes]
            view = raw.view(dtype).view(e.shape) if e.numel else torch.empty(e.shape, dtype=dtype)
            self._views[key] = view
        return view

    def weight(self, name: str) -> torch.Tensor:
        return self.view(f"W/{name}")

    def low_copy(self, name: str) -> torch.Tensor | None:
        """The weight's low-precision copy (``L/<name>``), if the store keeps one."""
        return self.view(f"L/{name}") if f"L/{name}" in self.layout.entries else None

    def state(self, name: str) -> dict[str, torch.Tensor]:
        return {key: self.view(f"K/{name}/{key}") for key in self.layout.state_keys.get(name, [])}

    def state_initialized(self, name: str) -> bool:
        return bool(self._flags[self._index[name]])

    def mark_state_initialized(self, name: str) -> None:
        self._flags[self._index[name]] = 1

    def grad_slot(self, device: int, name: str) -> torch.Tensor:
        key = f"G/{device}/{name}"
        if key not in self.layout.entries:
            raise RuntimeError(f"the host store has no slot for device {device}'s gradient of {name}: it was made "
                               "for another plan (HostStore.create(slots=Program.gradient_slots(tasks)))")
        return self.view(key)

    def _stamp_index(self, device: int, name: str) -> int:
        return len(self.layout.params) * (1 + device) + self._index[name]

    def slot_written(self, device: int, name: str, iteration: int) -> bool:
        return int(self._flags[self._stamp_index(device, name)]) == iteration + 1

    def stamp_slot(self, device: int, name: str, iteration: int) -> None:
        self._flags[self._stamp_index(device, name)] = iteration + 1

    def gradient_sum(self, name: str, iteration: int) -> torch.Tensor | None:
        """The sum of every device's slot of ``name`` written in ``iteration`` (a new tensor), or
        None if none was."""
        written = self._written(name, iteration)
        if not written:
            return None
        total = self.grad_slot(written[0], name).clone()
        for d in written[1:]:
            total.add_(self.grad_slot(d, name))
        return total

    def _written(self, name: str, iteration: int) -> list[int]:
        return [d for d in range(self.layout.devices) if self.slot_written(d, name, iteration)]

    def merge_slots(self, name: str, iteration: int) -> torch.Tensor | None:
        """Sum every slot of ``name`` written in ``iteration`` into the first of them, which stays
        the only one written (a clip scales it in place; ``gradient_sum`` then copies it once);
        None if none was written."""
        written = self._written(name, iteration)
        if not written:
            return None
        total = self.grad_slot(written[0], name)
        for d in written[1:]:
            total.add_(self.grad_slot(d, name))
            self._flags[self._stamp_index(d, name)] = 0
        return total

    # ------------------------------------------------------------ whole-model views
    def state_dict(self, graph: LayerGraph) -> dict[str, torch.Tensor]:
        """The original model's state_dict names (tied names included) -> copies of the values."""
        out: dict[str, torch.Tensor] = {}
        for name, spec in graph.state.items():
            if spec.kind == "parameter":
                out[name] = self.weight(graph.canonical(name)).clone()
            elif spec.kind == "buffer" and spec.persistent:
                out[name] = self.view(f"B/{name}").clone()
        for canon, aliases in graph.ties.items():
            for alias in aliases:
                if alias not in out and canon in out:
                    out[alias] = out[canon]
        return out

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per parameter (canonical name), its optimizer state; empty before its first step."""
        return {name: {k: v.clone() for k, v in self.state(name).items()}
                for name in self.layout.params if self.state_initialized(name)}

    def load_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name in self.layout.params:
                values = state.get(name)
                if not values:
                    self._flags[self._index[name]] = 0
                    continue
                for key, view in self.state(name).items():
                    view.copy_(values[key])
                self.mark_state_initialized(name)

