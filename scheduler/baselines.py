"""Pipeline baselines with per-GPU memory virtualization (§2, §5.1 "GP Swap", "2BW Swap", "(R)").

Prior pipelines pin layers to GPUs: the model is cut into N contiguous *stages*, stage s lives on
device s for the whole iteration, and microbatches flow through the stages. Enhanced with per-GPU
swap (each GPU virtualizes its own memory, as IBM-LMS does for the paper's baselines), a device
cannot hold its stage, so it runs the stage pack by pack, one microbatch at a time, and every such
task brings its pack's weights in and sends them out again (Fig. 3(c-d), Fig. 6(b)):

- **Stages.** The configuration's forward packs P_F (P_B is not used: the baselines run one
  packing in both passes) are grouped into N contiguous stages, balanced by compute time per
  microbatch of U_F (forward + backward, + recompute when recomputing), minimizing the slowest
  stage. A configuration with fewer packs than devices is refused (ValueError).
- **Tasks.** One task per (pack, microbatch), no input-batch grouping. FWD: W (and B) <- SWAP,
  X from the previous pack (LOCAL on the same device, P2P from the previous stage's device, or the
  minibatch from the host for the first pack), W -> SWAP (evicted), the stash Xs -> SWAP. BWD:
  W <- SWAP, the stash <- SWAP (the minibatch for layer 0), dY from the next pack (LOCAL or P2P),
  the running gradient dW <- SWAP (not for the first microbatch), then W, dW -> SWAP. The model's
  last pack has no FWD task: its BWD (``loss``) runs forward, loss and backward per microbatch,
  like dp-swap. At the end every device runs one UPD per pack of its stage (W, dW, K in; W, K out).
- **Stash.** With recompute (the "-r" modes) only each pack's input is stashed and the backward
  recomputes the pack; without it the input of every layer of the pack is stashed (as dp-swap
  does). The estimator charges recompute time to every non-loss BWD either way, so the modes
  differ there in bytes moved, not in compute.
- **Schedules.** ``gpipe_swap``: each stage runs the forwards of all microbatches, then all their
  backwards (a flush), in microbatch order. ``one_f_one_b_swap``: PipeDream-Flush (1F1B): stage s
  runs min(N - s - 1, m) warm-up forwards, then alternates one forward and one backward, then the
  remaining backwards. The paper's "2BW Swap" baseline is PipeDream-2BW, which keeps two weight
  versions and updates without a flush (asynchronous weight-update semantics); we implement its
  flush variant, which has the same 1F1B order, stage binding and swaps but synchronous SGD
  semantics, so that every mode trains the same model. On the last stage a "forward" of a
  microbatch is the FWD tasks of its packs before the model's last pack, and a "backward" is the
  loss task followed by the other packs' BWDs in reverse.

``BASELINES`` maps mode names to generators ``(profile, config, devices, minibatch) -> TaskGraph``:
"gpipe-swap", "1f1b-swap" and, with recompute, "gpipe-swap-r", "1f1b-swap-r"; "dp-swap-r" is
taskgraph's dp-swap with recompute (plain "dp-swap" stays taskgraph's mode).

Device memory: the stash goes to host memory in both schedules, so what 1F1B saves here is what a
device holds between the passes: GPipe's last stage keeps every microbatch's activation between its
packs (LOCAL) from its forward phase to its backward phase, and upstream sends wait for a receiver
that is still forwarding; 1F1B bounds both by N - s microbatches.

Weight swaps per iteration with m microbatches (§3): (4m + 2)·|W| (every microbatch swaps every
pack in and out in both passes, plus the update), less 2m·|W_last| because the last pack's forward
runs with its backward.
"""

from __future__ import annotations

import bisect
from typing import Callable

from harmony.profiling.profiles import LOSS_FORWARD, Profile
from harmony.scheduler.taskgraph import (Sizes, buffer_out, check_packing, connect, dp_swap, state_inputs,
                                         update_inputs, update_outputs)
from harmony.scheduler.tasks import Channel, Configuration, Kind, Task, TaskGraph, Transfer, microbatch_sizes

__all__ = ["BASELINES", "gpipe_swap", "one_f_one_b_swap", "stages", "schedule"]


# --------------------------------------------------------------------------- stages
def _pack_cost(profile: Profile, first: int, last: int, u: int, recompute: bool) -> float:
    """A pack's compute per microbatch: forward and backward, and the recompute unless it is
    the model's last pack (its loss task runs its forward, recording for autograd as a recompute
    does, and its backward together)."""
    cost = profile.pack_time(first, last, u, "bwd_time")
    if last == len(profile.layers) - 1:
        return cost + profile.pack_time(first, last, u, LOSS_FORWARD)
    cost += profile.pack_time(first, last, u, "fwd_time")
    if recompute:
        cost += profile.pack_time(first, last, u, "recompute_time")
    return cost


def stages(profile: Profile, config: Configuration, devices: int, recompute: bool = True) -> list[list[tuple[int, int]]]:
    """P_F split into ``devices`` contiguous, non-empty groups of packs minimizing the largest
    group's compute time per microbatch of U_F (binary search on that bound, greedy fill)."""
    packs = list(config.packs_f)
    if devices < 1:
        raise ValueError(f"need at least one device, got {devices}")
    if len(packs) < devices:
        raise ValueError(f"{len(packs)} pack(s) cannot fill {devices} pipeline stages; pack finer")
    costs = [_pack_cost(profile, a, b, config.u_f, recompute) for a, b in packs]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cut(bound: float) -> list[int] | None:
        """Stage ends (exclusive pack indices) filling each stage up to ``bound``, leaving at least
        one pack per later stage; None if the packs do not fit in ``devices`` stages."""
        ends, start = [], 0
        for s in range(devices - 1):
            limit = len(packs) - (devices - 1 - s)  # the last end this stage may take
            j = bisect.bisect_right(prefix, prefix[start] + bound * (1 + 1e-12), lo=start + 1) - 1
            j = max(start + 1, min(j, limit))
            ends.append(j)
            start = j
        if prefix[-1] - prefix[start] > bound * (1 + 1e-12) and len(packs) - start > 1:
            return None
        return ends + [len(packs)]

    lo, hi = max(costs), prefix[-1]
    for _ in range(60):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        if cut(mid) is None:
            lo = mid
        else:
            hi = mid
    ends = cut(hi) or [*range(len(packs) - devices + 1, len(packs)), len(packs)]
    groups, start = [], 0
    for end in ends:
        groups.append(packs[start:end])
        start = end
    return groups


def schedule(kind: str, stage: int, devices: int, microbatches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s order of ("F", j) forwards and ("B", j) backwards of microbatch j."""
    m = microbatches
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if kind == "1f1b":
        warmup = min(devices - stage - 1, m)
        ops = [("F", j) for j in range(warmup)]
        for j in range(m - warmup):
            ops += [("F", warmup + j), ("B", j)]
        return ops + [("B", j) for j in range(m - warmup, m)]
    raise ValueError(f"unknown pipeline schedule {kind!r}")


# --------------------------------------------------------------------------- graph
_PackTasks = dict[tuple[tuple[int, int], int], Task]  # (pack, microbatch) -> its FWD or BWD task


def _pipeline_swap(kind: str, mode: str, profile: Profile, config: Configuration, devices: int, minibatch: int,
                   recompute: bool) -> TaskGraph:
    """The task graph of a per-GPU-swap pipeline with ``kind``'s schedule (see the module docs).

    Built in three passes, because every route names task ids: the tasks in each device's order,
    then the activations, stashes and gradients between them, then the closing updates.
    """
    check_packing(config, len(profile.layers))
    if devices < 1 or minibatch < 1:
        raise ValueError(f"need at least one device and one sample, got {devices} devices and minibatch {minibatch}")
    sz = Sizes(profile)
    groups = stages(profile, config, devices, recompute)
    sizes = microbatch_sizes(minibatch, config.u_f)
    tasks, fwd, bwd = _stage_tasks(kind, groups, devices, sizes, config)
    _route_microbatches(config.packs_f, fwd, bwd, sz, sizes, recompute)
    _route_updates(tasks, groups, sz, bwd, len(sizes))
    return TaskGraph(mode=mode, devices=devices, minibatch=minibatch, config=config, tasks=_interleave(tasks, devices))


def _stage_tasks(kind: str, groups: list[list[tuple[int, int]]], devices: int, sizes: list[int],
                 config: Configuration) -> tuple[list[Task], _PackTasks, _PackTasks]:
    """(tasks, FWD by (pack, microbatch), BWD by (pack, microbatch), the loss task included), with
    no routes yet: ids follow each device's execution order (device 0's first, then device 1's,
    ...), which ``_interleave`` keeps, so they are fixed before anything refers to them."""
    loss_pack = config.packs_f[-1]
    tasks: list[Task] = []
    fwd: _PackTasks = {}
    bwd: _PackTasks = {}

    def add(**kwargs) -> Task:
        task = Task(id=len(tasks), **kwargs)
        tasks.append(task)
        return task

    for s, packs in enumerate(groups):
        for op, j in schedule(kind, s, devices, len(sizes)):
            common = dict(device=s, microbatches=[sizes[j]], offset=j * config.u_f)
            if op == "F":
                for first, last in packs:
                    if (first, last) != loss_pack:
                        fwd[((first, last), j)] = add(kind=Kind.FWD, first=first, last=last, **common)
            else:
                for first, last in reversed(packs):
                    loss = (first, last) == loss_pack
                    bwd[((first, last), j)] = add(kind=Kind.BWD, first=first, last=last, loss=loss, **common)
        for first, last in packs:
            add(device=s, kind=Kind.UPD, first=first, last=last, microbatches=[])
    return tasks, fwd, bwd


def _channel(src: Task, dst: Task) -> Channel:
    """Between packs on one device an activation stays put (LOCAL); across stages it is sent (P2P)."""
    return Channel.LOCAL if src.device == dst.device else Channel.P2P


def _route_microbatches(packs_f: list[tuple[int, int]], fwd: _PackTasks, bwd: _PackTasks, sz: Sizes,
                        sizes: list[int], recompute: bool) -> None:
    """Every FWD and BWD task's state swaps, activations, stash and running gradient.

    Pack by pack and, within a pack, microbatch by microbatch, its forward before its backward:
    the order transfers are appended in is the order they appear in the graph.
    """
    for i, pack in enumerate(packs_f):
        prev_pack = packs_f[i - 1] if i > 0 else None
        next_pack = packs_f[i + 1] if i + 1 < len(packs_f) else None
        for j in range(len(sizes)):
            if pack != packs_f[-1]:
                _route_forward(fwd[(pack, j)], fwd[(prev_pack, j)] if prev_pack else None, sz)
            task = bwd[(pack, j)]
            task.inputs += state_inputs(sz, *pack)
            if task.loss:
                _route_loss(task, fwd[(prev_pack, j)] if prev_pack else None, sz)
            else:
                _route_backward(task, fwd[(pack, j)], bwd[(next_pack, j)], sz, sizes[j], recompute)
            if j > 0:  # the gradient accumulated so far
                task.inputs.append(Transfer("dW", Channel.SWAP, sz.dw(*pack), task=bwd[(pack, j - 1)].id))
            task.outputs.append(Transfer("W", Channel.SWAP, sz.w(*pack)))
            task.outputs.append(Transfer("dW", Channel.SWAP, sz.dw(*pack)))


def _route_forward(task: Task, src: Task | None, sz: Sizes) -> None:
    """A FWD: its state swapped in, X from the previous pack (the minibatch in host memory for the
    first), and its weights evicted afterwards, since per-GPU swap cannot keep the stage resident."""
    first, last = task.first, task.last
    task.inputs += state_inputs(sz, first, last)
    connect(src, task, "Y", "X", _channel(src, task) if src else Channel.SWAP, lambda n: sz.x(first, n))
    task.outputs.append(Transfer("W", Channel.SWAP, sz.w(first, last)))  # evicted
    task.outputs += buffer_out(sz, first, last)


def _route_loss(task: Task, src: Task | None, sz: Sizes) -> None:
    """The loss task runs its pack's forward itself, so it takes X as a FWD would and stashes nothing."""
    first, last = task.first, task.last
    connect(src, task, "Y", "X", _channel(src, task) if src else Channel.SWAP, lambda n: sz.x(first, n))
    task.outputs += buffer_out(sz, first, last)


def _route_backward(task: Task, producer: Task, src: Task, sz: Sizes, size: int, recompute: bool) -> None:
    """A non-loss BWD: the stash its FWD ``producer`` left in host memory (only the pack's input
    when recomputing, every layer's input otherwise; layer 0's is the minibatch itself) and dY
    from the next pack's BWD ``src``."""
    first, last = task.first, task.last
    for layer in ([first] if recompute else range(first, last + 1)):
        n = sz.x(layer, size)
        if layer == 0:  # the minibatch itself, from host memory
            task.inputs.append(Transfer("X", Channel.SWAP, n, microbatch=0))
        else:
            producer.outputs.append(Transfer("Xs", Channel.SWAP, n, task=task.id, microbatch=0))
            task.inputs.append(Transfer("Xs", Channel.SWAP, n, task=producer.id, microbatch=0))
    connect(src, task, "dX", "dY", _channel(src, task), lambda n: sz.y(last, n))


def _route_updates(tasks: list[Task], groups: list[list[tuple[int, int]]], sz: Sizes, bwd: _PackTasks,
                   m: int) -> None:
    """Each UPD steps its pack's owned state with the gradient summed over all m microbatches, so
    it waits for the pack's last BWD; it runs on the device of the pack's stage."""
    stage_of = {p: s for s, packs in enumerate(groups) for p in packs}
    for task in tasks:
        if task.kind == Kind.UPD:
            pack = (task.first, task.last)
            assert stage_of[pack] == task.device
            task.inputs = update_inputs(sz, *pack, bwd[(pack, m - 1)].id)
            task.outputs = update_outputs(sz, *pack)


def _interleave(tasks: list[Task], devices: int) -> list[Task]:
    """A global topological order keeping each device's order (its tasks by id): advance every
    device as far as its dependencies allow, round after round."""
    queues = [[t for t in tasks if t.device == d] for d in range(devices)]
    heads = [0] * devices
    done: set[int] = set()
    ordered: list[Task] = []
    while len(ordered) < len(tasks):
        progressed = False
        for d in range(devices):
            q = queues[d]
            while heads[d] < len(q) and q[heads[d]].deps() <= done:
                ordered.append(q[heads[d]])
                done.add(q[heads[d]].id)
                heads[d] += 1
                progressed = True
        if not progressed:
            raise ValueError("pipeline schedule has a dependency cycle")
    return ordered


def gpipe_swap(profile: Profile, config: Configuration, devices: int, minibatch: int, recompute: bool) -> TaskGraph:
    """GPipe with per-GPU swap ("GP Swap", "GP Swap (R)" with recompute): all forwards, then all
    backwards, on stages pinned to devices; see the module docs."""
    mode = "gpipe-swap-r" if recompute else "gpipe-swap"
    return _pipeline_swap("gpipe", mode, profile, config, devices, minibatch, recompute)


def one_f_one_b_swap(profile: Profile, config: Configuration, devices: int, minibatch: int, recompute: bool) -> TaskGraph:
    """PipeDream-Flush (1F1B) with per-GPU swap, our synchronous stand-in for "2BW Swap"; see the
    module docs."""
    mode = "1f1b-swap-r" if recompute else "1f1b-swap"
    return _pipeline_swap("1f1b", mode, profile, config, devices, minibatch, recompute)


def _dp_swap_r(profile: Profile, config: Configuration, devices: int, minibatch: int) -> TaskGraph:
    graph = dp_swap(profile, config, devices, minibatch, recompute=True)
    graph.mode = "dp-swap-r"
    return graph


BASELINES: dict[str, Callable[[Profile, Configuration, int, int], TaskGraph]] = {
    "gpipe-swap": lambda p, c, n, b: gpipe_swap(p, c, n, b, recompute=False),
    "gpipe-swap-r": lambda p, c, n, b: gpipe_swap(p, c, n, b, recompute=True),
    "1f1b-swap": lambda p, c, n, b: one_f_one_b_swap(p, c, n, b, recompute=False),
    "1f1b-swap-r": lambda p, c, n, b: one_f_one_b_swap(p, c, n, b, recompute=True),
    "dp-swap-r": _dp_swap_r,
}
