"""Configuration search (Algorithm 1): the fastest (U_F, P_F, U_B, P_B) that fits, by estimation.

For every backward microbatch size U_B the backward packs P_B come from balanced-time packing;
for every forward size U_F the forward packs P_F are packed around P_B's last pack (shared,
jit-compute); each configuration becomes a task graph that the event-driven estimator times. Two
lower bounds prune it: a configuration cannot beat its devices' total compute divided among them,
nor a pass that is already slower than the best whole iteration.

The paper's Algorithm 2 keeps the fewest packs that fit (the largest average pack); we also try a
few more packs per pass, since smaller packs sometimes balance a pipeline better (Fig. 8).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from harmony.scheduler import packing
from harmony.scheduler.estimator import Estimate, estimate
from harmony.scheduler.machine import Machine
from harmony.scheduler.profiles import Profile
from harmony.scheduler.taskgraph import generate
from harmony.scheduler.tasks import Configuration, TaskGraph

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


class NoFeasibleConfiguration(ValueError):
    """No configuration fits the device capacity."""


def _sizes(limit: int) -> list[int]:
    return list(range(1, max(1, limit) + 1))


def search(
    profile: Profile,
    machine: Machine,
    mode: str,
    devices: int,
    minibatch: int,
    capacity: int | None = None,
    extra_packs: int = 2,
    sizes: Callable[[int], list[int]] = _sizes,
    keep_candidates: bool = False,
    **options,
) -> SearchResult:
    """Search configurations for ``mode`` and return the best one with its graph and estimate."""
    capacity = capacity if capacity is not None else profile.capacity
    start = time.perf_counter()
    per_device = minibatch if mode == "pp" else -(-minibatch // devices)
    u_bs = [u for u in sizes(min(profile.u_bmax, per_device))]
    u_fs = [u for u in sizes(min(profile.u_fmax, per_device))]
    best: tuple[float, Configuration, TaskGraph, Estimate] | None = None
    explored = pruned = 0
    candidates: list[tuple[float, Configuration]] = []
    for u_b in u_bs:
        for p_b in _packings(profile, u_b, capacity, "bwd", None, extra_packs):
            bwd_compute = _compute(profile, p_b, u_b, "bwd", minibatch)
            if best is not None and bwd_compute / devices >= best[0]:
                pruned += 1
                continue
            for u_f in u_fs:
                for p_f in _packings(profile, u_f, capacity, "fwd", p_b[-1], extra_packs):
                    bound = (bwd_compute + _compute(profile, p_f[:-1], u_f, "fwd", minibatch)) / devices
                    if best is not None and bound >= best[0]:
                        pruned += 1
                        continue
                    config = Configuration(u_f=u_f, packs_f=p_f, u_b=u_b, packs_b=p_b)
                    for variant in _variants(mode, options):
                        graph = generate(mode, profile, config, devices, minibatch, **variant)
                        est = estimate(graph, profile, machine, capacity=capacity, record_events=False)
                        explored += 1
                        if not est.fits or est.deadlock:
                            continue
                        if keep_candidates:
                            candidates.append((est.iteration_time, config))
                        if best is None or est.iteration_time < best[0]:
                            best = (est.iteration_time, config, graph, est)
    if best is None:
        raise NoFeasibleConfiguration(
            f"no {mode} configuration fits {capacity:,} bytes per device (explored {explored}); "
            "give the devices more memory or cut the model into smaller layers"
        )
    _, config, graph, _ = best
    final = estimate(graph, profile, machine, capacity=capacity, record_events=True)
    return SearchResult(config, graph, final, explored, pruned, time.perf_counter() - start, candidates)


def _variants(mode: str, options: dict) -> list[dict]:
    """Generator options to try per configuration: where the update runs, unless the caller fixed
    it. A device-side update keeps the optimizer state on the device for a moment, which a tight
    device may not afford; the host-side one moves gradients out instead."""
    if mode in ("pp", "dp") and "update" not in options:
        return [{**options, "update": "device"}, {**options, "update": "host"}]
    return [options]


def _packings(profile: Profile, u: int, capacity: int, pass_: str, last_pack, extra: int) -> list[list[tuple[int, int]]]:
    """Balanced packings with the fewest packs that fit and up to ``extra`` more packs."""
    counts = packing.pack_counts(profile, u, capacity, pass_, last_pack=last_pack)
    result = []
    for n in list(counts)[: extra + 1]:
        p = packing.balanced_time_packing(profile, u, capacity, pass_, num_packs=n, last_pack=last_pack)
        if p is not None and p not in result:
            result.append(p)
    return result


def _compute(profile: Profile, packs, u: int, pass_: str, minibatch: int) -> float:
    """Compute seconds of a pass over the minibatch (a lower bound on its device time)."""
    full, rest = divmod(minibatch, u)
    total = 0.0
    for first, last in packs:
        if pass_ == "fwd":
            per = lambda s: profile.pack_time(first, last, s, "fwd_time")  # noqa: E731
        else:
            per = lambda s: profile.pack_time(first, last, s, "recompute_time") + profile.pack_time(first, last, s, "bwd_time")  # noqa: E731
        total += full * per(u) + (per(rest) if rest else 0.0)
    return total
