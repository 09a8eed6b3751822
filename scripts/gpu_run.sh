#!/usr/bin/env bash
# The one entry point on the GPU machine (device tool), run from the repo root:
#   bash scripts/gpu_run.sh [bench presets...]
# Runs the GPU-marked tests, then the benchmark table, from the source tree with
# the machine's own python3.  Logs and JSON go under $OUT (./out when unset).
# Carry .whl (tokamax and its wheels, plus .whl/stub) for side-by-side numbers.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="src:/tmp/site:.whl/stub"
fi
presets=${*:-training decode ep skewed}
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv; python3 -c 'import jax; print(jax.__version__, jax.devices())'; } 2>&1 | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q --maxfail=6 -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -n 60 | tee "$OUT/gpu_tests.log"
fi
if [ "${SWEEP:-0}" = 1 ]; then
  timeout "${SWEEP_TIMEOUT:-300}" python3 scripts/gpu_sweep.py "${SWEEP_BUDGET:-240}" 2>&1 | tee "$OUT/sweep.log" | grep -v '^{"op"' 
fi
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
timeout "${BENCH_TIMEOUT:-400}" python3 -m ragdot.bench --preset $presets --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v '^{'
