"""The whole gradient before any step: global-norm clipping, as ``torch.nn.utils.clip_grad_norm_``
clips, and fp16's overflow check.

The norm of the whole model's gradient is known only once its last gradient is: a plan that clips
has a NORM task on the host (``scheduler/taskgraph.with_norm``) after every backward that leaves a
gradient, and every update waits for it; no update is fused into a backward. The launcher runs the
NORM task beside the offloaded updates:

1. each parameter's gradient, left in host slots by every device that computed part of it, is
   summed into one slot (the others are let go, so an update copies the sum in once);
2. the global 2-norm, by ``torch.nn.utils.get_total_norm`` as ``clip_grad_norm_`` takes it
   (parameters in ``model.parameters()`` order, as the layer graph keeps them);
3. every gradient is multiplied by ``min(max_norm / (norm + 1e-6), 1)``, torch's coefficient in
   the gradients' dtype (skipped where it is exactly 1: the product would not change a bit).

With fp16's loss scaling the gradients are first unscaled and checked for overflow
(``lossscale.py``); an overflow skips every update of the minibatch (``Shared.skip_step``).

Updates then step with the clipped gradients as before (``updates.py``).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from harmony.errors import HarmonyError
from harmony.runtime.flags import Shared
from harmony.runtime.hoststore import HostStore
from harmony.runtime.lossscale import unscale
from harmony.runtime.precision import needs_loss_scaling
from harmony.scheduler.lower import Program
from harmony.scheduler.tasks import Kind, Task, TaskGraph

EPSILON = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


def check_clipping(tasks: TaskGraph, max_norm: float | None) -> None:
    """A plan that clips, or scales an fp16 loss, has a NORM task: one without it steps packs before
    the last gradient exists; a plan with one and neither is refused (its updates would wait for
    nothing)."""
    has_norm = any(t.kind == Kind.NORM for t in tasks.tasks)
    if max_norm is not None and not has_norm:
        raise HarmonyError(f"clip_grad_norm={max_norm:g}, but this plan was compiled without clipping: it steps "
                           "parameters before the whole gradient, and so its norm, is known. Compile it with "
                           "clip_grad_norm (harmony.compile(..., clip_grad_norm=X) or --clip-grad-norm X)")
    if needs_loss_scaling(tasks.precision) and not has_norm:
        raise HarmonyError(f"this {tasks.precision} plan has no NORM task to check its gradients for overflow "
                           "before any step; compile it with harmony.compile(..., precision=\"fp16\")")
    if max_norm is None and has_norm and not needs_loss_scaling(tasks.precision):
        raise HarmonyError("this plan was compiled to clip gradients but no clip_grad_norm was given")
    check_threshold(max_norm)


def check_threshold(max_norm: float | None) -> None:
    if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise HarmonyError(f"clip_grad_norm must be a positive number, got {max_norm!r}")


class Verdict(NamedTuple):
    """What a NORM task found: the norm before clipping (what ``clip_grad_norm_`` returns; None
    without clipping), whether the step is skipped (fp16 overflow), and when (``time.perf_counter``)
    its gradients were all there and its work began."""

    norm: float | None
    skipped: bool
    began: float


def host_norm(task: Task, program: Program, store: HostStore, shared: Shared, max_norm: float | None, iteration: int,
              timeout: float, loss_scale: float | None = None) -> Verdict:
    """Run a NORM task: wait for every gradient and sum each parameter's slots into one; with a
    ``loss_scale`` (fp16), unscale them and skip the step if one overflowed (``lossscale.py``); with
    ``max_norm``, clip them by the global norm."""
    shared.wait_done(program.gathers.get(task.id, []), iteration, f"the gradient norm (task {task.id})", timeout,
                     ring=True)
    began = time.perf_counter()
    gradients = [g for g in (store.merge_slots(name, iteration) for name in program.owner) if g is not None]
    skipped = loss_scale is not None and bool(gradients) and unscale(gradients, loss_scale)
    norm = clip_gradients(gradients, max_norm, apply=not skipped) if max_norm is not None else None
    if skipped:
        shared.skip_step(iteration)
    shared.mark_done(task.id, iteration)
    return Verdict(norm, skipped, began)


def clip_gradients(gradients: list[torch.Tensor], max_norm: float, apply: bool = True) -> float:
    """The global norm of ``gradients``, and (if ``apply``) every one scaled by
    ``clip_grad_norm_``'s coefficient ``min(max_norm / (norm + 1e-6), 1)``, in place."""
    total = torch.nn.utils.get_total_norm(gradients, 2.0)
    coefficient = torch.clamp(max_norm / (total + EPSILON), max=1.0)
    if apply and float(coefficient) != 1.0:
        for g in gradients:
            g.mul_(coefficient)
    return float(total)
