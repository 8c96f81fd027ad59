"""The hardware bound (bench/bound.py) and the GPU benchmark's report (bench/gpu.py), on the CPU.

The measurements themselves need a GPU; what these check is the arithmetic the report rests on:
the FLOPs counted for a model file, which part limits the bound, the floor traffic, the copies
read from a profiler trace, and that a results file becomes the README's table.
"""

from __future__ import annotations

import textwrap

import pytest

from bench import bound as bounds
from bench import gpu
from harmony.modelfile import load_model_file

TWO_LINEARS = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))

def loss_fn(output, target):
    return (output - target).pow(2).mean()

def get_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 4, generator=g)
"""

HARDWARE = bounds.Hardware(name="gpu", dtype="bfloat16", peak_flops=1e12, host_to_device=1e9,
                           device_to_host=1e9, duplex=1.5e9, source="test")


@pytest.fixture
def two_linears(tmp_path):
    path = tmp_path / "two.py"
    path.write_text(textwrap.dedent(TWO_LINEARS))
    return load_model_file(path)


def test_training_flops_are_forward_and_backward_matmuls_counted_on_meta(two_linears):
    flops, params, trainable = bounds.training_flops(two_linears, minibatch=5)
    # first layer: forward and the weight's gradient (its input needs none); second: forward,
    # the weight's gradient and the input's gradient. Each matmul is 2 * m * n * k.
    first, second = 2 * 5 * 8 * 16, 2 * 5 * 16 * 4
    assert flops == 2 * first + 3 * second
    assert params == trainable == 8 * 16 + 16 * 4


def test_bound_is_limited_by_compute_or_by_the_link():
    compute = bounds.bound(flops=2e12, bytes_in=10**8, bytes_out=10**8, hardware=HARDWARE)
    assert compute.limit == "compute" and compute.seconds == pytest.approx(2.0)
    assert compute.fraction(4.0) == pytest.approx(0.5)
    link = bounds.bound(flops=1e9, bytes_in=10**9, bytes_out=10**9, hardware=HARDWARE)
    # each direction alone takes 1 s; both at once share 1.5 GB/s: 2 GB take 1.33 s
    assert link.limit == "transfer" and link.seconds == pytest.approx(2 / 1.5)


def test_floor_traffic_is_every_trainable_weight_in_and_its_gradient_out_at_compute_precision():
    assert bounds.floor_traffic(1000, "bf16") == (2000, 2000)
    assert bounds.floor_traffic(1000, "fp32") == (4000, 4000)


def test_spec_hardware_takes_the_dtypes_dense_peak_and_the_pcie_rates():
    h100 = bounds.spec_hardware("h100", "bf16")
    assert h100.peak_flops == pytest.approx(989.4e12)
    assert h100.host_to_device == h100.device_to_host == 50e9
    assert h100.source == "spec h100"


def test_copies_are_read_from_a_profiler_trace_by_direction_and_pinning():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "args": {"bytes": 100}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "args": {"bytes": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "args": {"bytes": 50}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "args": {"bytes": 999}},
        {"ph": "X", "cat": "kernel", "name": "gemm HtoD lookalike", "args": {"bytes": 1}},
    ]}
    assert bounds.copy_bytes_in_trace(trace) == {"HtoD": 107, "DtoH": 50, "HtoD pageable": 7, "DtoH pageable": 0}


def _results() -> gpu.Results:
    case = {"flops": 3e12, "params": 10**8, "trainable": 10**8, "minibatch": 16, "footprint": 40 * 2**30,
            "cap": 10 * 2**30, "systems": {
                "eager": {"samples_per_s": 16.0, "bytes_in": 0, "bytes_out": 0, "command": "python -m bench.gpu"},
                "harmony": {"samples_per_s": 4.0, "bytes_in": 2 * 10**9, "bytes_out": 10**9, "estimated_s": 4.4,
                            "command": "harmony run models/gpt2.py"},
                "deepspeed": {"samples_per_s": 2.0, "command": "python -m bench.deepspeed_peer"},
            }}
    return gpu.Results(hardware=vars(HARDWARE), machine={"python": "3.12", "torch": "2.11", "cores": 16, "date": "d"},
                       cases={"gpt2-large": case}, commands=["python -m bench.gpu"])


def test_report_rows_give_rate_tflops_both_bounds_and_the_ratio_to_deepspeed():
    results = _results()
    harmony = gpu.figures(results.cases["gpt2-large"], "harmony", HARDWARE, "bf16")
    assert harmony["tflops"] == pytest.approx(3e12 / 4.0 / 1e12)
    # compute 3 s; its own traffic: 2 GB in at 1 GB/s, 3 GB both ways at 1.5 GB/s: 2 s. A 4 s iteration.
    assert harmony["bound_own"] == pytest.approx(3.0 / 4.0) and harmony["limit"] == "compute"
    # the floor: 0.2 GB each way, far below the compute
    assert harmony["bound_floor"] == pytest.approx(3.0 / 4.0)
    assert harmony["estimate_error"] == pytest.approx(4.4 / 4.0 - 1)
    deepspeed = gpu.figures(results.cases["gpt2-large"], "deepspeed", HARDWARE, "bf16")
    assert deepspeed["bytes_moved"] is None and deepspeed["bound_own"] is None
    text = gpu.report(results, "bf16")
    assert "| harmony | 4.00 | 0.8 | 3.00 GB | 0.75 | 0.75 | 0.25 | 2.00x | +10.0% |" in text
    assert "| deepspeed | 2.00 | 0.4 | not counted | - |" in text
    assert "- harmony: `harmony run models/gpt2.py`" in text


def test_a_system_that_failed_is_reported_with_its_error():
    results = _results()
    results.cases["gpt2-large"]["systems"]["deepspeed"] = {"error": "exit 2: deepspeed is not installed"}
    assert "| deepspeed | exit 2: deepspeed is not installed |" in gpu.report(results, "bf16")


def test_eager_splits_a_minibatch_that_does_not_fit_into_equal_microbatches():
    assert gpu._next_divisor(16, 16) == 8
    assert gpu._next_divisor(12, 12) == 6
    assert gpu._next_divisor(12, 6) == 4


def test_without_a_gpu_the_benchmark_says_so_and_points_to_the_dry_run():
    if gpu.torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit, match="--dry-run"):
        gpu.main([])


def test_dry_run_estimates_a_tiny_model_against_the_modelled_bound():
    case = gpu.Case("gpt2-tiny", "models/gpt2.py", {"preset": "tiny"}, minibatch=8)
    (row,) = gpu.dry_run([case], "bf16", "h100")
    assert row["cap"] == row["footprint"] // 4 > 0
    assert row["estimated_s"] > 0 and 0 < row["bound_floor"] and row["bound_s"] >= row["floor_s"] > 0
    assert row["bound_own"] == pytest.approx(row["bound_s"] / row["estimated_s"])
    # eager's estimate is the per-operation roofline: never faster than the FLOPs at peak
    assert row["flops"] / bounds.spec_hardware("h100", "bf16").peak_flops <= row["eager_s"]
    assert "| gpt2-tiny |" in gpu.dry_run_report([row], bounds.spec_hardware("h100", "bf16"), "cmd")
    # no resource is busier than the iteration it is part of, and the busiest one is named
    busy = row["busy"]
    assert 0 <= busy["recompute"] <= busy["compute"] <= row["estimated_s"] * (1 + 1e-9)
    assert max(busy["host link"], busy["host step"]) <= row["estimated_s"] * (1 + 1e-9)
    assert busy["device waits"] == pytest.approx(row["estimated_s"] - busy["compute"]) and busy["device waits"] >= 0
    assert row["binds"] == gpu.binding_resource(busy)


def test_the_binding_resource_is_the_busiest_and_recompute_where_compute_is_only_through_it():
    assert gpu.binding_resource({"compute": 3.0, "recompute": 0.5, "host link": 2.0, "host step": 1.0}) == "compute"
    assert gpu.binding_resource({"compute": 3.0, "recompute": 1.5, "host link": 2.0, "host step": 1.0}) == "recompute"
    assert gpu.binding_resource({"compute": 1.0, "recompute": 0.5, "host link": 2.0, "host step": 1.0}) == "host link"
    assert gpu.binding_resource({"compute": 1.0, "recompute": 0.0, "host link": 0.5, "host step": 1.5}) == "host step"
