"""Measure the machine: how fast bytes really move between host and devices, between devices and
between worker processes, alone and with every device copying at once (docs/architecture.md, "Devices").

``probe_machine`` returns a :class:`~harmony.scheduler.machine.Machine` with ``source="measured"``.
Every bandwidth is ``size / median(seconds)`` over ``repeats`` timed transfers after one untimed
warm-up (first-touch page faults and allocator growth are not part of a steady-state swap).

``cpu`` (emulated devices). In the runtime each emulated device is a worker *process*, so the probe
measures in worker processes too (``torch.multiprocessing``, spawn context), with the CPU threads
split evenly between the device workers (``cpu_count // devices`` torch threads each):

- ``h2d`` / ``d2h``: worker 0 alone, a ``size``-byte tensor copied into a block that exists
  already, on the device a run uses by default (``UncheckedCpuDevice``, no ``--check-memory``): a
  swap-out writes into the host store, and a swap in clones into blocks the allocator reuses (a
  state tensor is far smaller than ``size``). Timed as fresh clones on the memory tracker's
  ``CpuDevice``, each clone would map and fault in new pages and run several times slower than the
  runtime's copies, and every update waiting on swaps would be estimated far above its run;
- ``h2d_all`` / ``d2h_all``: all ``devices`` workers released together by a barrier, each copying
  ``size`` bytes; aggregate = ``devices * size`` over the overlap window, from the earliest start to
  the latest end. Start and end stamps are ``time.perf_counter``, which is the system-wide monotonic
  clock on Linux and macOS, so stamps of different processes compare;
- ``d2d`` and ``msg``: workers 0 and 1 time the runtime's own p2p path (``runtime/channels.py``:
  a copy into the pair's shared-memory slab, its place through a ``torch.multiprocessing`` queue,
  a copy into the receiver's device), ``size`` bytes one way. On CPU device memory is host memory,
  so the two are the same number: ``d2d == msg``. Two workers are started for it even when
  ``devices == 1``;
- ``latency``: the median of tiny (1 KiB) ``to_device`` copies issued on a stream thread and
  awaited, the fixed cost of a swap as the runtime makes one;
  ``p2p_latency``: half a tiny round trip on the p2p path, the fixed cost of one message, which is
  far larger; ``host_link_shared`` is True: one memory bus serves every worker.

The runtime's own costs (``runtime=True``, ``cpu`` only; ``harmony.profiling.overheads``): the real
launcher runs near-zero compute to give ``task_overhead``, ``microbatch_overhead``,
``update_overhead``, ``tensor_overhead`` (per state tensor moved) and the per-message cost of its p2p path (``p2p_latency`` becomes the larger of
that and the half round trip above), and a fixed loop in more processes than devices gives
``cpu_cores``, the cores the devices' compute shares; data parallelism over transformer blocks on the
real launcher, on one device and on all, gives ``compute_scale`` and ``compute_interference``, how
much slower the runtime computes than the profile alone and beside the other devices.

``cuda``: in this process, with pinned host buffers: ``h2d``/``d2h`` on device 0 alone;
``h2d_all``/``d2h_all`` issue one non-blocking copy per device back to back and wait for all;
``d2d`` is ``tensor.to(other_device)`` from device 0 to 1 (with one device it is not measurable and
set to the host-staged rate ``1 / (1/d2h + 1/h2d)``, said in ``notes``); ``msg`` and
``p2p_latency`` come from the queue path above between two CPU worker processes; ``latency`` the median of 1 KiB pinned ``h2d`` copies.
``host_link_shared`` is True by default: whether GPUs share a PCIe switch is not visible from
PyTorch, and the measured ``h2d_all`` already says how much they contend (for separate links it is
about ``devices * h2d``, and ``min(h2d, h2d_all / k)`` then equals ``h2d``).

Every process the probe starts is joined, or terminated and killed, before it returns or raises;
a worker that makes no progress for ``timeout`` seconds raises a ``HarmonyError`` naming the worker
and the step it hung in.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import queue as queue_module
import statistics
import sys
import time
import traceback
from typing import Any

import torch

from harmony.errors import HarmonyError
from harmony.scheduler.machine import Machine

from harmony.runtime import processes
from harmony.runtime.device import CpuDevice, UncheckedCpuDevice, make_devices
from harmony.runtime.streams import SWITCH_INTERVAL, Stream

log = logging.getLogger(__name__)

__all__ = ["probe_machine", "ProbeError", "DEFAULT_SIZE", "DEFAULT_TIMEOUT"]

MiB = 1 << 20
DEFAULT_SIZE = 64 * MiB
DEFAULT_TIMEOUT = 60.0
TINY = 1024  # bytes of the transfers that measure the fixed cost
_TINY_REPEATS = 21
_WARM_UPS = 3  # untimed copies each way first (the blocks' pages faulted in, the caches warm)

# What a worker is doing, by index in a shared array, so a hang can be named.
_STEPS = ("starting (importing torch)", "allocating buffers", "timing one device alone",
          "timing all devices at once", "timing p2p through shared memory", "done")


class ProbeError(HarmonyError):
    """The bandwidth probe could not measure: a worker failed or hung, or the machine is not usable."""


# ------------------------------------------------------------------ helpers
def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _rate(nbytes: float, seconds: float) -> float:
    """Bytes per second, never infinite: a copy too quick for the clock counts as one clock tick."""
    return nbytes / max(seconds, 1e-9)


def _host_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """``nbytes`` of host memory, written once so its pages exist before anything is timed."""
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    t.fill_(1)
    return t


def _threads(copiers: int) -> int:
    """Torch threads of each of ``copiers`` device workers: the CPUs split evenly between them."""
    return max(1, (os.cpu_count() or 1) // max(1, copiers))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


# ------------------------------------------------------------------ worker process
def _worker(rank: int, nprocs: int, copiers: int, size: int, capacity: int | None, repeats: int,
            links: Any, timeout: float, barrier: Any, steps: Any, results: Any) -> None:
    """One probe worker. Ranks below ``copiers`` emulate devices and time copies; ranks 0 and 1 then
    time the p2p path. Puts ``(rank, "ok", dict)`` or ``(rank, "error", traceback)`` on ``results``."""
    def step(name: str) -> None:
        steps[rank] = _STEPS.index(name)

    try:
        copying = rank < copiers
        torch.set_num_threads(_threads(copiers) if copying else 1)
        sys.setswitchinterval(SWITCH_INTERVAL)  # as in the runtime's workers
        out: dict[str, Any] = {}
        step("allocating buffers")
        if copying:
            dev = UncheckedCpuDevice(f"cpu{rank}", capacity)  # as a run copies (module docs)
            host, host_out = _host_buffer(size), _host_buffer(size)
            tiny = _host_buffer(TINY)
            resident = dev.to_device(host)  # the device-resident tensor swapped out below
            incoming = dev.to_device(host)  # the device block a swap in fills (module docs)
            for _ in range(_WARM_UPS):
                incoming.copy_(host)
                host_out.copy_(resident)
        barrier.wait(timeout)

        step("timing one device alone")
        if rank == 0 and copying:
            h2d, d2h, lat = [], [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                incoming.copy_(host)
                h2d.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                host_out.copy_(resident)
                d2h.append(time.perf_counter() - t0)
            # the fixed cost of a swap as the runtime makes it: a tiny copy issued on a stream
            # thread and awaited by the compute thread (the hand-over between threads included)
            stream = Stream("probe-swap-in", dev.memory_scope)
            try:
                for _ in range(_TINY_REPEATS):
                    t0 = time.perf_counter()
                    y = stream.submit(dev.to_device, tiny).result()
                    lat.append(time.perf_counter() - t0)
                    del y
            finally:
                stream.close()
            out.update(h2d=h2d, d2h=d2h, latency=lat)
        barrier.wait(timeout)

        step("timing all devices at once")
        h2d_spans, d2h_spans = [], []
        for _ in range(repeats):
            barrier.wait(timeout)
            if copying:
                t0 = time.perf_counter()
                incoming.copy_(host)
                h2d_spans.append((t0, time.perf_counter()))
            barrier.wait(timeout)
            if copying:
                t0 = time.perf_counter()
                host_out.copy_(resident)
                d2h_spans.append((t0, time.perf_counter()))
        out.update(h2d_spans=h2d_spans, d2h_spans=d2h_spans)
        if copying:
            del resident, incoming, host, host_out

        if rank < 2:
            out.update(_queue_pair(rank, size, repeats, timeout, links, step))
        step("done")
        results.put((rank, "ok", out))
    except BaseException:  # report, then let the process end; the parent raises
        results.put((rank, "error", traceback.format_exc()))


def _queue_pair(rank: int, size: int, repeats: int, timeout: float, links: Any, step: Any) -> dict[str, Any]:
    """Ranks 0 and 1 time the CPU runtime's own p2p path (``runtime/channels.py``): the sender copies
    a device tensor into the shared-memory slab of the pair and puts its place on the receiver's
    queue, the receiver copies it into its device memory and acknowledges. ``size`` bytes one way
    (minus half a tiny round trip), and tiny round trips for the fixed cost of one message."""
    step("timing p2p through shared memory")
    outbox, inbox, slabs = (links[0], links[1], links[2]) if rank == 0 else (links[1], links[0], links[2])
    dev = UncheckedCpuDevice(f"p2p{rank}", None)
    peer = 1 - rank

    def send(t: torch.Tensor) -> None:
        slabs.reset()  # one message in flight at a time
        outbox.put(slabs.encode([t], rank, peer))

    def receive() -> None:
        dev.to_device(slabs.decode(inbox.get(timeout=timeout), peer, rank)[0])

    def round_trip(t: torch.Tensor, back: torch.Tensor | None = None) -> float:
        """``t`` from rank 0 to rank 1 and ``back`` (default ``t``) the other way."""
        t0 = time.perf_counter()
        if rank == 0:
            send(t)
            receive()
        else:
            receive()
            send(t if back is None else back)
        return time.perf_counter() - t0

    big = dev.to_device(_host_buffer(size))
    tiny = dev.to_device(_host_buffer(TINY))
    round_trip(tiny)  # warm-up: queue feeder threads, first touch of the slabs
    tiny_trips = [round_trip(tiny) for _ in range(_TINY_REPEATS)]
    # the big message one way, the tiny one back: subtract half a round trip
    one_way = [round_trip(big, back=tiny) for _ in range(repeats)]
    half = _median(tiny_trips) / 2
    if rank == 0:
        return {"p2p": [max(t - half, 1e-9) for t in one_way], "p2p_latency": half}
    return {}


def _run_workers(copiers: int, size: int, capacity: int | None, repeats: int, timeout: float) -> dict[int, dict]:
    """Start ``max(copiers, 2)`` spawned workers, collect their results, and always reap them.
    ``timeout`` bounds each wait for progress (a result or a step change), so a slow but moving
    probe finishes and a stuck one is named."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    nprocs = max(copiers, 2)
    barrier = ctx.Barrier(nprocs)
    steps = ctx.Array("i", nprocs)
    results = ctx.Queue()
    from harmony.runtime.channels import Slabs

    # rank 0 -> 1 and 1 -> 0 queues, and the pair's slabs: the runtime's p2p path
    links = (ctx.Queue(), ctx.Queue(), Slabs({(0, 1): size + 4096, (1, 0): size + 4096}))
    procs = [
        ctx.Process(target=_worker, name=f"harmony-probe-{rank}", daemon=True,
                    args=(rank, nprocs, copiers, size, capacity, repeats, links, timeout, barrier, steps, results))
        for rank in range(nprocs)
    ]
    out: dict[int, dict] = {}
    try:
        processes.start(procs)
        last_progress = time.monotonic()
        last_steps = list(steps[:])
        while len(out) < nprocs:
            try:
                rank, status, body = results.get(timeout=0.2)
            except queue_module.Empty:
                now_steps = list(steps[:])
                if now_steps != last_steps:
                    last_steps, last_progress = now_steps, time.monotonic()
                for rank, p in enumerate(procs):
                    if rank not in out and not p.is_alive():
                        # it may have put its result just before exiting: look once more
                        try:
                            got = results.get(timeout=1.0)
                        except queue_module.Empty:
                            raise ProbeError(
                                f"bandwidth probe: worker {rank} died (exit code {p.exitcode}) while "
                                f"{_STEPS[steps[rank]]}"
                            ) from None
                        _accept(got, out)
                        break
                if time.monotonic() - last_progress > timeout:
                    stuck = [r for r in range(nprocs) if r not in out]
                    where = ", ".join(f"worker {r} {_STEPS[steps[r]]}" for r in stuck)
                    raise ProbeError(
                        f"bandwidth probe hung for {timeout:g} s with no progress ({where}); "
                        "another process may hold the CPUs"
                    )
                continue
            _accept((rank, status, body), out)
        return out
    finally:
        for p in procs:
            if p.pid is None:
                continue  # never started
            p.join(timeout=5.0 if len(out) == nprocs else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        results.join_thread()


def _accept(item: tuple[int, str, Any], out: dict[int, dict]) -> None:
    rank, status, body = item
    if status != "ok":
        raise ProbeError(f"bandwidth probe: worker {rank} failed:\n{body}")
    out[rank] = body


def _aggregate(spans_by_rank: list[list[tuple[float, float]]], size: int) -> float:
    """Aggregate B/s of repeat ``r``: all bytes over the window from the first start to the last end;
    the median over repeats."""
    rates = []
    for spans in zip(*spans_by_rank):
        window = max(end for _, end in spans) - min(start for start, _ in spans)
        rates.append(_rate(size * len(spans), window))
    return _median(rates)


# ------------------------------------------------------------------ the probes
def _probe_cpu(devices: int, capacity: int | None, size: int, repeats: int, timeout: float) -> Machine:
    cap = CpuDevice("cpu0", capacity).capacity
    if 2 * size > cap:  # a worker holds a resident copy and the copy being timed
        size = cap // 2
    if size < TINY:
        raise ProbeError(f"device capacity {cap} bytes is too small to time copies; give at least {2 * TINY} bytes")
    res = _run_workers(devices, size, capacity, repeats, timeout)
    w0 = res[0]
    p2p = _rate(size, _median(w0["p2p"]))
    nprocs = max(devices, 2)
    return Machine(
        kind="cpu",
        device_name=_cpu_name(),
        devices=devices,
        capacity=cap,
        h2d=_rate(size, _median(w0["h2d"])),
        d2h=_rate(size, _median(w0["d2h"])),
        d2d=p2p,
        host_link_shared=True,
        h2d_all=_aggregate([res[r]["h2d_spans"] for r in range(devices)], size),
        d2h_all=_aggregate([res[r]["d2h_spans"] for r in range(devices)], size),
        msg=p2p,
        latency=_median(w0["latency"]),
        p2p_latency=w0["p2p_latency"],
        source="measured",
        notes={
            "size": f"{size} bytes per transfer, median of {repeats}",
            "workers": f"{nprocs} spawned processes; {devices} device worker(s) with {_threads(devices)} torch thread(s) each",
            "h2d_all": f"{devices} workers copying at once, released by a barrier; bytes over the overlap window",
            "d2d": "the CPU runtime's p2p path between two worker processes (a shared-memory copy handed over a "
                   "queue, copied into the receiver's device); same as msg",
            "latency": f"median of {_TINY_REPEATS} {TINY}-byte to_device copies on a stream thread, awaited",
            "p2p_latency": f"half the median of {_TINY_REPEATS} {TINY}-byte round trips on the p2p path",
            "host_link_shared": "one memory bus serves every emulated device",
        },
    )


def _probe_cuda(devices: int, capacity: int | None, size: int, repeats: int, timeout: float) -> Machine:
    try:
        devs = make_devices("cuda", devices, capacity)
    except (ValueError, RuntimeError) as exc:
        raise ProbeError(f"cannot probe CUDA devices: {exc}") from exc
    try:
        return _time_cuda(devs, size, repeats, timeout)
    finally:
        for d in devs:
            d.release()


def _time_cuda(devs: list, size: int, repeats: int, timeout: float) -> Machine:
    devices = len(devs)

    def sync_all() -> None:
        for d in devs:
            d.synchronize()

    def timed(fn: Any) -> float:
        sync_all()
        t0 = time.perf_counter()
        fn()
        sync_all()
        return time.perf_counter() - t0

    dev0 = devs[0]
    hosts = [_host_buffer(size, pin=True) for _ in devs]
    tiny = _host_buffer(TINY, pin=True)
    resident = [d.to_device(h) for d, h in zip(devs, hosts)]
    for d, h in zip(devs, hosts):  # warm-up: allocator growth, pinned staging, context
        d.to_host(d.to_device(h, non_blocking=True), pinned=True)
    sync_all()

    h2d = [timed(lambda: dev0.to_device(hosts[0], non_blocking=True)) for _ in range(repeats)]
    d2h = [timed(lambda: dev0.to_host(resident[0], pinned=True)) for _ in range(repeats)]
    lat = [timed(lambda: dev0.to_device(tiny, non_blocking=True)) for _ in range(_TINY_REPEATS)]

    def all_h2d() -> None:
        outs = [d.to_device(h, non_blocking=True) for d, h in zip(devs, hosts)]
        sync_all()
        del outs

    def all_d2h() -> None:
        outs = [d.to_host(r, pinned=True) for d, r in zip(devs, resident)]
        sync_all()
        del outs

    h2d_all = _median([_rate(size * devices, timed(all_h2d)) for _ in range(repeats)])
    d2h_all = _median([_rate(size * devices, timed(all_d2h)) for _ in range(repeats)])
    h2d_rate, d2h_rate = _rate(size, _median(h2d)), _rate(size, _median(d2h))

    notes = {
        "size": f"{size} bytes per transfer, pinned host buffers, median of {repeats}",
        "h2d_all": f"{devices} non-blocking copies issued back to back, then all devices synchronized",
        "latency": f"median of {_TINY_REPEATS} {TINY}-byte pinned h2d copies",
        "host_link_shared": "assumed (not visible from PyTorch); h2d_all measures the contention",
    }
    if devices >= 2:
        dev1 = devs[1]
        d2d = _rate(size, _median([timed(lambda: resident[0].to(dev1.torch_device)) for _ in range(repeats)]))
        notes["d2d"] = f"tensor.to from {dev0.name} to {dev1.name}"
    else:
        d2d = 1.0 / (1.0 / d2h_rate + 1.0 / h2d_rate)
        notes["d2d"] = "one device: not measured; host-staged rate 1/(1/d2h + 1/h2d)"
    del resident, hosts
    for d in devs:
        d.empty_cache()

    res = _run_workers(0, size, None, repeats, timeout)
    msg = _rate(size, _median(res[0]["p2p"]))
    notes["msg"] = "a shared-memory copy handed over a queue between two CPU worker processes"
    notes["p2p_latency"] = f"half the median of {_TINY_REPEATS} {TINY}-byte round trips on that path"
    return Machine(
        kind="cuda",
        device_name=torch.cuda.get_device_name(dev0.torch_device),
        devices=devices,
        capacity=dev0.capacity,
        h2d=h2d_rate,
        d2h=d2h_rate,
        d2d=d2d,
        host_link_shared=True,
        h2d_all=h2d_all,
        d2h_all=d2h_all,
        msg=msg,
        latency=_median(lat),
        p2p_latency=res[0]["p2p_latency"],
        source="measured",
        notes=notes,
    )


def probe_machine(kind: str, devices: int, capacity: int | None, size: int = DEFAULT_SIZE,
                  repeats: int = 3, timeout: float = DEFAULT_TIMEOUT, runtime: bool = True) -> Machine:
    """Measure ``devices`` devices of ``kind`` (``"cpu"`` or ``"cuda"``) with ``capacity`` bytes each
    (None: the host's memory for ``cpu``, the free GPU memory for ``cuda``), timing ``size``-byte
    transfers ``repeats`` times; with ``runtime`` (``cpu`` only), also the runtime's own costs and
    the cores the devices share. See the module docs for what each number is."""
    if kind not in ("cpu", "cuda"):
        raise ProbeError(f"cannot probe device kind {kind!r}; expected 'cpu' or 'cuda'")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ProbeError(f"need at least one device to probe, got {devices!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ProbeError(f"repeats must be a whole number >= 1, got {repeats!r}")
    if not isinstance(size, int) or size < TINY:
        raise ProbeError(f"size must be at least {TINY} bytes, got {size!r}")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ProbeError(f"timeout must be a positive number of seconds, got {timeout!r}")
    t0 = time.perf_counter()
    if kind == "cpu":
        machine = _probe_cpu(devices, capacity, size, repeats, timeout)
    else:
        machine = _probe_cuda(devices, capacity, size, repeats, timeout)
    if runtime and kind == "cpu":
        machine = _with_runtime_costs(machine, timeout)
    log.info("probed %d %s device(s) in %.1f s:\n%s", devices, kind, time.perf_counter() - t0, machine.describe())
    return machine


def _with_runtime_costs(machine: Machine, timeout: float) -> Machine:
    """``machine`` with the runtime's measured overheads and shared cores (module docs)."""
    from .overheads import measure_compute_scaling, measure_cores, measure_overheads  # the launcher, when asked for

    cores = measure_cores(machine.devices)
    try:
        costs = measure_overheads(machine, timeout=timeout)
        measured = dataclasses.replace(machine, task_overhead=costs.task, microbatch_overhead=costs.microbatch,
                                       update_overhead=costs.update, iteration_overhead=costs.iteration,
                                       tensor_overhead=costs.tensor, host_update_overhead=costs.host_update,
                                       host_tensor_overhead=costs.host_tensor, p2p_send_overhead=costs.send,
                                       cpu_cores=cores)
        scaling = measure_compute_scaling(measured, timeout=timeout)
    except HarmonyError as exc:
        raise ProbeError(f"measuring the runtime's overheads failed: {exc}") from exc
    probed = machine.p2p_latency if machine.p2p_latency is not None else machine.latency
    notes = {
        **machine.notes,
        "overheads": f"the real launcher on {costs.tasks} tasks of near-zero compute: measured span minus the "
                     "estimator's, median residuals of one-microbatch and many-microbatch tasks; per iteration, "
                     "the launcher's step beyond its slowest worker (lower quartile); per state tensor, the "
                     "difference between updates of layers of 2 and of 12 tensors; per host update, its span less "
                     "its profiled step, fixed and per parameter, on the same two kinds of layer; per p2p "
                     "message, the median hand-off on its sender's p2p-out stream in the pipeline below",
        "p2p_latency": f"the larger of the half round trip ({probed * 1e6:.0f} us) and the message cost that "
                       f"makes the estimate of a near-zero pipeline match its run ({costs.message * 1e6:.0f} us)",
        "cpu_cores": f"work of {machine.devices + 1} single-threaded loops at once over one alone, in one window",
        "compute_scale": "the real launcher's tasks on transformer MLP blocks, one device, over their estimate "
                         "from the same blocks profiled (median)",
        "compute_interference": f"the same on {max(2, machine.devices)} devices at once over one device, "
                                "less one, per other device",
    }
    return dataclasses.replace(scaling.applied(measured), p2p_latency=max(probed, costs.message), notes=notes)
