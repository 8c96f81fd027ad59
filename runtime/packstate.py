"""A pack's state on the device: its parameters (W) and buffers (B) in from the host store and out
again, and the gradients (dW) its parameters collect across tasks.

- In: on the swap-in stream where the program lists its LOAD: ahead of the task's first inputs as
  the task starts, or while the task before computes, at the unit the program names
  (``Program.prefetches``, from the memory promise), a prefetch giving up rather than waiting when
  it does not fit (the task then loads it as it starts); or kept resident on the device for a
  later task (``Program.resident``).
- Out: buffers a forward changed (BatchNorm statistics) written back; weights evicted without an
  update, as the per-GPU-swap baselines do.
- Gradients: the running gradient a baseline's backward starts from (dW <- SWAP) and the deposits a
  task leaves in this device's host slots for an update elsewhere (dW -> SWAP).
- Kept: state the plan keeps on the device across iterations (``W <- KEEP``, ``scheduler/keep.py``)
  is loaded from the host store once, the first time a task reads it, and stays (``kept_state``,
  held in the ledger as ``KEPT``, outside every task). ``sync_kept`` writes it back to the host
  store for a reader there (a checkpoint, ``state_dict``); ``drop_kept`` lets it go after the host
  store was written (weights or a checkpoint loaded), so that the next iteration loads the new values.

One of the executor's parts (``executor.py``); copies into the device go through ``admission.py``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Iterable

import torch

from harmony.runtime.admission import Admission, NoRoom
from harmony.runtime.channels import tensor_bytes
from harmony.runtime.context import DeviceContext
from harmony.runtime.ledger import KEPT, STATE
from harmony.scheduler import memory
from harmony.scheduler.memory import running_gradient_input
from harmony.scheduler.tasks import Channel, Task


class PackState:
    """A pack's W, B and dW between the host store and the device; see the module docs."""

    def __init__(self, ctx: DeviceContext, admission: Admission) -> None:
        self.ctx = ctx
        self.admission = admission
        self._prefetched: dict[int, Future] = {}  # task -> its state, prefetched
        self._running: dict[int, Future] = {}  # task -> its running gradient, queued on swap-in
        self._prefetches = ctx.program.prefetches(ctx.rank)  # (task, unit) -> the task whose state loads then
        self.prefetching = True  # off only to measure what prefetching buys (``Executor(prefetch=False)``)
        self._zeros: dict[torch.dtype, torch.Tensor] = {}  # per dtype, the element gradient sinks broadcast
        self.kept_state: dict[str, torch.Tensor] = {}  # weights (canonical name) and buffers kept across iterations
        self.kept_optim: dict[str, dict[str, torch.Tensor]] = {}  # canonical name -> its optimizer state, kept likewise

    def _state_names(self, task: Task) -> list[str]:
        names: list[str] = []
        for layer in range(task.first, task.last + 1):
            for name in self.ctx.layers.layers[layer].state:
                if name not in names:
                    names.append(name)
        return names

    def unit_starts(self, unit: int) -> None:
        """Unit ``unit`` of the running task (a microbatch, or its update) is about to compute: the
        moment the program loads the next task's state where it does (``Program.prefetches``), its
        memory counted beside this unit's."""
        self.admission.ledger_unit(self.ctx.task, unit)
        nxt = self._prefetches.get((self.ctx.task, unit))
        if nxt is not None and self.prefetching:
            self._prefetch_state(self.ctx.by_id[nxt])

    def _prefetch_state(self, task: Task) -> None:
        """Load the next task's state while the running one computes, where the plan does (its
        memory counts it beside the running task)."""
        before = self.ctx.program.after.get(task.id)
        if before is not None and not self.ctx.shared.is_done(before, self.ctx.iteration):
            # its buffers are still being updated (maybe by the task running now): a prefetch would
            # hold the swap-in stream, and the running task's inputs queued behind it, until then
            return
        self._prefetched[task.id] = self.ctx.swap_in.submit(self._try_load_state, task, label="state in", task=task.id)

    def issue_state(self, task: Task) -> None:
        """The running task's state on the swap-in stream, unless prefetched (or on the device
        already): the program lists it there, ahead of the task's first inputs, which the compute
        thread queues next rather than after the state is in."""
        if memory.is_kept(task) or any(t.tensor == "W" and t.channel in (Channel.LOCAL, Channel.KEEP)
                                       for t in task.inputs):
            return
        prefetch = self._prefetched.get(task.id)
        if prefetch is None:
            self._prefetched[task.id] = self.ctx.swap_in.submit(self._load_state, task, label="state in", task=task.id)
        elif not prefetch.done() or prefetch.result() is None:
            # a prefetch that gives up (no room beside the task before) leaves the load to now, still
            # ahead of the task's first inputs on the stream
            self._prefetched[task.id] = self.ctx.swap_in.submit(
                lambda: prefetch.result() or self._load_state(task), label="state in", task=task.id)

    def claim_resident(self, task: Task) -> None:
        """Count the pack state ``task`` takes over from an earlier task (W LOCAL) as its own before
        its first unit is reserved (the unit's planned bytes count it), not as that task's beside it."""
        source = _resident_source(task)
        state = self.ctx.resident.get(source) if source is not None else None
        if state is not None:
            self.ctx.ledger.hold(list(state.values()), (task.id, STATE))

    def _try_load_state(self, task: Task) -> dict[str, torch.Tensor] | None:
        """A prefetch of the next task's state that gives up, rather than wait, when it does not
        fit beside the running task: waiting would hold the swap-in stream, and the running task's
        inputs behind it. The task then loads its state when it starts."""
        try:
            # a prefetch the plan makes was counted beside the running task: it needs no room kept
            return self._load_state(task, wait=False, room=0)
        except NoRoom:
            return None

    def _load_state(self, task: Task, wait: bool = True, room: int | None = None) -> dict[str, torch.Tensor]:
        """The pack's parameters and buffers on the device, by original name (a tied parameter's
        names share one copy)."""
        source = _resident_source(task)
        if source is not None:  # kept for this task by the one before: now this task's state
            state = self.ctx.resident.pop(source)
            self.ctx.ledger.hold(list(state.values()), (task.id, STATE))
            return state
        if memory.is_kept(task):
            return self.kept_pack_state(task)
        before = self.ctx.program.after.get(task.id)
        if before is not None:
            self.ctx.wait_done([before], f"task {task.id} reads the buffers task {before} updates")
        keys: dict[str, str] = {}  # state name -> the source it is copied from (a tie's names: one)
        sources: dict[str, torch.Tensor] = {}
        for name in self._state_names(task):
            if self.ctx.layers.state[name].kind == "parameter":
                key = self.ctx.layers.canonical(name)
                if key not in sources:
                    sources[key] = self._carried(key)
            else:
                key = f"B/{name}"
                sources[key] = self.ctx.store.view(key)
            keys[name] = key
        made = dict(zip(sources, self.admission.many_to_device(list(sources.values()), wait, room, (task.id, STATE))))
        state = {name: made[key] for name, key in keys.items()}
        copies = {key: t for key, t in made.items() if not key.startswith("B/")}
        # counted once the whole state is in (an abandoned prefetch moved nothing the plan counts)
        buffers = [t for n, t in state.items() if self.ctx.layers.state[n].kind != "parameter"]
        for tensor, group in (("B", buffers), ("W", list(copies.values()))):
            for t in group:
                self.ctx.counters.add("SWAP", "in", tensor, t.numel() * t.element_size())
        for tensor, group in (("W", list(copies.values())), ("B", buffers)):
            if group:
                self.ctx.moved("swap-in", "LOAD", (task.id, tensor), tensor_bytes(group))
        return state

    def kept_pack_state(self, task: Task) -> dict[str, torch.Tensor]:
        """The pack's state kept on the device, by original name; what is not there yet (the first
        iteration, or after ``drop_kept``) comes from the host store now, once: a load outside
        every iteration's plan, which counts the kept bytes as held from its start."""
        state: dict[str, torch.Tensor] = {}
        for name in self._state_names(task):
            parameter = self.ctx.layers.state[name].kind == "parameter"
            key = self.ctx.layers.canonical(name) if parameter else name
            if key not in self.kept_state:
                source = self._carried(key) if parameter else self.ctx.store.view(f"B/{name}")
                self.kept_state[key] = self.admission.to_device(source, "KEEP", "W" if parameter else "B", count=False,
                                                                room=0, owner=KEPT)
            state[name] = self.kept_state[key]
        return state

    def sync_kept(self) -> None:
        """Write the kept state back to the host store (weights the devices step, buffers and
        optimizer state), for a reader of the host store; it stays on the device."""
        mine = set(self.ctx.program.kept_writes(self.ctx.graph, self.ctx.rank))  # trainable: frozen weights never change (and may be low copies)
        with torch.no_grad(), self.ctx.device.host_side():
            for key, t in self.kept_state.items():
                if key in self.ctx.layers.state and self.ctx.layers.state[key].kind != "parameter":
                    self.ctx.store.view(f"B/{key}").copy_(t)
                elif key in mine:
                    self.ctx.store.weight(key).copy_(t)
            for name, values in self.kept_optim.items():
                if name not in mine:
                    continue
                slots = self.ctx.store.state(name)
                for k, v in values.items():
                    if isinstance(v, torch.Tensor):
                        slots[k].copy_(v)
                self.ctx.store.mark_state_initialized(name)

    def drop_kept(self, optimizer: bool = True) -> None:
        """Let the kept weights and buffers go, and with ``optimizer`` their optimizer state: the host
        store was written (weights, a checkpoint loaded), and the next iteration loads them anew."""
        self.kept_state.clear()
        if optimizer:
            self.kept_optim.clear()

    def _carried(self, name: str) -> torch.Tensor:
        """The weight as it travels: its host master, or for a weight that autocast only casts and
        no device steps (``TaskGraph.low_copies``, ``profiling/casts.py``) its low-precision copy,
        cast on the host (``HostStore.refresh_low_copies``) with the rounding autocast's own cast
        would apply on the device."""
        if name not in self.ctx.graph.low_copies:
            return self.ctx.store.weight(name)
        copy = self.ctx.store.low_copy(name)
        if copy is None:
            raise RuntimeError(f"the host store keeps no low-precision copy of {name}, which the plan moves as one; "
                               "the store was made for another plan: make it with HostStore.create(low_copies=)")
        return copy

    def pack_state(self, task: Task) -> dict[str, torch.Tensor]:
        """The running task's state on the device: the prefetched copy if one came, else loaded now."""
        future = self._prefetched.pop(task.id, None)
        state = self.ctx.wait(future, "state") if future is not None else None
        if state is None:
            state = self._load_state(task)
        if task.id in self.ctx.program.resident:
            self.ctx.resident[task.id] = state
        return state

    def params(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical name -> the device tensor whose ``.grad`` collects a trainable parameter's
        gradient: the parameter itself, or for one travelling as a low-precision copy (a host-stepped
        weight, ``TaskGraph.low_copies``) a float32 sink its gradient reaches through the cast's
        backward (``compute._GradInFloat32``), adding up in float32 as eager's does."""
        out = {}
        for name, t in state.items():
            spec = self.ctx.layers.state[name]
            canon = self.ctx.layers.canonical(name)
            if spec.kind == "parameter" and spec.requires_grad and canon not in out:
                out[canon] = self._grad_sink(canon, t) if canon in self.ctx.graph.low_copies else t
        return out

    def _grad_sink(self, name: str, copy: torch.Tensor) -> torch.Tensor:
        """A leaf of the master's dtype and the copy's shape that holds no memory of its own (one
        element of the run, broadcast): autograd accumulates the gradient into its ``.grad``."""
        dtype = self.ctx.store.weight(name).dtype
        zero = self._zeros.get(dtype)
        if zero is None:
            with self.ctx.device.host_side():  # made once, outside the plan's tensors
                zero = self._zeros[dtype] = torch.zeros((), dtype=dtype, device=copy.device)
        return zero.expand(copy.shape)

    def write_buffers(self, task: Task, state: dict[str, torch.Tensor]) -> None:
        """B -> SWAP: buffers changed by the forward (running statistics) go back to the host."""
        if not any(t.tensor == "B" and t.channel == Channel.SWAP for t in task.outputs):
            return
        buffers = {name: t for name, t in state.items() if self.ctx.layers.state[name].kind != "parameter"}

        def write() -> None:
            self.many_to_host_into([(self.ctx.store.view(f"B/{name}"), t) for name, t in buffers.items()], "B")

        self.ctx.moved("swap-out", "STORE", (task.id, "B"), tensor_bytes(list(buffers.values())))
        self.ctx.after_compute(self.ctx.swap_out, "B out", write)

    def evict_weights(self, task: Task, state: dict[str, torch.Tensor]) -> None:
        """W -> SWAP without an update (per-GPU-swap baselines evict their weights): the copy is
        made, as the baseline makes it, into a scratch buffer, since the master is unchanged."""
        if task.jit_update() or not any(t.tensor == "W" and t.channel == Channel.SWAP for t in task.outputs):
            return
        params = {self.ctx.layers.canonical(n): t for n, t in state.items() if self.ctx.layers.state[n].kind == "parameter"}

        def evict() -> None:
            for t in params.values():
                host = self.ctx.device.to_host(t)
                self.ctx.counters.add("SWAP", "out", "W", host.numel() * host.element_size())

        self.ctx.moved("swap-out", "STORE", (task.id, "W"), tensor_bytes(list(params.values())))
        self.ctx.after_compute(self.ctx.swap_out, "W out", evict)

    def issue_running_gradient(self, task: Task) -> None:
        """dW <- SWAP (per-GPU-swap baselines): the gradient accumulated so far, queued on the swap-in
        stream where the program lists it, after the task's state and before its first inputs.
        (A tied weight's gradient handed over by another pack is not one: it is added at the step.)"""
        if any(running_gradient_input(task, t, self.ctx.by_id) for t in task.inputs):
            self._running[task.id] = self.ctx.swap_in.submit(self._running_gradient, task, self._trainable(task),
                                                             label="dW in", task=task.id)

    def _running_gradient(self, task: Task, names: set[str]) -> dict[str, torch.Tensor]:
        """The running gradient's slots on the device, by canonical name, once the earlier tasks of
        this device depositing into them are done (their deposits have left: not the whole swap-out
        stream, which holds later tasks' stashes and evictions too). Held as the task's own: its
        unit's planned bytes count its gradient."""
        self.ctx.wait_done(self._earlier_deposits(task, names), f"task {task.id} starts from their gradients")
        written = [name for name in names if self.ctx.store.slot_written(self.ctx.rank, name, self.ctx.iteration)]
        slots = [self.ctx.store.grad_slot(self.ctx.rank, name) for name in written]
        grads = self.admission.many_to_device(slots, owner=(task.id, STATE), counted="dW")
        self.ctx.moved("swap-in", "LOAD", (task.id, "dW"), tensor_bytes(grads))
        return dict(zip(written, grads))

    def _trainable(self, task: Task) -> set[str]:
        """The canonical names of the pack's trainable parameters."""
        specs = self.ctx.layers.state
        return {self.ctx.layers.canonical(n) for n in self._state_names(task)
                if specs[n].kind == "parameter" and specs[n].requires_grad}

    def load_running_gradient(self, task: Task, params: dict[str, torch.Tensor]) -> bool:
        """The running gradient queued by ``issue_running_gradient`` becomes the starting value of
        this task's gradient buffers; says whether there was one."""
        future = self._running.pop(task.id, None)
        if future is None:
            return False
        for name, grad in self.ctx.wait(future, "dW").items():
            params[name].grad = grad
        return True

    def _earlier_deposits(self, task: Task, params: Iterable[str]) -> list[int]:
        """The tasks of this device before ``task`` that leave a gradient of ``params`` in its slots."""
        earlier = []
        for t in self.ctx.graph.device_tasks(self.ctx.rank):
            if t.id == task.id:
                break
            if any(name in params for name in self.ctx.program.deposits.get(t.id, ())):
                earlier.append(t.id)
        return earlier

    def deposit(self, grads: dict[str, torch.Tensor], overwrite: bool) -> None:
        """dW -> SWAP: leave gradients in this device's host slots (added to what an earlier task
        of this iteration left there, unless this task started from it)."""
        fresh = {name for name in grads if overwrite or not self.ctx.store.slot_written(self.ctx.rank, name, self.ctx.iteration)}
        self.many_to_host_into([(self.ctx.store.grad_slot(self.ctx.rank, name), g) for name, g in grads.items()
                                 if name in fresh], "dW")
        for name, g in grads.items():
            if name not in fresh:
                host = self.ctx.device.to_host(g)
                self.ctx.counters.add("SWAP", "out", "dW", host.numel() * host.element_size())
                self.ctx.store.grad_slot(self.ctx.rank, name).add_(host)
            self.ctx.store.stamp_slot(self.ctx.rank, name, self.ctx.iteration)

    def _to_host_into(self, dst: torch.Tensor, src: torch.Tensor, tensor: str) -> None:
        """A counted copy from the device into host memory the store owns (a master, a slot)."""
        self.many_to_host_into([(dst, src)], tensor)

    def many_to_host_into(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], tensor: str) -> None:
        """``_to_host_into`` of several (destination, source) pairs, counted once: a state's
        tensors leave together, as they came in (``Admission.many_to_device``)."""
        began = time.perf_counter()
        with torch.no_grad(), self.ctx.device.host_side():
            for dst, src in pairs:
                dst.copy_(src.detach())
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        self.ctx.device.transferred(nbytes, began)
        self.ctx.counters.add("SWAP", "out", tensor, nbytes)


def _resident_source(task: Task) -> int | None:
    """The earlier task whose pack state ``task`` takes over on the device (W on LOCAL), if any."""
    return next((t.task for t in task.inputs if t.tensor == "W" and t.channel == Channel.LOCAL), None)
