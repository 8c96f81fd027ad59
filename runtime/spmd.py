"""Running under ``torchrun``: every process is one device's worker (SPMD), on one host.

``torchrun --standalone --nproc-per-node N -m harmony.cli run MODEL_FILE ...`` (or
``torchrun ... $(which harmony) run ...``) starts N processes; they rendezvous through
torch.distributed (``env://``, gloo) instead of being forked by a launcher. Rank 0 makes the host
store, the shared flags and the message slabs as files in ``/dev/shm`` and the other ranks map the
same files, so master weights and optimizer state still live once. Messages between workers go
through the rendezvous's key-value store (only offsets and shapes; the tensors are in the slabs).
Every rank reads the same minibatch from the model file's ``get_batch``; rank 0 also runs the
plan's host-bound updates, and an all-reduce of the loss ends each iteration on every rank.

Only one host: the host store is one host's shared memory. A run whose ranks span hosts is
refused with a message saying so.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Callable

import msgpack
import torch
import torch.distributed as dist

from harmony.decomposer.layer_graph import dtype_from_str
from harmony.errors import HarmonyError
from harmony.runtime.channels import Aborted, Slabs
from harmony.runtime.device import CpuDevice, CudaDevice
from harmony.runtime.executor import Batch, Executor, IterationResult, Shared, host_update
from harmony.runtime.hoststore import HostStore, Layout
from harmony.runtime.launcher import StepResult, slab_sizes, working_memory
from harmony.runtime.routes import build_routes
from harmony.scheduler.tasks import HOST

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another env:// launcher)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


class StorePeer:
    """The ``put`` of a peer's inbox, as a key in the rendezvous store."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def put(self, item: tuple) -> None:
        key, (items, state, src) = item
        self.store.set(_name(key), _pack(items, state, src))


class StoreMailbox:
    """This worker's messages: from other workers through the rendezvous store, and from itself."""

    def __init__(self, store: Any, aborted: Callable[[], bool]) -> None:
        self.store = store
        self._aborted = aborted
        self._local: dict = {}
        self._cond = threading.Condition()

    def put_local(self, key: tuple, payload: Any) -> None:
        with self._cond:
            self._local[key] = payload
            self._cond.notify_all()

    def take(self, key: tuple, what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        name = _name(key)
        while True:
            with self._cond:
                if key in self._local:
                    return self._local.pop(key)
            if self._aborted():
                raise Aborted("the run was aborted by another worker's failure")
            if not self.store.check([name]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout:.0f} s for {what}; its sender never sent it")
                time.sleep(0.0005)
                continue
            payload = _unpack(self.store.get(name))
            self.store.delete_key(name)
            return payload

    def close(self) -> None:
        """Nothing to stop: no thread of its own."""


def _pack(items: list, state: bytes | None, src: int) -> bytes:
    """A message as msgpack: slab places, plain values, and (for a tensor that did not fit its
    slab) the tensor's bytes with its shape and dtype. Never a pickle: the store is a socket."""
    wire = []
    for item in items:
        if item[0] == "tensor":
            t = item[1].contiguous()
            wire.append(["bytes", t.view(-1).view(torch.uint8).numpy().tobytes(), list(t.shape), str(t.dtype)])
        else:
            wire.append(list(item))
    try:
        return msgpack.packb([wire, state, src], use_bin_type=True)
    except TypeError as exc:
        raise HarmonyError(f"a value passed between layers cannot travel between torchrun processes ({exc}); "
                           "only tensors, numbers, strings and lists of them can") from exc


def _unpack(data: bytes) -> tuple[list, bytes | None, int]:
    wire, state, src = msgpack.unpackb(data, raw=False)
    items = []
    for item in wire:
        if item[0] == "bytes":
            _, raw, shape, dtype = item
            flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            items.append(("tensor", flat.view(dtype_from_str(dtype)).reshape(shape)))
        else:
            items.append(tuple(item))
    return items, state, src


def _name(key: tuple) -> str:
    return "harmony/msg/" + "/".join(str(part) for part in key)


def run_spmd(plan, loss_fn: Callable, build_optimizer: Callable, get_batch: Callable, build_model: Callable,
             iterations: int, seed: int = 0, timeout: float = 600.0,
             on_step: Callable[[int, float, float], None] = lambda step, loss, seconds: None) -> list[StepResult]:
    """Train ``iterations`` minibatches as one rank of a torchrun job; returns, on rank 0, every
    iteration's results with every rank's measurements (other ranks get their own only)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local_world != world:
        raise HarmonyError(f"this run spans hosts ({world} ranks, {local_world} on this host); Harmony keeps master "
                           "weights in one host's shared memory and runs on one host only for now")
    if world != plan.tasks.devices:
        raise HarmonyError(f"the plan is for {plan.tasks.devices} device(s) but torchrun started {world} process(es); "
                           f"use --nproc-per-node {plan.tasks.devices}")
    store = dist.distributed_c10d._get_default_store()
    graph, tasks = plan.graph, plan.tasks
    routes = build_routes(tasks, graph)
    token = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    prefix = os.path.join(SHM_DIR, f"harmony-{token[0]}")
    sizes = slab_sizes(tasks, routes)
    files = [f"{prefix}-store", f"{prefix}-flags", f"{prefix}-shared"] + [f"{prefix}-slab-{a}-{b}" for a, b in sizes]
    try:
        if rank == 0:
            torch.manual_seed(seed)
            host = HostStore.create(graph, world, build_optimizer, build_model().state_dict(), path=prefix)
            shared = Shared.create(len(tasks.tasks), path=f"{prefix}-shared")
            layout = [host.layout.to_dict()]
        else:
            layout = [None]
        dist.broadcast_object_list(layout, src=0)
        if rank != 0:
            host = HostStore.open(Layout.from_dict(layout[0]), prefix)
            shared = Shared.create(len(tasks.tasks), path=f"{prefix}-shared", create=False)
        slabs = Slabs(sizes, prefix=prefix, create=rank == 0)
        dist.barrier()
        return _train(rank, world, plan, routes, host, shared, slabs, store, loss_fn, build_optimizer, get_batch,
                      iterations, seed, timeout, on_step)
    finally:
        dist.barrier()
        if rank == 0:
            for path in files:
                if os.path.exists(path):
                    os.unlink(path)


def _train(rank, world, plan, routes, host, shared, slabs, store, loss_fn, build_optimizer, get_batch,
           iterations, seed, timeout, on_step) -> list[StepResult]:
    tasks = plan.tasks
    capacity = plan.options.get("device_memory") or plan.profile.capacity
    torch.set_num_threads(1)  # as the profile measured an emulated device
    device = (CudaDevice(int(os.environ["LOCAL_RANK"]), capacity) if plan.options.get("device_type") == "cuda"
              else CpuDevice(f"cpu{rank}", capacity))
    mailbox = StoreMailbox(store, shared.aborted)
    executor = Executor(rank, device, plan.graph, routes, host, shared, mailbox, [StorePeer(store)] * world,
                        loss_fn, build_optimizer, seed, timeout, working_memory(tasks, plan.profile), slabs)
    history: list[StepResult] = []
    try:
        for step in range(iterations):
            inputs, target = get_batch(tasks.minibatch, step)
            inputs = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
            batch = Batch(inputs=inputs, target=target, size=tasks.minibatch, seed=seed)
            start = time.perf_counter()
            errors: list[BaseException] = []
            updater = None
            if rank == 0:
                updater = threading.Thread(target=_host_tasks, args=(plan, routes, host, shared, build_optimizer,
                                                                     step, timeout, errors), daemon=True)
                updater.start()
            result = executor.run_iteration(step, batch)
            if updater is not None:
                updater.join()
                if errors:
                    raise HarmonyError(f"the host update failed: {errors[0]}") from errors[0]
            loss = torch.tensor([result.loss], dtype=torch.float64)
            dist.all_reduce(loss)
            gathered: list[IterationResult | None] = [None] * world
            dist.all_gather_object(gathered, result)
            seconds = time.perf_counter() - start
            history.append(StepResult(loss=float(loss), seconds=seconds, workers=list(gathered)))
            on_step(step, float(loss), seconds)
    except BaseException:
        shared.set_abort()
        raise
    finally:
        executor.close()
    return history


def _host_tasks(plan, routes, host, shared, build_optimizer, iteration, timeout, errors) -> None:
    try:
        for task in plan.tasks.tasks:
            if task.device == HOST:
                host_update(task, plan.graph, routes, host, shared, build_optimizer, iteration, timeout)
    except BaseException as exc:  # handed to the training loop
        shared.set_abort()
        errors.append(exc)
