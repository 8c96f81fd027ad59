"""Models nobody here wrote by hand: each case draws a family and its sizes from a seed.

Families: residual MLPs (LayerNorm or not, several activations), residual conv nets with
BatchNorm, transformer stacks of ``nn.MultiheadAttention`` (batch first or not, with a causal
mask or none), and Hugging Face BERT (with a padding attention mask) and GPT-2 configurations.
Widths, depths, sequence lengths and dtypes are drawn; every case is a plain PyTorch model with a
``loss_fn(output, target)`` and a ``get_batch(batch_size, step)``, as a user's model file has.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Case", "draw_case", "FAMILIES"]


@dataclass
class Case:
    """One generated model, described by ``name`` (family and sizes) so a failure can be rebuilt."""

    name: str
    model: nn.Module
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    get_batch: Callable[[int, int], tuple]
    dtype: torch.dtype


# ----------------------------------------------------------------------------- models
class ResidualMLP(nn.Module):
    def __init__(self, d_in: int, width: int, hidden: int, depth: int, classes: int, act: str, norm: bool) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width) if norm else nn.Identity(), nn.Linear(width, hidden),
                          _ACTIVATIONS[act](), nn.Linear(hidden, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResidualConvNet(nn.Module):
    def __init__(self, channels: int, depth: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(depth))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


class AttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int, batch_first: bool, causal: bool) -> None:
        super().__init__()
        self.batch_first, self.causal = batch_first, causal
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=batch_first)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, width)
        h = self.ln1(x)
        seq = x.shape[1]
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), 1) if self.causal else None
        if not self.batch_first:
            h = h.transpose(0, 1)
        a = self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        if not self.batch_first:
            a = a.transpose(0, 1)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TransformerStack(nn.Module):
    def __init__(self, vocab: int, seq: int, width: int, heads: int, depth: int, batch_first: bool, causal: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, seq, width) * 0.02)
        self.blocks = nn.ModuleList(AttentionBlock(width, heads, batch_first, causal) for _ in range(depth))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}


# ----------------------------------------------------------------------------- batches and losses
def _generator(step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * step + salt)


def _token_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _class_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits, target)


def _mlp(rng: random.Random, dtype: torch.dtype) -> Case:
    d_in, width, hidden = rng.choice([12, 24, 40]), rng.choice([16, 24, 48, 96]), rng.choice([32, 64, 96, 192])
    depth, classes = rng.randint(2, 6), rng.choice([3, 10])
    act, norm = rng.choice(sorted(_ACTIVATIONS)), rng.random() < 0.7
    model = ResidualMLP(d_in, width, hidden, depth, classes, act, norm).to(dtype)

    def get_batch(b: int, step: int) -> tuple:
        g = _generator(step, 1)
        return torch.randn(b, d_in, generator=g, dtype=dtype), torch.randint(0, classes, (b,), generator=g)

    name = f"mlp(d_in={d_in}, width={width}, hidden={hidden}, depth={depth}, act={act}, norm={norm})"
    return Case(name, model, _class_loss, get_batch, dtype)


def _convnet(rng: random.Random, dtype: torch.dtype) -> Case:
    channels, depth, side, classes = rng.choice([4, 8, 12]), rng.randint(1, 4), rng.choice([6, 8, 10]), 5
    model = ResidualConvNet(channels, depth, classes).to(dtype)

    def get_batch(b: int, step: int) -> tuple:
        g = _generator(step, 2)
        return torch.randn(b, 3, side, side, generator=g, dtype=dtype), torch.randint(0, classes, (b,), generator=g)

    return Case(f"convnet(channels={channels}, depth={depth}, side={side})", model, _class_loss, get_batch, dtype)


def _transformer(rng: random.Random, dtype: torch.dtype) -> Case:
    heads = rng.choice([1, 2, 4])
    width, seq, vocab, depth = heads * rng.choice([4, 8, 12]), rng.choice([6, 9, 16]), rng.choice([32, 50]), rng.randint(1, 4)
    batch_first, causal = rng.random() < 0.5, rng.random() < 0.5
    model = TransformerStack(vocab, seq, width, heads, depth, batch_first, causal).to(dtype)

    def get_batch(b: int, step: int) -> tuple:
        x = torch.randint(0, vocab, (b, seq), generator=_generator(step, 3))
        return x, torch.roll(x, -1, 1)

    name = (f"transformer(width={width}, heads={heads}, seq={seq}, depth={depth}, batch_first={batch_first}, "
            f"causal={causal})")
    return Case(name, model, _token_loss, get_batch, dtype)


def _padded_tokens(b: int, seq: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask whose samples end in padding of different lengths."""
    ids = torch.randint(1, vocab, (b, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (b,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def _hf_bert(rng: random.Random, dtype: torch.dtype) -> Case:
    from transformers import BertConfig, BertForSequenceClassification

    heads = rng.choice([2, 4])
    hidden, layers, seq, vocab = heads * rng.choice([8, 12, 24]), rng.randint(1, 4), rng.choice([8, 12, 24]), 96
    config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=rng.choice([2, 4]) * hidden, max_position_embeddings=max(32, seq),
                        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config).to(dtype)

    def get_batch(b: int, step: int) -> tuple:
        g = _generator(step, 4)
        return _padded_tokens(b, seq, vocab, g), torch.randint(0, 3, (b,), generator=g)

    return Case(f"hf_bert(hidden={hidden}, heads={heads}, layers={layers}, seq={seq})", model, _class_loss, get_batch,
                dtype)


def _hf_gpt2(rng: random.Random, dtype: torch.dtype) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    heads = rng.choice([2, 4])
    width, layers, seq, vocab = heads * rng.choice([8, 16]), rng.randint(1, 4), rng.choice([8, 16, 32]), 64
    config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=width, n_layer=layers, n_head=heads, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(dtype)

    def get_batch(b: int, step: int) -> tuple:
        x = torch.randint(0, vocab, (b, seq), generator=_generator(step, 5))
        return x, torch.roll(x, -1, 1)

    return Case(f"hf_gpt2(width={width}, heads={heads}, layers={layers}, seq={seq})", model, _token_loss, get_batch,
                dtype)


FAMILIES: dict[str, Callable[[random.Random, torch.dtype], Case]] = {
    "mlp": _mlp, "convnet": _convnet, "transformer": _transformer, "hf_bert": _hf_bert, "hf_gpt2": _hf_gpt2,
}


def draw_case(seed: int) -> Case:
    """The case of ``seed``: its family, sizes and dtype, and the model's initial weights."""
    rng = random.Random(seed)
    family = list(FAMILIES)[seed % len(FAMILIES)]  # every family within any five consecutive seeds
    dtype = rng.choice([torch.float32, torch.float64])
    torch.manual_seed(seed)
    case = FAMILIES[family](rng, dtype)
    case.name = f"seed {seed}: {case.name} {str(dtype).removeprefix('torch.')}"
    return case
