"""Seconds of ``harmony compile`` from a fresh process: GPT-2 1.5B planned for four modelled GTX
1080 Ti, every mode compared, as a user runs it.

    python -m bench.compile_time [--runs 3] [--no-compare] [--out bench/results/compile_time.md]

Each run is a new Python process that runs the command line's compile
(``harmony compile models/gpt2.py --arg preset=1.5b --analytic 1080ti --minibatch 64 --devices 4``),
timed by this process from before it starts to its exit, its CPU seconds (its comparison workers'
included) beside. The breakdown is the compile's own (``harmony.timing``: the stages it logs at
INFO), and "imports" is the time from the process's start to harmony's command line, compiler and
decomposer imported. The searches of the modes compared run in worker processes beside one another
(``scheduler/comparison.py``), so their seconds overlap; "comparison" is the compile's wait for them
after its own search. The machine is shared and times move by 10-20% between runs: the table gives
the median of the runs, with their least and most.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

MODELS = Path(__file__).resolve().parents[1] / "models"
GOAL_SECONDS = 10.0
WORKER = " (worker)"  # the suffix of a comparison worker's search in the stage records


def compile_args(model: str, preset: str, devices: int, minibatch: int, analytic: str, compare: bool) -> list[str]:
    """The ``harmony`` command line of the compile timed (without ``--out``)."""
    args = ["compile", str(MODELS / f"{model}.py"), "--arg", f"preset={preset}", "--analytic", analytic,
            "--minibatch", str(minibatch), "--devices", str(devices)]
    return args + ([] if compare else ["--no-compare"])


class _Stages(logging.Handler):
    """Collects the compile's stage records (``harmony.timing.STAGE_MESSAGE``) as (name, seconds)."""

    def __init__(self, message: str) -> None:
        super().__init__(logging.INFO)
        self.message = message
        self.stages: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == self.message:
            name, seconds = record.args
            self.stages.append((name, float(seconds)))


def _child(started: float, report: Path, argv: list[str]) -> int:
    """One fresh process's compile: the imports it needs, then the command line itself; writes
    ``report`` (JSON: imports, stages, torch's version)."""
    import torch

    import harmony.cli
    import harmony.compiler  # noqa: F401 - imported by the compile command; timed with the rest
    import harmony.decomposer.decompose  # noqa: F401
    from harmony import timing

    imported = time.time()
    stages = _Stages(timing.STAGE_MESSAGE)
    timing.log.addHandler(stages)
    timing.log.setLevel(logging.INFO)
    timing.log.propagate = False  # the records come here only, not to the command's console
    code = harmony.cli.main(argv)
    report.write_text(json.dumps({"imports": imported - started, "stages": stages.stages, "code": code,
                                  "torch": torch.__version__}))
    return code


def run_once(argv: list[str]) -> dict:
    """One compile in a fresh process: its wall seconds, CPU seconds and the child's report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.time()
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "bench.compile_time", "--child", str(started), str(report), "--",
                               *argv, "--out", str(Path(tmp) / "plan")], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1])
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0 or not report.exists():
            raise RuntimeError(f"the compile failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
        result = json.loads(report.read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, **result}


def summarize(runs: list[dict]) -> list[tuple[str, list[float]]]:
    """(stage, seconds per run) in the order the compile reports them: total and CPU first, then
    the imports, the compile's stages, what the stages leave out (start-up, printing, exit), and
    the comparison workers' searches (overlapping one another and the compile's)."""
    rows: dict[str, list[float]] = {"total (wall)": [r["wall"] for r in runs], "CPU (all processes)": [r["cpu"] for r in runs],
                                    "imports": [r["imports"] for r in runs]}
    workers: dict[str, list[float]] = {}
    for run in runs:
        for name, seconds in run["stages"]:
            (workers if name.endswith(WORKER) else rows).setdefault(name, []).append(seconds)
    rows["rest (start-up, output, exit)"] = [
        r["wall"] - r["imports"] - sum(s for n, s in r["stages"] if not n.endswith(WORKER)) for r in runs]
    return list(rows.items()) + list(workers.items())


def _cells(values: list[float]) -> tuple[str, str, str]:
    return f"{statistics.median(values):.2f}", f"{min(values):.2f}", f"{max(values):.2f}"


def markdown(rows: list[tuple[str, list[float]]], runs: list[dict], command: str) -> str:
    """The table for ``bench/results/compile_time.md``, dated, with the command that reproduces it."""
    total = statistics.median(rows[0][1])
    verdict = "met" if total <= GOAL_SECONDS else "not met"
    lines = [
        "# Compile time from a fresh process",
        "",
        f"Measured {datetime.date.today().isoformat()} on torch {runs[0]['torch']}, {os.cpu_count()} cores, load "
        f"average {os.getloadavg()[0]:.1f} at the end: `{command}` ({len(runs)} runs; the median, least and most)",
        "",
        f"Goal: at most {GOAL_SECONDS:.0f} s from a fresh process, every mode compared: **{verdict}** "
        f"(median {total:.2f} s).",
        "",
        "| stage | median s | least s | most s |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {' | '.join(_cells(values))} |" for name, values in rows]
    lines += ["", "The searches marked (worker) run in the comparison's worker processes, side by side and beside the "
              "compile's own search: their seconds overlap, and the compile waits only for the last of them "
              "(\"comparison\"). \"decompose\" includes torch's own import of torch._dynamo, which its meta kernels' "
              "Python decompositions load on first use.", ""]
    return "\n".join(lines)


def _print(rows: list[tuple[str, list[float]]], console: Console) -> None:
    table = Table(title="harmony compile from a fresh process (seconds)")
    for col in ("stage", "median", "least", "most"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for name, values in rows:
        table.add_row(name, *_cells(values))
    console.print(table)


def main(args: list[str] | None = None) -> None:
    args = sys.argv[1:] if args is None else args
    if args[:1] == ["--child"]:
        started, report, _, *argv = args[1:]
        sys.exit(_child(float(started), Path(report), argv))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default="gpt2", help="a model file of models/ (default gpt2)")
    parser.add_argument("--preset", default="1.5b")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--minibatch", type=int, default=64)
    parser.add_argument("--analytic", default="1080ti")
    parser.add_argument("--no-compare", action="store_true", help="search the chosen mode only")
    parser.add_argument("--out", type=Path, help="write the table as markdown here")
    ns = parser.parse_args(args)
    argv = compile_args(ns.model, ns.preset, ns.devices, ns.minibatch, ns.analytic, not ns.no_compare)
    runs = [run_once(argv) for _ in range(ns.runs)]
    rows = summarize(runs)
    _print(rows, Console(width=160))
    if ns.out is not None:
        command = " ".join(["python -m bench.compile_time", *args])
        ns.out.write_text(markdown(rows, runs, command))


if __name__ == "__main__":
    main()
