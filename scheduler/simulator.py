"""The program played: when each action of a lowered program runs, as the runtime runs it.

``simulate(program, graph, profile, machine)`` plays the per-device, per-stream action lists that
``lower.py`` wrote and the runtime executes, and reports when each action starts and ends (an
:class:`~harmony.scheduler.estimator.Estimate` whose timeline has one event per action). It derives
no order of its own: each stream runs its actions in the program's order, and each action waits
for what the program says it reads. What it models of the runtime:

- **The compute thread** of each device walks the device's actions in issue order
  (``Program.issue_order``). Reaching a compute unit (FWD, BWD, a loss task's unit, a fused or
  separate UPD, NORM), it first issues the actions listed before it that the unit reads (its
  task's state, a running gradient, its microbatch's receives) and the sends and stores of the
  unit before; once the unit's reads are in, it issues what is listed before the unit for later
  (the next microbatch's receives, the next task's state: the runtime queues them after the unit's
  own inputs arrived) and runs the unit for its ``costs.unit_seconds``.
- **A stream** (swap-in, swap-out, p2p-in, p2p-out) runs the actions issued onto it one at a time,
  first issued first (the runtime's stream threads are FIFO queues); the action at its head starts
  once its data exists:
  a SEND once its unit has ended; a RECV once the piece's SEND is done (the minibatch's pieces
  are in host memory from the start); a LOAD once the task whose output it reads (``Action.src``)
  has stored it, and for a task continuing another's buffers (``Program.after``) once that task is
  done; a STORE once its task's last unit has ended.
- **Durations** (``costs.copy_seconds``): a copy in or out of host memory its bytes over ``h2d``
  or ``d2h`` (``msg`` for MSG pieces), a pack state's with the runtime's cost per tensor; a P2P
  piece costs its receiver the ``d2d`` copy (the sender hands its message over: an emulated
  device's shared-memory slab, whose copy in is the receiver's); LOCAL pieces stay on the device
  and cost nothing.
- **A state prefetch the runtime would not make**: the next task's state is not prefetched while
  the task whose buffers it continues is still running (``Program.after``), nor where it does not
  fit: the device's memory is counted as the runtime's ledger counts it (``_Ledger``: the running
  unit's planned bytes from the memory promise, its task's state and its microbatch's inputs inside
  them; beside them the copies made ahead and the outputs still leaving, until their sends and
  stores are done), and a prefetch that would take it past the plan's peak for the device gives up,
  as the runtime's does rather than hold its stream. Either loads when its task starts, ahead of
  the task's first inputs.
- **Updates** (a UPD task, a backward's fused step) and a clipped plan's NORM wait for every task
  whose gradients they read to be done (``Program.gathers``): the host's program is its updates
  (and the norm), in order.

Peaks are not reported here: a program's reservations are the promise its graph was lowered with
(``Program.peaks``, the estimator's). The search ranks candidates with the estimator, which
chooses where each state is prefetched; the program lowered from the winner is what this module
plays and what the runtime runs. A copy of the next microbatch's inputs waits for room in the
runtime (until the compute thread waits for it); here it does not.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from harmony.profiling.profiles import Profile

from .costs import copy_seconds, unit_seconds
from .estimator import Estimate, StreamEvent
from .lower import STREAMS, Action, Program
from .machine import Machine
from .tasks import HOST, Channel, TaskGraph

__all__ = ["simulate", "stream_order", "unit_starts"]

COMPUTE_OPS = frozenset(("FWD", "BWD", "FWD+loss", "BWD+loss", "UPD", "NORM"))
_P2P, _LOCAL, _MSG = Channel.P2P.value, Channel.LOCAL.value, Channel.MSG.value


class _Node:
    """One action being played."""

    __slots__ = ("action", "device", "dur", "need", "then", "start", "end", "issued", "done")

    def __init__(self, action: Action, device: int, dur: float) -> None:
        self.action = action
        self.device = device
        self.dur = dur
        self.need = 0  # actions it waits for that are not done
        self.then: list[_Node] = []  # actions waiting for it
        self.start = math.nan
        self.end = math.nan
        self.issued = False
        self.done = False

    @property
    def compute(self) -> bool:
        return self.action.op in COMPUTE_OPS


class _Thread:
    """A device's compute thread: its units in order, each with the actions listed before it."""

    __slots__ = ("segments", "tail", "k", "reads_issued", "running", "deferred", "waiting")

    def __init__(self, order: list[_Node]) -> None:
        self.segments: list[tuple[_Node, list[_Node]]] = []
        before: list[_Node] = []
        for node in order:
            if node.compute:
                self.segments.append((node, before))
                before = []
            else:
                before.append(node)
        self.tail = before  # what follows the last unit: its stores
        self.k = 0  # the unit it is at
        self.reads_issued = False  # the unit's reads (and what it issues at once) are issued
        self.running = False
        self.waiting = False  # blocked on a unit's reads: every copy it waits for may take the margin
        self.deferred: dict[int, list[_Node]] = {}  # task -> state loads put off to its start


class _Ledger:
    """A device's memory as the runtime's ledger counts it (``runtime/ledger.py``): the running
    unit's planned bytes (its own buffers inside them), every other buffer beside them (copies made
    ahead, outputs still leaving), against the plan's peak for the device."""

    __slots__ = ("budget", "held", "running", "planned")

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.held: dict[tuple, int] = {}
        self.running: frozenset = frozenset()
        self.planned = 0

    def occupied(self) -> int:
        inside = outside = 0
        for owner, n in self.held.items():
            if owner in self.running:
                inside += n
            else:
                outside += n
        return outside + max(self.planned, inside)

    def fits(self, nbytes: int) -> bool:
        return self.budget is None or self.occupied() + nbytes <= self.budget

    def hold(self, owner: tuple, nbytes: int) -> None:
        self.held[owner] = self.held.get(owner, 0) + nbytes

    def free(self, owner: tuple, nbytes: int | None = None) -> None:
        left = 0 if nbytes is None else self.held.get(owner, 0) - nbytes
        if left > 0:
            self.held[owner] = left
        else:
            self.held.pop(owner, None)


def _reads(node: _Node, unit: _Node) -> bool:
    """Whether an action listed before a unit is issued as the thread reaches it (not held until
    the unit may start): what the unit reads, and sends and stores, which wait for nothing the
    thread holds."""
    a, u = node.action, unit.action
    if a.op in ("SEND", "STORE"):
        return True
    if a.op == "LOAD":
        return a.task == u.task
    return a.task == u.task and a.unit == u.unit


class _Player:
    """The program's actions as nodes with their dependencies, played on a heap of events."""

    def __init__(self, program: Program, graph: TaskGraph, profile: Profile, machine: Machine) -> None:
        self.program = program
        self.machine = machine
        self.by_id = {t.id: t for t in graph.tasks}
        self.nodes: list[_Node] = []
        self.by_task: dict[int, list[_Node]] = {}
        self.threads: dict[int, _Thread] = {}
        self.queues: dict[tuple[int, str], deque[_Node]] = {}
        self.busy: dict[tuple[int, str], bool] = {}
        memory = graph.memory
        self.memory = memory
        self.ledgers = {d: _Ledger(memory.devices.get(d) if memory is not None else None)
                        for d in program.streams if d != HOST}
        self.last_unit: dict[int, int] = {}  # task -> its last compute unit
        # task -> the later task that takes its pack state over where it stays on the device (W LOCAL)
        self.heirs = {i.task: t.id for t in graph.tasks for i in t.inputs
                      if i.tensor == "W" and i.channel == Channel.LOCAL and i.task is not None}
        self.gave_up: list[int] = []  # tasks whose state prefetch found no room (loaded as they started)
        self.heap: list = []
        self.ran: dict[int, dict[str, list[Action]]] = {}  # per device and stream, the actions as they started
        self.seq = 0
        self.now = 0.0
        costs = {t.id: unit_seconds(t, profile, machine) for t in graph.tasks}
        for task, times in costs.items():
            self.last_unit[task] = len(times) - 1
        sends = self._p2p_sends()
        for device in program.streams:
            order = [self._node(a, device, costs, sends, profile) for a in program.issue_order(device)]
            self.threads[device] = _Thread(order)
            for stream in STREAMS:
                self.queues[(device, stream)] = deque()
                self.busy[(device, stream)] = False
        self._wire()

    # ------------------------------------------------------------------------------ building
    def _p2p_sends(self) -> dict[tuple[int, int], int]:
        """(task, unit) -> P2P pieces it sends: each costs its compute ``Machine.p2p_send_overhead``."""
        out: dict[tuple[int, int], int] = {}
        for e in self.program.edges:
            if e.channel == _P2P and e.producer is not None and e.src_unit is not None:
                out[(e.producer, e.src_unit)] = out.get((e.producer, e.src_unit), 0) + 1
        return out

    def _node(self, a: Action, device: int, costs: dict[int, list[float]], sends: dict[tuple[int, int], int],
              profile: Profile) -> _Node:
        node = _Node(a, device, self._seconds(a, costs, sends, profile))
        self.nodes.append(node)
        self.by_task.setdefault(a.task, []).append(node)
        return node

    def _seconds(self, a: Action, costs: dict[int, list[float]], sends: dict[tuple[int, int], int],
                 profile: Profile) -> float:
        machine = self.machine
        if a.op in COMPUTE_OPS:
            units = costs[a.task]
            seconds = units[a.unit] if a.unit is not None and a.unit < len(units) else units[-1]
            return seconds + machine.p2p_send_overhead * sends.get((a.task, a.unit), 0)
        if a.stream == "compute":  # a LOCAL piece: it stays on the device
            return 0.0
        task = self.by_id[a.task]
        if a.op == "LOAD":
            return copy_seconds(a.nbytes, "h2d", machine, a.tensor, task, profile)
        if a.op == "STORE":
            return copy_seconds(a.nbytes, "d2h", machine, a.tensor, task, profile)
        channel = self.program.edges[a.edge].channel
        if channel == _P2P:
            return copy_seconds(a.nbytes, "d2d", machine) if a.op == "RECV" else 0.0
        if channel == _MSG:
            return copy_seconds(a.nbytes, "msg", machine)
        return copy_seconds(a.nbytes, "h2d" if a.op == "RECV" else "d2h", machine)

    def _wire(self) -> None:
        """Each action's dependencies (the module docs say which)."""
        program = self.program
        units: dict[tuple[int, int], _Node] = {}
        last: dict[int, _Node] = {}
        stores: dict[int, list[_Node]] = {}
        sends: dict[int, _Node] = {}
        for node in self.nodes:
            a = node.action
            if node.compute:
                units[(a.task, a.unit)] = node
                if a.task not in last or a.unit > last[a.task].action.unit:
                    last[a.task] = node
            elif a.op == "STORE":
                stores.setdefault(a.task, []).append(node)
            elif a.op == "SEND":
                sends[a.edge] = node
        recvs: dict[tuple[int, int], list[_Node]] = {}
        loads: dict[int, list[_Node]] = {}
        for node in self.nodes:
            a = node.action
            if a.op == "SEND":
                self._after(node, [units[(a.task, a.unit)]])
            elif a.op == "RECV":
                recvs.setdefault((a.task, a.unit), []).append(node)
                producer = program.edges[a.edge].producer
                if producer is not None and a.edge not in sends:
                    raise ValueError(f"{a} receives edge e{a.edge}, which no action of the program sends")
                if producer is not None:
                    self._after(node, [sends[a.edge]])
            elif a.op == "STORE":
                self._after(node, [last[a.task]])
            elif a.op == "LOAD":
                loads.setdefault(a.task, []).append(node)
                if a.src is not None and a.src in self.by_task:
                    self._after(node, stores.get(a.src) or [last[a.src]])
                writer = program.after.get(a.task)
                if writer is not None and a.tensor in ("W", "B"):
                    self._after(node, self.by_task[writer])
        for node in self.nodes:
            if not node.compute:
                continue
            a = node.action
            reads = recvs.get((a.task, a.unit), []) + [n for n in loads.get(a.task, []) if n.action.seq < a.seq]
            self._after(node, reads)
            if a.op in ("UPD", "NORM"):  # a step (or a fused one) sums what its gathers left
                for task in program.gathers.get(a.task, []):
                    self._after(node, self.by_task.get(task, []))

    @staticmethod
    def _after(node: _Node, before: list[_Node]) -> None:
        for b in before:
            if b is not node:
                node.need += 1
                b.then.append(node)

    # ------------------------------------------------------------------------------ playing
    def play(self) -> None:
        for device in self.threads:
            self._advance(device)
        while self.heap:
            t, _, node = heapq.heappop(self.heap)
            self.now = t
            self._finish(node)

    def _push(self, t: float, node: _Node) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, node))

    def _advance(self, device: int) -> None:
        """The compute thread goes on as far as it can: issues, waits for a unit's reads, runs it."""
        thread = self.threads[device]
        if thread.running:
            return
        if thread.k == len(thread.segments):
            self._issue_all(thread.tail, thread)
            thread.tail = []
            return
        unit, before = thread.segments[thread.k]
        if not thread.reads_issued:
            thread.reads_issued = True
            if unit.action.unit == 0:  # the task's first unit is reserved as it starts, before its state loads
                self._reserve(unit)
            # a state load put off to the task's start goes first, ahead of its first inputs
            self._issue_all(thread.deferred.pop(unit.action.task, []), thread)
            self._issue_all([n for n in before if _reads(n, unit)], thread)
        if unit.need:
            if not thread.waiting:  # copies waiting for room are now what the thread waits for
                thread.waiting = True
                self._serve_inbound(device)
            return  # woken when its last read is done
        thread.waiting = False
        if unit.action.unit:
            self._reserve(unit)
        self._issue_all([n for n in before if not _reads(n, unit)], thread)
        thread.k += 1
        thread.reads_issued = False
        thread.running = True
        self._start(unit)

    def _issue_all(self, nodes: list[_Node], thread: _Thread) -> None:
        for node in nodes:
            a = node.action
            writer = self.program.after.get(a.task)
            if a.op == "LOAD" and writer is not None and not self._task_done(writer) and \
                    thread.k < len(thread.segments) and thread.segments[thread.k][0].action.task != a.task:
                thread.deferred.setdefault(a.task, []).append(node)  # no prefetch of buffers still being updated
                continue
            self._issue(node)

    def _task_done(self, task: int) -> bool:
        return all(n.done for n in self.by_task.get(task, []))

    def _issue(self, node: _Node) -> None:
        node.issued = True
        if node.action.stream == "compute":  # a LOCAL piece: there once its producer made it
            if not node.need:
                self._start(node)
            return
        key = (node.device, node.action.stream)
        self.queues[key].append(node)
        self._serve(key)

    def _serve(self, key: tuple[int, str]) -> None:
        """The stream's head starts if the stream is free and the head's data exists."""
        queue = self.queues[key]
        if self.busy[key] or not queue or queue[0].need or self._waits_for_room(queue[0]):
            return
        node = queue.popleft()
        if self._gives_up(node):
            self._serve(key)
            return
        self.busy[key] = True
        self._hold(node)
        self._start(node)

    def _start(self, node: _Node) -> None:
        node.start = self.now
        self.ran.setdefault(node.device, {}).setdefault(node.action.stream, []).append(node.action)
        self._push(self.now + node.dur, node)

    def _finish(self, node: _Node) -> None:
        node.done = True
        node.end = self.now
        self._release(node)
        a = node.action
        if node.compute:
            self.threads[node.device].running = False
        elif a.stream != "compute":
            key = (node.device, a.stream)
            self.busy[key] = False
            self._serve(key)
        woken: set[int] = {node.device} if node.compute else set()
        for nxt in node.then:
            nxt.need -= 1
            if nxt.need:
                continue
            if nxt.compute:
                woken.add(nxt.device)
            elif nxt.issued and nxt.action.stream == "compute":
                self._start(nxt)
            elif nxt.issued:
                self._serve((nxt.device, nxt.action.stream))
        for device in sorted(woken):
            self._advance(device)

    # ------------------------------------------------------------------------------ memory
    def _reserve(self, unit: _Node) -> None:
        """A unit starts: the ledger reserves its planned bytes, its task's state and its own
        microbatch's buffers counted inside them."""
        ledger = self.ledgers.get(unit.device)
        a = unit.action
        if ledger is None or self.memory is None:
            return
        ledger.running = frozenset(((a.task, "S"), (a.task, a.unit)))
        ledger.planned = self.memory.unit_bytes(a.task, a.unit)
        self._serve_inbound(unit.device)  # a copy for this unit, or one that fits beside it now, may go

    def _gives_up(self, node: _Node) -> bool:
        """A state prefetch (a LOAD of a task not yet running) that does not fit beside what the
        device holds gives up, as the runtime's does rather than hold its stream: the task loads
        its state as it starts."""
        a = node.action
        ledger = self.ledgers.get(node.device)
        if a.op != "LOAD" or a.tensor not in ("W", "B") or ledger is None or (a.task, "S") in ledger.running:
            return False
        if ledger.fits(self._state_bytes(node)):
            return False
        self.gave_up.append(a.task)
        thread = self.threads[node.device]
        for n in self.by_task[a.task]:  # its state (W and B, loaded together) waits for the task's start
            if n.action.op == "LOAD" and n.action.tensor in ("W", "B") and not n.done:
                queue = self.queues[(n.device, n.action.stream)]
                if n in queue:
                    queue.remove(n)
                n.issued = False
                if n not in thread.deferred.get(a.task, []):
                    thread.deferred.setdefault(a.task, []).append(n)
        return True

    def _waits_for_room(self, node: _Node) -> bool:
        """A later microbatch's inputs copied in ahead wait (holding their stream) while they do not
        fit beside what the device holds, until the compute thread waits for something: then every
        copy may take the margin, as in the runtime's admission."""
        a = node.action
        ledger = self.ledgers.get(node.device)
        if a.op != "RECV" or ledger is None or (a.task, a.unit) in ledger.running:
            return False
        return not self.threads[node.device].waiting and not ledger.fits(a.nbytes)

    def _serve_inbound(self, device: int) -> None:
        for stream in ("swap-in", "p2p-in"):
            self._serve((device, stream))

    def _state_bytes(self, node: _Node) -> int:
        return sum(n.action.nbytes for n in self.by_task[node.action.task]
                   if n.action.op == "LOAD" and n.action.tensor in ("W", "B") and not n.done)

    def _hold(self, node: _Node) -> None:
        """A copy onto the device holds its bytes from its start: a LOAD under its task's state, a
        RECV under its microbatch."""
        ledger = self.ledgers.get(node.device)
        a = node.action
        if ledger is None or a.op not in ("LOAD", "RECV"):
            return
        ledger.hold((a.task, "S") if a.op == "LOAD" else (a.task, a.unit), a.nbytes)

    def _release(self, node: _Node) -> None:
        """What an ended action lets go: a unit its inputs, its outputs left beside the next units
        until their sends are done, and at its task's end the state, but for what the task's
        stores still copy out; a send or a store its bytes."""
        ledger = self.ledgers.get(node.device)
        a = node.action
        if ledger is None:
            return
        if node.compute:
            ledger.free((a.task, a.unit))
            out = sum(n.action.nbytes for n in node.then if n.action.op == "SEND" and n.action.stream != "compute")
            if out:
                ledger.hold((a.task, a.unit, "out"), out)
            for n in node.then:  # activations kept for the pack's backward: its microbatch's from now on
                if n.action.op == "SEND" and n.action.stream == "compute" and n.action.tensor == "A":
                    e = self.program.edges[n.action.edge]
                    ledger.hold((e.consumer, e.dst_unit), n.action.nbytes)
            if a.unit == self.last_unit.get(a.task):
                state = ledger.held.get((a.task, "S"), 0)
                ledger.free((a.task, "S"))
                heir = self.heirs.get(a.task)
                if heir is not None and state:  # the state stays for a later task of the device
                    ledger.hold((heir, "S"), state)
                stores = sum(n.action.nbytes for n in self.by_task[a.task] if n.action.op == "STORE")
                if stores:
                    ledger.hold((a.task, "stores"), stores)
                ledger.running, ledger.planned = frozenset(), 0
        elif a.op == "SEND" and a.stream != "compute":
            ledger.free((a.task, a.unit, "out"), a.nbytes)
        elif a.op == "STORE":
            ledger.free((a.task, "stores"), a.nbytes)
        else:
            return
        self._serve_inbound(node.device)  # a copy waiting for room may fit now

    # ------------------------------------------------------------------------------ result
    def estimate(self) -> Estimate:
        ends = [n.end for n in self.nodes if n.done]
        stuck = [d for d, thread in self.threads.items() if thread.k < len(thread.segments) or thread.running]
        deadlock = self._deadlock(stuck) if stuck or len(ends) < len(self.nodes) else None
        end = max(ends, default=0.0)
        busy: dict[int, dict[str, float]] = {d: dict.fromkeys(STREAMS, 0.0) for d in self.threads}
        moved: dict[int, dict[str, int]] = {d: {} for d in self.threads if d != HOST}
        by_channel: dict[str, int] = {}
        events = []
        for n in self.nodes:
            if not n.done:
                continue
            a = n.action
            busy[n.device][a.stream] += n.end - n.start
            events.append(StreamEvent(n.device, a.stream, a.task, str(a), n.start, n.end))
            if a.op in ("RECV", "LOAD", "STORE") or (a.op == "SEND" and a.stream == "swap-out"):
                what = self._label(a)
                if what:
                    by_channel[what] = by_channel.get(what, 0) + a.nbytes
                    per = moved.setdefault(n.device, {})
                    per[what] = per.get(what, 0) + a.nbytes
        events.sort(key=lambda e: (e.start, e.end))
        return Estimate(iteration_time=math.inf if deadlock else end + self.machine.iteration_overhead, fits=True,
                        peak_memory=dict(self.program.peaks), bytes_by_channel=by_channel, bytes_by_device=moved,
                        busy=busy, deadlock=deadlock, events=events)

    def _label(self, a: Action) -> str:
        if a.op in ("LOAD", "STORE"):
            return "SWAP in" if a.op == "LOAD" else "SWAP out"
        channel = self.program.edges[a.edge].channel
        if channel == _LOCAL:
            return ""
        if channel == _P2P:
            return "P2P" if a.op == "RECV" else ""
        return f"{'MSG' if channel == _MSG else 'SWAP'} {'in' if a.op == 'RECV' else 'out'}"

    def _deadlock(self, stuck: list[int]) -> str:
        lines = []
        for device in stuck:
            thread = self.threads[device]
            if thread.k >= len(thread.segments):
                continue
            unit = thread.segments[thread.k][0]
            waits = [str(n.action) for n in self.nodes if unit in n.then and not n.done]
            lines.append(f"{'host' if device == HOST else f'dev{device}'} waits to run {unit.action} for "
                         + (", ".join(waits[:4]) or "nothing it names"))
        return "; ".join(lines) or "actions never ran"


def _played(program: Program, graph: TaskGraph, profile: Profile, machine: Machine) -> _Player:
    player = _Player(program, graph, profile.for_graph(graph), machine)
    player.play()
    return player


def simulate(program: Program, graph: TaskGraph, profile: Profile, machine: Machine) -> Estimate:
    """Play ``program`` (lowered from ``graph``) on ``machine`` with ``profile``'s costs; see the module
    docs. The estimate's events are the program's actions, labelled as the program prints them."""
    return _played(program, graph, profile, machine).estimate()


def stream_order(program: Program, graph: TaskGraph, profile: Profile,
                 machine: Machine) -> dict[int, dict[str, list[Action]]]:
    """Per device and stream, the actions in the order the simulation started them: what the
    program lists, if nothing here orders a stream its own way (the agreement tests hold it so)."""
    return _played(program, graph, profile, machine).ran


def unit_starts(est: Estimate) -> dict[tuple[int, int], float]:
    """(task, unit) -> when each compute unit starts in a simulated program's timeline."""
    out = {}
    for e in est.events:
        if e.stream == "compute" and "." in e.label.split(" ", 1)[0]:
            where = e.label.split(" ", 1)[0]
            task, unit = where[1:].split(".")
            if e.label.split(" ")[1] in COMPUTE_OPS:
                out[(int(task), int(unit))] = e.start
    return out

