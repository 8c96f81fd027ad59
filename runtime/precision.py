"""Mixed precision: the device computes under ``torch.autocast``.

``precision`` is "fp32" (no autocast), "bf16" or "fp16": every layer's forward (and recompute) and
the loss run under ``torch.autocast(device_type, dtype)``, so the ops eager autocast runs in low
precision (matmuls, convolutions, linear layers) run so here, and the rest (norms, softmax,
reductions, the loss) in float32, exactly as the reference does. Masters, gradients and optimizer
state stay in the model's dtype (float32). Weights that autocast only casts move and stay on the
devices as low-precision copies cast on the host (``profiling/casts.py``): frozen ones always,
trainable ones where the host steps them, their gradients cast up to float32 as the cast's
backward does (``compute._GradInFloat32``). Activations that autocast makes low precision move as
such. Autocast
leaves float64 alone.

fp16 also scales the loss (``lossscale.py``), as ``torch.amp.GradScaler`` does.

The model is traced without autocast (``decomposer/decompose.py``). Not bitwise eager either way:
where the plan adds gradients in another order than eager code (across devices, or where a value
used several times meets its gradient at a pack boundary) float32 sums differ by an ulp, a later
cast may round to the neighbouring bf16 value, and that spreads (``python -m bench.precision_exactness``:
losses within 3e-4 after three steps on generated models, many runs bitwise equal). A model torch.fx
traces keeps ``x.dtype`` symbolic, so its own casts follow autocast as eager code's do; one that
only torch.export traces (a peft wrapper) has the dtypes it saw baked into explicit casts, which
stay float32 where eager's follow bf16 values (``tests/runtime/test_lora.py``).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from harmony.errors import HarmonyError

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check(precision: str) -> None:
    if precision not in PRECISIONS:
        raise HarmonyError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")


def needs_loss_scaling(precision: str) -> bool:
    """fp16's range is too narrow for small gradients: the loss is scaled up, and a step whose
    gradient overflowed is skipped (``lossscale.py``)."""
    return precision == "fp16"


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast runs the low-precision ops in; None for fp32."""
    return PRECISIONS[precision]


def autocast(device_type: str, precision: str, cache: bool = True) -> ContextManager:
    """The autocast region layers and the loss run in (nothing for fp32). ``cache=False`` for a
    long region (a whole compile): autocast keeps its low-precision copies of the weights until the
    outermost region ends, which over many measurements would fill the device."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=cache)
