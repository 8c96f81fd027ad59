"""Lower bounds on an iteration's time, which let the search skip candidates without simulating them.

Two bounds, from cheap to tight:

- ``quick_bound`` reads a configuration alone, before its task graph is built: the busiest
  device's compute and the weights every pass must bring over the host link.
- ``lower_bound`` reads a task graph: the longest chain of work its dependencies force, unit by unit
  (``_Chain``), and its host-link traffic at full bandwidth.

Both must stay below every estimate of the candidates they judge (``estimator.py`` never lets a unit
run faster than its ``unit_seconds``, a copy faster than its channel, or a task start before its
inputs exist): a bound above an estimate would make the search drop a plan that could have won.
``tests/scheduler/test_bounds.py`` holds them to that over every mode.
"""

from __future__ import annotations

import itertools

from harmony.profiling.profiles import LOSS_FORWARD, Profile
from harmony.scheduler.costs import task_compute_seconds, unit_seconds
from harmony.scheduler.memory import profile_cache as _profile_cache
from harmony.scheduler.keep import KEEP_MODES
from harmony.scheduler.lower import ranges
from harmony.scheduler.machine import Machine
from harmony.scheduler.memory import input_unit
from harmony.scheduler.taskgraph import keepable_packs
from harmony.scheduler.tasks import HOST, Channel, Configuration, Kind, Task, TaskGraph

__all__ = ["compute_bound", "graph_key", "lower_bound", "quick_bound"]

_ACTIVATIONS = frozenset(("X", "Xs", "dY", "A", "As"))  # inputs read microbatch by microbatch


def quick_bound(mode: str, profile: Profile, config: Configuration, devices: int, minibatch: int, machine: Machine,
                keep: bool = False) -> float:
    """A lower bound computed from the configuration alone, before any task graph is built.

    Compute: in ``pp`` the busiest device of the wrap-around binding, in ``dp`` and ``dp-swap`` the
    device with the largest share; in the per-GPU-swap pipelines the total over the devices, or the
    slowest pack, which one device runs whole. Swaps: every pack's weights come from the host at
    least once per pass (the last pack once): once in ``pp``, on every device in ``dp``, and per
    microbatch in the per-GPU-swap baselines; none where ``keep`` may keep them on the devices
    (``keep.py``). The baselines read U_F and P_F only (``graph_key``).
    """
    layers = profile.layers
    last = config.packs_f[-1]
    baseline = mode not in ("pp", "dp")
    u_b, packs_b = (config.u_f, config.packs_f) if baseline else (config.u_b, config.packs_b)
    recompute = not baseline or mode.endswith("-r")
    samples = minibatch if mode in ("pp", "gpipe-swap", "gpipe-swap-r", "1f1b-swap", "1f1b-swap-r") \
        else -(-minibatch // devices)
    cache = _profile_cache(profile)
    forward_packs, backward_packs = tuple(config.packs_f[:-1]), tuple(reversed(packs_b[:-1]))
    times, ends_f = _pass_times(profile, cache, "fwd", forward_packs, config.u_f, samples)
    loss, ends_loss = _pass_times(profile, cache, "loss", (tuple(last),), u_b, samples)
    backward, ends_b = _pass_times(profile, cache, "bwd" if recompute else "bwd-only", backward_packs, u_b, samples)
    keepable = set(keepable_packs(mode, config, devices))
    if keepable:  # a variant keeping their activations records its forward and recomputes nothing
        times, ends_f = _least(times, ends_f, _pass_times(profile, cache, "keep", forward_packs, config.u_f, samples),
                               [tuple(p) in keepable for p in forward_packs])
        backward, ends_b = _least(backward, ends_b,
                                  _pass_times(profile, cache, "bwd-only", backward_packs, u_b, samples),
                                  [tuple(p) in keepable for p in backward_packs])
    times = times + loss
    if mode == "pp":
        counts = [-(-samples // config.u_f)] * len(ends_f) + [-(-samples // u_b)] * (1 + len(backward))
        compute = _pipeline_chain(times + backward, ends_f + ends_loss + ends_b, counts, devices, machine)
    elif samples == minibatch:  # a pipeline of stages: every pack's work falls on one device
        per_pack = [f + b for f, b in zip(times[:-1], reversed(backward))] + [times[-1]]
        compute = max(sum(per_pack) / devices, max(per_pack))
    else:  # the times are already one device's share of the minibatch
        compute = sum(times) + sum(backward)
    if mode != "pp":  # pp's chain scales its own
        compute *= machine.compute_scale
    weights = cache.get(("quick", "weights"))
    if weights is None:  # prefix sums of the layers' weight bytes
        weights = cache[("quick", "weights")] = list(itertools.accumulate((layer.w_bytes for layer in layers), initial=0))
    w_all = weights[-1]
    w_last = weights[last[1] + 1] - weights[last[0]]
    per_pass = 2 * w_all - w_last  # every pack's weights once per pass, the last pack's once
    if keep and mode in KEEP_MODES:
        weights_in = 0
    elif mode == "pp":
        weights_in = per_pass
    elif mode == "dp":
        weights_in = devices * per_pass
    elif mode.startswith("dp-swap"):  # no grouping: every microbatch of every device, plus its update
        weights_in = devices * (-(-(-(-minibatch // devices)) // config.u_f) * per_pass + w_all)
    else:  # per-GPU-swap pipelines: every microbatch once through the stages, plus the update
        weights_in = -(-minibatch // config.u_f) * per_pass + w_all
    return max(compute, weights_in / machine.h2d_all)


def _least(times: list[float], ends: list[tuple[float, float]], other: tuple[list, list],
           where: list[bool]) -> tuple[list[float], list[tuple[float, float]]]:
    """Per pack, the lesser of two passes' times (and first and last microbatch's) where ``where``
    says either may run: a bound for both."""
    other_times, other_ends = other
    out_times = [min(a, b) if w else a for a, b, w in zip(times, other_times, where)]
    out_ends = [(min(a[0], b[0]), min(a[1], b[1])) if w else a for a, b, w in zip(ends, other_ends, where)]
    return out_times, out_ends


def _pass_times(profile: Profile, cache: dict, kind: str, packs: tuple, u: int,
                samples: int) -> tuple[list[float], list[tuple[float, float]]]:
    """Per pack, its compute over ``samples`` samples in microbatches of ``u``, and its first and
    last microbatch's (the pipeline chain's); ``kind``: "fwd", "keep" (a forward recording for
    autograd), "loss" (forward and backward of the last pack), "bwd" (recompute and backward) or
    "bwd-only". Kept in the profile's cache: the
    configurations of a search share their passes (one backward packing meets every forward one)."""
    key = ("quick", kind, packs, u, samples)
    hit = cache.get(key)
    if hit is not None:
        return hit
    again = {"loss": LOSS_FORWARD, "bwd": "recompute_time"}.get(kind)  # the forward a backward runs first

    def pack(first: int, last: int, size: int) -> float:
        if kind == "fwd":
            return profile.pack_time(first, last, size, "fwd_time")
        if kind == "keep":
            return profile.pack_time(first, last, size, LOSS_FORWARD)
        before = profile.pack_time(first, last, size, again) if again else 0.0
        return before + profile.pack_time(first, last, size, "bwd_time")

    full, rest = divmod(samples, u)
    edge = (min(u, samples), samples - (-(-samples // u) - 1) * u)  # first and last microbatch
    times = [full * pack(a, b, u) + (pack(a, b, rest) if rest else 0.0) for a, b in packs]
    ends = [(pack(a, b, edge[0]), pack(a, b, edge[1])) for a, b in packs]
    cache[key] = (times, ends)
    return times, ends


def _pipeline_chain(times: list[float], ends: list[tuple[float, float]], counts: list[int], devices: int,
                    machine: Machine) -> float:
    """The wrap-around pipeline's chain (``_Chain`` for a configuration, before its graph exists):
    task i on device i mod N runs after that device's previous task, its first microbatch after the
    previous task's first, and its last microbatch after the previous task's last. ``times``: each
    task's compute; ``ends``: its first and last microbatch's; ``counts``: its microbatches. The
    executor's costs per task and microbatch are counted; the state copies and the updates are not
    (a kept or a host-stepped variant may do without them)."""
    scale, per_task, per_mb = machine.compute_scale, machine.task_overhead, machine.microbatch_overhead
    free = [0.0] * devices  # the earliest each device's previous task ends
    first_end = last_end = latest = 0.0  # the previous task's first and last microbatch's earliest ends
    for i, (t, (first, last), n) in enumerate(zip(times, ends, counts)):
        d = i % devices
        begin = max(free[d], first_end)
        first_end = begin + per_task + per_mb + first * scale
        end = max(begin + per_task + n * per_mb + t * scale, last_end + per_mb + last * scale)
        free[d] = last_end = end
        latest = max(latest, end)
    return latest + machine.iteration_overhead


def graph_key(mode: str, config: Configuration) -> tuple:
    """What of ``config`` the task graph of ``mode`` depends on: the per-GPU-swap baselines run
    every pack at U_F, forward and backward, and never read U_B or P_B; so configurations that
    differ there alone are one candidate."""
    if mode in ("pp", "dp"):
        return (config.u_f, tuple(config.packs_f), config.u_b, tuple(config.packs_b), tuple(config.keep))
    return (config.u_f, tuple(config.packs_f))


def lower_bound(graph: TaskGraph, profile: Profile, machine: Machine) -> float:
    """No schedule of ``graph`` finishes sooner than its longest chain of forced work (``_Chain``),
    nor sooner than its host-link traffic takes at the link's full aggregate bandwidth."""
    swap_in = swap_out = 0
    for task in graph.tasks:
        for t in task.inputs:
            if t.channel == Channel.SWAP:
                swap_in += t.nbytes
        for t in task.outputs:
            if t.channel == Channel.SWAP:
                swap_out += t.nbytes
    chain = _Chain(graph, profile, machine).length()
    return max(chain, swap_in / machine.h2d_all, swap_out / machine.d2h_all)


def compute_bound(graph: TaskGraph, profile: Profile) -> float:
    """The busiest device's compute alone (the profile's, unscaled): the bound before ``_Chain``."""
    busy: dict[int, float] = {}
    for task in graph.tasks:
        busy[task.device] = busy.get(task.device, 0.0) + task_compute_seconds(task, profile)
    return max(busy.values(), default=0.0)


class _Chain:
    """The earliest each task's units can start and end if every stream were free and every copy
    went at its channel's full rate: a device runs its tasks in order; a task's first microbatch
    waits for the producer unit holding its first sample, and its last for the one holding its last
    sample; state from the host must arrive before its first unit; an update waits for the whole
    backward it steps and for its gradients' copy to the host. The latest end, plus the launcher's
    cost per iteration, bounds the iteration: the pipeline's fill and drain that a per-device sum of
    compute leaves out."""

    def __init__(self, graph: TaskGraph, profile: Profile, machine: Machine):
        self.machine = machine
        self.by_id = {t.id: t for t in graph.tasks}
        cache = _profile_cache(profile)
        self.units = {t.id: unit_seconds(t, profile, machine, cache) for t in graph.tasks}
        self.start: dict[int, float] = {}  # task -> its first unit's earliest start
        self.mb_end: dict[int, float] = {}  # task -> its last microbatch unit's earliest end
        self.end: dict[int, float] = {}  # task -> its last unit's earliest end
        self.graph = graph

    def length(self) -> float:
        previous: dict[int, float] = {}  # device -> the earliest end of its last task so far
        for task in self.graph.tasks:  # each device's tasks in their order; producers come first
            units = self.units[task.id]
            n = min(len(task.microbatches), len(units))
            spans = ranges(task)
            start = max(previous.get(task.device, 0.0), self._state_arrives(task))
            last_mb = 0.0  # the earliest its last microbatch unit may start
            at_end = 0.0  # the earliest its last unit (a fused update) may start
            for i in task.inputs:
                producer = self.by_id.get(i.task) if i.task is not None else None
                if producer is None or producer.id not in self.end:
                    continue
                # the unit that waits for it, as the simulation wires it (``memory.input_unit``)
                unit = input_unit(task, i.tensor, i.microbatch, len(units))
                if i.tensor in _ACTIVATIONS:
                    if i.microbatch is None or not 0 <= i.microbatch < n:
                        continue
                    first, size = spans[i.microbatch]
                    if unit == 0:
                        start = max(start, self._sample_ready(producer, first))
                    if unit == n - 1:
                        last_mb = max(last_mb, self._sample_ready(producer, first + size - 1, last=True))
                elif unit == 0:
                    start = max(start, self.end[producer.id] + self._copy(i, producer, task))
                elif unit == len(units) - 1:
                    at_end = max(at_end, self.end[producer.id] + self._copy(i, producer, task))
            mb_end = start + sum(units[:n])
            if n:
                mb_end = max(mb_end, last_mb + units[n - 1])
            end = mb_end + sum(units[n:])
            if len(units) > n:
                end = max(end, at_end + units[-1])
            self.start[task.id], self.mb_end[task.id], self.end[task.id] = start, mb_end, end
            previous[task.device] = end
        return max(self.end.values(), default=0.0) + self.machine.iteration_overhead

    def _sample_ready(self, producer: Task, sample: int, last: bool = False) -> float:
        """The earliest end of ``producer``'s unit holding ``sample`` (0 if none does); with
        ``last``, a bound on the consumer's last microbatch: that unit's end, where it is the
        producer's last microbatch (whose end the producer's own inputs may have pushed later)."""
        units = self.units[producer.id]
        spans = ranges(producer)
        for k, (first, size) in enumerate(spans):
            if first <= sample < first + size:
                if last and k == len(spans) - 1:
                    return self.mb_end[producer.id]
                return self.start[producer.id] + sum(units[:k + 1])
        return 0.0

    def _state_arrives(self, task: Task) -> float:
        """The earliest its pack state (weights and buffers) is on the device, where it comes from
        the host: every byte over one host link."""
        if task.device == HOST or task.kind == Kind.UPD:
            return 0.0
        nbytes = sum(i.nbytes for i in task.inputs if i.tensor in ("W", "B") and i.channel == Channel.SWAP)
        return self.machine.transfer_time(nbytes, "h2d") if nbytes else 0.0

    def _copy(self, i, producer: Task, consumer: Task) -> float:
        """Seconds an output read whole (a gradient, a buffer) takes to reach the consumer's side
        after its producer ends: the copy to the host for a consumer there; none counted otherwise."""
        if consumer.device == HOST and producer.device != HOST and i.channel == Channel.SWAP and i.nbytes:
            return self.machine.transfer_time(i.nbytes, "d2h")
        return 0.0
