"""decompose() refuses what it cannot do with a DecomposeError that says why and what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import harmony
from zoo import RTOL, assert_layers_match_model


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize(
    "bad", ["not a tensor", [1, 2, 3], (), [], None, {"x": torch.zeros(2, 4)}, (torch.zeros(2, 4), "extra")],
    ids=["string", "list-of-ints", "empty-tuple", "empty-list", "none", "dict", "tensor-and-string"],
)
def test_example_inputs_of_wrong_type_raise_decompose_error(bad):
    with pytest.raises(harmony.DecomposeError, match="example_inputs"):
        harmony.decompose(Tiny(), bad)


def test_non_module_model_raises_decompose_error():
    with pytest.raises(harmony.DecomposeError, match="Module"):
        harmony.decompose(lambda x: x, (torch.zeros(2, 4),))


def test_example_inputs_of_wrong_shape_raise_decompose_error_naming_shapes():
    with pytest.raises(harmony.DecomposeError, match=r"\(2, 7\)"):
        harmony.decompose(Tiny(), (torch.zeros(2, 7),))


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + y)


def test_model_with_two_inputs_given_one_example_input_raises_decompose_error():
    with pytest.raises(harmony.DecomposeError, match="'y'"):
        harmony.decompose(TwoInputs(), (torch.zeros(2, 4),))


def test_model_with_two_inputs_decomposes_given_both():
    torch.manual_seed(0)
    model = TwoInputs().double()
    inputs = (torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))
    lg = assert_layers_match_model(model, inputs, RTOL[torch.float64])
    assert lg.inputs == ["x", "y"]
    with pytest.raises(harmony.DecomposeError, match="2 input"):
        lg.run_sequential(inputs[0])


class Gate(nn.Module):
    """Data-dependent Python control flow: neither torch.fx nor torch.export can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        # a different shape on the other branch (a trace of either branch would be wrong)
        k = int(x.abs().sum().item()) % 3 + 1
        return self.lin(x)[:, :k].repeat(1, 4)[:, :4] * -1.0


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.gate = Gate()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.body(self.stem(x))))


def _gated():
    torch.manual_seed(0)
    return Gated().double(), (torch.randn(3, 4, dtype=torch.float64) + 2.0,)


def test_untraceable_control_flow_error_names_module_and_opaque_option():
    model, inputs = _gated()
    with pytest.raises(harmony.DecomposeError) as info:
        harmony.decompose(model, inputs)
    message = str(info.value)
    assert "'gate'" in message
    assert "opaque" in message
    assert "opaque_modules=['gate']" in message


def test_untraceable_control_flow_with_fx_only_names_module():
    model, inputs = _gated()
    with pytest.raises(harmony.DecomposeError, match="gate"):
        harmony.decompose(model, inputs, method="fx")


def test_opaque_module_with_control_flow_decomposes_and_matches():
    model, inputs = _gated()
    lg = assert_layers_match_model(model, inputs, RTOL[torch.float64], opaque_modules=["gate"])
    assert any("gate" in spec.modules for spec in lg.layers)
    # both branches of the gate must still be followed eagerly
    negative = (-inputs[0] - 5.0,)
    with torch.no_grad():
        assert torch.equal(lg.run_sequential(*negative), model(*negative))


def test_model_returning_its_own_parameter_raises_decompose_error():
    class ReturnsWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.lin(x), self.scale

    with pytest.raises(harmony.DecomposeError, match="parameter"):
        harmony.decompose(ReturnsWeight(), (torch.zeros(2, 4),))


def test_a_forward_that_reads_a_buffer_it_updates_is_refused_naming_the_buffer():
    # spectral_norm's power iteration updates its vectors under torch.no_grad() and reads them back:
    # each microbatch's output depends on the ones before it, which no schedule reproduces
    from harmony.decomposer.forward_state import check_forward_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)), nn.ReLU(), nn.Linear(4, 2))
    inputs = (torch.randn(2, 4),)
    harmony.decompose(model, inputs)
    with pytest.raises(harmony.DecomposeError, match=r"updates and reads buffer '0.parametrizations.weight.0._[uv]'"):
        check_forward_state(model, inputs)


def test_a_forward_that_writes_into_a_parameter_is_refused_naming_it():
    from harmony.decomposer.forward_state import check_forward_state

    class Clamps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)
            return self.lin(x)

    with pytest.raises(harmony.DecomposeError, match=r"writes into parameter 'lin.weight'"):
        check_forward_state(Clamps(), (torch.randn(2, 4),))


def test_batchnorm_running_statistics_are_updated_but_not_read_so_they_pass():
    from harmony.decomposer.forward_state import check_forward_state

    check_forward_state(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), (torch.randn(3, 4),))