"""Search time and chosen configuration per model (the paper's Table 1), with analytic profiles.

Mode pp, 4 devices, minibatch 64, on the modelled GTX 1080 Ti server. Decomposition and
profiling are timed apart from the search, as Table 1 times the scheduler alone.

    python -m bench.search_time [--quick]
    python -m bench.search_time --comparison [--quick]

``--comparison`` times what a compile's comparison table costs instead: every per-GPU-swap
baseline searched over its whole ladder of pack counts and coarsely (``search.pack_doublings``),
profiled as ``harmony compile --analytic 1080ti --device-memory 11GiB`` profiles, with the seconds
and the estimate each finds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Iterator

import torch
from rich.console import Console
from rich.table import Table

import harmony
from harmony.decomposer.meta_init import on_meta
from harmony.modelfile import ModelFile, load_model_file
from harmony.profiling.analytic import analytic_profile
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import NoFeasibleConfiguration, search
from harmony.scheduler.modes import MODES

MODELS = Path(__file__).resolve().parents[1] / "models"
PAPER_SECONDS = {"BERT96": 1.4, "GPT-2 1.5B": 0.7, "VGG416": 17.7, "ResNet1K": 31.6}
CASES = [("BERT96", "bert", "96"), ("GPT-2 1.5B", "gpt2", "1.5b"), ("VGG416", "vgg", "vgg416"), ("ResNet1K", "resnet", "resnet1k")]


def _models(names: tuple[str, ...] | None) -> Iterator[tuple[str, ModelFile, torch.nn.Module]]:
    """(name, model file, model built on the meta device, without its initialisers) of each case, or
    of those ``names`` gives."""
    for name, file, preset in CASES:
        if names is not None and name not in names:
            continue
        mf = load_model_file(MODELS / f"{file}.py", {"preset": preset})
        with on_meta():
            model = mf.build_model()
        yield name, mf, model


def search_times(names: tuple[str, ...] | None = None, minibatch: int = 64, devices: int = 4) -> list[dict]:
    """One row per model: layers, decompose / profile / search seconds, Table 1's seconds, the
    configuration chosen and its estimated iteration time."""
    machine = Machine.from_spec("1080ti", devices)
    rows = []
    for name, mf, model in _models(names):
        t0 = time.perf_counter()
        graph = harmony.decompose(model, mf.get_batch(1, 0)[0])
        t1 = time.perf_counter()
        profile = analytic_profile(graph, "1080ti", max_microbatch=minibatch)
        t2 = time.perf_counter()
        result = search(profile, machine, "pp", devices, minibatch)
        t3 = time.perf_counter()
        rows.append({"model": name, "layers": len(graph.layers), "decompose_seconds": t1 - t0,
                     "profile_seconds": t2 - t1, "search_seconds": t3 - t2, "paper_seconds": PAPER_SECONDS[name],
                     "speedup": PAPER_SECONDS[name] / (t3 - t2), "explored": result.explored,
                     "estimated_iteration_seconds": result.estimate.iteration_time, "configuration": str(result.config)})
    return rows


def coarse_against_full(names: tuple[str, ...] | None = None, minibatch: int = 64, devices: int = 4,
                        device_memory: str = "11GiB") -> list[dict]:
    """Per model and per-GPU-swap baseline: seconds and estimate of the whole search and of the
    comparison table's coarse one, on the profile and capacity a compile plans with."""
    from harmony.compiler import CompileOptions, _two_samples, batch_coupled, profile_graph

    rows = []
    for name, mf, model in _models(names):
        graph = harmony.decompose(model, mf.get_batch(2, 0)[0])
        options = CompileOptions(minibatch=minibatch, devices=devices, device_memory=device_memory, analytic="1080ti")
        profile, machine = profile_graph(graph, mf.get_batch, mf.build_optimizer, options)
        planned = int(profile.capacity * (1 - options.memory_margin))
        same_u = bool(batch_coupled(graph, _two_samples(graph, mf.get_batch, minibatch)))
        for mode in (m for m in MODES if m not in ("pp", "dp")):
            row = {"model": name, "mode": mode}
            for kind, coarse in (("full", False), ("coarse", True)):
                start = time.perf_counter()
                try:
                    result = search(profile, machine, mode, devices, minibatch, capacity=planned, same_u=same_u,
                                    coarse=coarse)
                    row[f"{kind}_estimate_s"] = result.estimate.iteration_time
                except NoFeasibleConfiguration:
                    row[f"{kind}_estimate_s"] = None
                row[f"{kind}_search_s"] = time.perf_counter() - start
            rows.append(row)
    return rows


def _print_comparison(rows: list[dict], console: Console) -> None:
    table = Table(title="The comparison table's baselines: whole search against the coarse one")
    for col in ("model", "mode", "full search s", "coarse s", "full estimate s", "coarse estimate s", "slower by"):
        table.add_column(col, justify="left" if col in ("model", "mode") else "right")
    for r in rows:
        full, coarse = r["full_estimate_s"], r["coarse_estimate_s"]
        slower = f"{coarse / full - 1:+.1%}" if full and coarse else "-"
        table.add_row(r["model"], r["mode"], f"{r['full_search_s']:.1f}", f"{r['coarse_search_s']:.1f}",
                      f"{full:.3f}" if full else "does not fit", f"{coarse:.3f}" if coarse else "does not fit", slower)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="GPT-2 1.5B only")
    parser.add_argument("--minibatch", type=int, default=64)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--comparison", action="store_true",
                        help="time the baselines' whole search against the comparison table's coarse one (minutes)")
    ns = parser.parse_args()
    console = Console(width=160)
    if ns.comparison:
        names = ("GPT-2 1.5B",) if ns.quick else ("GPT-2 1.5B", "BERT96")
        _print_comparison(coarse_against_full(names, ns.minibatch, ns.devices), console)
        return
    table = Table(title=f"Search time, mode pp, {ns.devices} x 1080 Ti (analytic), minibatch {ns.minibatch}")
    for col in ("model", "layers", "decompose s", "profile s", "search s", "paper s", "speed-up", "explored", "estimate s", "configuration"):
        table.add_column(col, justify="left" if col in ("model", "configuration") else "right")
    for r in search_times(("GPT-2 1.5B",) if ns.quick else None, ns.minibatch, ns.devices):
        config = r["configuration"]
        table.add_row(
            r["model"], str(r["layers"]), f"{r['decompose_seconds']:.1f}", f"{r['profile_seconds']:.1f}",
            f"{r['search_seconds']:.2f}", f"{r['paper_seconds']}", f"{r['speedup']:.2f}x", str(r["explored"]),
            f"{r['estimated_iteration_seconds']:.2f}", config if len(config) < 70 else config[:67] + "...",
        )
    console.print(table)
    console.print("goal: search at most the paper's Table 1 time, aiming for 10x faster (speed-up ≥ 10x)")


if __name__ == "__main__":
    main()
