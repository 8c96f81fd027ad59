"""How steady this machine's cores are, by the kind of work: the ceiling on how close any estimate
made before a run can come to it.

An emulated device on a tiny model is interpreter-bound: its layers are tens of small ops, each a
Python call into the dispatcher. This benchmark pins itself to each core in turn and times, back to
back, four fixed loops: pure Python arithmetic, small tensor ops (the interpreter and the
dispatcher, as a tiny model's layers), a 256x256 matrix product (compute-bound) and an 8 MiB fill
and sum (memory-bound), a few repetitions each (their median is one sample), then sleeps a little
and goes again, for ``--seconds``. Per kind and core it prints the median, the share of samples
more than ``SLOW`` times the median and how much slower those are.

On a shared VM the Python and small-op loops can run markedly slower in a share of the samples,
on every core, in spells of one to several seconds, while the matrix product barely moves: a state
of the host (another tenant on the core's sibling thread, most likely, with no steal time showing)
that slows interpreter-bound work alone. A plan's few iterations on GPT-2 tiny take a fraction of a
second and fall in one state or the other, so its measured time moves by that much from one run to
the next, and so does the model's calibration at compile time; GPT-2 small, whose ops are larger,
moves far less.

    python -m bench.machine_drift [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

SLOW = 1.3  # a sample this many times its kind's median on its core counts as slow
REPEATS = 7  # timings per sample; their median is the sample
PAUSE = 0.3  # seconds between samples, so that they spread over the machine's spells


def python_loop() -> None:
    total = 0
    for i in range(20000):
        total += i * i


def _loops() -> dict[str, Callable[[], None]]:
    """The fixed loops, by kind of work (made once: their tensors are not part of the timing)."""
    small = torch.randn(64)
    square = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))

    def small_ops() -> None:
        x = small
        for _ in range(300):
            x = x + small

    def matmul() -> None:
        for _ in range(4):
            square @ square

    def memory() -> None:
        block = torch.empty(8 << 20, dtype=torch.uint8)
        block.fill_(1)
        block.sum()

    return {"python": python_loop, "small ops": small_ops, "matmul": matmul, "memory": memory}


def _sample(fn: Callable[[], None]) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(seconds: float) -> dict[tuple[int, str], list[float]]:
    """Per (core, kind), every sample's seconds, the cores taken in turn until ``seconds`` pass (at
    least once each)."""
    loops = _loops()
    cores = sorted(os.sched_getaffinity(0))
    samples: dict[tuple[int, str], list[float]] = {(c, k): [] for c in cores for k in loops}
    before = os.sched_getaffinity(0)
    try:
        end = time.monotonic() + seconds
        while True:  # at least one pass
            for core in cores:
                os.sched_setaffinity(0, {core})
                for kind, fn in loops.items():
                    samples[core, kind].append(_sample(fn))
            if time.monotonic() >= end:
                break
            time.sleep(PAUSE)
    finally:
        os.sched_setaffinity(0, before)
    return samples


def summary(times: list[float]) -> tuple[float, float, float]:
    """The median, the share of samples over ``SLOW`` times it, and their median over the median."""
    median = statistics.median(times)
    slow = [t for t in times if t > SLOW * median]
    return median, len(slow) / len(times), (statistics.median(slow) / median if slow else 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to sample (default 60)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    console = Console()
    with console.status(f"timing fixed loops on each core for {args.seconds:.0f} s"):
        samples = measure(args.seconds)
    table = Table(title=f"fixed loops per core, {len(next(iter(samples.values())))} samples each "
                        f"(a sample: the median of {REPEATS} timings)")
    for column in ("core", "work", "median ms", f"samples > {SLOW}x median", "slow / median", "max / median"):
        table.add_column(column, justify="left" if column == "work" else "right")
    for (core, kind), times in samples.items():
        median, share, ratio = summary(times)
        table.add_row(str(core), kind, f"{median * 1e3:.3f}", f"{share:.0%}", f"{ratio:.2f}x",
                      f"{max(times) / median:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
