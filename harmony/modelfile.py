"""Loading a user's model file: the four functions Harmony needs and the `--arg` options.

A model file is ordinary Python defining ``build_model``, ``loss_fn``, ``get_batch`` and,
optionally, ``build_optimizer`` and ``build_lr_scheduler(optimizer)`` (a ``torch.optim.lr_scheduler``
scheduler, stepped once per minibatch). Options given on the command line as ``--arg key=value`` are
passed as keyword arguments to whichever of these functions declare them (or take ``**kwargs``),
so one file can offer presets without any Harmony-specific API.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from harmony.errors import HarmonyError, ModelFileError
from harmony.inputs import check_batch, check_loss, check_optimizer, check_scheduler

REQUIRED = ("build_model", "loss_fn", "get_batch")
OPTIONAL = ("build_optimizer", "build_lr_scheduler")


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """Turn ``["preset=tiny", "layers=4"]`` into ``{"preset": "tiny", "layers": 4}``.

    Values are read as Python literals when they are one (numbers, booleans, None, lists) and kept
    as strings otherwise, so ``--arg preset=tiny`` needs no quoting.
    """
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ModelFileError(f"--arg {pair!r} is not of the form key=value (key a Python identifier)")
        try:
            options[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            options[key] = raw
    return options


def _accepts(fn: Callable, name: str) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.kind is p.VAR_KEYWORD or p.name == name for p in params)


def _declares(fn: Callable, name: str) -> bool:
    """Whether ``fn`` names the option, or takes arbitrary options (``**kwargs``, not ``**_``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or (p.kind is p.VAR_KEYWORD and not p.name.startswith("_")) for p in params)


def _where(exc: BaseException, path: Path) -> str:
    """" (line N)" of the deepest frame of ``exc``'s traceback in the model file, if any."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    return f" (line {frames[-1].lineno})" if frames else ""


def default_optimizer(params) -> torch.optim.Optimizer:
    """SGD at lr 0.01, where no optimizer is given (a module-level function: spawned workers
    receive it pickled)."""
    return torch.optim.SGD(params, lr=0.01)


@dataclass
class ModelFile:
    """The functions of a loaded model file with its options bound."""

    path: Path
    options: dict[str, Any]
    source_hash: str
    module: Any = field(repr=False)

    def __reduce__(self):
        """Pickled as its path and options (re-imported on the other side): spawned CUDA workers
        receive the model file's loss and optimizer this way."""
        return (load_model_file, (str(self.path), dict(self.options)))

    def _call(self, name: str, *args):
        """``name`` of the model file with its options; an exception it raises becomes a
        ``ModelFileError`` naming the function, the options and the line of the file it came from
        (a bad ``--arg`` value is the usual cause), the original kept as its ``__cause__``."""
        fn = getattr(self.module, name)
        kwargs = {k: v for k, v in self.options.items() if _accepts(fn, k)}
        try:
            return fn(*args, **kwargs)
        except HarmonyError:
            raise
        except Exception as exc:
            options = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            raise ModelFileError(
                f"{self.path}: {name}({options}) raised {type(exc).__name__}: {exc}"
                f"{_where(exc, self.path)}; check the --arg options and the file"
            ) from exc

    @property
    def _source(self) -> str:
        """The prefix of the checks' messages (``harmony.inputs``): the same words as the Python
        API's, after the file's path."""
        return f"{self.path}: "

    def build_model(self) -> torch.nn.Module:
        model = self._call("build_model")
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{self.path}: build_model() returned {type(model).__name__}, expected a torch.nn.Module"
            )
        return model

    def loss_fn(self, output, target) -> torch.Tensor:
        """The file's loss, checked on every call (a cheap look at its result): a scalar that
        carries the output's gradient."""
        return check_loss(self.module.loss_fn(output, target), output, error=ModelFileError, source=self._source)

    def get_batch(self, batch_size: int, step: int) -> tuple:
        """The file's batch, checked on every call: a pair of ``batch_size`` samples, batch first."""
        batch = self._call("get_batch", batch_size, step)
        return check_batch(batch, batch_size, step, error=ModelFileError, source=self._source)

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        if hasattr(self.module, "build_optimizer"):
            return check_optimizer(self._call("build_optimizer", params), error=ModelFileError, source=self._source)
        return default_optimizer(params)

    @property
    def lr_scheduler(self) -> Callable | None:
        """The file's learning-rate scheduler builder with its options, or None if it has none."""
        return self._build_lr_scheduler if hasattr(self.module, "build_lr_scheduler") else None

    def _build_lr_scheduler(self, optimizer):
        return check_scheduler(self._call("build_lr_scheduler", optimizer), name="build_lr_scheduler",
                               error=ModelFileError, source=self._source)


def source_hash(path: Path) -> str:
    """SHA-256 of the model file's bytes: a plan records it to notice that its model changed."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_model_file(path: str | Path, options: dict[str, Any] | None = None) -> ModelFile:
    """Import ``path`` as a module and check that it defines what Harmony needs.

    Raises ModelFileError naming the missing function, a function that is not callable, or an
    option that no function of the file accepts (a mistyped ``--arg`` should not pass silently).
    """
    path = Path(path)
    options = dict(options or {})
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist")
    name = f"harmony_user_model_{hashlib.md5(str(path.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path} cannot be imported as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise ModelFileError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc

    missing = [fn for fn in REQUIRED if not hasattr(module, fn)]
    if missing:
        raise ModelFileError(
            f"{path} does not define {', '.join(missing)}; a model file needs "
            "build_model(), loss_fn(output, target), get_batch(batch_size, step) "
            "and optionally build_optimizer(params)"
        )
    for fn in REQUIRED + OPTIONAL:
        if hasattr(module, fn) and not callable(getattr(module, fn)):
            raise ModelFileError(f"{path}: {fn} is defined but is not a function")

    functions = [getattr(module, fn) for fn in REQUIRED + OPTIONAL if hasattr(module, fn)]
    unknown = [k for k in options if not any(_declares(f, k) for f in functions)]
    if unknown:
        raise ModelFileError(
            f"{path}: no function of the model file takes the option(s) {', '.join(unknown)}"
        )
    return ModelFile(path=path, options=options, source_hash=source_hash(path), module=module)
