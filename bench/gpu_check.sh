#!/usr/bin/env bash
# The check of a lent GPU machine, as one command that ends within its ten-minute limit: four
# steps, each under a `timeout` cut from one time budget, each printing one line; then a summary of
# what passed and failed with each step's seconds. A step's failure is recorded and the later steps
# run anyway; the exit status is 1 when any step failed.
#
# The device tool brings back at most 8 files from $OUT (./out unless set), so the whole logs,
# reports and bench.gpu's own files are kept in a folder under /tmp and packed, after every step,
# into $OUT/gpu_check-logs.tar.gz (plans' binary files left out); beside it $OUT/summary.txt and, after
# step 4, the results folder (README.md and results.json).
#
#   1 env       nvidia-smi, torch and its GPUs; the package installed against the machine's own torch
#               without network; DeepSpeed from the wheels in .whl/ (bench/gpu_wheels.sh) when they
#               travelled, its CPU Adam op built in the background for step 4
#   2 tests     tests/runtime/test_cuda_training.py and tests/runtime/test_device.py
#   3 medium    GPT-2 medium at 6 GiB compiled and trained from the CLI (harmony -vv, a few iterations)
#   4 bench     python -m bench.gpu: eager, Harmony (capped at a quarter of eager's measured training
#               footprint) and DeepSpeed ZeRO-Offload on one model in bf16; the results folder
#               bench/results/gpu-<device> is copied to $OUT
#
# On the GPU machine, in the repository root, with .whl carried (device tool: carry [".whl"]):
#
#   bash bench/gpu_check.sh
#
# Here, without a GPU (CI-like, a few minutes on two cores): every step against modelled hardware:
# the install resolved with pip's --dry-run and the DeepSpeed peer's config built instead of
# installed, the CUDA tests collected (they skip), GPT-2 medium at 6 GiB compiled against an
# analytic H100 and GPT-2 tiny trained on two emulated CPU devices, and bench.gpu --dry-run of the
# same case into $OUT/gpu-dry-run (OUT defaults to ./out/dry-run):
#
#   bash bench/gpu_check.sh --dry-run
#
#   bash bench/gpu_check.sh --estimate   # step 1, then only `bench.estimate_accuracy --full` on the
#                                        # machine's CPUs with the GPU hidden (about three minutes)
#
# Settings (environment): PYTHON (python3; for --dry-run .venv/bin/python where it exists),
# GPU_CHECK_BUDGET (seconds for all steps: 540, leaving a minute of the machine's 600 s limit),
# GPU_CHECK_CASE (bench.gpu's case for step 4), GPU_CHECK_SPEC (the analytic spec of --dry-run, h100).
#
# Step 4's case is gpt2-medium (355 M parameters), not bench.gpu's default gpt2-large (774 M). Step 4
# gets what steps 1-3 leave of the budget, and they may take up to six minutes of it (step 3 alone
# three: its compile profiles every layer on the GPU before training). Each of step 4's three runs
# begins with work that grows with the model (eager builds and trains it whole, Harmony profiles it
# layer by layer, DeepSpeed partitions it and pins its state on the host), Harmony's a compile of
# step 3's size for gpt2-medium and of twice its parameters for gpt2-large: three of gpt2-large's do
# not fit what is left with a margin. `python -m bench.gpu --cases gpt2-large` (after step 1's
# installs) runs the large one in a command of its own.
set -u
export PYTHONUNBUFFERED=1

MODE=gpu
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --estimate) MODE=estimate ;;
  -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "gpu_check.sh: unknown argument '$1': give none (on the GPU machine), --dry-run or --estimate" >&2; exit 2 ;;
esac

if [ "$MODE" = dry ]; then
  OUT=${OUT:-out/dry-run}
  DEFAULT_PY=python3; [ -x .venv/bin/python ] && DEFAULT_PY=.venv/bin/python
else
  OUT=${OUT:-out}
  DEFAULT_PY=python3
fi
mkdir -p "$OUT"
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
PY=${PYTHON:-$DEFAULT_PY}
BUDGET=${GPU_CHECK_BUDGET:-540}
CASE=${GPU_CHECK_CASE:-gpt2-medium}
SPEC=${GPU_CHECK_SPEC:-h100}
SITE=/tmp/site          # where the carried wheels are installed (PYTHONPATH of DeepSpeed's users only)
BENCH_ITERS=5           # bench.gpu's iterations per system, the first left out
MEDIUM_ITERS=4
PREBUILD_PID=
RUN_NOTE=
STEPS=(); VERDICTS=(); TIMES=(); NOTES=()

log() { echo "=== $* ($(date +%T), ${SECONDS} s)"; }

# limit CAP RESERVE: seconds a step may take: at most CAP, leaving RESERVE of the budget to the
# steps after it (at least 30, so a late step still runs, if briefly)
limit() {
  local left=$((BUDGET - SECONDS - $2))
  [ "$left" -gt "$1" ] && left=$1
  [ "$left" -lt 30 ] && left=30
  echo "$left"
}

# record NAME START STATUS NOTE...: one step's verdict (STATUS 0 passes) and its non-empty notes,
# printed and kept for the summary
record() {
  local name=$1 verdict=PASS seconds=$((SECONDS - $2)) note="" part
  [ "$3" -ne 0 ] && verdict=FAIL
  shift 3
  for part in "$@"; do
    [ -n "$part" ] && note="${note:+$note; }$part"
  done
  STEPS+=("$name"); VERDICTS+=("$verdict"); TIMES+=("$seconds"); NOTES+=("$note")
  echo ">>> [$verdict] $name (${seconds} s): $note"
  summary_lines >"$OUT/summary.txt"
  pack
}

# the summary: one line per step so far
summary_lines() {
  local i
  echo "=== summary: bench/gpu_check.sh ($MODE), $(date -u '+%Y-%m-%d %H:%M UTC'), ${SECONDS} s of a ${BUDGET} s budget;" \
    "logs in $OUT/gpu_check-logs.tar.gz"
  for i in "${!STEPS[@]}"; do
    printf '%-4s %-10s %5s s  %s\n' "${VERDICTS[$i]}" "${STEPS[$i]}" "${TIMES[$i]}" "${NOTES[$i]}"
  done
}

# pack: $LOGS into $OUT/gpu_check-logs.tar.gz, under the device tool's 16 MiB a file: logs over 8 MiB
# (harmony -vv's) cut to their first megabyte and last six, plans' binary files and other files over
# 8 MiB left out
pack() {
  local big
  while IFS= read -r big; do
    { head -c 1000000 "$big"; printf '\n[... cut: its first megabyte and last six ...]\n'; tail -c 6000000 "$big"; } \
      >"$big.cut" && mv "$big.cut" "$big"
  done < <(find "$LOGS" -type f -name '*.log' -size +8M)
  (cd "$LOGS" && find . -type f ! -name '*.log' \( -size +8M -o -name '*.msgpack' \)) >"$LOGS/.left-out"
  # status 1: a file changed as it was read (the background build's log), packed as it was
  tar czf "$OUT/gpu_check-logs.tar.gz.part" -C "$LOGS" -X "$LOGS/.left-out" --exclude=./.left-out \
    --warning=no-file-changed .
  [ $? -le 1 ] && mv "$OUT/gpu_check-logs.tar.gz.part" "$OUT/gpu_check-logs.tar.gz"
}

# timed LIMIT COMMAND...: COMMAND under `timeout`, SIGINT first (pytest and Python then report
# what they were doing and stop their children), SIGKILL 20 s later
timed() {
  local limit=$1; shift
  timeout -s INT -k 20 "$limit" "$@"
}

# why STATUS LIMIT LOG: a failure's cause in one line: the timeout, or the log's last error line
why() {
  if [ "$1" -eq 124 ] || [ "$1" -eq 137 ] || [ "$1" -eq 130 ]; then
    echo "stopped at its ${2} s limit (exit $1; log ${3##*/})"
  else
    local line
    line=$(grep -a -E '^(error|Error|[A-Za-z.]*Error|FAILED|ERROR)' "$3" | tail -1)
    [ -z "$line" ] && line=$(grep -a -v -E '^\s*$' "$3" | tail -1)
    line=${line:-its log is empty}
    echo "exit $1: ${line:0:300} (log ${3##*/})"
  fi
}

# --- step 1: the environment, the package, DeepSpeed -----------------------------------------------

step_env() {
  local start=$SECONDS status=0 notes=() gpus
  log "1 env"
  if [ "$MODE" = dry ]; then
    notes+=("no GPU (dry run)")
  else
    local smi
    smi=$(nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1) || status=1
    echo "$smi"; notes+=("$(echo "$smi" | head -1)")
  fi
  gpus=$("$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.device_count(), 'GPU(s)')" 2>&1) \
    || { status=1; gpus="$PY cannot import torch: $(echo "$gpus" | tail -1)"; }
  echo "$gpus"; notes+=("$gpus")
  if [ "$MODE" != dry ] && ! echo "$gpus" | grep -q -E ' [1-9][0-9]* GPU\(s\)$'; then
    status=1; notes+=("torch sees no GPU")
  fi
  # the machine's own torch, no network: no dependencies, no build isolation, no index
  local dry_flag=(); [ "$MODE" = dry ] && dry_flag=(--dry-run)
  if timed 120 "$PY" -m pip install -q "${dry_flag[@]}" --no-deps --no-build-isolation --no-index -e . \
      >"$LOGS/install.log" 2>&1; then
    if [ "$MODE" = dry ]; then
      notes+=("pip --dry-run: the package's install against this torch without network resolves")
    else
      notes+=("the package installed against this torch without network")
    fi
  else
    status=1; tail -20 "$LOGS/install.log"; notes+=("install failed (install.log)")
  fi
  if [ "$MODE" = gpu ]; then
    install_deepspeed || status=1
  elif [ "$MODE" = dry ]; then
    check_deepspeed_peer || status=1
  fi
  record env "$start" "$status" "${notes[@]}"
}

# DeepSpeed from the carried wheels, into $SITE; its CPU Adam op (a JIT build with ninja, cached
# under ~/.cache/torch_extensions) built in the background, so that step 4's DeepSpeed run loads it
# instead of building it on its clock (a run that starts before the build ends waits on its lock)
install_deepspeed() {
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    notes+=("no .whl/: DeepSpeed not installed (bench/gpu_wheels.sh, carry .whl)")
    return 0
  fi
  if ! timed 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .whl/*.whl >"$LOGS/deepspeed_install.log" 2>&1; then
    tail -20 "$LOGS/deepspeed_install.log"; notes+=("DeepSpeed wheels failed to install (deepspeed_install.log)")
    return 1
  fi
  notes+=("DeepSpeed installed from .whl/ into $SITE")
  PYTHONPATH=$SITE MAX_JOBS=4 "$PY" -c "
import time
from deepspeed.ops.op_builder import CPUAdamBuilder
start = time.perf_counter()
CPUAdamBuilder().load()
print(f'CPU Adam ready in {time.perf_counter() - start:.0f} s')" >"$LOGS/cpu_adam_build.log" 2>&1 &
  PREBUILD_PID=$!
}

# without DeepSpeed's install: the peer's config for both precisions and its command line
check_deepspeed_peer() {
  if "$PY" -c "
import json
from bench.deepspeed_peer import zero_offload_config
for precision in ('bf16', 'fp32'):
    config = zero_offload_config(4, 4, precision)
    assert config['zero_optimization']['stage'] == 3, config
    json.dumps(config)" >"$LOGS/deepspeed_peer.log" 2>&1 \
      && "$PY" -m bench.deepspeed_peer --help >>"$LOGS/deepspeed_peer.log" 2>&1; then
    notes+=("DeepSpeed install skipped; the peer's ZeRO-3 offload config builds")
  else
    tail -20 "$LOGS/deepspeed_peer.log"; notes+=("the DeepSpeed peer's config failed (deepspeed_peer.log)")
    return 1
  fi
}

# --- step 2: the CUDA tests ------------------------------------------------------------------------

step_tests() {
  local start=$SECONDS status lim summary cause="" parallel=()
  lim=$(limit 180 320)
  log "2 cuda tests (limit ${lim} s)"
  # in parallel where pytest-xdist is there: the tests spawn their workers, which start slowly
  [ "$MODE" = gpu ] && "$PY" -c "import xdist" 2>/dev/null && parallel=(-n 4)
  timed "$lim" "$PY" -m pytest -q -rs -p no:cacheprovider --log-level=INFO "${parallel[@]}" \
    tests/runtime/test_cuda_training.py tests/runtime/test_device.py >"$LOGS/cuda_tests.log" 2>&1
  status=$?
  grep -v "^  " "$LOGS/cuda_tests.log" | tail -20
  summary=$(grep -a -E "[0-9]+ (passed|failed|skipped|error)" "$LOGS/cuda_tests.log" | tail -1 | tr -d '=' | sed 's/^ *//')
  [ "$status" -ne 0 ] && cause=$(why "$status" "$lim" "$LOGS/cuda_tests.log")
  if [ "$MODE" = gpu ] && grep -q "needs a CUDA GPU" "$LOGS/cuda_tests.log"; then
    status=1; cause="${cause:+$cause; }tests skipped for want of a GPU"
  fi
  record cuda-tests "$start" "$status" "$summary" "$cause"
}

# --- step 3: GPT-2 medium at 6 GiB from the CLI ----------------------------------------------------

step_medium() {
  local start=$SECONDS status lim note
  lim=$(limit 180 200)
  if [ "$MODE" = dry ]; then
    log "3 GPT-2 medium at 6 GiB compiled for an analytic $SPEC; GPT-2 tiny trained on emulated CPU devices"
    rm -rf "$LOGS/plan-medium-6g" "$LOGS/plan-tiny"
    timed "$lim" "$PY" -m harmony.cli -v compile models/gpt2.py --arg preset=medium --minibatch 16 \
      --device-memory 6GiB --devices 1 --analytic "$SPEC" --out "$LOGS/plan-medium-6g" >"$LOGS/compile-medium-6g.log" 2>&1
    status=$?
    grep -a -E "^(chosen|estimated iteration|host memory|error)" "$LOGS/compile-medium-6g.log"
    if [ "$status" -eq 0 ]; then
      note="compiled: $(grep -a "^chosen" "$LOGS/compile-medium-6g.log" | cut -c1-120)"
    else
      note="compile: $(why "$status" "$lim" "$LOGS/compile-medium-6g.log")"
    fi
    run_cli tiny "$lim" --arg preset=tiny --minibatch 16 --iters 2 --device cpu --devices 2 || status=1
  else
    log "3 GPT-2 medium at 6 GiB compiled and trained on the GPU (limit ${lim} s)"
    rm -rf "$LOGS/plan-medium-6g"
    note=""
    run_cli medium-6g "$lim" --arg preset=medium --minibatch 16 --device-memory 6GiB --device cuda --devices 1 \
      --iters "$MEDIUM_ITERS"
    status=$?
  fi
  record medium "$start" "$status" "$note" "$RUN_NOTE"
}

# run_cli NAME LIMIT ARGS...: `harmony -vv run models/gpt2.py ARGS`, its whole log, report and plan
# in $LOGS; RUN_NOTE: its figures, or why it failed
run_cli() {
  local name=$1 lim=$2 status; shift 2
  rm -f "$LOGS/run-$name.json"
  timed "$lim" "$PY" -m harmony.cli -vv run models/gpt2.py --report "$LOGS/run-$name.json" --out "$LOGS/plan-$name" "$@" \
    >"$LOGS/run-$name.log" 2>&1
  status=$?
  grep -a -v "^\s*$" "$LOGS/run-$name.log" | grep -a -v -E "^(INFO|DEBUG)" | tail -12
  if [ "$status" -eq 0 ] && [ -f "$LOGS/run-$name.json" ]; then
    RUN_NOTE="$name: $("$PY" -c "
import json, sys
r = json.load(open(sys.argv[1]))
peak = max(d.get('peak_memory') or 0 for d in r['per_device']) / 2**20
cap = max(d.get('capacity') or 0 for d in r['per_device']) / 2**20
print(f\"{r['mode']} {r['configuration']}; {r['mean_iteration_seconds'] * 1e3:.1f} ms/iteration measured, \"
      f\"{r['estimated_iteration_seconds'] * 1e3:.1f} estimated ({r['relative_error']:+.1%}); \"
      f\"peak {peak:,.1f} of {cap:,.1f} MiB\")" "$LOGS/run-$name.json" 2>&1)"
    return 0
  fi
  [ "$status" -eq 0 ] && status=1
  RUN_NOTE="$name: $(why "$status" "$lim" "$LOGS/run-$name.log")"
  return 1
}

# --- step 4: eager, Harmony and DeepSpeed on one model (bench.gpu) -----------------------------------

step_bench() {
  local start=$SECONDS status lim per_system figures cause=""
  lim=$(limit 100000 10)
  [ "$lim" -lt 120 ] && lim=120
  # bench.gpu's --timeout bounds each system's run, one figure for all three, in turn: eager, Harmony,
  # DeepSpeed. Harmony may take what is left after a minute for the hardware's measurement and the
  # eager run and a minute and a half kept for DeepSpeed (its CPU Adam prebuilt in step 1); where
  # Harmony takes all that, the step's own limit stops DeepSpeed, and bench.gpu's results keep the
  # two runs before it.
  per_system=$((lim - 150))
  [ "$per_system" -lt 60 ] && per_system=60
  if [ "$MODE" = dry ]; then
    log "4 bench.gpu --dry-run --cases $CASE (modelled $SPEC)"
    rm -rf "$OUT/gpu-dry-run"  # bench.gpu --dry-run writes a folder only where --out names one
    timed "$lim" "$PY" -m bench.gpu --dry-run --spec "$SPEC" --cases "$CASE" --iters "$BENCH_ITERS" \
      --timeout "$per_system" --out "$OUT/gpu-dry-run" >"$LOGS/gpu.log" 2>&1
    status=$?
    tail -8 "$LOGS/gpu.log"
    [ "$status" -ne 0 ] && cause=$(why "$status" "$lim" "$LOGS/gpu.log")
    figures=$(bench_figures "$OUT/gpu-dry-run/results.json" dry) || status=1
  else
    log "4 bench.gpu --cases $CASE, eager, harmony, deepspeed (limit ${lim} s, ${per_system} s per system)"
    if [ -n "$PREBUILD_PID" ] && kill -0 "$PREBUILD_PID" 2>/dev/null; then
      echo "DeepSpeed's CPU Adam is still building: its run waits for it"
    fi
    touch "$LOGS/bench.started"  # the results folder is the one whose results.json this run wrote
    # OUT: where bench.gpu keeps its systems' own reports and plans (OUT/work)
    OUT=$LOGS PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} timed "$lim" "$PY" -m bench.gpu --cases "$CASE" \
      --systems eager,harmony,deepspeed --precision bf16 --iters "$BENCH_ITERS" --timeout "$per_system" \
      2>&1 | tee "$LOGS/gpu.log"
    status=${PIPESTATUS[0]}
    [ "$status" -ne 0 ] && cause=$(why "$status" "$lim" "$LOGS/gpu.log")
    local results folder
    results=$(find bench/results -path 'bench/results/gpu-*/results.json' -newer "$LOGS/bench.started" | head -1)
    if [ -n "$results" ]; then
      folder=$(dirname "$results")
      mkdir -p "$OUT/${folder##*/}"
      cp "$results" "$folder/README.md" "$OUT/${folder##*/}"/ 2>/dev/null
      figures="$folder: $(bench_figures "$results" gpu)" || status=1
    else
      status=1; figures="bench.gpu wrote no results.json under bench/results/gpu-<device>"
    fi
  fi
  record bench "$start" "$status" "$CASE" "$figures" "$cause"
}

# bench_figures RESULTS MODE: one line of bench.gpu's results for $CASE; fails where a system has no rate
bench_figures() {
  "$PY" -c "
import json, sys
path, mode, case = sys.argv[1:]
results = json.load(open(path))
if mode == 'dry':
    r = next(r for r in results['cases'] if r['case'] == case)
    print(f\"estimated on {results['hardware']['name']}: footprint {r['footprint'] / 2**30:.1f} GiB, cap {r['cap'] / 2**30:.2f} GiB, \"
          f\"Harmony {r['estimated_s']:.3f} s/iteration ({r['configuration']}), {r['bound_own']:.2f} of the bound\")
    sys.exit(0)
entry = results['cases'][case]
parts, missing = [f\"cap {entry['cap'] / 2**30:.2f} GiB of a {entry['footprint'] / 2**30:.1f} GiB footprint\"], []
for system in ('eager', 'harmony', 'deepspeed'):
    run = entry['systems'].get(system, {})
    if 'samples_per_s' in run:
        parts.append(f\"{system} {run['samples_per_s']:.2f} samples/s\")
    else:
        missing.append(system)
        parts.append(f\"{system}: {str(run.get('error', 'not run'))[:160]}\")
print('; '.join(parts))
sys.exit(1 if missing else 0)" "$1" "$2" "$CASE" 2>&1 | tail -1
  return "${PIPESTATUS[0]}"
}

# --- the estimator's accuracy on the machine's CPUs ------------------------------------------------

step_estimate() {
  local start=$SECONDS status lim cause=""
  lim=$(limit 480 0)
  log "bench.estimate_accuracy --full on $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg) (limit ${lim} s)"
  CUDA_VISIBLE_DEVICES= COLUMNS=200 timed "$lim" "$PY" -m bench.estimate_accuracy --full --iterations 11 \
    --json "$LOGS/estimate_accuracy.json" >"$LOGS/estimate_accuracy.log" 2>&1
  status=$?
  grep -a -E "mean absolute|rel. error|^Traceback|Error" "$LOGS/estimate_accuracy.log" | cut -c1-400
  [ "$status" -ne 0 ] && cause=$(why "$status" "$lim" "$LOGS/estimate_accuracy.log")
  record estimate "$start" "$status" "$(grep -a "mean absolute" "$LOGS/estimate_accuracy.log" | tail -1 | cut -c1-200)" "$cause"
}

# --- the summary ----------------------------------------------------------------------------------

summary() {
  local i failed=0
  if [ -n "$PREBUILD_PID" ]; then
    if kill -0 "$PREBUILD_PID" 2>/dev/null; then
      kill "$PREBUILD_PID" 2>/dev/null
      echo "DeepSpeed's CPU Adam build was still running at the end and was stopped (cpu_adam_build.log)"
    else
      tail -1 "$LOGS/cpu_adam_build.log"
    fi
  fi
  pack
  summary_lines | tee "$OUT/summary.txt"
  echo "(the logs unpacked: $LOGS)"
  for i in "${!VERDICTS[@]}"; do
    [ "${VERDICTS[$i]}" = FAIL ] && failed=1
  done
  return "$failed"
}

step_env
case $MODE in
  estimate) step_estimate ;;
  *) step_tests; step_medium; step_bench ;;
esac
summary
