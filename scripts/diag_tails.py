"""What the group tails cost the forward (GPU machine).

  python3 scripts/diag_tails.py OUT_DIR [--rounds 3]

On the Qwen3 training shapes (m = 32768, 128 experts, top-8) times, interleaved
with CUPTI, the automatic forward on the same m with three group-size layouts, and the dense
matmul of the same (m, k, n):
  routed   top-8 routing of random logits (the bench's sizes: 256 +- 15 rows);
  aligned  every group exactly 256 rows: two full 128-row tiles, no tail;
  halves   groups of 240 and 272 rows in turn: half the groups end in a tile
           of 16 rows, the other half in one of 112.
``aligned`` over ``dense`` is what the kernel reaches with no tail at all; the
gap from ``routed`` to ``aligned`` is what tails (and padding) cost.  Writes
OUT_DIR/diag_tails.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import ragdot
from ragdot import bench, timing


def layouts(s: bench.Shape) -> dict[str, np.ndarray]:
  """Group sizes (int32[g], summing to m) of each layout."""
  per = s.m // s.g
  halves = np.where(np.arange(s.g) % 2 == 0, per - 16, per + 16)
  return {"routed": bench.routed_group_sizes(s),
          "aligned": np.full((s.g,), per, np.int32),
          "halves": halves.astype(np.int32)}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=20)
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []
  for s in bench.PRESETS["training"]:
    if s.g != 128 or s.top_k != 8:
      continue
    kx, kw, kd = jax.random.split(jax.random.key(len(rows)), 3)
    x = jax.random.normal(kx, (s.m, s.k), jnp.bfloat16)
    w = (jax.random.normal(kw, (s.g, s.k, s.n), jnp.float32) / 32).astype(jnp.bfloat16)
    wd = w[0]
    fwd = jax.jit(lambda x, w, gs: ragdot.ragged_dot(x, w, gs))
    cases = {name: (fwd, (x, w, jnp.asarray(gs))) for name, gs in layouts(s).items()}
    cases["dense"] = (jax.jit(jnp.dot), (x, wd))
    med = timing.interleaved_median_ms(cases, rounds=args.rounds, iterations=args.iterations)
    flops = 2 * s.m * s.k * s.n
    for name, ms in med.items():
      row = dict(shape=s.name, case=name, ms=ms, tflops=flops / ms / 1e9,
                 x_dense=med["dense"] / ms)
      rows.append(row)
      print(f"{s.name:20s} {name:8s} {ms:.4f} ms {row['tflops']:6.1f} TFLOP/s  "
            f"x dense {row['x_dense']:.3f}", flush=True)
  with open(os.path.join(args.out_dir, "diag_tails.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
