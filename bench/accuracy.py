"""Estimator accuracy over configurations sampled from the search (the paper's Fig. 15).

A thin adapter over ``bench.estimate_accuracy`` (its cases, its compile with probed links, its
training loop): where that module runs the configuration the search picks per mode, this one takes
``keep_candidates`` from the search and samples configurations spread over the candidates' ranks
(the best, the worst that fits and evenly between), so that the estimator is checked on
configurations it did not choose too. Each is estimated and trained on 2 emulated CPU devices; the
first iteration is left out and the median of the rest is compared with the estimate.
Goal: mean relative error <= 5%.

    python -m bench.accuracy [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from rich.console import Console

from bench import estimate_accuracy as ea
from bench.common import with_tasks
from harmony.errors import HarmonyError
from harmony.scheduler.estimator import estimate
from harmony.scheduler.search import NoFeasibleConfiguration, search
from harmony.scheduler.modes import generate

# (case, mode, how many configurations): 15 in all
SAMPLE = (("gpt2-tiny", "pp", 4), ("gpt2-tiny", "dp", 3), ("gpt2-tiny", "dp-swap", 2),
          ("gpt2-small", "pp", 3), ("gpt2-small", "dp", 3))
QUICK = (("gpt2-tiny", "pp", 2), ("gpt2-tiny", "dp", 1))


def spread(items: list, k: int) -> list:
    """``k`` items evenly spaced over ``items`` (first and last included)."""
    if k >= len(items):
        return list(items)
    if k == 1:
        return [items[0]]
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)]


def sampled_configurations(base, mode: str, k: int) -> list:
    """``k`` fitting configurations of ``mode`` on ``base``'s profile, spread over the search's ranking."""
    try:
        result = search(base.profile, base.profile.machine, mode, 2, base.tasks.minibatch,
                        capacity=base.options["planned_memory"], same_u=bool(base.options["same_u"]),
                        keep_candidates=True)
    except NoFeasibleConfiguration:
        return []
    unique: dict[str, Any] = {}
    for seconds, config in sorted(result.candidates, key=lambda c: c[0]):
        unique.setdefault(str(config), config)
    return spread(list(unique.values()), k)


def measure(sample=SAMPLE, iterations: int = 5) -> list[dict[str, Any]]:
    rows = []
    bases = {}
    for name, mode, k in sample:
        case = ea.CASES[name]
        if name not in bases:
            bases[name] = ea.plans_for(case, ("pp",))[0][1]
        base = bases[name]
        for config in sampled_configurations(base, mode, k):
            row: dict[str, Any] = {"model": name, "mode": mode, "configuration": str(config)}
            graph = None
            for update in (("device", "host") if mode in ("pp", "dp") else (None,)):
                options = {"update": update} if update else {}
                candidate = generate(mode, base.profile, config, 2, case.minibatch, **options)
                est = estimate(candidate, base.profile, base.profile.machine, capacity=base.options["planned_memory"])
                if est.fits and not est.deadlock and (graph is None or est.iteration_time < row["estimated_seconds"]):
                    graph, row["estimated_seconds"] = candidate, est.iteration_time
            if graph is None:
                continue
            plan = with_tasks(base, graph, row["estimated_seconds"])
            try:
                history = ea.train(plan, case, iterations)
            except HarmonyError as exc:
                rows.append({**row, "failed": f"{type(exc).__name__}: {exc}"})
                continue
            seconds = [h.seconds for h in history]
            measured = statistics.median(seconds[1:])
            rows.append({**row, "measured_seconds": measured, "iteration_seconds": seconds,
                         "relative_error": (row["estimated_seconds"] - measured) / measured})
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(r["relative_error"]) for r in rows if "relative_error" in r]
    return {"configurations": len(errors), "failed": sum(1 for r in rows if "failed" in r),
            "mean_relative_error": statistics.fmean(errors) if errors else None,
            "max_relative_error": max(errors) if errors else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args()
    rows = measure(QUICK if ns.quick else SAMPLE)
    console = Console(width=160)
    for r in rows:
        console.print(r)
    console.print(summary(rows))


if __name__ == "__main__":
    main()
