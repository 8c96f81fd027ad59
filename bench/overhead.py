"""Runtime overhead: Harmony on one emulated CPU device with ample memory vs a plain eager PyTorch
training loop on the same model and minibatch (issue 7, item 1).

Both compute on one thread (an emulated device is a single-threaded worker process). Steps are
interleaved, one Harmony step then one eager step, so both see the same machine load; the wall time
of ``trainer.step`` (what a user waits for) is compared with the wall time of the eager step. The
first step of each is left out. Goal: Harmony's throughput at least 90% of eager (overhead <= 10%).

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

import harmony
from bench.common import Model, compiled
from harmony.models import gpt2
from harmony.models.common import token_sequences
from harmony.models.gpt2 import GPT, GPTConfig
from harmony.profiling.measure import torch_threads

# a GPT-2 whose steps take tens of milliseconds on one core: compute, not per-call overhead, dominates
SMALL_GPT = GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=64)
AMPLE = 1 << 30  # bytes per emulated device: far more than the model's training footprint


def small_gpt_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = token_sequences(batch_size, SMALL_GPT.block_size + 1, SMALL_GPT.vocab_size, step)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


SMALL = Model("gpt2-small", functools.partial(GPT, SMALL_GPT), gpt2.loss_fn, small_gpt_batch, gpt2.build_optimizer)


def measure(minibatch: int = 16, steps: int = 8, model: Model = SMALL) -> dict[str, Any]:
    """Interleaved step times of Harmony (1 device, ample memory; memory unchecked and checked) and
    eager PyTorch."""
    plan = compiled(model, minibatch, devices=1, device_memory=AMPLE)
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
    return {"model": model.name, "minibatch": minibatch, "steps": steps, "configuration": str(plan.tasks.config),
            "harmony_seconds": h, "eager_seconds": e, "harmony_samples_per_second": minibatch / h,
            "eager_samples_per_second": minibatch / e, "throughput_ratio": e / h, "overhead": h / e - 1,
            "harmony_steps": harmony_s, "eager_steps": eager_s,
            "checked_seconds": c, "checked_throughput_ratio": e / c, "checked_steps": checked_s,
            "breakdown": {"task_seconds": tasks, "worker_seconds": worker, "step_seconds": h}}


def describe(r: dict[str, Any]) -> str:
    return (f"{r['model']}, minibatch {r['minibatch']}: Harmony {r['harmony_samples_per_second']:.1f} samples/s "
            f"({r['configuration']}), eager {r['eager_samples_per_second']:.1f} samples/s; "
            f"throughput ratio {r['throughput_ratio']:.3f} (overhead {r['overhead']:+.1%}; goal <= +10%); "
            f"with --check-memory {r['checked_throughput_ratio']:.3f} of eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    ns = parser.parse_args()
    Console().print(describe(measure(steps=5 if ns.quick else 10)))


if __name__ == "__main__":
    main()
