"""Handing each iteration's minibatch to the workers through buffers they already hold.

A tensor put on a ``torch.multiprocessing`` queue moves to a new shared-memory segment, and every
worker that unpickles it fetches the segment's file descriptor from the sender over a socket and
maps it. Done afresh for every minibatch, that is the largest part of the launcher's overhead
between ``step`` and a worker's first task on a small model.

``BatchSlots`` (the launcher's side) keeps the last minibatch it sent in shared memory. A new one of
the same structure (tensor shapes and dtypes, the other values, size and seed) is copied into those
buffers and the workers are told to reuse theirs (``None`` on the queue); anything else is sent
whole and becomes the new buffers. The copy is safe because ``Launcher.step`` returns only once
every worker finished the iteration, after which no worker reads the buffers until the next command.
"""

from __future__ import annotations

from typing import Any

import torch

from harmony.runtime.context import Batch

__all__ = ["BatchSlots", "received"]


def _shared(x: Any) -> Any:
    """A copy of a host tensor in shared memory (other values as they are)."""
    if not isinstance(x, torch.Tensor):
        return x
    out = torch.empty(x.shape, dtype=x.dtype).share_memory_()
    out.copy_(x.detach().cpu())
    return out


def _same_structure(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype)
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # a value without a plain equality: send it again
        return False


class BatchSlots:
    """The launcher's shared buffers for the minibatch; see the module docs."""

    def __init__(self) -> None:
        self._held: Batch | None = None  # what the workers hold

    def fill(self, batch: Batch) -> Batch | None:
        """Put ``batch`` where the workers read it: ``None`` when it went into the buffers they
        hold, else the new shared batch to send them."""
        held = self._held
        values = [*batch.inputs, batch.target]
        if held is not None and held.size == batch.size and held.seed == batch.seed \
                and len(held.inputs) == len(batch.inputs) \
                and all(_same_structure(h, v) for h, v in zip([*held.inputs, held.target], values)):
            with torch.no_grad():
                for h, v in zip([*held.inputs, held.target], values):
                    if isinstance(h, torch.Tensor):
                        h.copy_(v.detach())
            return None
        self._held = Batch(inputs=[_shared(x) for x in batch.inputs], target=_shared(batch.target),
                           size=batch.size, seed=batch.seed)
        return self._held

    def forget(self) -> None:
        """The workers hold nothing any more (they were restarted): the next batch goes whole."""
        self._held = None


def received(sent: Batch | None, held: Batch | None) -> Batch:
    """The worker's side: the batch of this iteration, given what came on the queue and what it
    held from before."""
    if sent is not None:
        return sent
    if held is None:
        raise RuntimeError("the launcher sent no minibatch and this worker holds none")
    return held
