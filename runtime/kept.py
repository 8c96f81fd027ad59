"""Activations kept from a pack's forward to its backward, on the device or through host memory.

Where the plan keeps or swaps a pack's activations (``Task.keep``, ``Configuration.keep`` and
``swap``), its forward records for autograd under ``torch.autograd.graph.saved_tensors_hooks`` and
each microbatch leaves a ``KeptForward`` for the backward: the leaves of its inputs, its outputs
and the tensors it keeps alive, which the ledger counts. A swapping forward saves each tensor in a
box (``_Saved``); once the microbatch is done, every saved storage that is neither the pack's
state, input nor output goes to host memory whole, as bytes (``swap_out``), and the backward views
each box again in the storages brought back (``restore``).

Nothing but the autograd graph may hold a saved tensor (or its box) once the backward starts:
autograd lets each go as the backward passes the op that saved it, and a reference held past that
(the hooks' list, a loop's variable) is memory the plan counts as free.

Used by ``compute.py``; what moves goes through ``transport.py`` (``Transport.keep``, ``take_kept``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Values = list  # a boundary: tensors and plain objects, in the layer graph's value order

KEPT = "kept"  # ``Compute._sends_by_layer``'s keys of the edges carrying a forward's kept activations
SWAPPED = "swapped"  # and of those carrying the ones it swaps out


@dataclass
class KeptForward:
    """What a forward microbatch leaves for its pack's backward where nothing is recomputed: the
    leaves of its inputs (their ``.grad`` flows back), its outputs (the backward starts there), and
    every device tensor the microbatch keeps alive for it (autograd's saved tensors among them, the
    pack state aside), which the ledger counts until the backward lets them go; where the pack
    swaps its activations, the boxes of the saved tensors that went to host memory."""

    leaves: Values
    outputs: Values
    held: list[torch.Tensor]
    boxes: list["_Saved"] = field(default_factory=list)


class _Saved:
    """A saved tensor of a swapping forward: on the device until the forward ends; then, where it is
    neither the pack's state, input nor output, a place in one of the storages sent to host memory
    (``storage``, with its dtype and view), and on the device again once the backward brings that
    storage back (``restore``)."""

    __slots__ = ("tensor", "storage", "dtype", "offset", "size", "stride")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.storage = -1

    def send(self, storage: int) -> None:
        t = self.tensor
        self.storage, self.dtype, self.offset, self.size, self.stride = (storage, t.dtype, t.storage_offset(),
                                                                        t.size(), t.stride())
        self.tensor = None

    def restore(self, storages: list[torch.Tensor]) -> None:
        bytes_ = storages[self.storage]
        self.tensor = torch.empty(0, dtype=self.dtype, device=bytes_.device).set_(
            bytes_.untyped_storage(), self.offset, self.size, self.stride)


def boxed(into: list, t: torch.Tensor) -> _Saved:
    """A swapping forward's pack hook: the saved tensor in a box (``_Saved``), noted."""
    box = _Saved(t.detach())
    into.append(box)
    return box


def unboxed(box: _Saved) -> torch.Tensor:
    return box.tensor


def restore(boxes: list[_Saved], storages: list[torch.Tensor]) -> None:
    """Each box's tensor viewed again in the storages brought back; the list of boxes emptied. From
    then on only the graph holds the boxes (nothing here, not even a loop's variable), and lets each
    go, its view with it, as the backward passes the op that saved it."""
    for box in boxes:
        box.restore(storages)
    boxes.clear()


def swap_out(boxes: list[_Saved], stay: set[int]) -> tuple[list[_Saved], list[torch.Tensor]]:
    """The saved tensors of a swapping forward's microbatch that go to host memory (every one whose
    storage is not in ``stay``: the pack's state, input and output), each storage once, as bytes:
    (their boxes, the storages' bytes to send). The boxes let go of the device tensors."""
    index: dict[int, int] = {}
    storages: list[torch.Tensor] = []
    sent: list[_Saved] = []
    for box in boxes:
        st = box.tensor.untyped_storage()
        key = st._cdata
        if key in stay:
            continue
        if key not in index:
            index[key] = len(storages)
            storages.append(torch.empty(0, dtype=torch.uint8, device=box.tensor.device).set_(st))
        box.send(index[key])
        sent.append(box)
    return sent, storages


def saved_alias(into: list[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """A saved tensor's pack hook: noted (the ledger counts what the kept activations hold) and
    saved as a detached alias, which holds no reference back to the graph saving it."""
    alias = t.detach()
    into.append(alias)
    return alias


def unsaved(t: torch.Tensor) -> torch.Tensor:
    return t


def detached(values: Values) -> Values:
    """A boundary's values without their autograd history: what a keeping forward sends on."""
    return [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
