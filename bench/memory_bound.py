"""Planned vs measured peak device memory on models we did not write.

A plan is a promise: the estimate of each device's peak must bound what the run measures (the
emulated device counts every live tensor storage), and be tight (within 10%). This diagnostic builds
a few outside models (MLPs with LayerNorm/SiLU/GELU, a transformer stack, a conv net with
BatchNorm), compiles each on 2 emulated devices at fractions of its training footprint in pp and dp,
trains two steps and prints per device the planned peak, the measured peak and their ratio; with
``--tasks`` also per task (the estimate's device bytes while the task computes beside the bytes the
worker measured while it ran).

    HARMONY_START_METHOD=spawn python -m bench.memory_bound [--models a,b] [--fractions 1/3,1/6]
        [--modes pp,dp] [--tasks]

The models and ``run_case`` serve ``tests/runtime/test_planned_memory_bounds_the_run.py`` too.
"""

from __future__ import annotations

import argparse
import copy
import fractions
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from harmony.compiler import CompileOptions, compile_plan
from harmony.decomposer.decompose import decompose
from harmony.errors import HarmonyError
from harmony.plan import Plan
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train


# ------------------------------------------------------------------------------------ the models
class SiluBlock(nn.Module):
    """LayerNorm -> Linear(w -> 2w) -> SiLU -> Linear(2w -> w), residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.SiLU()
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class GeluBlock(nn.Module):
    """Linear -> GELU -> LayerNorm, residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.act(self.fc(x)))


class Mlp(nn.Module):
    def __init__(self, block: Callable[[int], nn.Module], width: int, depth: int, inputs: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class SelfAttention(nn.Module):
    """Causal self-attention written out (softmax and all), with shapes taken from the input so
    that every microbatch size runs the same code."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, c))


class TransformerBlock(nn.Module):
    """Pre-norm attention and a GELU MLP, both residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class ConvBlock(nn.Module):
    """conv -> BatchNorm -> ReLU -> conv -> BatchNorm, residual, ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(channels)
        self.c2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


class ConvNet(nn.Module):
    def __init__(self, channels: int, depth: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(depth))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def classification_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def features_batch(batch: int, step: int, inputs: int, classes: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, inputs, generator=g, dtype=dtype), torch.randint(0, classes, (batch,), generator=g)


def tokens_batch(batch: int, step: int, vocab: int, seq: int) -> tuple:
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def images_batch(batch: int, step: int, size: int, classes: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(batch, 3, size, size, generator=g, dtype=dtype), torch.randint(0, classes, (batch,), generator=g)


@dataclass(frozen=True)
class Outside:
    """A model as a user's script would have it: built, its loss, batches, optimizer, minibatch."""

    name: str
    build: Callable[[], nn.Module]
    get_batch: Callable[[int, int], tuple]
    minibatch: int
    loss_fn: Callable = classification_loss
    build_optimizer: Callable = adam


def _mlp(block, width, depth, inputs, classes, dtype):
    return Mlp(block, width, depth, inputs, classes).to(dtype)


def _transformer(vocab, width, depth, heads, seq, dtype):
    return Transformer(vocab, width, depth, heads, seq).to(dtype)


def _convnet(channels, depth, classes, dtype):
    return ConvNet(channels, depth, classes).to(dtype)


MODELS: dict[str, Outside] = {m.name: m for m in (
    Outside("mlp-silu", functools.partial(_mlp, SiluBlock, 384, 6, 384, 10, torch.float32),
            functools.partial(features_batch, inputs=384, classes=10, dtype=torch.float32), 16),
    Outside("mlp-gelu64", functools.partial(_mlp, GeluBlock, 256, 8, 256, 10, torch.float64),
            functools.partial(features_batch, inputs=256, classes=10, dtype=torch.float64), 16),
    Outside("transformer", functools.partial(_transformer, 128, 64, 4, 4, 32, torch.float32),
            functools.partial(tokens_batch, vocab=128, seq=32), 16),
    Outside("convnet", functools.partial(_convnet, 16, 4, 10, torch.float32),
            functools.partial(images_batch, size=16, classes=10, dtype=torch.float32), 16),
)}


# ------------------------------------------------------------------------------------ measuring
@dataclass
class Case:
    """One model at one fraction of its footprint in one mode: the plan's and the run's peaks."""

    model: str
    fraction: float
    mode: str
    capacity: int
    config: str = ""
    planned: dict[int, int] = field(default_factory=dict)  # the estimate's peak per device
    measured: dict[int, int] = field(default_factory=dict)  # the run's peak per device, max over steps
    task_planned: dict[int, int] = field(default_factory=dict)  # the estimate's bytes per task
    task_measured: dict[int, int] = field(default_factory=dict)  # the run's bytes per task
    losses: list[float] = field(default_factory=list)
    expected: list[float] = field(default_factory=list)
    error: str = ""  # compile refusal or run failure
    plan: Plan | None = None

    def ratios(self) -> dict[int, float]:
        return {d: self.planned[d] / m for d, m in self.measured.items() if m and d in self.planned}


@functools.lru_cache(maxsize=None)
def footprint(name: str) -> int:
    m = MODELS[name]
    torch.manual_seed(0)
    model = m.build()
    graph = decompose(model, m.get_batch(2, 0)[0])
    return training_footprint(graph, m.get_batch, m.minibatch)


def compile_case(name: str, fraction: float, mode: str, devices: int = 2, trials: int = 1,
                 samples: int = 3) -> tuple[nn.Module, Plan]:
    """The model (initial weights) and its plan at ``fraction`` of its training footprint."""
    m = MODELS[name]
    torch.manual_seed(0)
    model = m.build()
    capacity = int(fraction * footprint(name))
    options = CompileOptions(minibatch=m.minibatch, devices=devices, device_memory=capacity, mode=mode,
                             compare=False, probe=False, trials=trials, samples=samples)
    plan, _ = compile_plan(model, m.get_batch, m.build_optimizer, options, loss_fn=m.loss_fn)
    plan.loss_fn, plan.build_optimizer, plan.get_batch = m.loss_fn, m.build_optimizer, m.get_batch
    return model, plan


def run_case(name: str, fraction: float, mode: str, steps: int = 2, devices: int = 2,
             reference: bool = True) -> Case:
    """Compile, train ``steps`` minibatches and collect planned and measured peaks."""
    import harmony

    m = MODELS[name]
    case = Case(name, fraction, mode, int(fraction * footprint(name)))
    try:
        model, plan = compile_case(name, fraction, mode, devices)
    except HarmonyError as exc:
        case.error = f"compile: {exc}"
        return case
    case.plan = plan
    case.config = str(plan.tasks.config)
    case.planned = {int(d): int(v) for d, v in plan.estimate["peak_memory"].items()}
    case.task_planned = {int(t): int(v) for t, v in (plan.estimate.get("task_peak_memory") or {}).items()}
    batches = [m.get_batch(m.minibatch, step) for step in range(steps)]
    start = copy.deepcopy(model)
    try:
        with harmony.Trainer(plan, optimizer=m.build_optimizer, timeout=60, check_memory=True) as trainer:
            for inputs, target in batches:
                case.losses.append(trainer.step(inputs, target))
            for step in trainer.history:
                for rank, w in enumerate(step.workers):
                    case.measured[rank] = max(case.measured.get(rank, 0), w.peak)
                    for t, v in w.task_peaks.items():
                        case.task_measured[t] = max(case.task_measured.get(t, 0), v)
    except HarmonyError as exc:
        case.error = f"run: {str(exc).splitlines()[0]}"
        return case
    if reference:
        case.expected = reference_train(start, m.loss_fn, m.build_optimizer, batches, microbatches_of(plan.tasks))
    return case


def _fraction(text: str) -> float:
    return float(fractions.Fraction(text))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def report(case: Case, tasks: bool) -> list[str]:
    head = f"{case.model:12s} {case.mode:3s} {case.fraction:.3f} cap {_mib(case.capacity)} MiB {case.config}"
    if case.error:
        return [f"{head}  {case.error}"]
    lines = [head]
    for d in sorted(case.measured):
        p, m = case.planned.get(d, 0), case.measured[d]
        lines.append(f"    dev{d} planned {_mib(p)} measured {_mib(m)} MiB ratio {p / m if m else float('nan'):.3f}")
    if tasks and case.plan is not None:
        for t in case.plan.tasks.tasks:
            if t.id in case.task_measured:
                p, m = case.task_planned.get(t.id, 0), case.task_measured[t.id]
                label = str(t).split(" in:")[0]
                lines.append(f"      {label:40s} planned {_mib(p)} measured {_mib(m)} ratio {p / m if m else 0:.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--fractions", default="1/2,1/3,1/6")
    parser.add_argument("--modes", default="pp,dp")
    parser.add_argument("--tasks", action="store_true", help="per task too")
    args = parser.parse_args()
    worst = []
    for name in args.models.split(","):
        for text in args.fractions.split(","):
            for mode in args.modes.split(","):
                case = run_case(name, _fraction(text), mode)
                for line in report(case, args.tasks):
                    print(line, flush=True)
                worst += list(case.ratios().values())
    if worst:
        print(f"planned/measured: min {min(worst):.3f} max {max(worst):.3f} over {len(worst)} device runs")


if __name__ == "__main__":
    main()
