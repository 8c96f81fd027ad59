"""The host's optimizer step: torch's fused CPU kernel where it computes what the user's optimizer does.

An offloaded update (``updates.host_update``) steps a pack's master weights in the host store. The
user's optimizer as built steps them with torch's single-tensor loop on the CPU: a kernel, and a
pass over memory, per arithmetic op per tensor. Torch's fused CPU kernels for Adam, AdamW and SGD
(``fused=True``) make one pass per tensor over the weight, its gradient and its state. So the host
step builds the user's optimizer as always (its class and its groups' settings are the update's,
and a learning-rate schedule sets its groups), then steps a *twin*: the same class over the same
parameter groups and settings with ``fused=True``, over the same tensors and the same state.

The twin steps only where the fused kernel computes the same algorithm: torch's own ``Adam``,
``AdamW`` and ``SGD`` classes (not subclasses, which may step otherwise), float32 or float64
weights on the CPU with dense gradients of their dtype, no ``differentiable`` or ``capturable``
group, no hooks on the optimizer's step, and not ``fused=False`` (the user asked for the loop's
arithmetic). Anything else steps the optimizer as built. The fused kernel orders its arithmetic
its own way: it equals the loop bitwise for SGD without momentum, and within a few units in the
last place of a tensor's scale per step otherwise (``tests/runtime/test_host_step.py`` states the
bounds). Half and bfloat16 weights step by the loop: the kernel computes them in float32 where the
loop rounds every op to the weight's dtype, and the two part by more than rounding order (in
float16, Adam's second moment overflows in the loop and not in the kernel).

Threads: the step runs on the thread count of the calling thread, which the launcher sets as the
profiler timed host updates (one on the emulated ``cpu`` backend, whose devices have the cores;
torch's default beside GPUs). ``host_optimizer`` is the same choice as a builder, which the
profiler times, so that a profile's host update time is this step's.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

__all__ = ["FUSED_CLASSES", "fused_twin", "host_optimizer", "host_step"]

FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)  # torch's optimizers with a fused CPU kernel
FUSED_DTYPES = (torch.float32, torch.float64)  # weights the kernel rounds as the loop does (op by op)


def fused_twin(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The fused form of ``optimizer`` over the same parameter groups and settings, or None where it
    has none that computes its algorithm (see the module docs). An optimizer built fused is its own
    twin. Call it after the gradients are set: their layout decides."""
    reason = _unfusable(optimizer)
    if reason is not None:
        log.debug("the host steps %s as built: %s", type(optimizer).__name__, reason)
        return None
    if all(group.get("fused") for group in optimizer.param_groups):
        return optimizer
    groups = [{**group, "params": list(group["params"]), "fused": True, "foreach": False}
              for group in optimizer.param_groups]
    accepted = _constructor_settings(type(optimizer))
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return type(optimizer)(groups, **{**defaults, "fused": True, "foreach": False})


def host_step(optimizer: torch.optim.Optimizer,
              states: dict[torch.Tensor, dict[str, Any]]) -> dict[torch.Tensor, dict[str, Any]]:
    """Step ``optimizer``'s parameters with their gradients, from ``states`` (each parameter stepped
    before: its stored state, stepped in place), by its fused twin where it has one. Returns every
    stepped parameter's state after the step (a first step's is new tensors)."""
    stepper = fused_twin(optimizer)
    if stepper is None or _mixed_first_momentum(stepper, states):
        stepper = optimizer
    for param, state in states.items():
        stepper.state[param] = state
    stepper.step()
    return {p: stepper.state[p] for group in stepper.param_groups for p in group["params"] if p in stepper.state}


def host_optimizer(build_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                   ) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """A builder of the optimizer a host update steps over ``params`` (whose gradients are set): the
    fused twin of ``build_optimizer``'s where it has one. What the profiler times a host update with."""

    def build(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        optimizer = build_optimizer(params)
        return fused_twin(optimizer) or optimizer

    return build


@functools.cache
def _constructor_settings(cls: type) -> frozenset[str]:
    """The settings ``cls``'s constructor takes (AdamW's defaults hold one it sets itself)."""
    return frozenset(inspect.signature(cls).parameters)


def _unfusable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` has no fused twin computing its algorithm, or None."""
    if type(optimizer) not in FUSED_CLASSES:
        return f"torch has no fused form of {type(optimizer).__qualname__}"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return "its step has hooks"
    for group in optimizer.param_groups:
        for setting in ("differentiable", "capturable"):
            if group.get(setting):
                return f"a group is {setting}"
        if group.get("fused") is False:
            return "it was built with fused=False"
        for p in group["params"]:
            reason = _unfusable_tensor(p)
            if reason is not None:
                return reason
    return None


def _unfusable_tensor(p: torch.Tensor) -> str | None:
    if p.device.type != "cpu":
        return f"a parameter is on {p.device}"
    if p.dtype not in FUSED_DTYPES:
        return f"a parameter is {p.dtype}"
    grad = p.grad
    if grad is not None and (grad.layout != torch.strided or grad.dtype != p.dtype or grad.device != p.device):
        return f"a gradient is {grad.layout} {grad.dtype} on {grad.device}"
    return None


def _mixed_first_momentum(optimizer: torch.optim.Optimizer, states: dict[torch.Tensor, dict[str, Any]]) -> bool:
    """Whether a momentum SGD group steps some parameters for the first time and others not: the
    fused kernel takes one first-step flag per group (the loop starts each buffer on its own)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    for group in optimizer.param_groups:
        if group["momentum"] != 0:
            stepped = [p in states for p in group["params"] if p.grad is not None]
            if any(stepped) and not all(stepped):
                return True
    return False
