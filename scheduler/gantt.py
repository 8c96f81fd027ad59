"""A Gantt picture of a simulated iteration, like the paper's Fig. 5: one row per device stream.

matplotlib is an optional dependency (``pip install harmony-train[plots]``); the trace.json of a
plan shows the same timeline interactively in Perfetto without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from harmony.errors import HarmonyError
from harmony.scheduler.estimator import STREAMS, StreamEvent

COLORS = {"FWD": "#4c72b0", "BWD": "#dd8452", "UPD": "#55a868"}
TRANSFER_COLOR = "#9e9e9e"


def write_gantt(path: str | Path, events: Iterable[StreamEvent], title: str = "") -> None:
    """Draw ``events`` (an estimate's stream events) to a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise HarmonyError("a Gantt picture needs matplotlib: pip install matplotlib (or use trace.json in Perfetto)") from exc
    events = list(events)
    rows = sorted({(e.device, e.stream) for e in events}, key=lambda r: (r[0] < 0, r[0], _stream_order(r[1])))
    index = {row: i for i, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.2))
    for e in events:
        kind = e.label.split()[0] if e.stream == "compute" and e.label else ""
        color = next((c for k, c in COLORS.items() if kind.startswith(k)), TRANSFER_COLOR)
        ax.barh(index[(e.device, e.stream)], e.end - e.start, left=e.start, height=0.8, color=color, edgecolor="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{'host' if d < 0 else f'dev{d}'} {s}" for d, s in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*COLORS.values(), TRANSFER_COLOR)]
    ax.legend(handles, [*COLORS, "transfer"], loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _stream_order(stream: str) -> int:
    return STREAMS.index(stream) if stream in STREAMS else len(STREAMS)
