"""Random numbers that do not depend on how the work is scheduled.

Each microbatch has its own random stream, seeded from (run seed, iteration, first sample of the
microbatch). Layers draw from it in model order wherever they run: a pack's forward starts from the
state the previous pack left (carried with the activation), and a recompute restores the state its
forward had at the same layer (stashed with the input). The eager reference seeds the default
generator the same way before each microbatch's forward, so dropout masks match exactly.
"""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads nearby seeds apart
_MASK = (1 << 63) - 1


def microbatch_seed(seed: int, iteration: int, first_sample: int) -> int:
    """The seed of the microbatch that starts at ``first_sample`` of the minibatch of ``iteration``."""
    return ((seed * _MIX) ^ (iteration * 1_000_003 + first_sample) * 0xBF58476D1CE4E5B9) & _MASK


def capture(device: torch.device) -> torch.Tensor:
    """The generator state that work on ``device`` draws from."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def restore(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def seeded(device: torch.device, seed: int) -> torch.Tensor:
    """The state right after ``manual_seed(seed)``, made on a generator of its own: stream threads
    call this while the compute thread draws from the default generator."""
    return torch.Generator(device=device).manual_seed(seed).get_state()
