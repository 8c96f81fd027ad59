"""Checkpoint files: a ``torch.save`` archive the user can open, sealed so a damaged one is refused.

A checkpoint is what ``torch.save`` writes (a zip archive), so ``torch.load(path, weights_only=True)
["model"]`` loads into the user's own ``nn.Module`` with ``load_state_dict``. PyTorch does not check
the archive's CRCs, so a flipped bit in a weight would load silently; the file therefore ends with
a SHA-256 of everything before it, kept in the zip comment (which zip readers, PyTorch's included,
ignore). Reading checks the seal first and then loads with ``weights_only=True``: nothing is
unpickled beyond tensors and plain containers.

A checkpoint folder (``harmony run --checkpoint-dir``) holds ``step-000010.pt`` files and
``latest.json``, which names the newest complete one. Each file is written under a temporary name
and renamed, and the pointer is moved only after that, so an interrupted save leaves the previous
good checkpoint in place and named.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from harmony import serialization
from harmony.errors import FormatError, HarmonyError

log = logging.getLogger(__name__)

VERSION = 2
LATEST = "latest.json"
KEEP = 2  # the newest checkpoint and the one before it
_SEAL = b"harmony-sha256:"
_SEAL_LEN = len(_SEAL) + 64
_EOCD = b"PK\x05\x06"  # zip end-of-central-directory signature; its last 2 bytes are the comment length
_EOCD_LEN = 22
_STEP_FILE = re.compile(r"step-(\d+)\.pt")
REQUIRED = {"version": int, "graph": str, "model_sha256": str, "iteration": int, "seed": int, "model": dict,
            "optimizer": dict, "rng": dict}


class CheckpointError(FormatError):
    """A checkpoint is missing, damaged, of another version, or made for another model."""


# ------------------------------------------------------------------ one file
def write(path: str | Path, body: dict[str, Any]) -> Path:
    """Save ``body`` sealed, atomically: the file at ``path`` is the old one or the new complete
    one, whatever interrupts the save (an exception, Ctrl-C, a full disk)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise HarmonyError(f"cannot save a checkpoint to {path}: the folder {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(body, tmp)
        _seal(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise HarmonyError(f"cannot save a checkpoint to {path}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read(path: str | Path) -> dict[str, Any]:
    """A checkpoint's contents, after checking its seal, version and structure; anything else is a
    CheckpointError naming the file and the reason."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist or is not a file; give a checkpoint written by Harmony")
    _check_seal(path)
    try:
        body = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - a sealed file that does not load is damaged all the same
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(exc).__name__}: {exc})") from exc
    if not isinstance(body, dict) or body.get("version") != VERSION:
        found = body.get("version") if isinstance(body, dict) else type(body).__name__
        raise CheckpointError(f"{path} is a checkpoint of version {found}; this Harmony reads version {VERSION}")
    for key, kind in REQUIRED.items():
        if not isinstance(body.get(key), kind) or isinstance(body.get(key), bool):
            raise CheckpointError(f"{path} is malformed: {key!r} is missing or not a {kind.__name__}")
    if body["iteration"] < 0 or not all(isinstance(v, torch.Tensor) for v in body["model"].values()):
        raise CheckpointError(f"{path} is malformed: a negative step or a model entry that is not a tensor")
    return body


def _seal(path: Path) -> None:
    """Append the SHA-256 of the archive as its zip comment (the archive must have none yet)."""
    with open(path, "r+b") as f:
        f.seek(-_EOCD_LEN, os.SEEK_END)
        eocd = f.read(_EOCD_LEN)
        if eocd[:4] != _EOCD or eocd[-2:] != b"\0\0":
            raise HarmonyError(f"torch.save wrote {path} in a layout Harmony cannot seal (not a zip archive)")
        size = f.tell()
        digest = _digest(f, size - 2)
        f.seek(size - 2)
        f.write(_SEAL_LEN.to_bytes(2, "little") + _SEAL + digest.encode())
        f.flush()
        os.fsync(f.fileno())


def _check_seal(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < _EOCD_LEN + _SEAL_LEN:
            raise CheckpointError(f"{path} is truncated or not a Harmony checkpoint ({size} bytes)")
        f.seek(size - _EOCD_LEN - _SEAL_LEN)
        tail = f.read()
        if tail[:4] != _EOCD or tail[_EOCD_LEN - 2:_EOCD_LEN] != _SEAL_LEN.to_bytes(2, "little") \
                or tail[_EOCD_LEN:_EOCD_LEN + len(_SEAL)] != _SEAL:
            raise CheckpointError(f"{path} is truncated, damaged, or not a Harmony checkpoint (no seal at its end)")
        if _digest(f, size - _SEAL_LEN - 2) != tail[-64:].decode("ascii", "replace"):
            raise CheckpointError(f"{path} is corrupt (checksum mismatch): it was damaged after it was written")


def _digest(f, length: int) -> str:
    """SHA-256 of the first ``length`` bytes of an open file, read in chunks (checkpoints are big)."""
    f.seek(0)
    h = hashlib.sha256()
    left = length
    while left > 0:
        chunk = f.read(min(left, 1 << 22))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------ a run's state
def snapshot(plan, store, iteration: int, seed: int, schedule=None, loss_scale=None) -> dict[str, Any]:
    """The body of a checkpoint of a run of ``plan`` whose host store ``store`` holds the state
    after ``iteration`` steps: weights and buffers under the model's names, optimizer state, the
    step, the seed, this process's global generators and, for a scheduled run, the learning-rate
    schedule (``runtime/lr_schedule.Schedule``; the key is absent otherwise), for an fp16 run the loss
    scale (``runtime/lossscale.LossScale``, as GradScaler's state_dict, key "grad_scaler")."""
    body = {
        "version": VERSION, "graph": plan.graph.fingerprint(), "model_sha256": plan.model_sha256 or "",
        "iteration": iteration, "seed": seed, "model": store.state_dict(plan.graph),
        "optimizer": store.optimizer_state(), "rng": capture_rng(),
    }
    if schedule is not None:
        body["lr_scheduler"] = schedule.state_dict()
    if loss_scale is not None:
        body["grad_scaler"] = loss_scale.state_dict()
    return body


def restore(path: str | Path, plan, store, restore_rng_state: bool = True, schedule=None,
            loss_scale=None) -> tuple[int, int]:
    """Load the checkpoint at ``path`` into ``store`` (the host store of a run of ``plan``) and,
    for a scheduled run, its learning-rate ``schedule`` (one saved without a schedule: the schedule
    is stepped to the checkpoint's step, as if it had run from the start), for an fp16 run its
    ``loss_scale`` (if the checkpoint has one); returns its (step, seed).
    A file that is damaged or was saved for another model, model file or decomposition is refused
    before anything changes."""
    body = read(path)
    fingerprint = plan.graph.fingerprint()
    if body["graph"] != fingerprint:
        raise CheckpointError(
            f"{path} was saved for another model or decomposition (layer graph {body['graph'][:12]}…, this plan's "
            f"is {fingerprint[:12]}…); resume with the model and options it was saved with")
    if body["model_sha256"] and plan.model_sha256 and body["model_sha256"] != plan.model_sha256:
        raise CheckpointError(
            f"{path} was saved for another version of the model file (SHA-256 {body['model_sha256'][:12]}… then, "
            f"{plan.model_sha256[:12]}… now); resume with the model file it was saved with")
    problem = _misfit(body, plan.graph, store)
    if problem:
        raise CheckpointError(f"{path} does not fit this model: {problem}")
    if schedule is not None:
        _restore_schedule(path, body, schedule)
    if loss_scale is not None and body.get("grad_scaler"):
        loss_scale.load_state_dict(body["grad_scaler"])
    store.load_tensors(plan.graph, body["model"])
    store.load_optimizer_state(body["optimizer"])
    if restore_rng_state:
        restore_rng(body["rng"], str(path))
    return body["iteration"], body["seed"]


def _restore_schedule(path: str | Path, body: dict[str, Any], schedule) -> None:
    saved = body.get("lr_scheduler")
    if saved is None:
        log.warning("%s was saved without a learning-rate schedule; the schedule starts at its step %d",
                    path, body["iteration"])
        schedule.catch_up(body["iteration"])
        return
    try:
        schedule.load_state_dict(saved)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} holds a learning-rate schedule this run's scheduler cannot load ({exc}); "
                              "resume with the scheduler it was saved with") from exc


def _misfit(body: dict[str, Any], graph, store) -> str:
    """Why a checkpoint's tensors cannot be loaded into ``store``, or "": checked before anything
    is copied, so that a refused checkpoint leaves the run as it was."""
    model = body["model"]
    for name, spec in graph.state.items():
        canon = graph.canonical(name)
        names = [name, canon, *graph.ties.get(canon, [])]
        found = next((model[n] for n in names if n in model), None)
        if found is None:
            if name not in graph.constants and (spec.kind == "parameter" or spec.persistent):
                return f"no value for {name!r}"
        elif found.numel() != math.prod(spec.shape):
            return f"{name!r} has shape {tuple(found.shape)}, the model's is {tuple(spec.shape)}"
    params = set(store.layout.params)
    for name, values in body["optimizer"].items():
        if name not in params or not isinstance(values, dict):
            return f"optimizer state for {name!r}, which is not a parameter of this model"
        if not values:
            continue
        for key, view in store.state(name).items():
            value = values.get(key)
            if not isinstance(value, torch.Tensor) or value.numel() != view.numel():
                return f"the optimizer state {key!r} of {name!r} is missing or of another size"
    return ""


# ------------------------------------------------------------------ random number generators
def capture_rng() -> dict[str, Any]:
    """The global generators of torch, numpy and Python as tensors and plain numbers (what
    ``weights_only`` loading accepts), so that a user's ``get_batch`` that draws from them goes on
    after a resume as if never stopped."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, state, gauss_next = random.getstate()
    rng = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": int(version), "state": torch.tensor(state, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any], source: str) -> None:
    """Set the global generators to a ``capture_rng`` state; a damaged one is a CheckpointError."""
    try:
        torch.set_rng_state(rng["torch"])
        n = rng["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
        p = rng["python"]
        random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss_next"]))
        if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda"])
    except (*serialization.MALFORMED, RuntimeError) as exc:
        raise CheckpointError(f"{source} has a damaged random-generator state ({type(exc).__name__}: {exc})") from exc


# ------------------------------------------------------------------ a checkpoint folder
def step_path(directory: str | Path, step: int) -> Path:
    """The checkpoint file after ``step`` iterations."""
    return Path(directory) / f"step-{step:06d}.pt"


def publish(directory: str | Path, path: Path, step: int, keep: int = KEEP) -> None:
    """Point ``latest.json`` at the complete checkpoint ``path``, then delete the older ones but
    the ``keep`` newest; the pointer moves atomically, after the file is complete."""
    directory = Path(directory)
    serialization.atomic_write_bytes(directory / LATEST, serialization.json_seal({"checkpoint": path.name,
                                                                                  "step": step}))
    for _, old in sorted(_step_files(directory), reverse=True)[keep:]:
        old.unlink(missing_ok=True)


def latest(location: str | Path) -> Path:
    """The checkpoint to resume from: ``location`` itself when a file, else the one its
    ``latest.json`` names, else (no or a damaged pointer) the highest-numbered step file."""
    location = Path(location)
    if location.is_file():
        return location
    if not location.is_dir():
        raise CheckpointError(f"{location} is neither a checkpoint nor a checkpoint folder")
    pointer = location / LATEST
    if pointer.is_file():
        try:
            named = serialization.json_open(pointer.read_bytes(), str(pointer)).get("checkpoint")
        except FormatError:
            named = None
        if isinstance(named, str) and Path(named).name == named and (location / named).is_file():
            return location / named
    found = sorted(_step_files(location))
    if not found:
        raise CheckpointError(f"{location} holds no checkpoint (no {LATEST}, no step-*.pt); "
                              "start without --resume or give another folder")
    return found[-1][1]


def _step_files(directory: Path) -> Iterator[tuple[int, Path]]:
    for path in directory.iterdir():
        match = _STEP_FILE.fullmatch(path.name)
        if match and path.is_file():
            yield int(match.group(1)), path
