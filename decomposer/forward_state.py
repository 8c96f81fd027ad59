"""State a model's forward changes that Harmony's schedules cannot reproduce.

Harmony's devices compute on copies of the parameters, stepped by the optimizer on the host or
where the plan keeps them; what a forward does to the model's own parameters (an in-place write, a
``requires_grad_`` toggle) happens to a copy and is lost, so such a model is refused, naming the
parameter.

A buffer updated in forward() (BatchNorm's running statistics) is written back once per
forward. As long as the forward's output does not read it, the order in which microbatches run,
and a recompute of the forward in the backward, change nothing the gradients see. A forward that
also reads what it updates (``spectral_norm``'s power iteration, a running normalizer applied to
its own input) makes each microbatch's output depend on the ones before it: Harmony runs
microbatches on several devices at once and recomputes forwards in the backward, so its gradients
would differ from eager training. Such a model is refused, naming the buffer.

Found by running the model as written, not by reading its code: one forward shows which buffers
it changes; a second, from the same random state with those buffers perturbed, shows whether the
output reads them.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch.utils import _pytree as pytree

from harmony.decomposer.gradient_check import too_large_to_copy
from harmony.errors import DecomposeError

log = logging.getLogger(__name__)

SEED = 0


def check_forward_state(model: torch.nn.Module, inputs: tuple) -> None:
    """Refuse ``model`` if its forward writes into a parameter, toggles a parameter's
    ``requires_grad``, or reads a buffer it also updates (module docs)."""
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return
    why = too_large_to_copy(model)
    if why:
        log.warning("the check of what forward() changes in the model's state is skipped: %s", why)
        return
    replica = copy.deepcopy(model)
    params = {name: (p.detach().clone(), p.requires_grad) for name, p in replica.named_parameters()}
    before = {name: b.clone() for name, b in replica.named_buffers()}
    first = _outputs(replica, inputs)
    _check_parameters(replica, params)
    updated = [name for name, b in replica.named_buffers() if not _same(b, before[name])]
    if not updated:
        return
    with torch.no_grad():
        for name, b in replica.named_buffers():
            b.copy_(_perturbed(before[name]) if name in updated else before[name])
    second = _outputs(replica, inputs)
    if all(_same(a, b) for a, b in zip(first, second)):
        log.info("buffers updated in forward(), none read by its output: %s", ", ".join(updated[:5]))
        return
    read = _first_read(replica, inputs, before, updated, first)
    raise DecomposeError(
        f"the model's forward() both updates and reads buffer {read!r}: each microbatch's output depends on the "
        "microbatches before it (spectral_norm's power iteration, a running normalizer of its own input). Harmony "
        "runs microbatches on several devices at once and recomputes forwards in the backward, so it would train "
        "differently from eager. Update the buffer outside forward() (after the optimizer step), or use "
        "torch.nn.utils.parametrize without state read back in forward (spectral_norm in eval mode)")


def _check_parameters(model: torch.nn.Module, before: dict[str, tuple[torch.Tensor, bool]]) -> None:
    for name, p in model.named_parameters():
        value, requires_grad = before[name]
        if p.requires_grad != requires_grad:
            raise DecomposeError(
                f"the model's forward() changes requires_grad of parameter {name!r} ({requires_grad} -> "
                f"{p.requires_grad}); Harmony's devices compute on copies of the parameters and would not see it. "
                "Freeze or unfreeze parameters before compiling (p.requires_grad_(False)), not in forward()")
        if not _same(p.detach(), value):
            raise DecomposeError(
                f"the model's forward() writes into parameter {name!r} (an in-place op on it, e.g. a clamp under "
                "torch.no_grad()); Harmony's devices compute on copies of the parameters, so the write would be "
                "lost and training would differ from eager. Apply the change outside forward() (after the "
                "optimizer step), or compute a new tensor from the parameter instead of writing into it")


def _outputs(model: torch.nn.Module, inputs: tuple) -> list[torch.Tensor]:
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(SEED)
        out = model(*inputs)
    return [x.clone() for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))


def _perturbed(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t * 1.5 + 0.25
    if t.dtype == torch.bool:
        return ~t
    return t + 1


def _first_read(model: torch.nn.Module, inputs: tuple, before: dict[str, torch.Tensor], updated: list[str],
                reference: list[torch.Tensor]) -> str:
    """The first updated buffer whose perturbation alone changes the output."""
    for name in updated:
        with torch.no_grad():
            for other, b in model.named_buffers():
                b.copy_(_perturbed(before[other]) if other == name else before[other])
        if not all(_same(a, b) for a, b in zip(reference, _outputs(model, inputs))):
            return name
    return updated[0]
