"""A/B of Mosaic forward / dX configs on the training shapes (GPU machine).

  python3 scripts/ab_fwd.py OUT_DIR --set split_n=True block_m=64 [--rounds 3] [--ops fwd]

For each training shape and op (fwd, dX) times the default config (A) and the
same config with the ``--set`` fields replaced (B), interleaved A, B, A, B, ... with
CUPTI, on one set of fresh random inputs; prints medians, B/A, whether B's
output equals A's bitwise, and writes OUT_DIR/ab_fwd.json.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ragdot import bench, dispatch, timing
from ragdot.backends import mosaic_fwd
from ragdot.dispatch import backend_call


def parse_fields(items: list[str]) -> dict:
  """``["FIELD=VALUE", ...]`` (Python literals) as a dict of config fields."""
  return {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in items)}


def gmm_inputs(s: bench.Shape, call, key) -> tuple[jax.Array, jax.Array]:
  """Fresh bf16 operands of preset shape ``s``'s forward or dX call ``call``
  (``backend_call``): lhs [m, k] and rhs [g, k, n] ([g, n, k] for dX), the
  weights scaled by 1/32."""
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (s.m, call.k), jnp.bfloat16)
  shape = (s.g, call.n, call.k) if call.transpose_rhs else (s.g, call.k, call.n)
  return x, (jax.random.normal(kw, shape, jnp.float32) / 32).astype(jnp.bfloat16)


def dw_case(s: bench.Shape, key, out_dtype: Any = None
            ) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
  """(group sizes, lhs x[m, k], rhs dy[m, n], the dispatcher's Choice for a dW
  of ``out_dtype`` (None: bf16)) of preset shape ``s``'s dW call: routed sizes,
  fresh bf16 operands."""
  gs = jnp.asarray(bench.routed_group_sizes(s))
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (s.m, s.k), jnp.bfloat16)
  dy = jax.random.normal(ky, (s.m, s.n), jnp.bfloat16)
  choice = dispatch.choose("tgmm", None, dtype=jnp.bfloat16, out_dtype=out_dtype, m=s.m,
                           k=s.k, n=s.n, g=s.g, num_groups=s.g)
  return gs, x, dy, choice


def case_rows(shape: str, op: str, choice, med: dict, equal: dict, configs: dict,
              flops: int, equal_key: str) -> list[dict]:
  """One row per timed case (``med``: name -> ms, "table" among them), each
  printed: time, TFLOP/s, time over the table choice's, bitwise equality
  (stored under ``equal_key``) and the case's config."""
  print(f"{shape} {op}: table = {choice.implementation} {choice.config}", flush=True)
  rows = []
  for name, ms in med.items():
    row = dict(shape=shape, op=op, case=name, ms=ms, tflops=flops / ms / 1e9,
               x_table=ms / med["table"], config=str(configs[name]))
    row[equal_key] = equal[name]
    rows.append(row)
    print(f"  {name:44s} {ms:.4f} ms {row['tflops']:6.1f} TFLOP/s  x table "
          f"{row['x_table']:.3f}  equal {equal[name]}", flush=True)
  return rows


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--set", nargs="+", required=True, metavar="FIELD=VALUE",
                 help="MosaicFwdConfig fields of B (Python literals)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--ops", nargs="+", default=["fwd", "dx"], choices=["fwd", "dx"])
  args = p.parse_args()
  changes = parse_fields(args.set)
  label = " ".join(args.set)
  rows = []
  for s in bench.PRESETS["training"]:
    gs = jnp.asarray(bench.routed_group_sizes(s))
    for op in args.ops:
      # dX contracts over the forward's n and outputs its k (rhs [g, k, n] read
      # transposed), as in a training step: the call's k and n are swapped.
      call = backend_call(op, s.k, s.n)
      tr = call.transpose_rhs
      x, w = gmm_inputs(s, call, jax.random.key(len(rows)))
      a = mosaic_fwd.default_config(s.m, call.k, call.n, s.g, jnp.bfloat16, tr, jnp.bfloat16)
      try:
        b = mosaic_fwd.fit_config(dataclasses.replace(a, **changes), jnp.bfloat16,
                                  jnp.bfloat16)
        if b is None:
          raise ValueError("does not fit SMEM")
      except ValueError as e:
        print(f"{s.name} {op}: B invalid ({e})", flush=True)
        continue
      fns = [jax.jit(lambda x, w, gs, c=c: mosaic_fwd.gmm(
          x, w, gs, None, transpose_rhs=tr, out_dtype=jnp.bfloat16, config=c)) for c in (a, b)]
      outs = [np.asarray(jax.block_until_ready(f(x, w, gs)).astype(jnp.float32)) for f in fns]
      med = timing.interleaved_median_ms({"A": (fns[0], (x, w, gs)), "B": (fns[1], (x, w, gs))},
                                         rounds=args.rounds, iterations=args.iterations)
      ma, mb = med["A"], med["B"]
      flops = 2 * s.m * call.k * call.n
      row = dict(shape=s.name, op=op, a_ms=ma, b_ms=mb, a_tflops=flops / ma / 1e9,
                 b_tflops=flops / mb / 1e9, b_over_a=mb / ma,
                 bitwise_equal=bool(np.array_equal(outs[0], outs[1])),
                 max_abs_diff=float(np.max(np.abs(outs[0] - outs[1]))), a=dataclasses.asdict(a),
                 b=dataclasses.asdict(b))
      rows.append(row)
      print(f"{s.name:20s} {op:3s} A {ma:.4f} ms {row['a_tflops']:6.1f}  B({label}) "
            f"{mb:.4f} ms {row['b_tflops']:6.1f}  B/A {mb / ma:.3f}  equal {row['bitwise_equal']}",
            flush=True)
  with open(os.path.join(args.out_dir, "ab_fwd.json"), "w") as f:
    json.dump(dict(set=changes, device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
