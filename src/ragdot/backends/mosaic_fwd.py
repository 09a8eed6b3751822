"""Forward / dX grouped matmul as a Pallas Mosaic GPU kernel (Hopper, sm90).

``gmm(lhs[m, k], rhs[g_local, k, n], group_sizes[G], group_offset) -> out[m, n]``
(``rhs[g_local, n, k]`` when ``transpose_rhs``: the dX mode, read in place and
fed to wgmma through a transposed SMEM view).

Rows of local group ``j`` (global group ``group_offset + j``) get
``lhs_rows @ rhs[j]``; every other row of ``out`` is exactly zero.

Design:
* A persistent grid of ``num_sms`` CTAs walks a flat work list with
  ``plgpu.nd_loop``: first the *zero tiles* (row blocks, or parts of them,
  outside the local row window, stored from a zeroed SMEM buffer), then the
  *compute tiles* (``metadata.tile_schedule`` entries x n tiles: group-aligned
  row windows, so only a group's last tile is partial; on a GPU the schedule
  comes from one ``triton_schedule`` kernel).  Both counts
  are device scalars, so the loop length is dynamic and nothing syncs to host.
  Zero tiles come first in every CTA's sequence, so its staging buffer is
  zeroed once.  Their async TMA stores are not hidden under the compute: on
  the EP=8 shard the kernel takes the local compute's time plus the zero
  rows' time (51 + 26 us, H200, 2026-11-30), also with the zeros issued by
  the producer warpgroup, and 1.23x that with half of the CTAs taking their
  compute tiles first (zero stores beside the compute slow it down more than
  they save).
* Compute tile: ``emit_pipeline`` streams (block_m, block_k) lhs and
  (block_k, block_n) rhs blocks through ``num_stages`` TMA buffers into wgmma
  with an f32 register accumulator.  The lhs window starts at the tile's
  ``row0`` (a multiple of 8, the TMA row granule) and may hold rows of a
  neighbouring group: only rows ``[row_start, row_end)`` are stored, as a
  ladder of power-of-two-row TMA stores, so other groups' rows are never
  touched.
* Partial blocks along m, k or n rely on TMA: out-of-bounds loads are zero
  filled, out-of-bounds stores are dropped.
* ``num_compute_wgs=2``: a warp-specialized variant (one TMA producer
  warpgroup, two consumer warpgroups each owning 64 rows of a 128-row tile and
  sharing the rhs block; with ``split_n``, both consumers share a 64-row tile
  and each owns half of its columns).  Options (``MosaicFwdConfig``): a consumer whose 64
  rows hold none of the tile's rows may skip its wgmmas, and one pipeline may
  run through all of a CTA's tiles.
* ``epilogue_split``: the f32 accumulator leaves through an SMEM staging buffer
  of block_n / split columns (per compute warpgroup), chunk after chunk, each
  chunk waiting until the previous chunk's TMA stores have read the buffer.
  This is what lets 2 warpgroups x 128x256 x bk64 run 4 stages (192 KiB of
  pipeline + 32 KiB of staging instead of 64 KiB).

The config (``MosaicFwdConfig``), its default, sweep and fitting live in
``mosaic_fwd_config`` (re-exported here); the ring and swap kernels in
``mosaic_fwd_ring`` and ``mosaic_fwd_swap``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ragdot.manual_axes import make_varying, match_varying, out_struct, varying_axes
from ragdot import backends
from ragdot import scales
from ragdot import validate
from ragdot.backends import sm90
from ragdot.backends.mosaic_fwd_config import (  # noqa: F401  (re-exported)
    MIN_SWAP_ROWS,
    SWAP_ROWS,
    MosaicFwdConfig,
    _WG_ROWS,
    _chains_tiles,
    decode_rows,
    default_config,
    fit_config,
    fit_rows_per_group,
    for_one_byte,
    k_tile,
    gpu_sweep_configs,
    one_tile_groups,
    resolve_producer_zeros,
    row_major_ring,
    shard_keeps_swap,
    stage_scales,
    swap_rows_for_mean,
    tail_fold_groups,
    weight_only_config,
    weight_only_decode,
    weight_only_tile_rows,
)

_IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_OUT_DTYPES = _IN_DTYPES + (jnp.dtype(jnp.float32),)
# Native fp8: 8-bit wgmma reads both operands K-major, as rhs laid out [g, n, k]
# is; rhs [g, k, n] is first copied to that layout (an XLA transpose, 1 byte an
# element: less traffic than the bf16 copies the other backends take).
FP8_DTYPES = validate.FP8_DTYPES


def takes_fp8(dtype: Any) -> bool:
  """Whether the kernel takes operands of ``dtype`` natively: e4m3 / e5m2."""
  return jnp.dtype(dtype) in FP8_DTYPES


def takes_weight_only(lhs_dtype: Any, rhs_dtype: Any) -> bool:
  """Whether the kernel takes bf16 / f16 rows with e4m3 / e5m2 weights as they
  are (W8A16: the swap kernel widens each weight slice, in registers or
  through SMEM, ``MosaicFwdConfig.widen_staging``), for some calls: see
  ``weight_only_refusal``."""
  return jnp.dtype(lhs_dtype) in _IN_DTYPES and jnp.dtype(rhs_dtype) in FP8_DTYPES


def weight_only_refusal(lhs_dtype: Any, rhs_dtype: Any, out_dtype: Any) -> str | None:
  """Why the kernel refuses a call of ``lhs_dtype`` rows with weights of
  ``rhs_dtype`` (a distinct dtype) writing ``out_dtype`` (None: it takes it,
  shapes aside, see ``unsupported_shape``; fewer than 16 rows are padded to
  16, the smallest swap tile)."""
  if not takes_weight_only(lhs_dtype, rhs_dtype):
    return (f"equal lhs/rhs dtypes or bf16/f16 rows with fp8 weights, got {jnp.dtype(lhs_dtype)}"
            f" and {jnp.dtype(rhs_dtype)}")
  if jnp.dtype(out_dtype).itemsize != 2:
    return (f"a bf16/f16 output with fp8 weights (its swap kernel's transposed stores),"
            f" got {jnp.dtype(out_dtype)}")
  return None


_INTERPRET_SMS = 4



def _check_supported(lhs, rhs, out_dtype, transpose_rhs) -> None:
  if lhs.dtype != rhs.dtype:
    reason = weight_only_refusal(lhs.dtype, rhs.dtype, out_dtype)
    if reason:
      raise NotImplementedError(f"mosaic gmm needs {reason}")
  if not takes_fp8(lhs.dtype) and jnp.dtype(lhs.dtype) not in _IN_DTYPES:
    raise NotImplementedError(
        f"mosaic gmm supports bf16/f16 inputs only, got {lhs.dtype}"
    )
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise NotImplementedError(
        f"mosaic gmm supports bf16/f16/f32 outputs only, got {out_dtype}"
    )
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  reason = unsupported_shape(lhs.shape[0], lhs.shape[1], n)
  if reason:
    raise NotImplementedError(f"mosaic gmm needs {reason}")


def _scale_blocks(lhs, rhs, rhs_scale, transpose_rhs: bool) -> tuple[int, int]:
  """(contracting rows, columns) of one block of a W8A16 call's ``rhs_scale``
  (rhs's layout); else NotImplementedError (not W8A16, a block not in whole
  64-row k steps) or ValueError (a shape or dtype that is no such scale)."""
  if lhs.dtype == rhs.dtype:
    raise NotImplementedError("mosaic gmm takes rhs_scale with fp8 weights beside 16-bit rows"
                              f" only, got {lhs.dtype} and {rhs.dtype}")
  rows, cols = scales.blocks(rhs_scale, rhs.shape, transpose_rhs)
  if rows % 64:
    raise NotImplementedError(f"mosaic gmm takes scale blocks of a multiple of 64 contracting"
                              f" rows (its k steps), got {rows}")
  return rows, cols


def _swap_scales(rhs_scale, rhs_shape, transpose_rhs: bool, block: tuple[int, int],
                 slice_cols: int) -> dict[str, Any]:
  """The swap kernel's scale arguments: ``rhs_scale`` as given (f32) where its
  blocks span whole consumer slices of ``slice_cols`` columns, else laid out
  per column (``[g, k // t, n]``, ``scale_block`` (t, 1))."""
  rows, cols = block
  if cols % slice_cols:
    return dict(rhs_scale=scales.kernel_scales(rhs_scale, rhs_shape, transpose_rhs),
                scale_block=(rows, 1))
  return dict(rhs_scale=rhs_scale.astype(jnp.float32), scale_block=block)


def unsupported_shape(m: int, k: int, n: int) -> str | None:
  """Why this kernel refuses lhs[m, k] -> out[m, n] (static; None: it takes it).

  Mosaic builds TMA descriptors on the swizzle-tiled views: rows in tiles of 8
  and 64 (128-byte) columns, checked only when lowering for the real GPU
  (interpret mode accepts more), so refuse what sm90 lowering rejects.
  """
  if k % 64 or n % 64:
    return f"k and n to be multiples of 64 (swizzled TMA tiles), got k={k}, n={n}"
  if m % 8 and m > 8:
    return f"m % 8 == 0 (TMA row tiles), got m={m}"
  return None


def _num_sms(config: MosaicFwdConfig, interpret: bool) -> int:
  if config.num_sms is not None:
    return config.num_sms
  if interpret:
    return _INTERPRET_SMS  # each simulated CTA is a CPU thread
  return config.ctas_per_sm * sm90.device_sm_count()


def _store_rows(src_smem, out_gmem, src_row, dst_row, count, col, *, max_rows: int,
                width: int) -> None:
  """Stores ``count`` (dynamic, 0..max_rows) rows src_smem[src_row:] -> out[dst_row:].

  TMA boxes are static, so the count is split into its binary digits: one
  predicated store of 2**i rows per set bit, largest first.  A 1-row box that
  may run past the output's last column goes out in 64-column pieces, each
  only where it starts before n: Mosaic sends a contiguous, unswizzled slice (one
  row) as a bulk copy clamped only at the end of the whole array, so its columns
  past n landed at the start of the next row (docs/performance.md v25c, v26;
  n is a multiple of 64, so no piece crosses it).
  """
  n = out_gmem.shape[-1]
  done = 0
  p = 1 << (max_rows.bit_length() - 1)
  while p >= 1:
    @pl.when((count & p) != 0)
    def _():
      src = src_smem.at[pl.ds(src_row + done, p)]
      dst_rows = pl.ds(dst_row + done, p)
      if p == 1 and n % width:
        for j in range(0, width, 64):
          pl.when(col + j < n)(functools.partial(
              plgpu.copy_smem_to_gmem, src.at[:, pl.ds(j, 64)],
              out_gmem.at[dst_rows, pl.ds(col + j, 64)]))
      else:
        plgpu.copy_smem_to_gmem(src, out_gmem.at[dst_rows, pl.ds(col, width)])
    done = done + (count & p)
    p //= 2


def _work_item(tiles_gmem, w, num_tiles, max_tiles: int, grid_n: int,
               cfg: MosaicFwdConfig):
  """(n tile, group, row0, row_start, row_end) of compute item w.

  Items go in ``plgpu.planar_snake`` order, except that the ring with strips of
  one row tile keeps plain row-major order (every n tile of a row tile in
  turn, no snake): the order its table entries were measured in.
  """
  if cfg.ring and cfg.grid_minor_dim == 0 and cfg.grid_tile_width == 1:
    ti, ni = lax.div(w, grid_n), lax.rem(w, grid_n)
  else:
    ti, ni = plgpu.planar_snake(
        w, (num_tiles, grid_n), cfg.grid_minor_dim, cfg.grid_tile_width
    )
  row0 = pl.multiple_of(tiles_gmem[max_tiles + ti], 8)
  return (ni, tiles_gmem[ti], row0, tiles_gmem[2 * max_tiles + ti],
          tiles_gmem[3 * max_tiles + ti])


def _lhs_spec(cfg: MosaicFwdConfig, row0, delay_release: int = 1):
  """The (block_m, block_k) lhs window at row ``row0`` (any multiple of 8)."""
  return plgpu.BlockSpec((pl.Element(cfg.block_m), cfg.block_k),
                         lambda ki: (row0, ki), delay_release=delay_release)


def _rhs_spec(cfg: MosaicFwdConfig, ni, transpose_rhs: bool, delay_release: int = 1):
  """The (block_k, block_n) rhs block of n tile ``ni``; (block_n, block_k) of
  rhs[g, n, k] in the dX mode."""
  bn, bk = cfg.block_n, cfg.block_k
  if transpose_rhs:
    return plgpu.BlockSpec((bn, bk), lambda ki: (ni, ki), delay_release=delay_release)
  return plgpu.BlockSpec((bk, bn), lambda ki: (ki, ni), delay_release=delay_release)


class _PipelinePhase:
  """``pipeline_state`` of one tile in a chain of warp-specialized pipelines.

  The pipeline compares its state with START (fill the stages first) and STOP
  (drain at the end); a CTA's only tile is both, which no single
  ``PipelinePipeline`` value can say, so the comparisons answer from two flags.
  """

  def __init__(self, first, last):
    self.first, self.last = first, last

  def __eq__(self, other):
    if other == plgpu.PipelinePipeline.START:
      return self.first
    if other == plgpu.PipelinePipeline.STOP:
      return self.last
    return jnp.logical_not(self.first | self.last)

  __hash__ = None


def _work_counts(scal_gmem, grid_n: int):
  """(num_tiles, lo, hi, za, zb, zero items, all items) from the metadata scalars."""
  num_tiles = scal_gmem[0]
  lo, hi, za, zb, num_zero = (scal_gmem[i] for i in range(1, 6))
  num_zero_work = num_zero * grid_n
  return num_tiles, lo, hi, za, zb, num_zero_work, num_zero_work + num_tiles * grid_n


def _zero_item(w, grid_n: int, za, zb):
  """(row block, n tile) of zero item w: blocks [0, za), then [zb, ...)."""
  zi, ni = lax.div(w, grid_n), lax.rem(w, grid_n)
  return jnp.where(zi < za, zi, zi - za + zb), ni


def _overlap(lo, hi, a, b):
  """Start and length of [max(lo, a), min(hi, b)) (length 0 when empty)."""
  start = jnp.maximum(lo, a)
  return start, jnp.maximum(jnp.minimum(hi, b) - start, 0)


def _outside_window(hs, he, lo, hi):
  """The pieces of rows [hs, he) below ``lo`` and at or above ``hi``."""
  return _overlap(hs, lo, hs, he), _overlap(hi, he, hs, he)


def _for_each_chunk(cfg: MosaicFwdConfig, n: int, ni, fn, wg=None) -> None:
  """Calls ``fn(c, col)`` for every epilogue chunk ``c`` of n tile ``ni``.

  ``col`` is the chunk's first output column.  Chunks that start at or past
  ``n`` (possible only in the last n tile) are skipped: their TMA box would lie
  wholly out of bounds.  With ``wg`` (``split_n``): only consumer ``wg``'s
  half of the chunks, ``c`` counted within that half.
  """
  cn = cfg.epilogue_n
  tail = n % cfg.block_n  # columns of the last n tile (0: a full tile)
  count = cfg.epilogue_split if wg is None else cfg.epilogue_split // 2
  first = 0 if wg is None else wg * count  # dynamic with wg: no static bound check
  for c in range(count):
    col = ni * cfg.block_n + (first + c) * cn
    if tail == 0 or (wg is None and c * cn < tail):
      fn(c, col)  # in bounds in every n tile
    else:
      pl.when(col < n)(functools.partial(fn, c, col))


def _store_zero_rows(zero_smem, out_gmem, cfg: MosaicFwdConfig, n: int, m: int, ni,
                     row_start, rows: int, lo, hi, chunks_wg=None) -> None:
  """Stores zeros from ``zero_smem`` (zeroed, ``rows`` rows) over the rows
  outside the shard's window [lo, hi) of the ``rows``-row block starting at
  ``row_start``, in every epilogue chunk of n tile ``ni`` (``chunks_wg``: only
  that consumer's chunks, with split_n)."""
  pieces = _outside_window(row_start, jnp.minimum(row_start + rows, m), lo, hi)

  def chunk(c, col):
    del c
    for start, count in pieces:
      _store_rows(zero_smem, out_gmem, 0, start, count, col, max_rows=min(rows, m),
                  width=cfg.epilogue_n)

  _for_each_chunk(cfg, n, ni, chunk, chunks_wg)


def _gmm_kernel_1wg(tiles_gmem, scal_gmem, lhs_gmem, rhs_gmem, out_gmem, *,
                    m: int, k: int, n: int, cfg: MosaicFwdConfig, transpose_rhs: bool):
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  grid_n = pl.cdiv(n, bn)
  k_steps = pl.cdiv(k, bk)
  max_tiles = tiles_gmem.shape[0] // 4
  max_rows = min(bm, m)
  out_dtype = out_gmem.dtype
  cn = cfg.epilogue_n
  num_tiles, lo, hi, za, zb, num_zero_work, total = _work_counts(scal_gmem, grid_n)

  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, cn), out_dtype))
  def _scope(o_smem):

    def zero_tile(w, first):
      blk, ni = _zero_item(w, grid_n, za, zb)
      _zero_fill_once(o_smem, first)
      _store_zero_rows(o_smem, out_gmem, cfg, n, m, ni, blk * bm, bm, lo, hi)

    def compute_tile(w):
      ni, grp, row0, row_start, row_end = _work_item(
          tiles_gmem, w, num_tiles, max_tiles, grid_n, cfg)

      def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            lambda _, lhs_smem, rhs_smem: _mma_step(acc_ref, lhs_smem, rhs_smem, transpose_rhs),
            grid=(k_steps,),
            in_specs=[_lhs_spec(cfg, row0), _rhs_spec(cfg, ni, transpose_rhs)],
            max_concurrent_steps=cfg.num_stages,
        )(lhs_gmem, rhs_gmem.at[grp])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))

      def chunk(c, col):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores read o_smem
        o_smem[...] = sm90.column_chunk(acc, c, cn).astype(out_dtype)
        plgpu.commit_smem()
        _store_rows(o_smem, out_gmem, row_start - row0, row_start,
                    row_end - row_start, col, max_rows=max_rows, width=cn)

      _for_each_chunk(cfg, n, ni, chunk)

    @plgpu.nd_loop((total,), collective_axes="sm")
    def _loop(info: plgpu.NDLoopInfo):
      (w,) = info.index
      is_zero = w < num_zero_work
      pl.when(is_zero)(lambda: zero_tile(w, info.local_index == 0))
      pl.when(jnp.logical_not(is_zero))(lambda: compute_tile(w - num_zero_work))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _zero_fill_once(smem, first, swizzle: int = 0) -> None:
  """Zeroes the staging buffer on this CTA's first zero item (``first``).

  A CTA's zero items run back to back (before its compute tiles here, after
  them in ``mosaic_fwd_ring``, which waits for the compute stores first), so a
  zero item that is not the first follows another one and the buffer still
  holds zeros: no refill, and no wait for in-flight stores, which only read it.
  ``swizzle``: the buffer's swizzle in bytes (0: none).
  """
  @pl.when(first)
  def _():
    zeros = jnp.zeros(smem.shape, smem.dtype)
    if swizzle:  # a swizzled buffer takes the zeros in its copy layout
      zeros = plgpu.layout_cast(zeros, plgpu.Layout.SMEM_GMEM_COPY(smem.shape, smem.dtype,
                                                                   swizzle))
    smem[...] = zeros
    plgpu.commit_smem()


def _mma_step(acc_ref, lhs_smem, rhs_smem, transpose_rhs: bool, delay_release: int = 1):
  # dX: rhs blocks arrive as (block_n, block_k) slices of rhs[g, n, k] and feed
  # wgmma through a transposed SMEM view (no transposed copy in HBM).
  rhs_op = rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem
  plgpu.wgmma(acc_ref, lhs_smem, rhs_op)
  # A step's buffers are refilled delay_release steps later: wait until at
  # most that many wgmmas are in flight.
  plgpu.wgmma_wait(delay_release)
  return acc_ref



def _gmm_kernel_2wg(tiles_gmem, scal_gmem, lhs_gmem, rhs_gmem, out_gmem, *,
                    m: int, k: int, n: int, cfg: MosaicFwdConfig, transpose_rhs: bool,
                    num_ctas: int):
  """Two consumer warpgroups (64 rows each, or half the columns each with
  ``split_n``) + one TMA producer warpgroup."""
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  hm = _WG_ROWS
  grid_n = pl.cdiv(n, bn)
  k_steps = pl.cdiv(k, bk)
  max_tiles = tiles_gmem.shape[0] // 4
  max_rows = min(hm, m)
  out_dtype = out_gmem.dtype
  cn = cfg.epilogue_n
  dr = cfg.delay_release
  chain = _chains_tiles(cfg, k)
  split = cfg.split_n
  acc_n = bn // 2 if split else bn  # accumulator columns per consumer
  guard = cfg.guard_last_stage and dr > 0 and not chain
  num_tiles, lo, hi, za, zb, num_zero_work, total = _work_counts(scal_gmem, grid_n)

  def make_pipeline(body, compute_context, row0=0, ni=0, state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_steps,),
        memory_registers=40,
        in_specs=[_lhs_spec(cfg, row0, dr), _rhs_spec(cfg, ni, transpose_rhs, dr)],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=cfg.num_stages,
        compute_context=compute_context,
        pipeline_state=state,
    )

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(ignore, ignore).get_allocations(lhs_gmem, rhs_gmem.at[0]),
      o_smem=plgpu.SMEM((2, hm, cn), out_dtype),
      # Consumers -> producer: a tile's last wgmma is done (see guard_last_stage).
      tile_done=plgpu.Barrier(num_arrivals=2),
      collective_axes="wg",
  )
  def _scope(allocs, o_smem, tile_done):
    wg = lax.axis_index("wg")
    my_smem = o_smem.at[wg]
    my_chunks = wg if split else None  # split_n: each consumer stores its own columns
    store = functools.partial(_store_rows, my_smem, out_gmem, max_rows=max_rows, width=cn)

    def zero_tile(w, first):
      # Each consumer zeroes its own 64-row half (split_n: its column half).
      blk, ni = _zero_item(w, grid_n, za, zb)
      _zero_fill_once(my_smem, first)
      _store_zero_rows(my_smem, out_gmem, cfg, n, m, ni, blk * bm + (0 if split else wg * hm),
                       hm, lo, hi, my_chunks)

    def compute_tile(w, state):
      ni, grp, row0, row_start, row_end = _work_item(
          tiles_gmem, w, num_tiles, max_tiles, grid_n, cfg)
      wg_rows = pl.ds(wg * hm, hm)
      hs = row0 + (0 if split else wg * hm)  # this consumer's first row

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((hm, acc_n), jnp.float32))
        def _acc(acc_ref):
          eval_pipeline(acc_ref)
          acc = acc_ref[...]  # waits for this consumer's last wgmma
          if guard:
            plgpu.barrier_arrive(tile_done)
          s, c = _overlap(row_start, row_end, hs, hs + hm)
          def chunk(ci, col):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores read it
            my_smem[...] = sm90.column_chunk(acc, ci, cn).astype(out_dtype)
            plgpu.commit_smem()
            store(s - hs, s, c, col)

          pl.when(c > 0)(lambda: _for_each_chunk(cfg, n, ni, chunk, my_chunks))

      def mma(_, lhs_smem, rhs_smem, acc_ref):
        if split:
          # The column offset is a whole number of 64-column swizzle tiles.
          cols = pl.ds(pl.multiple_of(wg * acc_n, acc_n), acc_n)
          rhs_half = rhs_smem.at[cols] if transpose_rhs else rhs_smem.at[:, cols]
          return _mma_step(acc_ref, lhs_smem, rhs_half, transpose_rhs, delay_release=dr)
        return _mma_step(acc_ref, lhs_smem.at[wg_rows], rhs_smem, transpose_rhs,
                         delay_release=dr)

      def idle(_, lhs_smem, rhs_smem, acc_ref):
        del lhs_smem, rhs_smem  # the stage is released untouched
        return acc_ref

      def run(body):
        make_pipeline(body, compute_context, row0, ni, state)(
            lhs_gmem, rhs_gmem.at[grp], allocations=allocs
        )

      if cfg.skip_empty_halves:
        # A consumer without rows in this tile walks the same pipeline (its
        # barrier arrivals are part of the protocol) with a body that issues no
        # wgmma.  The branch sits outside the k loop: a wgmma under a condition
        # inside the loop measured slower than no skip at all.
        empty = (wg < 2) & (hs >= row_end)
        pl.when(jnp.logical_not(empty))(lambda: run(mma))
        pl.when(empty)(lambda: run(idle))
      else:
        run(mma)
      # The producer moves on (to the next tile's loads) only once both
      # consumers' last wgmma of this tile is done with its stage.
      if guard:
        pl.when(wg == 2)(lambda: plgpu.barrier_wait(tile_done))

    @plgpu.nd_loop((total,), collective_axes="sm")
    def _loop(info: plgpu.NDLoopInfo):
      (w,) = info.index
      is_zero = w < num_zero_work
      pl.when(is_zero & (wg < 2))(lambda: zero_tile(w, info.local_index == 0))  # producer idles
      # Chained: this CTA's first compute tile fills the pipeline and its last
      # drains it (items of a CTA are w, w + num_ctas, ...).
      state = _PipelinePhase(w - num_ctas < num_zero_work,
                             w + num_ctas >= total) if chain else None
      pl.when(jnp.logical_not(is_zero))(lambda: compute_tile(w - num_zero_work, state))

    pl.when(wg < 2)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))


def _shard_swap_or_ring(lhs, rhs, group_sizes, group_offset, *, transpose_rhs: bool,
                        out_dtype, config: MosaicFwdConfig, interpret):
  """A shard call of a swap config with ``shard_ring_above``: swap while the
  shard's rows are at most that multiple of its fair share, else the row-major
  ring with producer zeros.  Both kernels are launched, one after the other on
  one output buffer (the second writes the first's in place); each reads the
  shard's rows off its schedule and the one not chosen exits at once (no host
  round trip, which a ``lax.cond`` takes)."""
  from ragdot.backends import mosaic_fwd_ring, mosaic_fwd_swap  # pylint: disable=g-import-not-at-top  (import this module)
  swap, ring = gated_pair_configs(config, lhs.dtype, out_dtype)
  run = dict(transpose_rhs=transpose_rhs, out_dtype=out_dtype, interpret=interpret)
  m, g_local = lhs.shape[0], rhs.shape[0]
  if (ring.smem_bytes(lhs.dtype, out_dtype) > ring.smem_budget()
      or m < mosaic_fwd_ring.ROWS + ring.tail_rows):  # (the ring's loads need that many rows)
    return mosaic_fwd_swap.gmm(lhs, rhs, group_sizes, group_offset, config=swap, **run)
  limit = shard_row_limit(m, g_local, group_sizes.shape[0], config.shard_ring_above)
  swap_run, ring_run = {}, {}
  if config.pair_schedule:
    swap_run["schedule"], ring_run["schedule"] = backends.flat_schedules(
        group_sizes, group_offset, m=m, num_local=g_local,
        tiles=((swap.swap_rows, swap.tail_rows), (mosaic_fwd_ring.ROWS, ring.tail_rows)),
        use_kernel=config.schedule_kernel, interpret=bool(interpret))
  out = mosaic_fwd_swap.gmm(lhs, rhs, group_sizes, group_offset, config=swap,
                            gate=mosaic_fwd_ring.RowGate(limit, above=False), **swap_run, **run)
  return mosaic_fwd_ring.gmm(lhs, rhs, group_sizes, group_offset, config=ring,
                             gate=mosaic_fwd_ring.RowGate(limit, above=True), into=out,
                             **ring_run, **run)


def gated_pair_configs(config: MosaicFwdConfig, dtype: Any, out_dtype: Any
                       ) -> tuple[MosaicFwdConfig, MosaicFwdConfig]:
  """The two kernels' configs of a gated shard call of swap ``config``: swap
  ungated (consumer-written zeros) and its row-major ring with producer zeros."""
  swap = dataclasses.replace(config, shard_ring_above=None, pair_schedule=False)
  ring = resolve_producer_zeros(dataclasses.replace(swap, producer_zeros=None), True, dtype,
                                out_dtype)
  return swap, ring


def shard_row_limit(m: int, g_local: int, num_groups: int, above: float) -> int:
  """The most rows a shard of ``g_local`` of ``num_groups`` groups in a call of
  ``m`` rows keeps swap for: ``above`` times its fair share ``m * g_local /
  num_groups``, rounded down."""
  return int(above * m * g_local / max(num_groups, 1))


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    transpose_rhs: bool,
    out_dtype: Any,
    precision: Any = None,
    interpret: Any = False,
    config: MosaicFwdConfig | None = None,
    rhs_scale: jax.Array | None = None,
) -> jax.Array:
  """Grouped matmul ``out[m, n]``; see the module docstring for semantics.

  Args:
    lhs: [m, k] bf16/f16, or e4m3 / e5m2 (then a [g_local, k, n] rhs is first
      copied to [g_local, n, k]: see ``FP8_DTYPES``; or, with a ``widen_rows``
      config, the rows are widened to bf16 instead).
    rhs: [g_local, k, n], or [g_local, n, k] when ``transpose_rhs``; lhs dtype,
      or e4m3 / e5m2 with bf16/f16 lhs (``takes_weight_only``: the swap kernel,
      ``weight_only_config``, a bf16/f16 output; either layout read as stored).
    group_sizes: int32[G] (G = g_local when ``group_offset`` is None).
    group_offset: None or int32 scalar; local group j is global group o + j.
    transpose_rhs: use each rhs[j] transposed (dX), without an HBM transpose.
    out_dtype: bf16, f16 or f32 (accumulation is always f32).
    precision: ignored (bf16/f16 wgmma with f32 accumulation is exact-product).
    interpret: False, True or ``plgpu.InterpretGPUParams`` (CPU interpret mode).
    config: tiling; ``default_config`` when None.
    rhs_scale: W8A16 only: the weights' block scales in rhs's layout
      (``[g_local, k // t, n // c]``, or ``[g_local, n // c, k // t]`` with
      ``transpose_rhs``; f32, bf16 or f16; ``t`` a multiple of 64; see
      ``ragdot.scales``): each consumer widens its weight slice, multiplies it
      by its columns' scales in f32 and rounds it to the rows' dtype, so the
      result is bitwise this kernel's on those dequantized weights.  Where
      ``c`` is a multiple of 64 a consumer's 64 columns share one scale per k
      step, which the producer reads from ``rhs_scale`` as it is; otherwise
      ``scales.kernel_scales`` first lays them out per column.

  Raises:
    NotImplementedError: dtypes or alignments the TMA path cannot take.
  """
  del precision
  sm90.check_device(interpret)
  _check_supported(lhs, rhs, out_dtype, transpose_rhs)
  scale_rows = scale_cols = None
  if rhs_scale is not None:
    scale_rows, scale_cols = _scale_blocks(lhs, rhs, rhs_scale, transpose_rhs)
  if (takes_fp8(lhs.dtype) and not transpose_rhs and config is not None and config.widen_rows
      and weight_only_refusal(jnp.bfloat16, rhs.dtype, out_dtype) is None):
    lhs = lhs.astype(jnp.bfloat16)  # (exact) the W8A16 form, reading the weights as stored
  weight_only = lhs.dtype != rhs.dtype
  if takes_fp8(lhs.dtype) and not transpose_rhs:  # (W8A16 reads [g, k, n] as stored)
    rhs, transpose_rhs = jnp.swapaxes(rhs, 1, 2), True
  m, k = lhs.shape
  g_local = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out_dtype = jnp.dtype(out_dtype)
  if m == 0 or n == 0:
    return jnp.zeros((m, n), out_dtype)
  if g_local == 0 or k == 0 or group_sizes.shape[0] == 0:
    return jnp.zeros((m, n), out_dtype)
  has_offset = group_offset is not None
  if weight_only and m < MIN_SWAP_ROWS:  # rows past the groups: written as zeros
    padded = jnp.pad(lhs, ((0, MIN_SWAP_ROWS - m), (0, 0)))
    return gmm(padded, rhs, group_sizes, group_offset, transpose_rhs=transpose_rhs,
               out_dtype=out_dtype, interpret=interpret, config=config,
               rhs_scale=rhs_scale)[:m]
  if weight_only:
    config = weight_only_config(config, m, group_sizes.shape[0], k, transpose_rhs, scale_rows,
                                scale_cols)
  if config is not None and config.swap and out_dtype.itemsize != 2:
    # swap's transposed stores take 16 bits: its row-major ring, fitted to SMEM
    # for this output (None: the default below).
    config = fit_config(config, lhs.dtype, out_dtype)
  if config is not None:
    config = resolve_producer_zeros(config, has_offset, lhs.dtype, out_dtype)
  if config is not None and config.share_rows and interpret:
    # The interpreter hangs with two CTAs per cluster (docs/performance.md v23a,
    # v32a): interpret the same tiles unclustered.
    config = dataclasses.replace(config, share_rows=False)
  if config is None or (config.num_compute_wgs == 2 and not config.ring
                        and k <= config.block_k) or (
      config.ring and m < (config.swap_rows if config.swap else config.block_m)
      + config.tail_rows):
    # The warp-specialized pipeline never releases a tile's last slot: with a
    # single k step the producer could refill it early, so use one warpgroup
    # (the ring releases every slot).  The ring's loads need 128 + tail_rows rows
    # (swap: swap_rows + tail_rows).
    config = default_config(m, k, n, g_local, lhs.dtype, transpose_rhs, out_dtype)
    config = resolve_producer_zeros(config, has_offset, lhs.dtype, out_dtype)
  tile = max(k_tile(config, lhs.dtype), k_tile(config, rhs.dtype))
  if k % tile:
    raise NotImplementedError(
        f"k={k} must be a multiple of the {tile}-column TMA tiles of block_k={config.block_k}"
        f" for {lhs.dtype}")
  smem = config.smem_bytes(lhs.dtype, out_dtype, rhs.dtype,
                           0 if rhs_scale is None else stage_scales(config.block_n, scale_cols))
  # (only the ring kernels are profiled: their 3 warpgroups each keep a buffer)
  profile = sm90.profile_smem_bytes(3, interpret) if config.ring else 0
  smem += profile
  if smem > config.smem_budget():
    raise NotImplementedError(f"config {config} needs {smem} bytes of SMEM"
                              f"{' with its profile buffer' if profile else ''}")

  shard_ring = (has_offset and config.shard_ring_above is not None and config.swap
                and config.producer_zeros is False)
  if rhs_scale is not None and (shard_ring or not (config.ring and config.swap)):
    raise NotImplementedError(f"rhs_scale needs the swap kernel alone, got config {config}")
  if shard_ring:
    return _shard_swap_or_ring(lhs, rhs, group_sizes, group_offset, transpose_rhs=transpose_rhs,
                               out_dtype=out_dtype, config=config, interpret=interpret)
  if config.ring:
    if config.tail_rows and out_dtype.itemsize != 2:
      raise NotImplementedError(f"tail_rows needs a bf16/f16 output, got {out_dtype}")
    if config.swap:
      from ragdot.backends import mosaic_fwd_swap  # pylint: disable=g-import-not-at-top  (imports this module)
      scale = {}
      if rhs_scale is not None:
        scale = _swap_scales(rhs_scale, rhs.shape, transpose_rhs, (scale_rows, scale_cols),
                             mosaic_fwd_swap.SCALE_COLS)
      return mosaic_fwd_swap.gmm(lhs, rhs, group_sizes, group_offset,
                                 transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                                 config=config, interpret=interpret, **scale)
    from ragdot.backends import mosaic_fwd_ring  # pylint: disable=g-import-not-at-top  (imports this module)
    return mosaic_fwd_ring.gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs=transpose_rhs,
                               out_dtype=out_dtype, config=config, interpret=interpret)
  tiles, scalars = backends.flat_schedule(
      group_sizes, group_offset, m=m, num_local=g_local, block_m=config.block_m,
      use_kernel=config.schedule_kernel, interpret=bool(interpret))
  tiles, scalars, lhs, rhs = match_varying(tiles, scalars, lhs, rhs)
  num_ctas = _num_sms(config, bool(interpret))
  if config.num_compute_wgs == 1:
    body, extra = _gmm_kernel_1wg, {}
  else:
    body = functools.partial(_gmm_kernel_2wg, num_ctas=num_ctas)
    extra = dict(num_threads=3, thread_name="wg")
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  kernel = plgpu.kernel(
      functools.partial(body, m=m, k=k, n=n, cfg=config, transpose_rhs=transpose_rhs),
      out_type=out_struct((m, n), out_dtype, lhs),
      grid=(num_ctas,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup
      ),
      interpret=interpret if interpret else None,
      **extra,
  )
  # plgpu.kernel drops the shard_map axis type of out_type: restore it.
  return make_varying(kernel(tiles, scalars, lhs, rhs), varying_axes(lhs))
