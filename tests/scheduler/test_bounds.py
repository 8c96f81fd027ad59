"""Lower bounds: never above an estimate (or the search would drop a plan that wins), and tight
enough to spare the search most of its simulations."""

import dataclasses
import random

import pytest

from harmony.scheduler.bounds import compute_bound, lower_bound, quick_bound
from harmony.scheduler.estimator import estimate
from harmony.scheduler.keep import keep_state
from harmony.scheduler.machine import Machine
from harmony.scheduler.packing import all_contiguous_packings
from harmony.scheduler.search import search
from harmony.scheduler.modes import MODES, generate
from harmony.scheduler.taskgraph import keepable_packs
from harmony.scheduler.tasks import Configuration

from test_search import skewed_profile


def _machines():
    analytic = Machine.from_spec("1080ti", 2)
    # the emulated CPU devices' model: runtime overheads, a compute scale and two shared cores
    emulated = dataclasses.replace(analytic, task_overhead=2e-3, microbatch_overhead=3e-4, update_overhead=1e-3,
                                   iteration_overhead=1.5e-3, cpu_cores=2.0, compute_scale=1.3,
                                   compute_interference=0.2, p2p_latency=1e-4)
    # a runtime faster than its profile (the probe measured 0.5-0.9 on this machine)
    quicker = dataclasses.replace(emulated, compute_scale=0.6, cpu_cores=None)
    return {"analytic": analytic, "emulated": emulated, "quicker": quicker}


def _graphs(mode, profile, count=24, seed=0):
    """A sample of each mode's task graphs over every kind of packing, both update sides, state kept
    or not, activations kept or recomputed."""
    rng = random.Random(seed)
    packings = [list(p) for p in all_contiguous_packings(len(profile.layers))]
    made = 0
    while made < count:
        p_b = rng.choice(packings)
        p_f = [p for p in packings if p[-1] == p_b[-1]]
        config = Configuration(rng.choice([1, 2, 3, 6]), rng.choice(p_f), rng.choice([1, 2, 3, 6]), p_b)
        for update in (("device", "host") if mode in ("pp", "dp") else (None,)):
            options = {} if update is None else {"update": update}
            try:
                graph = generate(mode, profile, config, 2, 6, **options)
            except ValueError:  # a configuration the mode cannot use
                continue
            made += 1
            yield config, graph
            kept = keep_state(graph, profile, profile.capacity) if update == "device" else None
            if kept is not None:
                yield config, kept
            # the backward packs' activations kept from their forward (the same packs at U_B)
            same = Configuration(config.u_b, p_b, config.u_b, p_b)
            held = keepable_packs(mode, same, 2)
            if held:
                yield same, generate(mode, profile, dataclasses.replace(same, keep=held), 2, 6, **options)


@pytest.mark.parametrize("machine", ["analytic", "emulated", "quicker"])
@pytest.mark.parametrize("mode", MODES)
def test_bounds_never_exceed_the_estimate(mode, machine):
    profile = skewed_profile(capacity=40_000_000)
    m = _machines()[machine]
    checked = 0
    for config, graph in _graphs(mode, profile):
        est = estimate(graph, profile, m, capacity=profile.capacity, record_events=False)
        if est.deadlock:
            continue
        assert lower_bound(graph, profile, m) <= est.iteration_time * (1 + 1e-9), str(config)
        assert quick_bound(mode, profile, config, 2, 6, m, keep=True) <= est.iteration_time * (1 + 1e-9), str(config)
        checked += 1
    assert checked >= 20


def test_lower_bound_counts_the_pipeline_fill_and_drain():
    """A pipeline's bound is more than its busiest device's compute: the first device's state
    comes in, each device waits for the microbatch before it, and the last update follows. With one
    microbatch per task nothing overlaps, and the bound is nearly the estimate."""
    profile = skewed_profile(capacity=40_000_000)
    m = _machines()["analytic"]
    graph = generate("pp", profile, Configuration(6, [(0, 1), (2, 2), (3, 4)], 6, [(0, 1), (2, 2), (3, 4)]), 2, 6,
                     update="host")
    busiest = compute_bound(graph, profile)
    bound = lower_bound(graph, profile, m)
    est = estimate(graph, profile, m).iteration_time
    assert bound <= est
    assert bound - busiest >= 0.9 * (est - busiest)


@pytest.mark.parametrize("mode", ["pp", "dp", "1f1b-swap"])
def test_search_with_pruning_finds_the_best_candidate(mode):
    profile = skewed_profile(capacity=12_000_000)
    machine = _machines()["emulated"]
    sizes = [1, 2, 3, 6]
    pruned = search(profile, machine, mode, 2, 6, sizes=lambda limit: [s for s in sizes if s <= limit])
    every = search(profile, machine, mode, 2, 6, sizes=lambda limit: [s for s in sizes if s <= limit],
                   keep_candidates=True)
    assert pruned.estimate.iteration_time == pytest.approx(min(t for t, _ in every.candidates), rel=1e-12)
    assert pruned.explored < every.explored
