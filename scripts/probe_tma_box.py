"""Do TMA stores clip a box that runs past the end of a row? (GPU machine; a probe)

  python3 scripts/probe_tma_box.py [--interpret]

25c found the ring forward writing zeros into the first 64 columns of the row
after a 1-row store whose 128 columns run past n (the zeros of the weight
columns past n, which TMA loads as zeros).  This stores a (rows, width) box of
sevens at column ``col`` of an output whose other elements were first stored
as ones, and reports which elements outside the box's in-bounds part changed:

  2-D out (16, 960): boxes of 1, 2 and 8 rows x 128 columns at column 896
     (64 columns past n); spill = out[row + rows, 0:64] is 7;
  3-D out (2, 72, 64): a (16, 64) box at rows 64..79 of expert 0 (8 rows
     past k = 72, the full row width); spill = out[1, 0:8] is 7;
  the same 2-D cases with the 1-row box split into 64-column pieces, each
     stored only where it starts before n (the fix in ``_store_rows``).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def _kernel(out_shape, box, dst, interpret, pieces=False):
  """A kernel: ones over all of out (64-column boxes of 8 rows), then the
  ``box`` of sevens at ``dst`` (an index tuple of ints, last two are row, col)."""
  rows, width = box
  n = out_shape[-1]
  lead = out_shape[:-2]

  def body(dst_gmem, out_gmem):
    def scope(ones, sevens):
      ones[...] = jnp.ones(ones.shape, ones.dtype)
      sevens[...] = jnp.full(sevens.shape, 7, sevens.dtype)
      plgpu.commit_smem()
      for idx in np.ndindex(*lead):
        ref = out_gmem.at[idx] if lead else out_gmem
        for r in range(0, out_shape[-2], 8):
          for c in range(0, n, 64):
            plgpu.copy_smem_to_gmem(ones, ref.at[pl.ds(r, 8), pl.ds(c, 64)])
      plgpu.wait_smem_to_gmem(0)
      ref = out_gmem.at[dst[:-2]] if lead else out_gmem
      # (dynamic, as in the kernels: a static slice past the end is refused)
      row, col = dst_gmem[0], dst_gmem[1]
      if pieces:
        for j in range(0, width, 64):
          pl.when(col + j < n)(lambda j=j: plgpu.copy_smem_to_gmem(
              sevens.at[:, pl.ds(j, 64)], ref.at[pl.ds(row, rows), pl.ds(col + j, 64)]))
      else:
        plgpu.copy_smem_to_gmem(sevens, ref.at[pl.ds(row, rows), pl.ds(col, width)])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM((8, 64), jnp.bfloat16),
                  plgpu.SMEM((rows, width), jnp.bfloat16))

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
                      grid=(1,), grid_names=("x",),
                      interpret=plgpu.InterpretGPUParams() if interpret else None)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--interpret", action="store_true")
  args = p.parse_args()
  cases = [((16, 960), (rows, 128), (3, 896), False) for rows in (1, 2, 8)]
  cases += [((2, 72, 64), (16, 64), (0, 64, 0), False)]
  cases += [((16, 960), (1, 128), (3, 896), True)]
  for out_shape, box, dst, pieces in cases:
    run = _kernel(out_shape, box, dst, args.interpret, pieces)
    out = np.asarray(run(jnp.asarray(dst[-2:], jnp.int32)).astype(jnp.float32))
    expect = np.ones(out_shape, np.float32)
    sl = tuple(slice(d, d + 1) for d in dst[:-2]) + (
        slice(dst[-2], dst[-2] + box[0]), slice(dst[-1], dst[-1] + box[1]))
    expect[sl] = 7
    wrong = np.argwhere(out != expect)
    print(f"out {out_shape} box {box} at {dst}{' in 64-column pieces' if pieces else ''}: "
          f"{len(wrong)} elements outside the box changed"
          f"{', e.g. ' + str(wrong[:4].tolist()) if len(wrong) else ''}", flush=True)


if __name__ == "__main__":
  main()
