"""What starting the workers costs by start method: a ``Trainer`` for a tiny GPT-2 plan on two
emulated devices, built and closed, with workers forked, taken from the fork server (what a
process whose autograd cannot survive a fork gets: ``runtime/processes.py``) and spawned. Methods
are interleaved round by round and each keeps its best time, so machine load hits all alike; the
fork server's first start (it imports torch once per process) is reported apart.

    python -m bench.start_methods [--rounds N]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
from rich.console import Console
from rich.table import Table

import harmony
from harmony.models import gpt2
from harmony.runtime import processes

METHODS = ("fork", "forkserver", "spawn")


def _plan():
    torch.manual_seed(0)
    model = gpt2.build_model("tiny")
    get_batch = functools.partial(gpt2.get_batch, preset="tiny")
    return harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=8, devices=2, device_memory=4 << 20,
                           probe=False)


def _start_seconds(plan, method: str) -> float:
    os.environ[processes.START_METHOD] = method
    begin = time.perf_counter()
    harmony.Trainer(plan).close()
    return time.perf_counter() - begin


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every method (default 3)")
    args = parser.parse_args(argv)
    plan = _plan()
    first_server = _start_seconds(plan, "forkserver")
    best = {m: float("inf") for m in METHODS}
    for _ in range(args.rounds):
        for method in METHODS:
            best[method] = min(best[method], _start_seconds(plan, method))
    os.environ.pop(processes.START_METHOD, None)
    table = Table(title=f"Trainer start and close, 2 emulated devices (torch {torch.__version__}, best of {args.rounds})")
    table.add_column("start method")
    table.add_column("seconds", justify="right")
    table.add_column("x fork", justify="right")
    for method in METHODS:
        table.add_row(method, f"{best[method]:.3f}", f"{best[method] / best['fork']:.1f}")
    table.add_row("forkserver, its first start", f"{first_server:.3f}", f"{first_server / best['fork']:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
