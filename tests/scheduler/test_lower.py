"""Lowering: every mode's task graph becomes per-device, per-stream action lists whose sends and
receives pair up by edge id, which print as reviewed and survive a msgpack round trip."""

import os
from collections import Counter
from pathlib import Path

import pytest

from harmony.errors import FormatError
from harmony.scheduler.estimator import promise
from harmony.scheduler.lower import NO_PROMISE, STREAMS, Program, lower
from harmony.scheduler.machine import Machine
from harmony.scheduler.modes import MODES, generate
from harmony.scheduler.tasks import Channel, Configuration, TaskGraph

GOLDEN = Path(__file__).parent / "golden" / "program"
PACKS_F, PACKS_B = [(0, 1), (2, 2), (3, 3)], [(0, 0), (1, 2), (3, 3)]


def uneven_config() -> Configuration:
    """U_F != U_B and different packs in the two passes: pieces cross microbatch boundaries."""
    return Configuration(u_f=2, packs_f=PACKS_F, u_b=3, packs_b=PACKS_B)


MACHINE = Machine(kind="analytic", device_name="test", devices=2, capacity=1 << 30, h2d=1e9, d2h=1e9, d2d=2e9,
                  host_link_shared=False, h2d_all=2e9, d2h_all=2e9, msg=1e9, latency=0.0)


def promised(uniform, mode: str) -> TaskGraph:
    """The uneven configuration's task graph with its memory promise, as compile leaves it."""
    graph = generate(mode, uniform(layers=4), uneven_config(), 2, 6)
    graph.memory = promise(graph, uniform(layers=4), MACHINE)
    return graph


def program_of(uniform, mode: str) -> Program:
    return lower(promised(uniform, mode), uniform(layers=4))


@pytest.mark.parametrize("mode", MODES)
def test_every_edge_is_sent_once_and_received_once_on_the_right_streams(uniform, mode):
    program = program_of(uniform, mode)
    sends, recvs = Counter(), Counter()
    for device, per in program.streams.items():
        for stream, actions in per.items():
            for a in actions:
                if a.op == "SEND":
                    sends[a.edge] += 1
                    edge = program.edges[a.edge]
                    assert edge.src_device == device and edge.nbytes == a.nbytes
                    assert stream == {"P2P": "p2p-out", "LOCAL": "compute"}.get(edge.channel, "swap-out")
                elif a.op == "RECV":
                    recvs[a.edge] += 1
                    edge = program.edges[a.edge]
                    assert edge.dst_device == device and edge.nbytes == a.nbytes
                    assert stream == {"P2P": "p2p-in", "LOCAL": "compute"}.get(edge.channel, "swap-in")
    produced = [e.id for e in program.edges if e.producer is not None]
    assert sends == Counter(produced)
    assert recvs == Counter(e.id for e in program.edges)


@pytest.mark.parametrize("mode", MODES)
def test_pieces_of_a_consumer_microbatch_cover_its_samples_exactly(uniform, mode):
    graph = promised(uniform, mode)
    program = lower(graph, uniform(layers=4))
    by_id = {t.id: t for t in graph.tasks}
    covered: dict[tuple, list[tuple[int, int]]] = {}
    for e in program.edges:
        covered.setdefault((e.consumer, e.stream, e.dst_unit), []).append((e.start, e.stop))
    for (consumer, _, unit), spans in covered.items():
        task = by_id[consumer]
        start = task.offset + sum(task.microbatches[:unit])
        spans.sort()
        assert spans[0][0] == start and spans[-1][1] == start + task.microbatches[unit]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("mode", MODES)
def test_a_receive_comes_before_the_unit_that_reads_it_and_a_send_after_the_unit_making_it(uniform, mode):
    program = program_of(uniform, mode)
    for device, per in program.streams.items():
        units = [(a.task, a.unit) for a in per["compute"] if a.op not in ("SEND", "RECV")]
        assert len(units) == len(set(units))
        local = [a for a in per["compute"]]
        position = {(a.task, a.unit): i for i, a in enumerate(local) if a.op not in ("SEND", "RECV")}
        for i, a in enumerate(local):
            if a.op == "SEND":
                assert position[(a.task, a.unit)] < i
            if a.op == "RECV":
                assert i < position[(a.task, a.unit)]


@pytest.mark.parametrize("mode", ["pp", "dp", "gpipe-swap"])
def test_printed_program_matches_golden(uniform, mode):
    """A small plan's program prints exactly as reviewed; regenerate with HARMONY_UPDATE_GOLDEN=1."""
    text = str(program_of(uniform, mode)) + "\n"
    path = GOLDEN / f"{mode}.txt"
    if os.environ.get("HARMONY_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def test_program_survives_a_msgpack_round_trip_and_refuses_a_truncated_file(uniform, tmp_path):
    program = program_of(uniform, "pp")
    program.save(tmp_path)
    loaded = Program.load(tmp_path)
    assert loaded == program and str(loaded) == str(program)
    path = tmp_path / "program.msgpack"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(FormatError):
        Program.load(tmp_path)


def test_every_stream_is_named_and_p2p_moves_only_between_devices(uniform):
    program = program_of(uniform, "pp")
    for per in program.streams.values():
        assert set(per) == set(STREAMS)
    assert all(e.src_device != e.dst_device for e in program.edges if e.channel == Channel.P2P.value)


@pytest.mark.parametrize("mode", MODES)
def test_every_state_input_with_a_producer_reads_one_named_output_of_its_tensor(uniform, mode):
    """The program, not each player, says which output a pack state, optimizer state or gradient
    input reads (no matching in the estimator); an output naming its reader is read once."""
    graph = promised(uniform, mode)
    program = lower(graph, uniform(layers=4))
    by_id = {t.id: t for t in graph.tasks}
    edges = {(t.id, n) for t in graph.tasks for n, _ in program.reads(t)}
    expected = {(t.id, n) for t in graph.tasks for n, i in enumerate(t.inputs)
                if (t.id, n) not in edges and i.task in by_id}
    assert set(program.sources) == expected
    read = Counter()
    for (consumer, n), (producer, o) in program.sources.items():
        i, out = by_id[consumer].inputs[n], by_id[producer].outputs[o]
        assert i.task == producer and out.tensor == i.tensor, (consumer, n)
        if out.task is not None:
            read[(producer, o)] += 1
    assert max(read.values(), default=1) == 1
    loads = [a for per in program.streams.values() for acts in per.values() for a in acts if a.op == "LOAD"]
    assert all(a.src is None or (a.task, a.src) in {(c, p) for (c, _), (p, _) in program.sources.items()}
               for a in loads)


def test_a_task_graph_without_a_memory_promise_has_no_program_but_has_edges(uniform):
    graph = generate("pp", uniform(layers=4), uneven_config(), 2, 6)
    with pytest.raises(ValueError, match="memory promise") as info:
        lower(graph, uniform(layers=4))
    assert str(info.value) == NO_PROMISE
    assert lower(graph, uniform(layers=4), streams=False).edges == program_of(uniform, "pp").edges
