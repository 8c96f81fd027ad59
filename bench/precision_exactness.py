"""How far a bf16 run lands from eager autocast training, on models nobody here wrote for it.

Each generated model (``tests/runtime/generated_models.py``: residual MLPs, conv nets with
BatchNorm, ``nn.MultiheadAttention`` stacks with and without masks, Hugging Face BERT and GPT-2
configurations) that trains in float32 is compiled for 2 emulated devices at a third of its
footprint, with its first parameter frozen, bf16 and clipping at 0.5, in pp and in dp, and trained
three steps beside ``reference_train`` with the same settings. Printed per run: the largest
relative difference of the losses, of the clipped norms, and of the weights (each tensor's
difference over its scale, floored at 1e-3), and whether the frozen tensor kept its value.

Not exact, and not expected to be: where the plan adds gradients in another order than eager code
(across devices, or where a value used several times meets its gradient at a pack boundary), the
float32 sums differ by an ulp, a later cast to bf16 may round the other way (2^-8 relative), and
Adam's normalized steps carry that into the weights, most of all on small tensors.

    python -m bench.precision_exactness [--seeds 0-30]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import harmony
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))
from generated_models import draw_case  # noqa: E402  (the test suite's generator, as it draws them)

CLIP = 0.5
STEPS = 3
MINIBATCH = 8


def adam(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def _relative(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def run_case(seed: int) -> list[dict]:
    """Both modes of one generated case (none if it is not a float32 model: autocast leaves float64 alone)."""
    case = draw_case(seed)
    if case.dtype != torch.float32:
        return []
    model = copy.deepcopy(case.model)
    frozen_name, frozen = next(iter(model.named_parameters()))
    frozen.requires_grad_(False)
    graph = harmony.decompose(copy.deepcopy(model), case.get_batch(2, 0)[0])
    capacity = int(0.34 * training_footprint(graph, case.get_batch, MINIBATCH))
    batches = [case.get_batch(MINIBATCH, step) for step in range(STEPS)]
    rows = []
    for mode in ("pp", "dp"):
        plan = harmony.compile(model, case.loss_fn, case.get_batch, minibatch_size=MINIBATCH, devices=2,
                               device_memory=capacity, mode=mode, build_optimizer=adam, probe=False,
                               precision="bf16", clip_grad_norm=CLIP)
        with harmony.Trainer(plan, optimizer=adam, timeout=120) as trainer:
            losses = [trainer.step(*batch) for batch in batches]
            state, norms = trainer.state_dict(), [step.grad_norm for step in trainer.history]
        reference, eager_norms = copy.deepcopy(model), []
        expected = reference_train(reference, case.loss_fn, adam, batches, microbatches_of(plan.tasks),
                                   precision="bf16", clip_grad_norm=CLIP, grad_norms=eager_norms)
        want = reference.state_dict()
        weights = max(float((state[k].double() - v.double()).abs().max()) / float(v.double().abs().max().clamp_min(1e-3))
                      for k, v in want.items() if v.is_floating_point())
        rows.append({"case": case.name, "mode": mode, "tracer": graph.tracer, "config": str(plan.tasks.config),
                     "loss": _relative(losses, expected), "norm": _relative(norms, eager_norms), "weights": weights,
                     "frozen_kept": bool(torch.equal(state[frozen_name], frozen.detach()))})
    return rows


def _seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0-30", help="generated cases to draw, e.g. 0-30 (default)")
    ns = parser.parse_args()
    table = Table(title=f"bf16 + clipping + a frozen tensor against eager autocast, {STEPS} steps, 2 emulated devices")
    for col in ("case", "mode", "tracer", "loss", "norm", "weights", "frozen kept", "configuration"):
        table.add_column(col, justify="right")
    for seed in _seeds(ns.seeds):
        for r in run_case(seed):
            table.add_row(r["case"], r["mode"], r["tracer"], f"{r['loss']:.1e}", f"{r['norm']:.1e}",
                          f"{r['weights']:.1e}", "yes" if r["frozen_kept"] else "NO", r["config"])
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
