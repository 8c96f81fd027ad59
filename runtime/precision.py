"""Mixed precision: the device computes under ``torch.autocast`` (issue 17).

``precision`` is "fp32" (no autocast), "bf16" or "fp16": every layer's forward (and recompute) and
the loss run under ``torch.autocast(device_type, dtype)``, so the ops eager autocast runs in low
precision (matmuls, convolutions, linear layers) run so here, and the rest (norms, softmax,
reductions, the loss) in float32, exactly as the reference does. Weights, gradients and optimizer
state stay in the model's dtype (float32) on the device, in host memory and over the links; only
activations that autocast makes low precision move as such. Autocast leaves float64 alone.

fp16 also scales the loss (``lossscale.py``), as ``torch.amp.GradScaler`` does.

The model is traced without autocast (``decomposer/decompose.py``). A model torch.fx traces keeps
``x.dtype`` symbolic, so its casts follow autocast's dtypes as eager code's do: exact. One that only
torch.export traces (a peft wrapper) has the dtypes it saw baked into explicit casts, which stay
float32 where eager's follow bf16 values: a few elementwise ops then run in another precision,
within bf16 rounding of eager (``tests/runtime/test_lora.py``).

Not done yet: moving low-precision copies of the weights (half the swap bytes).
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
