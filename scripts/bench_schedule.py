"""Device time of the schedule kernels alone (GPU machine), per program size.

  python3 scripts/bench_schedule.py [--elements 1024 2048 4096 8192]

For the forward / dX schedule (``triton_schedule.build``) of a few call
shapes (training and decode rows, G = 8 / 128 / 256, with and without a
group_offset) prints the CUPTI time of one launch for each ``elements`` value,
and the dW bounds kernel once.  Inputs: top-k routed group sizes.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

from ragdot import bench
from ragdot.backends import triton_schedule as ts

CASES = [  # m, G, local groups, offset, block_m
    (32768, 128, 128, None, 128),
    (32768, 128, 16, 0, 128),
    (32768, 256, 256, None, 128),
    (16384, 8, 8, None, 128),
    (512, 128, 128, None, 64),
]


def _us(fn, *args) -> float:
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*args))
  _, times = profiler.measure(fn, iterations=20)(*args)
  return 1e3 * float(statistics.median(times))


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--elements", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
  args = p.parse_args()
  for m, g, local, offset, bm in CASES:
    sizes = jnp.asarray(bench.routed_group_sizes(bench.Shape("s", m, 1, 1, g, top_k=min(8, g))))
    go = None if offset is None else jnp.int32(offset)
    cells = []
    for e in args.elements:
      f = jax.jit(lambda s, o, e=e: ts.build(s, o, m=m, num_local=local, block_m=bm, elements=e))
      cells.append(f"{e}: {_us(f, sizes, go):.2f} us ({ts.padded_tiles(m, bm, local, e) // ts.tile_block(local, e)} programs)")
    fb = jax.jit(lambda s, o: ts.build_bounds(s, o, m=m, num_local=local, block_m=64))
    print(f"m={m} G={g} local={local} offset={offset} bm={bm}: " + ", ".join(cells)
          + f"; bounds {_us(fb, sizes, go):.2f} us", flush=True)


if __name__ == "__main__":
  main()
