"""The msgpack envelope refuses truncated, corrupt, foreign and other-version files by name."""

import pytest

from harmony import serialization
from harmony.errors import FormatError


def test_round_trip(tmp_path):
    path = tmp_path / "x.msgpack"
    serialization.save(path, "thing", 3, {"a": [1, 2.5, "s", b"\x00\x01"]})
    assert serialization.load(path, "thing", 3) == {"a": [1, 2.5, "s", b"\x00\x01"]}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[: len(b) // 2], "truncated or corrupt"),
        (lambda b: b"not msgpack at all" + b, "not a Harmony"),
        (lambda b: b[:-3] + bytes([b[-3] ^ 0xFF]) + b[-2:], "corrupt"),
    ],
)
def test_damaged_files_are_refused(tmp_path, mutate, message):
    data = serialization.dumps("thing", 1, {"payload": list(range(100))})
    path = tmp_path / "x.msgpack"
    path.write_bytes(mutate(data))
    with pytest.raises(FormatError, match=message):
        serialization.load(path, "thing", 1)


def test_other_version_is_refused_with_both_versions_named():
    data = serialization.dumps("thing", 2, {})
    with pytest.raises(FormatError, match="version 2.*reads version 1"):
        serialization.loads(data, "thing", 1)


def test_other_kind_is_refused():
    with pytest.raises(FormatError, match="holds a 'plan'"):
        serialization.loads(serialization.dumps("plan", 1, {}), "profile", 1)


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    serialization.atomic_write_bytes(tmp_path / "f", b"abc")
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
