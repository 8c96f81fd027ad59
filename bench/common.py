"""What the benchmarks share: the tiny models, one compile per model and a search per mode, timed
training runs on emulated CPU devices, and a description of the machine.

A model is profiled once (``compiled``); every mode, minibatch and ablation is then a search on that
profile, as ``tests/runtime/test_training.py`` does, so that a benchmark spends its time training
rather than re-profiling.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

import harmony
from harmony.compiler import CompileOptions, compile_plan
from harmony.models import bert, gpt2, resnet, vgg
from harmony.plan import Plan
from harmony.runtime import launcher
from harmony.scheduler.search import SearchResult, search


@dataclass(frozen=True)
class Model:
    """A model with its loss, batches and optimizer (a model file's four functions)."""

    name: str
    build: Callable[[], torch.nn.Module]
    loss_fn: Callable
    get_batch: Callable[[int, int], tuple]
    build_optimizer: Callable


def _tiny(module) -> Model:
    return Model(f"{module.__name__.rsplit('.', 1)[-1]}-tiny", functools.partial(module.build_model, "tiny"),
                 module.loss_fn, functools.partial(module.get_batch, preset="tiny"), module.build_optimizer)


TINY = {m.name: m for m in (_tiny(gpt2), _tiny(bert), _tiny(vgg), _tiny(resnet))}


def compiled(model: Model, minibatch: int, devices: int = 2, device_memory: int | None = None,
             probe: bool = False, trials: int = 2, samples: int = 3) -> Plan:
    """A pp plan of ``model`` whose profile (measured on one emulated device) serves every later
    search; ``device_memory=None``: a quarter of the training footprint (the CLI's default)."""
    torch.manual_seed(0)
    module = model.build()
    options = CompileOptions(minibatch=minibatch, devices=devices, device_memory=device_memory, mode="pp",
                             compare=False, probe=probe, trials=trials, samples=samples)
    # with the loss, as a user's compile has it: its memory and time are profiled, and a probed
    # compile calibrates the compute scale on the model's own layers (without it, on MLP blocks)
    plan, _ = compile_plan(module, model.get_batch, model.build_optimizer, options, loss_fn=model.loss_fn)
    plan.loss_fn, plan.build_optimizer, plan.get_batch = model.loss_fn, model.build_optimizer, model.get_batch
    return plan


def searched(base: Plan, mode: str, devices: int, minibatch: int, **options) -> tuple[Plan, SearchResult]:
    """``base``'s profile searched again for another mode / device count / minibatch / switches."""
    result = search(base.profile, base.profile.machine, mode, devices, minibatch,
                    capacity=base.options["planned_memory"], same_u=bool(base.options["same_u"]), **options)
    return with_tasks(base, result.graph, result.estimate.iteration_time), result


def with_tasks(base: Plan, tasks, estimated: float | None = None) -> Plan:
    """``base`` with another task graph (same model, profile and capacity)."""
    plan = Plan(graph=base.graph, profile=base.profile, tasks=tasks, estimate={"iteration_time": estimated},
                options={**base.options, "devices": tasks.devices, "mode": tasks.mode})
    plan.loss_fn, plan.build_optimizer, plan.get_batch = base.loss_fn, base.build_optimizer, base.get_batch
    return plan


@dataclass
class Run:
    """What a short training run measured (the first iteration, warm-up, left out)."""

    seconds: float  # median iteration time
    samples_per_second: float
    peak: list[int]  # per worker, the most tracked device memory over the iterations
    swap_bytes: int  # host<->device bytes of the last iteration, as the runtime counted them
    bytes_by_channel: dict[str, int]
    iterations: list[float]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def train(plan: Plan, iterations: int = 4, prefetch: bool = True, timeout: float = 120.0,
          check_memory: bool = False) -> Run:
    """Train ``plan`` for ``iterations`` minibatches on its emulated devices; as a user's run, not
    checking memory op by op unless ``check_memory`` (then out-of-memory is raised where it happens
    and peaks are measured; else they are the plan's reservations)."""
    minibatch = plan.tasks.minibatch
    with harmony.Trainer(plan, optimizer=plan.build_optimizer, timeout=timeout, prefetch=prefetch,
                         check_memory=check_memory) as trainer:
        for step in range(iterations):
            trainer.step(*plan.get_batch(minibatch, step))
        history = list(trainer.history)
    return summarize(history, minibatch)


def summarize(history: list, minibatch: int) -> Run:
    seconds = [h.seconds for h in history]
    steady = seconds[1:] or seconds
    median = statistics.median(steady)
    last = history[-1].bytes_by_channel()
    return Run(seconds=median, samples_per_second=minibatch / median,
               peak=[max(h.workers[r].peak for h in history) for r in range(len(history[-1].workers))],
               swap_bytes=last.get("SWAP in", 0) + last.get("SWAP out", 0), bytes_by_channel=last,
               iterations=seconds)


def machine_info() -> dict[str, Any]:
    """The machine and software the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    ram = None
    try:
        with open("/proc/meminfo") as f:
            ram = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "ram_bytes": ram, "python": platform.python_version(),
        "torch": torch.__version__, "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": os.getloadavg()[0],
    }


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now, for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stopwatch:
    """Seconds since creation, for the benchmarks' own wall time."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start


@contextlib.contextmanager
def from_workers(snapshot: Callable[[], Any]) -> Iterator[list[Any]]:
    """What each worker forked inside the block holds at its end: ``snapshot()``, taken in the
    worker as it exits (a diagnostic's counters, gathered there by functions this process wrapped
    before the fork) and written as JSON. The yielded list is filled with one entry per worker when
    the block ends; train with the workers closed inside it."""
    gathered: list[Any] = []
    original = launcher._worker_main
    with tempfile.TemporaryDirectory(prefix="harmony-bench-") as out_dir:
        def dumping_main(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                with open(os.path.join(out_dir, f"{os.getpid()}.json"), "w") as f:
                    json.dump(snapshot(), f)

        launcher._worker_main = dumping_main
        try:
            yield gathered
        finally:
            launcher._worker_main = original
            for name in sorted(os.listdir(out_dir)):
                with open(os.path.join(out_dir, name)) as f:
                    gathered.append(json.load(f))
