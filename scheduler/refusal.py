"""Why a dp search was refused where pp fits, and the device memory at which dp would fit.

A dp refusal's shortfall names the configuration that came closest, at the capacity searched; it
says neither whether pp (Harmony's other mode) would have fitted that capacity nor the least
memory at which some dp configuration fits: packings change with the capacity, so the closest
configuration's own need is an upper bound, not the least. Both are searched for, on the same
profile, where the refusal is raised (``explain_refusal``): a pp search and a bisection of at most
ten dp searches, each a few milliseconds on a small profile and about as long as the refused one.
"""

from __future__ import annotations

from dataclasses import dataclass

from harmony.errors import DeviceOutOfMemoryError
from harmony.profiling.profiles import Profile
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import NoFeasibleConfiguration, SearchResult, Shortfall, search, task_own_memory
from harmony.scheduler.tasks import Configuration, Kind

_fmt = DeviceOutOfMemoryError._fmt


@dataclass
class PpFit:
    """pp's best configuration at the capacity dp was refused, and what its busiest device holds."""

    config: Configuration
    peak: int  # the largest device peak of its estimate
    task: str  # the task at that peak
    own: int  # that task's own pack: weights, gradients, inputs and one microbatch's activations


@dataclass
class DpRefusal:
    """What a dp refusal at ``capacity`` is missing: the least capacity at which the dp search fits,
    and pp's fit of the same capacity where it has one."""

    capacity: int
    least: int | None  # bytes per device at which the dp search fits; None where no probe fitted
    shortfall: Shortfall  # dp's closest configuration at ``capacity``
    pp: PpFit | None

    def describe(self) -> str:
        """One sentence on what dp holds that pp does not, in the search's bytes, then the least
        memory and pp's fit: the cause, and the two remedies (more memory, or mode pp)."""
        s = self.shortfall
        held = s.peak - s.own
        text = (f"dp needs more memory per device than pp here: every dp device runs every pack on its share of the "
                f"minibatch, so its closest configuration ({s.config}) peaks at {_fmt(s.peak)} in {_short(s.task)}, "
                f"that pack's own {_fmt(s.own)} (weights, gradients, inputs and one microbatch's activations)")
        if held > 0:
            text += f" and {_fmt(held)} of the packs run before and after it on the same device"
            gradient = s.outgoing.get("dW", 0)
            if gradient:
                text += f" ({_fmt(gradient)} of it the previous pack's gradient still leaving for the host reduction)"
        if self.pp is not None:
            text += (f", where pp runs each pack on one device and peaks at {_fmt(self.pp.peak)} in "
                     f"{_short(self.pp.task)} (own pack {_fmt(self.pp.own)}, {_fmt(self.pp.peak - self.pp.own)} "
                     f"around it) with {self.pp.config}")
        text += "."
        if self.least is not None:
            text += f" The dp search fits from {_fmt(self.least)} per device."
        if self.pp is not None:
            text += f" Mode pp fits this device memory ({self.capacity:,} bytes per device): use --mode pp."
        return text


def _short(task: str) -> str:
    """A task's text without its transfers: ``dev0 BWD L3 u=1x2``."""
    return task.split(" in:")[0].split(" out:")[0]


def explain_refusal(exc: NoFeasibleConfiguration, mode: str, profile: Profile, machine: Machine, devices: int,
                    minibatch: int, capacity: int, probes: int = 8, **options) -> DpRefusal | None:
    """A dp refusal at ``capacity`` explained (``DpRefusal``); None for another mode, or where the
    search found no closest configuration (nothing estimated: a minibatch no microbatch size cuts).
    ``options`` are the refused search's own, so that the probes search what it searched."""
    if mode != "dp" or exc.shortfall is None:
        return None
    least = least_capacity(profile, machine, "dp", devices, minibatch, capacity, exc.shortfall.needed, probes,
                           **options)
    return DpRefusal(capacity=capacity, least=least, shortfall=exc.shortfall,
                     pp=pp_fit(profile, machine, devices, minibatch, capacity, **options))


def pp_fit(profile: Profile, machine: Machine, devices: int, minibatch: int, capacity: int,
           **options) -> PpFit | None:
    """pp's search of the same capacity, summarised; None where pp does not fit it either."""
    try:
        result = search(profile, machine, "pp", devices, minibatch, capacity=capacity, timeline=False,
                        explain=False, **options)
    except NoFeasibleConfiguration:
        return None
    return _peak_of(result, profile)


def _peak_of(result: SearchResult, profile: Profile) -> PpFit:
    """The busiest device's peak of a search's winner, and the computing task there that peaks."""
    est = result.estimate
    device = max(est.peak_memory, key=est.peak_memory.get)
    computing = [t for t in result.graph.tasks if t.device == device and t.kind in (Kind.FWD, Kind.BWD)]
    own_profile = profile.for_graph(result.graph)
    task = max(computing, key=lambda t: (est.task_peaks.get(t.id, 0), task_own_memory(own_profile, t)))
    return PpFit(config=result.config, peak=est.peak_memory[device], task=str(task),
                 own=task_own_memory(own_profile, task))


def fits(profile: Profile, machine: Machine, mode: str, devices: int, minibatch: int, capacity: int,
         **options) -> bool:
    """Whether the search of ``mode`` finds a configuration that fits ``capacity`` (a probe: the
    refusal's closest configuration is not played out again)."""
    try:
        search(profile, machine, mode, devices, minibatch, capacity=capacity, timeline=False, explain=False, **options)
    except NoFeasibleConfiguration:
        return False
    return True


def least_capacity(profile: Profile, machine: Machine, mode: str, devices: int, minibatch: int, refused: int,
                   upper: int, probes: int = 8, tolerance: float = 0.005, **options) -> int | None:
    """The least capacity at which the search of ``mode`` fits, to within ``tolerance`` of it: a
    bisection between ``refused`` (which did not fit) and ``upper`` (the closest configuration's
    need, which should), in at most ``probes`` searches. Packings follow the capacity, so a search
    may fit a capacity and not a larger one; the answer is a capacity that fits with one that does
    not just below it. Where ``upper`` does not fit, the bisection reaches up to twice it; None
    where that does not fit either."""
    low, high = refused, upper
    if not fits(profile, machine, mode, devices, minibatch, high, **options):
        high *= 2
        if not fits(profile, machine, mode, devices, minibatch, high, **options):
            return None
    for _ in range(probes):
        if high - low <= max(1, int(high * tolerance)):
            break
        middle = (low + high) // 2
        if fits(profile, machine, mode, devices, minibatch, middle, **options):
            high = middle
        else:
            low = middle
    return high
