"""Profiling a layer graph on a device: the slow-start sweep, the sampled sizes, the Profile (§4.2).

The sweep finds the largest microbatch that fits the device for the forward pass (U_FMAX) and for
the backward pass (U_BMAX) the way TCP slow start finds a window: double until the first
out-of-memory, then grow additively from the last size that fitted, halving the increment after
every failure, so it ends on a u that fits while u+1 does not. Then every layer is measured at a
few sizes at a fixed stride from 1 to the maximum, with repeated trials, and the Profile's
regression answers for the sizes in between.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch.utils._pytree import tree_unflatten

from harmony.decomposer.layer_graph import LayerGraph
from harmony.errors import DeviceOutOfMemoryError, HarmonyError
from harmony.runtime.device import CpuDevice, Device
from harmony.runtime.host_step import host_optimizer
from harmony.profiling.measure import (Measurement, host_device, measure_layer, measure_loss_time, measure_norm,
                                      measure_pack, measure_update, torch_threads, update_scratch)
from harmony.profiling.profiles import LayerProfile, LayerSample, LossSample, PackSample, Profile

log = logging.getLogger(__name__)


@dataclass
class _Attempt:
    """All layers at one microbatch size: measurements, or where it ran out of memory."""

    u: int
    fwd: list[Measurement | None]
    fwd_fits: bool
    bwd_fits: bool
    failure: str = ""
    failed_layer: int | None = None
    last_inputs: tuple = ()  # the last layer's inputs (host memory), when it ran


CALL_CHAIN, CALL_WIDTH = 8, 32  # the chain ``Profiler._backward_call_time`` reads the backward's call cost on


class _Link(torch.nn.Module):
    """A layer of the chain ``Profiler._backward_call_time`` measures: a small linear map, its
    outputs a tuple as a decomposed layer's are."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(CALL_WIDTH, CALL_WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.linear(x),)


class Profiler:
    """Measures every layer of ``graph`` on ``device`` with inputs from the model's ``get_batch``."""

    def __init__(
        self,
        graph: LayerGraph,
        get_batch: Callable[[int, int], tuple],
        build_optimizer: Callable[[Any], torch.optim.Optimizer],
        device: Device,
        trials: int = 3,
        on_progress: Callable[[str], None] | None = None,
        threads: int | None = None,
        loss_fn: Callable | None = None,
    ):
        if graph.modules is None:
            raise HarmonyError("the layer graph has no layer modules to run; decompose the model first")
        # the libraries' workspaces are allocated before the first layer is measured, and come
        # out of the capacity the plan is made for
        device.warm_up(within_capacity=True)
        self.graph = graph
        self.get_batch = get_batch
        self.build_optimizer = build_optimizer
        self.device = device
        self.trials = trials
        self.on_progress = on_progress or (lambda msg: None)
        self.threads = threads  # torch threads while measuring: an emulated device's share of the cores
        self.loss_fn = loss_fn  # for the loss task's own memory; None: the profile assumes a cross-entropy's
        self._fit_cache: dict[tuple[int, bool], _Attempt] = {}

    # ------------------------------------------------------------------ one size
    def _inputs(self, u: int) -> tuple:
        inputs, _ = self.get_batch(u, 0)
        return inputs if isinstance(inputs, tuple) else (inputs,)

    def run(self, u: int, backward: bool, trials: int) -> _Attempt:
        """Every layer at microbatch ``u``, in order, each fed the previous layer's real output."""
        values = self._inputs(u)
        attempt = _Attempt(u=u, fwd=[], fwd_fits=True, bwd_fits=backward)
        for i, module in enumerate(self.graph.modules):
            spec = self.graph.layers[i]
            attempt.last_inputs = values
            try:
                with _naming_failures(i, spec.name, u):
                    m, values = measure_layer(module, values, self.device, trials=trials, backward=attempt.bwd_fits,
                                              input_grad=i > 0)
            except DeviceOutOfMemoryError as exc:
                attempt.fwd_fits = attempt.bwd_fits = False
                attempt.failure = f"forward of layer {i} ({spec.name}) at u={u}: {exc}"
                attempt.failed_layer = i
                return attempt
            if m.bwd_error:
                attempt.bwd_fits = False
                attempt.failure = f"backward of layer {i} ({spec.name}) at u={u}: {m.bwd_error}"
                attempt.failed_layer = i
            attempt.fwd.append(m)
        return attempt

    def _fits(self, u: int, backward: bool) -> bool:
        key = (u, backward)
        if key not in self._fit_cache:
            self.on_progress(f"sweep {'backward' if backward else 'forward'} u={u}")
            self._fit_cache[key] = self.run(u, backward=backward, trials=0)
        attempt = self._fit_cache[key]
        return attempt.bwd_fits if backward else attempt.fwd_fits

    # ------------------------------------------------------------------ the sweep
    def smallest_microbatch(self, cap: int) -> int:
        """The fewest samples (up to ``MIN_MICROBATCH_TRIES``) every layer trains on, out of memory or
        not. BatchNorm in training needs more than one value per channel: an MLP with BatchNorm1d, or
        an ImageNet network on CIFAR-sized images (a 1x1 map at the end), trains on the user's
        minibatch but not on one sample, and a plan must not split the minibatch below that. A
        model that fails at every size tried fails with one sample's error."""
        u, _, refused = _at_fewest_samples(lambda u: self._fits(u, backward=True), cap)
        if refused is not None:
            log.warning("layer %d (%s) cannot train on fewer than %d samples (%s); every microbatch of the plan "
                        "holds at least %d", refused.index, refused.name, u, refused.cause, u)
        return u

    def slow_start(self, backward: bool, cap: int, start: int = 1) -> int:
        """Largest u ≤ cap whose every layer fits (forward, or backward), by slow start from ``start``
        (the smallest microbatch the model trains on)."""
        if not self._fits(start, backward):
            raise HarmonyError(self._too_small(self._fit_cache[(start, backward)]))
        u = start
        while u * 2 <= cap and self._fits(u * 2, backward):
            u *= 2
        step = max(1, u // 2)
        while step >= 1 and u < cap:
            if u + step <= cap and self._fits(u + step, backward):
                u += step
            else:
                step //= 2
        return u

    def _too_small(self, attempt: _Attempt) -> str:
        """Which layer cannot run the smallest microbatch on this device, and how much it needs
        (measured on an unlimited device)."""
        i, u = attempt.failed_layer, attempt.u
        if i is None:
            return f"{self.device.name}: even microbatch size {u} does not fit: {attempt.failure}"
        values = self._inputs(u)
        for module in self.graph.modules[:i]:
            values = measure_layer(module, values, CpuDevice("need"), trials=0, backward=False)[1]
        need, _ = measure_layer(self.graph.modules[i], values, CpuDevice("need"), trials=0, backward=True,
                                input_grad=i > 0)
        needed = max(need.fwd_peak, need.bwd_peak)
        if needed <= self.device.capacity:  # the layer fits; something else took the room
            return (
                f"{self.device.name}: layer {i} ({self.graph.layers[i].name}) needs {needed:,} bytes for {_samples(u)}, "
                f"within the {self.device.capacity:,} bytes of the device, yet it ran out of memory ({attempt.failure}); "
                "something else holds that device's memory (another process, or tensors of this one): free it "
                "or give more memory (--device-memory)"
            )
        return (
            f"layer {i} ({self.graph.layers[i].name}) needs {needed:,} bytes of device memory "
            f"for {_samples(u)} (forward {need.fwd_peak:,}, backward {need.bwd_peak:,}), more than the {self.device.capacity:,} "
            f"bytes of {self.device.name}; give each device more memory (--device-memory) or cut the model into "
            "smaller layers (--depth or --modules)"
        )

    # ------------------------------------------------------------------ the profile
    def profile(self, u_cap: int, samples: int = 4) -> Profile:
        """Sweep, measure at ``samples`` sizes per pass, measure updates, and assemble the Profile."""
        with torch_threads(self.threads):
            return self._profile(u_cap, samples)

    def _profile(self, u_cap: int, samples: int) -> Profile:
        u_min = self.smallest_microbatch(u_cap)
        u_fmax = self.slow_start(backward=False, cap=u_cap, start=u_min)
        u_bmax = self.slow_start(backward=True, cap=u_fmax, start=u_min)
        log.info("%s: U_MIN=%d U_FMAX=%d U_BMAX=%d", self.device.name, u_min, u_fmax, u_bmax)
        # the stride, plus the sweep's doublings: peak memory bends where the task's largest moment
        # moves from one phase to another, and denser small sizes catch that bend
        doublings = {1 << k for k in range(u_fmax.bit_length()) if u_min <= 1 << k <= u_fmax} | {u_min}
        bwd_us = _from(u_min, stride_sizes(u_bmax, samples)) | {u for u in doublings if u <= u_bmax}
        sizes = sorted(_from(u_min, stride_sizes(u_fmax, samples)) | doublings | bwd_us)  # a backward sample needs its forward
        layers = [self._layer_profile(i) for i in range(len(self.graph.layers))]
        losses: list[LossSample] = []
        for u in sizes:
            self.on_progress(f"measure u={u}")
            attempt = self.run(u, backward=u in bwd_us, trials=self.trials)
            if not attempt.fwd_fits or (u in bwd_us and not attempt.bwd_fits):
                raise HarmonyError(f"u={u} fitted during the sweep but not when measured: {attempt.failure}")
            if u in bwd_us:
                self._loss_sample(u, attempt.last_inputs, losses)
            for layer, m in zip(layers, attempt.fwd):
                sample = LayerSample(
                    u=u, fwd_time=m.fwd_time, bwd_time=m.bwd_time, recompute_time=m.recompute_time,
                    fwd_peak=m.fwd_peak, bwd_peak=m.bwd_peak, x_bytes=m.x_bytes, y_bytes=m.y_bytes, dx_bytes=m.dx_bytes,
                    act_bytes=m.act_bytes, bwd_first_peak=m.bwd_first_peak,
                )
                layer.fwd_samples.append(sample)
                if u in bwd_us:
                    layer.bwd_samples.append(sample)
        return Profile(
            source="measured", device=f"{self.device.kind}:{self.device.name}", capacity=self.device.capacity,
            u_fmax=u_fmax, u_bmax=u_bmax, u_min=u_min, layers=layers, graph_hash=self.graph.fingerprint(),
            loss_samples=losses, update_growth=self._update_growth(layers),
            backward_call_time=self._backward_call_time(),
        )

    def _backward_call_time(self) -> float:
        """``Profile.backward_call_time`` on this device: a chain of ``CALL_CHAIN`` small linear
        layers, each measured alone and then all as one pack; the backward's share the layers count
        once each and the pack once in all, ``(sum of the layers' bwd_time - the pack's) / (layers -
        1)``, at least 0. Without it a pack's backward composed from its layers comes out longer
        than the pack measured whole, and a plan of one long task that much high. The model's own
        layers would read the same, but a large model's layers hide it in their noise, and a whole
        model need not fit the device at once; the autograd engine's set-up does not depend on the
        layers."""
        with torch.random.fork_rng(devices=[]):  # the user's generator is left where it was
            torch.manual_seed(0)
            chain = [_Link() for _ in range(CALL_CHAIN)]
            inputs = (torch.randn(1, CALL_WIDTH),)
        devices = [self.device]
        if self.device.kind == "cpu":  # an emulated device too small for the chain: the same cores, uncapped
            devices.append(CpuDevice("backward call", None))
        for device in devices:
            try:
                measured = self._chain_backwards(chain, inputs, device)
            except DeviceOutOfMemoryError as exc:
                log.info("the backward call's cost is not read on %s: %s", device.name, exc)
                continue
            if measured is None:
                log.info("the backward call's cost is not read on %s: a backward does not fit", device.name)
                continue
            alone, whole = measured
            break
        else:
            return 0.0
        per_call = max((sum(alone) - whole) / (CALL_CHAIN - 1), 0.0)
        log.info("backward call cost: %.1f us (%d layers' backwards %.3f ms alone, %.3f ms as one pack)",
                 per_call * 1e6, CALL_CHAIN, sum(alone) * 1e3, whole * 1e3)
        return per_call

    def _chain_backwards(self, chain: list[torch.nn.Module], inputs: tuple,
                         device: Device) -> tuple[list[float], float] | None:
        """Each layer's backward measured alone, and the chain's as one pack, on ``device``; None
        where a backward does not fit (a forward that does not raises ``DeviceOutOfMemoryError``)."""
        alone, values = [], inputs
        for module in chain:
            m, values = measure_layer(module, values, device, trials=self.trials)
            if m.bwd_error:
                return None
            alone.append(m.bwd_time)
        whole, _ = measure_pack(chain, inputs, device, trials=self.trials)
        return None if whole.bwd_error else (alone, whole.bwd_time)

    def loss_on_device(self, u: int) -> Callable[[tuple, Device], tuple[torch.Tensor, Any]] | None:
        """The loss of a microbatch of ``u`` samples as a loss task computes it from the last
        layer's outputs, with its target copied to the device (held until the backward ends, as
        the loss task holds it), or None without a loss function."""
        if self.loss_fn is None:
            return None
        target = self.get_batch(u, 0)[1]
        spec = self.graph.out_spec()

        def loss(outputs: tuple, device: Device) -> tuple[torch.Tensor, Any]:
            t = device.to_device(target) if isinstance(target, torch.Tensor) else target
            return self.loss_fn(tree_unflatten(list(outputs), spec), t) * 1.0, t  # scaled, as a loss task does

        return loss

    def measure_packs(self, packs: list[tuple[int, int, int]]) -> list[PackSample]:
        """Packs (first, last, u) measured whole, as ``PackSample``s: the FWD task's peak and the
        BWD task's, the loss task's for a pack of the last layer. A plan's estimate then rests on
        what its own packs hold, not on composing layers (an upper bound, loose where layers share
        tensors). A pack that does not fit the device is left out (the composition stands for it),
        and so is the last pack without a loss function. ``u = 0`` asks for the pack's optimizer step (``upd_bytes``)."""
        out = [self._update_sample(first, last) for first, last, u in sorted(packs) if u == 0]
        last_layer = len(self.graph.modules) - 1
        for u in sorted({u for _, _, u in packs} - {0}):
            inputs = [self._inputs(u)]
            for module in self.graph.modules[:-1]:
                inputs.append(measure_layer(module, inputs[-1], CpuDevice("feed"), trials=0, backward=False)[1])
            for first, last, size in sorted(p for p in packs if p[2] == u):
                loss = self.loss_on_device(u) if last == last_layer else None
                if last == last_layer and loss is None:
                    continue  # a loss task without its loss would be measured short
                try:
                    m, _ = measure_pack(self.graph.modules[first:last + 1], inputs[first], self.device, trials=0,
                                        loss=loss, input_grad=first > 0)
                except DeviceOutOfMemoryError as exc:
                    log.info("pack L%d-%d at u=%d: forward: %s", first, last, u, exc)
                    continue
                if m.bwd_error:
                    log.info("pack L%d-%d at u=%d: %s", first, last, u, m.bwd_error)
                    continue
                out.append(PackSample(first=first, last=last, u=u, fwd_peak=m.fwd_peak, bwd_peak=m.bwd_peak,
                                      bwd_first_peak=m.bwd_first_peak, fwd_layer_peaks=m.fwd_layer_peaks))
        return out

    def _update_sample(self, first: int, last: int) -> PackSample:
        """The optimizer step of a pack's parameters measured whole: its temporaries and scalar
        state (``update_scratch``). Composed from its layers (the largest layer's temporaries, the
        others' by ``Profile.update_growth``) it was off by a few bytes either way."""
        params = list({id(p): p for m in self.graph.modules[first:last + 1] for p in m.parameters()
                       if p.requires_grad}.values())
        try:
            scratch, scalars = update_scratch(params, self.build_optimizer, self.device)
        except DeviceOutOfMemoryError:
            scratch, scalars = update_scratch(params, self.build_optimizer, CpuDevice("update scratch", None))
        return PackSample(first=first, last=last, u=0, fwd_peak=0, bwd_peak=0, upd_bytes=scratch + scalars)

    def _loss_sample(self, u: int, inputs: tuple, out: list[LossSample]) -> None:
        """The last layer's loss task alone at ``u`` (``LossSample``); none recorded where it
        cannot run here (no loss function, a loss that does not fit or fails on the profiler's
        batches): the profile then assumes a cross-entropy's loss."""
        loss = self.loss_on_device(u)
        if loss is None or not inputs:
            return
        index = len(self.graph.modules) - 1
        module = self.graph.modules[index]
        try:
            m, outputs = measure_pack([module], inputs, self.device, trials=0, loss=loss, input_grad=index > 0)
        except DeviceOutOfMemoryError:
            m = None
        except Exception as exc:  # noqa: BLE001 - the loss is the user's; training will say what is wrong
            log.info("the loss task could not be measured at u=%d: %s: %s", u, type(exc).__name__, exc)
            return
        if m is None or m.bwd_error:
            log.info("the last layer's loss task does not fit %s at u=%d", self.device.name, u)
            return
        try:
            seconds = measure_loss_time(outputs, self.device, loss, trials=self.trials)
        except DeviceOutOfMemoryError:  # the memory figure stands; the loss's time is left unmeasured
            seconds = 0.0
        params = [p for p in module.parameters()]
        own = (sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in params)
               + sum(b.numel() * b.element_size() for b in module.buffers()) + m.x_bytes)
        out.append(LossSample(u=u, nbytes=max(0, m.bwd_peak - own), first_nbytes=max(0, m.bwd_first_peak - own),
                              seconds=seconds))

    def _update_growth(self, layers: list[LayerProfile]) -> float:
        """How the optimizer's temporaries grow with the parameters stepped together
        (``Profile.update_growth``): the layer with the most, stepped beside a copy of itself."""
        top = max(layers, key=lambda layer: layer.upd_bytes, default=None)
        if top is None or top.upd_bytes <= 0:
            return 1.0
        params = [p for p in self.graph.modules[top.index].parameters() if p.requires_grad]
        try:
            both, _ = update_scratch(params + [p.detach().clone() for p in params], self.build_optimizer, self.device)
        except DeviceOutOfMemoryError:
            return 1.0
        return min(1.0, max(0.0, (both - top.upd_bytes) / top.upd_bytes))

    def _layer_profile(self, index: int) -> LayerProfile:
        module = self.graph.modules[index]
        params = [p for p in module.parameters() if p.requires_grad]
        w_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        b_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
        self.on_progress(f"update layer {index}")
        # timed as a host update steps: by the fused twin where the optimizer has one (runtime/host_step.py)
        upd_host, k_bytes, k_tensors = measure_update(params, host_optimizer(self.build_optimizer), host_device(),
                                                      self.trials)
        norm_host = measure_norm(params, self.trials)
        try:
            upd_device = measure_update(params, self.build_optimizer, self.device, self.trials).seconds
            upd_bytes, upd_scalar_bytes = update_scratch(params, self.build_optimizer, self.device)
        except DeviceOutOfMemoryError:
            upd_device = float("inf")  # the update of this layer must be offloaded to the host
            upd_bytes, upd_scalar_bytes = self._unbounded_update_scratch(index, params)
        return LayerProfile(
            index=index, name=self.graph.layers[index].name, w_bytes=w_bytes,
            dw_bytes=sum(p.numel() * p.element_size() for p in params), k_bytes=k_bytes, b_bytes=b_bytes,
            upd_time_device=upd_device, upd_time_host=upd_host, upd_bytes=upd_bytes,
            upd_scalar_bytes=upd_scalar_bytes, norm_time_host=norm_host, w_tensors=len(list(module.parameters())),
            dw_tensors=len(params), k_tensors=k_tensors, b_tensors=len(list(module.buffers())),
        )


    def _unbounded_update_scratch(self, index: int, params: list[torch.Tensor]) -> tuple[int, int]:
        """``update_scratch`` of a layer whose update does not fit the device, measured on an
        emulated device without a limit: a plan that still steps it on the device (the per-GPU
        baselines know no other place) must count its temporaries, so that it is refused rather
        than run out of memory. On a GPU this is the CPU optimizer's figure, logged as such."""
        if self.device.kind != "cpu":
            log.warning("layer %d's update does not fit the device; its temporaries are taken from a step on "
                        "the CPU", index)
        return update_scratch(params, self.build_optimizer, CpuDevice("update scratch", None))


def training_footprint(graph: LayerGraph, get_batch: Callable[[int, int], tuple], minibatch: int, k_per_w: float = 2.0) -> int:
    """Bytes to train on one device without recompute: weights, gradients, optimizer state
    (``k_per_w`` times the weights; Adam keeps two) and every layer's activations for a whole
    minibatch. The activations per sample are measured (one sample through every layer's BWD task
    on an unlimited emulated device) and scaled by the minibatch size."""
    activations, _, u = _smallest_pass(graph, get_batch, minibatch)
    return _footprint(graph, minibatch * activations / u, k_per_w)


def _footprint(graph: LayerGraph, activations: float, k_per_w: float = 2.0) -> int:
    return int((2 + k_per_w) * graph.parameter_bytes() + activations)


def default_capacity(graph: LayerGraph, get_batch: Callable[[int, int], tuple], minibatch: int) -> int:
    """An emulated device's memory when the user gives none: a quarter of the training footprint,
    so that a default run needs the swaps a GPU run needs, and at least twice what the hungriest
    layer takes at the smallest microbatch, so that every layer has room to run (a model that
    trains on no fewer than two samples needs that much more of it)."""
    activations, peak, u = _smallest_pass(graph, get_batch, minibatch)
    return max(1, _footprint(graph, minibatch * activations / u) // 4, 2 * peak)


def _smallest_pass(graph: LayerGraph, get_batch: Callable[[int, int], tuple], minibatch: int) -> tuple[int, int, int]:
    """(every layer's activations, the largest layer peak, u) at the fewest samples u the model
    trains on."""
    if graph.modules is None:
        raise HarmonyError("the layer graph has no layer modules to run; decompose the model first")
    u, (activations, peak), _ = _at_fewest_samples(lambda u: _activation_bytes(graph, get_batch, u), minibatch)
    return activations, peak, u


T = TypeVar("T")


def _at_fewest_samples(attempt: Callable[[int], T], limit: int) -> tuple[int, T, _LayerFailed | None]:
    """(u, ``attempt(u)``, the first size's failure or None) at the fewest samples u, from one up
    to ``MIN_MICROBATCH_TRIES`` and ``limit``, where no layer fails on its own (out of memory is
    the caller's to judge). Every size failing raises the one-sample failure."""
    first: _LayerFailed | None = None
    for u in range(1, min(limit, MIN_MICROBATCH_TRIES) + 1):
        try:
            return u, attempt(u), first
        except _LayerFailed as exc:
            first = first or exc
    assert first is not None
    raise first


def _activation_bytes(graph: LayerGraph, get_batch: Callable[[int, int], tuple], u: int) -> tuple[int, int]:
    """(every layer's activations, the largest forward or backward peak of one layer) at microbatch
    ``u``, measured on an unlimited emulated device."""
    device = CpuDevice("footprint")
    inputs, _ = get_batch(u, 0)
    values = inputs if isinstance(inputs, tuple) else (inputs,)
    activations = peak = 0
    for index, module in enumerate(graph.modules):
        with _naming_failures(index, graph.layers[index].name, u):
            m, values = measure_layer(module, values, device, trials=0, backward=True, input_grad=index > 0)
        activations += m.act_bytes
        peak = max(peak, m.fwd_peak, m.bwd_peak)
    return activations, peak


# how many sizes, from one sample up, a model is tried at before its failure is taken for its own
MIN_MICROBATCH_TRIES = 8


class _LayerFailed(HarmonyError):
    """A layer's own error (not out of memory) at one microbatch size."""

    def __init__(self, index: int, name: str, u: int, exc: BaseException) -> None:
        self.index, self.name, self.u = index, name, u
        self.cause = f"{type(exc).__name__}: {exc}"
        super().__init__(
            f"layer {index} ({name}) failed at microbatch size {u}: {self.cause}. Its code ran at the example batch "
            "when the model was decomposed; if it fails only at other sizes, the trace fixed something there "
            "(torch.export asserting what a mask selected, as in Hugging Face BART's classification head): keep "
            "the module computing it whole (--opaque MODULE) or trace with the other method (--method fx or export)"
        )


@contextmanager
def _naming_failures(index: int, name: str, u: int):
    """Any error but out-of-memory while running a layer is the model's: say where it happened."""
    try:
        yield
    except (DeviceOutOfMemoryError, HarmonyError):
        raise
    except Exception as exc:
        raise _LayerFailed(index, name, u, exc) from exc


def _samples(u: int) -> str:
    return "one sample" if u == 1 else f"{u} samples (the fewest it trains on)"


def _from(u_min: int, sizes: list[int]) -> set[int]:
    """``sizes`` with those below the smallest microbatch raised to it."""
    return {max(u, u_min) for u in sizes}


def stride_sizes(u_max: int, samples: int) -> list[int]:
    """``samples`` sizes at a fixed stride from 1 to ``u_max`` (both included).

    A stride of 8 or more is rounded to a multiple of 8: kernels are tuned for such sizes, and an
    odd size between two of them runs slower than either neighbour, which would bend the fit.
    Both ends are always measured, so fewer than two samples means two.
    """
    samples = max(samples, 2)
    if u_max <= samples:
        return list(range(1, u_max + 1))
    stride = (u_max - 1) / (samples - 1)
    if stride >= 8:
        step = 8 * max(1, round(stride / 8))
        return sorted({1, u_max, *(min(u_max, k * step) for k in range(1, samples - 1))})
    return sorted({1 + round(k * stride) for k in range(samples)})
