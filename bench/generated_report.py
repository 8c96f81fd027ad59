"""The long run of the generated-model test, summarised: how many cases and runs it tried, how many
compiles were refused, and the planned/measured peak ratios per device (the largest, the smallest,
and the runs whose measured peak passed the plan).

    HARMONY_GENERATED_CASES=200 HARMONY_GENERATED_REPORT=gen.jsonl python -m pytest tests/runtime/test_generated_models.py
    python -m bench.generated_report gen.jsonl
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table


def summarise(path: str) -> dict:
    runs, refused, cases = [], 0, set()
    with open(path) as f:
        for line in f:
            entry = json.loads(line)
            cases.add(entry["case"])
            if "refused" in entry:
                refused += 1
                continue
            for device, measured in entry["measured"].items():
                if measured:
                    runs.append((entry["planned"][device] / measured, entry["run"], device))
    runs.sort()
    return {"cases": len(cases), "runs": len({r[1] for r in runs}), "refused": refused,
            "smallest": runs[0] if runs else None, "largest": runs[-1] if runs else None,
            "over": [r for r in runs if r[0] < 1]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="the JSON lines HARMONY_GENERATED_REPORT wrote")
    s = summarise(parser.parse_args(argv).report)
    table = Table(title="generated models: planned / measured peak per device")
    table.add_column("figure")
    table.add_column("value")
    table.add_row("cases", str(s["cases"]))
    table.add_row("training runs", str(s["runs"]))
    table.add_row("refused compiles or modes", str(s["refused"]))
    for key in ("smallest", "largest"):
        if s[key]:
            ratio, run, device = s[key]
            table.add_row(f"{key} ratio", f"{ratio:.3f} (dev{device}: {run})")
    table.add_row("device peaks above the plan", str(len(s["over"])))
    Console().print(table)
    for ratio, run, device in s["over"]:
        Console().print(f"  {ratio:.3f} dev{device}: {run}")


if __name__ == "__main__":
    main()
