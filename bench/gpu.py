"""Harmony on one real GPU against the hardware bound and against DeepSpeed ZeRO-Offload.

For each model (GPT-2 large, 774 M parameters; Llama 3.2 1B, 1.24 B) in bf16, minibatch 16 of
1024 tokens, three systems train the same model file one after another, each in its own process:

- ``eager``: plain PyTorch on the uncapped GPU (autocast, the model file's optimizer): the ceiling,
  and the measured training footprint (weights, gradients, optimizer state and the minibatch's
  activations);
- ``harmony``: ``harmony run`` with the device capped at a quarter of that footprint;
- ``deepspeed``: ZeRO-3 with parameters and optimizer state offloaded to the CPU
  (``bench/deepspeed_peer.py``), capped the same way, its CPU Adam where it builds.

Per system: samples/s, achieved TFLOP/s (the model's FLOPs, ``bench/bound.py``), bytes moved
between host and device, and the fraction of the bound (``bound.py``: max of compute at the
measured matmul peak and traffic at the measured pinned-copy rates), both for the bytes the system
moved and for the floor any host-stepped system must move. Harmony's estimate stands beside its
measurement.

    python -m bench.gpu [--cases gpt2-large,llama-1b] [--systems eager,harmony,deepspeed] [--out DIR]
    python -m bench.gpu --dry-run   # no GPU: the bound and Harmony's estimate on a modelled H100

Results accumulate in ``DIR/results.json`` (default ``bench/results/gpu-<device>``) and are written
as ``DIR/README.md`` with the commands that made them, so one case or one system can run per call
of a machine whose commands are limited to minutes. DeepSpeed comes to a machine without network as
carried wheels (``bench/gpu_wheels.sh``); ``bash bench/gpu_check.sh`` installs them and runs one case,
``gpt2-medium`` (GPT-2 medium, 355 M parameters: small enough for its three runs to share one
ten-minute command of a GPU machine with the CUDA tests and a compile of the same model).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import bound as bounds
from harmony.modelfile import load_model_file

log = logging.getLogger("bench.gpu")

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("eager", "harmony", "deepspeed")
WIDTH = 140  # rich's tables at a width that fits them, also when the output is a log file


@dataclass(frozen=True)
class Case:
    """One model file with its options, trained at one minibatch."""

    name: str
    model_file: str
    options: dict[str, Any]
    minibatch: int = 16
    deepspeed_microbatch: int = 4  # halved on out-of-memory, down to 1

    def args(self) -> list[str]:
        return [a for k, v in self.options.items() for a in ("--arg", f"{k}={v}")]


CASES = {c.name: c for c in (
    Case("gpt2-medium", "models/gpt2.py", {"preset": "medium", "dropout": 0.0}),
    Case("gpt2-large", "models/gpt2.py", {"preset": "large", "dropout": 0.0}),
    Case("llama-1b", "models/llama.py", {"preset": "1b", "seq_len": 1024}),
    Case("llama-3b", "models/llama.py", {"preset": "3b", "seq_len": 1024}),
)}
DEFAULT_CASES = ("gpt2-large", "llama-1b")


@dataclass
class Results:
    """What ``results.json`` holds: the hardware figures, and per case its FLOPs, parameters, cap
    and each system's run."""

    hardware: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    cases: dict[str, dict[str, Any]] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> "Results":
        return cls(**json.loads(path.read_text())) if path.exists() else cls()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)


# --- the eager ceiling, run in a child process -------------------------------------------------

def eager_run(case: Case, precision: str, iterations: int) -> dict[str, Any]:
    """Plain PyTorch training on the whole GPU: autocast at ``precision``, float32 weights, the
    model file's optimizer, the minibatch in one step or, where it does not fit even the whole GPU,
    in as few equal microbatches as fit (gradients accumulated, as a user would).

    Its peak allocated bytes give the training footprint the caps divide: the weights, gradients
    and optimizer state held after a step, plus the activations of the whole minibatch (measured
    for one microbatch and scaled by their count where the minibatch was split)."""
    mf = load_model_file(ROOT / case.model_file, case.options)
    torch.manual_seed(0)
    model = mf.build_model().cuda()
    optimizer = mf.build_optimizer(model.parameters())
    micro = case.minibatch
    while True:
        try:
            return _eager_steps(mf, model, optimizer, case.minibatch, micro, precision, iterations)
        except torch.OutOfMemoryError:
            if micro == 1:
                raise
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            micro = _next_divisor(case.minibatch, micro)
            log.info("eager: the minibatch does not fit the GPU at once; %d microbatches of %d",
                     case.minibatch // micro, micro)


def _next_divisor(n: int, below: int) -> int:
    return max(d for d in range(1, below) if n % d == 0)


def _eager_steps(mf, model, optimizer, minibatch: int, micro: int, precision: str, iterations: int) -> dict[str, Any]:
    dtype = bounds.dtype_of(precision)
    seconds, losses, state = [], [], 0
    torch.cuda.reset_peak_memory_stats()
    for step in range(iterations):
        inputs, target = (t.cuda() for t in mf.get_batch(minibatch, step))
        torch.cuda.synchronize()
        start = time.perf_counter()
        total = 0.0
        for x, y in zip(inputs.split(micro), target.split(micro)):
            with torch.autocast("cuda", dtype=dtype, enabled=precision != "fp32"):
                loss = mf.loss_fn(model(x), y) * (x.shape[0] / minibatch)
            loss.backward()
            total += loss.item()
        optimizer.step()
        state = max(state, torch.cuda.memory_allocated())  # weights, gradients, optimizer state
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    kept = seconds[1:] or seconds
    return {"system": "eager", "iteration_s": seconds, "losses": losses, "microbatch": micro,
            "samples_per_s": minibatch / statistics.median(kept), "peak_allocated": peak,
            "peak_reserved": torch.cuda.max_memory_reserved(),
            "footprint": state + (peak - state) * minibatch // micro, "bytes_in": 0, "bytes_out": 0}


# --- the three systems, each in its own process -------------------------------------------------

def _child(command: list[str], timeout: float, out: Path) -> dict[str, Any]:
    """Run one system's command; its result is the JSON it wrote to ``out``, or an error naming
    the command's exit and the end of its output."""
    log.info("running %s", shlex.join(command))
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s", "command": shlex.join(command)}
    if out.exists():  # also after a failure that the child reported (DeepSpeed out of memory: exit 1)
        result = json.loads(out.read_text())
    else:
        tail = (done.stdout + done.stderr).strip().splitlines()[-6:]
        result = {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    result["command"] = shlex.join(command)
    return result


def run_eager(case: Case, args, work: Path) -> dict[str, Any]:
    out = work / f"eager-{case.name}.json"
    out.unlink(missing_ok=True)
    return _child([sys.executable, "-m", "bench.gpu", "--eager-child", case.name, "--precision", args.precision,
                   "--iters", str(args.iters), "--child-out", str(out)], args.timeout, out)


def run_harmony(case: Case, cap: int, args, work: Path) -> dict[str, Any]:
    out = work / f"harmony-{case.name}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "harmony.cli", "run", case.model_file, *case.args(),
               "--device", "cuda", "--devices", "1", "--minibatch", str(case.minibatch),
               "--precision", args.precision, "--device-memory", str(cap), "--iters", str(args.iters),
               "--report", str(out), "--out", str(work / f"plan-{case.name}")]
    result = _child(command, args.timeout, out)
    if "error" in result:
        return result
    moved = result.get("bytes_by_channel", {})
    seconds = [it["seconds"] for it in result["iterations"]]
    return {"system": "harmony", "samples_per_s": case.minibatch / statistics.median(seconds[1:] or seconds),
            "iteration_s": seconds,
            "losses": [it["loss"] for it in result["iterations"]],
            "bytes_in": moved.get("SWAP in", 0), "bytes_out": moved.get("SWAP out", 0),
            "estimated_s": result.get("estimated_iteration_seconds"), "configuration": result.get("configuration"),
            "peak": max((d.get("peak", 0) for d in result.get("per_device", [])), default=0),
            "command": result["command"]}


def run_deepspeed(case: Case, cap: int, args, work: Path) -> dict[str, Any]:
    """ZeRO-3 offload at the same cap; the micro-batch halves on out-of-memory (the minibatch stays,
    through gradient accumulation)."""
    micro = case.deepspeed_microbatch
    while True:
        out = work / f"deepspeed-{case.name}.json"
        out.unlink(missing_ok=True)
        result = _child([sys.executable, "-m", "bench.deepspeed_peer", "--model", case.model_file, *case.args(),
                         "--minibatch", str(case.minibatch), "--microbatch", str(micro),
                         "--device-memory", str(cap), "--iters", str(args.iters), "--precision", args.precision,
                         "--json", str(out)], args.timeout, out)
        if "error" in result and "out of memory" in result["error"].lower() and micro > 1:
            micro //= 2
            continue
        result["system"] = "deepspeed"
        result.setdefault("microbatch", micro)
        return result


# --- the report ----------------------------------------------------------------------------------

def figures(case_result: dict[str, Any], system: str, hardware: bounds.Hardware, precision: str) -> dict[str, Any]:
    """One system's row: rate, TFLOP/s and both fractions of the bound."""
    run = case_result["systems"].get(system, {})
    if "samples_per_s" not in run:
        return {"system": system, "error": run.get("error", "not run")}
    minibatch, flops = case_result["minibatch"], case_result["flops"]
    seconds = minibatch / run["samples_per_s"]
    floor = bounds.bound(flops, *bounds.floor_traffic(case_result["trainable"], precision), hardware)
    row = {"system": system, "samples_per_s": run["samples_per_s"], "tflops": flops / seconds / 1e12,
           "bytes_moved": None, "bound_own": None, "bound_floor": floor.fraction(seconds), "limit": floor.limit}
    if "bytes_in" in run:  # a run whose copies were not counted has no bound of its own
        own = bounds.bound(flops, run["bytes_in"], run["bytes_out"], hardware)
        row.update(bytes_moved=run["bytes_in"] + run["bytes_out"], bound_own=own.fraction(seconds), limit=own.limit)
    if run.get("estimated_s"):
        row["estimate_error"] = run["estimated_s"] / seconds - 1
    return row


def report(results: Results, precision: str) -> str:
    """README.md of the results folder: the hardware, one table per case, the commands."""
    hardware = bounds.Hardware(**results.hardware)
    lines = ["# Harmony on one GPU against the bound and DeepSpeed ZeRO-Offload (`python -m bench.gpu`)", "",
             f"Hardware figures: {bounds.describe(hardware)}.", "",
             f"Machine: {results.machine.get('python')}, torch {results.machine.get('torch')}, "
             f"{results.machine.get('cores')} CPU cores, {results.machine.get('date')}.", ""]
    for name, case in results.cases.items():
        lines += [f"## {name}: {case['params'] / 1e6:.0f} M parameters, minibatch {case['minibatch']}, "
                  f"{precision}, device capped at {case['cap'] / 2**30:.2f} GiB "
                  f"(a quarter of the training footprint measured by eager, {case['footprint'] / 2**30:.2f} GiB)", "",
                  "| system | samples/s | TFLOP/s | bytes moved | of bound (own bytes) | of bound (floor) | vs eager | vs DeepSpeed | estimate error |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        ds = case["systems"].get("deepspeed", {}).get("samples_per_s")
        eager = case["systems"].get("eager", {}).get("samples_per_s")
        for system in SYSTEMS:
            row = figures(case, system, hardware, precision)
            if "error" in row:
                lines.append(f"| {system} | {row['error'][:120]} | | | | | | | |")
                continue
            versus = f"{row['samples_per_s'] / ds:.2f}x" if ds else "-"
            of_eager = f"{row['samples_per_s'] / eager:.2f}" if eager else "-"
            error = f"{row['estimate_error']:+.1%}" if "estimate_error" in row else "-"
            lines.append(f"| {system} | {row['samples_per_s']:.2f} | {row['tflops']:.1f} | "
                         f"{_gb(row['bytes_moved'])} | {_fraction(row['bound_own'])} | {row['bound_floor']:.2f} | "
                         f"{of_eager} | {versus} | {error} |")
        lines.append("")
        for system in SYSTEMS:
            command = case["systems"].get(system, {}).get("command")
            if command:
                lines.append(f"- {system}: `{command}`")
        lines.append("")
    lines += ["`of bound`: the bound's time over the measured iteration (1.00: at the hardware's limit; the "
              "bound counts the model's FLOPs at the measured matmul peak, so the memory-bound operations "
              "(norms, activations, residual sums) keep even eager below 1). `vs eager`: "
              "samples/s over eager's on the uncapped GPU, the part of the gap an offloading system "
              "controls.", "", "Commands of this folder:", ""] + [f"- `{c}`" for c in results.commands] + [""]
    return "\n".join(lines)


def _gb(nbytes: int | None) -> str:
    return "not counted" if nbytes is None else f"{nbytes / 1e9:.2f} GB"


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(results: Results, precision: str) -> None:
    hardware = bounds.Hardware(**results.hardware)
    table = Table(title=bounds.describe(hardware))
    for column in ("case", "system", "samples/s", "TFLOP/s", "moved", "of bound", "of floor bound"):
        table.add_column(column, justify="right" if column not in ("case", "system") else "left")
    for name, case in results.cases.items():
        for system in SYSTEMS:
            row = figures(case, system, hardware, precision)
            if "error" in row:
                table.add_row(name, system, row["error"][:60], "", "", "", "")
            else:
                table.add_row(name, system, f"{row['samples_per_s']:.2f}", f"{row['tflops']:.1f}",
                              _gb(row["bytes_moved"]), _fraction(row["bound_own"]), f"{row['bound_floor']:.2f}")
    Console(width=WIDTH).print(table)


# --- without a GPU: the bound and Harmony's estimate on a modelled device -----------------------------

def dry_run(cases: list[Case], precision: str, spec: str) -> list[dict[str, Any]]:
    """Per case, on a modelled ``spec`` device: the FLOPs, the analytic training footprint and its
    quarter, Harmony's searched pp plan at that cap (estimate and swap bytes), and the fractions of
    the bound the estimate stands for. What a GPU run will be compared with."""
    import harmony
    from harmony.compiler import CompileOptions, profile_graph
    from harmony.scheduler.devicespec import load_spec
    from harmony.scheduler.search import search

    hardware = bounds.spec_hardware(spec, precision)
    efficiency = load_spec(spec).efficiency
    rows = []
    for case in cases:
        mf = load_model_file(ROOT / case.model_file, case.options)
        flops, params, trainable = bounds.training_flops(mf, case.minibatch)
        with torch.device("meta"):
            model = mf.build_model()
        graph = harmony.decompose(model, mf.get_batch(1, 0)[0])

        def profiled(device_memory: int | None):
            """The analytic profile and machine ``harmony compile --analytic`` plans with."""
            options = CompileOptions(minibatch=case.minibatch, devices=1, device_memory=device_memory,
                                     analytic=spec, precision=precision, compare=False, probe=False)
            return profile_graph(graph, mf.get_batch, mf.build_optimizer, options)

        uncapped, _ = profiled(None)
        footprint = analytic_footprint(uncapped, case.minibatch)
        cap = footprint // 4
        profile, machine = profiled(cap)
        result = search(profile, machine, "pp", 1, case.minibatch)
        moved = result.estimate.bytes_by_channel
        bytes_in, bytes_out = moved.get("SWAP in", 0), moved.get("SWAP out", 0)
        seconds = result.estimate.iteration_time
        eager_s = sum(layer.at("fwd_time", case.minibatch) + layer.at("bwd_time", case.minibatch)
                      + layer.upd_time_device for layer in uncapped.layers)
        own = bounds.bound(flops, bytes_in, bytes_out, hardware)
        floor = bounds.bound(flops, *bounds.floor_traffic(trainable, precision), hardware)
        busy = plan_resources(result, profile, machine.compute_scale)
        rows.append({"case": case.name, "params": params, "flops": flops, "footprint": footprint, "cap": cap,
                     "configuration": _configuration_text(result), "estimated_s": seconds, "eager_s": eager_s,
                     "samples_per_s": case.minibatch / seconds, "bytes_in": bytes_in, "bytes_out": bytes_out,
                     "bound_s": own.seconds, "bound_own": own.fraction(seconds), "flop_bound_s": own.compute_s,
                     "floor_s": floor.seconds, "bound_floor": floor.fraction(seconds), "limit": own.limit,
                     "busy": busy, "binds": binding_resource(busy), "efficiency": efficiency})
    return rows


def _configuration_text(result) -> str:
    """The searched configuration, and the layers whose state the plan keeps (and steps) on the device."""
    from harmony.scheduler.memory import kept_on

    kept = sorted(kept_on(result.graph).get(0, ()))
    return str(result.config) + (f"; state kept and stepped on the device: layers {_spans(kept)}" if kept else "")


def _spans(layers: list[int]) -> str:
    """Sorted layer indices as runs: [0, 1, 2, 5] -> "L0-2 L5"."""
    from harmony.scheduler.tasks import packs_text

    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return packs_text(runs)


def plan_resources(result, profile, compute_scale: float) -> dict[str, float]:
    """Seconds each resource is busy in the plan's estimate: the device's compute stream (with, on its
    own, the forward its backward tasks recompute), the host link (the busier direction of the
    device's swaps) and the host's optimizer step, none of which the iteration can be shorter than;
    and how long the device's compute waits in the iteration (for its first state, for the host's
    last steps)."""
    from harmony.scheduler.tasks import HOST, Kind

    device = result.estimate.busy.get(0, {})
    recompute = compute_scale * sum(profile.pack_time(t.first, t.last, u, "recompute_time")
                                    for t in result.graph.tasks if t.kind == Kind.BWD and not t.loss
                                    for u in t.microbatches)
    compute = device.get("compute", 0.0)
    return {"compute": compute, "recompute": recompute,
            "host link": max(device.get("swap-in", 0.0), device.get("swap-out", 0.0)),
            "host step": result.estimate.busy.get(HOST, {}).get("compute", 0.0),
            "device waits": result.estimate.iteration_time - compute}


def binding_resource(busy: dict[str, float]) -> str:
    """The resource that binds the plan: the busiest of compute, the host link and the host step;
    ``recompute`` where compute binds only through what it recomputes (without it, another resource
    would be the busiest)."""
    resources = {name: busy[name] for name in ("compute", "host link", "host step")}
    busiest = max(resources, key=resources.get)
    others = max(v for name, v in resources.items() if name != busiest)
    if busiest == "compute" and busy["compute"] - busy["recompute"] < others:
        return "recompute"
    return busiest


def analytic_footprint(profile, minibatch: int) -> int:
    """Bytes to train on one device without recompute, from an analytic profile: weights, their
    gradients and optimizer state, and every layer's saved activations for the whole minibatch (the
    analytic counterpart of ``training_footprint``, which runs the layers)."""
    state = sum(layer.w_bytes + layer.dw_bytes + layer.k_bytes for layer in profile.layers)
    activations = sum(layer.at("act_bytes", minibatch) for layer in profile.layers)
    return int(state + activations)


def print_dry_run(rows: list[dict[str, Any]], hardware: bounds.Hardware) -> None:
    table = Table(title=f"estimated, no GPU: {bounds.describe(hardware)}")
    for column in ("case", "footprint", "cap", "eager s", "eager of FLOP bound", "Harmony s/iter", "GB moved", "bound s",
                   "of bound", "floor s", "of floor", "binds"):
        table.add_column(column, justify="left" if column in ("case", "binds") else "right")
    for r in rows:
        table.add_row(r["case"], f"{r['footprint'] / 2**30:.1f} GiB", f"{r['cap'] / 2**30:.2f} GiB",
                      f"{r['eager_s']:.3f}", f"{r['flop_bound_s'] / r['eager_s']:.2f}", f"{r['estimated_s']:.3f}",
                      f"{(r['bytes_in'] + r['bytes_out']) / 1e9:.2f}", f"{r['bound_s']:.3f}", f"{r['bound_own']:.2f}",
                      f"{r['floor_s']:.3f}", f"{r['bound_floor']:.2f}", r["binds"])
    console = Console(width=WIDTH)
    console.print(table)
    for r in rows:
        console.print(f"{r['case']}: {r['configuration']}, the bound limited by {r['limit']}; the plan busy "
                      f"(s): {_busy_text(r['busy'])}")


def _busy_text(busy: dict[str, float]) -> str:
    return (f"compute {busy['compute']:.3f} (recompute {busy['recompute']:.3f}), host link {busy['host link']:.3f}, "
            f"host step {busy['host step']:.3f}; device waits {busy['device waits']:.3f}")


def dry_run_report(rows: list[dict[str, Any]], hardware: bounds.Hardware, command: str, made: str = "") -> str:
    """README.md of a dry run: what the GPU run will be compared with; ``made``: when and with what
    torch (whose kernels and FLOP counter the estimate follows)."""
    efficiency = rows[0]["efficiency"] if rows else 1.0
    lines = ["# Harmony's estimate against the bound on a modelled GPU (`python -m bench.gpu --dry-run`)", "",
             f"No GPU: {bounds.describe(hardware)}. Footprint: weights, gradients, Adam's state and the "
             "minibatch's activations from the analytic profile; the device is capped at a quarter of it. "
             "Harmony's figures are its estimator's, for the pp plan its search picks on one modelled "
             "device; nothing here was measured.", "",
             "`eager s` is the same analytic profile's forward, backward and device step of every layer at the "
             "whole minibatch on an uncapped device: where the per-operation roofline puts plain PyTorch, "
             "with attention counted as the GPU's fused kernel (FlashAttention for bf16: 4·b·h·s²·d FLOPs "
             "forward, 2.5 times that backward, no s² scores kept; a causal one takes the time of the tiles it "
             "computes, 9/16 of them at 1,024 tokens, while the bound counts its FLOPs whole). Every kernel "
             "runs at the spec's "
             f"efficiency ({efficiency:g} of the peak) or its memory bandwidth, so even eager reaches about "
             f"{efficiency:g} of the FLOP bound at most, which counts the model's FLOPs at the full peak; below that, eager loses the "
             "operations bound by memory bandwidth (autocast's casts, the float32 residual sums, norms and "
             "activations) and the flash backward's recomputed scores (2.5 times the forward's FLOPs where "
             "the bound counts 2).", "",
             "`busy s` is what Harmony's estimate keeps each resource busy: the device's compute (and, of "
             "it, the forward the backward tasks recompute), the host link (the busier direction), the "
             "host's optimizer step; and how long the device's compute waits in the iteration. `binds` "
             "names the busiest resource; `recompute` where compute is the busiest only through its "
             "recompute. `bound s` is the FLOP bound, or the plan's own host traffic at the link's rates "
             "where that takes longer; `floor bound s` the same with the least traffic an offloading plan "
             "can move (``bounds.floor_traffic``). Eager moves nothing, so its fraction is of the FLOP "
             "bound alone.", "",
             "| case | parameters | footprint | cap | eager s (estimated) | eager of FLOP bound | Harmony s/iter (estimated) | swapped | bound s | of bound | floor bound s | of floor | busy s | binds | configuration |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['params'] / 1e6:.0f} M | {r['footprint'] / 2**30:.1f} GiB | "
                     f"{r['cap'] / 2**30:.2f} GiB | {r['eager_s']:.3f} | {r['flop_bound_s'] / r['eager_s']:.2f} | "
                     f"{r['estimated_s']:.3f} | "
                     f"{(r['bytes_in'] + r['bytes_out']) / 1e9:.2f} GB | {r['bound_s']:.3f} | {r['bound_own']:.2f} | "
                     f"{r['floor_s']:.3f} | {r['bound_floor']:.2f} | {_busy_text(r['busy'])} | {r['binds']} | "
                     f"{r['configuration']} |")
    return "\n".join(lines + [""] + ([f"Estimated {made}.", ""] if made else []) + [f"Command: `{command}`", ""])


# --- the command ----------------------------------------------------------------------------------

def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def measure(args) -> None:
    """Run the chosen systems on the chosen cases and fold them into the results folder."""
    from bench.common import machine_info

    cases = [CASES[name] for name in args.cases]
    hardware = bounds.measure_hardware(args.precision)
    torch.cuda.empty_cache()  # the systems run in child processes: leave them the whole GPU
    out = Path(args.out or ROOT / "bench" / "results" / f"gpu-{_slug(hardware.name)}")
    work = Path(os.environ.get("OUT", out)) / "work"
    work.mkdir(parents=True, exist_ok=True)
    results = Results.load(out / "results.json")
    results.hardware, results.machine = asdict(hardware), machine_info()
    results.commands = list(dict.fromkeys([*results.commands, shlex.join(["python", "-m", "bench.gpu", *sys.argv[1:]])]))
    for case in cases:
        mf = load_model_file(ROOT / case.model_file, case.options)
        flops, params, trainable = bounds.training_flops(mf, case.minibatch)
        entry = results.cases.setdefault(case.name, {"systems": {}})
        entry.update(flops=flops, params=params, trainable=trainable, minibatch=case.minibatch)
        if "eager" in args.systems or "footprint" not in entry:
            entry["systems"]["eager"] = run_eager(case, args, work)
            if "peak_allocated" not in entry["systems"]["eager"]:
                raise SystemExit(f"{case.name}: the eager run failed, so there is no footprint to cap at: "
                                 f"{entry['systems']['eager'].get('error')}")
            entry["footprint"] = entry["systems"]["eager"]["footprint"]
        entry["cap"] = args.device_memory or entry["footprint"] // 4
        _checkpoint(results, out, args.precision)
        if "harmony" in args.systems:
            entry["systems"]["harmony"] = run_harmony(case, entry["cap"], args, work)
            _checkpoint(results, out, args.precision)
        if "deepspeed" in args.systems:
            entry["systems"]["deepspeed"] = run_deepspeed(case, entry["cap"], args, work)
            _checkpoint(results, out, args.precision)
    print_table(results, args.precision)


def _checkpoint(results: Results, out: Path, precision: str) -> None:
    """results.json and README.md written after each system's run, so that a call stopped from
    outside (a machine's command limit) keeps the runs that finished."""
    results.save(out / "results.json")
    (out / "README.md").write_text(report(results, precision))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(DEFAULT_CASES),
                        help=f"comma-separated, of {', '.join(CASES)} (default {','.join(DEFAULT_CASES)})")
    parser.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS),
                        help="comma-separated, of eager, harmony, deepspeed (default all); eager runs anyway "
                             "when a case has no footprint yet")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="compute precision of every system (default bf16: autocast, float32 masters)")
    parser.add_argument("--iters", type=int, default=6, help="iterations per run, the first left out (default 6)")
    parser.add_argument("--device-memory", type=int, help="cap in bytes, instead of a quarter of the training footprint eager measured")
    parser.add_argument("--timeout", type=float, default=540, help="seconds per system's run (default 540)")
    parser.add_argument("--out", help="results folder (default bench/results/gpu-<device>; a dry run writes one "
                                      "only when given)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: the bound and Harmony's estimate on a modelled device (--spec)")
    parser.add_argument("--spec", default="h100", help="device spec for --dry-run (default h100)")
    parser.add_argument("--eager-child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    unknown = [c for c in args.cases if c not in CASES] + [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown case or system: {', '.join(unknown)}")
    if args.eager_child:
        Path(args.child_out).write_text(json.dumps(eager_run(CASES[args.eager_child], args.precision, args.iters)))
        return
    if args.dry_run:
        hardware = bounds.spec_hardware(args.spec, args.precision)
        rows = dry_run([CASES[c] for c in args.cases], args.precision, args.spec)
        print_dry_run(rows, hardware)
        if args.out:
            from bench.common import machine_info

            Path(args.out).mkdir(parents=True, exist_ok=True)
            command = shlex.join(["python", "-m", "bench.gpu", *(argv if argv is not None else sys.argv[1:])])
            info = machine_info()
            made = f"{info['date']} with torch {info['torch']}"
            (Path(args.out) / "README.md").write_text(dry_run_report(rows, hardware, command, made))
            (Path(args.out) / "results.json").write_text(json.dumps({"hardware": asdict(hardware), "cases": rows}, indent=1))
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu measures on a CUDA GPU and none is visible here; "
                         "`python -m bench.gpu --dry-run` gives the bound and Harmony's estimate on a modelled one")
    measure(args)


if __name__ == "__main__":
    main()
