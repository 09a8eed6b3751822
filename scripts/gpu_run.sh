#!/usr/bin/env bash
# The one entry point on the GPU machine (device tool), run from the repo root.
# Runs stages from the source tree with the machine's own python3; logs and JSON
# go under $OUT (./out when unset).  Carry .whl (tokamax + its wheels, and
# .whl/stub for the xprof module tokamax imports; scripts/fetch_bench_wheels.sh
# fills it) for side-by-side numbers.
#
#   STAGES="tests bench moe ep" bash scripts/gpu_run.sh
#   STAGES= bash scripts/gpu_run.sh   (empty: only install the wheels into /tmp/site, for a
#   command of your own after it with PYTHONPATH=src:/tmp/site:.whl/stub; unset: tests bench)
#
# stages (each with its own timeout, <NAME>_TIMEOUT seconds):
#   tests  GPU-marked tests (kernels at real sizes, NaN-poisoned memory)    TESTS_ARGS
#          (*_ARGS are split on spaces: a -k expression must have none, e.g. -k schedule;
#          no -n there: TESTS_WORKERS sets the processes, and the rerun is on one)
#          TESTS_PART=i/k: only every k-th collected test from the i-th (1-based), so a
#          suite longer than one device call (10 min) runs in k calls
#          TESTS_LIST=FILE: the test ids in FILE (one a line) instead; with TESTS_PART, its
#          i-th of every k lines (docs/data/gpu_cases_v52_remaining.txt: the cases
#          not run since v48); TESTS_WORKERS / TESTS_MEM_FRACTION: xdist processes and
#          each one's share of GPU memory (an H100's 80 GB: 4 x 0.22); cases that run
#          out of it run again alone at TESTS_RETRY_MEM_FRACTION (0.9), TESTS_RETRY_TIMEOUT
#          (default: what is left of 590 s since the script started)
#   tune   ragdot tune into $OUT/<this GPU's table>.json (a copy of the shipped table the
#          tuner writes for this device kind: nvidia_h200.json on an H200, the H100's own
#          on an H100)                                                     TUNE_ARGS
#          (USE_TUNED=1: the stages after it use that table)
#   bench  ragdot bench table + JSON + PNG                                 BENCH_ARGS
#   moe    one MoE block fwd+bwd: ragdot vs lax vs tokamax
#   ep     MoE block expert-parallel scaling over the local GPUs           EP_ARGS
#   floors dW's measured bytes floors: fills and sums of its bytes beside the dW kernel
#          and the dense dW matmul, per training shape (scripts/dw_floors.py)  FLOORS_ARGS
#   regular  the regular form: ragdot on routed and equal groups beside XLA's batched
#          matmul (cuBLAS) of the equal groups and dense (scripts/regular_form.py)  REGULAR_ARGS
#   profile  ncu counters of the main kernels (scripts/profile_kernels.py)  PROFILE_ARGS
#          (PROFILE_SECTIONS="SourceCounters ...": more ncu sections;
#           PROFILE_METRICS="metric metric ...": single ncu metrics, given to ncu
#           as one comma-separated --metrics)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="src:/tmp/site:.whl/stub"
fi
STAGES=${STAGES-tests bench}  # set but empty: only the set-up above (wheels), no stage
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c 'import jax; print(jax.__version__, jax.devices())'; } 2>&1 | tee "$OUT/env.txt"

run() {  # run NAME TIMEOUT CMD...: output to $OUT/NAME.log, summary lines to stdout
  local name=$1 limit=$2; shift 2
  echo "=== $name (timeout ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name exit $?"
  grep -v '^{' "$OUT/$name.log" | grep -v 'WARNING:absl' | tail -n "${TAIL:-45}"
}

for stage in $STAGES; do
  case $stage in
    tests)
      # Each real-size test spends most of its ~14 s compiling: with pytest-xdist
      # (carried in .whl) TESTS_WORKERS processes share the GPU, each with a
      # slice of its memory instead of the default 75% preallocation.
      par=""
      if python3 -c "import xdist" 2>/dev/null; then
        par="-n ${TESTS_WORKERS:-4}"
        export XLA_PYTHON_CLIENT_MEM_FRACTION=${TESTS_MEM_FRACTION:-0.18}
      fi
      targets=tests/test_gpu.py
      if [ -n "${TESTS_LIST:-}" ]; then
        awk -v part="${TESTS_PART:-1/1}" 'BEGIN { split(part, p, "/") }
          NF && (NR - p[1]) % p[2] == 0' "$TESTS_LIST" > "$OUT/tests_part.txt"
        echo "TESTS_LIST $TESTS_LIST ${TESTS_PART:-}: $(wc -l < "$OUT/tests_part.txt") tests"
        targets=$(cat "$OUT/tests_part.txt")
      elif [ -n "${TESTS_PART:-}" ]; then
        python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/test_gpu.py ${TESTS_ARGS:-} \
          | grep '::' | awk -v i="${TESTS_PART%/*}" -v k="${TESTS_PART#*/}" '(NR - i) % k == 0' > "$OUT/tests_part.txt"
        echo "TESTS_PART $TESTS_PART: $(wc -l < "$OUT/tests_part.txt") tests"
        targets=$(cat "$OUT/tests_part.txt")
      fi
      # (each failure's traceback as it happens: a timeout kills pytest before its summary)
      export RAGDOT_FAILURES="$OUT/tests_failures.txt"
      rm -f "$RAGDOT_FAILURES"  # (reports are appended: none from an earlier run)
      run tests "${TESTS_TIMEOUT:-540}" python3 -m pytest -m gpu -v --tb=short --maxfail=${TESTS_MAXFAIL:-10} -p no:cacheprovider $par $targets ${TESTS_ARGS:-}
      # Cases that ran out of their worker's slice of GPU memory (the largest shapes
      # on an H100), again on one worker with most of it (scripts/oom_failures.py).
      # By default the rerun gets what is left of a 600 s device call.
      if [ -n "$par" ]; then
        python3 scripts/oom_failures.py "$RAGDOT_FAILURES" | grep . > "$OUT/tests_oom.txt"
        if [ -s "$OUT/tests_oom.txt" ]; then
          mapfile -t oom < "$OUT/tests_oom.txt"
          limit=${TESTS_RETRY_TIMEOUT:-$((590 - SECONDS))}
          if [ "$limit" -ge 30 ]; then
            echo "=== ${#oom[@]} out-of-memory failures, again on one worker"
            XLA_PYTHON_CLIENT_MEM_FRACTION=${TESTS_RETRY_MEM_FRACTION:-0.9} \
            RAGDOT_FAILURES="$OUT/tests_retry_failures.txt" \
              run tests_retry "$limit" python3 -m pytest -m gpu -v --tb=short \
              -p no:cacheprovider "${oom[@]}" ${TESTS_ARGS:-}
          else
            echo "=== ${#oom[@]} out-of-memory failures, no time left to rerun them ($OUT/tests_oom.txt)"
          fi
        fi
      fi
      unset XLA_PYTHON_CLIENT_MEM_FRACTION ;;
    tune)
      shipped=$(python3 -c 'import jax; from ragdot import tune
print(tune.default_table_path(jax.devices()[0].device_kind))')
      [ -n "$shipped" ] || { echo "=== tune: no device kind (jax found no GPU?)"; continue; }
      tuned="$OUT/$(basename "$shipped")"
      if [ -f "$shipped" ]; then cp "$shipped" "$tuned"; else rm -f "$tuned"; fi
      run tune "${TUNE_TIMEOUT:-300}" python3 -m ragdot tune --table "$tuned" \
        --log "$OUT/tune_candidates.jsonl" ${TUNE_ARGS:---preset training}
      # USE_TUNED=1: later stages of this call run with the table just tuned.
      [ "${USE_TUNED:-0}" = 1 ] && cp "$tuned" "$shipped" ;;
    bench) run bench "${BENCH_TIMEOUT:-400}" python3 -m ragdot bench --json "$OUT/bench.json" --plot "$OUT/bench.png" ${BENCH_ARGS:---preset training decode ep skewed} ;;
    floors) run floors "${FLOORS_TIMEOUT:-240}" python3 scripts/dw_floors.py "$OUT/floors" ${FLOORS_ARGS:-} ;;
    regular) run regular "${REGULAR_TIMEOUT:-300}" python3 scripts/regular_form.py "$OUT/regular" ${REGULAR_ARGS:-} ;;
    moe) run moe "${MOE_TIMEOUT:-120}" python3 -m ragdot.moe.bench --json "$OUT/moe.json" ;;
    ep) run ep "${EP_TIMEOUT:-180}" python3 -m ragdot.moe.ep_bench --json "$OUT/ep.json" ${EP_ARGS:-} ;;
    profile)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      # No preallocation: ncu backs up the memory a replayed kernel may touch.
      XLA_PYTHON_CLIENT_PREALLOCATE=false run profile "${PROFILE_TIMEOUT:-180}" "$NCU" \
        --clock-control none --profile-from-start off --launch-count 60 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section LaunchStats --section Occupancy \
        $(for sec in ${PROFILE_SECTIONS:-}; do printf -- '--section %s ' "$sec"; done) \
        $([ -n "${PROFILE_METRICS:-}" ] && printf -- '--metrics %s' "$(echo ${PROFILE_METRICS} | tr ' ' ',')") \
        python3 scripts/profile_kernels.py ${PROFILE_ARGS:-} ;;
    *) echo "unknown stage $stage" >&2 ;;
  esac
done
