"""BERT (Devlin et al., 2018) with a masked-language-model head, in plain PyTorch; also a model file.

The Harmony paper (§5.1) trains BERT-Large (24 layers) and BERT96 (96 layers of the same width, as
in PipeDream-2BW) at sequence length 512 with Adam. The layers follow the original post-LayerNorm
design: ``LayerNorm(x + Dropout(sublayer(x)))``.

Only the MLM head is kept (no pooler / next-sentence head): every parameter then receives a
gradient from the loss, which the equivalence tests rely on. The MLM decoder's weight is tied to
the word embedding, as in BERT, so it is a single Parameter. ``forward`` takes token ids and,
optionally, Hugging Face's padding mask (1 for a token, 0 for padding); every token is in segment 0.
The model file's batches hold no padding.

Attention is one ``F.scaled_dot_product_attention`` call with the padding mask as its boolean
``attn_mask`` (none without padding), as Hugging Face's sdpa attention for BERT takes it: on a GPU a
fused kernel that never stores the sequence x sequence scores.

Usage as a model file: ``harmony compile models/bert.py --arg preset=large``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from harmony.models.common import resolve_dtype, resolve_preset, token_sequences


@dataclass(frozen=True)
class BertConfig:
    """Shape of a BERT model; ``max_position`` is also the sequence length get_batch produces."""

    num_layers: int
    hidden: int
    num_heads: int
    intermediate: int
    vocab_size: int = 30522
    max_position: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    layer_norm_eps: float = 1e-12


PRESETS: dict[str, BertConfig] = {
    # 22,016 parameters: for tests.
    "tiny": BertConfig(num_layers=2, hidden=32, num_heads=4, intermediate=64, vocab_size=96,
                       max_position=16),
    # BERT-Large with MLM head: 335,174,458 parameters.
    "large": BertConfig(num_layers=24, hidden=1024, num_heads=16, intermediate=4096),
    # BERT96 (PipeDream-2BW's 96-layer BERT-Large): 1,242,102,586 parameters.
    "96": BertConfig(num_layers=96, hidden=1024, num_heads=16, intermediate=4096),
}

# Token id that replaces masked positions in get_batch (BERT's [MASK] is 103 in its vocabulary;
# any fixed id works for synthetic data, and 0 exists in every preset).
MASK_ID = 0
MASK_PROB = 0.15


class BertEmbeddings(nn.Module):
    """Sum of word, position and token-type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embeddings = nn.Embedding(config.max_position, config.hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden)
        self.LayerNorm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.size(1)
        pos = torch.arange(T, device=input_ids.device)
        token_type_ids = torch.zeros_like(input_ids)  # a single segment
        x = (self.word_embeddings(input_ids) + self.position_embeddings(pos)
             + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Bidirectional multi-head attention with separate query/key/value/output projections."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if config.hidden % config.num_heads:
            raise ValueError(f"hidden {config.hidden} is not a multiple of num_heads {config.num_heads}")
        self.num_heads = config.num_heads
        self.head_dim = config.hidden // config.num_heads
        self.query = nn.Linear(config.hidden, config.hidden)
        self.key = nn.Linear(config.hidden, config.hidden)
        self.value = nn.Linear(config.hidden, config.hidden)
        self.attn_dropout = config.dropout  # on the attention weights, inside the fused kernel
        self.output = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``attn_mask``: boolean, broadcastable to (B, heads, T, T), True where a query may attend."""
        B, T, C = x.size(0), x.size(1), x.size(2)
        q = self.query(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.key(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.value(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           dropout_p=self.attn_dropout if self.training else 0.0)
        return self.output(y.transpose(1, 2).contiguous().view(B, T, C))


class BertLayer(nn.Module):
    """One post-LayerNorm encoder layer: attention and feed-forward, each with residual + LN."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.attention_dropout = nn.Dropout(config.dropout)
        self.attention_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden, config.intermediate)
        self.intermediate_act = nn.GELU()  # BERT uses the exact (erf) GELU
        self.output = nn.Linear(config.intermediate, config.hidden)
        self.output_dropout = nn.Dropout(config.dropout)
        self.output_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention_norm(x + self.attention_dropout(self.attention(x, attn_mask)))
        h = self.output(self.intermediate_act(self.intermediate(x)))
        return self.output_norm(x + self.output_dropout(h))


class BertMLMHead(nn.Module):
    """Transform (Linear + GELU + LayerNorm), then decode to the vocabulary with a tied weight."""

    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.transform = nn.Linear(config.hidden, config.hidden)
        self.transform_act = nn.GELU()
        self.LayerNorm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden, config.vocab_size)
        self.decoder.weight = word_embeddings.weight  # tied: one Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.LayerNorm(self.transform_act(self.transform(x))))


class BertForMaskedLM(nn.Module):
    """BERT encoder with MLM head: token ids (B, T) -> vocabulary logits (B, T, vocab_size)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))
        self.cls = BertMLMHead(config, self.embeddings.word_embeddings)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """BERT init: N(0, 0.02) weights, zero biases, unit LayerNorm; in place, meta-safe."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``input_ids`` (B, T); ``attention_mask`` (B, T), 1 for a token and 0 for padding,
        keeps every query from attending to the padding (no mask: nothing is padding)."""
        attn_mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        x = self.embeddings(input_ids)
        for layer in self.encoder:
            x = layer(x, attn_mask)
        return self.cls(x)


def build_model(preset: str = "tiny", dtype: str = "float32", dropout: float | None = None,
                **_) -> BertForMaskedLM:
    """BERT of the named preset; ``dropout=None`` keeps the preset's 0.1, 0.0 disables it."""
    config = resolve_preset(PRESETS, preset, "BERT")
    if dropout is not None:
        config = replace(config, dropout=float(dropout))
    return BertForMaskedLM(config).to(dtype=resolve_dtype(dtype))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all positions (masked and unmasked) of every sample."""
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


def get_batch(batch_size: int, step: int, preset: str = "tiny", dtype: str = "float32",
              **_) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids with ~15% replaced by MASK_ID, original ids), both (B, max_position) int64.

    Tokens are drawn from [1, vocab) so that MASK_ID never appears as a real token. Depends
    only on (batch_size, step, preset); ``dtype`` is accepted for a uniform interface.
    """
    return batch_of(resolve_preset(PRESETS, preset, "BERT"), batch_size, step)


def batch_of(config: BertConfig, batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_batch`` for a model of any shape, not only a preset's."""
    target = token_sequences(batch_size, config.max_position, config.vocab_size, step, low=1)
    g = torch.Generator(device="cpu")
    g.manual_seed(2 * int(step) + 1)
    masked = torch.rand(target.shape, generator=g, device="cpu") < MASK_PROB
    inputs = target.masked_fill(masked, MASK_ID)
    return inputs, target


def build_optimizer(params, lr: float = 1e-4, weight_decay: float = 0.0,
                    **_) -> torch.optim.Optimizer:
    """Adam, as the paper uses for BERT (§5.1)."""
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
