"""Beaumont et al.'s lower bound on training a chain whose weights move between host and device.

Beaumont, Eyraud-Dubois, Shilova and Zhao (*Weight Offloading Strategies for Training Large DNN
Models*, 2022, §3 and §6) model one iteration on one device as the cycle of operations
B_L, ..., B_1, F_1, ..., F_L. F_i and B_i need layer i's weights w_i on the device; B_i also makes
the gradient δw_i and steps w_i there. A weight may leave the device after F_i (to come back
before B_i), after B_i (to come back before F_i), or both, and an updated weight that leaves must
first have been written to the host once since B_i (one offload may serve two prefetches: the
paper's *discount*). The host link is full duplex. Deciding which weights leave, and when each
copy runs, is strongly NP-hard; the paper's mixed integer program (Theorem 2) relaxes the memory
limit to the start of each operation, and its optimum is a lower bound on every schedule's
iteration time. ``iteration_bound`` builds that program and solves it with HiGHS
(``scipy.optimize.milp``); ``link_bound`` solves it again for the least host-link time any schedule
needs to fit the device at all.

Variables, per layer i and operation j (the interval from the start of j to the start of j + 1):
O_ij, P_ij, D_ij (bytes of w_i offloaded, prefetched, deleted), idle_j, and the binaries O*_i (w_i
is offloaded once), D1_i (w_i leaves between F_i and B_i), D0_i (between B_i and F_i). Constraints
(2) to (8) of §6, with these readings:

- the sums of (6) are written through two state variables per layer and operation, the bytes of
  w_i on the device at the start of j (m_ij, the paper's own m_{i,k}) and the bytes offloaded since
  B_i; the program is the paper's, only sparser;
- (6)'s first inequality is printed as Σ (P - D) >= 0 ("the amount of prefetched data is not
  higher than the deleted data"): that says P <= D, i.e. Σ (P - D) <= 0, which is what is kept
  (as printed it would forbid every deletion, and the schedule of the NP-hardness proof);
- in the memory constraint (4), M_k is what operation k holds beside the weights on the device
  (eq. (1) less |w_i|, which the sum of m_ik already counts): the NP-hardness proof's schedule,
  M_GPU = mV + V with mV of weights and V for one gradient, fits only so.

How the solution is reported: the bound is HiGHS's dual bound (the optimum when it proves one, else
the best bound at the time limit, with the remaining gap), or the LP relaxation's optimum where the
integer search stopped before it had one (or, where not even that came in time, the compute alone);
``OffloadSolution.status`` says which.

A Harmony plan as a chain (``chain_of_graph``): the plan's own work per layer, so that the bound
judges how the plan moves weights, not its microbatches. What the model leaves out costs a Harmony
plan time the bound does not charge: the optimizer state (Adam's moments, held and moved for a
device step), the host's optimizer step and its wait, the activations stashed to the host and read
back, the minibatch's copy, the fixed cost of a copy (``Machine.latency``), the runtime's overheads;
a pack's whole working memory (the bound counts each layer's own peak, at the start of its
operation only); a pack moves its layers' weights together, where the bound moves each layer alone;
and Harmony's iteration starts and ends on an idle device, where the paper's cycle overlaps the next
iteration's first prefetches with the end of this one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from harmony.profiling.profiles import LOSS_FORWARD, Profile
from harmony.scheduler.machine import Machine
from harmony.scheduler.memory import fused_update
from harmony.scheduler.tasks import HOST, Kind, Task, TaskGraph

__all__ = ["Chain", "OffloadSchedule", "OffloadSolution", "chain_of_graph", "iteration_bound", "link_bound"]

TIME_LIMIT = 20.0  # seconds of HiGHS per program: a chain of a hundred layers is a program of 10^5 variables
LP_TIME_LIMIT = 60.0  # for the LP relaxation where the integer search stopped before its root's: ~9 s at 144 layers


@dataclass(frozen=True)
class Chain:
    """One instance of the paper's OFF(L, M_GPU, β): a chain of layers on one device.

    Times in seconds, sizes in bytes, bandwidths in bytes per second. ``forward_memory[i]`` and
    ``backward_memory[i]`` are what F_i and B_i hold at their peak beside the weights on the device
    (activations; for B_i also δw_i): eq. (1) less |w_i|. ``h2d`` and ``d2h`` are the prefetch and
    offload rates (the paper's β, one each way)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weights: tuple[int, ...]
    forward_memory: tuple[int, ...]
    backward_memory: tuple[int, ...]
    capacity: int
    h2d: float
    d2h: float
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.weights)
        if n == 0:
            raise ValueError("a chain needs at least one layer")
        for name in ("forward", "backward", "forward_memory", "backward_memory"):
            values = getattr(self, name)
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} layers: give one per layer")
            if any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"{name} must be finite and non-negative, got {values!r}")
        if any(w < 0 for w in self.weights):
            raise ValueError(f"weight sizes must be non-negative, got {self.weights!r}")
        if self.h2d <= 0 or self.d2h <= 0:
            raise ValueError(f"the host link's rates must be positive, got h2d={self.h2d!r} d2h={self.d2h!r}")
        if self.names and len(self.names) != n:
            raise ValueError(f"{len(self.names)} names for {n} layers")
        for op, need in enumerate(self.alone()):
            if need > self.capacity:
                raise ValueError(f"{self.op_name(op)} alone needs {need} bytes (its weights and what it holds "
                                 f"beside them), more than the device's {self.capacity}: no schedule fits; "
                                 "give the device more memory or cut the layer")

    @classmethod
    def from_activations(cls, forward, backward, weights, activations, capacity: int, bandwidth: float,
                         names: tuple[str, ...] = ()) -> "Chain":
        """The paper's memory model, eq. (1): every activation a^k stays on the device from F_k to
        B_{k+1}, so F_i holds Σ_{k<=i} |a^k| beside its weights and B_i that and δw_i (|w_i|);
        one bandwidth β both ways."""
        held = np.cumsum(np.asarray(activations, dtype=float))
        return cls(tuple(map(float, forward)), tuple(map(float, backward)), tuple(int(w) for w in weights),
                   tuple(int(round(a)) for a in held), tuple(int(round(a + w)) for a, w in zip(held, weights)),
                   int(capacity), float(bandwidth), float(bandwidth), tuple(names))

    @property
    def layers(self) -> int:
        return len(self.weights)

    @property
    def compute(self) -> float:
        """Σ_j u_j: the iteration without a moment of idle."""
        return float(sum(self.forward) + sum(self.backward))

    # the operations in the paper's order, from 0: B_{L-1}, ..., B_0, F_0, ..., F_{L-1}
    def backward_op(self, layer: int) -> int:
        return self.layers - 1 - layer

    def forward_op(self, layer: int) -> int:
        return self.layers + layer

    def op_layer(self, op: int) -> int:
        return self.layers - 1 - op if op < self.layers else op - self.layers

    def op_name(self, op: int) -> str:
        """``F3``, ``B3``: the operation's pass and layer (and the layer's name, where known)."""
        layer = self.op_layer(op)
        name = f"{'B' if op < self.layers else 'F'}{layer}"
        return f"{name} ({self.names[layer]})" if self.names else name

    def durations(self) -> list[float]:
        """u_j of each operation."""
        return [self.backward[self.op_layer(j)] if j < self.layers else self.forward[self.op_layer(j)]
                for j in range(2 * self.layers)]

    def beside(self) -> list[int]:
        """M_k beside the weights: what each operation holds besides them."""
        return [self.backward_memory[self.op_layer(j)] if j < self.layers else self.forward_memory[self.op_layer(j)]
                for j in range(2 * self.layers)]

    def alone(self) -> list[int]:
        """What each operation needs with nothing else's weights on the device."""
        return [m + self.weights[self.op_layer(j)] for j, m in enumerate(self.beside())]


@dataclass(frozen=True)
class OffloadSchedule:
    """The decisions of the program's best solution: per layer whether its weights leave after its
    forward (``after_forward``, the paper's D1) or after its backward (``after_backward``, D0), whether
    they are written to the host (``offloaded``, O*), and during which operations each layer's
    prefetches run (operation index -> bytes); per operation its idle seconds."""

    after_forward: tuple[bool, ...]
    after_backward: tuple[bool, ...]
    offloaded: tuple[bool, ...]
    prefetches: tuple[dict[int, float], ...]
    offloads: tuple[dict[int, float], ...]
    idle: tuple[float, ...]

    @property
    def resident(self) -> tuple[int, ...]:
        """The layers whose weights never leave the device."""
        return tuple(i for i, (f, b) in enumerate(zip(self.after_forward, self.after_backward)) if not f and not b)

    @property
    def prefetched_bytes(self) -> float:
        return float(sum(sum(p.values()) for p in self.prefetches))

    @property
    def offloaded_bytes(self) -> float:
        return float(sum(sum(o.values()) for o in self.offloads))


@dataclass(frozen=True)
class OffloadSolution:
    """A bound and the best schedule found under it.

    ``bound``: seconds no schedule beats (an iteration, or the host link's busier direction);
    ``status``: ``"optimal"`` (HiGHS proved the optimum, within ``gap``), ``"time limit"`` (its dual
    bound when time ran out, ``gap`` left to its best solution), ``"lp relaxation"`` (the integer
    search stopped before its first bound: the relaxation's optimum, ``gap`` unknown, nan) or
    ``"trivial"`` (not even the relaxation in time: no idle, no link time); ``value``: the best
    solution's objective (nan without one); ``seconds``: the solver's wall time."""

    bound: float
    status: str
    gap: float
    value: float
    seconds: float
    schedule: OffloadSchedule | None = field(default=None, repr=False)


class _Program:
    """The mixed integer program of §6 over one chain, in scaled units (bytes over the largest
    weight, seconds over a unit that keeps both compute and copies near 1: HiGHS's tolerances are
    absolute)."""

    def __init__(self, chain: Chain):
        self.chain = chain
        L = chain.layers
        self.n = n = 2 * L
        self.byte = float(max(max(chain.weights), 1))
        slowest = min(chain.h2d, chain.d2h)
        self.time = max(max(chain.durations()), self.byte / slowest) or 1.0
        self.w = np.array(chain.weights, dtype=float) / self.byte
        self.u = np.array(chain.durations()) / self.time
        self.b_in = chain.h2d * self.time / self.byte  # scaled bytes per scaled second
        self.b_out = chain.d2h * self.time / self.byte
        # variable blocks: O, P, D, m (on the device at the start of j), c (offloaded since B_i), idle,
        # O*, D1, D0, and the link time of ``link_bound``
        grid = L * n
        self.off = {"O": 0, "P": grid, "D": 2 * grid, "m": 3 * grid, "c": 4 * grid, "idle": 5 * grid}
        self.off["O*"] = 5 * grid + n
        self.off["D1"] = self.off["O*"] + L
        self.off["D0"] = self.off["D1"] + L
        self.off["link"] = self.off["D0"] + L
        self.size = self.off["link"] + 1
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def at(self, block: str, i: int, j: int | None = None) -> int:
        if j is None:
            return self.off[block] + i
        return self.off[block] + i * self.n + j % self.n

    def row(self, coefficients: dict[int, float], low: float, high: float) -> None:
        self.rows.append((coefficients, low, high))

    def build(self) -> tuple[Bounds, LinearConstraint, np.ndarray]:
        chain, L, n = self.chain, self.chain.layers, self.n
        low = np.zeros(self.size)
        high = np.full(self.size, np.inf)
        high[self.off["O*"]:self.off["link"]] = 1.0
        integrality = np.zeros(self.size)
        integrality[self.off["O*"]:self.off["link"]] = 1
        for i in range(L):
            w = self.w[i]
            b_op, f_op = chain.backward_op(i), chain.forward_op(i)
            for j in range(n):
                high[self.at("m", i, j)] = w  # (6): never more of w_i than w_i, never less than none
                # m_{i,j+1} = m_{i,j} + P_{i,j} - D_{i,j}; round the whole cycle, (5)'s first half
                self.row({self.at("m", i, j + 1): 1.0, self.at("m", i, j): -1.0, self.at("P", i, j): -1.0,
                          self.at("D", i, j): 1.0}, 0.0, 0.0)
                # (6), second half: what is missing of the updated w_i was written to the host since B_i
                self.row({self.at("c", i, j): 1.0, self.at("m", i, j): 1.0}, w, np.inf)
                if (j + 1) % n != b_op:  # c counts from B_i and does not wrap round
                    self.row({self.at("c", i, j + 1): 1.0, self.at("c", i, j): -1.0, self.at("O", i, j): -1.0},
                             0.0, 0.0)
            for op in (b_op, f_op):  # w_i whole at the start of B_i and of F_i: (5)'s second half
                low[self.at("m", i, op)] = high[self.at("m", i, op)] = w
            low[self.at("c", i, b_op)] = high[self.at("c", i, b_op)] = 0.0
            # (7): offloaded whole once, or not at all
            self.row({**{self.at("O", i, j): 1.0 for j in range(n)}, self.at("O*", i): -w}, 0.0, 0.0)
            # (8): deleted whole, or not at all, in each of the two phases
            phase0 = [(b_op + k) % n for k in range(f_op - b_op)]
            phase1 = [j for j in range(n) if j not in phase0]
            self.row({**{self.at("D", i, j): 1.0 for j in phase1}, self.at("D1", i): -w}, 0.0, 0.0)
            self.row({**{self.at("D", i, j): 1.0 for j in phase0}, self.at("D0", i): -w}, 0.0, 0.0)
            # (3): w_i is not written out while B_i changes it
            self.row({self.at("O", i, b_op): 1.0 / self.b_out, self.at("idle", b_op): -1.0}, -np.inf, 0.0)
        beside = np.array(chain.beside(), dtype=float) / self.byte
        capacity = chain.capacity / self.byte
        for j in range(n):
            # (2): the copies of an interval end before the next operation starts
            self.row({**{self.at("O", i, j): 1.0 / self.b_out for i in range(L)}, self.at("idle", j): -1.0},
                     -np.inf, self.u[j])
            self.row({**{self.at("P", i, j): 1.0 / self.b_in for i in range(L)}, self.at("idle", j): -1.0},
                     -np.inf, self.u[j])
            # (4): the weights on the device at the start of j, beside what j holds
            self.row({self.at("m", i, j): 1.0 for i in range(L)}, -np.inf, capacity - beside[j])
        return Bounds(low, high), self.matrix(), integrality

    def link_rows(self) -> None:
        """The link time ``link_bound`` minimises: at least each direction's bytes over its rate."""
        L, n = self.chain.layers, self.n
        for block, rate in (("P", self.b_in), ("O", self.b_out)):
            self.row({**{self.at(block, i, j): 1.0 / rate for i in range(L) for j in range(n)},
                      self.at("link", 0): -1.0}, -np.inf, 0.0)

    def matrix(self) -> LinearConstraint:
        data, rows, cols = [], [], []
        lows, highs = [], []
        for r, (coefficients, lo, hi) in enumerate(self.rows):
            for col, value in coefficients.items():
                rows.append(r)
                cols.append(col)
                data.append(value)
            lows.append(lo)
            highs.append(hi)
        matrix = sparse.csr_array((data, (rows, cols)), shape=(len(self.rows), self.size))
        return LinearConstraint(matrix, np.array(lows), np.array(highs))

    def schedule(self, x: np.ndarray) -> OffloadSchedule:
        L, n = self.chain.layers, self.n
        tolerance = 1e-6

        def spread(block: str, i: int) -> dict[int, float]:
            return {j: float(x[self.at(block, i, j)] * self.byte) for j in range(n)
                    if x[self.at(block, i, j)] > tolerance}

        return OffloadSchedule(
            after_forward=tuple(bool(round(x[self.at("D1", i)])) for i in range(L)),
            after_backward=tuple(bool(round(x[self.at("D0", i)])) for i in range(L)),
            offloaded=tuple(bool(round(x[self.at("O*", i)])) for i in range(L)),
            prefetches=tuple(spread("P", i) for i in range(L)),
            offloads=tuple(spread("O", i) for i in range(L)),
            idle=tuple(float(x[self.at("idle", j)] * self.time) for j in range(n)))


def iteration_bound(chain: Chain, time_limit: float = TIME_LIMIT, tidy: bool = True) -> OffloadSolution:
    """Theorem 2: no schedule of ``chain`` runs an iteration in fewer seconds than ``bound``
    (Σ_j u_j + idle_j at the program's optimum). With ``tidy``, the schedule reported is, among
    those as fast as the best one found, one that keeps the host link least busy (a second solve):
    the program has many optima, most of them moving weights for nothing."""
    program = _Program(chain)
    bounds, constraints, integrality = program.build()
    objective = np.zeros(program.size)
    objective[program.off["idle"]:program.off["idle"] + program.n] = 1.0
    high = bounds.ub.copy()
    high[program.off["link"]] = 0.0  # unused here
    solution = _shifted(_solve(program, objective, Bounds(bounds.lb, high), constraints, integrality, time_limit),
                        chain.compute)
    if not tidy or solution.schedule is None:
        return solution
    idle = solution.value - chain.compute
    program.row({program.at("idle", j): 1.0 for j in range(program.n)}, -np.inf,
                (idle + 1e-9 * max(chain.compute, idle)) / program.time * (1 + 1e-7))
    quiet = _link(program, bounds, integrality, time_limit)
    return replace(solution, seconds=solution.seconds + quiet.seconds,
                   schedule=quiet.schedule if quiet.schedule is not None else solution.schedule)


def link_bound(chain: Chain, time_limit: float = TIME_LIMIT) -> OffloadSolution:
    """The least time the host link's busier direction is busy in any schedule of ``chain`` that
    fits the device (idle unlimited: which weights must move, and how often, for memory alone)."""
    program = _Program(chain)
    bounds, _, integrality = program.build()
    return _link(program, bounds, integrality, time_limit)


def _link(program: _Program, bounds: Bounds, integrality: np.ndarray, time_limit: float) -> OffloadSolution:
    """The program's rows so far, minimising the host link's busier direction."""
    program.link_rows()
    objective = np.zeros(program.size)
    objective[program.off["link"]] = 1.0
    return _solve(program, objective, bounds, program.matrix(), integrality, time_limit)


def _solve(program: _Program, objective: np.ndarray, bounds: Bounds, constraints: LinearConstraint,
           integrality: np.ndarray, time_limit: float) -> OffloadSolution:
    """HiGHS on the program; the bound in seconds (unscaled), from the dual bound, or from the LP
    relaxation where the search stopped with neither an optimum nor a dual bound."""
    begin = time.perf_counter()
    result = milp(objective, integrality=integrality, bounds=bounds, constraints=constraints,
                  options={"time_limit": time_limit, "mip_rel_gap": 1e-6})
    if result.status == 2:
        raise ValueError("the offloading program has no solution: the chain does not fit the device whatever moves "
                         "(every operation fits alone, but not beside the weights it must keep); give the device "
                         "more memory")
    dual = getattr(result, "mip_dual_bound", None)
    if result.status == 0 and result.x is not None:
        value = float(result.fun) * program.time
        bound = float(dual) * program.time if dual is not None and math.isfinite(dual) else value
        return OffloadSolution(min(bound, value), "optimal", float(result.mip_gap or 0.0), value,
                               time.perf_counter() - begin, program.schedule(result.x))
    value = float(result.fun) * program.time if result.x is not None else math.nan
    schedule = program.schedule(result.x) if result.x is not None else None
    if dual is not None and math.isfinite(dual):
        gap = (value - dual * program.time) / value if value and math.isfinite(value) else math.nan
        return OffloadSolution(float(dual) * program.time, "time limit", gap, value,
                               time.perf_counter() - begin, schedule)
    relaxed = milp(objective, integrality=np.zeros_like(integrality), bounds=bounds, constraints=constraints,
                   options={"time_limit": max(time_limit, LP_TIME_LIMIT)})
    if relaxed.status == 0:
        return OffloadSolution(float(relaxed.fun) * program.time, "lp relaxation", math.nan, value,
                               time.perf_counter() - begin, schedule)
    # every variable of the objective is non-negative: nothing less than zero idle, zero link time
    return OffloadSolution(0.0, "trivial", math.nan, value, time.perf_counter() - begin, schedule)


def _shifted(solution: OffloadSolution, compute: float) -> OffloadSolution:
    """The idle-time solution as iteration seconds: Σ_j u_j added to bound and value."""
    return OffloadSolution(solution.bound + compute, solution.status, solution.gap, solution.value + compute,
                           solution.seconds, solution.schedule)


# ---------------------------------------------------------------- a Harmony plan as a chain

def chain_of_graph(graph: TaskGraph, profile: Profile, machine: Machine, capacity: int) -> Chain:
    """The chain a one-device Harmony plan trains, with the plan's own work per layer, for the
    bound to judge how the plan moves weights.

    - F_i: the layer's forward over the minibatch as the plan runs it (a FWD task's microbatches at
      U_F, or the loss task's forward recording for autograd); B_i: its backward as the plan runs
      it (recompute and backward, the loss on the last layer, a step fused into the task), a pack's
      backward call cost shared over its layers as ``Profile.pack_time`` counts it; scaled by the
      machine's compute scale. Host steps are not the device's work and are not counted.
    - Memory beside the weights: the layer's own peak at the plan's largest microbatch in that pass
      less its weights and buffers (a backward's includes its gradient buffer, the paper's δw_i);
      the plan's pack holds all of that and more.
    - Weights: parameters and buffers; a tied weight counted in its lowest layer only (one copy
      on the device, one copy to move).
    - The device: ``capacity``, the memory the plan was searched against; the link: the machine's
      one-device rates, without ``Machine.latency``.

    Refuses a graph on more than one device, and a profile with frozen weights (the paper's model
    writes every weight back after its backward)."""
    devices = {t.device for t in graph.tasks if t.device != HOST}
    if len(devices) > 1:
        raise ValueError(f"the bound is for one device; this {graph.mode} plan uses {len(devices)}: compile it "
                         "with devices=1")
    layers = profile.layers
    frozen = [layer.name for layer in layers if layer.dw_bytes != layer.w_bytes]
    if frozen:
        raise ValueError(f"layers {', '.join(frozen)} hold frozen weights, which never go back to the host: the "
                         "paper's model writes every weight back after its backward; bound a model that trains "
                         "all its weights")
    work = _Work(profile, machine.compute_scale)
    for task in graph.tasks:
        if task.device != HOST:
            work.add(task)
    weights = [layer.w_bytes + layer.b_bytes for layer in layers]
    for tie in profile.ties:
        for i in sorted(tie.layers)[1:]:
            weights[i] -= tie.w_bytes
    return Chain(tuple(work.forward), tuple(work.backward), tuple(weights),
                 tuple(int(m) for m in work.forward_memory), tuple(int(m) for m in work.backward_memory),
                 int(capacity), float(machine.h2d), float(machine.d2h), tuple(layer.name for layer in layers))


class _Work:
    """Per layer, the device's seconds and peak bytes (beside its weights) in each pass, summed
    over a plan's tasks."""

    def __init__(self, profile: Profile, scale: float):
        self.profile, self.scale = profile, scale
        n = len(profile.layers)
        self.forward, self.backward = [0.0] * n, [0.0] * n
        self.forward_memory, self.backward_memory = [0.0] * n, [0.0] * n

    def add(self, task: Task) -> None:
        span = range(task.first, task.last + 1)
        layers = self.profile.layers
        if task.kind == Kind.UPD or fused_update(task):  # a step on the device: the paper's B_i steps w_i
            for i in span:
                self.backward[i] += layers[i].upd_time_device
        if task.kind not in (Kind.FWD, Kind.BWD):
            return
        for u in task.microbatches:
            if task.kind == Kind.FWD:
                self._forward(span, "fwd_time", u)
                continue
            if task.loss:  # the last pack's forward runs in its loss task, recording for autograd
                self._forward(span, LOSS_FORWARD, u)
                self.backward[-1] += self.profile.loss_time(u) * self.scale
            for i, seconds in zip(span, _shared_backward(self.profile, task.first, task.last, u)):
                recompute = 0.0 if task.loss else layers[i].at("recompute_time", u)
                self.backward[i] += (recompute + seconds) * self.scale
                self.backward_memory[i] = max(self.backward_memory[i], _beside(layers[i], "bwd_peak", u))

    def _forward(self, span: range, quantity: str, u: int) -> None:
        for i in span:
            layer = self.profile.layers[i]
            self.forward[i] += layer.at(quantity, u) * self.scale
            self.forward_memory[i] = max(self.forward_memory[i], _beside(layer, "fwd_peak", u))


def _beside(layer, peak: str, u: int) -> float:
    """A layer's peak at ``u`` less its weights and buffers."""
    return max(0.0, layer.at(peak, u) - layer.w_bytes - layer.b_bytes)


def _shared_backward(profile: Profile, first: int, last: int, u: int) -> list[float]:
    """Each layer's backward in a pack, scaled so that they add up to the pack's (``pack_time``
    takes one backward call's cost off every layer but one)."""
    own = [profile.layers[i].at("bwd_time", u) for i in range(first, last + 1)]
    total = sum(own)
    whole = profile.pack_time(first, last, u, "bwd_time")
    return [t * whole / total for t in own] if total > 0 else own
