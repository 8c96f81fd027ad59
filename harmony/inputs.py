"""Checks of what a user hands Harmony: the sizes, the functions, and what the functions return.

A mistake in ``get_batch``, ``loss_fn`` or an optimizer builder otherwise surfaces deep inside the
compile or a worker, in words about Harmony's code ("too many values to unpack", a batch size read
from a tensor's second dimension, autograd's "grad can be implicitly created only for scalar
outputs"). Each check here names the argument, says what it got (type, shape, length) and what to
do. ``harmony.compile``, the ``Trainer`` and the model-file loader call the same checks, so a
mistake reads the same whichever way the function came in; the model file adds its path in front
(``source``) and raises ``ModelFileError`` (``error``).

The checks that call the user's functions do so once, on small inputs, and leave the global random
generators (torch's, numpy's, Python's) and the model's buffers as they found them: checking must
not change what training draws or computes.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import random
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import numpy as np
import torch
from torch.utils import _pytree as pytree

from harmony.errors import HarmonyError

log = logging.getLogger(__name__)

__all__ = ["describe", "check_positive_int", "check_minibatch_size", "check_devices", "check_model",
           "check_callable", "check_batch", "sample_batch", "check_loss", "check_loss_fn", "check_loss_on_model",
           "check_optimizer", "check_optimizer_builder", "check_scheduler", "check_scheduler_builder",
           "random_states_kept"]

Error = type[HarmonyError]

BATCH_SIGNATURE = "get_batch(batch_size, step) -> (inputs, target)"
LOSS_SIGNATURE = "loss_fn(output, target) -> a scalar loss tensor"
OPTIMIZER_EXAMPLE = "lambda params: torch.optim.SGD(params, lr=0.01)"
SCHEDULER_EXAMPLE = "lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)"


# ------------------------------------------------------------ describing what was given
def describe(value: Any, depth: int = 0) -> str:
    """A value as a message shows it: a tensor by dtype and shape, a sequence by its length and
    first items, a mapping by its keys, anything else by type (and value, if short)."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{'an' if dtype.startswith('i') else 'a'} {dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        kind = type(value).__name__
        count = f"a {kind} of {len(value)} value{'s' if len(value) != 1 else ''}"
        if depth > 0 or not value:
            return count
        items = ", ".join(describe(v, depth + 1) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{count} ({items})"
    if isinstance(value, Mapping):
        keys = ", ".join(repr(k) for k in list(value)[:6]) + (", ..." if len(value) > 6 else "")
        return f"a {type(value).__name__} with keys {keys}" if value else f"an empty {type(value).__name__}"
    if value is None:
        return "None"
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 40 else f"a {type(value).__name__}"


# ------------------------------------------------------------ sizes and the model
def check_positive_int(value: Any, name: str, what: str, example: str) -> int:
    """``value`` as an int if it is a positive integer (numpy's included, ``bool`` not: ``True`` is
    a mistake, not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise HarmonyError(f"{name}: the {what} must be a positive integer, got {describe(value)}; "
                           f"pass e.g. {name}={example}")
    return int(value)


def check_minibatch_size(minibatch_size: Any) -> int:
    """The samples of one optimizer step, which the plan cuts into microbatches."""
    return check_positive_int(minibatch_size, "minibatch_size", "minibatch size", "64")


def check_devices(devices: Any) -> int:
    """How many devices the plan spreads the model over."""
    return check_positive_int(devices, "devices", "device count", "2")


def check_model(model: Any) -> torch.nn.Module:
    """The model must be a module: the decomposer cuts its forward into layers."""
    if not isinstance(model, torch.nn.Module):
        raise HarmonyError(f"model: expected a torch.nn.Module, got {describe(model)}; pass the model itself "
                           "(an nn.Module instance, not its class or its output)")
    return model


def check_callable(fn: Any, name: str, signature: str, *, error: Error = HarmonyError, source: str = "") -> None:
    """A function argument must be callable; the message shows how it is called."""
    if not callable(fn):
        raise error(f"{source}{name} must be a function {signature}, got {describe(fn)}")


# ------------------------------------------------------------ get_batch
def check_batch(batch: Any, batch_size: int, step: int = 0, *, name: str = "get_batch", error: Error = HarmonyError,
                source: str = "") -> tuple[Any, Any]:
    """What ``get_batch(batch_size, step)`` returned, checked: a pair (inputs, target), the inputs a
    tensor or a non-empty tuple or list of tensors, every tensor (the target's too, if a tensor)
    batch first with ``batch_size`` samples, as the runtime cuts them into microbatches."""
    call = f"{source}{name}({batch_size}, {step})"
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise error(f"{call} returned {describe(batch)}; it must return a pair (inputs, target), e.g. "
                    f"`return x, y`{_pair_hint(batch)}")
    inputs, target = batch
    if isinstance(inputs, torch.Tensor):
        named = {"inputs": inputs}
    elif isinstance(inputs, (tuple, list)) and inputs and all(isinstance(x, torch.Tensor) for x in inputs):
        named = {f"inputs[{i}]": x for i, x in enumerate(inputs)}
    else:
        raise error(f"{call} returned inputs that are {describe(inputs)}; the inputs must be a tensor or a non-empty "
                    "tuple of tensors, the model's positional arguments (model(*inputs)), e.g. `return (x1, x2), y`")
    for label, tensor in named.items():
        _check_batch_first(tensor, label, call, batch_size, error)
    if isinstance(target, torch.Tensor):
        _check_batch_first(target, "the target", call, batch_size, error)
    return inputs, target


def _pair_hint(batch: Any) -> str:
    """What to change for the usual wrong shapes of a batch."""
    if isinstance(batch, torch.Tensor):
        return "; a bare tensor is not a pair: return the target beside it"
    if isinstance(batch, (tuple, list)) and len(batch) > 2:
        return "; for a model of several inputs, put them in one tuple: `return (x1, x2), y`"
    if isinstance(batch, Mapping):
        return "; take the inputs and the target out of the dict: `return batch['x'], batch['y']`"
    return ""


def _check_batch_first(tensor: torch.Tensor, label: str, call: str, batch_size: int, error: Error) -> None:
    """A tensor of the batch holds ``batch_size`` samples along its first dimension."""
    if tensor.dim() == 0:
        raise error(f"{call} returned {label} as {describe(tensor)}, which has no batch dimension to cut into "
                    f"microbatches; give it {batch_size} samples along its first dimension")
    if tensor.shape[0] != batch_size:
        raise error(f"{call} returned {label} as {describe(tensor)}: {tensor.shape[0]} samples where {batch_size} "
                    "were asked for; build the batch from the batch_size argument, samples along the first dimension")


def sample_batch(get_batch: Any, batch_size: int, step: int = 0, name: str = "get_batch") -> tuple[Any, Any]:
    """Call ``get_batch`` once and check what it returns, leaving the random generators as they
    were (a ``get_batch`` that draws its data must draw the same batches in training)."""
    check_callable(get_batch, name, BATCH_SIGNATURE)
    with random_states_kept():
        batch = _called(get_batch, name, f"{name}({batch_size}, {step})", batch_size, step)
    return check_batch(batch, batch_size, step, name=name)


# ------------------------------------------------------------ loss_fn
def check_loss(loss: Any, output: Any, *, name: str = "loss_fn", error: Error = HarmonyError,
               source: str = "") -> torch.Tensor:
    """What ``loss_fn(output, target)`` returned, checked: one floating value the backward can
    start from (a per-sample vector needs a ``.mean()``), still attached to the output's graph."""
    call = f"{source}{name}(output, target)"
    if not isinstance(loss, torch.Tensor):
        raise error(f"{call} returned {describe(loss)}; it must return the loss as a tensor, computed with torch "
                    "operations on the output (not .item() or a Python number), e.g. "
                    "torch.nn.functional.cross_entropy(output, target)")
    if loss.numel() != 1:
        raise error(f"{call} returned {describe(loss)}; the loss must be a scalar, the mean over the batch's "
                    "samples: reduce it (e.g. `.mean()`, or reduction='mean' in torch.nn.functional)")
    if not loss.is_floating_point():
        raise error(f"{call} returned {describe(loss)}; the loss must be a real floating-point tensor (autograd "
                    "differentiates no integers): compute it from the output, not from counts or labels alone")
    if torch.is_grad_enabled() and _requires_grad(output) and not loss.requires_grad:
        raise error(f"{call} returned a loss that does not require grad although the output does: it was cut "
                    "from the output's graph (.detach(), .item(), .data, torch.no_grad(), or a new tensor made from "
                    "numbers); compute it with torch operations on the output")
    return loss


def _requires_grad(value: Any) -> bool:
    """Whether any tensor in a model output (a tensor, or tuples, lists and dicts of them) requires grad."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, Mapping):
        return any(_requires_grad(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_requires_grad(v) for v in value)
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in pytree.tree_leaves(value))


def check_loss_fn(loss_fn: Any, output: Any, target: Any, name: str = "loss_fn") -> torch.Tensor:
    """Call ``loss_fn`` on a model output and its target and check the result (``check_loss``)."""
    check_callable(loss_fn, name, LOSS_SIGNATURE)
    loss = _called(loss_fn, name, f"{name}(output, target) with output {describe(output)} and target "
                                  f"{describe(target)}", output, target)
    return check_loss(loss, output, name=name)


def check_loss_on_model(model: torch.nn.Module, loss_fn: Any, inputs: Any, target: Any,
                        name: str = "loss_fn") -> None:
    """Run ``model`` once on ``get_batch``'s example and check ``loss_fn`` on its output, with
    autograd on (the loss must carry the output's gradient). The forward runs on copies of the
    buffers (BatchNorm's running statistics stay as they were) with the random generators forked
    (dropout draws nothing from the user's stream); nothing calls backward, so no gradient reaches
    the parameters. A model on the meta device cannot run and is not checked: its loss is first
    seen by the profiler."""
    device = _device_of(model)
    if device is None:
        log.debug("the loss function is not checked before the compile: the model's state is on the meta "
                  "device or on several devices")
        return
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    args = tuple(x.to(device) for x in args)
    target = target.to(device) if isinstance(target, torch.Tensor) else target
    buffers = {key: b.detach().clone() for key, b in model.named_buffers()}
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        try:
            output = torch.func.functional_call(model, buffers, args)
        except HarmonyError:
            raise
        except Exception as exc:
            raise HarmonyError(f"the model raised {type(exc).__name__} on get_batch's inputs ({describe(inputs)}): "
                               f"{exc}; get_batch must return the model's positional inputs, as model(*inputs) "
                               "takes them") from exc
        check_loss_fn(loss_fn, output, target, name=name)


def _device_of(model: torch.nn.Module) -> torch.device | None:
    """The one device a model's parameters and buffers are on (the host for a model without any),
    or None where the model cannot run as it is: on the meta device, or spread over devices."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1 or next(iter(devices)).type == "meta":
        return None
    return next(iter(devices))


# ------------------------------------------------------------ optimizer and scheduler builders
def check_optimizer(optimizer: Any, *, name: str = "build_optimizer", error: Error = HarmonyError,
                    source: str = "") -> torch.optim.Optimizer:
    """What an optimizer builder returned: the runtime steps, saves and restores a torch optimizer."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise error(f"{source}{name}(params) returned {describe(optimizer)}; it must return a torch.optim.Optimizer "
                    f"over the parameters it is given, e.g. {OPTIMIZER_EXAMPLE}")
    return optimizer


def check_optimizer_builder(build_optimizer: Any, name: str = "build_optimizer") -> None:
    """An optimizer builder, tried on stand-in parameters (a matrix and a vector, so a builder that
    groups weights by their shape finds both kinds): the runtime calls it on every pack's
    parameters, so one that fails fails there, in a worker."""
    check_callable(build_optimizer, name, f"{name}(params) -> torch.optim.Optimizer")
    check_optimizer(_called(build_optimizer, name, f"{name}(params) on stand-in parameters", _stand_ins()), name=name)


def _stand_ins() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]


def check_scheduler(scheduler: Any, *, name: str = "lr_scheduler", error: Error = HarmonyError,
                    source: str = "") -> Any:
    """What a learning-rate scheduler builder returned: something the trainer steps once per minibatch."""
    if not callable(getattr(scheduler, "step", None)):
        raise error(f"{source}{name}(optimizer) returned {describe(scheduler)}, which has no step() method; it "
                    "must return a torch.optim.lr_scheduler scheduler of the optimizer it is given, e.g. "
                    f"{SCHEDULER_EXAMPLE}")
    return scheduler


def check_scheduler_builder(build_scheduler: Any, build_optimizer: Callable, name: str = "lr_scheduler") -> None:
    """A scheduler builder, tried on an optimizer over stand-in parameters (``build_optimizer``'s)."""
    check_callable(build_scheduler, name, f"{name}(optimizer) -> a torch.optim.lr_scheduler scheduler")
    optimizer = _called(build_optimizer, "build_optimizer", "the optimizer builder on stand-in parameters",
                        _stand_ins())
    check_scheduler(_called(build_scheduler, name, f"{name}(optimizer) on an optimizer over stand-in parameters",
                            optimizer), name=name)


# ------------------------------------------------------------ calling the user's functions
def _called(fn: Callable, name: str, call: str, *args: Any) -> Any:
    """``fn(*args)``; an exception it raises becomes a ``HarmonyError`` naming the argument and the
    call, the original kept as its ``__cause__`` (whose traceback shows the line that failed)."""
    try:
        return fn(*args)
    except HarmonyError:
        raise
    except Exception as exc:
        raise HarmonyError(f"{call} raised {type(exc).__name__}: {exc}; check {name}") from exc


@contextlib.contextmanager
def random_states_kept() -> Iterator[None]:
    """Torch's (host and initialized GPUs), numpy's and Python's global generators, restored on exit."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
