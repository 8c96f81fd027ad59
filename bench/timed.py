"""Estimate against run on timed devices: how well the program's simulation says what the runtime does.

Each case compiles a tiny model with an analytic profile of a real GPU (``--analytic``), at a device
memory small enough that state moves, then runs the plan on timed devices (``runtime/timed.py``):
every compute unit and copy lasts what the cost model says, scaled so that the simulated iteration
lasts ``timed.ITERATION`` (``--seconds``). The run's time is then set by the runtime's order and waits, not by this
machine's cores, and is compared with the simulation of the plan's program on the same modelled
machine (``timed_machine``, ``scheduler/simulator.py``); beside it, the search's own estimate of the
task graph (``scheduler/estimator.py``, which ranks candidates and chooses where state is
prefetched). A case off by more than the target names the compute unit where the run first parts
from the simulation (``first_divergence``).

    python -m bench.timed [--quick] [--models gpt2,bert,llama,resnet] [--devices 2,4,8]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import logging
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table

import harmony
from harmony.models import bert, gpt2, llama, resnet
from harmony.errors import HarmonyError
from harmony.plan import Plan
from harmony.runtime.timed import ITERATION, Timing, scale_for, timed_machine
from harmony.scheduler.estimator import estimate
from harmony.scheduler.machine import nominal_machine
from harmony.scheduler.search import NoFeasibleConfiguration
from harmony.scheduler.simulator import simulate, unit_starts

console = Console(width=140)
log = logging.getLogger("bench.timed")

MODELS = {"gpt2": gpt2, "bert": bert, "llama": llama, "resnet": resnet}
MODES = ("pp", "dp", "1f1b-swap", "gpipe-swap")
TARGET = 0.02  # |measured / estimated - 1| each run should stay within
MINIBATCH_PER_DEVICE = 4
MEMORY = 0.3  # of an uncapped plan's device peak: packs swap and several devices compute
ABOVE_LEAST = 1.2  # where no plan of a mode fits MEMORY: this times the least its closest plan needs


@dataclass
class Case:
    model: str
    mode: str
    devices: int
    estimated: float = float("nan")  # seconds per iteration, scaled as the run is: the program's simulation
    searched: float = float("nan")  # the search's estimate of the task graph, scaled alike
    measured: float = float("nan")  # median over the measured steps
    spread: float = float("nan")  # (slowest - fastest) / median of the measured steps
    worst_unit: str = ""  # where the run first parts from the simulation (``first_divergence``)
    error: str = ""

    @property
    def relative(self) -> float:
        return self.measured / self.estimated - 1

    @property
    def search_relative(self) -> float:
        return self.measured / self.searched - 1


def compile_case(name: str, mode: str, devices: int, spec: str, memory: float = MEMORY) -> Plan:
    """A plan of the tiny preset of ``name`` on ``devices`` analytic devices, each holding
    ``memory`` of the device peak of a plan without a memory cap, so that its state moves (or, for
    a mode none of whose plans fits that, ``ABOVE_LEAST`` times the least its closest plan needs)."""
    module = MODELS[name]
    get_batch = functools.partial(module.get_batch, preset="tiny")
    torch.manual_seed(0)
    model = module.build_model("tiny")
    options = dict(minibatch_size=MINIBATCH_PER_DEVICE * devices, devices=devices, mode=mode, analytic=spec,
                   probe=False, compare=False, check_gradients=False, build_optimizer=module.build_optimizer,
                   keep_state=False)
    uncapped = harmony.compile(model, module.loss_fn, get_batch, **options)
    footprint = max(uncapped.estimate["peak_memory"].values())
    try:
        return harmony.compile(model, module.loss_fn, get_batch, device_memory=int(footprint * memory), **options)
    except HarmonyError as exc:
        cause = exc.__cause__
        if not isinstance(cause, NoFeasibleConfiguration) or cause.shortfall is None:
            raise
        # the mode's smallest plan needs more than that (a per-GPU-swap pack holds a whole layer's
        # state and activations at once): a little more than its least
        return harmony.compile(model, module.loss_fn, get_batch, device_memory=int(cause.shortfall.needed * ABOVE_LEAST),
                               **options)


def run_case(case: Case, plan: Plan, steps: int, seconds: float = ITERATION) -> Case:
    """The simulation of the plan's program and its run on timed devices, ``steps`` measured after
    one warm-up."""
    tasks, profile = plan.tasks, plan.profile
    machine = timed_machine(profile.machine or nominal_machine("cpu", tasks.devices, profile.capacity))
    est = simulate(plan.program(), tasks, profile, machine)
    if est.deadlock:
        raise RuntimeError(f"the program's simulation does not finish: {est.deadlock}")
    searched = estimate(tasks, profile, machine, capacity=plan.options.get("planned_memory", profile.capacity),
                        record_events=False)
    timing = Timing.of(tasks, profile, machine, scale_for(est.iteration_time, seconds))
    case.estimated = est.iteration_time * timing.scale
    case.searched = searched.iteration_time * timing.scale
    module = MODELS[case.model]
    with harmony.Trainer(plan, optimizer=module.build_optimizer, loss_fn=module.loss_fn, timeout=60.0,
                         timing=timing) as trainer:
        for step in range(steps + 1):
            trainer.step(*module.get_batch(tasks.minibatch, step, preset="tiny"))
    measured = trainer.history[1:]
    seconds = [result.seconds for result in measured]
    case.measured = statistics.median(seconds)
    case.spread = (max(seconds) - min(seconds)) / case.measured
    simulated = {key: start * timing.scale for key, start in unit_starts(est).items()}
    case.worst_unit = first_divergence(measured_unit_starts(measured[-1]), _from_first(simulated), tasks)
    return case


def first_divergence(measured: dict[tuple[int, int], float], simulated: dict[tuple[int, int], float],
                     tasks) -> str:
    """The compute unit where the run parts most from the simulation: the one whose start's gap
    grows most over the gap of the unit before it on its device (a gap carried from an earlier
    unit says nothing of its own), with that growth."""
    by_id = {t.id: t for t in tasks.tasks}
    per_device: dict[int, list[tuple[float, tuple[int, int]]]] = {}
    for key, start in simulated.items():
        if key in measured:
            per_device.setdefault(by_id[key[0]].device, []).append((start, key))
    worst, growth = None, 0.0
    for units in per_device.values():
        before = 0.0
        for _, key in sorted(units):
            gap = measured[key] - simulated[key]
            if abs(gap - before) > abs(growth):
                worst, growth = key, gap - before
            before = gap
    if worst is None:
        return ""
    task, unit = worst
    where = str(by_id[task]).split(" in:")[0].rsplit(" u=", 1)[0]
    return f"task {task} unit {unit} ({where}): {growth * 1e3:+.0f} ms"


def measured_unit_starts(result: Any) -> dict[tuple[int, int], float]:
    """When each (task, unit) began computing in one step, in seconds from the first (the workers'
    clocks are one monotonic clock)."""
    return _from_first({key: start for worker in result.workers for key, start in worker.unit_starts.items()})


def _from_first(starts: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    origin = min(starts.values(), default=0.0)
    return {key: start - origin for key, start in starts.items()}


def run(models: list[str], modes: list[str], devices: list[int], spec: str, steps: int,
        progress: Callable[[str], None] = log.info, seconds: float = ITERATION) -> list[Case]:
    cases = []
    for name in models:
        for count in devices:
            for mode in modes:
                case = Case(name, mode, count)
                progress(f"{name} {mode} on {count} timed devices")
                try:
                    run_case(case, compile_case(name, mode, count, spec), steps, seconds)
                except Exception as exc:  # noqa: BLE001 - one case's failure is reported in the table
                    case.error = f"{type(exc).__name__}: {str(exc).splitlines()[0].split(';')[0][:100]}"
                cases.append(case)
    return cases


def report(cases: list[Case]) -> None:
    table = Table(title="estimate against run on timed devices")
    for column in ("model", "mode", "devices", "estimated ms", "measured ms", "error", "search's error", "run spread",
                   "most off"):
        table.add_column(column, justify="left" if column in ("model", "mode", "most off") else "right")
    for c in cases:
        if c.error:
            table.add_row(c.model, c.mode, str(c.devices), "", "", "", "", "", c.error)
            continue
        off = c.worst_unit if abs(c.relative) > TARGET else ""
        table.add_row(c.model, c.mode, str(c.devices), f"{c.estimated * 1e3:.1f}", f"{c.measured * 1e3:.1f}",
                      f"{100 * c.relative:+.1f}%", f"{100 * c.search_relative:+.1f}%", f"{100 * c.spread:.1f}%", off)
    console.print(table)
    ran = [c for c in cases if not c.error]
    if ran:
        worst = max(abs(c.relative) for c in ran)
        console.print(f"max |error| {100 * worst:.1f}% over {len(ran)} runs (target {100 * TARGET:.0f}%)")


def markdown(cases: list[Case], command: str, seconds: float = ITERATION) -> str:
    """The table for ``bench/results/timed.md``, dated, with the command that reproduces it."""
    lines = ["# Estimate against run on timed devices", "",
             f"Measured {datetime.date.today().isoformat()} on torch {torch.__version__}: `{command}` "
             "(tiny presets, analytic H100 profiles, device memory at "
             f"{MEMORY:g} of an uncapped plan's peak or, where no plan of the mode fits that, {ABOVE_LEAST:g} times "
             f"the least its closest plan needs, time scaled so that the simulated iteration lasts {seconds:g} s)",
             "",
             "| model | mode | devices | simulated ms | measured ms | error | search's error | run spread | "
             "where it first parts (+: a unit starts later than simulated) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in cases:
        if c.error:
            lines.append(f"| {c.model} | {c.mode} | {c.devices} | | | | | | {c.error} |")
        else:
            lines.append(f"| {c.model} | {c.mode} | {c.devices} | {c.estimated * 1e3:.1f} | {c.measured * 1e3:.1f} | "
                         f"{100 * c.relative:+.1f}% | {100 * c.search_relative:+.1f}% | {100 * c.spread:.1f}% | "
                         f"{c.worst_unit if abs(c.relative) > TARGET else ''} |")
    ran = [c for c in cases if not c.error]
    if ran:
        lines += ["", f"max |error| {100 * max(abs(c.relative) for c in ran):.1f}% over {len(ran)} runs "
                  f"(target {100 * TARGET:.0f}%)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,bert,llama,resnet")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--analytic", default="h100")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=ITERATION,
                        help="what the simulated iteration is scaled to last (default 1 s)")
    parser.add_argument("--quick", action="store_true", help="gpt2 and bert, pp and dp, on 2 and 4 devices")
    parser.add_argument("--out", help="also write the table as markdown to this file")
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("harmony").setLevel(logging.WARNING)  # the compiles' stages: not what this table is about
    if ns.quick:
        ns.models, ns.modes, ns.devices = "gpt2,bert", "pp,dp", "2,4"
    cases = run(ns.models.split(","), ns.modes.split(","), [int(d) for d in ns.devices.split(",")], ns.analytic,
                ns.steps, seconds=ns.seconds)
    report(cases)
    if ns.out:
        Path(ns.out).write_text(markdown(cases, "python -m bench.timed " + " ".join(sys.argv[1:]), ns.seconds))


if __name__ == "__main__":
    main()
