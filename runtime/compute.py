"""Compute: a pack's forward and backward on the compute thread, each as one-process eager training
runs it (``reference.py``).

- **FWD**: the pack's forward for each microbatch of its group, without autograd; the inputs of
  the layers a later recompute starts from are stashed to host memory with the random-generator
  state they had (``rng.py``); buffers (BatchNorm statistics) are updated and written back once.
- **BWD**: per microbatch, the recompute from the stash (buffers on throwaway copies, so running
  statistics are not updated twice; the generator state restored, so dropout masks repeat), then
  the backward with the gradient arriving from the next pack. The pack's gradient buffer stays on
  the device across its microbatches (input-batch grouping). Where the plan keeps or swaps a pack's
  activations (``Task.keep``), its FWD records for autograd and leaves each microbatch's graph for
  the BWD (``kept.py``), its state stays on the device too, and the BWD runs the backward alone. A ``loss`` task runs the last pack's
  forward, the loss scaled by u/D and the backward together.

Each microbatch is a unit of the plan (``PackState.unit_starts``: the next task's state may load then), and
every tensor of a microbatch is let go as soon as the plan counts it gone (the ``del`` statements).

One of the executor's parts (``executor.py``): inputs and sends go through ``transport.py``, the
pack's state through ``packstate.py``, what follows a backward through ``updates.py``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.func import functional_call
from torch.utils import _pytree as pytree

from harmony.runtime import rng
from harmony.runtime.kept import (KEPT, SWAPPED, KeptForward, boxed, detached, restore, saved_alias, swap_out, unboxed,
                                  unsaved)
from harmony.runtime.context import DeviceContext
from harmony.runtime.packstate import PackState
from harmony.runtime.precision import autocast
from harmony.runtime.transport import Transport, Values, slice_samples
from harmony.runtime.updates import Updates
from harmony.scheduler.lower import Edge, ranges, stash_layers
from harmony.scheduler.tasks import Kind, Task


class Compute:
    """FWD and BWD tasks on the compute thread; see the module docs."""

    def __init__(self, ctx: DeviceContext, packs: PackState, transport: Transport, updates: Updates,
                 loss_fn: Callable) -> None:
        self.ctx = ctx
        self.packs = packs
        self.transport = transport
        self.updates = updates
        self.loss_fn = loss_fn
        self.modules = ctx.layers.modules
        self.minibatch = ctx.graph.minibatch
        self._out_spec = ctx.layers.out_spec()  # the model's output structure, to give the loss what the model returns
        self.loss_scale: float | None = None  # this iteration's (fp16): the loss is multiplied by it before its backward
        # a keeping forward's parameters (leaves, or float32 sinks of low-precision copies), by task:
        # its backward's gradients collect on them
        self._kept_params: dict[int, dict[str, torch.Tensor]] = {}

    def claim(self, task: Task) -> None:
        """What a backward from kept activations takes over on the device (its forward's state and
        its first microbatch's activations), counted as its own before its first unit is reserved:
        the unit's planned bytes count them, and counted beside it as well they would be twice."""
        if task.kind == Kind.BWD and task.keep:
            self.packs.claim_resident(task)
            self.transport.claim_kept(task, 0)

    def _sinks(self, state: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """State name -> the float32 sink its low-precision copy's gradient reaches (``_through_sinks``)."""
        return {n: p for n, t in state.items()
                if (p := params.get(self.ctx.layers.canonical(n))) is not None and p is not t}

    def _run_layer(self, index: int, state: dict[str, torch.Tensor], values: Values) -> Values:
        """One layer, with the pack state's tensors as its parameters and buffers.

        ``tie_weights=False``: a layer's state names every name of a tied tensor (the decomposer
        records them with ``remove_duplicate=False``) and the pack state gives each the same copy,
        so there is nothing for ``functional_call`` to tie, and its search for ties would cost small
        layers a good part of their forward."""
        names = self.ctx.layers.layers[index].state
        with autocast(self.ctx.device.torch_device.type, self.ctx.graph.precision):
            return list(functional_call(self.modules[index], {n: state[n] for n in names}, tuple(values),
                                        tie_weights=False))

    def _run_pack(self, task: Task, state: dict[str, torch.Tensor], values: Values) -> Values:
        for layer in range(task.first, task.last + 1):
            values = self._run_layer(layer, state, values)
        return values

    def forward(self, task: Task) -> None:
        """FWD: each microbatch through the pack without autograd (recording for it where the task
        keeps its activations for the backward, ``Task.keep``); stashes and outputs sent as the
        program's edges say."""
        self.packs.issue_state(task)
        ready = self.transport.stream_prefetch(task, ["X"], 0)
        state = self.packs.pack_state(task)
        sinks: dict[str, torch.Tensor] | None = None
        if task.keep:  # the backward's gradients collect on these: the backward takes them over
            params = self._kept_params[task.id] = self.packs.params(state)
            for p in params.values():
                p.requires_grad_(True)
            sinks = self._sinks(state, params)
        for mb in range(len(task.microbatches)):
            got = self.transport.inputs(task, ["X"], mb, ready)
            ready = self.transport.stream_prefetch(task, ["X"], mb + 1)
            self.packs.unit_starts(mb)
            with self.ctx.device.unit(task.id, mb):
                if sinks is None:
                    self._forward_unit(task, state, mb, *got.pop("X"))
                else:
                    self._keeping_unit(task, state, sinks, mb, *got.pop("X"))
            del got
        self.packs.write_buffers(task, state)
        self.packs.evict_weights(task, state)

    def _forward_unit(self, task: Task, state: dict[str, torch.Tensor], mb: int, values: Values,
                      gen: torch.Tensor | None) -> None:
        """Microbatch ``mb`` of a forward, from its inputs ``values`` and their generator state."""
        device = self.ctx.device.torch_device
        if gen is not None:
            rng.restore(device, gen)
        at = self._sends_by_layer(task, mb)
        with torch.no_grad():
            for layer in range(task.first, task.last + 1):
                if layer in at:
                    self.transport.send(task, mb, at[layer], values, rng.capture(device))
                values = self._run_layer(layer, state, values)
        self.transport.send(task, mb, at.get(task.last + 1, []), values, rng.capture(device))

    def _keeping_unit(self, task: Task, state: dict[str, torch.Tensor], sinks: dict[str, torch.Tensor], mb: int,
                      values: Values, gen: torch.Tensor | None) -> None:
        """Microbatch ``mb`` of a forward that keeps its activations: the pack's forward recording
        for autograd from leaves of its inputs, as a recompute would run it; its stashes and
        outputs sent (detached) as the program says, and what the backward needs (the leaves, the
        outputs, every tensor autograd saved) left on the device for it (``Transport.keep``)."""
        device = self.ctx.device.torch_device
        if gen is not None:
            rng.restore(device, gen)
        at = self._sends_by_layer(task, mb)
        kept, swapped = at.pop(KEPT, []), at.pop(SWAPPED, [])
        leaves = _leaves(values, task.first)
        values = leaves
        run_state = _through_sinks(state, sinks)
        saved: list = []  # aliases of what autograd saves (``_Saved`` boxes where they may go to the host)
        pack = functools.partial(boxed if swapped else saved_alias, saved)
        with torch.autograd.graph.saved_tensors_hooks(pack, unboxed if swapped else unsaved):
            for layer in range(task.first, task.last + 1):
                if layer in at:
                    self.transport.send(task, mb, at[layer], detached(values), rng.capture(device))
                values = self._run_layer(layer, run_state, values)
        self.transport.send(task, mb, at.get(task.last + 1, []), detached(values), rng.capture(device))
        own = {t.untyped_storage()._cdata for t in (*state.values(), *sinks.values())}
        ends = [t for t in (*leaves, *values) if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in own]
        boxes: list = []
        if swapped:
            boxes, storages = swap_out(saved, own | {t.untyped_storage()._cdata for t in ends})
            self.transport.send(task, mb, swapped, storages, None)
            held = ends
        else:
            held = ends + [t for t in saved if t.untyped_storage()._cdata not in own]
        saved.clear()  # every saved tensor keeps the hooks, and with them this list, until the backward is done
        self.transport.keep(task, mb, kept, KeptForward(leaves, values, held, boxes))

    def _sends_by_layer(self, task: Task, mb: int) -> dict[int | str, list[Edge]]:
        """A forward microbatch's sends by the layer boundary each is taken at (stashes before a
        layer of the pack, outputs after its last; activations kept for the backward: ``KEPT``)."""
        at: dict[int | str, list[Edge]] = {}
        for e in self.ctx.program.out_of(task.id, mb):
            if e.stream in ("A", "As"):
                at.setdefault(KEPT if e.stream == "A" else SWAPPED, []).append(e)
                continue
            if not task.first <= e.layer <= task.last + 1:
                raise RuntimeError(f"task {task.id} ({task}) is to send {e.stream} at layer {e.layer}, outside its pack")
            at.setdefault(e.layer, []).append(e)
        return at

    def backward(self, task: Task) -> float:
        """BWD (and the loss task): per microbatch, the recompute from the stash (or the activations
        its forward kept) and the backward; returns the task's share of the loss."""
        layers = stash_layers(task)
        streams = ["X"] if task.loss else ["dY"] + [f"Xs{l}" for l in layers]
        if task.swaps():
            streams.append("As")  # activations the forward swapped out, brought back a microbatch ahead
        self.packs.issue_state(task)
        self.packs.issue_running_gradient(task)
        ready = self.transport.stream_prefetch(task, streams, 0)
        state = self.packs.pack_state(task)
        if task.keep:  # the forward's leaves, on which its recorded graph leaves the gradients
            params = self._kept_params.pop(next(t.task for t in task.inputs if t.tensor == "A"))
        else:
            params = self.packs.params(state)
        for p in params.values():
            p.requires_grad_(True)
        sinks = self._sinks(state, params)
        overwrite = self.packs.load_running_gradient(task, params)
        loss_total = 0.0
        for mb, (start, size) in enumerate(ranges(task)):
            got = self.transport.inputs(task, streams, mb, ready)
            # the activations its forward kept are the unit's, as its other inputs are, before it starts
            kept = self.transport.take_kept(task, mb) if task.keep else None
            ready = self.transport.stream_prefetch(task, streams, mb + 1)
            self.packs.unit_starts(mb)
            with self.ctx.device.unit(task.id, mb):
                if task.loss:
                    xs, loss = self._loss_unit(task, state, sinks, *got.pop("X"), start, size)
                    loss_total += loss
                elif kept is not None:
                    xs = self._kept_unit(kept, got)
                    kept = None
                else:
                    xs = self._recompute_unit(task, state, sinks, layers, got)
                del got
                if task.first > 0:
                    dx = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in xs]
                    edges = [e for e in self.ctx.program.out_of(task.id, mb) if e.stream == "dY"]
                    self.transport.send(task, mb, edges, dx, None)
                    del dx
                # nothing of this microbatch outlives it but what its sends hold until they have left (the
                # plan counts its gradients gone then, not alive into the next microbatch)
                del xs
        if task.loss:
            self.packs.write_buffers(task, state)
        self.updates.after_backward(task, state, params, overwrite)
        return loss_total

    def _loss_unit(self, task: Task, state: dict[str, torch.Tensor], sinks: dict[str, torch.Tensor], xs: Values,
                   gen: torch.Tensor | None, start: int, size: int) -> tuple[Values, float]:
        """A loss task's microbatch: the pack's forward recording for autograd, the loss scaled by
        its share of the minibatch, and the backward. Returns the pack's inputs (their ``.grad``
        is what flows back) and the microbatch's share of the loss."""
        device = self.ctx.device.torch_device
        xs = _leaves(xs, task.first)
        if gen is not None:
            rng.restore(device, gen)
        outputs = self._run_pack(task, _through_sinks(state, sinks), xs)
        target = self._target(start, size)
        with autocast(device.type, self.ctx.graph.precision):
            loss = self.loss_fn(pytree.tree_unflatten(outputs, self._out_spec), target) * (size / self.minibatch)
        del outputs
        if self.loss_scale is not None:  # as GradScaler.scale: times the scale in float32
            (loss * torch.full((), self.loss_scale, dtype=torch.float32, device=device)).backward()
        else:
            loss.backward()
        return xs, float(loss.detach())

    def _recompute_unit(self, task: Task, state: dict[str, torch.Tensor], sinks: dict[str, torch.Tensor],
                        layers: list[int], got: dict[str, tuple]) -> Values:
        """A backward's microbatch: from each stash, last first, the recompute and the backward with
        the gradient arriving from the next pack (``got``'s entries are let go as they are done
        with). Returns the first stash's inputs, whose ``.grad`` is what flows back."""
        device = self.ctx.device.torch_device
        # the pack's incoming gradient is the last layer's alone: let go once its gradient moved
        # on (a plan stepping layer by layer counts it in that layer's step, not in earlier ones)
        grads = got.pop("dY")[0]
        scratch = {n: (t.clone() if self.ctx.layers.state[n].kind != "parameter" else t) for n, t in state.items()}
        scratch = _through_sinks(scratch, sinks)
        for layer in reversed(layers):
            xs, gen = got[f"Xs{layer}"]
            xs = _leaves(xs, layer)
            if gen is not None:
                rng.restore(device, gen)
            stop = task.last if len(layers) == 1 else layer
            values = xs
            for l in range(layer, stop + 1):
                values = self._run_layer(l, scratch, values)
            _autograd_backward(values, grads)
            del values
            grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in xs]
            # a later layer's stash is done with once its gradient moved on; the first's gives dX
            got[f"Xs{layer}"] = (xs, None) if layer == layers[0] else None
        return got[f"Xs{layers[0]}"][0]

    def _kept_unit(self, kept: KeptForward, got: dict[str, tuple]) -> Values:
        """A backward's microbatch from the activations its forward kept: the backward alone, with
        the gradient arriving from the next pack. Returns the forward's leaves, whose ``.grad`` is
        what flows back."""
        kept.held.clear()  # autograd holds what it saved, and lets each go as the backward passes it
        if kept.boxes:  # what the forward swapped out, back on the device: each saved tensor a view of it
            restore(kept.boxes, got.pop("As")[0])
        grads = got.pop("dY")[0]
        _autograd_backward(kept.outputs, grads)
        return kept.leaves

    def _target(self, start: int, size: int) -> Any:
        """The loss target of samples ``start`` to ``start + size``, on the device."""
        target = slice_samples(self.ctx.batch.target, start, size)
        if isinstance(target, torch.Tensor):
            target = self.ctx.device.to_device(target)
            self.ctx.counters.add("TARGET", "in", "T", target.numel() * target.element_size())
        return target


class _GradInFloat32(torch.autograd.Function):
    """A low-precision weight copy read as eager autocast reads its cast of the float32 weight: the
    forward is the copy itself; the backward casts the copy's gradient (summed over its uses in
    the layer, in the low dtype, as over a cached cast's) to the sink's float32, as the cast's
    backward does, and the sink's ``.grad`` adds it up across microbatches."""

    @staticmethod
    def forward(ctx, sink: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = sink.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def _through_sinks(state: dict[str, torch.Tensor], sinks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A backward microbatch's pack state: each low-precision copy of a trainable weight read
    through ``_GradInFloat32`` into its sink (a new node per microbatch, as eager casts anew)."""
    if not sinks:
        return state
    return {n: (_GradInFloat32.apply(sinks[n], t) if n in sinks else t) for n, t in state.items()}


def _leaves(values: Values, layer: int) -> Values:
    """Inputs of a recompute or a loss task from ``layer`` on: floating tensors become leaves that
    collect their gradient (what flows back to the previous pack). The model's own inputs (layer
    0) stay as they are, as in eager training: nobody reads their gradient, and computing it cost
    a convolutional stem's backward as much again."""
    if layer == 0:
        return list(values)
    out = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.detach().requires_grad_(True)
        out.append(v)
    return out


def _autograd_backward(outputs: Values, grads: Values) -> None:
    """Backward from the outputs that have both a graph and an incoming gradient."""
    pairs = [(y, g) for y, g in zip(outputs, grads)
             if isinstance(y, torch.Tensor) and y.requires_grad and isinstance(g, torch.Tensor)]
    if pairs:
        torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])

