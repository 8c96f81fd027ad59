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
- In ``pp`` and ``dp`` a backward pack recomputes its activations from the stash its forward left
  in host memory, or, where the configuration keeps them (``Configuration.keep``,
  ``keepable_packs``), reads them from its forward on the same device (``A`` on ``LOCAL``) with the
  forward's state (``W`` on ``LOCAL``), and recomputes nothing.
- ``dp-swap``: data parallelism with per-GPU memory virtualization (§2): no grouping, each
  microbatch brings every pack's weights in and out in both passes, and each device updates.

Ablation switches (the paper's Fig. 14), each on by default and turned off one at a time to
measure what it buys: ``grouping=False`` (``pp``, ``dp``) splits every task into one task per
microbatch, each swapping its pack's weights in and leaving its gradient in host memory, where the
microbatches' gradients add up; ``jit_update=False`` (``pp``) steps each pack in a UPD task on its
device after the whole backward pass instead of right after the pack's backward; ``p2p=False``
(``pp``) sends activations and gradients between devices through host memory (SWAP).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harmony.profiling.profiles import Profile
from harmony.scheduler.tasks import HOST, Channel, Configuration, Kind, Task, TaskGraph, Transfer, microbatch_sizes


@dataclass
class Sizes:
    """Byte sizes of a pack's tensors, from the profile.

    A tied weight held by several layers of one pack moves once (``w``, ``dw``, ``k``). Its update
    belongs to the pack of its lowest layer: ``owned_*`` leave out the tied weights another pack
    owns, ``handed_dw`` is the gradient a pack hands to the owner, ``received_dw`` what the
    owner receives.
    """

    profile: Profile
    # (attribute, first, last) -> bytes: a graph asks for the same pack's sizes once per microbatch
    _memo: dict[tuple[str, int, int], int] = field(default_factory=dict, repr=False)

    def _layer_sum(self, attr: str, first: int, last: int) -> int:
        return sum(getattr(layer, attr) for layer in self.profile.layers[first:last + 1])

    def _dedup(self, attr: str, first: int, last: int) -> int:
        key = (attr, first, last)
        if key not in self._memo:
            self._memo[key] = self._deduplicated(attr, first, last)
        return self._memo[key]

    def _deduplicated(self, attr: str, first: int, last: int) -> int:
        total = self._layer_sum(attr, first, last)
        for tie in self.profile.ties:
            inside = sum(1 for l in tie.layers if first <= l <= last)
            if inside > 1:
                total -= (inside - 1) * getattr(tie, attr)
        return total

    def _foreign(self, attr: str, first: int, last: int) -> int:
        """Bytes of the tied weights in the pack whose update another pack owns."""
        return sum(getattr(tie, attr) for tie in self.profile.ties
                   if any(first <= l <= last for l in tie.layers) and not first <= min(tie.layers) <= last)

    def w(self, first: int, last: int) -> int:
        return self._dedup("w_bytes", first, last)

    def b(self, first: int, last: int) -> int:
        return sum(layer.b_bytes for layer in self.profile.layers[first:last + 1])

    def dw(self, first: int, last: int) -> int:
        return self._dedup("dw_bytes", first, last)

    def k(self, first: int, last: int) -> int:
        return self._dedup("k_bytes", first, last)

    def stepped_w(self, first: int, last: int) -> int:
        """The weights an update of the pack changes and writes back: the trainable ones it owns,
        each the size of its gradient. Frozen weights never change, so they never go back."""
        return self.owned_dw(first, last)

    def lowest_trainable(self) -> int:
        """The first layer a gradient must reach: below it every parameter is frozen and the
        minibatch needs no gradient, so no backward runs there (the whole model when none is
        trainable)."""
        return next((layer.index for layer in self.profile.layers if layer.dw_bytes), len(self.profile.layers))

    def trainable(self, first: int, last: int) -> bool:
        """Whether the pack has anything to update: no UPD task, no optimizer state otherwise."""
        return self.owned_dw(first, last) > 0

    def owned_dw(self, first: int, last: int) -> int:
        return self.dw(first, last) - self._foreign("dw_bytes", first, last)

    def owned_k(self, first: int, last: int) -> int:
        return self.k(first, last) - self._foreign("k_bytes", first, last)

    def handed_dw(self, first: int, last: int) -> int:
        return self._foreign("dw_bytes", first, last)

    def received(self, first: int, last: int) -> list[tuple[int, list[int]]]:
        """(gradient bytes, the other layers holding it) of each tied weight this pack owns and
        other packs also hold."""
        out = []
        for tie in self.profile.ties:
            if first <= min(tie.layers) <= last:
                others = [l for l in tie.layers if not first <= l <= last]
                if others:
                    out.append((tie.dw_bytes, others))
        return out

    def x(self, layer: int, u: int) -> int:
        return int(round(self.profile.layers[layer].at("x_bytes", u)))

    def dx(self, layer: int, u: int) -> int:
        return int(round(self.profile.layers[layer].at("dx_bytes", u)))

    def y(self, layer: int, u: int) -> int:
        return int(round(self.profile.layers[layer].at("y_bytes", u)))

    def kept(self, first: int, last: int, u: int) -> int:
        """A microbatch's activations kept from the pack's forward to its backward (``A``)."""
        return self.profile.pack_kept_bytes(first, last, u)

    def swapped(self, first: int, last: int, u: int) -> int:
        """Of those, what a swapping pack sends through host memory (``As``)."""
        return self.profile.pack_swapped_bytes(first, last, u)


class _Builder:
    """Accumulates tasks with fresh ids."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(self, **kwargs) -> Task:
        task = Task(id=len(self.tasks), **kwargs)
        self.tasks.append(task)
        return task


def state_inputs(sz: Sizes, first: int, last: int) -> list[Transfer]:
    inputs = [Transfer("W", Channel.SWAP, sz.w(first, last))]
    if sz.b(first, last):
        inputs.append(Transfer("B", Channel.SWAP, sz.b(first, last)))
    return inputs


def buffer_out(sz: Sizes, first: int, last: int) -> list[Transfer]:
    return [Transfer("B", Channel.SWAP, sz.b(first, last))] if sz.b(first, last) else []


def _device_update(sz: Sizes, task: Task, earlier: list[Task] = ()) -> None:
    """jit-update on the device right after the pack's last backward: state in, new state out.
    A tied weight is stepped by the pack of its lowest layer, which runs last in the backward:
    the other packs hand their gradient of it over through host memory (``earlier``: the tasks
    before this one, to find them)."""
    first, last = task.first, task.last
    task.update = "device"
    for nbytes, layers in sz.received(first, last):
        for other in earlier:
            if other.kind == Kind.BWD and any(other.first <= l <= other.last for l in layers):
                task.inputs.append(Transfer("dW", Channel.SWAP, nbytes, task=other.id))
                break
    task.inputs.append(Transfer("K", Channel.SWAP, sz.owned_k(first, last)))
    task.outputs += update_outputs(sz, first, last)
    if sz.handed_dw(first, last):
        task.outputs.append(Transfer("dW", Channel.SWAP, sz.handed_dw(first, last)))


def check_packing(config: Configuration, layers: int) -> None:
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


def keepable_packs(mode: str, config: Configuration, devices: int, grouping: bool = True) -> tuple[tuple[int, int], ...]:
    """The backward packs whose activations may stay on the device from their forward, so that their
    backward recomputes nothing: a pack that is also a forward pack (not the last, whose one task
    runs forward, loss and backward), at one microbatch size in both passes (with input-batch
    grouping: one forward and one backward task over it), whose two tasks run on one device, since
    what autograd recorded cannot leave its process. In ``dp`` every device runs both; in ``pp`` the
    wrap-around puts forward pack i on device i mod N and the backward at chain position j on
    device j mod N (with two devices, every pack)."""
    if mode not in ("pp", "dp") or not grouping or config.u_f != config.u_b:
        return ()
    forward = {tuple(p): i for i, p in enumerate(config.packs_f[:-1])}
    out = []
    for k, pack in enumerate(reversed(config.packs_b)):
        i = forward.get(tuple(pack))
        if k == 0 or i is None:
            continue
        if mode == "pp" and i % devices != (len(config.packs_f) - 1 + k) % devices:
            continue
        out.append(tuple(pack))
    return tuple(sorted(out))


def _check_keep(mode: str, config: Configuration, devices: int, grouping: bool) -> dict[tuple[int, int], bool]:
    """The packs whose activations ``config`` keeps (False) or swaps (True), each checked to be
    keepable (the same conditions hold for both: the backward takes the forward's autograd graph)."""
    keep = {tuple(p): False for p in config.keep}
    both = keep.keys() & {tuple(p) for p in config.swap}
    if both:
        raise ValueError(f"{config} both keeps and swaps the activations of {sorted(both)}")
    keep.update({tuple(p): True for p in config.swap})
    wrong = set(keep) - set(keepable_packs(mode, config, devices, grouping))
    if wrong:
        raise ValueError(f"{mode} cannot keep the activations of {sorted(wrong)} for {config} on {devices} device(s): "
                         "a kept pack is a forward and a backward pack at one microbatch size, both on one device")
    return keep


def _kept_backward(sz: Sizes, fwd: Task, task: Task, swapped: bool) -> None:
    """A backward over the pack whose forward ``fwd`` kept its activations: its state stays on the
    device from the forward (whose autograd graph holds it, and whose leaves collect the gradient),
    and each microbatch's activations come from the forward's microbatch: on the device (A, LOCAL),
    or where the pack swaps them, the pack's input and output there and the rest (As) through host
    memory."""
    fwd.keep = task.keep = True
    first, last = fwd.first, fwd.last
    task.inputs.append(Transfer("W", Channel.LOCAL, 0, task=fwd.id))
    if not swapped:
        connect(fwd, task, "A", "A", Channel.LOCAL, lambda n: sz.kept(first, last, n))
        return
    connect(fwd, task, "A", "A", Channel.LOCAL, lambda n: sz.kept(first, last, n) - sz.swapped(first, last, n))
    connect(fwd, task, "As", "As", Channel.SWAP, lambda n: sz.swapped(first, last, n))


DATA_PARALLEL = ("dp", "dp-swap", "dp-swap-r")  # modes that give each device its share of the minibatch


def split_samples(mode: str, minibatch: int, devices: int) -> list[int]:
    """The sample counts ``mode``'s tasks cut into microbatches: each device's share in the
    data-parallel modes, the whole minibatch in the others."""
    if mode in DATA_PARALLEL:
        return sorted({_share(minibatch, devices, d)[1] for d in range(devices)})
    return [minibatch]


def _share(total: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, size) of part ``index`` when ``total`` samples are split as evenly as possible."""
    base, extra = divmod(total, parts)
    size = base + (1 if index < extra else 0)
    offset = index * base + min(index, extra)
    return offset, size


def connect(producer: Task | None, consumer: Task, out_name: str, in_name: str, channel: Channel,
             nbytes, out_channel: Channel | None = None) -> None:
    """Route a per-microbatch activation or gradient from ``producer`` to ``consumer``.

    One transfer per consumer microbatch. Its output side is attached to the producer's microbatch
    that completes those samples, so that a consumer with another microbatch size (U_F ≠ U_B)
    starts as soon as its samples exist; ``nbytes(size)`` gives the bytes of ``size`` samples.
    ``producer=None`` reads from the minibatch in host memory.
    """
    sizes: dict[int, int] = {}  # bytes by microbatch size: all but the last are alike
    if producer is None:
        for j, size in enumerate(consumer.microbatches):
            n = sizes[size] if size in sizes else sizes.setdefault(size, nbytes(size))
            consumer.inputs.append(Transfer(in_name, Channel.SWAP, n, microbatch=j))
        return
    peer_in = producer.device if channel == Channel.P2P else None
    peer_out = consumer.device if channel == Channel.P2P else None
    out_ch = out_channel or channel
    made = producer.microbatches
    # the producer's microbatch that completes the samples so far (its last, if none does)
    k, done = (0, made[0]) if made else (-1, 0)
    start = 0
    for j, size in enumerate(consumer.microbatches):
        n = sizes[size] if size in sizes else sizes.setdefault(size, nbytes(size))
        start += size
        while done < start and k < len(made) - 1:
            k += 1
            done += made[k]
        producer.outputs.append(Transfer(out_name, out_ch, n, peer=peer_out, task=consumer.id, microbatch=k))
        consumer.inputs.append(Transfer(in_name, channel, n, peer=peer_in, task=producer.id, microbatch=j))


def _after_buffers(writers: dict[tuple[int, int], Task], sz: Sizes, task: Task) -> None:
    """Buffers (BatchNorm statistics) change in every forward over them, and the reference changes
    them microbatch after microbatch in minibatch order: a task that updates a pack's buffers on
    another device than the last one to do so waits for it (a pure dependency, no bytes)."""
    pack = (task.first, task.last)
    if not sz.b(*pack):
        return
    before = writers.get(pack)
    if before is not None and before.device != task.device:
        task.inputs.append(Transfer("B", Channel.SHM, 0, task=before.id))
    writers[pack] = task


def _between(src: Task, dst: Task) -> Channel:
    return Channel.LOCAL if src.device == dst.device else Channel.P2P


# --------------------------------------------------------------------------- pp
def _groups(samples: int, u: int, grouping: bool, offset: int = 0) -> list[tuple[int, list[int]]]:
    """(first sample, microbatch sizes) of each task a pack runs over ``samples`` samples: one
    group of all microbatches with input-batch grouping, one group per microbatch without."""
    sizes = microbatch_sizes(samples, u)
    if grouping:
        return [(offset, sizes)]
    starts = [offset + j * u for j in range(len(sizes))]
    return [(start, [size]) for start, size in zip(starts, sizes)]


def _via_host(src: Task, dst: Task) -> Channel:
    """``_between`` with p2p swaps off: what crosses devices goes through host memory."""
    return Channel.LOCAL if src.device == dst.device else Channel.SWAP


def _check_switches(config: Configuration, update: str, grouping: bool, jit_update: bool) -> None:
    if not grouping and config.u_f != config.u_b:
        raise ValueError("without input-batch grouping each backward task reads one forward task's microbatch: "
                         f"U_F ({config.u_f}) must equal U_B ({config.u_b})")
    if not jit_update and update != "device":
        raise ValueError(f"jit_update=False defers the device update; it does not apply to update={update!r}")


def wrap_around_pipeline(profile: Profile, config: Configuration, devices: int, minibatch: int, update: str = "device",
                         grouping: bool = True, jit_update: bool = True, p2p: bool = True,
                         device_steps: tuple[tuple[int, int], ...] = ()) -> TaskGraph:
    """Harmony PP: FWD packs, the jit-compute pack, BWD packs in reverse; task i on device i mod N
    (each of its tasks, one per microbatch, when ``grouping`` is off; see the module docs).
    ``device_steps``: backward packs stepped on their device where ``update`` is "host" (the pack
    whose backward ends the iteration and whose forward begins the next, so that the next one need
    not wait for the host: ``search.boundary_steps``)."""
    check_packing(config, len(profile.layers))
    _check_switches(config, update, grouping, jit_update)
    device_steps = tuple(tuple(p) for p in device_steps)
    packs_b = {tuple(p) for p in config.packs_b}
    if device_steps and (update != "host" or not packs_b.issuperset(device_steps)):
        raise ValueError(f"device_steps must be backward packs of a plan whose updates run on the host; got "
                         f"{device_steps} with update={update!r} and backward packs {sorted(packs_b)}")
    keep = _check_keep("pp", config, devices, grouping)
    sz = Sizes(profile)
    b = _Builder()
    f_groups = _groups(minibatch, config.u_f, grouping)
    b_groups = _groups(minibatch, config.u_b, grouping)
    between = _between if p2p else _via_host
    fwd_of_layer: dict[int, list[Task]] = {}  # the FWD tasks (one per group) whose pack contains the layer
    chain = len(config.packs_f) - 1 + len(config.packs_b)
    deferred: list[list[Task]] = []

    prev: list[Task] | None = None
    for i, (first, last) in enumerate(config.packs_f[:-1]):
        tasks = []
        for g, (offset, sizes) in enumerate(f_groups):
            task = b.add(device=i % devices, kind=Kind.FWD, first=first, last=last, microbatches=list(sizes), offset=offset)
            task.inputs += state_inputs(sz, first, last)
            src = prev[g] if prev else None
            connect(src, task, "Y", "X", between(src, task) if src else Channel.SWAP, lambda n, f=first: sz.x(f, n))
            task.outputs += buffer_out(sz, first, last)
            tasks.append(task)
        for layer in range(first, last + 1):
            fwd_of_layer[layer] = tasks
        prev = tasks

    lowest = sz.lowest_trainable()
    for k, (first, last) in enumerate(reversed(config.packs_b)):
        i = len(config.packs_f) - 1 + k
        loss = k == 0
        if last < lowest and not loss:  # frozen all the way down: nothing to compute a gradient for
            chain -= 1
            continue
        tasks = []
        for g, (offset, sizes) in enumerate(b_groups):
            task = b.add(device=i % devices, kind=Kind.BWD, first=first, last=last, microbatches=list(sizes),
                         offset=offset, loss=loss)
            if (first, last) in keep:
                _kept_backward(sz, fwd_of_layer[first][g], task, keep[(first, last)])
                connect(prev[g], task, "dX", "dY", between(prev[g], task), lambda n, l=last: sz.y(l, n))
                tasks.append(task)
                continue
            task.inputs += state_inputs(sz, first, last)
            if loss:
                src = prev[g] if prev else None
                connect(src, task, "Y", "X", between(src, task) if src else Channel.SWAP, lambda n, f=first: sz.x(f, n))
                task.outputs += buffer_out(sz, first, last)
            else:
                # the recompute starts from the stash the forward left in host memory (or the minibatch)
                stash = fwd_of_layer[first][g] if first > 0 else None
                connect(stash, task, "Xs", "Xs" if first > 0 else "X", Channel.SWAP, lambda n, f=first: sz.x(f, n))
                connect(prev[g], task, "dX", "dY", between(prev[g], task), lambda n, l=last: sz.y(l, n))
            tasks.append(task)
        if jit_update:
            _finish_update(b, sz, tasks, "device" if (first, last) in device_steps else update)
        else:
            _leave_gradients(sz, tasks)
            deferred.append(tasks)
        prev = tasks
    for tasks in deferred:  # jit-update off: every pack is stepped after the whole backward pass
        _deferred_update(b, sz, tasks)
    assert not grouping or len([t for t in b.tasks if t.kind != Kind.UPD]) == chain
    return TaskGraph(mode="pp", devices=devices, minibatch=minibatch, config=config, tasks=_ordered(b.tasks))


def _leave_gradients(sz: Sizes, tasks: list[Task]) -> None:
    """dW -> SWAP: the tasks leave their gradients in host memory (where they add up) for an update
    elsewhere."""
    for task in tasks:
        if sz.dw(task.first, task.last):
            task.outputs.append(Transfer("dW", Channel.SWAP, sz.dw(task.first, task.last)))


def _tie_sources(tasks: list[Task], earlier: list[Task], sz: Sizes) -> list[Task]:
    """The BWD tasks of other packs that hand over a gradient of a tied weight this pack owns."""
    first, last = tasks[0].first, tasks[0].last
    held = {l for _, layers in sz.received(first, last) for l in layers}
    own = {t.id for t in tasks}
    return [t for t in earlier if t.kind == Kind.BWD and t.id not in own and any(t.first <= l <= t.last for l in held)]


def _gradient_dependencies(task: Task, sources: list[Task]) -> None:
    """Pure dependencies (SHM, no bytes) on the tasks whose gradients in host memory ``task`` sums."""
    task.inputs += [Transfer("dW", Channel.SHM, 0, task=s.id) for s in sources]


def _finish_update(b: _Builder, sz: Sizes, tasks: list[Task], update: str) -> None:
    """The update of a pack whose backward ran as ``tasks`` (one, or one per microbatch): a
    jit-update fused into the last task, or an offloaded update on the host."""
    first, last = tasks[0].first, tasks[0].last
    if not sz.trainable(first, last):  # frozen: at most a tied weight's gradient for its owner
        _leave_gradients(sz, tasks)
        return
    if update == "device":
        *earlier, final = tasks
        if not earlier:
            _device_update(sz, final, b.tasks[:-1])
            return
        # no grouping: the earlier microbatches' gradients wait in host memory; the step sums them
        # with the last one's (tied weights handed over included) and copies the sum in once
        _leave_gradients(sz, earlier)
        final.update = "device"
        final.inputs.append(Transfer("dW", Channel.SWAP, sz.owned_dw(first, last)))
        _gradient_dependencies(final, earlier + _tie_sources(tasks, b.tasks, sz))
        final.inputs.append(Transfer("K", Channel.SWAP, sz.owned_k(first, last)))
        final.outputs += update_outputs(sz, first, last)
        if sz.handed_dw(first, last):
            final.outputs.append(Transfer("dW", Channel.SWAP, sz.handed_dw(first, last)))
    elif update == "host":
        for task in tasks:
            task.update = "host"
        _leave_gradients(sz, tasks)
        b.add(device=HOST, kind=Kind.UPD, first=first, last=last, microbatches=[],
              inputs=[Transfer("dW", Channel.SHM, 0, task=t.id) for t in tasks])
    else:
        raise ValueError(f"update must be 'device' or 'host', got {update!r}")


def _deferred_update(b: _Builder, sz: Sizes, tasks: list[Task]) -> None:
    """A UPD task on the device of the pack's backward, after the whole backward pass: weights,
    the gradient summed in host memory and the optimizer state in; weights and state out."""
    first, last = tasks[0].first, tasks[0].last
    if not sz.trainable(first, last):
        return
    task = b.add(device=tasks[-1].device, kind=Kind.UPD, first=first, last=last, microbatches=[],
                 inputs=update_inputs(sz, first, last, tasks[-1].id), outputs=update_outputs(sz, first, last))
    _gradient_dependencies(task, tasks[:-1] + _tie_sources(tasks, b.tasks, sz))


# --------------------------------------------------------------------------- dp
def harmony_dp(profile: Profile, config: Configuration, devices: int, minibatch: int, update: str = "host",
               grouping: bool = True) -> TaskGraph:
    """Harmony DP: each device runs every pack over its share with input-batch grouping (one task
    per microbatch when ``grouping`` is off); gradients are reduced in host memory; one update per
    pack (on the host, or replicated on each device)."""
    check_packing(config, len(profile.layers))
    _check_switches(config, update, grouping, True)
    if minibatch < devices:
        raise ValueError(f"dp needs at least one sample per device: minibatch {minibatch} < {devices} devices")
    keep = _check_keep("dp", config, devices, grouping)
    sz = Sizes(profile)
    b = _Builder()
    bwd_tasks: dict[tuple[int, int], list[Task]] = {}
    writers: dict[tuple[int, int], Task] = {}  # the last task to update each pack's buffers
    lowest = sz.lowest_trainable()
    for d in range(devices):
        offset, share = _share(minibatch, devices, d)
        f_groups = _groups(share, config.u_f, grouping, offset)
        b_groups = _groups(share, config.u_b, grouping, offset)
        fwd_of_layer: dict[int, list[Task]] = {}
        prev: list[Task] | None = None
        for first, last in config.packs_f[:-1]:
            tasks = []
            for g, (start, sizes) in enumerate(f_groups):
                task = b.add(device=d, kind=Kind.FWD, first=first, last=last, microbatches=list(sizes), offset=start)
                task.inputs += state_inputs(sz, first, last)
                _after_buffers(writers, sz, task)
                # a group's activations do not fit on the device: they wait in host memory
                connect(prev[g] if prev else None, task, "Y", "X", Channel.SWAP, lambda n, f=first: sz.x(f, n))
                task.outputs += buffer_out(sz, first, last)
                tasks.append(task)
            for layer in range(first, last + 1):
                fwd_of_layer[layer] = tasks
            prev = tasks
        for k, (first, last) in enumerate(reversed(config.packs_b)):
            loss = k == 0
            if last < lowest and not loss:  # frozen all the way down: nothing to compute a gradient for
                break
            tasks = []
            for g, (start, sizes) in enumerate(b_groups):
                task = b.add(device=d, kind=Kind.BWD, first=first, last=last, microbatches=list(sizes), offset=start,
                             loss=loss)
                if (first, last) in keep:
                    _kept_backward(sz, fwd_of_layer[first][g], task, keep[(first, last)])
                    connect(prev[g], task, "dX", "dY", Channel.SWAP, lambda n, l=last: sz.y(l, n))
                elif loss:
                    task.inputs += state_inputs(sz, first, last)
                    connect(prev[g] if prev else None, task, "Y", "X", Channel.SWAP, lambda n, f=first: sz.x(f, n))
                    task.outputs += buffer_out(sz, first, last)
                    _after_buffers(writers, sz, task)
                else:
                    task.inputs += state_inputs(sz, first, last)
                    stash = fwd_of_layer[first][g] if first > 0 else None
                    connect(stash, task, "Xs", "Xs" if first > 0 else "X", Channel.SWAP, lambda n, f=first: sz.x(f, n))
                    connect(prev[g], task, "dX", "dY", Channel.SWAP, lambda n, l=last: sz.y(l, n))
                task.update = update
                _leave_gradients(sz, [task])
                bwd_tasks.setdefault((first, last), []).append(task)
                tasks.append(task)
            prev = tasks

    # one update per pack once every device's gradient of it is in host memory
    for first, last in reversed(config.packs_b):
        if not sz.trainable(first, last):
            continue
        sources = bwd_tasks[(first, last)]
        if update == "host":
            b.add(device=HOST, kind=Kind.UPD, first=first, last=last, microbatches=[],
                  inputs=[Transfer("dW", Channel.SHM, 0, task=t.id) for t in sources])
        elif update == "device":
            last_of = {t.device: t for t in sources}  # each device's last task over the pack keeps it resident
            for t in last_of.values():  # replicated update: every device refreshes its own copy (§3's Harmony DP)
                b.add(device=t.device, kind=Kind.UPD, first=first, last=last, microbatches=[],
                      inputs=[Transfer("W", Channel.LOCAL, 0, task=t.id),
                              Transfer("dW", Channel.SWAP, sz.owned_dw(first, last), task=sources[0].id)]
                      + [Transfer("dW", Channel.SHM, 0, task=s.id) for s in sources[1:]]
                      + [Transfer("K", Channel.SWAP, sz.owned_k(first, last))],
                      outputs=update_outputs(sz, first, last))
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
    check_packing(config, len(profile.layers))
    sz = Sizes(profile)
    b = _Builder()
    packs = config.packs_f
    writers: dict[tuple[int, int], Task] = {}  # the last task to update each pack's buffers
    for d in range(devices):
        offset, share = _share(minibatch, devices, d)
        sizes = microbatch_sizes(share, config.u_f)
        last_bwd: dict[tuple[int, int], Task] = {}
        for j, size in enumerate(sizes):
            prev: Task | None = None
            stashes: dict[int, tuple[Task, Transfer]] = {}  # layer -> (forward task, its stash output)
            for first, last in packs[:-1]:  # the last pack's forward runs with the loss and its backward
                task = b.add(device=d, kind=Kind.FWD, first=first, last=last, microbatches=[size],
                             offset=offset + j * config.u_f)
                task.inputs += state_inputs(sz, first, last)
                task.inputs.append(Transfer("X", Channel.SWAP if prev is None else Channel.LOCAL,
                                            sz.x(first, size) if prev is None else 0, task=prev.id if prev else None))
                task.outputs.append(Transfer("W", Channel.SWAP, sz.w(first, last)))  # evicted
                task.outputs += buffer_out(sz, first, last)
                _after_buffers(writers, sz, task)
                stashed = [first] if recompute else list(range(first, last + 1))
                for s in stashed:
                    if s > 0:
                        out = Transfer("Xs", Channel.SWAP, sz.x(s, size))
                        task.outputs.append(out)
                        stashes[s] = (task, out)
                prev = task
            for k, (first, last) in enumerate(reversed(packs)):
                task = b.add(device=d, kind=Kind.BWD, first=first, last=last, microbatches=[size],
                             offset=offset + j * config.u_f, loss=k == 0)
                task.inputs += state_inputs(sz, first, last)
                if k == 0:
                    task.inputs.append(Transfer("X", Channel.SWAP if prev is None else Channel.LOCAL,
                                                sz.x(first, size) if prev is None else 0, task=prev.id if prev else None))
                    task.outputs += buffer_out(sz, first, last)
                    _after_buffers(writers, sz, task)
                else:
                    stashed = [first] if recompute else list(range(first, last + 1))
                    for s in stashed:
                        if s > 0:
                            producer, out = stashes[s]
                            out.task = task.id
                            task.inputs.append(Transfer("Xs", Channel.SWAP, sz.x(s, size), task=producer.id))
                        else:
                            task.inputs.append(Transfer("X", Channel.SWAP, sz.x(0, size)))
                    # the gradient at the pack's output stays on the device from the previous backward
                    task.inputs.append(Transfer("dY", Channel.LOCAL, 0, task=prev.id, microbatch=0))
                    prev.outputs.append(Transfer("dX", Channel.LOCAL, 0, task=task.id, microbatch=0))
                if (first, last) in last_bwd and sz.dw(first, last):
                    task.inputs.append(Transfer("dW", Channel.SWAP, sz.dw(first, last), task=last_bwd[(first, last)].id))
                task.outputs.append(Transfer("W", Channel.SWAP, sz.w(first, last)))
                _leave_gradients(sz, [task])
                last_bwd[(first, last)] = task
                prev = task
        for first, last in packs:
            if not sz.trainable(first, last):
                continue
            b.add(device=d, kind=Kind.UPD, first=first, last=last, microbatches=[],
                  inputs=update_inputs(sz, first, last, last_bwd[(first, last)].id),
                  outputs=update_outputs(sz, first, last))
    return TaskGraph(mode="dp-swap", devices=devices, minibatch=minibatch, config=config, tasks=b.tasks)


def update_inputs(sz: Sizes, first: int, last: int, gradient_from: int) -> list[Transfer]:
    """A UPD task's inputs: the weights it steps, their summed gradient, their optimizer state."""
    return [Transfer("W", Channel.SWAP, sz.stepped_w(first, last)),
            Transfer("dW", Channel.SWAP, sz.owned_dw(first, last), task=gradient_from),
            Transfer("K", Channel.SWAP, sz.owned_k(first, last))]


def update_outputs(sz: Sizes, first: int, last: int) -> list[Transfer]:
    """What a step sends back to the host: the weights it changed and their optimizer state."""
    return [Transfer("W", Channel.SWAP, sz.stepped_w(first, last)), Transfer("K", Channel.SWAP, sz.owned_k(first, last))]


def with_norm(graph: TaskGraph) -> TaskGraph:
    """``graph`` with global-norm gradient clipping: a NORM task on the host after every backward
    that leaves a gradient, and every UPD task after it. The norm is known only once the last
    gradient is, so no update may be fused into a backward (generate the graph with
    ``jit_update=False`` or host updates); what the updates lose is their overlap with the rest
    of the backward, which the estimator sees through the new dependencies.

    Tasks are renumbered in their new order (each device's order is kept): the NORM task before
    the updates it gates, which move behind it."""
    fused = [t for t in graph.tasks if t.jit_update()]
    if fused:
        raise ValueError(f"clipping needs the global gradient norm before any step, but {fused[0]} steps its pack "
                         "inside its backward")
    updates = [t for t in graph.tasks if t.kind == Kind.UPD]
    rest = [t for t in graph.tasks if t.kind != Kind.UPD]
    for device in {t.device for t in updates}:
        mine = [t for t in graph.tasks if t.device == device]
        if any(t.kind != Kind.UPD for t in mine[mine.index(next(u for u in mine if u.kind == Kind.UPD)):]):
            raise ValueError(f"dev{device} runs other work after an update; the updates cannot wait for the norm")
    sources = [t for t in rest if t.kind == Kind.BWD and any(o.tensor == "dW" and o.nbytes for o in t.outputs)]
    norm = Task(id=-1, device=HOST, kind=Kind.NORM, first=0, last=max(t.last for t in graph.tasks), microbatches=[],
                inputs=[Transfer("dW", Channel.SHM, 0, task=t.id) for t in sources])
    ordered = rest + [norm] + updates
    new_id = {t.id: i for i, t in enumerate(ordered)}
    for task in ordered:
        for t in task.inputs + task.outputs:
            if t.task is not None:
                t.task = new_id[t.task]
    for upd in updates:
        upd.inputs.append(Transfer("dW", Channel.SHM, 0, task=new_id[-1]))
    for i, task in enumerate(ordered):
        task.id = i
    return TaskGraph(mode=graph.mode, devices=graph.devices, minibatch=graph.minibatch, config=graph.config,
                     tasks=ordered)
