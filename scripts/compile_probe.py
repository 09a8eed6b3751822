"""Where a ragdot call's compile time goes (GPU machine): per call, the time of
``jax.jit(f).lower(...)`` (tracing and the Python lowering of the Pallas
kernels) and of ``.compile()`` (XLA, with Mosaic's MLIR -> PTX -> SASS), for
the forward, dX, dW and forward+backward of one training shape, then the
forward again in a new jit (does a kernel compiled before get reused?).
With ``--cache DIR`` JAX's persistent compilation cache is on: run it twice
to see what a second process pays.

  python3 scripts/compile_probe.py [--shape "qwen3-30b gate_up"] [--cache DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from ragdot import bench


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="qwen3-30b gate_up")
  p.add_argument("--cache", default=None, help="persistent compilation cache directory")
  p.add_argument("--json", default=None)
  args = p.parse_args()
  if args.cache:
    jax.config.update("jax_compilation_cache_dir", args.cache)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  shape = next(s for s in bench.PRESETS["training"] if s.name == args.shape)
  _, (x, w, dy, gs) = bench.shape_inputs(shape, 0)
  # The bench's own functions (its "compile s" column), then the forward again.
  calls = {op: bench._ragdot_fns(op, None) for op in ("fwd", "dx", "dw", "fwdbwd")}  # pylint: disable=protected-access
  calls["fwd_again"] = bench._ragdot_fns("fwd", None)  # pylint: disable=protected-access
  rows = []
  for name, f in calls.items():
    t0 = time.perf_counter()
    lowered = jax.jit(f).lower(x, w, dy, gs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(x, w, dy, gs))
    t3 = time.perf_counter()
    rows.append(dict(call=name, lower_s=t1 - t0, compile_s=t2 - t1, first_run_s=t3 - t2))
    print(f"{args.shape} {name:10s} lower {t1 - t0:6.2f} s  compile {t2 - t1:6.2f} s"
          f"  first run {t3 - t2:6.2f} s", flush=True)
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(dict(shape=args.shape, cache=args.cache, rows=rows), fh, indent=1)


if __name__ == "__main__":
  main()
