"""What the automatic-sharding wrapper costs on one GPU (GPU machine).

On one device ``custom_partitioning`` inlines ragdot's call, so the compiled
program should hold the same kernels as with ``RAGDOT_AUTO_PARTITION=0``.  Per
shape and op, with the wrapper on and off (each in a fresh ``jax.jit``):
compile seconds (lower + compile), device time (CUPTI), host wall time of
back-to-back jitted calls, host wall time of eager (un-jitted) calls, the
number of custom calls in the optimized HLO, and whether the outputs are
bitwise equal.

  python3 scripts/auto_partition_overhead.py [--shapes NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from ragdot import bench
from ragdot import timing

DEFAULT_SHAPES = ("qwen3-30b gate_up decode", "qwen3-30b gate_up")


def _measure(fn, args) -> dict:
  jitted = jax.jit(fn)
  t0 = time.perf_counter()
  lowered = jitted.lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  out = compiled(*args)
  jax.block_until_ready(out)
  dev_ms, _ = timing.device_time_ms(compiled, *args, warmup_s=timing.SETTLE_S)
  return {
      "lower_s": t1 - t0,
      "compile_s": t2 - t1,
      "custom_calls": compiled.as_text().count("custom-call("),
      "device_ms": dev_ms,
      "jit_wall_ms": timing.host_time_ms(compiled, *args),
      "eager_wall_ms": timing.host_time_ms(fn, *args),
      "out": [np.asarray(leaf) for leaf in jax.tree.leaves(out)],
  }


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
  p.add_argument("--ops", nargs="+", default=["fwd", "fwdbwd"])
  p.add_argument("--json", default=None)
  args = p.parse_args()
  rows = []
  # A name may sit in several presets: one shape per name.
  shapes = {s.name: s for s in bench.preset_shapes(list(bench.PRESETS), args.shapes)}
  for name, shape in shapes.items():
    _, inputs = bench.shape_inputs(shape, 0)
    # A first compile of the shape, so that neither mode pays the process's first-use costs.
    jax.block_until_ready(jax.jit(bench._ragdot_fns("fwd", None))(*inputs))  # pylint: disable=protected-access
    for op in args.ops:
      res = {}
      for mode in ("1", "0"):
        os.environ["RAGDOT_AUTO_PARTITION"] = mode
        res[mode] = _measure(bench._ragdot_fns(op, None), inputs)  # pylint: disable=protected-access
      os.environ.pop("RAGDOT_AUTO_PARTITION")
      equal = all(np.array_equal(a, b, equal_nan=True)
                  for a, b in zip(res["1"].pop("out"), res["0"].pop("out")))
      row = {"shape": name, "op": op, "on": res["1"], "off": res["0"], "bitwise_equal": equal}
      rows.append(row)
      on, off = res["1"], res["0"]
      print(f"{name:28s} {op:6s} compile s {on['lower_s'] + on['compile_s']:.2f} / "
            f"{off['lower_s'] + off['compile_s']:.2f}  custom calls {on['custom_calls']} / "
            f"{off['custom_calls']}  device ms {on['device_ms']:.4f} / {off['device_ms']:.4f}  "
            f"jit wall ms {on['jit_wall_ms']:.4f} / {off['jit_wall_ms']:.4f}  eager wall ms "
            f"{on['eager_wall_ms']:.4f} / {off['eager_wall_ms']:.4f}  equal {equal}  (on / off)",
            flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
