"""What a worker's stream threads cost its compute thread: a GPT-2 block's forward and backward on
an emulated device (``profiler.measure_pack``, under the memory tracker, one thread), alone and
beside a busy neighbour copying 1 MiB tensors back to back:

- in the same process through the tracker's dispatch mode (what a stream thread's copy was before
  ``MemoryTracker.paused`` skipped Python dispatch),
- in the same process through ``CpuDevice.to_device`` (the guarded copy the runtime makes now),
- in the same process as a plain ``clone`` (no tracker at all),
- in another process (what the memory bus alone costs).

The interpreter lock is the difference between the in-process and the other-process rows. Variants
are interleaved round by round and each keeps its median over rounds (ratios within one run).

    python -m bench.stream_gil [--preset tiny|small] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Callable

import torch
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from harmony.models.gpt2 import GPT, GPTConfig
from harmony.profiling.measure import torch_threads
from harmony.runtime.device import CpuDevice
from harmony.profiling.measure import measure_pack

PRESETS = {
    "tiny": (GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=32), 4),
    "small": (GPTConfig(n_layer=1, n_head=4, n_embd=128, vocab_size=512, block_size=64), 6),
}
COPY_BYTES = 1 << 20


def _copy_through_tracker(device: CpuDevice, src: torch.Tensor, stop: threading.Event) -> None:
    with device.memory_scope():
        while not stop.is_set():
            src.clone()


def _copy_guarded(device: CpuDevice, src: torch.Tensor, stop: threading.Event) -> None:
    with device.memory_scope():
        while not stop.is_set():
            device.to_device(src)


def _copy_plain(device: CpuDevice, src: torch.Tensor, stop) -> None:
    while not stop.is_set():
        src.clone()


NEIGHBOURS: dict[str, Callable | None] = {
    "alone": None,
    "thread copying through the tracker": _copy_through_tracker,
    "thread copying through to_device": _copy_guarded,
    "thread copying, no tracker": _copy_plain,
    "another process copying": _copy_plain,
}


def _block_ms(block: torch.nn.Module, x: torch.Tensor, device: CpuDevice) -> tuple[float, float]:
    m, _ = measure_pack([block], (x,), device, trials=10, backward=True)
    return m.fwd_time * 1e3, (m.recompute_time + m.bwd_time) * 1e3


def _with_neighbour(name: str, block: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    device = CpuDevice("bench")
    src = torch.randn(COPY_BYTES // 4)
    copy = NEIGHBOURS[name]
    if copy is None:
        return _block_ms(block, x, device)
    if name.startswith("another process"):
        ctx = mp.get_context("fork")
        stop = ctx.Event()
        neighbour = ctx.Process(target=copy, args=(device, src, stop), daemon=True)
    else:
        stop = threading.Event()
        neighbour = threading.Thread(target=copy, args=(device, src, stop), daemon=True)
    neighbour.start()
    time.sleep(0.05)
    try:
        return _block_ms(block, x, device)
    finally:
        stop.set()
        neighbour.join(timeout=10)


def measure(preset: str, rounds: int) -> dict[str, tuple[float, float]]:
    """Per neighbour, the median forward and backward milliseconds of the block over ``rounds``."""
    config, batch = PRESETS[preset]
    torch.manual_seed(0)
    block = GPT(config).h[0]
    x = torch.randn(batch, config.block_size, config.n_embd)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in NEIGHBOURS}
    with torch_threads(1):
        for _ in range(rounds):
            for name in NEIGHBOURS:
                times[name].append(_with_neighbour(name, block, x))
    return {name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
            for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    result = measure(ns.preset, ns.rounds)
    fwd0, bwd0 = result["alone"]
    table = Table(title=f"gpt2 block ({ns.preset}) under the tracker, median of {ns.rounds} interleaved rounds")
    for column in ("neighbour", "fwd ms", "vs alone", "bwd ms", "vs alone"):
        table.add_column(column, justify="left" if column == "neighbour" else "right")
    for name, (fwd, bwd) in result.items():
        table.add_row(name, f"{fwd:.2f}", f"{fwd / fwd0:.2f}x", f"{bwd:.2f}", f"{bwd / bwd0:.2f}x")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
