"""Files from outside: a plan directory's files and checkpoints that are truncated,
bit-flipped, of another schema version or kind, made for another model, or well-sealed but of the
wrong shape are refused with a HarmonyError naming the file and the reason, never another exception.

Two tiny plans (the same model file at two sizes, so their graphs differ) are compiled once per
module; each test damages a copy.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
from pathlib import Path
from typing import Callable

import msgpack
import pytest
import torch

from harmony import checkpoint, serialization
from harmony.cli import main
from harmony.errors import FormatError, HarmonyError
from harmony.plan import Plan, StalePlanError

MODEL = Path(__file__).with_name("tiny_rng_model.py")
FILES = ("plan.msgpack", "graph.msgpack", "profile.msgpack", "manifest.json")
FLIPS = 24


def compile_plan(directory: Path, minibatch: int, model: Path = MODEL) -> Path:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(["compile", str(model), "--minibatch", str(minibatch), "--device-memory", "24KiB", "--no-probe",
                   "--no-compare", "--trials", "1", "--out", str(directory)])
    assert rc == 0, out.getvalue()
    return directory


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """(the plan, the plan of another model (wider layers), the plan of the same model for
    minibatches of 4)."""
    root = tmp_path_factory.mktemp("fuzz")
    wider = root / "wider_model.py"
    wider.write_text(MODEL.read_text().replace("16", "12"))
    return compile_plan(root / "plan8", 8), compile_plan(root / "other", 8, wider), compile_plan(root / "plan4", 4)


@pytest.fixture
def plan_dir(plans, tmp_path):
    copy = tmp_path / "plan"
    shutil.copytree(plans[0], copy)
    return copy


@pytest.fixture(scope="module")
def checkpoint_file(plans, tmp_path_factory):
    """A checkpoint of the 8-sample plan after 2 steps, written by harmony run."""
    folder = tmp_path_factory.mktemp("ckpt")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(["run", "--plan", str(plans[0]), str(MODEL), "--iters", "2", "--checkpoint-every", "2",
                   "--checkpoint-dir", str(folder), "--report", str(folder / "run.json")])
    assert rc == 0, out.getvalue()
    return folder / "step-000002.pt"


def refused(load: Callable[[], object], name: str, reason: str = "") -> HarmonyError:
    """Run ``load``; it must raise a FormatError or StalePlanError naming ``name`` (and ``reason``)."""
    try:
        load()
    except (FormatError, StalePlanError) as exc:
        assert name in str(exc), f"the message does not name {name}: {exc}"
        assert reason in str(exc), f"the message does not say {reason!r}: {exc}"
        return exc
    except BaseException as exc:  # noqa: BLE001 - the point of the test: nothing else may escape
        pytest.fail(f"{name}: {type(exc).__name__} leaked instead of a HarmonyError: {exc}")
    pytest.fail(f"a damaged {name} was loaded")


def load_plan(directory: Path) -> Callable[[], Plan]:
    return lambda: Plan.load(directory, model_file=MODEL, device="meta")


def flips(data: bytes, seed: int) -> list[bytes]:
    """``FLIPS`` copies of ``data``, each with one bit flipped at a seeded random position."""
    rng = random.Random(seed)
    out = []
    for _ in range(FLIPS):
        b = bytearray(data)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        out.append(bytes(b))
    return out


def test_the_undamaged_plan_and_checkpoint_load(plans, checkpoint_file):
    plan = Plan.load(plans[0], model_file=MODEL, device="meta")
    assert plan.tasks.minibatch == 8
    assert checkpoint.read(checkpoint_file)["iteration"] == 2


@pytest.mark.parametrize("name", FILES)
def test_a_truncated_plan_file_is_refused_naming_it(plan_dir, name):
    whole = (plan_dir / name).read_bytes()
    for cut in sorted({0, 1, 7, len(whole) // 3, len(whole) // 2, len(whole) - 10, len(whole) - 1}):
        (plan_dir / name).write_bytes(whole[:cut])
        refused(load_plan(plan_dir), name)


@pytest.mark.parametrize("name", FILES)
def test_a_plan_file_with_a_flipped_bit_is_refused_naming_it(plan_dir, name):
    for damaged in flips((plan_dir / name).read_bytes(), seed=FILES.index(name)):
        (plan_dir / name).write_bytes(damaged)
        refused(load_plan(plan_dir), name)


@pytest.mark.parametrize("name", ["plan.msgpack", "profile.msgpack", "graph.msgpack"])
def test_a_plan_file_of_another_schema_version_is_refused_naming_both_versions(plan_dir, name):
    envelope = msgpack.unpackb((plan_dir / name).read_bytes())
    envelope["version"] += 1
    (plan_dir / name).write_bytes(msgpack.packb(envelope, use_bin_type=True))
    refused(load_plan(plan_dir), name, f"version {envelope['version']}")


def test_a_manifest_of_another_schema_version_is_refused(plan_dir):
    manifest = json.loads((plan_dir / "manifest.json").read_text())
    manifest["schema"]["plan"] = 99
    (plan_dir / "manifest.json").write_bytes(serialization.json_seal(manifest))
    refused(load_plan(plan_dir), "manifest.json", "version 99")


def test_an_edited_manifest_is_refused_as_edited(plan_dir):
    manifest = json.loads((plan_dir / "manifest.json").read_text())
    manifest["options"]["minibatch"] = 4
    (plan_dir / "manifest.json").write_text(json.dumps(manifest))
    refused(load_plan(plan_dir), "manifest.json", "checksum mismatch")


def test_a_file_of_another_kind_is_refused_naming_what_it_holds(plan_dir):
    shutil.copy(plan_dir / "profile.msgpack", plan_dir / "plan.msgpack")
    refused(load_plan(plan_dir), "plan.msgpack", "holds a 'profile'")


@pytest.mark.parametrize("name", ["plan.msgpack", "profile.msgpack", "graph.msgpack"])
def test_a_file_of_another_models_plan_is_refused(plans, plan_dir, name):
    shutil.copy(plans[1] / name, plan_dir / name)
    exc = refused(load_plan(plan_dir), name)
    assert "another" in str(exc) or "not the graph" in str(exc) or "modified" in str(exc), str(exc)


def test_a_plan_file_compiled_with_other_options_than_its_manifest_says_is_refused(plans, plan_dir):
    shutil.copy(plans[2] / "plan.msgpack", plan_dir / "plan.msgpack")
    refused(load_plan(plan_dir), "plan.msgpack", "other options")


def test_a_manifest_of_another_model_file_is_refused_as_stale(plan_dir, tmp_path):
    other = tmp_path / "other_model.py"
    other.write_text(MODEL.read_text() + "\n# changed\n")
    exc = refused(lambda: Plan.load(plan_dir, model_file=other, device="meta"), "other_model.py", "changed")
    assert isinstance(exc, StalePlanError)


def reseal(plan_dir: Path, name: str, mutate: Callable[[dict], object]) -> None:
    """Rewrite ``name`` with its body changed by ``mutate`` and a valid checksum (a file written by
    another program: the envelope is right, the body's shape is not)."""
    envelope = msgpack.unpackb((plan_dir / name).read_bytes())
    body = msgpack.unpackb(envelope["body"], strict_map_key=False)
    replaced = mutate(body)
    serialization.save(plan_dir / name, envelope["kind"], envelope["version"],
                       replaced if isinstance(replaced, (list, str, int)) else body)


BAD_BODIES = {
    "plan.msgpack": [lambda b: b.pop("tasks"), lambda b: b.update(tasks=[1, 2]), lambda b: [b],
                     lambda b: b["tasks"].update(devices="two"), lambda b: b["tasks"]["tasks"][0].update(kind="XYZ"),
                     lambda b: b.update(estimate=None), lambda b: b["tasks"]["tasks"][0].pop("inputs")],
    "graph.msgpack": [lambda b: b.pop("layers"), lambda b: b.update(layers={"a": 1}), lambda b: b["layers"][0].pop("name"),
                      lambda b: b["layers"][0].update(index="zero"), lambda b: b["values"].update(x=[1]),
                      lambda b: b["layers"][0].update(code_file="../../evil.py"), lambda b: "a string"],
    "profile.msgpack": [lambda b: b.pop("layers"), lambda b: b["layers"][0].update(fwd_samples=None),
                        lambda b: b["layers"][0]["fwd_samples"][0].update(fwd_time="fast"),
                        lambda b: b["layers"][0].update(w_bytes=[1]), lambda b: b.update(capacity="lots"),
                        lambda b: b.update(machine={"kind": 3}), lambda b: b["layers"].pop(0), lambda b: 7],
}


@pytest.mark.parametrize("name, case", [(n, i) for n, cases in BAD_BODIES.items() for i in range(len(cases))])
def test_a_sealed_file_whose_body_has_the_wrong_shape_is_a_format_error_naming_it(plan_dir, name, case):
    reseal(plan_dir, name, BAD_BODIES[name][case])
    refused(load_plan(plan_dir), name)


# ------------------------------------------------------------------ checkpoints
def test_a_truncated_checkpoint_is_refused_naming_it(checkpoint_file, tmp_path):
    whole = checkpoint_file.read_bytes()
    path = tmp_path / "cut.pt"
    for cut in sorted({0, 1, 100, len(whole) // 2, len(whole) - 80, len(whole) - 1}):
        path.write_bytes(whole[:cut])
        refused(lambda: checkpoint.read(path), "cut.pt")


def test_a_checkpoint_with_a_flipped_bit_is_refused_naming_it(checkpoint_file, tmp_path):
    path = tmp_path / "flipped.pt"
    for damaged in flips(checkpoint_file.read_bytes(), seed=7):
        path.write_bytes(damaged)
        refused(lambda: checkpoint.read(path), "flipped.pt")


def test_a_checkpoint_of_another_version_is_refused_naming_the_versions(checkpoint_file, tmp_path):
    body = torch.load(checkpoint_file, weights_only=True)
    body["version"] = 1
    path = checkpoint.write(tmp_path / "old.pt", body)
    refused(lambda: checkpoint.read(path), "old.pt", "version 1")


def test_an_unsealed_torch_file_is_refused_and_not_unpickled(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"version": checkpoint.VERSION, "model": {}}, path)
    refused(lambda: checkpoint.read(path), "plain.pt", "no seal")


@pytest.mark.parametrize("mutate", [lambda b: b.pop("model"), lambda b: b.update(iteration="2"),
                                    lambda b: b.update(model={"w": [1.0]}), lambda b: b.update(iteration=-1),
                                    lambda b: b.update(rng=None), lambda b: b.update(graph=3)])
def test_a_sealed_checkpoint_of_the_wrong_shape_is_refused_naming_it(checkpoint_file, tmp_path, mutate):
    body = torch.load(checkpoint_file, weights_only=True)
    mutate(body)
    path = checkpoint.write(tmp_path / "odd.pt", body)
    refused(lambda: checkpoint.read(path), "odd.pt", "malformed")


def test_a_pickle_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    path = tmp_path / "evil.pt"
    torch.save({"version": checkpoint.VERSION, "evil": Evil()}, path)
    checkpoint._seal(path)  # noqa: SLF001 - a well-sealed file, so that only weights_only stands in the way
    refused(lambda: checkpoint.read(path), "evil.pt")
    assert not marker.exists()


def test_a_damaged_latest_pointer_falls_back_to_the_newest_step_file(checkpoint_file, tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    shutil.copy(checkpoint_file, checkpoint.step_path(folder, 2))
    shutil.copy(checkpoint_file, checkpoint.step_path(folder, 4))
    checkpoint.publish(folder, checkpoint.step_path(folder, 2), 2)
    assert checkpoint.latest(folder).name == "step-000002.pt"
    (folder / checkpoint.LATEST).write_bytes((folder / checkpoint.LATEST).read_bytes()[:10])
    assert checkpoint.latest(folder).name == "step-000004.pt"
