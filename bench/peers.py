"""Harmony ``pp`` vs ``torch.distributed.pipelining`` on 2 CPU processes.

The model is a GPT-2 whose LM head is not tied to the embedding (a tied weight cannot be split
across pipelining's stages) and without dropout, written as a list of layers (embedding, blocks,
head) so that both systems cut it at the same places. Both train with Adam, one thread per
process, minibatch 32; pipelining runs ``ScheduleGPipe`` and ``Schedule1F1B`` (one stage per
process), ``ScheduleLoopedBFS``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``
(two stages per process, looped) and ``ScheduleZBVZeroBubble`` (two per process, V-shaped) over
gloo, with 4 microbatches; Harmony runs its searched configuration, and a second time with the
same 4 microbatches. The plain eager loop on one thread gives the two cores' limit (twice its
rate). Goals: Harmony's pp at least the best schedule's rate, and at least 0.9 of
the two cores' limit. How much of that limit this machine gives any two processes at all is
measured beside: two eager loops at once, each on its half of the minibatch, exchanging nothing.

Beside them, with the same memory to spare, the data parallelism each side has: Harmony's ``dp``
(searched on the same profile) against ``torch.nn.parallel.DistributedDataParallel`` on gloo (each
process half the minibatch, the gradients averaged), the peer a user whose model fits would
otherwise reach for. Pipelining's numbers and pp's ratios do not include them.

Memory: Harmony reports the peak of the device memory its ledger reserves per worker (the plan's
reservations, ``runtime/ledger.py``: weights, gradients, optimizer state and activations resident
on the device; the master copy lives in host memory; the tests hold measured peaks within them). A pipelining process has no such tracker:
its figure is the growth of the process's peak resident set (``ru_maxrss``) from just before its
stages are materialized, which also holds allocator slack and gloo buffers. Like with like would
be tensor bytes on both sides; the RSS figure over-states pipelining's tensors somewhat.

Largest model under one per-process budget: GPT-2 depth is doubled until a system fails. Harmony:
compile with ``device_memory`` = budget and train 2 steps checking memory op by op (fails when no
configuration fits or a worker runs out of memory). Pipelining: train 2 steps and compare the peak RSS growth with the
budget. Depths are bounded so that the search ends in time; ">= N" means it never failed.

    python -m bench.peers [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import math
import os
import queue
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from torch import nn

from bench.common import Model, compiled, free_port, searched, train
from harmony.errors import HarmonyError
from harmony.scheduler.memory import kept_on
from harmony.models import gpt2
from harmony.models.gpt2 import Block, GPTConfig
from harmony.profiling.measure import torch_threads

# every schedule of torch.distributed.pipelining that runs on gloo with one or two stages per process
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleLoopedBFS", "ScheduleInterleaved1F1B",
             "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")
TWO_STAGES = {"ScheduleLoopedBFS", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"}
V_SHAPED = {"ScheduleZBVZeroBubble"}  # rank r holds stages r and 2W-1-r (the others: stages s with s % W == r)
MICROBATCHES = 4
MINIBATCH = 32
DDP = "DistributedDataParallel"  # a Job's ``schedule`` for torch's data parallelism (the peer of Harmony's dp)
PAIR = "independent eager loops"  # a Job's ``schedule``: each process trains alone on its half (no communication)
AMPLE = 1 << 30


def config(depth: int) -> GPTConfig:
    return GPTConfig(n_layer=depth, n_head=4, n_embd=128, vocab_size=512, block_size=64, dropout=0.0)


class Embed(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Head(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class PeerGPT(nn.Module):
    """GPT-2 as a flat list of layers, LM head untied: splittable into pipeline stages."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Embed(c), *(Block(c) for _ in range(c.n_layer)), Head(c)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.layers:
            x = layer(x)
        return x


def peer_model(depth: int) -> Model:
    c = config(depth)
    return Model(f"gpt2-{depth}x128", lambda: PeerGPT(c), gpt2.loss_fn, functools.partial(gpt2.batch_of, c),
                 gpt2.build_optimizer)


# ------------------------------------------------------------------ pipelining
def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of ``parts`` contiguous, nearly equal chunks of ``n`` layers."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> int:
    """Free what can be freed, restart the kernel's peak-RSS counter; the RSS now."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _rss()


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmHWM"))) * 1024


@dataclass(frozen=True)
class Job:
    """``steps`` minibatches of a GPT-2 of ``depth`` blocks under ``schedule``; a job whose ``group``
    already failed (an error, or a peak over ``budget``) is skipped."""

    schedule: str
    depth: int
    steps: int
    group: str = ""
    budget: int | None = None


def _run_whole_model_job(rank: int, world: int, job: Job) -> tuple[list[float], int, int]:
    """``job`` under DistributedDataParallel: the whole model on every process (rank 0's initial
    weights, which DDP broadcasts), each process its share of the minibatch; what ``_run_job``
    returns. As ``PAIR``, each process trains its own copy on its share and nothing is exchanged:
    what two single-threaded processes reach on this machine when neither ever waits for the other,
    the ceiling of every two-process system here (below the two cores' limit where the two cores
    slow each other down)."""
    from torch.nn.parallel import DistributedDataParallel

    model = peer_model(job.depth)
    base = _reset_peak()
    torch.manual_seed(0)
    module = model.build() if job.schedule == PAIR else DistributedDataParallel(model.build())
    opt = model.build_optimizer(module.parameters())
    share = MINIBATCH // world
    times = []
    for step in range(job.steps):
        x, y = model.get_batch(MINIBATCH, step)
        mine = slice(rank * share, (rank + 1) * share)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model.loss_fn(module(x[mine]), y[mine]).backward()  # under DDP the gradients are averaged: the minibatch's mean
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    state = sum(p.numel() * p.element_size() for p in module.parameters()) * 4
    return times, max(_peak_rss() - base, 0), state


def _run_job(rank: int, world: int, job: Job) -> tuple[list[float], int, int]:
    """``job``'s step times (seconds), peak RSS growth and state bytes on this process."""
    from torch.distributed import pipelining

    if job.schedule in (DDP, PAIR):
        return _run_whole_model_job(rank, world, job)
    model = peer_model(job.depth)
    per_rank = 2 if job.schedule in TWO_STAGES else 1
    stages_total = world * per_rank
    with torch.device("meta"):
        layers = list(model.build().layers)
    if job.schedule in V_SHAPED:
        mine = [rank, stages_total - 1 - rank]
    else:
        mine = [s for s in range(stages_total) if s % world == rank]
    base = _reset_peak()
    torch.manual_seed(rank)
    stages, params = [], []
    for s in mine:
        a, b = _chunks(len(layers), stages_total)[s]
        module = nn.Sequential(*layers[a:b]).to_empty(device="cpu")
        for p in module.parameters():
            nn.init.normal_(p, std=0.02)
        params += list(module.parameters())
        stages.append(pipelining.PipelineStage(module, s, stages_total, torch.device("cpu")))
    schedule = getattr(pipelining, job.schedule)(stages if per_rank > 1 else stages[0], MICROBATCHES,
                                                 loss_fn=model.loss_fn)
    opt = model.build_optimizer(params)
    times = []
    for step in range(job.steps):
        x, y = model.get_batch(MINIBATCH, step)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        kwargs = {"target": y, "losses": []} if stages_total - 1 in mine else {}
        schedule.step(*((x,) if 0 in mine else ()), **kwargs)
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    state = sum(p.numel() * p.element_size() for p in params) * 4  # weights, gradients, Adam's two moments
    return times, max(_peak_rss() - base, 0), state


def _worker(rank: int, world: int, jobs: list[Job], port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    failed: set[str] = set()
    try:
        for i, job in enumerate(jobs):
            if job.group and job.group in failed:
                continue
            try:
                times, peak, state = _run_job(rank, world, job)
                error = None
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which prints it
                times, peak, state, error = [], 0, 0, f"{type(exc).__name__}: {exc}"
            # both ranks agree on whether the job failed, to skip the same later jobs
            verdict = torch.tensor([peak, int(error is not None)], dtype=torch.int64)
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
            if job.budget is not None and (verdict[1] or verdict[0] > job.budget):
                failed.add(job.group)
            out.put((i, rank, times, peak, state, error))
    finally:
        out.put(None)
        dist.destroy_process_group()


@dataclass
class PipeRun:
    job: Job
    seconds: float
    samples_per_second: float
    peak_rss: list[int]
    state_bytes: list[int]
    error: str | None = None


MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"  # glibc: allocations of at least this many bytes get their own mapping


@contextlib.contextmanager
def spawn_environment(rss_between_jobs: bool) -> Iterator[None]:
    """The environment the peers' processes start with (a spawned process reads it as it starts):
    the mmap threshold only where asked for (``run_pipelining``), whatever the parent has; the
    parent's own environment as it was afterwards."""
    saved = os.environ.pop(MMAP_THRESHOLD, None)
    if rss_between_jobs:
        os.environ[MMAP_THRESHOLD] = "65536"
    try:
        yield
    finally:
        os.environ.pop(MMAP_THRESHOLD, None)
        if saved is not None:
            os.environ[MMAP_THRESHOLD] = saved


def run_pipelining(jobs: list[Job], timeout: float = 900, rss_between_jobs: bool = False) -> list[PipeRun]:
    """Every job on the same 2 spawned processes (one start-up for all); a job's first step is
    left out of its median. Jobs skipped after their group failed are missing from the answer.

    ``rss_between_jobs``: every allocation of 64 KiB or more gets its own mapping (glibc's
    ``MALLOC_MMAP_THRESHOLD_``), so that a freed tensor leaves the resident set before the next job
    on the same processes and each job's peak RSS growth is its own. That slows training (a mapping
    and its page faults for every activation), so jobs timed for throughput run without it, each in
    processes of their own."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    with spawn_environment(rss_between_jobs):
        procs = [ctx.Process(target=_worker, args=(r, 2, jobs, port, out)) for r in range(2)]
        for p in procs:
            p.start()
    got: dict[int, list] = {}
    finished = 0
    deadline = time.monotonic() + timeout
    while finished < len(procs):
        try:
            item = out.get(timeout=1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                break
            continue
        if item is None:
            finished += 1
        else:
            got.setdefault(item[0], []).append(item)
    for p in procs:
        p.join(timeout=30)
    runs = []
    for i, items in sorted(got.items()):
        job = jobs[i]
        items.sort(key=lambda it: it[1])
        error = next((it[5] for it in items if it[5]), None)
        if error or len(items) < 2:
            runs.append(PipeRun(job, math.nan, math.nan, [], [], error or "a process did not report"))
            continue
        per_step = [max(ts) for ts in zip(*(it[2] for it in items))]
        seconds = statistics.median(per_step[1:] or per_step)
        runs.append(PipeRun(job, seconds, MINIBATCH / seconds, [it[3] for it in items], [it[4] for it in items]))
    return runs


# ------------------------------------------------------------------ comparison
def _harmony_row(label: str, plan, runs: list) -> dict[str, Any]:
    return {"system": label, "samples_per_second": statistics.median(r.samples_per_second for r in runs),
            "peak_per_process": [max(p) for p in zip(*(r.peak for r in runs))],
            "memory_kind": "peak reserved device bytes (ledger)",
            "configuration": str(plan.tasks.config) + (" kept" if kept_on(plan.tasks) else "")}


def _pipelining_row(name: str, runs: list[PipeRun]) -> dict[str, Any]:
    failed = next((r.error for r in runs if r.error), None)
    system = {DDP: "torch DDP (gloo)", PAIR: "two eager loops at once (no communication)"}.get(name, f"pipelining {name}")
    return {"system": system, "error": failed,
            "samples_per_second": math.nan if failed else statistics.median(r.samples_per_second for r in runs),
            "peak_per_process": [] if failed else [max(p) for p in zip(*(r.peak_rss for r in runs))],
            "state_bytes_per_process": [] if failed else runs[0].state_bytes,
            "memory_kind": "peak RSS growth",
            "configuration": f"{MINIBATCH // 2} samples a process" if name in (DDP, PAIR) else f"{MICROBATCHES} microbatches"}


def eager_rate(model: Model, steps: int) -> float:
    """Samples per second of the plain eager loop on one thread (first step left out): twice it is
    what two cores can do at best."""
    torch.manual_seed(0)
    module = model.build().train()
    opt = model.build_optimizer(module.parameters())
    times = []
    with torch_threads(1):
        for step in range(steps):
            x, y = model.get_batch(MINIBATCH, step)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model.loss_fn(module(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    return MINIBATCH / statistics.median(times[1:])


def harmony_fits(depth: int, budget: int) -> tuple[bool, str]:
    """Whether Harmony compiles and trains 2 steps of the model under ``budget`` bytes per device."""
    try:
        plan = compiled(peer_model(depth), MINIBATCH, devices=2, device_memory=budget, samples=2)
        train(plan, iterations=2, check_memory=True)  # a device past its capacity fails the run
        return True, str(plan.tasks.config)
    except (HarmonyError, RuntimeError, TimeoutError) as exc:
        return False, f"{type(exc).__name__}: {exc}"[:300]


def compare(depth: int, steps: int, rounds: int, budget: int, depths: tuple[int, ...],
            harmony_deadline_s: float) -> dict[str, Any]:
    """Throughput and memory per process of every system at ``depth`` (rounds interleave Harmony's
    runs with pipelining's), then the deepest model each trains under ``budget``."""
    model = peer_model(depth)
    base = compiled(model, MINIBATCH, devices=2, device_memory=AMPLE, probe=True)  # as a user compiles: the machine probed
    same_mb, _ = searched(base, "pp", 2, MINIBATCH, sizes=lambda limit: [MINIBATCH // MICROBATCHES])
    data_parallel, _ = searched(base, "dp", 2, MINIBATCH)
    plans = {"harmony pp (searched)": base, f"harmony pp ({MICROBATCHES} microbatches)": same_mb,
             "harmony dp (searched)": data_parallel}
    harmony_runs: dict[str, list] = {label: [] for label in plans}
    pipe_runs: dict[str, list[PipeRun]] = {name: [] for name in (*SCHEDULES, DDP, PAIR)}
    limit_jobs = [Job(name, d, 2, group=name, budget=budget) for name in SCHEDULES for d in depths]
    limits: list[PipeRun] = []
    eager: list[float] = []
    for r in range(rounds):
        eager.append(eager_rate(model, steps))
        for label, plan in plans.items():
            harmony_runs[label].append(train(plan, iterations=steps))
        for name in (*SCHEDULES, DDP, PAIR):  # each in fresh processes: its peak RSS growth is its own
            pipe_runs[name] += run_pipelining([Job(name, depth, steps)])
        if r == rounds - 1:
            limits += run_pipelining(limit_jobs, rss_between_jobs=True)
    rows = [_harmony_row(label, plans[label], runs) for label, runs in harmony_runs.items()]
    rows += [_pipelining_row(name, runs) for name, runs in pipe_runs.items()]
    rate = {r["system"]: r["samples_per_second"] for r in rows}
    peers = [v for k, v in rate.items() if k.startswith("pipelining") and not math.isnan(v)]
    best = max(v for k, v in rate.items() if k.startswith("harmony pp"))

    largest: dict[str, Any] = {}
    for name in SCHEDULES:
        tried = [run for run in limits if run.job.schedule == name]
        ok = [run.job.depth for run in tried if run.error is None and max(run.peak_rss) <= budget]
        largest[f"pipelining {name}"] = {
            "largest": max(ok, default=None), "beyond_range": len(ok) == len(depths),
            "peaks": {run.job.depth: (max(run.peak_rss) if run.peak_rss else None) for run in tried}}
    started, fit, notes = time.perf_counter(), None, {}
    for d in depths:
        if time.perf_counter() - started > harmony_deadline_s:
            notes["stopped"] = f"time bound of {harmony_deadline_s:.0f} s reached before depth {d}"
            break
        ok, note = harmony_fits(d, budget)
        notes[d] = note
        if not ok:
            break
        fit = d
    largest["harmony pp"] = {"largest": fit, "beyond_range": fit == depths[-1], "notes": notes}
    two_cores = 2 * statistics.median(eager)
    dp = rate["harmony dp (searched)"]
    pair = rate["two eager loops at once (no communication)"]
    return {"model": model.name, "minibatch": MINIBATCH, "rows": rows,
            "ratio_to_best_peer": best / max(peers) if peers else math.nan,
            "eager_one_thread": statistics.median(eager), "ratio_to_two_cores": best / two_cores,
            "two_processes": {"ratio_to_two_cores": pair / two_cores, "pp_ratio": best / pair,
                              "dp_ratio": dp / pair},
            "data_parallel": {"ratio_to_ddp": dp / rate["torch DDP (gloo)"], "ratio_to_two_cores": dp / two_cores},
            "budget": budget, "depths": list(depths), "largest": largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args()
    result = compare(4, steps=4, rounds=1 if ns.quick else 2, budget=64 << 20,
                     depths=(2, 4, 8) if ns.quick else (2, 4, 8, 16, 32), harmony_deadline_s=120 if ns.quick else 300)
    Console(width=160).print(result)


if __name__ == "__main__":
    main()
