"""Estimated vs measured iteration time for a sample of configurations (the paper's Fig. 15).

Each model is compiled once on 2 emulated CPU devices with the default capacity (a quarter of the
training footprint) and a probed machine (``probe=True``: links, and the runtime's own costs per
task, microbatch, update and p2p message and the cores the devices share, ``harmony.profiling.overheads``):
that gives the plan of mode pp; dp and a per-device-swap baseline are searched on the same profile
and the same probed machine. ``--full`` takes the best few configurations of the search per mode
(``SAMPLE_FULL``, 15 in all), not just the best, as the paper's Fig. 15 samples the search. Every plan
is then trained ``--runs`` times (twelve by default), each time in fresh worker processes for K
iterations, the runs interleaved over the model's plans (every plan once, then every plan again), so
that a slow minute of the machine falls on all of them rather than on one; the first iteration of
each run (process and allocator warm-up) is left out and the median of the rest of all runs is the
measured iteration time, compared with the scheduler's estimate (the event-driven simulation) as a
ratio taken within the run. The runs' own disagreement, (max - min) / median of their medians, is
printed beside each row: how far one run of the plan can be from another, the error an exact
estimate would still show against a single run. Fresh workers land differently each run, so any
one run, taken as the plan's time, can be well off the others, while the median of many runs lies
much closer to the estimate. So the default is twelve runs, enough for the two interleaved halves of
a plan's runs to agree closely (``repeat_error`` prints how closely), where four are not. Beside it,
the same estimate with the runtime's costs switched off (overheads zero, no shared cores: the
estimator without the runtime's measured costs), on the same measured run. The spread of the
measured iterations, (max - min) / median, is printed beside each row as the machine's noise, and so
is its CPU contention: a fixed single-threaded matmul loop run in two forked processes at once
around the training, over the same loop run in one process just before the profile was taken (the
profile times one device computing alone; the run has both devices computing at once on the same
cores, with whatever else the machine runs). On a machine with a free core per device it is about 1.
A matrix product does not see the state that moves a tiny model's runs most here: interpreter-bound
work running markedly slower in spells of seconds (``bench.machine_drift``). So the same is done
with a pure Python loop (``interpreter``: in two processes around each run, over its fastest of
five readings in one process before the profile), printed per run: a run beside a reading well
over 1 was likely made in such a spell.

``--breakdown`` prints, per device task, the estimate's compute (``task_compute_seconds``), the
estimate's span (from the end of the device's previous task to the end of this one, waits for
inputs included) and the measured span (``IterationResult.task_seconds``, median over the kept
iterations), then per device the estimated and measured busy time, the launcher's overhead
(iteration time minus the slowest worker's), and a least-squares fit over the device tasks of
measured span = a * estimated compute + b: ``a`` is the compute slowdown, ``b`` the fixed cost per
task that the profile does not see. Last, one P2P message on the CPU runtime's own path (a copy
into shared memory, a ``torch.multiprocessing`` queue to another process, a copy in) is timed at
a few sizes beside the time the estimator gives it (the probed per-message cost plus bytes over ``d2d``).

    python -m bench.estimate_accuracy [--quick | --full] [--models NAME ...] [--breakdown] [--iterations K] [--runs R] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.table import Table

import harmony
from bench import machine_drift
from bench.common import Model
from harmony.compiler import estimate_range
from harmony.errors import HarmonyError
from harmony.models import gpt2, resnet, vgg
from harmony.models.gpt2 import GPT, GPTConfig
from harmony.plan import Plan
from harmony.scheduler.costs import task_compute_seconds
from harmony.scheduler.estimator import Estimate, estimate
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import NoFeasibleConfiguration, search
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import HOST, Configuration

console = Console(width=160)

BASELINE = "dp-swap"  # the per-device-swap data parallelism the paper compares with (Fig. 11)
# a GPT-2 whose iterations take tens to hundreds of milliseconds on two emulated devices
SMALL_GPT = GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=64)


@dataclass(frozen=True)
class Case(Model):
    """A model (``bench.common.Model``) and its minibatch size."""

    minibatch: int


CASES = {
    "gpt2-tiny": Case("gpt2-tiny", functools.partial(gpt2.build_model, "tiny"), gpt2.loss_fn,
                      functools.partial(gpt2.get_batch, preset="tiny"), gpt2.build_optimizer, 8),
    "gpt2-small": Case("gpt2-small", functools.partial(GPT, SMALL_GPT), gpt2.loss_fn, functools.partial(gpt2.batch_of, SMALL_GPT),
                       gpt2.build_optimizer, 16),
    "vgg-tiny": Case("vgg-tiny", functools.partial(vgg.build_model, "tiny"), vgg.loss_fn,
                     functools.partial(vgg.get_batch, preset="tiny"), vgg.build_optimizer, 16),
    "resnet-tiny": Case("resnet-tiny", functools.partial(resnet.build_model, "tiny"), resnet.loss_fn,
                        functools.partial(resnet.get_batch, preset="tiny"), resnet.build_optimizer, 16),
}
QUICK = [("gpt2-tiny", ("pp", "dp", BASELINE)), ("gpt2-small", ("pp",))]
FULL = [("gpt2-tiny", ("pp", "dp", BASELINE)), ("gpt2-small", ("pp", "dp", BASELINE)),
        ("vgg-tiny", ("pp", "dp", BASELINE)), ("resnet-tiny", ("pp", "dp"))]
# (model, modes, configurations per mode): the best few of the search, 15 configurations in all
SAMPLE_FULL = [("gpt2-tiny", ("pp", "dp", BASELINE), 2), ("gpt2-small", ("pp",), 2),
               ("gpt2-small", ("dp", BASELINE), 1), ("vgg-tiny", ("pp", "dp", BASELINE), 1),
               ("resnet-tiny", ("pp", "dp"), 1)]


class CpuReading(NamedTuple):
    """Seconds of the two fixed single-threaded loops in one process: 150 products of 192x192
    matrices, and pure Python arithmetic (``machine_drift.python_loop`` ten times)."""

    matmul: float
    python: float


def _cpu_loop(out=None) -> CpuReading:
    torch.set_num_threads(1)
    a = torch.randn(192, 192, generator=torch.Generator().manual_seed(0))
    a @ a  # untimed: a fresh process's first product (its kernels' set-up) would read the contention low
    t0 = time.perf_counter()
    for _ in range(150):
        a @ a
    t1 = time.perf_counter()
    for _ in range(10):
        machine_drift.python_loop()
    reading = CpuReading(t1 - t0, time.perf_counter() - t1)
    if out is not None:
        out.put(tuple(reading))
    return reading


def cpu_seconds(processes: int) -> CpuReading:
    """Median seconds of each fixed loop in ``processes`` forked processes running at once (forked,
    one thread each, as the runtime's emulated devices are)."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_cpu_loop, args=(out,), daemon=True) for _ in range(processes)]
    for p in procs:
        p.start()
    readings = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return CpuReading(*(statistics.median(column) for column in zip(*readings)))


def _baseline() -> CpuReading:
    """The loops in one process before the profile: the matmul's first reading, and the Python
    loop's fastest of five (its speed outside the machine's slow spells)."""
    readings = [cpu_seconds(1) for _ in range(5)]
    return CpuReading(readings[0].matmul, min(r.python for r in readings))


def _p2p_receiver(inbox, out, slabs) -> None:
    torch.set_num_threads(1)
    while (item := inbox.get()) is not None:
        sent, items = item
        slabs.decode(items, 0, 1)[0].clone()
        out.put(time.perf_counter() - sent)


def p2p_seconds(sizes: tuple[int, ...], repeats: int = 15) -> dict[int, float]:
    """Median seconds of one message on the CPU runtime's P2P path between two processes (a copy
    into the pair's shared-memory slab, its place through a ``torch.multiprocessing`` queue, a copy
    out on the receiver: ``runtime/channels.Slabs``, as the launcher's workers send), per size in
    bytes; ``perf_counter`` is one clock across processes on Linux. The runtime's stream and
    mailbox threads around it are not in this number (the probe's calibrated message cost has them)."""
    import torch.multiprocessing as tmp

    from harmony.runtime.channels import Slabs

    ctx = tmp.get_context("fork")
    slabs = Slabs({(0, 1): max(sizes) + 4096})
    inbox, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_p2p_receiver, args=(inbox, out, slabs), daemon=True)
    proc.start()
    try:
        result = {}
        for size in sizes:
            t = torch.zeros(max(1, size // 4))
            times = []
            for _ in range(repeats):
                slabs.reset()
                inbox.put((time.perf_counter(), slabs.encode([t], 0, 1)))
                times.append(out.get(timeout=60))
            result[size] = statistics.median(times[repeats // 3:])
        return result
    finally:
        inbox.put(None)
        proc.join(timeout=10)


def without_runtime_costs(machine: Machine) -> Machine:
    """``machine`` as the estimator sees it without the runtime's own costs measured."""
    return dataclasses.replace(machine.without_overheads(), cpu_cores=None, compute_scale=1.0, compute_interference=0.0)


def _best_configurations(base: Plan, machine: Machine, mode: str, case: Case, count: int) -> list[Configuration]:
    """The ``count`` fastest distinct configurations the search found for ``mode``, best first."""
    result = search(base.profile, machine, mode, 2, case.minibatch, capacity=base.options["planned_memory"],
                    same_u=bool(base.options["same_u"]), keep_candidates=count > 1)
    if count <= 1:
        return [result.config]
    seen, out = set(), []
    for _, config in sorted(result.candidates, key=lambda c: c[0]):
        key = str(config)
        if key not in seen:
            seen.add(key)
            out.append(config)
        if len(out) == count:
            break
    return out


def _plan_of(base: Plan, machine: Machine, mode: str, config: Configuration, case: Case) -> tuple[Plan, Estimate] | None:
    """The fastest fitting variant (device or host update) of ``config`` in ``mode`` as a plan."""
    best = None
    variants = [{"update": "device"}, {"update": "host"}] if mode in ("pp", "dp") else [{}]
    for options in variants:
        try:
            tasks = generate(mode, base.profile, config, 2, case.minibatch, **options)
        except ValueError:
            continue
        est = estimate(tasks, base.profile, machine, capacity=base.options["planned_memory"])
        if est.fits and not est.deadlock and (best is None or est.iteration_time < best[1].iteration_time):
            best = (tasks, est)
    if best is None:
        return None
    tasks, est = best
    plan = Plan(graph=base.graph, profile=base.profile, tasks=tasks,
                estimate={"iteration_time": est.iteration_time,
                          "busy": {str(d): dict(s) for d, s in est.busy.items()}},
                options={**base.options, "mode": mode})
    plan.loss_fn, plan.build_optimizer = case.loss_fn, case.build_optimizer
    return plan, est


def plans_for(case: Case, modes: tuple[str, ...], per_mode: int = 1) -> list[tuple[str, Plan | None, Estimate | None, float]]:
    """(mode, plan or None if it does not fit, its estimate, compile seconds) for every mode, the
    ``per_mode`` best configurations of each; one compile (profile + machine probe) serves them all.
    The plans carry ``cpu_alone``: the fixed loops' seconds in one process just before the profile
    (``_baseline``)."""
    torch.manual_seed(0)
    model = case.build()
    alone = _baseline()
    t0 = time.perf_counter()
    base = harmony.compile(model, case.loss_fn, case.get_batch, minibatch_size=case.minibatch, devices=2,
                           mode="pp", build_optimizer=case.build_optimizer, probe=True, compare=False)
    compile_seconds = time.perf_counter() - t0
    machine = base.profile.machine
    out = []
    for mode in modes:
        if per_mode > 1:
            try:
                configs = _best_configurations(base, machine, mode, case, per_mode)
            except NoFeasibleConfiguration:
                out.append((mode, None, None, compile_seconds))
                continue
            for config in configs:
                made = _plan_of(base, machine, mode, config, case)
                if made is not None:
                    made[0].cpu_alone = alone
                out.append((mode, *(made or (None, None)), compile_seconds))
            continue
        if mode == base.options["mode"]:  # the compiled plan itself; re-simulated for its timeline
            est = estimate(base.tasks, base.profile, machine, capacity=base.options["planned_memory"])
            est.iteration_time = base.estimate["iteration_time"]
            base.cpu_alone = alone
            out.append((mode, base, est, compile_seconds))
            continue
        try:
            result = search(base.profile, machine, mode, 2, case.minibatch, capacity=base.options["planned_memory"],
                            same_u=bool(base.options["same_u"]))
        except NoFeasibleConfiguration:
            out.append((mode, None, None, compile_seconds))
            continue
        plan = Plan(graph=base.graph, profile=base.profile, tasks=result.graph,
                    estimate={"iteration_time": result.estimate.iteration_time,
                              "busy": {str(d): dict(s) for d, s in result.estimate.busy.items()}},
                    options={**base.options, "mode": mode})
        plan.loss_fn, plan.build_optimizer = case.loss_fn, case.build_optimizer
        plan.cpu_alone = alone
        out.append((mode, plan, result.estimate, compile_seconds))
    return out


def train(plan: Plan, case: Case, iterations: int) -> list:
    """The trainer's history over ``iterations`` steps."""
    with harmony.Trainer(plan, optimizer=case.build_optimizer, timeout=120) as trainer:
        for step in range(iterations):
            trainer.step(*case.get_batch(case.minibatch, step))
        return list(trainer.history)



@dataclass
class Measured:
    """One plan's runs (``measure``): every run's iterations, its kept histories, and the CPU contention."""

    runs: list[list[float]]  # per run, every iteration's seconds (the first is the warm-up)
    steady: list  # the kept iterations' histories, all runs
    contention: list[float]  # per run, the fixed loop in two processes over one process before the profile
    interpreter: list[float] = dataclasses.field(default_factory=list)  # per run, the same with the Python loop
    failed: str | None = None


def measure(case: Case, plans: list[Plan], iterations: int, runs: int) -> list[Measured]:
    """Each plan trained ``runs`` times in fresh workers, ``iterations`` steps a run, the runs
    interleaved over ``plans`` (each once, then each again): a slow spell of the machine falls on
    all the plans rather than on one. A plan whose run fails is not trained again."""
    out = [Measured([], [], []) for _ in plans]
    for _ in range(runs):
        for plan, got in zip(plans, out):
            if got.failed:
                continue
            with console.status(f"training {case.name} {plan.options['mode']} (run {len(got.runs) + 1} of {runs})"):
                before = cpu_seconds(2)
                try:
                    history = train(plan, case, iterations)
                except HarmonyError as exc:  # a run that fails is a finding of its own: report it, go on
                    console.print(f"[red]{case.name} {plan.options['mode']} ({plan.tasks.config}) failed:[/red] {exc}")
                    got.failed = f"{type(exc).__name__}: {exc}"
                    continue
                after = cpu_seconds(2)
                got.contention.append((before.matmul + after.matmul) / 2 / plan.cpu_alone.matmul)
                got.interpreter.append((before.python + after.python) / 2 / plan.cpu_alone.python)
            got.runs.append([h.seconds for h in history])
            got.steady += history[1:]
    return out


def measured_rows_of(name: str, case: Case, plans: list, iterations: int, runs: int, with_breakdown: bool) -> list[dict[str, Any]]:
    """The rows of one model's plans (``plans_for``): each estimate beside its plan's measured runs."""
    rows, fitting = [], [(mode, plan, est, seconds) for mode, plan, est, seconds in plans if plan is not None]
    results = dict(zip((id(plan) for _, plan, _, _ in fitting), measure(case, [p for _, p, _, _ in fitting], iterations, runs)))
    for mode, plan, est, compile_seconds in plans:
        row: dict[str, Any] = {"model": name, "mode": mode, "minibatch": case.minibatch, "devices": 2,
                               "compile_seconds": compile_seconds}
        if plan is None:
            rows.append({**row, "configuration": "does not fit"})
            continue
        machine = plan.profile.machine
        plain = estimate(plan.tasks, plan.profile, without_runtime_costs(machine),
                         capacity=plan.options["planned_memory"], record_events=False).iteration_time
        span = estimate_range(plan.tasks, plan.profile, machine, plan.options["planned_memory"])
        row.update({"configuration": str(plan.tasks.config), "capacity": plan.options["device_memory"],
                    "estimated_seconds": est.iteration_time, "estimated_without_runtime_costs": plain,
                    "estimated_range": span.get("iteration_time_range")})
        got = results[id(plan)]
        if got.failed:
            rows.append({**row, "failed": got.failed})
            continue
        kept = [s for run in got.runs for s in run[1:]]
        measured = statistics.median(kept)
        medians = [statistics.median(run[1:]) for run in got.runs]
        lo_hi = row["estimated_range"]
        row.update({
            "within_range": lo_hi[0] <= measured <= lo_hi[1] if lo_hi else None,
            "measured_seconds": measured,
            "relative_error": (est.iteration_time - measured) / measured,
            "relative_error_without_runtime_costs": (plain - measured) / measured,
            "iteration_seconds": got.runs, "run_medians": medians,
            "runs_disagree": (max(medians) - min(medians)) / measured,
            "repeat_error": repeat_error(got.runs),
            "spread": (max(kept) - min(kept)) / measured,
            "contention": statistics.median(got.contention), "interpreter": got.interpreter,
            "load_average": os.getloadavg()[0],
            "machine": {name: getattr(machine, name) for name in (
                "h2d", "d2h", "d2d", "latency", "p2p_latency", "task_overhead", "microbatch_overhead",
                "update_overhead", "host_update_overhead", "host_tensor_overhead", "p2p_send_overhead",
                "cpu_cores", "compute_scale", "compute_interference", "compute_scale_range", "compute_task_overhead")},
        })
        if with_breakdown:
            row["breakdown"] = breakdown(plan, est, got.steady)
        rows.append(row)
    return rows


def repeat_error(runs: list[list[float]]) -> float | None:
    """How far the benchmark's own measurement moves when it is taken again: the runs split into two
    interleaved halves (odd and even, so both span the same minutes), each half's median kept
    iteration as this benchmark reads a plan, and the one half's error against the other's as if
    it were the estimate. An estimator can do no better against one measurement than the
    measurement does against a second one of the same plan, so over the rows this is the floor
    the accuracy target is read against on this machine. None with fewer than two runs."""
    if len(runs) < 2:
        return None
    halves = [[s for run in runs[start::2] for s in run[1:]] for start in (0, 1)]
    first, second = (statistics.median(half) for half in halves)
    return (first - second) / second


def breakdown(plan: Plan, est: Estimate, steady: list) -> dict[str, Any]:
    """Per device task: estimated compute and span vs the measured span; per device totals."""
    ends: dict[int, float] = {}
    for ev in est.events:
        if ev.stream == "compute":
            ends[ev.task] = max(ends.get(ev.task, 0.0), ev.end)
    tasks, devices = [], []
    for rank in range(plan.tasks.devices):
        own = [t for t in plan.tasks.tasks if t.device == rank]
        previous = 0.0
        for task in own:
            end = ends.get(task.id, previous)
            measured = statistics.median(step.workers[rank].task_seconds.get(task.id, 0.0) for step in steady)
            tasks.append({"device": rank, "task": str(task), "id": task.id,
                          "estimated_compute": task_compute_seconds(task, plan.profile),
                          "estimated_span": end - previous, "measured_span": measured})
            previous = end
        devices.append({"device": rank, "estimated_compute": sum(task_compute_seconds(t, plan.profile) for t in own),
                        "estimated_finish": previous,
                        "measured_tasks": statistics.median(sum(s.workers[rank].task_seconds.values()) for s in steady),
                        "measured_worker": statistics.median(s.workers[rank].seconds for s in steady)})
    host = [t for t in plan.tasks.tasks if t.device == HOST]
    overhead = statistics.median(s.seconds - max(w.seconds for w in s.workers) for s in steady)
    fit = None
    xs, ys = [t["estimated_compute"] for t in tasks], [t["measured_span"] for t in tasks]
    if len(set(xs)) > 1:
        slope, intercept = statistics.linear_regression(xs, ys)
        fit = {"slowdown": slope, "per_task_seconds": intercept}
    return {"tasks": tasks, "devices": devices, "host_tasks": len(host), "fit": fit,
            "host_compute": sum(task_compute_seconds(t, plan.profile) for t in host), "launcher_overhead": overhead}


def print_breakdown(row: dict) -> None:
    b = row["breakdown"]
    table = Table(title=f"{row['model']} {row['mode']}: per task (ms; measured = median span over kept iterations)")
    for col in ("task", "est compute", "est span", "measured", "measured / est span"):
        table.add_column(col, justify="left" if col == "task" else "right", overflow="fold")
    for t in b["tasks"]:
        text = t["task"] if len(t["task"]) <= 90 else t["task"][:87] + "..."
        ratio = t["measured_span"] / t["estimated_span"] if t["estimated_span"] > 0 else float("nan")
        table.add_row(text, f"{t['estimated_compute'] * 1e3:.2f}", f"{t['estimated_span'] * 1e3:.2f}",
                      f"{t['measured_span'] * 1e3:.2f}", f"{ratio:.2f}")
    for d in b["devices"]:
        ratio = d["measured_tasks"] / d["estimated_finish"] if d["estimated_finish"] > 0 else float("nan")
        table.add_row(f"[bold]dev{d['device']} total[/bold] (measured worker: {d['measured_worker'] * 1e3:.2f})",
                      f"{d['estimated_compute'] * 1e3:.2f}", f"{d['estimated_finish'] * 1e3:.2f}",
                      f"{d['measured_tasks'] * 1e3:.2f}", f"{ratio:.2f}")
    console.print(table)
    console.print(f"  host tasks: {b['host_tasks']} (estimated compute {b['host_compute'] * 1e3:.2f} ms); "
                  f"launcher overhead (iteration - slowest worker): {b['launcher_overhead'] * 1e3:.2f} ms")
    if b["fit"]:
        console.print(f"  fit over the device tasks: measured span = {b['fit']['slowdown']:.2f} x estimated compute "
                      f"+ {b['fit']['per_task_seconds'] * 1e3:.2f} ms")


def error_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean and max absolute relative error over measured rows, with and without the runtime's costs."""
    errors = [abs(r["relative_error"]) for r in rows]
    plain = [abs(r["relative_error_without_runtime_costs"]) for r in rows if "relative_error_without_runtime_costs" in r]
    return {"mean": statistics.fmean(errors), "max": max(errors),
            "mean_without_runtime_costs": statistics.fmean(plain) if plain else float("nan"),
            "max_without_runtime_costs": max(plain) if plain else float("nan")}


def _repeat_summary(rows: list[dict[str, Any]]) -> str:
    """The rows' ``repeat_error`` in words; empty where fewer than two runs were taken."""
    repeats = [abs(r["repeat_error"]) for r in rows if r.get("repeat_error") is not None]
    if not repeats:
        return ""
    return (f"the measurement against itself taken again (half the runs against the other half): "
            f"{statistics.fmean(repeats):.1%} mean (max {max(repeats):.1%}); ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="GPT-2 tiny (pp, dp, baseline) and the small GPT-2 (pp)")
    parser.add_argument("--full", action="store_true", help="15 configurations: the best few of the search per mode")
    parser.add_argument("--iterations", type=int, default=6, help="iterations per configuration, the first discarded")
    parser.add_argument("--runs", type=int, default=12,
                        help="fresh runs per configuration, interleaved over the model's configurations "
                             "(default 12: one run of fresh workers can be well off a plan's typical time)")
    parser.add_argument("--breakdown", action="store_true", help="per-task estimated vs measured seconds")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--models", nargs="+", choices=sorted(CASES), metavar="MODEL",
                        help=f"only these models' rows of the sample ({', '.join(sorted(CASES))})")
    ns = parser.parse_args()
    if ns.iterations < 2:
        parser.error("--iterations must be at least 2 (the first is discarded)")
    if ns.runs < 1:
        parser.error("--runs must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    if ns.quick and ns.full:
        parser.error("choose one of --quick and --full")
    sample = [(name, modes, 1) for name, modes in QUICK] if ns.quick else (
        SAMPLE_FULL if ns.full else [(name, modes, 1) for name, modes in FULL])
    if ns.models:
        sample = [entry for entry in sample if entry[0] in ns.models]
        if not sample:
            parser.error(f"none of {', '.join(ns.models)} is in the chosen sample")
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    last_machine = None
    for name, modes, per_mode in sample:
        case = CASES[name]
        with console.status(f"compiling {name} (profile + machine probe)"):
            plans = plans_for(case, modes, per_mode)
        last_machine = next((p.profile.machine for _, p, _, _ in plans if p is not None), last_machine)
        rows += measured_rows_of(name, case, plans, ns.iterations, ns.runs, ns.breakdown)

    table = Table(title=f"Estimated vs measured iteration time, 2 emulated CPU devices, capacity 1/4 of the "
                        f"training footprint, median of {ns.runs} runs x {ns.iterations - 1} iterations after one "
                        f"warm-up each")
    for col in ("model", "mode", "configuration", "estimated ms", "range ms", "measured ms", "rel. error",
                "without runtime costs", "runs (ms)", "measured again", "noise (spread)", "contention", "interpreter"):
        table.add_column(col, justify="left" if col in ("model", "mode", "configuration") else "right",
                         overflow="fold")
    for r in rows:
        if "measured_seconds" not in r:
            estimated = f"{r['estimated_seconds'] * 1e3:.1f}" if "estimated_seconds" in r else "-"
            measured = "run failed" if "failed" in r else "-"
            table.add_row(r["model"], r["mode"], r["configuration"], estimated, "-", measured, "-", "-", "-", "-", "-", "-", "-")
            continue
        span = r.get("estimated_range")
        span_text = (f"{span[0] * 1e3:.1f}-{span[1] * 1e3:.1f}" + ("" if r["within_range"] else " (out)")) if span else "-"
        table.add_row(r["model"], r["mode"], r["configuration"], f"{r['estimated_seconds'] * 1e3:.1f}", span_text,
                      f"{r['measured_seconds'] * 1e3:.1f}", f"{r['relative_error']:+.1%}",
                      f"{r['relative_error_without_runtime_costs']:+.1%}",
                      " / ".join(f"{m * 1e3:.1f}" for m in r["run_medians"]),
                      "-" if r.get("repeat_error") is None else f"{r['repeat_error']:+.1%}", f"{r['spread']:.1%}",
                      f"{r['contention']:.2f}x", " / ".join(f"{x:.2f}x" for x in r["interpreter"]))
    console.print(table)
    measured_rows = [r for r in rows if "relative_error" in r]
    if measured_rows:
        summary = error_summary(measured_rows)
        noise = statistics.median(r["spread"] for r in measured_rows)
        disagree = [r["runs_disagree"] for r in measured_rows]
        contention = statistics.median(r["contention"] for r in measured_rows)
        console.print(f"mean absolute relative error: {summary['mean']:.1%} (max {summary['max']:.1%}) over "
                      f"{len(measured_rows)} configurations; without the runtime's costs: "
                      f"{summary['mean_without_runtime_costs']:.1%} (max {summary['max_without_runtime_costs']:.1%}); "
                      f"machine noise (median spread of the measured iterations): {noise:.1%}; "
                      f"the runs of one plan disagree by {statistics.median(disagree):.1%} (median; max "
                      f"{max(disagree):.1%}), which an exact estimate would still show against a single run; "
                      f"{_repeat_summary(measured_rows)}"
                      f"CPU contention (median, 1.00x = a free core per device): {contention:.2f}x; "
                      f"interpreter-bound speed around the runs (1.00x = its fastest before the profile): "
                      f"{sum(x > machine_drift.SLOW for r in measured_rows for x in r['interpreter'])} of "
                      f"{sum(len(r['interpreter']) for r in measured_rows)} runs beside a reading over "
                      f"{machine_drift.SLOW}x; "
                      f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
                      f"{sum(bool(r.get('within_range')) for r in measured_rows)} of "
                      f"{sum(r.get('within_range') is not None for r in measured_rows)} within the plan's stated range; "
                      f"wall time {time.perf_counter() - started:.0f} s")
    if ns.breakdown:
        for r in measured_rows:
            print_breakdown(r)
        if last_machine is not None:
            sizes = (4 << 10, 256 << 10, 4 << 20)
            real = p2p_seconds(sizes)
            console.print("P2P, one message, ms: " + "; ".join(
                f"{size >> 10} KiB runtime path {real[size] * 1e3:.3f} vs modelled "
                f"{last_machine.transfer_time(size, 'd2d') * 1e3:.3f}" for size in sizes)
                + f" (modelled: probed message cost {(last_machine.p2p_latency or last_machine.latency) * 1e6:.0f} us "
                f"+ bytes / d2d {last_machine.d2d / 1e9:.2f} GB/s, both probed on the runtime's p2p path)")
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=2, default=str))
        console.print(f"rows written to {ns.json}")


if __name__ == "__main__":
    main()
