"""Helpers the generated layer modules call to own their parameters, buffers and leaf modules.

A generated layer either binds to a live model (``source``), sharing its tensors so that gradients
and buffer updates land in the original, or builds fresh ones from the shapes recorded at
generation time (for a worker that only has the plan; weights are loaded afterwards). Attributes
keep the original model's qualified names, so a layer's ``state_dict`` keys are the model's.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

import torch


def _parent(layer: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str]:
    *prefix, name = path.split(".")
    module = layer
    for item in prefix:
        child = module._modules.get(item)
        if child is None:
            child = torch.nn.Module()
            module.add_module(item, child)
        module = child
    return module, name


def attach_module(
    layer: torch.nn.Module,
    path: str,
    build: Callable[[], torch.nn.Module],
    dtype: torch.dtype | None,
    source: torch.nn.Module | None,
) -> None:
    """Install a whole torch.nn leaf (Linear, BatchNorm, Dropout …) at ``path``."""
    if source is not None:
        module = source.get_submodule(path)
    else:
        module = build()
        if dtype is not None:
            module = module.to(dtype)
    parent, name = _parent(layer, path)
    parent.add_module(name, module)


_PROVIDED: dict[str, torch.nn.Module] = {}


def provide_opaque(modules: dict[str, torch.nn.Module]) -> None:
    """The modules kept whole, for layers built without the live model (a spawned worker receives
    them, structure only, from the process that has it)."""
    _PROVIDED.update(modules)


_FUNCTIONS: dict[tuple[str, str], type] = {}


def provide_functions(functions: dict[tuple[str, str], type]) -> None:
    """Custom autograd Functions the layer code calls, by (module, qualified name), for a process
    that cannot import them by name (a spawned worker, for a class of the script run as __main__)."""
    _FUNCTIONS.update(functions)


def function_class(module: str, qualname: str) -> type:
    """The custom autograd Function class the layer code names: provided, or imported."""
    cls = _FUNCTIONS.get((module, qualname))
    if cls is None:
        cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
    return cls


def function_apply(module: str, qualname: str) -> Callable[..., Any]:
    """``apply`` of the custom autograd Function a layer calls as one op (``autograd_guard``)."""
    return function_class(module, qualname).apply


def attach_opaque(layer: torch.nn.Module, path: str, source: torch.nn.Module | None) -> None:
    """Install a module kept whole (asked for, or for what only an eager run keeps): it has no
    generated code, so it comes from the live model or from ``provide_opaque``."""
    if source is not None:
        module = source.get_submodule(path)
    elif path in _PROVIDED:
        module = _PROVIDED[path]
    else:
        raise RuntimeError(
            f"layer {type(layer).__name__} runs module {path!r} as an opaque module; build the layer "
            "with source=<the model>, or provide it (layer_support.provide_opaque): opaque modules have no generated code"
        )
    parent, name = _parent(layer, path)
    parent.add_module(name, module)


def attach_parameter(
    layer: torch.nn.Module,
    path: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    requires_grad: bool,
    source: torch.nn.Module | None,
) -> None:
    if source is not None:
        param = source.get_parameter(path)
    else:
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=requires_grad)
    parent, name = _parent(layer, path)
    parent.register_parameter(name, param)


def attach_buffer(
    layer: torch.nn.Module,
    path: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    persistent: bool,
    source: torch.nn.Module | None,
) -> None:
    if source is not None:
        buf = _get_tensor(source, path)
    else:
        buf = torch.empty(shape, dtype=dtype)
    parent, name = _parent(layer, path)
    parent.register_buffer(name, buf, persistent=persistent)


def _get_tensor(source: torch.nn.Module, path: str) -> torch.Tensor:
    """A buffer or a tensor constant attribute (torch.export lifts constants to plain attributes)."""
    module_path, _, name = path.rpartition(".")
    module = source.get_submodule(module_path) if module_path else source
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise AttributeError(f"{path} is not a tensor of {type(source).__name__}")
    return value


def grad_off() -> bool:
    """Enter a part of the model's forward that ran under ``torch.no_grad()``; returns the mode
    to restore after it (``decomposer/grad_mode.py``)."""
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    return previous


def grad_restore(previous: bool) -> None:
    """Leave such a part: the caller's grad mode again."""
    torch.set_grad_enabled(previous)


def keeps_grad_mode(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A layer's forward that switches grad mode gives its caller's mode back even when it raises
    (an out-of-memory error the profiler catches and retries after)."""

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        previous = torch.is_grad_enabled()
        try:
            return forward(*args, **kwargs)
        finally:
            torch.set_grad_enabled(previous)

    return wrapped
