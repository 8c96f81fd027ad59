"""The Python API for a single virtual device (docs/architecture.md, section 7): `compile` and `load_plan`."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from harmony.compiler import CompileOptions, compile_plan
from harmony.modelfile import default_optimizer
from harmony.plan import Plan


def compile(  # noqa: A001 - the API's name (docs/architecture.md, section 7)
    model: torch.nn.Module,
    loss_fn: Callable,
    get_batch: Callable[[int, int], tuple],
    minibatch_size: int = 64,
    devices: int = 2,
    device_memory: int | str | None = None,
    mode: str = "pp",
    device_type: str = "cpu",
    build_optimizer: Callable | None = None,
    analytic: str | None = None,
    compare: bool = False,
    probe: bool = True,
    clip_grad_norm: float | None = None,
    precision: str = "fp32",
    keep_state: bool = True,
) -> Plan:
    """Decompose ``model``, profile it and search a schedule; the plan remembers ``loss_fn`` and
    ``get_batch`` (not saved to disk) for the trainer that runs it. ``clip_grad_norm``: clip the
    gradient to this global 2-norm before every step, as ``torch.nn.utils.clip_grad_norm_`` (the
    plan's updates then wait for the whole gradient). ``precision="bf16"``: the devices compute
    under ``torch.autocast`` (weights, gradients and optimizer state stay float32). ``keep_state``:
    where a device has room, its packs' weights and optimizer state stay there across iterations
    and are stepped there (docs/architecture.md, "Kept state"); False moves them every iteration."""
    options = CompileOptions(
        minibatch=minibatch_size, devices=devices, device_memory=device_memory, mode=mode,
        device_type=device_type, analytic=analytic, compare=compare, probe=probe, clip_grad_norm=clip_grad_norm,
        precision=precision, keep_state=keep_state,
    )
    optimizer = build_optimizer or default_optimizer
    plan, trace = compile_plan(model, get_batch, optimizer, options, loss_fn=loss_fn)
    plan.trace = trace
    plan.loss_fn = loss_fn
    plan.get_batch = get_batch
    plan.build_optimizer = optimizer
    return plan


def load_plan(directory: str | Path, model_file: str | Path | None = None) -> Plan:
    """A plan directory written by ``Plan.save`` or ``harmony compile``, checked for staleness."""
    return Plan.load(directory, model_file=model_file)
