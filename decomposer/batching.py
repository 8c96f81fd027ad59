"""How every value of a traced model depends on the batch size, and sizes re-derived per layer.

The runtime runs each layer on microbatches of sizes other than the example's, and when the
forward's microbatches differ from the backward's (U_F != U_B) it cuts and joins the values that
cross a layer boundary. Two things make that go wrong unless the decomposer knows how each value
depends on the batch:

* a tensor's samples need not lie along dim 0 (``nn.MultiheadAttention(batch_first=False)`` passes
  (T, B, W) between blocks), and a tensor of dim 0 equal to the example batch need not hold
  samples at all: cutting it along the wrong dim gives another microbatch's shape;
* a size computed from the batch (torch.export's ``sym_size``, ``B * heads`` for
  ``nn.MultiheadAttention``'s reshape) would travel between layers as a plain number, and a
  joined or cut microbatch would keep the number of the microbatch that produced it.

``probe`` runs the traced graph at three batch sizes and classifies every value (``BatchFact``);
``rederive_sizes`` rewrites each layer that reads a size made by another layer to compute it from
the batch dim of a tensor it receives, so no batch-dependent number crosses a boundary. A value
that depends on the batch in a way neither cut nor re-derived is ``coupled``: the scheduler must
then give the backward the forward's microbatches (U_F = U_B).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

CONSTANT = "constant"  # the same at every batch size: relayed as is, never cut
BATCHED = "batched"  # a tensor whose dim ``dim`` has exactly one entry per sample
AFFINE = "affine"  # an int equal to ``coef * batch + offset``
COUPLED = "coupled"  # depends on the batch otherwise: cannot be cut, joined or re-derived


@dataclass(frozen=True)
class BatchFact:
    """How one value depends on the batch size (see the module docstring)."""

    kind: str
    dim: int | None = None
    coef: int = 0
    offset: int = 0


def batch_size_of(inputs: tuple) -> int:
    """The example batch: dim 0 of the first input tensor with a dim (the model file's contract)."""
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 1


def probe_sizes(batch: int) -> tuple[int, int, int]:
    """The example batch and two more: three points tell an affine size from any other, and none
    of the extra sizes is 0 or 1, which torch.export would specialise."""
    return batch, batch + 1, batch + 3


def resized_inputs(inputs: tuple, batch: int, size: int) -> tuple:
    """``inputs`` with every batched tensor (dim 0 equal to ``batch``) grown or shrunk to ``size``
    samples; real tensors repeat their samples, so token ids and masks stay valid."""
    out = []
    for x in inputs:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != batch:
            out.append(x)
        elif x.is_meta:
            out.append(torch.empty((size, *x.shape[1:]), dtype=x.dtype, device="meta"))
        else:
            reps = -(-size // max(batch, 1))
            out.append(x.repeat(reps, *([1] * (x.dim() - 1)))[:size].clone())
    return tuple(out)


def probe(
    gm: fx.GraphModule,
    inputs: tuple,
    values: dict[fx.Node, Any],
    propagate: Callable[[tuple], dict[fx.Node, Any]],
) -> tuple[dict[fx.Node, BatchFact], str]:
    """Every node's ``BatchFact``, from ``values`` (at the example batch) and two more runs.

    Returns ``({}, why)`` when the graph does not run at another batch size (a trace that
    specialised the batch, e.g. torch.export at batch 1): its layers then only run at the
    example batch.
    """
    sizes = probe_sizes(batch_size_of(inputs))
    runs = [values]
    for size in sizes[1:]:
        try:
            runs.append(propagate(resized_inputs(inputs, sizes[0], size)))
        except Exception as exc:  # noqa: BLE001 - any failure means "only the example batch"
            why = f"the traced model does not run at batch size {size}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            log.warning("%s; its layers run at batch size %d only", why, sizes[0])
            return {}, why
    facts = {}
    for node in gm.graph.nodes:
        if all(node in run for run in runs):
            facts[node] = classify(sizes, [run[node] for run in runs])
    return facts, ""


def classify(sizes: tuple[int, ...], samples: list[Any]) -> BatchFact:
    """How a value seen at each of ``sizes`` (the same node's values, in order) follows the batch."""
    if all(isinstance(s, torch.Tensor) for s in samples):
        return _classify_tensor(sizes, [tuple(s.shape) for s in samples])
    if all(type(s) is int for s in samples):
        return _classify_int(sizes, samples)
    if all(isinstance(s, (tuple, list)) for s in samples) and len({len(s) for s in samples}) == 1:
        parts = [classify(sizes, list(items)) for items in zip(*samples)]
        return BatchFact(CONSTANT) if all(p.kind == CONSTANT for p in parts) else BatchFact(COUPLED)
    try:
        same = all(bool(s == samples[0]) and type(s) is type(samples[0]) for s in samples)
    except Exception:  # noqa: BLE001 - values that cannot be compared are treated as varying
        same = False
    return BatchFact(CONSTANT) if same else BatchFact(COUPLED)


def _classify_tensor(sizes: tuple[int, ...], shapes: list[tuple[int, ...]]) -> BatchFact:
    if len({len(s) for s in shapes}) != 1:
        return BatchFact(COUPLED)
    varying = [d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1]
    if not varying:
        return BatchFact(CONSTANT)
    if len(varying) == 1 and all(s[varying[0]] == b for s, b in zip(shapes, sizes)):
        return BatchFact(BATCHED, dim=varying[0])
    return BatchFact(COUPLED)


def _classify_int(sizes: tuple[int, ...], values: list[int]) -> BatchFact:
    if len(set(values)) == 1:
        return BatchFact(CONSTANT)
    (b0, v0), (b1, v1) = (sizes[0], values[0]), (sizes[1], values[1])
    coef, rest = divmod(v1 - v0, b1 - b0)
    offset = v0 - coef * b0
    if rest == 0 and all(v == coef * b + offset for b, v in zip(sizes, values)):
        return BatchFact(AFFINE, coef=coef, offset=offset)
    return BatchFact(COUPLED)


def rederive_sizes(
    gm: fx.GraphModule, segments: list, boundaries: list[list[fx.Node]], facts: dict[fx.Node, BatchFact]
) -> int:
    """Make every layer compute the batch-dependent sizes it reads from another layer itself.

    For each such read, the layer gets ``sym_size(x, d) * coef + offset`` from a tensor ``x`` that
    enters it with its samples along ``d``, inserted at the layer's start; the original number then
    no longer crosses the boundary (``live_sets`` must be recomputed). Returns how many reads were
    rewritten; a size with no batched tensor to come from stays relayed (and coupled).
    """
    layer_of = {node: i for i, seg in enumerate(segments) for node in seg.nodes}
    rewritten = 0
    for j, seg in enumerate(segments):
        made: dict[fx.Node, fx.Node] = {}
        for node in list(seg.nodes):
            for arg in node.all_input_nodes:
                fact = facts.get(arg)
                if fact is None or fact.kind != AFFINE or layer_of.get(arg, -1) == j:
                    continue
                if arg not in made:
                    source = _batched_source(boundaries[j], facts)
                    if source is None:
                        continue
                    made[arg] = _emit_size(gm.graph, seg, source, facts[source].dim, fact)
                node.replace_input_with(arg, made[arg])
                rewritten += 1
    return rewritten


def _batched_source(live: list[fx.Node], facts: dict[fx.Node, BatchFact]) -> fx.Node | None:
    """A tensor entering the layer with one entry per sample along a known dim."""
    for node in live:
        fact = facts.get(node)
        if fact is not None and fact.kind == BATCHED:
            return node
    return None


def _emit_size(graph: fx.Graph, seg, source: fx.Node, dim: int, fact: BatchFact) -> fx.Node:
    """Insert ``sym_size(source, dim) * coef + offset`` at the start of ``seg``; return its node."""
    new: list[fx.Node] = []
    with graph.inserting_before(seg.nodes[0]):
        value = graph.call_function(torch.ops.aten.sym_size.int, (source, dim))
        new.append(value)
        if fact.coef != 1:
            value = graph.call_function(operator.mul, (value, fact.coef))
            new.append(value)
        if fact.offset:
            value = graph.call_function(operator.add, (value, fact.offset))
            new.append(value)
    seg.nodes[:0] = new
    return value


def cut(values: list, dims: list[int | None], start: int, stop: int) -> list:
    """Samples ``start:stop`` of the values at a layer boundary: each batched tensor narrowed along
    its batch dim (``dims``, from ``LayerGraph.input_batch_dims``), every other value kept whole."""
    return [v.narrow(d, start, stop - start) if d is not None and isinstance(v, torch.Tensor) else v
            for v, d in zip(values, _padded(dims, len(values)))]


def join(parts: list[list], dims: list[int | None]) -> list:
    """Consecutive microbatches of the values at a layer boundary as one: batched tensors
    concatenated along their batch dim, every other value taken from the first part (it is the
    same in every part)."""
    if len(parts) == 1:
        return parts[0]
    out = []
    for i, (first, d) in enumerate(zip(parts[0], _padded(dims, len(parts[0])))):
        out.append(torch.cat([p[i] for p in parts], dim=d) if d is not None and isinstance(first, torch.Tensor) else first)
    return out


def _padded(dims: list[int | None], n: int) -> list[int | None]:
    return list(dims[:n]) + [None] * (n - len(dims))
