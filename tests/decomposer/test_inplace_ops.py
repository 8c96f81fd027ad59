"""Models that change values in place, as torchvision's do (``ReLU(inplace=True)``), and that call
functions fx keeps whole (``torch.fx.wrap``): decomposed so that each layer runs as the runtime
runs it, its inputs autograd leaves that collect the gradient for the layer before."""

from __future__ import annotations

import torch
from torch import nn
from zoo import assert_close, assert_layers_match_model

import harmony


def halved(x: torch.Tensor) -> torch.Tensor:
    """A function fx keeps as one call (``torch.fx.wrap``), as torchvision wraps ``stochastic_depth``."""
    return x / 2


torch.fx.wrap("halved")


class Bottleneck(nn.Module):
    """RegNet's residual block: the activation after the sum is a module of the block itself, so
    the block's inner Sequential ends a layer just before it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, width))
        self.activation = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(x + self.f(x))


class ResidualNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.trunk = nn.Sequential(*(Bottleneck(8) for _ in range(3)))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(self.stem(x)))


def _run_as_the_runtime_does(lg: harmony.LayerGraph, x: torch.Tensor) -> torch.Tensor:
    """Each layer on its own, its floating inputs fresh leaves that require grad (``compute._leaves``),
    then the backward layer by layer; returns the output."""
    values = {lg.layers[0].inputs[0]: x}
    runs = []
    for spec in lg.layers:
        inputs = [values[n].detach().requires_grad_(True) if spec.index else values[n] for n in spec.inputs]
        outputs = lg.run_layer(spec.index, *inputs)
        runs.append((spec, inputs, outputs))
        values.update(zip(spec.outputs, (o.detach() for o in outputs)))
    grads = {lg.layers[-1].outputs[0]: torch.ones_like(values[lg.layers[-1].outputs[0]])}
    for spec, inputs, outputs in reversed(runs):
        pairs = [(o, grads[n]) for n, o in zip(spec.outputs, outputs) if n in grads and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for name, leaf in zip(spec.inputs, inputs):
            if spec.index and leaf.grad is not None:
                grads[name] = grads[name] + leaf.grad if name in grads and name not in spec.outputs else leaf.grad
    return values[lg.layers[-1].outputs[0]]


def test_no_layer_starts_by_changing_its_input_in_place():
    torch.manual_seed(0)
    model = ResidualNet().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    reference = ResidualNet().double()
    reference.load_state_dict(model.state_dict())
    lg = harmony.decompose(model, (x,))
    assert len(lg) > 3
    out = _run_as_the_runtime_does(lg, x)
    expected = reference(x)
    expected.sum().backward()
    assert_close(out, expected.detach(), 1e-12, "output")
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert_close(p.grad, q.grad, 1e-12, f"gradient of {name}")


def test_an_in_place_op_after_a_repeated_module_is_traced():
    # shape propagation memoizes a repeated torch.nn call (metamemo.py); its remembered output
    # must take an in-place op as the module's real output does
    torch.manual_seed(0)
    # (ShuffleNet: a BatchNorm seen before without an activation, now followed by one)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True)),
        nn.Linear(8, 2),
    ).double()
    assert_layers_match_model(model, (torch.randn(4, 8, dtype=torch.float64),), 1e-12)


class Halving(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = halved(block(x))
        return x


def test_a_function_kept_whole_by_fx_wrap_is_called_from_the_layer_code():
    torch.manual_seed(0)
    lg = assert_layers_match_model(Halving().double(), (torch.randn(2, 4, dtype=torch.float64),), 1e-12)
    assert any("halved" in source for source in lg.sources.values())


def test_a_layer_named_alone_that_only_changes_its_input_in_place_joins_the_layer_before():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    lg = harmony.decompose(model, (x,), modules=["0", "1", "2"])
    assert [spec.name for spec in lg.layers] == ["0+1", "2"]
    assert_layers_match_model(model, (x,), 1e-12, lg=lg)
