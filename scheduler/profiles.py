"""Layer profiles: what each layer costs in time, memory and bytes moved, at any microbatch size.

The scheduler only ever asks "how long / how much memory / how many bytes for layer l at
microbatch size u", so a profile is a set of samples per layer plus a regression fitted over them
(scikit-learn), answering for sizes that were never run. Profiles are measured on a device
(runtime's measuring loop) or computed analytically (FLOP counts and a roofline); each records which.
The profiler itself lives with the runtime; this module only holds the data and the fit, so the
scheduler depends on nothing that runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from sklearn.linear_model import LinearRegression

from harmony import serialization
from harmony.errors import FormatError

SCHEMA_VERSION = 1
KIND = "profile"
PROFILE_FILE = "profile.msgpack"

# Quantities that grow with the microbatch size and are interpolated.
TIME_FIELDS = ("fwd_time", "bwd_time", "recompute_time")
MEMORY_FIELDS = ("fwd_peak", "bwd_peak", "x_bytes", "y_bytes", "dx_bytes")
SAMPLE_FIELDS = TIME_FIELDS + MEMORY_FIELDS


@dataclass
class LayerSample:
    """One layer measured (or computed) at one microbatch size ``u``.

    Times are seconds (median of trials). ``fwd_peak``/``bwd_peak`` are the peak device bytes of the
    forward / backward task on that layer alone, including its weights, inputs, outputs and
    temporaries (backward includes the recompute). Sizes are of the layer's input X, output Y and
    input gradient dX.
    """

    u: int
    fwd_time: float
    bwd_time: float
    recompute_time: float
    fwd_peak: int
    bwd_peak: int
    x_bytes: int
    y_bytes: int
    dx_bytes: int


@dataclass
class Fit:
    """y ≈ intercept + slope·u for one quantity, with the worst relative error on its samples."""

    intercept: float
    slope: float
    max_rel_error: float

    def __call__(self, u: float) -> float:
        return max(0.0, self.intercept + self.slope * u)


def fit_samples(us: list[int], ys: list[float]) -> Fit:
    """Least-squares line through the samples (scikit-learn), recording how well it fits them."""
    if not us:
        return Fit(0.0, 0.0, 0.0)
    if len(set(us)) == 1:
        return Fit(0.0, float(np.mean(ys)) / us[0], 0.0)
    model = LinearRegression().fit(np.asarray(us, dtype=float).reshape(-1, 1), np.asarray(ys, dtype=float))
    fit = Fit(float(model.intercept_), float(model.coef_[0]), 0.0)
    errors = [abs(fit(u) - y) / y for u, y in zip(us, ys) if y > 0]
    fit.max_rel_error = float(max(errors)) if errors else 0.0
    return fit


@dataclass
class LayerProfile:
    """Everything the scheduler needs about one layer.

    The sizes W (parameters), dW (their gradients), K (optimizer state) and B (buffers) do not
    depend on u. ``fwd_samples`` may reach larger u than ``bwd_samples``: forward and backward
    have separate maxima (U_FMAX, U_BMAX).
    """

    index: int
    name: str
    w_bytes: int
    dw_bytes: int
    k_bytes: int
    b_bytes: int
    upd_time_device: float
    upd_time_host: float
    fwd_samples: list[LayerSample] = field(default_factory=list)
    bwd_samples: list[LayerSample] = field(default_factory=list)

    @cached_property
    def fits(self) -> dict[str, Fit]:
        fits = {}
        for name in SAMPLE_FIELDS:
            samples = self.bwd_samples if name in ("bwd_time", "recompute_time", "bwd_peak", "dx_bytes") else self.fwd_samples
            fits[name] = fit_samples([s.u for s in samples], [getattr(s, name) for s in samples])
        return fits

    def at(self, quantity: str, u: int) -> float:
        """The quantity at microbatch size u: the sample itself when measured, else the fit."""
        samples = self.bwd_samples if quantity in ("bwd_time", "recompute_time", "bwd_peak", "dx_bytes") else self.fwd_samples
        for s in samples:
            if s.u == u:
                return float(getattr(s, quantity))
        return self.fits[quantity](u)


@dataclass
class Profile:
    """Per-layer profiles of one model on one kind of device, with the sweep's maxima."""

    source: str  # "measured" or "analytic"
    device: str  # e.g. "cpu (emulated, 512 MiB)", "NVIDIA H100", "analytic:v100"
    capacity: int
    u_fmax: int
    u_bmax: int
    layers: list[LayerProfile]
    graph_hash: str = ""  # ties the profile to the layer graph it was made from
    notes: dict[str, str] = field(default_factory=dict)

    def fit_errors(self) -> dict[str, float]:
        """The worst relative fit error per quantity over all layers (reported, not hidden)."""
        worst: dict[str, float] = {}
        for layer in self.layers:
            for name, fit in layer.fits.items():
                worst[name] = max(worst.get(name, 0.0), fit.max_rel_error)
        return worst

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, body: dict) -> "Profile":
        try:
            layers = [
                LayerProfile(
                    **{k: v for k, v in layer.items() if k not in ("fwd_samples", "bwd_samples")},
                    fwd_samples=[LayerSample(**s) for s in layer["fwd_samples"]],
                    bwd_samples=[LayerSample(**s) for s in layer["bwd_samples"]],
                )
                for layer in body["layers"]
            ]
            return cls(**{k: v for k, v in body.items() if k != "layers"}, layers=layers)
        except (KeyError, TypeError) as exc:
            raise FormatError(f"profile is malformed ({type(exc).__name__}: {exc})") from exc

    def save(self, path: str | Path) -> None:
        serialization.save(path, KIND, SCHEMA_VERSION, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_dict(serialization.load(path, KIND, SCHEMA_VERSION))
