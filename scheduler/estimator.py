"""The runtime estimator (§4.3.1 "estimate"): an event-driven simulation of one training iteration.

``estimate(graph, profile, machine)`` plays a :class:`~harmony.scheduler.tasks.TaskGraph` the way the
runtime executes it (§4.4) and reports the iteration time, each device's peak memory, the bytes moved
and a timeline of every stream. The search calls it thousands of times, so it is a single pass over
a heap of events with integer bookkeeping (``_Simulation``: one method per kind of event);
``record_events=False`` skips building the timeline.

What is simulated (the runtime's semantics, which this module must keep in step with):

- **Streams.** Every device has five: compute, swap-in, swap-out, p2p-in and p2p-out. The host
  (``HOST``) is one more "device" whose compute stream runs offloaded updates. Each device computes
  its tasks in graph order; a task is one *unit* per microbatch (FWD: the pack's forward; BWD: the
  recompute and the backward, or for a ``loss`` task the forward and the backward), plus one unit
  for a fused device update; a UPD task is one unit.
- **Transfers.** SWAP inputs (host -> device) run on the swap-in stream at the ``h2d`` rate, SWAP
  outputs (device -> host) on the swap-out stream at ``d2h``; MSG uses the same streams at the
  ``msg`` rate; a P2P transfer holds the sender's p2p-out and the receiver's p2p-in streams at once,
  for ``transfer_time(nbytes, "d2d")``. SHM and LOCAL cost nothing and are pure dependencies. A task
  on the host reads SWAP inputs straight from host memory: they are dependencies on the producer's
  swap-out, not copies.
- **When a transfer may start.** An input transfer is *issued* when the task before its consumer on
  the same device starts computing (one task of lookahead: the next task's inputs are prefetched
  while the current one computes; the first task's at time zero), and it is *ready* when its data
  exists: a SWAP input produced by task k waits for k's matching swap-out to end, a P2P input for
  the microbatch of k that produces it. Outputs leave as soon as the unit producing them ends (the
  microbatch for per-microbatch outputs, the whole task for W/K/dW). Swap-in streams serve ready
  transfers in the order their consumers compute; swap-out and p2p streams in the order transfers
  became ready, so that a p2p transfer that heads both its queues always exists and p2p cannot
  deadlock on its own.
- **When compute may start.** A unit starts once the previous unit on the device has ended, the
  task-wide inputs (W, B, K, ...) and its own microbatch's inputs have arrived. A UPD task on a
  device is the exception to the lookahead: the runtime loads its weights, summed gradient and
  optimizer state when it starts it, so its inputs are issued when the previous task ends.
- **The runtime's own costs.** A unit on a device lasts its profiled compute times
  ``machine.compute_scale`` (the runtime's compute over the profiler's, measured; 1 where nobody
  did) plus the machine's measured
  overheads (``Machine.task_overhead`` on a task's first unit, and on a FWD or BWD task's first
  unit the model's own ``compute_task_overhead`` as well; ``microbatch_overhead`` on each
  microbatch, ``update_overhead`` on each optimizer step on a device, fused or not;
  ``host_update_overhead`` and ``host_tensor_overhead`` per parameter on each update on the host;
  ``p2p_send_overhead`` on a unit per P2P piece it sends, which an emulated device's compute thread
  hands over itself), and
  ``iteration_overhead`` once on the iteration (the launcher handing out the minibatch and taking
  the results back, outside every task); zero on a machine nobody measured.
- **Shared cores.** With ``machine.cpu_cores`` set (emulated devices computing on the host's
  cores), the units computing at one moment on all devices and the host share that many cores:
  each progresses at ``min(1, cpu_cores / k)`` for the k units computing at the moment, rates
  recomputed whenever one starts or ends (processor sharing, as for the host link); with
  ``machine.compute_interference`` (units computing at once slowing each other through the memory
  bus and caches, measured), that rate is divided by ``1 + compute_interference * (k - 1)``.
- **Host-link contention.** On a shared host link (``machine.host_link_shared``) the active h2d
  copies of all devices share the link (likewise d2h): each progresses at
  ``machine.bandwidth(channel, k)`` for the k copies active at the moment, rates recomputed whenever
  one starts or ends (processor sharing); the fixed ``latency`` is paid before joining the link,
  and for a pack's state (W, dW, K, B) ``machine.tensor_overhead`` per tensor in it
  (``Profile.state_tensors``: the runtime moves a state one tensor at a time). P2P and MSG copies
  do not contend.
- **Memory.** What a task holds is ``memory.task_memory``'s: its state (W, B, and dW for a BWD)
  from its first unit's start to its last unit's end, and each unit's work while it computes (a
  microbatch's pack peak above the state, its inputs X, Xs, dY included; a fused update's optimizer
  state and temporaries). On top: every input from the moment its copy starts until its unit
  starts computing (then the unit's work covers it, ``memory.covers``; an input it does not cover,
  everything of a UPD task, stays until the unit ends); every output from the end of the unit that
  produced it until its copy ends (LOCAL outputs until their consumer starts; a pack state a
  backward leaves for a later update, until that update ends). A fused update's optimizer state
  is loaded when its backward is done, as the runtime loads it (no lookahead). The peak of that sum
  is reported per device, and per task from its predecessor's end to its own (``task_peaks``, what
  the runtime measures per task); ``fits`` says whether every device stays within ``capacity``.
  A microbatch's input counts in device memory from when the runtime copies it in, one microbatch
  ahead (as the previous microbatch of its task starts; the first microbatch's once the task before
  has ended), whenever its transfer runs. On emulated devices (``machine.kind == "cpu"``)
  outputs still leaving the device are not part of the peak: the runtime's memory manager lets
  them go before it lets an allocation past the plan's peak (``runtime/memory.py``'s budget).
- **Memory-aware prefetch.** A swap-in that would push its device past ``capacity`` waits (the
  runtime's memory manager blocks the prefetch) until memory is freed or its consumer is the very
  next unit and the compute stream is idle; then it goes ahead regardless and the overflow shows in
  the peak. P2P receives are not held back (the sender pushes as soon as the receiver issued them).
- **Deadlock.** If the heap empties while a device still has units to run, the result carries a
  ``deadlock`` description naming, for each stuck device, the task it waits to run and the inputs
  it waits for (and the iteration time is infinite).

Which producer's output a consumer's input reads: the program decides it for activations and
gradients (X, Xs, dY from a producer task), as it does for the executor. Each estimate lowers the
graph's edges once (``lower.lower(graph, None, streams=False)``: no byte sizes, no stream order,
which this module simulates itself). An input of microbatch j of stream s (as ``Program.reads``,
that is ``lower.stream_names``, names it) reads the producer's output made by the unit that sends
the last piece of ``program.into(consumer, s, j)`` (the piece that completes the consumer's
samples): the first not yet read of its outputs naming the consumer, else one of the same tensor
left in the host store naming no reader; with no such output it waits for that unit, and with no
edge for the producer's whole task. One transfer is still simulated per input, of the input's
bytes. Every other input with a producer (pack state W, B, K and gradients dW, between tasks or
through the host store) reads the output ``program.sources`` names (``lower.state_sources``, the
same the program's LOADs name); an input whose producer has no such output waits for the
producer's whole task. Nothing is matched here.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from . import memory
from .memory import cached_task_memory as _task_memory
from .memory import profile_cache as _profile_cache
from .costs import STATE_TENSORS as _STATE_TENSORS
from .costs import unit_seconds
from .lower import STREAMS, Program, lower
from .machine import Machine
from harmony.profiling.profiles import Profile
from .tasks import HOST, Channel, Kind, MemoryPlan, Task, TaskGraph, Transfer

__all__ = ["Estimate", "StreamEvent", "STREAMS", "estimate", "chrome_trace", "promise"]

_COMPUTE, _SWAP_IN, _SWAP_OUT, _P2P_IN, _P2P_OUT = range(5)

# transfer kinds
_IN, _OUT, _MSG_IN, _MSG_OUT, _P2P = range(5)
_KIND_LABEL = {_IN: "SWAP in", _OUT: "SWAP out", _MSG_IN: "MSG in", _MSG_OUT: "MSG out", _P2P: "P2P"}

# event codes
_E_UNIT, _E_XFER, _E_JOIN, _E_LINK, _E_CPU = range(5)

_STATE = ("W", "B")  # a pack's state, loaded before its first unit
_P2P_CHANNEL = Channel.P2P.value  # an edge's channel, as lowering writes it
# outputs that are activations or gradients: their readers are paired with them by the program's edges
_ACTIVATIONS = frozenset(("X", "Y", "Xs", "dX", "dY", "A", "As"))
_HOSTLIKE = (Channel.SWAP, Channel.MSG, Channel.SHM)


class StreamEvent(NamedTuple):
    """One interval on one stream, for Chrome traces."""

    device: int  # HOST (-1) for the host
    stream: str  # one of STREAMS
    task: int
    label: str
    start: float
    end: float


@dataclass
class Estimate:
    iteration_time: float  # seconds: the last completion over devices and host (inf on deadlock)
    fits: bool  # every device's peak within capacity
    peak_memory: dict[int, int]  # per device, bytes
    bytes_by_channel: dict[str, int]  # "SWAP in", "SWAP out", "P2P", "MSG in", "MSG out"
    bytes_by_device: dict[int, dict[str, int]]  # "SWAP in", "SWAP out", "P2P in", "P2P out", "MSG in", ...
    busy: dict[int, dict[str, float]]  # per device per stream, busy seconds
    deadlock: str | None = None  # what each stuck device waits for, if the graph cannot finish
    events: list[StreamEvent] = field(default_factory=list)
    capacity: int | None = None
    # per task on a device: its device's bytes at most from its predecessor's end to its own end
    # (what the runtime measures per task, and what an out-of-memory report quotes)
    task_peaks: dict[int, int] = field(default_factory=dict)
    # task -> the unit of the task before it on its device during which its state (W, B) began to
    # load (tasks whose state loaded once that task had ended are not in it)
    prefetched: dict[int, int] = field(default_factory=dict)
    # why the simulation stopped before the iteration's end (``estimate(beat=...)``): "slower" (its
    # clock passed ``beat``: iteration_time is that clock, a lower bound) or "over capacity" (a
    # device went past it: fits is False, the peaks are those reached so far); None when played out
    cut: str | None = None
    # the simulation's busy spans, unlabelled, where ``estimate(timeline_later=True)`` kept them
    recorded: list[tuple] | None = field(default=None, repr=False, compare=False)

    def with_timeline(self) -> "Estimate":
        """This estimate with its ``events``, labelled from what the simulation recorded (itself
        where it has them already)."""
        if self.events or self.recorded is None:
            return self
        if self.cut:
            raise ValueError(f"a simulation cut short ({self.cut}) has no whole timeline")
        return dataclasses.replace(self, events=_timeline(self.recorded), recorded=None)

    def utilization(self, device: int, stream: str = "compute") -> float:
        """Fraction of the iteration the stream was busy."""
        if not self.iteration_time or math.isinf(self.iteration_time):
            return 0.0
        return self.busy.get(device, {}).get(stream, 0.0) / self.iteration_time


# ---------------------------------------------------------------------------------------- model
class _Unit:
    """One microbatch of a task's compute (or its fused update, or a whole UPD task)."""

    __slots__ = (
        "slot", "order", "task", "j", "dur", "need", "end_units", "end_xfers", "issue",
        "delta_start", "release_end", "alloc_end", "waits", "done", "start", "remaining", "version",
        "started", "fetch_on_start", "fetch_on_end", "outbound_end",
    )

    def __init__(self, slot: int, task: Task, j: int, dur: float):
        self.slot = slot
        self.order = 0
        self.task = task
        self.j = j  # microbatch index; len(microbatches) for the fused update unit
        self.dur = dur
        self.need = 0
        self.end_units: list[_Unit] = []
        self.end_xfers: list[_Xfer] = []
        self.issue: list[_Xfer] = []  # the next task's input transfers, issued when this unit starts
        self.delta_start = 0  # bytes: + task peak (first unit) - inputs the peak covers
        self.release_end = 0  # bytes freed at the end: uncovered inputs, the task peak (last unit)
        self.alloc_end = 0  # bytes of outputs produced by this unit, held until they leave
        self.waits: list[tuple[Transfer, int | None, object]] = []  # for deadlock reports
        self.done = False
        self.start = 0.0
        self.remaining = 0.0  # seconds of work left at full speed (shared cores)
        self.version = 0
        self.started = False
        # inputs of later microbatches whose device copy the runtime makes when this unit starts / ends
        self.fetch_on_start: list[_Xfer] = []
        self.fetch_on_end: list[_Xfer] = []
        self.outbound_end = 0  # bytes of alloc_end that leave the device (swap-outs, sends)


class _Xfer:
    __slots__ = (
        "kind", "nbytes", "dur", "fixed", "link", "src", "dst", "need", "end_units", "end_xfers", "unit",
        "alloc_dst", "free_src", "free_dst", "done", "start", "transfer", "task_id",
        "remaining", "version", "fetch_after", "fetch_at_end", "fetched", "fit",
    )

    def __init__(self, kind: int, transfer: Transfer, task_id: int, src: int | None, dst: int | None):
        self.kind = kind
        self.transfer = transfer
        self.task_id = task_id
        self.nbytes = transfer.nbytes
        self.src = src
        self.dst = dst
        self.dur = 0.0
        self.fixed = 0.0  # s paid before its bytes move (on a shared link: before it joins)
        self.link = None
        self.need = 0
        self.end_units: list[_Unit] = []
        self.end_xfers: list[_Xfer] = []
        self.unit: _Unit | None = None  # the consuming unit (inputs)
        self.alloc_dst = 0
        self.free_src = 0
        self.free_dst = 0
        self.done = False
        self.start = 0.0
        self.remaining = 0.0
        self.version = 0
        self.fetch_after: _Unit | None = None  # the unit whose start (or end) the device copy waits for
        self.fetch_at_end = False
        self.fetched = False  # its bytes are on the device
        self.fit = 0  # bytes that must fit for a prefetch to start: its own, or a whole pack state's


class _Link:
    """A shared host link in one direction: active copies share it (processor sharing)."""

    __slots__ = ("channel", "active", "last", "rate", "rates")

    def __init__(self, channel: str, machine: Machine, devices: int):
        self.channel = channel
        self.active: list[_Xfer] = []
        self.last = 0.0
        self.rate = 0.0
        self.rates = [0.0] + [machine.bandwidth(channel, k) for k in range(1, devices + 2)]


def _fetch_point(x: _Xfer, units: list[_Unit], before: _Unit | None) -> None:
    """When a microbatch's input counts in device memory: the runtime copies it in (from host
    memory, or from the message a P2P sender left there) one microbatch ahead, as the previous
    microbatch of its task starts, and the first microbatch's when the task starts, once the task
    before it has ended; counted from then on whenever its transfer runs (if later, the runtime's
    copy waits for the data, and the plan keeps its room)."""
    j = x.unit.j
    if j > 0:
        x.fetch_after = units[j - 1]
        units[j - 1].fetch_on_start.append(x)
    elif before is not None:
        x.fetch_after = before
        x.fetch_at_end = True
        before.fetch_on_end.append(x)


def _running_gradient(task: Task, i: Transfer) -> bool:
    """Whether ``i`` is the gradient a backward starts from (the per-GPU-swap baselines): the
    runtime copies it in as the task starts, like its first microbatch's inputs, not ahead."""
    return task.kind == Kind.BWD and i.tensor == "dW" and i.channel == Channel.SWAP


_GROUP = {Channel.P2P: "p2p", Channel.LOCAL: "local", Channel.SWAP: "host", Channel.MSG: "host", Channel.SHM: "host"}


def _where(device: int) -> str:
    return "host" if device == HOST else f"dev{device}"


# ---------------------------------------------------------------------------------------- estimate
def estimate(
    graph: TaskGraph,
    profile: Profile,
    machine: Machine,
    capacity: int | None = None,
    record_events: bool = True,
    beat: float | None = None,
    timeline_later: bool = False,
) -> Estimate:
    """Simulate one iteration of ``graph``; see the module docs for the model.

    ``capacity`` (bytes per device; ``machine.capacity`` when not given) is what ``fits`` is judged
    against and what prefetching may use. ``beat`` (a search's best time so far): only an estimate
    that fits and is faster matters, so the simulation stops as soon as a device goes past
    ``capacity`` or its clock passes ``beat``, and says so in ``Estimate.cut``: most of a search's
    candidates lose, and most of those that lose overflow early.

    ``record_events`` builds the timeline (``Estimate.events``); ``timeline_later`` only keeps what
    it is made of, for ``Estimate.with_timeline`` to label if asked: a search wants the winner's
    timeline, and which candidate wins is known only once the others have been played."""
    profile = profile.for_graph(graph)  # the one ``generate`` sized the graph's weights with
    # The simulation allocates tens of thousands of small objects; in a process that holds a big
    # heap (torch, a model) the cyclic collector's full passes would triple the run time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        recording = "now" if record_events else "later" if timeline_later else None
        return _estimate(graph, profile, machine, capacity, recording, beat)
    finally:
        if enabled:
            gc.enable()


def promise(graph: TaskGraph, profile: Profile, machine: Machine, capacity: int | None = None) -> MemoryPlan:
    """The memory promise of a task graph (``TaskGraph.memory``), from its estimate: what the
    runtime admits every copy against. ``compile`` attaches it to the plan it chooses; a graph
    made any other way (a script's own ``search``, the overheads probe) gets it here."""
    est = estimate(graph, profile, machine, capacity=capacity, record_events=False)
    return memory.memory_plan(graph, est.peak_memory, est.task_peaks, est.prefetched, profile)


def _estimate(graph: TaskGraph, profile: Profile, machine: Machine, capacity: int | None, recording: str | None,
              beat: float | None = None) -> Estimate:
    simulation = _Simulation(graph, lower(graph, None, streams=False), profile, machine, capacity, recording)
    try:
        return simulation.run(beat)
    finally:
        simulation.release()


class _Overflow(Exception):
    """A device went past capacity in a simulation that stops there (``estimate(beat=...)``)."""


_heappush = heapq.heappush
_heappop = heapq.heappop


def _hold(cu: _Unit, n: int, per_mb: bool, covered: bool, task_units: list[_Unit]) -> None:
    """An input's ``n`` bytes on its device until its unit starts (the unit's work covers it), or
    ends (a microbatch's input), or else until its task ends."""
    if covered:
        cu.delta_start -= n
    elif per_mb:
        cu.release_end += n
    else:
        task_units[-1].release_end += n


class _Simulation:
    """One iteration of a task graph played out (see the module docs). ``__init__`` builds the units
    and transfers and wires their dependencies; ``run`` plays the heap of events, one method per
    kind of event, and returns the ``Estimate``."""

    __slots__ = (
        # what is simulated
        "profile", "machine", "recording", "cap", "cache", "tasks", "by_id",
        # slots: one per device, then the host
        "slot_of", "host_slot", "slot_dev", "nslots",
        # units: task id -> its units; per slot its units in order; the previous task's first / last unit
        "units_of", "slot_units", "first_unit_prev", "last_unit_prev",
        # transfers and what they count
        "links", "kinds", "xfers", "bytes_by_channel", "bytes_by_device",
        # outputs by who may read them (records: [transfer, producing unit, swap-out xfer or None, used, slot])
        "made", "made_host", "records",
        # the simulation's state
        "heap", "seq", "now", "end_time", "mem", "peak", "caps", "ptr", "computing", "busy_flag", "busy_time",
        "swap_in_q", "swap_out_q", "p2p_in_q", "p2p_out_q", "events", "task_peak", "prefetched",
        "reclaim", "outbound", "cores", "interference", "running", "cpu_last", "cpu_rate", "stop_over",
    )

    def __init__(self, graph: TaskGraph, program: Program, profile: Profile, machine: Machine,
                 capacity: int | None, recording: str | None):
        self.profile = profile
        self.machine = machine
        self.recording = recording  # "now": label the timeline, "later": keep its spans, None: neither
        self.cap = machine.capacity if capacity is None else int(capacity)
        self.cache = _profile_cache(profile)
        self.tasks = graph.tasks
        self.by_id = {t.id: t for t in self.tasks}
        self._build_slots(graph)
        self._build_units()
        self._build_inline_sends(program)
        # transfer rates: a shared host link in each direction
        links = {}
        if machine.host_link_shared:
            links["h2d"] = _Link("h2d", machine, self.nslots)
            links["d2h"] = _Link("d2h", machine, self.nslots)
        self.links = links
        self.xfers: list[_Xfer] = []
        self.bytes_by_channel: dict[str, int] = {}
        self.bytes_by_device: dict[int, dict[str, int]] = {d: {} for d in self.slot_dev}
        self._build_kinds()
        self._build_outputs()
        self._build_inputs(program)
        self._build_update_dependencies(program)
        self._build_unread_outputs()
        self._build_state()
        self._build_kept(graph)

    # ------------------------------------------------------------------------------ building
    def _build_slots(self, graph: TaskGraph) -> None:
        """One slot per device, then the host."""
        devices = sorted({t.device for t in self.tasks if t.device != HOST} | set(range(graph.devices)))
        slot_of = {d: i for i, d in enumerate(devices)}
        self.host_slot = len(devices)
        slot_of[HOST] = self.host_slot
        self.slot_of = slot_of
        self.slot_dev = devices + [HOST]
        self.nslots = len(self.slot_dev)

    def _slot(self, device: int | None) -> int | None:
        if device is None:
            return None
        return self.slot_of.get(device)

    def _build_units(self) -> None:
        """Each task's units, in its slot's order, with their durations and the memory they hold."""
        profile, machine, cache, by_id = self.profile, self.machine, self.cache, self.by_id
        slot_of, host_slot, nslots = self.slot_of, self.host_slot, self.nslots
        units_of: dict[int, list[_Unit]] = {}
        slot_units: list[list[_Unit]] = [[] for _ in range(nslots)]
        first_unit_prev: dict[int, _Unit | None] = {}  # task id -> first unit of the previous task on its slot
        last_unit_prev: dict[int, _Unit | None] = {}  # task id -> last unit of the previous task on its slot
        last_on_slot: list[_Unit | None] = [None] * nslots
        end_on_slot: list[_Unit | None] = [None] * nslots
        for task in self.tasks:
            s = slot_of[task.device]
            held = _task_memory(task, profile, cache, memory.stash_layers(task, by_id))
            us = [_Unit(s, task, j, d) for j, d in enumerate(unit_seconds(task, profile, machine, cache))]
            su = slot_units[s]
            for u in us:
                u.order = len(su)
                su.append(u)
            if s != host_slot:  # the state for the task's span, each unit's work while it computes
                us[0].delta_start += held.state
                us[-1].release_end += held.state
                for u, work in zip(us, held.work):
                    u.delta_start += work
                    u.release_end += work
            first_unit_prev[task.id] = last_on_slot[s]
            last_unit_prev[task.id] = end_on_slot[s]
            last_on_slot[s] = us[0]
            end_on_slot[s] = us[-1]
            units_of[task.id] = us
        self.units_of = units_of
        self.slot_units = slot_units
        self.first_unit_prev = first_unit_prev
        self.last_unit_prev = last_unit_prev

    def _build_inline_sends(self, program: Program) -> None:
        """Each P2P piece a unit sends keeps its compute busy ``machine.p2p_send_overhead`` longer
        (an emulated device's compute thread hands its messages over itself)."""
        cost = self.machine.p2p_send_overhead
        if not cost:
            return
        units_of = self.units_of
        for e in program.edges:
            if e.channel == _P2P_CHANNEL and e.producer is not None and e.src_unit is not None:
                us = units_of.get(e.producer)
                if us is not None and 0 <= e.src_unit < len(us):
                    us[e.src_unit].dur += cost

    def _unit_for(self, task: Task, mb: int | None, produce: bool) -> _Unit:
        us = self.units_of[task.id]
        if mb is not None and 0 <= mb < len(task.microbatches) and mb < len(us):
            return us[mb]
        return us[-1] if produce else us[0]

    def _build_kinds(self) -> None:
        """Per kind of transfer: its channel's fixed cost and bandwidth (``Machine.transfer_time``,
        looked up once: a search builds a hundred thousand transfers), its link, and the counter keys
        of its source and destination devices."""
        machine, links = self.machine, self.links
        kinds = []
        for kind, channel, link, src_key, dst_key in (
                (_IN, "h2d", links.get("h2d"), None, "SWAP in"), (_OUT, "d2h", links.get("d2h"), "SWAP out", None),
                (_MSG_IN, "msg", None, None, "MSG in"), (_MSG_OUT, "msg", None, "MSG out", None),
                (_P2P, "d2d", None, "P2P out", "P2P in")):
            fixed = machine.p2p_latency if channel in ("d2d", "msg") and machine.p2p_latency is not None \
                else machine.latency
            kinds.append((fixed, machine.bandwidth(channel), link, src_key, dst_key, _KIND_LABEL[kind]))
        self.kinds = kinds

    def _new_xfer(self, kind: int, transfer: Transfer, task_id: int, src: int | None, dst: int | None) -> _Xfer:
        fixed, bandwidth, link, src_key, dst_key, label = self.kinds[kind]
        x = _Xfer(kind, transfer, task_id, src, dst)
        n = transfer.nbytes
        if n < 0:
            raise ValueError(f"nbytes must be a number >= 0, got {n!r}")
        per_tensor = self.machine.tensor_overhead
        if per_tensor and kind in (_IN, _OUT) and transfer.tensor in _STATE_TENSORS:
            task = self.by_id[task_id]
            fixed += per_tensor * self.profile.state_tensors(transfer.tensor, task.first, task.last)
        x.fixed = fixed
        x.dur = fixed + n / bandwidth if n else 0.0
        x.link = link
        by_device, slot_dev = self.bytes_by_device, self.slot_dev
        if src_key is not None and src is not None:
            per = by_device[slot_dev[src]]
            per[src_key] = per.get(src_key, 0) + n
        if dst_key is not None and dst is not None:
            per = by_device[slot_dev[dst]]
            per[dst_key] = per.get(dst_key, 0) + n
        by_channel = self.bytes_by_channel
        by_channel[label] = by_channel.get(label, 0) + n
        self.xfers.append(x)
        return x

    def _build_outputs(self) -> None:
        """What each producer emits, and when: activations indexed by the unit making them (the
        program's edges name it), every output by (producer, output index) (the program's
        ``sources`` name it)."""
        by_id, slot_of, host_slot = self.by_id, self.slot_of, self.host_slot
        # record: [transfer, producing unit, swap-out xfer or None, used, slot]
        made: dict[tuple, list[list]] = {}  # activations: (producer, consumer, group, producing unit) -> records
        made_host: dict[tuple, list[list]] = {}  # activations naming no consumer: (producer, producing unit) -> records
        records: dict[tuple[int, int], list] = {}  # (producer, output index) -> record
        for task in self.tasks:
            s = slot_of[task.device]
            on_host = s == host_slot
            for n, o in enumerate(task.outputs):
                pu = self._unit_for(task, o.microbatch, produce=True)
                ch = o.channel
                x = None
                if o.nbytes > 0 and ch in (Channel.SWAP, Channel.MSG) and not (on_host and ch == Channel.SWAP):
                    x = self._new_xfer(_OUT if ch == Channel.SWAP else _MSG_OUT, o, task.id, s, None)
                    x.need = 1
                    pu.end_xfers.append(x)
                    if not on_host:
                        pu.alloc_end += o.nbytes
                        pu.outbound_end += o.nbytes
                        x.free_src = o.nbytes
                elif not on_host and o.nbytes > 0 and ch in (Channel.P2P, Channel.LOCAL):
                    pu.alloc_end += o.nbytes  # held until sent / read
                    if ch == Channel.P2P:
                        pu.outbound_end += o.nbytes
                rec = [o, pu, x, False, s]
                records[(task.id, n)] = rec
                if o.tensor not in _ACTIVATIONS:
                    continue
                if o.task is not None and o.task in by_id:
                    made.setdefault((task.id, o.task, _GROUP[ch], pu.j), []).append(rec)
                elif ch in _HOSTLIKE:
                    made_host.setdefault((task.id, pu.j), []).append(rec)
        self.made = made
        self.made_host = made_host
        self.records = records

    def _produced(self, program: Program, k: int, c: Task, i: Transfer,
                  stream: str) -> tuple[list | None, _Unit | None]:
        """The record of producer ``k``'s output that consumer ``c``'s activation input ``i`` (of the
        program's ``stream``) reads, and the unit producing it, as the program's edges say: the
        producer's unit that sends the last piece of ``i``'s microbatch (module docs)."""
        edges = program.into(c.id, stream, i.microbatch or 0)
        if not edges or edges[-1].producer != k:
            return None, None
        p = edges[-1].src_unit
        us = self.units_of[k]
        if p is None or not 0 <= p < len(us):
            return None, None
        for rec in self.made.get((k, c.id, _GROUP[i.channel], p), ()):
            if not rec[3]:
                return rec, us[p]
        if _GROUP[i.channel] == "host":  # left in the host store for any reader
            for rec in self.made_host.get((k, p), ()):
                if rec[0].tensor == i.tensor:
                    return rec, us[p]
        return None, us[p]

    def _build_inputs(self, program: Program) -> None:
        """Transfers into each consumer and their dependencies."""
        for task in self.tasks:
            s = self.slot_of[task.device]
            on_host = s == self.host_slot
            prev_first = self.first_unit_prev[task.id]
            # a UPD task's inputs are loaded when it starts (no lookahead): issued as the previous task ends
            prev_end = self.last_unit_prev[task.id] if task.kind == Kind.UPD and not on_host else None
            task_units = self.units_of[task.id]
            streams = dict(program.reads(task))
            state = []
            for index, i in enumerate(task.inputs):
                x = self._build_input(program, task, index, streams.get(index), s, on_host, prev_first, prev_end,
                                      task_units)
                if x is not None and i.tensor in _STATE and x.kind == _IN:
                    state.append(x)
            if len(state) > 1:  # the runtime loads a pack's weights and buffers together, or neither
                state[0].fit = sum(x.alloc_dst for x in state)

    def _build_input(self, program: Program, task: Task, index: int, stream: str | None, s: int, on_host: bool,
                     prev_first: _Unit | None, prev_end: _Unit | None, task_units: list[_Unit]) -> _Xfer | None:
        """The transfer bringing the task's input ``index`` in, with its dependencies (None where
        nothing is copied: a dependency on the producer alone)."""
        i = task.inputs[index]
        by_id = self.by_id
        cu = task_units[memory.input_unit(task, i.tensor, i.microbatch, len(task_units))]
        per_mb = cu.j == i.microbatch
        covered = memory.covers(task, cu.j, len(task_units), i.tensor, memory.running_gradient_input(task, i, by_id))
        # the optimizer state of a fused update is loaded for the step, once the backward is done
        load_after = task_units[cu.j - 1] if cu.j and i.tensor == "K" and not per_mb else prev_end
        k = i.task if i.task in by_id else None
        rec = made_by = None
        if k is not None:
            if stream is not None:  # an activation or gradient: the program's edges say who made it
                rec, made_by = self._produced(program, k, task, i, stream)
            else:  # state, optimizer state, gradients: the program's sources say which output
                source = program.sources.get((task.id, index))
                rec = self.records[source] if source is not None else None
        if rec is not None and rec[0].task is not None:
            rec[3] = True
        # where the data becomes available: a swap-out's end, a producing unit's end, or now
        if rec is not None:
            source = rec[2] if (rec[2] is not None and i.channel != Channel.P2P) else rec[1]
        elif made_by is not None:
            source = made_by
        elif k is not None:
            source = self.units_of[k][-1]
        else:
            source = None
        k_slot = self.slot_of[by_id[k].device] if k is not None else None
        x = self._input_xfer(task, i, s, on_host, k, k_slot, rec)
        if x is not None:
            x.unit = cu
            if not on_host:
                x.alloc_dst = x.fit = i.nbytes
                if per_mb or stream is not None or _running_gradient(task, i):
                    _fetch_point(x, task_units, self.last_unit_prev[task.id])
                _hold(cu, i.nbytes, per_mb, covered, task_units)
            if source is not None:
                x.need += 1
                source.end_xfers.append(x)
            if load_after is not None:
                x.need += 1
                load_after.end_xfers.append(x)
            elif prev_first is not None:
                x.need += 1
                prev_first.issue.append(x)
            if i.tensor in _STATE and task.id in program.after:
                self._after_writer(x, program.after[task.id])
            x.end_units.append(cu)
            cu.need += 1
            cu.waits.append((i, k, x))
            return x
        if source is not None:
            source.end_units.append(cu)
            cu.need += 1
            cu.waits.append((i, k, source))
        ch = i.channel
        # a LOCAL tensor left on this device by its producer is taken over by the consumer
        if rec is not None and ch == Channel.LOCAL and rec[0].channel == Channel.LOCAL and rec[4] == s and not on_host:
            _hold(cu, rec[0].nbytes, per_mb, covered, task_units)
        # a pack state a task left resident for a later one on the device: held from the producer's
        # end until the update's end (dp; an update's memory leaves it out), or until the backward
        # starts that kept its forward's activations (its state counts it from then on)
        elif rec is None and k is not None and ch == Channel.LOCAL and i.tensor == "W" and not on_host and k_slot == s:
            held = memory.resident_bytes(by_id[k], self.profile)
            self.units_of[k][-1].alloc_end += held
            if task.kind == Kind.UPD:
                task_units[-1].release_end += held
            else:
                task_units[0].delta_start -= held
        return None

    def _after_writer(self, x: _Xfer, writer: int) -> None:
        """A state load of a task continuing another's buffers (``Program.after``) waits until that
        writer is done: its last unit ended and its outputs left (the runtime loads weights and
        buffers together, and neither before then)."""
        x.need += 1
        self.units_of[writer][-1].end_xfers.append(x)
        n = 0
        while (writer, n) in self.records:
            out = self.records[(writer, n)][2]
            if out is not None:
                x.need += 1
                out.end_xfers.append(x)
            n += 1

    def _input_xfer(self, task: Task, i: Transfer, s: int, on_host: bool, k: int | None, k_slot: int | None,
                    rec: list | None) -> _Xfer | None:
        """The copy that brings input ``i`` to slot ``s``, if it needs one."""
        ch = i.channel
        n = i.nbytes
        if n > 0 and not on_host and ch == Channel.P2P:
            src = k_slot if k is not None else self._slot(i.peer)
            if src == self.host_slot:
                return self._new_xfer(_IN, i, task.id, None, s)
            if src != s:
                x = self._new_xfer(_P2P, i, task.id, src, s)
                if rec is not None and rec[4] == src:
                    x.free_src = rec[0].nbytes
                return x
            return None
        if n > 0 and ch in (Channel.SWAP, Channel.MSG) and not (on_host and ch == Channel.SWAP):
            return self._new_xfer(_IN if ch == Channel.SWAP else _MSG_IN, i, task.id, None, s)
        return None

    def _build_update_dependencies(self, program: Program) -> None:
        """An update steps the summed gradient: it waits for every task the program says it gathers
        from (``Program.gathers``: each backward depositing one of its parameters' gradients, on any
        device; dp-swap's replicas), of which, as a device runs its tasks in order, the last per
        device and pack."""
        by_id, units_of = self.by_id, self.units_of
        order = {t.id: i for i, t in enumerate(self.tasks)}
        for task in self.tasks:
            if task.kind != Kind.UPD:
                continue
            last: dict[tuple[int, int, int], Task] = {}
            for b in program.gathers.get(task.id, ()):
                bwd = by_id[b]
                key = (bwd.device, bwd.first, bwd.last)
                if bwd.kind == Kind.BWD and (key not in last or order[b] > order[last[key].id]):
                    last[key] = bwd
            cu = units_of[task.id][0]
            for b in last.values():
                source = units_of[b.id][-1]
                source.end_units.append(cu)
                cu.need += 1
                cu.waits.append((Transfer("dW", Channel.SWAP, 0, task=b.id), b.id, source))

    def _build_unread_outputs(self) -> None:
        """Outputs nobody read: P2P sends still happen; LOCAL tensors stay until their named task ends."""
        by_id, slot_of, host_slot = self.by_id, self.slot_of, self.host_slot
        named: dict[tuple, list[list]] = {}  # grouped as the outputs' readers are, for a stable order
        unnamed: dict[int, list[list]] = {}
        for (producer, _), rec in self.records.items():
            o = rec[0]
            if o.task is not None and o.task in by_id:
                named.setdefault((producer, o.task, _GROUP[o.channel]), []).append(rec)
            else:
                unnamed.setdefault(producer, []).append(rec)
        for recs in (*named.values(), *unnamed.values()):
            for o, pu, x, used, s in recs:
                if used or s == host_slot or o.nbytes <= 0:
                    continue
                if o.channel == Channel.P2P:
                    consumer = by_id.get(o.task) if o.task is not None else None
                    dst = slot_of[consumer.device] if consumer is not None else self._slot(o.peer)
                    if dst == s or dst == host_slot:
                        dst = None
                    y = self._new_xfer(_P2P, o, pu.task.id, s, dst)
                    y.need = 1
                    y.free_src = o.nbytes
                    if dst is not None:
                        y.alloc_dst = y.free_dst = o.nbytes
                    pu.end_xfers.append(y)
                elif o.channel == Channel.LOCAL and o.task in by_id and slot_of[by_id[o.task].device] == s:
                    self.units_of[o.task][-1].release_end += o.nbytes

    def _build_kept(self, graph: TaskGraph) -> None:
        """State kept on a device across iterations (``keep.py``) is there from time zero."""
        for device, n in memory.kept_bytes(graph, self.profile).items():
            s = self.slot_of[device]
            self.mem[s] += n
            self.peak[s] = max(self.peak[s], self.mem[s])

    def _build_state(self) -> None:
        """The streams, queues and counters at time zero."""
        nslots = self.nslots
        machine = self.machine
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.end_time = 0.0
        self.mem = [0] * nslots
        self.peak = [0] * nslots
        caps = [self.cap] * nslots
        caps[self.host_slot] = None
        self.caps = caps
        self.ptr = [0] * nslots
        self.computing = [False] * nslots
        self.busy_flag = [[False] * 5 for _ in range(nslots)]
        self.busy_time = [[0.0] * 5 for _ in range(nslots)]
        self.swap_in_q: list[list] = [[] for _ in range(nslots)]
        self.swap_out_q: list[deque] = [deque() for _ in range(nslots)]
        self.p2p_in_q: list[deque] = [deque() for _ in range(nslots)]
        self.p2p_out_q: list[deque] = [deque() for _ in range(nslots)]
        self.events: list[tuple] = []  # busy spans: (device, stream, task, unit or transfer, start, end)
        self.task_peak: dict[int, int] = {}  # task id -> device bytes at most from the previous task's end to its own
        self.prefetched: dict[int, int] = {}
        # On an emulated device the runtime's memory manager lets outputs still leaving the device (queued
        # swap-outs and sends) go before it lets an allocation past the plan's peak: there they are not
        # part of the peak the plan promises.
        self.reclaim = machine.kind == "cpu"
        self.stop_over = False
        self.outbound = [0] * nslots
        cores = machine.cpu_cores
        interference = machine.compute_interference
        if cores is None and interference:
            cores = math.inf  # no core sharing, but the rates still follow the units computing at once
        self.cores = cores
        self.interference = interference
        self.running: list[_Unit] = []  # units computing at this moment, sharing the cores
        self.cpu_last = 0.0  # time of the last rate change
        self.cpu_rate = 0.0  # the rate of each running unit since

    # ------------------------------------------------------------------------------ the event loop
    def release(self) -> None:
        """Cut the references from units and transfers to what they wait for and what waits for them:
        they form cycles, which the cyclic collector would otherwise have to find (in the first
        allocations after each estimate); without them the simulation goes by reference
        counting as soon as it is done. A recorded timeline keeps what it labels (a unit's task and
        microbatch, a transfer's consumer)."""
        for x in self.xfers:
            x.end_units = x.end_xfers = None
        for units in self.units_of.values():
            for u in units:
                u.end_units = u.end_xfers = u.issue = u.waits = u.fetch_on_start = u.fetch_on_end = None

    def run(self, beat: float | None = None) -> Estimate:
        """Time zero: everything issued and ready goes; then the events in time order (with ``beat``,
        until a device overflows or the clock passes it; see ``estimate``)."""
        self.stop_over = beat is not None and self.cap is not None
        try:
            return self.play(math.inf if beat is None else beat)
        except _Overflow:
            return self.result("over capacity")

    def play(self, beat: float) -> Estimate:
        enqueue = self.enqueue
        for x in self.xfers:
            if not x.need:
                enqueue(x)
        try_compute = self.try_compute
        for s in range(self.nslots):
            try_compute(s)
        heap = self.heap
        heappop = _heappop
        finish_unit, finish_xfer = self.finish_unit, self.finish_xfer
        link_join, cpu_done, link_done = self.link_join, self.cpu_done, self.link_done
        while heap:
            t, _, code, obj, ver = heappop(heap)
            if (code == _E_CPU or code == _E_LINK) and ver != obj.version:
                continue  # rescheduled since: its time is no event (nor a reason to stop)
            if t > beat:
                self.now = t
                return self.result("slower")
            self.now = t
            if code == _E_UNIT:
                finish_unit(obj)
            elif code == _E_XFER:
                finish_xfer(obj)
            elif code == _E_JOIN:
                link_join(obj)
            elif code == _E_CPU:
                cpu_done(obj)
            else:
                link_done(obj)
        return self.result()

    def push(self, t: float, code: int, obj, ver: int = 0) -> None:
        seq = self.seq + 1
        self.seq = seq
        _heappush(self.heap, (t, seq, code, obj, ver))

    def bump(self, s: int, tid: int | None) -> None:
        """Record slot ``s``'s level in its peak and in the peak of task ``tid`` (None: the task its
        compute thread runs or waits to run; the runtime measures a task's peak from the moment its
        predecessor ended)."""
        mem = self.mem
        level = mem[s] - self.outbound[s] if self.reclaim else mem[s]
        peak = self.peak
        if level > peak[s]:
            peak[s] = level
            if self.stop_over and s != self.host_slot and level > self.cap:
                raise _Overflow
        if tid is None:
            ptr = self.ptr
            p = ptr[s] - 1 if self.computing[s] else ptr[s]
            su = self.slot_units[s]
            if not 0 <= p < len(su):
                return
            tid = su[p].task.id
        task_peak = self.task_peak
        if level > task_peak.get(tid, -1):
            task_peak[tid] = level

    def try_compute(self, s: int) -> None:
        computing = self.computing
        if computing[s]:
            return
        su = self.slot_units[s]
        ptr = self.ptr
        p = ptr[s]
        if p >= len(su):
            return
        u = su[p]
        if u.need:
            return
        computing[s] = True
        ptr[s] = p + 1
        u.started = True
        tid = u.task.id
        mem = self.mem
        level = mem[s] - self.outbound[s] if self.reclaim else mem[s]
        task_peak = self.task_peak
        if level > task_peak.get(tid, -1):  # the level it starts from (the runtime resets its peak there)
            task_peak[tid] = level
        mem[s] += u.delta_start
        self.bump(s, tid)
        if u.fetch_on_start:
            self.fetch_waiting(u.fetch_on_start)
        now = self.now
        u.start = now
        if self.cores is None:
            seq = self.seq + 1
            self.seq = seq
            _heappush(self.heap, (now + u.dur, seq, _E_UNIT, u, 0))
        else:
            u.remaining = u.dur
            self.cpu_advance()
            self.running.append(u)
            self.cpu_reschedule()
        for x in u.issue:
            x.need -= 1
            if not x.need:
                self.enqueue(x)

    def cpu_advance(self) -> None:
        now = self.now
        dt = now - self.cpu_last
        running = self.running
        if dt > 0 and running:
            r = self.cpu_rate * dt
            for a in running:
                a.remaining -= r
        self.cpu_last = now

    def cpu_reschedule(self) -> None:
        running = self.running
        if not running:
            return
        k = len(running)
        rate = min(1.0, self.cores / k) / (1.0 + self.interference * (k - 1))
        self.cpu_rate = rate
        now = self.now
        heap = self.heap
        seq = self.seq
        for a in running:
            a.version += 1
            seq += 1
            _heappush(heap, (now + max(a.remaining, 0.0) / rate, seq, _E_CPU, a, a.version))
        self.seq = seq

    def enqueue(self, x: _Xfer) -> None:
        kind = x.kind
        if kind == _IN or kind == _MSG_IN:
            seq = self.seq + 1
            self.seq = seq
            dst = x.dst
            _heappush(self.swap_in_q[dst], (x.unit.order, seq, x))
            self.try_swap_in(dst)
        elif kind == _P2P:
            if x.src is not None:
                self.p2p_out_q[x.src].append(x)
            if x.dst is not None:
                self.p2p_in_q[x.dst].append(x)
            self.try_p2p(x)
        else:
            self.swap_out_q[x.src].append(x)
            self.try_swap_out(x.src)

    def try_swap_in(self, s: int) -> None:
        q = self.swap_in_q[s]
        flags = self.busy_flag[s]
        if flags[_SWAP_IN] or not q:
            return
        x = q[0][2]
        c = self.caps[s]
        if c is not None and not x.fetched and self.mem[s] + x.fit > c:
            # a prefetch that does not fit waits, unless the compute stream idles waiting for it
            if self.computing[s] or self.ptr[s] != x.unit.order:
                return
        _heappop(q)
        flags[_SWAP_IN] = True
        self.start(x)

    def try_swap_out(self, s: int) -> None:
        q = self.swap_out_q[s]
        flags = self.busy_flag[s]
        if flags[_SWAP_OUT] or not q:
            return
        x = q.popleft()
        flags[_SWAP_OUT] = True
        self.start(x)

    def try_p2p(self, x: _Xfer) -> None:
        src, dst = x.src, x.dst
        busy_flag = self.busy_flag
        if src is not None and (busy_flag[src][_P2P_OUT] or self.p2p_out_q[src][0] is not x):
            return
        if dst is not None and (busy_flag[dst][_P2P_IN] or self.p2p_in_q[dst][0] is not x):
            return
        if src is not None:
            self.p2p_out_q[src].popleft()
            busy_flag[src][_P2P_OUT] = True
        if dst is not None:
            self.p2p_in_q[dst].popleft()
            busy_flag[dst][_P2P_IN] = True
        self.start(x)

    def fetch(self, x: _Xfer) -> None:
        """The transfer's bytes land in its device's memory."""
        x.fetched = True
        d = x.dst
        self.mem[d] += x.alloc_dst
        self.bump(d, None)

    def fetch_waiting(self, xs: list[_Xfer]) -> None:
        for x in xs:
            if not x.fetched:
                self.fetch(x)

    def start(self, x: _Xfer) -> None:
        now = self.now
        x.start = now
        if x.unit is not None and x.unit.j == 0 and x.transfer.tensor in _STATE:
            before = self.last_unit_prev.get(x.task_id)
            if before is not None and not before.done:
                d = x.dst
                ptr = self.ptr
                at = self.slot_units[d][ptr[d] - 1 if self.computing[d] else ptr[d]]  # the unit computing, or next
                unit = at.j if at.task is before.task else 0
                prefetched = self.prefetched
                prefetched[x.task_id] = min(unit, prefetched.get(x.task_id, unit))
        if x.alloc_dst and x.fetch_after is None:
            self.fetch(x)
        link = x.link
        if link is None:
            seq = self.seq + 1
            self.seq = seq
            _heappush(self.heap, (now + x.dur, seq, _E_XFER, x, 0))
        else:
            x.remaining = float(x.nbytes)
            if x.fixed > 0:
                self.push(now + x.fixed, _E_JOIN, x, 0)
            else:
                self.join(link, x)

    def advance(self, link: _Link) -> None:
        now = self.now
        dt = now - link.last
        if dt > 0 and link.active:
            r = link.rate * dt
            for a in link.active:
                a.remaining -= r
        link.last = now

    def reschedule(self, link: _Link) -> None:
        active = link.active
        if not active:
            return
        rates = link.rates
        rate = rates[len(active)] if len(active) < len(rates) else self.machine.bandwidth(link.channel, len(active))
        link.rate = rate
        now = self.now
        heap = self.heap
        seq = self.seq
        for a in active:
            a.version += 1
            seq += 1
            _heappush(heap, (now + max(a.remaining, 0.0) / rate, seq, _E_LINK, a, a.version))
        self.seq = seq

    def join(self, link: _Link, x: _Xfer) -> None:
        self.advance(link)
        link.active.append(x)
        self.reschedule(link)

    # ------------------------------------------------------------------------------ events
    def link_join(self, x: _Xfer) -> None:
        """A host copy has paid its latency and joins its shared link."""
        self.join(x.link, x)

    def link_done(self, x: _Xfer) -> None:
        """A copy on a shared link has moved its last byte."""
        link = x.link
        self.advance(link)
        link.active.remove(x)
        self.reschedule(link)
        self.finish_xfer(x)

    def cpu_done(self, u: _Unit) -> None:
        """A unit sharing the cores has done its work."""
        self.cpu_advance()
        self.running.remove(u)
        self.cpu_reschedule()
        self.finish_unit(u)

    def finish_xfer(self, x: _Xfer) -> None:
        """A transfer has ended: its streams are free, its bytes leave, what waited for it may go."""
        x.done = True
        kind = x.kind
        src, dst = x.src, x.dst
        now = self.now
        if now > self.end_time:
            self.end_time = now
        # its streams are idle again; their busy time (and timeline) count it
        d = now - x.start
        busy_flag, busy_time = self.busy_flag, self.busy_time
        record = self.recording
        if kind == _IN or kind == _MSG_IN:
            busy_flag[dst][_SWAP_IN] = False
            busy_time[dst][_SWAP_IN] += d
            if record:
                self.events.append((self.slot_dev[dst], "swap-in", x.task_id, x, x.start, now))
        elif kind == _P2P:
            if src is not None:
                busy_flag[src][_P2P_OUT] = False
                busy_time[src][_P2P_OUT] += d
                if record:
                    self.events.append((self.slot_dev[src], "p2p-out", x.task_id, x, x.start, now))
            if dst is not None:
                busy_flag[dst][_P2P_IN] = False
                busy_time[dst][_P2P_IN] += d
                if record:
                    self.events.append((self.slot_dev[dst], "p2p-in", x.task_id, x, x.start, now))
        else:
            busy_flag[src][_SWAP_OUT] = False
            busy_time[src][_SWAP_OUT] += d
            if record:
                self.events.append((self.slot_dev[src], "swap-out", x.task_id, x, x.start, now))
        if x.free_src:  # an output that has left
            self.mem[src] -= x.free_src
            self.outbound[src] -= x.free_src
        if x.free_dst:
            self.mem[dst] -= x.free_dst
        for u in x.end_units:
            u.need -= 1
            if not u.need:
                self.try_compute(u.slot)
        for y in x.end_xfers:
            y.need -= 1
            if not y.need:
                self.enqueue(y)
        # the freed streams take their next transfer (and a swap-in waiting for the memory freed may go)
        if kind == _IN or kind == _MSG_IN:
            self.try_swap_in(dst)
        elif kind == _P2P:
            if src is not None:
                q = self.p2p_out_q[src]
                if q:
                    self.try_p2p(q[0])
                if x.free_src and self.swap_in_q[src]:
                    self.try_swap_in(src)
            if dst is not None:
                q = self.p2p_in_q[dst]
                if q:
                    self.try_p2p(q[0])
                if x.free_dst and self.swap_in_q[dst]:
                    self.try_swap_in(dst)
        else:
            self.try_swap_out(src)
            if x.free_src and self.swap_in_q[src]:
                self.try_swap_in(src)

    def finish_unit(self, u: _Unit) -> None:
        """A unit has ended: its outputs are produced, what waited for it may go, the next unit may start."""
        s = u.slot
        u.done = True
        self.computing[s] = False
        now = self.now
        if now > self.end_time:
            self.end_time = now
        self.busy_time[s][_COMPUTE] += now - u.start
        if self.recording:
            self.events.append((self.slot_dev[s], "compute", u.task.id, u, u.start, now))
        self.mem[s] += u.alloc_end - u.release_end
        self.outbound[s] += u.outbound_end
        self.bump(s, u.task.id)
        if u.fetch_on_end:
            self.fetch_waiting(u.fetch_on_end)
        for v in u.end_units:
            v.need -= 1
            if not v.need:
                self.try_compute(v.slot)
        for y in u.end_xfers:
            y.need -= 1
            if not y.need:
                self.enqueue(y)
        self.try_compute(s)
        if self.swap_in_q[s]:
            self.try_swap_in(s)

    # ------------------------------------------------------------------------------ results
    def result(self, cut: str | None = None) -> Estimate:
        nslots, slot_dev, slot_units, ptr = self.nslots, self.slot_dev, self.slot_units, self.ptr
        stuck = [s for s in range(nslots) if ptr[s] < len(slot_units[s])] if cut is None else []
        deadlock = (_describe_deadlock(stuck, slot_units, ptr, slot_dev, self.by_id, self.units_of)
                    if stuck else None)
        device_slots = [s for s in range(nslots) if slot_dev[s] != HOST]
        peak_memory = {slot_dev[s]: int(self.peak[s]) for s in device_slots}
        cap = self.cap
        fits = cap is None or all(v <= cap for v in peak_memory.values())
        busy = {}
        busy_time = self.busy_time
        for s in range(nslots):
            if slot_dev[s] == HOST and not any(busy_time[s]) and not slot_units[s]:
                continue
            busy[slot_dev[s]] = {name: busy_time[s][k] for k, name in enumerate(STREAMS)}
        by_id = self.by_id
        return Estimate(
            iteration_time=(math.inf if deadlock or cut == "over capacity" else
                            self.now if cut else self.end_time + self.machine.iteration_overhead),
            fits=fits,
            peak_memory=peak_memory,
            bytes_by_channel=self.bytes_by_channel,
            bytes_by_device={d: v for d, v in self.bytes_by_device.items() if v or d != HOST},
            busy=busy,
            deadlock=deadlock,
            events=_timeline(self.events) if self.recording == "now" else [],
            capacity=cap,
            task_peaks={t: int(v) for t, v in self.task_peak.items() if by_id[t].device != HOST},
            prefetched=self.prefetched,
            cut=cut,
            recorded=self.events if self.recording == "later" else None,
        )


def _timeline(recorded: list[tuple]) -> list[StreamEvent]:
    """The simulation's recorded busy spans as events in time order, each labelled: the labels are
    made here, once, not as the simulation plays."""
    events = [StreamEvent(device, stream, task, _unit_label(what) if isinstance(what, _Unit) else _xfer_label(what),
                          start, end) for device, stream, task, what, start, end in recorded]
    events.sort(key=lambda e: (e.start, e.end))
    return events


def _unit_label(u: _Unit) -> str:
    t = u.task
    name = t.kind.value + ("+loss" if t.loss else "")
    layers = f"L{t.first}" if t.first == t.last else f"L{t.first}-{t.last}"
    if t.kind == Kind.UPD:
        return f"{name} {layers}"
    if u.j >= len(t.microbatches):
        return f"UPD {layers}"
    return f"{name} {layers} mb{u.j} u={t.microbatches[u.j]}"


def _xfer_label(x: _Xfer) -> str:
    tr = x.transfer
    arrow = "->" if x.kind in (_OUT, _MSG_OUT) or (x.kind == _P2P and x.unit is None) else "<-"
    mb = f" mb{tr.microbatch}" if tr.microbatch is not None else ""
    return f"{tr.tensor}{arrow}{tr.channel.value}{mb} ({tr.nbytes} B)"


def _describe_deadlock(stuck, slot_units, ptr, slot_dev, by_id, units_of) -> str:
    parts = []
    for s in stuck:
        u = slot_units[s][ptr[s]]
        task = u.task
        what = f"task {task.id} ({task})"
        if len(task.microbatches) > 1 and u.j < len(task.microbatches):
            what = f"microbatch {u.j} of {what}"
        waits = []
        for transfer, k, obj in u.waits:
            if obj.done:
                continue
            src = ""
            if k is not None:
                producer = by_id[k]
                pu = units_of[k]
                ran = all(v.done for v in pu)
                if not ran:
                    state = "not yet computed"
                elif isinstance(obj, _Xfer) and obj.kind == _OUT:
                    state = "its swap-out has not ended"
                else:
                    state = "not yet delivered"
                src = f" from task {k} on {_where(producer.device)} ({state})"
            waits.append(f"{transfer.tensor} via {transfer.channel.value}{src}")
        reason = "; ".join(waits) if waits else "nothing it can name (a transfer never started)"
        parts.append(f"{_where(slot_dev[s])} waits to run {what} for {reason}")
    return "deadlock: " + " | ".join(parts)


def chrome_trace(est: Estimate) -> dict:
    """The estimate's timeline in Chrome trace format (open in Perfetto): one process per device,
    one thread per stream, times in microseconds."""
    return {"traceEvents": trace_events(est.events), "displayTimeUnit": "ms"}


def trace_events(events: list[StreamEvent], pid_base: int = 0, suffix: str = "") -> list[dict]:
    """Chrome trace events of ``events``: device ``d`` is process ``pid_base + d`` named
    ``dev{d}{suffix}``, each stream one of its threads (so that two timelines, estimated and
    measured, can share one file)."""
    trace = []
    for d in sorted({e.device for e in events}):
        pid = pid_base + d
        trace.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{_where(d)}{suffix}"}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for k, name in enumerate(STREAMS):
            trace.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": k, "args": {"name": name}})
    tid = {name: k for k, name in enumerate(STREAMS)}
    for e in events:
        trace.append({
            "ph": "X", "name": e.label, "pid": pid_base + e.device, "tid": tid[e.stream],
            "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": {"task": e.task},
        })
    return trace
