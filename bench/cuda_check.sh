#!/usr/bin/env bash
# The checks to run on a lent GPU machine (.library/device): install the package against the
# machine's own torch (no network there), run the CUDA tests, train from the CLI on the GPU (its own
# and with workers sharing it), then the CPU suite under that torch as long as time allows. Full
# logs go to $OUT (./out when run elsewhere). Usage:
# bash bench/cuda_check.sh [quick|tests|estimate|gpu ARGS]
# (quick: no CPU suite; tests: no CLI runs; estimate: only `bench.estimate_accuracy --full` on the
# machine's CPUs with the GPU hidden and nothing else running, about 3 minutes: the estimator's
# accuracy on a machine without a shared VM's interpreter spells; gpu: only `python -m bench.gpu
# ARGS`, e.g. `gpu --cases gpt2-large --systems eager,harmony`, one case per call of a machine whose
# commands end in ten minutes, with DeepSpeed installed from the wheels in .whl/
# (bench/gpu_wheels.sh) when they travelled; its results folder, bench/results/gpu-<device>, is copied to $OUT)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
log() { echo "=== $* ($(date +%T))"; }
log env
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count(), 'GPU(s)')"
log install
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
if [ "${1:-}" = estimate ]; then
  log "bench.estimate_accuracy --full on $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg)"
  CUDA_VISIBLE_DEVICES= COLUMNS=200 python3 -m bench.estimate_accuracy --full --iterations 11 \
    --json "$OUT/estimate_accuracy.json" >"$OUT/estimate_accuracy.log" 2>&1
  grep -a -E "mean absolute|rel. error|^Traceback|Error" "$OUT/estimate_accuracy.log" | cut -c1-400
  exit 0
fi
if [ "${1:-}" = gpu ]; then
  shift
  if [ -d .whl ]; then
    log install carried wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site || exit 1
  fi
  log "bench.gpu $*"
  python3 -m bench.gpu "$@" 2>&1 | tee "$OUT/gpu.log"
  cp -r bench/results/gpu-* "$OUT"/ 2>/dev/null
  exit 0
fi
log cuda tests
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider --log-level=INFO tests/runtime/test_cuda_training.py \
  tests/runtime/test_device.py 2>&1 | tee "$OUT/cuda_tests.log" | grep -v "^  " | tail -30
grep -h "BLAS libraries keep" "$OUT/cuda_tests.log" | sort | uniq -c | head -5
run() {  # name, timeout, harmony run arguments (the whole log, with a traceback on error, in $OUT)
  local name=$1 limit=$2; shift 2
  log "harmony run $*"
  HARMONY_SHARE_GPUS=1 timeout "$limit" harmony "${V:--v}" run models/gpt2.py --iters 6 --report "$OUT/run-$name.json" \
    "$@" >"$OUT/run-$name.log" 2>&1
  grep -v "^\s*$" "$OUT/run-$name.log" | grep -v -E "^(INFO|DEBUG)" | tail -14
}
if [ "${1:-}" != tests ]; then
run tiny 120 --arg preset=tiny --minibatch 16
run tiny-shared-pp 120 --arg preset=tiny --minibatch 16 --devices 2 --mode pp
V=-vv run medium-6g 420 --arg preset=medium --minibatch 16 --device-memory 6GiB  # the longest: minutes, verbose
fi
[ "${1:-}" = quick ] && exit 0
log cpu suite under this torch
# SIGINT, not TERM, at the limit: pytest then still prints what failed so far
timeout -s INT ${SUITE_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -n 14 --timeout 200 --tb=short -rfE \
  tests >"$OUT/suite.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | cut -c1-220 | tail -40
