"""Models written the ways users write them, none of them from a library, trained against eager.

Each is small, float64, with nothing random drawn differently from eager, compiled at a third of
its training footprint (the tutorial CNN at 0.6) on two emulated devices and trained two steps in pp and in dp
(``bench/outside.py``). They are the patterns that outside scripts use and our models do not:
recurrent layers, PyTorch's own transformer encoder, activation checkpointing inside the model,
weight normalization, several inputs, a tuple output whose loss reads both parts, arguments left
at their defaults, a frozen embedding, a root-level parameter (a class token), in-place dropout,
and PyTorch's tutorial CNN, whose modules sit in no container.

    python -m bench.pattern_models [--models lstm,tutorial_cnn] [--modes pp,dp] [--markdown out.md]

Runs take 1-5 s each on two cores.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bench import outside
from bench.outside import Case

VOCAB, SEQ, WIDTH, MINIBATCH = 50, 12, 16, 8


def tokens(b: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (b, SEQ), generator=g), torch.randint(0, VOCAB, (b, SEQ), generator=g)


def next_tokens(out, target: torch.Tensor) -> torch.Tensor:
    out = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


class RecurrentLM(nn.Module):
    def __init__(self, cell: type[nn.Module] = nn.LSTM) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.rnn = cell(WIDTH, WIDTH, num_layers=2, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return self.head(h)


class EncoderLM(nn.Module):
    """``nn.TransformerEncoder``, returning a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": self.head(self.enc(self.emb(x)))}


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` inside the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


class WeightNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.convs = nn.ModuleList(nn.utils.parametrizations.weight_norm(nn.Conv1d(WIDTH, WIDTH, 3, padding=1))
                                   for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x).transpose(1, 2)
        for conv in self.convs:
            x = torch.relu(conv(x)) + x
        return self.head(x.transpose(1, 2))


class Masked(nn.Module):
    """Two inputs: the tokens and a float mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) * mask.unsqueeze(-1)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def masked_tokens(b: int, step: int) -> tuple:
    x, y = tokens(b, step)
    return (x, (torch.arange(SEQ) < SEQ - 2).double().expand(b, SEQ).contiguous()), y


class TwoHeads(nn.Module):
    """A tuple output whose loss reads both parts, an argument left at its default, a frozen
    embedding, functional dropout at p=0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.aux = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(x) * scale
        for block in self.blocks:
            h = F.dropout(F.gelu(block(h)), p=0.0, training=self.training) + h
        return self.head(h), self.aux(h).squeeze(-1)


def both_heads(out: tuple, target: torch.Tensor) -> torch.Tensor:
    logits, aux = out
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)) + 0.1 * aux.pow(2).mean()


class ClassToken(nn.Module):
    """A root-level class token and position embedding (ViT's), an InstanceNorm1d."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.cls = nn.Parameter(torch.randn(1, 1, WIDTH))
        self.pos = nn.Parameter(torch.randn(1, SEQ + 1, WIDTH))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(3))
        self.norm = nn.InstanceNorm1d(SEQ + 1)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.emb(x)], dim=1) + self.pos
        for block in self.blocks:
            h = block(h) + h
        return self.head(self.norm(h)[:, 0])


def classes(b: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (b, SEQ), generator=g), torch.randint(0, 4, (b,), generator=g)


class InPlaceDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.3, inplace=True),
                                                  nn.ReLU(inplace=True)) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class TutorialCNN(nn.Module):
    """PyTorch's CIFAR-10 tutorial network: every module a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def images(b: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(step)
    return torch.randn(b, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 10, (b,), generator=g)


def _case(build: Callable[[], nn.Module], batch: Callable[[int, int], tuple] = tokens,
          loss: Callable = next_tokens) -> Callable[[], Case]:
    def case() -> Case:
        def model() -> nn.Module:
            torch.manual_seed(0)
            return build().double()

        return model, batch, loss

    return case


CASES: dict[str, Callable[[], Case]] = {
    "lstm": _case(RecurrentLM),
    "gru": _case(lambda: RecurrentLM(nn.GRU)),
    "transformer_encoder": _case(EncoderLM),
    "checkpointed": _case(Checkpointed),
    "weight_norm": _case(WeightNormed),
    "two_inputs": _case(Masked, masked_tokens),
    "two_heads": _case(TwoHeads, tokens, both_heads),
    "class_token": _case(ClassToken, classes, F.cross_entropy),
    "inplace_dropout": _case(InPlaceDropout),
    "tutorial_cnn": _case(TutorialCNN, images, F.cross_entropy),
}

# the tutorial CNN's first linear layer holds most of its footprint: its backward needs more than a third
COLLECTION = outside.Collection(CASES, MINIBATCH, "torch", "bench.pattern_models", __doc__, fractions={"tutorial_cnn": 0.6})
run = COLLECTION.run
main = COLLECTION.main


if __name__ == "__main__":
    main()
