"""What the executor needs to know about a task graph beyond each task's own line: its program
(``scheduler/lower.py``, lowered at compile and saved with the plan: which pieces of which
activation stream move where, in which order, whose buffers each task continues), which tasks
update (or contribute a gradient to) each parameter and which pack states stay resident. Pure
functions of the plan's data, so every worker and the launcher derive the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harmony.decomposer.layer_graph import LayerGraph
from harmony.scheduler.lower import Program
from harmony.scheduler.memory import is_kept
from harmony.scheduler.tasks import HOST, Channel, Kind, Task, TaskGraph


@dataclass
class Routes:
    """Everything derived from the graph for execution; see the module docs."""

    graph: TaskGraph
    program: Program  # the graph lowered: which pieces move where, in which order
    by_id: dict[int, Task] = field(default_factory=dict)
    owner: dict[str, int] = field(default_factory=dict)  # parameter -> the lowest layer holding it
    updates: dict[int, list[str]] = field(default_factory=dict)  # task -> parameters it steps
    deposits: dict[int, list[str]] = field(default_factory=dict)  # task -> parameters whose gradient it leaves in host memory
    sources: dict[str, list[int]] = field(default_factory=dict)  # parameter -> tasks depositing its gradient
    replicas: dict[int, list[int]] = field(default_factory=dict)  # UPD task -> all UPD tasks of its pack (replicated update)
    jit: set[int] = field(default_factory=set)  # BWD tasks that step their pack right after its backward
    buffers_after: dict[int, int] = field(default_factory=dict)  # the program's ``after`` (``lower.buffer_chain``)
    kept_resident: set[int] = field(default_factory=set)  # tasks whose pack state a later task reads LOCAL

    def kept_writes(self, rank: int) -> list[str]:
        """The parameters whose kept state (``scheduler/keep.py``) device ``rank`` writes back to the
        host store: those its kept tasks step, where it is the lowest of the replicas stepping them
        (dp keeps a replica on every device; one writes it)."""
        names: list[str] = []
        for task in self.graph.tasks:
            if task.device != rank or not is_kept(task) or task.id not in self.updates:
                continue
            replicas = self.replicas.get(task.id, [task.id])
            if rank == min(self.by_id[t].device for t in replicas):
                names += [n for n in self.updates[task.id] if n not in names]
        return names

    def gradient_slots(self) -> set[tuple[int, str]]:
        """(device, parameter) of every host gradient slot a task deposits into: the host store
        needs no other (in pp each pack's backward runs on one device, so one slot per parameter,
        where a slot for every device would hold the weights' size once per device)."""
        return {(self.by_id[t].device, p) for t, params in self.deposits.items() for p in params}


def build_routes(graph: TaskGraph, layers: LayerGraph, program: Program) -> Routes:
    """The routes of ``graph`` as ``program`` (lowered from it: ``Plan.program``; the launcher
    checks that it was) moves its data."""
    r = Routes(graph=graph, program=program, by_id={t.id: t for t in graph.tasks})
    for task in graph.tasks:
        r.kept_resident.update(t.task for t in task.inputs
                               if t.tensor == "W" and t.channel == Channel.LOCAL and t.task is not None)
    _parameters(r, layers)
    _check_low_copies(r)
    r.buffers_after = dict(r.program.after)
    return r


def _check_low_copies(r: Routes) -> None:
    """Refuse a plan that steps on a device a weight it moves as a low-precision copy: the step
    needs the float32 master there (``generate`` carries a trainable weight low only where the
    host steps it, so only a plan edited or assembled by hand gets here)."""
    for tid, names in r.updates.items():
        low = sorted(set(names) & set(r.graph.low_copies)) if r.by_id[tid].device != HOST else []
        if low:
            raise ValueError(f"task {tid} is to step {', '.join(low)} on a device, but the plan moves them as "
                             "low-precision copies; the plan is inconsistent: compile it again")


def _parameters(r: Routes, layers: LayerGraph) -> None:
    holders: dict[str, list[int]] = {}
    for spec in layers.layers:
        for name in spec.state:
            st = layers.state[name]
            if st.kind == "parameter" and st.requires_grad:
                holders.setdefault(layers.canonical(name), []).append(spec.index)
    # in the model's order of parameters (the layer graph's state table): a sum over all of them
    # (the clipped gradient's norm) adds them up as eager code over model.parameters() does
    ordered = dict.fromkeys(layers.canonical(name) for name in layers.state)
    r.owner = {p: min(holders[p]) for p in ordered if p in holders}

    def params_in(first: int, last: int) -> list[str]:
        return [p for p, ls in holders.items() if any(first <= l <= last for l in ls)]

    for task in r.graph.tasks:
        inside = params_in(task.first, task.last)
        owned = [p for p in inside if task.first <= r.owner[p] <= task.last]
        if task.kind == Kind.UPD:
            r.updates[task.id] = owned
        elif task.kind == Kind.BWD:
            if task.jit_update():
                r.jit.add(task.id)
                r.updates[task.id] = owned
                r.deposits[task.id] = [p for p in inside if p not in owned]
            else:
                r.deposits[task.id] = inside
    for tid, params in r.deposits.items():
        for p in params:
            r.sources.setdefault(p, []).append(tid)
    upd: dict[tuple[int, int], list[int]] = {}
    for task in r.graph.tasks:
        if task.kind == Kind.UPD and task.device != HOST:
            upd.setdefault((task.first, task.last), []).append(task.id)
    for ids in upd.values():
        for tid in ids:
            r.replicas[tid] = ids
