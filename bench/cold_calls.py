"""What slows a layer's call on an emulated device beyond its profile: the call timed back to back (as
the profiler times it) against the same call after a pause in which something else ran.

Inside the runtime's workers a layer's first call of a microbatch takes longer than an immediate
repeat of it (bench/results/estimate_accuracy.md), and the profile, read back to back, has the
repeat's speed. This benchmark reproduces the pause outside the runtime, on ResNet tiny's first
three layers (a convolutional stem and two residual stages, u = 3), one process pinned to core 0,
per condition:

- ``back to back``: the profiler's way;
- ``after a 1 ms sleep``: the thread leaves the core and comes back;
- ``after a 1 ms sleep, neighbour: Python``, ``copies`` or ``GPT-2``: the same, while a second
  process pinned to the same core runs pure Python, large tensor copies, or GPT-2 tiny's forward
  (another model's torch code), so that it runs in the pause.

Each figure is the median thread CPU time of the call (``time.thread_time``: what the thread itself
spent, not its wait for the core). A sleep alone costs the call a little, a Python or copying
neighbour little more, and a neighbour running another model's torch code much more: code and data
of the other model replace the layer's in the core's caches and predictors. In the runtime's workers
the first-call cost stays with the compute thread alone on its core (every other thread and process
on the other one), so there the cause is the worker's own code between calls (see the results file),
not co-scheduling.

    python -m bench.cold_calls [--calls N]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table
from torch.func import functional_call

from harmony.decomposer.decompose import decompose
from harmony.models import gpt2, resnet
from harmony.profiling.measure import measure_layer
from harmony.runtime.device import CpuDevice

PAUSE = 1e-3  # seconds the timed thread sleeps before each call of a paused condition
CORE = 0  # the core both processes are pinned to
NEIGHBOURS = ("Python", "copies", "GPT-2")

console = Console()


def _layers(count: int = 3, u: int = 3) -> list[Callable[[], object]]:
    """ResNet tiny's first ``count`` layers as calls on their own inputs (u samples)."""
    torch.manual_seed(0)
    model = resnet.build_model("tiny")
    x, _ = resnet.get_batch(u, 0)
    graph = decompose(model, (x,))
    calls, values = [], (x,)
    for module in graph.modules[:count]:
        state = {k: v.detach().clone() for k, v in [*module.named_parameters(), *module.named_buffers()]}
        calls.append(_call_of(module, state, values))
        values = measure_layer(module, values, CpuDevice("feed"), trials=0, backward=False)[1]  # as the profiler feeds
    return calls


def _call_of(module: torch.nn.Module, state: dict[str, torch.Tensor], values: tuple) -> Callable[[], object]:
    def call():
        with torch.no_grad():
            return functional_call(module, state, values, tie_weights=False)
    return call


def _neighbour(kind: str, stop, ready) -> None:
    """Runs ``kind`` of work on ``CORE`` until ``stop`` is set."""
    os.sched_setaffinity(0, {CORE})
    torch.set_num_threads(1)
    if kind == "GPT-2":
        model = gpt2.build_model("tiny")
        tokens, _ = gpt2.get_batch(2, 0)
        work = lambda: model(tokens)  # noqa: E731
    elif kind == "copies":
        a, b = torch.empty(1 << 20), torch.empty(1 << 20)
        work = lambda: b.copy_(a)  # noqa: E731
    else:
        work = lambda: sum(i * i for i in range(1000))  # noqa: E731
    with torch.no_grad():
        work()
        ready.set()
        while not stop.is_set():
            work()


def _median_cpu(call: Callable[[], object], calls: int, pause: float) -> float:
    """Median thread CPU seconds of ``call``, each after ``pause`` seconds of sleep (none: back to back)."""
    times = []
    for _ in range(calls):
        if pause:
            time.sleep(pause)
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return statistics.median(times[len(times) // 8:])


def measure(calls: int) -> dict[str, list[float]]:
    """Per condition, each layer's median CPU seconds a call; the process's cores and torch threads
    are given back after."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {CORE})
    torch.set_num_threads(1)
    try:
        return _conditions(calls)
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def _conditions(calls: int) -> dict[str, list[float]]:
    layers = _layers()
    out = {"back to back": [_median_cpu(c, calls, 0.0) for c in layers],
           "after a 1 ms sleep": [_median_cpu(c, calls, PAUSE) for c in layers]}
    ctx = multiprocessing.get_context("fork")
    for kind in NEIGHBOURS:
        stop, ready = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_neighbour, args=(kind, stop, ready), daemon=True)
        proc.start()
        try:
            if not ready.wait(timeout=60):  # measured without it, the row would say nothing about a neighbour
                raise RuntimeError(f"the {kind} neighbour process did not start within 60 s "
                                   f"(exit code {proc.exitcode}); rerun when the machine is less loaded")
            out[f"after a 1 ms sleep, neighbour: {kind}"] = [_median_cpu(c, calls, PAUSE) for c in layers]
        finally:
            stop.set()
            proc.join(timeout=10)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=40, help="timed calls per layer and condition")
    ns = parser.parse_args()
    if ns.calls < 8:
        parser.error("--calls must be at least 8")
    with console.status("timing ResNet tiny's first three layers"):
        result = measure(ns.calls)
    base = result["back to back"]
    table = Table(title=f"ResNet tiny layers at u = 3, median CPU ms a call (x back to back), pinned to core {CORE}")
    table.add_column("condition")
    for k in range(len(base)):
        table.add_column(f"layer {k}", justify="right")
    for condition, times in result.items():
        table.add_row(condition, *(f"{t * 1e3:.3f} ({t / b:.2f}x)" for t, b in zip(times, base)))
    console.print(table)


if __name__ == "__main__":
    main()
