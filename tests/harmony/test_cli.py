"""The harmony command line: help for every subcommand, decompose end to end, clear errors."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from harmony.cli import build_parser, main
from harmony.decomposer.layer_graph import LayerGraph
from harmony.scheduler.machine import Machine
from harmony.profiling.profiles import Profile

ROOT = Path(__file__).resolve().parents[2]


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse has no public listing
    assert "decompose" in subcommands
    for name in subcommands:
        with pytest.raises(SystemExit) as exc:
            main([name, "--help"])
        assert exc.value.code == 0
        assert "usage: harmony " + name in capsys.readouterr().out


def test_decompose_writes_graph_and_code_and_prints_layers(tmp_path, capsys):
    rc = main(["decompose", str(ROOT / "models" / "gpt2.py"), "--arg", "preset=tiny", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "h.0" in out and "lm_head" in out
    assert (tmp_path / "graph.msgpack").is_file()
    assert sorted(p.name for p in (tmp_path / "layers").glob("layer_*.py"))[0] == "layer_000.py"


def test_bad_model_file_exits_2_with_message(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def build_model():\n    return None\n")
    assert main(["decompose", str(bad)]) == 2
    assert "does not define loss_fn, get_batch" in capsys.readouterr().out


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "harmony.cli", "--help"], capture_output=True, text=True, check=True)
    assert "decompose" in result.stdout


def test_profile_measures_and_writes_a_profile(tmp_path, capsys):
    rc = main(["profile", str(ROOT / "models" / "gpt2.py"), "--arg", "preset=tiny", "--device", "cpu",
               "--device-memory", "4MiB", "--max-microbatch", "4", "--samples", "2", "--trials", "1", "--no-probe", "--out", str(tmp_path)])
    assert rc == 0
    assert "U_FMAX=4" in capsys.readouterr().out
    profile = Profile.load(tmp_path / "profile.msgpack")
    graph = LayerGraph.load(tmp_path)
    assert profile.graph_hash == graph.fingerprint()
    assert len(profile.layers) == len(graph.layers)


@pytest.mark.slow  # probing takes seconds; tests/profiling/test_probe.py probes in the default run
def test_probe_writes_a_machine_description(tmp_path, capsys):
    out = tmp_path / "machine.msgpack"
    assert main(["probe", "--device", "cpu", "--devices", "2", "--size", "1MiB", "--repeats", "1", "--out", str(out)]) == 0
    machine = Machine.load(out)
    assert machine.source == "measured" and machine.devices == 2 and machine.h2d > 0
    assert "h2d" in capsys.readouterr().out


def test_analytic_profile_of_an_unknown_spec_is_a_clear_error(capsys):
    assert main(["profile", str(ROOT / "models" / "gpt2.py"), "--arg", "preset=tiny", "--analytic", "nope"]) == 2
    assert "neither a device spec preset" in capsys.readouterr().out


def test_compile_writes_a_plan_that_show_prints_and_a_changed_model_file_is_refused(tmp_path, capsys):
    model_file = tmp_path / "gpt2.py"
    model_file.write_text((ROOT / "models" / "gpt2.py").read_text())
    out = tmp_path / "plan"
    rc = main(["compile", str(model_file), "--arg", "preset=tiny", "--minibatch", "4", "--devices", "2",
               "--trials", "1", "--no-probe", "--out", str(out)])
    assert rc == 0
    assert "chosen: pp" in capsys.readouterr().out
    for name in ("manifest.json", "plan.msgpack", "graph.msgpack", "profile.msgpack", "program.msgpack", "trace.json",
                 "summary.md"):
        assert (out / name).is_file(), name
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "FWD" in shown and "activations: " in shown and "forward, loss and backward in one task" in shown
    assert main(["show", str(out), "--program", "--device", "1"]) == 0
    printed = capsys.readouterr().out
    assert "dev1" in printed and "dev0:" not in printed and "p2p-in:" in printed and " RECV " in printed
    from harmony.plan import Plan, StalePlanError

    plan = Plan.load(out, model_file=model_file)
    # the per-GPU-swap baselines' rows are searched coarsely, and the summary says which
    coarse = plan.coarsely_compared()
    assert coarse and not {"pp", "dp"} & set(coarse)
    assert f"{', '.join(coarse)}: searched over fewer pack counts" in (out / "summary.md").read_text()
    model_file.write_text(model_file.read_text() + "\n# edited\n")
    with pytest.raises(StalePlanError, match="changed since the plan"):
        Plan.load(out, model_file=model_file)


def test_a_plan_whose_program_is_missing_or_lowered_from_other_tasks_is_refused_naming_the_file(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", str(ROOT / "models" / "gpt2.py"), "--arg", "preset=tiny", "--minibatch", "4",
                 "--devices", "2", "--trials", "1", "--no-probe", "--out", str(out)]) == 0
    from harmony.plan import Plan
    from harmony.scheduler.lower import PROGRAM_FILE, Program

    program = Plan.load(out).program()
    Program(program.mode, program.edges[:-1], program.streams, program.peaks, tasks="0" * 64).save(out)
    capsys.readouterr()
    assert main(["show", str(out), "--program"]) != 0
    assert f"{out / PROGRAM_FILE} was lowered from other tasks than the plan's" in " ".join(capsys.readouterr().out.split())
    (out / PROGRAM_FILE).unlink()
    assert main(["run", str(ROOT / "models" / "gpt2.py"), "--arg", "preset=tiny", "--plan", str(out), "--iters", "1"]) != 0
    printed = " ".join(capsys.readouterr().out.split())
    assert f"{out / PROGRAM_FILE} is missing" in printed and "compile the plan again" in printed


def test_compile_refuses_bad_arguments_before_any_work(tmp_path, capsys):
    base = ["compile", str(ROOT / "models" / "gpt2.py"), "--arg", "preset=tiny", "--out", str(tmp_path / "p")]
    assert main(base + ["--minibatch", "0"]) == 2
    assert "minibatch size must be a positive integer" in capsys.readouterr().out
    assert main(base + ["--devices", "0"]) == 2
    assert "device count must be a positive integer" in capsys.readouterr().out
    assert main(base + ["--device-memory", "lots"]) == 2
    assert "device memory" in capsys.readouterr().out


PER_SAMPLE_LOSS = '''
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def loss_fn(output, target):
    return ((output - target) ** 2).mean(-1)  # one value per sample


def get_batch(batch_size, step):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 2)
'''


def test_compile_refuses_a_model_file_whose_loss_is_per_sample_before_any_work(tmp_path, capsys):
    model_file = tmp_path / "per_sample.py"
    model_file.write_text(PER_SAMPLE_LOSS)
    assert main(["compile", str(model_file), "--minibatch", "4", "--devices", "2", "--no-probe",
                 "--out", str(tmp_path / "plan")]) == 2
    out = capsys.readouterr().out
    assert "loss_fn" in out and "per_sample.py" in out, out
    assert not (tmp_path / "plan").exists()


def test_compile_logs_the_seconds_of_each_stage(tmp_path, caplog):
    """``-v`` tells where a compile's time goes: building, decomposing, profiling, each mode's search
    (the compared ones in their workers), the wait for them, finishing and writing the plan."""
    from harmony import timing
    from harmony.scheduler.modes import MODES

    with caplog.at_level(logging.INFO, logger="harmony.timing"):
        rc = main(["compile", str(ROOT / "models" / "gpt2.py"), "--arg", "preset=tiny", "--analytic", "1080ti",
                   "--minibatch", "8", "--devices", "2", "--out", str(tmp_path)])
    assert rc == 0
    stages = dict(r.args for r in caplog.records if r.name == "harmony.timing" and r.msg == timing.STAGE_MESSAGE)
    expected = {"model build", "decompose", "gradient check", "profile", "sample-mixing check", "search pp",
                "comparison (waiting for the other modes)", "finish (packs, memory promise, lowering)", "write plan"}
    assert expected <= set(stages)
    compared = {name.removeprefix("search ").removesuffix(" (worker)") for name in stages if name.endswith("(worker)")}
    assert compared and compared <= set(MODES) - {"pp"}
    assert all(seconds >= 0 for seconds in stages.values())
