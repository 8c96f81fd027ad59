"""Where a worker's task time goes, beside the profile's compute for the same task: a diagnostic for
the estimator's gap (Fig. 15). The executor's phase methods are wrapped with timers in this process
before the workers fork (nothing in the runtime changes); only the compute thread's time is
counted, per task, averaged over the iterations (the first included). "layers" is the forward
(and recompute) of the pack's layers; what no phase covers is mostly ``backward()``.

    python -m bench.task_phases [--model gpt2-tiny] [--mode pp] [--devices 1|2] [--iterations K]
"""

from __future__ import annotations

import argparse
import functools
import threading
import time
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table

import harmony
from bench.common import from_workers
from bench.estimate_accuracy import CASES, Case, plans_for
from harmony.runtime import executor
from harmony.scheduler.estimator import task_compute_seconds

PHASES = ("_run_layer", "_inputs", "_send", "_pack_state", "_after_backward", "_write_buffers", "_evict_weights",
          "_stream_prefetch", "_finish", "_target")
_TOTALS: dict[tuple[int, str], float] = {}


def _timed(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            if threading.current_thread() is threading.main_thread() and getattr(self, "_bench_task", None) is not None:
                key = (self._bench_task, name)
                _TOTALS[key] = _TOTALS.get(key, 0.0) + time.perf_counter() - start
    return wrapper


def _instrument() -> None:
    """Wrap the executor's phases (each worker's totals are gathered by ``from_workers``)."""
    for name in PHASES:
        setattr(executor.Executor, name, _timed(name, getattr(executor.Executor, name)))
    run_task = executor.Executor._run_task

    def timed_task(self, task):
        self._bench_task = task.id
        return _timed("total", run_task)(self, task)

    executor.Executor._run_task = timed_task


def _plan(case: Case, mode: str, devices: int):
    if devices == 2:
        return plans_for(case, (mode,))[0][1]
    torch.manual_seed(0)
    return harmony.compile(case.build(), case.loss_fn, case.get_batch, minibatch_size=case.minibatch, devices=devices,
                           mode=mode, build_optimizer=case.build_optimizer, probe=False, compare=False)


def measure(model: str, mode: str, devices: int, iterations: int) -> list[dict[str, Any]]:
    """Per device task: the profile's compute and the mean measured ms of each phase."""
    case = CASES[model]
    plan = _plan(case, mode, devices)
    _instrument()
    with from_workers(lambda: [[task, phase, s] for (task, phase), s in _TOTALS.items()]) as workers:
        with harmony.Trainer(plan, optimizer=case.build_optimizer, timeout=120) as trainer:
            for step in range(iterations):
                trainer.step(*case.get_batch(case.minibatch, step))
    totals: dict[tuple[int, str], float] = {}
    for rows in workers:
        totals.update({(task, phase): s for task, phase, s in rows})
    rows = []
    for task in plan.tasks.tasks:
        if task.device < 0:
            continue
        phases = {phase: s / iterations * 1e3 for (tid, phase), s in totals.items() if tid == task.id}
        rows.append({"task": str(task).split(" in:")[0], "profiled_ms": task_compute_seconds(task, plan.profile) * 1e3,
                     **phases})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny", choices=sorted(CASES))
    parser.add_argument("--mode", default="pp")
    parser.add_argument("--devices", type=int, default=2, choices=(1, 2))
    parser.add_argument("--iterations", type=int, default=12)
    ns = parser.parse_args()
    rows = measure(ns.model, ns.mode, ns.devices, ns.iterations)
    table = Table(title=f"{ns.model} {ns.mode} on {ns.devices} device(s): ms per iteration, compute thread")
    for column in ("task", "profiled", "total", "layers", "inputs", "other phases", "unlisted"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for r in rows:
        other = sum(v for k, v in r.items() if k not in ("task", "profiled_ms", "total", "_run_layer", "_inputs"))
        total, layers, inputs = r.get("total", 0.0), r.get("_run_layer", 0.0), r.get("_inputs", 0.0)
        table.add_row(r["task"], f"{r['profiled_ms']:.2f}", f"{total:.2f}", f"{layers:.2f}", f"{inputs:.2f}",
                      f"{other:.2f}", f"{total - layers - inputs - other:.2f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
