"""Worker faults end a run quickly and cleanly: an exception in a task, a worker killed by a signal,
a stalled worker, Ctrl-C and SIGTERM at the launcher. Each ends within 30 s with an error naming
the device, the task and the cause, and leaves no worker process and no shared-memory file; with
P2P over torch.distributed (gloo) as with shared memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import harmony
from harmony.models import gpt2
from harmony.models.gpt2 import GPT, GPTConfig
from harmony.runtime.launcher import WorkerError

MINIBATCH = 8
LIMIT = 30.0  # seconds a failed run may take to end


def sgd(params):
    return torch.optim.SGD(params, lr=0.01)


def get_batch(batch_size: int, step: int):
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 64, (batch_size, 17), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@pytest.fixture(scope="module")
def plan():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.0)).double()
    compiled = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                               build_optimizer=sgd, probe=False, mode="pp")
    assert {0, 1} <= {t.device for t in compiled.tasks.tasks}
    return compiled


def shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(("harmony-", "torch_"))}


def children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


class Raising:
    """A loss function that raises on one device's loss task at one iteration (the loss task runs
    on the device that owns the last pack)."""

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration
        self.calls = 0

    def __call__(self, output, target):
        self.calls += 1
        if self.calls > self.iteration:
            raise ValueError("the loss exploded on purpose")
        return gpt2.loss_fn(output, target)


class Sleeping:
    """A loss function that, from its second call on, writes a marker and then sleeps ``seconds``."""

    def __init__(self, marker: Path, seconds: float) -> None:
        self.marker, self.seconds, self.calls = marker, seconds, 0

    def __call__(self, output, target):
        self.calls += 1
        if self.calls > 1:
            # written whole, then named: a reader polling for the marker never sees it empty
            partial = self.marker.with_name(f"{self.marker.name}.{os.getpid()}.partial")
            partial.write_text(str(os.getpid()))
            partial.replace(self.marker)
            time.sleep(self.seconds)
        return gpt2.loss_fn(output, target)


def run_until_failure(trainer, steps: int = 20) -> tuple[WorkerError, float]:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        for step in range(steps):
            trainer.step(*get_batch(MINIBATCH, step))
    return info.value, time.monotonic() - start


def assert_clean(trainer, before: set[str]) -> None:
    assert not any(p.is_alive() for p in trainer.launcher.processes)
    assert not children(os.getpid()) & {p.pid for p in trainer.launcher.processes}
    assert shm_files() <= before, shm_files() - before


@pytest.mark.parametrize("p2p", ["shm", "dist"])
def test_exception_in_a_task_names_device_task_and_traceback(plan, p2p):
    before = shm_files()
    with harmony.Trainer(plan, optimizer=sgd, loss_fn=Raising(iteration=1), timeout=20, p2p=p2p) as trainer:
        error, seconds = run_until_failure(trainer)
    message = str(error)
    loss_device = next(t.device for t in plan.tasks.tasks if t.loss)
    assert f"the worker of device {loss_device} failed in task" in message
    assert "BWD+loss" in message and "ValueError: the loss exploded on purpose" in message
    assert "Traceback" in message and "__call__" in message
    assert seconds < LIMIT
    assert_clean(trainer, before)


@pytest.mark.parametrize("p2p", ["shm", "dist"])
def test_worker_killed_by_sigkill_mid_iteration_is_reported_and_the_rest_stop(plan, tmp_path, p2p):
    marker = tmp_path / "sleeping"
    before = shm_files()
    with harmony.Trainer(plan, optimizer=sgd, loss_fn=Sleeping(marker, seconds=60), timeout=60, p2p=p2p) as trainer:
        def kill() -> None:
            deadline = time.monotonic() + LIMIT
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(int(marker.read_text()), signal.SIGKILL)

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        error, seconds = run_until_failure(trainer)
        killer.join()
    message = str(error)
    assert "was killed by SIGKILL while running task" in message, message
    assert seconds < LIMIT
    assert_clean(trainer, before)


def test_worker_killed_between_steps_is_reported_as_killed_at_the_next_step(plan):
    """Commands reach a worker through its own pipe: sending to a dead one breaks it, and the step
    says which worker died and how, not that a pipe broke."""
    before = shm_files()
    with harmony.Trainer(plan, optimizer=sgd, timeout=20) as trainer:
        trainer.step(*get_batch(MINIBATCH, 0))
        victim = trainer.launcher.processes[1]
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + LIMIT
        while victim.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        error, seconds = run_until_failure(trainer)
    message = str(error)
    assert "the worker of device 1" in message and "was killed by SIGKILL" in message, message
    assert seconds < LIMIT
    assert_clean(trainer, before)


@pytest.mark.slow
def test_stalled_worker_is_reported_with_what_each_worker_waits_for(plan, tmp_path):
    before = shm_files()
    with harmony.Trainer(plan, optimizer=sgd, loss_fn=Sleeping(tmp_path / "m", seconds=120), timeout=4) as trainer:
        error, seconds = run_until_failure(trainer)
    message = str(error)
    assert "stalled" in message
    assert "device 0" in message and "device 1" in message
    assert "waiting for" in message and "nothing: computing" in message, message
    assert seconds < LIMIT
    assert_clean(trainer, before)


LAUNCHER_SCRIPT = textwrap.dedent("""
    import faulthandler, signal, sys, torch, harmony
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks of a launcher that hangs
    # Ctrl-C as a terminal delivers it: a shell without job control (a CI script started in the
    # background) starts its children with SIGINT ignored, which Python then keeps
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {tests!r})
    from test_faults import MINIBATCH, get_batch, sgd
    from harmony.models import gpt2
    from harmony.models.gpt2 import GPT, GPTConfig
    if __name__ == "__main__":  # where a GPU is visible, the workers are spawned and import this file
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)).double()
        plan = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                               build_optimizer=sgd, probe=False)
        with harmony.Trainer(plan, optimizer=sgd) as trainer:
            print("training", flush=True)
            for step in range(100000):
                trainer.step(*get_batch(MINIBATCH, step))
""")


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM])
def test_signal_to_the_launcher_stops_every_worker(signum, tmp_path):
    """SIGINT (as Ctrl-C would, to the whole process group) or SIGTERM to the launcher's process."""
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER_SCRIPT.format(tests=str(Path(__file__).parent)))
    before = shm_files()
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        assert process.stdout.readline().strip() == "training"
        time.sleep(1.0)
        workers = children(process.pid)
        assert len(workers) >= 2
        start = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        try:
            _, err = process.communicate(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            os.killpg(process.pid, signal.SIGKILL)
            _, err = process.communicate()
            pytest.fail(f"the launcher did not end within {LIMIT:.0f} s of the signal; its threads then:\n{err[-6000:]}")
        seconds = time.monotonic() - start
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0
    assert seconds < LIMIT
    deadline = time.monotonic() + 5
    while workers & children(1) and time.monotonic() < deadline:  # orphans are adopted by init
        time.sleep(0.1)
    alive = {pid for pid in workers if Path(f"/proc/{pid}").exists()
             and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"}
    assert not alive, f"left behind: {alive}\n{err[-2000:]}"
    assert shm_files() <= before
