"""Throughput of every mode over minibatch sizes (the paper's Fig. 10).

Estimated: BERT96, GPT-2 1.5B, VGG416 and ResNet1K on 4 modelled GTX 1080 Ti (analytic profiles),
every mode searched per minibatch; throughput (samples/s of the estimated iteration) is normalized
as the paper does, against ``dp-swap`` at the smallest minibatch. The per-GPU-swap baselines'
searches walk every pack count and their graphs have a task per microbatch and pack, which makes
them slow for 50-400 layers; to bound the benchmark's time their microbatch sizes are limited to
``BASELINE_SIZES``: one sample per microbatch, the paper's setting for them (per-GPU memory
virtualization of these models leaves room for no more, §3). Harmony's modes search the full ladder.

Swap volume (Fig. 11) comes with it: the GPT-2 1.5B rows carry their plans' host<->device bytes
per minibatch, and the measured rows carry the bytes the runtime counted beside the plan's.

Measured: every mode on 2 emulated CPU devices for the tiny presets (each device a quarter of the
training footprint), the searched plan trained for a few iterations (first left out), modes
interleaved round by round.

    python -m bench.throughput [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

import harmony
from bench.common import TINY, compiled, searched, train
from harmony.errors import HarmonyError
from harmony.modelfile import load_model_file
from harmony.profiling.analytic import analytic_profile
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import NoFeasibleConfiguration, search
from harmony.scheduler.modes import MODES

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
BIG = {"BERT96": ("bert", "96"), "GPT-2 1.5B": ("gpt2", "1.5b"), "VGG416": ("vgg", "vgg416"),
       "ResNet1K": ("resnet", "resnet1k")}
ESTIMATED_MODES = ("pp", "dp", "dp-swap", "gpipe-swap-r", "1f1b-swap-r")
BASELINE_SIZES = (1,)
# the baselines' searches on VGG416 and ResNet1K (hundreds of layers, a task per layer pack and
# sample) take minutes at larger minibatches: they get the smaller sizes, to stay in the time budget
MINIBATCHES = {"GPT-2 1.5B": (16, 32, 64), "BERT96": (16, 32, 64), "VGG416": (8, 16), "ResNet1K": (8, 16)}
QUICK_MINIBATCHES = {"GPT-2 1.5B": (16, 32)}


def big_profile(name: str, max_microbatch: int):
    """The analytic 1080 Ti profile of one of the paper's models (built on the meta device)."""
    file, preset = BIG[name]
    mf = load_model_file(MODELS_DIR / f"{file}.py", {"preset": preset})
    with torch.device("meta"):
        model = mf.build_model()
    graph = harmony.decompose(model, mf.get_batch(1, 0)[0])
    return analytic_profile(graph, "1080ti", max_microbatch=max_microbatch)


def baseline_sizes(limit: int) -> list[int]:
    return [u for u in BASELINE_SIZES if u <= limit] or [1]


def estimated(minibatches: dict[str, tuple[int, ...]], modes: tuple[str, ...] = ESTIMATED_MODES,
              devices: int = 4, budget_s: float | None = None) -> list[dict[str, Any]]:
    """One row per (model, mode, minibatch): estimated iteration time, throughput and swap volume.
    Models in the order given, each over its minibatches from the smallest (its normalization);
    rows past ``budget_s`` seconds are marked skipped."""
    machine = Machine.from_spec("1080ti", devices)
    rows = []
    started = time.perf_counter()
    for name, sizes in minibatches.items():
        profile = big_profile(name, max(sizes))
        for d in sorted(sizes):
            for mode in modes:
                row: dict[str, Any] = {"model": name, "mode": mode, "minibatch": d, "devices": devices}
                if budget_s is not None and time.perf_counter() - started > budget_s:
                    rows.append({**row, "error": "skipped: the benchmark's time bound was reached"})
                    continue
                options = {} if mode in ("pp", "dp") else {"sizes": baseline_sizes}
                t0 = time.perf_counter()
                try:
                    result = search(profile, machine, mode, devices, d, **options)
                except NoFeasibleConfiguration:
                    rows.append({**row, "error": "does not fit"})
                    continue
                seconds = result.estimate.iteration_time
                rows.append({**row, "iteration_seconds": seconds, "samples_per_second": d / seconds,
                             "swap_bytes": result.graph.swap_bytes(), "configuration": str(result.config),
                             "search_seconds": time.perf_counter() - t0})
    normalize(rows)
    return rows


def normalize(rows: list[dict[str, Any]]) -> None:
    """``normalized``: throughput over dp-swap's at the smallest minibatch of the same model."""
    for name in {r["model"] for r in rows}:
        own = [r for r in rows if r["model"] == name]
        smallest = min(r["minibatch"] for r in own)
        ref = next((r.get("samples_per_second") for r in own if r["mode"] == "dp-swap" and r["minibatch"] == smallest), None)
        for r in own:
            if ref and "samples_per_second" in r:
                r["normalized"] = r["samples_per_second"] / ref


def measured(models: tuple[str, ...], minibatch: int = 8, devices: int = 2, iterations: int = 4,
             rounds: int = 1, modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    """Every mode trained on emulated CPU devices; one row per (model, mode)."""
    rows = []
    for name in models:
        base = compiled(TINY[name], minibatch, devices=devices)
        plans = {}
        for mode in modes:
            try:
                plans[mode] = searched(base, mode, devices, minibatch)[0]
            except NoFeasibleConfiguration:
                plans[mode] = None
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        failed: dict[str, str] = {}
        swapped: dict[str, int] = {}
        for _ in range(rounds):
            for mode, plan in plans.items():
                if plan is None or mode in failed:
                    continue
                try:
                    run = train(plan, iterations=iterations)
                except HarmonyError as exc:
                    failed[mode] = f"{type(exc).__name__}: {exc}"
                    continue
                times[mode] += run.iterations[1:]
                swapped[mode] = run.swap_bytes
        for mode, plan in plans.items():
            row: dict[str, Any] = {"model": name, "mode": mode, "minibatch": minibatch, "devices": devices}
            if plan is None:
                rows.append({**row, "error": "does not fit"})
            elif mode in failed:
                rows.append({**row, "error": failed[mode]})
            else:
                seconds = statistics.median(times[mode])
                rows.append({**row, "iteration_seconds": seconds, "samples_per_second": minibatch / seconds,
                             "estimated_seconds": plan.estimate["iteration_time"], "configuration": str(plan.tasks.config),
                             "planned_swap_bytes": plan.tasks.swap_bytes(), "measured_swap_bytes": swapped[mode]})
    for name in models:
        own = [r for r in rows if r["model"] == name]
        ref = next((r.get("samples_per_second") for r in own if r["mode"] == "dp-swap"), None)
        for r in own:
            if ref and "samples_per_second" in r:
                r["normalized"] = r["samples_per_second"] / ref
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args()
    console = Console(width=160)
    for r in estimated(QUICK_MINIBATCHES if ns.quick else MINIBATCHES):
        console.print(r)
    for r in measured(("gpt2-tiny",) if ns.quick else tuple(TINY)):
        console.print(r)


if __name__ == "__main__":
    main()
