"""Every kernel of one ragdot call with its CUPTI time (GPU machine).

  python3 scripts/list_kernels.py [--presets training ep] [--ops fwdbwd] [--names ragdot local-rows]

For each shape and op, the bench's candidate functions named by ``--names``
(the automatic choice is "ragdot", the dense reference "dense"; EP shapes have "masked" and
"local-rows"), on the bench's inputs: one line per kernel of one call, then
the sum.  Shows the small fixed costs (casts, reductions, schedules) next to
the matmul kernels.
"""

from __future__ import annotations

import argparse

import jax

from ragdot import bench


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--presets", nargs="+", default=["training", "ep"])
  p.add_argument("--ops", nargs="+", default=["fwdbwd"])
  p.add_argument("--names", nargs="+", default=["ragdot", "local-rows", "dense"])
  args = p.parse_args()
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  for s in [s for name in args.presets for s in bench.PRESETS[name]]:
    sizes, (x, w, dy, gs) = bench.shape_inputs(s)
    for op in args.ops:
      fns = (bench._ep_candidates(op, s, None, sizes) if s.ep > 1  # pylint: disable=protected-access
             else bench._candidates(op, s, None))  # pylint: disable=protected-access
      for name in args.names:
        if name not in fns:
          continue
        f = jax.jit(fns[name])
        jax.block_until_ready(f(x, w, dy, gs))
        _, per_iter = profiler.measure(f, aggregate=False, iterations=3)(x, w, dy, gs)
        kernels = per_iter[-1]
        total = sum(t for _, t in kernels)
        small = sum(t for _, t in kernels if t < 0.02)
        print(f"{s.name} {op} {name}: {len(kernels)} kernels, {total * 1e3:.1f} us"
              f" ({small * 1e3:.1f} us in kernels under 20 us)", flush=True)
        for k, t in kernels:
          print(f"    {t * 1e3:8.1f} us  {k}", flush=True)


if __name__ == "__main__":
  main()
