"""Configuration search (Algorithm 1): the fastest (U_F, P_F, U_B, P_B) that fits, by estimation.

For every backward microbatch size U_B the backward packs P_B come from balanced-time packing;
for every forward size U_F the forward packs P_F are packed around P_B's last pack (shared,
jit-compute); each configuration becomes a task graph that the event-driven estimator times. A
lower bound prunes it: a configuration cannot beat its busiest device's compute, nor its host-link
traffic at full bandwidth; candidates are simulated in the order of that bound.

The paper's Algorithm 2 keeps the fewest packs that fit (the largest average pack); we also try a
few more packs per pass, since smaller packs sometimes balance a pipeline better (Fig. 8).

Each backward pack recomputes its activations from a stash, keeps them on the device from its
forward (``Configuration.keep``), or has them sent to host memory and back (``Configuration.swap``),
where ``taskgraph.keepable_packs`` allows the latter two: a configuration whose packs may keep is
tried recomputing, then keeping as many packs as fit and swapping or recomputing the rest
(``_activation_chains``); and at U_F = U_B the backward's own packing is tried as the forward's,
which is what lets packs keep.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from harmony.scheduler import packing
from harmony.scheduler.bounds import graph_key, lower_bound, quick_bound
from harmony.scheduler.estimator import Estimate, estimate
from harmony.scheduler.keep import KEEP_MODES, keep_state
from harmony.scheduler.memory import kept_on, least_peaks
from harmony.scheduler.machine import Machine
from harmony.profiling.profiles import Profile
from harmony.scheduler.taskgraph import DATA_PARALLEL, keepable_packs, split_samples
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import HOST, Configuration, Kind, TaskGraph, microbatch_sizes

log = logging.getLogger(__name__)


@dataclass
class SearchResult:
    config: Configuration
    graph: TaskGraph
    estimate: Estimate
    explored: int
    pruned: int
    seconds: float
    candidates: list[tuple[float, Configuration]] = field(default_factory=list)  # (time, config) of every fitting one


@dataclass
class Shortfall:
    """What the configuration that came closest to fitting needs: the bytes per device that fit it
    and, at its peak, what the device holds besides the peak task's own pack."""

    config: Configuration
    needed: int  # bytes per device at which this configuration fits (estimated)
    peak: int  # its peak at the capacity searched
    device: int
    task: str  # the task at the peak
    own: int  # that task's own pack: weights, gradients, a microbatch's activations and inputs
    outgoing: dict[str, int] = field(default_factory=dict)  # earlier tasks' outputs still leaving as it starts

    def describe(self, mode: str) -> str:
        held = self.peak - self.own
        text = (f"the closest, {self.config}, peaks at {self.peak:,} bytes on dev{self.device} in {self.task}, whose own "
                f"pack needs {self.own:,} (weights, gradients, inputs and one microbatch's activations)")
        if held > 0:
            text += (f"; the other {held:,} are tensors of the work around it held at the same time: inputs prefetched "
                     "for its later microbatches and the next task, outputs on their way out")
        if self.outgoing:
            text += f" (when it starts, {_bytes_by_tensor(self.outgoing)} of earlier tasks' outputs are still leaving)"
        if mode == "dp" and 2 * self.outgoing.get("dW", 0) >= held > 0:
            text += (". In dp every device runs every pack back to back, so a pack starts while the previous pack's "
                     "gradient is still on its way to the reduction in host memory; pp runs the next pack on another device")
        return text + f". This configuration fits {self.needed:,} bytes per device"


def _bytes_by_tensor(nbytes: dict[str, int]) -> str:
    return ", ".join(f"{name} {n:,} B" for name, n in sorted(nbytes.items()))


PIPELINES = ("gpipe-swap", "1f1b-swap")  # the baselines whose packs are pipeline stages, one per device


class NoFeasibleConfiguration(ValueError):
    """No configuration fits the device capacity; ``shortfall`` says what the closest one needs."""

    def __init__(self, message: str, shortfall: Shortfall | None = None,
                 overflowed: list[tuple[Configuration, dict]] | None = None):
        super().__init__(message)
        self.shortfall = shortfall
        self.overflowed = overflowed or []  # (configuration, generator options) of those that overflowed


def ladder(limit: int) -> list[int]:
    """Microbatch sizes worth trying up to ``limit``: 1, 2, 3, 4, 6, 8, 12, 16, 24, … and ``limit``.

    Neighbouring sizes differ little in time per sample, and each size costs a packing and a
    simulation, so the search walks this ladder (ratios of at most 1.5) instead of every integer.
    """
    sizes = {1}
    k = 1
    while k <= limit:
        sizes.update(x for x in (k, 3 * k // 2) if 1 <= x <= limit)
        k *= 2
    sizes.add(max(1, limit))
    return sorted(sizes)


def microbatch_ladders(profile: Profile, mode: str, devices: int, minibatch: int,
                       sizes: Callable[[int], list[int]]) -> tuple[list[int], list[int]]:
    """The backward and forward microbatch sizes a search of ``mode`` tries: ``sizes`` up to what
    the profile's sweep fitted and a device's samples, less those that would cut a microbatch
    below the fewest samples the model trains on. Refuses a minibatch that no size cuts so."""
    groups = split_samples(mode, minibatch, devices)
    u_bs = trainable_sizes(sizes(min(profile.u_bmax, max(groups))), groups, profile.u_min)
    u_fs = trainable_sizes(sizes(min(profile.u_fmax, max(groups))), groups, profile.u_min)
    if not u_bs or not u_fs:
        raise NoFeasibleConfiguration(
            f"the model trains on no fewer than {profile.u_min} samples at once (the profile's smallest microbatch), "
            f"and no {mode} microbatch size cuts {' and '.join(map(str, groups))} samples into microbatches that "
            "large; use a larger minibatch" + (" or fewer devices" if mode in DATA_PARALLEL else ""))
    return u_bs, u_fs


def trainable_sizes(sizes: list[int], groups: list[int], u_min: int) -> list[int]:
    """The microbatch sizes that cut every group of samples into microbatches of at least ``u_min``
    (the fewest samples the model trains on: ``Profile.u_min``), the last, smaller one included."""
    if u_min <= 1:
        return sizes
    return [u for u in sizes if all(min(microbatch_sizes(g, u)) >= u_min for g in groups)]


def every_size(limit: int) -> list[int]:
    """Every size 1..limit (Algorithm 1 as written; for small problems and brute-force checks)."""
    return list(range(1, max(1, limit) + 1))


@dataclass(order=True)
class _Candidate:
    bound: float
    order: int
    config: Configuration = field(compare=False)
    graph: TaskGraph = field(compare=False)


_frozen_for_good = False  # ``freeze_heap`` ran in this process


def freeze_heap() -> None:
    """``gc.freeze()`` for the rest of the process (a comparison worker's), which the searches then
    leave as it is without asking ``gc.get_freeze_count()``: that walks every frozen object, a
    large part of a search in a worker forked from a compile of a large model."""
    global _frozen_for_good
    gc.freeze()
    _frozen_for_good = True


@contextlib.contextmanager
def _collecting_own() -> Iterator[None]:
    """The cyclic collector's passes during a search walk only what the search made: the objects of
    the process before it (torch's, the model's: hundreds of thousands) are frozen meanwhile: a
    full pass over them can take most of a search's time in a process that has just built it.
    Where something else froze the heap already (``freeze_heap``, or a caller's own), it stays so."""
    if not gc.isenabled() or _frozen_for_good or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def search(
    profile: Profile,
    machine: Machine,
    mode: str,
    devices: int,
    minibatch: int,
    capacity: int | None = None,
    extra_packs: int = 1,
    sizes: Callable[[int], list[int]] = ladder,
    keep_candidates: bool = False,
    same_u: bool = False,
    coarse: bool = False,
    keep: bool = True,
    timeline: bool = True,
    explain: bool = True,
    **options,
) -> SearchResult:
    """Search configurations for ``mode`` and return the best one with its graph and estimate.

    Every candidate's task graph is built first and given a lower bound (its busiest device's
    compute, and its host-link traffic at full bandwidth); candidates are then simulated in order
    of their bound, stopping once the next bound is no better than the best time found.

    ``same_u`` keeps U_F = U_B: for models whose layers draw random numbers or normalize over the
    batch (dropout, BatchNorm), where a recompute must see exactly the forward's microbatches.

    ``coarse`` searches the per-GPU-swap baselines over fewer pack counts (``pack_doublings``):
    a compile's comparison table, where their whole ladder would take a hundred times pp's search.

    ``keep``: a configuration whose packs the devices have room to keep across iterations is also
    tried so (``keep.py``: their state is not moved, and their update runs on the device).

    ``timeline=False`` returns the winner's estimate without the events of its timeline (a
    comparison row needs its figures only): its candidates' simulations record nothing.

    ``explain=False`` refuses without a ``Shortfall``: a probe that asks only whether anything fits
    (``refusal.least_capacity``) skips playing the overflowed candidates out again.

    Other ``options`` go to the task-graph generator: ``update`` fixes where the update runs, and
    the ablation switches of ``pp`` / ``dp`` (``grouping``, ``jit_update``, ``p2p``; see
    ``taskgraph``) turn one of Harmony's optimizations off, for the paper's Fig. 14.
    """
    capacity = capacity if capacity is not None else profile.capacity
    if mode.startswith(PIPELINES) and len(profile.layers) < devices:
        raise NoFeasibleConfiguration(
            f"{mode} runs a pipeline stage of at least one layer on each device, and the model has "
            f"{len(profile.layers)} layers for {devices} devices; use at most {len(profile.layers)} devices, or "
            "decompose the model into more layers")
    start = time.perf_counter()
    ladders = microbatch_ladders(profile, mode, devices, minibatch, sizes)  # refuses a minibatch no size cuts
    # the fewest packs that fit the profile's memory can still overflow once prefetching and
    # transfers in flight are simulated: widen to more, smaller packs until something fits
    tried: set[int] = set()
    overflowed: list[tuple[Configuration, dict]] = []
    for extra in (extra_packs, extra_packs + 3, extra_packs + 12, len(profile.layers)):
        if extra in tried:
            continue
        tried.add(extra)
        try:
            with _collecting_own():
                result = _search(profile, machine, mode, devices, minibatch, capacity, extra, ladders, keep_candidates,
                                 same_u, coarse, keep, timeline, options)
        except NoFeasibleConfiguration as exc:
            overflowed += exc.overflowed
            if extra >= len(profile.layers):
                break
            continue
        result.seconds = time.perf_counter() - start
        return result
    message = f"no {mode} configuration fits {capacity:,} bytes per device"
    closest = _closest(overflowed, profile, machine, mode, devices, minibatch, capacity) if explain else None
    shortfall = shortfall_of(closest[1], profile, machine, capacity) if closest is not None else None
    if shortfall is not None:
        message += f"; {shortfall.describe(mode)}"
    raise NoFeasibleConfiguration(message + "; give the devices more memory or cut the model into smaller layers", shortfall)


def pack_doublings(mode: str, coarse: bool = False) -> tuple[int, int]:
    """How many doublings of the fewest packs that fit ``mode``'s search tries, for the backward
    packs and the forward ones.

    The per-GPU-swap baselines do best with fine packs (swapping per layer is their nature): they
    get the whole ladder of pack counts, so that a comparison with them is fair to them. ``coarse``
    (a compile's comparison table) keeps their backward packs to the fewest that fit and one more, as
    pp's, and their forward pack counts to three doublings (and one layer per pack): several times
    faster than the whole ladder, and the estimates found are the same or a few percent slower
    (``python -m bench.search_time --comparison`` compares the two).
    """
    if mode in ("pp", "dp"):
        return 0, 0
    return (0, 3) if coarse else (64, 64)


def _search(profile, machine, mode, devices, minibatch, capacity, extra_packs, ladders, keep_candidates, same_u,
            coarse, keep, timeline, options) -> SearchResult:
    start = time.perf_counter()
    bwd_doublings, fwd_doublings = pack_doublings(mode, coarse)
    u_bs, u_fs = ladders
    pending: list[tuple[float, int, Configuration]] = []
    seen: set[tuple] = set()  # configurations whose task graph is already pending
    forward: dict[tuple, list] = {}  # (U_F, the loss pack) -> forward packings: many backward packings share one
    for u_b in u_bs:
        for p_b in _packings(profile, u_b, capacity, "bwd", None, extra_packs, bwd_doublings):
            for u_f in ([u_b] if u_b <= max(u_fs) else []) if same_u else u_fs:
                if (u_f, p_b[-1]) not in forward:
                    forward[(u_f, p_b[-1])] = _packings(profile, u_f, capacity, "fwd", p_b[-1], extra_packs,
                                                        fwd_doublings)
                # the backward's own packs in the forward too, where its activations may then be kept
                # (``keepable_packs``): a backward pack fits as a forward one
                symmetric = [list(p_b)] if u_f == u_b and mode in ("pp", "dp") and len(p_b) > 1 else []
                for p_f in forward[(u_f, p_b[-1])] + [p for p in symmetric if p not in forward[(u_f, p_b[-1])]]:
                    config = Configuration(u_f=u_f, packs_f=p_f, u_b=u_b, packs_b=p_b)
                    key = graph_key(mode, config)
                    if key in seen:
                        continue
                    seen.add(key)
                    pending.append((quick_bound(mode, profile, config, devices, minibatch, machine, keep), len(pending),
                                    config))
    # equal bounds, U_F = U_B first: where the forward is one pack (the loss task's, run at U_B) U_F
    # changes nothing, and the first of equal estimates is kept; the plan then says U_F = U_B
    pending.sort(key=lambda c: (c[0], c[2].u_f != c[2].u_b, c[1]))
    best: tuple[float, Configuration, TaskGraph, Estimate] | None = None
    overflowed: list[tuple[Configuration, dict]] = []  # candidates whose simulation stopped at their first overflow
    explored = 0
    candidates: list[tuple[float, Configuration]] = []

    def consider(config: Configuration, variant: dict, graph: TaskGraph) -> Estimate | None:
        """Estimate one candidate unless its bound cannot beat the best; keep it if it is the best."""
        nonlocal best, explored
        if best is not None and lower_bound(graph, profile, machine) >= best[0] and not keep_candidates:
            return None
        floor = least_peaks(graph, profile.for_graph(graph))
        if any(peak > capacity for peak in floor.values()):  # overflows inside one task, whatever the schedule
            overflowed.append((config, variant))
            return Estimate(iteration_time=math.inf, fits=False, peak_memory=floor, bytes_by_channel={},
                            bytes_by_device={}, busy={}, capacity=capacity, cut="over capacity")
        beat = None if keep_candidates else best[0] if best is not None else math.inf
        est = estimate(graph, profile, machine, capacity=capacity, record_events=False, beat=beat,
                       timeline_later=timeline)
        explored += 1
        if not est.fits and not est.deadlock:
            overflowed.append((config, variant))
        if not est.fits or est.deadlock or est.cut:
            return est
        if keep_candidates:
            candidates.append((est.iteration_time, config))
        if best is None or est.iteration_time < best[0]:
            best = (est.iteration_time, config, graph, est)
        return est

    def consider_kept_state(config: Configuration, variant: dict, graph: TaskGraph, est: Estimate | None) -> None:
        """The same graph with the state its devices have room for kept there: it holds more than
        the graph itself at all times, so where that overflowed it is not tried."""
        if keep and variant.get("update") == "device" and (est is None or est.fits or est.deadlock):
            kept = keep_state(graph, profile, capacity)
            if kept is not None:
                consider(config, {**variant, "keep": True}, kept)

    for quick, _, config in pending:
        if best is not None and quick >= best[0] and not keep_candidates:
            break
        for variant, graph in _graphs(mode, profile, config, devices, minibatch, options):
            est = consider(config, variant, graph)
            consider_kept_state(config, variant, graph, est)
            # the packs' activations kept from forward to backward or swapped, as many as fit
            for chain in _activation_chains(mode, profile, config, devices, variant):
                for held, swapped in chain:
                    choice = replace(config, keep=held, swap=swapped)
                    graph = generate(mode, profile, choice, devices, minibatch, **variant)
                    est = consider(choice, variant, graph)
                    consider_kept_state(choice, variant, graph, est)
                    if est is None or (est.fits and not est.deadlock):
                        break
    if best is None:
        raise NoFeasibleConfiguration(
            f"no {mode} configuration fits {capacity:,} bytes per device (explored {explored}); "
            "give the devices more memory or cut the model into smaller layers", overflowed=overflowed)
    if keep and mode in KEEP_MODES and not keep_candidates and options.get("update") != "host":
        best, tried = _partly_kept(best, mode, profile, machine, devices, minibatch, capacity, options, timeline)
        explored += tried
    if keep and mode == "pp" and not keep_candidates and "update" not in options:
        best, tried = _boundary_stepped(best, profile, machine, devices, minibatch, capacity, options, timeline,
                                        u_bs)
        explored += tried
    _, config, graph, final = best  # the winner ran to its end: neither cut nor over capacity
    if timeline:
        final = final.with_timeline()
    pruned = len(pending) * len(_variants(mode, options)) - explored
    return SearchResult(config, graph, final, explored, pruned, time.perf_counter() - start, candidates)


def _partly_kept(best: tuple, mode: str, profile: Profile, machine: Machine, devices: int, minibatch: int,
                 capacity: int, options: dict, timeline: bool) -> tuple[tuple, int]:
    """The search's best, or its configuration stepped on the devices keeping the packs there is
    room for where that is faster (``keep_state(partial=True)``): a device short of room for all of
    its packs' state may still keep some, saving their copies. Tried once, for the winner only, so
    that it costs the search one estimate; returns (best, candidates estimated)."""
    time_, config, graph, _ = best
    if kept_on(graph):
        return best, 0
    try:
        device = generate(mode, profile, config, devices, minibatch, **{**options, "update": "device"})
    except ValueError:
        return best, 0
    partial = keep_state(device, profile, capacity, partial=True)
    if partial is None:
        return best, 0
    est = estimate(partial, profile, machine, capacity=capacity, record_events=False, beat=time_,
                   timeline_later=timeline)
    if est.fits and not est.deadlock and not est.cut and est.iteration_time < time_:
        return (est.iteration_time, config, partial, est), 1
    return best, 1


def boundary_steps(profile: Profile, config: Configuration) -> tuple[tuple[int, int], ...]:
    """The backward packs a host-updated pp plan of ``config`` may step on its device to keep the
    iteration's boundary off the host: the first pack, whose backward ends one iteration and whose
    forward begins the next (on the host, its gradients go out, are stepped and come back in
    between), and every pack holding a weight tied to one of its layers (a tied weight is one
    tensor, stepped and kept in one place)."""
    packs = [tuple(p) for p in config.packs_b]
    layers = set(range(packs[0][0], packs[0][1] + 1))
    changed = True
    while changed:
        changed = False
        for tie in profile.ties:
            if layers.intersection(tie.layers) and not layers.issuperset(tie.layers):
                for first, last in packs:
                    if any(first <= layer <= last for layer in tie.layers):
                        layers.update(range(first, last + 1))
                changed = True
    return tuple(p for p in packs if p[0] in layers)


def _alone(packs: list[tuple[int, int]], layers: set[int]) -> list[tuple[int, int]]:
    """``packs`` with each of ``layers`` cut out into a pack of its own."""
    out = []
    for first, last in packs:
        cuts = sorted({first} | {layer for layer in layers if first < layer <= last}
                      | {layer + 1 for layer in layers if first <= layer < last})
        out += [(a, b - 1) for a, b in zip(cuts, cuts[1:] + [last + 1])]
    return out


def _boundary_configs(profile: Profile, config: Configuration, sizes: list[int]) -> Iterator[Configuration]:
    """``config``, then the same with the boundary layers (the first layer and those tied to it)
    in packs of their own, each at its microbatch sizes and up to three smaller ones of ``sizes``:
    what a device must hold beside the boundary packs' state is their largest task, which smaller
    packs and microbatches shrink."""
    first = config.packs_b[0][0]
    layers = {first} | {layer for tie in profile.ties if first in tie.layers for layer in tie.layers}
    split = replace(config, packs_f=_alone(config.packs_f, layers), packs_b=_alone(config.packs_b, layers),
                    keep=(), swap=())
    u = max(config.u_f, config.u_b)
    smaller = [s for s in sorted(sizes, reverse=True) if s < u][:3]
    for packed in (config, split) if split.packs_b != config.packs_b else (config,):
        yield packed
        for s in smaller:
            yield replace(packed, u_f=min(packed.u_f, s), u_b=min(packed.u_b, s))


def _boundary_stepped(best: tuple, profile: Profile, machine: Machine, devices: int, minibatch: int,
                      capacity: int, options: dict, timeline: bool, sizes: list[int]) -> tuple[tuple, int]:
    """The search's best, or, where the host steps it, a configuration like it with its boundary
    packs (``boundary_steps``) stepped on their device and their state kept there, where one fits
    and is faster (``_boundary_configs``). Tried for the winner only; returns (best, candidates
    estimated)."""
    _, config, graph, _ = best
    if not any(t.kind == Kind.UPD and t.device == HOST for t in graph.tasks):
        return best, 0
    tried = 0

    def consider(candidate: Configuration) -> Estimate | None:
        """``candidate`` with its boundary packs stepped and kept on the device, estimated (None
        where it cannot be generated or kept); the best so far where it is."""
        nonlocal best, tried
        variant = {**options, "update": "host", "device_steps": boundary_steps(profile, candidate)}
        try:
            mixed = generate("pp", profile, candidate, devices, minibatch, **variant)
        except ValueError:
            return None
        kept = keep_state(mixed, profile, capacity)
        if kept is None or not kept_on(kept):
            return None
        tried += 1
        est = estimate(kept, profile, machine, capacity=capacity, record_events=False, beat=best[0],
                       timeline_later=timeline)
        if est.fits and not est.deadlock and not est.cut and est.iteration_time < best[0]:
            best = (est.iteration_time, candidate, kept, est)
        return est

    for candidate in _boundary_configs(profile, config, sizes):
        consider(candidate)
        # the host link the boundary leaves free may carry activations the recompute would redo
        for chain in _activation_chains("pp", profile, candidate, devices, {**options, "update": "host"}):
            for held, swapped in chain:
                est = consider(replace(candidate, keep=held, swap=swapped))
                if est is None or (est.fits and not est.deadlock):
                    break
    return best, tried


def _closest(overflowed: list[tuple[Configuration, dict]], profile: Profile, machine: Machine, mode: str, devices: int,
             minibatch: int, capacity: int) -> tuple[int, TaskGraph] | None:
    """(peak, task graph) of the configuration that came closest to fitting: the search stopped each
    simulation at its first overflow, so these are played out again, once nothing fits."""
    closest: tuple[int, TaskGraph] | None = None
    seen: set[str] = set()
    for config, variant in overflowed:
        key = f"{config} {sorted(variant.items())}"  # the widening attempts revisit configurations
        if key in seen:
            continue
        seen.add(key)
        graph = generate(mode, profile, config, devices, minibatch, **variant)
        peak = max(estimate(graph, profile, machine, capacity=capacity, record_events=False).peak_memory.values(),
                   default=0)
        if closest is None or peak < closest[0]:
            closest = (peak, graph)
    return closest


def shortfall_of(graph: TaskGraph, profile: Profile, machine: Machine, capacity: int) -> Shortfall:
    """What ``graph`` (a configuration that did not fit ``capacity``) needs: the bytes per device at
    which it fits, found by re-estimating at its own peak (more room lets prefetches start earlier,
    which can raise the peak again), and its peak task's own share of that peak."""
    profile = profile.for_graph(graph)
    est = estimate(graph, profile, machine, capacity=capacity, record_events=True)
    needed = max(est.peak_memory.values(), default=0)
    for _ in range(8):
        trial = estimate(graph, profile, machine, capacity=needed, record_events=False)
        if trial.fits:
            break
        needed = max(needed + 1, max(trial.peak_memory.values(), default=0))
    device = max(est.peak_memory, key=est.peak_memory.get)
    computing = [t for t in graph.tasks if t.device == device and t.kind != Kind.UPD]
    peaks = getattr(est, "task_peaks", None) or {}
    if any(t.id in peaks for t in computing):
        task = max((t for t in computing if t.id in peaks), key=lambda t: peaks[t.id])
    else:  # an estimate without per-task peaks: the task whose own pack is largest
        task = max(computing, key=lambda t: task_own_memory(profile, t))
    return Shortfall(config=graph.config, needed=needed, peak=peaks.get(task.id, est.peak_memory[device]),
                     device=device, task=str(task), own=task_own_memory(profile, task),
                     outgoing=_held_beside(est, device, task))


def task_own_memory(profile: Profile, task) -> int:
    """A FWD or BWD task's own peak: its pack's weights, gradients, activations and inputs."""
    if task.kind == Kind.FWD:
        return profile.pack_fwd_memory(task.first, task.last, task.u)
    return profile.pack_bwd_memory(task.first, task.last, task.u)


def _held_beside(est: Estimate, device: int, task) -> dict[str, int]:
    """Bytes by tensor of earlier tasks' outputs still being copied off ``device`` when ``task``
    starts computing (a timeline fact, from the estimate's events)."""
    computes = [e for e in est.events if e.device == device and e.stream == "compute"]
    start = min(e.start for e in computes if e.task == task.id)
    ended = {e.task for e in computes if e.end <= start}
    outgoing: dict[str, int] = {}
    for e in est.events:
        if e.device == device and e.stream in ("swap-out", "p2p-out") and e.task in ended and e.end > start:
            tensor, nbytes = _transfer_of(e.label)
            outgoing[tensor] = outgoing.get(tensor, 0) + nbytes
    return outgoing


def _transfer_of(label: str) -> tuple[str, int]:
    """(tensor, bytes) of a transfer's timeline label, e.g. ``dW->SWAP (399872 B)``."""
    tensor = label.split("<-")[0].split("->")[0].strip()
    nbytes = int(label.rsplit("(", 1)[1].split()[0]) if "(" in label else 0
    return tensor, nbytes


def _graphs(mode: str, profile: Profile, config: Configuration, devices: int, minibatch: int,
            options: dict) -> Iterator[tuple[dict, TaskGraph]]:
    """(generator options, task graph) of each variant of ``config``: where the update runs."""
    for variant in _variants(mode, options):
        try:
            yield variant, generate(mode, profile, config, devices, minibatch, **variant)
        except ValueError as exc:  # a configuration this mode cannot use (e.g. fewer packs than stages)
            log.debug("skipping %s for %s: %s", config, mode, exc)


Packs = tuple[tuple[int, int], ...]


def _activation_chains(mode: str, profile: Profile, config: Configuration, devices: int,
                       variant: dict) -> list[list[tuple[Packs, Packs]]]:
    """(kept, swapped) pack sets for the activations of a variant of ``config``, in two chains, each
    tried in turn until one fits: every pack that may (``keepable_packs``) kept, then one at a time
    swapped instead (first chain) or recomputed (second), the pack that saves the least recompute
    per byte it keeps first. Keeping costs no compute and no copy, so along a chain the first that
    fits is the one to take; swapping costs the host link what recomputing costs compute, so the
    estimate decides between the chains. Where nothing fits, the configuration recomputes every
    pack, as tried before these."""
    packs = keepable_packs(mode, config, devices, variant.get("grouping", True))
    if not packs:
        return []
    u = config.u_b

    def saving(pack: tuple[int, int]) -> float:
        return profile.pack_time(pack[0], pack[1], u, "recompute_time") / max(1, profile.pack_kept_bytes(*pack, u))

    order = sorted(packs, key=saving)
    swapping = [(tuple(sorted(order[i:])), tuple(sorted(order[:i]))) for i in range(len(order) + 1)]
    recomputing = [(tuple(sorted(order[i:])), ()) for i in range(1, len(order))]
    return [swapping, recomputing]


def _variants(mode: str, options: dict) -> list[dict]:
    """Generator options to try per configuration: where the update runs, unless the caller fixed
    it. A device-side update keeps the optimizer state on the device for a moment, which a tight
    device may not afford; the host-side one moves gradients out instead."""
    if mode in ("pp", "dp") and "update" not in options:
        if options.get("jit_update") is False:  # the ablation defers the device update; no host variant
            return [{**options, "update": "device"}]
        return [{**options, "update": "device"}, {**options, "update": "host"}]
    return [options]


def _packings(profile: Profile, u: int, capacity: int, pass_: str, last_pack, extra: int,
              doublings: int = 2) -> list[list[tuple[int, int]]]:
    """Balanced packings with the fewest packs that fit, up to ``extra`` more, and then doubling
    pack counts up to one layer per pack: fewer, larger packs swap less, more, smaller ones leave
    room for prefetching and balance pipelines better, and the best is rarely at either end."""
    counts = list(packing.pack_counts(profile, u, capacity, pass_, last_pack=last_pack))
    if not counts:
        return []
    wanted = set(counts[: extra + 1])
    n = counts[0] * 2
    while n < counts[-1] and len(wanted) < extra + 1 + doublings:
        wanted.add(n)
        n *= 2
    if doublings > 2:
        wanted.add(counts[-1])
    result = []
    for n in sorted(wanted):
        p = packing.balanced_time_packing(profile, u, capacity, pass_, num_packs=n, last_pack=last_pack)
        if p is not None and p not in result:
            result.append(p)
    return result
