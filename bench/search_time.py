"""Search time and chosen configuration per model (the paper's Table 1), with analytic profiles.

Mode pp, 4 devices, minibatch 64, on the modelled GTX 1080 Ti server. Decomposition and
profiling are timed apart from the search, as Table 1 times the scheduler alone.

    python -m bench.search_time [--quick]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import harmony
from harmony.modelfile import load_model_file
from harmony.scheduler.analytic import analytic_profile
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import search

MODELS = Path(__file__).resolve().parents[1] / "models"
PAPER_SECONDS = {"BERT96": 1.4, "GPT-2 1.5B": 0.7, "VGG416": 17.7, "ResNet1K": 31.6}
CASES = [("BERT96", "bert", "96"), ("GPT-2 1.5B", "gpt2", "1.5b"), ("VGG416", "vgg", "vgg416"), ("ResNet1K", "resnet", "resnet1k")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="GPT-2 1.5B only")
    parser.add_argument("--minibatch", type=int, default=64)
    parser.add_argument("--devices", type=int, default=4)
    ns = parser.parse_args()
    console = Console(width=160)
    table = Table(title=f"Search time, mode pp, {ns.devices} x 1080 Ti (analytic), minibatch {ns.minibatch}")
    for col in ("model", "layers", "decompose s", "profile s", "search s", "paper s", "speed-up", "explored", "estimate s", "configuration"):
        table.add_column(col, justify="left" if col in ("model", "configuration") else "right")
    machine = Machine.from_spec("1080ti", ns.devices)
    for name, file, preset in CASES[1:2] if ns.quick else CASES:
        mf = load_model_file(MODELS / f"{file}.py", {"preset": preset})
        with torch.device("meta"):
            model = mf.build_model()
        t0 = time.perf_counter()
        graph = harmony.decompose(model, mf.get_batch(1, 0)[0])
        t1 = time.perf_counter()
        profile = analytic_profile(graph, "1080ti", max_microbatch=ns.minibatch)
        t2 = time.perf_counter()
        result = search(profile, machine, "pp", ns.devices, ns.minibatch)
        t3 = time.perf_counter()
        config = str(result.config)
        table.add_row(
            name, str(len(graph.layers)), f"{t1 - t0:.1f}", f"{t2 - t1:.1f}", f"{t3 - t2:.2f}", f"{PAPER_SECONDS[name]}",
            f"{PAPER_SECONDS[name] / (t3 - t2):.2f}x", str(result.explored), f"{result.estimate.iteration_time:.2f}",
            config if len(config) < 70 else config[:67] + "...",
        )
    console.print(table)
    console.print("goal: search at most the paper's Table 1 time, aiming for 10x faster (speed-up ≥ 10x)")


if __name__ == "__main__":
    main()
