"""The host-step benchmark: one small pass writes every row, each stepping like torch's AdamW, and
the line comparing Harmony's step with torch's default. DeepSpeed is left out: the suite must not
build its op (minutes) nor need it installed."""

from __future__ import annotations

from bench import host_step


def test_one_small_pass_writes_every_row_and_the_ratio(tmp_path, monkeypatch):
    monkeypatch.setattr(host_step, "deepspeed_row",
                        lambda weights, grads: host_step.Row("deepspeed CPUAdam", None, [], "not available: left out"))
    out = tmp_path / "host_step.md"
    host_step.main(["--width", "8", "--rounds", "1", "--out", str(out)])
    text = out.read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| implementation")}
    assert set(rows) == {"harmony host step", "torch default", "torch foreach", "torch fused", "deepspeed CPUAdam"}
    for name in ("harmony host step", "torch foreach", "torch fused"):
        assert float(rows[name][1]) > 0 and float(rows[name][4]) < 1e-5, name  # steps, and as AdamW does
    assert "not available" in rows["deepspeed CPUAdam"][-1]
    assert text.rstrip().splitlines()[-1].startswith("harmony/torch-default = ")
    assert "`python -m bench.host_step --width 8 --rounds 1 --out " in text
