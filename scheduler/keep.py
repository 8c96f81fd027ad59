"""Kept state: packs whose weights, buffers and optimizer state stay on their device across
iterations, where the device has room for them.

Harmony's plans move every pack's state in from host memory and out again each iteration: that is
what lets a model far larger than the devices train at all. A model (or the part of it a device
runs) that fits beside its working memory pays for those copies, and for an optimizer step on the
host, for nothing: eager training on one device moves none of it. ``keep_state`` rewrites a task
graph so that such state stays put:

- a layer is *kept* on device ``d`` when every task over it runs on ``d`` and every trainable
  weight of it is stepped there (a backward's fused update, or a UPD task on ``d``): no other
  device and not the host ever reads or changes its state. In dp with updates on the devices,
  every replica steps every layer with the same summed gradient: each keeps its own copy (and
  optimizer state), as DistributedDataParallel does, unless the layer has buffers (BatchNorm
  statistics change in one chain through every device's microbatches). A tied weight's layers
  are kept together or not at all (a layer holding only a tied weight another layer owns is
  stepped with that layer); a weight the host steps as a low-precision copy is never kept;
- a task reads state from ``KEEP`` only if all of its layers are kept (a task loads its pack's
  state whole): layers shared with a task that cannot are let go, until nothing changes;
- the kept tasks' state inputs (W, B; K of their update) and outputs (the stepped W and K, the
  buffers a forward changed) become ``KEEP`` transfers of no bytes: nothing moves. Gradients still
  travel as before (a tied weight's share handed over through host memory, deposits for a NORM
  task).

The kept bytes (``memory.kept_bytes``) are a static reservation: held on the device from the first
iteration on, counted by the estimator from time zero and by the runtime's ledger outside every
task. The host store's copy of kept state is stale between iterations; the runtime writes it
back whenever someone reads the host store (``Launcher.sync``: a checkpoint, ``state_dict``, the
end of a run) and drops the device copies when someone writes it (``Launcher.drop``).
"""

from __future__ import annotations

import dataclasses

from harmony.profiling.profiles import Profile
from .memory import cached_task_memory, is_kept, kept_bytes
from .taskgraph import Sizes
from .tasks import HOST, Channel, Kind, Task, TaskGraph, Transfer

__all__ = ["KEEP_MODES", "keep_state", "keepable_layers"]

# the modes whose packs may keep their state: Harmony's own. The per-GPU-swap baselines swap every
# pack by their nature (that is what they stand for in a comparison).
KEEP_MODES = ("pp", "dp")
_STATE = ("W", "B", "K")


def keepable_layers(graph: TaskGraph, profile: Profile) -> dict[int, frozenset[int]]:
    """Layer -> the devices it can be kept on (see the module docs): one, or in dp every replica."""
    layers = len(profile.layers)
    devices: dict[int, set[int]] = {layer: set() for layer in range(layers)}
    stepped: dict[int, set[int]] = {layer: set() for layer in range(layers)}
    for task in graph.tasks:
        if task.kind == Kind.NORM:  # reads gradients in host memory, no state
            continue
        steps = task.kind == Kind.UPD or task.jit_update()
        for layer in range(task.first, task.last + 1):
            devices[layer].add(task.device)
            if steps:
                stepped[layer].add(task.device)
    hosted = {c.layer for c in profile.low_copies if c.trainable}
    sz = Sizes(profile)
    keep: dict[int, frozenset[int]] = {}
    for layer, on in devices.items():
        if not on or HOST in on or layer in hosted:
            continue
        if sz.owned_dw(layer, layer) and stepped[layer] != on:
            # a layer owning trainable weights stepped elsewhere (the host), or not by every device
            # running it; one holding only a tied weight another layer owns goes with that layer
            continue
        if len(on) > 1 and profile.layers[layer].b_bytes:
            continue  # replicas' buffers (BatchNorm statistics) are one chain through every device
        keep[layer] = frozenset(on)
    return _closed(keep, graph, profile)


def _closed(keep: dict[int, frozenset[int]], graph: TaskGraph, profile: Profile) -> dict[int, frozenset[int]]:
    """``keep`` less what cannot be kept without a layer it lacks: a tied weight is one tensor (all
    its layers kept alike, or none), and a task loads its pack's state whole (kept only where every
    layer of it is)."""
    keep = dict(keep)
    for tie in profile.ties:
        if len({keep.get(layer) for layer in tie.layers}) != 1 or tie.layers[0] not in keep:
            for layer in tie.layers:
                keep.pop(layer, None)
    changed = True
    while changed:
        changed = False
        for task in graph.tasks:
            span = range(task.first, task.last + 1)
            if task.device != HOST and any(layer in keep for layer in span) and not all(layer in keep for layer in span):
                changed |= _let_go(keep, span, profile)
    return keep


def _let_go(keep: dict[int, frozenset[int]], span: range, profile: Profile) -> bool:
    """Drop the layers of ``span`` (and every layer tied to one of them) from ``keep``; whether any was kept."""
    dropped = False
    for layer in span:
        dropped |= keep.pop(layer, None) is not None
    for tie in profile.ties:
        if any(layer in span for layer in tie.layers):
            for layer in tie.layers:
                dropped |= keep.pop(layer, None) is not None
    return dropped


def keep_state(graph: TaskGraph, profile: Profile, capacity: int | None, partial: bool = False) -> TaskGraph | None:
    """``graph`` with every keepable pack's state kept on its device (module docs), or None where
    nothing can be kept or, given ``capacity``, where a device's kept state and its largest task
    would not fit together (the estimate says whether the whole does). ``partial``: rather than
    give up, let go of the largest kept pack of a device that does not fit, until it does. ``graph``
    is not changed."""
    if graph.mode not in KEEP_MODES:
        return None
    profile = profile.for_graph(graph)
    keep = keepable_layers(graph, profile)
    while keep:
        tasks = [_kept_task(task) if task.device in keep.get(task.first, ()) else task for task in graph.tasks]
        kept = dataclasses.replace(graph, tasks=tasks, memory=None)
        short = _short_of_room(kept, profile, capacity)
        if short is None:
            return kept
        if not partial:
            return None
        mine = [t for t in tasks if t.device == short and is_kept(t)]
        if not mine:  # a task of its own does not fit beside nothing kept: the estimate will say
            return None
        largest = max(mine, key=lambda t: _state_bytes(t, profile))
        _let_go(keep, range(largest.first, largest.last + 1), profile)
        keep = _closed(keep, graph, profile)
    return None


def _short_of_room(kept: TaskGraph, profile: Profile, capacity: int | None) -> int | None:
    """A device whose kept state and one of its tasks alone exceed ``capacity``, or None."""
    if capacity is None:
        return None
    held = kept_bytes(kept, profile)
    for task in kept.tasks:
        if task.device != HOST and held.get(task.device, 0) + cached_task_memory(task, profile).peak > capacity:
            return task.device
    return None


def _state_bytes(task: Task, profile: Profile) -> int:
    return sum(layer.w_bytes + layer.b_bytes + layer.k_bytes for layer in profile.layers[task.first:task.last + 1])


def _kept_task(task: Task) -> Task:
    """The task with its state transfers (and its update's) KEEP: nothing moves."""
    inputs = [_kept(t) if t.tensor in _STATE and t.channel in (Channel.SWAP, Channel.LOCAL) else t for t in task.inputs]
    outputs = [_kept(t) if t.tensor in _STATE and t.channel == Channel.SWAP else t for t in task.outputs]
    return dataclasses.replace(task, inputs=inputs, outputs=outputs)


def _kept(t: Transfer) -> Transfer:
    return Transfer(t.tensor, Channel.KEEP, 0)
