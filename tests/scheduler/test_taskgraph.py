"""Task graphs: weight swap volumes of §3's analysis, structure of every mode, golden printouts."""

from pathlib import Path

import pytest

from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import HOST, Channel, Configuration, Kind, TaskGraph

GOLDEN = Path(__file__).parent / "golden"
R, W = 6, 1000


def single_layer_packs(r=R):
    return [(i, i) for i in range(r)]


def config(u_f=1, u_b=1, r=R):
    return Configuration(u_f=u_f, packs_f=single_layer_packs(r), u_b=u_b, packs_b=single_layer_packs(r))


@pytest.mark.parametrize("n, m", [(1, 1), (2, 3), (4, 2)])
def test_weight_swaps_match_section_3(uniform, n, m):
    """§3: per iteration, DP with per-GPU swap moves (4m+2)·N·|W| of weights, Harmony DP 3·N·|W|,
    Harmony PP 3·|W| (m microbatches per device, one layer per pack). The last pack's forward runs
    with its backward (jit-compute), which saves one swap-in of its weights per pass that would
    have swapped them: 2m per device for dp-swap, 1 per device for dp and 1 for pp."""
    profile = uniform(layers=R, w=W)
    total_w, last_w = R * W, W
    d = m * n
    dp_swap = generate("dp-swap", profile, config(), n, d)
    assert dp_swap.swap_bytes("W") == (4 * m + 2) * n * total_w - 2 * m * n * last_w
    dp = generate("dp", profile, config(), n, d, update="device")
    assert dp.swap_bytes("W") == 3 * n * total_w - n * last_w
    pp = generate("pp", profile, config(), n, d)
    assert pp.swap_bytes("W") == 3 * total_w - last_w


def test_pp_binds_task_i_to_device_i_mod_n_and_wraps_around(uniform):
    graph = generate("pp", uniform(layers=R), config(u_f=2, u_b=1), 4, 8)
    compute = [t for t in graph.tasks if t.kind != Kind.UPD]
    assert [t.device for t in compute] == [i % 4 for i in range(len(compute))]
    assert [(t.kind, t.first) for t in compute] == [(Kind.FWD, i) for i in range(R - 1)] + [(Kind.BWD, i) for i in reversed(range(R))]
    assert compute[R - 1].loss and all(t.microbatches == [2] * 4 for t in compute[: R - 1])
    graph.validate()


def test_pp_sends_activations_and_gradients_peer_to_peer(uniform):
    graph = generate("pp", uniform(layers=4), config(r=4), 2, 2)
    second = graph.tasks[1]
    assert {(t.tensor, t.channel, t.peer) for t in second.inputs if t.tensor == "X"} == {("X", Channel.P2P, 0)}
    p2p_bytes = sum(t.nbytes for task in graph for t in task.inputs if t.channel == Channel.P2P)
    # only the minibatch comes from the host: for the first forward pack and for its recompute
    assert p2p_bytes > 0 and graph.swap_bytes("X") == 2 * (2 * 10)


def test_host_update_moves_gradients_not_weights_out(uniform):
    graph = generate("pp", uniform(layers=3), config(r=3), 2, 4, update="host")
    assert graph.swap_bytes("dW") == 3 * W
    assert [t.device for t in graph.tasks if t.kind == Kind.UPD] == [HOST] * 3
    graph.validate()


def test_dp_reduces_gradients_of_all_devices_before_one_host_update(uniform):
    graph = generate("dp", uniform(layers=3), config(r=3), 3, 7)
    updates = [t for t in graph.tasks if t.kind == Kind.UPD]
    assert len(updates) == 3 and all(len(t.deps()) == 3 for t in updates)
    assert sorted(t.samples for t in graph.tasks if t.kind == Kind.FWD and t.first == 0) == [2, 2, 3]
    graph.validate()


def test_last_microbatch_is_smaller_when_u_does_not_divide_the_minibatch(uniform):
    graph = generate("pp", uniform(layers=3), config(u_f=4, u_b=3, r=3), 2, 10)
    assert graph.tasks[0].microbatches == [4, 4, 2]
    assert graph.tasks[2].microbatches == [3, 3, 3, 1]


def test_unknown_mode_and_bad_packs_are_refused(uniform):
    with pytest.raises(ValueError, match="unknown mode"):
        generate("zigzag", uniform(), config(), 2, 4)
    bad = Configuration(1, [(0, 2), (4, 5)], 1, single_layer_packs())
    with pytest.raises(ValueError, match="contiguous"):
        generate("pp", uniform(), bad, 2, 4)


def test_graphs_round_trip_through_plain_data(uniform):
    for mode in ("pp", "dp", "dp-swap"):
        graph = generate(mode, uniform(layers=3), config(r=3), 2, 4)
        assert TaskGraph.from_dict(graph.to_dict()).to_text() == graph.to_text()


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_printed_task_graph_matches_golden(uniform, mode):
    """A small plan prints exactly as reviewed; regenerate with HARMONY_UPDATE_GOLDEN=1."""
    import os

    packs = [(0, 1), (2, 2), (3, 3)]
    cfg = Configuration(u_f=2, packs_f=packs, u_b=1, packs_b=[(0, 0), (1, 2), (3, 3)])
    text = generate(mode, uniform(layers=4), cfg, 2, 4).to_text()
    path = GOLDEN / f"{mode}.txt"
    if os.environ.get("HARMONY_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


def test_gantt_picture_is_drawn_from_the_estimate(uniform, tmp_path):
    pytest.importorskip("matplotlib")
    from harmony.scheduler.estimator import estimate
    from harmony.scheduler.gantt import write_gantt
    from harmony.scheduler.machine import Machine

    profile = uniform(layers=4)
    graph = generate("pp", profile, config(r=4), 2, 4)
    est = estimate(graph, profile, Machine.from_spec("1080ti", 2))
    write_gantt(tmp_path / "g.png", est.events, title="pp")
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
