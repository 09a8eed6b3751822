"""The dW ring's side buffers gathered by one Pallas-Triton kernel.

``gather(lhs, rhs, starts, ends)`` returns what ``mosaic_dw.side_buffers``
returns (each group's <= 14 rows outside its 8-aligned interior, zero-padded to
16 rows a group, of lhs and of rhs), bitwise, in one launch instead of an index
computation and two XLA gathers.  Those wrote 15-75 MB at a third of the copy
rate on the H200: 3.0% of Qwen3-30B gate_up's dW time, 4.6% of down's
(docs/performance.md v30e).

A group's side rows are two runs: its head ``[start, ceil8(start))`` and its
tail ``[floor8(end), end)`` (clipped so that they do not overlap).  Each
program reads two 16-row windows of one column block, the first at ``start``
(kept where the output row is a head row) and the second placed so that the
tail lands right after the head, and stores their blend: no gather, only
masked loads of contiguous rows.

Like ``triton_schedule``, this module holds Triton lowering only; the dW
kernel reaches it through ``ragdot.backends.side_rows_kernel`` (compiled GPU
calls only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ragdot.backends import mosaic_dw
from ragdot.manual_axes import match_varying, out_struct

SIDE_ROWS = mosaic_dw._SIDE_ROWS  # rows per group in the side buffers  # pylint: disable=protected-access
_MAX_COLS = 256  # columns per program


def column_block(width: int) -> int:
  """Columns per program for an operand ``width`` columns wide: the largest
  power of two up to ``_MAX_COLS`` that is not wider than the operand."""
  if width < 1:
    raise ValueError(f"width must be >= 1, got {width}")
  return min(_MAX_COLS, 1 << (width.bit_length() - 1))


def _kernel(starts_ref, ends_ref, lhs_ref, rhs_ref, side_lhs_ref, side_rhs_ref):
  j, c = pl.program_id(0), pl.program_id(1)
  start = plgpu.load(starts_ref.at[j])
  end = plgpu.load(ends_ref.at[j])
  heads, tail_start, tails = mosaic_dw.side_runs(start, end)
  t = lax.broadcasted_iota(jnp.int32, (SIDE_ROWS, 1), 0)
  in_head = t < heads
  in_tail = (t >= heads) & (t < heads + tails)
  for src, dst in ((lhs_ref, side_lhs_ref), (rhs_ref, side_rhs_ref)):
    width = src.shape[1]
    cols = column_block(width)
    c0 = c * cols

    @pl.when(c0 < width)
    def _(src=src, dst=dst, width=width, cols=cols, c0=c0):
      ok = (c0 + lax.broadcasted_iota(jnp.int32, (1, cols), 1)) < width
      zero = jnp.zeros((), src.dtype)
      head = plgpu.load(src.at[pl.ds(start, SIDE_ROWS), pl.ds(c0, cols)],
                        mask=in_head & ok, other=zero)
      # Row t of this window is tail row t - heads (tail_start - heads >= start >= 0).
      tail = plgpu.load(src.at[pl.ds(tail_start - heads, SIDE_ROWS), pl.ds(c0, cols)],
                        mask=in_tail & ok, other=zero)
      plgpu.store(dst.at[pl.ds(j * SIDE_ROWS, SIDE_ROWS), pl.ds(c0, cols)],
                  jnp.where(in_head, head, tail), mask=ok)


def gather(lhs: jax.Array, rhs: jax.Array, starts: jax.Array, ends: jax.Array, *,
           interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """The side buffers of ``mosaic_dw.side_buffers``: ``[g * 16, k]`` of lhs
  ``[m, k]`` and ``[g * 16, n]`` of rhs ``[m, n]``, for the groups' rows
  ``[starts, ends)`` (int32[g], ``0 <= starts <= ends <= m``).  ``m`` must be at
  least 16 (the dW kernel pads smaller calls to a row block first)."""
  (m, k), (m_rhs, n) = lhs.shape, rhs.shape
  g = starts.shape[0]
  if m != m_rhs or m < SIDE_ROWS:
    raise ValueError(f"lhs and rhs need the same rows, at least {SIDE_ROWS}:"
                     f" got lhs {lhs.shape}, rhs {rhs.shape}")
  if ends.shape != (g,):
    raise ValueError(f"starts and ends must both be [g], got {starts.shape}, {ends.shape}")
  if g == 0:
    return jnp.zeros((0, k), lhs.dtype), jnp.zeros((0, n), rhs.dtype)
  starts, ends, lhs, rhs = match_varying(starts.astype(jnp.int32), ends.astype(jnp.int32),
                                         lhs, rhs)
  programs = max(pl.cdiv(k, column_block(k)), pl.cdiv(n, column_block(n)))
  return pl.pallas_call(
      _kernel,
      out_shape=(out_struct((g * SIDE_ROWS, k), lhs.dtype, lhs),
                 out_struct((g * SIDE_ROWS, n), rhs.dtype, rhs)),
      grid=(g, programs),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="ragdot_side_rows",
  )(starts, ends, lhs, rhs)
