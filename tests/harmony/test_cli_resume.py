"""`harmony run --checkpoint-every K --checkpoint-dir DIR` and `--resume`: a run
stopped at a checkpoint and resumed reproduces the uninterrupted run's losses exactly (float64,
dropout on, a get_batch drawing from the global generators of torch, numpy and Python), and a
checkpoint's "model" loads into the user's own model.

One plan is compiled per module, by the uninterrupted run; the other runs reuse it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch

from harmony import checkpoint
from harmony.cli import main

MODEL = Path(__file__).with_name("tiny_rng_model.py")
ITERS = 6


def run(plan: Path, folder: Path, iters: int, *extra: str, model: Path = MODEL,
        compile_into: bool = True) -> tuple[int, str, dict | None]:
    """(exit status, printed output, run report) of one harmony run checkpointing every 2 steps into
    ``folder``; ``plan`` is compiled into (or reused from) with --out, unless ``compile_into`` is False."""
    report = folder / f"run-{iters}-{len(extra)}.json"
    report.unlink(missing_ok=True)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(["run", str(model), "--minibatch", "8", "--device-memory", "24KiB", "--no-probe", "--trials", "1",
                   *(["--out", str(plan)] if compile_into else []), "--iters", str(iters), "--checkpoint-every",
                   "2", "--checkpoint-dir", str(folder), "--report", str(report), *extra])
    text = " ".join(out.getvalue().split())
    return rc, text, json.loads(report.read_text()) if report.is_file() else None


def losses(report: dict) -> dict[int, float]:
    return {it["iteration"]: it["loss"] for it in report["iterations"]}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """(plan directory, checkpoint folder, report) of an uninterrupted run of ITERS steps."""
    root = tmp_path_factory.mktemp("resume")
    rc, out, report = run(root / "plan", root / "straight", ITERS)
    assert rc == 0, out
    return root / "plan", root / "straight", report


def test_checkpoints_are_named_by_step_the_two_newest_kept_and_latest_names_the_newest(straight):
    _, folder, _ = straight
    assert sorted(p.name for p in folder.glob("step-*.pt")) == ["step-000004.pt", "step-000006.pt"]
    assert checkpoint.latest(folder).name == "step-000006.pt"
    assert checkpoint.read(folder / "step-000006.pt")["iteration"] == ITERS
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], "a temporary file was left behind"


def test_a_run_stopped_at_step_4_and_resumed_reproduces_the_uninterrupted_losses_exactly(straight, tmp_path):
    plan, _, report = straight
    rc, out, first = run(plan, tmp_path, 4)
    assert rc == 0, out
    assert losses(first) == {k: v for k, v in losses(report).items() if k < 4}
    rc, out, resumed = run(plan, tmp_path, ITERS, "--resume")
    assert rc == 0, out
    assert "resuming from" in out and "step-000004.pt at step 4" in out
    assert losses(resumed) == {4: losses(report)[4], 5: losses(report)[5]}
    # the losses move: equal losses are not those of a model that never trained
    assert len(set(losses(report).values())) == ITERS


def test_resuming_from_an_odd_step_file_continues_from_that_step(straight, tmp_path):
    plan, _, report = straight
    rc, out, _ = run(plan, tmp_path / "a", 3)
    assert rc == 0, out
    assert checkpoint.latest(tmp_path / "a").name == "step-000003.pt"  # the final state is saved too
    rc, out, resumed = run(plan, tmp_path / "b", ITERS, "--resume", str(tmp_path / "a" / "step-000003.pt"))
    assert rc == 0, out
    assert losses(resumed) == {k: v for k, v in losses(report).items() if k >= 3}


def test_a_checkpoints_model_entry_loads_into_the_users_original_model(straight):
    _, folder, _ = straight
    spec = importlib.util.spec_from_file_location("user_model", MODEL)
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    model = user.build_model()
    body = torch.load(checkpoint.latest(folder), weights_only=True)
    assert model.load_state_dict(body["model"], strict=True) is not None
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, body["model"][name]), name
    assert body["iteration"] == ITERS and body["optimizer"] and body["rng"]["torch"].dtype == torch.uint8


def test_resuming_with_a_changed_model_file_is_refused_naming_the_checkpoint(straight, tmp_path):
    plan, folder, _ = straight
    changed = tmp_path / "changed_model.py"
    changed.write_text(MODEL.read_text().replace("16", "12"))
    rc, out, _ = run(tmp_path / "plan", tmp_path, ITERS + 2, "--resume", str(folder), model=changed)
    assert rc == 2, out
    assert "step-000006.pt" in out and "another model" in out


def test_an_interrupted_save_keeps_the_previous_checkpoint_and_pointer(straight, tmp_path, monkeypatch):
    plan, folder, _ = straight
    good = checkpoint.latest(folder)
    before = good.read_bytes()

    def crash(body, path, *args, **kwargs):
        Path(path).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.write(good, {"version": checkpoint.VERSION})
    assert good.read_bytes() == before
    assert checkpoint.latest(folder) == good
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], "the temporary file was left behind"


@pytest.mark.parametrize("args, message", [
    (["--resume"], "holds no checkpoint"),
    (["--resume", "/nonexistent/ckpt"], "neither a checkpoint nor a checkpoint folder"),
])
def test_resume_from_nothing_exits_2_before_compiling(args, message, tmp_path):
    (tmp_path / "empty").mkdir()
    rc, out, _ = run(tmp_path / "plan", tmp_path / "empty", ITERS, *args)
    assert rc == 2 and message in out, out
    assert not (tmp_path / "plan").exists()


def test_a_model_files_lr_schedule_is_followed_and_resumed_where_it_stopped(tmp_path):
    # One plan for every run, given with --plan: dropout draws, and so losses, follow the microbatch
    # split, and a model file of other text compiles a plan of its own that may split otherwise.
    # A schedule of gamma=1 keeps the rate, so it stands for the unscheduled run on the same plan.
    scheduled = tmp_path / "scheduled_model.py"
    scheduled.write_text(MODEL.read_text() + "\n\ndef build_lr_scheduler(optimizer, gamma=1.0):\n"
                         "    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)\n")
    rc, out, _ = run(tmp_path / "plan", tmp_path / "compile", 1, model=scheduled)
    assert rc == 0, out

    def follow(folder: str, iters: int, *extra: str) -> dict:
        rc, out, report = run(tmp_path / "plan", tmp_path / folder, iters, "--plan", str(tmp_path / "plan"),
                              "--arg", "gamma=0.25", *extra, model=scheduled, compile_into=False)
        assert rc == 0, out
        return report

    rc, out, plain = run(tmp_path / "plan", tmp_path / "plain", 4, "--plan", str(tmp_path / "plan"),
                         model=scheduled, compile_into=False)
    assert rc == 0, out
    whole = follow("whole", 4)
    assert losses(whole)[0] == losses(plain)[0] and losses(whole)[2] != losses(plain)[2]
    follow("half", 2)
    resumed = follow("half", 4, "--resume")
    assert losses(resumed) == {2: losses(whole)[2], 3: losses(whole)[3]}
    assert checkpoint.read(tmp_path / "half" / "step-000004.pt")["lr_scheduler"]["scheduler"]["last_epoch"] == 4
