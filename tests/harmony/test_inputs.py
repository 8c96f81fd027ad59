"""What a user hands Harmony is checked before any work (harmony/inputs.py): each malformed
argument to `harmony.compile`, the `Trainer` or a model file is refused with a `HarmonyError` that
names the argument, says what it got and what to do, instead of an error from deep inside."""

from __future__ import annotations

import random
import re
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import harmony
from harmony import inputs
from harmony.errors import HarmonyError, ModelFileError
from harmony.modelfile import load_model_file

MINIBATCH = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))


def get_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 4, generator=g), torch.randint(0, 3, (batch_size,), generator=g)


def _compile(model=None, loss_fn=nn.functional.cross_entropy, batches=get_batch, **kwargs):
    args = {"minibatch_size": MINIBATCH, "devices": 2, "probe": False, "compare": False, **kwargs}
    return harmony.compile(_model() if model is None else model, loss_fn, batches, **args)


def _refused(expected: str, **kwargs) -> str:
    """The compile's error for ``kwargs``, which must contain ``expected``."""
    with pytest.raises(HarmonyError) as info:
        _compile(**kwargs)
    message = str(info.value)
    assert expected in message, message
    return message


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y)


@pytest.fixture(scope="module")
def plan():
    return _compile()


# ------------------------------------------------------------ get_batch
def test_get_batch_returning_three_values_is_refused_naming_get_batch():
    message = _refused("get_batch(2, 0) returned a tuple of 3 values",
                       batches=lambda b, s: (torch.zeros(b, 4), torch.zeros(b, 4), torch.zeros(b, dtype=torch.long)))
    assert "must return a pair (inputs, target)" in message and "`return (x1, x2), y`" in message
    assert "unpack" not in message


def test_get_batch_returning_a_bare_tensor_is_refused_as_not_a_pair_not_as_a_batch_of_its_second_dim():
    message = _refused("get_batch(2, 0) returned a float32 tensor of shape (2, 12)",
                       batches=lambda b, s: torch.zeros(b, 12))
    assert "must return a pair (inputs, target)" in message and "batch size 12" not in message


def test_get_batch_returning_a_dict_is_refused_naming_its_keys():
    _refused("get_batch(2, 0) returned a dict with keys 'x', 'y'",
             batches=lambda b, s: {"x": torch.zeros(b, 4), "y": torch.zeros(b, dtype=torch.long)})


def test_get_batch_ignoring_its_batch_size_is_refused_with_both_sizes():
    message = _refused("get_batch(2, 0) returned inputs as a float32 tensor of shape (8, 4): 8 samples where 2 were "
                       "asked for", batches=lambda b, s: get_batch(8, s))
    assert "batch_size argument" in message


def test_a_target_of_another_size_than_the_inputs_is_refused_naming_the_target():
    _refused("get_batch(2, 0) returned the target as an int64 tensor of shape (8,): 8 samples where 2",
             batches=lambda b, s: (get_batch(b, s)[0], get_batch(8, s)[1]))


def test_one_input_of_several_with_the_wrong_batch_size_is_named_by_its_index():
    _refused("returned inputs[1] as a float32 tensor of shape (3, 4)",
             model=_TwoInputs(), batches=lambda b, s: ((torch.zeros(b, 4), torch.zeros(3, 4)), get_batch(b, s)[1]))


def test_a_scalar_tensor_in_the_batch_is_refused_as_having_no_batch_dimension():
    _refused("the target as a float32 tensor of shape (), which has no batch dimension",
             batches=lambda b, s: (torch.zeros(b, 4), torch.tensor(0.0)))


def test_inputs_that_are_not_tensors_are_refused_naming_what_they_are():
    _refused("get_batch(2, 0) returned inputs that are a list of 2 values (int 1, int 2)",
             batches=lambda b, s: ([1, 2], torch.zeros(b)))


def test_a_get_batch_that_is_not_callable_is_refused_showing_how_it_is_called():
    _refused("get_batch must be a function get_batch(batch_size, step) -> (inputs, target), got a list",
             batches=[get_batch(4, 0)] * 3)


def test_a_get_batch_that_raises_is_named_with_its_call_and_the_cause_kept():
    with pytest.raises(HarmonyError, match=re.escape("get_batch(2, 0) raised TypeError")) as info:
        _compile(batches=lambda batch_size: get_batch(batch_size, 0))
    assert isinstance(info.value.__cause__, TypeError)


def test_checking_get_batch_leaves_the_random_generators_where_they_were():
    def drawing(batch_size, step):
        return torch.randn(batch_size, 4) + float(np.random.rand()) + random.random(), torch.zeros(batch_size, 3)

    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    inputs.sample_batch(drawing, 2)
    after = torch.rand(1), np.random.rand(), random.random()
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    assert (torch.rand(1), np.random.rand(), random.random()) == after


# ------------------------------------------------------------ loss_fn
def test_loss_fn_returning_a_per_sample_vector_is_refused_naming_loss_fn():
    message = _refused("loss_fn(output, target) returned a float32 tensor of shape (2,); the loss must be a scalar",
                       loss_fn=lambda out, target: nn.functional.cross_entropy(out, target, reduction="none"))
    assert ".mean()" in message and "implicitly created" not in message


def test_loss_fn_returning_a_python_number_is_refused_asking_for_a_tensor():
    _refused("loss_fn(output, target) returned float",
             loss_fn=lambda out, t: nn.functional.cross_entropy(out, t).item())


def test_a_detached_loss_is_refused_because_no_gradient_could_flow():
    _refused("does not require grad although the output does",
             loss_fn=lambda out, t: nn.functional.cross_entropy(out, t).detach())


def test_an_integer_loss_is_refused_as_not_differentiable():
    _refused("returned an int64 tensor of shape (); the loss must be a real floating-point tensor",
             loss_fn=lambda out, t: (out.argmax(1) == t).sum())


def test_a_loss_fn_that_raises_is_named_with_the_output_and_target_it_got():
    with pytest.raises(HarmonyError) as info:
        _compile(loss_fn=lambda out, t: out + t)
    message = str(info.value)
    assert "loss_fn(output, target) with output a float32 tensor of shape (2, 3) and target an int64 tensor of " \
           "shape (2,) raised RuntimeError" in message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_loss_fn_that_is_not_callable_is_refused():
    _refused("loss_fn must be a function loss_fn(output, target)", loss_fn="cross_entropy")


def test_checking_the_loss_changes_no_running_statistic_random_stream_or_gradient():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    x, y = get_batch(2, 0)
    inputs.check_loss_on_model(model, nn.functional.cross_entropy, x, y)
    drawn = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(1))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_model_on_the_meta_device_is_not_run_for_the_loss_check():
    with torch.device("meta"):
        model = _model()

    def loss_fn(out, target):
        raise AssertionError("the loss of a model that cannot run was computed")

    inputs.check_loss_on_model(model, loss_fn, *get_batch(2, 0))


def test_a_model_that_cannot_take_get_batchs_inputs_is_refused_showing_them():
    _refused("the model raised RuntimeError on get_batch's inputs (a float32 tensor of shape (2, 5))",
             batches=lambda b, s: (torch.zeros(b, 5), torch.zeros(b, dtype=torch.long)))


# ------------------------------------------------------------ sizes and builders
@pytest.mark.parametrize("value, shown", [(0, "int 0"), (-3, "int -3"), (True, "bool True"), (2.0, "float 2.0"),
                                          ("4", "str '4'")])
def test_a_minibatch_size_that_is_not_a_positive_int_is_refused_naming_minibatch_size(value, shown):
    _refused(f"minibatch_size: the minibatch size must be a positive integer, got {shown}", minibatch_size=value)


@pytest.mark.parametrize("value, shown", [(0, "int 0"), (False, "bool False"), (1.5, "float 1.5")])
def test_a_device_count_that_is_not_a_positive_int_is_refused_naming_devices(value, shown):
    _refused(f"devices: the device count must be a positive integer, got {shown}", devices=value)


def test_a_numpy_integer_is_a_minibatch_size():
    size = inputs.check_minibatch_size(np.int64(4))
    assert size == 4 and type(size) is int


def test_a_model_class_instead_of_an_instance_is_refused_naming_model():
    _refused("model: expected a torch.nn.Module, got type", model=nn.Linear)


def test_build_optimizer_returning_no_optimizer_is_refused_naming_build_optimizer():
    _refused("build_optimizer(params) returned a list of 1 value (a SGD); it must return",
             build_optimizer=lambda params: [torch.optim.SGD(params, lr=0.1)])


def test_a_build_optimizer_that_is_not_callable_is_refused():
    _refused("build_optimizer must be a function build_optimizer(params) -> torch.optim.Optimizer, got a SGD",
             build_optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))


def test_the_trainer_refuses_an_optimizer_builder_that_builds_no_optimizer_naming_optimizer(plan):
    with pytest.raises(HarmonyError, match=re.escape("optimizer(params) returned str 'adam'")):
        harmony.Trainer(plan, optimizer=lambda params: "adam")


def test_the_trainer_refuses_a_loss_fn_that_is_not_callable(plan):
    with pytest.raises(HarmonyError, match="loss_fn must be a function"):
        harmony.Trainer(plan, loss_fn=torch.zeros(()))


def test_the_trainer_refuses_a_scheduler_builder_returning_no_scheduler_naming_lr_scheduler(plan):
    expected = "lr_scheduler(optimizer) returned float 0.1, which has no step()"
    with pytest.raises(HarmonyError, match=re.escape(expected)):
        harmony.Trainer(plan, lr_scheduler=lambda optimizer: 0.1)


def test_the_trainer_names_a_scheduler_builder_that_raises(plan):
    with pytest.raises(HarmonyError, match=re.escape("lr_scheduler(optimizer) on an optimizer over stand-in parameters "
                                                     "raised TypeError")):
        harmony.Trainer(plan, lr_scheduler=lambda: None)


# ------------------------------------------------------------ the model file says the same
MODEL_FILE = """
import torch
def build_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
def loss_fn(output, target):
    return torch.nn.functional.cross_entropy(output, target)
def get_batch(batch_size, step):
    return torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))
"""


def _model_file(tmp_path, old: str, new: str):
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(MODEL_FILE.replace(old, new)))
    return load_model_file(path)


def _api_message(**kwargs) -> str:
    with pytest.raises(HarmonyError) as info:
        _compile(**kwargs)
    return str(info.value)


def test_a_model_file_returning_three_values_is_refused_in_the_api_s_words(tmp_path):
    mf = _model_file(tmp_path, "return torch.randn(batch_size, 4), torch.randint",
                     "return torch.randn(batch_size, 4), torch.randn(batch_size, 4), torch.randint")
    with pytest.raises(ModelFileError) as info:
        mf.get_batch(2, 0)
    api = _api_message(batches=lambda b, s: (torch.zeros(b, 4), torch.zeros(b, 4), torch.zeros(b, dtype=torch.long)))
    assert str(info.value) == f"{mf.path}: {api}"


def test_a_model_file_loss_per_sample_is_refused_in_the_api_s_words(tmp_path):
    mf = _model_file(tmp_path, "cross_entropy(output, target)", "cross_entropy(output, target, reduction='none')")
    model = mf.build_model()
    x, y = get_batch(2, 0)
    with pytest.raises(ModelFileError) as info:
        mf.loss_fn(model(x), y)
    api = _api_message(loss_fn=lambda out, t: nn.functional.cross_entropy(out, t, reduction="none"))
    assert str(info.value) == f"{mf.path}: {api}"


def test_a_model_file_optimizer_builder_returning_no_optimizer_is_named(tmp_path):
    mf = _model_file(tmp_path, "def get_batch", "def build_optimizer(params):\n    return None\ndef get_batch")
    with pytest.raises(ModelFileError, match=re.escape(f"{mf.path}: build_optimizer(params) returned None")):
        mf.build_optimizer([nn.Parameter(torch.zeros(1))])
