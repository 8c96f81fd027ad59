"""The Python API for a single virtual device (docs/architecture.md, section 7): `compile` and `load_plan`."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from harmony import inputs
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
    check_gradients: bool = True,
) -> Plan:
    """Decompose ``model``, profile it and search a schedule; the plan remembers ``loss_fn`` and
    ``get_batch`` (not saved to disk) for the trainer that runs it. ``clip_grad_norm``: clip the
    gradient to this global 2-norm before every step, as ``torch.nn.utils.clip_grad_norm_`` (the
    plan's updates then wait for the whole gradient). ``precision="bf16"``: the devices compute
    under ``torch.autocast`` (weights, gradients and optimizer state stay float32). ``keep_state``:
    where a device has room, its packs' weights and optimizer state stay there across iterations
    and are stepped there (docs/architecture.md, "Kept state"); False moves them every iteration.
    ``check_gradients``: before anything else, compare the decomposed layers' output and gradients
    with eager autograd on the example batch and refuse a model whose tracing lost part of its
    backward (``decomposer/gradient_check.py``; one forward and backward of a float64 copy).
    The arguments are checked before any work (``harmony.inputs``): ``get_batch`` is called once on
    two samples, and a model not on the meta device runs once on them for ``loss_fn``'s check."""
    options = CompileOptions(
        minibatch=inputs.check_minibatch_size(minibatch_size), devices=inputs.check_devices(devices),
        device_memory=device_memory, mode=mode, device_type=device_type, analytic=analytic, compare=compare,
        probe=probe, clip_grad_norm=clip_grad_norm, precision=precision, keep_state=keep_state,
        check_gradients=check_gradients,
    )
    options.validate()
    optimizer = build_optimizer or default_optimizer
    _check_functions(model, loss_fn, get_batch, build_optimizer, options.minibatch)
    plan, trace = compile_plan(model, get_batch, optimizer, options, loss_fn=loss_fn)
    plan.trace = trace
    plan.loss_fn = loss_fn
    plan.get_batch = get_batch
    plan.build_optimizer = optimizer
    return plan


def _check_functions(model: torch.nn.Module, loss_fn: Callable, get_batch: Callable, build_optimizer: Callable | None,
                     minibatch: int) -> None:
    """What the compile is given, checked before any of its work (``harmony.inputs``): the model,
    ``get_batch`` on the batch the decomposer traces (two samples, or one), ``build_optimizer`` on
    stand-in parameters, and ``loss_fn`` on the model's output for that batch."""
    inputs.check_model(model)
    inputs.check_callable(loss_fn, "loss_fn", inputs.LOSS_SIGNATURE)
    if build_optimizer is not None:
        inputs.check_optimizer_builder(build_optimizer)
    example, target = inputs.sample_batch(get_batch, min(2, minibatch))
    inputs.check_loss_on_model(model, loss_fn, example, target)


def load_plan(directory: str | Path, model_file: str | Path | None = None) -> Plan:
    """A plan directory written by ``Plan.save`` or ``harmony compile``, checked for staleness."""
    return Plan.load(directory, model_file=model_file)
