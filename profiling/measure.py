"""The profiler's measuring loop: one layer (or pack), one microbatch, on a device backend (§4.2).

A layer is measured as the runtime will run it: its weights and buffers copied to the device,
its input swapped in, forward without autograd (a FWD task stashes only its input), then the
backward task (recompute with autograd from the stashed input, then backward with an output
gradient). Memory is the device's peak over each task, from the untimed warm-up trial, which an
emulated device watches op by op; times are medians of the later trials, run unwatched
(``_unwatched``), as a run computes unless it checks memory. Timed watched, a layer's forward takes
several times its unwatched time, by a factor that differs per layer, per pass and per microbatch
size (the tracker's cost is per op), which no one compute scale could undo. The model's
own tensors are never touched (work happens on device copies) and the RNG is restored afterwards,
so profiling does not change training.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import statistics
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch.func import functional_call
from torch.utils._python_dispatch import _disable_current_modes

from harmony.errors import DeviceOutOfMemoryError
from harmony.runtime.device import Device, UncheckedCpuDevice, torch_threads

log = logging.getLogger(__name__)


@dataclass
class Measurement:
    """A pack's (usually one layer's) FWD task and, when asked, its BWD task at one microbatch size.

    ``act_bytes`` is what the recompute leaves alive for the backward (saved activations and the
    outputs): what a pack of several layers accumulates before its backward starts, so the
    scheduler can estimate a pack's memory from its layers'.
    """

    fwd_time: float
    fwd_peak: int
    x_bytes: int
    y_bytes: int
    bwd_time: float = 0.0
    recompute_time: float = 0.0
    bwd_peak: int = 0  # a microbatch accumulating into the gradient buffers of an earlier one
    bwd_first_peak: int = 0  # the group's first microbatch, whose backward makes the gradient buffers
    act_bytes: int = 0
    dx_bytes: int = 0
    bwd_error: str = ""  # why the backward task did not fit, if it did not
    fwd_layer_peaks: list[int] = field(default_factory=list)  # the FWD task's peak during each layer


@contextmanager
def _collection_paused() -> Iterator[None]:
    """No automatic cycle collection inside a measured window. Bytes read as the difference of two
    readings (a recompute's activations, an update's temporaries) lose whatever an earlier
    measurement's cyclic garbage gives back if a collection falls between them: a layer's
    activations read negative, and a run of ``bench.tv_models`` planned ResNet-18 from a training
    footprint below its weights' bytes alone."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _collect_garbage(device: Device, before: int) -> None:
    """Collect reference cycles if the device holds more than ``before`` bytes after a failed
    attempt whose error is gone: tensors a model's code left in a cycle (a list holding itself, a
    closure over its frame) are freed only by Python's cycle collector, which GPU code allocating
    few Python objects may not run for a long time, while the allocator counts their memory as in
    use. Collected only then: a full collection takes about 0.15 s with torch loaded."""
    if device.allocated() > before:
        gc.collect()
        device.empty_cache()


def _leaving_no_garbage(measure: Callable) -> Callable:
    """``measure`` (taking a ``device`` argument) whose out-of-memory error holds none of the failed
    attempt's tensors: raised afresh (the same fields, no traceback into the frames of the layer
    that failed, which would keep its activations alive while the caller goes on: PyTorch's FAQ on
    out-of-memory handlers), with cyclic garbage collected first (``_collect_garbage``). The failed
    attempt's own traceback is logged at debug level (``harmony -vv``)."""
    signature = inspect.signature(measure)

    @functools.wraps(measure)
    def measured(*args: Any, **kwargs: Any) -> Any:
        device = signature.bind(*args, **kwargs).arguments["device"]
        before = device.allocated()
        try:
            return measure(*args, **kwargs)
        except DeviceOutOfMemoryError as exc:
            log.debug("%s ran out of memory (traceback kept only here):", measure.__name__, exc_info=True)
            failed = DeviceOutOfMemoryError(*exc.args)
        _collect_garbage(device, before)
        raise failed

    return measured


MIN_TIMED_SECONDS = 0.02  # keep repeating a short task until this much was timed ...
MAX_TRIAL_FACTOR = 10  # ... but at most this many times the asked-for trials


def _trial_indices(trials: int, timed: list[float]):
    """Trial numbers: 0 is the untimed warm-up; then at least ``trials`` timed runs, more while
    the timed total is under ``MIN_TIMED_SECONDS`` (a sub-millisecond task's median of three is
    mostly the noise of a shared machine). ``trials=0`` runs the warm-up only (sweeps)."""
    trial = 0
    while trial == 0 or (trial <= trials) or (
        trials and sum(timed) < MIN_TIMED_SECONDS and trial <= trials * MAX_TRIAL_FACTOR
    ):
        yield trial
        trial += 1


def _unwatched(device: Device, trial: int) -> AbstractContextManager:
    """A timed trial (``trial`` > 0) runs without the emulated device's memory tracker, as a run's
    unchecked device computes; the warm-up (0) is watched, for the memory figures. Only the
    dispatch modes are lifted (``_disable_current_modes``): a model's own tensor subclasses still
    dispatch."""
    return _disable_current_modes() if trial and device.measures_memory else nullcontext()


def _nbytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else 0.0


def _on_device(device: Device, values: tuple, grad: bool) -> tuple:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            d = device.to_device(v.detach())
            if grad and d.is_floating_point():
                d.requires_grad_(True)
            out.append(d)
        else:
            out.append(v)
    return tuple(out)


def _device_state(module: torch.nn.Module, device: Device) -> dict[str, torch.Tensor]:
    """The layer's parameters and buffers copied to the device (the task's resident weights), by
    every name, a tied tensor's names sharing one copy: the layer runs with ``tie_weights=False``,
    as the runtime's do (``Compute._run_layer``)."""
    state: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in copies:
            copies[id(p)] = device.to_device(p.detach()).requires_grad_(p.requires_grad)
        state[name] = copies[id(p)]
    for name, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in copies:
            copies[id(b)] = device.to_device(b.detach())
        state[name] = copies[id(b)]
    return state


def _run_pack(modules: Sequence[torch.nn.Module], states: list[dict], values: tuple,
              peaks: list[int] | None = None, device: Device | None = None) -> tuple:
    """The pack's forward; with ``peaks``, the device's peak during each layer goes there (a
    stashed input adds to the layer after its own, so where the peak falls matters)."""
    for module, state in zip(modules, states):
        if peaks is not None:
            device.reset_peak()
        values = tuple(functional_call(module, state, values, tie_weights=False))
        if peaks is not None:
            peaks.append(device.peak())
    return values


def measure_layer(
    module: torch.nn.Module, inputs: tuple, device: Device, trials: int = 3, backward: bool = True,
    input_grad: bool = True,
) -> tuple[Measurement, tuple]:
    """One layer measured as a pack of one; see ``measure_pack``."""
    return measure_pack([module], inputs, device, trials=trials, backward=backward, input_grad=input_grad)


@_leaving_no_garbage
def measure_pack(
    modules: Sequence[torch.nn.Module], inputs: tuple, device: Device, trials: int = 3, backward: bool = True,
    loss: Callable[[tuple, Device], tuple[torch.Tensor, Any]] | None = None, input_grad: bool = True,
) -> tuple[Measurement, tuple]:
    """Time and peak memory of a pack's FWD task and (with ``backward``) its BWD task, and the
    pack's outputs in host memory (the next layer's inputs).

    The BWD task runs as under input-batch grouping: the pack's gradient buffers are resident
    (allocated before the task), and the recompute and backward add to them. Its backward starts
    from an output gradient of ones, or, with ``loss`` (the pack's outputs and the device -> the
    scalar loss and what the loss task holds until its backward ends: the target it copied in),
    from the loss, as a loss task runs it. ``input_grad``: the backward computes the gradient of
    the pack's floating inputs (False for a pack starting at layer 0: the runtime, as eager
    training, leaves the model's inputs without one). A forward that does
    not fit raises ``DeviceOutOfMemoryError``; a backward that does not fit is recorded in
    ``Measurement.bwd_error``, since the forward figures are still good. The device is left as
    before either way.
    """
    with torch.random.fork_rng(devices=[]), device.memory_scope():
        states = [_device_state(module, device) for module in modules]
        fwd_times, fwd_peak, x_bytes, y_bytes = [], 0, 0, 0
        layer_peaks: list[int] = []
        outputs: tuple = ()
        for trial in _trial_indices(trials, fwd_times):  # the warm-up is not timed and feeds the next layer
            xs = _on_device(device, inputs, grad=False)
            peaks: list[int] | None = None if trial else []  # the peak per layer, from the untimed run
            device.reset_peak()
            with _unwatched(device, trial):
                timer = device.timer()
                timer.start()
                with torch.no_grad():
                    ys = _run_pack(modules, states, xs, peaks, device)
                elapsed = timer.stop()
            x_bytes, y_bytes = _nbytes(xs), _nbytes(ys)
            if trial:
                fwd_times.append(elapsed)
            else:
                fwd_peak = max(peaks or (device.peak(),))
                layer_peaks = peaks
                outputs = tuple(device.to_host(y) if isinstance(y, torch.Tensor) else y for y in ys)
            del xs, ys
        m = Measurement(fwd_time=_median(fwd_times), fwd_peak=fwd_peak, x_bytes=x_bytes, y_bytes=y_bytes,
                        fwd_layer_peaks=layer_peaks)
        if backward:
            before = device.allocated()
            try:
                with device.oom_converted():  # a GPU's error would otherwise pass as the forward's
                    _measure_backward(modules, states, inputs, device, trials, m, loss, input_grad)
            except DeviceOutOfMemoryError as exc:
                m.bwd_error = str(exc)
            if m.bwd_error:
                for t in {id(t): t for state in states for t in state.values()}.values():
                    t.grad = None  # what the failed backward accumulated, so that only garbage is left over
                _collect_garbage(device, before)
        del states
    return m, outputs


def _measure_backward(modules, states, inputs: tuple, device: Device, trials: int, m: Measurement,
                      loss: Callable[[tuple, Device], tuple[torch.Tensor, Any]] | None = None,
                      input_grad: bool = True) -> None:
    params = list({id(t): t for state in states for t in state.values() if t.requires_grad}.values())
    # the group's first microbatch: autograd makes the gradient buffers (it keeps each fresh gradient)
    _backward_once(modules, states, params, inputs, device, m, loss, input_grad=input_grad)
    m.bwd_first_peak, m.bwd_peak = m.bwd_peak, 0
    for p in params:  # the gradient buffer, resident across the group's microbatches
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # the later ones: each gradient is made, then added to the buffer
    rec_times, bwd_times = [], []
    for trial in _trial_indices(trials, bwd_times):
        with _unwatched(device, trial):
            recompute, backward = _backward_once(modules, states, params, inputs, device, m, loss, watched=not trial,
                                                 input_grad=input_grad)
        if trial:
            rec_times.append(recompute)
            bwd_times.append(backward)
    for p in params:
        p.grad = None
    m.recompute_time = _median(rec_times)
    m.bwd_time = _median(bwd_times)


def _backward_once(modules, states, params, inputs: tuple, device: Device, m: Measurement,
                   loss: Callable[[tuple, Device], tuple[torch.Tensor, Any]] | None = None,
                   watched: bool = True, input_grad: bool = True) -> tuple[float, float]:
    """One BWD task; in a function of its own so that every tensor it made is gone when it returns
    (a tensor surviving into the next trial would inflate that trial's peak). ``watched``: its
    memory figures go into ``m`` (a timed trial runs unwatched and leaves them)."""
    xs = _on_device(device, inputs, grad=input_grad)
    device.reset_peak()
    with _collection_paused():
        before = device.allocated()
        timer = device.timer()
        timer.start()
        ys = _run_pack(modules, states, xs)
        recompute = timer.stop()
        after = device.allocated()
    if watched:
        m.act_bytes = after - before
    outs = [y for y in ys if isinstance(y, torch.Tensor) and y.requires_grad]
    held = ys  # a BWD task holds all of its pack's outputs (masks relayed beside activations too)
    if loss is not None and outs:  # the loss task drops its outputs once the loss is computed
        value, held = loss(ys, device)
        outs = [value]
    del ys
    # the output gradient is made before the timer: a BWD task receives it (the next pack's dX)
    grads = None if loss is not None or not outs else [torch.ones_like(y) for y in outs]
    timer = device.timer()
    timer.start()
    if outs:
        wanted = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad] + params
        torch.autograd.backward(outs, grads, inputs=wanted)
    del held
    backward = timer.stop()
    if watched:
        m.bwd_peak = max(m.bwd_peak, device.peak())
    m.dx_bytes = _nbytes([x.grad for x in xs if isinstance(x, torch.Tensor) and x.grad is not None])
    return recompute, backward


@_leaving_no_garbage
def measure_loss_time(outputs: tuple, device: Device, loss: Callable[[tuple, Device], tuple[torch.Tensor, Any]],
                      trials: int = 3) -> float:
    """Seconds of the loss's own forward and backward on a microbatch's ``outputs`` (host copies of
    the last layer's), as a loss task computes it between that layer's forward and backward: the
    target copied in, the loss, its backward to the outputs. 0 where the loss does not reach the
    outputs (nothing to differentiate)."""
    times: list[float] = []
    with torch.random.fork_rng(devices=[]), device.memory_scope():
        for trial in _trial_indices(trials, times):
            if not _loss_trial(outputs, device, loss, trial, times):
                return 0.0
    return _median(times)


def _loss_trial(outputs: tuple, device: Device, loss: Callable[[tuple, Device], tuple[torch.Tensor, Any]], trial: int,
                times: list[float]) -> bool:
    """One trial of ``measure_loss_time``, its time added to ``times`` unless it is the warm-up
    (0); False where the loss does not reach the outputs."""
    ys = _on_device(device, outputs, grad=True)
    with _unwatched(device, trial):
        timer = device.timer()
        timer.start()
        value, held = loss(ys, device)
        if not value.requires_grad:
            return False
        value.backward()
        del value, held
        elapsed = timer.stop()
    if trial:
        times.append(elapsed)
    return True


@_leaving_no_garbage
def update_scratch(
    params: list[torch.Tensor], build_optimizer: Callable[[Any], torch.optim.Optimizer], device: Device
) -> tuple[int, int]:
    """Bytes the optimizer allocates on ``device`` during a step beyond the weights and their
    gradients: its temporaries (Adam's denominator, one parameter at a time in the per-tensor
    implementation, the whole group at once in the foreach one), and its scalar state on the device
    (step counters: never moved as K, held through every step, one per parameter, so that a pack's
    sum over its parameters, not the largest layer's). Two steps: the first creates the state, the
    second runs as every later one. Scalars a GPU optimizer keeps on the host count for neither."""
    if not params:
        return 0, 0
    with torch.random.fork_rng(devices=[]), device.memory_scope():
        copies = [device.to_device(p.detach()).requires_grad_(True) for p in params]
        for c in copies:
            c.grad = torch.zeros_like(c)
        opt = build_optimizer(copies)
        with _collection_paused():
            before = device.allocated()
            device.reset_peak()
            for _ in range(2):
                opt.step()
            peak = device.peak()
        values = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        state = sum(v.untyped_storage().nbytes() for v in values if v.dim() > 0)
        scalars = sum(v.untyped_storage().nbytes() for v in values
                      if v.dim() == 0 and v.device.type == copies[0].device.type)
        del opt, copies, values
    return max(0, peak - before - state - scalars), scalars


def host_device() -> Device:
    """Where a host update is measured: host memory that nothing watches, as the runtime steps the
    host store (a watched device's per-op tracking makes an Adam step several times its run's
    time, which would put a plan's last host update late)."""
    return UncheckedCpuDevice("host")


class UpdateMeasure(NamedTuple):
    """One layer's optimizer step, as ``measure_update`` measured it."""

    seconds: float
    k_bytes: int
    k_tensors: int


@_leaving_no_garbage
def measure_update(
    params: list[torch.Tensor], build_optimizer: Callable[[Any], torch.optim.Optimizer], device: Device, trials: int = 3
) -> UpdateMeasure:
    """Seconds of one optimizer step over a layer's parameters on ``device``, and the optimizer
    state's bytes (K) and tensors (those the runtime moves: of more than one element). The first
    step creates the state, is not timed, and is the one an emulated device watches: it raises ``DeviceOutOfMemoryError`` when weights, gradients and state do not
    fit together. The timed steps run unwatched (``Device.host_side``), as a run steps unless it
    checks memory: an optimizer's step is many small ops, and the memory tracker's per-op dispatch
    made GPT-2 small's device updates twice their run's time."""
    if not params:
        return UpdateMeasure(0.0, 0, 0)
    with device.memory_scope():
        copies = [device.to_device(p.detach()).requires_grad_(True) for p in params]
        # gradients of a run's kind, not zeros: torch's Adam loop steps zero gradients much slower than
        # real ones on the CPU, which made device updates look far longer than a run's
        generator = torch.Generator(device=copies[0].device).manual_seed(0)
        for c in copies:
            c.grad = torch.empty_like(c).normal_(generator=generator)
        opt = build_optimizer(copies)
        times = []
        for trial in _trial_indices(trials, times):
            timer = device.timer()
            timer.start()
            with device.host_side() if trial else nullcontext():  # timed as a run steps: unwatched
                opt.step()
            elapsed = timer.stop()
            if trial:
                times.append(elapsed)
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        k_bytes = sum(v.numel() * v.element_size() for v in state)
    return UpdateMeasure(_median(times), k_bytes, len(state))


def measure_cast(weight: torch.Tensor, dtype: torch.dtype, trials: int = 3) -> float:
    """Seconds the host takes to cast ``weight`` into its low-precision copy, as a host update does
    after its step (``HostStore.refresh_low_copies``), on one thread as host updates run. A weight
    without values (meta, in an analytic plan) is 0."""
    if weight.is_meta:
        return 0.0
    master = weight.detach().to("cpu")
    copy = torch.empty_like(master, dtype=dtype)
    times: list[float] = []
    with torch_threads(1), torch.no_grad():
        for trial in _trial_indices(trials, times):
            start = time.perf_counter()
            copy.copy_(master)
            if trial:
                times.append(time.perf_counter() - start)
    return _median(times)


def measure_norm(params: list[torch.Tensor], trials: int = 3) -> float:
    """Seconds the host takes to clip a layer's gradients (``runtime/clipping.py``): the norm of
    each, then each scaled, over host copies of the parameters' size."""
    from harmony.runtime.clipping import clip_gradients

    if not params:
        return 0.0
    grads = [torch.empty_like(p.detach(), device="cpu") for p in params]
    times = []
    for trial in _trial_indices(trials, times):
        for g in grads:  # ones again: a norm of sqrt(numel) > 0.5, so every trial scales
            g.fill_(1.0)
        start = time.perf_counter()
        clip_gradients(grads, 0.5)
        elapsed = time.perf_counter() - start
        if trial:
            times.append(elapsed)
    return _median(times)
