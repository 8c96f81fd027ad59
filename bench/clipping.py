"""What global-norm gradient clipping costs, estimated on modelled GPUs and measured on emulated
devices.

Harmony clips exactly by waiting: a NORM task on the host takes the global norm once the last
gradient is in, and every update waits for it, so no update is fused into the backward
(``scheduler/taskgraph.with_norm``). The alternative is to step speculatively as the gradients
complete and undo a step when the norm turns out above the threshold (post-validation). Even when
nothing is ever undone, speculation still pays the norm (after the last backward, before the next
iteration can use the weights) and a copy of every stepped weight and state to undo from. So the
unclipped plan plus the NORM task's time is a lower bound of speculation's cost; this benchmark
prints each plan's estimate beside that bound, searched for each setting.

    python -m bench.clipping [--quick]

Estimated: GPT-2 1.5B and BERT-large on 4 modelled GTX 1080 Ti (analytic profiles), minibatch 64.
Measured: the tiny GPT-2 on 2 emulated devices, clipped and unclipped runs interleaved.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import harmony
from bench.common import TINY, compiled, searched, summarize, train
from harmony.modelfile import load_model_file
from harmony.profiling.analytic import analytic_profile
from harmony.scheduler.costs import task_seconds
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import NoFeasibleConfiguration, search
from harmony.scheduler.tasks import Kind

MODELS = Path(__file__).resolve().parents[1] / "models"
CASES = [("GPT-2 1.5B", "gpt2", "1.5b"), ("BERT-large", "bert", "large")]


def estimated(cases=CASES, modes=("pp", "dp"), minibatch: int = 64, devices: int = 4) -> list[dict]:
    """Per model and mode: the estimated iteration without clipping, with it, and speculation's
    lower bound (without clipping plus the NORM task)."""
    machine = Machine.from_spec("1080ti", devices)
    rows = []
    for name, file, preset in cases:
        mf = load_model_file(MODELS / f"{file}.py", {"preset": preset})
        with torch.device("meta"):
            model = mf.build_model()
        graph = harmony.decompose(model, mf.get_batch(1, 0)[0])
        profile = analytic_profile(graph, "1080ti", max_microbatch=minibatch)
        for mode in modes:
            try:
                plain = search(profile, machine, mode, devices, minibatch)
                clipped = search(profile, machine, mode, devices, minibatch, gated=True)
            except NoFeasibleConfiguration as exc:
                rows.append({"model": name, "mode": mode, "error": str(exc)})
                continue
            norm = sum(task_seconds(t, profile, machine) for t in clipped.graph.tasks if t.kind == Kind.NORM)
            rows.append({
                "model": name, "mode": mode, "unclipped_s": plain.estimate.iteration_time,
                "clipped_s": clipped.estimate.iteration_time, "norm_s": norm,
                "speculation_bound_s": plain.estimate.iteration_time + norm,
                "unclipped_config": str(plain.config), "clipped_config": str(clipped.config),
                "clipped_updates": _update_places(clipped.graph),
            })
    return rows


def _update_places(graph) -> str:
    upd = [t for t in graph.tasks if t.kind == Kind.UPD]
    return "host" if upd and all(t.device < 0 for t in upd) else "device" if upd else "-"


def measured(modes=("pp", "dp"), rounds: int = 3, iterations: int = 4, minibatch: int = 8) -> list[dict]:
    """The tiny GPT-2 on 2 emulated devices: median seconds per iteration with and without
    clipping, runs interleaved so that the machine's noise hits both alike; and the NORM task's
    own seconds (from its gradients all in to its end) beside its estimate."""
    model = TINY["gpt2-tiny"]
    base = compiled(model, minibatch)
    rows = []
    for mode in modes:
        plain, _ = searched(base, mode, 2, minibatch)
        clipped, _ = searched(base, mode, 2, minibatch, gated=True)
        clipped.options["clip_grad_norm"] = 1.0
        times: dict[str, list[float]] = {"unclipped": [], "clipped": []}
        norm_seconds: list[float] = []
        for _ in range(rounds):
            times["unclipped"].append(train(plain, iterations=iterations).seconds)
            times["clipped"].append(_train_clipped(clipped, iterations, norm_seconds))
        norm = next(t for t in clipped.tasks.tasks if t.kind == Kind.NORM)
        rows.append({"model": model.name, "mode": mode, **{f"{k}_s": statistics.median(v) for k, v in times.items()},
                     "estimated_unclipped_s": plain.estimate["iteration_time"],
                     "estimated_clipped_s": clipped.estimate["iteration_time"],
                     "norm_s": statistics.median(norm_seconds),
                     "estimated_norm_s": task_seconds(norm, clipped.profile, clipped.profile.machine)})
    return rows


def _train_clipped(plan, iterations: int, norm_seconds: list[float]) -> float:
    """``bench.common.train`` for a plan that clips; the NORM task's seconds of every step after the
    first go to ``norm_seconds``."""
    with harmony.Trainer(plan, optimizer=plan.build_optimizer, timeout=120) as trainer:
        for step in range(iterations):
            trainer.step(*plan.get_batch(plan.tasks.minibatch, step))
        history = list(trainer.history)
    norm_seconds += [end - start for step in history[1:] for _, label, start, end in step.host_events if "NORM" in label]
    return summarize(history, plan.tasks.minibatch).seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="GPT-2 1.5B only, one measured round")
    ns = parser.parse_args()
    console = Console(width=160)
    table = Table(title="estimated iteration, 4 x 1080 Ti (analytic), minibatch 64: clipping's cost")
    for col in ("model", "mode", "unclipped ms", "clipped ms", "ratio", "NORM ms", "speculation >= ms",
                "clipped updates", "configuration (clipped)"):
        table.add_column(col, justify="right")
    for r in estimated(CASES[:1] if ns.quick else CASES):
        if "error" in r:
            table.add_row(r["model"], r["mode"], "does not fit", *[""] * 6)
            continue
        table.add_row(r["model"], r["mode"], f"{r['unclipped_s'] * 1e3:.0f}", f"{r['clipped_s'] * 1e3:.0f}",
                      f"{r['clipped_s'] / r['unclipped_s']:.3f}", f"{r['norm_s'] * 1e3:.1f}",
                      f"{r['speculation_bound_s'] * 1e3:.0f}", r["clipped_updates"], r["clipped_config"])
    console.print(table)
    table = Table(title="measured, gpt2-tiny on 2 emulated devices, minibatch 8 (median of interleaved runs)")
    for col in ("mode", "unclipped ms", "clipped ms", "ratio", "estimated unclipped ms", "estimated clipped ms",
                "NORM ms", "estimated NORM ms"):
        table.add_column(col, justify="right")
    for r in measured(rounds=1 if ns.quick else 3):
        table.add_row(r["mode"], f"{r['unclipped_s'] * 1e3:.1f}", f"{r['clipped_s'] * 1e3:.1f}",
                      f"{r['clipped_s'] / r['unclipped_s']:.3f}", f"{r['estimated_unclipped_s'] * 1e3:.1f}",
                      f"{r['estimated_clipped_s'] * 1e3:.1f}", f"{r['norm_s'] * 1e3:.2f}",
                      f"{r['estimated_norm_s'] * 1e3:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
