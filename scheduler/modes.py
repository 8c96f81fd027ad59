"""The modes, and the task graph of one iteration in any of them.

Harmony's own modes (``pp``, ``dp``) and the per-GPU-swap ``dp-swap`` are generated in
``taskgraph.py``, the pipeline baselines in ``baselines.py``; ``generate`` picks the generator
for a mode and applies what every mode shares: updates gated on the whole gradient, kept state.
"""

from __future__ import annotations

from harmony.profiling.profiles import Profile
from harmony.scheduler.baselines import BASELINES
from harmony.scheduler.keep import keep_state
from harmony.scheduler.taskgraph import dp_swap, harmony_dp, with_norm, wrap_around_pipeline
from harmony.scheduler.tasks import Configuration, TaskGraph

MODES = ("pp", "dp", "dp-swap", "dp-swap-r", "gpipe-swap", "gpipe-swap-r", "1f1b-swap", "1f1b-swap-r")


def generate(mode: str, profile: Profile, config: Configuration, devices: int, minibatch: int, gated: bool = False,
             keep: bool = False, **options) -> TaskGraph:
    """The task graph of one iteration of ``config`` in ``mode``; ``gated``: one whose updates wait
    for the whole gradient (``with_norm``: clipping needs its norm, fp16 whether it overflowed).
    Weights the profile counts in low precision travel so: frozen ones always, trainable ones
    where the host steps them (``Profile.for_update``: not those of ``device_steps``' packs).
    ``keep``: the state that can stay on its device across iterations does (``keep.py``; whether
    it fits is the estimate's to say)."""
    if gated and mode == "pp" and options.get("update", "device") == "device":
        options = {**options, "jit_update": False}
    device_layers = frozenset(layer for first, last in options.get("device_steps", ())
                              for layer in range(first, last + 1))
    profile = profile.for_update(update_side(mode, options), device_layers)
    graph = _generate(mode, profile, config, devices, minibatch, **options)
    if gated:
        graph = with_norm(graph)
    # the weights' bytes are the profile's, which counts these copies in low precision: the runtime moves them so
    graph.low_copies = {c.name: c.dtype for c in profile.low_copies}
    if keep:
        graph = keep_state(graph, profile, None) or graph
    return graph


def update_side(mode: str, options: dict) -> str:
    """Where ``mode``'s updates run with generator ``options``: "host" (every pack stepped in host
    memory) or "device" (a device steps some; the per-GPU-swap baselines step all on the devices)."""
    if mode == "pp":
        return options.get("update", "device")
    if mode == "dp":
        return options.get("update", "host")
    return "device"


def _generate(mode: str, profile: Profile, config: Configuration, devices: int, minibatch: int, **options) -> TaskGraph:
    if devices < 1 or minibatch < 1:
        raise ValueError(f"need at least one device and one sample, got {devices} devices and minibatch {minibatch}")
    if mode == "pp":
        return wrap_around_pipeline(profile, config, devices, minibatch, **options)
    if mode == "dp":
        return harmony_dp(profile, config, devices, minibatch, **options)
    if mode == "dp-swap":
        return dp_swap(profile, config, devices, minibatch, recompute=False, **options)
    if mode in BASELINES:
        return BASELINES[mode](profile, config, devices, minibatch, **options)
    raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
