"""The outside reference: plain eager PyTorch on one process, with the same microbatches.

It shares no code with the runtime but the seeding rule (``rng.microbatch_seed``): for each
microbatch, in minibatch order, seed the generator, run the original model, scale the loss by
u/D, backward; then one optimizer step over the whole model. Tests and benchmarks compare a run's
losses and final parameters with it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from harmony.runtime.precision import autocast
from harmony.runtime.rng import microbatch_seed


def microbatches_of(graph_tasks) -> list[tuple[int, int]]:
    """The microbatches a plan runs the model's first layers on, in minibatch order: the ones
    whose samples and random streams the reference must reproduce."""
    first = [t for t in graph_tasks.tasks if t.first == 0 and t.kind.value in ("FWD", "BWD") and
             (t.kind.value == "FWD" or t.loss)]
    out = set()
    for t in first:
        start = t.offset
        for size in t.microbatches:
            out.add((start, size))
            start += size
    return sorted(out)


def _slice(x: Any, start: int, size: int) -> Any:
    return x[start:start + size] if isinstance(x, torch.Tensor) else x


def reference_train(model: torch.nn.Module, loss_fn: Callable, build_optimizer: Callable,
                    batches: list[tuple[Any, Any]], microbatches: list[tuple[int, int]], seed: int = 0,
                    lr_scheduler: Callable | None = None, clip_grad_norm: float | None = None,
                    grad_norms: list[float] | None = None, precision: str = "fp32",
                    loss_scale: float = 2.0 ** 16) -> list[float]:
    """Train ``model`` in place on ``batches`` ((inputs, target) pairs), one optimizer step each
    (after ``torch.nn.utils.clip_grad_norm_`` if ``clip_grad_norm``, its norms appended to
    ``grad_norms``), then one step of the scheduler ``lr_scheduler`` builds, if any
    (``ReduceLROnPlateau`` with the minibatch's loss); returns the mean loss of every minibatch.
    ``precision`` "bf16": the forward and the loss under ``torch.autocast``, as users write it;
    "fp16" also with ``torch.amp.GradScaler(init_scale=loss_scale)`` (a skipped step's loss is
    still returned)."""
    device_type = next(model.parameters()).device.type
    opt = build_optimizer(model.parameters())
    scaler = torch.amp.GradScaler(device_type, init_scale=loss_scale) if precision == "fp16" else None
    scheduler = lr_scheduler(opt) if lr_scheduler is not None else None
    losses = []
    for iteration, (inputs, target) in enumerate(batches):
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        total = int(next(x for x in inputs if isinstance(x, torch.Tensor)).shape[0])
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for start, size in microbatches:
            torch.manual_seed(microbatch_seed(seed, iteration, start))
            with autocast(device_type, precision):
                out = model(*[_slice(x, start, size) for x in inputs])
                loss = loss_fn(out, _slice(target, start, size)) * (size / total)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += float(loss.detach())
        if scaler is not None:
            scaler.unscale_(opt)
        if clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            if grad_norms is not None:
                grad_norms.append(float(norm))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step(loss_sum)
        elif scheduler is not None:
            scheduler.step()
        losses.append(loss_sum)
    return losses
