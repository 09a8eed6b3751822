"""The forward / dX ring on clusters of two CTAs that share one weight block by
TMA multicast (``MosaicFwdConfig(ring=True, cluster_pairs=True)``;
``mosaic_fwd_ring.gmm`` calls here).

Why: on Qwen3-30B down the ring runs its L2 at 87-93% of peak and the tensor
pipe at 74-77% (docs/performance.md v22f); each CTA step reads a 128 x 64 lhs
block and a 64 x 256 weight block from L2.  When the two CTAs of a cluster
take two row tiles of one group, the same weight block feeds both: each CTA
loads half of it and multicasts it to both, so a CTA reads 16 + 16 KB from L2
per step instead of 16 + 32.

Schedule (``pair_tiles``): a group's row tiles in twos; a group with an odd
count leaves its last tile (usually its short tail) to pair with another
group's leftover, each CTA then loading its own weight block; an odd total
leaves one tile that both CTAs of the last pair compute, only the first
storing it.  Items are (pair, n tile), pair-major; cluster ``c`` takes items
``c + j * clusters``.

Protocol: the ring of ``mosaic_fwd_ring`` (a producer and two consumer
warpgroups per CTA), with ``consumed`` a cluster barrier: a slot is refilled
only once the consumers of both CTAs released it, since the partner's
multicast writes into this CTA's slot too.  Both CTAs walk the same items and
k steps, so the two rings stay in step.  The rows outside a shard's window
are written by the consumers after the ring (no producer zeros); no folded
tails.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ragdot import backends
from ragdot.backends import mosaic_fwd as mf
from ragdot.backends import mosaic_fwd_ring as mr
from ragdot.backends import sm90
from ragdot.manual_axes import make_varying, match_varying, out_struct, varying_axes

_ROWS = 128
_HALF = _ROWS // 2


def pair_tiles(tiles: jax.Array, num_tiles: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Orders row tiles so that tiles ``2p`` and ``2p + 1`` form pair ``p``.

  Args:
    tiles: int32[4, T], ``metadata.flat_schedule``'s rows (group, row0,
      row_start, row_end), ordered by group, then row.
    num_tiles: int32 scalar, the real tiles.

  Returns ``(tiles int32[4, T + 1], num_pairs)``: first every group's tiles but
  the last of an odd count, in order (so pairs fall within a group), then
  those leftover tiles; with an odd total, entry ``num_tiles`` repeats the
  last tile with no rows to store (``row_start == row_end``).
  """
  t_max = tiles.shape[1]
  group = tiles[0]
  t = jnp.arange(t_max, dtype=jnp.int32)
  real = t < num_tiles
  prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), group[:-1]])
  nxt = jnp.concatenate([group[1:], jnp.full((1,), -1, jnp.int32)])
  first = lax.cummax(jnp.where(real & (prev != group), t, 0))
  last = real & ((t + 1 >= num_tiles) | (nxt != group))
  last_idx = lax.cummin(jnp.where(last, t, t_max), reverse=True)
  count = last_idx - first + 1
  leftover = real & (count % 2 == 1) & (t == last_idx)
  perm = jnp.argsort(jnp.where(real, leftover.astype(jnp.int32), 2), stable=True)
  out = jnp.concatenate([tiles[:, perm], jnp.zeros((4, 1), jnp.int32)], axis=1)
  lone = out[:, jnp.maximum(num_tiles - 1, 0)]
  lone = lone.at[2].set(lone[1]).at[3].set(lone[1])
  pad = (jnp.arange(t_max + 1) == num_tiles) & (num_tiles % 2 == 1)
  out = jnp.where(pad[None, :], lone[:, None], out)
  return out, pl.cdiv(num_tiles, 2)


def _body(tiles_gmem, scal_gmem, lhs_gmem, rhs_gmem, out_gmem, *, m: int, k: int, n: int,
          cfg: mf.MosaicFwdConfig, transpose_rhs: bool, num_clusters: int):
  bn, bk, stages, cn = cfg.block_n, cfg.block_k, cfg.num_stages, cfg.epilogue_n
  grid_n, k_steps = pl.cdiv(n, bn), pl.cdiv(k, bk)
  max_tiles = tiles_gmem.shape[0] // 4
  num_pairs, lo, hi, za, zb, num_zero_work, _ = mf._work_counts(scal_gmem, grid_n)
  num_work = num_pairs * grid_n
  b_shape = (bn, bk) if transpose_rhs else (bk, bn)
  cl, rank = lax.axis_index("cluster_grid"), lax.axis_index("cluster")
  my_items = pl.cdiv(jnp.maximum(num_work - cl, 0), num_clusters)
  dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype

  scratch = dict(
      a_smem=plgpu.SMEM((stages, _ROWS, bk), dtype, transforms=sm90.swizzled(bk, dtype)),
      b_smem=plgpu.SMEM((stages, *b_shape), dtype, transforms=sm90.swizzled(b_shape[1], dtype)),
      produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      # Both CTAs' consumers release a slot before either producer refills it.
      consumed=plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=2,
                                    num_barriers=stages),
      o_smem=plgpu.SMEM((2, _HALF, cn), out_dtype),
  )

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(a_smem, b_smem, produced, consumed, o_smem):
    wg = lax.axis_index("wg")

    def tile_of(w):
      """(n tile, group, shared weight block, row0, row_start, row_end) of
      this CTA's tile in item w."""
      p, ni = lax.div(w, grid_n), lax.rem(w, grid_n)
      t = 2 * p + rank
      grp = tiles_gmem[t]
      shared = grp == tiles_gmem[2 * p + 1 - rank]
      row0 = pl.multiple_of(tiles_gmem[max_tiles + t], 8)
      return (ni, grp, shared, row0, tiles_gmem[2 * max_tiles + t],
              tiles_gmem[3 * max_tiles + t])

    works = functools.partial(mr.for_each_item, my_items, cl, num_clusters, k_steps)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def load(w, step0):
        ni, grp, shared, row0, _, _ = tile_of(w)

        @pl.loop(0, k_steps)
        def _(kk):
          step = step0 + kk
          slot = mr.free_slot(consumed, step, stages)
          cols = pl.ds(kk * bk, bk)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[pl.ds(row0, _ROWS), cols], a_smem.at[slot],
                                  produced.at[slot])
          blk = mr.rhs_block(rhs_gmem, grp, ni, cols, bn, transpose_rhs)
          # Shared: each CTA loads half the block and multicasts it to both.
          pl.when(shared)(lambda: plgpu.copy_gmem_to_smem(
              blk, b_smem.at[slot], produced.at[slot], collective_axes="cluster"))
          pl.when(~shared)(lambda: plgpu.copy_gmem_to_smem(blk, b_smem.at[slot],
                                                           produced.at[slot]))

      works(load)
      mr.drain(consumed, my_items * k_steps, stages)

    @pl.when(wg < 2)
    def _consumers():
      plgpu.set_max_registers(232, action="increase")
      my_smem = o_smem.at[wg]

      def compute(w, step0):
        ni, _, _, row0, row_start, row_end = tile_of(w)
        hs = row0 + wg * _HALF
        s, c = mf._overlap(row_start, row_end, hs, hs + _HALF)

        def acc_scope(acc_ref):
          def mma(slot):
            b = b_smem.at[slot]
            plgpu.wgmma(acc_ref, a_smem.at[slot].at[pl.ds(wg * _HALF, _HALF)],
                        b.transpose((1, 0)) if transpose_rhs else b)

          mr.consume_item(produced, consumed, step0, k_steps, stages, mma, in_flight=1)
          return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((_HALF, bn), jnp.float32))

        def chunk(ci, col):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          my_smem[...] = sm90.column_chunk(acc, ci, cn).astype(out_dtype)
          plgpu.commit_smem()
          mf._store_rows(my_smem, out_gmem, s - hs, s, c, col, max_rows=min(_HALF, m),
                         width=cn)

        pl.when(c > 0)(lambda: mf._for_each_chunk(cfg, n, ni, chunk))

      works(compute)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      # Rows outside the shard's window, after the ring, over every CTA.
      cta = cl * 2 + rank
      zero_item, num_zero_items = mr._zero_items(cta, 2 * num_clusters, num_work,
                                                 num_zero_work, 0)

      @pl.loop(0, num_zero_items)
      def _zeros(j):
        blk, ni = mf._zero_item(zero_item(j), grid_n, za, zb)
        mf._zero_fill_once(my_smem, j == 0)
        mf._store_zero_rows(my_smem, out_gmem, cfg, n, m, ni, blk * _ROWS + wg * _HALF,
                            _HALF, lo, hi)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_offset: jax.Array | None,
        *, transpose_rhs: bool, out_dtype: Any, config: mf.MosaicFwdConfig,
        interpret: Any = False) -> jax.Array:
  """``mosaic_fwd.gmm`` for a ``cluster_pairs`` config (checked by
  ``mosaic_fwd.gmm``: supported dtypes and alignments, non-empty operands,
  m >= 128, a config that fits SMEM)."""
  m, k = lhs.shape
  g_local = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tiles, scalars = backends.flat_schedule(
      group_sizes, group_offset, m=m, num_local=g_local, block_m=_ROWS,
      use_kernel=config.schedule_kernel, interpret=bool(interpret))
  tiles, num_pairs = pair_tiles(tiles.reshape(4, -1), scalars[0])
  tiles, scalars = tiles.reshape(-1), scalars.at[0].set(num_pairs)
  tiles, scalars, lhs, rhs = match_varying(tiles, scalars, lhs, rhs)
  num_ctas = mf._num_sms(config, bool(interpret))
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  kernel = plgpu.kernel(
      functools.partial(_body, m=m, k=k, n=n, cfg=config, transpose_rhs=transpose_rhs,
                        num_clusters=num_ctas // 2),
      out_type=out_struct((m, n), out_dtype, lhs),
      grid=(num_ctas // 2,),
      grid_names=("cluster_grid",),
      cluster=(2,),
      cluster_names=("cluster",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret if interpret else None,
  )
  return make_varying(kernel(tiles, scalars, lhs, rhs), varying_axes(lhs))
