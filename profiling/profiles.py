"""Layer profiles: what each layer costs in time, memory and bytes moved, at any microbatch size.

The scheduler only ever asks "how long / how much memory / how many bytes for layer l at
microbatch size u", so a profile is a set of samples per layer plus a regression fitted over them
(scikit-learn), answering for sizes that were never run. Profiles are measured on a device
(runtime's measuring loop) or computed analytically (FLOP counts and a roofline); each records which.
The profiler itself lives with the runtime; this module only holds the data and the fit, so the
scheduler depends on nothing that runs.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from harmony import serialization
from harmony.errors import FormatError
from harmony.scheduler.machine import Machine

SCHEMA_VERSION = 1
_TENSOR_FIELDS = {"W": "w_tensors", "dW": "dw_tensors", "K": "k_tensors", "B": "b_tensors"}
KIND = "profile"
PROFILE_FILE = "profile.msgpack"

# Quantities that grow with the microbatch size and are interpolated.
TIME_FIELDS = ("fwd_time", "bwd_time", "recompute_time")
MEMORY_FIELDS = ("fwd_peak", "bwd_peak", "bwd_first_peak", "act_bytes", "x_bytes", "y_bytes", "dx_bytes")
BWD_FIELDS = ("bwd_time", "recompute_time", "bwd_peak", "bwd_first_peak", "act_bytes", "dx_bytes")
SAMPLE_FIELDS = TIME_FIELDS + MEMORY_FIELDS
# the quantity a loss task's forward takes: it records for autograd, as a recompute does (dearer
# than the no-grad forward of a FWD task)
LOSS_FORWARD = "recompute_time"


@dataclass
class LayerSample:
    """One layer measured (or computed) at one microbatch size ``u``.

    Times are seconds (median of trials). ``fwd_peak``/``bwd_peak`` are the peak device bytes of the
    forward / backward task on that layer alone, including its weights, inputs, outputs and
    temporaries; the backward includes the recompute and the resident gradient buffer dW, into
    which it adds each fresh gradient (a temporary), as every microbatch of a group but the first
    does. ``bwd_first_peak`` is the first's, whose backward makes the buffer (0: not measured).
    ``act_bytes`` is what the recompute leaves alive for the backward (saved activations and Y).
    Sizes are of the layer's input X, output Y and input gradient dX.
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
    act_bytes: int = 0
    bwd_first_peak: int = 0


@dataclass
class Fit:
    """One quantity as a function of u: exact at the samples, linear between neighbouring samples,
    and a least-squares line (scikit-learn) over the largest samples beyond them.

    Time is only piecewise linear in u (small microbatches are bound by reading the weights), so
    one line through every sample misfits small u; memory is affine and comes out exact either way.
    ``max_rel_error`` is the leave-one-out error: each interior sample predicted from the others.
    """

    us: list[int]
    ys: list[float]

    @property
    def max_rel_error(self) -> float:
        """Reckoned on first use: a search fits thousands of quantities and reports none of these."""
        if "_error" not in self.__dict__:
            errors = []
            for k in range(1, len(self.us) - 1):
                others = self.us[:k] + self.us[k + 1:], self.ys[:k] + self.ys[k + 1:]
                predicted = _interpolate(*others, self.us[k])
                if self.ys[k] > 0:
                    errors.append(abs(predicted - self.ys[k]) / self.ys[k])
            self.__dict__["_error"] = float(max(errors)) if errors else 0.0
        return self.__dict__["_error"]

    def __call__(self, u: float) -> float:
        if not self.us:
            return 0.0
        if self.us[0] <= u <= self.us[-1]:
            return _interpolate(self.us, self.ys, u)
        if u < self.us[0]:
            return max(0.0, self.ys[0] * u / self.us[0])
        intercept, slope = self.line()
        return max(0.0, intercept + slope * u)

    def line(self) -> tuple[float, float]:
        """(intercept, slope) of the line through the larger half of the samples; fitted on first
        use, since most lookups fall between samples and never need it."""
        if "_line" not in self.__dict__:
            tail = max(2, len(self.us) // 2)  # extrapolate from the larger sizes, where the trend has settled
            self.__dict__["_line"] = _line(self.us[-tail:], self.ys[-tail:])
        return self.__dict__["_line"]


def _line(us: list[int], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the samples, its slope at least 0:
    nothing profiled shrinks as the microbatch grows, and a falling line between two noisy timings of
    a small layer, extrapolated to a larger microbatch, would give it no time at all."""
    if len(set(us)) < 2:
        return 0.0, (ys[0] / us[0] if us and us[0] else 0.0)
    from sklearn.linear_model import LinearRegression  # here: a second to import, and workers never fit

    model = LinearRegression().fit(np.asarray(us, dtype=float).reshape(-1, 1), np.asarray(ys, dtype=float))
    if model.coef_[0] < 0:
        return float(np.mean(ys)), 0.0
    return float(model.intercept_), float(model.coef_[0])


def _interpolate(us: list[int], ys: list[float], u: float) -> float:
    """``np.interp(u, us, ys)`` for one ``u`` inside the samples, as numpy computes it (the same
    bits), without its per-call cost: a search evaluates thousands of fits once each."""
    j = bisect.bisect_right(us, u) - 1
    if j >= len(us) - 1:
        return float(ys[-1])
    slope = (ys[j + 1] - ys[j]) / (us[j + 1] - us[j])
    return float(slope * (u - us[j]) + ys[j])


def _grid_column(us: list[int], values: np.ndarray, u: int) -> list[float] | None:
    """Every layer's value at ``u`` from a sampled grid (``Profile._grid``): the sample, or
    ``_interpolate``'s line between its neighbours; None outside the samples (``Fit`` extrapolates)."""
    if not us[0] <= u <= us[-1]:
        return None
    j = bisect.bisect_right(us, u) - 1
    if us[j] == u:
        return values[:, j].tolist()
    slope = (values[:, j + 1] - values[:, j]) / (us[j + 1] - us[j])
    return (slope * (u - us[j]) + values[:, j]).tolist()


def fit_samples(us: list[int], ys: list[float]) -> Fit:
    """Fit one quantity's samples (any order); see ``Fit``."""
    order = sorted(range(len(us)), key=lambda i: us[i])
    us = [int(us[i]) for i in order]
    ys = [float(ys[i]) for i in order]
    return Fit(us, ys)


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
    upd_bytes: int = 0  # the optimizer's temporaries in a step of this layer on the device
    upd_scalar_bytes: int = 0  # its scalar state on the device (step counters), held through a step
    norm_time_host: float = 0.0  # s, the norm and the clip of its gradients on the host (clipping's NORM task)
    # tensors the runtime moves one by one for this layer's state (0: not counted, as in profiles
    # made before they were): parameters (W), trainable ones (dW), optimizer state of more than one
    # element (K; a step counter stays on the host) and buffers (B)
    w_tensors: int = 0
    dw_tensors: int = 0
    k_tensors: int = 0
    b_tensors: int = 0

    def fit(self, quantity: str) -> Fit:
        """The fit of one quantity, made on first use (the search asks for a few of them only)."""
        fits = self.__dict__.setdefault("_fits", {})
        if quantity not in fits:
            samples = self.bwd_samples if quantity in BWD_FIELDS else self.fwd_samples
            fits[quantity] = fit_samples([s.u for s in samples], [getattr(s, quantity) for s in samples])
        return fits[quantity]

    @property
    def fits(self) -> dict[str, Fit]:
        return {name: self.fit(name) for name in SAMPLE_FIELDS}

    def at(self, quantity: str, u: int) -> float:
        """The quantity at microbatch size u: the sample itself when measured, else the fit.

        Memoized: the scheduler asks for the same few (quantity, u) pairs many thousands of times.
        """
        memo = self.__dict__.setdefault("_at", {})
        key = (quantity, u)
        if key not in memo:
            by_u = self.__dict__.get("_by_u")
            if by_u is None:  # the first sample of each size, per pass
                by_u = self.__dict__["_by_u"] = tuple({s.u: s for s in reversed(samples)}
                                                     for samples in (self.fwd_samples, self.bwd_samples))
            exact = by_u[quantity in BWD_FIELDS].get(u)
            memo[key] = float(getattr(exact, quantity)) if exact is not None else self.fit(quantity)(u)
        return memo[key]


@dataclass
class TiedWeight:
    """A parameter held by several layers (e.g. GPT-2's embedding and output projection): its
    bytes, and the layers holding it. A pack moves it once; the pack holding its lowest layer
    owns its update, the others hand their gradient over."""

    layers: list[int]
    w_bytes: int
    dw_bytes: int
    k_bytes: int


@dataclass
class LowCopy:
    """A weight the devices may receive in low precision (``profiling/casts.py``): its canonical
    name, the layer holding it, the dtype it travels in and the device bytes that saves against its
    float32 master. A ``trainable`` one travels so only where its update runs on the host
    (``Profile.for_update``), which then casts it anew after each step in ``cast_time`` seconds; a
    frozen one always does, cast once when the weights are loaded."""

    name: str
    layer: int
    dtype: str
    saved: int
    trainable: bool = False
    cast_time: float = 0.0
    # the bytes of the cast that autograd keeps for the backward where the weight travels in full
    # precision (a matrix or kernel: an operand of the op's input gradient), which the layer's
    # ``act_bytes`` counted and a copy cast on the host never makes
    kept_cast: int = 0


@dataclass
class LossSample:
    """The model's last layer run alone as a loss task at microbatch size ``u`` (forward, loss,
    backward): its peak device bytes beyond the layer's weights, buffers, gradient buffers and
    input. That covers what the layer profiles cannot see: the loss's forward and target, its
    backward, the output gradient it makes, and the output itself, which a loss task lets go once
    the loss is computed unless the layer saved it for its backward. ``first_nbytes``: the same
    for a group's first microbatch, which makes the gradient buffers. ``seconds``: the loss's own
    compute, its forward from the layer's outputs and its backward to them (the target copied in
    included), which a loss task runs between the layer's forward and backward and the layers'
    profiles time neither (0: not measured)."""

    u: int
    nbytes: int
    first_nbytes: int = 0
    seconds: float = 0.0


@dataclass
class PackSample:
    """A pack measured whole at microbatch size ``u``: the peak device bytes of its FWD task and
    of its BWD task (the loss task's, loss included, when the pack ends with the model's last
    layer). Measured for the packs a chosen plan runs, so that its estimate does not rest on
    composing layer profiles (an upper bound, loose where layers share tensors: relays, residual
    gradients)."""

    first: int
    last: int
    u: int  # 0: the pack's optimizer step on the device, in ``upd_bytes``
    fwd_peak: int
    bwd_peak: int
    bwd_first_peak: int = 0  # a group's first microbatch (0: as ``bwd_peak``)
    upd_bytes: int = 0  # (u = 0) what the step holds beyond weights, gradients and state K
    fwd_layer_peaks: list[int] = field(default_factory=list)  # the FWD task's peak during each layer


def _lower_peaks(sample: "LayerSample | PackSample", saved: int) -> None:
    """A sample's peaks with ``saved`` bytes of resident weights less (``Profile.carry``)."""
    for name in ("fwd_peak", "bwd_peak", "bwd_first_peak"):
        value = getattr(sample, name)
        if value:
            setattr(sample, name, max(0, value - saved))
    if isinstance(sample, PackSample):
        sample.fwd_layer_peaks = [max(0, peak - saved) for peak in sample.fwd_layer_peaks]


def _measured_fwd_memory(sample: PackSample, beside: list[float]) -> int:
    """A measured FWD task's peak with ``beside[k]`` (the stash still leaving while layer k runs,
    ``Profile.pack_fwd_memory``) added to layer k's. A pack measured before its peak per layer was
    recorded adds the largest stash to its peak."""
    peaks = sample.fwd_layer_peaks
    if len(peaks) != len(beside):
        return int(round(sample.fwd_peak + max(beside)))
    slack = sample.fwd_peak - max(peaks)  # a timed run that peaked above the per-layer run
    return int(round(slack + max(peak + extra for peak, extra in zip(peaks, beside))))


@dataclass
class Profile:
    """Per-layer profiles of one model on one kind of device, with the sweep's maxima."""

    source: str  # "measured" or "analytic"
    device: str  # e.g. "cpu (emulated, 512 MiB)", "NVIDIA H100", "analytic:v100"
    capacity: int
    u_fmax: int
    u_bmax: int
    layers: list[LayerProfile]
    # the fewest samples every layer trains on (BatchNorm needs two values per channel): no
    # microbatch of a plan is smaller (``search.microbatch_ladders``)
    u_min: int = 1
    graph_hash: str = ""  # ties the profile to the layer graph it was made from
    notes: dict[str, str] = field(default_factory=dict)
    machine: Machine | None = None  # devices and link bandwidths, probed or from a spec
    ties: list[TiedWeight] = field(default_factory=list)
    loss_samples: list[LossSample] = field(default_factory=list)
    packs: list[PackSample] = field(default_factory=list)
    # how a pack's optimizer temporaries grow with its layers: 0 when the optimizer steps one
    # parameter at a time (the largest layer's), 1 when it steps the whole group at once (their sum)
    update_growth: float = 1.0
    # weights carried in low precision (``carry``): ``w_bytes`` and the peaks count their copies
    low_copies: list[LowCopy] = field(default_factory=list)
    # trainable weights that could be carried so too, where the host steps them (``for_update``)
    host_copies: list[LowCopy] = field(default_factory=list)
    # seconds of a backward call's own work beyond its layers' (autograd's set-up of the pass), which
    # each layer's ``bwd_time``, measured alone, carries once and a pack's backward carries once in
    # all (``pack_time``); 0 where it was not measured (analytic profiles, older files)
    backward_call_time: float = 0.0

    def for_update(self, update: str, device_layers: frozenset[int] = frozenset()) -> "Profile":
        """The profile of a plan whose updates run on ``update`` ("host" or "device"), but for the
        layers in ``device_layers``, which a host-updated plan steps on their device. A trainable
        weight travels in low precision only where the host steps it: a device step needs the
        float32 master on the device. A host variant is a copy with those ``host_copies`` carried
        as well, made once per set of layers and kept; this profile stays the one saved and
        searched from."""
        copies = [c for c in self.host_copies if c.layer not in device_layers] if update == "host" else []
        if not copies:
            return self
        variants = self.__dict__.setdefault("_hosted", {})
        key = frozenset(c.layer for c in copies)
        if key not in variants:
            hosted = Profile.from_dict(self.to_dict())
            hosted.host_copies = []
            hosted._carry_more(copies)
            variants[key] = hosted
        return variants[key]

    def for_graph(self, graph) -> "Profile":
        """The profile a task graph was generated with (``for_update``): the host variant for the
        trainable weights it carries in low precision (``TaskGraph.low_copies``)."""
        carried = set(getattr(graph, "low_copies", {}))
        hosted = {c.layer for c in self.host_copies if c.name in carried}
        return self.for_update("host", frozenset(c.layer for c in self.host_copies if c.layer not in hosted))

    def carry(self, copies: list[LowCopy]) -> None:
        """Count ``copies`` as the devices will hold them: each layer's weights, and the peaks that
        include them, smaller by their saving. The peaks were measured (or counted) with float32
        weights that autocast cast op by op; with the copies cast on the host those casts never
        happen, so the peaks only fall further: what the plan counts bounds what runs. What the
        forward keeps for the backward (``act_bytes``) loses the casts autograd kept
        (``LowCopy.kept_cast``): the saved operand is the copy itself, part of the pack's state."""
        if self.low_copies or self.host_copies:
            raise ValueError("the profile already counts its weights' low-precision copies")
        self.host_copies = [c for c in copies if c.trainable]
        self._carry_more([c for c in copies if not c.trainable])

    def _carry_more(self, copies: list[LowCopy]) -> None:
        """Count ``copies`` in low precision beside those counted already (``carry``)."""
        self.low_copies = self.low_copies + list(copies)
        for layer in self.layers:
            # the host update that steps a trainable copy's master casts the copy anew
            layer.upd_time_host += sum(c.cast_time for c in copies if c.layer == layer.index and c.trainable)
            saved = sum(c.saved for c in copies if c.layer == layer.index)
            if not saved:
                continue
            layer.w_bytes -= saved
            for sample in layer.fwd_samples + layer.bwd_samples:
                _lower_peaks(sample, saved)
            cast = sum(c.kept_cast for c in copies if c.layer == layer.index)
            for sample in layer.bwd_samples:
                sample.act_bytes = max(0, sample.act_bytes - cast)
            for memo in ("_fits", "_at", "_by_u"):
                layer.__dict__.pop(memo, None)
        for sample in self.packs:
            if sample.u:
                _lower_peaks(sample, sum(c.saved for c in copies if sample.first <= c.layer <= sample.last))
        for memo in ("_prefix", "_columns", "_grids", "_packs"):
            self.__dict__.pop(memo, None)
        self.__dict__["_memory_version"] = self.__dict__.get("_memory_version", 0) + 1

    def _saved(self, first: int, last: int) -> int:
        """Device bytes the low-precision copies of layers first..last save."""
        return sum(c.saved for c in self.low_copies if first <= c.layer <= last)

    def fit_errors(self) -> dict[str, float]:
        """The worst relative fit error per quantity over all layers (reported, not hidden)."""
        worst: dict[str, float] = {}
        for layer in self.layers:
            for name, fit in layer.fits.items():
                worst[name] = max(worst.get(name, 0.0), fit.max_rel_error)
        return worst

    # ------------------------------------------------------------ packs
    def column(self, quantity: str, u: int) -> list[float]:
        """``quantity`` at size ``u`` of every layer, in order (``LayerProfile.at``), kept: the
        pack models read a pack's layers' values many thousands of times in a search."""
        columns = self.__dict__.setdefault("_columns", {})
        key = (quantity, u)
        hit = columns.get(key)
        if hit is None:
            grid = self._grid(quantity)
            hit = _grid_column(*grid, u) if grid is not None else None
            if hit is None:
                hit = [layer.at(quantity, u) for layer in self.layers]
            columns[key] = hit
        return hit

    def _grid(self, quantity: str) -> tuple[list[int], np.ndarray] | None:
        """(sizes, values per layer and size) of ``quantity`` where every layer was sampled at the
        same distinct sizes (a sweep or an analytic profile), else None: a column is then read off
        or interpolated for all layers at once, with the arithmetic of ``Fit``."""
        grids = self.__dict__.setdefault("_grids", {})
        if quantity not in grids:
            grids[quantity] = None
            attr = "bwd_samples" if quantity in BWD_FIELDS else "fwd_samples"
            rows = [sorted(getattr(layer, attr), key=lambda s: s.u) for layer in self.layers]
            us = [s.u for s in rows[0]] if rows else []
            if us and len(set(us)) == len(us) and all([s.u for s in row] == us for row in rows):
                values = np.array([[float(getattr(s, quantity)) for s in row] for row in rows], dtype=np.float64)
                grids[quantity] = (us, values)
        return grids[quantity]

    def pack_time(self, first: int, last: int, u: int, quantity: str) -> float:
        """Seconds of a pack (layers first..last) for fwd_time, bwd_time or recompute_time: its
        layers' sum, less, for the backward, the call cost (``backward_call_time``) that every
        layer but one carries: a BWD task makes one backward call over its pack.

        From prefix sums per (quantity, u): the search asks for hundreds of thousands of packs.
        """
        prefixes = self.__dict__.setdefault("_prefix", {})
        key = (quantity, u)
        prefix = prefixes.get(key)
        if prefix is None:
            prefix = prefixes[key] = [0.0]
            for value in self.column(quantity, u):
                prefix.append(prefix[-1] + value)
        total = prefix[last + 1] - prefix[first]
        if quantity == "bwd_time" and last > first:
            total = max(total - (last - first) * self.backward_call_time, 0.0)
        return total

    def measured_pack(self, first: int, last: int, u: int) -> PackSample | None:
        """The pack measured whole at size u, if it was (``packs``)."""
        index = self.__dict__.get("_packs")
        if index is None or index[0] != len(self.packs):
            index = (len(self.packs), {(p.first, p.last, p.u): p for p in self.packs})
            self.__dict__["_packs"] = index
        return index[1].get((first, last, u))

    def add_packs(self, samples: list[PackSample]) -> None:
        """Record packs measured whole; later estimates use them instead of composing layers (and
        those of the host variant, ``for_update``)."""
        for hosted in self.__dict__.get("_hosted", {}).values():
            hosted.add_packs([PackSample(**asdict(s)) for s in samples])
        known = {(p.first, p.last, p.u): i for i, p in enumerate(self.packs)}
        for sample in samples:
            if sample.u:  # measured with float32 weights; held with their low-precision copies (``carry``)
                _lower_peaks(sample, self._saved(sample.first, sample.last))
            key = (sample.first, sample.last, sample.u)
            if key in known:
                self.packs[known[key]] = sample
            else:
                known[key] = len(self.packs)
                self.packs.append(sample)
        self.__dict__.pop("_packs", None)
        self.__dict__["_memory_version"] = self.__dict__.get("_memory_version", 0) + 1

    def pack_fwd_memory(self, first: int, last: int, u: int, stashes: tuple[int, ...] = (), keep: bool = False) -> int:
        """Peak device bytes of a FWD task over layers first..last.

        The pack's weights and buffers are resident; layer l's input, output and temporaries come
        and go in turn, while the pack's own input stays (it is stashed for the recompute). The
        input of a layer in ``stashes`` (stashed for a backward starting there) is queued for the
        host when that layer starts and counted while the next layer runs: a copy out takes far
        less than a layer's compute, and where one is late the runtime waits for it before going
        past the plan's peak (``Admission.let_outputs_leave``), as for every output leaving the
        device. Counted until the pack's end, the stashes would make a long forward's plan well
        above what it holds.

        ``keep``: the forward records for autograd and keeps what each layer leaves alive for its
        backward (``act_bytes``), up to the layer at hand's own, above that layer's working memory:
        at the end the pack's kept activations (``pack_kept_bytes``) are all there.
        """
        layers = self.layers[first:last + 1]
        x = self.column("x_bytes", u)
        # per layer, the stash of the layer before it (the pack's own input is no stash: it stays)
        beside = [0.0] + [x[first + k] if first + k in stashes and k else 0.0 for k in range(len(layers) - 1)]
        measured = self.measured_pack(first, last, u)
        if measured is not None and not keep:
            return _measured_fwd_memory(measured, beside)
        kept = list(itertools.accumulate(self.column("act_bytes", u)[first:last + 1])) if keep else [0.0] * len(layers)
        resident = sum(layer.w_bytes + layer.b_bytes for layer in layers)
        peaks = self.column("fwd_peak", u)
        x_first = x[first]
        worst = 0.0
        for k, layer in enumerate(layers):
            working = peaks[first + k] - layer.w_bytes - layer.b_bytes
            worst = max(worst, working + (x_first if k else 0.0) + beside[k] + kept[k])
        if measured is not None:  # the pack measured whole, with every layer's activations kept beside
            return max(_measured_fwd_memory(measured, beside) + int(round(kept[-1])), int(round(resident + worst)))
        return int(round(resident + worst))

    def pack_bwd_memory(self, first: int, last: int, u: int, accumulate: bool = True) -> int:
        """Peak device bytes of a BWD task (recompute, then backward) over layers first..last; for
        the pack of the model's last layer, of the loss task (forward, loss, backward).

        Weights, buffers and gradient buffers of the pack are resident, and so is the pack's input.
        The recompute leaves every layer's activations alive; the backward then walks from the last
        layer down, freeing them as it goes, so during layer l's backward the activations of
        layers ≤ l are alive plus l's own backward working memory (measured on the layer alone,
        with its incoming gradient), and, in a BWD task, the pack's output with its gradient, which
        the task holds until the backward ends. In a loss task the last layer's moment is its loss
        task measured alone (``loss_memory``: its activations, the loss, the backward), above the
        activations of the layers before it.
        ``accumulate=False``: the group's first microbatch, which makes the gradient buffers rather
        than adding a fresh gradient to them.
        """
        measured = self.measured_pack(first, last, u)
        if measured is not None:
            return measured.bwd_peak if accumulate or not measured.bwd_first_peak else measured.bwd_first_peak
        layers = self.layers[first:last + 1]
        resident = sum(layer.w_bytes + layer.b_bytes + layer.dw_bytes for layer in layers)
        x = self.column("x_bytes", u)
        acts = self.column("act_bytes", u)
        peaks = self.column("bwd_peak", u)
        firsts = self.column("bwd_first_peak", u) if not accumulate else peaks
        loss = last == len(self.layers) - 1
        # a BWD task's output and its incoming gradient stay alive until the whole backward is done
        held = 0.0 if loss else 2 * self.column("y_bytes", u)[last]
        worst = 0.0
        alive = 0.0  # activations of the pack's layers up to the one at hand
        for k, layer in enumerate(layers):
            if loss and k == len(layers) - 1:  # the last layer's loss task, measured as a whole
                worst = max(worst, alive + self.loss_memory(u, accumulate))
                continue
            l = first + k
            alive += acts[l]
            own_resident = layer.w_bytes + layer.b_bytes + layer.dw_bytes + x[l] + acts[l]
            peak = firsts[l] or peaks[l]
            extra = max(0.0, peak - own_resident)
            worst = max(worst, alive + extra + (held if k < len(layers) - 1 else 0.0))
        return int(round(resident + x[first] + worst))

    def pack_kept_bytes(self, first: int, last: int, u: int) -> int:
        """What a microbatch of ``u`` leaves on the device between a pack's forward recording for
        autograd and its backward, when the backward does not recompute: the pack's input and what
        each layer's forward leaves alive for its backward (``act_bytes``: saved activations and
        the layer's output)."""
        x = self.column("x_bytes", u)
        acts = self.column("act_bytes", u)
        return int(round(x[first] + sum(acts[first:last + 1])))

    def pack_swapped_bytes(self, first: int, last: int, u: int) -> int:
        """Of a microbatch's kept activations (``pack_kept_bytes``), what a pack that swaps them
        sends to host memory and back: all but its input and output, which the backward's autograd
        graph holds on the device (the input's leaves collect the gradient, the outputs are where
        the backward starts)."""
        y = self.column("y_bytes", u)[last]
        x = self.column("x_bytes", u)[first]
        return max(0, self.pack_kept_bytes(first, last, u) - int(round(x + y)))

    def pack_bwd_memory_layerwise(self, first: int, last: int, u: int, accumulate: bool = True) -> int:
        """Peak device bytes of a BWD task that stashed every layer's input (the no-recompute
        baselines): it recomputes and back-propagates one layer at a time, from the last down,
        holding the pack's weights and gradient buffers, its own input and the stashes of the layers
        still to come, and the layer at hand's backward as measured alone (its input, activations,
        incoming gradient and temporaries)."""
        layers = self.layers[first:last + 1]
        resident = sum(layer.w_bytes + layer.b_bytes + layer.dw_bytes for layer in layers)
        xs = [layer.at("x_bytes", u) for layer in layers]
        worst = 0.0
        for k, layer in enumerate(layers):
            peak = layer.at("bwd_peak", u) if accumulate else layer.at("bwd_first_peak", u) or layer.at("bwd_peak", u)
            own = peak - layer.w_bytes - layer.b_bytes - layer.dw_bytes
            worst = max(worst, sum(xs[:k]) + own)
        return int(round(resident + worst))

    def loss_memory(self, u: int, accumulate: bool = True) -> float:
        """The model's last layer in its loss task beyond its weights, buffers, gradient buffers and
        input (``LossSample``): measured (``loss_samples``), or, where nobody measured it, the
        layer's backward (its activations, output and their gradients) and a cross-entropy's loss
        above it: a log-softmax as large as the output and the gradient of the loss on it."""
        if self.loss_samples:
            field_ = "nbytes" if accumulate or not all(s.first_nbytes for s in self.loss_samples) else "first_nbytes"
            return self._loss_at(field_, self.loss_samples, u)
        layer = self.layers[-1]
        own = layer.w_bytes + layer.b_bytes + layer.dw_bytes + layer.at("x_bytes", u)
        return max(0.0, layer.at("bwd_peak", u) - own) + 2 * layer.at("y_bytes", u)

    def loss_time(self, u: int) -> float:
        """Seconds of the loss's own forward and backward on a microbatch of ``u`` samples
        (``LossSample.seconds``), fitted over the sizes measured; 0 where nobody measured it (an
        analytic profile, no loss function, a profile made before it was measured)."""
        timed = [s for s in self.loss_samples if s.seconds > 0]
        return max(0.0, self._loss_at("seconds", timed, u)) if timed else 0.0

    def _loss_at(self, field_: str, samples: list[LossSample], u: int) -> float:
        """``field_`` of the loss ``samples`` at size ``u``: the sample of that size, else their fit
        (made once per field and sample count)."""
        exact = [getattr(s, field_) for s in samples if s.u == u]
        if exact:
            return float(exact[0])
        fits = self.__dict__.setdefault("_loss_fits", {})
        key = (field_, len(samples))
        if key not in fits:
            fits[key] = fit_samples([s.u for s in samples], [getattr(s, field_) for s in samples])
        return float(fits[key](u))

    def state_tensors(self, tensor: str, first: int, last: int) -> int:
        """Tensors the runtime moves one by one for ``tensor`` (W, dW, K or B) of layers first..last:
        each pays the runtime's per-tensor cost (``Machine.tensor_overhead``). 0 where the profile
        did not count them (a profile made before it did, an analytic one)."""
        field_ = _TENSOR_FIELDS.get(tensor)
        if field_ is None:
            return 0
        sums = self.__dict__.setdefault("_tensor_sums", {})
        prefix = sums.get(field_)
        if prefix is None:
            prefix = [0]
            for layer in self.layers:
                prefix.append(prefix[-1] + getattr(layer, field_))
            sums[field_] = prefix
        return prefix[last + 1] - prefix[first]

    def pack_update_memory(self, first: int, last: int) -> int:
        """What one step of a pack's parameters holds on the device beyond the weights, gradients
        and state K: the optimizer's temporaries (the largest layer's, and the others' by
        ``update_growth``) and every layer's scalar state (step counters), which do not share; or,
        for a pack a plan steps on the device, its step measured whole (``PackSample`` u = 0)."""
        measured = self.measured_pack(first, last, 0)
        if measured is not None:
            return measured.upd_bytes
        layers = self.layers[first:last + 1]
        scratch = [layer.upd_bytes for layer in layers]
        if not scratch:
            return 0
        top = max(scratch)
        scalars = sum(layer.upd_scalar_bytes for layer in layers)
        return int(round(top + self.update_growth * (sum(scratch) - top))) + scalars

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, body: dict) -> "Profile":
        """The profile of ``to_dict``'s plain data; a body of the wrong shape is a FormatError naming
        the field (files come from outside)."""
        check = serialization.check_fields
        try:
            check(Profile, body, "profile")
            layers = []
            for i, layer in enumerate(body["layers"]):
                check(LayerProfile, layer, f"layer {i}")
                samples = {key: [LayerSample(**check(LayerSample, s, f"layer {i} {key}")) for s in layer[key]]
                           for key in ("fwd_samples", "bwd_samples")}
                layers.append(LayerProfile(**{**layer, **samples}))
            machine = Machine.from_dict(body["machine"]) if body.get("machine") else None
            ties = [TiedWeight(**check(TiedWeight, t, f"tie {i}")) for i, t in enumerate(body.get("ties", []))]
            losses = [LossSample(**check(LossSample, x, f"loss sample {i}")) for i, x in enumerate(body.get("loss_samples", []))]
            packs = [PackSample(**check(PackSample, x, f"pack {i}")) for i, x in enumerate(body.get("packs", []))]
            copies = {key: [LowCopy(**check(LowCopy, x, f"low copy {i}")) for i, x in enumerate(body.get(key, []))]
                      for key in ("low_copies", "host_copies")}
            nested = ("layers", "machine", "ties", "loss_samples", "packs", "low_copies", "host_copies")
            profile = cls(**{k: v for k, v in body.items() if k not in nested}, layers=layers,
                          machine=machine, ties=ties, loss_samples=losses, packs=packs, **copies)
        except serialization.MALFORMED as exc:
            raise FormatError(f"profile is malformed ({type(exc).__name__}: {exc})") from exc
        if any(layer.index != i or not layer.fwd_samples or not layer.bwd_samples for i, layer in enumerate(layers)):
            raise FormatError("profile is malformed (layers out of order, or a layer without samples)")
        if profile.backward_call_time < 0:  # it is taken off every pack's backward: a negative one would add to it
            raise FormatError(f"profile: field 'backward_call_time' is negative ({profile.backward_call_time}); "
                              "re-create the profile")
        return profile

    def save(self, path: str | Path) -> None:
        serialization.save(path, KIND, SCHEMA_VERSION, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        body = serialization.load(path, KIND, SCHEMA_VERSION)
        with serialization.decoding(str(path), "profile"):
            return cls.from_dict(body)
