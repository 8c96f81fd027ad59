"""The offloading-bound benchmark's instances and tables, on chains that solve in a fraction of a second."""

from __future__ import annotations

import dataclasses

import pytest

from bench import offload_bound as bench
from harmony.profiling.profiles import LayerProfile, LayerSample, Profile
from harmony.scheduler.machine import Machine
from harmony.scheduler.offload_bound import iteration_bound
from harmony.scheduler.search import search


def synthetic_profile(layers: int = 6, w: int = 10**6) -> Profile:
    """Identical layers of ``w`` bytes of weights, 10 us of forward a sample, small activations."""
    def sample(u: int) -> LayerSample:
        x = 10**4 * u
        return LayerSample(u=u, fwd_time=1e-5 * u, bwd_time=2e-5 * u, recompute_time=1e-5 * u,
                           fwd_peak=w + 3 * x, bwd_peak=2 * w + 6 * x, x_bytes=x, y_bytes=x, dx_bytes=x,
                           act_bytes=2 * x)
    return Profile(source="analytic", device="synthetic", capacity=10**9, u_fmax=16, u_bmax=16,
                   layers=[LayerProfile(index=i, name=f"block{i}", w_bytes=w, dw_bytes=w, k_bytes=0, b_bytes=0,
                                        upd_time_device=1e-6, upd_time_host=1e-5,
                                        fwd_samples=[sample(1), sample(16)], bwd_samples=[sample(1), sample(16)])
                           for i in range(layers)])


def test_the_shallowest_gpt2_row_of_table_1_meets_the_papers_ilp():
    row = bench.PAPER_TABLE[8]  # GPT-2, 38 layers, batch 16: Σu = ILP = 5794 ms
    chain = bench.paper_chain(row)
    assert chain.layers == 38 and chain.compute == pytest.approx(5.794)
    assert sum(chain.weights) > chain.capacity  # the weights must move
    solution = iteration_bound(chain, tidy=False)
    assert solution.status == "optimal"
    assert solution.bound == pytest.approx(row[4] / 1000, rel=1e-6)
    cells = bench.paper_cells(bench.PaperRow(*row[:6], bound=solution))
    assert len(cells) == len(bench.PAPER_COLUMNS) and cells[6] == "5794" and cells[7] == "0"


def test_a_plan_is_never_faster_than_the_bound_and_its_row_and_report_say_so():
    profile = synthetic_profile()
    machine = dataclasses.replace(Machine.from_spec("1080ti", 1), latency=0.0)
    case = bench.Case("synthetic", "", {}, 8, "1080ti")
    row = bench.HarmonyRow(case, device_memory=5 * 10**6, planned=4 * 10**6)  # four of the six layers' weights
    result = search(profile, machine, "pp", 1, case.minibatch, capacity=row.planned)
    bench.bounded(row, result, profile, machine, time_limit=5.0)
    assert row.bound.status == "optimal" and row.link.bound > 0
    assert row.bound.bound <= row.harmony_s * (1 + 1e-9)
    assert row.link.bound <= row.harmony_link_s * (1 + 1e-9)
    cells = bench.harmony_cells(row)
    assert len(cells) == len(bench.HARMONY_COLUMNS)
    assert cells[bench.HARMONY_COLUMNS.index("Harmony/bound")] == f"{row.harmony_s / row.bound.bound:.2f}"
    text = bench.report([], [], [row], "python -m bench.offload_bound")
    assert "| case | spec |" in text and "`python -m bench.offload_bound`" in text
    assert ("above 1.2x the bound" in text) == (row.ratio > bench.FLAG)
    assert "on the device throughout" in bench.optimum_text(row)
