"""Machine descriptions: files round-trip, the transfer model (latency, bandwidth, contention on a
shared host link), construction from analytic device specs, and refusal of bad values."""

from __future__ import annotations

import math

import pytest

from harmony import serialization
from harmony.errors import FormatError, HarmonyError
from harmony.scheduler.devicespec import GB, preset
from harmony.scheduler.machine import FIELD_NAMES, KIND, VERSION, Machine, MachineError


def make(**overrides) -> Machine:
    fields = dict(
        kind="cpu", device_name="test cpu", devices=4, capacity=1 << 30,
        h2d=10e9, d2h=8e9, d2d=5e9, host_link_shared=True, h2d_all=20e9, d2h_all=16e9,
        msg=3e9, latency=1e-5, source="given", notes={"why": "a test"},
    )
    fields.update(overrides)
    return Machine(**fields)


def test_round_trip_through_msgpack(tmp_path):
    m = make(source="measured")
    path = tmp_path / "machine.msgpack"
    m.save(path)
    loaded = Machine.load(path)
    assert loaded == m
    assert isinstance(loaded.capacity, int) and isinstance(loaded.h2d, float)
    assert Machine.from_dict(m.to_dict()) == m
    assert set(m.to_dict()) == set(FIELD_NAMES)
    # the envelope says what the file is
    assert serialization.load(path, KIND, VERSION)["device_name"] == "test cpu"


def test_load_refuses_other_kinds_versions_and_bad_bodies(tmp_path):
    path = tmp_path / "m"
    serialization.save(path, "plan", VERSION, make().to_dict())
    with pytest.raises(FormatError, match="'plan'"):
        Machine.load(path)
    serialization.save(path, KIND, VERSION + 1, make().to_dict())
    with pytest.raises(FormatError, match="version"):
        Machine.load(path)
    body = make().to_dict()
    del body["h2d"]
    body["color"] = "red"
    serialization.save(path, KIND, VERSION, body)
    with pytest.raises(FormatError, match="missing field.*h2d.*unknown field.*color"):
        Machine.load(path)


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    m = make()
    n = 10**9
    assert m.transfer_time(n, "h2d") == pytest.approx(1e-5 + n / 10e9)
    assert m.transfer_time(n, "d2h") == pytest.approx(1e-5 + n / 8e9)
    assert m.transfer_time(n, "d2d") == pytest.approx(1e-5 + n / 5e9)
    assert m.transfer_time(n, "msg") == pytest.approx(1e-5 + n / 3e9)
    assert m.transfer_time(0, "h2d") == 0.0
    assert m.transfer_time(1, "h2d") == pytest.approx(1e-5 + 1e-10)


def test_contention_on_a_shared_host_link():
    m = make()  # h2d 10 GB/s alone, 20 GB/s aggregate; d2h 8 alone, 16 aggregate
    n = 10**9
    # two at once: 20/2 = 10 = the single rate, no slow-down yet
    assert m.bandwidth("h2d", 2) == pytest.approx(10e9)
    # four at once: each gets 20/4 = 5 GB/s
    assert m.bandwidth("h2d", 4) == pytest.approx(5e9)
    assert m.transfer_time(n, "h2d", concurrent=4) == pytest.approx(1e-5 + n / 5e9)
    assert m.bandwidth("d2h", 4) == pytest.approx(4e9)
    # an aggregate above devices x single never speeds one device up
    assert make(h2d_all=100e9).bandwidth("h2d", 3) == pytest.approx(10e9)
    # p2p and messages do not use the host link
    assert m.bandwidth("d2d", 4) == m.d2d and m.bandwidth("msg", 4) == m.msg
    # separate links: no contention whatever the aggregate says
    assert make(host_link_shared=False).bandwidth("h2d", 4) == pytest.approx(10e9)


def test_transfer_time_refuses_bad_arguments():
    m = make()
    with pytest.raises(ValueError, match="channel"):
        m.transfer_time(10, "pcie")
    with pytest.raises(ValueError, match="concurrent"):
        m.transfer_time(10, "h2d", concurrent=0)
    with pytest.raises(ValueError, match="nbytes"):
        m.transfer_time(-1, "h2d")


def test_from_spec_1080ti():
    spec = preset("1080ti")
    m = Machine.from_spec(spec, devices=4)
    assert m.kind == "analytic" and m.source == "analytic" and m.devices == 4
    assert m.h2d == spec.host_to_device == 12 * GB
    assert m.d2h == spec.device_to_host and m.d2d == spec.device_to_device
    assert m.capacity == spec.capacity and m.host_link_shared is True
    # one shared PCIe link: the aggregate is one link, so four at once get a quarter each
    assert m.h2d_all == spec.host_to_device
    assert m.bandwidth("h2d", 4) == pytest.approx(3 * GB)
    assert m.msg > 0 and m.latency > 0 and m.notes["spec"] == "1080ti"
    assert Machine.from_spec("1080ti", 4) == m  # a preset name works too


def test_from_spec_separate_links_scale_the_aggregate():
    m = Machine.from_spec("a100", devices=8)
    assert m.host_link_shared is False
    assert m.h2d_all == pytest.approx(8 * m.h2d)
    assert m.bandwidth("h2d", 8) == m.h2d


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"kind": "tpu"}, "kind"),
        ({"devices": 0}, "devices"),
        ({"capacity": -1}, "capacity"),
        ({"h2d": 0.0}, "h2d"),
        ({"d2h_all": math.inf}, "d2h_all"),
        ({"msg": math.nan}, "msg"),
        ({"latency": -1e-6}, "latency"),
        ({"source": "guessed"}, "source"),
        ({"host_link_shared": "yes"}, "host_link_shared"),
        ({"notes": {"a": 1}}, "notes"),
    ],
)
def test_bad_values_are_refused(overrides, words):
    with pytest.raises(MachineError, match=words):
        make(**overrides)
    assert issubclass(MachineError, HarmonyError)


def test_describe_mentions_the_numbers():
    text = make().describe()
    assert "4 x test cpu" in text and "10.00 GB/s" in text and "20.00 GB/s" in text


def test_runtime_costs_round_trip_and_default_to_unmeasured(tmp_path):
    m = make(task_overhead=1e-3, microbatch_overhead=2e-4, update_overhead=5e-4, cpu_cores=1.5)
    m.save(tmp_path / "m")
    assert Machine.load(tmp_path / "m") == m
    plain = make()
    assert (plain.task_overhead, plain.microbatch_overhead, plain.update_overhead, plain.cpu_cores) == (0, 0, 0, None)
    assert "per task" in m.describe() and "1.50 cores" in m.describe()
    assert "per task" not in plain.describe()


def test_a_version_1_file_is_read_with_the_runtime_costs_unmeasured(tmp_path):
    assert VERSION == 8
    body = make().to_dict()
    for name in ("task_overhead", "microbatch_overhead", "update_overhead", "cpu_cores", "compute_scale",
                 "compute_interference", "iteration_overhead", "tensor_overhead", "host_update_overhead",
                 "host_tensor_overhead", "p2p_send_overhead", "compute_scale_range", "compute_task_overhead"):
        del body[name]
    serialization.save(tmp_path / "old", KIND, 1, body)
    old = Machine.load(tmp_path / "old")
    assert old == make()
    assert old.task_overhead == 0.0 and old.cpu_cores is None and old.compute_interference == 0.0


def test_a_version_2_file_is_read_with_the_compute_as_profiled(tmp_path):
    body = make(task_overhead=1e-3, cpu_cores=2.0).to_dict()
    del body["compute_interference"], body["compute_scale"]
    serialization.save(tmp_path / "v2", KIND, 2, body)
    old = Machine.load(tmp_path / "v2")
    assert old == make(task_overhead=1e-3, cpu_cores=2.0)
    assert (old.compute_scale, old.compute_interference) == (1.0, 0.0)


def test_a_version_3_file_is_read_without_an_iteration_overhead(tmp_path):
    body = make(task_overhead=1e-3, compute_scale=1.2).to_dict()
    del body["iteration_overhead"]
    serialization.save(tmp_path / "v3", KIND, 3, body)
    assert Machine.load(tmp_path / "v3").iteration_overhead == 0.0


def test_a_version_4_file_is_read_without_a_cost_per_state_tensor(tmp_path):
    body = make(task_overhead=1e-3, iteration_overhead=2e-4).to_dict()
    del body["tensor_overhead"]
    serialization.save(tmp_path / "v4", KIND, 4, body)
    old = Machine.load(tmp_path / "v4")
    assert old == make(task_overhead=1e-3, iteration_overhead=2e-4) and old.tensor_overhead == 0.0


def test_a_version_5_file_is_read_without_a_host_updates_or_a_senders_own_cost(tmp_path):
    body = make(task_overhead=1e-3, tensor_overhead=1e-5).to_dict()
    del body["host_update_overhead"], body["host_tensor_overhead"], body["p2p_send_overhead"]
    del body["compute_scale_range"]
    serialization.save(tmp_path / "v5", KIND, 5, body)
    old = Machine.load(tmp_path / "v5")
    assert old == make(task_overhead=1e-3, tensor_overhead=1e-5)
    assert (old.host_update_overhead, old.host_tensor_overhead, old.p2p_send_overhead) == (0.0, 0.0, 0.0)


def test_a_version_6_file_is_read_with_one_reading_of_the_compute_scale(tmp_path):
    body = make(compute_scale=1.4).to_dict()
    del body["compute_scale_range"]
    serialization.save(tmp_path / "v6", KIND, 6, body)
    old = Machine.load(tmp_path / "v6")
    assert old == make(compute_scale=1.4) and old.compute_scale_range is None


def test_a_version_7_file_is_read_without_a_cost_per_compute_task(tmp_path):
    body = make(compute_scale=1.4, compute_scale_range=(1.2, 1.9)).to_dict()
    del body["compute_task_overhead"]
    serialization.save(tmp_path / "v7", KIND, 7, body)
    old = Machine.load(tmp_path / "v7")
    assert old == make(compute_scale=1.4, compute_scale_range=(1.2, 1.9)) and old.compute_task_overhead == 0.0


def test_the_cost_per_compute_task_round_trips_and_is_described(tmp_path):
    m = make(compute_scale=1.1, compute_task_overhead=4e-4)
    m.save(tmp_path / "m")
    assert Machine.load(tmp_path / "m") == m
    assert "compute 1.10x the profile and 0.40 ms per compute task" in m.describe()
    with pytest.raises(MachineError, match="compute_task_overhead"):
        make(compute_task_overhead=-1e-3)


def test_the_compute_scales_range_round_trips_and_is_described(tmp_path):
    m = make(compute_scale=1.4, compute_scale_range=(1.2, 1.9))
    m.save(tmp_path / "m")
    assert Machine.load(tmp_path / "m") == m and m.compute_scale_range == [1.2, 1.9]
    assert "1.20-1.90 across the calibration's tasks, 10th-90th percentile" in m.describe()


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"compute_scale_range": [1.5, 1.2]}, "compute_scale_range"),
        ({"compute_scale_range": [0.0, 1.2]}, "compute_scale_range"),
        ({"compute_scale_range": [1.2]}, "compute_scale_range"),
        ({"task_overhead": -1e-3}, "task_overhead"),
        ({"microbatch_overhead": math.inf}, "microbatch_overhead"),
        ({"update_overhead": "1ms"}, "update_overhead"),
        ({"host_tensor_overhead": -1e-6}, "host_tensor_overhead"),
        ({"cpu_cores": 0}, "cpu_cores"),
        ({"cpu_cores": True}, "cpu_cores"),
        ({"compute_interference": -0.1}, "compute_interference"),
        ({"compute_scale": 0}, "compute_scale"),
    ],
)
def test_bad_runtime_costs_are_refused(overrides, words):
    with pytest.raises(MachineError, match=words):
        make(**overrides)
