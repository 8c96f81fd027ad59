"""The compile-time benchmark: a fresh process's compile, timed, broken down by the compile's own
stages, written as a dated table with its command."""

from __future__ import annotations

from bench import compile_time


def test_one_run_of_a_tiny_compile_writes_the_total_and_every_stage(tmp_path):
    out = tmp_path / "compile_time.md"
    compile_time.main(["--runs", "1", "--preset", "tiny", "--devices", "2", "--minibatch", "8", "--no-compare",
                       "--out", str(out)])
    text = out.read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| stage")}
    for stage in ("total (wall)", "CPU (all processes)", "imports"):
        assert float(rows[stage][0]) > 0, stage
    for stage in ("model build", "decompose", "profile", "search pp", "write plan"):
        assert float(rows[stage][0]) >= 0, stage
    assert float(rows["imports"][0]) < float(rows["total (wall)"][0])
    assert not any(name.endswith("(worker)") for name in rows)  # --no-compare: no other mode searched
    assert "`python -m bench.compile_time --runs 1 --preset tiny" in text and "Measured 20" in text
