"""Host<->device swap volume per iteration by mode and minibatch size (the paper's Fig. 11).

GPT-2 1.5B on four modelled GTX 1080 Ti (11 GB, PCIe 3) with analytic profiles: every mode's
configuration is searched, and the swap volume of the chosen task graph is reported with its
ratio to Harmony PP's. Goal: dp-swap at least 100x pp at minibatch 64 and above. "dp-swap u=1"
is the paper's setting (one sample per microbatch); plain "dp-swap" is searched like pp.

    python -m bench.swap_volume [--quick]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import harmony
from harmony.modelfile import load_model_file
from harmony.profiling.analytic import analytic_profile
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import NoFeasibleConfiguration, search

MODELS = Path(__file__).resolve().parents[1] / "models"
MODES = ("pp", "dp", "dp-swap", "dp-swap u=1", "gpipe-swap-r", "1f1b-swap-r")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="minibatch 64 only")
    ns = parser.parse_args()
    minibatches = (64,) if ns.quick else (64, 128, 256)
    mf = load_model_file(MODELS / "gpt2.py", {"preset": "1.5b"})
    with torch.device("meta"):
        model = mf.build_model()
    graph = harmony.decompose(model, mf.get_batch(1, 0)[0])
    profile = analytic_profile(graph, "1080ti", max_microbatch=max(minibatches))
    machine = Machine.from_spec("1080ti", 4)
    table = Table(title="GPT-2 1.5B, 4 x 1080 Ti (analytic): swap volume per iteration, GB (ratio to pp)")
    table.add_column("minibatch", justify="right")
    for mode in MODES:
        table.add_column(mode, justify="right")
    for d in minibatches:
        volumes = {}
        for mode in MODES:
            name, _, fixed = mode.partition(" u=")
            sizes = {"sizes": (lambda limit, u=int(fixed): [u])} if fixed else {}
            try:
                volumes[mode] = search(profile, machine, name, 4, d, **sizes).graph.swap_bytes()
            except NoFeasibleConfiguration:
                volumes[mode] = None
        base = volumes["pp"]
        table.add_row(str(d), *[
            "does not fit" if volumes[m] is None else f"{volumes[m] / 1e9:.1f} ({volumes[m] / base:.0f}x)" for m in MODES
        ])
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
