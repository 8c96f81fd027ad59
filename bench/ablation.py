"""Optimization breakdown (the paper's Fig. 14): turn off one optimization at a time.

A GPT-2 of 4 blocks (width 128) on 2 emulated CPU devices, each with a quarter of the training
footprint, minibatch 16. For ``pp`` and ``dp``: all optimizations on (the searched plan), then one
off at a time: input-batch grouping (``grouping=False``: one task per microbatch), jit-update
(``jit_update=False``: UPD tasks after the backward pass; pp), prefetch (``Trainer(prefetch=False)``),
p2p swaps (``p2p=False``: activations through host memory; pp) and configuration search (a
hand-picked configuration instead: equal-sized packs, two per device, and microbatches of a
quarter of the minibatch, finer packs only if that does not fit). Each switched-off plan is
searched again with the switch, so the rest stays optimized. Variants run interleaved, round after
round, each round starting one variant later, after a warm-up run; a row's figure is its median
iteration time over the all-on one's (higher is worse), beside the estimator's ratio.

    python -m bench.ablation [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from rich.console import Console

from bench.common import compiled, searched, train, with_tasks
from bench.overhead import SMALL
from harmony.errors import HarmonyError
from harmony.scheduler.estimator import estimate
from harmony.scheduler.search import NoFeasibleConfiguration
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import Configuration

MINIBATCH = 16
SWITCHES = {
    "pp": {"grouping": {"grouping": False}, "jit-update": {"jit_update": False}, "p2p swaps": {"p2p": False}},
    "dp": {"grouping": {"grouping": False}},
}


def hand_picked(base, mode: str, devices: int, minibatch: int):
    """An expert's configuration: equal packs (two per device, finer if that does not fit) and a
    quarter of the minibatch per microbatch; None if nothing of that shape fits."""
    layers = len(base.profile.layers)
    u = max(1, minibatch // 4)
    for count in range(2 * devices, layers + 1):
        bounds = [round(i * layers / count) for i in range(count + 1)]
        packs = [(a, b - 1) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        config = Configuration(u_f=u, packs_f=packs, u_b=u, packs_b=packs)
        graph = generate(mode, base.profile, config, devices, minibatch)
        est = estimate(graph, base.profile, base.profile.machine, capacity=base.options["planned_memory"])
        if est.fits and not est.deadlock:
            return with_tasks(base, graph, est.iteration_time)
    return None


def variants(base, mode: str, devices: int) -> dict[str, tuple[Any, bool]]:
    """label -> (plan, prefetch) for all-on and each optimization off."""
    on, _ = searched(base, mode, devices, MINIBATCH)
    out: dict[str, tuple[Any, bool]] = {"all on": (on, True)}
    for label, switch in SWITCHES[mode].items():
        try:
            out[f"no {label}"] = (searched(base, mode, devices, MINIBATCH, **switch)[0], True)
        except NoFeasibleConfiguration:
            out[f"no {label}"] = (None, True)
    out["no prefetch"] = (on, False)
    out["no search (hand-picked)"] = (hand_picked(base, mode, devices, MINIBATCH), True)
    return out


def measure(modes: tuple[str, ...] = ("pp", "dp"), rounds: int = 2, iterations: int = 4, devices: int = 2) -> list[dict]:
    base = compiled(SMALL, MINIBATCH, devices=devices)
    rows = []
    for mode in modes:
        plans = variants(base, mode, devices)
        times: dict[str, list[float]] = {label: [] for label in plans}
        errors: dict[str, str] = {}
        train(plans["all on"][0], iterations=2)  # warm-up: the first runs of a process are slower
        for r in range(rounds):
            order = list(plans.items())
            for label, (plan, prefetch) in order[r % len(order):] + order[:r % len(order)]:
                if plan is None or label in errors:
                    continue
                try:
                    run = train(plan, iterations=iterations, prefetch=prefetch)
                except HarmonyError as exc:
                    errors[label] = f"{type(exc).__name__}: {exc}"
                    continue
                times[label] += run.iterations[1:]
        reference = statistics.median(times["all on"])
        estimated_on = plans["all on"][0].estimate["iteration_time"]
        for label, (plan, prefetch) in plans.items():
            row: dict[str, Any] = {"mode": mode, "variant": label, "model": SMALL.name, "minibatch": MINIBATCH,
                                   "devices": devices}
            if plan is None:
                rows.append({**row, "error": "no configuration fits"})
                continue
            row["configuration"] = str(plan.tasks.config)
            if label in errors or not times[label]:
                rows.append({**row, "error": errors.get(label, "not run")})
                continue
            measured = statistics.median(times[label])
            row.update({"measured_seconds": measured, "slowdown": measured / reference,
                        "estimated_slowdown": (plan.estimate["iteration_time"] / estimated_on) if prefetch else None})
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="pp only, one round")
    ns = parser.parse_args()
    rows = measure(("pp",) if ns.quick else ("pp", "dp"), rounds=1 if ns.quick else 2)
    console = Console(width=160)
    for r in rows:
        console.print(r)


if __name__ == "__main__":
    main()
