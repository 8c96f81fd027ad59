"""The kept-order benchmark: one small pass writes its three orders, each against the profile's."""

from __future__ import annotations

from bench import kept_order


def test_one_small_pass_writes_the_three_orders_against_the_profiles(tmp_path):
    out = tmp_path / "kept_order.md"
    kept_order.main(["--blocks", "1", "--microbatches", "2", "--u", "1", "--rounds", "1", "--out", str(out)])
    text = out.read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| order")}
    assert set(rows) == {"forward without autograd", "forward and backward per microbatch",
                         "all forwards, then all backwards (kept)"}
    assert float(rows["forward and backward per microbatch"][2].strip(" |")) == 1.0
    assert all(float(r[1]) > 0 for r in rows.values())
    assert "`python -m bench.kept_order --blocks 1 --microbatches 2" in text
