"""Harmony's swap schedules against Beaumont et al.'s lower bound for weight offloading.

``scheduler/offload_bound.py`` solves the paper's mixed integer program (§6): no schedule that moves
a chain's weights between host and device trains an iteration faster than its bound, nor keeps the
host link busy for less than its link bound. Two sets of instances:

- **the paper's** (§7, Table 1): GPT-2 and BERT chains of 38 to 144 transformer layers at batches
  16 to 64 on a V100 with a 12 GB/s link, and the same GPT-2 chain under slower links (Fig. 4).
  The text gives each row's total compute and its own ILP, greedy and L2L times, the hidden size,
  the activations kept per layer and the recompute's working memory, but neither the split of a
  layer's time between forward and backward nor M_GPU: ``paper_chain`` fills them in as its
  docstring says, and the table sets the paper's ILP column beside this program's bound.
- **Harmony's**: one-device pp plans under memory pressure of the tiny presets and of GPT-2
  medium and large, from analytic profiles. Each plan's own work per layer (its microbatches, its
  recompute) makes the chain (``chain_of_graph``); its device is the memory the search planned
  with. The plan is searched on the spec's machine less the fixed cost of a copy, the paper's link
  model, so that its estimate and the bound price the same copies (``Harmony at 10 us``: the
  plan searched with the analytic machine's assumed 10 us a copy, as ``harmony compile
  --analytic`` plans). The models train with plain SGD (no optimizer state, as in the paper) and
  GPT-2 medium also with its model file's Adam, whose state the paper's model neither holds nor
  moves. On chains of a few layers, every configuration Harmony can express is also estimated
  (``enumerated_best``), to tell what its search misses from what its task graphs cannot do.

    python -m bench.offload_bound [--quick] [--out bench/results/offload_bound.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table

import harmony
from harmony.compiler import CompileOptions, profile_graph
from harmony.modelfile import load_model_file
from harmony.scheduler.estimator import estimate
from harmony.scheduler.keep import keep_state
from harmony.scheduler.machine import Machine
from harmony.scheduler.modes import generate
from harmony.scheduler.offload_bound import (Chain, OffloadSolution, chain_of_graph, iteration_bound,
                                             link_bound)
from harmony.scheduler.search import NoFeasibleConfiguration, SearchResult, search
from harmony.scheduler.tasks import Channel, Configuration

log = logging.getLogger("bench.offload_bound")
ROOT = Path(__file__).resolve().parents[1]
WIDTH = 160
MARGIN = 0.1  # CompileOptions.memory_margin: the search plans within capacity x (1 - MARGIN)
ENUMERATE_LAYERS = 5  # chains this short also get every configuration Harmony can express estimated
ABOVE_LEAST = 1.2  # where no plan fits the case's device: this times the least the closest one needs
FLAG = 1.2  # Harmony above this multiple of the bound: the results file says what the optimum does

# ------------------------------------------------------------------------------ the paper's instances

# Table 1 (ms): network, depth, batch, Σ_j u_j, ILP, Greedy, L2L, Greedy*
PAPER_TABLE = (
    ("GPT-2", 74, 64, 47421, 47421, 47493, 52707, 47493),
    ("GPT-2", 56, 64, 35553, 35553, 35625, 39542, 35625),
    ("GPT-2", 38, 64, 23694, 23694, 23838, 26387, 23838),
    ("GPT-2", 74, 32, 23697, 23697, 23769, 28983, 23769),
    ("GPT-2", 56, 32, 17762, 17762, 17834, 21751, 17834),
    ("GPT-2", 38, 32, 11840, 11840, 11948, 14533, 11948),
    ("GPT-2", 74, 16, 11612, 11612, 11684, 16898, 11715),
    ("GPT-2", 56, 16, 8697, 8697, 8769, 12686, 8800),
    ("GPT-2", 38, 16, 5794, 5794, 5902, 8487, 5934),
    ("Bert", 144, 64, 34486, 34486, 34499, 38379, 34499),
    ("Bert", 96, 64, 22965, 22965, 22978, 25577, 22978),
    ("Bert", 144, 32, 17443, 17443, 17483, 21336, 17483),
    ("Bert", 96, 32, 11617, 11617, 11657, 14230, 11657),
    ("Bert", 144, 16, 9090, 9090, 9183, 12983, 9215),
    ("Bert", 96, 16, 6058, 6058, 6085, 8670, 6085),
)
HIDDEN = 3072  # §7: both models' hidden size
LAYER_WEIGHTS = 4 * (12 * HIDDEN * HIDDEN + 13 * HIDDEN)  # a transformer block in float32: QKV, projection, MLP, norms
ACTIVATION_16 = 20e6  # §7: bytes kept per layer at batch 16
WORKING_16 = 1e9  # §7: 1-2 GB recomputed per layer at batch 16; the low end (see ``paper_chain``)
V100 = 16 << 30
FORWARD_SHARE = 0.25  # of a layer's time: its backward recomputes the forward, then back-propagates (2x)
PAPER_LINK = 12e9  # Table 1's bidirectional bandwidth
SWEEP = (0.5e9, 1e9, 2e9, 4e9, 8e9, 12e9)  # Fig. 4's bandwidths
SWEEP_ROW = 5  # GPT-2, depth 38, batch 32


def paper_chain(row: tuple, bandwidth: float = PAPER_LINK) -> Chain:
    """One row of Table 1 as a chain of ``depth`` identical transformer layers.

    From the text: the row's total compute, shared equally by the layers; weights of a block of
    hidden size 3072 in float32 (12h^2 + 13h parameters); 20 MB of activations kept per layer at
    batch 16, in proportion to the batch; the link. Filled in: each layer's forward is a quarter
    of its time (the backward recomputes the forward and back-propagates at twice its cost), and
    M_GPU is the V100's 16 GiB less one layer's recompute working memory, 1 GB per 16 samples: the
    low end of the text's 1-2 GB, since at the high end the deepest row (BERT, 144 layers, batch
    64) would have no room for its own activations."""
    _, depth, batch, total_ms = row[:4]
    per_layer = total_ms / 1000 / depth
    activation = ACTIVATION_16 * batch / 16
    return Chain.from_activations([per_layer * FORWARD_SHARE] * depth, [per_layer * (1 - FORWARD_SHARE)] * depth,
                                  [LAYER_WEIGHTS] * depth, [activation] * depth,
                                  int(V100 - WORKING_16 * batch / 16), bandwidth)


@dataclass
class PaperRow:
    network: str
    depth: int
    batch: int
    compute_ms: float
    paper_ilp_ms: float
    paper_greedy_ms: float
    bound: OffloadSolution | None = None
    bandwidth: float = PAPER_LINK


def departure_text(row: PaperRow) -> str:
    """Why this row's bound exceeds the paper's ILP, where it does: how many layers' weights fit at
    the turn (B_L, which holds every activation and the last gradient) against what the others'
    prefetches take."""
    if row.bound is None or not math.isfinite(row.paper_ilp_ms) or row.bound.bound * 1e3 <= row.paper_ilp_ms * 1.005:
        return ""
    chain = paper_chain((row.network, row.depth, row.batch, row.compute_ms))
    room = chain.capacity - chain.backward_memory[-1]
    fit = int(room // LAYER_WEIGHTS)
    copy = LAYER_WEIGHTS / row.bandwidth
    return (f"{row.network}, {row.depth} layers, batch {row.batch}: the chain built here is not the paper's. With the "
            f"M_GPU assumed, {fit} of the {row.depth} layers' weights fit beside the activations at the turn, so the "
            f"others leave and come back at least once, {_time(copy)} a copy, against {_time(row.compute_ms / 1e3 / row.depth)} "
            "of compute a layer, and the bound finds that the link cannot hide them all.")


def paper_rows(rows: tuple, time_limit: float) -> list[PaperRow]:
    """The program's bound for each Table 1 row."""
    out = []
    for row in rows:
        chain = paper_chain(row)
        out.append(PaperRow(row[0], row[1], row[2], row[3], row[4], row[5],
                            iteration_bound(chain, time_limit, tidy=False)))
    return out


def bandwidth_sweep(row: tuple, time_limit: float) -> list[PaperRow]:
    """Fig. 4's experiment on one Table 1 row: the bound as the link slows."""
    return [PaperRow(row[0], row[1], row[2], row[3], math.nan, math.nan,
                     iteration_bound(paper_chain(row, bandwidth), time_limit, tidy=False), bandwidth)
            for bandwidth in SWEEP]


# ---------------------------------------------------------------------------- Harmony's instances

def sgd(params) -> torch.optim.Optimizer:
    """Plain SGD: no optimizer state, the paper's model of an update."""
    return torch.optim.SGD(params, lr=1e-3)


@dataclass(frozen=True)
class Case:
    """A model file at one minibatch on an analytic device, ``weights_share`` of whose weights the
    device has room for beside the largest layer's work (memory pressure on the weights)."""

    name: str
    model_file: str
    options: dict[str, Any]
    minibatch: int
    spec: str
    optimizer: str = "sgd"  # "sgd", or "file": the model file's own (Adam for GPT-2)
    weights_share: float = 0.5
    same_u: bool = False  # U_F = U_B, as the compile asks of a model whose layers mix samples (BatchNorm)


CASES = (
    Case("gpt2 tiny", "models/gpt2.py", {"preset": "tiny", "dropout": 0.0}, 8, "h100"),
    Case("bert tiny", "models/bert.py", {"preset": "tiny", "dropout": 0.0}, 8, "h100"),
    Case("llama tiny", "models/llama.py", {"preset": "tiny"}, 8, "h100"),
    Case("resnet tiny", "models/resnet.py", {"preset": "tiny"}, 8, "h100", same_u=True),
    Case("gpt2-medium", "models/gpt2.py", {"preset": "medium", "dropout": 0.0}, 16, "1080ti"),
    Case("gpt2-medium", "models/gpt2.py", {"preset": "medium", "dropout": 0.0}, 16, "1080ti", "file"),
    Case("gpt2-large", "models/gpt2.py", {"preset": "large", "dropout": 0.0}, 2, "h100"),
)
QUICK = ("gpt2 tiny",)


@dataclass
class HarmonyRow:
    case: Case
    device_memory: int = 0
    planned: int = 0
    configuration: str = ""
    harmony_s: float = math.nan  # the plan's estimate, on the link model of the paper
    harmony_latency_s: float = math.nan  # the plan searched with the spec machine's latency
    harmony_link_s: float = math.nan  # its host link's busier direction
    harmony_state_bytes: int = 0  # weights, buffers and optimizer state it moves in
    kept: tuple[int, ...] = ()
    update: str = ""
    bound: OffloadSolution | None = None
    link: OffloadSolution | None = None
    chain: Chain | None = field(default=None, repr=False)
    error: str = ""
    grown: bool = False  # the case's device fitted no plan: grown to what the closest one needs
    compute_s: float = math.nan  # the plan's device compute
    head_s: float = math.nan  # before its first compute unit
    best: tuple[float, str] = (math.nan, "")  # ``enumerated_best``, on a short chain
    tail_s: float = math.nan  # after its last

    @property
    def ratio(self) -> float:
        return self.harmony_s / self.bound.bound if self.bound else math.nan

    @property
    def link_ratio(self) -> float:
        if not self.link or self.link.bound <= 0:
            return math.nan
        return self.harmony_link_s / self.link.bound


def graph_of(case: Case):
    """The model file's layer graph (built on the meta device, as an analytic compile does) and
    its model file."""
    mf = load_model_file(ROOT / case.model_file, case.options)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = mf.build_model()
    return harmony.decompose(model, mf.get_batch(1, 0)[0]), mf


def device_memory(profile, case: Case) -> int:
    """The device: the largest layer's pass at one sample alone (its weights included), beside
    ``weights_share`` of every layer's weights, over the search's margin."""
    alone = max(max(layer.at("fwd_peak", 1), layer.at("bwd_peak", 1)) for layer in profile.layers)
    weights = sum(layer.w_bytes + layer.b_bytes for layer in profile.layers)
    return int((alone + case.weights_share * weights) / (1 - MARGIN))


def harmony_row(case: Case, time_limit: float) -> HarmonyRow:
    """Harmony's plan for ``case`` and the bound of the chain it trains."""
    graph, mf = graph_of(case)
    build_optimizer: Callable = sgd if case.optimizer == "sgd" else mf.build_optimizer

    def profiled(memory: int | None):
        options = CompileOptions(minibatch=case.minibatch, devices=1, device_memory=memory, analytic=case.spec,
                                 compare=False, probe=False)
        return profile_graph(graph, mf.get_batch, build_optimizer, options)

    uncapped, _ = profiled(None)
    row = HarmonyRow(case, device_memory=device_memory(uncapped, case))
    try:
        profile, machine, result = planned(row, profiled)
    except NoFeasibleConfiguration as exc:
        row.error = f"Harmony finds no plan: {exc}"[:200]
        return row
    return bounded(row, result, profile, machine, time_limit)


def bounded(row: HarmonyRow, result: SearchResult, profile, machine: Machine, time_limit: float) -> HarmonyRow:
    """The row with the plan's figures and the bounds of the chain it trains on its planned memory."""
    describe_plan(row, result)
    row.head_s, row.tail_s = cold_ends(result, profile, machine, row.planned)
    if len(profile.layers) <= ENUMERATE_LAYERS:
        row.best = enumerated_best(profile, machine, row.planned, row.case, result.config)
    row.chain = chain_of_graph(result.graph, profile, machine, row.planned)
    row.bound = iteration_bound(row.chain, time_limit)
    row.link = link_bound(row.chain, time_limit)
    return row


def planned(row: HarmonyRow, profiled: Callable, grow: bool = True) -> tuple:
    """Harmony's search on the row's device, on the paper's link model (the spec's machine without
    its fixed cost a copy), and the same search on the spec's machine. Where no configuration fits,
    the device grows to ``ABOVE_LEAST`` times what the closest one needs, as ``bench.timed`` does."""
    profile, spec_machine = profiled(row.device_memory)
    row.planned = int(row.device_memory * (1 - MARGIN))
    machine = dataclasses.replace(spec_machine, latency=0.0)
    try:
        result = search(profile, machine, "pp", 1, row.case.minibatch, capacity=row.planned, same_u=row.case.same_u)
    except NoFeasibleConfiguration as exc:
        if not grow or exc.shortfall is None:
            raise
        row.device_memory = int(exc.shortfall.needed * ABOVE_LEAST / (1 - MARGIN))
        row.grown = True
        return planned(row, profiled, grow=False)
    row.harmony_latency_s = search(profile, spec_machine, "pp", 1, row.case.minibatch, capacity=row.planned,
                                   same_u=row.case.same_u).estimate.iteration_time
    return profile, machine, result


def enumerated_best(profile, machine: Machine, capacity: int, case: Case,
                    chosen: Configuration) -> tuple[float, str]:
    """Harmony's own estimate of the fastest configuration that fits among all it can express on a
    chain this short: every forward and backward packing (sharing the last pack), U_F and U_B among
    the powers of two up to the minibatch and the search's choice, each with no state kept, with
    every keepable pack kept, and kept as far as room allows (``keep_state``): what the search,
    which tries the fewest packs that fit and one more and keeps partly only its winner, may miss."""
    layers = len(profile.layers)
    sizes = sorted({1 << k for k in range(case.minibatch.bit_length()) if 1 << k <= case.minibatch}
                   | {chosen.u_f, chosen.u_b})
    best = (math.inf, "")
    for packs_f, packs_b in itertools.product(_packings(layers), repeat=2):
        if packs_f[-1] != packs_b[-1]:
            continue
        for u_f, u_b in itertools.product(sizes, repeat=2):
            if (case.same_u and u_f != u_b) or u_f > profile.u_fmax or u_b > profile.u_bmax:
                continue
            config = Configuration(u_f, packs_f, u_b, packs_b)
            graph = generate("pp", profile, config, 1, case.minibatch)
            for label, variant in (("no state kept", graph), ("kept", keep_state(graph, profile, capacity)),
                                   ("kept partly", keep_state(graph, profile, capacity, partial=True))):
                if variant is None:
                    continue
                est = estimate(variant, profile, machine, capacity=capacity, record_events=False)
                if est.fits and not est.deadlock and est.iteration_time < best[0]:
                    best = (est.iteration_time, f"{config}, {label}")
    return best


def _packings(layers: int) -> list[list[tuple[int, int]]]:
    """Every cut of ``layers`` layers into contiguous packs."""
    out = []
    for cuts in itertools.product((False, True), repeat=layers - 1):
        packs, first = [], 0
        for i, cut in enumerate(cuts):
            if cut:
                packs.append((first, i))
                first = i + 1
        out.append(packs + [(first, layers - 1)])
    return out


def cold_ends(result: SearchResult, profile, machine: Machine, capacity: int) -> tuple[float, float]:
    """How long the plan's device waits before its first compute unit (the first tasks' state and
    inputs coming in) and after its last (the last state going out, the host's steps): an iteration
    the estimate plays from an idle device to an idle device, where the paper's cyclic schedule
    overlaps both with the neighbouring iterations."""
    events = [e for e in estimate(result.graph, profile, machine, capacity=capacity).events
              if e.stream == "compute" and e.device == 0]
    if not events:
        return math.nan, math.nan
    return min(e.start for e in events), result.estimate.iteration_time - max(e.end for e in events)


def describe_plan(row: HarmonyRow, result: SearchResult) -> None:
    """The plan's figures the table reports."""
    est = result.estimate
    busy = est.busy.get(0, {})
    row.configuration = str(result.config)
    row.harmony_s = est.iteration_time
    row.compute_s = busy.get("compute", 0.0)
    row.harmony_link_s = max(busy.get("swap-in", 0.0), busy.get("swap-out", 0.0))
    row.harmony_state_bytes = sum(t.nbytes for task in result.graph.tasks for t in task.inputs
                                  if t.channel == Channel.SWAP and t.tensor in ("W", "B", "K"))
    row.kept = tuple(sorted({layer for task in result.graph.tasks for t in task.inputs if t.channel == Channel.KEEP
                             for layer in range(task.first, task.last + 1)}))
    row.update = ", ".join(sorted({task.update for task in result.graph.tasks if task.update != "none"})) or "none"


# ------------------------------------------------------------------------------------ reporting

def _time(seconds: float) -> str:
    """Seconds in the unit that suits them: ``11.2 us``, ``3.45 ms``, ``1.31 s``."""
    if not math.isfinite(seconds):
        return "—"
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= size:
            return f"{seconds / size:.3g} {unit}"
    return "0" if seconds == 0 else f"{seconds * 1e9:.3g} ns"


def _ratio(value: float) -> str:
    return "—" if not math.isfinite(value) else f"{value:.2f}"


def _status(solution: OffloadSolution | None) -> str:
    if solution is None:
        return "—"
    if solution.status == "optimal":
        return "optimal"
    gap = "" if not math.isfinite(solution.gap) else f", gap {solution.gap:.1%}"
    return f"{solution.status}{gap}"


def _optimizer(case: Case) -> str:
    return "SGD" if case.optimizer == "sgd" else "Adam"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


PAPER_COLUMNS = ("network", "depth", "batch", "link", "Σu ms", "paper ILP ms", "bound ms", "idle ms", "status",
                 "paper greedy ms", "solve s")
HARMONY_COLUMNS = ("case", "spec", "optimizer", "device", "layers", "update", "Harmony", "bound", "status",
                   "Harmony/bound", "Harmony link", "link bound", "link ratio", "Harmony at 10 us",
                   "Harmony's best of all", "solve s")


def paper_cells(row: PaperRow) -> list[str]:
    b = row.bound
    return [row.network, str(row.depth), str(row.batch), f"{row.bandwidth / 1e9:g} GB/s", f"{row.compute_ms:.0f}",
            "—" if not math.isfinite(row.paper_ilp_ms) else f"{row.paper_ilp_ms:.0f}",
            f"{b.bound * 1e3:.0f}", f"{max(0.0, b.bound - row.compute_ms / 1e3) * 1e3:.0f}", _status(b),
            "—" if not math.isfinite(row.paper_greedy_ms) else f"{row.paper_greedy_ms:.0f}", f"{b.seconds:.1f}"]


def harmony_cells(row: HarmonyRow) -> list[str]:
    c = row.case
    head = [c.name, c.spec, _optimizer(c), _bytes(row.device_memory) + (" *" if row.grown else "")]
    if row.error:
        return head + ["", row.error] + [""] * (len(HARMONY_COLUMNS) - 6)
    return head + [str(row.chain.layers), row.update, _time(row.harmony_s), _time(row.bound.bound),
                   _status(row.bound), _ratio(row.ratio), _time(row.harmony_link_s), _time(row.link.bound),
                   _ratio(row.link_ratio), _time(row.harmony_latency_s), _time(row.best[0]),
                   f"{row.bound.seconds + row.link.seconds:.1f}"]


def table(title: str, columns: tuple[str, ...], rows: list[list[str]]) -> Table:
    """A rich table of ``rows`` under ``columns``."""
    out = Table(title=title)
    for name in columns:
        out.add_column(name, justify="left" if name in ("network", "case", "status") else "right")
    for cells in rows:
        out.add_row(*cells)
    return out


def markdown(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def optimum_text(row: HarmonyRow) -> str:
    """What the bound's schedule does, in words: which layers' weights never leave, which stay from
    their forward to their backward (sent out after the backward only), which from their backward
    to the next forward (out after the forward only), which leave twice; what it moves; where the
    device idles."""
    chain, schedule = row.chain, row.bound.schedule
    if schedule is None:
        return "has no schedule within the time limit"
    groups: dict[tuple[bool, bool], list[int]] = {(False, False): [], (False, True): [], (True, False): [],
                                                  (True, True): []}
    for i, leaves in enumerate(zip(schedule.after_forward, schedule.after_backward)):
        groups[leaves].append(i)
    text = (f"keeps {_layers(groups[False, False])} on the device throughout, {_layers(groups[False, True])} "
            f"from their forward to their backward only, {_layers(groups[True, False])} from their backward to "
            f"the next forward only, and sends {_layers(groups[True, True])} out after both passes; it prefetches "
            f"{_bytes(schedule.prefetched_bytes)} and writes back {_bytes(schedule.offloaded_bytes)}, each weight "
            "at most once")
    loads = [f"L{i} during {chain.op_name(max(spread, key=spread.get)).split()[0]}"
             for i, spread in enumerate(schedule.prefetches) if spread]
    if loads:
        text += " (the most of each prefetch: " + ", ".join(loads) + ")"
    idle = [(chain.op_name(j).split()[0], s) for j, s in enumerate(schedule.idle) if s > 1e-9 * chain.compute]
    if idle:
        return text + "; idles after " + ", ".join(f"{name} {_time(s)}" for name, s in idle)
    return text + "; never idles"


def _layers(indices: list[int]) -> str:
    return "L" + _ranges(indices) if indices else "no layer"


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out, start = [], None
    for k, v in enumerate(values):
        if start is None:
            start = v
        if k + 1 == len(values) or values[k + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", L".join(out)


def harmony_text(row: HarmonyRow) -> str:
    kept = f"keeps {_layers(list(row.kept))} across iterations"
    return (f"{row.configuration}; {kept}; updates on the {row.update}; moves "
            f"{_bytes(row.harmony_state_bytes)} of state in (weights, buffers, optimizer state); computes "
            f"{_time(row.compute_s)} of its {_time(row.harmony_s)}, waiting {_time(row.head_s)} before its first "
            f"unit and {_time(row.tail_s)} after its last")


def missed_text(row: HarmonyRow) -> str:
    """What Harmony's own estimator finds that its search does not, where the chain was enumerated."""
    seconds, config = row.best
    if not math.isfinite(seconds):
        return ""
    if seconds < row.harmony_s * (1 - 1e-6):
        return (f" Its own estimator puts {config} at {_time(seconds)} ({_ratio(seconds / row.bound.bound)}x the "
                "bound), a plan its search does not reach.")
    return " No configuration it can express estimates faster."


def report(paper: list[PaperRow], sweep: list[PaperRow], ours: list[HarmonyRow], command: str) -> str:
    """The results file."""
    lines = ["# Harmony's swap schedules against Beaumont et al.'s offloading bound", "",
             f"Measured {datetime.date.today().isoformat()} with torch {torch.__version__} and HiGHS "
             f"(scipy.optimize.milp): `{command}`", "",
             "The bound is `scheduler/offload_bound.py`: the mixed integer program of Beaumont, Eyraud-Dubois, "
             "Shilova and Zhao, *Weight Offloading Strategies for Training Large DNN Models* (2022, §6), whose "
             "optimum no schedule of the chain beats. `status`: `optimal` where HiGHS proved the optimum; `time "
             "limit, gap g`: its dual bound when the time limit (`--time-limit`, 5 s a program by default) ran out, "
             "g short of its best schedule; `lp relaxation`: the relaxation's optimum, where the integer search had "
             "no bound of its own in time.", "",
             "## The paper's instances (Table 1)", "",
             "The text gives each row's total compute (Σu) and the paper's ILP and greedy times, the hidden size "
             "(3072), 20 MB of activations kept per layer at batch 16, 1-2 GB recomputed per layer at batch 16 "
             "and the 12 GB/s link. It does not give the forward/backward split of a layer's time, M_GPU, nor "
             "whether the depth counts the embedding and the head: here every layer is a float32 transformer "
             "block taking Σu/depth, a quarter of it forward; M_GPU is 16 GiB less 1 GB per 16 samples "
             "(`paper_chain`).", ""]
    lines += markdown(PAPER_COLUMNS, [paper_cells(r) for r in paper]) + [""]
    lines += [f"- {text}" for text in (departure_text(r) for r in paper) if text] + [""]
    if sweep:
        lines += ["Fig. 4's bandwidths on one row (the text: \"almost no idle time when the bandwidth is higher "
                  "than 4GB/s\"):", ""]
        lines += markdown(PAPER_COLUMNS, [paper_cells(r) for r in sweep]) + [""]
    lines += ["## Harmony's one-device pp plans", "",
              "Analytic profiles; the device has room for the largest layer's pass at one sample and half the "
              "model's weights, over the search's 10% margin (`device`); the bound's device is the memory the "
              "search planned with. `Harmony` is the plan's estimate on the spec's machine without the fixed "
              "10 us a copy (the paper's link model, which the search also planned on); `Harmony at 10 us`: "
              "the same search on the analytic machine as `harmony compile --analytic` models it, 10 us a copy. `link`: the host link's busier direction "
              "(Harmony's includes the activations it stashes and the minibatch; the bound's only weights). The "
              "chain is the plan's own work per layer (its microbatches, its recompute), so the bound judges how "
              "the plan moves weights, not its choice of microbatches.", ""]
    lines += markdown(HARMONY_COLUMNS, [harmony_cells(r) for r in ours]) + [""]
    if any(r.grown for r in ours):
        lines += [f"\\* no configuration fitted the case's device: grown to {ABOVE_LEAST} times what the closest one "
                  "needs, as `bench.timed` does.", ""]
    if any(math.isfinite(r.best[0]) for r in ours):
        lines += [f"`Harmony's best of all`: on chains of at most {ENUMERATE_LAYERS} layers, Harmony's own estimate "
                  "of the fastest configuration that fits among every packing, U_F and U_B among the powers of two "
                  "and the search's choice, without kept state, kept whole and kept partly (`enumerated_best`).", ""]
    lines += ["Harmony's plans:", ""] + [f"- {r.case.name}, {r.case.spec}, {_optimizer(r.case)}: {harmony_text(r)}"
                                        for r in ours if not r.error] + [""]
    flagged = [r for r in ours if not r.error and r.ratio > FLAG]
    if flagged:
        lines += [f"### Where Harmony is above {FLAG}x the bound", ""]
        for r in flagged:
            c = r.case
            lines += [f"- **{c.name}, {c.spec}, {_optimizer(c)}** ({_ratio(r.ratio)}x). The optimum {optimum_text(r)}. "
                      f"Harmony: {harmony_text(r)}.{missed_text(r)}"]
        lines.append("")
    lines += ["What the bound can and cannot say: it is the paper's relaxation (memory checked at the start of each "
              "operation, against each layer's own working memory rather than a pack's; each layer's weights moved "
              "alone), so no schedule beats it and none need reach it. Two freedoms of the optimum are outside "
              "Harmony's task graphs by construction: its schedule is a cycle, so the next iteration's first "
              "prefetches run during this iteration's backward (a layer sent out after its backward comes back for "
              "the next forward while later backwards run), where Harmony's iteration starts and ends on an idle "
              "device; and it "
              "keeps a layer from its forward to its backward only, or from its backward to the next forward only, "
              "where Harmony keeps a pack's state across iterations whole (`keep.py`) or loads it for each task "
              "that runs the pack.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three paper rows, no sweep, the tiny GPT-2 only")
    parser.add_argument("--time-limit", type=float, default=5.0, help="seconds of HiGHS per program (default 5)")
    parser.add_argument("--out", help="write the results file here (e.g. bench/results/offload_bound.md)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    console = Console(width=WIDTH)
    begin = time.perf_counter()
    rows = PAPER_TABLE[6:9] if args.quick else PAPER_TABLE
    paper = paper_rows(rows, args.time_limit)
    console.print(table("Table 1's instances: the paper's ILP and this program's bound", PAPER_COLUMNS,
                        [paper_cells(r) for r in paper]))
    sweep = [] if args.quick else bandwidth_sweep(PAPER_TABLE[SWEEP_ROW], args.time_limit)
    if sweep:
        console.print(table("Fig. 4's bandwidths", PAPER_COLUMNS, [paper_cells(r) for r in sweep]))
    cases = [c for c in CASES if c.name in QUICK] if args.quick else CASES
    ours = []
    for case in cases:
        log.info("%s (%s, %s)", case.name, case.spec, case.optimizer)
        ours.append(harmony_row(case, args.time_limit))
    console.print(table("Harmony's one-device pp plans against the bound", HARMONY_COLUMNS,
                        [harmony_cells(r) for r in ours]))
    for r in ours:
        if not r.error and r.ratio > FLAG:
            console.print(f"{r.case.name} ({r.case.spec}, {r.case.optimizer}): the optimum {optimum_text(r)}")
    log.info("%.0f s", time.perf_counter() - begin)
    if args.out:
        command = "python -m bench.offload_bound " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.out).write_text(report(paper, sweep, ours, command.strip()))


if __name__ == "__main__":
    main()
