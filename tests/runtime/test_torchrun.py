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

MODEL = Path(__file__).resolve().parents[2] / "models" / "gpt2.py"


@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="torchrun is not installed")
def test_torchrun_run_matches_the_forked_launcher(tmp_path, capsys):
    plan = tmp_path / "plan"
    common = ["run", str(MODEL), "--arg", "preset=tiny", "--minibatch", "8", "--iters", "3", "--no-probe",
              "--device", "cpu",
              "--out", str(plan)]
    assert main([*common, "--report", str(tmp_path / "local.json")]) == 0
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    before = set(Path("/dev/shm").glob("harmony-*"))
    done = subprocess.run(
        [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", "2", "-m", "harmony.cli", *common,
         "--report", str(tmp_path / "torchrun.json")],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "reusing the plan" in done.stdout
    local = json.loads((tmp_path / "local.json").read_text())
    spmd = json.loads((tmp_path / "torchrun.json").read_text())
    assert [i["loss"] for i in spmd["iterations"]] == [i["loss"] for i in local["iterations"]]
    assert spmd["bytes_by_channel"] == local["bytes_by_channel"] == local["planned_bytes_by_channel"]
    assert set(Path("/dev/shm").glob("harmony-*")) <= before, "shared-memory files left behind"


def test_messages_between_torchrun_processes_round_trip_as_msgpack():
    import msgpack
    import torch

    from harmony.runtime.spmd import _pack, _unpack

    tensor = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    items = [("slab", 128, [2, 3], "torch.float32"), ("obj", 7), ("tensor", tensor)]
    data = _pack(items, b"rng", 1)
    msgpack.unpackb(data, raw=False)  # plain msgpack: nothing to unpickle
    got, state, src = _unpack(data)
    assert got[:2] == items[:2] and (state, src) == (b"rng", 1)
    assert got[2][0] == "tensor" and torch.equal(got[2][1], tensor)
