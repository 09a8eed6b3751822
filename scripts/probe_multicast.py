"""Does TMA multicast between 2-CTA clusters pay on this GPU? (GPU machine; a probe)

  python3 scripts/probe_multicast.py OUT_DIR [--m 32768 --k 2048 --n 1536] [--rounds 3]

Issue #3's next step is a forward kernel whose CTA pairs share the weight tile
by TMA multicast (ragdot's forward is L2-bound: 83.5% L2 throughput, ncu v10).
Before building it, this times JAX's own Hopper dense matmul
(``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``) with ragdot's tile
(two consumer warpgroups, each 128 rows x 128 columns, i.e. a 128 x 256 CTA tile
along n; k steps of 64; 4 stages) without clusters, and with 2-CTA clusters
along m (the two CTAs share the (64 x 256) rhs block: multicast) and along n
(they share the lhs block), interleaved with CUPTI on one set of random inputs,
beside ``jnp.dot``. If clusters along m run clearly faster than no clusters at
this tile, multicast is worth building into the grouped kernel; if not, the
grouped kernel's L2 limit needs another answer. Run it under ncu for the L2
throughput of each variant.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

from ragdot import timing


def configs() -> dict[str, hm.TuningConfig]:
  base = dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
              epi_tile_m=64, epi_tile_n=64, grid_minor_dim=hm.MatmulDimension.N,
              grid_tile_width=4, wg_dimension=hm.MatmulDimension.N)
  return {
      "no cluster": hm.TuningConfig(**base),
      "cluster m (rhs multicast)": hm.TuningConfig(**base,
                                                   cluster_dimension=hm.MatmulDimension.M),
      "cluster n (lhs multicast)": hm.TuningConfig(**base,
                                                   cluster_dimension=hm.MatmulDimension.N),
  }


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--m", type=int, default=32768)
  p.add_argument("--k", type=int, default=2048)
  p.add_argument("--n", type=int, default=1536)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  args = p.parse_args()
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (args.m, args.k), jnp.bfloat16)
  b = (jax.random.normal(kb, (args.k, args.n), jnp.float32) / 32).astype(jnp.bfloat16)
  ref = np.asarray(jnp.dot(a, b, preferred_element_type=jnp.float32))
  cases = {"jnp.dot": (jax.jit(jnp.dot), (a, b))}
  errors = {}
  for name, cfg in configs().items():
    fn = jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, config=cfg))
    try:
      out = np.asarray(fn(a, b).astype(jnp.float32))
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    errors[name] = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    cases[name] = (fn, (a, b))
  med = timing.interleaved_median_ms(cases, rounds=args.rounds, iterations=args.iterations)
  flops = 2 * args.m * args.k * args.n
  rows = []
  for name, ms in med.items():
    rows.append(dict(case=name, ms=ms, tflops=flops / ms / 1e9,
                     x_no_cluster=ms / med.get("no cluster", float("nan")),
                     rel_err=errors.get(name)))
    print(f"{name:28s} {ms:.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s  "
          f"x no-cluster {rows[-1]['x_no_cluster']:.3f}  rel err {errors.get(name)}", flush=True)
  with open(os.path.join(args.out_dir, "probe_multicast.json"), "w") as f:
    json.dump(dict(m=args.m, k=args.k, n=args.n, device=jax.devices()[0].device_kind,
                   rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
