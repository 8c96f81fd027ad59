"""Small helpers shared by the reference models: preset lookup, dtype names, synthetic data.

Every model file in this package takes its options as plain strings and numbers (they arrive
from ``--arg key=value``), so the conversions from those strings live here once.
"""

from __future__ import annotations

from typing import Mapping, TypeVar

import torch
from torch import nn

C = TypeVar("C")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"float32"``/``"float64"`` (or a torch dtype) to the torch dtype.

    Only the two floating types the tests compare at are accepted: float64 for tight
    equivalence checks against eager PyTorch, float32 for everything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose one of {sorted(DTYPES)}")
        return dtype
    try:
        return DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None


def resolve_preset(presets: Mapping[str, C], preset: str | int, model: str) -> C:
    """Look up a preset by name, naming the valid ones when it is mistyped.

    ``--arg preset=96`` arrives as the integer 96 (options are parsed as Python literals), so the
    name is converted to a string before the lookup.
    """
    key = str(preset)
    if key not in presets:
        raise ValueError(f"{model} has no preset {preset!r}; choose one of {', '.join(presets)}")
    return presets[key]


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once); works on meta."""
    return sum(p.numel() for p in model.parameters())


def generator_for(step: int) -> torch.Generator:
    """A CPU generator seeded from the step, so a batch depends only on (batch_size, step)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(1_000_003 * int(step) + 12_345)
    return g


def token_sequences(batch_size: int, length: int, vocab_size: int, step: int,
                    low: int = 0) -> torch.Tensor:
    """Learnable token data: each row counts from a random start with a random stride (1..4).

    Random tokens would leave nothing to learn, so convergence tests could not tell a training
    bug from noise; arithmetic progressions modulo the vocabulary are predictable from the two
    previous tokens yet differ per row. Tokens lie in ``[low, vocab_size)``.
    """
    g = generator_for(step)
    span = vocab_size - low
    start = torch.randint(0, span, (batch_size, 1), generator=g, device="cpu")
    stride = torch.randint(1, 5, (batch_size, 1), generator=g, device="cpu")
    pos = torch.arange(length, device="cpu").unsqueeze(0)
    return (start + stride * pos) % span + low


def class_images(batch_size: int, channels: int, size: int, num_classes: int, step: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable image data: Gaussian noise shifted by a per-class, per-channel offset.

    The offsets come from a fixed seed (the same for every step), so a class looks alike across
    batches and a classifier can learn it; storing one offset per (class, channel) keeps this
    cheap even for 1000 classes at 224x224.
    """
    g = generator_for(step)
    labels = torch.randint(0, num_classes, (batch_size,), generator=g, device="cpu")
    noise = torch.randn(batch_size, channels, size, size, generator=g, device="cpu", dtype=dtype)
    offsets = torch.randn(num_classes, channels, generator=generator_for(-1), device="cpu",
                          dtype=dtype)
    images = noise + offsets[labels][:, :, None, None]
    return images, labels
