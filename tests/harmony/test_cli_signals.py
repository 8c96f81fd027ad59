"""`harmony run` stopped by a signal (the CLI side): SIGINT and SIGTERM end a run
mid-training within 30 s, with exit status 130 / 143, the cause and the last checkpoint printed, no
worker process left and no shared-memory segment left behind.

The run is a real ``harmony run`` subprocess on a plan compiled once per module; it is known to be
training once its first checkpoint appears.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harmony.cli import main

MODEL = Path(__file__).with_name("tiny_rng_model.py")
ENDS_WITHIN = 30.0


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    directory = tmp_path_factory.mktemp("signals") / "plan"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(["compile", str(MODEL), "--minibatch", "8", "--device-memory", "24KiB", "--no-probe", "--no-compare",
                   "--trials", "1", "--out", str(directory)])
    assert rc == 0, out.getvalue()
    return directory


def shared_memory() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(("harmony-", "torch_"))}


def children(pid: int) -> set[int]:
    """The pids whose parent is ``pid`` (from /proc; psutil is not a dependency)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    """Running and not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_training(plan: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path, set[int]]:
    """A harmony run of many iterations, once it has written its first checkpoint; with its workers."""
    folder, log = tmp_path / "ckpt", tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "harmony.cli", "run", str(MODEL), "--plan", str(plan), "--iters", "1000000",
           "--checkpoint-every", "3", "--checkpoint-dir", str(folder), "--report", str(tmp_path / "run.json")]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (folder / "latest.json").is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the run did not start training:\n{log.read_text()}")
        time.sleep(0.2)
    workers = children(proc.pid)
    assert len(workers) >= 2, f"expected the device workers among {workers}"
    return proc, log, workers


@pytest.mark.parametrize("signum, status, group", [pytest.param(signal.SIGINT, 130, False, marks=pytest.mark.slow),
                                                   pytest.param(signal.SIGTERM, 143, False, marks=pytest.mark.slow),
                                                   (signal.SIGINT, 130, True)],
                         ids=["SIGINT", "SIGTERM", "SIGINT-to-the-group-like-a-terminal"])
def test_a_signal_mid_run_stops_every_worker_and_exits_with_its_status_naming_the_cause(plan, tmp_path, signum,
                                                                                          status, group):
    before = shared_memory()
    proc, log, workers = start_training(plan, tmp_path)
    sent = time.monotonic()
    if group:  # a terminal's Ctrl-C reaches the workers too
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    try:
        rc = proc.wait(timeout=ENDS_WITHIN)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the run was still going {ENDS_WITHIN:.0f} s after {signum.name}:\n{log.read_text()}")
    took = time.monotonic() - sent
    out = " ".join(log.read_text().split())
    assert rc == status, out
    assert f"interrupted by {signum.name}" in out
    assert "the last checkpoint is" in out and "--resume" in out
    deadline = time.monotonic() + 5  # orphans would be reaped by init; give it a moment, not more
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"worker processes {left} outlived the run"
    assert shared_memory() <= before, f"left in /dev/shm: {sorted(shared_memory() - before)}"
    assert took < ENDS_WITHIN


def test_the_checkpoint_named_after_an_interruption_resumes(plan, tmp_path):
    proc, log, _ = start_training(plan, tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=ENDS_WITHIN) == 143
    named = " ".join(log.read_text().split()).split("the last checkpoint is ", 1)[1].split(" (step", 1)[0]
    step = int(Path(named).stem.split("-")[1])
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(["run", str(MODEL), "--plan", str(plan), "--iters", str(step + 1), "--resume", str(Path(named).parent),
                   "--report", str(tmp_path / "resumed.json")])
    assert rc == 0, out.getvalue()
    assert f"at step {step}" in " ".join(out.getvalue().split())
