"""Running under ``torchrun``: every process is one device's worker (SPMD), on one host or more.

``torchrun --standalone --nproc-per-node N -m harmony.cli run MODEL_FILE ...`` (or
``torchrun ... $(which harmony) run ...``) starts N processes; they rendezvous through
torch.distributed (``env://``, gloo) instead of being forked by a launcher. On more than one host,
``torchrun --nnodes H --nproc-per-node N --node-rank I --master-addr HOST0 --master-port P ...`` on
every host (H x N devices in all; the plan directory given with ``--plan`` on each).

Per node (the ranks of one host; ``topology``), the node's lowest rank makes the host store, the
shared flags and the message slabs between its own ranks as files in ``/dev/shm``; the node's other
ranks map the same files, and the files are unlinked as soon as every rank mapped them, so no exit,
however abrupt, leaves one behind. Rank 0 builds the initial weights and sends them to the other
nodes' stores. Messages between workers go through the rendezvous's key-value store (offsets and
shapes into the slabs; a tensor between two hosts as bytes). Every rank reads the same minibatch
from the model file's ``get_batch``; rank 0 also runs the plan's host-bound updates, and an
all-reduce of the loss ends each iteration on every rank.

On more than one node each node's host store is a replica, kept in step by ``replication.py``:
every task's host-store writes travel to the other nodes before its done flag, and every rank waits
before the all-reduce until the other nodes applied all it sent, so the replicas are equal at every
iteration's end and the run trains exactly as on one host. A rank that fails publishes its rank and
cause to every node, and a node whose process dies is noticed by the others at once: every rank
stops within seconds with an error naming the failed rank.

With ``p2p="dist"`` (the default on GPUs) P2P messages go over torch.distributed instead
(``p2p.py``): every rank creates the pair groups on top of the rendezvous's default group (NCCL
between GPUs, gloo between emulated devices, also between hosts), and the message headers travel
through the store like the other messages.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import torch
import torch.distributed as dist

from harmony import checkpoint
from harmony.decomposer.layer_graph import dtype_from_str
from harmony.errors import HarmonyError
from harmony.runtime.channels import Aborted, Slabs
from harmony.runtime.clipping import Verdict, check_clipping, host_norm
from harmony.runtime.device import cpu_device, cuda_device, memory_checked
from harmony.runtime.context import Batch
from harmony.runtime.executor import Executor, IterationResult
from harmony.runtime.flags import Shared
from harmony.runtime.hostroom import check_room
from harmony.runtime.hoststore import HostStore, Layout
from harmony.runtime.launcher import NO_PROMISE, StepResult, WorkerError, slab_sizes
from harmony.runtime.lossscale import LossScale
from harmony.runtime.p2p import DistTransport, backend_for, p2p_pairs, pair_groups, resolve, start_default_group
from harmony.runtime.precision import needs_loss_scaling
from harmony.runtime.replication import PeerWatch, ReplicatedShared, Replicator, kept_writes, task_writes
from harmony.runtime.lr_schedule import Schedule
from harmony.runtime.updates import host_update
from harmony.scheduler.memory import kept_on
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
        key, (items, state, src, sent) = item
        self.store.set(_name(key), _pack(items, state, src, sent))


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


def _pack(items: list, state: bytes | None, src: int, sent: float) -> bytes:
    """A message as msgpack: slab places, plain values, and (for a tensor that did not fit its
    slab) the tensor's bytes with its shape and dtype, with its sender and when it was sent
    (the sender's ``Device.work_done``). Never a pickle: the store is a socket."""
    wire = []
    for item in items:
        if item[0] == "tensor":
            t = item[1].contiguous()
            wire.append(["bytes", t.view(-1).view(torch.uint8).numpy().tobytes(), list(t.shape), str(t.dtype)])
        else:
            wire.append(list(item))
    try:
        return msgpack.packb([wire, state, src, sent], use_bin_type=True)
    except TypeError as exc:
        raise HarmonyError(f"a value passed between layers cannot travel between torchrun processes ({exc}); "
                           "only tensors, numbers, strings and lists of them can") from exc


def _unpack(data: bytes) -> tuple[list, bytes | None, int, float]:
    wire, state, src, sent = msgpack.unpackb(data, raw=False)
    items = []
    for item in wire:
        if item[0] == "bytes":
            _, raw, shape, dtype = item
            flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            items.append(("tensor", flat.view(dtype_from_str(dtype)).reshape(shape)))
        else:
            items.append(tuple(item))
    return items, state, src, sent


def _name(key: tuple) -> str:
    return "harmony/msg/" + "/".join(str(part) for part in key)


@dataclass
class Topology:
    """Which ranks share a host: a node (one torchrun agent, one ``/dev/shm``, one host store)."""

    rank: int
    node: int  # this rank's node; node 0 holds rank 0
    nodes: list[list[int]]  # global ranks per node, lowest first

    @property
    def leader(self) -> bool:
        """The node's lowest rank: it makes the node's files and applies the other nodes' writes."""
        return self.rank == self.nodes[self.node][0]

    @property
    def leaders(self) -> list[int]:
        return [ranks[0] for ranks in self.nodes]

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)


def topology(rank: int, world: int) -> Topology:
    """Nodes by host name and torchrun's node rank (``GROUP_RANK``): two node ranks on one machine
    (the loopback test) are two nodes, each with files of its own."""
    here = f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"
    names: list[str | None] = [None] * world
    dist.all_gather_object(names, here)
    order = list(dict.fromkeys(names))
    nodes = [[r for r in range(world) if names[r] == name] for name in order]
    return Topology(rank, order.index(here), nodes)


@dataclass
class RunState:
    """What a checkpoint of an SPMD run is made of: this node's host store after ``iteration``
    steps (every node's replica is the same at an iteration's end). Duck-types the trainer for
    ``running.Checkpointer``."""

    plan: Any
    host: HostStore
    seed: int
    iteration: int
    schedule: Schedule | None = None
    loss_scale: LossScale | None = None

    def save_checkpoint(self, path) -> Any:
        return checkpoint.write(path, checkpoint.snapshot(self.plan, self.host, self.iteration, self.seed,
                                                          self.schedule, self.loss_scale))


def run_spmd(plan, loss_fn: Callable, build_optimizer: Callable, get_batch: Callable, build_model: Callable,
             iterations: int, seed: int = 0, timeout: float = 600.0,
             on_step: Callable[[int, float, float], None] = lambda step, loss, seconds: None,
             p2p: str = "auto", resume: str | os.PathLike | None = None, saves: frozenset[int] = frozenset(),
             save: Callable[[RunState], None] | None = None, check_memory: bool | None = None,
             lr_scheduler: Callable | None = None, clip_grad_norm: float | None = None) -> list[StepResult]:
    """Train up to ``iterations`` minibatches in all as one rank of a torchrun job; returns, on
    rank 0, every iteration's results with every rank's measurements (other ranks get their own
    only). ``p2p``: "shm", "dist" or "auto", and ``check_memory``, as for ``Launcher``.

    ``resume``: a checkpoint every host can read, loaded into each node's host store; training
    goes on from its step with its seed. ``saves``: the steps (iterations done) after which rank 0
    calls ``save`` with the run's state while every rank waits, so that nothing changes the host
    store under the save. ``lr_scheduler`` and ``clip_grad_norm`` as for ``harmony.Trainer``: every
    rank keeps the same schedule and (fp16) loss scale, stepped with the all-reduced loss and the
    NORM task's verdict, which rank 0 runs beside its host updates (``clipping.py``)."""
    if not dist.is_initialized():
        start_default_group(timeout, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    if plan.tasks.memory is None:
        raise HarmonyError(NO_PROMISE)
    # the plan's own threshold unless given, as harmony.Trainer takes it
    clip_grad_norm = clip_grad_norm if clip_grad_norm is not None else plan.options.get("clip_grad_norm")
    check_clipping(plan.tasks, clip_grad_norm)
    if world != plan.tasks.devices:
        raise HarmonyError(f"the plan is for {plan.tasks.devices} device(s) but torchrun started {world} process(es); "
                           f"start {plan.tasks.devices} in all (--nnodes times --nproc-per-node)")
    topo = topology(rank, world)
    _check_same_plan(plan, topo)
    store = dist.distributed_c10d._get_default_store()
    graph, tasks = plan.graph, plan.tasks
    program = plan.program()
    p2p = resolve(p2p, plan.options.get("device_type", "cpu"), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    token = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    prefix = os.path.join(SHM_DIR, f"harmony-{token[0]}-node{topo.node}")
    sizes = {pair: n for pair, n in slab_sizes(tasks, p2p=p2p == "shm").items()
             if topo.node_of(pair[0]) == topo.node_of(pair[1]) == topo.node}
    files = [f"{prefix}-store", f"{prefix}-flags", f"{prefix}-shared"] + [f"{prefix}-slab-{a}-{b}" for a, b in sizes]
    try:
        host, shared, slabs = _node_state(topo, plan, program, build_optimizer, build_model, seed, prefix, sizes)
        if topo.leader:
            _remove(files)  # every rank of the node mapped them: the memory lives on, the names go
        schedule = None if lr_scheduler is None else Schedule.for_graph(graph, build_optimizer, lr_scheduler)
        loss_scale = LossScale() if needs_loss_scaling(tasks.precision) else None
        start = 0
        if resume is not None:
            start, seed = _resume(topo, plan, host, resume, schedule, loss_scale)
        replicator, watch = _replication(topo, plan, program, store, host, shared, timeout)
        state = RunState(plan, host, seed, start, schedule, loss_scale)
        checkpoints = _Checkpoints(saves, save if rank == 0 else None, state)
        try:
            history = _train(topo, plan, program, host, shared, slabs, store, replicator, loss_fn, build_optimizer,
                             get_batch, range(start, iterations), seed, timeout, on_step, p2p, checkpoints,
                             memory_checked(check_memory), clip_grad_norm)
        finally:
            if replicator is not None:  # also on failure: a thread left in a store call aborts the exit
                replicator.close()
        if watch is not None:
            watch.close()
        return history
    finally:
        _remove(files)


def _resume(topo: Topology, plan, host: HostStore, path, schedule: Schedule | None = None,
            loss_scale: LossScale | None = None) -> tuple[int, int]:
    """Each node's lowest rank loads the checkpoint into its node's host store, its generators, the
    learning-rate schedule and the loss scale; every rank learns whether all could, the step and seed
    to go on from, and (from its node's leader, so that the file is read once per host) the
    generators', the schedule's and the loss scale's states."""
    outcome: tuple[str, int | None, int | None, dict | None] = ("", None, None, None)
    if topo.leader:
        try:
            step, seed = checkpoint.restore(path, plan, host, schedule=schedule, loss_scale=loss_scale)
            outcome = ("", step, seed, {"rng": checkpoint.capture_rng(),
                                        "schedule": schedule.state_dict() if schedule is not None else None,
                                        "loss_scale": loss_scale.state_dict() if loss_scale is not None else None})
        except HarmonyError as exc:
            outcome = (f"rank {topo.rank} on {socket.gethostname()}: {exc}", None, None, None)
    outcomes: list[Any] = [None] * sum(len(ranks) for ranks in topo.nodes)
    dist.all_gather_object(outcomes, outcome)
    problems = [problem for problem, _, _, _ in outcomes if problem]
    if problems:
        raise HarmonyError("cannot resume: " + "; ".join(problems) + " (every host needs the same checkpoint file)")
    found = {(step, seed) for _, step, seed, _ in outcomes if step is not None}
    if len(found) != 1:
        raise HarmonyError(f"the hosts' checkpoints are of different steps or seeds {sorted(found)}; give every host "
                           "the same checkpoint file")
    if not topo.leader:
        states = outcomes[topo.nodes[topo.node][0]][3]
        checkpoint.restore_rng(states["rng"], str(path))
        if schedule is not None:
            schedule.load_state_dict(states["schedule"])
        if loss_scale is not None:
            loss_scale.load_state_dict(states["loss_scale"])
    return found.pop()


@dataclass
class _Checkpoints:
    """When and how rank 0 saves, and the state it saves (its iteration kept current)."""

    steps: frozenset[int]
    save: Callable[[RunState], None] | None
    state: RunState

    def due(self, step: int) -> bool:
        """Whether a save follows ``step`` (0-based)."""
        return step + 1 in self.steps

    def after(self, step: int) -> None:
        """After ``step`` (0-based) on every rank: rank 0 saves if one is due, the others wait for it."""
        self.state.iteration = step + 1
        if self.state.iteration not in self.steps:
            return
        if self.save is not None:
            self.save(self.state)
        dist.barrier()


def _check_same_plan(plan, topo: Topology) -> None:
    """Every rank must run the same plan: on several hosts each loads its own copy of it (a plan
    compiled on each host would differ: profiles are measurements)."""
    body = json.dumps([plan.graph.fingerprint(), plan.tasks.to_dict()], sort_keys=True, default=str)
    digests: list[str | None] = [None] * sum(len(ranks) for ranks in topo.nodes)
    dist.all_gather_object(digests, hashlib.sha256(body.encode()).hexdigest())
    others = [r for r, d in enumerate(digests) if d != digests[0]]
    if others:
        raise HarmonyError(f"rank(s) {others} loaded another plan than rank 0; give every host the same plan "
                           "directory (compile once, copy it, and pass --plan DIR on every host)")


def _node_state(topo: Topology, plan, program, build_optimizer: Callable, build_model: Callable, seed: int, prefix: str,
                sizes: dict[tuple[int, int], int]) -> tuple[HostStore, Shared, Slabs]:
    """This node's host store, flags and slabs: made by the node's lowest rank (rank 0 builds the
    initial weights, and sends them to the other nodes' stores), mapped by the others."""
    graph, tasks = plan.graph, plan.tasks
    world = sum(len(ranks) for ranks in topo.nodes)
    kind = ReplicatedShared if len(topo.nodes) > 1 else Shared
    host = shared = None
    layout: list[Any] = [None]
    if topo.rank == 0:
        torch.manual_seed(seed)
        host = HostStore.create(graph, world, build_optimizer, build_model().state_dict(), path=prefix,
                                low_copies=plan.tasks.low_copies, slots=program.gradient_slots(plan.tasks))
        layout = [host.layout.to_dict()]
    dist.broadcast_object_list(layout, src=0)
    if topo.leader:
        if host is None:  # another node's leader: its replica of the store
            replica = Layout.from_dict(layout[0])
            check_room(max(replica.size, 1), f"node {topo.node}'s replica of the host store ({replica.describe()})")
            host = HostStore.open(replica, prefix)
        shared = kind.create(len(tasks.tasks), path=f"{prefix}-shared")
        for leader in topo.leaders[1:]:  # the same initial state on every node
            for tensor in (host.buffer, host.flags):
                if topo.rank == 0:
                    dist.send(tensor, dst=leader)
                elif topo.rank == leader:
                    dist.recv(tensor, src=0)
    dist.barrier()
    if not topo.leader:
        host = HostStore.open(Layout.from_dict(layout[0]), prefix)
        shared = kind.create(len(tasks.tasks), path=f"{prefix}-shared", create=False)
    slabs = Slabs(sizes, prefix=prefix, create=topo.leader, spill=_detached)
    dist.barrier()
    return host, shared, slabs


def _replication(topo: Topology, plan, program, store, host: HostStore, shared: Shared,
                 timeout: float) -> tuple[Replicator | None, PeerWatch | None]:
    """On more than one node: the replicator of this rank's writes and, in each node's lowest rank,
    the watch on the other nodes' (see ``replication.py``). Nothing on one node."""
    if len(topo.nodes) == 1:
        return None, None
    writes = {t.id: task_writes(t, program, plan.tasks, plan.graph, host) for t in plan.tasks.tasks}
    replicator = Replicator(store, topo.rank, topo.node, topo.nodes, host, shared, writes, timeout)
    shared.attach(replicator)
    watch = None
    if topo.leader:
        watch = PeerWatch(store, topo.rank, [r for r in topo.leaders if r != topo.rank], replicator.lost, timeout)
    dist.barrier()
    return replicator, watch


def _detached(t: torch.Tensor) -> torch.Tensor:
    """A tensor without a slab travels as itself: ``StorePeer`` serializes it at once."""
    return t.detach().cpu()


def _remove(files: list[str]) -> None:
    for path in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _train(topo: Topology, plan, program, host, shared, slabs, store, replicator, loss_fn, build_optimizer, get_batch,
           steps: range, seed, timeout, on_step, p2p: str, checkpoints: _Checkpoints,
           check_memory: bool, clip_grad_norm: float | None = None) -> list[StepResult]:
    rank, world = topo.rank, sum(len(ranks) for ranks in topo.nodes)
    tasks = plan.tasks
    capacity = plan.worker_capacity()
    torch.set_num_threads(1)  # as the profile measured an emulated device
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = (cuda_device(local_rank, local_world, capacity) if plan.options.get("device_type") == "cuda"
              else cpu_device(f"cpu{rank}", capacity, check_memory))
    device.warm_up(within_capacity=False)  # this thread computes; the plan keeps all of its capacity
    mailbox = StoreMailbox(store, shared.aborted)
    peers = [StorePeer(store)] * world
    transport = _transport(p2p, tasks, rank, device, peers, mailbox, shared, timeout)
    executor = Executor(rank, device, plan.graph, plan.tasks, program, host, shared, mailbox, peers,
                        loss_fn, build_optimizer, seed, timeout, slabs,
                        transport=transport)
    fail = replicator.fail if replicator is not None else lambda reason: shared.set_abort()
    keeps = bool(kept_on(tasks))  # state kept on the devices across iterations (scheduler/keep.py)
    history: list[StepResult] = []
    errors: list[BaseException] = []
    try:
        for step in steps:
            inputs, target = get_batch(tasks.minibatch, step)
            inputs = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
            batch = Batch(inputs=inputs, target=target, size=tasks.minibatch, seed=seed)
            start = time.perf_counter()
            schedule, loss_scale = checkpoints.state.schedule, checkpoints.state.loss_scale
            rates = schedule.rates() if schedule is not None else None
            scale = loss_scale.scale if loss_scale is not None else None
            updater = None
            verdict: list[Verdict] = []
            if rank == 0:
                updater = threading.Thread(target=_host_tasks, args=(plan, program, host, shared, build_optimizer,
                                                                     step, timeout, errors, rates, clip_grad_norm,
                                                                     scale, verdict), daemon=True)
                updater.start()
            result = executor.run_iteration(step, batch, rates, scale)
            if updater is not None:
                updater.join()
                if errors:
                    raise errors[0]
            if replicator is not None:
                replicator.flush()
            # the loss summed over the ranks; whether rank 0's NORM task skipped the step (fp16), for every rank
            skipped = bool(verdict) and verdict[0].skipped
            totals = torch.tensor([result.loss, float(skipped)], dtype=torch.float64)
            dist.all_reduce(totals)
            loss, skipped = totals[0], bool(totals[1])
            if loss_scale is not None:
                loss_scale.update(skipped)
            if schedule is not None:
                schedule.step(float(loss))
            gathered: list[IterationResult | None] = [None] * world
            dist.all_gather_object(gathered, result)
            seconds = time.perf_counter() - start
            history.append(StepResult(loss=float(loss), seconds=seconds, workers=list(gathered),
                                      grad_norm=verdict[0].norm if verdict else None, loss_scale=scale,
                                      skipped=skipped))
            on_step(step, float(loss), seconds)
            if checkpoints.due(step) and keeps:  # every rank's kept state in rank 0's host store first
                executor.sync_kept()
                if replicator is not None:
                    replicator.synced(kept_writes(rank, program, plan.tasks, plan.graph, host))
                    replicator.flush()
                dist.barrier()
            checkpoints.after(step)
    except BaseException as exc:
        own = next((e for e in errors if not isinstance(e, Aborted)), None)  # the host update's
        if own is None and transport is not None:
            own = transport.failure  # this rank's P2P failed (and stopped the rest)
        error = _failure(own or exc, topo, shared, replicator, fail, own is not None)
        if error is exc:
            raise
        raise error from exc
    finally:
        executor.close()
    return history


def _transport(p2p: str, tasks, rank: int, device, peers: list, mailbox: StoreMailbox, shared: Shared,
               timeout: float) -> DistTransport | None:
    """P2P over torch.distributed, when asked for and the plan has P2P messages: the pair groups
    (created by every rank, in one order) and this rank's transport, whose headers go through the
    store. A transport error stops this node's workers at once; the training loop then publishes
    it as this rank's failure."""
    pairs = p2p_pairs(tasks) if p2p == "dist" else []
    if not pairs:
        return None
    if device.kind == "cuda":
        torch.cuda.set_device(device.torch_device)
    groups = pair_groups(pairs, backend_for(device.kind), timeout)
    return DistTransport(rank, device, groups, peers, mailbox, shared.aborted, lambda: Shared.set_abort(shared),
                         idle_poll=0.002)


def _failure(exc: BaseException, topo: Topology, shared: Shared, replicator: Replicator | None,
             fail: Callable[[str], None], own: bool = False) -> BaseException:
    """The error this rank ends with: its own failure (published first, so that every node stops
    at once), or, when another rank's failure stopped it, that rank's."""
    if isinstance(exc, KeyboardInterrupt):
        fail(f"rank {topo.rank} was interrupted")
        return exc
    stopped = not own and (shared.aborted() or isinstance(exc, Aborted))
    if not stopped and replicator is not None and _peer_gone(exc):
        stopped = replicator.reason(wait=2.0) is not None
    if stopped:
        Shared.set_abort(shared)
        cause = replicator.reason(wait=2.0) if replicator is not None else None
        return WorkerError(f"rank {topo.rank} (node {topo.node}) stopped: "
                           f"{cause or 'another rank failed; its error is above'}")
    cause = exc if isinstance(exc, HarmonyError) else f"{type(exc).__name__}: {exc}"
    text = f"rank {topo.rank} (node {topo.node}) failed: {_SOURCE_LOCATION.sub('', str(cause))}"
    log.error("%s", text, exc_info=exc)
    fail(text)
    return WorkerError(text)


_SOURCE_LOCATION = re.compile(r"\[/[^\]]*\]\s*")  # "[/path/pair.cc:561] " in gloo's messages


def _peer_gone(exc: BaseException) -> bool:
    """A collective or store call failed because another node's process or the store went away."""
    text = str(exc)
    return (isinstance(exc, (dist.DistNetworkError, dist.DistStoreError))
            or "Connection closed by peer" in text or "Connection reset by peer" in text)


def _host_tasks(plan, program, host, shared, build_optimizer, iteration, timeout, errors, rates=None,
                clip_grad_norm: float | None = None, loss_scale: float | None = None,
                verdict: list[Verdict] | None = None) -> None:
    """Rank 0's host program in order, as the launcher's: offloaded updates at the schedule's
    ``rates``, and the NORM task of a plan that clips or scales the loss (its verdict to ``verdict``)."""
    by_id = {t.id: t for t in plan.tasks.tasks}
    try:
        for action in program.actions(HOST, "compute"):
            task = by_id[action.task]
            if action.op == "NORM":
                found = host_norm(task, program, host, shared, clip_grad_norm, iteration, timeout, loss_scale)
                if verdict is not None:
                    verdict.append(found)
            else:
                host_update(task, program, host, shared, build_optimizer, iteration, timeout, rates)
    except BaseException as exc:  # handed to the training loop, which publishes it
        errors.append(exc if isinstance(exc, Aborted) else HarmonyError(f"the host update failed: {exc!r}"))
        Shared.set_abort(shared)  # this node's workers stop waiting now
