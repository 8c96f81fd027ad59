"""`harmony run`: train a model file on a plan (compiled now, or reused) and report what happened.

The run report (JSON) has, per iteration, the loss and the wall time; per device, the bytes moved
per channel and the peak memory; and beside each measurement the plan's estimate of it, so that a
run shows at a glance how far the estimator was off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import statistics
from pathlib import Path
from typing import Any, Callable, ContextManager

from harmony import checkpoint
from harmony.plan import Plan
from harmony.runtime.launcher import StepResult

log = logging.getLogger(__name__)

CACHE_DIR = Path(".harmony") / "plans"


def cache_dir(model_sha256: str, options: dict[str, Any], root: Path = CACHE_DIR) -> Path:
    """Where the plan for this model source and these compile options is cached."""
    key = json.dumps({"model": model_sha256, "options": options}, sort_keys=True, default=str)
    return root / hashlib.sha256(key.encode()).hexdigest()[:16]


def run_report(plan: Plan, history: list[StepResult], warmup: int = 1, first: int = 0,
               p2p: str | None = None) -> dict[str, Any]:
    """Measured figures beside the plan's estimates; the first ``warmup`` iterations (process and
    allocator start-up) are left out of the mean time. ``first``: the step of ``history[0]`` (not 0
    when the run resumed from a checkpoint); ``p2p``: the transport that carried P2P messages
    ("shm" or "dist"), recorded since it changes the times but not the bytes."""
    est = plan.estimate or {}
    steady = history[warmup:] or history
    mean = statistics.fmean(r.seconds for r in steady) if steady else float("nan")
    planned = plan.tasks.bytes_by_channel()
    devices = []
    for rank in range(plan.tasks.devices):
        counted: dict[str, int] = {}
        for key, value in history[-1].workers[rank].bytes_by_channel.items():
            counted[key] = value
        devices.append({
            "device": rank,
            "bytes_by_channel": counted,
            "planned_bytes_by_channel": _device_bytes(plan, rank),
            "peak_memory": max(step.workers[rank].peak for step in history),
            # False: emulated devices that did not check their memory (the peak is the plan's reservations')
            "peak_memory_measured": all(step.workers[rank].peak_measured for step in history),
            "estimated_peak_memory": (est.get("peak_memory") or {}).get(str(rank)),
            "capacity": plan.options.get("device_memory"),
            "busy_seconds": statistics.fmean(sum(step.workers[rank].task_seconds.values()) for step in steady),
        })
    total = history[-1].bytes_by_channel()
    estimated = est.get("iteration_time")
    return {
        "mode": plan.tasks.mode, "devices": plan.tasks.devices, "minibatch": plan.tasks.minibatch,
        "configuration": str(plan.tasks.config), "p2p": p2p,
        "iterations": [{"iteration": i, "loss": r.loss, "seconds": r.seconds,
                        **({"grad_norm": r.grad_norm} if r.grad_norm is not None else {}),
                        **({"loss_scale": r.loss_scale, "skipped": r.skipped} if r.loss_scale is not None else {})}
                       for i, r in enumerate(history, first)],
        "mean_iteration_seconds": mean, "estimated_iteration_seconds": estimated,
        "relative_error": (estimated - mean) / mean if estimated and mean else None,
        **_within_range(est.get("iteration_time_range"), mean),
        "samples_per_second": plan.tasks.minibatch / mean if mean else None,
        "bytes_by_channel": total, "planned_bytes_by_channel": {k: v for k, v in planned.items() if v},
        "per_device": devices,
    }


def _within_range(span: list[float] | None, mean: float) -> dict[str, Any]:
    """The plan's stated range for its iteration time (``iteration_time_range``: the estimate at
    both ends of ``Machine.compute_scale_range``) and whether the run's mean fell in it."""
    if not span:
        return {}
    return {"estimated_iteration_range": list(span), "within_estimated_range": span[0] <= mean <= span[1]}


def _device_bytes(plan: Plan, rank: int) -> dict[str, int]:
    """The plan's bytes per channel for one device's tasks (as counted at that device)."""
    from harmony.scheduler.tasks import TaskGraph

    own = TaskGraph(mode=plan.tasks.mode, devices=plan.tasks.devices, minibatch=plan.tasks.minibatch,
                    config=plan.tasks.config, tasks=[t for t in plan.tasks.tasks if t.device == rank])
    return {k: v for k, v in own.bytes_by_channel().items() if v}


def write_report(path: Path, report: dict[str, Any]) -> None:
    from harmony import serialization

    serialization.atomic_write_bytes(path, json.dumps(report, indent=2, default=str).encode())


class Checkpointer:
    """Saves the trainer every ``every`` steps into ``directory`` (``checkpoint.step_path``), moving
    ``latest.json`` to each complete file, and remembers the last one for the message an
    interrupted run prints."""

    def __init__(self, directory: Path | None, every: int | None, start: int = 0,
                 shield: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.directory, self.every = directory, every
        self.start = start  # the step the run began at (a resumed run: the checkpoint's)
        self.last: tuple[Path, int] | None = None
        self.shield = shield  # holds a signal back until a save and its bookkeeping are done

    def after_step(self, trainer) -> None:
        if self.directory is not None and self.every and trainer.iteration % self.every == 0:
            self.save(trainer)

    def save(self, trainer) -> Path:
        """A checkpoint of the trainer's current step, published once complete."""
        step = trainer.iteration
        with self.shield():
            path = trainer.save_checkpoint(checkpoint.step_path(self.directory, step))
            checkpoint.publish(self.directory, path, step)
            self.last = (path, step)
        log.info("checkpoint %s (step %d)", path, step)
        return path

    def describe(self) -> str:
        """Where a run stopped now would resume from, in words."""
        if self.last is None:
            return f"no checkpoint written since step {self.start}"
        path, step = self.last
        return f"the last checkpoint is {path} (step {step}); continue with --resume {path.parent}"


def train(trainer, get_batch: Callable[[int, int], tuple], iterations: int, on_step: Callable[[int, float, float], None],
          checkpointer: Checkpointer | None = None) -> None:
    """``iterations`` steps on the model file's batches, from the trainer's current iteration,
    checkpointing as ``checkpointer`` says."""
    minibatch = trainer.plan.tasks.minibatch
    for _ in range(iterations):
        step = trainer.iteration
        inputs, target = get_batch(minibatch, step)
        loss = trainer.step(inputs, target)
        on_step(step, loss, trainer.history[-1].seconds)
        if checkpointer is not None:
            checkpointer.after_step(trainer)
