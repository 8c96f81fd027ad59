"""Harmony: train PyTorch models far larger than GPU memory on one server, as if on one virtual device."""

from harmony.api import compile, load_plan  # noqa: A004
from harmony.decomposer.decompose import decompose
from harmony.decomposer.layer_graph import LayerGraph
from harmony.errors import DecomposeError, FormatError, HarmonyError, ModelFileError
from harmony.trainer import Trainer

__version__ = "0.1.0"

__all__ = ["compile", "load_plan", "Trainer", "decompose", "LayerGraph", "HarmonyError", "DecomposeError", "FormatError", "ModelFileError", "__version__"]
