"""The one on-disk envelope every Harmony stage uses: msgpack, a kind, a schema version, a checksum.

Files cross machines and outlive code versions, so a reader must be able to refuse a file that is
truncated, corrupted, of another kind or of another schema version with a message that says which,
instead of failing deep inside msgpack or, worse, loading garbage. Nothing here unpickles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Iterator

import msgpack

from harmony.errors import FormatError, HarmonyError

MAGIC = "harmony"


def _digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def dumps(kind: str, version: int, body: Any) -> bytes:
    """Encode ``body`` (plain data: dicts, lists, str, numbers, bytes) in the envelope."""
    payload = msgpack.packb(body, use_bin_type=True)
    envelope = {"magic": MAGIC, "kind": kind, "version": version, "sha256": _digest(payload), "body": payload}
    return msgpack.packb(envelope, use_bin_type=True)


def loads(data: bytes, kind: str, version: int, source: str = "<bytes>") -> Any:
    """Decode an envelope, checking magic, kind, version and checksum before the body is read."""
    try:
        envelope = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise FormatError(f"{source} is not a Harmony {kind} file (truncated or corrupt: {exc})") from exc
    if not isinstance(envelope, dict) or envelope.get("magic") != MAGIC:
        raise FormatError(f"{source} is not a Harmony file")
    if envelope.get("kind") != kind:
        raise FormatError(f"{source} holds a {envelope.get('kind')!r}, not a {kind!r}")
    if envelope.get("version") != version:
        raise FormatError(
            f"{source} is {kind} schema version {envelope.get('version')}, this Harmony reads version "
            f"{version}; re-create it with this version of Harmony"
        )
    payload = envelope.get("body")
    if not isinstance(payload, bytes) or _digest(payload) != envelope.get("sha256"):
        raise FormatError(f"{source} is corrupt (checksum mismatch); re-create it")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise FormatError(f"{source} is corrupt ({exc})") from exc


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write via a temporary file and rename, so a crash never leaves a half-written file in place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(path: str | Path, kind: str, version: int, body: Any) -> None:
    atomic_write_bytes(path, dumps(kind, version, body))


def load(path: str | Path, kind: str, version: int) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path} does not exist")
    return loads(path.read_bytes(), kind, version, source=str(path))


# the exceptions that reading a structure of the wrong shape raises: a missing key, a list where a
# mapping belongs, a string where a number belongs, an unknown enum value
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError)


@contextlib.contextmanager
def decoding(source: str, what: str) -> Iterator[None]:
    """Turn any sign of a body of the wrong shape, raised while building objects from it, into a
    FormatError naming the file: a file whose checksum is right can still be malformed (written by
    another program, or by hand), and the user must learn which file, not see a KeyError."""
    try:
        yield
    except HarmonyError as exc:
        if isinstance(exc, FormatError) and source in str(exc):
            raise
        raise FormatError(f"{source} is not a valid {what}: {exc}; re-create it") from exc
    except MALFORMED as exc:
        raise FormatError(f"{source} is not a valid {what} ({type(exc).__name__}: {exc}); re-create it") from exc


_SCALARS = {int: (int,), float: (int, float), str: (str,), bool: (bool,), bytes: (bytes,)}


def check_fields(cls: type, data: Any, what: str) -> dict:
    """``data`` as the keyword arguments of dataclass ``cls``, each field of a plain type (int,
    float, str, bool, bytes, list, dict, or optional) checked, so that a number that decodes as a
    string fails here with the field's name instead of deep inside the scheduler."""
    if not isinstance(data, dict):
        raise FormatError(f"{what} must be a mapping, found {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        allowed = _allowed_types(hints.get(f.name))
        value = data[f.name]
        if allowed is None or (value is None and type(None) in allowed):
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise FormatError(f"{what}: field {f.name!r} is a {type(value).__name__}, expected "
                              f"{' or '.join(t.__name__ for t in allowed)}")
    unknown = sorted(str(k) for k in data if k not in {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise FormatError(f"{what} has unknown field(s) {', '.join(unknown)}")
    return data


def _allowed_types(hint: Any) -> tuple[type, ...] | None:
    """The runtime types a field annotated ``hint`` accepts, or None when not checked here."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_allowed_types(a) for a in typing.get_args(hint)]
        if any(p is None for p in parts):
            return None
        return tuple(t for p in parts for t in p)  # type: ignore[union-attr]
    if hint is type(None):
        return (type(None),)
    if origin in (list, tuple) or hint in (list, tuple):
        return (list, tuple)
    if origin is dict or hint is dict:
        return (dict,)
    return _SCALARS.get(hint)


def json_seal(obj: dict) -> bytes:
    """``obj`` as indented JSON with a ``sha256`` field over its canonical form: JSON files are for
    people to read, and the digest lets a reader tell an edited or damaged file from a good one."""
    body = json.loads(json.dumps({k: v for k, v in obj.items() if k != "sha256"}, default=str))  # as read back
    return json.dumps({**body, "sha256": _json_digest(body)}, indent=2, default=str).encode()


def json_open(data: bytes, source: str) -> dict:
    """The object of a file written by ``json_seal``, refused by name when it is not valid JSON, not
    an object, has no digest, or its digest does not match (it was damaged or edited)."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FormatError(f"{source} is corrupt ({exc})") from exc
    if not isinstance(obj, dict):
        raise FormatError(f"{source} is corrupt (a JSON {type(obj).__name__}, not an object)")
    digest = obj.pop("sha256", None)
    if not isinstance(digest, str):
        raise FormatError(f"{source} has no checksum (written by an older Harmony, or edited)")
    if _json_digest(obj) != digest:
        raise FormatError(f"{source} is corrupt or was edited (checksum mismatch)")
    return obj


def _json_digest(obj: dict) -> str:
    return _digest(json.dumps(obj, sort_keys=True, default=str).encode())
