"""bf16 against fp32: estimated throughput on modelled GPUs, and the swap volume planned and
counted.

Harmony's bf16 runs every layer under ``torch.autocast`` with float32 masters, gradients and
optimizer state (``runtime/precision.py``): the matmuls run at the bf16 peak. Weights that autocast
only casts (linear layers) move and stay on the devices as bf16 copies (``profiling/casts.py``),
half their bytes: frozen ones always, trainable ones where the host steps them. The search weighs
a device update (float32 weights) against a host one (bf16 weights); the updates column says which
it picked. This benchmark shows both.

    python -m bench.precision [--quick]

Estimated: GPT-2 1.5B and Llama 3.2 1B on 4 modelled H100s (analytic profiles), pp, minibatch 16;
Llama also with its first 12 of 16 blocks frozen (fine-tuning the top). Counted: the tiny GPT-2 on
2 emulated devices, one iteration each, whole and with its first block frozen.
"""

from __future__ import annotations

import argparse
import copy
import functools
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import harmony
from harmony.modelfile import load_model_file
from harmony.models import gpt2
from harmony.compiler import CompileOptions, profile_graph
from harmony.profiling.sweep import training_footprint
from harmony.scheduler.search import NoFeasibleConfiguration, search
from harmony.scheduler.tasks import HOST, Kind

MODELS = Path(__file__).resolve().parents[1] / "models"
# (name, model file, preset, options, prefixes of the parameters frozen)
CASES = [("GPT-2 1.5B", "gpt2", "1.5b", {}, ()), ("Llama 3.2 1B", "llama", "1b", {"seq_len": 1024}, ()),
         ("Llama 3.2 1B, blocks 0-11 frozen", "llama", "1b", {"seq_len": 1024},
          ("model.embed_tokens.", *(f"model.layers.{i}." for i in range(12))))]


def freeze(model: torch.nn.Module, prefixes: tuple[str, ...]) -> torch.nn.Module:
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            p.requires_grad_(False)
    return model


def estimated(cases=CASES, spec: str = "h100", devices: int = 4, minibatch: int = 16) -> list[dict]:
    """Per model and precision: the searched pp plan's estimated iteration and swap bytes."""
    rows = []
    for name, file, preset, extra, frozen in cases:
        mf = load_model_file(MODELS / f"{file}.py", {"preset": preset, **extra})
        with torch.device("meta"):
            model = freeze(mf.build_model(), frozen)
        graph = harmony.decompose(model, mf.get_batch(1, 0)[0])
        for precision in ("fp32", "bf16"):
            # as `harmony compile --analytic` profiles: tied weights counted once, low copies carried
            options = CompileOptions(minibatch=minibatch, devices=devices, device_type="cuda", analytic=spec,
                                     precision=precision)
            profile, machine = profile_graph(graph, mf.get_batch, mf.build_optimizer, options)
            try:
                result = search(profile, machine, "pp", devices, minibatch)
            except NoFeasibleConfiguration as exc:
                rows.append({"model": name, "precision": precision, "error": str(exc)})
                continue
            rows.append({"model": name, "precision": precision, "iteration_s": result.estimate.iteration_time,
                         "samples_per_s": minibatch / result.estimate.iteration_time,
                         "swap_bytes": result.graph.swap_bytes(), "updates": updates_of(result.graph),
                         "config": str(result.config)})
    return rows


def updates_of(graph) -> str:
    """Where a plan steps its weights: "host" (offloaded updates) or "device" (jit or UPD tasks)."""
    return "host" if any(t.kind == Kind.UPD and t.device == HOST for t in graph.tasks) else "device"


def counted(minibatch: int = 8) -> list[dict]:
    """The tiny GPT-2 compiled at each precision, whole and with its first block frozen: swap bytes
    planned and counted in one iteration, and the weights' share of them."""
    get_batch = functools.partial(gpt2.get_batch, preset="tiny")
    rows = []
    for name, frozen in (("gpt2-tiny", ()), ("gpt2-tiny, block 0 frozen", ("h.0.",))):
        torch.manual_seed(0)
        model = freeze(gpt2.build_model("tiny"), frozen)
        capacity = int(0.3 * training_footprint(harmony.decompose(copy.deepcopy(model), get_batch(2, 0)[0]),
                                                get_batch, minibatch))
        for precision in ("fp32", "bf16"):
            plan = harmony.compile(copy.deepcopy(model), gpt2.loss_fn, get_batch, minibatch_size=minibatch,
                                   devices=2, device_memory=capacity, probe=False, precision=precision)
            with harmony.Trainer(plan, timeout=60) as trainer:
                trainer.step(*get_batch(minibatch, 0))
                moved = trainer.history[-1].bytes_by_channel()
            rows.append({"model": name, "precision": precision, "planned": plan.tasks.swap_bytes(),
                         "planned_w": plan.tasks.swap_bytes("W"),
                         "counted": moved.get("SWAP in", 0) + moved.get("SWAP out", 0),
                         "updates": updates_of(plan.tasks), "config": str(plan.tasks.config)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="GPT-2 1.5B only")
    ns = parser.parse_args()
    console = Console(width=160)
    table = Table(title="estimated, pp on 4 modelled H100s (analytic), minibatch 16: bf16 against fp32")
    for col in ("model", "precision", "iteration s", "samples/s", "speedup", "swap GB", "updates", "configuration"):
        table.add_column(col, justify="right")
    rows = estimated(CASES[:1] if ns.quick else CASES)
    base = {r["model"]: r for r in rows if r["precision"] == "fp32" and "error" not in r}
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], r["precision"], "does not fit", *[""] * 5)
            continue
        ref = base.get(r["model"])
        table.add_row(r["model"], r["precision"], f"{r['iteration_s']:.2f}", f"{r['samples_per_s']:.2f}",
                      f"{ref['iteration_s'] / r['iteration_s']:.2f}x" if ref else "-", f"{r['swap_bytes'] / 1e9:.1f}",
                      r["updates"], r["config"])
    console.print(table)
    table = Table(title="2 emulated devices, minibatch 8: swap bytes per iteration")
    for col in ("model", "precision", "planned", "of which weights", "counted", "updates", "configuration"):
        table.add_column(col, justify="right")
    for r in counted():
        table.add_row(r["model"], r["precision"], f"{r['planned']:,}", f"{r['planned_w']:,}", f"{r['counted']:,}",
                      r["updates"], r["config"])
    console.print(table)


if __name__ == "__main__":
    main()
