"""Layer packing: cutting the R layers into contiguous packs, one task per pack (paper §4.3.1).

A pack is ``(first, last)``, inclusive; a packing is a list of packs covering layers 0..R-1 in
order. Every pack must fit the device: a FWD task over the pack within ``capacity`` bytes
(``Profile.pack_fwd_memory``), a BWD task (recompute, then backward) likewise
(``Profile.pack_bwd_memory``).

Why balance time rather than take the largest packs (Fig. 8): in a pipeline every pack is a stage,
and the slowest pack sets the pace, so greedily filling memory leaves the other devices idle.
``balanced_time_packing`` is Algorithm 2 done exactly: for a given number of packs P it finds the
packing whose slowest pack is as fast as possible while every pack fits. With ``num_packs=None`` it
takes the fewest packs that fit (the paper's loop from S_min upward stops at the first S that
fits, i.e. the largest average pack), and ``pack_counts`` lists every P for a search to sweep.
``greedy_packing`` is the "largest pack that fits" baseline the paper compares against.

The last pack is shared by the forward and the backward (jit-compute, Algorithm 2 line 2): the
last FWD task runs forward, loss and backward together without a recompute, so the forward packing
is made for the layers before the backward's last pack, which is then appended unchanged
(``last_pack``).

How it is fast enough for the search (R up to ~420, called U_FMAX·U_BMAX times): per-layer values
are read from the profile once per (u, pass) and the memory of *every* pack is computed at once
with numpy (O(R²), cached per (u, pass, capacity)), leaving per start layer i its ``reach``: the
last layer j such that packs [i..i], ..., [i..j] all fit. The min-max problem on top is then a
"jump game": with a time bound T, from layer i one pack can end anywhere up to
min(reach[i], last layer with time ≤ T), so the layers coverable with k packs are always a prefix
and the fewest packs for T come out of a prefix maximum in O(R log R). The optimal T is one of the
pack times, found by selection over the sorted pack-time rows (weighted-median pivots), i.e.
O(log R) checks, until a few per row are left, which are then listed and bisected (most calls start
there: between the lower bound and it plus the slowest layer a row holds one or two). Any packing into k < P packs can be refined into P packs under the same bound
(split the last layer off a pack: both halves fit, neither is slower), so "at most P" and
"exactly P" coincide, and the packing is rebuilt from the back in O(R·P) choosing each pack's end
nearest the remaining average time, which keeps the packs even beyond the slowest one.

One caveat, stated rather than hidden: a forward pack's memory only grows as the pack grows, but a
backward pack holds its output and output gradient during the whole backward, so a pack ending at a
wide layer can need more than the same pack extended past a narrowing one. A pack is therefore
only *allowed* when it and every shorter pack with the same first layer fit; this is exact for the
forward and conservative (every returned pack fits, but such a "fits only once extended" pack is
never chosen) for the backward.

The cache is keyed by the profile object (weakly); a profile edited in place after packing needs
``clear_cache()``.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from harmony.profiling.profiles import Profile

Pack = tuple[int, int]
Pass = Literal["fwd", "bwd"]

_PASSES = ("fwd", "bwd")
_CACHE_ENTRIES = 2048
# Pack times are compared as prefix-sum differences; this relative slack makes a bound equal to a
# pack's own time always admit that pack despite rounding.
_REL_EPS = 1e-12


# ---------------------------------------------------------------- single packs
def fits_fwd(profile: Profile, pack: Pack, u: int, capacity: int) -> bool:
    """Whether a FWD task over ``pack`` at microbatch ``u`` fits ``capacity`` bytes."""
    return profile.pack_fwd_memory(pack[0], pack[1], u) <= capacity


def fits_bwd(profile: Profile, pack: Pack, u: int, capacity: int) -> bool:
    """Whether a BWD task (recompute + backward) over ``pack`` at ``u`` fits ``capacity`` bytes."""
    return profile.pack_bwd_memory(pack[0], pack[1], u) <= capacity


def fits(profile: Profile, pack: Pack, u: int, capacity: int, pass_: Pass) -> bool:
    """``fits_fwd`` or ``fits_bwd`` by pass."""
    return (fits_fwd if _check_pass(pass_) == "fwd" else fits_bwd)(profile, pack, u, capacity)


def all_contiguous_packings(R: int) -> Iterator[list[Pack]]:
    """Every partition of layers 0..R-1 into contiguous packs (2^(R-1) of them), for brute force.

    Bit b of the counter set means "a pack ends after layer b".
    """
    if R <= 0:
        return
    for mask in range(1 << (R - 1)):
        packs: list[Pack] = []
        first = 0
        for b in range(R - 1):
            if mask >> b & 1:
                packs.append((first, b))
                first = b + 1
        packs.append((first, R - 1))
        yield packs


def is_packing(packing: list[Pack], R: int) -> bool:
    """Whether ``packing`` is contiguous, in order, non-empty packs covering exactly 0..R-1."""
    expected = 0
    for first, last in packing:
        if first != expected or last < first:
            return False
        expected = last + 1
    return expected == R and R > 0


# ---------------------------------------------------------------- per-layer tables (cached)
class _Cache:
    """A small LRU keyed by the profile's identity, holding the profile weakly so a recycled id
    (after the profile is collected) never answers for a different profile."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.data: OrderedDict[tuple, tuple[weakref.ref, object]] = OrderedDict()

    def get(self, profile: Profile, key: tuple) -> object | None:
        full = (id(profile),) + key
        hit = self.data.get(full)
        if hit is None or hit[0]() is not profile:
            return None
        self.data.move_to_end(full)
        return hit[1]

    def put(self, profile: Profile, key: tuple, value: object) -> None:
        full = (id(profile),) + key
        self.data[full] = (weakref.ref(profile), value)
        self.data.move_to_end(full)
        while len(self.data) > self.entries:
            self.data.popitem(last=False)


_arrays_cache = _Cache(_CACHE_ENTRIES)
_tables_cache = _Cache(_CACHE_ENTRIES)


def clear_cache() -> None:
    """Forget cached per-layer values (needed only if a profile is edited in place)."""
    _arrays_cache.data.clear()
    _tables_cache.data.clear()


def _memory_version(profile: Profile) -> int:
    """Bumped by ``Profile.add_packs``: measured packs change the memory of the packs they name."""
    return profile.__dict__.get("_memory_version", 0)


def _check_pass(pass_: str) -> Pass:
    if pass_ not in _PASSES:
        raise ValueError(f"pass_ must be 'fwd' or 'bwd', not {pass_!r}")
    return pass_  # type: ignore[return-value]


def _layer_arrays(profile: Profile, u: int, pass_: Pass) -> dict[str, np.ndarray]:
    """The per-layer values one pass needs at ``u``, read from the profile once."""
    key = ("arrays", u, pass_, len(profile.layers), _memory_version(profile))
    hit = _arrays_cache.get(profile, key)
    if hit is not None:
        return hit  # type: ignore[return-value]
    layers = profile.layers

    def col(quantity: str) -> np.ndarray:
        return np.array(profile.column(quantity, u), dtype=np.float64)

    def fixed(*names: str) -> np.ndarray:
        return np.array([sum(getattr(layer, n) for n in names) for layer in layers], dtype=np.float64)

    if pass_ == "fwd":
        arrays = {"time": col("fwd_time"), "resident": fixed("w_bytes", "b_bytes"),
                  "peak": col("fwd_peak"), "x": col("x_bytes")}
    else:
        arrays = {"time": col("recompute_time") + col("bwd_time"),
                  "resident": fixed("w_bytes", "b_bytes", "dw_bytes"), "peak": col("bwd_peak"),
                  "x": col("x_bytes"), "y": col("y_bytes"), "act": col("act_bytes")}
    _arrays_cache.put(profile, key, arrays)
    return arrays


def layer_times(profile: Profile, u: int, pass_: Pass) -> np.ndarray:
    """Seconds per layer: ``fwd_time`` for the forward, ``recompute_time + bwd_time`` for the
    backward (a BWD task recomputes its pack's activations from the stashed input first)."""
    return _layer_arrays(profile, u, _check_pass(pass_))["time"].copy()


def pack_memory_matrix(profile: Profile, u: int, pass_: Pass) -> np.ndarray:
    """``M[i, j]`` = peak device bytes of a task over layers i..j (j ≥ i; +inf below the diagonal).

    The same model as ``Profile.pack_fwd_memory`` / ``pack_bwd_memory`` (tested equal), computed
    for all O(R²) packs at once from prefix sums and running maxima instead of O(R³) by calls.
    """
    a = _layer_arrays(profile, u, _check_pass(pass_))
    R = len(a["time"])
    rows, cols = np.indices((R, R))
    upper = cols >= rows
    resident = np.concatenate(([0.0], np.cumsum(a["resident"])))
    span = resident[None, 1:] - resident[:R, None]  # resident bytes of pack i..j
    x_first = a["x"][:, None]
    with np.errstate(invalid="ignore"):
        if pass_ == "fwd":
            # layer k's working memory; for k > first the pack's input stays alive as well
            work = a["peak"] - a["resident"]
            later = np.where(cols > rows, work[None, :], -np.inf)
            worst = np.maximum(work[:, None], x_first + np.maximum.accumulate(later, axis=1))
            memory = span + np.maximum(worst, 0.0)
        else:
            act = a["act"]
            acts = np.concatenate(([0.0], np.cumsum(act)))
            extra = np.maximum(0.0, a["peak"] - (a["resident"] + a["x"] + act))
            g = acts[1:] + extra  # during layer k's backward: activations of layers ≤ k + its extra
            run = np.maximum.accumulate(np.where(upper, g[None, :], -np.inf), axis=1)
            before_last = np.full((R, R), -np.inf)
            before_last[:, 1:] = run[:, :-1]  # max over k in [i, j-1]: the output is still held
            base = acts[:R, None]
            worst = np.maximum(before_last + 2.0 * a["y"][None, :], g[None, :]) - base
            # the last pack is a loss task: its last layer's moment is the layer's loss task measured
            # alone, above the activations of the layers before it; no output held before that
            worst[:, R - 1] = np.maximum(before_last[:, R - 1], acts[R - 1] + profile.loss_memory(u)) - acts[:R]
            memory = span + x_first + np.maximum(worst, 0.0)
        for pack in profile.packs:  # packs measured whole replace their composition
            if pack.u == u:
                memory[pack.first, pack.last] = pack.fwd_peak if pass_ == "fwd" else pack.bwd_peak
    return np.where(upper, memory, np.inf)


@dataclass(frozen=True)
class _Tables:
    prefix: np.ndarray  # R+1 cumulative layer times
    reach: np.ndarray  # per first layer i: last j with [i..i]..[i..j] all fitting; i-1 if none


def _tables(profile: Profile, u: int, capacity: int, pass_: Pass) -> _Tables:
    key = ("tables", u, pass_, capacity, len(profile.layers), _memory_version(profile))
    hit = _tables_cache.get(profile, key)
    if hit is not None:
        return hit  # type: ignore[return-value]
    times = _layer_arrays(profile, u, pass_)["time"]
    R = len(times)
    too_big = np.round(pack_memory_matrix(profile, u, pass_)) > capacity
    too_big[np.tril_indices(R, -1)] = False
    first_bad = np.argmax(too_big, axis=1)
    reach = np.where(too_big.any(axis=1), first_bad - 1, R - 1).astype(np.int64)
    tables = _Tables(np.concatenate(([0.0], np.cumsum(np.maximum(times, 0.0)))), reach)
    _tables_cache.put(profile, key, tables)
    return tables


def _prefix_range(profile: Profile, last_pack: Pack | None) -> int:
    """How many leading layers are packed: all of them, or those before the shared last pack."""
    R = len(profile.layers)
    if last_pack is None:
        return R
    first, last = last_pack
    if last != R - 1 or not 0 <= first <= last:
        raise ValueError(f"last_pack {last_pack} must end at the last layer {R - 1}")
    return first


# ---------------------------------------------------------------- the jump game
def _levels(step: np.ndarray, n: int, limit: int) -> list[int] | None:
    """``his[k]``: layers 0..his[k]-1 can be packed with ≤ k packs (always a prefix, see module
    doc). ``step[i]`` is one past the furthest layer a pack starting at i may end at. None when
    more than ``limit`` packs would be needed or some layer cannot be packed at all."""
    best = np.maximum.accumulate(step[:n]).tolist() if n else []
    his = [0]
    hi = 0
    while hi < n:
        if len(his) > limit:
            return None
        new = best[hi]
        if new <= hi:
            return None
        his.append(new)
        hi = new
    return his


def _ends_within(t: _Tables, n: int, bound: float) -> np.ndarray:
    """Per first layer i < n: last layer a pack may end at under time ``bound`` (i-1 if none)."""
    prefix = t.prefix[:n + 1]
    slack = _REL_EPS * max(float(prefix[-1]), 1e-300)
    by_time = np.searchsorted(prefix, prefix[:n] + bound + slack, side="right") - 2
    return np.minimum(np.minimum(t.reach[:n], n - 1), by_time)


def _feasible(t: _Tables, n: int, bound: float, packs: int) -> bool:
    return _levels(_ends_within(t, n, bound) + 1, n, packs) is not None


def _optimal_bound(t: _Tables, n: int, packs: int) -> float | None:
    """The smallest pack time T such that layers 0..n-1 split into ≤ ``packs`` allowed packs each
    taking ≤ T; None if none does. T is one of the O(n²) pack times. They are selected from rather
    than listed while many remain: row i holds the times of packs starting at i (sorted, as times
    are ≥ 0), each probe is the weighted median of the rows' medians within (lo, hi), so each check
    removes at least a quarter of the candidates. Once a few per row remain (from the start, for
    most calls: the band between the lower bound and it plus the slowest layer), they are listed
    and bisected (``_least_feasible``). Listing also ends the selection where rounding makes its
    median equal a bound: a pack time computed as a difference of prefix sums can round onto
    ``hi`` while the comparisons that count it put it below; stopping there would answer ``hi``, a
    layer's time above the optimum."""
    prefix = t.prefix[:n + 1]
    if not _feasible(t, n, np.inf, packs):
        return None
    starts = np.arange(n)
    last = np.minimum(t.reach[:n], n - 1)  # q = j+1 ranges over starts+1 .. last+1
    q_lo, q_hi = starts + 1, np.maximum(last + 2, starts + 1)
    single = prefix[1:] - prefix[:-1]
    lower = max(float(prefix[-1]) / packs, float(single.max()))
    lo = lower * (1.0 - 1e-9) - 1e-300  # every pack time ≤ lo is known infeasible
    hi = np.inf  # known feasible
    guess = lower + float(single.max())  # enough without memory limits; try it first
    if _feasible(t, n, guess, packs):
        hi = guess
    while True:
        a = np.clip(np.searchsorted(prefix, prefix[:n] + lo, side="right"), q_lo, q_hi)
        b = np.clip(np.searchsorted(prefix, prefix[:n] + hi, side="left"), q_lo, q_hi) if np.isfinite(hi) else q_hi
        count = b - a
        rows = np.nonzero(count > 0)[0]
        if not len(rows):
            break
        if np.isfinite(hi) and int(count.max()) <= _LISTED:
            return _least_feasible(t, n, packs, _listed(prefix, a, count), hi)
        mids = prefix[(a[rows] + b[rows] - 1) // 2] - prefix[rows]
        order = np.argsort(mids, kind="stable")
        weights = np.cumsum(count[rows][order])
        pivot = float(mids[order][np.searchsorted(weights, weights[-1] / 2.0)])
        if not lo < pivot < hi:  # rounding: the median sits on a bound; list what is left
            return _least_feasible(t, n, packs, _listed(prefix, a, count), hi)
        if _feasible(t, n, pivot, packs):
            hi = pivot
        else:
            lo = pivot
    if not np.isfinite(hi):  # cannot happen when feasible at inf: some pack time was probed
        hi = float(prefix[-1])
    return hi


_LISTED = 4  # candidates per row at most, for the selection to list them instead of selecting


def _listed(prefix: np.ndarray, a: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The distinct pack times of rows i with q in a[i] .. a[i] + count[i] - 1, sorted."""
    rows = np.repeat(np.arange(len(a)), count)
    offsets = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    return np.unique(prefix[np.repeat(a, count) + offsets] - prefix[rows])


def _least_feasible(t: _Tables, n: int, packs: int, times: np.ndarray, hi: float) -> float:
    """The smallest of ``times`` (sorted) under which the layers pack into ``packs``, else ``hi``
    (known to be feasible), by bisection: feasibility only grows with the bound."""
    left, right = 0, len(times)  # times[right:] feasible (and hi), times[:left] not
    while left < right:
        mid = (left + right) // 2
        if _feasible(t, n, float(times[mid]), packs):
            right = mid
        else:
            left = mid + 1
    return float(min(times[right], hi)) if right < len(times) else float(hi)


def _rebuild(t: _Tables, n: int, bound: float, packs: int) -> list[Pack] | None:
    """Exactly ``packs`` allowed packs under ``bound``, chosen from the back: each pack's first
    layer is the one leaving a pack time nearest the average of what remains, among the choices
    that keep the rest packable into the remaining count (d[s] ≤ k-1 ≤ s). None where no choice
    is left: ``s ≥ k-1`` assumes a prefix splits into more packs as easily as into fewer, which
    holds for packs composed from layers but not once packs are measured whole (``PackSample``):
    a measured pack may fit where one of its layers, composed alone, does not. The search of a
    generated transformer's compiled profile crashed on it."""
    ends = _ends_within(t, n, bound)
    his = _levels(ends + 1, n, packs)
    assert his is not None
    fewest = np.searchsorted(np.asarray(his), np.arange(n + 1), side="left")  # d[s] for prefix s
    prefix = t.prefix
    idx = np.arange(n)
    out: list[Pack] = []
    end, k = n, packs
    while k > 0:
        s = idx[:end]
        ok = (ends[:end] >= end - 1) & (fewest[:end] <= k - 1) & (s >= k - 1)
        candidates = s[ok]
        if not len(candidates):
            return None
        target = (prefix[end] - prefix[0]) / k
        pick = int(candidates[np.argmin(np.abs(prefix[end] - prefix[candidates] - target))])
        out.append((pick, end - 1))
        end, k = pick, k - 1
    out.reverse()
    return out


# ---------------------------------------------------------------- public packings
def min_packs(profile: Profile, u: int, capacity: int, pass_: Pass, last_pack: Pack | None = None) -> int | None:
    """The fewest packs (``last_pack`` included when given) in which every pack fits; None if
    some layer does not fit alone. O(R) after the cached tables."""
    n = _prefix_range(profile, last_pack)
    extra = 0 if last_pack is None else 1
    if n == 0:
        return extra
    t = _tables(profile, u, capacity, _check_pass(pass_))
    his = _levels(np.minimum(t.reach[:n], n - 1) + 1, n, n)
    return None if his is None else len(his) - 1 + extra


def pack_counts(profile: Profile, u: int, capacity: int, pass_: Pass, last_pack: Pack | None = None) -> range:
    """Every number of packs a packing can have (from the fewest that fit up to one pack per
    layer; ``last_pack`` counted), for Algorithm 1 to sweep; empty if nothing fits."""
    fewest = min_packs(profile, u, capacity, pass_, last_pack)
    if fewest is None:
        return range(0)
    return range(fewest, _prefix_range(profile, last_pack) + (0 if last_pack is None else 1) + 1)


def balanced_time_packing(
    profile: Profile,
    u: int,
    capacity: int,
    pass_: Pass,
    num_packs: int | None = None,
    last_pack: Pack | None = None,
) -> list[Pack] | None:
    """Algorithm 2: contiguous packs whose slowest one is as fast as possible, every pack fitting.

    ``num_packs`` is the total number of packs (``last_pack`` included); None takes the fewest that
    fit, i.e. the largest average pack, as the paper's loop does. With ``last_pack`` (the backward's
    last pack, shared by jit-compute) only the layers before it are packed and it is appended as
    is: it runs at the backward's microbatch, so it is neither timed nor checked here. Returns None
    if no packing with that many packs fits. Cost: O(R²) numpy once per (u, pass, capacity), then
    O(R log R · log R) to find the bound and O(R·P) to build the packs.
    """
    pass_ = _check_pass(pass_)
    n = _prefix_range(profile, last_pack)
    tail = [] if last_pack is None else [tuple(last_pack)]
    packs = None if num_packs is None else num_packs - len(tail)
    if n == 0:
        return list(tail) if packs in (None, 0) and tail else None  # type: ignore[arg-type]
    t = _tables(profile, u, capacity, pass_)
    if packs is None:
        his = _levels(np.minimum(t.reach[:n], n - 1) + 1, n, n)
        if his is None:
            return None
        packs = len(his) - 1
    if not 1 <= packs <= n:
        return None
    bound = _optimal_bound(t, n, packs)
    if bound is None:
        return None
    rebuilt = _rebuild(t, n, bound, packs)
    return None if rebuilt is None else rebuilt + tail


def greedy_packing(
    profile: Profile, u: int, capacity: int, pass_: Pass, last_pack: Pack | None = None,
) -> list[Pack] | None:
    """The baseline of Fig. 8: from the first layer, grow each pack until the next layer would not
    fit, then start the next pack. Fewest packs, but their times fall where memory puts them.
    None if some layer does not fit alone. O(R) after the cached tables."""
    n = _prefix_range(profile, last_pack)
    tail = [] if last_pack is None else [tuple(last_pack)]
    t = _tables(profile, u, capacity, _check_pass(pass_))
    out: list[Pack] = []
    i = 0
    while i < n:
        j = min(int(t.reach[i]), n - 1)
        if j < i:
            return None
        out.append((i, j))
        i = j + 1
    return out + tail  # type: ignore[operator]


def pack_times(profile: Profile, packing: list[Pack], u: int, pass_: Pass) -> list[float]:
    """Seconds of each pack's task (see ``layer_times``)."""
    prefix = np.concatenate(([0.0], np.cumsum(_layer_arrays(profile, u, _check_pass(pass_))["time"])))
    return [float(prefix[last + 1] - prefix[first]) for first, last in packing]
