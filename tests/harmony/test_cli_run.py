"""`harmony run`: compile (or reuse) a plan, train on it, write a JSON run report (docs/architecture.md section 7, README).

One plan is compiled per module, by the first invocation (``first_run``); the tests that rerun it
make sure nothing is compiled again by replacing the compiler with a function that fails.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import harmony.compiler
from harmony import serialization
from harmony.cli import main

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ROOT / "models" / "gpt2.py"


def run_args(directory: Path) -> list[str]:
    return ["run", str(GPT2), "--arg", "preset=tiny", "--minibatch", "8", "--iters", "2", "--no-probe",
            "--out", str(directory), "--report", str(directory / "run.json")]


def flat(text: str) -> str:
    """The console's output with its line wrapping undone."""
    return " ".join(text.split())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(plan directory, exit status, printed output, run report) of the first invocation."""
    directory = tmp_path_factory.mktemp("run") / "plan"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(run_args(directory))
    report = json.loads((directory / "run.json").read_text()) if rc == 0 else None
    return directory, rc, out.getvalue(), report


@pytest.fixture
def no_compiling(monkeypatch):
    """Any compilation from here on fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("harmony run compiled a plan although it had one")

    monkeypatch.setattr(harmony.compiler, "compile_plan", refuse)


def test_run_compiles_trains_and_writes_a_report(first_run):
    directory, rc, out, report = first_run
    assert rc == 0, out
    assert "compiled pp" in flat(out)
    assert (directory / "manifest.json").is_file() and (directory / "plan.msgpack").is_file()
    assert {"iterations", "mean_iteration_seconds", "estimated_iteration_seconds", "bytes_by_channel",
            "planned_bytes_by_channel", "per_device"} <= set(report)
    assert (report["mode"], report["devices"], report["minibatch"]) == ("pp", 2, 8)
    assert [it["iteration"] for it in report["iterations"]] == [0, 1]
    for it in report["iterations"]:
        assert it["seconds"] > 0
        assert math.isfinite(it["loss"]) and it["loss"] > 0
    assert f"final loss {report['iterations'][-1]['loss']:.6f}" in flat(out)


def test_run_writes_the_last_iterations_timeline_measured_above_estimated(first_run):
    directory, rc, out, report = first_run
    assert rc == 0, out
    trace = json.loads((directory / "run-trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {"dev0 measured", "dev1 measured", "dev0 estimated", "dev1 estimated"} <= set(names.values())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    measured = [e for e in spans if names[e["pid"]].endswith("measured")]
    assert measured and all(e["ts"] >= 0 and e["dur"] >= 0 for e in measured)
    assert max(e["ts"] + e["dur"] for e in measured) <= report["iterations"][-1]["seconds"] * 1e6


def test_run_report_counts_the_planned_bytes_and_stays_within_each_devices_capacity(first_run):
    _, rc, out, report = first_run
    assert rc == 0, out
    assert report["bytes_by_channel"], "the plan moves nothing: the test devices are too large"
    assert report["bytes_by_channel"] == report["planned_bytes_by_channel"]
    assert [d["device"] for d in report["per_device"]] == [0, 1]
    for d in report["per_device"]:
        counted = {k: v for k, v in d["bytes_by_channel"].items() if not k.startswith("TARGET")}
        assert counted == d["planned_bytes_by_channel"], f"device {d['device']}"
        assert d["capacity"] and 0 < d["peak_memory"] <= d["capacity"], f"device {d['device']}"


def test_second_identical_run_reuses_the_plan_and_does_not_recompile(first_run, capsys, no_compiling):
    directory, rc, out, report = first_run
    assert rc == 0, out
    plan_file = directory / "plan.msgpack"
    written = plan_file.stat().st_mtime_ns
    assert main(run_args(directory)) == 0
    again = flat(capsys.readouterr().out)
    assert f"reusing the plan in {directory}" in again
    assert "compiled pp" not in again
    assert plan_file.stat().st_mtime_ns == written
    second = json.loads((directory / "run.json").read_text())
    assert second["configuration"] == report["configuration"]
    assert len(second["iterations"]) == 2


def test_run_plan_dir_without_model_file_runs_that_plan(first_run, capsys, no_compiling, monkeypatch, tmp_path):
    directory, rc, out, report = first_run
    assert rc == 0, out
    monkeypatch.chdir(tmp_path)
    (directory / "run.json").unlink()
    checkpoint = tmp_path / "ckpt.pt"
    assert main(["run", "--plan", str(directory), "--iters", "2", "--checkpoint", str(checkpoint)]) == 0
    printed = flat(capsys.readouterr().out)
    assert "compiled pp" not in printed
    assert not (tmp_path / ".harmony").exists()
    rerun = json.loads((directory / "run.json").read_text())  # the report's default place: the plan directory
    assert rerun["configuration"] == report["configuration"]
    assert rerun["bytes_by_channel"] == report["planned_bytes_by_channel"]
    assert len(rerun["iterations"]) == 2
    body = torch.load(checkpoint, weights_only=True)
    assert body["iteration"] == 2 and "lm_head.weight" in body["model"]


def test_run_without_out_caches_the_plan_under_the_working_directory(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["run", str(GPT2), "--arg", "preset=tiny", "--arg", "dropout=0.0", "--minibatch", "8", "--iters", "1",
            "--no-probe", "--trials", "1"]
    assert main(args) == 0
    assert "compiled pp" in flat(capsys.readouterr().out)
    cached = list((tmp_path / ".harmony" / "plans").iterdir())
    assert len(cached) == 1
    assert (cached[0] / "manifest.json").is_file() and (cached[0] / "run.json").is_file()
    with monkeypatch.context() as m:
        m.setattr(harmony.compiler, "compile_plan", lambda *a, **k: pytest.fail("compiled again"))
        assert main(args) == 0
    assert "reusing the plan" in flat(capsys.readouterr().out)
    assert len(list((tmp_path / ".harmony" / "plans").iterdir())) == 1


@pytest.mark.parametrize("iters", ["0", "-3"])
def test_iters_below_1_exits_2_with_a_message(iters, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(GPT2), "--arg", "preset=tiny", "--minibatch", "8", "--iters", iters, "--no-probe"]) == 2
    assert f"--iters must be at least 1, got {iters}" in flat(capsys.readouterr().out)
    assert not (tmp_path / ".harmony").exists()


def test_run_plan_of_a_missing_directory_exits_2_with_a_message(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--plan", "/nonexistent"]) == 2
    printed = flat(capsys.readouterr().out)
    assert "error:" in printed and "/nonexistent" in printed and "manifest.json" in printed


def test_run_plan_whose_model_file_is_gone_exits_2_naming_it(first_run, monkeypatch, tmp_path, capsys):
    directory, rc, out, _ = first_run
    assert rc == 0, out
    monkeypatch.chdir(tmp_path)
    moved = tmp_path / "plan"
    moved.mkdir()
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["model_file"] = str(tmp_path / "gone.py")
    (moved / "manifest.json").write_bytes(serialization.json_seal(manifest))  # a manifest Harmony wrote
    assert main(["run", "--plan", str(moved)]) == 2
    printed = flat(capsys.readouterr().out)
    assert "gone.py" in printed and "harmony run MODEL_FILE --plan DIR" in printed


def test_run_without_model_file_or_plan_exits_2_with_a_message(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--iters", "1"]) == 2
    assert "give a model file" in flat(capsys.readouterr().out)


def test_run_out_dir_with_a_plan_for_other_options_does_not_reuse_it(first_run, monkeypatch, tmp_path, capsys):
    directory, rc, out, _ = first_run
    assert rc == 0, out
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "plan"
    shutil.copytree(directory, copy)
    args = ["run", str(GPT2), "--arg", "preset=tiny", "--minibatch", "16", "--iters", "1", "--no-probe",
            "--trials", "1", "--out", str(copy), "--report", str(tmp_path / "run.json")]
    assert main(args) == 0
    assert "reusing the plan" not in flat(capsys.readouterr().out)
    assert json.loads((tmp_path / "run.json").read_text())["minibatch"] == 16


def test_run_with_clip_grad_norm_reports_each_norm_and_a_plan_without_clipping_refuses_it(first_run, tmp_path):
    directory, rc, out, _ = first_run
    assert rc == 0, out
    clipped = tmp_path / "clipped"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        rc = main(run_args(clipped) + ["--clip-grad-norm", "0.5"])
    assert rc == 0, printed.getvalue()
    report = json.loads((clipped / "run.json").read_text())
    assert all(it["grad_norm"] > 0 for it in report["iterations"]) and len(report["iterations"]) == 2
    summary = (clipped / "summary.md").read_text()
    assert "host NORM" in summary and "gradient clipping: global 2-norm 0.5" in summary
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        rc = main(["run", "--plan", str(directory), "--iters", "1", "--clip-grad-norm", "0.5",
                   "--report", str(tmp_path / "r.json")])
    assert rc == 2 and "compiled without clipping" in flat(printed.getvalue())
