"""Bad arguments: `harmony compile`, `harmony run` and `harmony.compile` refuse
them with one clear message, exit status 2, and no worker process started."""

from __future__ import annotations

import multiprocessing.process
import re
from pathlib import Path

import pytest
import torch

import harmony
from harmony.cli import main

MODEL = Path(__file__).with_name("tiny_rng_model.py")
BASE = ["--minibatch", "8", "--device-memory", "24KiB", "--no-probe", "--trials", "1"]


@pytest.fixture(autouse=True)
def no_processes(monkeypatch, tmp_path):
    """Starting any process fails the test; the working directory is empty (no plan cache)."""
    def refuse(self):
        raise AssertionError(f"a process ({self.name}) was started for arguments that cannot work")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.chdir(tmp_path)


def refused(args: list[str], capsys, *expected: str) -> str:
    rc = main(args)
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert rc == 2, out
    assert flat.count("error:") == 1 and "Traceback" not in out, out
    for text in expected:
        assert text in flat, out
    return flat


@pytest.mark.parametrize("command", ["compile", "run"])
@pytest.mark.parametrize("flag, value, expected", [
    ("--minibatch", "0", "minibatch size must be a positive integer, got 0"),
    ("--minibatch", "-8", "minibatch size must be a positive integer, got -8"),
    ("--devices", "0", "device count must be a positive integer, got 0"),
    ("--devices", "-1", "device count must be a positive integer, got -1"),
    ("--device-memory", "0", "device memory must be positive"),
    ("--device-memory", "lots", "cannot read 'lots' as a memory size"),
    ("--memory-margin", "1.5", "the memory margin must be in [0, 1), got 1.5"),
    ("--memory-margin", "-0.1", "the memory margin must be in [0, 1), got -0.1"),
])
def test_a_non_positive_size_or_count_is_refused_naming_it(command, flag, value, expected, capsys, tmp_path):
    out = ["--out", str(tmp_path / "plan")]
    refused([command, str(MODEL), *BASE, *out, flag, value], capsys, expected)
    assert not (tmp_path / "plan").exists()


@pytest.mark.parametrize("flag, value, expected", [
    ("--iters", "0", "--iters must be at least 1, got 0"),
    ("--iters", "-1", "--iters must be at least 1, got -1"),
    ("--checkpoint-every", "0", "--checkpoint-every must be at least 1, got 0"),
    ("--checkpoint-every", "-2", "--checkpoint-every must be at least 1, got -2"),
    ("--timeout", "0", "--timeout must be positive"),
])
def test_run_refuses_non_positive_iterations_checkpoint_interval_and_timeout(flag, value, expected, capsys, tmp_path):
    refused(["run", str(MODEL), *BASE, "--checkpoint-dir", str(tmp_path / "c"), flag, value], capsys, expected)
    assert not (tmp_path / ".harmony").exists()


def test_checkpoint_every_without_a_folder_is_refused_saying_what_to_add(capsys):
    refused(["run", str(MODEL), *BASE, "--checkpoint-every", "2"], capsys, "needs --checkpoint-dir")


@pytest.mark.parametrize("command", ["compile", "run"])
def test_an_unknown_mode_is_refused_listing_the_modes(command, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main([command, str(MODEL), *BASE, "--out", str(tmp_path / "p"), "--mode", "zigzag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'zigzag'" in err and "pp" in err and "dp" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs fewer visible GPUs than asked for")
@pytest.mark.parametrize("command", ["compile", "run"])
def test_more_cuda_devices_than_visible_are_refused_with_the_count(command, capsys, tmp_path):
    visible = torch.cuda.device_count()
    refused([command, str(MODEL), *BASE, "--out", str(tmp_path / "p"), "--device", "cuda", "--devices", "2"], capsys,
            f"asked for 2 CUDA devices but {visible} are visible")


@pytest.mark.parametrize("command", ["compile", "run"])
def test_device_memory_below_the_smallest_layers_need_names_the_layer_and_its_bytes(command, capsys, tmp_path):
    flat = refused([command, str(MODEL), *BASE, "--out", str(tmp_path / "p"), "--device-memory", "1KiB"], capsys)
    match = re.search(r"layer (\d+) \((.+?)\) needs ([\d,]+) bytes of device memory for one sample", flat)
    assert match, flat
    assert int(match.group(3).replace(",", "")) > 1024
    assert "more than the 1,024 bytes" in flat


@pytest.mark.parametrize("kwargs, expected", [
    ({"minibatch_size": 0}, "minibatch size must be a positive integer"),
    ({"devices": 0}, "device count must be a positive integer"),
    ({"mode": "zigzag"}, "unknown mode 'zigzag'"),
    ({"device_type": "tpu"}, "unknown device type 'tpu'"),
    ({"device_memory": "-1"}, "device memory"),
])
def test_the_python_api_refuses_the_same_arguments_with_a_harmony_error(kwargs, expected):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).double()

    def batches(size, step):
        return torch.zeros(size, 4, dtype=torch.float64), torch.zeros(size, 4, dtype=torch.float64)

    args = {"minibatch_size": 4, "devices": 2, "probe": False, "device_memory": "16KiB", **kwargs}
    with pytest.raises(harmony.HarmonyError, match=re.escape(expected)):
        harmony.compile(model, torch.nn.functional.mse_loss, batches, **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs fewer visible GPUs than asked for")
def test_the_python_api_refuses_more_cuda_devices_than_visible():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(harmony.HarmonyError, match="CUDA devices"):
        harmony.compile(model, torch.nn.functional.mse_loss, lambda s, i: (torch.zeros(s, 4), torch.zeros(s, 4)),
                        minibatch_size=4, devices=1, device_type="cuda", probe=False)


def test_a_run_across_hosts_without_a_plan_is_refused_before_the_rendezvous(monkeypatch, capsys):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # nothing listens there: a rendezvous would hang
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    refused(["run", str(MODEL), *BASE], capsys, "more than one host needs one plan on every host", "--plan DIR")


def test_an_error_message_with_markup_like_brackets_is_printed_as_is(capsys):
    flat = refused(["run", "/nonexistent/[/bold]model.py", *BASE], capsys)
    assert "[/bold]model.py" in flat
