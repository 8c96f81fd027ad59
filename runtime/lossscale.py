"""Dynamic loss scaling for fp16, as ``torch.amp.GradScaler`` does it, decided once per minibatch.

The loss task multiplies the loss by the scale before its backward. Once every gradient of the
minibatch is in host memory, the NORM task (``clipping.py``) unscales them all and checks them for
inf and NaN with torch's own kernel; if any overflowed, no update of the minibatch steps (every
update of a plan that scales waits for the NORM task, and none is fused into a backward). After the
minibatch the launcher updates the scale with torch's kernel: halved after an overflow, doubled
after ``growth_interval`` steps without one. The state saves as GradScaler's ``state_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossScale:
    """The scale and its growth tracker, with GradScaler's defaults."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0

    def update(self, found_inf: bool) -> None:
        """GradScaler.update: the same kernel on the same float32 values."""
        scale = torch.full((1,), self.scale, dtype=torch.float32)
        tracker = torch.full((1,), self.growth_tracker, dtype=torch.int32)
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(found_inf)), self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self.scale, self.growth_tracker = float(scale), int(tracker)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])


def unscale(gradients: list[torch.Tensor], scale: float) -> bool:
    """Divide every gradient by the loss scale in place (as GradScaler.unscale_: times its float32
    reciprocal); True if any holds an inf or a NaN."""
    found_inf = torch.zeros(1)
    inv_scale = torch.full((1,), scale, dtype=torch.float32).double().reciprocal().float()
    for dtype in {g.dtype for g in gradients}:
        torch._amp_foreach_non_finite_check_and_unscale_([g for g in gradients if g.dtype == dtype], found_inf,
                                                         inv_scale)
    return bool(found_inf.item())
