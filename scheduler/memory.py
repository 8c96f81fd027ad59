"""What one task holds on its device, and when: the byte accounting of a task (§4.4's memory manager).

The executor runs a task as *units* (the estimator's): one per microbatch and, for a backward that
steps its pack on the device, one more for that update; a UPD task is one unit. A task holds:

- ``state``: the pack's weights and buffers (W, B) and, for a BWD, its gradient buffers (dW), from
  its first unit's start to its last unit's end (loaded before the first microbatch, let go after
  the update);
- ``work[j]``: what unit j allocates above the state while it computes, freed when it ends. For a
  microbatch: the pack's peak at its size less the state, which counts the microbatch's inputs (X,
  Xs, dY), the activations, the backward's temporaries and a loss task's loss; the stashed input a
  forward queues for the host, while the layer after it runs; the copies of the buffers a recompute
  runs on. A forward that keeps its activations for the backward (``Task.keep``) leaves them (``A``)
  as a LOCAL output, held until the backward's microbatch, whose work counts them in place of the
  recompute's. For the update: the optimizer state (K), the gradients summed on the host that come in
  for the step, and the optimizer's temporaries.
- Inputs a unit's work counts (``covers``) are held by their copy from its start until that unit
  starts; every other input is held until its unit ends. Outputs are held from the end of the unit
  that made them until they have left (the estimator adds both, as transfers between tasks).

Nothing here simulates: each function answers for one task, so that the estimator's simulation, the
runtime's reservation before a prefetch (``reserve``) and a per-device program with static
reservations count the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from harmony.profiling.profiles import Profile
from .tasks import HOST, Channel, Kind, MemoryPlan, Task, Transfer

__all__ = ["TaskMemory", "cached_task_memory", "covers", "fused_update", "input_unit", "is_kept", "kept_bytes",
           "kept_on", "least_peaks", "memory_plan", "profile_cache", "reserve", "resident_bytes",
           "running_gradient_input", "stash_layers", "stashes_every_layer", "task_key", "task_memory",
           "unit_holds"]

# what the work of a unit counts among the task's inputs, by unit kind
_FIRST_COVERS = frozenset(("W", "B"))
_MICROBATCH_COVERS = {Kind.FWD: frozenset(("X",)), Kind.BWD: frozenset(("X", "Xs", "dY", "A", "As"))}
_UPDATE_COVERS = frozenset(("K",))


@dataclass(frozen=True)
class TaskMemory:
    """Bytes a task holds on its device: ``state`` for its whole span, ``work[j]`` while unit j
    computes (see the module docs)."""

    state: int
    work: tuple[int, ...]

    @property
    def peak(self) -> int:
        """The most the task itself holds at once (its transfers in flight aside)."""
        return self.state + max(self.work, default=0)


def fused_update(task: Task) -> bool:
    """Whether the task has a unit for an update on the device after its microbatches: a backward
    that steps its own pack (``Task.jit_update``: it reads the optimizer state), as the runtime and
    the lowering have it; not one whose pack a later UPD task steps (dp's replicated update)."""
    return task.jit_update() and task.device != HOST


def stash_layers(task: Task, consumers: dict[int, Task]) -> tuple[int, ...]:
    """The layers of a FWD task whose inputs it stashes for a backward starting there."""
    if task.kind != Kind.FWD:
        return ()
    return tuple(sorted({consumers[o.task].first for o in task.outputs
                         if o.tensor == "Xs" and o.task in consumers}))


def _update_inputs(task: Task) -> int:
    """Gradient bytes an update brings in from host slots (a tied weight's other share) on top
    of its own."""
    return sum(t.nbytes for t in task.inputs if t.tensor == "dW" and t.channel == Channel.SHM)


def stashes_every_layer(task: Task) -> bool:
    """Whether a BWD task reads a stash of every layer's input (the no-recompute baselines) and so
    recomputes layer by layer (``lower.stash_layers``)."""
    if task.kind != Kind.BWD or task.loss or task.last == task.first:
        return False
    stashes = [t for t in task.inputs if t.tensor in ("X", "Xs") and t.microbatch in (0, None) and t.channel == Channel.SWAP]
    return len(stashes) == task.last - task.first + 1


def _running_gradient(task: Task) -> bool:
    """Whether a BWD task starts from a gradient brought in (the per-GPU-swap baselines' running
    gradient), adding to it from its first microbatch on."""
    return task.kind == Kind.BWD and any(t.tensor == "dW" and t.channel == Channel.SWAP for t in task.inputs)


def task_key(task: Task, stashes: tuple[int, ...] = ()) -> tuple:
    """What ``task_memory`` depends on, for caching across the many graphs of a search."""
    return (task.kind, task.loss, fused_update(task), task.device == HOST, task.first, task.last,
            tuple(task.microbatches), stashes, _update_inputs(task) if fused_update(task) else 0,
            _running_gradient(task), stashes_every_layer(task), is_kept(task), task.keep)


def is_kept(task: Task) -> bool:
    """Whether the task's pack state stays on its device across iterations (``keep.py``): it reads
    its weights from KEEP."""
    return any(t.tensor == "W" and t.channel == Channel.KEEP for t in task.inputs)


def kept_on(graph) -> dict[int, set[int]]:
    """Device -> the layers whose state it keeps across iterations (``keep.py``); empty if none."""
    on: dict[int, set[int]] = {}
    for task in graph.tasks:
        if is_kept(task):
            on.setdefault(task.device, set()).update(range(task.first, task.last + 1))
    return on


def kept_bytes(graph, profile: Profile) -> dict[int, int]:
    """Per device, the bytes of the state kept there across iterations (weights, buffers, optimizer
    state; a tied weight once): a reservation held from the first iteration on."""
    held: dict[int, int] = {}
    for device, layers in kept_on(graph).items():
        total = sum(profile.layers[l].w_bytes + profile.layers[l].b_bytes + profile.layers[l].k_bytes for l in layers)
        for tie in profile.ties:
            inside = sum(1 for l in tie.layers if l in layers)
            if inside > 1:
                total -= (inside - 1) * (tie.w_bytes + tie.k_bytes)
        held[device] = total
    return held


def least_peaks(graph, profile: Profile, cache: dict | None = None) -> dict[int, int]:
    """Per device, a floor under any simulation's peak: its kept state beside the largest
    ``TaskMemory.peak`` of its tasks, which every schedule holds at once whatever else it moves. A
    search rejects a candidate above capacity here without lowering and simulating it: most of its
    candidates that overflow do so inside one task."""
    cache = profile_cache(profile) if cache is None else cache
    consumers = {t.id: t for t in graph.tasks}
    largest: dict[int, int] = {}
    for task in graph.tasks:
        if task.device == HOST or task.kind == Kind.NORM:
            continue
        peak = cached_task_memory(task, profile, cache, stash_layers(task, consumers)).peak
        if peak > largest.get(task.device, -1):
            largest[task.device] = peak
    kept = kept_bytes(graph, profile)
    return {d: kept.get(d, 0) + largest.get(d, 0) for d in set(largest) | set(kept)}


def profile_cache(profile: Profile) -> dict:
    """A cache of answers about ``profile`` that a search asks for every graph it builds (task
    memory here, task costs in the estimator), dropped when the profile's layers or memory change."""
    version = (len(profile.layers), profile.__dict__.get("_memory_version", 0))
    cache = profile.__dict__.get("_estimator_cache")
    if cache is None or cache[0] != version:
        cache = (version, {})
        profile.__dict__["_estimator_cache"] = cache
    return cache[1]


def cached_task_memory(task: Task, profile: Profile, cache: dict | None = None,
                       stashes: tuple[int, ...] = ()) -> TaskMemory:
    """``task_memory``, cached across the graphs of a search (``profile_cache``)."""
    cache = profile_cache(profile) if cache is None else cache
    key = ("memory", *task_key(task, stashes))
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = task_memory(task, profile, stashes)
    return hit


def task_memory(task: Task, profile: Profile, stashes: tuple[int, ...] = ()) -> TaskMemory:
    """What ``task`` holds on its device (``stashes``: see ``stash_layers``); nothing for a task
    on the host."""
    if task.device == HOST:
        return TaskMemory(0, (0,))
    first, last = task.first, task.last
    layers = profile.layers[first:last + 1]
    weights = sum(layer.w_bytes + layer.b_bytes for layer in layers)
    kept = is_kept(task)  # its state is the device's kept reservation (``kept_bytes``), not the task's
    if task.kind == Kind.UPD:
        return TaskMemory(0, (profile.pack_update_memory(first, last),))
    if task.kind == Kind.FWD:
        by_size = {u: profile.pack_fwd_memory(first, last, u, stashes, task.keep) for u in set(task.microbatches)}
        work = tuple(by_size[u] - weights for u in task.microbatches)  # microbatches share few sizes
        return TaskMemory(0 if kept else weights, work or (0,))
    gradients = sum(layer.dw_bytes for layer in layers)
    # a recompute runs on copies of the buffers, so that running statistics are updated once
    scratch = 0 if task.loss or task.keep else sum(layer.b_bytes for layer in layers)
    # the first microbatch makes the gradient buffers, unless a running gradient came in to start from
    running = _running_gradient(task)
    pack = profile.pack_bwd_memory_layerwise if stashes_every_layer(task) else profile.pack_bwd_memory
    accumulates = [bool(j) or running for j in range(len(task.microbatches))]
    by_size = {key: pack(first, last, key[0], accumulate=key[1]) for key in set(zip(task.microbatches, accumulates))}
    work = tuple(by_size[key] - weights - gradients + scratch for key in zip(task.microbatches, accumulates))

    if fused_update(task):
        optimizer = 0 if kept else sum(layer.k_bytes for layer in layers)
        work += (optimizer + _update_inputs(task) + profile.pack_update_memory(first, last),)
    return TaskMemory((0 if kept else weights) + gradients, work or (0,))


def input_unit(task: Task, tensor: str, microbatch: int | None, units: int) -> int:
    """The unit of ``task`` (of ``units``) that reads an input: its microbatch's, the update's for
    the optimizer state of a fused update (the executor loads it for the step, not before), else
    the first."""
    if microbatch is not None and 0 <= microbatch < len(task.microbatches) and microbatch < units:
        return microbatch
    if tensor == "K" and fused_update(task):
        return units - 1
    return 0


def running_gradient_input(task: Task, t: Transfer, by_id: Mapping[int, Task]) -> bool:
    """Whether input ``t`` of ``task`` is the gradient so far of the task's own pack (a
    per-GPU-swap backward starts from it, and it becomes the task's gradient buffers, which its
    state counts), rather than a tied weight's share from another pack, which the step adds."""
    if task.kind != Kind.BWD or t.tensor != "dW" or t.channel != Channel.SWAP or not t.nbytes:
        return False
    source = by_id.get(t.task)
    return source is not None and (source.first, source.last) == (task.first, task.last)


def covers(task: Task, unit: int, units: int, tensor: str, running_gradient: bool = False) -> bool:
    """Whether unit ``unit`` (of ``units``) of ``task`` counts input ``tensor`` in its work; a
    ``running_gradient`` (``running_gradient_input``) is counted by the task's state."""
    if task.kind in (Kind.UPD, Kind.NORM):
        return False
    if running_gradient:
        return True
    if fused_update(task) and unit == units - 1:
        return tensor in _UPDATE_COVERS
    return tensor in _MICROBATCH_COVERS[task.kind] or (unit == 0 and tensor in _FIRST_COVERS)


def resident_bytes(task: Task, profile: Profile) -> int:
    """The pack state (W, B) a task leaves on its device for a later task that reads it LOCAL."""
    return sum(layer.w_bytes + layer.b_bytes for layer in profile.layers[task.first:task.last + 1])


def unit_holds(task: Task, profile: Profile, stashes: tuple[int, ...] = (),
               by_id: Mapping[int, Task] | None = None) -> tuple[int, ...]:
    """What a running task holds while each of its units computes: its state, the unit's work and
    the inputs no unit's work counts (an update's weights, gradients and optimizer state). The
    runtime's ledger (``runtime/ledger.py``) reserves it for the unit."""
    held = task_memory(task, profile, stashes)
    units = len(held.work)
    by_id = by_id or {}
    uncovered = sum(t.nbytes for t in task.inputs
                    if not covers(task, input_unit(task, t.tensor, t.microbatch, units), units, t.tensor,
                                  running_gradient_input(task, t, by_id))
                    and t.channel not in (Channel.SHM, Channel.LOCAL, Channel.KEEP))
    return tuple(held.state + work + uncovered for work in held.work)


def reserve(task: Task, profile: Profile, stashes: tuple[int, ...] = (), by_id: Mapping[int, Task] | None = None) -> int:
    """The most a running task holds at once (its largest unit's ``unit_holds``). The runtime lets a
    copy ahead of need in beside the running task only if what the task has not allocated yet of
    this stays free."""
    return max(unit_holds(task, profile, stashes, by_id))


def memory_plan(graph, device_peaks: dict[int, int], task_peaks: dict[int, int], prefetched: dict[int, int],
                profile: Profile) -> MemoryPlan:
    """What a plan promises: per device the estimate's peak, per task the device's bytes while it
    runs (estimated) and its ``reserve``, the most it holds at once; and the tasks whose state
    the estimate loads while the task before them computes, with the unit of that task it loads
    during."""
    profile = profile.for_graph(graph)
    consumers = {t.id: t for t in graph.tasks}
    units = {t.id: unit_holds(t, profile, stash_layers(t, consumers), consumers) for t in graph.tasks
             if t.device != HOST}
    return MemoryPlan(devices=dict(device_peaks), tasks=dict(task_peaks),
                      reserves={task: max(held) for task, held in units.items()}, prefetch=dict(prefetched),
                      units=units)
