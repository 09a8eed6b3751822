"""Kernel config sweep on the GPU (run by scripts/gpu_run.sh when SWEEP=1).

For each (op, shape) every candidate config is compiled, checked against a
host numpy reference and timed on device; prints one JSON line per config and
the best config per (op, shape) last.  Feeds the dispatcher's tables.
"""

from __future__ import annotations

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "tests")
import oracle  # noqa: E402
from ragdot.backends import mosaic_dw, mosaic_fwd  # noqa: E402
from ragdot.bench import Shape, routed_group_sizes  # noqa: E402
from ragdot.timing import device_time_ms  # noqa: E402

SHAPES = [Shape("qwen3-30b gate_up", 32768, 2048, 1536, 128),
          Shape("qwen3-30b down", 32768, 768, 2048, 128)]


def main(budget_s: float = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0) -> None:
  t0 = time.time()
  best = {}
  for op in ("fwd", "dx", "dw"):
    for shape in SHAPES:
      m, k, n, g = shape.m, shape.k, shape.n, shape.g
      sizes = routed_group_sizes(shape)
      gs = jnp.asarray(sizes)
      keys = jax.random.split(jax.random.key(1), 2)
      bf = jnp.bfloat16
      if op == "dw":
        a = jax.random.normal(keys[0], (m, k), bf)
        b = jax.random.normal(keys[1], (m, n), bf)
        ref = oracle.np_trans_ragged_dot(a, b, sizes)
        cfgs = mosaic_dw.gpu_sweep_configs(m, k, n, g)
        make = lambda c: jax.jit(functools.partial(mosaic_dw.tgmm, num_groups=g, out_dtype=bf, precision=None, interpret=False, config=c))
      else:
        tr = op == "dx"
        a = jax.random.normal(keys[0], (m, k), bf)
        b = (jax.random.normal(keys[1], (g, n, k) if tr else (g, k, n), jnp.float32) / 32).astype(bf)
        ref = oracle.np_ragged_dot(a, b, sizes, None, tr)
        cfgs = mosaic_fwd.gpu_sweep_configs(m, k, n, g, tr, bf, bf)
        make = lambda c, tr=tr: jax.jit(functools.partial(mosaic_fwd.gmm, transpose_rhs=tr, out_dtype=bf, precision=None, interpret=False, config=c))
      for cfg in cfgs:
        if time.time() - t0 > budget_s:
          print(json.dumps({"stop": "budget"}), flush=True)
          break
        row = {"op": op, "shape": shape.name, "config": repr(cfg)}
        try:
          fn = make(cfg)
          c0 = time.time()
          out = jax.block_until_ready(fn(a, b, gs, None))
          row["compile_s"] = round(time.time() - c0, 2)
          row["rel_err"] = oracle.rel_error(out, ref)
          ms, method = device_time_ms(fn, a, b, gs, None, iterations=10)
          row.update(ms=ms, tflops=2 * m * k * n / ms / 1e9, method=method)
          if row["rel_err"] < 2e-2 and row["tflops"] > best.get((op, shape.name), {}).get("tflops", 0):
            best[(op, shape.name)] = row
        except Exception as e:  # pylint: disable=broad-except
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
  print("BEST")
  for key, row in best.items():
    print(f"{key[0]:4s} {key[1]:22s} {row['tflops']:7.1f} TFLOP/s  {row['ms']:.3f} ms  err {row['rel_err']:.1e}  {row['config']}")


if __name__ == "__main__":
  main()
