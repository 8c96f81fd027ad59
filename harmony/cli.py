"""The ``harmony`` command line.

Each subcommand is one stage of the flow (docs/architecture.md, "The flow of data") and reads or
writes that stage's files, so stages can be run, inspected and tested alone. Errors a user can fix
are printed as one message without a traceback (``-v`` shows it) and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harmony import checkpoint
from harmony.errors import HarmonyError
from harmony import timing
from harmony.scheduler.modes import MODES
from harmony.runtime.device import SHARE_GPUS, visible_gpus

if TYPE_CHECKING:  # loaded where a command reads a plan: the other commands start without it
    from harmony.plan import Plan

console = Console(width=None if sys.stdout.isatty() else 160)
log = logging.getLogger("harmony")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_file", type=Path, help="Python file defining build_model, loss_fn, get_batch (and optionally build_optimizer)")
    p.add_argument(
        "--arg", dest="args", action="append", default=[], metavar="KEY=VALUE",
        help="option passed to the model file's functions, e.g. --arg preset=tiny (repeatable)",
    )


def _add_granularity_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layer granularity (default: one block of each ModuleList/Sequential)")
    g.add_argument("--depth", type=int, help="one layer per module this many levels below the root")
    g.add_argument("--modules", help="comma-separated module names, each one layer")
    g.add_argument(
        "--opaque", action="append", default=[], metavar="MODULE",
        help="keep this module whole and run it eagerly (for modules that cannot be traced; repeatable)",
    )
    g.add_argument("--method", choices=("auto", "fx", "export"), default="auto", help="tracer (default: fx, then torch.export)")


def _load_and_decompose(ns: argparse.Namespace, meta: bool, check_loss: bool = True):
    """The model file, its model (on the meta device when asked, without running its initialisers:
    ``decomposer/meta_init.py``) and its layer graph; the file's
    ``loss_fn`` checked on the model's output first where it is to train (``harmony.inputs``)."""
    from harmony.decomposer.decompose import decompose
    from harmony.decomposer.meta_init import on_meta
    from harmony.inputs import check_loss_on_model
    from harmony.modelfile import load_model_file, parse_options

    with timing.stage("model build"):
        mf = load_model_file(ns.model_file, parse_options(ns.args))
        with on_meta() if meta else contextlib.nullcontext():
            model = mf.build_model()
    inputs, target = mf.get_batch(ns.batch_size, 0)
    if check_loss:
        check_loss_on_model(model, mf.loss_fn, inputs, target)
    with timing.stage("decompose"):
        graph = decompose(
            model, inputs, depth=ns.depth, modules=ns.modules.split(",") if ns.modules else None,
            opaque_modules=ns.opaque, method=ns.method,
        )
    return mf, model, graph


def default_device() -> str:
    """The backend when --device is not given: the GPUs where there are any, else emulated devices."""
    return "cuda" if visible_gpus() else "cpu"


def _add_device_args(p: argparse.ArgumentParser, what: str = "number of devices N") -> None:
    g = p.add_argument_group("devices")
    g.add_argument("--device", choices=("cpu", "cuda"),
                   help="device backend (default: cuda if a GPU is visible, else emulated cpu devices)")
    g.add_argument("--devices", type=int, help=f"{what} (default: every visible GPU with --device cuda, 2 emulated "
                   f"cpu devices; more workers than GPUs need {SHARE_GPUS}=1)")
    p.set_defaults(device_defaults=True)
    g.add_argument("--device-memory", help="capacity per device, e.g. 8GiB (default: free GPU memory; emulated cpu: "
                   "a quarter of the model's training footprint)")
    g.add_argument("--memory-margin", type=float, default=0.1,
                   help="share of device memory the plan leaves unplanned, for noise the estimate cannot know (a "
                        "GPU allocator's fragmentation; default 0.1); the plan's peak itself bounds the run's")


def _cmd_decompose(ns: argparse.Namespace) -> int:
    start = time.perf_counter()
    _, model, graph = _load_and_decompose(ns, meta=ns.meta, check_loss=False)
    elapsed = time.perf_counter() - start
    if ns.out is not None:
        graph.save(ns.out)
    _print_layers(graph, ns.batch_size)
    where = f"; wrote {ns.out}/graph.msgpack and {ns.out}/layers/" if ns.out is not None else ""
    console.print(
        f"{type(model).__name__}: {len(graph)} layers, {_human_bytes(graph.parameter_bytes())} of parameters, "
        f"traced with {graph.tracer} in {elapsed:.1f}s{where}"
    )
    return 0


def _cmd_profile(ns: argparse.Namespace) -> int:
    from harmony.compiler import CompileOptions, profile_graph

    options = CompileOptions(
        minibatch=ns.max_microbatch or ns.minibatch, devices=ns.devices, device_memory=ns.device_memory,
        device_type=ns.device, analytic=ns.analytic, trials=ns.trials, samples=ns.samples, probe=not ns.no_probe,
    )
    options.validate()
    mf, _, graph = _load_and_decompose(ns, meta=bool(ns.analytic))
    with _progress("profiling") as report:
        profile, machine = profile_graph(graph, mf.get_batch, mf.build_optimizer, options, report, mf.loss_fn)
    if ns.out is not None:
        graph.save(ns.out)
        profile.save(ns.out / "profile.msgpack")
    _print_profile(profile)
    console.print(machine.describe())
    where = f"; wrote {ns.out}/profile.msgpack" if ns.out is not None else ""
    console.print(f"{profile.device}: capacity {_human_bytes(profile.capacity)}, U_FMAX={profile.u_fmax}, U_BMAX={profile.u_bmax}"
                  + (f", U_MIN={profile.u_min} (the fewest samples every layer trains on)" if profile.u_min > 1 else "")
                  + where)
    return 0


@contextlib.contextmanager
def _progress(start: str):
    """A spinner with elapsed time for long work of unknown length; yields a reporter of steps."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(start, total=None)
        yield lambda msg: bar.update(task, description=msg)


def _training_arguments(p: argparse.ArgumentParser) -> None:
    """The training options that are part of a plan: clipping and precision."""
    p.add_argument("--clip-grad-norm", type=float, metavar="X",
                   help="clip the gradient to global 2-norm X before every step, as torch.nn.utils.clip_grad_norm_ "
                        "(the updates wait for the whole gradient: none overlaps the backward)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="device compute: fp32, or bf16 / fp16 under torch.autocast with float32 weights, gradients "
                        "and optimizer state; fp16 also scales the loss and skips overflowing steps as "
                        "torch.amp.GradScaler does (default fp32)")
    p.add_argument("--no-keep-state", action="store_true",
                   help="move every pack's weights and optimizer state in from host memory and out again each "
                        "iteration, even where a device has room to keep them (by default a plan keeps them on the "
                        "device, steps them there and writes them back to host memory when it is read: a checkpoint, "
                        "the end of the run)")
    p.add_argument("--no-gradient-check", action="store_true",
                   help="skip comparing the decomposed layers' output and gradients with eager autograd on the "
                        "example batch before compiling (one forward and backward of a float64 copy on the host); "
                        "without it a model whose tracing loses part of its backward trains with wrong gradients")


def _cmd_compile(ns: argparse.Namespace) -> int:
    from harmony.compiler import CompileOptions, compile_plan

    # what is loaded by now (torch, harmony) lives as long as the process: frozen, the collector's
    # passes during the compile (most of them full ones, with a large model's objects) skip it
    gc.freeze()
    options = CompileOptions(
        minibatch=ns.minibatch, devices=ns.devices, device_memory=ns.device_memory, mode=ns.mode,
        device_type=ns.device, analytic=ns.analytic, compare=not ns.no_compare, trials=ns.trials,
        probe=not ns.no_probe, memory_margin=ns.memory_margin, clip_grad_norm=ns.clip_grad_norm,
        precision=ns.precision, keep_state=not ns.no_keep_state, check_gradients=not ns.no_gradient_check,
        extra={"args": ns.args},
    )
    options.validate()
    mf, model, graph = _load_and_decompose(ns, meta=bool(ns.analytic))
    with _progress("compiling") as report:
        plan, trace = compile_plan(
            model, mf.get_batch, mf.build_optimizer, options, model_file=str(ns.model_file),
            model_sha256=mf.source_hash, graph=graph, on_progress=report, loss_fn=mf.loss_fn,
        )
    with timing.stage("write plan"):
        plan.save(ns.out, trace=trace)
    if ns.gantt:
        from harmony.scheduler.gantt import write_gantt

        write_gantt(ns.out / "gantt.png", plan.events, title=f"{plan.tasks.mode}: {plan.tasks.config}")
    _print_comparison(plan)
    console.print(f"chosen: {plan.tasks.mode} {plan.tasks.config}")
    console.print(f"estimated iteration: {plan.estimate['iteration_time'] * 1e3:.2f} ms{_estimate_range_text(plan)}; "
                  f"wrote {ns.out}/ (plan.msgpack, program.msgpack, trace.json, summary.md)")
    _print_host_memory(plan)
    return 0


def _print_host_memory(plan) -> None:
    """What a run of the plan maps in shared memory, and a warning where this machine has less."""
    from harmony.runtime.hostroom import check_room

    console.print(f"host memory: {plan.host_memory_text()}")
    if kept := plan.kept_text():
        console.print(f"kept on the devices: {kept}")
    try:
        check_room(plan.estimate["host_store_bytes"], "a run of this plan on this machine",
                   private=plan.tasks.parked_bytes())
    except HarmonyError as exc:
        console.print(f"[yellow]warning:[/yellow] {escape(str(exc))}")


def _check_run_args(ns: argparse.Namespace) -> None:
    """Refuse arguments that cannot work before anything is compiled or started."""
    if ns.iters < 1:
        raise HarmonyError(f"--iters must be at least 1, got {ns.iters}")
    if ns.timeout <= 0:
        raise HarmonyError(f"--timeout must be positive, got {ns.timeout}")
    if ns.checkpoint_every is not None:
        if ns.checkpoint_every < 1:
            raise HarmonyError(f"--checkpoint-every must be at least 1, got {ns.checkpoint_every}")
        if ns.checkpoint_dir is None:
            raise HarmonyError("--checkpoint-every needs --checkpoint-dir DIR, the folder to write the checkpoints to")
    if ns.checkpoint_dir is not None and ns.checkpoint_dir.exists() and not ns.checkpoint_dir.is_dir():
        raise HarmonyError(f"--checkpoint-dir {ns.checkpoint_dir} is a file; give a folder")
    if ns.resume == "" and ns.checkpoint_dir is None:
        raise HarmonyError("--resume without a path needs --checkpoint-dir DIR (or give --resume PATH)")
    if ns.resume is not None:
        checkpoint.latest(ns.resume or ns.checkpoint_dir)  # nothing to resume from is refused before compiling


def _seed_everything(seed: int) -> None:
    """Seed the global generators of torch, numpy and Python that a model file's build_model and
    get_batch may draw from (compiling drew from them already)."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _cmd_run(ns: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from harmony.running import Checkpointer, run_report, train
    from harmony.runtime.spmd import under_torchrun
    from harmony.runtime.timeline import run_trace
    from harmony.trainer import Trainer

    _check_run_args(ns)
    if under_torchrun():
        return _cmd_run_spmd(ns)
    plan, mf = _plan_for_run(ns)
    _seed_everything(ns.seed)  # the initial weights and the batches too: two identical runs train identically
    model = mf.build_model()
    if any(p.is_meta for p in model.parameters()):
        raise HarmonyError(f"{mf.path}: build_model() made a model on the meta device; training needs real weights")
    if ns.checkpoint_dir is not None:
        ns.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    guard = getattr(ns, "signal_guard", None)
    saver = ns.checkpointer = Checkpointer(ns.checkpoint_dir, ns.checkpoint_every,
                                           shield=guard.held_back if guard is not None else contextlib.nullcontext)
    with Trainer(plan, optimizer=mf.build_optimizer, loss_fn=mf.loss_fn, state_dict=model.state_dict(),
                 seed=ns.seed, timeout=ns.timeout, p2p=ns.p2p, check_memory=ns.check_memory,
                 lr_scheduler=mf.lr_scheduler, clip_grad_norm=ns.clip_grad_norm) as trainer:
        del model
        if ns.resume is not None:
            path = checkpoint.latest(ns.resume or ns.checkpoint_dir)
            saver.start = trainer.load_checkpoint(path)
            console.print(f"resuming from {path} at step {saver.start}")
        todo = ns.iters - trainer.iteration
        if todo <= 0:
            console.print(f"the checkpoint is at step {trainer.iteration}, --iters {ns.iters} is reached; nothing to train")
            return 0
        columns = (TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as bar:
            job = bar.add_task("train", total=ns.iters, completed=trainer.iteration, stats="")

            def on_step(step: int, loss: float, seconds: float) -> None:
                bar.update(job, advance=1, stats=f"loss {loss:.4f}  {plan.tasks.minibatch / seconds:,.1f} samples/s")

            train(trainer, mf.get_batch, todo, on_step, saver)
        if ns.checkpoint_dir is not None and (saver.last is None or saver.last[1] != trainer.iteration):
            saver.save(trainer)  # the final state too, when the last step was not a multiple of K
        report = run_report(plan, trainer.history, first=saver.start, p2p=trainer.launcher.p2p)
        if ns.checkpoint:
            trainer.save_checkpoint(ns.checkpoint)
    _finish_run(ns, report, run_trace(plan, trainer.history[-1]))
    return 0


def _finish_run(ns: argparse.Namespace, report: dict, trace: dict | None = None) -> None:
    """Write the run report (default: run.json in the plan directory) and, beside it, the last
    iteration's timeline measured and estimated (``run-trace.json``, for Perfetto); print the table."""
    from harmony.running import write_report

    report_path = Path(ns.report or Path(ns.plan_dir) / "run.json")
    write_report(report_path, report)
    written = [str(report_path)]
    if trace is not None:
        trace_path = report_path.with_name(f"{report_path.stem}-trace.json")
        write_report(trace_path, trace)
        written.append(str(trace_path))
    if ns.checkpoint:
        written.append(str(ns.checkpoint))
    _print_run(report)
    console.print(f"wrote {', '.join(written)}")


def _cmd_run_spmd(ns: argparse.Namespace) -> int:
    """``harmony run`` as one rank of a torchrun job: rank 0 compiles (or reuses) the plan, every
    rank loads it and trains its device's tasks; rank 0 reports."""
    import torch.distributed as dist

    from harmony.running import Checkpointer, run_report
    from harmony.runtime.p2p import resolve, start_default_group
    from harmony.runtime.spmd import run_spmd
    from harmony.runtime.timeline import run_trace

    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if world != local and ns.plan is None:
        raise HarmonyError("a run on more than one host needs one plan on every host: compile it once "
                           "(harmony compile MODEL_FILE ... --out DIR), copy DIR to each host, and run with --plan DIR")
    faulthandler.enable()  # a rank that aborts (SIGABRT, SIGSEGV) prints every thread's stack before torchrun reports it
    start_default_group(ns.timeout, init_method="env://")
    rank = dist.get_rank()
    try:
        if rank == 0:
            plan, mf = _plan_for_run(ns)
        dist.barrier()
        if rank != 0:
            with contextlib.redirect_stdout(None):
                plan, mf = _plan_for_run(ns)
        def on_step(step: int, loss: float, seconds: float) -> None:
            if rank == 0:
                console.print(f"iteration {step}: loss {loss:.6f}, {plan.tasks.minibatch / seconds:,.1f} samples/s")

        # every rank reads the checkpoint to resume from (on several hosts, each its own copy of it)
        resume = checkpoint.latest(ns.resume or ns.checkpoint_dir) if ns.resume is not None else None
        saver = None
        if rank == 0 and ns.checkpoint_dir is not None:
            ns.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            saver = ns.checkpointer = Checkpointer(ns.checkpoint_dir, ns.checkpoint_every)
        every = set(range(ns.checkpoint_every, ns.iters + 1, ns.checkpoint_every)) if ns.checkpoint_every else set()
        last = {ns.iters} if ns.checkpoint_dir is not None or ns.checkpoint else set()

        def save(state) -> None:  # rank 0, after a step in ``every | last``, the other ranks waiting
            if saver is not None:
                saver.save(state)
            if ns.checkpoint and state.iteration == ns.iters:
                state.save_checkpoint(ns.checkpoint)

        history = run_spmd(plan, mf.loss_fn, mf.build_optimizer, mf.get_batch, mf.build_model, ns.iters,
                           seed=ns.seed, timeout=ns.timeout, on_step=on_step, p2p=ns.p2p, resume=resume,
                           saves=frozenset(every | last), save=save, check_memory=ns.check_memory,
                           lr_scheduler=mf.lr_scheduler, clip_grad_norm=ns.clip_grad_norm)
        if rank == 0 and not history:
            console.print(f"the checkpoint {resume} is at or past --iters {ns.iters}; nothing to train")
        elif rank == 0:
            # one host: its workers share one clock, so their timelines line up
            trace = run_trace(plan, history[-1]) if world == local else None
            p2p = resolve(ns.p2p, plan.options.get("device_type", "cpu"), local)  # as run_spmd resolved it
            first = ns.iters - len(history)
            _finish_run(ns, run_report(plan, history, first=first, p2p=p2p), trace)
    finally:
        dist.destroy_process_group()
    return 0


def _plan_for_run(ns: argparse.Namespace):
    """The plan to run: --plan DIR as given, or the cached plan for these options, compiled when
    missing or stale."""
    from harmony.compiler import CompileOptions, compile_plan
    from harmony.modelfile import load_model_file, parse_options
    from harmony.plan import Plan, StalePlanError
    from harmony.running import cache_dir

    if ns.plan:
        manifest = _read_manifest(ns.plan)
        model_file = ns.model_file or Path(manifest.get("model_file", ""))
        if not model_file or not Path(model_file).is_file():
            raise HarmonyError(f"the plan in {ns.plan} names model file {str(model_file)!r}, which is not there; "
                               "give the model file: harmony run MODEL_FILE --plan DIR")
        args = ns.args or (manifest.get("options", {}).get("args") or [])
        mf = load_model_file(model_file, parse_options(args))
        plan = Plan.load(ns.plan, model_file=model_file, device="meta")
        ns.plan_dir = ns.plan
        return plan, mf
    if ns.model_file is None:
        raise HarmonyError("give a model file (harmony run MODEL_FILE ...) or a plan (harmony run --plan DIR)")
    mf = load_model_file(ns.model_file, parse_options(ns.args))
    key = {"minibatch": ns.minibatch, "devices": ns.devices, "device_memory": ns.device_memory, "mode": ns.mode,
           "device_type": ns.device, "probe": not ns.no_probe, "args": sorted(ns.args), "depth": ns.depth,
           "modules": ns.modules, "opaque": sorted(ns.opaque), "method": ns.method,
           "memory_margin": ns.memory_margin, "clip_grad_norm": ns.clip_grad_norm, "precision": ns.precision,
           "keep_state": not ns.no_keep_state}
    options = CompileOptions(
        minibatch=ns.minibatch, devices=ns.devices, device_memory=ns.device_memory, mode=ns.mode,
        device_type=ns.device, compare=False, trials=ns.trials, probe=not ns.no_probe,
        memory_margin=ns.memory_margin, clip_grad_norm=ns.clip_grad_norm, precision=ns.precision,
        keep_state=not ns.no_keep_state, check_gradients=not ns.no_gradient_check,
        extra={"args": ns.args, "run_options": key},
    )
    options.validate()
    directory = ns.out or cache_dir(mf.source_hash, key)
    ns.plan_dir = directory
    if (Path(directory) / "manifest.json").is_file():
        try:
            plan = Plan.load(directory, model_file=ns.model_file, device="meta")
            if plan.options.get("run_options") != json.loads(json.dumps(key)):
                raise StalePlanError(f"the plan in {directory} was compiled with other options")
            console.print(f"reusing the plan in {directory} (nothing changed since it was compiled)")
            return plan, mf
        except (StalePlanError, HarmonyError) as exc:
            console.print(f"compiling again: {exc}")
    _, model, graph = _load_and_decompose(ns, meta=False)
    with _progress("compiling") as report:
        plan, trace = compile_plan(model, mf.get_batch, mf.build_optimizer, options, model_file=str(ns.model_file),
                                   model_sha256=mf.source_hash, graph=graph, on_progress=report, loss_fn=mf.loss_fn)
    plan.save(directory, trace=trace)
    console.print(f"compiled {plan.tasks.mode} {plan.tasks.config} into {directory}")
    return plan, mf


def _read_manifest(directory: Path) -> dict:
    from harmony.plan import read_manifest

    return read_manifest(directory)


def _print_run(report: dict) -> None:
    table = Table(title=f"{report['mode']} on {report['devices']} device(s): measured vs estimated")
    for col in ("device", "peak memory", "estimated peak", "capacity", "bytes moved", "planned bytes"):
        table.add_column(col, justify="right")
    for d in report["per_device"]:
        moved = sum(v for k, v in d["bytes_by_channel"].items() if not k.startswith("TARGET"))
        peak = _human_bytes(d["peak_memory"]) + ("" if d.get("peak_memory_measured", True) else " (ledger)")
        table.add_row(str(d["device"]), peak,
                      _human_bytes(d["estimated_peak_memory"]) if d["estimated_peak_memory"] else "-",
                      _human_bytes(d["capacity"]) if d["capacity"] else "-", _human_bytes(moved),
                      _human_bytes(sum(d["planned_bytes_by_channel"].values())))
    console.print(table)
    if not all(d.get("peak_memory_measured", True) for d in report["per_device"]):
        console.print("peak memory (ledger): the plan's reservations, not measured; --check-memory measures it")
    est = report["estimated_iteration_seconds"]
    console.print(
        f"iteration: {report['mean_iteration_seconds'] * 1e3:.1f} ms measured"
        + (f", {est * 1e3:.1f} ms estimated ({report['relative_error']:+.1%})" if est else "")
        + _range_verdict(report)
        + f"; {report['samples_per_second']:,.1f} samples/s; final loss {report['iterations'][-1]['loss']:.6f}"
    )


def _range_verdict(report: dict) -> str:
    """Where the run's mean fell against the plan's stated range, if it stated one."""
    span = report.get("estimated_iteration_range")
    if not span:
        return ""
    where = "within" if report["within_estimated_range"] else "outside"
    return f", {where} its range {span[0] * 1e3:.1f}-{span[1] * 1e3:.1f} ms"


def _estimate_range_text(plan: Plan) -> str:
    """`` (a-b ms on this machine's calibration)`` where the compile measured how much the
    runtime's compute moves here (``Plan.estimate["iteration_time_range"]``), else nothing."""
    span = plan.estimate.get("iteration_time_range")
    if not span:
        return ""
    return f" ({span[0] * 1e3:.2f}-{span[1] * 1e3:.2f} ms at the 10th and 90th percentiles of the calibration's task readings)"


def _print_comparison(plan) -> None:
    table = Table(title=f"Modes on {plan.tasks.devices} device(s), minibatch {plan.tasks.minibatch} (estimated)")
    for col in ("mode", "iteration ms", "samples/s", "swap volume", "peak memory", "configuration"):
        table.add_column(col, justify="left" if col in ("mode", "configuration") else "right")
    for row in plan.comparison:
        t = row["iteration_time"]
        if t is None:
            table.add_row(row["mode"], "-", "-", "-", "-", row["config"])
            continue
        table.add_row(row["mode"], f"{t * 1e3:.2f}", f"{plan.tasks.minibatch / t:,.1f}" if t else "-",
                      _human_bytes(row["swap_bytes"]), _human_bytes(row["peak_memory"]), row["config"])
    table.caption = plan.comparison_note() or None
    console.print(table)


def _cmd_show(ns: argparse.Namespace) -> int:
    from harmony.plan import Plan

    plan = Plan.load(ns.plan_dir)
    console.print(f"{plan.tasks.mode} on {plan.tasks.devices} device(s), minibatch {plan.tasks.minibatch}: {plan.tasks.config}")
    if ns.program:
        _print_program(plan, ns.device)
        return 0
    devices = [ns.device] if ns.device is not None else sorted({t.device for t in plan.tasks})
    for d in devices:
        tasks = plan.tasks.device_tasks(d)
        console.print(f"[bold]{'host' if d < 0 else f'device {d}'}[/] ({len(tasks)} tasks)")
        for t in tasks:
            console.print(f"  {t.id:>4} {t}", highlight=False, soft_wrap=True)
    if kept := plan.kept_text():
        console.print(f"kept on the devices: {kept}")
    console.print(f"activations: {plan.activations_text()}", highlight=False, soft_wrap=True)
    _print_comparison(plan)
    return 0


def _print_program(plan, device: int | None) -> None:
    """The program saved with the plan (``Plan.load`` refused it if it was not its tasks')."""
    console.print(plan.program().text(device), highlight=False, soft_wrap=True)


def _print_profile(profile) -> None:
    u = profile.u_bmax
    table = Table(title=f"Layer profiles at u={u} ({profile.source}, {profile.device})")
    for col in ("#", "layer", "W", "K", "fwd ms", "recompute ms", "bwd ms", "upd ms (dev/host)", "fwd peak", "bwd peak", "X"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for layer in profile.layers:
        table.add_row(
            str(layer.index), layer.name, _human_bytes(layer.w_bytes), _human_bytes(layer.k_bytes),
            f"{1e3 * layer.at('fwd_time', u):.2f}", f"{1e3 * layer.at('recompute_time', u):.2f}",
            f"{1e3 * layer.at('bwd_time', u):.2f}", f"{1e3 * layer.upd_time_device:.2f}/{1e3 * layer.upd_time_host:.2f}",
            _human_bytes(layer.at("fwd_peak", u)), _human_bytes(layer.at("bwd_peak", u)), _human_bytes(layer.at("x_bytes", u)),
        )
    console.print(table)
    errors = ", ".join(f"{k} {100 * v:.1f}%" for k, v in profile.fit_errors().items())
    console.print(f"worst regression error on the samples: {errors}")


def _print_layers(graph, batch_size: int) -> None:
    table = Table(title=f"Layers (tensor sizes at batch size {batch_size})")
    for col, justify in (("#", "right"), ("layer", "left"), ("params", "right"), ("param bytes", "right"),
                         ("input", "left"), ("in bytes", "right"), ("relayed", "right")):
        table.add_column(col, justify=justify)
    for spec in graph.layers:
        params = graph.layer_parameters(spec.index)
        first = graph.values.get(spec.inputs[0]) if spec.inputs else None
        shape = "×".join(map(str, first.shape)) if first is not None and first.kind == "tensor" else "-"
        in_bytes = sum(graph.values[n].nbytes for n in spec.inputs if n in graph.values)
        more = f" +{len(spec.inputs) - 1}" if len(spec.inputs) > 1 else ""
        table.add_row(
            str(spec.index), spec.name, f"{sum(_numel(p.shape) for p in params):,}",
            _human_bytes(sum(p.nbytes for p in params)), shape + more, _human_bytes(in_bytes), str(len(spec.relayed)),
        )
    console.print(table)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _add_decompose_parser(sub: argparse._SubParsersAction) -> None:
    """The ``decompose`` subcommand: cut a model into layers and write their code."""
    p = sub.add_parser(
        "decompose", help="cut a model into layers and generate per-layer code",
        description=(
            "Trace the model from MODEL_FILE (torch.fx, falling back to torch.export), cut it into a chain "
            "of layers, relay tensors that skip layers, and write graph.msgpack plus one Python module per "
            "layer. Prints a table of the layers."
        ),
    )
    _add_model_args(p)
    _add_granularity_args(p)
    p.add_argument("--out", type=Path, help="directory to write graph.msgpack and layers/ into")
    p.add_argument("--batch-size", type=int, default=2, help="batch size of the example inputs (default 2)")
    p.add_argument("--meta", action="store_true", help="build the model on the meta device (no memory; for huge presets)")
    p.set_defaults(func=_cmd_decompose)


def _add_profile_parser(sub: argparse._SubParsersAction) -> None:
    """The ``profile`` subcommand: measure (or estimate) every layer at several microbatch sizes."""
    p = sub.add_parser(
        "profile", help="measure every layer's time and memory across microbatch sizes",
        description=(
            "Decompose the model, find the largest microbatch that fits one device for the forward and the "
            "backward pass (slow-start sweep), measure every layer at a few sizes from 1 to that maximum, "
            "measure the optimizer update, and write profile.msgpack. Prints a per-layer table."
        ),
    )
    _add_model_args(p)
    _add_granularity_args(p)
    _add_device_args(p, what="devices the machine description covers")
    p.add_argument("--minibatch", type=int, default=64,
                   help="minibatch size D: no microbatch is larger, and the default emulated capacity is a quarter of "
                   "the footprint of training D samples on one device (default 64)")
    p.add_argument("--max-microbatch", type=int, help="largest microbatch size worth trying (default: the minibatch)")
    p.add_argument("--samples", type=int, default=4, help="microbatch sizes measured per pass (default 4)")
    p.add_argument("--trials", type=int, default=3, help="timed repetitions per measurement (default 3)")
    p.add_argument("--batch-size", type=int, default=2, help="batch size of the example inputs used for tracing")
    p.add_argument("--no-probe", action="store_true", help="skip measuring the machine's link bandwidths")
    p.add_argument("--analytic", metavar="SPEC",
                   help="estimate instead of measuring, for a device we lack: 1080ti, v100, a100, h100 or a JSON "
                   "file of DeviceSpec fields; the model is built on the meta device")
    p.add_argument("--out", type=Path, help="directory to write graph.msgpack, layers/ and profile.msgpack into")
    p.set_defaults(func=_cmd_profile)


def _add_compile_parser(sub: argparse._SubParsersAction) -> None:
    """The ``compile`` subcommand: decompose, profile and search, writing a plan directory."""
    p = sub.add_parser(
        "compile", help="decompose, profile and search a schedule; write a plan directory",
        description=(
            "Decompose the model, profile its layers (measured on the device, or analytic with --analytic), "
            "search the fastest configuration (U_F, P_F, U_B, P_B) for the mode, and write a plan directory "
            "(plan.msgpack, program.msgpack: the per-device action program, trace.json for Perfetto, summary.md). Prints every mode's estimate for comparison."
        ),
    )
    _add_model_args(p)
    _add_granularity_args(p)
    p.add_argument("--minibatch", type=int, default=64, help="minibatch size D (default 64)")
    _add_device_args(p)
    p.add_argument("--mode", choices=MODES, default="pp",
                   help="pp (wrap-around pipeline), dp (Harmony DP), or a per-GPU-swap baseline (default pp)")
    p.add_argument("--analytic", metavar="SPEC", help="plan for hardware we lack: 1080ti, v100, a100, h100 or a JSON spec")
    p.add_argument("--trials", type=int, default=3, help="timed repetitions per profile measurement (default 3)")
    p.add_argument("--no-compare", action="store_true",
                   help="search only the chosen mode (by default every other mode is searched too, for the "
                        "comparison table; the per-GPU-swap baselines there over fewer pack counts, which is most "
                        "of a compile's time)")
    p.add_argument("--no-probe", action="store_true", help="do not measure link bandwidths (nominal values)")
    p.add_argument("--batch-size", type=int, default=2, help="batch size of the example inputs used for tracing")
    _training_arguments(p)
    p.add_argument("--gantt", action="store_true", help="also draw the simulated timeline as gantt.png (needs matplotlib)")
    p.add_argument("--out", type=Path, required=True, help="plan directory to write")
    p.set_defaults(func=_cmd_compile)


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    """The ``run`` subcommand: train from a given plan or one compiled (and cached) on the way."""
    p = sub.add_parser(
        "run", help="train: compile (or reuse) a plan and run it on the devices",
        description=(
            "Train the model of MODEL_FILE for --iters minibatches with one worker process per device, "
            "following a plan: the one given with --plan, or one compiled from the options below (cached "
            "under .harmony/plans and reused while the model file and options are unchanged). Shows a "
            "progress bar with the loss and samples/s and writes a run report (JSON) with per-iteration "
            "times, bytes per channel and peak memory per device, beside the plan's estimates."
        ),
    )
    p.add_argument("model_file", type=Path, nargs="?", help="Python file defining build_model, loss_fn, get_batch")
    p.add_argument("--arg", dest="args", action="append", default=[], metavar="KEY=VALUE",
                   help="option passed to the model file's functions, e.g. --arg preset=tiny (repeatable)")
    p.add_argument("--plan", type=Path, help="run this plan directory instead of compiling one (its own minibatch, "
                   "devices and mode apply; the compile options below are ignored)")
    _add_granularity_args(p)
    p.add_argument("--minibatch", type=int, default=64, help="minibatch size D (default 64)")
    _add_device_args(p)
    p.add_argument("--mode", choices=MODES, default="pp",
                   help="pp (wrap-around pipeline), dp (Harmony DP), or a per-GPU-swap baseline (default pp)")
    p.add_argument("--iters", type=int, default=10, help="minibatches to train (default 10)")
    _training_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the random streams (dropout) "
                   "(default 0)")
    p.add_argument("--trials", type=int, default=3, help="timed repetitions per profile measurement (default 3)")
    p.add_argument("--no-probe", action="store_true", help="do not measure link bandwidths (nominal values)")
    p.add_argument("--batch-size", type=int, default=2, help="batch size of the example inputs used for tracing")
    p.add_argument("--out", type=Path, help="plan directory to compile into (default: the cache)")
    p.add_argument("--report", type=Path, help="run report to write (default: run.json in the plan directory)")
    p.add_argument("--checkpoint", type=Path, help="save a checkpoint here after the last iteration")
    p.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="save a checkpoint every K iterations (and after the last) into --checkpoint-dir")
    p.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                   help="folder of the checkpoints step-NNNNNN.pt and latest.json, which names the newest complete one; "
                   "the two newest are kept")
    p.add_argument("--resume", nargs="?", const="", metavar="PATH|DIR",
                   help="continue from a checkpoint (a file, or the newest in a folder; default --checkpoint-dir) up to "
                   "--iters iterations in all; the losses are those of a run never stopped")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a worker may wait for another before the run is declared stalled (default 600)")
    p.add_argument("--p2p", choices=("auto", "shm", "dist"), default="auto",
                   help="how activations and gradients travel between devices: shm (through shared host memory), "
                   "dist (torch.distributed send/recv: NCCL between GPUs, gloo between emulated cpu devices) or auto "
                   "(dist on cuda, shm on cpu; the default)")
    p.add_argument("--check-memory", action="store_true", default=None,
                   help="emulated cpu devices count every op against their capacity, raise out-of-memory where it "
                   "happens and report measured peaks (slower: about a fifth on small models). Without it a run "
                   "keeps to the plan's reservations and reports their peak (HARMONY_CHECK_MEMORY=1 turns it on)")
    p.set_defaults(func=_cmd_run)


def _add_show_parser(sub: argparse._SubParsersAction) -> None:
    """The ``show`` subcommand: print a plan's tasks or its lowered program."""
    p = sub.add_parser("show", help="print a plan's tasks per device and its mode comparison",
                       description="Print the tasks of a plan directory, one line each, grouped by device.")
    p.add_argument("plan_dir", type=Path, help="a directory written by harmony compile")
    p.add_argument("--device", type=int, help="only this device (-1: the host)")
    p.add_argument("--program", action="store_true",
                   help="print the lowered action program instead: per device and stream (compute, swap-in, swap-out, "
                        "p2p-in, p2p-out) the actions in order, each send and receive naming its edge e<N>")
    p.set_defaults(func=_cmd_show)


def _add_probe_parser(sub: argparse._SubParsersAction) -> None:
    """The ``probe`` subcommand: measure the machine's link bandwidths."""
    p = sub.add_parser(
        "probe", help="measure the machine's link bandwidths (host<->device, device<->device, contention)",
        description=(
            "Measure host->device and device->host copy bandwidth for one device and for all devices at once "
            "(the contention of a shared host link), device->device (p2p) bandwidth and the fixed cost of a "
            "transfer, on the devices Harmony would use. Emulated cpu devices are worker processes and p2p is "
            "torch.distributed gloo, as in the runtime."
        ),
    )
    _add_device_args(p)
    p.add_argument("--size", default="64MiB", help="bytes per timed transfer (default 64MiB)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions, the median is kept (default 5, as a compile)")
    p.add_argument("--out", type=Path, help="file to write the machine description (msgpack) to")
    p.set_defaults(func=_cmd_probe)


def build_parser() -> argparse.ArgumentParser:
    """The ``harmony`` command line: global options, then one subparser per command, each added by
    its own ``_add_<command>_parser`` so that a command's options read together in one place."""
    parser = argparse.ArgumentParser(
        prog="harmony",
        description=(
            "Train a PyTorch model far larger than GPU memory on one server, as if on a single device. "
            "Harmony cuts the model into layers, profiles them, searches a schedule over your devices "
            "and host memory, and runs it."
        ),
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug); show tracebacks")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_decompose_parser(sub)
    _add_profile_parser(sub)
    _add_compile_parser(sub)
    _add_run_parser(sub)
    _add_show_parser(sub)
    _add_probe_parser(sub)
    return parser


def _cmd_probe(ns: argparse.Namespace) -> int:
    from harmony.runtime.device import parse_bytes
    from harmony.profiling.probe import probe_machine

    if ns.devices < 1:
        raise HarmonyError(f"--devices must be at least 1, got {ns.devices}")
    try:
        capacity = parse_bytes(ns.device_memory) if ns.device_memory else None
        size = parse_bytes(ns.size)
    except ValueError as exc:
        raise HarmonyError(str(exc)) from exc
    with console.status(f"probing {ns.devices} {ns.device} device(s)"):
        machine = probe_machine(ns.device, ns.devices, capacity, size=size, repeats=ns.repeats)
    console.print(machine.describe())
    if ns.out is not None:
        machine.save(ns.out)
        console.print(f"wrote {ns.out}")
    return 0


def _version() -> str:
    from harmony import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(ns.verbose, 2), format="%(levelname)s %(name)s: %(message)s"
    )
    if ns.command is None:
        parser.print_help()
        return 2
    if getattr(ns, "batch_size", 1) is not None and getattr(ns, "batch_size", 1) < 1:
        parser.error("--batch-size must be a positive integer")
    if getattr(ns, "device_defaults", False):
        ns.device = ns.device or default_device()
        if ns.devices is None:
            ns.devices = max(1, visible_gpus()) if ns.device == "cuda" else 2
    try:
        with _signals_raise() as guard:
            ns.signal_guard = guard
            code = ns.func(ns)
        # the interpreter's last collections would walk every object the command leaves (torch, the
        # model, the plan), a noticeable wait at the end of a large compile; everything is closed by now
        gc.freeze()
        return code
    except HarmonyError as exc:
        if ns.verbose:
            console.print_exception()
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        saver = getattr(ns, "checkpointer", None)
        where = f"; {saver.describe()}" if saver is not None else ""
        console.print(f"interrupted by {signal.Signals(signum).name}{where}", highlight=False, soft_wrap=True)
        return 128 + signum


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread so that ``with`` blocks close the trainer (which
    stops and joins every worker) on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _SignalGuard:
    """SIGINT and SIGTERM raise ``Interrupted`` once, in this process only (see ``_signals_raise``),
    except inside ``held_back()``, whose work (writing a checkpoint and moving the pointer to it)
    completes first, so that the message names the checkpoint a resume will really use."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.fired = False
        self.held = 0
        self.pending: int | None = None

    def handle(self, signum: int, frame) -> None:
        if os.getpid() != self.owner:  # a forked worker: behave as if no handler were installed
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.fired:
            log.warning("%s received while shutting down; still stopping the workers", signal.Signals(signum).name)
            return
        self.fired = True
        if self.held:
            self.pending = signum
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def held_back(self):
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            if not self.held and self.pending is not None:
                signum, self.pending = self.pending, None
                raise Interrupted(signum)


@contextlib.contextmanager
def _signals_raise():
    """While a command runs, SIGINT and SIGTERM raise ``Interrupted`` (``_SignalGuard``): a second
    signal during the shutdown is logged and ignored so the workers are still joined, and a process
    forked meanwhile (a worker) keeps the default behaviour. Yields the guard (None off the main
    thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    guard = _SignalGuard()
    previous = {s: signal.signal(s, guard.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield guard
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
