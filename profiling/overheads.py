"""The runtime's own costs, measured on its own path: what a task, a microbatch and an optimizer step
cost beyond their compute and transfers, and how many cores the emulated devices' compute shares.

The profile times each layer alone; the probe times copies alone. What neither sees is the executor's
work around them (loading a pack's state, handing inputs and outputs between the compute thread and
the stream threads, generator states, marking tasks done, building an optimizer for each step), and,
on the emulated ``cpu`` backend, that all devices compute on the same cores. ``measure_overheads``
runs the real :class:`~harmony.runtime.launcher.Launcher` on a chain of layers of near-zero compute,
in two task graphs (Harmony DP: several microbatches per task and offloaded updates; per-device-swap
DP: one microbatch per task and an update task per pack on each device), and takes each task's
measured span minus the span the event-driven estimator gives it without overheads (compute and
transfers as profiled and probed): the line ``task + microbatch * microbatches`` through the lower
quartile of the residuals of the FWD/BWD tasks of one microbatch and that of the tasks of
``MINIBATCH`` microbatches gives ``task_overhead`` and ``microbatch_overhead``; the lower quartile of
the residuals of the device UPD tasks, less ``task_overhead``, gives ``update_overhead``. The
probe's layers alternate between 2 state tensors and 12 (``_ManyTensors``) and step with Adam (two
state tensors a parameter): the updates of the two kinds differ by the runtime's cost per state
tensor moved (``tensor_overhead``, ``_tensor_cost``), which the fits above then take as modelled.
A GPT-2 block's update moves about a hundred tensors (each a copy and a ledger entry, though under
one admission): with the plain linear layers' update cost alone, a transformer's device updates
would run well over their estimate. (Lower quartiles: on a shared machine other processes delay some
tasks by whole scheduler slices, which is the machine's load at that moment, not the runtime's cost;
on a busy machine the medians vary widely from one probe to the next.) Last, a wrap-around pipeline
on the same layers sends every microbatch from device to device through the runtime's p2p path (a
stream thread, a queue, the receiver's mailbox thread, its p2p-in stream, the compute thread
waiting): the per-message cost is the ``p2p_latency`` at which the estimator, with the overheads
above, gives that pipeline's measured iteration time (found by bisection; the estimate grows with
it). The probe's own half round trip between two processes sees none of those threads.

``measure_compute_scaling`` runs data parallelism over transformer MLP blocks (matrix products and
the memory-bound element-wise ops around them, as in the models trained here) on the real launcher,
on one device and on all: the factor on the estimator's compute that makes its task spans (with the
overheads above) the runtime's, as a median over the tasks and then over a few runs, is
``compute_scale`` on one device (the worker's compute thread shares
the interpreter lock with its stream threads, which a layer profiled alone never does); its growth
on all devices at once is ``compute_interference`` (the memory bus and caches the devices share).
Both depend on the workload; the blocks are one point, chosen to look like the models in ``models/``.
``measure_model_scale`` measures both again on the model being compiled, which a probed compile on
emulated devices uses instead (``compiler._scaled_to_the_model``): its own layers in a few packs on
one device and on all, at the square root of the largest microbatch its profile measured (plans
under memory pressure run small microbatches, and the ratio moves with the microbatch). The blocks'
scale can leave a model's estimate well under its runs, and the model's own brings it closer
(``python -m bench.estimate_accuracy --full`` compares the two). The model's calibration
also reads what each of its tasks costs beside the scale (``_task_cost``, the machine's
``compute_task_overhead``): its tasks hold two microbatches, a plan's up to eight, and a cost per
task read as a scale grows with every microbatch of a long task.

``measure_cores`` runs a fixed single-threaded loop for a fixed window in one forked process, then in
``devices + 1`` processes released together by a barrier: ``k`` processes on ``c`` free cores do ``c``
times the work of one (at most ``k``). Counting work in one window, rather than timing a fixed amount
of work, keeps every process running for the whole measurement: timed runs that fork starts one
after another overlap only in part, and would read a machine as having more cores than it has.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from harmony.decomposer.decompose import decompose
from harmony.decomposer.layer_graph import LayerGraph
from harmony.scheduler.costs import task_compute_seconds
from harmony.scheduler.estimator import estimate, promise
from harmony.scheduler.lower import Program, lower
from harmony.scheduler.machine import Machine
from harmony.profiling.profiles import LayerProfile, LayerSample, Profile
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import HOST, Configuration, Kind, TaskGraph

from harmony.runtime.device import CpuDevice
from harmony.runtime.context import Batch
from harmony.runtime.host_step import host_optimizer
from harmony.runtime.hoststore import HostStore
from harmony.runtime.launcher import Launcher
from .measure import host_device, measure_layer, measure_update, torch_threads

log = logging.getLogger(__name__)

__all__ = ["Overheads", "Scaling", "measure_overheads", "measure_cores", "measure_compute_scaling", "measure_model_scale"]

WIDTH = 8  # features of the probe's layers: compute of a few microseconds
LAYERS = 4
MINIBATCH = 8  # per device
_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Overheads:
    """Seconds the runtime spends per task, per microbatch and per optimizer step beyond compute and
    transfers, with the evidence (``tasks``: how many task spans the fit used)."""

    task: float
    microbatch: float
    update: float
    message: float  # s, one p2p message on the runtime's path (the pipeline's calibration)
    tasks: int
    iteration: float = 0.0  # s, per iteration: the minibatch to the workers, their results back
    tensor: float = 0.0  # s, per state tensor moved between the host store and a device
    host_update: float = 0.0  # s, per update on the host beyond its step
    host_tensor: float = 0.0  # s, per parameter an update on the host steps
    send: float = 0.0  # s, of the sender's compute thread per p2p message


def _optimizer(params):
    """Adam, as most models trained here use: its two state tensors per parameter are what a pack's
    update moves most of (``tensor_overhead``)."""
    return torch.optim.Adam(params, lr=0.01)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


class _ManyTensors(torch.nn.Module):
    """A layer of near-zero compute whose state is many small tensors (a linear layer and
    ``EXTRA_TENSORS`` biases): beside plain linear layers, what its update costs more is the
    runtime's cost per state tensor moved."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.biases = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(width)) for _ in range(EXTRA_TENSORS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        for b in self.biases:
            x = x + b
        return x


EXTRA_TENSORS = 10


def _model() -> torch.nn.Module:
    """Linear layers of 2 tensors alternating with layers of 12."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) if i % 2 == 0 else _ManyTensors(WIDTH)
                                 for i in range(LAYERS)])


class _Block(torch.nn.Module):
    """A transformer MLP block: the mix of matrix products and memory-bound element-wise ops (and
    the number of small ops per millisecond) that the models trained here have."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


BLOCK_WIDTH = 64
BLOCK_TOKENS = 32
BLOCKS = 4


def _blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[_Block(BLOCK_WIDTH) for _ in range(BLOCKS)])


def _profile(graph, device: CpuDevice, shape: tuple[int, ...] = (WIDTH,)) -> Profile:
    """The probe's layers profiled as the profiler does it (so the residual is what it misses);
    ``shape``: one sample's input."""
    layers = []
    samples: list[list[LayerSample]] = [[] for _ in graph.modules]
    for u in _SIZES:
        values: tuple = (torch.randn(u, *shape),)
        for i, module in enumerate(graph.modules):
            m, values = measure_layer(module, values, device, trials=3, input_grad=i > 0)
            samples[i].append(LayerSample(u=u, fwd_time=m.fwd_time, bwd_time=m.bwd_time,
                                          recompute_time=m.recompute_time, fwd_peak=m.fwd_peak, bwd_peak=m.bwd_peak,
                                          x_bytes=m.x_bytes, y_bytes=m.y_bytes, dx_bytes=m.dx_bytes,
                                          act_bytes=m.act_bytes))
    for i, module in enumerate(graph.modules):
        params = [p for p in module.parameters() if p.requires_grad]
        upd_host, k_bytes, k_tensors = measure_update(params, host_optimizer(_optimizer), host_device(), 3)
        upd_device = measure_update(params, _optimizer, device, 3).seconds
        nbytes = sum(p.numel() * p.element_size() for p in params)
        layers.append(LayerProfile(index=i, name=graph.layers[i].name, w_bytes=nbytes, dw_bytes=nbytes,
                                   k_bytes=k_bytes, b_bytes=0, upd_time_device=upd_device, upd_time_host=upd_host,
                                   fwd_samples=samples[i], bwd_samples=samples[i], w_tensors=len(params),
                                   dw_tensors=len(params), k_tensors=k_tensors))
    return Profile(source="measured", device="cpu:overhead-probe", capacity=device.capacity,
                   u_fmax=max(_SIZES), u_bmax=max(_SIZES), layers=layers)


def _profiled(model: torch.nn.Module, shape: tuple[int, ...]):
    """The probe's model decomposed and profiled on one thread, as an emulated device computes in
    the launcher's workers; ``shape``: one sample's input."""
    with torch_threads(1):
        graph = decompose(model, (torch.randn(2, *shape),))
        return graph, _profile(graph, CpuDevice("overhead-probe"), shape)


def _promised(tasks: TaskGraph, profile: Profile, machine: Machine) -> TaskGraph:
    """The task graph with its memory promise, which the launcher runs it under."""
    tasks.memory = promise(tasks, profile, machine)
    return tasks


class Spans(NamedTuple):
    """What the real launcher measured over a few iterations (after one warm-up)."""

    tasks: dict[int, float]  # median span of every device task
    host: dict[int, float]  # median span of every host task (from its inputs' arrival to its end)
    sends: list[float]  # every p2p message's hand-off on its sender's p2p-out stream
    slowest: float  # median iteration time of the slowest worker
    launch: list[float]  # per iteration, the launcher's step time minus its slowest worker's


def _spans(graph, tasks: TaskGraph, iterations: int, timeout: float,
           shape: tuple[int, ...] = (WIDTH,)) -> Spans:
    """Run ``tasks`` on the real launcher for ``iterations`` (after one warm-up); ``shape``: one
    sample's input (and target)."""
    def batch(step: int) -> Batch:
        gen = torch.Generator().manual_seed(step)
        size = tasks.minibatch
        return Batch(inputs=[torch.randn(size, *shape, generator=gen)], target=torch.randn(size, *shape, generator=gen),
                     size=size, seed=0)

    store = HostStore.create(graph, tasks.devices, _optimizer, graph.state_dict())
    program = lower(tasks, None, params=graph.parameter_layers())
    return _run(graph, tasks, program, store, _loss, _optimizer, batch, iterations, timeout)


def _run(graph, tasks: TaskGraph, program: Program, store: HostStore, loss_fn: Callable, build_optimizer: Callable,
         batch: Callable[[int], Batch], iterations: int, timeout: float) -> Spans:
    """``tasks`` (lowered to ``program`` at compile time, as a plan's are; its edges' byte sizes
    are not read) on the real launcher, ``batch(step)`` at each step, for ``iterations`` after one
    warm-up; the launcher is closed (and ``store`` with it) whatever happens."""
    launcher = Launcher(graph, tasks, program, store, loss_fn, build_optimizer, device_type="cpu", timeout=timeout)
    try:
        per_task: dict[int, list[float]] = {}
        per_host: dict[int, list[float]] = {}
        sends: list[float] = []
        slowest: list[float] = []
        launch: list[float] = []
        for step in range(iterations + 1):
            result = launcher.step(batch(step))
            if step == 0:
                continue
            slowest.append(max(w.seconds for w in result.workers))
            launch.append(result.seconds - slowest[-1])
            for worker in result.workers:
                for task_id, seconds in worker.task_seconds.items():
                    per_task.setdefault(task_id, []).append(seconds)
                sends += [end - start for stream, _, _, start, end in worker.events if stream == "p2p-out"]
            for task_id, _, began, ended in result.host_events:
                per_host.setdefault(task_id, []).append(ended - began)
        return Spans({t: statistics.median(v) for t, v in per_task.items()},
                     {t: statistics.median(v) for t, v in per_host.items()}, sends, statistics.median(slowest), launch)
    finally:
        launcher.close()


def _estimated_spans(tasks: TaskGraph, profile: Profile, machine: Machine) -> dict[int, float]:
    """Per device task, the estimator's span (from the end of the device's previous task to its own
    end) on a machine without overheads."""
    est = estimate(tasks, profile, machine, record_events=True)
    ends: dict[int, float] = {}
    for ev in est.events:
        if ev.stream == "compute":
            ends[ev.task] = max(ends.get(ev.task, 0.0), ev.end)
    spans, previous = {}, {}
    for task in tasks.tasks:
        if task.device == HOST:
            continue
        start = previous.get(task.device, 0.0)
        end = ends.get(task.id, start)
        spans[task.id] = end - start
        previous[task.device] = end
    return spans


def measure_overheads(machine: Machine, iterations: int = 12, timeout: float = 60.0) -> Overheads:
    """Run the real launcher on near-zero compute and fit the runtime's own costs (module docs).
    ``machine`` gives the probed links (its overheads are ignored); at least two devices are used.
    ``iterations``: 12 per run (a few milliseconds each): with fewer, the per-microbatch and
    message costs spread widely from one probe to the next, and so does a plan's estimate from one
    compile to the next (with the model's calibration, ``measure_model_scale``, as it is)."""
    devices = max(2, machine.devices)
    base = dataclasses.replace(machine.without_overheads(), devices=devices, cpu_cores=None)
    graph, profile = _profiled(_model(), (WIDTH,))
    packs = [(i, i) for i in range(len(profile.layers))]
    config = Configuration(u_f=1, packs_f=packs, u_b=1, packs_b=packs)
    runs: list[tuple[TaskGraph, dict[int, float]]] = []
    launch: list[float] = []
    host: tuple[float, float] = (0.0, 0.0)
    for mode in ("dp", "dp-swap"):
        tasks = _promised(generate(mode, profile, config, devices, MINIBATCH * devices), profile, base)
        spans = _spans(graph, tasks, iterations, timeout)
        runs.append((tasks, spans.tasks))
        if mode == "dp":  # its updates are the host's
            host = _host_update_cost(tasks, spans.host, profile)
        if mode == "dp-swap":  # no host tasks: the launcher's step beyond its workers is its own cost
            launch = spans.launch
    tensor = _tensor_cost(runs, profile, base)
    costed = dataclasses.replace(base, tensor_overhead=tensor)
    residuals, updates = _residuals(runs, profile, costed)
    one, many = min(residuals), max(residuals)
    r_one, r_many = _lower_quartile(residuals[one]), _lower_quartile(residuals[many])
    microbatch = max((r_many - r_one) / (many - one), 0.0) if many > one else 0.0
    task = max(r_one - microbatch * one, 0.0)
    counted = sum(len(v) for v in residuals.values())
    update = max(_lower_quartile(updates) - task, 0.0) if updates else 0.0
    with_overheads = dataclasses.replace(costed, task_overhead=task, microbatch_overhead=microbatch,
                                         update_overhead=update)
    pipeline = _promised(generate("pp", profile, config, devices, MINIBATCH * devices), profile, base)
    piped = _spans(graph, pipeline, iterations, timeout)
    # the typical hand-off, as for the compute scale: a run sees the machine's usual load
    send = statistics.median(piped.sends) if piped.sends else 0.0
    with_overheads = dataclasses.replace(with_overheads, p2p_send_overhead=send)
    message = _message_cost(pipeline, profile, with_overheads, piped.slowest)
    iteration = max(_lower_quartile(launch), 0.0)
    log.info("runtime overheads: %.3f ms per task, %.3f ms per microbatch, %.3f ms per update (%d tasks), "
             "%.1f us per state tensor, %.3f ms per p2p message (%.3f ms of it on the sender's compute), %.3f ms "
             "per iteration, %.3f ms and %.1f us per parameter per host update", task * 1e3, microbatch * 1e3,
             update * 1e3, counted, tensor * 1e6, message * 1e3, send * 1e3, iteration * 1e3, host[0] * 1e3,
             host[1] * 1e6)
    return Overheads(task=task, microbatch=microbatch, update=update, message=message, tasks=counted,
                     iteration=iteration, tensor=tensor, host_update=host[0], host_tensor=host[1], send=send)


def _host_update_cost(tasks: TaskGraph, spans: dict[int, float], profile: Profile) -> tuple[float, float]:
    """``(host_update_overhead, host_tensor_overhead)``: the host's UPD tasks' measured spans less
    their profiled steps, grouped by the parameters each steps (the probe's layers alternate
    between 2 and 12), the line through the two groups' lower quartiles. The span starts once the
    update's gradients are all there, so the residual is the launcher's own work around the step;
    the probe's steps are too small to contend with the devices' near-zero compute."""
    groups: dict[int, list[float]] = {}
    for task in tasks.tasks:
        if task.device == HOST and task.kind == Kind.UPD and task.id in spans:
            step = sum(layer.upd_time_host for layer in profile.layers[task.first:task.last + 1])
            groups.setdefault(profile.state_tensors("dW", task.first, task.last), []).append(spans[task.id] - step)
    if not groups:
        return 0.0, 0.0
    few, many = min(groups), max(groups)
    r_few, r_many = _lower_quartile(groups[few]), _lower_quartile(groups[many])
    per = max((r_many - r_few) / (many - few), 0.0) if many > few else 0.0
    return max(r_few - per * few, 0.0), per


def _residuals(runs: list[tuple[TaskGraph, dict[int, float]]], profile: Profile,
               machine: Machine) -> tuple[dict[int, list[float]], list[float]]:
    """Per device task, its measured span less the span ``machine`` gives it: the FWD/BWD tasks'
    by their number of microbatches, and the UPD tasks'."""
    residuals: dict[int, list[float]] = {}
    updates: list[float] = []
    for tasks, measured in runs:
        modelled = _estimated_spans(tasks, profile, machine)
        for task in tasks.tasks:
            if task.id not in measured or task.id not in modelled:
                continue
            residual = measured[task.id] - modelled[task.id]
            if task.kind == Kind.UPD:
                updates.append(residual)
            else:
                residuals.setdefault(len(task.microbatches), []).append(residual)
    return residuals, updates


_TENSOR_STEP = 1e-5  # s per tensor, the step at which the estimate's response to the per-tensor cost is read


def _tensor_cost(runs: list[tuple[TaskGraph, dict[int, float]]], profile: Profile, machine: Machine) -> float:
    """The runtime's cost per state tensor moved (``Machine.tensor_overhead``): the device UPD
    tasks, grouped by how many tensors' costs their estimated span carries (read as the span's
    response to a small per-tensor cost: a copy overlapped by compute carries none), differ in
    residual (lower quartiles) by that many tensors' costs. 0 without two such groups."""
    stepped = dataclasses.replace(machine, tensor_overhead=_TENSOR_STEP)
    groups: dict[int, list[float]] = {}
    for tasks, measured in runs:
        plain = _estimated_spans(tasks, profile, machine)
        bumped = _estimated_spans(tasks, profile, stepped)
        for task in tasks.tasks:
            if task.kind == Kind.UPD and task.id in measured and task.id in plain:
                carried = round((bumped[task.id] - plain[task.id]) / _TENSOR_STEP)
                groups.setdefault(carried, []).append(measured[task.id] - plain[task.id])
    if len(groups) < 2:
        return 0.0
    few, many = min(groups), max(groups)
    return max((_lower_quartile(groups[many]) - _lower_quartile(groups[few])) / (many - few), 0.0)


def measure_compute_scaling(machine: Machine, iterations: int = 5, rounds: int = 2,
                            timeout: float = 60.0) -> Scaling:
    """The compute scale, interference and range (``Scaling``, module docs): data parallelism over transformer
    blocks on the real launcher, one device alone and then all of ``machine``'s devices at once (at
    least two), ``rounds`` times interleaved; per run, the median over the tasks of the compute
    scale that turns the span the estimator gives (with ``machine``'s overheads and shared cores)
    into the measured one (``_median_ratio``); read as ``_scaling`` reads it."""
    devices = max(2, machine.devices)
    base = dataclasses.replace(machine, devices=devices, compute_scale=1.0, compute_interference=0.0)
    shape = (BLOCK_TOKENS, BLOCK_WIDTH)
    graph, profile = _profiled(_blocks(), shape)
    packs = [(0, len(profile.layers) - 1)]
    config = Configuration(u_f=MINIBATCH // 2, packs_f=packs, u_b=MINIBATCH // 2, packs_b=packs)
    runs = {}  # per device count: its task graph and the estimator's span of each task (the same every round)
    for count in (1, devices):
        tasks = _promised(generate("dp", profile, config, count, MINIBATCH * count, update="host"), profile,
                          dataclasses.replace(base, devices=count))
        runs[count] = tasks, _modelled(tasks, profile, dataclasses.replace(base, devices=count))
    return _scaling(runs, rounds, lambda tasks: _spans(graph, tasks, iterations, timeout, shape).tasks, "MLP blocks")


def measure_model_scale(graph: LayerGraph, profile: Profile, machine: Machine, get_batch: Callable, loss_fn: Callable,
                        build_optimizer: Callable, minibatch: int, iterations: int = 4, rounds: int = 5,
                        timeout: float = 60.0, precision: str = "fp32") -> Scaling:
    """The compute scale, interference and range (``Scaling``) measured on the model itself (module docs): its own
    layers in a few packs, data parallel on one device and then on all of ``machine``'s devices at
    once (at least two), two microbatches a task at the square root of the largest microbatch its
    profile measured, ``rounds`` times interleaved (five: with three, the scale of five compiles in
    a row spread 1.8-2.3 on GPT-2 tiny; fewer, and fewer iterations, where their steps' estimate
    says they would take more than ``MODEL_SCALE_SECONDS``), read as
    ``measure_compute_scaling`` reads the blocks', with a cost per task beside the scale
    (``_scaling``'s ``per_task``). ``precision``: the plan's, which the runs compute in."""
    u = max(profile.u_min, round(math.sqrt(min(profile.u_fmax, profile.u_bmax, minibatch))))
    devices = max(2, machine.devices)
    base = dataclasses.replace(machine, devices=devices, compute_scale=1.0, compute_interference=0.0,
                               compute_task_overhead=0.0)
    packs = _calibration_packs(len(profile.layers))
    config = Configuration(u_f=u, packs_f=packs, u_b=u, packs_b=packs)
    capacity = CpuDevice("model-scale").capacity  # the host's memory: the calibration is not the plan
    runs = {}
    for count in (1, devices):
        counted = dataclasses.replace(base, devices=count)
        tasks = generate("dp", profile, config, count, 2 * u * count, update="host")
        tasks.precision = precision  # computed as the plan's runs will (under autocast for bf16)
        tasks.memory = promise(tasks, profile, counted, capacity=capacity)
        runs[count] = tasks, _modelled(tasks, profile, counted)
    step = sum(_step_seconds(tasks, spans) for tasks, spans in runs.values())
    rounds, iterations = _within(MODEL_SCALE_SECONDS, step, rounds, iterations)

    def batch(size: int) -> Callable[[int], Batch]:
        def make(step: int) -> Batch:
            inputs, target = get_batch(size, step)
            return Batch(inputs=list(inputs) if isinstance(inputs, (tuple, list)) else [inputs], target=target,
                         size=size, seed=0)
        return make

    state = graph.state_dict()  # every run's store starts from the same weights, copied in

    def measure(tasks: TaskGraph) -> dict[int, float]:
        program = lower(tasks, None, params=graph.parameter_layers())
        store = HostStore.create(graph, tasks.devices, build_optimizer, state, low_copies=tasks.low_copies,
                                 slots=program.gradient_slots(tasks))
        return _run(graph, tasks, program, store, loss_fn, build_optimizer, batch(tasks.minibatch), iterations,
                    timeout).tasks

    return _scaling(runs, rounds, measure, "the model", per_task=True)


class Scaling(NamedTuple):
    """What a calibration read (``_scaling``): the compute scale (the median round on one device),
    the interference, the range a plan's tasks may land in (``_range``,
    ``Machine.compute_scale_range``) and the cost per compute task beside the scale
    (``Machine.compute_task_overhead``; 0 where the calibration does not read one)."""

    scale: float
    interference: float
    low: float
    high: float
    task: float = 0.0

    def applied(self, machine: Machine) -> Machine:
        return dataclasses.replace(machine, compute_scale=self.scale, compute_interference=self.interference,
                                   compute_scale_range=[self.low, self.high] if self.high > self.low else None,
                                   compute_task_overhead=self.task)


def _scaling(runs: dict[int, tuple[TaskGraph, dict[int, tuple[float, float]]]], rounds: int,
             measure: Callable[[TaskGraph], dict[int, float]], what: str, per_task: bool = False) -> Scaling:
    """The compute scale, interference and range (``Scaling``) from ``runs`` (per device count, one and all: a
    task graph and, per task, the estimator's span and the compute inside it), each measured
    ``rounds`` times interleaved: per run, the median over the tasks of the compute scale that
    explains the measured span (``_median_ratio``); the median one-device run is the scale (a run,
    like a user's, sees the machine's typical load, not its best moment), the median all-devices
    run over it, less one, spread over the other devices, the interference; the one-device tasks'
    readings over all rounds, the range (``_range``). With ``per_task``, each one-device run first
    reads a cost per task (``_task_cost``: the intercept beside the scale), their median is taken
    off every task's span before the scales are read, and it is the machine's
    ``compute_task_overhead``."""
    spans: dict[int, list[dict[int, float]]] = {count: [] for count in runs}
    for _ in range(rounds):
        for count, (tasks, modelled) in runs.items():
            spans[count].append(measure(tasks))
    alone_tasks, alone_modelled = runs[1]
    cost = statistics.median(_task_cost(alone_tasks, run, alone_modelled) for run in spans[1]) if per_task else 0.0
    reads = {count: [_task_ratios(runs[count][0], run, runs[count][1], cost) for run in spans[count]] for count in runs}
    ratios = {count: [_median_of(run) for run in runs_read] for count, runs_read in reads.items()}
    tasks_alone = [r for run in reads[1] for r in run]
    devices = max(runs)
    alone, together = statistics.median(ratios[1]), statistics.median(ratios[devices])
    interference = max(0.0, (together / alone - 1.0) / (devices - 1))
    low, high = _range(tasks_alone, ratios[1])
    log.info("compute scaling on %s: tasks run %.2fx their estimate on one device (%.2f-%.2f over its tasks and "
             "rounds) and %.3f ms more each, %.2fx on %d at once: %.3f per other device computing", what, alone, low,
             high, cost * 1e3, together, devices, interference)
    return Scaling(alone, interference, low, high, cost)


def _task_cost(tasks: TaskGraph, measured: dict[int, float], modelled: dict[int, tuple[float, float]]) -> float:
    """Seconds each compute task of one run took beyond its scaled compute and its modelled rest: the
    intercept of the least-squares line ``measured - (span - compute) = scale x compute + cost`` over
    the run's FWD and BWD tasks (a few packs, forward and backward: computes that differ severalfold).
    A task starts on layers another pack's task has pushed out of the caches, at a cost the
    overheads probe's near-zero layers do not have; read into the scale instead, it would make the
    calibration's tasks of two microbatches read a much higher scale than a plan's tasks of six or
    eight run at, and the plan's estimate would come out high. 0 where the tasks' computes are too
    alike to tell a cost from a scale, or where the line says no cost (or no compute)."""
    points = [(modelled[t.id][1], _beyond_rest(t, measured, modelled)) for t in tasks.tasks
              if t.kind in (Kind.FWD, Kind.BWD) and t.id in measured and modelled.get(t.id, (0.0, 0.0))[1] > 0]
    computes = [x for x, _ in points]
    if len(points) < 3 or max(computes) < _DISTINCT_COMPUTES * min(computes):
        return 0.0
    slope, intercept = statistics.linear_regression(computes, [y for _, y in points])
    return intercept if intercept > 0 and slope >= MIN_COMPUTE_SCALE else 0.0


_DISTINCT_COMPUTES = 1.5  # the largest task's compute over the smallest's below which no cost per task is read


def _beyond_rest(task, measured: dict[int, float], modelled: dict[int, tuple[float, float]]) -> float:
    """Seconds of the task's measured span beyond the modelled rest (its span less its compute): what
    its compute took, as the calibration reads it."""
    span, compute = modelled[task.id]
    return measured[task.id] - (span - compute)


def _range(tasks: list[float], rounds: list[float]) -> tuple[float, float]:
    """The scale's range (``Machine.compute_scale_range``): the 10th and 90th percentiles of the
    one-device tasks' readings over all rounds, and at least the rounds' medians. The tasks of a
    plan are not the calibration's (other packs, other kinds, other microbatches), and on the
    emulated devices the model's kinds of task read differently (a forward's layers start on cold
    caches, a backward's after its recompute): the spread over its own tasks is where a plan's can
    land, and the rounds' spread alone (a few percent) left 10 of 15 runs of ``bench.estimate_accuracy
    --full`` outside it."""
    positive = [r for r in tasks if r > 0]
    if len(positive) < 2:
        return min(rounds), max(rounds)
    tenth, *_, ninetieth = statistics.quantiles(positive, n=10, method="inclusive")
    return min(tenth, *rounds), max(ninetieth, *rounds)


MODEL_SCALE_SECONDS = 8.0  # what the model's calibration may take, by the estimate of its steps


def _step_seconds(tasks: TaskGraph, modelled: dict[int, tuple[float, float]]) -> float:
    """The estimated step of a calibration graph: its busiest device's spans."""
    busy: dict[int, float] = {}
    for task in tasks.tasks:
        busy[task.device] = busy.get(task.device, 0.0) + modelled.get(task.id, (0.0, 0.0))[0]
    return max(busy.values(), default=0.0)


def _within(budget: float, step: float, rounds: int, iterations: int) -> tuple[int, int]:
    """Fewer rounds, then fewer iterations, while the runs (a warm-up step and ``iterations``, per
    round and per device count, whose steps add up to ``step`` seconds) would take more than
    ``budget``: a large model's step takes seconds on the CPU. At least one round of one iteration."""
    while rounds > 1 and rounds * (iterations + 1) * step > budget:
        rounds -= 1
    while iterations > 1 and rounds * (iterations + 1) * step > budget:
        iterations -= 1
    return rounds, iterations


def _calibration_packs(layers: int, packs: int = 3) -> list[tuple[int, int]]:
    """Up to ``packs`` runs of consecutive layers, as even in count as they divide."""
    bounds = [round(k * layers / min(packs, layers)) for k in range(min(packs, layers) + 1)]
    return [(bounds[k], bounds[k + 1] - 1) for k in range(len(bounds) - 1)]


def _modelled(tasks: TaskGraph, profile: Profile, machine: Machine) -> dict[int, tuple[float, float]]:
    """Per device task, the estimator's span on ``machine`` (compute at the profile's speed) and the
    profiled compute inside it (what ``compute_scale`` multiplies)."""
    spans = _estimated_spans(tasks, profile, machine)
    return {t.id: (spans[t.id], task_compute_seconds(t, profile)) for t in tasks.tasks if t.id in spans}


def _median_ratio(tasks: TaskGraph, measured: dict[int, float], modelled: dict[int, tuple[float, float]]) -> float:
    """The median over the device's compute tasks of their scales (``_task_ratios``)."""
    return _median_of(_task_ratios(tasks, measured, modelled))


def _median_of(reads: list[float]) -> float:
    """A run's scale from its tasks' readings; 0 without any (the caller's guard reads it as none)."""
    return statistics.median(reads) if reads else 0.0


def _task_ratios(tasks: TaskGraph, measured: dict[int, float], modelled: dict[int, tuple[float, float]],
                 cost: float = 0.0) -> list[float]:
    """Per compute task, the scale ``s`` for which the estimate, with its compute times ``s`` and
    the rest (the runtime's overheads, waits, and ``cost`` on a FWD or BWD task) as modelled, gives
    the measured span: the estimator applies the scale to compute alone, so the calibration
    measures it so. Measured over the whole span instead, a task whose overheads are half of it
    read 0.8 where its compute ran at 0.6. Where the modelled overheads alone come near the
    measured spans (tasks of almost no compute), that reading says nothing (its median can go to
    zero or below): the ratios of the whole spans stand instead, each span less its ``cost``, which
    the machine goes on charging beside the scale."""
    kept = [t for t in tasks.tasks if t.kind != Kind.UPD and t.id in measured and modelled.get(t.id, (0.0, 0.0))[0] > 0]

    def charged(t) -> float:
        return cost if t.kind in (Kind.FWD, Kind.BWD) else 0.0

    on_compute = [(_beyond_rest(t, measured, modelled) - charged(t)) / modelled[t.id][1]
                  for t in kept if modelled[t.id][1] > 0]
    if on_compute and statistics.median(on_compute) >= MIN_COMPUTE_SCALE:
        return on_compute
    log.info("the runtime's overheads are most of these tasks' spans: their scale is read on the whole spans")
    return [(measured[t.id] - charged(t)) / modelled[t.id][0] for t in kept]


MIN_COMPUTE_SCALE = 0.1  # below it, a scale read on compute alone is the overheads' error, not the compute's


def _lower_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4, method="inclusive")[0] if len(values) > 1 else values[0]


def _message_cost(tasks: TaskGraph, profile: Profile, machine: Machine, measured: float,
                  high: float = 0.05, steps: int = 30) -> float:
    """The p2p message cost at which the estimate of ``tasks`` equals ``measured`` seconds; the
    machine's own when even that one over-estimates, ``high`` when nothing below reaches it."""

    def predicted(latency: float) -> float:
        return estimate(tasks, profile, dataclasses.replace(machine, p2p_latency=latency),
                        record_events=False).iteration_time

    low = machine.p2p_latency if machine.p2p_latency is not None else machine.latency
    if predicted(low) >= measured:
        return low
    if predicted(high) <= measured:
        return high
    for _ in range(steps):
        mid = (low + high) / 2
        if predicted(mid) < measured:
            low = mid
        else:
            high = mid
    return (low + high) / 2


# ------------------------------------------------------------------ shared cores
_LOOP_SIZE = 128
_WINDOW = 0.15  # seconds each process computes; a process that finished early would free its core


def _loop(barrier, out) -> None:
    """Fixed single-threaded work for ``_WINDOW`` seconds after every process is ready: the units
    done in the window (a count, not a duration, so that every process is measured over the same
    stretch of time, whenever fork happened to start it)."""
    torch.set_num_threads(1)
    a = torch.randn(_LOOP_SIZE, _LOOP_SIZE, generator=torch.Generator().manual_seed(0))
    a @ a  # warm-up
    barrier.wait(timeout=60)
    done = 0
    end = time.perf_counter() + _WINDOW
    while time.perf_counter() < end:
        a @ a
        done += 1
    out.put(done)


def _loop_units(processes: int) -> int:
    """Units of the fixed loop that ``processes`` forked processes do between them in the window."""
    ctx = multiprocessing.get_context("fork")
    out, barrier = ctx.Queue(), ctx.Barrier(processes)
    procs = [ctx.Process(target=_loop, args=(barrier, out), daemon=True) for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        return sum(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def measure_cores(devices: int, repeats: int = 3) -> float:
    """The cores the devices' compute gets between them (module docs): the work ``devices + 1``
    processes do at once in a window over what one does alone in the same window (the highest of
    ``repeats`` readings); one process more than devices, so that a machine with a free core per
    device still shows its limit."""
    k = devices + 1
    ratios = []
    for _ in range(repeats):  # interleaved, so that a change in the machine's load hits both alike
        alone = _loop_units(1)
        together = _loop_units(k)
        ratios.append(together / max(alone, 1))
    # load from other processes only lowers a reading; noise may raise one past the machine's cores
    cores = min(float(k), float(len(os.sched_getaffinity(0))), max(ratios))
    log.info("shared cores: %d processes at once do %.2f times the work of one: %.2f cores", k, cores, cores)
    return cores
