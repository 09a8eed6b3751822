"""How far the regular form of each grouped product gets (GPU machine).

  python3 scripts/regular_form.py OUT_DIR [--shapes NAME ...] [--ops fwd dx dw]

Per training shape and op (fwd, dx, dw), interleaved CUPTI device time of:

* ``routed``: ragdot's automatic call on the bench's routed group sizes;
* ``uniform``: the same call with every group m / g rows (no group boundary
  inside a row block when m / g is a multiple of 64);
* ``batched``: XLA's batched matmul (cuBLAS) of those uniform groups, x / dy
  viewed as [g, m / g, k] / [g, m / g, n]: the regular form of the product,
  the best a vendor library does when there is nothing ragged about it;
* ``dense``: the bench's dense matmul of the same (m, k, n).

Prints each time over dense (the issues' ratio), uniform / routed (what the
raggedness costs ragdot) and batched / uniform (the regular form's best
against ragdot's kernel on the same rows), checks that ``uniform`` and
``batched`` agree to bf16 rounding, and writes OUT_DIR/regular_form.json.
``--kernels``: also the kernels (names and times) of one batched and one
dense call, i.e. which cuBLAS kernel (tile shape, cluster) XLA picked.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from ragdot import bench, timing


def batched_fn(op: str, g: int):
  """fn(x, w, dy, gs) of ``op`` over g equal groups as one batched matmul."""
  def grouped(a):
    return a.reshape(g, a.shape[0] // g, a.shape[1])
  if op == "fwd":
    return lambda x, w, dy, gs: jnp.einsum("gmk,gkn->gmn", grouped(x), w).reshape(
        x.shape[0], -1)
  if op == "dx":
    return lambda x, w, dy, gs: jnp.einsum("gmn,gkn->gmk", grouped(dy), w).reshape(
        dy.shape[0], -1)
  if op == "dw":
    return lambda x, w, dy, gs: jnp.einsum("gmk,gmn->gkn", grouped(x), grouped(dy))
  raise ValueError(f"unknown op {op!r}")


def kernels(fn, args) -> list[tuple[str, float]]:
  """(kernel name, ms) of each kernel of one call of ``fn(*args)`` (CUPTI)."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  _, per_iter = profiler.measure(fn, aggregate=False, iterations=2)(*args)
  return [(k, float(t)) for k, t in per_iter[-1]]


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--shapes", nargs="+", default=None, help="preset names (default: all)")
  p.add_argument("--ops", nargs="+", default=["fwd", "dx", "dw"], choices=["fwd", "dx", "dw"])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--kernels", action="store_true",
                 help="print the kernels of the batched and dense calls")
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []
  for s in bench.preset_shapes("training", args.shapes):
    if s.m % (8 * s.g):
      print(f"{s.name}: m / g = {s.m / s.g} is not a multiple of 8; skipped", flush=True)
      continue
    _, (x, w, dy, gs) = bench.shape_inputs(s)
    uniform = jnp.full((s.g,), s.m // s.g, jnp.int32)
    for op in args.ops:
      fns = bench._candidates(op, s, None, baselines=["dense"])  # pylint: disable=protected-access
      ragdot_fn, dense_fn = jax.jit(fns["ragdot"]), jax.jit(fns["dense"])
      batched = jax.jit(batched_fn(op, s.g))
      cases = {"routed": (ragdot_fn, (x, w, dy, gs)), "uniform": (ragdot_fn, (x, w, dy, uniform)),
               "batched": (batched, (x, w, dy, uniform)), "dense": (dense_fn, (x, w, dy, gs))}
      ref = np.asarray(batched(x, w, dy, uniform).astype(jnp.float32))
      out = np.asarray(ragdot_fn(x, w, dy, uniform).astype(jnp.float32))
      err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
      del ref, out
      med = timing.interleaved_median_ms(cases, rounds=args.rounds, iterations=args.iterations)
      row = dict(shape=s.name, op=op, ms=med,
                 x_dense={k: med["dense"] / v for k, v in med.items()},
                 uniform_over_routed=med["uniform"] / med["routed"],
                 batched_over_uniform=med["batched"] / med["uniform"],
                 uniform_vs_batched_err=err)
      if args.kernels:
        row["kernels"] = {name: kernels(*cases[name]) for name in ("batched", "dense")}
      rows.append(row)
      print(f"{s.name:20s} {op:3s} x dense: routed {row['x_dense']['routed']:.3f}"
            f" uniform {row['x_dense']['uniform']:.3f} batched {row['x_dense']['batched']:.3f}"
            f"  (dense {med['dense']:.4f} ms)  uniform/routed {row['uniform_over_routed']:.3f}"
            f"  batched/uniform {row['batched_over_uniform']:.3f}"
            f"  max|uniform - batched|/max|batched| {err:.1e}", flush=True)
      for name, ks in row.get("kernels", {}).items():
        print("    " + name + ": " + "; ".join(f"{k} {t * 1e3:.1f} us" for k, t in ks), flush=True)
  with open(os.path.join(args.out_dir, "regular_form.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
