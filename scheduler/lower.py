"""Lowering: a task graph becomes one ordered action list per device and stream (the program).

A :class:`~harmony.scheduler.tasks.TaskGraph` says what each task reads and writes; it leaves open
which sample ranges travel between two tasks of different microbatch sizes, which stream carries
each copy, and in which order. Lowering decides those once, so that whoever plays the plan (the
estimator simulating it, the executor running it, a test comparing the two) reads the same answer
instead of deriving its own. Modelled on ``torch.distributed.pipelining``'s per-rank ``_Action``
lists, with the five streams of a Harmony device and host-memory swaps.

- **Edges.** Every activation or gradient that moves from one task to another is cut into
  *pieces*: the overlap of one producer microbatch and one consumer microbatch (``U_F != U_B``
  makes one producer microbatch feed several consumer microbatches, or the reverse). Each piece is
  an :class:`Edge` with an id; its send and its receive name that id. An edge is keyed, as the
  executor keys its messages, by (consumer task, stream, first sample).
- **Streams.** ``compute`` (a task's units: each microbatch, then a fused update), ``swap-in``
  (pack state and host-parked activations onto the device), ``swap-out`` (activations parked in
  host memory, state and gradients leaving), ``p2p-in`` and ``p2p-out`` (device to device).
  ``LOCAL`` edges stay on the device: their send and receive are on ``compute``.
- **Order.** Per stream, actions are listed in the order the runtime issues them: a task's first
  microbatch's inputs when it starts, each later microbatch's while the one before computes, the
  next task's state at the unit the memory promise chose (``MemoryPlan.prefetch``), else when
  that task starts. A graph without a promise has no program (``NO_PROMISE``).

Each action prints as one short line (``t3.1 RECV X e12 <-dev0 4.0K``), a program as one block per
device and stream; ``harmony show PLAN --program`` prints it, ``Program.save`` writes it to the plan
directory as versioned msgpack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from harmony import serialization
from harmony.errors import FormatError
from harmony.profiling.profiles import Profile
from harmony.scheduler.tasks import HOST, Channel, Kind, Task, TaskGraph
from harmony.scheduler.memory import is_kept, running_gradient_input

__all__ = ["Action", "Edge", "Piece", "Program", "PROGRAM_FILE", "STREAMS", "buffer_chain", "gradient_gathers", "lower",
           "ownership", "pieces", "ranges", "stash_layers", "state_sources", "stream_layer", "stream_names", "IN_STREAM", "OUT_STREAM"]

SCHEMA_VERSION = 4  # 2: LOADs name their source; Program.sources, Program.after. 3: Program.tasks. 4: Action.seq,
# Program.gathers, the parameters' ownership (owner, updates, deposits, replicas, resident)
PROGRAM_FILE = "program.msgpack"
NO_PROMISE = ("a task graph without a memory promise (TaskGraph.memory) has no program: where each task's "
              "state is loaded is the promise's choice. Attach one with harmony.scheduler.estimator.promise(graph, "
              "profile, machine, capacity), or for a Plan plan.promise_memory()")
STREAMS = ("compute", "swap-in", "swap-out", "p2p-in", "p2p-out")


@dataclass(frozen=True)
class Piece:
    """Samples [start, stop) (minibatch positions) of producer microbatch ``src`` and consumer
    microbatch ``dst``."""

    src: int
    dst: int
    start: int
    stop: int


def ranges(task: Task) -> list[tuple[int, int]]:
    """(first sample, size) of each microbatch of the task's group."""
    out, start = [], task.offset
    for size in task.microbatches:
        out.append((start, size))
        start += size
    return out


def pieces(producer: Task, consumer: Task) -> list[Piece]:
    """The overlaps of the producer's and the consumer's microbatches, in producer order."""
    return [Piece(*o) for o in _overlaps(ranges(producer), ranges(consumer))]


def _overlaps(src: list[tuple[int, int]], dst: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """(producer microbatch, consumer microbatch, start, stop) of each overlap of two tasks'
    ``ranges``, in producer order. Both lists run up the samples without gaps (``ranges``), so one
    walk along the two finds every overlap: a search lowers thousands of these pairs, with up to a
    minibatch of microbatches on each side."""
    out = []
    i = j = 0
    while i < len(src) and j < len(dst):
        a, n = src[i]
        b, m = dst[j]
        end, other = a + n, b + m
        lo = a if a > b else b
        hi = end if end < other else other
        if lo < hi:
            out.append((i, j, lo, hi))
        if end < other:
            i += 1
        else:
            j += 1
    return out


def stash_layers(task: Task) -> list[int]:
    """Layers whose stashed input a BWD task reads: the pack's first layer (recompute), or every
    layer of the pack when the plan stashes them all (the no-recompute baselines); none where the
    forward kept the activations (``Task.keep``)."""
    if task.kind != Kind.BWD or task.loss or task.keep:
        return []
    per_mb = [t for t in task.inputs if t.tensor in ("X", "Xs") and t.microbatch in (0, None) and t.channel == Channel.SWAP]
    span = task.last - task.first + 1
    return list(range(task.first, task.last + 1)) if len(per_mb) == span and span > 1 else [task.first]


def stream_layer(task: Task, stream: str) -> int:
    """The layer boundary a stream of ``task`` is taken at: its input (X), its output gradient
    (dY, at the boundary after its last layer), a stash before layer l (Xs<l>), or the activations
    its forward kept (A, As: once the pack's forward is done, after its outputs)."""
    if stream in ("dY", "A", "As"):
        return task.last + 1
    if stream.startswith("Xs"):
        return int(stream[2:])
    return task.first


@dataclass(frozen=True)
class InStream:
    """An input stream of a task: its name, the task producing it (None: the minibatch in host
    memory) and the channel it arrives on."""

    name: str
    producer: int | None
    channel: Channel


_READ_WHOLE = frozenset(("dY", "A", "As"))  # streams a task reads under their own name, whoever made them


def stream_names(task: Task) -> list[tuple[int, str]]:
    """(index in ``task.inputs``, stream name) of each activation or gradient input (X, Xs, dY) of
    a FWD or BWD task, of every microbatch: ``X`` for a FWD or loss task, ``dY``, and for a
    backward's stashes ``Xs<layer>``, the n-th stash of a microbatch being of the n-th of its
    ``stash_layers`` (a microbatch of None counts as the first)."""
    kind = task.kind
    if kind == Kind.UPD:
        return []
    out: list[tuple[int, str]] = []
    plain = task.loss or kind == Kind.FWD  # its X is the pack's input, not a stash
    layers: list[int] | None = None
    seen: dict[int, int] = {}  # microbatch -> stashes named so far
    for index, t in enumerate(task.inputs):
        tensor = t.tensor
        if tensor in _READ_WHOLE:
            out.append((index, tensor))
        elif tensor == "X" or tensor == "Xs":
            if plain:
                out.append((index, "X"))
                continue
            if layers is None:
                layers = stash_layers(task)
            mb = t.microbatch or 0
            position = seen.get(mb, 0)
            seen[mb] = position + 1
            out.append((index, f"Xs{layers[position] if len(layers) > 1 and position < len(layers) else task.first}"))
    return out


def input_streams(task: Task) -> list[InStream]:
    """The activation and gradient streams a FWD or BWD task reads, in the order it reads them."""
    return [InStream(*s) for s in _first_reads(task)]


def _first_reads(task: Task, names: list[tuple[int, str]] | None = None) -> list[tuple[str, int | None, Channel]]:
    """(name, producer, channel) of each stream a task reads, from its first microbatch's input
    (``names``: the task's ``stream_names``)."""
    out: dict[str, tuple[str, int | None, Channel]] = {}
    inputs = task.inputs
    for index, name in stream_names(task) if names is None else names:
        t = inputs[index]
        if name not in out and t.microbatch in (0, None):
            out[name] = (name, t.task, t.channel)
    return list(out.values())


def read_order(task: Task) -> list[str]:
    """The streams a task's microbatch loop reads, in the runtime's order."""
    if task.kind == Kind.FWD or task.loss:
        return ["X"]
    if task.keep:
        return ["dY", "A", "As"] if task.swaps() else ["dY", "A"]
    return ["dY"] + [f"Xs{layer}" for layer in stash_layers(task)]


# ------------------------------------------------------------------------------------ the IR
@dataclass(frozen=True)
class Edge:
    """One piece of an activation or gradient moving from a producer task to a consumer task.
    ``stream`` is the consumer's name for it (X, dY, Xs<layer>, A: activations a forward kept for
    its pack's backward, As: those it swapped); ``producer`` None is the minibatch in host memory."""

    id: int
    stream: str
    channel: str
    producer: int | None
    src_unit: int | None
    consumer: int
    dst_unit: int
    start: int
    stop: int
    nbytes: int
    src_device: int | None
    dst_device: int
    layer: int  # the layer boundary the producer takes it at (see ``stream_layer``)

    @property
    def key(self) -> tuple[int, str, int]:
        """What the runtime names the message by: (consumer, stream, first sample)."""
        return (self.consumer, self.stream, self.start)


@dataclass(frozen=True)
class Action:
    """One step of one stream of one device. ``op``: FWD, BWD, UPD (compute units: ``unit`` is
    the microbatch, or the fused update's index after them); SEND and RECV of an ``edge``; LOAD
    and STORE of a pack's state (``tensor`` W, B, K or dW), a LOAD naming the task whose output it
    reads (``Program.sources``)."""

    stream: str
    op: str
    task: int
    unit: int | None = None
    tensor: str = ""
    edge: int | None = None
    nbytes: int = 0
    peer: int | None = None
    src: int | None = None  # a LOAD's: the task whose output it reads (None: the host store's initial copy)
    seq: int = -1  # its place in its device's issue order, over all streams (``Program.issue_order``)

    def __str__(self) -> str:
        where = f"t{self.task}" + (f".{self.unit}" if self.unit is not None else "")
        parts = [where, self.op]
        if self.tensor:
            parts.append(self.tensor)
        if self.edge is not None:
            parts.append(f"e{self.edge}")
        if self.src is not None:
            parts.append(f"<-t{self.src}")
        if self.peer is not None:
            arrow = "->" if self.op == "SEND" else "<-"
            parts.append(f"{arrow}{'host' if self.peer == HOST else f'dev{self.peer}'}")
        if self.nbytes:
            parts.append(_size(self.nbytes))
        return " ".join(parts)


def _size(n: int) -> str:
    for unit, scale in (("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


@dataclass
class Program:
    """Per device (``HOST`` for offloaded updates), per stream, the ordered actions; the edges they
    name; and the per-device peak the plan reserves."""

    mode: str
    edges: list[Edge]
    streams: dict[int, dict[str, list[Action]]]
    peaks: dict[int, int] = field(default_factory=dict)
    # (consumer, input index) -> (producer, output index) of every input that is not an edge and
    # that a task of the graph produced: pack state, optimizer state, gradients (``state_sources``)
    sources: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    # task -> the earlier task whose buffers it continues: its state loads once that one is done
    after: dict[int, int] = field(default_factory=dict)
    tasks: str = ""  # the fingerprint of the task graph it was lowered from (``TaskGraph.fingerprint``)
    # update (UPD) or norm task -> the backward tasks whose gradients it reads: it runs once they are done
    gathers: dict[int, list[int]] = field(default_factory=dict)
    # who steps each trainable parameter and where its gradients go (``ownership``; empty when lowered
    # without the layer graph's parameters, as a search's edges-only lowering is)
    owner: dict[str, int] = field(default_factory=dict)  # parameter -> its lowest holding layer (model order)
    updates: dict[int, list[str]] = field(default_factory=dict)  # task -> parameters it steps
    deposits: dict[int, list[str]] = field(default_factory=dict)  # task -> parameters whose gradient it leaves in host memory
    replicas: dict[int, list[int]] = field(default_factory=dict)  # device UPD task -> every UPD task of its pack
    resident: list[int] = field(default_factory=list)  # tasks whose pack state a later task reads LOCAL

    def __post_init__(self) -> None:
        into: dict[tuple[int, str, int], list[Edge]] = {}
        for e in self.edges:
            key = (e.consumer, e.stream, e.dst_unit)
            if key in into:
                into[key].append(e)
            else:
                into[key] = [e]
        self._into = into
        self._out: dict[tuple[int, int], list[Edge]] | None = None  # built on first use
        self._reads: dict[int, list[tuple[int, str]]] = {}  # task id -> its stream_names, from lowering

    def gradient_slots(self, graph: TaskGraph) -> set[tuple[int, str]]:
        """(device, parameter) of every host gradient slot a task deposits into: the host store
        needs no other (in pp each pack's backward runs on one device, so one slot per parameter,
        where a slot for every device would hold the weights' size once per device)."""
        device = {t.id: t.device for t in graph.tasks}
        return {(device[t], p) for t, params in self.deposits.items() for p in params}

    def kept_writes(self, graph: TaskGraph, rank: int) -> list[str]:
        """The parameters whose kept state (``scheduler/keep.py``) device ``rank`` writes back to the
        host store: those its kept tasks step, where it is the lowest of the replicas stepping them
        (dp keeps a replica on every device; one writes it)."""
        device = {t.id: t.device for t in graph.tasks}
        names: list[str] = []
        for task in graph.tasks:
            if task.device != rank or not is_kept(task) or task.id not in self.updates:
                continue
            if rank == min(device[t] for t in self.replicas.get(task.id, [task.id])):
                names += [n for n in self.updates[task.id] if n not in names]
        return names

    def reads(self, task: Task) -> list[tuple[int, str]]:
        """(index in ``task.inputs``, stream) of each activation or gradient input of ``task``
        (``stream_names``; remembered from lowering)."""
        names = self._reads.get(task.id)
        return stream_names(task) if names is None else names

    def into(self, consumer: int, stream: str, unit: int) -> list[Edge]:
        """The pieces a consumer's microbatch ``unit`` of ``stream`` is assembled from, in order."""
        return self._into.get((consumer, stream, unit), [])

    def out_of(self, producer: int, unit: int) -> list[Edge]:
        """What a producer's unit sends, in the order it makes it (a stable sort by the layer
        boundary keeps consumers in graph order)."""
        if self._out is None:
            out: dict[tuple[int, int], list[Edge]] = {}
            for e in self.edges:
                if e.producer is not None:
                    out.setdefault((e.producer, e.src_unit), []).append(e)
            for made in out.values():  # stashes at the layer they are taken before, then outputs
                made.sort(key=lambda e: e.layer)
            self._out = out
        return self._out.get((producer, unit), [])

    def actions(self, device: int, stream: str) -> list[Action]:
        return self.streams.get(device, {}).get(stream, [])

    def issue_order(self, device: int) -> list[Action]:
        """The device's actions over all its streams in the order its compute thread reaches them:
        a unit's own reads as it comes to the unit, the next microbatch's and the next task's
        state as the unit starts, sends and stores once the unit has ended."""
        return sorted((a for acts in self.streams.get(device, {}).values() for a in acts), key=lambda a: a.seq)

    def prefetches(self, device: int) -> dict[tuple[int, int], int]:
        """(task, unit) -> the task whose state (W, B) the device loads ahead while that unit
        computes: a LOAD listed before another task's unit. The runtime issues it as the unit starts."""
        out: dict[tuple[int, int], int] = {}
        loads: list[Action] = []
        for a in self.issue_order(device):
            if a.op == "LOAD" and a.tensor in ("W", "B"):
                loads.append(a)
            elif a.stream == "compute" and a.op not in ("SEND", "RECV"):
                for load in loads:
                    if load.task != a.task:
                        out[(a.task, a.unit)] = load.task
                loads = []
        return out

    def transfers(self, device: int, stream: str) -> list[tuple[str, int, int]]:
        """(op, edge, bytes) of the edge actions on a stream, in order: what two players of the
        program must agree on."""
        return [(a.op, a.edge, a.nbytes) for a in self.actions(device, stream) if a.edge is not None]

    def __str__(self) -> str:
        return self.text()

    def text(self, device: int | None = None) -> str:
        """The printout: a heading, then per device (only ``device``, if given) one line per stream."""
        lines = [f"program: {self.mode}, {len(self.edges)} edges"]
        for device in sorted(self.streams if device is None else [device], key=lambda d: (d == HOST, d)):
            name = "host" if device == HOST else f"dev{device}"
            peak = self.peaks.get(device)
            lines.append(f"{name}" + (f" (peak {_size(peak)})" if peak else "") + ":")
            for stream in STREAMS:
                acts = self.actions(device, stream)
                if acts:
                    lines.append(f"  {stream}: " + " | ".join(str(a) for a in acts))
        return "\n".join(lines)

    # ------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {"mode": self.mode, "edges": [asdict(e) for e in self.edges],
                "streams": {str(d): {s: [asdict(a) for a in acts] for s, acts in per.items()}
                            for d, per in self.streams.items()},
                "peaks": {str(d): int(p) for d, p in self.peaks.items()},
                "sources": [[c, i, p, o] for (c, i), (p, o) in sorted(self.sources.items())],
                "after": [[t, e] for t, e in sorted(self.after.items())], "tasks": self.tasks,
                "gathers": [[t, list(g)] for t, g in sorted(self.gathers.items())],
                "owner": dict(self.owner), "updates": [[t, list(n)] for t, n in sorted(self.updates.items())],
                "deposits": [[t, list(n)] for t, n in sorted(self.deposits.items())],
                "replicas": [[t, list(r)] for t, r in sorted(self.replicas.items())], "resident": list(self.resident)}

    @classmethod
    def from_dict(cls, body: dict) -> "Program":
        return cls(mode=body["mode"], edges=[Edge(**e) for e in body["edges"]],
                   streams={int(d): {s: [Action(**a) for a in acts] for s, acts in per.items()}
                            for d, per in body["streams"].items()},
                   peaks={int(d): int(p) for d, p in body.get("peaks", {}).items()},
                   sources={(int(c), int(i)): (int(p), int(o)) for c, i, p, o in body.get("sources", [])},
                   after={int(t): int(e) for t, e in body.get("after", [])}, tasks=str(body["tasks"]),
                   gathers={int(t): [int(b) for b in g] for t, g in body["gathers"]},
                   owner={str(p): int(l) for p, l in body["owner"].items()},
                   updates={int(t): [str(n) for n in names] for t, names in body["updates"]},
                   deposits={int(t): [str(n) for n in names] for t, names in body["deposits"]},
                   replicas={int(t): [int(r) for r in rs] for t, rs in body["replicas"]},
                   resident=[int(t) for t in body["resident"]])

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / PROGRAM_FILE
        serialization.save(path, "program", SCHEMA_VERSION, self.to_dict())
        return path

    @classmethod
    def load(cls, directory: str | Path, tasks: TaskGraph | None = None) -> "Program":
        """The program in a plan directory; given ``tasks``, refused unless it was lowered from
        them: the program is what the workers run, so it must be the plan's."""
        path = Path(directory) / PROGRAM_FILE
        if not path.exists():
            raise FormatError(f"{path} is missing: a plan's workers run its program, saved beside its tasks; "
                              "compile the plan again")
        body = serialization.load(path, "program", SCHEMA_VERSION)
        with serialization.decoding(str(path), "program"):
            program = cls.from_dict(body)
        if tasks is not None and program.tasks != tasks.fingerprint():
            raise FormatError(f"{path} was lowered from other tasks than the plan's (task graph "
                              f"{program.tasks[:12]}…, the plan's {tasks.fingerprint()[:12]}…); compile the plan again")
        return program


# ------------------------------------------------------------------------------- lowering
def _edge_bytes(profile: Profile | None, stream: str, consumer: Task, samples: int) -> int:
    """The profile's bytes of ``samples`` samples of a stream (0 without a profile: a worker needs
    the edges' structure, not their sizes)."""
    if profile is None:
        return 0
    if stream == "A":  # what stays on the device: all of them, or where the pack swaps, its input and output
        kept = profile.pack_kept_bytes(consumer.first, consumer.last, samples)
        if consumer.swaps():
            kept -= profile.pack_swapped_bytes(consumer.first, consumer.last, samples)
        return kept
    if stream == "As":
        return profile.pack_swapped_bytes(consumer.first, consumer.last, samples)
    layer = stream_layer(consumer, stream)
    at = profile.layers[layer - 1] if stream == "dY" else profile.layers[layer]
    return int(round(at.at("y_bytes" if stream == "dY" else "x_bytes", samples)))


_EDGE_FIELDS = tuple(f.name for f in fields(Edge))


def _edge(values: tuple, _new=object.__new__, _fields=_EDGE_FIELDS) -> Edge:
    """``Edge(*values)`` without the frozen dataclass's field-by-field ``object.__setattr__``: the
    estimator lowers every graph the search tries, thousands of edges each time."""
    e = _new(Edge)
    e.__dict__.update(zip(_fields, values))
    return e


def _edges(graph: TaskGraph, profile: Profile | None,
           reads: dict[int, list[tuple[int, str]]] | None = None) -> list[Edge]:
    """The edges of ``graph``; each task's ``stream_names`` go into ``reads`` when given."""
    by_id = {t.id: t for t in graph.tasks}
    edges: list[Edge] = []
    swap = Channel.SWAP.value
    spans: dict[int, list[tuple[int, int]]] = {}  # task id -> ranges
    for task in graph.tasks:
        names = stream_names(task)
        if reads is not None:
            reads[task.id] = names
        streams = _first_reads(task, names)
        if not streams:
            continue
        dst = spans.get(task.id)
        if dst is None:
            dst = spans[task.id] = ranges(task)
        consumer, device = task.id, task.device
        for name, producer_id, channel in streams:
            layer = stream_layer(task, name)
            if producer_id is None:
                for j, (start, size) in enumerate(dst):
                    nbytes = 0 if profile is None else _edge_bytes(profile, name, task, size)
                    edges.append(_edge((len(edges), name, swap, None, None, consumer, j, start, start + size, nbytes,
                                        None, device, layer)))
                continue
            producer = by_id[producer_id]
            src = spans.get(producer_id)
            if src is None:
                src = spans[producer_id] = ranges(producer)
            channel = channel.value
            for i, j, start, stop in _overlaps(src, dst):
                nbytes = 0 if profile is None else _edge_bytes(profile, name, task, stop - start)
                edges.append(_edge((len(edges), name, channel, producer_id, i, consumer, j, start, stop, nbytes,
                                    producer.device, device, layer)))
    return edges


# the program stream each channel's copies run on (keys: channel names; a ``Channel`` looks up alike)
IN_STREAM = {Channel.P2P.value: "p2p-in", Channel.SWAP.value: "swap-in", Channel.MSG.value: "swap-in",
              Channel.LOCAL.value: "compute"}
OUT_STREAM = {Channel.P2P.value: "p2p-out", Channel.SWAP.value: "swap-out", Channel.MSG.value: "swap-out",
               Channel.LOCAL.value: "compute"}


_ACTIVATIONS = frozenset(("X", "Y", "Xs", "dX", "dY", "A", "As"))
_HOSTLIKE = frozenset((Channel.SWAP, Channel.MSG, Channel.SHM))
# which inputs may read which outputs: copies through host memory are one group whatever the channel
_GROUP = {Channel.P2P: "p2p", Channel.LOCAL: "local", Channel.SWAP: "host", Channel.MSG: "host", Channel.SHM: "host"}


class _Outputs:
    """Every output that is not an activation, indexed by who may read it: a consumer it names
    (by microbatch, and by any microbatch), or the host store (outputs naming no task of the
    graph). Entries are ``[producer, output index, transfer, read]``."""

    def __init__(self, graph: TaskGraph) -> None:
        ids = {t.id for t in graph.tasks}
        self.by_mb: dict[tuple, list[list]] = {}  # (producer, consumer, group, microbatch)
        self.by_consumer: dict[tuple, list[list]] = {}  # (producer, consumer, group)
        self.host_mb: dict[tuple, list[list]] = {}  # (producer, microbatch): naming no task
        self.host: dict[int, list[list]] = {}  # producer: naming no task
        for task in graph.tasks:
            for n, o in enumerate(task.outputs):
                entry = [task.id, n, o, False]
                if o.task is not None and o.task in ids:
                    if o.tensor not in _ACTIVATIONS:
                        group = _GROUP[o.channel]
                        self.by_mb.setdefault((task.id, o.task, group, o.microbatch), []).append(entry)
                        self.by_consumer.setdefault((task.id, o.task, group), []).append(entry)
                else:
                    self.host.setdefault(task.id, []).append(entry)
                    self.host_mb.setdefault((task.id, o.microbatch), []).append(entry)

    def read_by(self, producer: int, consumer: int, i) -> list | None:
        """The output of ``producer`` that ``consumer``'s input ``i`` reads: an unread one naming the
        consumer, of ``i``'s microbatch first, the same tensor first; else one left in the host store."""
        group = _GROUP[i.channel]
        for candidates in (self.by_mb.get((producer, consumer, group, i.microbatch), ()),
                           self.by_consumer.get((producer, consumer, group), ())):
            fallback = None
            for entry in candidates:
                if not entry[3]:
                    if entry[2].tensor == i.tensor:
                        return entry
                    if fallback is None:
                        fallback = entry
            if fallback is not None:
                return fallback
        return self._in_host(producer, i) if group == "host" else None

    def _in_host(self, producer: int, i) -> list | None:
        """An output of the same tensor to the host store: of the same microbatch first, else the
        last task-wide one, else the last the producer wrote."""
        for entry in self.host_mb.get((producer, i.microbatch), ()):
            o = entry[2]
            if o.channel in _HOSTLIKE and o.tensor == i.tensor:
                return entry
        best, best_score = None, -1
        for entry in self.host.get(producer, ()):
            o = entry[2]
            if o.channel in _HOSTLIKE and o.tensor == i.tensor:
                score = o.microbatch is None
                if score >= best_score:
                    best, best_score = entry, score
        return best


def state_sources(graph: TaskGraph, reads: dict[int, list[tuple[int, str]]] | None = None
                  ) -> dict[tuple[int, int], tuple[int, int]]:
    """Which output each input that is not an edge reads (pack state, optimizer state, gradients):
    (consumer, input index) -> (producer, output index). A task graph names the producer task of
    an input, not which of its outputs; an output naming the consumer is read once, so two inputs
    of one tensor (a tied weight's two shares) read two outputs. Inputs reading the host store's
    initial copy (no producer) have none."""
    outputs = _Outputs(graph)
    ids = {t.id for t in graph.tasks}
    sources: dict[tuple[int, int], tuple[int, int]] = {}
    for task in graph.tasks:
        edges = {n for n, _ in (reads.get(task.id) if reads is not None and task.id in reads else stream_names(task))}
        for n, i in enumerate(task.inputs):
            if n in edges or i.task is None or i.task not in ids:
                continue
            entry = outputs.read_by(i.task, task.id, i)
            if entry is not None:
                if entry[2].task is not None:
                    entry[3] = True
                sources[(task.id, n)] = (entry[0], entry[1])
    return sources


def buffer_chain(graph: TaskGraph) -> dict[int, int]:
    """Tasks whose forward updates buffers (BatchNorm statistics) update them in the plan's order,
    which lists microbatches in minibatch order, as eager training does: each task writing buffers
    -> the previous writer of any of its layers' buffers (on any device). Its state (weights and
    buffers, loaded together) is not loaded until that writer is done, outputs gone: it would
    otherwise read statistics one microbatch old."""
    after: dict[int, int] = {}
    writers: list[Task] = []
    for task in graph.tasks:
        # (buffers kept on a device change there, in the device's order of tasks: no chain to wait on)
        if not any(t.tensor == "B" and t.channel == Channel.SWAP for t in task.outputs):
            continue
        for earlier in reversed(writers):
            if earlier.first <= task.last and task.first <= earlier.last:
                after[task.id] = earlier.id
                break
        writers.append(task)
    return after


def gradient_gathers(graph: TaskGraph, program: Program) -> dict[int, list[int]]:
    """Each task that steps or sums gradients -> the tasks it waits for, done (their gradients in
    host memory): a NORM task every task it reads; an update (a UPD task, or the fused step of a
    backward stepping its own pack) the tasks depositing a gradient of a parameter it steps (every
    replica's, in data parallel; a tied weight's from another pack), by the program's ownership,
    or without one (a search's lowering) the backwards over its layers; and the tasks it reads
    through shared memory (the norm an update of a clipped plan scales by)."""
    backwards = [b for b in graph.tasks if b.kind == Kind.BWD and not b.jit_update()]
    depositors: dict[str, set[int]] = {}
    for t, names in program.deposits.items():
        for name in names:
            depositors.setdefault(name, set()).add(t)
    out: dict[int, list[int]] = {}
    for task in graph.tasks:
        if task.kind == Kind.NORM:
            waits = task.deps()
        elif task.kind == Kind.UPD or task.id in program.updates:
            if program.owner:
                waits = set().union(*(depositors.get(name, ()) for name in program.updates.get(task.id, ())))
            else:
                waits = {b.id for b in backwards if b.first <= task.last and task.first <= b.last}
            waits |= {t.task for t in task.inputs if t.channel == Channel.SHM and t.task is not None}
        else:
            continue
        waits.discard(task.id)
        out[task.id] = sorted(waits)
    return out


def ownership(program: Program, graph: TaskGraph, params: dict[str, list[int]]) -> None:
    """Who steps each trainable parameter and who leaves its gradient where, from ``params`` (each
    trainable parameter's canonical name, in the model's order, and the layers holding it):

    - a parameter is its lowest holding layer's (``owner``): the pack holding that layer steps it;
    - a UPD task steps the parameters its pack owns; a backward stepping its own pack at once
      (``jit_update``) steps them too, and leaves a tied weight another pack owns in host memory
      for that pack's update;
    - every other backward leaves all its parameters' gradients in its device's host slots
      (``deposits``), which the update sums;
    - the UPD tasks of one pack on several devices (data parallel) are replicas of one update
      (``replicas``): each steps, the lowest writes the master;
    - a pack state a later task reads LOCAL stays resident (``resident``).

    A plan stepping on a device a weight it moves as a low-precision copy is refused: the step
    needs the float32 master there."""
    program.owner = {name: min(layers) for name, layers in params.items()}
    for task in graph.tasks:
        inside = [p for p, layers in params.items() if any(task.first <= l <= task.last for l in layers)]
        owned = [p for p in inside if task.first <= program.owner[p] <= task.last]
        if task.kind == Kind.UPD:
            program.updates[task.id] = owned
        elif task.kind == Kind.BWD and task.jit_update():
            program.updates[task.id] = owned
            program.deposits[task.id] = [p for p in inside if p not in owned]
        elif task.kind == Kind.BWD:
            program.deposits[task.id] = inside
        low = sorted(set(program.updates.get(task.id, ())) & set(graph.low_copies)) if task.device != HOST else []
        if low:
            raise ValueError(f"task {task.id} is to step {', '.join(low)} on a device, but the plan moves them as "
                             "low-precision copies; the plan is inconsistent: compile it again")
    packs: dict[tuple[int, int], list[int]] = {}
    for task in graph.tasks:
        if task.kind == Kind.UPD and task.device != HOST:
            packs.setdefault((task.first, task.last), []).append(task.id)
    program.replicas = {t: ids for ids in packs.values() for t in ids}
    program.resident = sorted({t.task for task in graph.tasks for t in task.inputs
                               if t.tensor == "W" and t.channel == Channel.LOCAL and t.task is not None})


def lower(graph: TaskGraph, profile: Profile | None, streams: bool = True,
          params: dict[str, list[int]] | None = None) -> Program:
    """The program of ``graph``: its edges and, per device and stream, the ordered actions (edge
    bytes from ``profile``; 0 without one). ``streams=False`` lowers the edges alone (no actions):
    who sends what to whom, all a player that orders the streams itself needs (the estimator).
    The actions need the graph's memory promise: it says where each task's state is loaded.
    ``params`` (``LayerGraph.parameter_layers``): the trainable parameters and the layers holding
    them, whose ownership a program to run needs (``ownership``)."""
    if streams and graph.memory is None:
        raise ValueError(NO_PROMISE)
    reads: dict[int, list[tuple[int, str]]] = {}
    program = Program(graph.mode, _edges(graph, profile, reads), {},
                      dict(graph.memory.devices) if graph.memory is not None else {})
    if streams:  # (the estimator's edges-only lowering of every graph the search tries needs no fingerprint)
        program.tasks = graph.fingerprint()
    program._reads = reads
    program.sources = state_sources(graph, reads)
    program.after = buffer_chain(graph)
    if params is not None:
        ownership(program, graph, params)
    program.gathers = gradient_gathers(graph, program)
    if not streams:
        return program
    b = _Builder(graph, program, graph.memory.prefetch)
    for device in b.streams:
        tasks = graph.device_tasks(device)
        for i, task in enumerate(tasks):
            b.task(task, tasks[i + 1] if i + 1 < len(tasks) else None)
    program.streams = b.streams
    return program


def _loads(task: Task, names: tuple[str, ...], sources: dict[tuple[int, int], tuple[int, int]]) -> list[Action]:
    """LOADs of the task's inputs of ``names`` from host memory, each naming the task it reads."""
    return [Action("swap-in", "LOAD", task.id, tensor=t.tensor, nbytes=t.nbytes,
                   src=sources[(task.id, n)][0] if (task.id, n) in sources else None)
            for n, t in enumerate(task.inputs) if t.tensor in names and t.channel == Channel.SWAP and t.nbytes]


def _state_loads(task: Task, sources: dict[tuple[int, int], tuple[int, int]]) -> list[Action]:
    """The pack state a task brings onto its device from host memory (nothing for LOCAL state);
    an update also its optimizer state and summed gradient."""
    return _loads(task, ("W", "B", "K", "dW") if task.kind == Kind.UPD else ("W", "B"), sources)


def _update_loads(task: Task, sources: dict[tuple[int, int], tuple[int, int]]) -> list[Action]:
    """What a fused update brings in once its backward is done: optimizer state (and a running
    gradient kept in host memory)."""
    return _loads(task, ("K",), sources)


_STORE_ORDER = {"dW": 0, "B": 0, "W": 1, "K": 2}  # gradients (or buffers) leave first, then a step's W and K


def _state_stores(task: Task) -> list[Action]:
    """What a task writes back to host memory once its last unit has ended, in the order the runtime
    queues it: a backward's gradients (a forward's buffers), then weights, then optimizer state."""
    outs = sorted((t for t in task.outputs if t.tensor in _STORE_ORDER and t.channel == Channel.SWAP and t.nbytes),
                  key=lambda t: _STORE_ORDER[t.tensor])
    return [Action("swap-out", "STORE", task.id, tensor=t.tensor, nbytes=t.nbytes) for t in outs]


class _Builder:
    """Appends each task's actions to its device's streams, in the runtime's issue order."""

    def __init__(self, graph: TaskGraph, program: Program, prefetch: dict[int, int]) -> None:
        self.streams: dict[int, dict[str, list[Action]]] = {}
        for device in sorted({t.device for t in graph.tasks} | set(range(graph.devices))):
            self.streams[device] = {s: [] for s in STREAMS}
        self.program, self.prefetch = program, prefetch
        self.by_id = {t.id: t for t in graph.tasks}
        self.loaded: set[int] = set()  # tasks whose state an earlier action loaded
        self.seq: dict[int, int] = {}  # per device, actions issued so far

    def add(self, device: int, actions: list[Action]) -> None:
        for action in actions:
            n = self.seq.get(device, 0)
            self.seq[device] = n + 1
            action = replace(action, seq=n)
            self.streams[device][action.stream].append(action)

    def load(self, task: Task) -> None:
        if task.id not in self.loaded:
            self.loaded.add(task.id)
            self.add(task.device, _state_loads(task, self.program.sources))

    def running_gradient(self, task: Task) -> list[Action]:
        """A per-GPU-swap backward's gradient so far, loaded as the task starts (after its state,
        before its first microbatch's inputs) to become its gradient buffers. A tied weight's share
        from another pack is not one: the step adds it."""
        if task.kind != Kind.BWD:
            return []
        same = [n for n, t in enumerate(task.inputs) if running_gradient_input(task, t, self.by_id)]
        sources = self.program.sources
        return [Action("swap-in", "LOAD", task.id, tensor="dW", nbytes=task.inputs[n].nbytes,
                       src=sources[(task.id, n)][0] if (task.id, n) in sources else None) for n in same]

    def recvs(self, task: Task, unit: int) -> None:
        for stream in read_order(task):
            for e in self.program.into(task.id, stream, unit):
                peer = e.src_device if e.channel == Channel.P2P.value else None
                self.add(task.device, [Action(IN_STREAM[e.channel], "RECV", task.id, unit, e.stream, e.id, e.nbytes,
                                              peer)])

    def sends(self, task: Task, unit: int) -> None:
        for e in self.program.out_of(task.id, unit):
            peer = e.dst_device if e.channel == Channel.P2P.value else None
            self.add(task.device, [Action(OUT_STREAM[e.channel], "SEND", task.id, unit, e.stream, e.id, e.nbytes,
                                          peer)])

    def task(self, task: Task, nxt: Task | None) -> None:
        """One task's actions, with the next task's state loaded at the unit the memory plan
        prefetches it (else when that task starts; an update's always then)."""
        ahead = nxt is not None and nxt.kind != Kind.UPD
        self.load(task)
        at = self.prefetch.get(nxt.id) if ahead else None
        if task.kind in (Kind.UPD, Kind.NORM):
            self.add(task.device, [Action("compute", task.kind.value, task.id, 0)])
            self.add(task.device, _state_stores(task))
            return
        units = len(task.microbatches)
        self.add(task.device, self.running_gradient(task))
        self.recvs(task, 0)
        name = task.kind.value + ("+loss" if task.loss else "")
        for unit in range(units):
            if unit + 1 < units:
                self.recvs(task, unit + 1)
            if at == unit:
                self.load(nxt)
            self.add(task.device, [Action("compute", name, task.id, unit)])
            self.sends(task, unit)
        if task.jit_update():
            if at == units:
                self.load(nxt)
            self.add(task.device, _update_loads(task, self.program.sources) + [Action("compute", "UPD", task.id, units)])
        self.add(task.device, _state_stores(task))
