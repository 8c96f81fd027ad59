"""The cost model: how long each compute unit of a task keeps its device busy, and each copy its
stream.

A task is one unit per microbatch (FWD: the pack's forward, recording for autograd where it keeps
its activations; BWD: the recompute and the backward, the backward alone from kept activations, or
for a ``loss`` task the forward, the loss and the backward), plus one for a fused device
update; a UPD or NORM task is one unit. A unit lasts its profiled compute (``Profile.pack_time``),
on a device times ``Machine.compute_scale`` (the runtime's compute over the profiler's), plus the
runtime's own overheads the machine measured (zero where nobody did). A copy lasts its bytes over
its channel's bandwidth, plus the fixed latency, plus for a pack's state the runtime's cost per
tensor it moves (``copy_seconds``). The estimator (``estimator.py``) and the program's simulation
(``simulator.py``) play with these durations, and the bounds (``bounds.py``) prune with them.
"""

from __future__ import annotations

from harmony.profiling.profiles import LOSS_FORWARD, Profile

from . import memory
from .machine import Machine
from .memory import profile_cache as _profile_cache
from .tasks import HOST, Kind, Task

STATE_TENSORS = frozenset(("W", "dW", "K", "B"))  # moved one tensor at a time (``Machine.tensor_overhead``)

def _task_costs(task: Task, profile: Profile, cache: dict) -> list[float]:
    """Durations of the task's units."""
    key = (task.kind, task.loss, memory.fused_update(task), task.device == HOST, task.first, task.last,
           tuple(task.microbatches), task.keep)
    hit = cache.get(key)
    if hit is not None:
        return hit
    first, last = task.first, task.last
    layers = profile.layers[first:last + 1]

    def pack(q: str, u: int) -> float:
        k = (q, first, last, u)
        v = cache.get(k)
        if v is None:
            v = cache[k] = profile.pack_time(first, last, u, q)
        return v

    if task.kind == Kind.UPD:
        q = "upd_time_host" if task.device == HOST else "upd_time_device"
        durs = [float(sum(getattr(layer, q) for layer in layers))]
    elif task.kind == Kind.NORM:  # a norm and a scale of every gradient on the host
        durs = [float(sum(layer.norm_time_host for layer in layers))]
    else:
        durs = []
        for size in task.microbatches:
            if task.kind == Kind.FWD:  # recording for autograd where it keeps its activations
                durs.append(pack(LOSS_FORWARD if task.keep else "fwd_time", size))
            elif task.keep:  # the backward from the activations the forward kept: nothing recomputed
                durs.append(pack("bwd_time", size))
            elif task.loss:  # the pack's forward recording for autograd (``LOSS_FORWARD``), the loss's
                # own forward and backward (``Profile.loss_time``), the pack's backward
                durs.append(pack(LOSS_FORWARD, size) + pack("bwd_time", size) + profile.loss_time(size))
            else:
                durs.append(pack("recompute_time", size) + pack("bwd_time", size))
        if memory.fused_update(task):  # not dp's backwards, which a UPD task steps: counted, their
            # step would put dp's estimate above the host-stepped one's where it runs faster
            durs.append(float(sum(layer.upd_time_device for layer in layers)))
        if not durs:
            durs = [0.0]
    cache[key] = durs
    return durs


def task_compute_seconds(task: Task, profile: Profile) -> float:
    """Seconds of compute the task needs on its device (all microbatches, and a fused update)."""
    return sum(_task_costs(task, profile, _profile_cache(profile)))


def unit_overheads(task: Task, machine: Machine, units: int, tensors: int = 0) -> list[float]:
    """The runtime's own seconds on each of a task's ``units`` compute units (see the module docs):
    the task's fixed cost on the first (a FWD or BWD task's with the model's cost per compute task,
    ``Machine.compute_task_overhead``), a microbatch's on each microbatch, an update's on a fused
    device update and on a UPD task. A task on the host (an offloaded update of ``tensors``
    parameters) pays the host update's: the launcher runs it without the executor's per-task work,
    and with work of its own around the step (``Machine.host_update_overhead``)."""
    extra = [0.0] * units
    if units == 0:
        return extra
    if task.kind == Kind.UPD and task.device == HOST:
        extra[0] = machine.host_update_overhead + machine.host_tensor_overhead * tensors
        return extra
    if task.kind == Kind.UPD:
        extra[0] = machine.update_overhead + machine.task_overhead
        return extra
    if task.kind == Kind.NORM:
        return extra
    microbatches = len(task.microbatches)
    for j in range(min(microbatches, units)):
        extra[j] = machine.microbatch_overhead
    if memory.fused_update(task) and units > microbatches:
        extra[-1] += machine.update_overhead
    extra[0] += machine.task_overhead + machine.compute_task_overhead
    return extra


def unit_seconds(task: Task, profile: Profile, machine: Machine, cache: dict | None = None) -> list[float]:
    """Seconds each unit of the task (see ``_Unit``) keeps its compute stream busy when nothing else
    computes: its compute (scaled to the runtime's, on a device) and the runtime's overheads."""
    durs = _task_costs(task, profile, _profile_cache(profile) if cache is None else cache)
    scale = 1.0 if task.device == HOST else machine.compute_scale
    # the scale is the runtime's forward and backward over the profile's; an update (a UPD task, a
    # fused update's last unit) is measured on its own, in ``measure_update``, and is not scaled
    scaled = len(task.microbatches) if task.kind in (Kind.FWD, Kind.BWD) else 0
    tensors = profile.state_tensors("dW", task.first, task.last) if task.kind == Kind.UPD and task.device == HOST else 0
    return [d * (scale if j < scaled else 1.0) + e
            for j, (d, e) in enumerate(zip(durs, unit_overheads(task, machine, len(durs), tensors)))]


def task_seconds(task: Task, profile: Profile, machine: Machine) -> float:
    """Seconds the task keeps its device's compute stream busy when nothing else computes."""
    return sum(unit_seconds(task, profile, machine))


def copy_seconds(nbytes: int, channel: str, machine: Machine, tensor: str = "", task: Task | None = None,
                 profile: Profile | None = None) -> float:
    """Seconds one copy of ``nbytes`` on ``channel`` (``h2d``, ``d2h``, ``d2d``, ``msg``) keeps its
    stream busy: ``Machine.transfer_time``, and for a pack's state (``tensor`` W, dW, K or B of
    ``task``'s layers) the runtime's cost per tensor it moves. Host copies are timed alone here:
    the estimator shares a host link between the copies active at once."""
    if not nbytes:
        return 0.0
    seconds = machine.transfer_time(nbytes, channel)
    if machine.tensor_overhead and tensor in STATE_TENSORS and task is not None and profile is not None \
            and channel in ("h2d", "d2h"):
        seconds += machine.tensor_overhead * profile.state_tensors(tensor, task.first, task.last)
    return seconds
