"""Harmony: train PyTorch models far larger than GPU memory on one server, as if on one virtual device.

The public names load on first use (PEP 562): a spawned worker imports ``harmony.runtime`` without
the compiler, the scheduler's fitting libraries or the trainer, and starts a second or two sooner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from harmony.errors import DecomposeError, FormatError, HarmonyError, ModelFileError

if TYPE_CHECKING:
    from harmony.api import compile, load_plan  # noqa: A004
    from harmony.decomposer.decompose import decompose
    from harmony.decomposer.layer_graph import LayerGraph
    from harmony.trainer import Trainer

__version__ = "0.1.0"

_LAZY = {
    "compile": "harmony.api",
    "load_plan": "harmony.api",
    "Trainer": "harmony.trainer",
    "decompose": "harmony.decomposer.decompose",
    "LayerGraph": "harmony.decomposer.layer_graph",
}

__all__ = ["compile", "load_plan", "Trainer", "decompose", "LayerGraph", "HarmonyError", "DecomposeError", "FormatError",
           "ModelFileError", "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'harmony' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
