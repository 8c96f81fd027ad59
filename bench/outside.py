"""Models Harmony's own tests did not write, trained against eager PyTorch: the runner and the
report that ``bench.hf_models`` (Hugging Face) and ``bench.tv_models`` (torchvision) share.

A case is built in float64 with nothing random in its forward, compiled at a third of its
training footprint on two emulated devices, and trained two steps in a mode. Its row says how far
the losses and parameters are from eager's on the same microbatches and how close each device came
to its capacity; a case that fails is a row with its error.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train
from rich.console import Console
from rich.table import Table
from torch import nn

import harmony

DEVICES, STEPS = 2, 2
Case = tuple[Callable[[], nn.Module], Callable[[int, int], tuple], Callable]


def adam(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def run(name: str, case: Callable[[], Case], mode: str, minibatch: int, fraction: float = 1 / 3) -> dict[str, Any]:
    """One case in one mode at ``fraction`` of its training footprint: the worst relative errors
    against eager, and the peaks."""
    start = time.perf_counter()
    row: dict[str, Any] = {"model": name, "mode": mode}
    try:
        build, get_batch, loss_fn = case()
        model = build()
        graph = harmony.decompose(copy.deepcopy(model), get_batch(2, 0)[0])
        capacity = int(fraction * training_footprint(graph, get_batch, minibatch))
        plan = harmony.compile(model, loss_fn, get_batch, minibatch_size=minibatch, devices=DEVICES, mode=mode,
                               device_type="cpu", device_memory=capacity, build_optimizer=adam, probe=False)
        batches = [get_batch(minibatch, step) for step in range(STEPS)]
        reference = copy.deepcopy(model)
        with harmony.Trainer(plan, optimizer=adam, timeout=120) as trainer:
            losses = [trainer.step(inputs, target) for inputs, target in batches]
            state = trainer.state_dict()
            peaks = [max(w.peak for w in step.workers) for step in trainer.history]
        expected = reference_train(reference, plan.loss_fn, adam, batches, microbatches_of(plan.tasks))
        row.update(config=str(plan.tasks.config), capacity=capacity, peak=max(peaks), u_min=plan.profile.u_min,
                   loss_error=max(abs(a - b) / abs(b) for a, b in zip(losses, expected)),
                   param_error=_worst_parameter(reference.state_dict(), state))
    except Exception as exc:  # noqa: BLE001 - a failing case is a row, not the end of the run
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    row["seconds"] = time.perf_counter() - start
    return row


def _worst_parameter(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """The largest difference over every floating tensor of the state, relative to its largest
    value (at least 1e-3: running means of zero-mean activations are ~1e-17, all rounding)."""
    worst = 0.0
    for name, w in want.items():
        if w.is_floating_point():
            scale = float(w.abs().max().clamp_min(1e-3))
            worst = max(worst, float((got[name].double() - w.double()).abs().max()) / scale)
    return worst


def table(rows: list[dict[str, Any]], title: str) -> Table:
    out = Table(title=title)
    for col in ("model", "mode", "loss error", "parameter error", "peak / capacity", "s", "configuration or error"):
        out.add_column(col, justify="left" if col in ("model", "mode", "configuration or error") else "right")
    for r in rows:
        if "error" in r:
            out.add_row(r["model"], r["mode"], "-", "-", "-", f"{r['seconds']:.0f}", f"[red]{_short(r['error'])}[/]")
            continue
        out.add_row(r["model"], r["mode"], f"{r['loss_error']:.1e}", f"{r['param_error']:.1e}",
                    f"{r['peak'] / r['capacity']:.2f}", f"{r['seconds']:.0f}", _configuration(r))
    return out


def _configuration(row: dict[str, Any]) -> str:
    smallest = row.get("u_min", 1)
    return row["config"] + (f" (microbatches of {smallest} or more)" if smallest > 1 else "")


def _short(error: str, limit: int = 110) -> str:
    return error if len(error) <= limit else error[: limit - 1] + "…"


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| model | mode | loss error | parameter error | peak / capacity | configuration or error |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | - | - | - | {_short(r['error'], 200)} |")
        else:
            lines.append(f"| {r['model']} | {r['mode']} | {r['loss_error']:.1e} | {r['param_error']:.1e} | "
                         f"{r['peak'] / r['capacity']:.2f} | {_configuration(r)} |")
    return "\n".join(lines) + "\n"


@dataclass
class Collection:
    """A benchmark's cases, how it reports them and its command line: ``library`` names the package
    whose models these are (its version heads the markdown), ``command`` the module that runs them."""

    cases: dict[str, Callable[[], Case]]
    minibatch: int
    library: str
    command: str
    doc: str  # the module's docstring: the command line's --help
    # cases compiled at another fraction of their footprint than a third (a model whose one layer
    # holds most of it cannot run that layer in a third)
    fractions: dict[str, float] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return (f"{self.library} models against eager ({STEPS} steps, float64, {DEVICES} emulated devices, "
                "a third of the training footprint each unless said)")

    def run(self, name: str, mode: str) -> dict[str, Any]:
        """One case in one mode (``run``)."""
        return run(name, self.cases[name], mode, self.minibatch, self.fractions.get(name, 1 / 3))

    def table(self, rows: list[dict[str, Any]]) -> Table:
        return table(rows, self.title)

    def header(self) -> str:
        library = "" if self.library == "torch" else f", {self.library} {importlib.import_module(self.library).__version__}"
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        return (f"Measured {date} on torch {torch.__version__}{library}: `python -m {self.command}` ({STEPS} steps, "
                f"float64, {DEVICES} emulated devices at a third of the training footprint{self._others()}; errors relative to eager "
                "on the same microbatches)")

    def _others(self) -> str:
        return "".join(f", {name} at {fraction:g}" for name, fraction in self.fractions.items())

    def main(self, argv: list[str] | None = None) -> None:
        """The command line: which cases to run, in which modes, where to write."""
        parser = argparse.ArgumentParser(description=self.doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--models", default=",".join(self.cases), help=f"comma-separated, of: {', '.join(self.cases)}")
        parser.add_argument("--modes", default="pp,dp", help="comma-separated modes (default: pp,dp)")
        parser.add_argument("--json", help="also write the rows here")
        parser.add_argument("--markdown", help="also write the table here, as markdown")
        ns = parser.parse_args(argv)
        unknown = [m for m in ns.models.split(",") if m not in self.cases]
        if unknown:
            parser.error(f"unknown models: {', '.join(unknown)}")
        rows = [self.run(name, mode) for name in ns.models.split(",") for mode in ns.modes.split(",")]
        Console().print(self.table(rows))
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(rows, f, indent=1)
        if ns.markdown:
            with open(ns.markdown, "w") as f:
                f.write(markdown(rows, self.header()))
