"""``python -m bench [--quick] [--only NAME ...] [--out DIR]``: every benchmark in one run (or those
named), then the results folder (README.md with the figures and their goals, results.json, PNG
plots): ``bench/results``, or ``bench/results/NAME`` for a run with ``--only``.

The full run is sized for under 20 minutes on two cores, ``--quick`` for under 3 (a subset: fewer
models, minibatches, configurations and rounds). A benchmark that fails is reported in the README
and the others still run. Benchmarks are not tests; they do not run in CI.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from bench import ablation, accuracy, clipping, overhead, peers, precision, report, search_time, throughput
from bench.common import TINY, Stopwatch, machine_info

console = Console(width=160)
log = logging.getLogger("bench")


def _throughput(quick: bool) -> dict[str, Any]:
    sizes = throughput.QUICK_MINIBATCHES if quick else throughput.MINIBATCHES
    return {"estimated": throughput.estimated(sizes, budget_s=60 if quick else 480),
            "measured": throughput.measured(("gpt2-tiny",) if quick else tuple(TINY), iterations=3 if quick else 4)}


def _accuracy(quick: bool) -> dict[str, Any]:
    rows = accuracy.measure(accuracy.QUICK if quick else accuracy.SAMPLE, iterations=4 if quick else 5)
    return {"rows": rows, "summary": accuracy.summary(rows)}


def _peers(quick: bool) -> dict[str, Any]:
    # five interleaved rounds: the schedules' own rates move by a quarter between runs on two shared cores
    return peers.compare(4, steps=4, rounds=1 if quick else 5, budget=32 << 20,
                         depths=(4, 8) if quick else (2, 4, 8, 16, 32), harmony_deadline_s=20 if quick else 200)


BENCHMARKS: dict[str, Callable[[bool], Any]] = {
    "overhead": lambda quick: overhead.measure_all(steps=6 if quick else 10,
                                                   models=overhead.MODELS[:1] if quick else overhead.MODELS),
    "search": lambda quick: search_time.search_times(("GPT-2 1.5B",) if quick else None),
    "throughput": _throughput,
    "accuracy": _accuracy,
    "ablation": lambda quick: ablation.measure(("pp",) if quick else ("pp", "dp"), rounds=1 if quick else 2,
                                                iterations=3 if quick else 4),
    "peers": _peers,
    "precision": lambda quick: {"estimated": precision.estimated(precision.CASES[:1] if quick else precision.CASES),
                                "counted": precision.counted()},
    "clipping": lambda quick: {"estimated": clipping.estimated(clipping.CASES[:1] if quick else clipping.CASES),
                               "measured": clipping.measured(rounds=1 if quick else 3)},
}


def run(quick: bool, only: list[str] | None = None) -> dict[str, Any]:
    """Every benchmark (or ``only`` those), each timed; failures recorded, not raised."""
    clock = Stopwatch()
    results: dict[str, Any] = {"machine": machine_info(), "quick": quick, "failures": {}, "seconds": {}}
    for name, bench in BENCHMARKS.items():
        if only and name not in only:
            continue
        started = clock()
        with console.status(f"[bold]{name}[/bold] ({clock():.0f} s so far)"):
            try:
                results[name] = bench(quick)
            except Exception as exc:  # noqa: BLE001 - one failing benchmark must not stop the others
                log.warning("%s failed:\n%s", name, traceback.format_exc())
                results["failures"][name] = f"{type(exc).__name__}: {exc}"
        results["seconds"][name] = clock() - started
        status = "[red]failed[/red]" if name in results["failures"] else "done"
        console.print(f"{name}: {status} in {results['seconds'][name]:.0f} s")
    results["wall_seconds"] = clock()
    return results


def summary_table(results: dict[str, Any]) -> Table:
    table = Table(title="Harmony benchmarks")
    for col in ("benchmark", "seconds", "figure"):
        table.add_column(col)
    figures = {
        "overhead": lambda r: f"throughput ratio {r.get('worst_ratio', r['throughput_ratio']):.3f} at worst (goal ≥ 0.95)",
        "peers": lambda r: f"Harmony / best pipelining schedule {r['ratio_to_best_peer']:.2f} (goal ≥ 1.2)",
        "search": lambda r: "speed-up over Table 1: " + ", ".join(f"{x['model']} {x['speedup']:.1f}x" for x in r),
        "throughput": lambda r: f"{len(r['estimated'])} estimated and {len(r['measured'])} measured rows",
        "accuracy": lambda r: (f"mean error {r['summary']['mean_relative_error']:.1%} over "
                               f"{r['summary']['configurations']} configurations (goal ≤ 5%)"
                               if r["summary"]["mean_relative_error"] is not None else "no configuration ran"),
        "ablation": lambda r: ", ".join(f"{x['mode']} {x['variant']} {x['slowdown']:.2f}" for x in r if "slowdown" in x),
        "precision": lambda r: "bf16 / fp32 estimated: " + ", ".join(
            f"{m} {s:.2f}x" for m, s in report.precision_speedups(r["estimated"]).items()),
        "clipping": lambda r: "clipped / unclipped estimated: " + ", ".join(
            f"{x['model']} {x['mode']} {x['clipped_s'] / x['unclipped_s']:.3f}" for x in r["estimated"] if "error" not in x),
    }
    for name, seconds in results["seconds"].items():
        text = results["failures"].get(name) or figures[name](results[name])
        table.add_row(name, f"{seconds:.0f}", text)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a subset, under 3 minutes on two cores")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the report goes (default bench/results, or bench/results/NAME for --only NAME: "
                             "a partial run does not overwrite the whole report)")
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHMARKS), help="run only these benchmarks")
    ns = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if ns.out is None:
        results_dir = Path(__file__).resolve().parent / "results"
        ns.out = results_dir / "-".join(ns.only) if ns.only else results_dir
    results = run(ns.quick, ns.only)
    console.print(summary_table(results))
    readme = report.write(results, ns.out, ns.quick, " ".join(["python -m bench", *map(shlex.quote, sys.argv[1:])]))
    console.print(f"results written to {readme.parent} (README.md, results.json, plots)")


if __name__ == "__main__":
    main()
