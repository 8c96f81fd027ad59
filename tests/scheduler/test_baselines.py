"""Per-GPU-swap pipeline baselines (GPipe, 1F1B, with and without recompute): stage binding,
schedules, §3's swap volumes, the stash with and without recompute, and the estimator on them."""

import pytest

from harmony.scheduler.baselines import BASELINES, gpipe_swap, one_f_one_b_swap, schedule, stages
from harmony.scheduler.estimator import estimate
from harmony.scheduler.machine import Machine
from harmony.scheduler.tasks import Channel, Configuration, Kind, TaskGraph

R, W, X = 8, 1000, 10  # layers, weight bytes per layer, activation bytes per sample (uniform profile)
PIPELINES = ("gpipe-swap", "gpipe-swap-r", "1f1b-swap", "1f1b-swap-r")


def packed(size=1, r=R, u=1):
    packs = [(i, min(i + size - 1, r - 1)) for i in range(0, r, size)]
    return Configuration(u_f=u, packs_f=packs, u_b=u, packs_b=packs)


def ops(graph: TaskGraph, device: int) -> list[tuple[str, int]]:
    """The device's order of microbatch forwards ("F", j) and backwards ("B", j), read off its
    tasks: a forward starts at the FWD of its stage's first pack, a backward at the BWD of its last."""
    tasks = [t for t in graph.device_tasks(device) if t.kind != Kind.UPD]
    first_fwd = min((t.first for t in tasks if t.kind == Kind.FWD), default=None)
    last_bwd = max(t.first for t in tasks if t.kind == Kind.BWD)
    u = graph.config.u_f
    out = []
    for t in tasks:
        if t.kind == Kind.FWD and t.first == first_fwd:
            out.append(("F", t.offset // u))
        elif t.kind == Kind.BWD and t.first == last_bwd:
            out.append(("B", t.offset // u))
    return out


@pytest.mark.parametrize("mode", PIPELINES)
def test_stage_s_runs_on_device_s_and_stages_are_contiguous_and_balanced(uniform, mode):
    profile, cfg = uniform(layers=R), packed()
    groups = stages(profile, cfg, 4)
    assert [p for g in groups for p in g] == cfg.packs_f and all(groups)
    assert [len(g) for g in groups] == [2, 2, 2, 2]  # identical layers: an even split
    graph = BASELINES[mode](profile, cfg, 4, 6)
    stage_of = {p: s for s, g in enumerate(groups) for p in g}
    assert all(t.device == stage_of[(t.first, t.last)] for t in graph.tasks)
    # one microbatch per task, no grouping; one update per pack at the end of its device's work
    assert all(t.microbatches == [1] for t in graph.tasks if t.kind != Kind.UPD)
    for d in range(4):
        kinds = [t.kind for t in graph.device_tasks(d)]
        assert kinds[-2:] == [Kind.UPD, Kind.UPD] and Kind.UPD not in kinds[:-2]
    graph.validate()


def test_stages_balance_time_not_pack_count(uniform):
    # the last pack's loss task does no recompute: it is cheaper than the others with recompute
    profile = uniform(layers=5)
    cfg = packed(r=5)
    assert [len(g) for g in stages(profile, cfg, 4, recompute=True)] == [1, 1, 1, 2]
    with pytest.raises(ValueError, match="cannot fill"):
        stages(profile, packed(size=3, r=5), 4)


def test_activations_cross_stages_peer_to_peer_and_stay_local_within_one(uniform):
    graph = gpipe_swap(uniform(layers=4), packed(r=4), 2, 3, recompute=True)
    for t in graph.tasks:
        for i in t.inputs:
            if i.tensor in ("X", "dY") and i.task is not None:
                producer = next(p for p in graph.tasks if p.id == i.task)
                want = Channel.LOCAL if producer.device == t.device else Channel.P2P
                assert i.channel == want and any(o.task == t.id for o in producer.outputs)
    # the minibatch comes from the host for the first pack's forward and its backward only
    assert graph.swap_bytes("X") == 2 * 3 * X


def test_gpipe_runs_every_forward_before_any_backward(uniform):
    graph = gpipe_swap(uniform(layers=R), packed(), 4, 6, recompute=False)
    for d in range(4):
        assert ops(graph, d) == schedule("gpipe", d, 4, 6)
        assert ops(graph, d) == [("F", j) for j in range(6)] + [("B", j) for j in range(6)]
        kinds = [t.kind for t in graph.device_tasks(d)]
        assert max(i for i, k in enumerate(kinds) if k == Kind.FWD) < kinds.index(Kind.BWD)


def test_1f1b_warms_up_then_alternates_then_cools_down(uniform):
    n, m = 4, 6
    graph = one_f_one_b_swap(uniform(layers=R), packed(), n, m, recompute=True)
    assert ops(graph, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                             ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert ops(graph, n - 1) == [op for j in range(m) for op in (("F", j), ("B", j))]
    for s in range(n):
        seq = ops(graph, s)
        warmup = seq.index(("B", 0))
        assert warmup == n - s  # N - s - 1 warm-up forwards, then the steady state's first forward
        in_flight = max(sum(1 for o in seq[:k + 1] if o[0] == "F") - sum(1 for o in seq[:k + 1] if o[0] == "B")
                        for k in range(len(seq)))
        assert in_flight == n - s  # at most N - s microbatches stashed at once, however large m
    # fewer microbatches than stages: all forwards, then all backwards
    assert schedule("1f1b", 0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    graph.validate()


@pytest.mark.parametrize("n, m", [(1, 1), (2, 3), (4, 2), (4, 7)])
@pytest.mark.parametrize("mode", PIPELINES)
def test_weight_swaps_match_section_3(uniform, mode, n, m):
    """§3: PP with per-GPU swap moves (4m+2)·|W| of weights per iteration (no N term: no replicas),
    less 2m·|W_last| as the last pack's forward runs with its backward; gradients are swapped in and
    out per microbatch (not in for the first) and read once more by the update."""
    profile = uniform(layers=R, w=W)
    graph = BASELINES[mode](profile, packed(), n, m)
    graph.validate()
    assert graph.swap_bytes("W") == (4 * m + 2) * R * W - 2 * m * W
    assert graph.swap_bytes("dW") == 2 * m * R * W
    assert graph.swap_bytes("K") == 2 * R * 2 * W
    dp = BASELINES["dp-swap-r"](profile, packed(), n, n * m)
    assert dp.mode == "dp-swap-r"
    assert dp.swap_bytes("W") == n * graph.swap_bytes("W")  # DP swaps the same per replica


@pytest.mark.parametrize("kind", [gpipe_swap, one_f_one_b_swap])
def test_recompute_stashes_pack_inputs_only(uniform, kind):
    m = 5
    profile, cfg = uniform(layers=R), packed(size=2)  # packs L0-1 L2-3 L4-5 L6-7 (the loss pack)
    with_r = kind(profile, cfg, 2, m, recompute=True)
    without = kind(profile, cfg, 2, m, recompute=False)
    # stashed and read back per microbatch: the inputs of L2, L4 with recompute; of L1..L5 without
    assert with_r.swap_bytes("Xs") == 2 * m * 2 * X
    assert without.swap_bytes("Xs") == 2 * m * 5 * X
    assert with_r.swap_bytes("W") == without.swap_bytes("W")


@pytest.mark.parametrize("mode", PIPELINES)
def test_estimator_runs_the_baselines_without_deadlock(uniform, mode):
    profile = uniform(layers=R, w=10**6, x_per_sample=10**5)
    graph = BASELINES[mode](profile, packed(size=2, u=2), 4, 15)  # microbatches 2x7 + 1
    est = estimate(graph, profile, Machine.from_spec("1080ti", 4), record_events=False)
    assert est.deadlock is None and 0 < est.iteration_time < float("inf")
    assert est.bytes_by_channel["SWAP in"] + est.bytes_by_channel["SWAP out"] == graph.swap_bytes()
    assert est.bytes_by_channel["P2P"] > 0


def test_1f1b_needs_less_device_memory_than_gpipe_with_many_microbatches(uniform):
    """The reason 1F1B exists. With per-GPU swap the stash goes to host memory in both, but GPipe's
    last stage keeps every microbatch's activation between its packs from the forward phase to the
    backward phase, and upstream stages hold sends that wait; 1F1B bounds both by N - s."""
    profile = uniform(layers=R, w=10**6, x_per_sample=10**6)
    machine = Machine.from_spec("1080ti", 4)
    peaks = {}
    for mode in ("gpipe-swap", "1f1b-swap"):
        graph = BASELINES[mode](profile, packed(), 4, 32)
        est = estimate(graph, profile, machine, record_events=False)
        assert est.deadlock is None
        peaks[mode] = est.peak_memory
    assert max(peaks["1f1b-swap"].values()) < max(peaks["gpipe-swap"].values())
    assert peaks["1f1b-swap"][3] < peaks["gpipe-swap"][3] / 2


def test_graphs_round_trip_through_plain_data(uniform):
    for mode, make in BASELINES.items():
        graph = make(uniform(layers=4), packed(r=4), 2, 4)
        assert graph.mode == mode
        assert TaskGraph.from_dict(graph.to_dict()).to_text() == graph.to_text()
