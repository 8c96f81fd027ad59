"""`compile`: decompose → profile → search, for a model file or a live model, into a Plan.

The steps are the stages of docs/architecture.md ("The flow of data") run in order; each can be
skipped by handing in its result (a profile made earlier, a machine description). Every mode can
be searched so that the plan carries a comparison table next to its choice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harmony.decomposer.decompose import decompose
from harmony.decomposer.forward_state import check_forward_state
from harmony.decomposer.gradient_check import check_gradients
from harmony.decomposer.layer_graph import LayerGraph, dtype_from_str
from harmony.decomposer.sample_mixing import describe as describe_mixing
from harmony.decomposer.sample_mixing import check_layers
from harmony.errors import DeviceOutOfMemoryError, HarmonyError
from harmony.plan import Plan
from harmony.profiling.sweep import Profiler, default_capacity
from harmony.runtime.device import check_gpus, make_devices, parse_bytes
from harmony.profiling.analytic import analytic_profile, optimizer_name
from harmony.scheduler.devicespec import load_spec
from harmony.scheduler.estimator import chrome_trace, estimate
from harmony.scheduler.machine import Machine, nominal_machine
from harmony.scheduler.memory import fused_update, memory_plan
from harmony.profiling.casts import low_copies
from harmony.runtime.hoststore import Layout
from harmony.profiling.profiles import PackSample, Profile, TiedWeight
from harmony.scheduler.comparison import comparing, row
from harmony.scheduler.refusal import DpRefusal, explain_refusal
from harmony.scheduler.search import NoFeasibleConfiguration, SearchResult, search
from harmony.scheduler.lower import lower
from harmony.scheduler.modes import MODES
from harmony.scheduler.tasks import HOST, Kind
from harmony.runtime import precision
from harmony.runtime.clipping import check_threshold
from harmony import timing

log = logging.getLogger(__name__)


@dataclass
class CompileOptions:
    minibatch: int
    devices: int = 2
    device_memory: int | str | None = None  # bytes or "8GiB"; default: see docs/architecture.md "Devices"
    mode: str = "pp"
    device_type: str = "cpu"
    analytic: str | None = None  # device spec preset or JSON file: plan for hardware we lack
    compare: bool = True  # also search the other modes, for the comparison table
    trials: int = 3
    samples: int = 4
    probe: bool = True
    # the share of device memory the plan leaves unplanned, for noise the estimate cannot know (a GPU
    # allocator's rounding and fragmentation, a library's workspaces): the plan's peak per device is
    # an upper bound of the run's on its own (scheduler/memory.py, the estimator), and the runtime
    # lets nothing optional (prefetches) past it; the margin does not hide the estimate's errors
    memory_margin: float = 0.1
    search_workers: int | None = None  # processes comparing the other modes (None: one per core; scheduler/comparison.py)
    clip_grad_norm: float | None = None  # global-norm gradient clipping: every update waits for the norm
    precision: str = "fp32"  # device compute: fp32, or bf16 under autocast (runtime/precision.py)
    keep_state: bool = True  # state a device has room for stays there across iterations (scheduler/keep.py)
    # the layers' output and gradients compared with eager autograd's before anything else
    # (decomposer/gradient_check.py): a model whose decomposition loses part of its backward is refused
    check_gradients: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if not isinstance(self.minibatch, int) or self.minibatch < 1:
            raise HarmonyError(f"the minibatch size must be a positive integer, got {self.minibatch!r}")
        if not isinstance(self.devices, int) or self.devices < 1:
            raise HarmonyError(f"the device count must be a positive integer, got {self.devices!r}")
        if self.mode not in MODES:
            raise HarmonyError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not 0 <= self.memory_margin < 1:
            raise HarmonyError(f"the memory margin must be in [0, 1), got {self.memory_margin!r}")
        check_threshold(self.clip_grad_norm)
        precision.check(self.precision)
        if self.device_type not in ("cpu", "cuda"):
            raise HarmonyError(f"unknown device type {self.device_type!r}; choose cpu or cuda")
        if self.device_type == "cuda" and not self.analytic:
            try:
                check_gpus(self.devices)
            except ValueError as exc:
                raise HarmonyError(str(exc)) from None

    def gated(self) -> bool:
        """Whether every update must wait for the whole gradient (``taskgraph.with_norm``): to clip
        it by its norm, or to skip the step if fp16 overflowed."""
        return self.clip_grad_norm is not None or precision.needs_loss_scaling(self.precision)

    def search_options(self) -> dict[str, Any]:
        """What the task graphs must do beyond the mode's default."""
        options: dict[str, Any] = {"gated": True} if self.gated() else {}
        if not self.keep_state:
            options["keep"] = False
        return options

    def capacity(self) -> int | None:
        if self.device_memory is None:
            return None
        try:
            value = parse_bytes(self.device_memory)
        except ValueError as exc:
            raise HarmonyError(f"device memory: {exc}") from exc
        if value <= 0:
            raise HarmonyError(f"device memory must be positive, got {self.device_memory!r}")
        return value


def _check_something_trains(graph: LayerGraph) -> None:
    """A model whose parameters are all frozen has nothing to train: refuse it before profiling
    rather than compile a plan whose iterations only run the forward."""
    params = {graph.canonical(name): spec for name, spec in graph.state.items() if spec.kind == "parameter"}
    if params and not any(spec.requires_grad for spec in params.values()):
        raise HarmonyError(f"every parameter of the model ({len(params)}) is frozen (requires_grad=False), so there "
                           "is nothing to train; unfreeze the ones to fine-tune with p.requires_grad_(True)")


def compile_plan(
    model: torch.nn.Module,
    get_batch: Callable[[int, int], tuple],
    build_optimizer: Callable,
    options: CompileOptions,
    model_file: str = "",
    model_sha256: str = "",
    graph: LayerGraph | None = None,
    on_progress: Callable[[str], None] = lambda msg: None,
    loss_fn: Callable | None = None,
) -> tuple[Plan, dict]:
    """Decompose, profile and search; returns the plan and its Chrome trace. ``loss_fn`` lets the
    profile measure the loss task's own memory (without it, a cross-entropy's is assumed). Every
    measurement runs at the plan's precision (under autocast for bf16), as its run will."""
    options.validate()
    stage = "starting"

    def report(message: str) -> None:
        nonlocal stage
        stage = message
        on_progress(message)

    try:
        example = get_batch(min(2, options.minibatch), 0)
        if graph is None:  # traced as written: autocast applies when the layers run, not to the graph
            report("decomposing")
            with timing.stage("decompose"):
                graph = decompose(model, example[0])
        inputs = (example[0],) if isinstance(example[0], torch.Tensor) else tuple(example[0])
        check_forward_state(model, inputs)
        if options.check_gradients:
            report("checking the layers' gradients against eager autograd")
            with timing.stage("gradient check"):
                check_gradients(model, graph, inputs, example[1], loss_fn)
        with precision.autocast(options.device_type, options.precision, cache=False):
            plan, trace = _compile_plan(model, get_batch, build_optimizer, options, model_file, model_sha256, graph,
                                        report, loss_fn)
    except DeviceOutOfMemoryError as exc:
        raise HarmonyError(
            f"the compile ran out of device memory while {stage} ({exc.device}: {exc.what()}). The profiler "
            "measures what fits and is meant to catch this itself, so it is a bug of Harmony's, not of the model: "
            "rerun with -v (harmony -v compile ...) and report the traceback"
        ) from exc
    plan.tasks.precision = options.precision
    return plan, trace


def _compile_plan(model, get_batch, build_optimizer, options: CompileOptions, model_file: str, model_sha256: str,
                  graph: LayerGraph, on_progress: Callable[[str], None],
                  loss_fn: Callable | None) -> tuple[Plan, dict]:
    _check_batch_sizes(graph, options.minibatch)
    _check_something_trains(graph)
    with timing.stage("profile"):
        profile, machine = profile_graph(graph, get_batch, build_optimizer, options, on_progress, loss_fn)
    capacity = profile.capacity
    _check_smallest_layer(profile, capacity)
    planned = int(capacity * (1 - options.memory_margin))
    with timing.stage("sample-mixing check"):
        same_u = batch_coupled(graph, _two_samples(graph, get_batch, options.minibatch))
    if same_u:
        log.info("U_F = U_B: %s", same_u)
    others = [m for m in MODES if m != options.mode] if options.compare else []
    with comparing(others, profile, machine, options.devices, options.minibatch, planned, bool(same_u),
                   workers=options.search_workers, gated=options.gated(),
                   on_done=lambda done, total: on_progress(f"comparing modes: {done} of {total}")) as compared:
        on_progress(f"searching {options.mode}")  # beside the other modes' searches
        try:
            result = search(profile, machine, options.mode, options.devices, options.minibatch, capacity=planned,
                            same_u=bool(same_u), **options.search_options())
        except NoFeasibleConfiguration as exc:
            refusal = explain_refusal(exc, options.mode, profile, machine, options.devices, options.minibatch, planned,
                                      same_u=bool(same_u), **options.search_options())
            raise HarmonyError(str(exc) + _memory_that_fits(exc, options.memory_margin, refusal)) from exc
        timing.log_stage(f"search {options.mode}", result.seconds)
        with timing.stage("comparison (waiting for the other modes)"):
            comparison = [row(options.mode, result)] + compared()
    for r in comparison[1:]:
        if "search_seconds" in r:
            timing.log_stage(f"search {r['mode']} (worker)", r["search_seconds"])
    comparison.sort(key=lambda r: (r["iteration_time"] is None, MODES.index(r["mode"])))
    on_progress("measuring the plan's packs")
    with timing.stage("finish (packs, memory promise, lowering)"):
        measure = pack_measurer(graph, get_batch, build_optimizer, loss_fn, options)
        chosen = finish_plan(result, profile, machine, options, planned, bool(same_u), measure)
        est = chosen.estimate
        program = lower(chosen.graph, profile, params=graph.parameter_layers())
        host = Layout.for_graph(graph, options.devices, build_optimizer, chosen.graph.low_copies,
                                program.gradient_slots(chosen.graph))
    plan = Plan(
        graph=graph, profile=profile, tasks=chosen.graph,
        estimate={
            "iteration_time": est.iteration_time, "fits": est.fits,
            "host_store_bytes": host.size, "host_store": host.bytes_by_kind(),
            "peak_memory": {str(k): int(v) for k, v in est.peak_memory.items()},
            "task_peak_memory": {str(k): int(v) for k, v in est.task_peaks.items()},
            "bytes_by_channel": {k: int(v) for k, v in est.bytes_by_channel.items()},
            "busy": {str(d): dict(s) for d, s in est.busy.items()},
            **estimate_range(chosen.graph, profile, machine, planned),
        },
        options={
            "minibatch": options.minibatch, "devices": options.devices, "mode": options.mode,
            "device_type": options.device_type, "device_memory": capacity, "analytic": options.analytic,
            "same_u": same_u, "planned_memory": planned, "clip_grad_norm": options.clip_grad_norm,
            "precision": options.precision, "keep_state": options.keep_state, **options.extra,
        },
        comparison=comparison, model_file=model_file, model_sha256=model_sha256,
        search={"explored": chosen.explored, "pruned": chosen.pruned, "seconds": chosen.seconds},
        lowered=program,
    )
    plan.events = est.events  # for a Gantt picture; not saved (trace.json holds the same)
    return plan, chrome_trace(est)


def estimate_range(tasks, profile: Profile, machine: Machine, capacity: int) -> dict[str, list[float]]:
    """``{"iteration_time_range": [low, high]}``: the plan's iteration time at the lowest and the
    highest compute scale the machine's calibration read (``Machine.compute_scale_range``), what the
    machine's own variation leaves open and the estimate cannot know; nothing where it read one
    scale (GPUs, analytic machines, an unprobed compile)."""
    if not machine.compute_scale_range:
        return {}
    times = [estimate(tasks, profile, dataclasses.replace(machine, compute_scale=scale), capacity=capacity,
                      record_events=False).iteration_time for scale in machine.compute_scale_range]
    return {"iteration_time_range": [min(times), max(times)]}


def finish_plan(result: SearchResult, profile: Profile, machine: Machine, options: CompileOptions, planned: int,
                same_u: bool, measure: Callable[[list[tuple[int, int, int]]], list[PackSample]] | None) -> SearchResult:
    """The search's choice made a plan's: re-estimated on its packs measured whole (a measured
    profile), and its memory promise attached to its task graph (``TaskGraph.memory``)."""
    if profile.source == "measured" and measure is not None:
        result = measured_packs_plan(result, profile, machine, options, planned, same_u, measure)
    est = result.estimate
    result.graph.memory = memory_plan(result.graph, est.peak_memory, est.task_peaks, est.prefetched, profile)
    return result


def measured_packs_plan(result: SearchResult, profile: Profile, machine: Machine, options: CompileOptions,
                        planned: int, same_u: bool, measure: Callable[[list[tuple[int, int, int]]], list[PackSample]],
                        rounds: int = 3) -> SearchResult:
    """The search's choice re-estimated with its own packs measured whole (``Profile.packs``), so
    that the plan's memory is what its packs hold rather than a composition of layer profiles (an
    upper bound that is loose where layers share tensors). Composition meant to bound the truth: if
    a measured pack holds more, the configuration may no longer fit, and the search runs again
    knowing it, up to ``rounds`` times."""
    for _ in range(rounds):
        wanted = sorted(plan_packs(result.graph) - {(p.first, p.last, p.u) for p in profile.packs})
        if not wanted:
            return result
        profile.add_packs(measure(wanted))
        est = estimate(result.graph, profile, machine, capacity=planned)
        if est.fits and not est.deadlock:
            return dataclasses.replace(result, estimate=est)
        log.info("with its packs measured, %s no longer fits: searching again", result.config)
        try:
            graph = result.graph
            result = search(profile, machine, graph.mode, graph.devices, graph.minibatch, capacity=planned, same_u=same_u,
                            **options.search_options())
        except NoFeasibleConfiguration as exc:
            refusal = explain_refusal(exc, graph.mode, profile, machine, graph.devices, graph.minibatch, planned,
                                      same_u=same_u, **options.search_options())
            raise HarmonyError(str(exc) + _memory_that_fits(exc, options.memory_margin, refusal)) from exc
    return result


def plan_packs(graph) -> set[tuple[int, int, int]]:
    """(first, last, u) of every FWD and BWD task of a device, at each of its microbatch sizes,
    and (first, last, 0) of every pack it steps on a device (a UPD task, or a fused update)."""
    packs = {(t.first, t.last, u) for t in graph.tasks
             if t.kind in (Kind.FWD, Kind.BWD) and t.device != HOST for u in set(t.microbatches)}
    packs |= {(t.first, t.last, 0) for t in graph.tasks
              if t.device != HOST and (t.kind == Kind.UPD or fused_update(t))}
    return packs


def pack_measurer(graph: LayerGraph, get_batch, build_optimizer, loss_fn, options: CompileOptions):
    """Measures packs on a device like the profile's without its limit (an emulated device of the
    host's memory, a GPU's free memory): a measured pack may hold more than its composition said,
    and then the plan is searched again (``measured_packs_plan``) rather than the compile failing
    on the measurement. Peaks are exact either way."""

    def measure(packs: list[tuple[int, int, int]]) -> list[PackSample]:
        device = make_devices(options.device_type, 1, None)[0]
        try:
            profiler = Profiler(graph, get_batch, build_optimizer, device, trials=0, loss_fn=loss_fn)
            return profiler.measure_packs(packs)
        finally:
            device.release()

    return measure


def _memory_that_fits(exc: NoFeasibleConfiguration, margin: float, refusal: DpRefusal | None = None) -> str:
    """What ``--device-memory`` must at least be, the unplanned margin included: the least planned
    memory at which the refused mode's search fits where ``refusal`` found it (a dp refusal, which
    also says why dp needs more than pp and whether pp fits), else the closest configuration's need."""
    if exc.shortfall is None:
        return ""
    needed = refusal.least if refusal is not None and refusal.least is not None else exc.shortfall.needed
    memory = math.ceil(needed / (1 - margin))
    while int(memory * (1 - margin)) < needed:  # the compile plans int(memory * (1 - margin)) bytes
        memory += 1
    text = f" (with {margin:.0%} left unplanned: --device-memory {memory:,} bytes or more)"
    return text + (f". {refusal.describe()}" if refusal is not None else "")


def _check_batch_sizes(graph: LayerGraph, minibatch: int) -> None:
    """Refuse a graph whose trace specialised the batch size before profiling runs it at others:
    profiling and the plan's microbatches need every size from 1 up to the minibatch."""
    if graph.batch_sizes and not set(range(1, minibatch + 1)) <= set(graph.batch_sizes):
        raise HarmonyError(
            f"the model's layers run at batch size {', '.join(map(str, graph.batch_sizes))} only ({graph.batch_note}); "
            "the plan needs microbatches of every size up to the minibatch. Decompose with example inputs of "
            "batch size 2 or more (torch.export fixes a batch of 1), or remove what fixes the batch size in forward()"
        )


# functional calls that draw random numbers, as they appear in generated layer code (module calls
# such as nn.Dropout are found on the modules themselves)
_RANDOM_CALLS = ("functional.dropout", "functional.alpha_dropout", "functional.feature_alpha_dropout",
                 "functional.dropout1d", "functional.dropout2d", "functional.dropout3d", "functional.rrelu",
                 "torch.dropout", "torch.bernoulli", "torch.rand(", "torch.randn(", "torch.randint(",
                 "torch.randperm(", "torch.normal(", "torch.multinomial(", ".bernoulli_(", ".normal_(",
                 ".uniform_(", "native_dropout")


def _two_samples(graph: LayerGraph, get_batch, minibatch: int) -> tuple | None:
    """Real model inputs of two samples for the sample-mixing check (None, and synthesised inputs,
    where the minibatch has one sample or the batch does not line up with the graph's inputs)."""
    if minibatch < 2:
        return None
    inputs = get_batch(2, 0)[0]
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return inputs if len(inputs) == len(graph.inputs) else None


def batch_coupled(graph: LayerGraph, inputs: tuple | None = None) -> str:
    """Why the forward's microbatches must be the recompute's (U_F = U_B), or "" if they need not:
    a layer that draws random numbers (dropout masks are drawn per microbatch) or normalizes over
    the batch (BatchNorm in training mode) gives other results on other microbatches, and a value
    between layers that the decomposer could not cut along a batch dim (``LayerGraph.coupled_inputs``)
    must reach the backward on the microbatch it was made for. Layers whose own code mixes samples
    (``x - x.mean(0)``) are found by running them (``decomposer/sample_mixing.py``); a layer that
    mixes through a BatchNorm keeps BatchNorm's reason. ``inputs``: the model's example inputs for
    that check (synthesised from the graph's specs without them)."""
    reasons = []
    coupled = graph.coupled_inputs()
    if coupled:
        layer, name = coupled[0]
        more = f" and {len(coupled) - 1} more" if len(coupled) > 1 else ""
        reasons.append(f"value {name} entering layer {layer}{more} depends on the microbatch size in a way that "
                       "cannot be cut between microbatches")
    batchnorm_layers: set[int] = set()
    checks = check_layers(graph, inputs)
    if graph.training:
        text = "\n".join(graph.sources.values())
        found = [name.rstrip("(").split(".")[-1] for name in _RANDOM_CALLS if name in text]
        for index, module in enumerate(graph.modules or []):
            for sub in module.modules():
                if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
                    found.append(type(sub).__name__)
                if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
                    reasons.append(f"{type(sub).__name__} normalizes over the microbatch")
                    batchnorm_layers.add(index)
        if not found and checks.random:  # drawn through calls no name gives away (torchvision's stochastic depth)
            found = [f"layer {index} ({name})" for index, name in checks.random[:3]]
            found += [f"{len(checks.random) - 3} more layers"] if len(checks.random) > 3 else []
        if found:
            reasons.insert(0, f"layers draw random numbers ({', '.join(sorted(set(found)))})")
    mixing = [layer for layer in checks.mixing if layer.index not in batchnorm_layers]
    if mixing:
        reasons.append(describe_mixing(mixing))
    return "; ".join(dict.fromkeys(reasons))


def profile_graph(graph, get_batch, build_optimizer, options: CompileOptions, on_progress=lambda msg: None,
                  loss_fn: Callable | None = None) -> tuple[Profile, Machine]:
    """The profile (measured on one device, or analytic) and the machine description, tied to the graph."""
    capacity = options.capacity()
    host_bandwidth = None  # a measured profile times the host's casts of low-precision copies
    if options.analytic:
        spec = load_spec(options.analytic)
        if capacity is not None:
            spec = type(spec)(**{**spec.to_dict(), "capacity": capacity})
        on_progress(f"analytic profile on {spec.name}")
        profile = analytic_profile(graph, spec, max_microbatch=options.minibatch,
                                   optimizer=optimizer_name(build_optimizer),
                                   compute=precision.compute_dtype(options.precision))
        machine = Machine.from_spec(spec, options.devices)
        host_bandwidth = spec.host_memory_bandwidth
    else:
        if capacity is None and options.device_type == "cpu":
            on_progress("measuring the training footprint")
            capacity = default_capacity(graph, get_batch, options.minibatch)
        device = make_devices(options.device_type, 1, capacity)[0]
        # an emulated device computes on one thread, as the runtime's forked workers do (OpenMP
        # cannot run a parallel region in a process forked from one that used it)
        threads = 1 if options.device_type == "cpu" else None
        try:
            profiler = Profiler(graph, get_batch, build_optimizer, device, trials=options.trials,
                                threads=threads, on_progress=on_progress, loss_fn=loss_fn)
            profile = profiler.profile(u_cap=options.minibatch, samples=options.samples)
        finally:
            device.release()
        if options.probe:
            from harmony.profiling.probe import probe_machine

            on_progress("probing links")
            machine = probe_machine(options.device_type, options.devices, device.capacity, size=16 << 20, repeats=5)
        else:
            machine = nominal_machine(options.device_type, options.devices, device.capacity)
    profile.graph_hash = graph.fingerprint()
    profile.ties = tied_weights(graph, build_optimizer)
    profile.carry(low_copies(graph, options.device_type, precision.compute_dtype(options.precision), host_bandwidth))
    if options.probe and not options.analytic and options.device_type == "cpu" and loss_fn is not None:
        machine = _scaled_to_the_model(graph, profile, machine, get_batch, loss_fn, build_optimizer, options, on_progress)
    profile.machine = machine
    return profile, machine


def _scaled_to_the_model(graph, profile: Profile, machine: Machine, get_batch, loss_fn, build_optimizer,
                         options: CompileOptions, on_progress: Callable[[str], None]) -> Machine:
    """``machine`` with the compute scale and interference of this model's own layers on the runtime,
    not the probe's MLP blocks': how much slower the runtime computes than the profiler's trials depends on
    the size of the model's ops (the runtime's costs around them are per op and per layer)
    (``profiling/overheads.measure_model_scale``)."""
    from harmony.profiling.overheads import measure_model_scale  # the launcher, only when probing

    on_progress("measuring the runtime on the model")
    try:
        scaling = measure_model_scale(graph, profile, machine, get_batch, loss_fn, build_optimizer, options.minibatch,
                                      precision=options.precision)
    except HarmonyError as exc:
        log.warning("the model's compute scale could not be measured (%s); the probe's %.2f stands", exc,
                    machine.compute_scale)
        return machine
    notes = {**machine.notes,
             "compute_scale": "the real launcher's tasks on the model's own layers, one device, over their estimate "
                              "from its profile (median)",
             "compute_interference": f"the same on {max(2, machine.devices)} devices at once over one device, less "
                                     "one, per other device",
             "compute_task_overhead": "the same runs: the intercept beside the scale over each run's compute tasks "
                                      "(median of the one-device runs)"}
    return dataclasses.replace(scaling.applied(machine), notes=notes)


def tied_weights(graph: LayerGraph, build_optimizer: Callable) -> list[TiedWeight]:
    """The parameters several layers hold, with their bytes (the optimizer state's from a dry step
    on a zero copy), so that the task graphs move and update each of them once."""
    from harmony.runtime.hoststore import state_layout

    ties = []
    for canon, aliases in graph.ties.items():
        names = {canon, *aliases}
        layers = sorted({spec.index for spec in graph.layers if names & set(spec.state)})
        if len(layers) < 2:
            continue
        spec = graph.state[canon]
        dtype = dtype_from_str(spec.dtype)
        k = 0
        if spec.requires_grad:
            for shape, kdtype in state_layout(torch.empty(spec.shape, dtype=dtype, device="meta"), build_optimizer).values():
                if shape:
                    k += math.prod(shape) * kdtype.itemsize
        ties.append(TiedWeight(layers=layers, w_bytes=spec.nbytes, dw_bytes=spec.nbytes if spec.requires_grad else 0,
                               k_bytes=k))
    return ties


def _check_smallest_layer(profile: Profile, capacity: int) -> None:
    """Refuse early, naming the layer, when one layer alone cannot run even one sample."""
    for layer in profile.layers:
        need = max(layer.at("fwd_peak", 1), layer.at("bwd_peak", 1))
        if need > capacity:
            raise HarmonyError(
                f"layer {layer.index} ({layer.name}) needs {int(need):,} bytes for one sample, more than the "
                f"{capacity:,} bytes a device has; give the devices more memory or decompose with a finer granularity"
            )

