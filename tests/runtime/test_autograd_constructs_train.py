"""Models whose forward uses what a tracer could lose train exactly as eager, end to end.

One model holds a custom autograd Function (a straight-through rounding whose forward has a zero
gradient), a ``torch.no_grad()`` statistic, a tensor hook registered in forward() and a module
backward hook (their modules kept whole and run eagerly); another a Function that draws random numbers in its forward, which a
recompute must draw again. Compiled on two emulated devices at a third of its training
footprint, three AdamW steps in float64 equal plain eager PyTorch over the plan's microbatches, in
pp and in dp; no device passes its capacity.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import harmony
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train

MINIBATCH = 8
WIDTH = 16
STEPS = 3
TOLERANCE = 1e-9


class StraightThroughRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class StochasticRound(torch.autograd.Function):
    """Rounds up or down at random (per element, so per sample): a recompute must draw the same."""

    @staticmethod
    def forward(ctx, x):
        return torch.floor(x * 4 + torch.rand_like(x)) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Rounded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return StraightThroughRound.apply(torch.tanh(self.lin(x)), 0.7)


class StochasticallyRounded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return StochasticRound.apply(torch.tanh(self.lin(x)))


class Centred(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        with torch.no_grad():
            centre = y.mean(-1, keepdim=True)
        return y - centre


class Damped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        if y.requires_grad:
            y.register_hook(lambda g: g * 0.5)
        return y


def halved_in_backward(module: nn.Module) -> nn.Module:
    module.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 0.5,))
    return module


def build(*middle: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, WIDTH), *middle, nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 4)).double()


def get_batch(batch_size: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(batch_size, 8, generator=g, dtype=torch.float64),
            torch.randn(batch_size, 4, generator=g, dtype=torch.float64))


def loss_fn(output, target):
    return ((output - target) ** 2).mean()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_function_no_grad_tensor_hook_and_module_backward_hook_train_like_eager(mode):
    torch.manual_seed(0)
    assert_trains_like_eager(build(Rounded(), Centred(), Damped(), halved_in_backward(nn.Linear(WIDTH, WIDTH))), mode)


def test_function_drawing_random_numbers_repeats_them_in_the_recompute():
    torch.manual_seed(0)
    assert_trains_like_eager(build(StochasticallyRounded(), Centred()), "dp")


def assert_trains_like_eager(model: nn.Module, mode: str, share: int = 3) -> None:
    """Three steps at 1/``share`` of the training footprint equal eager over the plan's microbatches."""
    reference = copy.deepcopy(model)
    graph = harmony.decompose(copy.deepcopy(model), get_batch(2, 0)[0])
    capacity = training_footprint(graph, get_batch, MINIBATCH) // share
    plan = harmony.compile(model, loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2, mode=mode,
                           device_memory=capacity, build_optimizer=adamw, probe=False)
    batches = [get_batch(MINIBATCH, step) for step in range(STEPS)]
    with harmony.Trainer(plan, optimizer=adamw, timeout=60) as trainer:
        losses = [trainer.step(inputs, target) for inputs, target in batches]
        state = trainer.state_dict()
        history = trainer.history
    expected = reference_train(reference, loss_fn, adamw, batches, microbatches_of(plan.tasks))
    for step, (got, want) in enumerate(zip(losses, expected)):
        assert abs(got - want) <= TOLERANCE * abs(want), f"step {step}: loss {got!r} != eager {want!r}"
    for name, want in reference.state_dict().items():
        err = float((state[name] - want).abs().max()) / float(want.abs().max().clamp_min(1e-3))
        assert err <= TOLERANCE, f"{name}: relative error {err:.3g} after {STEPS} steps"
    for step in history:
        for rank, worker in enumerate(step.workers):
            assert worker.peak <= capacity, f"dev{rank} peaked at {worker.peak:,} of {capacity:,} bytes"


class ScaledLinear(torch.autograd.Function):
    """A matmul inside a Function written for autocast (``custom_fwd``/``custom_bwd``: the backward
    runs under the forward's autocast state), so autocast applies within it as in eager."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return 0.5 * grad @ weight, grad.t() @ x


class FunctionLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH ** 0.5)

    def forward(self, x):
        return torch.tanh(ScaledLinear.apply(x, self.weight))


def test_function_under_bf16_autocast_trains_as_eager_autocast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, WIDTH), FunctionLinear(), Centred(), nn.Linear(WIDTH, 4))
    batches = [tuple(t.float() for t in get_batch(MINIBATCH, step)) for step in range(STEPS)]

    def get_float_batch(batch_size: int, step: int) -> tuple:
        return tuple(t.float() for t in get_batch(batch_size, step))

    reference = copy.deepcopy(model)
    plan = harmony.compile(model, loss_fn, get_float_batch, minibatch_size=MINIBATCH, devices=2, mode="pp",
                           build_optimizer=adamw, probe=False, precision="bf16")
    with harmony.Trainer(plan, optimizer=adamw, timeout=60) as trainer:
        losses = [trainer.step(inputs, target) for inputs, target in batches]
        state = trainer.state_dict()
    expected = reference_train(reference, loss_fn, adamw, batches, microbatches_of(plan.tasks), precision="bf16")
    assert losses == pytest.approx(expected, rel=1e-5)
    for name, want in reference.state_dict().items():
        err = float((state[name] - want).norm() / want.norm())
        assert err <= 1e-5, f"{name}: relative error {err:.3g} after {STEPS} steps"


def test_function_of_the_script_run_as_main_reaches_spawned_workers(monkeypatch):
    """A class of ``__main__`` cannot be imported by name in a spawned worker (the launcher starts
    it without the user's script): the Functions the layers call travel to it by value."""
    import sys

    class GradientReversal(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return -0.3 * grad

    GradientReversal.__module__ = "__main__"
    GradientReversal.__qualname__ = "GradientReversal"
    monkeypatch.setattr(sys.modules["__main__"], "GradientReversal", GradientReversal, raising=False)

    class Reversed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return GradientReversal.apply(torch.tanh(self.lin(x)))

    monkeypatch.setenv("HARMONY_START_METHOD", "spawn")
    torch.manual_seed(0)
    assert_trains_like_eager(build(Reversed()), "pp", share=2)  # a smaller model: a third leaves no room to plan
