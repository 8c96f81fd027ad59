"""What keeping a pack's activations costs on the CPU beyond its layers profiled one microbatch at a
time, in plain PyTorch: no Harmony code runs here.

A pack that keeps its activations runs every microbatch's forward (recording for autograd), then
every microbatch's backward; the profile times each layer's forward and backward one microbatch at a
time, the backward right after its own forward. On the CPU the kept order is slower: the backward
reads activations written several microbatches ago, long out of the caches. The estimator does not
model this (``README.md``, known limits), and this benchmark measures how much it misses.

Rows, on ``--blocks`` GPT-2 blocks (the estimator-accuracy benchmark's width) and ``--microbatches``
microbatches of ``--u`` samples, one thread, each the median of ``--rounds`` rounds interleaved:

- a forward without autograd of every microbatch (what a recompute-only pack's forward runs);
- per microbatch, a forward recording for autograd and its backward at once (the profile's order);
- every microbatch's forward recording for autograd, then every backward (a kept pack's order).

    python -m bench.kept_order [--blocks 2] [--microbatches 6] [--u 3] [--rounds 9] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console

from harmony.models.gpt2 import Block, GPTConfig

CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=64)  # bench.estimate_accuracy's


def orders(blocks: torch.nn.Module, xs: list[torch.Tensor]) -> dict[str, Callable[[], None]]:
    """The three orders of the module docs, as functions of no argument."""

    def forward_only() -> None:
        with torch.no_grad():
            for x in xs:
                blocks(x)

    def each_at_once() -> None:
        for x in xs:
            y = blocks(x.detach().requires_grad_())
            y.backward(torch.ones_like(y))

    def kept() -> None:
        outs = [blocks(x.detach().requires_grad_()) for x in xs]
        for y in outs:
            y.backward(torch.ones_like(y))

    return {"forward without autograd": forward_only, "forward and backward per microbatch": each_at_once,
            "all forwards, then all backwards (kept)": kept}


def measure(rows: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds of each row over ``rounds`` interleaved rounds, after one warm-up each."""
    for run in rows.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, run in rows.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def markdown(seconds: dict[str, float], command: str, args: argparse.Namespace) -> str:
    base = seconds["forward and backward per microbatch"]
    lines = ["# Kept order against the profile's order on the CPU", "",
             f"Measured {datetime.date.today().isoformat()} on torch {torch.__version__}: `{command}` "
             f"({args.blocks} GPT-2 blocks of width {CONFIG.n_embd}, {args.microbatches} microbatches of {args.u} "
             f"samples at {CONFIG.block_size} tokens, one thread, median of {args.rounds} interleaved rounds)", "",
             "| order | ms | against forward and backward per microbatch |", "|---|---:|---:|"]
    lines += [f"| {name} | {s * 1e3:.1f} | {s / base:.2f} |" for name, s in seconds.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=6)
    parser.add_argument("--u", type=int, default=3, help="samples a microbatch")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, help="write the table as markdown here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[Block(CONFIG) for _ in range(args.blocks)])
    xs = [torch.randn(args.u, CONFIG.block_size, CONFIG.n_embd) for _ in range(args.microbatches)]
    seconds = measure(orders(blocks, xs), args.rounds)
    command = " ".join(["python -m bench.kept_order", *(sys.argv[1:] if argv is None else argv)])
    text = markdown(seconds, command, args)
    Console().print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
