"""The one on-disk envelope every Harmony stage uses: msgpack, a kind, a schema version, a checksum.

Files cross machines and outlive code versions, so a reader must be able to refuse a file that is
truncated, corrupted, of another kind or of another schema version with a message that says which,
instead of failing deep inside msgpack or, worse, loading garbage. Nothing here unpickles.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import msgpack

from harmony.errors import FormatError

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
