"""What a tracer could lose of a model's autograd is kept exactly or refused naming it, never dropped.

Each model here puts one construct between ordinary layers; "kept" means the layers, run in
sequence, give the eager model's output and every parameter's gradient in float64
(``assert_layers_match_model``); "refused" means a ``DecomposeError`` naming the construct.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import harmony
from harmony.decomposer.gradient_check import check_gradients
from zoo import RTOL, assert_layers_match_model

WIDTH = 6


class StraightThroughRound(torch.autograd.Function):
    """Rounds in the forward; passes the gradient through, scaled, in the backward (its round has
    a zero gradient, so a traced forward alone would zero every gradient before it)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class SplitScale(torch.autograd.Function):
    """Two outputs, each with its own hand-written gradient."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, ga, gb):
        return ga * 0.5 + gb * 0.25


def chain(middle: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), middle, nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 3)).double()


def example() -> tuple:
    return (torch.randn(4, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),)


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)


class RoundBlock(Lin):
    def forward(self, x):
        return StraightThroughRound.apply(torch.tanh(self.lin(x)), 0.7)


class TwoOutputBlock(Lin):
    def forward(self, x):
        a, b = SplitScale.apply(self.lin(x))
        return torch.tanh(a) + b


class RoundWithControlFlow(Lin):
    """Control flow on a shape sends it to torch.export, which would inline the Function."""

    def forward(self, x):
        y = self.lin(x)
        if y.shape[-1] > 2:
            y = StraightThroughRound.apply(y, 0.5)
        return y


class LocalFunctionBlock(Lin):
    def __init__(self) -> None:
        super().__init__()

        class Halve(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                return grad * 0.5

        self.fn = Halve

    def forward(self, x):
        return self.fn.apply(torch.tanh(self.lin(x)))


class HookBlock(Lin):
    def forward(self, x):
        out = torch.tanh(self.lin(x))
        if out.requires_grad:
            out.register_hook(lambda g: g * 0.5)
        return out


class NoGradBlock(Lin):
    def forward(self, x):
        y = torch.tanh(self.lin(x))
        with torch.no_grad():
            centre = y.mean(-1, keepdim=True)
        return y - centre


class NestedGradModes(Lin):
    """no_grad around an enable_grad, and set_grad_enabled(False), with control flow on a shape so
    that torch.export traces it too."""

    def __init__(self, branch: bool) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        if self.branch and y.shape[-1] > 2:
            y = y * 1.0
        with torch.no_grad():
            stat = y.pow(2).mean(-1, keepdim=True)
            with torch.enable_grad():
                kept = y * 2
        with torch.set_grad_enabled(False):
            other = y.abs().amax(-1, keepdim=True)
        return kept - stat * y - other


class InferenceModeBlock(Lin):
    def forward(self, x):
        y = torch.tanh(self.lin(x))
        with torch.inference_mode():
            scale = y.detach().abs().mean()
        return y * scale.clone()


class TanhBlock(Lin):
    def forward(self, x):
        return torch.tanh(self.lin(x))


class RetainGradBlock(Lin):
    def forward(self, x):
        y = torch.tanh(self.lin(x))
        y.retain_grad()
        return y


class ReentrantCheckpoint(Lin):
    def forward(self, x):
        return checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=True)


def assert_kept(block: nn.Module, method: str = "auto") -> harmony.LayerGraph:
    return assert_layers_match_model(chain(block), example(), RTOL[torch.float64], method=method)


@pytest.mark.parametrize("block", [RoundBlock, TwoOutputBlock, RoundWithControlFlow, LocalFunctionBlock],
                         ids=["straight-through", "two-outputs", "under-export", "local-class"])
def test_custom_autograd_function_runs_its_own_backward(block):
    graph = assert_kept(block())
    if block is RoundBlock:  # one call in the layer code, not its forward's ops
        assert any("function_apply(" in source and "'StraightThroughRound')" in source for source in graph.sources.values())


def test_custom_function_under_torch_export_keeps_its_module_whole():
    graph = assert_kept(RoundWithControlFlow())
    assert graph.tracer == "fx"
    assert any("attach_opaque(self, '2'" in source for source in graph.sources.values())


class ExactGelu(torch.autograd.Function):
    """A hand-written backward that is the forward's derivative (Bloom's GeLU is one)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return grad * (s + 1.702 * x * s * (1 - s))


class RootCalls(nn.Module):
    """Calls a Function in its own forward, with control flow on a shape there: torch.fx fails on
    the model itself, so no module kept whole helps, and torch.export must inline the Function."""

    def __init__(self, function: type) -> None:
        super().__init__()
        self.function = function
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x):
        y = self.lin(x)
        if y.shape[-1] > 2:
            y = self.function.apply(y) if self.function is ExactGelu else self.function.apply(y, 0.5)
        return self.out(y)


def test_custom_function_export_inlines_is_kept_where_its_backward_is_the_derivative():
    torch.manual_seed(0)
    graph = assert_layers_match_model(RootCalls(ExactGelu).double(), example(), RTOL[torch.float64])
    assert graph.tracer == "export"


def test_custom_function_export_inlines_is_refused_naming_it_where_its_backward_is_not_the_derivative():
    torch.manual_seed(0)
    with pytest.raises(harmony.DecomposeError, match=r"inlined the custom autograd Function\(s\) StraightThroughRound"
                                                     r".*not their forward's derivative"):
        harmony.decompose(RootCalls(StraightThroughRound).double(), example())


def test_tensor_hook_registered_in_forward_is_honoured():
    assert_kept(HookBlock())


def test_tensor_hook_in_the_model_own_forward_is_refused_naming_it():
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            y = self.lin(x)
            y.register_hook(lambda g: g * 2)
            return y

    with pytest.raises(harmony.DecomposeError, match="register_hook"):
        harmony.decompose(Root().double(), example())


@pytest.mark.parametrize("block", [NoGradBlock, lambda: NestedGradModes(False), lambda: NestedGradModes(True),
                                   InferenceModeBlock],
                         ids=["no_grad", "nested-fx", "nested-export", "inference_mode"])
def test_grad_mode_regions_in_forward_train_as_eager(block):
    assert_kept(block())


def test_grad_mode_region_cut_by_a_layer_boundary_is_closed_and_reopened():
    class Straddle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(WIDTH, WIDTH)
            self.b = nn.Linear(WIDTH, WIDTH)
            self.c = nn.Linear(WIDTH, 3)

        def forward(self, x):
            y = torch.tanh(self.a(x))
            with torch.no_grad():
                frozen = self.b(y)  # layer a | layer b: the region spans the cut
            return self.c(y + frozen)

    torch.manual_seed(0)
    assert_layers_match_model(Straddle().double(), example(), RTOL[torch.float64], modules=["a", "b", "c"])


def test_module_forward_and_forward_pre_hooks_are_kept():
    block = TanhBlock()
    block.lin.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    block.register_forward_hook(lambda m, args, out: out * 3)
    assert_kept(block)


def test_retain_grad_in_forward_is_kept():
    assert_kept(RetainGradBlock())


def test_reentrant_checkpoint_trains_as_the_function_it_wraps():
    assert_kept(ReentrantCheckpoint())


def test_parameter_gradient_hook_is_refused_naming_the_parameter():
    model = chain(NoGradBlock())
    model[0].weight.register_hook(lambda g: g * 2)
    with pytest.raises(harmony.DecomposeError, match=r"parameter '0.weight' has a gradient hook"):
        harmony.decompose(model, example())


def test_module_full_backward_hooks_are_honoured_by_keeping_the_module_whole():
    block = TanhBlock()
    block.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 0.5,))
    block.lin.register_full_backward_pre_hook(lambda m, grad_out: (grad_out[0] * 3,))
    graph = assert_kept(block)
    assert any("attach_opaque(self, '2'" in source for source in graph.sources.values())


def test_a_backward_hook_on_the_model_itself_is_refused():
    model = chain(TanhBlock())
    model.register_full_backward_hook(lambda m, grad_in, grad_out: None)
    with pytest.raises(harmony.DecomposeError, match="backward hook on itself"):
        harmony.decompose(model, example())


def test_autograd_grad_inside_forward_is_refused_naming_it():
    class Penalty(Lin):
        def forward(self, x):
            x = x.requires_grad_()
            y = self.lin(x)
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            return y + g

    with pytest.raises(harmony.DecomposeError, match=r"module '2' calls torch.autograd.grad inside forward"):
        harmony.decompose(chain(Penalty()), example())


def test_parameter_created_in_forward_is_refused():
    class Grows(Lin):
        def forward(self, x):
            self.extra = nn.Parameter(torch.ones(WIDTH, dtype=torch.float64))
            return self.lin(x) * self.extra

    with pytest.raises(harmony.DecomposeError, match="creates or replaces the model's parameters"):
        harmony.decompose(chain(Grows()), example())


def test_uninitialized_lazy_module_is_refused():
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(harmony.DecomposeError, match="lazy module"):
        harmony.decompose(model, (torch.randn(2, WIDTH),))


def test_python_step_counter_changed_in_forward_is_refused():
    class Counts(Lin):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x) * (1.0 if self.calls < 100 else 0.5)

    with pytest.raises(harmony.DecomposeError, match=r"Python attribute '2.calls'"):
        harmony.decompose(chain(Counts()), example())


def test_gradient_check_refuses_layers_that_lose_a_backward_naming_the_layer(monkeypatch):
    """The safety net for what the guard does not know: with the Function's call traced through
    (as before it was kept), the check names the layer whose gradients go wrong."""
    from harmony.decomposer import autograd_guard

    def traced_through(guard):
        return lambda cls, *args, **kwargs: autograd_guard.original_apply(cls, *args, **kwargs)

    model, inputs = chain(RoundBlock()), example()
    monkeypatch.setattr(autograd_guard, "_traced_apply", traced_through)
    graph = harmony.decompose(model, inputs)
    with pytest.raises(harmony.DecomposeError, match=r"layer 1 \(2\).*--no-gradient-check"):
        check_gradients(model, graph, inputs, torch.zeros(4, 3, dtype=torch.float64),
                        lambda out, target: ((out - target) ** 2).mean())


def test_gradient_check_passes_a_faithful_decomposition_and_skips_meta_models(caplog):
    model, inputs = chain(NoGradBlock()), example()
    graph = harmony.decompose(model, inputs)
    check_gradients(model, graph, inputs, None, None)
    with torch.device("meta"):
        meta = chain(NoGradBlock())
    meta_graph = harmony.decompose(meta, tuple(x.to("meta") for x in inputs))
    check_gradients(meta, meta_graph, tuple(x.to("meta") for x in inputs), None, None)
    assert "gradient check skipped" in caplog.text and "meta device" in caplog.text


class Counted(torch.autograd.Function):
    """Scales by how often it ran: a second forward (a recompute) computes something else."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        Counted.calls += 1
        return x * (1 + 0.1 * Counted.calls)

    @staticmethod
    def backward(ctx, grad):
        return grad


class CountedBlock(Lin):
    def forward(self, x):
        return Counted.apply(self.lin(x))


def test_gradient_check_refuses_a_forward_that_does_not_compute_the_same_twice():
    model, inputs = chain(CountedBlock()), example()
    graph = harmony.decompose(model, inputs)
    with pytest.raises(harmony.DecomposeError, match="output 0 of the model differs.*does not compute the same twice"):
        check_gradients(model, graph, inputs, None, None)
