"""bench/gpu_check.sh, the one command a lent GPU machine runs: checks that need no GPU and take no
time (its --dry-run, a minute of CPU, is the full check without one)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from bench.gpu import CASES

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"


def _bash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=30, cwd=SCRIPT.parents[1])


def test_gpu_check_is_valid_bash():
    done = _bash("-n", str(SCRIPT))
    assert done.returncode == 0, done.stderr


def test_gpu_check_help_says_how_to_run_it_on_the_machine_and_without_a_gpu():
    done = _bash(str(SCRIPT), "--help")
    assert done.returncode == 0, done.stderr
    assert "bash bench/gpu_check.sh\n" in done.stdout and "bash bench/gpu_check.sh --dry-run" in done.stdout


def test_gpu_check_refuses_an_unknown_argument_naming_the_ones_it_takes():
    done = _bash(str(SCRIPT), "--quick")
    assert done.returncode == 2
    assert "--quick" in done.stderr and "--dry-run" in done.stderr


def test_gpu_check_benchmarks_a_case_bench_gpu_has():
    default = re.search(r"GPU_CHECK_CASE:-([\w-]+)\}", SCRIPT.read_text())
    assert default and default.group(1) in CASES
