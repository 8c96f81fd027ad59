"""``harmony run`` under torchrun on two nodes: two node ranks on loopback, each node with its own
host store, flags and slabs in /dev/shm, kept in step by replication (``runtime/replication.py``).
The run trains exactly as one host does (float64: the same losses, bit for bit, and the planned
bytes), for each way the host store is written (host updates, jit-updates on the device, the
replicated update of dp); a failure on one node ends both within seconds, naming the failed rank;
no run leaves a shared-memory file."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from harmony.cli import main
from harmony.scheduler.machine import nominal_machine
from harmony.modelfile import load_model_file, parse_options
from harmony.plan import Plan
from harmony.runtime.hoststore import HostStore
from harmony.runtime.replication import _merge, _stamp_index, task_writes
from harmony.scheduler.search import search
from harmony.trainer import Trainer

pytestmark = pytest.mark.slow  # several processes launched per test

MODEL = Path(__file__).resolve().parents[2] / "models" / "gpt2.py"
ARGS = ["--arg", "preset=tiny", "--arg", "dtype=float64"]
MINIBATCH = 8
ITERATIONS = 3
RUN_LIMIT = 150.0  # seconds two torchrun agents, each starting its python, may take for the run
FAULT_LIMIT = 30.0  # seconds from a failure until both nodes have ended

TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
needs_torchrun = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed")


def shm_files() -> set[Path]:
    return set(Path("/dev/shm").glob("harmony-*"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(args: list[str], timeout: float) -> list[tuple[int, str, float]]:
    """``torchrun --nnodes 2 --nproc-per-node 1`` twice (node ranks 0 and 1, static rendezvous on
    loopback): per node, its exit status, its output and when it ended (time.time())."""
    port = free_port()
    procs = [subprocess.Popen(
        [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
         "--master-port", str(port), "-m", "harmony.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    ) for node in (0, 1)]
    results = []
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, time.time()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


@pytest.fixture(scope="module")
def base_plan(tmp_path_factory) -> Path:
    """gpt2-tiny (float64, tied embedding) compiled for 2 devices."""
    out = tmp_path_factory.mktemp("multinode") / "base"
    assert main(["compile", str(MODEL), *ARGS, "--minibatch", str(MINIBATCH), "--devices", "2",
                 "--device", "cpu", "--no-probe",
                 "--out", str(out)]) == 0
    return out


def variant(base: Path, out: Path, mode: str, update: str, clip: float | None = None, gated: bool = False) -> Path:
    """The base plan rescheduled in ``mode`` with the update where asked (each writes the host
    store from other tasks: host UPD tasks, BWD tasks' jit-update, dp's replicated UPD tasks);
    with ``clip`` (or ``gated``: fp16's overflow check), a plan whose updates wait for a NORM task
    on the host."""
    plan = Plan.load(base)
    machine = nominal_machine("cpu", 2, plan.profile.capacity)
    result = search(plan.profile, machine, mode, 2, MINIBATCH, capacity=plan.options["planned_memory"],
                    same_u=bool(plan.options["same_u"]), update=update,
                    **({"gated": True} if gated or clip is not None else {}))
    result.graph.precision = plan.tasks.precision
    plan.tasks = result.graph
    plan.estimate = {}
    plan.options = {**plan.options, "mode": mode, "clip_grad_norm": clip}
    plan.save(out)
    return out


@needs_torchrun
@pytest.mark.parametrize("mode,update", [("pp", "host"), ("pp", "device"), ("dp", "device")])
def test_two_nodes_train_exactly_as_one_host(base_plan, tmp_path, mode, update):
    plan = variant(base_plan, tmp_path / "plan", mode, update)
    common = ["run", str(MODEL), *ARGS, "--plan", str(plan), "--iters", str(ITERATIONS)]
    assert main([*common, "--report", str(tmp_path / "one-host.json")]) == 0
    before = shm_files()
    start = time.time()
    nodes = two_nodes([*common, "--report", str(tmp_path / "two-nodes.json")], RUN_LIMIT)
    for rc, out, _ in nodes:
        assert rc == 0, out[-4000:]
    assert max(end for _, _, end in nodes) - start < RUN_LIMIT
    one = json.loads((tmp_path / "one-host.json").read_text())
    two = json.loads((tmp_path / "two-nodes.json").read_text())
    assert [i["loss"] for i in two["iterations"]] == [i["loss"] for i in one["iterations"]]
    assert two["bytes_by_channel"] == one["bytes_by_channel"] == one["planned_bytes_by_channel"]
    assert shm_files() <= before, "shared-memory files left behind"


SCHEDULED = """
import torch

from harmony.models.gpt2 import build_model, build_optimizer, get_batch, loss_fn  # noqa: F401


def build_lr_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
"""


def gated_plan(tmp_path: Path, source: str, args: list[str], flags: list[str]) -> tuple[Path, Path]:
    """A model file of ``source`` compiled with ``flags`` for 2 devices, rescheduled in pp with its
    updates on the devices, after the host's NORM task (node 1 steps packs of its own): (model, plan)."""
    model = tmp_path / "model.py"
    model.write_text(source)
    assert main(["compile", str(model), *args, "--minibatch", str(MINIBATCH), "--devices", "2", "--device", "cpu",
                 "--no-probe", *flags, "--out", str(tmp_path / "base")]) == 0
    plan = variant(tmp_path / "base", tmp_path / "plan", "pp", "device", gated=True,
                   clip=Plan.load(tmp_path / "base").options.get("clip_grad_norm"))
    assert any(t.kind.value == "UPD" and t.device == 1 for t in Plan.load(plan).tasks.tasks)
    return model, plan


def one_host_and_two_nodes(tmp_path: Path, model: Path, args: list[str], plan: Path) -> tuple[list[dict], list[dict]]:
    """The iterations of one run of ``plan`` with the forked launcher, and on two nodes."""
    common = ["run", str(model), *args, "--plan", str(plan), "--iters", str(ITERATIONS)]
    assert main([*common, "--report", str(tmp_path / "one-host.json")]) == 0
    nodes = two_nodes([*common, "--report", str(tmp_path / "two-nodes.json")], RUN_LIMIT)
    for rc, out, _ in nodes:
        assert rc == 0, out[-4000:]
    return tuple(json.loads((tmp_path / f"{name}.json").read_text())["iterations"] for name in ("one-host", "two-nodes"))


@needs_torchrun
def test_two_nodes_clip_and_follow_the_schedule_exactly_as_one_host(tmp_path):
    """Node 1 steps its packs with the gradient node 0's NORM task summed and clipped, shipped to
    node 1's replica with the task's flag."""
    model, plan = gated_plan(tmp_path, SCHEDULED, ARGS, ["--clip-grad-norm", "0.5"])
    one, two = one_host_and_two_nodes(tmp_path, model, ARGS, plan)
    assert [(i["loss"], i["grad_norm"]) for i in two] == [(i["loss"], i["grad_norm"]) for i in one]
    assert all(i["grad_norm"] > 0.5 for i in one)  # every step clipped


OVERFLOWING = """
from harmony.models import gpt2
from harmony.models.gpt2 import build_model, build_optimizer, get_batch  # noqa: F401


def loss_fn(output, target):
    return gpt2.loss_fn(output, target) * 1e7  # its fp16 gradient overflows at every scale these steps try
"""


@needs_torchrun
def test_two_nodes_skip_every_step_whose_fp16_gradient_overflowed(tmp_path):
    """fp16 (float32 weights): node 0's NORM task finds the overflow; node 1 must skip its packs'
    updates too, or its weights turn to inf and NaN."""
    args = ["--arg", "preset=tiny"]
    model, plan = gated_plan(tmp_path, OVERFLOWING, args, ["--precision", "fp16"])
    one, two = one_host_and_two_nodes(tmp_path, model, args, plan)
    fields = ("loss", "loss_scale", "skipped")
    assert [[i[k] for k in fields] for i in two] == [[i[k] for k in fields] for i in one]
    assert [i["skipped"] for i in one] == [True] * ITERATIONS
    assert [i["loss_scale"] for i in one] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14]


@needs_torchrun
def test_two_nodes_resume_from_a_checkpoint_each_node_loads_into_its_replica(base_plan, tmp_path):
    """Rank 0 saves its node's replica; on resume each node's leader loads the file into its own
    (here one file both read; on real hosts, each its copy): the losses of a run never stopped."""
    plan = variant(base_plan, tmp_path / "plan", "pp", "host")
    ckpts = tmp_path / "ckpts"
    common = ["run", str(MODEL), *ARGS, "--plan", str(plan)]
    assert main([*common, "--iters", "4", "--report", str(tmp_path / "one-host.json")]) == 0
    nodes = two_nodes([*common, "--iters", "2", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpts),
                       "--report", str(tmp_path / "first.json")], RUN_LIMIT)
    nodes += two_nodes([*common, "--iters", "4", "--checkpoint-dir", str(ckpts), "--resume",
                        "--report", str(tmp_path / "second.json")], RUN_LIMIT)
    for rc, out, _ in nodes:
        assert rc == 0, out[-4000:]
    one = [i["loss"] for i in json.loads((tmp_path / "one-host.json").read_text())["iterations"]]
    two = [json.loads((tmp_path / f"{name}.json").read_text())["iterations"] for name in ("first", "second")]
    assert [i["iteration"] for i in two[0] + two[1]] == [0, 1, 2, 3]
    assert [i["loss"] for i in two[0] + two[1]] == one


FAULTY_MODEL = """
    import os
    import signal
    import time

    from harmony.models import gpt2
    from harmony.models.gpt2 import build_model, build_optimizer

    STEP = [0]


    def get_batch(batch_size, step, **options):
        STEP[0] = step
        return gpt2.get_batch(batch_size, step, **options)


    def loss_fn(output, target):
        # compile measures packs with this loss too: it runs with no FAULT_NODE set
        if os.environ.get("GROUP_RANK") == os.environ.get("FAULT_NODE", "none") and STEP[0] == 2:
            with open(os.environ["FAULT_STAMP"], "w") as f:
                f.write(str(time.time()))
            if os.environ["FAULT"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on node {os.environ['FAULT_NODE']}")
        return gpt2.loss_fn(output, target)
"""


@needs_torchrun
@pytest.mark.parametrize("fault,node", [("raise", 1), ("kill", 0)])
def test_a_failure_on_one_node_ends_both_within_seconds_naming_the_rank(tmp_path, monkeypatch, fault, node):
    """A loss function that raises, or kills its own process (node 0: the one hosting the
    rendezvous store), at the third iteration in dp (every device computes a loss)."""
    model = tmp_path / "faulty.py"
    model.write_text(textwrap.dedent(FAULTY_MODEL))
    plan = tmp_path / "plan"
    assert main(["compile", str(model), *ARGS, "--minibatch", str(MINIBATCH), "--devices", "2",
                 "--device", "cpu", "--mode", "dp",
                 "--no-probe", "--out", str(plan)]) == 0
    stamp = tmp_path / "failed-at"
    monkeypatch.setenv("FAULT_STAMP", str(stamp))
    monkeypatch.setenv("FAULT", fault)
    monkeypatch.setenv("FAULT_NODE", str(node))
    before = shm_files()
    nodes = two_nodes(["run", str(model), *ARGS, "--plan", str(plan), "--iters", "5", "--timeout", "120"], RUN_LIMIT)
    assert stamp.exists(), "the fault was never injected:\n" + nodes[node][1][-3000:]
    failed_at = float(stamp.read_text())
    for rc, out, end in nodes:
        assert rc != 0, out[-3000:]
        assert end - failed_at < FAULT_LIMIT, out[-3000:]
    survivor = nodes[1 - node][1]
    assert f"stopped: rank {node}" in survivor, survivor[-3000:]
    if fault == "raise":
        assert f"injected failure on node {node}" in survivor, survivor[-3000:]
    assert shm_files() <= before, "shared-memory files left behind"


@pytest.mark.parametrize("mode,update,clip", [("pp", "host", None), ("pp", "device", None), ("dp", "device", None),
                                             ("dp", "device", 0.5)])
def test_replicated_regions_cover_every_host_store_write(base_plan, tmp_path, mode, update, clip):
    """What ``task_writes`` ships is at least what an iteration changes in the store: a write it
    did not name would leave the other node's replica stale (a plan that clips: its NORM task's)."""
    plan = Plan.load(variant(base_plan, tmp_path / "plan", mode, update, clip))
    mf = load_model_file(MODEL, parse_options(ARGS[1::2]))
    torch.manual_seed(0)
    with Trainer(plan, optimizer=mf.build_optimizer, loss_fn=mf.loss_fn,
                 state_dict=mf.build_model().state_dict()) as trainer:
        store: HostStore = trainer.store
        program = plan.program()
        named = [span for t in plan.tasks.tasks for span in task_writes(t, program, plan.tasks, plan.graph, store).spans]
        flags = {i for t in plan.tasks.tasks for i in task_writes(t, program, plan.tasks, plan.graph, store).flags}
        for step in range(2):
            buffer, stamps = store.buffer.clone(), store.flags.clone()
            trainer.step(*mf.get_batch(MINIBATCH, step))
            changed = (store.buffer != buffer).nonzero().flatten().tolist()
            covered = _merge(sorted(named))
            assert all(any(o <= b < o + n for o, n in covered) for b in changed)
            assert set((store.flags != stamps).nonzero().flatten().tolist()) <= flags


def test_stamp_indices_agree_with_the_host_store(base_plan):
    plan = Plan.load(base_plan)
    mf = load_model_file(MODEL, parse_options(ARGS[1::2]))
    store = HostStore.create(plan.graph, 2, mf.build_optimizer, mf.build_model().state_dict())
    index = {name: i for i, name in enumerate(store.layout.params)}
    for device in range(2):
        for name in store.layout.params[:3]:
            before = store.flags.clone()
            store.stamp_slot(device, name, 5)
            assert (store.flags != before).nonzero().flatten().tolist() == [
                _stamp_index(store.layout.params, index, device, name)]


@needs_torchrun
@pytest.mark.parametrize("model_file,mode", [("resnet.py", "pp"), ("gpt2.py", "dp")])
def test_two_nodes_keeping_state_on_their_devices_save_the_checkpoint_one_host_saves(tmp_path, model_file, mode):
    """Each node's device keeps its state (scheduler/keep.py): in pp its pack, in dp a replica of
    the model. Before the save, the device stepping a pack's master copy (pp: node 1's for its pack;
    dp: node 0's replica) writes its kept weights, buffers and optimizer state back and ships them
    to the other node's host store; rank 0 saves. The file holds exactly what the forked launcher's
    does after the same steps."""
    import torch

    from tests.runtime.test_torchrun import kept_on_both_devices

    model = MODEL.with_name(model_file)
    args = ["--arg", "preset=tiny", "--no-probe", "--device", "cpu"]
    assert main(["compile", str(model), *args, "--minibatch", str(MINIBATCH), "--devices", "2",
                 "--device-memory", "1GiB", "--no-compare", "--out", str(tmp_path / "base")]) == 0
    plan = kept_on_both_devices(tmp_path / "base", tmp_path / "plan", mode)
    common = ["run", str(model), *args, "--plan", str(plan), "--iters", str(ITERATIONS)]
    assert main([*common, "--report", str(tmp_path / "one-host.json"), "--checkpoint", str(tmp_path / "one.pt")]) == 0
    nodes = two_nodes([*common, "--report", str(tmp_path / "two-nodes.json"), "--checkpoint", str(tmp_path / "two.pt")],
                      RUN_LIMIT)
    for rc, out, _ in nodes:
        assert rc == 0, out[-4000:]
    one, two = (json.loads((tmp_path / f"{name}.json").read_text())["iterations"] for name in ("one-host", "two-nodes"))
    assert [i["loss"] for i in two] == [i["loss"] for i in one]
    want, got = (torch.load(tmp_path / name, weights_only=True) for name in ("one.pt", "two.pt"))
    assert set(got["model"]) == set(want["model"])
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for name, values in want["optimizer"].items():
        for key, tensor in values.items():
            assert torch.equal(got["optimizer"][name][key], tensor), (name, key)
