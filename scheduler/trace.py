"""Chrome trace export of a simulated (or measured) timeline: one track per device stream.

The format is the Trace Event Format that chrome://tracing and Perfetto open: complete events
("ph": "X") with microsecond timestamps, one process per device and one thread per stream, and
metadata events naming them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol

from harmony.scheduler.tasks import HOST

STREAMS = ("compute", "swap-in", "swap-out", "p2p-in", "p2p-out")


class Event(Protocol):
    device: int
    stream: str
    task: int
    label: str
    start: float
    end: float


def chrome_trace(events: Iterable[Event], title: str = "harmony") -> dict:
    """The trace as a JSON-ready dict."""
    out: list[dict] = []
    seen_devices: set[int] = set()
    seen_streams: set[tuple[int, str]] = set()
    for e in events:
        pid = _pid(e.device)
        if e.device not in seen_devices:
            seen_devices.add(e.device)
            name = "host" if e.device == HOST else f"device {e.device}"
            out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        tid = _tid(e.stream)
        if (e.device, e.stream) not in seen_streams:
            seen_streams.add((e.device, e.stream))
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": e.stream}})
        out.append({
            "ph": "X", "name": e.label, "cat": e.stream, "pid": pid, "tid": tid,
            "ts": e.start * 1e6, "dur": max(0.0, e.end - e.start) * 1e6, "args": {"task": e.task},
        })
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"title": title}}


def write_chrome_trace(path: str | Path, events: Iterable[Event], title: str = "harmony") -> None:
    Path(path).write_text(json.dumps(chrome_trace(events, title)))


def _pid(device: int) -> int:
    return 0 if device == HOST else device + 1


def _tid(stream: str) -> int:
    return STREAMS.index(stream) if stream in STREAMS else len(STREAMS) + sum(map(ord, stream)) % 50
