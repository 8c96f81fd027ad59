"""How long a worker's stream jobs wait for their thread: from ``Stream.submit`` to the job's start,
per device and stream, while a real plan trains (a diagnostic for the runtime's thread hand-offs).

On two cores with both emulated devices computing, a woken stream thread waits for a core and then
for the interpreter lock; a job on a consumer's path (a message, a prefetched input) pays that wait
in the iteration. ``Stream.submit`` is wrapped in this process before the workers fork (nothing in
the runtime changes). Jobs run on the calling thread (``Stream.run_here``: an emulated device's P2P
sends) wait for nothing and are not counted. The model is by default the README's first command's
(GPT-2 tiny, minibatch 16, two emulated devices, pp), or another of ``bench.estimate_accuracy``'s
(``--model``), compiled afresh with the machine probed.

    python -m bench.stream_lag [--iterations K] [--mode pp|dp|dp-swap] [--model NAME]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table

import harmony
from bench.common import from_workers
from bench.estimate_accuracy import CASES
from harmony.runtime import streams

_LAGS: dict[str, list[float]] = {}  # a worker's waits by stream name, filled in the worker


def _timing_submit(original: Callable) -> Callable:
    """``Stream.submit`` that records each job's wait (start minus submission) under its stream."""
    def submit(self: streams.Stream, fn: Callable[..., Any], *args: Any, label: str | None = None,
               task: int | None = None):
        submitted = time.perf_counter()

        def timed(*inner: Any) -> Any:
            _LAGS.setdefault(self.name, []).append(time.perf_counter() - submitted)
            return fn(*inner)

        return original(self, timed, *args, label=label, task=task)
    return submit


def measure(iterations: int, mode: str, model: str = "gpt2-tiny") -> dict[str, list[float]]:
    """Each stream's job waits (seconds) over ``iterations`` of ``model``'s plan in ``mode``."""
    case = CASES[model]
    torch.manual_seed(0)
    plan = harmony.compile(case.build(), case.loss_fn, case.get_batch, minibatch_size=case.minibatch, devices=2,
                           mode=mode, build_optimizer=case.build_optimizer, probe=True, compare=False)
    original = streams.Stream.submit
    streams.Stream.submit = _timing_submit(original)
    try:
        with from_workers(lambda: _LAGS) as workers:
            with harmony.Trainer(plan, optimizer=case.build_optimizer, loss_fn=case.loss_fn) as trainer:
                for step in range(iterations):
                    trainer.step(*case.get_batch(case.minibatch, step))
    finally:
        streams.Stream.submit = original
    lags: dict[str, list[float]] = {}
    for worker in workers:
        for stream, waits in worker.items():
            lags.setdefault(stream, []).extend(waits)
    return lags


def table(lags: dict[str, list[float]], iterations: int) -> Table:
    out = Table(title=f"Stream jobs' wait from submission to start ({iterations} iterations, ms)")
    for col in ("stream", "jobs", "median", "90th percentile", "max", "per iteration"):
        out.add_column(col, justify="left" if col == "stream" else "right")
    for stream, waits in sorted(lags.items()):
        ordered = sorted(waits)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        out.add_row(stream, str(len(waits)), f"{statistics.median(waits) * 1e3:.3f}", f"{p90 * 1e3:.3f}",
                    f"{ordered[-1] * 1e3:.3f}", f"{sum(waits) / iterations * 1e3:.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20, help="iterations to train (default 20)")
    parser.add_argument("--mode", default="pp", choices=("pp", "dp", "dp-swap"), help="the plan's mode (default pp)")
    parser.add_argument("--model", default="gpt2-tiny", choices=sorted(CASES),
                        help="the model, one of bench.estimate_accuracy's (default gpt2-tiny, the README's)")
    ns = parser.parse_args()
    Console().print(table(measure(ns.iterations, ns.mode, ns.model), ns.iterations))


if __name__ == "__main__":
    main()
