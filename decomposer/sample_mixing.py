"""Which layers mix samples across the batch, found by running them rather than reading their code.

Harmony may run a layer's forward on microbatches of one size (U_F) and its recompute and backward
on microbatches of another (U_B), cutting and joining activations by samples in between. That is
exact only when the layer is a function applied to each sample on its own: then a sample's output
is the same in whatever microbatch it runs. A layer whose code combines samples (``x -
x.mean(0)``, ``x / x.norm(dim=0)``, ``softmax(x, dim=0)``, ``cumsum(x, 0)``, a hand-written
batch-statistics normalisation) gives each sample an output that depends on the other samples of
its microbatch, so the recompute would not reproduce the forward, and training would differ from
eager training with the same microbatches without any error. Such code need not use a module we
know, so it cannot be found by names; it is found by what it does:

each layer runs on a small batch (built from the layer graph's specs and fed through the layers
before it, or from real example inputs), then again with only sample 0 of its batched inputs
changed. If an output of any other sample changes (or an output that is the same for the whole
batch, ``batch_dim`` None), the layer mixes samples. Inputs the graph records as not batched (a
mask broadcast over the batch, a constant) are never changed. Integer inputs (token ids, masks) are
changed by permuting the sample's own values, so they stay valid. Both runs start from the same
random seed and the same buffers, so dropout and other per-sample randomness is not mistaken for
mixing, and running statistics are left as they were. No backward is needed: the backward of a
function applied per sample is applied per sample too.

What it cannot see: a layer that mixes only for some inputs (a maximum over the batch that sample 0
does not win); state a layer updates from the whole batch (running statistics of an InstanceNorm
with ``track_running_stats``), which is not an output; and layers that fail on synthesised inputs
(``compiler.batch_coupled`` has only the graph, not the model's example batch), which are logged and
not reported.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import time
from typing import Any, Iterator, NamedTuple, Sequence

import torch

from harmony.decomposer.layer_graph import LayerGraph, LayerSpec, ValueSpec, dtype_from_str

log = logging.getLogger(__name__)

SAMPLES = 2  # the fewest that show mixing: sample 0 is changed, sample 1 is watched
SEED = 0  # both runs of a layer draw the same random numbers


class MixingLayer(NamedTuple):
    """A layer that mixes samples, and the first of its outputs that showed it."""

    index: int
    name: str
    output: str


class LayerChecks(NamedTuple):
    """What running the layers showed: those that mix samples, and those that draw random
    numbers (index, name), found by the generator's state moving, whatever the code calls
    (torchvision's stochastic depth draws through ``torch.empty(...).bernoulli_``)."""

    mixing: list[MixingLayer]
    random: list[tuple[int, str]]


def sample_mixing_layers(graph: LayerGraph, inputs: Sequence[Any] | None = None) -> list[MixingLayer]:
    """The layers of ``graph`` whose outputs for one sample change with another sample's inputs
    (``check_layers``)."""
    return check_layers(graph, inputs).mixing


def check_layers(graph: LayerGraph, inputs: Sequence[Any] | None = None) -> LayerChecks:
    """Run every layer as the module docs say: which mix samples, and which draw random numbers.

    ``inputs`` are real example inputs of the model (as ``graph.inputs``); without them the
    model's inputs are synthesised from their specs (floats in [0.5, 1.5), integers 0 or 1, random
    booleans). Finds nothing and logs why when the check cannot run: no layer modules, layers on
    the meta device, or a graph that runs at one sample only.
    """
    why = _cannot_check(graph)
    if why:
        log.info("sample-mixing check skipped: %s", why)
        return LayerChecks([], [])
    modules = graph.modules or []
    samples = _sample_count(graph)
    device = _device_of(modules)
    start = time.perf_counter()
    found = LayerChecks([], [])
    with torch.no_grad(), _isolated(modules, graph.training, device):
        generator = torch.Generator(device=device).manual_seed(SEED)
        values = _model_inputs(graph, inputs, samples, device, generator)
        for spec, module in zip(graph.layers, modules):
            if values is None:
                values = _synthesised(graph, spec.inputs, samples, device, generator)
            values, output, random = _check_layer(graph, spec, module, values, device, generator)
            if output is not None:
                found.mixing.append(MixingLayer(spec.index, spec.name, output))
            if random:
                found.random.append((spec.index, spec.name))
    log.info("sample-mixing check: %d layer(s) run at %d samples in %.3f s; %d mix samples, %d draw random numbers",
             len(modules), samples, time.perf_counter() - start, len(found.mixing), len(found.random))
    return found


def describe(layers: Sequence[MixingLayer]) -> str:
    """The reason ``compiler.batch_coupled`` gives for ``layers``, or "" for none."""
    if not layers:
        return ""
    named = ", ".join(f"{m.index} ({m.name})" for m in layers[:3])
    more = f" and {len(layers) - 3} more" if len(layers) > 3 else ""
    subject = f"layer {named}{more} mixes" if len(layers) == 1 else f"layers {named}{more} mix"
    return f"{subject} samples across the batch (an output of one sample changes with another sample's input)"


# --------------------------------------------------------------------------- set-up
def _cannot_check(graph: LayerGraph) -> str:
    """Why the layers cannot be run here, or ""."""
    if graph.modules is None:
        return "the layer graph has no layer modules"
    if any(t.is_meta for m in graph.modules for t in _tensors(m)):
        return "the layers are on the meta device (no data to run them on)"
    if _sample_count(graph) < 2:
        return "the layers run at a batch of one sample only"
    return ""


def _tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _device_of(modules: Sequence[torch.nn.Module]) -> torch.device:
    return next((t.device for m in modules for t in _tensors(m)), torch.device("cpu"))


def _sample_count(graph: LayerGraph) -> int:
    """The batch the layers run at: ``SAMPLES`` where they run at any size; otherwise the example's,
    since a graph traced at one batch size, or with values coupled to it, runs only there."""
    if graph.batch_sizes:
        return graph.batch_sizes[0]
    if any(v.coupled for v in graph.values.values()):
        return _example_batch(graph)
    return SAMPLES


def _example_batch(graph: LayerGraph) -> int:
    for name in graph.inputs:
        spec = graph.values.get(name)
        if spec is not None and spec.kind == "tensor" and spec.batch_dim is not None:
            return spec.shape[spec.batch_dim]
    return 1


@contextlib.contextmanager
def _isolated(modules: Sequence[torch.nn.Module], training: bool, device: torch.device) -> Iterator[None]:
    """The layers in the mode the runtime runs them in (``graph.training``), with the random state
    of the process restored afterwards and every submodule's mode put back."""
    modes = [(sub, sub.training) for m in modules for sub in m.modules()]
    cuda = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            for module in modules:
                module.train(training)
            yield
    finally:
        for sub, mode in modes:
            sub.training = mode


# --------------------------------------------------------------------------- inputs
def _model_inputs(graph: LayerGraph, inputs: Sequence[Any] | None, samples: int, device: torch.device,
                  generator: torch.Generator) -> list | None:
    """The first layer's inputs: ``inputs`` cut to ``samples`` samples, or synthesised."""
    if inputs is None:
        return _synthesised(graph, graph.inputs, samples, device, generator)
    out = []
    for name, value in zip(graph.inputs, inputs):
        spec = graph.values.get(name)
        if isinstance(value, torch.Tensor):
            if spec is not None and spec.batch_dim is not None and value.shape[spec.batch_dim] >= samples:
                value = value.narrow(spec.batch_dim, 0, samples)
            value = value.to(device)
        out.append(value)
    return out


def _synthesised(graph: LayerGraph, names: Sequence[str], samples: int, device: torch.device,
                 generator: torch.Generator) -> list | None:
    """Values for ``names`` made from their specs, or None if one cannot be made (a Python object
    whose repr is not a literal)."""
    out = []
    for name in names:
        spec = graph.values.get(name)
        value = _from_spec(spec, samples, device, generator) if spec is not None else None
        if value is None:
            log.debug("sample-mixing check: cannot make value %s from its spec", name)
            return None
        out.append(value)
    return out


def _from_spec(spec: ValueSpec, samples: int, device: torch.device, generator: torch.Generator) -> Any:
    if spec.kind != "tensor":
        try:
            return ast.literal_eval(spec.text)
        except (ValueError, SyntaxError):
            return None
    shape = list(spec.shape)
    if spec.batch_dim is not None and not spec.coupled:
        shape[spec.batch_dim] = samples
    dtype = dtype_from_str(spec.dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator, device=device) < 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.rand(shape, generator=generator, device=device, dtype=dtype) + 0.5
    return torch.randint(0, 2, shape, generator=generator, device=device, dtype=dtype)


def _perturbed(values: list, dims: Sequence[int | None], generator: torch.Generator) -> list | None:
    """``values`` with sample 0 of every batched tensor changed, the rest untouched; None when no
    input could be changed (nothing batched, or integers all alike)."""
    out = list(values)
    changed = False
    for k, (value, dim) in enumerate(zip(values, dims)):
        if dim is None or not isinstance(value, torch.Tensor) or value.shape[dim] < 2:
            continue
        new = value.clone()
        new.select(dim, 0).copy_(_other_sample(value, dim, generator))
        if not torch.equal(new, value):
            changed = True
            out[k] = new
    return out if changed else None


def _other_sample(value: torch.Tensor, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Another valid content for sample 0: floats moved by noise of the tensor's own scale (non-finite
    entries, such as a mask's -inf, kept); integers and booleans permuted within the sample, or
    taken from sample 1 when a permutation changes nothing."""
    sample = value.select(dim, 0)
    if value.is_floating_point() or value.is_complex():
        finite = torch.isfinite(value)
        scale = float(value[finite].abs().mean()) if bool(finite.any()) else 1.0
        noise = torch.randn(sample.shape, generator=generator, device=value.device, dtype=value.dtype)
        return torch.where(torch.isfinite(sample), sample + (scale or 1.0) * noise, sample)
    flat = sample.reshape(-1)
    order = torch.randperm(flat.numel(), generator=generator, device=value.device)
    permuted = flat[order].reshape(sample.shape)
    return value.select(dim, 1) if torch.equal(permuted, sample) else permuted


# --------------------------------------------------------------------------- one layer
def _check_layer(graph: LayerGraph, spec: LayerSpec, module: torch.nn.Module, values: list,
                 device: torch.device, generator: torch.Generator) -> tuple[list | None, str | None, bool]:
    """(the layer's outputs on ``values``, for the next layer; the first output that changed for
    another sample when sample 0's inputs changed, or None; whether it drew random numbers).
    Outputs are None if the layer failed."""
    try:
        base, random = _run(module, values, device)
        changed = _perturbed(values, graph.input_batch_dims(spec.index), generator)
        if changed is None:
            return base, None, random
        other, _ = _run(module, changed, device)
    except Exception as exc:  # noqa: BLE001 - a layer we cannot run is not evidence of mixing
        log.warning("sample-mixing check: layer %d (%s) did not run on synthesised inputs (%s: %s); not checked",
                    spec.index, spec.name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None, None, False
    return base, _first_changed(graph, spec.outputs, base, other), random


def _run(module: torch.nn.Module, values: list, device: torch.device) -> tuple[list, bool]:
    """The layer's outputs, from the same random seed and buffers every time (buffers such as
    batch-norm statistics are put back afterwards), and whether it drew random numbers (a
    generator's state moved); inputs are copied, so in-place code leaves the caller's values alone."""
    buffers = [(b, b.clone()) for b in module.buffers()]
    generators = [torch.random.default_generator]
    if device.type == "cuda":
        generators.append(torch.cuda.default_generators[device.index or 0])
    seeded = []
    for g in generators:
        g.manual_seed(SEED)
        seeded.append(g.get_state())
    try:
        outputs = list(module(*[v.clone() if isinstance(v, torch.Tensor) else v for v in values]))
        return outputs, any(not torch.equal(g.get_state(), state) for g, state in zip(generators, seeded))
    finally:
        for buffer, saved in buffers:
            buffer.copy_(saved)


def _first_changed(graph: LayerGraph, names: Sequence[str], base: list, other: list) -> str | None:
    """The first output (by name) whose samples other than sample 0 differ between the runs; an
    output with no batch dim is the whole batch's, so any change of it counts."""
    for name, a, b in zip(names, base, other):
        spec = graph.values.get(name)
        dim = spec.batch_dim if spec is not None and spec.kind == "tensor" else None
        if not _same(a, b, dim):
            return name
    return None


def _same(a: Any, b: Any, dim: int | None) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 - values that cannot be compared are taken as equal
            return True
    if a.shape != b.shape:
        return False
    if dim is not None and dim < a.dim():
        a, b = a.narrow(dim, 1, a.shape[dim] - 1), b.narrow(dim, 1, b.shape[dim] - 1)
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    tol = torch.finfo(a.dtype).eps ** 0.5
    finite = a[torch.isfinite(a)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return torch.allclose(a, b, rtol=tol, atol=tol * max(scale, 1e-12), equal_nan=True)
