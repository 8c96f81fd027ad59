"""The task IR: what each device does in one training iteration, and what moves where (§4.3.2).

A ``Task`` is a FWD, BWD or UPD over one pack of contiguous layers and a group of microbatches,
bound to one device (or to the host, for an update offloaded to the CPU); with gradient clipping a
NORM task on the host sums every gradient, takes the global norm and clips, and every UPD waits
for it. Its inputs and outputs are ``Transfer``s that name the tensor, the channel that carries it
and the task at the other end, so that the estimator can simulate the graph and the runtime can
execute it without knowing how it was made. Each task prints as one compact line, a graph as one
line per task, so plans can be read, diffed and golden-tested:

    dev1 FWD L2-3 u=10x2 in: X<-P2P(dev0) W<-SWAP out: Y->P2P(dev0) Xs->SWAP
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Iterator

import msgpack

from harmony.errors import FormatError

HOST = -1  # the device index of work bound to the host CPU (an offloaded update)


class Channel(str, Enum):
    """How a tensor travels (§4.3.2)."""

    SWAP = "SWAP"  # host memory <-> device memory
    P2P = "P2P"  # device <-> device
    MSG = "MSG"  # host <-> host between worker processes
    SHM = "SHM"  # shared host memory (master weights, optimizer state): no copy
    LOCAL = "LOCAL"  # stays resident on the device from an earlier task
    KEEP = "KEEP"  # stays on the device across iterations (state a device has room to keep: ``keep.py``)


class Kind(str, Enum):
    FWD = "FWD"  # with ``keep``: recording for autograd, its activations kept for the pack's backward
    BWD = "BWD"  # recompute + backward (with ``keep``: the backward alone); with ``loss`` the pack's forward, the loss and the backward
    UPD = "UPD"
    NORM = "NORM"  # on the host: the minibatch's global gradient norm, once every gradient is in; clips them


# Tensor names used in transfers.
#   X: the pack's input activation   Y: its output    Xs: X stashed for the recompute
#   dY: gradient arriving at the pack's output        dX: gradient leaving at its input
#   W: weights   B: buffers (e.g. batch-norm statistics)   dW: weight gradients   K: optimizer state
#   T: the loss target   A: a microbatch's activations, kept on the device from the pack's forward to
#   its backward (LOCAL: what autograd saved, the pack's input and output), so that nothing is recomputed
#   As: of those, what a swapping pack sends to host memory and back (all but its input and output)
TENSORS = ("X", "Y", "Xs", "dY", "dX", "W", "B", "dW", "K", "T", "A", "As")


@dataclass
class Transfer:
    """One tensor into or out of a task."""

    tensor: str
    channel: Channel
    nbytes: int
    peer: int | None = None  # the other device, for P2P
    task: int | None = None  # the producing task (inputs) or consuming task (outputs), if any
    microbatch: int | None = None  # index within the task's group, for per-microbatch activations

    def route(self) -> str:
        return f"{self.channel.value}(dev{self.peer})" if self.channel == Channel.P2P and self.peer is not None else self.channel.value


@dataclass
class Task:
    id: int
    device: int
    kind: Kind
    first: int
    last: int
    microbatches: list[int]  # sizes of the group's microbatches, in order (the last may be smaller)
    offset: int = 0  # index of the group's first sample in the minibatch
    loss: bool = False  # BWD of the last pack: forward, loss and backward together (jit-compute)
    update: str = "none"  # BWD: "device" (jit-update after its last microbatch), "host" or "none"
    # FWD: records for autograd and keeps each microbatch's activations (A; where the pack swaps them,
    # As goes to host memory) for the pack's backward; BWD: backward from them, with the forward's
    # state (W LOCAL), without recomputing
    keep: bool = False
    inputs: list[Transfer] = field(default_factory=list)
    outputs: list[Transfer] = field(default_factory=list)

    @property
    def u(self) -> int:
        return max(self.microbatches) if self.microbatches else 0

    @property
    def samples(self) -> int:
        return sum(self.microbatches)

    def jit_update(self) -> bool:
        """A backward that steps its own pack right after its last microbatch (it brings the
        optimizer state in); a BWD stepped by a separate UPD task only leaves its gradient. Read
        from the end, where the generator appends the K input: the estimator asks once per input,
        and a backward of many microbatches has hundreds."""
        return self.kind == Kind.BWD and self.update == "device" and any(t.tensor == "K" for t in reversed(self.inputs))

    def swaps(self) -> bool:
        """Whether the task's pack sends its kept activations through host memory (``As``) rather
        than keeping them all on the device."""
        return self.keep and any(t.tensor == "As" for t in (*self.inputs, *self.outputs))

    def deps(self) -> set[int]:
        """Tasks that must have produced an input before this task can use it."""
        return {t.task for t in self.inputs if t.task is not None}

    def __str__(self) -> str:
        where = "host" if self.device == HOST else f"dev{self.device}"
        name = self.kind.value + ("+loss" if self.loss else "") + ("+upd" if self.update == "device" else "")
        layers = f"L{self.first}" if self.first == self.last else f"L{self.first}-{self.last}"
        parts = [where, name, layers]
        if self.kind in (Kind.FWD, Kind.BWD):
            parts.append(f"u={_group_text(self.microbatches)}")
        for label, transfers, is_input in (("in:", self.inputs, True), ("out:", self.outputs, False)):
            if transfers:
                parts.append(label)
                parts.extend(_dedup(transfers, is_input))
        return " ".join(parts)


def _group_text(sizes: list[int]) -> str:
    """``[10, 10, 4]`` -> ``10x2+4``: the group's microbatch sizes, compactly."""
    if not sizes:
        return "0"
    full = sizes[0]
    count = sum(1 for s in sizes if s == full)
    rest = [s for s in sizes if s != full]
    text = f"{full}x{count}" if count > 1 else f"{full}"
    return text + "".join(f"+{s}" for s in rest)


def _dedup(transfers: list[Transfer], is_input: bool) -> list[str]:
    """Per-microbatch transfers of the same tensor and route print once."""
    seen: list[str] = []
    for t in transfers:
        text = f"{t.tensor}{'<-' if is_input else '->'}{t.route()}"
        if text not in seen:
            seen.append(text)
    return seen


@dataclass
class Configuration:
    """(U_F, P_F, U_B, P_B): microbatch sizes and layer packs of the two passes (§4.3.1)."""

    u_f: int
    packs_f: list[tuple[int, int]]
    u_b: int
    packs_b: list[tuple[int, int]]
    # the backward packs whose activations stay on the device from their forward (no recompute), and
    # those whose activations go to host memory in between and come back for the backward; every
    # other pack but the last (forward, loss and backward in one task) recomputes from a stash
    keep: tuple[tuple[int, int], ...] = ()
    swap: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        text = f"U_F={self.u_f} P_F=[{packs_text(self.packs_f)}] U_B={self.u_b} P_B=[{packs_text(self.packs_b)}]"
        return (text + (f" keep=[{packs_text(self.keep)}]" if self.keep else "")
                + (f" swap=[{packs_text(self.swap)}]" if self.swap else ""))

    def choices(self) -> list[tuple[tuple[int, int], str]]:
        """Each backward pack and what its backward does for its activations: ``keep`` (kept on the
        device since its forward), ``swap`` (sent to host memory by the forward and brought back),
        ``recompute`` (from the stashed input), or ``loss`` (the last pack: forward, loss and
        backward in one task)."""
        kept, swapped = set(self.keep), set(self.swap)
        return [(tuple(p), "loss" if i == len(self.packs_b) - 1 else "keep" if tuple(p) in kept
                 else "swap" if tuple(p) in swapped else "recompute")
                for i, p in enumerate(self.packs_b)]


def packs_text(packs) -> str:
    """Layer spans as text: [(0, 2), (5, 5)] -> "L0-2 L5"."""
    return " ".join(f"L{a}" if a == b else f"L{a}-{b}" for a, b in packs)


@dataclass
class MemoryPlan:
    """What a plan promises about memory (``scheduler/memory.py`` counts it, the estimator times
    it): per device the estimate's peak, which the runtime lets no prefetch go past; per task the
    device's bytes while it runs (an out-of-memory report compares with it) and its reserve, the
    most it holds at once, of which a prefetch beside it must leave free what it has not allocated;
    and the tasks whose state the plan loads while the task before them computes, with the unit of
    that task at whose start it does (the runtime prefetches those there, and no other)."""

    devices: dict[int, int]
    tasks: dict[int, int]
    reserves: dict[int, int]
    # task -> the unit of the task before it on its device at whose start its state loads
    prefetch: dict[int, int] = field(default_factory=dict)
    # task -> per unit, what the task holds while that unit computes (its reserve is the largest);
    # empty in plans made before it was recorded
    units: dict[int, tuple[int, ...]] = field(default_factory=dict)

    _MAPS = ("devices", "tasks", "reserves", "prefetch")

    def unit_bytes(self, task: int, unit: int) -> int:
        """What ``task`` holds while its unit ``unit`` computes (its reserve where the plan does not
        say)."""
        held = self.units.get(task)
        if held is None or not 0 <= unit < len(held):
            return self.reserves.get(task, 0)
        return held[unit]

    def to_dict(self) -> dict:
        body = {name: {str(k): int(v) for k, v in getattr(self, name).items()} for name in self._MAPS}
        body["units"] = {str(k): [int(b) for b in v] for k, v in self.units.items()}
        return body

    @classmethod
    def from_dict(cls, body: dict) -> "MemoryPlan":
        units = {int(k): tuple(int(b) for b in v) for k, v in body.get("units", {}).items()}
        return cls(**{name: {int(k): int(v) for k, v in body.get(name, {}).items()} for name in cls._MAPS},
                   units=units)


@dataclass
class TaskGraph:
    """One iteration's tasks in a valid execution order; each device runs its own in this order."""

    mode: str
    devices: int
    minibatch: int
    config: Configuration
    tasks: list[Task]
    memory: MemoryPlan | None = None  # set once estimated (search, compile)
    precision: str = "fp32"  # what the devices compute in: fp32, or bf16 under autocast (runtime/precision.py)
    # weights the devices receive as low-precision copies cast on the host, canonical name -> dtype:
    # frozen ones, and trainable ones the host steps (profiling/casts.py)
    low_copies: dict[str, str] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def device_tasks(self, device: int) -> list[Task]:
        return [t for t in self.tasks if t.device == device]

    def bytes_by_channel(self) -> dict[str, int]:
        """Bytes per channel per iteration, counting every input once (outputs are someone's input
        or land in host memory, which is counted on the way out)."""
        total: Counter[str] = Counter()
        for task in self.tasks:
            for t in task.inputs:
                if t.channel in (Channel.SWAP, Channel.P2P, Channel.MSG):
                    total[f"{t.channel.value} in"] += t.nbytes
            for t in task.outputs:
                if t.channel in (Channel.SWAP, Channel.MSG):
                    total[f"{t.channel.value} out"] += t.nbytes
        return dict(total)

    def swap_bytes(self, tensor: str | None = None) -> int:
        """Host<->device bytes per iteration (in and out), optionally of one tensor kind."""
        return sum(
            t.nbytes
            for task in self.tasks
            for t in (*task.inputs, *task.outputs)
            if t.channel == Channel.SWAP and (tensor is None or t.tensor == tensor)
        )

    def parked_bytes(self) -> int:
        """Host bytes the forwards of an iteration leave in their own worker's host memory for their
        backwards: the stashed inputs (``Xs``) and swapped activations (``As``) sent over SWAP to a
        task of the same device (one for another device goes through the message slabs, in shared
        memory, which a launch sizes and checks). Every forward of a pack runs before its backward,
        so at the turn they are all there at once; the pieces tasks pass on through host memory
        (``X``, ``dY``) come and go beside them."""
        device = {task.id: task.device for task in self.tasks}
        return sum(t.nbytes for task in self.tasks for t in task.outputs
                   if t.channel == Channel.SWAP and t.tensor in ("Xs", "As") and device.get(t.task) == task.device)

    def to_text(self) -> str:
        precision = f", {self.precision}" if self.precision != "fp32" else ""
        lines = [f"# {self.mode} on {self.devices} device(s), minibatch {self.minibatch}{precision}: {self.config}"]
        lines.extend(f"{t.id:>4} {t}" for t in self.tasks)
        return "\n".join(lines) + "\n"

    def validate(self) -> None:
        """Every input's producer exists and comes earlier; raises ValueError naming the task."""
        position = {t.id: i for i, t in enumerate(self.tasks)}
        if len(position) != len(self.tasks):
            raise ValueError("task ids are not unique")
        for i, task in enumerate(self.tasks):
            for dep in task.deps():
                if dep not in position:
                    raise ValueError(f"task {task.id} ({task}) reads from task {dep}, which does not exist")
                if position[dep] >= i:
                    raise ValueError(f"task {task.id} ({task}) reads from task {dep}, which comes later")

    # ---------------------------------------------------------------- files
    def fingerprint(self) -> str:
        """SHA-256 of the task graph with its memory promise: its program records it, so a program
        lowered from other tasks is recognized and refused."""
        return hashlib.sha256(msgpack.packb(self.to_dict(), use_bin_type=True)).hexdigest()

    def to_dict(self) -> dict:
        body = asdict(self)
        body["memory"] = self.memory.to_dict() if self.memory is not None else None
        for task in body["tasks"]:
            task["kind"] = task["kind"].value if isinstance(task["kind"], Kind) else task["kind"]
            for t in task["inputs"] + task["outputs"]:
                t["channel"] = t["channel"].value if isinstance(t["channel"], Channel) else t["channel"]
        return body

    @classmethod
    def from_dict(cls, body: dict) -> "TaskGraph":
        try:
            cfg = body["config"]
            config = Configuration(
                u_f=cfg["u_f"], packs_f=[tuple(p) for p in cfg["packs_f"]],
                u_b=cfg["u_b"], packs_b=[tuple(p) for p in cfg["packs_b"]],
                keep=tuple(tuple(p) for p in cfg.get("keep", ())), swap=tuple(tuple(p) for p in cfg.get("swap", ())),
            )
            tasks = []
            for t in body["tasks"]:
                inputs = [Transfer(**{**x, "channel": Channel(x["channel"])}) for x in t["inputs"]]
                outputs = [Transfer(**{**x, "channel": Channel(x["channel"])}) for x in t["outputs"]]
                tasks.append(Task(**{**t, "kind": Kind(t["kind"]), "inputs": inputs, "outputs": outputs}))
            memory = MemoryPlan.from_dict(body["memory"]) if body.get("memory") else None
            return cls(mode=body["mode"], devices=body["devices"], minibatch=body["minibatch"], config=config, tasks=tasks,
                       memory=memory, precision=body.get("precision", "fp32"),
                       low_copies=dict(body.get("low_copies", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FormatError(f"task graph is malformed ({type(exc).__name__}: {exc})") from exc


def microbatch_sizes(samples: int, u: int) -> list[int]:
    """``samples`` split into microbatches of ``u``, the last one smaller if u does not divide it."""
    if u < 1:
        raise ValueError(f"microbatch size must be at least 1, got {u}")
    full, rest = divmod(samples, u)
    return [u] * full + ([rest] if rest else [])
