"""Attention counted as the target device runs it, for the analytic profiler's meta and fake tensors.

``F.scaled_dot_product_attention`` is one call in a model and a choice of kernels in torch: each
device type dispatches it to a kernel of its own. Counted where the analytic profiler counts (meta
tensors, or fake tensors of this machine's device type), that choice would be the counting
machine's, not the target's: on meta tensors torch runs its math path, which writes the
sequence x sequence scores out and keeps them for the backward, where a GPU runs one fused kernel
that keeps the output and a log-sum-exp per query row. So the profiler names the target's device
type, and this module makes the call run that device's kernel on whatever tensors it is counted on:

- ``"cuda"`` (every ``DeviceSpec`` preset describes a CUDA GPU): :class:`CudaAttention` replaces
  the call with the kernel torch's CUDA dispatch chooses with its default backends on an sm80 or
  newer GPU (``cuda_kernel``): FlashAttention-2 for bf16/fp16 without a mask (grouped-query
  attention included), memory-efficient attention for float32 or with a mask (a boolean mask made
  additive, as torch makes it; grouped-query attention only from torch 2.14 on), the math path
  otherwise (float64). Under autocast its inputs are
  cast to autocast's dtype first, as CUDA autocast does for this op. The fused kernels' aten ops
  have meta implementations and FLOP formulas in ``torch.utils.flop_counter``: forward
  4·b·h·s_q·s_k·d (two matrix products), backward 2.5 times that (the kernel recomputes the
  scores: five products), as the model's FLOPs whether causal or not. With ``is_causal`` the
  kernels skip the tiles above the diagonal, so they execute fewer: ``executed_fraction`` is the
  share of the tiles they compute, which the profiler's times are taken from (9/16 at 1,024
  tokens in 128-wide tiles). Their outputs are the output and the float32 log-sum-exp, b·h·s
  numbers: no s² tensor is written or saved.
- ``"cpu"``: torch's own CPU dispatch, on fake CPU tensors. torch 2.13 and 2.14 run a fused kernel
  there too (``_scaled_dot_product_flash_attention_for_cpu``, float64 included, masks included),
  and the math path, with its s² scores, for a dropout above 0 in training. The flop counter has no
  formula for the CPU kernel: ``FLOP_FORMULAS`` gives it the same as the GPU kernels'. Its tiling
  depends on the thread count and the sizes, so its causal tiles are not discounted.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.torch_version import TorchVersion
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

DEVICE_TYPES = ("cuda", "cpu")
_SDPA = (F.scaled_dot_product_attention, aten.scaled_dot_product_attention,
         aten.scaled_dot_product_attention.default)
_FUSED_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
# memory-efficient attention takes fewer key/value heads than query heads from torch 2.14 on; before,
# CUDA runs grouped-query attention with a mask or in float32 on the math path
_EFFICIENT_GQA = TorchVersion(torch.__version__) >= (2, 14)


# the CUDA kernels' tiles (queries x keys) on sm80+, which a causal call skips above the diagonal:
# FlashAttention-2 at head dims up to 128, and the memory-efficient kernel; the tiles of the
# backward differ a little, and are taken as the forward's
_CAUSAL_TILES = {
    aten._scaled_dot_product_flash_attention.default: (128, 128),
    aten._scaled_dot_product_flash_attention_backward.default: (128, 128),
    aten._scaled_dot_product_efficient_attention.default: (64, 64),
    aten._scaled_dot_product_efficient_attention_backward.default: (64, 64),
}


def causal_tiles(queries: int, keys: int, tile_q: int, tile_k: int) -> float:
    """The share of the (queries x keys) tiles a causal kernel computes: those holding a key at or
    before a query of theirs (the mask aligned top-left, as torch's ``is_causal``)."""
    rows, cols = -(-queries // tile_q), -(-keys // tile_k)
    computed = sum(min(cols, -(-min((r + 1) * tile_q, keys) // tile_k)) for r in range(rows))
    return computed / (rows * cols)


def executed_fraction(func: Any, args: tuple, kwargs: dict[str, Any]) -> float:
    """The share of an aten op's counted FLOPs its kernel executes: the computed tiles' share
    (``causal_tiles``) for a causal fused attention kernel on CUDA, 1 for any other op."""
    tiles = _CAUSAL_TILES.get(func)
    if tiles is None:
        return 1.0
    names = [a.name for a in func._schema.arguments]
    bound = {**dict(zip(names, args)), **kwargs}
    if not bound.get("is_causal", False):
        return 1.0
    query, key = bound["query"], bound["key"]
    return causal_tiles(query.size(-2), key.size(-2), *tiles)


def _cpu_flash_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                              **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# for ``FlopCounterMode(custom_mapping=...)``: the fused kernels the flop counter has no formula for
FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
}


def _arguments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
               enable_gqa: bool = False) -> dict[str, Any]:
    """The call's arguments by name, as ``F.scaled_dot_product_attention`` and its aten op take them."""
    return dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa)


def cuda_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                is_causal: bool) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: the kernel torch's CUDA dispatch runs for these
    inputs on an sm80+ GPU with the default backends (``sdp_utils``' checks, in their order)."""
    if any(t.dim() != 4 for t in (query, key, value)) or query.size(-1) != key.size(-1):
        return "math"
    square = query.size(-2) == key.size(-2)
    if (query.dtype in _FUSED_DTYPES and attn_mask is None and query.size(-1) == value.size(-1)
            and query.size(-1) <= _FLASH_MAX_HEAD_DIM and (square or not is_causal)):
        return "flash"
    grouped = key.size(-3) != query.size(-3)
    if query.dtype in (*_FUSED_DTYPES, torch.float32) and (_EFFICIENT_GQA or not grouped):
        return "efficient"
    return "math"


def _additive(attn_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive bias the fused kernels take: 0 where attended, -inf elsewhere."""
    if attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(
        attn_mask.logical_not(), float("-inf"))


def _autocast_inputs(call: dict[str, Any]) -> dict[str, Any]:
    """The inputs CUDA autocast gives the op: floating ones in autocast's dtype, where it is on for
    the tensors' device type (the fake device a mixed-precision profile counts on)."""
    device_type = call["query"].device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return call
    low = torch.get_autocast_dtype(device_type)
    for name in ("query", "key", "value", "attn_mask"):
        t = call[name]
        if t is not None and t.is_floating_point():
            call[name] = t.to(low)
    return call


def cuda_attention(call: dict[str, Any]) -> torch.Tensor:
    """The attention output, computed by the aten op of the kernel CUDA would run (``cuda_kernel``)."""
    q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    kernel = cuda_kernel(q, k, v, mask, call["is_causal"])
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, call["dropout_p"], call["is_causal"], False,
                                                        scale=call["scale"])[0]
    if kernel == "efficient":
        log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        bias = None if mask is None else _additive(mask, q.dtype)
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, log_sumexp, call["dropout_p"],
                                                            call["is_causal"], scale=call["scale"])[0]
    return aten._scaled_dot_product_attention_math(q, k, v, mask, call["dropout_p"], call["is_causal"],
                                                   scale=call["scale"], enable_gqa=call["enable_gqa"])[0]


class CudaAttention(TorchFunctionMode):
    """Runs every ``scaled_dot_product_attention`` call as a CUDA GPU runs it (``cuda_attention``),
    whatever the tensors' device; every other call as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SDPA:
            return func(*args, **kwargs)
        call = _autocast_inputs(_arguments(*args, **kwargs))
        device_type = call["query"].device.type
        with (torch.autocast(device_type, enabled=False) if device_type != "meta" else contextlib.nullcontext()):
            return cuda_attention(call)


@contextlib.contextmanager
def run_on(device_type: str) -> Iterator[None]:
    """Within it, attention runs as on ``device_type`` (see the module docstring); ``"cpu"`` changes
    nothing, so the counting tensors must be (fake) CPU tensors."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"attention is counted for device types {', '.join(DEVICE_TYPES)}, not {device_type!r}")
    with CudaAttention() if device_type == "cuda" else contextlib.nullcontext():
        yield
