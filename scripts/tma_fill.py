"""A write-only Mosaic GPU kernel: fills a 2-D array with a constant by TMA stores.

Used by ``scripts/dw_floors.py`` as the write floor of the dW kernel: it writes
through the same path as the kernels' epilogues (an SMEM tile sent by
``cp.async.bulk.tensor`` stores), with no loads and no math, so its time for an
output's bytes is the least any of our kernels can spend writing them.  (XLA's
bf16 fill wrote at 1.70 TB/s on the H200 in 27e, slower than the dW kernel's own
writes, so it is no floor.)

  fill = tma_fill((rows, cols), jnp.bfloat16)   # a jitted () -> [rows, cols]
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ragdot.backends import sm90


def tma_fill(shape: tuple[int, int], dtype: Any, *, block: tuple[int, int] = (64, 256),
             num_ctas: int | None = None, in_flight: int = 8, value: float = 1.5,
             interpret: bool = False) -> Callable[[], jax.Array]:
  """A jitted function of no arguments returning ``full(shape, value, dtype)``.

  ``shape`` must be a multiple of ``block`` in each dim (the dW outputs of the
  training shapes are).  A persistent grid of ``num_ctas`` programs (default:
  the device's SM count) stores the blocks round-robin, keeping at most
  ``in_flight`` stores outstanding per program.
  """
  rows, cols = shape
  br, bc = block
  if rows % br or cols % bc:
    raise ValueError(f"shape {shape} is not a multiple of block {block}")
  if num_ctas is None:
    num_ctas = 4 if interpret else sm90.device_sm_count()
  grid_c = cols // bc
  num_blocks = rows // br * grid_c

  def body(out_gmem, buf):
    buf[...] = jnp.full(buf.shape, value, buf.dtype)
    plgpu.commit_smem()
    cta = lax.axis_index("sm")

    @pl.loop(cta, num_blocks, step=num_ctas)
    def _(b):
      r, c = b // grid_c, b % grid_c
      plgpu.copy_smem_to_gmem(buf, out_gmem.at[pl.ds(r * br, br), pl.ds(c * bc, bc)])
      plgpu.wait_smem_to_gmem(in_flight, wait_read_only=True)

    plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(shape, dtype),
      scratch_types=[plgpu.SMEM(block, dtype)],
      grid=(num_ctas,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return jax.jit(kernel)
