"""Skip connections across several layers become relays; granularity options; layer specs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zoo import FACTORIES, RTOL, assert_layers_match_model

import harmony
from bench.pattern_models import TutorialCNN


class Block(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.lin = nn.Linear(cin, cout)
        self.norm = nn.BatchNorm1d(cout)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.lin(x)))


class ToyUNet(nn.Module):
    """down1 -> down2 -> down3 -> up3 -> up2 (cat with down2) -> up1 (add down1)."""

    def __init__(self) -> None:
        super().__init__()
        self.down1 = Block(6, 8)
        self.down2 = Block(8, 8)
        self.down3 = Block(8, 8)
        self.up3 = Block(8, 8)
        self.up2 = Block(16, 8)
        self.up1 = Block(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(d1)
        d3 = self.down3(d2)
        u3 = self.up3(d3)
        u2 = self.up2(torch.cat([u3, d2], dim=1))
        return self.up1(u2 + d1)


def _unet(dtype=torch.float64):
    torch.manual_seed(0)
    return ToyUNet().to(dtype), (torch.randn(4, 6, dtype=dtype),)


def assert_chain(lg: harmony.LayerGraph) -> None:
    """Layer i's outputs are layer i+1's inputs; relayed values pass straight through."""
    assert lg.layers[0].inputs == lg.inputs
    for a, b in zip(lg.layers, lg.layers[1:]):
        assert a.outputs == b.inputs, f"{a.name} -> {b.name}: {a.outputs} != {b.inputs}"
    for spec in lg.layers:
        for name in spec.relayed:
            assert name in spec.inputs and name in spec.outputs, f"{spec.name} relays {name} but does not carry it"


def test_unet_skip_connections_are_relayed_through_intermediate_layers():
    model, inputs = _unet()
    model.eval()
    lg = harmony.decompose(model, inputs)
    assert [l.name for l in lg.layers] == ["down1", "down2", "down3", "up3", "up2", "up1"]
    assert_chain(lg)
    relays = lg.relays()
    assert relays, "a skip over several layers must be relayed"
    d1 = lg.layers[0].outputs
    assert len(d1) == 1
    (d1,) = d1
    # down1's output is consumed by up1's add (after up2): down3 and up3 only pass it on
    assert {i: names for i, names in relays.items()} == {2: [d1], 3: [d1]}
    for i in (1, 2, 3):  # it crosses every boundary between down1 and up2
        assert d1 in lg.layers[i].inputs and d1 in lg.layers[i].outputs
    assert d1 not in lg.layers[5].inputs
    for spec in lg.layers:
        assert set(spec.relayed) <= set(spec.inputs) & set(spec.outputs)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_unet_with_relays_matches_model(train):
    model, inputs = _unet()
    model.train(train)
    lg = assert_layers_match_model(model, inputs, RTOL[torch.float64])
    assert lg.relays()


def test_relayed_layers_run_one_at_a_time_pass_values_through_unchanged():
    model, inputs = _unet()
    model.eval()
    lg = harmony.decompose(model, inputs)
    values = dict(zip(lg.layers[0].inputs, inputs))
    for spec in lg.layers:
        out = lg.run_layer(spec.index, *[values[n] for n in spec.inputs])
        assert len(out) == len(spec.outputs)
        for name, value in zip(spec.outputs, out):
            if name in spec.relayed:
                assert value is values[name], f"{spec.name} changed relayed {name}"
            values[name] = value
    assert torch.equal(values[lg.layers[-1].outputs[0]], model(*inputs))


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@pytest.mark.parametrize(
    "options, names",
    [
        ({}, ["stem", "blocks.0", "blocks.1", "blocks.2", "norm+head"]),
        ({"depth": 1}, ["stem", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]),
        # one module two levels down; the parameterless activation joins the norm before it
        ({"depth": 2}, ["stem", "blocks.0.lin", "blocks.0.norm+blocks.0.act", "blocks.1.lin", "blocks.1.norm+blocks.1.act",
                        "blocks.2.lin", "blocks.2.norm+blocks.2.act", "norm", "head"]),
        ({"modules": ["blocks.0", "blocks.2"]}, ["blocks.0", "blocks.2"]),
        ({"modules": ["stem", "blocks.1", "head"]}, ["stem", "blocks.1", "head"]),
    ],
    ids=["auto", "depth1", "depth2", "modules-two", "modules-three"],
)
def test_granularity_options_give_expected_layers_and_still_match(options, names):
    torch.manual_seed(0)
    model = Small().double().eval()
    inputs = (torch.randn(3, 4, dtype=torch.float64),)
    lg = assert_layers_match_model(model, inputs, RTOL[torch.float64], **options)
    assert [l.name for l in lg.layers] == names
    assert_chain(lg)


def test_unknown_module_name_in_granularity_raises_decompose_error():
    model, inputs = _unet()
    with pytest.raises(harmony.DecomposeError, match="down9"):
        harmony.decompose(model, inputs, modules=["down1", "down9"])


@pytest.mark.parametrize("options", [{"depth": 0}, {"depth": 1, "modules": ["down1"]}, {"method": "magic"}])
def test_invalid_granularity_or_method_raises_decompose_error(options):
    model, inputs = _unet()
    with pytest.raises(harmony.DecomposeError):
        harmony.decompose(model, inputs, **options)


@pytest.mark.parametrize("name", ["gpt2", "resnet", "hf_gpt2"])
def test_layer_specs_record_inputs_outputs_state_and_value_shapes(name):
    model, inputs = FACTORIES[name](torch.float32, dropout=False)
    model.eval()
    lg = harmony.decompose(model, inputs)
    assert_chain(lg)
    batch = inputs[0].shape[0]
    owned: list[str] = []
    for spec in lg.layers:
        assert spec.inputs and spec.outputs, f"{spec.name} has no inputs or outputs"
        assert isinstance(spec.relayed, list)
        assert spec.state, f"{spec.name} owns no parameters"
        owned += spec.state
        assert spec.modules, f"{spec.name} names no modules"
        for value in spec.inputs + spec.outputs:
            v = lg.values[value]
            if v.kind == "tensor":
                assert v.shape and v.shape[0] == batch, f"{value}: {v.shape}"
                assert v.dtype.startswith("torch.")
                assert v.nbytes > 0
    for value, x in zip(lg.inputs, inputs):
        assert lg.values[value].shape == list(x.shape)
    shared = {n for n in owned if owned.count(n) > 1}
    assert all(lg.canonical(n) in lg.ties for n in shared), f"untied tensors owned by two layers: {shared}"
    named = {lg.canonical(n) for n in owned}
    expected = {n for n, _ in model.named_parameters()}  # tied parameters once, by canonical name
    assert {n for n in named if lg.state[n].kind == "parameter"} == expected
    for n in model.state_dict():
        assert n in lg.state, f"{n} missing from the graph's state table"
        assert lg.state[n].shape == list(model.state_dict()[n].shape)


def test_naming_a_module_list_as_a_layer_is_a_clear_error():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    with pytest.raises(harmony.DecomposeError, match="'blocks' is a ModuleList"):
        harmony.decompose(Net(), (torch.randn(2, 4),), modules=["blocks"])


def test_a_model_without_containers_gets_one_layer_per_child_module():
    torch.manual_seed(0)
    model = TutorialCNN().double()  # PyTorch's CIFAR-10 tutorial network: no container to cut at
    lg = assert_layers_match_model(model, (torch.randn(2, 3, 32, 32, dtype=torch.float64),), RTOL[torch.float64])
    assert [spec.name for spec in lg.layers] == ["conv1+pool", "conv2+pool", "fc1", "fc2", "fc3"]


class Scaled(nn.Module):
    """A forward with arguments the caller leaves at their defaults."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, scale: float = 0.5, mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * scale
        return x if mask is None else x * mask


def test_arguments_left_at_their_defaults_are_not_inputs_of_the_layers():
    torch.manual_seed(0)
    lg = assert_layers_match_model(Scaled().double(), (torch.randn(2, 4, dtype=torch.float64),), RTOL[torch.float64])
    assert lg.inputs == ["x"]
