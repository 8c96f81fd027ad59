"""Runtime overhead: Harmony on one emulated CPU device with ample memory vs a plain eager PyTorch
training loop on the same model and minibatch.

Both compute on one thread (an emulated device is a single-threaded worker process). Steps are
interleaved, one Harmony step then one eager step, so both see the same machine load; the wall time
of ``trainer.step`` (what a user waits for) is compared with the wall time of the eager step. The
first step of each is left out. Goal: Harmony's throughput at least 95% of eager, on
gpt2-small and on models of other shapes (a wide, shallow GPT; a small BERT).

Harmony runs as a user's run does, without checking its memory op by op (``check_memory=False``:
the plan's reservations alone); the same plan with the check on (``--check-memory``, what the
tests run) is stepped in the same rounds, and its cost is printed beside.

    python -m bench.overhead [--quick]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import harmony
from bench.common import Model, compiled
from harmony.models import bert, gpt2
from harmony.models.bert import BertConfig
from harmony.models.gpt2 import GPT, GPTConfig
from harmony.profiling.measure import torch_threads
from harmony.scheduler.memory import kept_on

# a GPT-2 whose steps take tens of milliseconds on one core: compute, not per-call overhead, dominates
SMALL_GPT = GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=64)
AMPLE = 1 << 30  # bytes per emulated device: far more than the model's training footprint


SMALL = Model("gpt2-small", functools.partial(GPT, SMALL_GPT), gpt2.loss_fn,
              functools.partial(gpt2.batch_of, SMALL_GPT), gpt2.build_optimizer)

# the same compute in fewer, wider blocks over shorter sequences: fewer, larger ops per step
WIDE_GPT = GPTConfig(n_layer=2, n_head=8, n_embd=256, vocab_size=1024, block_size=32)


WIDE = Model("gpt2-wide", functools.partial(GPT, WIDE_GPT), gpt2.loss_fn,
             functools.partial(gpt2.batch_of, WIDE_GPT), gpt2.build_optimizer)

# an encoder with a masked-LM head (no dropout: the step is deterministic for both)
SMALL_BERT = BertConfig(num_layers=4, hidden=128, num_heads=4, intermediate=512, vocab_size=512, max_position=64,
                        dropout=0.0)


BERT = Model("bert-small", functools.partial(bert.BertForMaskedLM, SMALL_BERT), bert.loss_fn,
             functools.partial(bert.batch_of, SMALL_BERT), bert.build_optimizer)
MODELS = (SMALL, WIDE, BERT)
GOAL = 0.95  # Harmony's throughput over eager's, every model


def measure(minibatch: int = 16, steps: int = 8, model: Model = SMALL) -> dict[str, Any]:
    """Interleaved step times of Harmony (1 device, ample memory; memory unchecked and checked) and
    eager PyTorch."""
    # probed, as a user's compile is: unprobed, the search knows nothing of the runtime's cost per
    # microbatch and may choose more, smaller microbatches on its profile's noise
    plan = compiled(model, minibatch, devices=1, device_memory=AMPLE, probe=True)
    torch.manual_seed(0)  # the weights ``compiled`` started from
    eager_model = model.build().train()
    opt = model.build_optimizer(eager_model.parameters())
    harmony_s, checked_s, eager_s = [], [], []
    with harmony.Trainer(plan, optimizer=model.build_optimizer, check_memory=False) as trainer, \
            harmony.Trainer(plan, optimizer=model.build_optimizer, check_memory=True) as checked, torch_threads(1):
        for step in range(steps):
            inputs, target = model.get_batch(minibatch, step)
            t0 = time.perf_counter()
            trainer.step(inputs, target)
            harmony_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            checked.step(inputs, target)
            checked_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model.loss_fn(eager_model(inputs), target).backward()
            opt.step()
            eager_s.append(time.perf_counter() - t0)
        history = trainer.history[1:]
    h, e = statistics.median(harmony_s[1:]), statistics.median(eager_s[1:])
    c = statistics.median(checked_s[1:])
    # where Harmony's step goes: its tasks' compute, the rest of the worker's iteration, the launcher
    tasks = statistics.median(sum(step.workers[0].task_seconds.values()) for step in history)
    worker = statistics.median(step.workers[0].seconds for step in history)
    kept = " kept" if kept_on(plan.tasks) else ""  # the state stays on the device (scheduler/keep.py)
    return {"model": model.name, "minibatch": minibatch, "steps": steps, "configuration": str(plan.tasks.config) + kept,
            "harmony_seconds": h, "eager_seconds": e, "harmony_samples_per_second": minibatch / h,
            "eager_samples_per_second": minibatch / e, "throughput_ratio": e / h, "overhead": h / e - 1,
            "harmony_steps": harmony_s, "eager_steps": eager_s,
            "checked_seconds": c, "checked_throughput_ratio": e / c, "checked_steps": checked_s,
            "breakdown": {"task_seconds": tasks, "worker_seconds": worker, "step_seconds": h}}


def describe(r: dict[str, Any]) -> str:
    return (f"{r['model']}, minibatch {r['minibatch']}: Harmony {r['harmony_samples_per_second']:.1f} samples/s "
            f"({r['configuration']}), eager {r['eager_samples_per_second']:.1f} samples/s; "
            f"throughput ratio {r['throughput_ratio']:.3f} (goal >= {GOAL}); "
            f"with --check-memory {r['checked_throughput_ratio']:.3f} of eager")


def measure_all(steps: int = 8, models: tuple[Model, ...] = MODELS) -> dict[str, Any]:
    """``measure`` for every model: the first model's figures at the top level (as ``measure``
    gives them), every model's under ``models``, and the lowest ratio under ``worst_ratio``."""
    rows = [measure(steps=steps, model=m) for m in models]
    return {**rows[0], "models": rows, "worst_ratio": min(r["throughput_ratio"] for r in rows), "goal": GOAL}


def table(result: dict[str, Any]) -> Table:
    out = Table(title=f"Harmony on one emulated device vs eager PyTorch (goal: ratio >= {GOAL})")
    for col in ("model", "eager samples/s", "Harmony samples/s", "ratio", "with --check-memory", "configuration"):
        out.add_column(col, justify="left" if col in ("model", "configuration") else "right")
    for r in result["models"]:
        out.add_row(r["model"], f"{r['eager_samples_per_second']:.1f}", f"{r['harmony_samples_per_second']:.1f}",
                    f"{r['throughput_ratio']:.3f}", f"{r['checked_throughput_ratio']:.3f}", r["configuration"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    ns = parser.parse_args()
    Console().print(table(measure_all(steps=5 if ns.quick else 24)))


if __name__ == "__main__":
    main()
