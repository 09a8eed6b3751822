"""Does the gated pair's in-place ring keep its aliased operand inside loops? (GPU machine)

  python3 scripts/probe_in_place_loops.py OUT_DIR

Qwen3-30B down's EP=8 shard 0 forward on routed sizes (swap runs, the in-place
ring finds no work and must hand swap's output through), over two inputs under
``lax.map`` (also with ``lax.optimization_barrier`` on each call's output) and
``vmap``, with and without the barriers around the in-place kernel's aliased
operand and output (``mosaic_fwd_ring.BARRIERS``); prints how many rows differ from the unbatched call and writes
the compiled HLO of the two ``lax.map`` cases to OUT_DIR (run it again under
``XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=false`` to test whether that
pass writes the ring's output straight into the stacked result; v46b-d).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ragdot import bench
from ragdot.backends import mosaic_fwd as mf
from ragdot.backends import mosaic_fwd_ring


def main() -> None:
  out_dir = sys.argv[1]
  os.makedirs(out_dir, exist_ok=True)
  m, k, n, g = 32768, 768, 2048, 128
  s = bench.Shape("t", m, k, n, g, ep=8)
  gs, go, local = jnp.asarray(bench.routed_group_sizes(s)), jnp.int32(0), g // 8
  config = bench.dispatch_choice("fwd", s).config
  print("config", config, flush=True)
  kx, kw = jax.random.split(jax.random.key(3))
  xs = jax.random.normal(kx, (2, m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (local, k, n), jnp.bfloat16)
  want = None
  tag = "dsf_off" if "dynamic_slice_fusion=false" in os.environ.get("XLA_FLAGS", "") else "default"
  for barriers in (True, False):
    mosaic_fwd_ring.BARRIERS = barriers
    # fresh functions for each setting: jit caches traces by the function object
    f = lambda x: mf.gmm(x, w, gs, go, transpose_rhs=False, out_dtype=x.dtype, config=config)
    fb = lambda x: lax.optimization_barrier(f(x))
    if want is None:
      want = np.stack([np.asarray(jax.jit(f)(xs[i])) for i in range(2)])
    cases = [("map", lambda xs: lax.map(f, xs)),
             ("map+user_barrier", lambda xs: lax.map(fb, xs)), ("vmap", jax.vmap(f))]
    for case, fn in cases:
      name = f"{case}/{'kernel_barriers' if barriers else 'none'}"
      compiled = jax.jit(fn).lower(xs).compile()
      if case.startswith("map"):
        with open(os.path.join(out_dir, f"hlo_{tag}_{name.replace('/', '_')}.txt"), "w") as fh:
          fh.write(compiled.as_text())
      got = np.asarray(compiled(xs))
      bad = (got.view(np.uint16) != want.view(np.uint16)).any(axis=2).sum()
      print(f"{tag:8s} {name:34s} rows differing from the unbatched call: {int(bad)} of {2 * m}",
            flush=True)


if __name__ == "__main__":
  main()
