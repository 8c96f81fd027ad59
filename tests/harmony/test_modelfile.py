"""The model-file loader: required functions, options and clear errors."""

import textwrap

import pytest

from harmony.errors import ModelFileError
from harmony.modelfile import load_model_file, parse_options


def _write(tmp_path, body: str):
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(body))
    return path


GOOD = """
import torch
def build_model(width=4):
    return torch.nn.Linear(width, 2)
def loss_fn(output, target):
    return torch.nn.functional.cross_entropy(output, target)
def get_batch(batch_size, step, width=4):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, width, generator=g), torch.randint(0, 2, (batch_size,), generator=g)
"""


def test_options_parse_literals_and_keep_plain_strings():
    assert parse_options(["preset=tiny", "layers=4", "p=0.5", "flag=True"]) == {
        "preset": "tiny", "layers": 4, "p": 0.5, "flag": True,
    }


def test_option_without_equals_sign_is_rejected():
    with pytest.raises(ModelFileError, match="key=value"):
        parse_options(["preset"])


def test_options_reach_the_functions_that_declare_them(tmp_path):
    mf = load_model_file(_write(tmp_path, GOOD), {"width": 6})
    assert mf.build_model().in_features == 6
    x, y = mf.get_batch(3, 0)
    assert x.shape == (3, 6) and y.shape == (3,)


def test_default_optimizer_is_sgd(tmp_path):
    mf = load_model_file(_write(tmp_path, GOOD))
    opt = mf.build_optimizer(mf.build_model().parameters())
    assert type(opt).__name__ == "SGD"


def test_missing_function_is_named(tmp_path):
    path = _write(tmp_path, GOOD.replace("def loss_fn", "def loss_function"))
    with pytest.raises(ModelFileError, match="does not define loss_fn"):
        load_model_file(path)


def test_mistyped_option_is_named(tmp_path):
    with pytest.raises(ModelFileError, match="widht"):
        load_model_file(_write(tmp_path, GOOD), {"widht": 3})


def test_import_error_in_model_file_names_the_file(tmp_path):
    path = _write(tmp_path, "import not_a_real_module_xyz\n")
    with pytest.raises(ModelFileError, match="importing .*m.py failed"):
        load_model_file(path)


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ModelFileError, match="does not exist"):
        load_model_file(tmp_path / "nope.py")


def test_get_batch_must_return_a_pair(tmp_path):
    path = _write(tmp_path, GOOD.replace("return torch.randn(batch_size, width, generator=g), torch.randint(0, 2, (batch_size,), generator=g)", "return 1"))
    with pytest.raises(ModelFileError, match="pair"):
        load_model_file(path).get_batch(2, 0)


def test_a_function_that_rejects_its_option_value_is_named_with_the_value_and_line(tmp_path):
    path = _write(tmp_path, GOOD.replace("    return torch.nn.Linear(width, 2)",
                                         "    if width > 8:\n        raise ValueError('too wide')\n"
                                         "    return torch.nn.Linear(width, 2)"))
    mf = load_model_file(path, {"width": 9})
    with pytest.raises(ModelFileError, match=r"build_model\(width=9\) raised ValueError: too wide \(line 5\)") as info:
        mf.build_model()
    assert isinstance(info.value.__cause__, ValueError)


def test_a_learning_rate_scheduler_builder_is_optional_and_gets_its_options(tmp_path):
    assert load_model_file(_write(tmp_path, GOOD)).lr_scheduler is None
    path = _write(tmp_path, GOOD + """
def build_lr_scheduler(optimizer, gamma=0.5):
    return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=gamma)
""")
    mf = load_model_file(path, {"gamma": 0.25})
    opt = mf.build_optimizer(mf.build_model().parameters())
    scheduler = mf.lr_scheduler(opt)
    opt.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.01 * 0.25]
