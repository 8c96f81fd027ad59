"""A Llama-style decoder (Touvron et al., 2023; Llama 3, 2024) as a plain PyTorch module; also a model file.

What makes it Llama rather than GPT-2: RMSNorm instead of LayerNorm, rotary position embeddings
on queries and keys instead of learned positions, a SwiGLU feed-forward (``down(silu(gate(x)) *
up(x))``), grouped-query attention (``n_kv_head`` key/value heads shared by ``n_head`` query
heads), no biases and no dropout.

Modules and parameters carry Hugging Face ``LlamaForCausalLM``'s names (``model.layers.3.self_attn.
q_proj.weight``, ...) and the same arithmetic (rotate-half rotary embeddings, RMSNorm in float32),
so a checkpoint of one loads into the other with ``load_state_dict`` and gives the same logits
(tests/models/test_llama.py checks it against ``transformers``), and adapters that name those
modules (LoRA's ``q_proj``, ``v_proj``) find them.

Attention is one ``F.scaled_dot_product_attention`` call, causal, with ``enable_gqa=True``: what
Hugging Face's sdpa attention calls when there is no padding mask, so the logits are the same to
the bit, and on a GPU a fused kernel (flash attention) that reads each key/value head once for its
group of query heads instead of copying it ``n_head // n_kv_head`` times. The rotary angles depend
on the sequence length and are built in ``forward``: a buffer of the longest sequence's size would
be swapped for nothing.

Usage as a model file: ``harmony compile models/llama.py --arg preset=8b --analytic h100``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from harmony.models.common import resolve_dtype, resolve_preset, token_sequences


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder; ``block_size`` is the longest sequence a batch holds."""

    n_layer: int
    n_head: int
    n_kv_head: int
    dim: int
    ffn_hidden: int
    vocab_size: int
    block_size: int = 2048
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


PRESETS: dict[str, LlamaConfig] = {
    # 24,736 parameters: for tests (grouped-query: 4 query heads share 2 key/value heads).
    "tiny": LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, dim=32, ffn_hidden=64, vocab_size=96, block_size=16,
                        rope_theta=10000.0),
    # Llama 3.2 1B: 1,235,814,400 parameters (embeddings tied).
    "1b": LlamaConfig(n_layer=16, n_head=32, n_kv_head=8, dim=2048, ffn_hidden=8192, vocab_size=128256,
                      tie_embeddings=True),
    # Llama 3.2 3B: 3,212,749,824 parameters (embeddings tied).
    "3b": LlamaConfig(n_layer=28, n_head=24, n_kv_head=8, dim=3072, ffn_hidden=8192, vocab_size=128256,
                      tie_embeddings=True),
    # Llama 2 7B: 6,738,415,616 parameters (multi-head: as many key/value heads as query heads).
    "7b": LlamaConfig(n_layer=32, n_head=32, n_kv_head=32, dim=4096, ffn_hidden=11008, vocab_size=32000,
                      block_size=4096, rope_theta=10000.0),
    # Llama 3 8B: 8,030,261,248 parameters.
    "8b": LlamaConfig(n_layer=32, n_head=32, n_kv_head=8, dim=4096, ffn_hidden=14336, vocab_size=128256),
}


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """Where Llama computes in float32 (norms, rotary angles): low precision goes up, float64
    stays (the exactness tests train in float64). A torch call rather than a branch, so that
    torch.fx records it instead of having to decide it while tracing."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as Llama does, returned in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(_at_least_float32(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.dim % config.n_head or config.n_head % config.n_kv_head:
            raise ValueError(f"dim {config.dim}, n_head {config.n_head} and n_kv_head {config.n_kv_head} "
                             "do not divide: each query head needs a whole key/value head")
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.dim, bias=False)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float()
                                                / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rotary(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position's angles, (T, head_dim), in float32 like Llama's."""
        inv_freq = self.inv_freq.to(_at_least_float32(self.inv_freq.dtype))
        positions = torch.ones_like(x[0, :, 0], dtype=inv_freq.dtype).cumsum(0) - 1.0  # 0..T-1, no traced factory
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = self._rotary(x)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # each key/value head serves n_head // n_kv_head query heads (enable_gqa); scale as Llama's
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim ** -0.5,
                                           enable_gqa=self.n_kv_head != self.n_head)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Token ids (B, T) -> the last layer's normalized hidden states (B, T, dim)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Llama(nn.Module):
    """Llama-style language model: token ids (B, T) -> next-token logits (B, T, vocab_size)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) weights and unit norms, as Llama's initializer; in-place ``nn.init`` only,
        which is a no-op on the meta device (an 8B model builds there in a second, for planning)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))


def build_model(preset: str = "tiny", dtype: str = "float32", **_) -> Llama:
    """The Llama-style decoder of the named preset."""
    return Llama(resolve_preset(PRESETS, preset, "Llama")).to(dtype=resolve_dtype(dtype))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of every sample."""
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


def get_batch(batch_size: int, step: int, preset: str = "tiny", dtype: str = "float32",
              seq_len: int | None = None, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids (B, T), next tokens (B, T)): T is ``seq_len`` or the preset's block size; the
    batch depends only on the arguments. ``dtype`` is accepted for a uniform interface."""
    config = resolve_preset(PRESETS, preset, "Llama")
    length = int(seq_len) if seq_len is not None else config.block_size
    tokens = token_sequences(batch_size, length + 1, config.vocab_size, step)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build_optimizer(params, lr: float = 3e-4, weight_decay: float = 0.1, **_) -> torch.optim.Optimizer:
    """AdamW, as Llama is trained (betas 0.9, 0.95)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
