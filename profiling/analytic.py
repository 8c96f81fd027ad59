"""Analytic profiles: layer costs from FLOP counts and a roofline, for hardware we do not have.

``analytic_profile(graph, spec)`` fills the same :class:`~harmony.profiling.profiles.Profile` that
the measuring profiler does (``source="analytic"``), without running anything real:

1. **Counting.** Each layer module runs on *meta* tensors (no memory, no arithmetic) with its
   parameters and buffers replaced by meta copies (``torch.func.functional_call``), once forward
   under ``no_grad`` (the FWD task of Harmony, which recomputes later) and once forward with
   autograd plus ``torch.autograd.backward`` (the BWD task: recompute + backward). Under
   ``torch.utils.flop_counter.FlopCounterMode`` and a dispatch mode of ours every aten op reports
   its FLOPs (backward FLOPs are counted from the real backward ops, not taken as 2x forward), the
   bytes it reads and writes (tensor arguments + results; views and aliases move nothing) and the
   bytes alive after it (every new storage is tracked until its last tensor dies, through weakref
   finalizers). A mixed-precision profile counts each layer under ``torch.autocast`` instead, on
   fake tensors of an autocast device type: low-precision outputs and the weights' casts are
   counted as eager autocast makes them. ``F.scaled_dot_product_attention`` is counted as the
   target runs it (``attention.py``): on a GPU (every ``DeviceSpec``) the fused kernel CUDA picks,
   whose forward keeps the output and a log-sum-exp per query row where the math path that meta
   tensors would run writes out and keeps the sequence x sequence scores; ``device_type="cpu"``
   counts on fake CPU tensors what torch runs there.
2. **Time** is a roofline summed *per op*: ``max(flops / (peak(dtype) * efficiency), bytes /
   memory_bandwidth)``, so a layer's matmuls may be compute-bound while its layer norm, softmax and
   element-wise ops are bandwidth-bound. ``fwd_time`` is the no-grad forward, ``bwd_time`` only the
   backward ops, ``recompute_time = fwd_time``.
3. **Memory.** ``fwd_peak = W + B + X + max(live bytes during the forward)`` (the outputs Y and
   every temporary are among the live bytes); ``bwd_peak = W + B + X + dY + max(live bytes during
   recompute + backward)`` (saved activations, the recomputed Y, dW and dX are among them).
   The live-byte timeline assumes tensors are freed as soon as the last Python reference dies, as
   the generated layer code does (it sets dead names to None); the caching allocator's
   fragmentation and the CUDA context are not modelled.
4. **Speed.** Identical layers (same generated code up to names and digits inside names, same
   parameter shapes, module types and input shapes) share one cost model. A cost model counts
   each layer at u = 2 and u = 4 and takes every per-op quantity (FLOPs, bytes, live bytes) as
   affine in u, checking the line at u = 8: FLOPs and bytes of these models are linear in the
   batch. If the check fails (a layer whose ops change with the batch size), that layer falls back
   to counting at every u asked for, exactly and more slowly.
5. **Maxima.** ``u_fmax`` / ``u_bmax`` are the largest u (binary search up to ``max_microbatch``)
   at which the largest single-layer ``fwd_peak`` / ``bwd_peak`` fits ``spec.capacity``; if even
   u = 1 does not fit, a :class:`~harmony.errors.HarmonyError` names the layer and what it needs.
   Samples are taken at u = 1..8, 12, 16, 24, 32, ... and at the maximum; the profile's linear fit
   answers the rest (times are only piecewise linear in u, so the fit is coarse between samples).

Sizes: ``W`` (every parameter the layer uses, tied ones once), ``dW`` (those that need gradients),
``B`` (buffers and constants) and ``K`` (optimizer state: ``OPTIMIZERS`` gives the number of fp32
numbers per parameter; adam 2, sgd with momentum 1, plain sgd 0). A parameter tied across layers
is updated by the first layer that uses it, so only that layer has its K and update time. The
update reads W, dW and K and writes W and K; its time is a roofline over those bytes and
``OPTIMIZERS``' FLOPs per parameter, on the device (``upd_time_device``) or the host CPU
(``upd_time_host``).

The batch dimension is dim 0 of the tensors in ``graph.values`` whose dim 0 equals the example
batch size (that of the graph's first input); other tensors keep their shapes.
"""

from __future__ import annotations

import ast
import logging
import re
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from harmony.decomposer.layer_graph import LayerGraph, dtype_from_str
from harmony.errors import HarmonyError
from harmony.profiling import attention
from harmony.scheduler.devicespec import DeviceSpec, load_spec
from harmony.profiling.profiles import LayerProfile, LayerSample, Profile
from harmony.runtime.hostroom import gib

log = logging.getLogger(__name__)

# optimizer name -> (fp32 state numbers per parameter, FLOPs per parameter of one update)
OPTIMIZERS: dict[str, tuple[int, int]] = {
    "adam": (2, 12),
    "adamw": (2, 14),
    "sgd": (0, 2),
    "sgd-momentum": (1, 4),
    "momentum": (1, 4),
    "rmsprop": (1, 8),
    "adagrad": (1, 6),
    "none": (0, 0),
}
OPTIMIZER_STATE_BYTES = 4  # optimizer state is kept in fp32

DEFAULT_MAX_MICROBATCH = 4096
_FIT_US = (2, 4)  # the two sizes each cost model counts at ...
_CHECK_U = 8  # ... and the one that checks the line through them
_REL_TOL = 1e-6


class AnalyticProfileError(HarmonyError):
    """The analytic profiler cannot profile this graph on this device."""


# --------------------------------------------------------------------------- counting
def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _OpRecorder(TorchDispatchMode):
    """Records, per aten op: FLOPs (from the FlopCounterMode below it), bytes moved, live bytes after.

    Storages of ``external`` tensors (parameters, buffers, inputs, output gradients: accounted for
    separately) are never counted as live.
    """

    def __init__(self, counter: FlopCounterMode, external: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.counter = counter
        self._keep = list(external)
        self.external = {_storage_key(t) for t in external}
        self.refs: dict[int, int] = {}
        self.live = 0
        self.names: list[str] = []
        self.flops: list[float] = []
        self.work: list[float] = []  # the FLOPs the kernel executes (``attention.executed_fraction``)
        self.bytes: list[float] = []
        self.lives: list[float] = []
        self._total = 0

    def _release(self, key: int, nbytes: int) -> None:
        n = self.refs.get(key, 0) - 1
        if n <= 0:
            self.refs.pop(key, None)
            self.live -= nbytes
        else:
            self.refs[key] = n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        total = self.counter.get_total_flops()
        flops, self._total = total - self._total, total
        ins = _tensors((args, kwargs))
        outs = _tensors(out)
        in_keys = {_storage_key(t) for t in ins}
        out_keys = [_storage_key(t) for t in outs]
        mutable = func._schema.is_mutable
        if not mutable and (getattr(func, "is_view", False) or all(k in in_keys for k in out_keys)):
            moved = 0  # a view or alias: no data moves
        elif func._overloadpacket is torch.ops.aten.embedding:
            moved = _nbytes(args[1]) + 2 * sum(_nbytes(t) for t in outs)  # reads the looked-up rows only
        else:
            moved = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
        seen_here: set[int] = set()
        for t, key in zip(outs, out_keys):
            if key in self.external or id(t) in seen_here:
                continue
            seen_here.add(id(t))
            if key not in self.refs:
                self.refs[key] = 0
                self.live += t.untyped_storage().nbytes()
            self.refs[key] += 1
            weakref.finalize(t, self._release, key, t.untyped_storage().nbytes())
        self.names.append(str(func))
        self.flops.append(float(flops))
        self.work.append(float(flops) * attention.executed_fraction(func, args, kwargs))
        self.bytes.append(float(moved))
        self.lives.append(float(self.live))
        return out


@dataclass
class _Counts:
    """One layer counted at one microbatch size; every field is affine in u for batch-linear layers.
    ``*_flops`` are the FLOPs as torch's counter counts them (the model's); ``*_work`` the FLOPs the
    kernels execute, which the times are computed from (less where a causal attention kernel skips
    its masked blocks)."""

    fwd_names: list[str]
    fwd_flops: np.ndarray
    fwd_work: np.ndarray
    fwd_bytes: np.ndarray
    fwd_live: np.ndarray
    bwd_names: list[str]  # recompute (forward with autograd) then backward
    bwd_flops: np.ndarray
    bwd_work: np.ndarray
    bwd_bytes: np.ndarray
    bwd_live: np.ndarray
    bwd_start: int  # index of the first backward op in the bwd_* arrays
    x_bytes: float
    y_bytes: float
    dx_bytes: float
    dy_bytes: float

    ARRAYS = ("fwd_flops", "fwd_work", "fwd_bytes", "fwd_live", "bwd_flops", "bwd_work", "bwd_bytes", "bwd_live")
    SCALARS = ("x_bytes", "y_bytes", "dx_bytes", "dy_bytes")

    def line_to(self, other: "_Counts", fraction: float) -> "_Counts":
        """The counts ``fraction`` of the way from these to ``other`` (same ops), field by field."""
        return replace(self, **{f: getattr(self, f) + (getattr(other, f) - getattr(self, f)) * fraction
                                for f in self.ARRAYS + self.SCALARS})

    def aligned(self, other: "_Counts") -> bool:
        return self.fwd_names == other.fwd_names and self.bwd_names == other.bwd_names and self.bwd_start == other.bwd_start


@dataclass
class Cost:
    """What one layer costs at one microbatch size on one device."""

    u: int
    fwd_flops: float
    bwd_flops: float  # backward ops only
    fwd_bytes: float  # bytes read and written by the forward's ops
    bwd_bytes: float
    fwd_time: float
    bwd_time: float
    recompute_time: float
    fwd_peak: int
    bwd_peak: int
    x_bytes: int
    y_bytes: int
    dx_bytes: int
    act_bytes: int = 0  # alive after the recompute, for the backward


def _roofline(flops: np.ndarray, moved: np.ndarray, peak: float, bandwidth: float) -> float:
    if flops.size == 0:
        return 0.0
    return float(np.maximum(flops / peak, moved / bandwidth).sum())


class LayerCostModel:
    """Costs of one layer (and of every layer identical to it) at any microbatch size."""

    def __init__(
        self,
        count: Callable[[int], _Counts],
        fixed_bytes: int,
        peak_flops: float,
        bandwidth: float,
        name: str,
        grad_bytes: int = 0,
    ) -> None:
        self._count = count
        self.fixed_bytes = fixed_bytes  # W + B on the device
        self.grad_bytes = grad_bytes  # dW: the gradient buffer, resident during a BWD task (grouping)
        self.peak_flops = peak_flops  # already times efficiency
        self.bandwidth = bandwidth
        self.name = name
        self._cache: dict[int, _Counts] = {}
        self._line: tuple[_Counts, _Counts, int, int] | None = None  # (counts at u1, at u2, u1, u2)
        self.linear = self._fit()

    def counts(self, u: int) -> _Counts:
        if u not in self._cache:
            self._cache[u] = self._count(u)
        return self._cache[u]

    def _fit(self) -> bool:
        u1, u2 = _FIT_US
        a, b = self.counts(u1), self.counts(u2)
        if not a.aligned(b):
            return False
        self._line = (a, b, u1, u2)
        check = self.counts(_CHECK_U)
        predicted = self._predict(_CHECK_U)
        if not check.aligned(predicted):
            self._line = None
            return False
        for f in _Counts.ARRAYS + _Counts.SCALARS:
            want, got = np.asarray(getattr(check, f)), np.asarray(getattr(predicted, f))
            if not np.allclose(got, want, rtol=_REL_TOL, atol=1.0):
                log.info("layer %s: %s is not linear in the microbatch size; counting at every size", self.name, f)
                self._line = None
                return False
        return True

    def _predict(self, u: int) -> _Counts:
        assert self._line is not None
        a, b, u1, u2 = self._line
        return a.line_to(b, (u - u1) / (u2 - u1))

    def _counts_at(self, u: int) -> _Counts:
        if u in self._cache:
            return self._cache[u]
        return self._predict(u) if self._line is not None else self.counts(u)

    def peaks(self, u: int) -> tuple[int, int]:
        c = self._counts_at(u)
        fwd = self.fixed_bytes + c.x_bytes + (float(c.fwd_live.max()) if c.fwd_live.size else 0.0)
        bwd = self.fixed_bytes + self.grad_bytes + c.x_bytes + c.dy_bytes + (float(c.bwd_live.max()) if c.bwd_live.size else 0.0)
        return int(round(fwd)), int(round(bwd))

    def at(self, u: int) -> Cost:
        c = self._counts_at(u)
        k = c.bwd_start
        fwd_time = _roofline(c.fwd_work, c.fwd_bytes, self.peak_flops, self.bandwidth)
        bwd_time = _roofline(c.bwd_work[k:], c.bwd_bytes[k:], self.peak_flops, self.bandwidth)
        fwd_peak, bwd_peak = self.peaks(u)
        return Cost(
            u=u, fwd_flops=float(c.fwd_flops.sum()), bwd_flops=float(c.bwd_flops[k:].sum()),
            fwd_bytes=float(c.fwd_bytes.sum()), bwd_bytes=float(c.bwd_bytes[k:].sum()),
            fwd_time=fwd_time, bwd_time=bwd_time, recompute_time=fwd_time,
            fwd_peak=fwd_peak, bwd_peak=bwd_peak,
            x_bytes=int(round(c.x_bytes)), y_bytes=int(round(c.y_bytes)), dx_bytes=int(round(c.dx_bytes)),
            act_bytes=int(round(c.bwd_live[k - 1])) if k > 0 else 0,
        )


# --------------------------------------------------------------------------- one layer on meta
class _LayerRunner:
    """Builds meta state and meta inputs for one layer and counts it at a given u. ``device``: where
    the tensors are made (meta; or a device type under a FakeTensorMode, ``casts.py``). With
    ``autocast`` (mixed precision's low dtype) the layer is counted as it runs under autocast: on
    fake tensors of an autocast device type (CUDA's op lists where CUDA is here, else the CPU's,
    as ``casts.py`` does), so that the ops autocast runs low move and keep half the bytes, and the
    weights' casts are counted as eager autocast makes them. ``target``: the device type the count
    stands for, which decides the attention kernels (``attention.py``); a ``"cpu"`` target is
    counted on fake CPU tensors, whose dispatch is the CPU's."""

    def __init__(self, graph: LayerGraph, index: int, module: torch.nn.Module, dtype: torch.dtype | None,
                 batch: int | None, device: str = "meta", autocast: torch.dtype | None = None,
                 target: str = "cuda") -> None:
        self.graph, self.index, self.module, self.dtype, self.batch = graph, index, module, dtype, batch
        self.device = device
        self.autocast = autocast
        self.target = target
        self.spec = graph.layers[index]

    def _cast(self, dt: torch.dtype) -> torch.dtype:
        return self.dtype if (self.dtype is not None and dt.is_floating_point) else dt

    def meta_state(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        made: dict[int, torch.Tensor] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) not in made:
                t = torch.empty(p.shape, dtype=self._cast(p.dtype), device=self.device)
                made[id(p)] = t.requires_grad_(p.requires_grad) if t.is_floating_point() else t
            state[name] = made[id(p)]
        for name, b in self.module.named_buffers(remove_duplicate=False):
            if id(b) not in made:
                made[id(b)] = torch.empty(b.shape, dtype=self._cast(b.dtype), device=self.device)
            state[name] = made[id(b)]
        return state

    def meta_inputs(self, u: int, grad: bool) -> list[Any]:
        values = []
        for name in self.spec.inputs:
            v = self.graph.values[name]
            if v.kind != "tensor":
                try:
                    values.append(ast.literal_eval(v.text))
                except (ValueError, SyntaxError) as exc:
                    raise AnalyticProfileError(
                        f"layer {self.index} ({self.spec.name}) takes the non-tensor value {name} = {v.text!r}, "
                        "which the analytic profiler cannot rebuild; profile it on a device instead"
                    ) from exc
                continue
            shape = list(v.shape)
            if v.batch_dim is not None:  # the samples' dim, as the decomposer probed it
                shape[v.batch_dim] = u
            t = torch.empty(shape, dtype=self._cast(dtype_from_str(v.dtype)), device=self.device)
            if grad and v.requires_grad and t.is_floating_point():
                t.requires_grad_(True)
            values.append(t)
        return values

    def count(self, u: int) -> _Counts:
        try:
            if self.autocast is not None:
                return self._count_autocast(u)
            if self.target == "cpu" and self.device == "meta":
                with FakeTensorMode(allow_non_fake_inputs=True):
                    return self._on_fake("cpu")._count(u)
            return self._count(u)
        except AnalyticProfileError:
            raise
        except Exception as exc:
            raise AnalyticProfileError(
                f"counting layer {self.index} ({self.spec.name}) on meta tensors at microbatch size {u} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _on_fake(self, device: str) -> "_LayerRunner":
        """This runner with its tensors made on fake ``device`` tensors (enter a FakeTensorMode to
        count with it)."""
        return _LayerRunner(self.graph, self.index, self.module, self.dtype, self.batch, device=device,
                            target=self.target)

    def _count_autocast(self, u: int) -> _Counts:
        """``_count`` under autocast on fake tensors; a layer fake tensors cannot run is counted
        without autocast (logged): float32 sizes, an upper bound of what it holds."""
        device = "cuda" if torch.cuda.is_available() and self.target == "cuda" else "cpu"
        runner = self._on_fake(device)
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), torch.autocast(device, dtype=self.autocast):
                return runner._count(u)
        except Exception as exc:
            log.info("layer %d (%s): not countable under autocast on fake tensors (%s: %s); counted in float32",
                     self.index, self.spec.name, type(exc).__name__, exc)
            self.autocast = None
            return self.count(u)

    def _count(self, u: int) -> _Counts:
        # forward, as the FWD task runs it: no autograd, outputs and temporaries only
        state = self.meta_state()
        xs = self.meta_inputs(u, grad=False)
        x_tensors = _tensors(xs)
        with torch.no_grad(), _counter() as counter, _OpRecorder(counter, list(state.values()) + x_tensors) as fwd, \
                attention.run_on(self.target):
            ys = functional_call(self.module, state, tuple(xs))
            y_tensors = _tensors(ys)
            y_bytes = _unique_bytes(y_tensors)
            y_meta = [(t.shape, t.dtype) for t in y_tensors]
            del ys, y_tensors
        x_bytes = _unique_bytes(x_tensors)
        del xs, x_tensors

        # recompute + backward, as the BWD task runs it
        state = self.meta_state()
        xs = self.meta_inputs(u, grad=True)
        x_tensors = _tensors(xs)
        dx_bytes = _unique_bytes([t for t in x_tensors if t.requires_grad])
        dys = [torch.empty(shape, dtype=dt, device=self.device) for shape, dt in y_meta]
        with _counter() as counter, _OpRecorder(counter, list(state.values()) + x_tensors + dys) as bwd, \
                attention.run_on(self.target):
            ys = _tensors(functional_call(self.module, state, tuple(xs)))
            pairs = [(y, dy) for y, dy in zip(ys, dys) if y.requires_grad]
            start = len(bwd.names)
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [dy for _, dy in pairs])
            dy_bytes = _unique_bytes([dy for _, dy in pairs])
            del ys, pairs
        return _Counts(
            fwd.names, np.array(fwd.flops), np.array(fwd.work), np.array(fwd.bytes), np.array(fwd.lives),
            bwd.names, np.array(bwd.flops), np.array(bwd.work), np.array(bwd.bytes), np.array(bwd.lives), start,
            float(x_bytes), float(y_bytes), float(dx_bytes), float(dy_bytes),
        )


def _counter() -> FlopCounterMode:
    """torch's FLOP counter, with formulas for the attention kernels it has none for."""
    return FlopCounterMode(display=False, custom_mapping=attention.FLOP_FORMULAS)


def _unique_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# --------------------------------------------------------------------------- identical layers
_TOKENS = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|\'[^\'\n]*\'|"[^"\n]*"|#[^\n]*|(?<!\w)[A-Za-z_]\w*')


def _canonical_source(source: str) -> str:
    """The generated code with comments dropped and the names and strings that carry digits renamed
    in order of first appearance: layers that differ only in their index and value names compare
    equal, while numeric literals (shapes, constants) and the data flow still tell layers apart."""
    names: dict[str, str] = {}

    def rename(match: re.Match) -> str:
        text = match.group()
        if text.startswith("#"):
            return ""
        if any(c.isdigit() for c in text):
            return names.setdefault(text, f"_{len(names)}")
        return text

    return _TOKENS.sub(rename, source)


def _signature(graph: LayerGraph, index: int, module: torch.nn.Module, dtype: torch.dtype | None, batch: int | None) -> tuple:
    spec = graph.layers[index]
    source = graph.sources.get(spec.code_file)
    code = _canonical_source(source) if source is not None else f"{type(module).__module__}.{type(module).__qualname__}"
    ids: dict[int, int] = {}
    state = tuple(
        (tuple(t.shape), str(t.dtype), bool(t.requires_grad), ids.setdefault(id(t), len(ids)))
        for _, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    )
    mods = tuple((type(m).__module__, type(m).__qualname__, m.extra_repr(), m.training) for m in list(module.modules())[1:])  # the root is the generated class: its code is above
    inputs = []
    for name in spec.inputs:
        v = graph.values[name]
        shape = list(v.shape)
        if v.batch_dim is not None:
            shape[v.batch_dim] = -1
        inputs.append((v.kind, tuple(shape), v.dtype, v.requires_grad, v.text if v.kind != "tensor" else ""))
    return (code, state, mods, tuple(inputs), str(dtype))


def _layer_modules(graph: LayerGraph) -> list[torch.nn.Module]:
    if graph.modules is not None:
        return graph.modules
    if all(spec.code_file in graph.sources for spec in graph.layers):
        from harmony.decomposer.layer_graph import _import_layer_class

        with torch.device("meta"):
            return [_import_layer_class(spec, graph.sources[spec.code_file], None)(source=None) for spec in graph.layers]
    raise AnalyticProfileError(
        "this layer graph has neither layer modules nor layer code; load it with LayerGraph.load(dir) or use harmony.decompose()"
    )


def _example_batch(graph: LayerGraph) -> int | None:
    for name in graph.inputs:
        v = graph.values.get(name)
        if v is not None and v.kind == "tensor" and v.shape:
            return int(v.shape[0])
    return None


def _training_dtype(graph: LayerGraph) -> torch.dtype:
    by_dtype: dict[str, int] = {}
    for s in graph.state.values():
        if s.kind == "parameter":
            by_dtype[s.dtype] = by_dtype.get(s.dtype, 0) + s.nbytes
    floating = {k: n for k, n in by_dtype.items() if dtype_from_str(k).is_floating_point}
    return dtype_from_str(max(floating, key=floating.get)) if floating else torch.float32


def layer_cost_models(
    graph: LayerGraph,
    spec: DeviceSpec | str,
    dtype: torch.dtype | str | None = None,
    modules: Sequence[torch.nn.Module] | None = None,
    compute: torch.dtype | None = None,
    device_type: str = "cuda",
) -> list[LayerCostModel]:
    """One cost model per layer (identical layers share the same object); ``compute``: the dtype
    autocast computes in (mixed precision), whose peak rate the FLOPs run at. ``device_type``: what
    the spec describes, which decides how attention is counted (``attention.py``): ``"cuda"``, as
    every preset, or ``"cpu"``."""
    if device_type not in attention.DEVICE_TYPES:
        raise AnalyticProfileError(f"device type {device_type!r} cannot be counted; choose one of "
                                   f"{', '.join(attention.DEVICE_TYPES)}")
    spec = load_spec(spec)
    override = _as_dtype(dtype)
    compute_dtype = compute or override or _training_dtype(graph)
    peak = spec.flops_for(compute_dtype) * spec.efficiency
    modules = _layer_modules(graph) if modules is None else modules
    batch = _example_batch(graph)
    cache: dict[tuple, LayerCostModel] = {}
    models = []
    for i, module in enumerate(modules):
        key = _signature(graph, i, module, override, batch)
        model = cache.get(key)
        if model is None:
            runner = _LayerRunner(graph, i, module, override, batch, autocast=_autocast_dtype(compute), target=device_type)
            w, dw, b = _state_bytes(graph, i, module, override)
            model = LayerCostModel(runner.count, w + b, peak, spec.memory_bandwidth, graph.layers[i].name, grad_bytes=dw)
            cache[key] = model
        models.append(model)
    return models


def _autocast_dtype(compute: torch.dtype | None) -> torch.dtype | None:
    """The dtype the layers are counted under autocast in: mixed precision's bf16 or fp16."""
    return compute if compute in (torch.bfloat16, torch.float16) else None


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if dtype.startswith("torch.") else f"torch.{dtype}"
    return dtype_from_str(name)


def _state_bytes(graph: LayerGraph, index: int, module: torch.nn.Module, dtype: torch.dtype | None) -> tuple[int, int, int]:
    """(W, dW, B) of one layer on the device: every tensor it uses, tied ones once."""
    def size(t: torch.Tensor) -> int:
        dt = dtype if (dtype is not None and t.dtype.is_floating_point) else t.dtype
        return t.numel() * (torch.finfo(dt).bits // 8 if dt.is_floating_point else t.element_size())

    seen: set[int] = set()
    w = dw = b = 0
    for _, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        w += size(p)
        dw += size(p) if p.requires_grad else 0
    for _, t in module.named_buffers(remove_duplicate=False):
        if id(t) not in seen:
            seen.add(id(t))
            b += size(t)
    return w, dw, b


# --------------------------------------------------------------------------- the profile
def _max_fitting(need: Callable[[int], int], capacity: int, cap: int) -> int:
    """Largest u in [1, cap] with need(u) <= capacity (need is non-decreasing); 0 if none."""
    if need(1) > capacity:
        return 0
    if need(cap) <= capacity:
        return cap
    lo, hi = 1, cap  # need(lo) fits, need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(mid) <= capacity:
            lo = mid
        else:
            hi = mid
    return lo


def default_microbatch_sizes(u_max: int) -> list[int]:
    """1 to 8, then 2^k and 3 * 2^(k-1) below u_max, and u_max itself.

    Rooflines are piecewise linear in u (small microbatches are bound by reading the weights, large
    ones by arithmetic), so one line through all sizes misses the small ones; samples are cheap
    here, and the profile answers a sampled u with the sample itself.
    """
    sizes = set(range(1, min(u_max, 8) + 1))
    u = 8
    while u < u_max:
        sizes.update(v for v in (u, u + u // 2) if v < u_max)
        u *= 2
    return sorted(sizes | {u_max})


def optimizer_name(build_optimizer: Callable) -> str:
    """The ``OPTIMIZERS`` entry describing the optimizer ``build_optimizer`` makes: by its class (SGD
    by its momentum), else by the state one step leaves per parameter (none, one or more tensors of
    its shape: ``sgd``, ``momentum``, ``adam``). What an analytic profile sizes the optimizer state
    (K) and times the step with; a profile assuming Adam for an SGD with momentum moves twice the
    state it has."""
    param = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([param])
    name = type(opt).__name__.lower()
    if name == "sgd":
        return "sgd-momentum" if opt.defaults.get("momentum") else "sgd"
    if name in OPTIMIZERS:
        return name
    param.grad = torch.zeros_like(param)
    opt.step()
    states = sum(1 for v in opt.state[param].values() if isinstance(v, torch.Tensor) and v.shape == param.shape)
    return {0: "sgd", 1: "momentum"}.get(states, "adam")


def _optimizer_entry(optimizer: str) -> tuple[str, int, int]:
    """(name, state numbers, FLOPs per parameter) of ``optimizer``, checked before any counting so
    that a typo fails at once rather than after the layers have been run on meta tensors."""
    opt = optimizer.lower()
    if opt not in OPTIMIZERS:
        raise AnalyticProfileError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    n_states, flops_per_param = OPTIMIZERS[opt]
    return opt, n_states, flops_per_param


def _microbatch_limits(
    graph: LayerGraph, models: list[LayerCostModel], spec: DeviceSpec, max_microbatch: int,
) -> tuple[int, int]:
    """(u_fmax, u_bmax): the largest microbatches whose worst layer fits ``spec.capacity`` in each pass.

    Only distinct cost models are searched (identical layers share one), and a model that cannot
    run even u = 1 fails here, naming the layer that needs the most, since nothing can schedule it.
    """
    distinct = list({id(m): m for m in models}.values())

    def worst(which: int) -> Callable[[int], int]:
        return lambda u: max(m.peaks(u)[which] for m in distinct)

    limits = {}
    for which, label in ((0, "forward"), (1, "backward")):
        u_max = _max_fitting(worst(which), spec.capacity, max_microbatch)
        if u_max == 0:
            i = max(range(len(models)), key=lambda j: models[j].peaks(1)[which])
            need = models[i].peaks(1)[which]
            raise AnalyticProfileError(
                f"layer {i} ({graph.layers[i].name}) needs {gib(need)} for its {label} pass at microbatch "
                f"size 1, more than the {gib(spec.capacity)} of {spec.name}; cut the model into smaller layers "
                "(decompose with a finer granularity) or use a device with more memory"
            )
        limits[label] = u_max
    return limits["forward"], limits["backward"]


def _sampled_sizes(u_max: int, microbatch_sizes: list[int] | None) -> list[int]:
    """The sizes sampled up to ``u_max``: the caller's that fit, or the default ladder when none
    does (a profile needs at least one sample per pass)."""
    if microbatch_sizes:
        chosen = sorted({int(u) for u in microbatch_sizes if 1 <= int(u) <= u_max})
        if chosen:
            return chosen
    return default_microbatch_sizes(u_max)


def _parameter_owners(graph: LayerGraph) -> dict[str, int]:
    """Canonical parameter name -> the first layer using it: a tied parameter is updated (and its
    optimizer state kept) once, by that layer."""
    owner: dict[str, int] = {}
    for i, layer in enumerate(graph.layers):
        for name in layer.state:
            s = graph.state.get(name)
            if s is not None and s.kind == "parameter":
                owner.setdefault(graph.canonical(name), i)
    return owner


def _memoized_costs() -> Callable[[LayerCostModel, int], Cost]:
    """``cost(model, u)`` remembering each answer: identical layers share a model, so each (model,
    u) is evaluated once however many layers (and the notes) ask for it."""
    cache: dict[tuple[int, int], Cost] = {}

    def cost(model: LayerCostModel, u: int) -> Cost:
        key = (id(model), u)
        if key not in cache:
            cache[key] = model.at(u)
        return cache[key]

    return cost


def _sample(c: Cost) -> LayerSample:
    """A cost model's answer at one u as the profile's sample (the fields both share)."""
    return LayerSample(
        u=c.u, fwd_time=c.fwd_time, bwd_time=c.bwd_time, recompute_time=c.recompute_time,
        fwd_peak=c.fwd_peak, bwd_peak=c.bwd_peak, x_bytes=c.x_bytes, y_bytes=c.y_bytes, dx_bytes=c.dx_bytes,
        act_bytes=c.act_bytes,
    )


def _update_cost(
    graph: LayerGraph, index: int, module: torch.nn.Module, dtype: torch.dtype | None, owner: dict[str, int],
    n_states: int, flops_per_param: int, spec: DeviceSpec,
) -> tuple[int, float, float, float]:
    """(K bytes, update time on the device, update time on the host, clipping time on the host) of
    one layer.

    K counts every trainable parameter the layer holds, as its W and dW do and as a measured profile
    does (a tied weight's in each layer holding it; the task graph counts it once per pack,
    ``taskgraph.Sizes``). The times count only the parameters this layer owns (a tied one is
    updated by its first user): the update reads W, dW and K and writes W and K, a roofline over
    those bytes and the optimizer's FLOPs. Clipping reads each gradient for its norm, then reads and
    writes it to scale it.
    """
    held = _owned_parameters(graph, index, module, {})
    k = sum(p.numel() for p in held) * n_states * OPTIMIZER_STATE_BYTES
    owned = _owned_parameters(graph, index, module, owner)
    n_params = sum(p.numel() for p in owned)
    w_own = sum(p.numel() * _elem(p, dtype) for p in owned)
    k_own = n_params * n_states * OPTIMIZER_STATE_BYTES
    traffic = (w_own + w_own + k_own) + (w_own + k_own)  # read W, dW, K; write W, K
    upd_flops = n_params * flops_per_param
    device = max(traffic / spec.memory_bandwidth, upd_flops / (spec.flops_for(torch.float32) * spec.efficiency))
    host = max(traffic / spec.host_memory_bandwidth, upd_flops / spec.host_flops)
    return k, device, host, 3 * w_own / spec.host_memory_bandwidth


def _profile_notes(
    spec: DeviceSpec, compute_dtype: torch.dtype, opt: str, n_states: int, flops_per_param: int,
    models: list[LayerCostModel], cost: Callable[[LayerCostModel, int], Cost], elapsed: float,
) -> dict[str, str]:
    """The profile's human-readable notes: how it was made, from what spec, and how many layers
    could use the linear fast path, so a reader of profile.msgpack can judge the estimate."""
    distinct = list({id(m): m for m in models}.values())
    linear = sum(m.linear for m in distinct)
    fwd_flops = sum(cost(m, 1).fwd_flops for m in models)
    bwd_flops = sum(cost(m, 1).bwd_flops for m in models)
    return {
        "method": "FLOPs, bytes and live bytes counted per aten op on meta tensors (FlopCounterMode); "
                  "time = sum over ops of max(flops / (peak * efficiency), bytes / memory bandwidth)",
        "spec": f"{spec.name}: {spec.flops_for(compute_dtype) / 1e12:.2f} TFLOP/s at {str(compute_dtype).removeprefix('torch.')} "
                f"x efficiency {spec.efficiency}, {spec.memory_bandwidth / 1e9:.0f} GB/s, {gib(spec.capacity)}",
        "dtype": str(compute_dtype).removeprefix("torch."),
        "optimizer": f"{opt}: {n_states} fp32 state number(s) and {flops_per_param} FLOPs per parameter",
        "fwd_peak": "forward without autograd (Harmony recomputes in the backward task)",
        "distinct_layers": f"{len(distinct)} cost model(s) for {len(models)} layers; {linear} linear in u "
                           f"(counted at u={_FIT_US[0]},{_FIT_US[1]}, checked at u={_CHECK_U}), "
                           f"{len(distinct) - linear} counted at every size",
        "flops_per_sample": f"forward {fwd_flops:.4g}, backward {bwd_flops:.4g}",
        "seconds": f"{elapsed:.2f}",
    }


def analytic_profile(
    graph: LayerGraph,
    spec: DeviceSpec | str,
    microbatch_sizes: list[int] | None = None,
    optimizer: str = "adam",
    dtype: torch.dtype | str | None = None,
    max_microbatch: int = DEFAULT_MAX_MICROBATCH,
    compute: torch.dtype | None = None,
) -> Profile:
    """The profile of ``graph`` on ``spec`` (a DeviceSpec, preset name or JSON path), from FLOP counts.

    ``dtype`` is the training dtype (default: that of most parameter bytes); a dtype other than the
    graph's casts its floating-point state and inputs. ``compute`` is mixed precision's autocast
    dtype: the FLOPs run at its peak rate, and each layer is counted under autocast (``_LayerRunner``):
    the ops autocast runs low make low-precision outputs, and each weight's cast is a copy. The
    layers' inputs keep the traced dtypes (a layer boundary autocast makes low counts float32: an
    upper bound). ``optimizer`` is a key of ``OPTIMIZERS``.
    ``microbatch_sizes`` are the sizes sampled (default: 1, 2, 4, ... and each maximum); sizes above
    a maximum are left out of that direction's samples.
    """
    started = time.perf_counter()
    spec = load_spec(spec)
    opt, n_states, flops_per_param = _optimizer_entry(optimizer)
    if max_microbatch < 1:
        raise AnalyticProfileError(f"max_microbatch must be at least 1, got {max_microbatch}")
    override = _as_dtype(dtype)
    compute_dtype = compute or override or _training_dtype(graph)
    modules = _layer_modules(graph)
    models = layer_cost_models(graph, spec, override, modules, compute=compute)
    u_fmax, u_bmax = _microbatch_limits(graph, models, spec, max_microbatch)
    fwd_us, bwd_us = _sampled_sizes(u_fmax, microbatch_sizes), _sampled_sizes(u_bmax, microbatch_sizes)
    owner = _parameter_owners(graph)
    cost = _memoized_costs()

    layers = []
    for i, (layer, model, module) in enumerate(zip(graph.layers, models, modules)):
        w, dw, b = _state_bytes(graph, i, module, override)
        k, upd_device, upd_host, norm_host = _update_cost(graph, i, module, override, owner, n_states,
                                                          flops_per_param, spec)
        layers.append(LayerProfile(
            index=i, name=layer.name, w_bytes=w, dw_bytes=dw, k_bytes=k, b_bytes=b,
            upd_time_device=upd_device, upd_time_host=upd_host, norm_time_host=norm_host,
            fwd_samples=[_sample(cost(model, u)) for u in fwd_us],
            bwd_samples=[_sample(cost(model, u)) for u in bwd_us],
        ))
    elapsed = time.perf_counter() - started
    notes = _profile_notes(spec, compute_dtype, opt, n_states, flops_per_param, models, cost, elapsed)
    return Profile(
        source="analytic", device=f"analytic:{spec.name}", capacity=spec.capacity, u_fmax=u_fmax, u_bmax=u_bmax,
        layers=layers, graph_hash=_graph_hash(graph), notes=notes,
    )


def _elem(p: torch.Tensor, dtype: torch.dtype | None) -> int:
    if dtype is not None and p.dtype.is_floating_point:
        return torch.finfo(dtype).bits // 8
    return p.element_size()


def _owned_parameters(graph: LayerGraph, index: int, module: torch.nn.Module, owner: dict[str, int]) -> list[torch.Tensor]:
    """Trainable parameters this layer updates: those whose canonical name it is the first to use
    (with no ``owner``: every trainable parameter it holds, once)."""
    out, seen = [], set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if owner.get(graph.canonical(name), index) == index:
            out.append(p)
    return out


def _graph_hash(graph: LayerGraph) -> str:
    fn = getattr(graph, "graph_hash", None) or getattr(graph, "hash", None)
    if callable(fn):
        try:
            return str(fn())
        except Exception:  # noqa: BLE001 - a missing hash must not stop profiling
            return ""
    return ""
