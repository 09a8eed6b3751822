#!/usr/bin/env bash
# Fills the git-ignored .whl/ folder that scripts/gpu_run.sh installs on the GPU machine
# (which cannot reach a package registry): tokamax and the wheels it needs beyond what the
# machine has, for side-by-side numbers (and pytest-xdist, which the tests stage uses to
# compile the GPU tests' kernels in parallel, and flatbuffers, which jax.export's serialize needs), plus a stub for the xprof module tokamax imports
# at import time (the real wheel is 32 MB; ragdot's benchmark never calls it).
# Run here, from the repo root; then name .whl in the device tool's carry list.
set -euo pipefail
mkdir -p .whl
for pkg in tokamax==0.0.17 qwix einshape pydantic pydantic-core annotated-types \
           typing-inspection immutabledict tensorboardx pytest-xdist execnet flatbuffers; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$pkg"
done
stub=.whl/stub/xprof/cli/tools
mkdir -p "$stub"
touch .whl/stub/xprof/__init__.py .whl/stub/xprof/cli/__init__.py "$stub/__init__.py"
cat > "$stub/get_kernel_stats_tool.py" <<'PY'
"""Stub: tokamax imports this at import time; ragdot's benchmark never calls it."""
def get_kernel_stats(*args, **kwargs):
  raise NotImplementedError("xprof stub")
PY
ls .whl
