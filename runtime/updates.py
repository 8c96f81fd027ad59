"""Updates: each parameter stepped exactly once per iteration, by the task that owns it, with the sum
of every gradient of it, as one-process eager training steps it (``reference.py``).

- jit-update on the device right after a pack's last backward (``update="device"``), or the
  gradient is left in a host slot for an update elsewhere (an offloaded host update, the baselines'
  UPD tasks, or the owner of a tied weight);
- a UPD task on a device: weights, the summed gradient and the optimizer state (K) in, step, out.
  Replicas of one update (data parallel with per-GPU swap) all compute it; the lowest one writes
  the master after every replica has read it;
- ``host_update``: a UPD task bound to the host steps the master weights in shared memory in place
  (run by the launcher, not by a worker), with torch's fused CPU kernel where the user's optimizer
  has one (``host_step.py``).

``Updates`` is one of the executor's parts (``executor.py``); ``host_update`` is a plain function.
Copies into the device go through ``admission.py``; gradient deposits and evictions are
``packstate.py``'s.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from harmony.runtime.admission import Admission
from harmony.runtime.channels import tensor_bytes
from harmony.runtime.context import DeviceContext
from harmony.runtime.flags import Shared
from harmony.runtime.host_step import host_step
from harmony.runtime.hoststore import HostStore
from harmony.runtime.ledger import KEPT, STATE
from harmony.runtime.lr_schedule import Rates
from harmony.runtime.lr_schedule import apply as apply_rates
from harmony.runtime.packstate import PackState
from harmony.scheduler import memory
from harmony.scheduler.lower import Program
from harmony.scheduler.tasks import Channel, Task


class Updates:
    """Optimizer steps on the device, and what follows a backward; see the module docs."""

    def __init__(self, ctx: DeviceContext, admission: Admission, packs: PackState,
                 build_optimizer: Callable) -> None:
        self.ctx = ctx
        self.admission = admission
        self.packs = packs
        self.build_optimizer = build_optimizer
        self.rates: Rates | None = None  # this iteration's learning-rate schedule (lr_schedule.py), None without one

    def after_backward(self, task: Task, state: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
                       overwrite: bool) -> None:
        """What follows a pack's backward, at the plan's update unit: its gradients deposited in host
        slots for an update elsewhere, or stepped here at once (jit-update); then its weights evicted
        (the baselines) and its gradients let go."""
        self.packs.unit_starts(len(task.microbatches))  # the plan's update unit (a step here or none)
        # the gradients are the task's until it ends, then leaving (deposited) or kept for its update
        self.ctx.ledger.hold([p.grad for p in params.values() if p.grad is not None], (task.id, STATE))
        deposits = self.ctx.program.deposits.get(task.id, [])
        if deposits:
            grads = {name: params[name].grad for name in deposits if params[name].grad is not None}
            if grads:  # logged as queued, as every move is: a stream runs its jobs in that order
                self.ctx.moved("swap-out", "STORE", (task.id, "dW"), tensor_bytes(list(grads.values())))
            self.ctx.after_compute(self.ctx.swap_out, "dW out", self.packs.deposit, grads, overwrite)
        if task.jit_update():
            owned = {name: params[name] for name in self.ctx.program.updates.get(task.id, [])}
            self._step(task, owned, len(task.microbatches), write=True)
        self.packs.evict_weights(task, state)
        for p in params.values():
            p.grad = None

    def update_task(self, task: Task) -> None:
        """A UPD task on this device: weights, the summed gradient and the state in, step, out.
        Replicas of one update (data parallel with per-GPU swap) all compute it; the lowest one
        writes the master after every replica has read it."""
        local = next((t for t in task.inputs if t.tensor == "W" and t.channel == Channel.LOCAL), None)
        state = self.ctx.resident.pop(local.task) if local is not None else None
        if state is not None:  # kept for this task by the one before: now this task's state
            self.ctx.ledger.hold(list(state.values()), (task.id, STATE))
        elif memory.is_kept(task):  # kept on the device across iterations
            state = self.packs.kept_pack_state(task)
        owned = self.ctx.program.updates.get(task.id, [])
        if state is not None:
            params = {name: next(t for n, t in state.items() if self.ctx.layers.canonical(n) == name) for name in owned}
        else:  # one admission for the whole pack's weights, as the plan reserves them
            weights = [self.ctx.store.weight(name) for name in owned]
            params = dict(zip(owned, self.admission.many_to_device(weights, counted="W")))
            if params:
                self.ctx.moved("swap-in", "LOAD", (task.id, "W"), tensor_bytes(list(params.values())))
        replicas = self.ctx.program.replicas.get(task.id, [task.id])
        writer = min(replicas, key=lambda t: self.ctx.by_id[t].device)
        self.packs.unit_starts(0)
        self._step(task, params, 0, write=task.id == writer, replicas=replicas)

    def _gradients(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """The full gradient of each parameter: its own (on the device) plus every host slot
        written this iteration, summed on the host and copied in once. The copies of gradients
        with no device part come in with one admission (``Admission.many_to_device``); one added
        to a device gradient comes in alone, so that it is let go before the next."""
        with self.ctx.device.host_side():  # the sums are host memory, not the device's
            host = {name: self.ctx.store.gradient_sum(name, self.ctx.iteration) for name in params}
        alone = [name for name, g in host.items() if g is not None and params[name].grad is None]
        copies = dict(zip(alone, self.admission.many_to_device([host[name] for name in alone], counted="dW")))
        out: dict[str, torch.Tensor | None] = {}
        for name, p in params.items():
            if name in copies:
                out[name] = copies[name]
            elif host[name] is None:
                out[name] = p.grad
            else:
                out[name] = p.grad.add_(self.admission.to_device(host[name], "SWAP", "dW"))
        return out

    def _step(self, task: Task, params: dict[str, torch.Tensor], unit: int, write: bool,
              replicas: list[int] | None = None) -> None:
        """Step ``params`` with their full gradients, once every task depositing one is done: the
        optimizer state (K) comes in from the host store, the step computes as the task's unit
        ``unit``, and the new weights and state go back (``_write_state``: into the master only if
        ``write``)."""
        if not params:
            self._write_state(task, {}, {}, write)
            return
        sources = self.ctx.program.gathers.get(task.id, [])
        self.ctx.wait_done(sources, f"updating task {task.id}")
        if self.ctx.shared.step_skipped(self.ctx.iteration):  # fp16 overflowed: nothing steps, nothing changes
            for p in params.values():
                p.grad = None
            self._write_state(task, {}, {}, write)
            return
        grads = self._gradients(params)
        leaves = {}
        for name, p in params.items():
            leaf = p.detach().requires_grad_(True)
            leaf.grad = grads[name]
            leaves[name] = leaf
        opt = self.build_optimizer(list(leaves.values()))
        apply_rates(opt, leaves, self.rates)
        kept = any(t.tensor == "K" and t.channel == Channel.KEEP for t in task.inputs)
        if kept:
            for name, leaf in leaves.items():
                self._load_kept_optimizer_state(name, leaf, opt)
        else:
            self._load_optimizer_state(leaves, opt)
        if replicas and len(replicas) > 1 and not kept:  # (kept replicas write no master: nothing to wait for)
            self.ctx.shared.mark_read(task.id, self.ctx.iteration, self.ctx.device.work_done())
            if write:
                self.ctx.wait_replicas(replicas)
        with self.ctx.device.unit(task.id, unit):
            opt.step()
        new_state = {name: dict(opt.state[leaf]) for name, leaf in leaves.items()}
        for leaf in leaves.values():
            leaf.grad = None
        if kept:  # the weights were stepped in place; the state stays for the next step
            self._keep_optimizer_state(new_state)
            return
        # a first step makes its optimizer state itself (the zero slots that came in are not it)
        self.ctx.ledger.hold([v for values in new_state.values() for v in values.values()], (task.id, STATE))
        weights = {name: leaf.detach() for name, leaf in leaves.items()}
        self._write_state(task, weights, new_state, write)

    def _load_optimizer_state(self, leaves: dict[str, torch.Tensor], opt: torch.optim.Optimizer) -> None:
        """The optimizer state (K) of ``leaves`` from the host store, with one admission for all of
        it. A first step starts from an empty state and makes its own, but the (zero) slots still
        come in, as the plan counts them."""
        stored = {name: self.ctx.store.state(name) for name in leaves}
        slots = [(name, key, v) for name, kv in stored.items() for key, v in kv.items() if v.dim() > 0]
        copies = self.admission.many_to_device([v for _, _, v in slots], counted="K")
        states: dict[str, dict[str, torch.Tensor]] = {}
        for (name, key, _), copy in zip(slots, copies):
            states.setdefault(name, {})[key] = copy
        for name, leaf in leaves.items():
            if self.ctx.store.state_initialized(name):
                copied = states.get(name, {})
                opt.state[leaf] = {k: copied[k] if v.dim() > 0 else v.clone() for k, v in stored[name].items()}

    def _keep_optimizer_state(self, states: dict[str, dict]) -> None:
        """The optimizer state of kept weights stays on the device for their next step, held as the
        device's kept reservation (its tensors; a step count, a scalar, lives on the host as the
        host store's does, in place from one step to the next)."""
        for name, values in states.items():
            for key, v in values.items():
                step_count = isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu"
                if name not in self.packs.kept_optim and step_count:
                    with self.ctx.device.host_side():
                        values[key] = v.clone()
        self.ctx.ledger.hold([v for values in states.values() for v in values.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0], KEPT)
        self.packs.kept_optim.update(states)

    def _load_kept_optimizer_state(self, name: str, leaf: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        """A kept weight's optimizer state for its step: the device's copy, or once (the first
        iteration, or after ``drop_kept``) the host store's, if it has been stepped; a first step
        makes its own."""
        values = self.packs.kept_optim.get(name)
        if values is None and self.ctx.store.state_initialized(name):
            with self.ctx.device.host_side():  # a step count stays on the host (``_keep_optimizer_state``)
                steps = {k: v.clone() for k, v in self.ctx.store.state(name).items() if v.dim() == 0}
            values = {k: self.admission.to_device(v, "KEEP", "K", count=False, room=0, owner=KEPT)
                      for k, v in self.ctx.store.state(name).items() if v.dim() > 0} | steps
        if values is not None:
            opt.state[leaf] = values

    def _write_state(self, task: Task, weights: dict, states: dict, write: bool) -> None:
        """W, K -> SWAP after a step: into the master (the writer) or a scratch copy (a replica)."""

        def out() -> None:
            values = [(name, key, v) for name, kv in states.items() for key, v in kv.items() if isinstance(v, torch.Tensor)]
            if not write:  # a replica's copies go to scratch memory: the master is the writer's
                to_host = self.ctx.device.to_host
                self.ctx.counters.add("SWAP", "out", "W", sum(tensor_bytes(to_host(w)) for w in weights.values()))
                self.ctx.counters.add("SWAP", "out", "K", sum(tensor_bytes(to_host(v)) for _, _, v in values
                                                              if v.dim() > 0))
                return
            self.packs.many_to_host_into([(self.ctx.store.weight(name), w) for name, w in weights.items()], "W")
            slots = {name: self.ctx.store.state(name) for name in states}
            for name, key, v in values:
                if v.dim() == 0:  # a step count: host memory both sides
                    slots[name][key].copy_(v)
            self.packs.many_to_host_into([(slots[name][key], v) for name, key, v in values if v.dim() > 0], "K")
            for name in states:
                self.ctx.store.mark_state_initialized(name)

        optimizer_state = [v for kv in states.values() for v in kv.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        for tensor, nbytes in (("W", tensor_bytes(list(weights.values()))), ("K", tensor_bytes(optimizer_state))):
            if nbytes:  # logged as queued, as every move is
                self.ctx.moved("swap-out", "STORE", (task.id, tensor), nbytes)
        self.ctx.after_compute(self.ctx.swap_out, "W K out", out)


def host_update(task: Task, program: Program, store: HostStore, shared: Shared,
                build_optimizer: Callable, iteration: int, timeout: float, rates: Rates | None = None) -> float:
    """A UPD task bound to the host (an offloaded update): once the devices have left their
    gradients, ``step_on_host`` steps its parameters. Returns when (``time.perf_counter``) its
    gradients were all there and the update began."""
    shared.wait_done(program.gathers.get(task.id, []), iteration, f"the host update of task {task.id}", timeout,
                     ring=True)
    began = time.perf_counter()
    if not shared.step_skipped(iteration):  # fp16 overflowed: nothing steps
        step_on_host(store, program.updates.get(task.id, []), build_optimizer, iteration, rates)
    shared.mark_done(task.id, iteration)
    return began


def step_on_host(store: HostStore, names: list[str], build_optimizer: Callable, iteration: int,
                 rates: Rates | None = None) -> None:
    """The optimizer step of an offloaded update: the master weights of ``names`` in the host store
    stepped in place (``host_step``: fused where torch has its kernel), with the gradients the
    devices left in their slots in ``iteration``, at the scheduled ``rates`` if any."""
    leaves = {}
    for name in names:
        # summed into the first slot rather than a new tensor: the optimizer only reads a gradient,
        # and a copy of every gradient on the host's critical path costs what the step itself does
        grad = store.merge_slots(name, iteration)
        if grad is None:
            continue
        leaf = torch.nn.Parameter(store.weight(name), requires_grad=True)
        leaf.grad = grad
        leaves[name] = leaf
    if not leaves:
        return
    opt = build_optimizer(list(leaves.values()))
    apply_rates(opt, leaves, rates)
    # in place: the state lives in the slots (a first step makes its own, copied in below)
    stored = {leaf: dict(store.state(name)) for name, leaf in leaves.items() if store.state_initialized(name)}
    after = host_step(opt, stored)
    for name, leaf in leaves.items():
        slots = store.state(name)
        for key, v in after.get(leaf, {}).items():
            if isinstance(v, torch.Tensor) and v.data_ptr() != slots[key].data_ptr():
                slots[key].copy_(v)
        store.mark_state_initialized(name)
    store.refresh_low_copies(leaves)  # the devices receive the new weights as these copies
