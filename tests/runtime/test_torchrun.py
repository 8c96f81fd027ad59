"""``harmony run`` under torchrun (env:// rendezvous, one process per device) trains exactly as
the forked launcher does: the same plan gives the same losses and moves the same bytes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harmony.cli import main

pytestmark = pytest.mark.slow  # several processes launched per test

MODEL = Path(__file__).resolve().parents[2] / "models" / "gpt2.py"


needs_torchrun = pytest.mark.skipif(
    shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
    reason="torchrun is not installed")


def torchrun(*args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` with 2 processes of ``harmony run ARGS``."""
    command = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run([command, "--standalone", "--nnodes", "1", "--nproc-per-node", "2", "-m", "harmony.cli", *args],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


FREEZE_BLOCK_0 = """

_build_model = build_model


def build_model(preset: str = "tiny", **kwargs):
    model = _build_model(preset, **kwargs)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("h.0."))
    return model
"""


@needs_torchrun
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torchrun_run_matches_the_forked_launcher(tmp_path, capsys, precision):
    """bf16 with block 0 frozen: its linear weights travel as the host store's bf16 copies."""
    plan, model = tmp_path / "plan", MODEL
    if precision == "bf16":
        model = tmp_path / "gpt2_frozen.py"
        model.write_text(MODEL.read_text() + FREEZE_BLOCK_0)
    common = ["run", str(model), "--arg", "preset=tiny", "--minibatch", "8", "--iters", "3", "--no-probe",
              "--device", "cpu", "--precision", precision,
              "--out", str(plan)]
    assert main([*common, "--report", str(tmp_path / "local.json")]) == 0
    before = set(Path("/dev/shm").glob("harmony-*"))
    done = torchrun(*common, "--report", str(tmp_path / "torchrun.json"))
    assert "reusing the plan" in done.stdout
    local = json.loads((tmp_path / "local.json").read_text())
    spmd = json.loads((tmp_path / "torchrun.json").read_text())
    assert [i["loss"] for i in spmd["iterations"]] == [i["loss"] for i in local["iterations"]]
    assert spmd["bytes_by_channel"] == local["bytes_by_channel"] == local["planned_bytes_by_channel"]
    assert set(Path("/dev/shm").glob("harmony-*")) <= before, "shared-memory files left behind"
    assert (precision == "bf16") == ("move as bf16 copies" in (plan / "summary.md").read_text())


SCHEDULED = """
import torch

from harmony.models.gpt2 import build_model, build_optimizer, get_batch, loss_fn  # noqa: F401


def build_lr_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
"""


@needs_torchrun
def test_a_torchrun_run_clips_scales_its_fp16_loss_and_follows_the_schedule_as_the_forked_launcher(tmp_path):
    """fp16 with GradScaler's scaling, clipping by the global norm and a learning-rate schedule,
    checkpointed at step 2 and resumed: every iteration's loss, norm and loss scale as the forked
    launcher's (the schedule and the scale travel in the checkpoint to every rank)."""
    model = tmp_path / "gpt2_scheduled.py"
    model.write_text(SCHEDULED)
    plan, ckpts = tmp_path / "plan", tmp_path / "ckpts"
    common = ["run", str(model), "--arg", "preset=tiny", "--minibatch", "8", "--no-probe", "--device", "cpu",
              "--precision", "fp16", "--clip-grad-norm", "0.5", "--out", str(plan)]
    assert main([*common, "--iters", "4", "--report", str(tmp_path / "local.json")]) == 0
    torchrun(*common, "--iters", "2", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpts),
             "--report", str(tmp_path / "first.json"))
    torchrun(*common, "--iters", "4", "--checkpoint-dir", str(ckpts), "--resume",
             "--report", str(tmp_path / "second.json"))
    fields = ("iteration", "loss", "grad_norm", "loss_scale", "skipped")
    local = [{k: i[k] for k in fields} for i in json.loads((tmp_path / "local.json").read_text())["iterations"]]
    spmd = [{k: i[k] for k in fields} for name in ("first", "second")
            for i in json.loads((tmp_path / f"{name}.json").read_text())["iterations"]]
    assert spmd == local
    assert len({i["loss"] for i in local}) == 4 and all(i["grad_norm"] > 0.5 for i in local)  # clipped every step


@needs_torchrun
def test_a_torchrun_run_checkpointed_at_step_2_and_resumed_gives_the_uninterrupted_losses(tmp_path):
    """Rank 0 saves the host store while every rank waits; on resume each node's store loads it and
    training goes on from its step with its seed: the same losses, and a checkpoint of the same
    weights as the forked launcher's after the same steps."""
    import torch

    plan, ckpts = tmp_path / "plan", tmp_path / "ckpts"
    common = ["run", str(MODEL), "--arg", "preset=tiny", "--minibatch", "8", "--no-probe", "--device", "cpu",
              "--out", str(plan), "--seed", "3"]
    assert main([*common, "--iters", "4", "--report", str(tmp_path / "local.json"),
                 "--checkpoint", str(tmp_path / "local.pt")]) == 0
    torchrun(*common, "--iters", "2", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpts),
             "--report", str(tmp_path / "first.json"))
    assert sorted(p.name for p in ckpts.glob("step-*.pt")) == ["step-000002.pt"]
    torchrun(*common, "--iters", "4", "--checkpoint-dir", str(ckpts), "--resume", "--checkpoint",
             str(tmp_path / "spmd.pt"), "--report", str(tmp_path / "second.json"))
    local = [i["loss"] for i in json.loads((tmp_path / "local.json").read_text())["iterations"]]
    first = json.loads((tmp_path / "first.json").read_text())["iterations"]
    second = json.loads((tmp_path / "second.json").read_text())["iterations"]
    assert [i["iteration"] for i in first + second] == [0, 1, 2, 3]
    assert [i["loss"] for i in first + second] == local
    assert sorted(p.name for p in ckpts.glob("step-*.pt")) == ["step-000002.pt", "step-000004.pt"]
    want, got = (torch.load(tmp_path / name, weights_only=True) for name in ("local.pt", "spmd.pt"))
    assert got["iteration"] == want["iteration"] == 4
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name


def test_messages_between_torchrun_processes_round_trip_as_msgpack():
    import msgpack
    import torch

    from harmony.runtime.spmd import _pack, _unpack

    tensor = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    items = [("slab", 128, [2, 3], "torch.float32"), ("obj", 7), ("tensor", tensor)]
    data = _pack(items, b"rng", 1, 12.5)
    msgpack.unpackb(data, raw=False)  # plain msgpack: nothing to unpickle
    got, state, src, sent = _unpack(data)
    assert got[:2] == items[:2] and (state, src, sent) == (b"rng", 1, 12.5)
    assert got[2][0] == "tensor" and torch.equal(got[2][1], tensor)


GROUP_AFTER_DESTROY = """
import os, sys
import torch.distributed as dist
from harmony.runtime.p2p import start_default_group

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
if sys.argv[1] == "harmony":
    start_default_group(60, store=dist.HashStore(), rank=0, world_size=1)
else:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
during = threads()
import torch._dynamo  # what loading a plan imports, after the group exists
dist.destroy_process_group()
print(before, during, threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_the_default_group_harmony_starts_is_gone_after_destroy_even_when_dynamo_is_imported_later():
    """torch.distributed.nn binds ``group.WORLD`` as a default argument when first imported; after
    ``init_process_group`` that keeps the group and its gloo threads alive past
    ``destroy_process_group``, and a torchrun rank then aborted at exit (SIGABRT) about once in fifty
    runs. Harmony imports it before starting the group, so destroying the group ends its threads."""
    def counts(how: str) -> list[int]:
        done = subprocess.run([sys.executable, "-c", GROUP_AFTER_DESTROY, how], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return [int(n) for n in done.stdout.split()]

    before, during, after = counts("harmony")
    assert during > before, "the group started no threads: nothing is being checked"
    assert after == before, f"{after - before} of the group's threads outlived destroy_process_group"
    plain = counts("plain")
    assert plain[2] > plain[0], "torch no longer keeps the group alive: start_default_group's import can go"


@needs_torchrun
def test_a_torchrun_run_keeping_its_state_on_the_devices_checkpoints_and_resumes_as_the_forked_launcher(tmp_path):
    """With room to spare each device keeps its packs' weights, BatchNorm statistics and optimizer
    state across iterations (scheduler/keep.py): every rank writes them back to the host store
    before rank 0 saves, and the run resumed from the file gives the uninterrupted losses and
    weights."""
    import torch

    resnet = MODEL.with_name("resnet.py")
    args = ["--arg", "preset=tiny", "--no-probe", "--device", "cpu"]
    assert main(["compile", str(resnet), *args, "--minibatch", "8", "--devices", "2", "--device-memory", "1GiB",
                 "--no-compare", "--out", str(tmp_path / "base")]) == 0
    plan = kept_on_both_devices(tmp_path / "base", tmp_path / "plan")
    ckpts = tmp_path / "ckpts"
    common = ["run", str(resnet), *args, "--plan", str(plan)]
    assert main([*common, "--iters", "4", "--report", str(tmp_path / "local.json"),
                 "--checkpoint", str(tmp_path / "local.pt")]) == 0
    torchrun(*common, "--iters", "2", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpts),
             "--report", str(tmp_path / "first.json"))
    torchrun(*common, "--iters", "4", "--checkpoint-dir", str(ckpts), "--resume", "--checkpoint",
             str(tmp_path / "spmd.pt"), "--report", str(tmp_path / "second.json"))
    local = [i["loss"] for i in json.loads((tmp_path / "local.json").read_text())["iterations"]]
    spmd = [i["loss"] for name in ("first", "second")
            for i in json.loads((tmp_path / f"{name}.json").read_text())["iterations"]]
    assert spmd == local
    want, got = (torch.load(tmp_path / name, weights_only=True) for name in ("local.pt", "spmd.pt"))
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name


def kept_on_both_devices(base: Path, out: Path, mode: str = "pp") -> Path:
    """The base plan (5 layers, 2 devices with room) with two packs, kept on the devices and stepped
    there: in pp each pack on its device, in dp a replica of both on each."""
    from harmony.plan import Plan
    from harmony.scheduler.memory import kept_on
    from harmony.scheduler.modes import generate
    from harmony.scheduler.tasks import Configuration

    plan = Plan.load(base)
    packs = [(0, 2), (3, 4)]
    plan.tasks = generate(mode, plan.profile, Configuration(u_f=4, packs_f=packs, u_b=4, packs_b=packs), 2,
                          plan.tasks.minibatch, update="device", keep=True)
    plan.options = {**plan.options, "mode": mode}
    assert set(kept_on(plan.tasks)) == {0, 1}, plan.tasks.to_text()
    plan.estimate = {}
    plan.promise_memory()
    plan.save(out)
    return out
