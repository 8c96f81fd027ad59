"""The launcher: one worker process per device, the host store they share, and the iteration loop.

``Launcher(plan parts...)`` creates the host store (master weights, buffers, optimizer state and
gradient slots, once, in shared memory), starts one worker per device and waits until each has
built its executor. ``step(batch)`` hands every worker the minibatch (in shared buffers they keep from
one step to the next, ``batches.py``), runs the plan's host-bound
tasks (offloaded updates) in this process, and returns when every worker finished the iteration,
with per-device measurements. Workers on emulated CPU devices are forked (they inherit the layer
code and the user's loss function) while autograd survives a fork; CUDA workers, and emulated ones
once it does not (``processes.start_method``), are spawned and rebuild the layer graph from its
plain data.

Failure: a worker that raises reports the error, the task it was running and its traceback, and
sets the shared abort flag, so that the other workers stop waiting for it; a worker that dies
without a word (killed by a signal) is noticed by the launcher within half a second; a run in which
no worker finishes for ``timeout`` seconds is a stall, reported with what each worker was waiting
for (every worker publishes its current task and waits in the shared flags). Each way ``step``
raises ``WorkerError`` naming the device, the task and the cause, and every worker is stopped.
Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the launcher alone
decides how to stop them) and exit by themselves if the launcher dies.

P2P messages travel through shared memory (``p2p="shm"``) or over torch.distributed
(``p2p="dist"``: NCCL between GPUs, gloo between emulated devices; ``p2p.py``); "auto" takes
torch.distributed on GPUs and shared memory on emulated devices. For the latter the workers' process
groups meet at a ``FileStore`` in a directory of the launcher's (not a ``TCPStore`` served by the
launcher: a server thread alive while the workers are forked left about one start in five with a
worker hung in its store client, measured); a transport error stops the run like any worker
failure, and gloo's operations time out after ``timeout`` seconds as the workers' other waits do.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import gc
import logging
import multiprocessing.connection
import os
import signal
import sys
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import cloudpickle
import torch

from harmony.decomposer.layer_graph import LayerGraph
from harmony.decomposer.layer_support import provide_functions, provide_opaque
from harmony.errors import DeviceOutOfMemoryError, HarmonyError
from harmony.runtime import p2p as p2p_transport
from harmony.runtime.batches import BatchSlots, received
from harmony.runtime.channels import Aborted, Inbox, Mailbox, Slabs
from harmony.runtime import processes
from harmony.runtime.device import Device, cpu_device, cuda_device, memory_checked
from harmony.runtime.context import Batch, describe
from harmony.runtime.executor import Executor, IterationResult
from harmony.runtime.flags import Shared
from harmony.runtime.hoststore import HostStore
from harmony.runtime.hostroom import available_memory, gib
from harmony.scheduler.lower import Program
from harmony.scheduler.memory import kept_on
from harmony.runtime.lr_schedule import Rates
from harmony.runtime.streams import SWITCH_INTERVAL
from harmony.runtime.clipping import Verdict, check_clipping, host_norm
from harmony.runtime.lossscale import LossScale
from harmony.runtime.precision import needs_loss_scaling
from harmony.runtime.timed import TimedDevice, Timing, sleep_until
from harmony.runtime.updates import host_update
from harmony.scheduler.tasks import HOST, Channel, TaskGraph

log = logging.getLogger(__name__)

__all__ = ["Launcher", "WorkerError", "StepResult"]


NO_PROMISE = ("the plan's task graph carries no memory promise (TaskGraph.memory), which the runtime admits every "
              "copy against: compile it with harmony.compile or `harmony compile`, or attach one with "
              "plan.promise_memory()")


# commands besides an iteration: the kept state to the host store; let go (all, or the weights and buffers)
SYNC, DROP, DROP_WEIGHTS = "sync", "drop", "drop-weights"


class WorkerError(HarmonyError):
    """A worker failed or died during a run."""


@dataclass
class StepResult:
    loss: float
    seconds: float
    workers: list[IterationResult] = field(default_factory=list)
    # (task, label, start, end) of the host's tasks (offloaded updates), time.perf_counter seconds
    host_events: list[tuple[int, str, float, float]] = field(default_factory=list)
    grad_norm: float | None = None  # the global gradient norm before clipping, in a plan that clips
    loss_scale: float | None = None  # fp16: the scale the loss was multiplied by
    skipped: bool = False  # fp16: the gradient overflowed and no parameter stepped

    def bytes_by_channel(self) -> dict[str, int]:
        """Bytes all workers moved per channel ("SWAP in", "P2P out", ...), as the plan counts them:
        the loss target's copy to the device is left out (the plan does not model it)."""
        total: dict[str, int] = {}
        for worker in self.workers:
            for key, value in worker.bytes_by_channel.items():
                if not key.startswith("TARGET"):
                    total[key] = total.get(key, 0) + value
        return total


@dataclass
class _WorkerContext:
    """What a worker needs; under fork it is inherited as is, under spawn it is pickled (the
    layer graph then travels as plain data and is rebuilt on the meta device)."""

    rank: int
    device_type: str
    capacity: int
    threads: int
    seed: int
    timeout: float
    graph_data: dict | None
    graph: LayerGraph | None
    tasks: TaskGraph
    program: Program  # the plan's, as compiled: a worker lowers nothing
    store: HostStore
    shared: Shared
    inboxes: list[Any]
    commands: Any  # this worker's end of its command pipe (multiprocessing.connection.Connection)
    results: Any  # this worker's end of its result pipe
    loss_fn: Callable
    build_optimizer: Callable
    slabs: Slabs
    prefetch: bool
    check_memory: bool  # emulated devices count every op against their capacity (device.memory_checked)
    p2p_store: str | None = None  # the rendezvous FileStore's path when P2P goes over torch.distributed
    p2p_pairs: list[tuple[int, int]] = field(default_factory=list)
    timing: Timing | None = None  # timed devices (``timed.py``): what each unit and copy takes


def slab_sizes(tasks: TaskGraph, p2p: bool = True) -> dict[tuple[int, int], int]:
    """Bytes per iteration each (sender, receiver) pair of workers exchanges in messages, with room
    to spare: the plan's sizes are interpolated, and pieces are aligned. ``p2p=False``: P2P
    messages go over torch.distributed, not through the slabs."""
    channels = (Channel.P2P, Channel.SWAP, Channel.MSG) if p2p else (Channel.SWAP, Channel.MSG)
    sizes: dict[tuple[int, int], int] = {}
    device = {t.id: t.device for t in tasks.tasks}
    for task in tasks.tasks:
        for t in task.inputs:
            if t.task is None or t.channel not in channels:
                continue
            src = device[t.task]
            if src == task.device or src == HOST or task.device == HOST or t.tensor not in ("X", "Xs", "dY"):
                continue
            sizes[(src, task.device)] = sizes.get((src, task.device), 0) + t.nbytes + 4 * 64
    return {pair: int(n * 1.25) + (1 << 20) for pair, n in sizes.items()}


class _ByValue:
    """A user's function on its way to spawned workers, pickled with cloudpickle: by reference
    where it can be imported, by value where plain pickle could only name it (a lambda, a closure,
    a function defined in a notebook cell or in the script run as ``__main__``)."""

    def __init__(self, fn: Callable, payload: bytes) -> None:
        self.fn, self.payload = fn, payload

    def __reduce__(self):
        return (_ByValue.load, (self.payload,))

    @staticmethod
    def load(payload: bytes) -> "_ByValue":
        return _ByValue(cloudpickle.loads(payload), payload)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _by_value(fn: Callable, what: str) -> _ByValue:
    try:
        return _ByValue(fn, cloudpickle.dumps(fn))
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises, named for the user
        raise HarmonyError(
            f"cannot send the {what} {getattr(fn, '__qualname__', fn)!r} to the workers: {type(exc).__name__}: {exc}. "
            "They are spawned processes here (CUDA workers always; emulated ones once this process's autograd "
            "cannot survive a fork) and "
            "receive it pickled: it must not hold what cannot be (an open file, a lock, a CUDA tensor)"
        ) from exc


def _layer_extras(graph: LayerGraph) -> bytes | None:
    """What the layers use and spawned workers cannot rebuild from generated code, pickled: the
    modules kept whole (structure only, on the meta device: the weights come with the pack state)
    and the custom autograd Functions they call (by value where they cannot be imported by name,
    as a class of the script run as __main__)."""
    if graph.modules is None:
        return None
    modules, functions = graph.opaque_modules(), graph.functions()
    if not modules and not functions:
        return None
    try:
        return cloudpickle.dumps({"modules": {path: copy.deepcopy(m).to("meta") for path, m in modules.items()},
                                  "functions": functions})
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises, named for the user
        names = sorted(modules) + [qualname for _, qualname in functions]
        raise HarmonyError(
            f"cannot send {', '.join(names)} (kept whole, or a custom autograd Function) to the workers: "
            f"{type(exc).__name__}: {exc}. They are spawned processes here and receive these pickled: they must not "
            "hold what cannot be (an open file, a lock)") from exc


def _make_device(ctx: _WorkerContext) -> Device:
    if ctx.device_type == "cuda":
        return cuda_device(ctx.rank, len(ctx.inboxes), ctx.capacity)
    if ctx.timing is not None:
        return TimedDevice(f"timed{ctx.rank}", ctx.capacity, ctx.timing)
    return cpu_device(f"cpu{ctx.rank}", ctx.capacity, ctx.check_memory)


def _exit_with_parent(parent: int) -> None:
    """A worker whose launcher died (SIGKILL, a crash) must not live on as an orphan."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def _failure(ctx: _WorkerContext, exc: BaseException) -> dict[str, Any]:
    """What the launcher needs to explain a worker's failure (plain data: it crosses a queue)."""
    oom = isinstance(exc, DeviceOutOfMemoryError)
    return {
        "kind": "oom" if oom else "stall" if isinstance(exc, TimeoutError) else "error",
        "task": ctx.shared.current_task(ctx.rank),
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(exc)),
        "memory": [exc.requested, exc.current, exc.capacity] if oom else None,
    }


def _next_command(commands: Any) -> Any:
    """The launcher's next command; None (stop) once the launcher's end is closed."""
    try:
        return commands.recv()
    except (EOFError, OSError):
        return None


def _report(ctx: _WorkerContext, message: tuple) -> None:
    """A failure or an abort to the launcher, unless it has stopped listening (it closed first)."""
    try:
        ctx.results.send(message)
    except (OSError, ValueError):
        log.debug("dev%d: the launcher no longer reads: %s", ctx.rank, message[0])


def _worker_main(ctx: _WorkerContext) -> None:
    """A worker's life: build the executor, then run iterations until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="harmony-parent-watch", daemon=True).start()
    torch.set_num_threads(ctx.threads)
    sys.setswitchinterval(SWITCH_INTERVAL)
    stacks = open(_stacks_path(os.getpid()), "w")  # noqa: SIM115 - open for the worker's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the launcher asks for them on a stall
    mailbox = None
    executor = None
    transport = None
    try:
        graph = ctx.graph
        if graph is None:
            graph = LayerGraph.from_dict(ctx.graph_data["graph"])
            graph.sources = dict(ctx.graph_data["sources"])
            if ctx.graph_data.get("by_value"):  # after the context, so the model file's module is loaded
                by_value = cloudpickle.loads(ctx.graph_data["by_value"])
                provide_opaque(by_value["modules"])
                provide_functions(by_value["functions"])
            graph.build_modules(device="meta")
        device = _make_device(ctx)
        device.warm_up(within_capacity=False)  # this thread computes; the plan keeps all of its capacity
        mailbox = Mailbox(ctx.inboxes[ctx.rank], ctx.shared.aborted)
        if ctx.p2p_store is not None:
            if ctx.device_type == "cuda":
                torch.cuda.set_device(device.torch_device)
            groups = p2p_transport.init_local(ctx.rank, len(ctx.inboxes), ctx.p2p_store, ctx.device_type,
                                              ctx.p2p_pairs, ctx.timeout)
            transport = p2p_transport.DistTransport(ctx.rank, device, groups, ctx.inboxes, mailbox, ctx.shared.aborted,
                                                    ctx.shared.set_abort)
        executor = Executor(ctx.rank, device, graph, ctx.tasks, ctx.program, ctx.store, ctx.shared, mailbox, ctx.inboxes,
                            ctx.loss_fn, ctx.build_optimizer, ctx.seed, ctx.timeout, ctx.slabs,
                            prefetch=ctx.prefetch, transport=transport)
        # what the worker inherited and built is never garbage: the collector's passes would walk the
        # launcher's whole heap (a test run's, a notebook's) between the plan's units
        gc.freeze()
        ctx.results.send(("ready", ctx.rank, None))
        batch = None
        while True:
            command = _next_command(ctx.commands)
            if command is None:
                break
            if command in (SYNC, DROP, DROP_WEIGHTS):  # the kept state (scheduler/keep.py) to the host store, or let go
                executor.sync_kept() if command == SYNC else executor.drop_kept(optimizer=command == DROP)
                ctx.results.send((command, ctx.rank, None))
                continue
            iteration, sent, rates, loss_scale = command
            batch = received(sent, batch)
            result = executor.run_iteration(iteration, batch, rates, loss_scale)
            ctx.results.send(("done", ctx.rank, (iteration, result)))
    except Aborted:
        if transport is not None and transport.failure is not None:  # this worker's own P2P failed
            _report(ctx, ("failed", ctx.rank, _failure(ctx, transport.failure)))
        else:
            _report(ctx, ("aborted", ctx.rank, None))
    except BaseException as exc:  # reported to the launcher, which raises it
        ctx.shared.set_abort()
        _report(ctx, ("failed", ctx.rank, _failure(ctx, exc)))
    finally:
        if executor is not None:
            executor.close()
        elif transport is not None:
            transport.close()
        if transport is not None and transport.idle:  # (a thread left inside a receive: the exit ends it)
            p2p_transport.shutdown()
        if mailbox is not None:
            mailbox.close()
        faulthandler.unregister(signal.SIGUSR1)
        stacks.close()
        if os.path.getsize(stacks.name) == 0:  # kept only when it holds a stall's stacks
            os.unlink(stacks.name)


def _warn_of_parked(tasks: TaskGraph) -> None:
    """Say so where what the plan parks in host memory between its forwards and backwards
    (``TaskGraph.parked_bytes``, at most) is more than the host has available beside the store:
    the workers would find out mid-run, from the kernel's out-of-memory killer."""
    parked, available = tasks.parked_bytes(), available_memory()
    if parked and available is not None and parked > available:
        log.warning("this plan parks up to %s of activations in host memory between its forwards and backwards, but "
                    "the kernel reports %s available beside the host store: a worker may be killed for memory "
                    "mid-run; free memory on this host, or compile a plan that recomputes more", gib(parked),
                    gib(available))


def _fmt(n: int | None) -> str:
    return DeviceOutOfMemoryError._fmt(n)


def _stacks_path(pid: int) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"harmony-worker-{pid}-stacks.txt")


class Launcher:
    """One worker per device running ``tasks``; see the module docs."""

    def __init__(self, graph: LayerGraph, tasks: TaskGraph, program: Program, store: HostStore, loss_fn: Callable,
                 build_optimizer: Callable, device_type: str = "cpu", capacity: int | None = None,
                 seed: int = 0, timeout: float = 600.0, threads: int | None = None,
                 prefetch: bool = True, p2p: str = "auto", check_memory: bool | None = None,
                 clip_grad_norm: float | None = None, loss_scale: float | None = None,
                 timing: Timing | None = None) -> None:
        if tasks.memory is None:
            raise HarmonyError(NO_PROMISE)
        if program.tasks and program.tasks != tasks.fingerprint():  # once here: every worker gets these two
            raise HarmonyError("the program was lowered from another task graph than the one to run; lower it from "
                               "this one (Plan.program)")
        if not program.owner and graph.parameter_layers():
            raise HarmonyError("the program was lowered without the model's parameters, so it says nobody steps them; "
                               "lower it with them (Plan.program, or lower(tasks, profile, "
                               "params=layer_graph.parameter_layers()))")
        check_clipping(tasks, clip_grad_norm)
        self.keeps = bool(kept_on(tasks))  # whether the devices keep state across iterations
        self._host_work = bool(program.actions(HOST, "compute"))  # updates or a norm on the host
        self._synced = 0  # the iteration after which the host store last held every kept state
        self.clip_grad_norm = clip_grad_norm
        self.timing = timing
        self.loss_scale = None
        if needs_loss_scaling(tasks.precision):
            self.loss_scale = LossScale() if loss_scale is None else LossScale(scale=float(loss_scale))
        method = processes.start_method(device_type)
        if method != "fork":  # before anything is made that would need closing
            loss_fn, build_optimizer = _by_value(loss_fn, "loss function"), _by_value(build_optimizer, "optimizer builder")
        self.graph = graph
        self.tasks = tasks
        self.store = store
        self.build_optimizer = build_optimizer
        self.program = program
        self.by_id = {t.id: t for t in tasks.tasks}
        self.timeout = timeout
        self.devices = tasks.devices
        mpctx = processes.context(method)
        self.shared = Shared.create(len(tasks.tasks), bell=mpctx.Semaphore(0))
        _warn_of_parked(tasks)
        self.p2p = p2p_transport.resolve(p2p, device_type, tasks.devices)
        pairs = p2p_transport.p2p_pairs(tasks) if self.p2p == "dist" else []
        # the directory of the FileStore the workers' process groups meet at (P2P over torch.distributed)
        self._rendezvous = tempfile.mkdtemp(prefix="harmony-p2p-") if pairs else None
        self.slabs = Slabs(slab_sizes(tasks, p2p=self.p2p == "shm"))
        self.planned = dict(tasks.memory.tasks)
        self.iteration = 0
        self._closed = False
        self._threads_before: int | None = None  # this process's torch threads, restored at close
        self._slots = BatchSlots()
        self.inboxes = [Inbox(mpctx) for _ in range(self.devices)]
        # a pipe each way per worker, not a multiprocessing.Queue: a queue's feeder thread adds a
        # thread hand-off to every command and every result
        self.commands: list[Any] = []  # our ends
        self.results: list[Any] = []
        # a forked worker must not enter an OpenMP parallel region if this process ever did (it
        # would hang): emulated devices compute on one thread each, as the profiler measured them
        threads = threads or (1 if device_type == "cpu" else max(1, (os.cpu_count() or 1) // self.devices))
        graph_data = None
        if method != "fork":
            graph_data = {"graph": graph.to_dict(), "sources": dict(graph.sources), "by_value": _layer_extras(graph)}
        self.processes = []
        for rank in range(self.devices):
            # made just before its worker starts, so that no other worker inherits its ends: a
            # worker's exit then closes its result pipe, and a command to it breaks its pipe
            command_in, command_out = mpctx.Pipe(duplex=False)
            result_in, result_out = mpctx.Pipe(duplex=False)
            self.commands.append(command_out)
            self.results.append(result_in)
            ctx = _WorkerContext(
                rank=rank, device_type=device_type, capacity=capacity, threads=threads, seed=seed, timeout=timeout,
                graph_data=graph_data, graph=graph if method == "fork" else None, tasks=tasks, program=program,
                store=store,
                shared=self.shared, inboxes=self.inboxes, commands=command_in, results=result_out,
                loss_fn=loss_fn, build_optimizer=build_optimizer,
                slabs=self.slabs, prefetch=prefetch, check_memory=memory_checked(check_memory), p2p_pairs=pairs,
                p2p_store=os.path.join(self._rendezvous, "store") if self._rendezvous is not None else None,
                timing=timing,
            )
            process = mpctx.Process(target=_worker_main, args=(ctx,), name=f"harmony-dev{rank}", daemon=True)
            processes.start([process])
            self.processes.append(process)
            command_in.close()  # the worker's ends are its own
            result_out.close()
        # this process's own torch work while the workers compute runs on one thread until ``close``:
        # emulated devices' workers have the cores. The minibatch's copy into their slots at the
        # default threads would leave an idle OpenMP team spin-waiting on a core the workers need;
        # and the host's updates run on the one thread the profiler timed them with (on every core
        # they would contend with the workers and take longer than the estimate knows)
        if device_type == "cpu":
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(1)
        try:
            self._collect("ready", timeout=max(60.0, timeout))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ running
    def step(self, batch: Batch, rates: Rates | None = None) -> StepResult:
        """One iteration over ``batch`` on every worker, updating at the learning-rate schedule's
        ``rates`` if any (``schedule.py``); raises ``WorkerError`` if one fails."""
        if self._closed:
            raise HarmonyError("this launcher was closed; start a new one")
        iteration = self.iteration
        start = time.perf_counter()
        sent = self._slots.fill(batch)
        scale = self.loss_scale.scale if self.loss_scale is not None else None
        host_error: list[BaseException] = []
        host_events: list[tuple[int, str, float, float]] = []
        verdict: list[Verdict] = []
        host = None  # a plan with no host tasks (its updates on the devices) starts no thread per step
        if self._host_work:
            host = threading.Thread(target=self._host_tasks,
                                    args=(iteration, host_error, host_events, rates, scale, verdict), daemon=True)
        # from the first command sent, anything raised here (a signal's ``Interrupted`` included, which
        # can land in ``Thread.start``'s wait) stops the iteration on every worker before closing:
        # closing with an iteration still running on some workers and not on others left ``close``
        # waiting for their kept state's write-back until the run's timeout (a flaky ``test_cli_signals``)
        try:
            self._send((iteration, sent, rates, scale))
            if host is None:
                results = self._collect("done", timeout=self.timeout)
            else:
                host.start()
                results = self._collect("done", timeout=self.timeout)
                host.join()
        except BaseException:
            self.shared.set_abort()
            if host is not None and host.ident is not None:
                host.join(timeout=5)
            self.close()
            raise
        if host_error:
            self.close()
            raise WorkerError(f"the host update failed: {host_error[0]}") from host_error[0]
        self.iteration += 1
        norm, skipped = (verdict[0].norm, verdict[0].skipped) if verdict else (None, False)
        if self.loss_scale is not None:
            self.loss_scale.update(skipped)
        ordered = [results[r][1] for r in range(self.devices)]
        return StepResult(loss=sum(r.loss for r in ordered), seconds=time.perf_counter() - start, workers=ordered,
                          host_events=host_events, grad_norm=norm, loss_scale=scale, skipped=skipped)

    def _host_tasks(self, iteration: int, errors: list, events: list, rates: Rates | None, loss_scale: float | None,
                    verdict: list) -> None:
        """The host's program (``Program.actions(HOST, "compute")``), in order: offloaded updates, and
        the NORM of a plan that clips or scales the loss (its norm and whether the step is skipped go
        to ``verdict``)."""
        try:
            for action in self.program.actions(HOST, "compute"):
                task = self.by_id[action.task]
                if action.op == "NORM":
                    found = host_norm(task, self.program, self.store, self.shared, self.clip_grad_norm, iteration,
                                      self.timeout, loss_scale)
                    verdict.append(found)
                    began = found.began
                elif action.op == "UPD":
                    began = host_update(task, self.program, self.store, self.shared, self.build_optimizer,
                                        iteration, self.timeout, rates)
                else:
                    raise HarmonyError(f"the host's program has {action}, which the host does not run")
                if self.timing is not None:  # the host's work lasts its modelled time, as a device's does
                    sleep_until(began + self.timing.units.get((task.id, 0), 0.0))
                events.append((task.id, str(task), began, time.perf_counter()))
        except Aborted:
            pass
        except BaseException as exc:  # handed to step()
            self.shared.set_abort()
            errors.append(exc)

    def _send(self, command: Any) -> None:
        """``command`` to every worker. A worker that has died since its last word breaks its pipe:
        that is reported as its death (how it ended), not as the broken pipe."""
        for rank, pipe in enumerate(self.commands):
            try:
                pipe.send(command)
            except OSError as exc:
                self._check_alive({})
                raise WorkerError(f"the worker of device {rank} no longer reads its commands ({exc})") from exc

    def _collect(self, kind: str, timeout: float) -> dict[int, Any]:
        """One ``kind`` message from every worker; a failure, a death or silence raises."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        aborted: set[int] = set()
        ended: set[int] = set()  # workers whose end of the result pipe closed: they exited
        while len(got) < self.devices:
            waiting = [self.results[r] for r in range(self.devices) if r not in got and r not in ended]
            ready = multiprocessing.connection.wait(waiting, timeout=0.5) if waiting else []
            if not ready:
                if not waiting:  # every silent worker has exited: give the kernel a moment to report it
                    time.sleep(0.1)
                self._check_alive(got)
                if time.monotonic() > deadline:
                    status = self._status()
                    self._dump_stacks()
                    self.shared.set_abort()
                    paths = ", ".join(_stacks_path(p.pid) for p in self.processes if p.pid)
                    raise WorkerError(f"no word from the workers for {timeout:.0f} s: a device is stalled.\n{status}\n"
                                      f"(their threads' stacks are in {paths})")
                continue
            for pipe in ready:
                try:
                    msg, rank, payload = pipe.recv()
                except (EOFError, OSError):  # reported by _check_alive once the process is reaped
                    ended.add(self.results.index(pipe))
                    continue
                log.debug("worker %d says %s", rank, msg)
                if msg == kind:
                    got[rank] = payload
                elif msg == "failed":
                    raise self._failed(rank, payload)
                elif msg == "aborted":
                    aborted.add(rank)
                    got[rank] = None
        if aborted:
            raise WorkerError("a worker stopped because another one failed")
        return got

    def _check_alive(self, got: dict[int, Any]) -> None:
        for rank, p in enumerate(self.processes):
            if p.is_alive() or rank in got:
                continue
            task = self.shared.current_task(rank)
            self.shared.set_abort()
            code = p.exitcode
            how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else \
                f"exited with code {code}"
            where = f" while running {describe(self.by_id[task])}" if task is not None else ""
            raise WorkerError(f"the worker of device {rank} (pid {p.pid}) {how}{where}, without reporting an error; "
                              "if the system ran out of host memory, see the kernel log (dmesg)")

    def _failed(self, rank: int, report: dict[str, Any]) -> WorkerError:
        """The launcher's account of a worker's failure: device, task, cause, and the worker's traceback."""
        task = report.get("task")
        where = f" in {describe(self.by_id[task])}" if task is not None else ""
        log.debug("worker %d failed:\n%s", rank, report.get("traceback"))
        if report["kind"] == "oom":
            return WorkerError(self._oom_message(rank, task, where, report["memory"]))
        if report["kind"] == "stall":
            return WorkerError(f"device {rank} stalled{where}: {report['error']}\n{self._status()}")
        return WorkerError(f"the worker of device {rank} failed{where}: {report['error']}\n\n"
                           f"the worker's traceback:\n{report['traceback']}")

    def _oom_message(self, rank: int, task: int | None, where: str, memory: list) -> str:
        requested, current, capacity = memory
        planned = self.planned.get(task) if task is not None else None
        expected = f"; the plan expected this task to peak at {_fmt(planned)}" if planned else ""
        return (f"device {rank} ran out of memory{where}: it asked for {_fmt(requested)} more with {_fmt(current)} "
                f"in use of its {_fmt(capacity)}{expected}. The plan underestimated this run, or another process "
                "took device memory: compile again leaving more headroom, with a larger --memory-margin (the share "
                "of device memory left unplanned; the default is 0.1) or a smaller --device-memory")

    def _status(self) -> str:
        """Per worker: alive or not, the task it runs, and what it waits for."""
        lines = []
        for rank, p in enumerate(self.processes):
            task = self.shared.current_task(rank)
            doing = describe(self.by_id[task]) if task is not None else "between tasks"
            waiting = self.shared.get_status(rank) or ("nothing: computing" if task is not None else "its next command")
            state = "alive" if p.is_alive() else f"dead (exit code {p.exitcode})"
            lines.append(f"  device {rank} ({state}): {doing}; waiting for {waiting}")
        return "\n".join(lines)

    def _dump_stacks(self) -> None:
        """Have every live worker print its threads' stacks (to its stderr): what a stall waits on."""
        for _ in range(2):  # twice, a second apart: what stays the same is what is stuck
            for p in self.processes:
                if p.is_alive() and p.pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1.0)

    # ------------------------------------------------------------ kept state
    def sync(self) -> None:
        """Bring the host store up to date: each worker writes back the state its device keeps
        across iterations (``scheduler/keep.py``); before anyone reads the host store. Raises if the
        workers stopped (a failure) with kept state the store does not have."""
        if self.keeps and self._closed and self._synced != self.iteration:
            raise HarmonyError(
                f"the devices kept their packs' weights and optimizer state across iterations, and the run stopped "
                f"before writing them back: the host store holds the state after iteration {self._synced}, not "
                f"{self.iteration}; continue from the last checkpoint (or compile with --no-keep-state to write "
                "them back every iteration)")
        self._kept_command(SYNC)
        self._synced = self.iteration

    def drop(self, optimizer: bool = True) -> None:
        """The host store was written (a checkpoint, or weights alone without ``optimizer``): each
        worker lets that kept state go, and the next iteration loads it from the host store."""
        self._kept_command(DROP if optimizer else DROP_WEIGHTS)
        self._synced = self.iteration  # the store is the state now

    def _kept_command(self, command: str, close_on_failure: bool = True) -> None:
        if not self.keeps or self._closed:
            return
        try:
            self._send(command)
            self._collect(command, timeout=self.timeout)
        except BaseException:
            self.shared.set_abort()
            if close_on_failure:
                self.close()
            raise

    # ------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop every worker (politely, then by force) and free the queues; safe to call twice.
        State the devices keep is written back to the host store first, where the workers are
        still well: the store then holds the run's result."""
        if self._closed:
            return
        if self.keeps and not self.shared.aborted() and all(p.is_alive() for p in self.processes):
            try:
                self._kept_command(SYNC, close_on_failure=False)
                self._synced = self.iteration
            except BaseException as exc:  # noqa: BLE001 - closing goes on; the store keeps the last synced state
                log.warning("could not write the devices' kept state back to the host store: %s", exc)
        self._closed = True
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        for pipe in self.commands:
            try:
                pipe.send(None)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + (2 if self.shared.aborted() else 10)
        for p in self.processes:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for p in self.processes:  # a worker killed before its clean-up leaves an empty stacks file
            path = _stacks_path(p.pid) if p.pid else None
            if path and os.path.exists(path) and os.path.getsize(path) == 0:
                os.unlink(path)
        for inbox in self.inboxes:
            inbox.close()
        for pipe in [*self.commands, *self.results]:
            pipe.close()
        if self._rendezvous is not None:
            shutil.rmtree(self._rendezvous, ignore_errors=True)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
