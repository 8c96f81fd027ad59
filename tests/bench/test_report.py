"""The benchmark suite's pure parts: configuration sampling and the results folder's writer.

These do not measure anything (benchmarks are not tests); they check that what a run returns is
written out with its goals and that every plot the README links exists.
"""

from __future__ import annotations

import json
import re

from bench.accuracy import spread, summary
from bench.report import write

MACHINE = {"cpu": "test CPU", "cores": 2, "ram_bytes": 2**30, "python": "3", "torch": "2", "platform": "linux",
           "date": "today", "load_average": 0.0}


def _results() -> dict:
    est = [{"model": "GPT-2 1.5B", "mode": m, "minibatch": 64, "devices": 4, "iteration_seconds": 1.0,
            "samples_per_second": s, "normalized": s / 10, "swap_bytes": b, "configuration": "c"}
           for m, s, b in (("pp", 30.0, 10**9), ("dp-swap", 10.0, 2 * 10**11))]
    acc = [{"model": "gpt2-tiny", "mode": "pp", "configuration": "c", "estimated_seconds": 0.1,
            "measured_seconds": 0.1, "relative_error": 0.0}]
    return {"machine": MACHINE, "quick": True, "failures": {"peers": "RuntimeError: boom"}, "seconds": {},
            "wall_seconds": 1.0,
            "overhead": {"model": "m", "minibatch": 16, "steps": 4, "configuration": "c", "harmony_seconds": 1.0,
                         "eager_seconds": 0.95, "harmony_samples_per_second": 16.0, "eager_samples_per_second": 16.8,
                         "throughput_ratio": 0.95, "overhead": 0.05},
            "throughput": {"estimated": est, "measured": []},
            "accuracy": {"rows": acc, "summary": summary(acc)}}


def test_spread_takes_both_ends_and_evenly_between():
    assert spread(list(range(10)), 3) == [0, 4, 9]
    assert spread([1, 2], 5) == [1, 2]
    assert spread([7, 8, 9], 1) == [7]


def test_results_readme_states_goals_and_links_only_plots_that_exist(tmp_path):
    readme = write(_results(), tmp_path, quick=True)
    text = readme.read_text()
    assert "test CPU" in text and "at least 0.95 of eager on every model — **met** (worst 0.950)" in text
    assert "≥ 100x below dp-swap's at minibatch ≥ 64 — **met**" in text
    assert "error ≤ 5% — **met**" in text
    assert "peers: RuntimeError: boom" in text
    links = set(re.findall(r"\]\(([\w.]+\.png)\)", text))
    assert links and all((tmp_path / name).is_file() for name in links)
    assert json.loads((tmp_path / "results.json").read_text())["overhead"]["throughput_ratio"] == 0.95


def test_the_precision_and_clipping_sections_show_each_row_and_the_speedup(tmp_path):
    from bench.report import precision_speedups

    precision = {"estimated": [{"model": "M", "precision": p, "iteration_s": t, "samples_per_s": 16 / t,
                                "swap_bytes": 2 * 10**9, "updates": "host", "config": "c"}
                               for p, t in (("fp32", 4.0), ("bf16", 1.0))],
                 "counted": [{"model": "T", "precision": "bf16", "planned": 1000, "planned_w": 400, "counted": 1000,
                              "updates": "device", "config": "c"}]}
    clipping = {"estimated": [{"model": "M", "mode": "pp", "unclipped_s": 1.0, "clipped_s": 1.01, "norm_s": 0.002,
                               "speculation_bound_s": 1.002}],
                "measured": [{"mode": "pp", "unclipped_s": 0.01, "clipped_s": 0.011}]}
    assert precision_speedups(precision["estimated"]) == {"M": 4.0}
    results = {"machine": MACHINE, "quick": True, "failures": {}, "seconds": {}, "wall_seconds": 1.0,
               "precision": precision, "clipping": clipping}
    text = write(results, tmp_path, quick=True).read_text()
    assert "| M | bf16 | 1.00 | 16.00 | 2.0 | host | c |" in text
    assert "| T | bf16 | 1,000 | 400 | 1,000 | device | c |" in text
    assert "| M | pp | 1.00 | 1.01 | 1.010 | 2.0 | 1.00 |" in text and "| pp | 10.0 | 11.0 | 1.100 |" in text
