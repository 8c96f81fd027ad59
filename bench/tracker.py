"""What the emulated device's memory tracker costs: one forward and backward of a small GPT-2 on one
thread, plain, under an empty ``TorchDispatchMode`` (the price of seeing every op from Python at
all) and under ``MemoryTracker`` (that plus the accounting). Variants are interleaved round by
round and each keeps its best time, so machine load hits all of them alike.

    python -m bench.tracker [--rounds N] [--batch B]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode

from harmony.models import gpt2
from harmony.models.gpt2 import GPT, GPTConfig
from harmony.profiling.measure import torch_threads
from harmony.runtime.memory import MemoryTracker

CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=64)


class _EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "plain": contextlib.nullcontext,
    "empty dispatch mode": _EmptyMode,
    "memory tracker": lambda: MemoryTracker(None, "bench"),
}


def measure(rounds: int = 12, batch: int = 8) -> dict[str, float]:
    """Best seconds of one fwd+bwd per variant."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (batch, CONFIG.block_size + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    best = {name: float("inf") for name in VARIANTS}
    with torch_threads(1):
        for _ in range(rounds):
            for name, make in VARIANTS.items():
                start = time.perf_counter()
                with make():
                    gpt2.loss_fn(model(x), y).backward()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    ns = parser.parse_args()
    best = measure(ns.rounds, ns.batch)
    table = Table(title=f"gpt2 4x128, fwd+bwd of {ns.batch} samples, best of {ns.rounds} interleaved rounds")
    table.add_column("variant")
    table.add_column("ms", justify="right")
    table.add_column("vs plain", justify="right")
    for name, seconds in best.items():
        table.add_row(name, f"{seconds * 1e3:.1f}", f"{seconds / best['plain']:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
