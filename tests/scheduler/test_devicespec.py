"""Device specs: presets, JSON files, and the errors for bad ones."""

from __future__ import annotations

import json

import pytest
import torch

from harmony.errors import HarmonyError
from harmony.scheduler.devicespec import FIELD_NAMES, PRESETS, DeviceSpec, load_spec, save_spec


@pytest.mark.parametrize("name", ["1080ti", "v100", "a100", "h100", *PRESETS])
def test_presets_load(name):
    spec = load_spec(name)
    assert isinstance(spec, DeviceSpec)
    assert spec.peak_flops > 1e12 and spec.memory_bandwidth > 1e11 and spec.capacity >= 11 * (1 << 30)
    assert 0 < spec.efficiency <= 1
    assert spec.flops_for(torch.float32) == spec.peak_flops
    assert spec.flops_for(None) == spec.peak_flops


def test_preset_numbers_from_datasheets():
    assert load_spec("1080ti").capacity == 11 * (1 << 30)
    assert load_spec("v100").flops_for(torch.float16) == pytest.approx(125e12)
    a100 = load_spec("a100")
    assert a100.peak_flops == pytest.approx(19.5e12)
    assert a100.flops_for(torch.bfloat16) == pytest.approx(312e12)
    assert a100.flops_for("bfloat16") == a100.flops_for("torch.bfloat16")
    h100 = load_spec("H100")  # names are case-insensitive
    assert h100.flops_for(torch.bfloat16) == pytest.approx(989.4e12)
    assert h100.memory_bandwidth == pytest.approx(3.35e12)
    assert h100.capacity == 80 * (1 << 30)
    assert load_spec("1080ti").host_link_shared and not h100.host_link_shared


def test_presets_are_fresh_copies():
    spec = load_spec("v100")
    spec.capacity = 1
    assert load_spec("v100").capacity == 16 * (1 << 30)


def test_json_round_trip(tmp_path):
    spec = load_spec("a100")
    path = tmp_path / "mine.json"
    save_spec(spec, path)
    again = load_spec(str(path))
    assert again == spec
    assert DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert set(spec.to_dict()) == set(FIELD_NAMES)


def test_json_without_optional_fields(tmp_path):
    body = load_spec("h100").to_dict()
    for optional in ("efficiency", "dtype_flops", "name"):
        body.pop(optional)
    path = tmp_path / "cluster-gpu.json"
    path.write_text(json.dumps(body))
    spec = load_spec(path)
    assert spec.name == "cluster-gpu"  # from the file name
    assert spec.efficiency == 0.5 and spec.dtype_flops == {}
    assert spec.flops_for(torch.bfloat16) == spec.peak_flops


def test_json_missing_and_unknown_fields(tmp_path):
    body = load_spec("v100").to_dict()
    del body["memory_bandwidth"]
    body["clock_mhz"] = 1530
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(body))
    with pytest.raises(HarmonyError) as info:
        load_spec(path)
    message = str(info.value)
    assert "memory_bandwidth" in message and "clock_mhz" in message and "missing" in message and "unknown" in message


def test_json_bad_values_and_syntax(tmp_path):
    body = load_spec("v100").to_dict()
    body["capacity"] = -5
    body["efficiency"] = 1.5
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(body))
    with pytest.raises(HarmonyError, match="capacity must be a positive number.*efficiency"):
        load_spec(path)
    broken = tmp_path / "broken.json"
    broken.write_text("{ not json")
    with pytest.raises(HarmonyError, match="not valid JSON"):
        load_spec(broken)
    listy = tmp_path / "list.json"
    listy.write_text("[1, 2]")
    with pytest.raises(HarmonyError, match="JSON object"):
        load_spec(listy)


def test_unknown_name_lists_presets():
    with pytest.raises(HarmonyError) as info:
        load_spec("tpu-v9")
    for name in ("1080ti", "v100", "a100", "h100"):
        assert name in str(info.value)
