"""GPT-2 (Radford et al., 2019) as a plain, nanoGPT-style PyTorch module; also a model file.

The Harmony paper (§5.1) trains GPT2-Medium (0.3B), GPT2 (1.5B) and "customized GPT2 models
(10s of billions)" following ZeRO-Infinity, all at sequence length 1024 with Adam. The paper does
not list the shapes of the customized models; ``10b``, ``20b`` and ``40b`` below take the shapes of
the ZeRO papers' GPT-2 scaling tables (10B: 50 layers x 4096; 40B: 50 layers x 8192; 20B: 25
layers x 8192, the same width at half the depth).

Attention is one ``F.scaled_dot_product_attention`` call with ``is_causal=True``, as Hugging Face's
``GPT2LMHeadModel`` computes it with its sdpa attention: on a GPU that is a fused kernel (flash
attention) that never stores the sequence x sequence scores, and no mask buffer of the longest
sequence's size is kept to be swapped for nothing.

Usage as a model file: ``harmony compile models/gpt2.py --arg preset=1.5b``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from harmony.models.common import resolve_dtype, resolve_preset, token_sequences


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2 model. ``block_size`` is the longest sequence (positions embedded)."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 50257
    block_size: int = 1024
    dropout: float = 0.1


# Parameter counts (lm_head tied to wte, so counted once; 12*d^2 + 13*d per block plus embeddings).
PRESETS: dict[str, GPTConfig] = {
    # 41,760 parameters: for tests.
    "tiny": GPTConfig(n_layer=3, n_head=4, n_embd=32, vocab_size=96, block_size=16),
    # GPT2-Medium: 354,823,168 parameters.
    "medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    # GPT2-Large: 774,030,080 parameters.
    "large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    # GPT2 (XL), the paper's default "GPT2": 1,557,611,200 parameters.
    "1.5b": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    # ZeRO's 10B GPT-2: 10,279,047,168 parameters.
    "10b": GPTConfig(n_layer=50, n_head=32, n_embd=4096),
    # 20,555,431,936 parameters.
    "20b": GPTConfig(n_layer=25, n_head=64, n_embd=8192),
    # ZeRO's 40B GPT-2: 40,690,753,536 parameters.
    "40b": GPTConfig(n_layer=50, n_head=64, n_embd=8192),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd {config.n_embd} is not a multiple of n_head {config.n_head}")
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = config.dropout  # on the attention weights, inside the fused kernel
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size(0), x.size(1), x.size(2)
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_dropout if self.training else 0.0,
                                           is_causal=True)  # (B, n_head, T, head_dim)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide, with GPT-2's tanh-approximated GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block (GPT-2 moved LayerNorm to the sub-block inputs)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2 language model: token ids (B, T) -> next-token logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying as in GPT-2: one Parameter, so Harmony must keep it shared across the
        # first and last layer instead of updating two copies.
        self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2L).

        Uses only in-place ``nn.init`` calls, which are no-ops on the meta device, so that a 40B
        model can be built there in seconds for planning.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(preset: str = "tiny", dtype: str = "float32", dropout: float | None = None,
                **_) -> GPT:
    """GPT-2 of the named preset; ``dropout=None`` keeps the preset's 0.1, 0.0 disables it."""
    config = resolve_preset(PRESETS, preset, "GPT-2")
    if dropout is not None:
        config = replace(config, dropout=float(dropout))
    return GPT(config).to(dtype=resolve_dtype(dtype))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of every sample."""
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


def get_batch(batch_size: int, step: int, preset: str = "tiny", dtype: str = "float32",
              **_) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids (B, T), next tokens (B, T)), T the preset's block size; depends only on the args.

    ``dtype`` is accepted for a uniform interface: token ids are always int64.
    """
    return batch_of(resolve_preset(PRESETS, preset, "GPT-2"), batch_size, step)


def batch_of(config: GPTConfig, batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_batch`` for a model of any shape, not only a preset's."""
    tokens = token_sequences(batch_size, config.block_size + 1, config.vocab_size, step)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build_optimizer(params, lr: float = 1e-4, weight_decay: float = 0.0,
                    **_) -> torch.optim.Optimizer:
    """Adam, as the paper uses for GPT-2 (§5.1)."""
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
