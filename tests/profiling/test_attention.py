"""Attention as a CUDA GPU runs it, on meta tensors: which kernel, and the same output shapes and
gradients' shapes as ``F.scaled_dot_product_attention`` gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from harmony.profiling.attention import CudaAttention, cuda_kernel, run_on

B, H, S, D = 2, 4, 8, 16


def _qkv(dtype: torch.dtype, kv_heads: int = H, head_dim: int = D, keys: int = S):
    return (torch.empty(B, H, S, head_dim, dtype=dtype, device="meta"),
            torch.empty(B, kv_heads, keys, head_dim, dtype=dtype, device="meta"),
            torch.empty(B, kv_heads, keys, head_dim, dtype=dtype, device="meta"))


EFFICIENT_GQA = "efficient" if TorchVersion(torch.__version__) >= (2, 14) else "math"


@pytest.mark.parametrize("dtype, mask, head_dim, keys, causal, kv_heads, kernel", [
    (torch.bfloat16, False, D, S, True, H, "flash"),
    (torch.bfloat16, False, D, S, True, H // 2, "flash"),
    (torch.float16, False, 256, S, False, H, "flash"),
    (torch.bfloat16, True, D, S, False, H, "efficient"),  # flash takes no mask
    (torch.bfloat16, False, 512, S, False, H, "efficient"),  # nor a head dim above 256
    (torch.bfloat16, False, D, 2 * S, True, H, "efficient"),  # nor a causal mask over unequal lengths
    (torch.bfloat16, False, D, 2 * S, False, H, "flash"),
    (torch.float32, False, D, S, True, H, "efficient"),
    (torch.float32, False, D, S, True, H // 2, EFFICIENT_GQA),  # grouped heads: from torch 2.14 on
    (torch.bfloat16, True, D, S, False, H // 2, EFFICIENT_GQA),
    (torch.float64, False, D, S, True, H, "math"),
])
def test_the_kernel_is_the_one_cuda_dispatches_to(dtype, mask, head_dim, keys, causal, kv_heads, kernel):
    q, k, v = _qkv(dtype, kv_heads=kv_heads, head_dim=head_dim, keys=keys)
    attn_mask = torch.ones(B, 1, 1, keys, dtype=torch.bool, device="meta") if mask else None
    assert cuda_kernel(q, k, v, attn_mask, causal) == kernel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kv_heads", [H, H // 2])
@pytest.mark.parametrize("mask", [False, True])
def test_every_kernel_gives_the_shapes_scaled_dot_product_attention_gives(dtype, kv_heads, mask):
    q, k, v = (t.requires_grad_() for t in _qkv(dtype, kv_heads=kv_heads))
    attn_mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device="meta") if mask else None
    with CudaAttention():
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=not mask, scale=0.5,
                                           enable_gqa=kv_heads != H)
    assert y.shape == q.shape and y.dtype == dtype
    grads = torch.autograd.grad(y, (q, k, v), torch.empty_like(y))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_every_call_of_the_op_is_replaced_and_nothing_else():
    q, k, v = _qkv(torch.bfloat16)
    seen = []

    class Outer(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Outer(), CudaAttention():
        torch.ops.aten.scaled_dot_product_attention.default(q, k, v, is_causal=True)
        F.scaled_dot_product_attention(q, k, v)
        torch.matmul(q, k.transpose(-2, -1))
    assert seen.count(torch.ops.aten._scaled_dot_product_flash_attention) == 2
    assert torch.matmul in seen


def test_an_unknown_device_type_is_refused():
    with pytest.raises(ValueError, match="cuda, cpu, not 'tpu'"):
        with run_on("tpu"):
            pass
