"""The DeepSpeed peer's parts that need neither DeepSpeed nor a GPU: the ZeRO-3 offload config it
hands DeepSpeed, and the command refusing clearly (status 2) where it cannot run.

CI installs no DeepSpeed and has no GPU; the training loop itself is checked on a GPU machine with
the wheels of ``bench/gpu_wheels.sh``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import deepspeed_peer
from bench.deepspeed_peer import EXIT_MISSING, MissingRequirement, missing_requirements, zero_offload_config

ROOT = Path(__file__).resolve().parents[2]


def test_bf16_config_is_zero3_with_params_and_optimizer_pinned_on_the_host():
    config = zero_offload_config(micro_batch=4, grad_accum=4, precision="bf16")
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 4
    assert config["bf16"] == {"enabled": True}
    assert config["fp16"]["enabled"] is False
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert config["gradient_clipping"] == 0.0  # no clipping, as the Harmony runs
    json.dumps(config)  # DeepSpeed takes it as JSON too


def test_fp32_config_enables_no_reduced_precision():
    config = zero_offload_config(micro_batch=2, grad_accum=8, precision="fp32")
    assert config["bf16"]["enabled"] is False and config["fp16"]["enabled"] is False
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 8
    assert config["zero_optimization"]["stage"] == 3


def test_optimizer_is_plain_adam_and_deepspeed_cpu_adam_by_default():
    config = zero_offload_config(4, 1, "bf16", lr=3e-4)
    assert config["optimizer"]["type"] == "Adam"
    params = config["optimizer"]["params"]
    assert params["lr"] == 3e-4 and params["betas"] == [0.9, 0.999] and params["eps"] == 1e-8
    assert params["weight_decay"] == 0.0 and params["adam_w_mode"] is False
    assert "torch_adam" not in params
    assert config["zero_force_ds_cpu_optimizer"] is True


def test_cpu_adam_false_makes_deepspeed_use_torch_adam():
    config = zero_offload_config(4, 2, "fp32", cpu_adam=False)
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert config["zero_force_ds_cpu_optimizer"] is False


def test_buckets_fit_a_few_gib_cap():
    """Gradient buckets (two in flight), prefetch and live parameters in fp32 stay under 1.5 GiB,
    a quarter of the 6 GiB cap the benchmark uses; DeepSpeed's defaults would need over 10 GiB."""
    zero = zero_offload_config(4, 4, "fp32")["zero_optimization"]
    fp32 = 4
    held = (2 * zero["reduce_bucket_size"] + zero["stage3_prefetch_bucket_size"]
            + zero["stage3_max_live_parameters"]) * fp32
    assert held <= 1.5 * 2**30
    assert zero["stage3_param_persistence_threshold"] <= 10**6


def test_fp16_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="fp16.*not supported.*'bf16' or 'fp32'"):
        zero_offload_config(4, 4, "fp16")
    with pytest.raises(ValueError, match="precision must be 'bf16' or 'fp32'"):
        zero_offload_config(4, 4, "int8")
    with pytest.raises(ValueError, match="at least 1"):
        zero_offload_config(0, 4, "bf16")


def test_missing_requirements_names_each_missing_piece(monkeypatch):
    monkeypatch.setattr(deepspeed_peer.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    missing = missing_requirements("cuda")
    assert len(missing) == 2
    assert "DeepSpeed is not installed" in missing[0] and "bench/gpu_wheels.sh" in missing[0]
    assert deepspeed_peer.INSTALL_LINE in missing[0]
    assert "no CUDA GPU" in missing[1]
    assert missing_requirements("cpu") == missing[:1]  # the CPU check needs no GPU
    monkeypatch.setattr(deepspeed_peer.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert missing_requirements("cuda") == []


def test_run_refuses_before_touching_anything_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MissingRequirement, match="no CUDA GPU"):
        deepspeed_peer.run("models/gpt2.py", {"preset": "tiny"}, 8, 2, 2**30, 2, "bf16")
    with pytest.raises(ValueError, match="multiple of microbatch"):
        deepspeed_peer.run("models/gpt2.py", {"preset": "tiny"}, 8, 3, 2**30, 2, "bf16")


def test_batches_are_cut_into_micro_steps_along_the_first_dimension():
    x, y = torch.arange(16).view(8, 2), torch.arange(8)
    pieces = deepspeed_peer._split((x, {"mask": y}), 4)
    assert len(pieces) == 4
    assert torch.equal(pieces[1][0], x[2:4]) and torch.equal(pieces[3][1]["mask"], y[6:8])
    moved = deepspeed_peer._to((x.float(), y), torch.device("cpu"), torch.bfloat16)
    assert moved[0].dtype == torch.bfloat16 and moved[1].dtype == torch.int64  # only floats are cast


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.deepspeed_peer", *args], cwd=ROOT, capture_output=True,
                          check=False, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.skipif(not missing_requirements("cuda"), reason="this machine has a GPU and DeepSpeed: it would train")
def test_cli_exits_2_with_one_clear_line_without_cuda_or_deepspeed():
    done = _cli("--model", "models/gpt2.py", "--arg", "preset=tiny", "--minibatch", "8", "--microbatch", "2",
                "--device-memory", "1GiB", "--iters", "2", "--precision", "bf16")
    assert done.returncode == EXIT_MISSING, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("deepspeed_peer: cannot run: ")
    assert "no CUDA GPU" in lines[0] or "DeepSpeed is not installed" in lines[0]
    if "DeepSpeed is not installed" in lines[0]:
        assert "bash bench/gpu_wheels.sh" in lines[0] and "--no-index" in lines[0]
    assert done.stdout == ""


@pytest.mark.slow
def test_cli_help_and_usage_errors():
    done = _cli("--help")
    assert done.returncode == 0 and "--device-memory" in done.stdout and "gpu_wheels.sh" in done.stdout
    done = _cli("--model", "models/gpt2.py", "--minibatch", "10", "--microbatch", "4")
    assert done.returncode == 2 and "multiple of --microbatch" in done.stderr
    done = _cli("--model", "models/gpt2.py", "--device-memory", "lots")
    assert done.returncode == 2 and "--device-memory" in done.stderr
