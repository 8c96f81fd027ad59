"""Task-graph generation for every mode (§4.3.2): Harmony's `pp` and `dp`, and per-GPU-swap baselines.

Each generator unrolls one iteration of a configuration into tasks bound to devices, with every
tensor's route. Sizes come from the profile, so the graph's bytes are the bytes the runtime moves.

- ``pp`` (wrap-around pipeline): packs P_F + reversed(P_B), the last pack shared (its task runs
  forward, loss and backward: jit-compute), task i on device i mod N; each task runs its pack
  over all microbatches of the minibatch (input-batch grouping); activations and gradients go
  to the next task's device (p2p swaps); weights come from the host once per task and leave once
  after the jit-update that follows each backward pack.
- ``dp`` (Harmony DP): every device runs every pack over its share of the minibatch with grouping;
  activations between packs of one device go through host memory; gradients are reduced in host
  memory and the update runs once per pack, on the host or replicated on the devices.
- ``dp-swap``: data parallelism with per-GPU memory virtualization (§2): no grouping, each
  microbatch brings every pack's weights in and out in both passes, and each device updates.
"""

from __future__ import annotations

from dataclasses import dataclass

from harmony.scheduler.profiles import Profile
from harmony.scheduler.tasks import HOST, Channel, Configuration, Kind, Task, TaskGraph, Transfer, microbatch_sizes

MODES = ("pp", "dp", "dp-swap")


@dataclass
class _Sizes:
    """Byte sizes of a pack's tensors, from the profile."""

    profile: Profile

    def w(self, first: int, last: int) -> int:
        return sum(layer.w_bytes for layer in self.profile.layers[first:last + 1])

    def b(self, first: int, last: int) -> int:
        return sum(layer.b_bytes for layer in self.profile.layers[first:last + 1])

    def dw(self, first: int, last: int) -> int:
        return sum(layer.dw_bytes for layer in self.profile.layers[first:last + 1])

    def k(self, first: int, last: int) -> int:
        return sum(layer.k_bytes for layer in self.profile.layers[first:last + 1])

    def x(self, layer: int, u: int) -> int:
        return int(round(self.profile.layers[layer].at("x_bytes", u)))

    def dx(self, layer: int, u: int) -> int:
        return int(round(self.profile.layers[layer].at("dx_bytes", u)))

    def y(self, layer: int, u: int) -> int:
        return int(round(self.profile.layers[layer].at("y_bytes", u)))


class _Builder:
    """Accumulates tasks with fresh ids."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(self, **kwargs) -> Task:
        task = Task(id=len(self.tasks), **kwargs)
        self.tasks.append(task)
        return task


def _route(src_device: int, dst_device: int) -> tuple[Channel, int | None]:
    return (Channel.LOCAL, None) if src_device == dst_device else (Channel.P2P, src_device)


def _state_inputs(sz: _Sizes, first: int, last: int) -> list[Transfer]:
    inputs = [Transfer("W", Channel.SWAP, sz.w(first, last))]
    if sz.b(first, last):
        inputs.append(Transfer("B", Channel.SWAP, sz.b(first, last)))
    return inputs


def _buffer_out(sz: _Sizes, first: int, last: int) -> list[Transfer]:
    return [Transfer("B", Channel.SWAP, sz.b(first, last))] if sz.b(first, last) else []


def _device_update(sz: _Sizes, task: Task) -> None:
    """jit-update on the device right after the pack's last backward: state in, new state out."""
    task.update = "device"
    task.inputs.append(Transfer("K", Channel.SWAP, sz.k(task.first, task.last)))
    task.outputs.append(Transfer("W", Channel.SWAP, sz.w(task.first, task.last)))
    task.outputs.append(Transfer("K", Channel.SWAP, sz.k(task.first, task.last)))


def _check(config: Configuration, layers: int) -> None:
    for name, packs in (("P_F", config.packs_f), ("P_B", config.packs_b)):
        expected = 0
        for first, last in packs:
            if first != expected or last < first:
                raise ValueError(f"{name} {packs} is not a contiguous packing of layers 0..{layers - 1}")
            expected = last + 1
        if expected != layers:
            raise ValueError(f"{name} {packs} does not cover layers 0..{layers - 1}")
    if config.packs_f[-1] != config.packs_b[-1]:
        raise ValueError(f"the last pack must be shared by P_F and P_B (jit-compute): {config.packs_f[-1]} vs {config.packs_b[-1]}")


def _stash_points(config: Configuration) -> set[int]:
    """Layers whose input the backward pass recomputes from: starts of P_B packs, except the last
    pack (no recompute) and layer 0 (its input is the minibatch, already in host memory)."""
    return {first for first, _ in config.packs_b[:-1] if first > 0}


def _share(total: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, size) of part ``index`` when ``total`` samples are split as evenly as possible."""
    base, extra = divmod(total, parts)
    size = base + (1 if index < extra else 0)
    offset = index * base + min(index, extra)
    return offset, size


# --------------------------------------------------------------------------- pp
def wrap_around_pipeline(profile: Profile, config: Configuration, devices: int, minibatch: int, update: str = "device") -> TaskGraph:
    """Harmony PP: FWD packs, the jit-compute pack, BWD packs in reverse; task i on device i mod N."""
    _check(config, len(profile.layers))
    sz = _Sizes(profile)
    b = _Builder()
    f_sizes = microbatch_sizes(minibatch, config.u_f)
    b_sizes = microbatch_sizes(minibatch, config.u_b)
    stash = _stash_points(config)
    stash_task: dict[int, int] = {}
    chain = len(config.packs_f) - 1 + len(config.packs_b)
    device = [i % devices for i in range(chain)]

    prev: Task | None = None
    for i, (first, last) in enumerate(config.packs_f[:-1]):
        task = b.add(device=device[i], kind=Kind.FWD, first=first, last=last, microbatches=list(f_sizes))
        task.inputs += _state_inputs(sz, first, last)
        for j, size in enumerate(f_sizes):
            if prev is None:
                task.inputs.append(Transfer("X", Channel.SWAP, sz.x(first, size), microbatch=j))
            else:
                channel, peer = _route(prev.device, task.device)
                task.inputs.append(Transfer("X", channel, sz.x(first, size), peer=peer, task=prev.id, microbatch=j))
            channel, peer = _route(task.device, device[i + 1])
            task.outputs.append(Transfer("Y", channel, sz.y(last, size), peer=device[i + 1] if peer is not None else None, microbatch=j))
            for s in sorted(p for p in stash if first <= p <= last):
                task.outputs.append(Transfer("Xs", Channel.SWAP, sz.x(s, size), microbatch=j))
                stash_task[s] = task.id
        task.outputs += _buffer_out(sz, first, last)
        prev = task

    bwd_packs = list(reversed(config.packs_b))
    for k, (first, last) in enumerate(bwd_packs):
        i = len(config.packs_f) - 1 + k
        loss = k == 0
        task = b.add(device=device[i], kind=Kind.BWD, first=first, last=last, microbatches=list(b_sizes), loss=loss)
        task.inputs += _state_inputs(sz, first, last)
        for j, size in enumerate(b_sizes):
            if loss:
                if prev is None:
                    task.inputs.append(Transfer("X", Channel.SWAP, sz.x(first, size), microbatch=j))
                else:
                    channel, peer = _route(prev.device, task.device)
                    task.inputs.append(Transfer("X", channel, sz.x(first, size), peer=peer, task=prev.id, microbatch=j))
            else:
                # the recompute starts from the stash, or from the minibatch itself for layer 0
                task.inputs.append(Transfer("Xs" if first > 0 else "X", Channel.SWAP, sz.x(first, size),
                                            task=stash_task.get(first), microbatch=j))
                channel, peer = _route(prev.device, task.device)
                task.inputs.append(Transfer("dY", channel, sz.y(last, size), peer=peer, task=prev.id, microbatch=j))
            if first > 0:
                nxt = device[i + 1]
                channel, peer = _route(task.device, nxt)
                task.outputs.append(Transfer("dX", channel, sz.dx(first, size), peer=nxt if peer is not None else None, microbatch=j))
        if loss:
            task.outputs += _buffer_out(sz, first, last)
        _finish_update(b, sz, task, update)
        prev = task
    return TaskGraph(mode="pp", devices=devices, minibatch=minibatch, config=config, tasks=b.tasks)


def _finish_update(b: _Builder, sz: _Sizes, task: Task, update: str) -> None:
    if update == "device":
        _device_update(sz, task)
    elif update == "host":
        task.update = "host"
        task.outputs.append(Transfer("dW", Channel.SWAP, sz.dw(task.first, task.last)))
        b.add(device=HOST, kind=Kind.UPD, first=task.first, last=task.last, microbatches=[],
              inputs=[Transfer("dW", Channel.SHM, 0, task=task.id)])
    else:
        raise ValueError(f"update must be 'device' or 'host', got {update!r}")


# --------------------------------------------------------------------------- dp
def harmony_dp(profile: Profile, config: Configuration, devices: int, minibatch: int, update: str = "host") -> TaskGraph:
    """Harmony DP: each device runs every pack over its share with input-batch grouping; gradients
    are reduced in host memory; one update per pack (on the host, or replicated on each device)."""
    _check(config, len(profile.layers))
    if minibatch < devices:
        raise ValueError(f"dp needs at least one sample per device: minibatch {minibatch} < {devices} devices")
    sz = _Sizes(profile)
    b = _Builder()
    stash = _stash_points(config)
    bwd_tasks: dict[tuple[int, int], list[Task]] = {}
    per_device: list[list[Task]] = []
    for d in range(devices):
        offset, share = _share(minibatch, devices, d)
        f_sizes = microbatch_sizes(share, config.u_f)
        b_sizes = microbatch_sizes(share, config.u_b)
        produced: dict[int, int] = {}  # layer -> task whose output (in host memory) is that layer's input
        prev: Task | None = None
        for first, last in config.packs_f[:-1]:
            task = b.add(device=d, kind=Kind.FWD, first=first, last=last, microbatches=list(f_sizes), offset=offset)
            task.inputs += _state_inputs(sz, first, last)
            for j, size in enumerate(f_sizes):
                task.inputs.append(Transfer("X", Channel.SWAP, sz.x(first, size), task=prev.id if prev else None, microbatch=j))
                task.outputs.append(Transfer("Y", Channel.SWAP, sz.y(last, size), microbatch=j))
                for s in sorted(p for p in stash if first < p <= last):
                    task.outputs.append(Transfer("Xs", Channel.SWAP, sz.x(s, size), microbatch=j))
            for s in range(first + 1, last + 1):
                produced[s] = task.id
            produced[last + 1] = task.id
            task.outputs += _buffer_out(sz, first, last)
            prev = task
        tasks = []
        for k, (first, last) in enumerate(reversed(config.packs_b)):
            loss = k == 0
            task = b.add(device=d, kind=Kind.BWD, first=first, last=last, microbatches=list(b_sizes), offset=offset, loss=loss)
            task.inputs += _state_inputs(sz, first, last)
            for j, size in enumerate(b_sizes):
                name = "X" if loss or first == 0 else "Xs"
                task.inputs.append(Transfer(name, Channel.SWAP, sz.x(first, size), task=produced.get(first), microbatch=j))
                if not loss:
                    task.inputs.append(Transfer("dY", Channel.SWAP, sz.y(last, size), task=tasks[-1].id, microbatch=j))
                if first > 0:
                    task.outputs.append(Transfer("dX", Channel.SWAP, sz.dx(first, size), microbatch=j))
            if loss:
                task.outputs += _buffer_out(sz, first, last)
            task.update = update
            task.outputs.append(Transfer("dW", Channel.SWAP, sz.dw(first, last)))
            bwd_tasks.setdefault((first, last), []).append(task)
            tasks.append(task)
        per_device.append(tasks)

    # one update per pack once every device's gradient of it is in host memory
    for first, last in reversed(config.packs_b):
        sources = bwd_tasks[(first, last)]
        if update == "host":
            b.add(device=HOST, kind=Kind.UPD, first=first, last=last, microbatches=[],
                  inputs=[Transfer("dW", Channel.SHM, 0, task=t.id) for t in sources])
        elif update == "device":
            for t in sources:  # replicated update: every device refreshes its own copy (§3's Harmony DP)
                upd = b.add(device=t.device, kind=Kind.UPD, first=first, last=last, microbatches=[],
                            inputs=[Transfer("dW", Channel.SWAP, sz.dw(first, last), task=s.id) for s in sources[:1]]
                            + [Transfer("dW", Channel.SHM, 0, task=s.id) for s in sources[1:]]
                            + [Transfer("K", Channel.SWAP, sz.k(first, last))],
                            outputs=[Transfer("W", Channel.SWAP, sz.w(first, last)), Transfer("K", Channel.SWAP, sz.k(first, last))])
                upd.inputs.insert(0, Transfer("W", Channel.LOCAL, 0, task=t.id))
        else:
            raise ValueError(f"update must be 'device' or 'host', got {update!r}")
    return TaskGraph(mode="dp", devices=devices, minibatch=minibatch, config=config, tasks=_ordered(b.tasks))


def _ordered(tasks: list[Task]) -> list[Task]:
    """A topological order that keeps each device's order (producers before consumers)."""
    done: set[int] = set()
    remaining = list(tasks)
    ordered: list[Task] = []
    while remaining:
        progressed = False
        for task in list(remaining):
            if task.deps() <= done and all(
                t.id in done for t in remaining if t.device == task.device and t.id < task.id
            ):
                ordered.append(task)
                done.add(task.id)
                remaining.remove(task)
                progressed = True
        if not progressed:
            raise ValueError("task graph has a dependency cycle")
    return ordered


# --------------------------------------------------------------------------- dp-swap
def dp_swap(profile: Profile, config: Configuration, devices: int, minibatch: int, recompute: bool = True) -> TaskGraph:
    """Data parallelism with per-GPU swap (§2): no grouping; every microbatch swaps every pack's
    weights in and out in the forward and the backward; each device updates its replica at the end."""
    _check(config, len(profile.layers))
    sz = _Sizes(profile)
    b = _Builder()
    packs = config.packs_f
    for d in range(devices):
        offset, share = _share(minibatch, devices, d)
        sizes = microbatch_sizes(share, config.u_f)
        last_bwd: dict[tuple[int, int], Task] = {}
        for j, size in enumerate(sizes):
            prev: Task | None = None
            for first, last in packs[:-1]:  # the last pack's forward runs with the loss and its backward
                task = b.add(device=d, kind=Kind.FWD, first=first, last=last, microbatches=[size],
                             offset=offset + j * config.u_f)
                task.inputs += _state_inputs(sz, first, last)
                task.inputs.append(Transfer("X", Channel.SWAP if prev is None else Channel.LOCAL,
                                            sz.x(first, size) if prev is None else 0, task=prev.id if prev else None))
                task.outputs.append(Transfer("W", Channel.SWAP, sz.w(first, last)))  # evicted
                stashed = [first] if recompute else list(range(first, last + 1))
                for s in stashed:
                    if s > 0:
                        task.outputs.append(Transfer("Xs", Channel.SWAP, sz.x(s, size)))
                prev = task
            for k, (first, last) in enumerate(reversed(packs)):
                task = b.add(device=d, kind=Kind.BWD, first=first, last=last, microbatches=[size],
                             offset=offset + j * config.u_f, loss=k == 0)
                task.inputs += _state_inputs(sz, first, last)
                if k == 0:
                    task.inputs.append(Transfer("X", Channel.SWAP if prev is None else Channel.LOCAL,
                                                sz.x(first, size) if prev is None else 0, task=prev.id if prev else None))
                else:
                    stashed = [first] if recompute else list(range(first, last + 1))
                    for s in stashed:
                        if s > 0:
                            task.inputs.append(Transfer("Xs", Channel.SWAP, sz.x(s, size), task=prev.id))
                        else:
                            task.inputs.append(Transfer("X", Channel.SWAP, sz.x(0, size)))
                if (first, last) in last_bwd:
                    task.inputs.append(Transfer("dW", Channel.SWAP, sz.dw(first, last), task=last_bwd[(first, last)].id))
                task.outputs.append(Transfer("W", Channel.SWAP, sz.w(first, last)))
                task.outputs.append(Transfer("dW", Channel.SWAP, sz.dw(first, last)))
                last_bwd[(first, last)] = task
                prev = task
        for first, last in packs:
            b.add(device=d, kind=Kind.UPD, first=first, last=last, microbatches=[],
                  inputs=[Transfer("W", Channel.SWAP, sz.w(first, last)),
                          Transfer("dW", Channel.SWAP, sz.dw(first, last), task=last_bwd[(first, last)].id),
                          Transfer("K", Channel.SWAP, sz.k(first, last))],
                  outputs=[Transfer("W", Channel.SWAP, sz.w(first, last)), Transfer("K", Channel.SWAP, sz.k(first, last))])
    return TaskGraph(mode="dp-swap", devices=devices, minibatch=minibatch, config=config, tasks=b.tasks)


def generate(mode: str, profile: Profile, config: Configuration, devices: int, minibatch: int, **options) -> TaskGraph:
    """The task graph of one iteration of ``config`` in ``mode``."""
    if devices < 1 or minibatch < 1:
        raise ValueError(f"need at least one device and one sample, got {devices} devices and minibatch {minibatch}")
    if mode == "pp":
        return wrap_around_pipeline(profile, config, devices, minibatch, **options)
    if mode == "dp":
        return harmony_dp(profile, config, devices, minibatch, **options)
    if mode == "dp-swap":
        return dp_swap(profile, config, devices, minibatch, **options)
    raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
