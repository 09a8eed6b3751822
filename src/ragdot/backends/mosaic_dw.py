"""Weight-gradient grouped matmul (``tgmm``) as a Pallas Mosaic GPU kernel (sm90).

``tgmm(lhs[m, k], rhs[m, n], group_sizes[G], group_offset) -> out[g_local, k, n]``
with ``out[j] = lhs[rows_j]^T @ rhs[rows_j]`` (f32 accumulation), where
``rows_j`` are the rows of global group ``group_offset + j`` (see
``ragdot.metadata.group_bounds``).  Local groups without rows give exact zeros.

Kernel layout: a persistent grid (one program per SM) walks the work items
``(local group, k tile, n tile)``.  For each item a TMA pipeline streams the
group's row blocks of ``lhs`` (``block_m x block_k``) and ``rhs``
(``block_m x block_n``) through SMEM, and one warpgroup accumulates
``lhs_tile^T @ rhs_tile`` with wgmma, reading ``lhs^T`` through a transposed
SMEM view.  A group's row blocks start at its first row rounded down to a
multiple of 8 (the TMA row granule), so only its last block (and a first block
starting up to 7 rows early) can hold rows of a neighbouring group, and only
those blocks are masked (in SMEM, before the wgmma).  Items of empty groups skip the pipeline
and store zeros.  Partial k/n tiles and row blocks past ``m`` rely on TMA:
out-of-bounds loads read zeros and out-of-bounds stores are dropped.

``num_compute_wgs=2`` (warp-specialized, ``_body_2wg``): a producer warpgroup
issues the TMA loads (``plgpu.emit_pipeline_warp_specialized``) and two
consumer warpgroups each accumulate half of the item's k-tile rows, reading the
same lhs/rhs stage; each stores its half of the output tile asynchronously.
This allows 256 x 128 / 128 x 256 output tiles per item (twice the work per
pipeline fill and epilogue) and lets the producer load the next item while the
consumers run their epilogue.  With ``pingpong`` the two consumers instead take
alternate items whole, so one's epilogue runs under the other's wgmmas, and
with ``mask_warpgroup`` a fourth warpgroup masks the boundary blocks' stages.
With ``side_rows`` (the table's and default rings) nothing is masked: a group's
unaligned end rows come from a zero-padded side buffer gathered before the
kernel, and its last row block is loaded in TMA pieces (``split_rows``).

The config (``MosaicDwConfig``), its register split, SMEM count, default,
sweep and fitting live in ``mosaic_dw_config`` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from ragdot.manual_axes import make_varying, match_varying, out_struct, varying_axes
from ragdot import backends
from ragdot.backends import sm90
from ragdot.backends.mosaic_dw_config import (  # noqa: F401  (re-exported)
    MosaicDwConfig,
    _PIECE_ROWS,
    _PRODUCER_REGISTERS,
    default_config,
    fit_config,
    gpu_sweep_configs,
    pingpong_pays,
    register_split,
    smem_bytes,
)

_IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_OUT_DTYPES = _IN_DTYPES + (jnp.dtype(jnp.float32),)
_MIN_DIM = 64  # k, n granule: one 128-byte swizzle atom of 16-bit elements
_MIN_BLOCK_M = 64  # MosaicDwConfig.block_m's granule: fewer rows are padded to a block
_ROW_ALIGN = 8  # TMA row granule of the tiled GMEM view: row blocks start here
# side_rows: a group's <= 7 + 7 unaligned end rows, zero-padded, in the side
# buffer; its last step's stage holds them in rows [0, 16) and up to 48
# interior rows in the pieces below.
_SIDE_ROWS = 16
_PIECES = ((16, 24), (40, 16), (56, 8))  # (stage row, rows): any multiple of 8 up to 48


def _check_supported(lhs: jax.Array, rhs: jax.Array, out_dtype) -> None:
  if lhs.dtype != rhs.dtype or lhs.dtype not in _IN_DTYPES:
    raise NotImplementedError(
        "mosaic tgmm takes bf16 or f16 lhs/rhs of one dtype, got"
        f" {lhs.dtype} and {rhs.dtype}"
    )
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise NotImplementedError(f"mosaic tgmm: unsupported out_dtype {out_dtype}")
  reason = unsupported_shape(lhs.shape[0], lhs.shape[1], rhs.shape[1])
  if reason:
    raise NotImplementedError(f"mosaic tgmm: {reason}")


def unsupported_shape(m: int, k: int, n: int) -> str | None:
  """Why this kernel refuses lhs[m, k], rhs[m, n] (static; None: it takes it).
  As the forward kernel, it takes an empty k or n (zeros, no kernel) and
  fewer rows than one block (padded to a block of zero rows, which add
  nothing)."""
  if k == 0 or n == 0:
    return None
  if k < _MIN_DIM or n < _MIN_DIM:
    return f"thin k={k} or n={n} (< {_MIN_DIM}) is not supported"
  # Mosaic builds its TMA descriptors on the swizzle-tiled view of GMEM, so the
  # tiled dims must be whole tiles: rows by 8, columns by one 128-byte atom.
  if k % _MIN_DIM or n % _MIN_DIM:
    return f"k={k} and n={n} must be multiples of {_MIN_DIM}"
  if m % 8 and m > _MIN_BLOCK_M:
    return f"m={m} must be a multiple of 8"
  return None


class RowSplit(NamedTuple):
  """How a ``side_rows`` ring covers a group's rows ``[start, end)``."""
  first: jax.Array  # ceil8(start): the 8-aligned interior's first row
  full: jax.Array  # whole _PIECE_ROWS-row blocks of the interior from ``first``
  rest: jax.Array  # the interior rows after them (a multiple of 8, < _PIECE_ROWS)
  nblocks: jax.Array  # ``full`` + the steps holding ``rest`` and the side rows (0 to 2)


def split_rows(start, end) -> RowSplit:
  """``RowSplit`` of rows ``[start, end)`` (int32 scalars or arrays: the kernel
  and the side buffer's gather use the same arithmetic).  The side rows are
  those outside ``[first, floor8(end))``: at most 7 at each end."""
  first = lax.div(start + (_ROW_ALIGN - 1), _ROW_ALIGN) * _ROW_ALIGN
  interior = jnp.maximum(lax.div(end, _ROW_ALIGN) * _ROW_ALIGN - first, 0)
  full = lax.div(interior, _PIECE_ROWS)
  rest = interior - full * _PIECE_ROWS
  side = end - start - interior
  room = _PIECE_ROWS - _SIDE_ROWS  # interior rows beside the side rows
  tail_steps = jnp.where((rest == 0) & (side == 0), 0, jnp.where(rest > room, 2, 1))
  return RowSplit(first, full, rest, full + tail_steps)


def side_runs(start, end):
  """``(heads, tail_start, tails)``: the side rows of rows ``[start, end)`` are
  its first ``heads`` rows (up to ``split_rows``' 8-aligned ``first``) and the
  ``tails`` rows from ``tail_start`` (the unaligned end, not overlapping the
  head).  int32 scalars or arrays: the XLA gather and the Pallas-Triton one
  (``triton_side_rows``) use this arithmetic."""
  head_end = jnp.minimum(split_rows(start, end).first, end)
  tail_start = jnp.maximum(lax.div(end, _ROW_ALIGN) * _ROW_ALIGN, head_end)
  return head_end - start, tail_start, end - tail_start


def side_row_index(starts: jax.Array, ends: jax.Array, m: int) -> jax.Array:
  """int32[g * 16]: for each group (``starts``/``ends``: int32[g]) the rows
  of lhs/rhs its side buffer rows copy, ``m`` (zeros) past its side rows."""
  heads, tail_start, tails = side_runs(starts, ends)
  heads, tails = heads[:, None], tails[:, None]
  t = jnp.arange(_SIDE_ROWS, dtype=jnp.int32)[None]
  index = jnp.where(t < heads, starts[:, None] + t,
                    jnp.where(t < heads + tails, tail_start[:, None] + t - heads, m))
  return index.reshape(-1)


def side_buffers(lhs: jax.Array, rhs: jax.Array, starts: jax.Array,
                 ends: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The ``side_rows`` ring's side buffers ([g * 16, k] and [g * 16, n]):
  each group's unaligned end rows of lhs and rhs (``side_row_index``), zeros
  past them.  ``starts``/``ends``: int32[g] of the local groups."""
  index = side_row_index(starts, ends, lhs.shape[0])
  return tuple(jnp.take(x, index, axis=0, mode="fill", fill_value=0) for x in (lhs, rhs))


class WorkItem(NamedTuple):
  """One (group, k tile, n tile) item of a CTA and the rows it contracts."""
  group: jax.Array
  k_tile: jax.Array
  n_tile: jax.Array
  start: jax.Array  # the group's rows [start, end)
  end: jax.Array
  first: jax.Array  # the first row block's first row (a multiple of 8)
  full: jax.Array  # side_rows: the steps before the piece steps (else nblocks)
  nblocks: jax.Array  # row block steps


def interleave_groups(j, w, num_groups: int, per_group: int, teams: int):
  """Item ``(j, w)`` of the plain order (group ``j``'s ``w``-th tile) remapped so
  that each run of ``teams`` groups deals its items in turn: position ``w`` of
  group ``j`` in the plain order holds, within its run of groups, group
  ``base + o % t``'s tile ``o // t`` (``o`` the position in the run, ``t`` the
  run's groups: ``teams``, fewer in the last run).  A permutation of the items,
  so consecutive CTAs of the persistent grid work on ``teams`` groups at once.
  Returns ``(group, tile)``; int32 scalars or arrays."""
  if teams == 1:
    return j, w
  base = j - lax.rem(j, teams)
  t = jnp.minimum(teams, num_groups - base)
  o = (j - base) * per_group + w
  return base + lax.rem(o, t), lax.div(o, t)


def _work_item(info, grid_k: int, grid_n: int, config: MosaicDwConfig,
               starts_gmem, ends_gmem, first_gmem, nblocks_gmem,
               num_groups: int, rows=None) -> WorkItem:
  """Item ``info`` of the CTA's loop; with ``side_rows`` its rows come from
  ``split_rows`` (the interior's first row and steps).  ``rows``: its group's
  ``(start, end)``, loaded already (``prefetch_rows``)."""
  j, w = interleave_groups(info.index[0], info.index[1], num_groups, grid_k * grid_n,
                           config.group_interleave)
  ki, ni = plgpu.planar_snake(w, (grid_k, grid_n), 1, config.grid_tile_width)
  start, end = rows if rows is not None else (starts_gmem[j], ends_gmem[j])
  if config.side_rows:
    split = split_rows(start, end)
    return WorkItem(j, ki, ni, start, end, pl.multiple_of(split.first, _ROW_ALIGN),
                    split.full, split.nblocks)
  first = pl.multiple_of(first_gmem[j], _ROW_ALIGN)
  nblocks = nblocks_gmem[j]
  return WorkItem(j, ki, ni, start, end, first, nblocks, nblocks)


def _row_spec(rows: int, cols: int, first, col_block, transforms, delay_release: int):
  """Block i of a group: rows [first + i * rows, +rows), column block col_block."""
  return plgpu.BlockSpec((pl.Element(rows), cols), lambda i: (first + i * rows, col_block),
                         transforms=transforms, delay_release=delay_release)


def _mask_rows(tile_smem, row0, start, end):
  """Zeroes the rows of an SMEM tile that lie outside [start, end)."""
  tile = tile_smem[...]
  rows = plgpu.layout_cast(
      lax.broadcasted_iota(jnp.int32, tile.shape, 0), plgpu.Layout.WGMMA
  ) + row0
  keep = (rows >= start) & (rows < end)
  tile_smem[...] = jnp.where(keep, tile, jnp.zeros_like(tile))


def _straddles(row0, rows: int, start, end):
  """Whether the row block [row0, row0 + rows) holds rows outside [start, end).

  Only a group's first and last blocks can: those are the ones masked.
  """
  return (row0 < start) | (row0 + rows > end)


def _mask_stage(tiles, wg, num_wgs: int, row0, start, end, banded: bool) -> None:
  """Zeroes the rows outside [start, end) of a stage's SMEM tiles, split among
  ``num_wgs`` warpgroups (``wg`` is this one): by row bands (``banded``), else
  whole tiles for one warpgroup or 64-column chunks for several."""
  if banded:
    _mask_bands(tiles, wg, num_wgs, row0, start, end)
  elif num_wgs == 1:
    for tile in tiles:
      _mask_rows(tile, row0, start, end)
  else:
    chunks = [(t, c) for t in tiles for c in range(0, t.shape[1], 64)]
    for i, (ref, col) in enumerate(chunks):
      pl.when(wg == i % num_wgs)(functools.partial(
          _mask_rows, ref.at[:, pl.ds(col, 64)], row0, start, end))


def _mask_own_stage(lhs_t, rhs_t, row0, start, end, banded: bool) -> None:
  """One warpgroup zeroes the rows outside [start, end) of a stage's tiles
  when the row block at ``row0`` holds any, and makes its writes visible to
  the wgmma (async proxy) that reads the stage next."""
  @pl.when(_straddles(row0, lhs_t.shape[0], start, end))
  def _():
    _mask_stage((lhs_t, rhs_t), 0, 1, row0, start, end, banded)
    plgpu.commit_smem()


def _consumers_mask(lhs_t, rhs_t, wg, row0, start, end, mask_barrier,
                    banded: bool = False) -> None:
  """The two consumers split the masking of a shared stage, then both wait
  until all of it is masked before their wgmmas read it."""
  _mask_stage((lhs_t, rhs_t), wg, 2, row0, start, end, banded)
  plgpu.commit_smem()
  plgpu.barrier_arrive(mask_barrier)
  plgpu.barrier_wait(mask_barrier)


def _band_rows(cols: int) -> int:
  """Rows of a masking band of a tile ``cols`` (64, 128 or 256) wide: a whole
  number of 8 x 64 swizzle tiles that one warpgroup's SMEM transfer layout
  covers (it needs 4 of them)."""
  return 8 * (4 // (cols // 64))


def _mask_bands(tiles, wg, num_wgs: int, row0, start, end) -> None:
  """Zeroes the rows outside [start, end) of SMEM tiles (each [rows, cols],
  swizzled, rows from ``row0``) band by band: a band wholly outside is
  overwritten with zeros, one that straddles a boundary is read, masked and
  written back, one wholly inside is left alone.  Bands go round-robin to the
  ``num_wgs`` warpgroups (``wg`` is this one's index).

  Each group boundary in a block cuts at most one band per tile, so on a
  typical boundary block this moves a fraction of the bytes of masking the
  whole tiles.
  """
  i = 0
  # A 192-column tile is masked as three 64-column slices: its own bands would
  # be 32 x 192 (48 values per thread, beside a pingpong consumer's 192
  # accumulator registers).
  tiles = [t.at[:, pl.ds(c, 64)] if t.shape[1] == 192 else t
           for t in tiles for c in (range(0, 192, 64) if t.shape[1] == 192 else (0,))]
  for tile in tiles:
    rows, cols = tile.shape
    band = min(_band_rows(cols), rows)
    layout = plgpu.Layout.SMEM_GMEM_COPY((band, cols), tile.dtype, 128)
    for b0 in range(0, rows, band):
      ref = tile.at[pl.ds(b0, band)]
      r0 = row0 + b0
      outside = (r0 + band <= start) | (r0 >= end)
      straddles = jnp.logical_not(outside) & ((r0 < start) | (r0 + band > end))

      def zero(ref=ref):
        ref[...] = plgpu.layout_cast(jnp.zeros(ref.shape, ref.dtype), layout)

      def mask(ref=ref, r0=r0):
        idx = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0), layout) + r0
        keep = (idx >= start) & (idx < end)
        val = plgpu.load(ref, layout=layout)
        ref[...] = jnp.where(keep, val, jnp.zeros_like(val))

      mine = wg == i % num_wgs
      pl.when(mine & outside)(zero)
      pl.when(mine & straddles)(mask)
      i += 1


def _store_consumer_half(acc, my_smem, out_gmem, j, row, col, lsu: bool = False) -> None:
  """A consumer's epilogue: its f32 accumulator through its own SMEM buffers
  (``my_smem``: [buffers, rows, cols]) to output tile j at (row, col); with
  ``lsu``, chunks wholly inside the output leave by the warpgroup's stores
  (``MosaicDwConfig.lsu_store``)."""
  nbuf, rm, cn = my_smem.shape
  t, stored = 0, None  # chunk count; whether the previous chunk was stored (by TMA)
  for r in range(0, acc.shape[0], rm):  # epilogue_rows chunks
    rows = acc if rm == acc.shape[0] else acc[r:r + rm]
    for c in range(acc.shape[1] // cn):  # epilogue_split chunks
      # The buffer's previous store must be done reading it: with one buffer
      # the last store; with two, all but the last one, which read the other
      # buffer (unless the previous chunk, wholly out of bounds, stored
      # nothing; and at an item's first chunk all are waited for).
      if nbuf == 1 or stored is None:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      else:
        pl.when(stored)(lambda: plgpu.wait_smem_to_gmem(1, wait_read_only=True))
        pl.when(~stored)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))
      buf = my_smem.at[t % nbuf]
      buf[...] = sm90.column_chunk(rows, c, cn).astype(buf.dtype)
      plgpu.commit_smem()
      stored = _store_half(buf, out_gmem, j, row + r, col + c * cn, lsu)
      t += 1


def _store_half(src_smem, out_gmem, j, row, col, lsu: bool = False):
  """One consumer's (epilogue_m, epilogue_n) chunk of output tile j at (row, col).

  Skipped when it lies wholly past k (a k tile wider than k's remainder) or n
  (an epilogue chunk of the last n tile): a TMA box entirely out of bounds is
  not left to the hardware to drop.  With ``lsu`` a chunk wholly inside is
  stored by the warpgroup's threads.  Returns whether a TMA store was issued.
  """
  hk, bn = src_smem.shape
  inside = (row < out_gmem.shape[1]) & (col < out_gmem.shape[2])
  dst = lambda: out_gmem.at[j, pl.ds(row, hk), pl.ds(col, bn)]
  if lsu:
    whole = (row + hk <= out_gmem.shape[1]) & (col + bn <= out_gmem.shape[2])
    pl.when(whole)(lambda: _lsu_copy(src_smem, dst()))
    inside = inside & ~whole
  pl.when(inside)(lambda: plgpu.copy_smem_to_gmem(src_smem, dst()))
  return inside


def _lsu_copy(src_smem, dst_gmem) -> None:
  """``dst_gmem[...] = src_smem[...]`` by the warpgroup's threads: 16-byte
  loads from the swizzled tile, then stores of each row's bytes: whole 128-byte
  lines, or 64-byte halves of one for a 32-column 16-bit chunk (Mosaic GPU's
  tiled SMEM-to-GMEM copy, which Pallas does not expose)."""
  transforms = sm90.swizzled(src_smem.shape[-1], src_smem.dtype)  # (the buffers' own)
  swizzle = transforms[1].swizzle

  # No barrier of its own: the caller's commit_smem() ends with a warpgroup
  # barrier (every thread's part of the chunk is in SMEM), and under Warpgroup
  # semantics the next chunk's SMEM store begins with one (all reads done).
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms=transforms), plgpu.RefType()))
  def copy(ctx, smem, gmem):
    del ctx
    mgpu_fa.copy_tiled(smem, gmem, swizzle)

  copy(src_smem, dst_gmem)


def _body_2wg(starts_gmem, ends_gmem, first_gmem, nblocks_gmem, lhs_gmem, rhs_gmem,
              out_gmem, *, config, num_groups, grid_k, grid_n, out_dtype,
              in_transforms_lhs, in_transforms_rhs, out_transforms):
  """Warp-specialized dW: warpgroups 0, 1 compute, warpgroup 2 issues TMA loads.

  Work item (group j, k tile ki, n tile ni): consumer ``w`` accumulates
  ``lhs[rows, ki*bk + w*hk : +hk]^T @ rhs[rows, ni*bn : +bn]`` over the group's
  row blocks (both consumers read the same SMEM stage) and stores its
  (hk, bn) half of the output tile asynchronously from its own SMEM buffer.

  Synchronization beyond the pipeline's own produced/consumed barriers:
  * ``mask_barrier`` (2 arrivals): on a boundary row block the two consumers
    split the masking of the shared lhs/rhs stage by 64-column chunks, then
    both wait until both halves are masked before their wgmma reads it.
  * ``done_barrier`` (2 arrivals): the pipeline never releases the slot of an
    item's last step, so before the producer starts the next item's loads it
    waits until both consumers have finished their last wgmma (read the
    accumulator).  Only items with row blocks use it, so the consumers can never
    be more than one phase ahead of the producer.
  """
  bm, bk, bn = config.block_m, config.block_k, config.block_n
  hk = bk // 2

  def make_pipeline(step, compute_context, nblocks, first=0, ki=0, ni=0):
    return plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(nblocks,),
        memory_registers=_PRODUCER_REGISTERS,
        in_specs=[
            _row_spec(bm, bk, first, ki, in_transforms_lhs, 1),
            _row_spec(bm, bn, first, ni, in_transforms_rhs, 1),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=config.num_stages,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None
  # A static grid of num_stages steps allocates the same num_stages slots as
  # the dynamic grids used below.
  allocs = make_pipeline(ignore, ignore, config.num_stages).get_allocations(
      lhs_gmem, rhs_gmem)

  @functools.partial(
      pl.run_scoped,
      allocs=allocs,
      o_smem=plgpu.SMEM((2, config.epilogue_buffers, config.epilogue_m, config.epilogue_n),
                        out_dtype, transforms=out_transforms),
      mask_barrier=plgpu.Barrier(num_arrivals=2),
      done_barrier=plgpu.Barrier(num_arrivals=2),
      collective_axes="wg",
  )
  def _scope(allocs, o_smem, mask_barrier, done_barrier):
    wg = lax.axis_index("wg")
    is_consumer = wg < 2

    @plgpu.nd_loop((num_groups, grid_k * grid_n), collective_axes="sm")
    def _item(info: plgpu.NDLoopInfo):
      j, ki, ni, start, end, first, _, nblocks = _work_item(
          info, grid_k, grid_n, config, starts_gmem, ends_gmem, first_gmem, nblocks_gmem,
          num_groups)

      def step(idx, lhs_smem, rhs_smem, acc_ref):
        row0 = first + idx[0] * bm
        pl.when(_straddles(row0, bm, start, end))(functools.partial(
            _consumers_mask, lhs_smem, rhs_smem, wg, row0, start, end, mask_barrier,
            config.banded_mask))

        plgpu.wgmma(acc_ref, lhs_smem.at[:, pl.ds(wg * hk, hk)].T, rhs_smem)
        # delay_release=1: this step's slot is released one step later, once
        # at most this step's wgmma is still in flight.
        plgpu.wgmma_wait(1)
        return acc_ref

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((hk, bn), jnp.float32))
        def _acc(acc_ref):
          eval_pipeline(acc_ref)
          acc = acc_ref[...]  # waits for the last wgmma
          pl.when(nblocks > 0)(lambda: plgpu.barrier_arrive(done_barrier))
          _store_consumer_half(acc, o_smem.at[wg], out_gmem, j, ki * bk + wg * hk, ni * bn,
                               config.lsu_store)

      # Items of empty groups run a zero-step pipeline: the consumers store
      # the zero-initialized accumulator, the producer loads nothing.
      make_pipeline(step, compute_context, nblocks, first, ki, ni)(
          lhs_gmem, rhs_gmem, allocations=allocs
      )

      @pl.when(jnp.logical_not(is_consumer) & (nblocks > 0))
      def _():
        plgpu.barrier_wait(done_barrier)

    pl.when(is_consumer)(lambda: plgpu.wait_smem_to_gmem(0))


_PREFETCH_ROWS, _PREFETCH_COLS = 64, 256  # one L2 prefetch box, at most


def _box_grid(m: int, k: int, n: int) -> tuple[int, tuple[int, int], tuple[int, int]]:
  """(box rows, box widths, boxes across) of lhs [m, k] and rhs [m, n]: boxes
  of at most 64 rows x 256 columns, the arrays' own sizes where smaller."""
  widths = (min(_PREFETCH_COLS, k), min(_PREFETCH_COLS, n))
  return (min(_PREFETCH_ROWS, m), widths,
          (pl.cdiv(k, widths[0]), pl.cdiv(n, widths[1])))


def prefetch_boxes(box, start, end, *, m: int, k: int, n: int):
  """The rows ``box`` of a group's rows ``[start, end)`` is: boxes
  (``_box_grid``) numbered over lhs's columns, then rhs's, row block by row
  block.  Returns ``[(operand 0 / 1, row, column, wanted), ...]`` for both
  operands (exactly one wanted where the box holds some of the group's rows);
  row and column keep the box inside the array."""
  rows, widths, counts = _box_grid(m, k, n)
  across = sum(counts)
  row = start + (box // across) * rows
  inside = row < end
  row = jnp.minimum(row, m - rows)
  col, skip, out = box % across, 0, []
  for operand, (cols, width, count) in enumerate(zip((k, n), widths, counts)):
    c0 = jnp.minimum(jnp.clip(col - skip, 0, count - 1) * width, cols - width)
    out.append((operand, row, c0, inside & (col >= skip) & (col < skip + count)))
    skip += count
  return out


def prefetch_boxes_per_item(m: int, k: int, n: int, num_groups: int,
                            items_per_group: int) -> int:
  """Boxes each item prefetches: enough for twice a mean group's rows
  (at most 4)."""
  blocks = pl.cdiv(2 * pl.cdiv(m, max(num_groups, 1)), _PREFETCH_ROWS)
  return max(1, min(4, pl.cdiv(blocks * sum(_box_grid(m, k, n)[2]), items_per_group)))


def _prefetch_later_group(it, starts_gmem, ends_gmem, lhs_gmem, rhs_gmem, *,
                          config: MosaicDwConfig, num_groups: int, grid_n: int,
                          items_per_group: int, num_sms: int) -> None:
  """``config.l2_prefetch_ahead``: this item's boxes (``prefetch_boxes``) of a
  later group's rows into L2.  Items of one group run on different CTAs
  (round-robin), so the item's place in its group, not the CTA, numbers them."""
  later = it.group + config.l2_prefetch_ahead + pl.cdiv(num_sms, items_per_group)
  j = jnp.minimum(later, num_groups - 1)
  start, end = starts_gmem[j], ends_gmem[j]
  (m, k), n = lhs_gmem.shape, rhs_gmem.shape[1]
  rows, widths, _ = _box_grid(m, k, n)
  place = it.k_tile * grid_n + it.n_tile
  refs = (lhs_gmem, rhs_gmem)
  for r in range(prefetch_boxes_per_item(m, k, n, num_groups, items_per_group)):
    for operand, row, c0, wanted in prefetch_boxes(place + r * items_per_group, start, end,
                                                   m=m, k=k, n=n):
      plgpu.async_prefetch(refs[operand].at[pl.ds(row, rows), pl.ds(c0, widths[operand])],
                           predicate=wanted & (later < num_groups))


def _body_2wg_flat(starts_gmem, ends_gmem, first_gmem, nblocks_gmem, lhs_gmem, rhs_gmem,
                   *refs, config, num_groups, grid_k, grid_n, out_dtype,
                   in_transforms_lhs, in_transforms_rhs, out_transforms, num_sms):
  """Warp-specialized dW with one pipeline through all of a CTA's items.

  The same roles and tiles as ``_body_2wg`` (consumers 0 and 1 each own half of
  the item's k tile; warpgroup 2 issues the TMA loads), but the stages form
  one ring that runs through the CTA's whole item sequence: the producer loads
  the next item's row blocks while the consumers finish an item and store it,
  so an item of a few row blocks (a group of ~256 rows) no longer pays a
  pipeline fill and drain.  Step ``s`` (counted over all items of the CTA)
  uses slot ``s % num_stages``; ``produced[slot]`` (TMA bytes landed) and
  ``consumed[slot]`` (both consumers' wgmmas done with it) are the ring's
  barriers, and each thread tracks their phases by waiting once per use.  The
  two consumers split a boundary block's row masking between their wgmmas.

  ``pingpong``: consumer ``q % 2`` owns the CTA's item q whole (a (bk, bn)
  accumulator, its own staging buffer, its own masking) and alone releases
  its steps (``consumed`` takes one arrival).  Each consumer has its own
  ``produced`` barriers (the producer signals the owner's), so a consumer
  waits only for its own steps, once each, and can start its next item while
  the other still works on its own.  A slot is reloaded only after its
  previous use was released, so no barrier runs a phase ahead of its waiter.

  ``mask_warpgroup`` (pingpong only): warpgroup 3 waits for every step's
  ``produced`` barrier, masks the boundary blocks' stages, and arrives on the
  owner's ``masked`` barrier, which the consumers wait for instead of
  ``produced``: each barrier still has exactly one waiter per phase.

  ``side_rows`` (``refs`` then starts with the side buffers of lhs and rhs):
  nothing is masked.  An item's steps from ``split_rows(...).full`` on are
  loaded in pieces (see ``MosaicDwConfig.side_rows``) and signal
  ``pieces_in`` (8 TMA arrivals) instead of ``produced``; the producer and
  the consumers both know which steps those are, and each thread keeps every
  barrier's phase, so waiting on one set or the other per step is safe.
  """
  side = config.side_rows
  if side:
    side_lhs_gmem, side_rhs_gmem, out_gmem = refs
  else:
    (out_gmem,) = refs
  bm, bk, bn = config.block_m, config.block_k, config.block_n
  pingpong = config.pingpong
  masker = config.mask_warpgroup
  hk = bk if pingpong else bk // 2  # rows of a consumer's accumulator
  stages = config.num_stages
  regs_producer, regs_consumer, regs_masker = register_split(masker, hk * bn)

  per_group = grid_k * grid_n

  def group_rows(item):
    """(start, end) of the group of this CTA's item number ``item`` in the
    loop's row-major order (clamped to the last item)."""
    item = jnp.minimum(item, num_groups * per_group - 1)
    j, _ = interleave_groups(lax.div(item, per_group), lax.rem(item, per_group), num_groups,
                             per_group, config.group_interleave)
    return starts_gmem[j], ends_gmem[j]

  def items(body, init):
    """Runs ``body(item, carry) -> carry`` over this CTA's items in order; the
    final carry."""
    if not config.prefetch_rows:
      @plgpu.nd_loop((num_groups, per_group), collective_axes="sm", init_carry=init)
      def steps(info: plgpu.NDLoopInfo, carry):
        with jax.named_scope("item"):  # (its rows: loads from GMEM)
          item = _work_item(info, grid_k, grid_n, config, starts_gmem, ends_gmem, first_gmem,
                            nblocks_gmem, num_groups)
        return body(item, carry)
      return steps

    # prefetch_rows: the loads for the CTA's next item (this one + the grid)
    # are issued before this item's work and carried over.
    @plgpu.nd_loop((num_groups, per_group), collective_axes="sm",
                   init_carry=(init, group_rows(lax.axis_index("sm"))))
    def prefetched(info: plgpu.NDLoopInfo, carry):
      inner, rows = carry
      ahead = group_rows(info.index[0] * per_group + info.index[1] + lax.axis_size("sm"))
      with jax.named_scope("item"):
        item = _work_item(info, grid_k, grid_n, config, starts_gmem, ends_gmem, first_gmem,
                          nblocks_gmem, num_groups, rows=rows)
      return body(item, inner), ahead
    return prefetched[0]

  def ring_steps(per_step):
    """Calls ``per_step(item, i, step, slot, owner)`` for row block ``i`` of
    every item of this CTA in order: ``step`` counts the ring's steps over all
    items, ``slot = step % stages``, and ``owner`` is the first of the item's
    consumer's ``produced`` / ``masked`` barriers with ``pingpong`` (else 0).
    Returns the number of steps."""
    def item(it, carry):
      step0, q = carry
      owner = lax.rem(q, 2) * stages if pingpong else 0

      def one(i, step):
        per_step(it, i, step, lax.rem(step, stages), owner)
        return step + 1

      return lax.fori_loop(0, it.nblocks, one, step0), q + 1

    total, _ = items(item, (jnp.int32(0), jnp.int32(0)))
    return total

  @functools.partial(
      pl.run_scoped,
      lhs_smem=plgpu.SMEM((stages, bm, bk), lhs_gmem.dtype, transforms=in_transforms_lhs),
      rhs_smem=plgpu.SMEM((stages, bm, bn), rhs_gmem.dtype, transforms=in_transforms_rhs),
      # Two TMA arrivals (lhs, rhs) per step; pingpong: one set per consumer.
      produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages * (2 if pingpong else 1)),
      consumed=plgpu.Barrier(num_arrivals=1 if pingpong else 2, num_barriers=stages),
      o_smem=plgpu.SMEM((2, config.epilogue_buffers, config.epilogue_m, config.epilogue_n),
                        out_dtype, transforms=out_transforms),
      # The shared ring's consumers mask a boundary block together.
      **(dict(mask_barrier=plgpu.Barrier(num_arrivals=2)) if not (pingpong or side) else {}),
      # mask_warpgroup: the masker -> the owner of a step (one set per consumer).
      **(dict(masked=plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages))
         if masker else {}),
      # side_rows: the piece steps' barriers (2 x 4 pieces).
      **(dict(pieces_in=plgpu.Barrier(num_arrivals=2 * (1 + len(_PIECES)),
                                      num_barriers=stages * (2 if pingpong else 1)))
         if side else {}),
      collective_axes="wg",
  )
  def _scope(lhs_smem, rhs_smem, produced, consumed, o_smem, mask_barrier=None,
             masked=None, pieces_in=None):
    wg = lax.axis_index("wg")

    def load_pieces(it, i, slot, barrier):
      """Stage ``slot`` of a piece step: the group's side rows (first piece
      step only) and the interior rows left after its whole blocks."""
      j, ki, ni, start, end, first, full, _ = it
      rest = split_rows(start, end).rest
      p = i - full  # 0, or 1 for the second piece step
      room = _PIECE_ROWS - _SIDE_ROWS
      left = jnp.clip(rest - p * room, 0, room)
      row = first + full * bm + p * room
      past_m, past_side = lhs_gmem.shape[0], side_lhs_gmem.shape[0]
      side_row = jnp.where(p == 0, j * _SIDE_ROWS, past_side)
      pieces = [(pl.ds(0, _SIDE_ROWS), side_row, True)]
      for at, rows in _PIECES:  # 24, 16, 8: takes any multiple of 8 up to 48
        take = left >= rows
        pieces.append((pl.ds(at, rows), jnp.where(take, row, past_m), False))
        row, left = row + jnp.where(take, rows, 0), left - jnp.where(take, rows, 0)
      for src, side_src, cols, dst in (
          (lhs_gmem, side_lhs_gmem, pl.ds(ki * bk, bk), lhs_smem.at[slot]),
          (rhs_gmem, side_rhs_gmem, pl.ds(ni * bn, bn), rhs_smem.at[slot])):
        for at, r, from_side in pieces:
          rows = pl.ds(pl.multiple_of(r, _ROW_ALIGN), at.size)
          plgpu.copy_gmem_to_smem((side_src if from_side else src).at[rows, cols],
                                  dst.at[at], barrier)

    if masker:
      @pl.when(wg == 3)
      def _masker():
        plgpu.set_max_registers(regs_masker, action="decrease")

        def mask_step(it, i, step, slot, owner):
          del step
          _, _, _, start, end, first, _, _ = it
          plgpu.barrier_wait(produced.at[owner + slot])
          _mask_own_stage(lhs_smem.at[slot], rhs_smem.at[slot], first + i * bm, start, end,
                          config.banded_mask)
          plgpu.barrier_arrive(masked.at[owner + slot])

        ring_steps(mask_step)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(regs_producer, action="decrease")

      def load(it, i, step, slot, owner):
        _, ki, ni, _, _, first, full, _ = it
        if config.l2_prefetch_ahead:
          pl.when(i == 0)(lambda: _prefetch_later_group(
              it, starts_gmem, ends_gmem, lhs_gmem, rhs_gmem, config=config,
              num_groups=num_groups, grid_n=grid_n, items_per_group=grid_k * grid_n,
              num_sms=num_sms))
        # The slot's previous use (step - stages) must be consumed first.
        with jax.named_scope("free"):  # (profile ranges: sm90.profiling)
          pl.when(step >= stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))

        def whole_block():
          rows = pl.ds(pl.multiple_of(first + i * bm, _ROW_ALIGN), bm)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, pl.ds(ki * bk, bk)],
                                  lhs_smem.at[slot], produced.at[owner + slot])
          plgpu.copy_gmem_to_smem(rhs_gmem.at[rows, pl.ds(ni * bn, bn)],
                                  rhs_smem.at[slot], produced.at[owner + slot])

        with jax.named_scope("load"):
          if side:
            in_pieces = i >= full
            pl.when(~in_pieces)(whole_block)
            pl.when(in_pieces)(lambda: load_pieces(it, i, slot, pieces_in.at[owner + slot]))
          else:
            whole_block()

      total = ring_steps(load)

      # Observe the consumption of the last stages too (every barrier phase is
      # waited for before the barriers go away).
      @pl.loop(jnp.maximum(total - stages, 0), total)
      def _drain(step):
        plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

    @pl.when(wg < 2)
    def _consumers():
      plgpu.set_max_registers(regs_consumer, action="increase")

      def compute(it, step0):
        """Accumulates this consumer's part of item ``it`` (from ring step
        ``step0``) and stores it."""
        j, ki, ni, start, end, first, full, nblocks = it

        def acc_scope(acc_ref):
          def mma(i, step):
            slot = lax.rem(step, stages)
            lhs_t, rhs_t = lhs_smem.at[slot], rhs_smem.at[slot]
            ready = masked if masker else produced
            mine = (wg * stages if pingpong else 0) + slot
            with jax.named_scope("wait"):
              if side:
                in_pieces = i >= full
                pl.when(~in_pieces)(lambda: plgpu.barrier_wait(ready.at[mine]))
                pl.when(in_pieces)(lambda: plgpu.barrier_wait(pieces_in.at[mine]))
              else:
                plgpu.barrier_wait(ready.at[mine])
            row0 = first + i * bm
            # (side_rows: the stage holds only the group's rows and zeros.)
            if pingpong and not (masker or side):  # this consumer's own stage
              _mask_own_stage(lhs_t, rhs_t, row0, start, end, config.banded_mask)
            elif not (pingpong or side):
              pl.when(_straddles(row0, bm, start, end))(functools.partial(
                  _consumers_mask, lhs_t, rhs_t, wg, row0, start, end, mask_barrier,
                  config.banded_mask))

            lhs_rows = lhs_t if pingpong else lhs_t.at[:, pl.ds(wg * hk, hk)]
            with jax.named_scope("mma"):
              plgpu.wgmma(acc_ref, lhs_rows.T, rhs_t)
              if config.delay_release:
                plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release it
                pl.when(i > 0)(lambda: plgpu.barrier_arrive(
                    consumed.at[lax.rem(step + stages - 1, stages)]))
              else:  # this step's wgmma is done: release its slot at once
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(consumed.at[slot])
            return step + 1

          step = lax.fori_loop(0, nblocks, mma, step0)
          with jax.named_scope("last_mma"):
            acc = acc_ref[...]  # waits for the last wgmma
          if config.delay_release:
            pl.when(nblocks > 0)(lambda: plgpu.barrier_arrive(
                consumed.at[lax.rem(step + stages - 1, stages)]))
          return acc

        acc = pl.run_scoped(acc_scope, plgpu.ACC((hk, bn), jnp.float32))
        row = ki * bk if pingpong else ki * bk + wg * hk
        with jax.named_scope("store"):
          _store_consumer_half(acc, o_smem.at[wg], out_gmem, j, row, ni * bn,
                               config.lsu_store)

      def item(it, carry):
        step0, q = carry
        if pingpong:  # the other consumer's items: only their steps are counted
          pl.when(lax.rem(q, 2) == wg)(lambda: compute(it, step0))
        else:
          compute(it, step0)
        return step0 + it.nblocks, q + 1

      items(item, (jnp.int32(0), jnp.int32(0)))
      plgpu.wait_smem_to_gmem(0)


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    num_groups: int,
    out_dtype,
    precision=None,
    interpret=False,
    config: MosaicDwConfig | None = None,
) -> jax.Array:
  """``out[j] = lhs[rows_j]^T @ rhs[rows_j]`` for the ``num_groups`` local groups.

  Args:
    lhs: [m, k] bf16/f16, rows grouped by ``group_sizes``.
    rhs: [m, n], same dtype and row grouping.
    group_sizes: int32[G] (device array, may be traced).
    group_offset: None (local = global groups, ``num_groups == G``) or an int32
      scalar: local group j is global group ``group_offset + j``.
    num_groups: number of local groups (static).
    out_dtype: bf16, f16 or f32; accumulation is always f32.
    precision: ignored (16-bit products are exact in the f32 accumulator).
    interpret: False, True, or ``plgpu.InterpretGPUParams`` (CPU interpret mode).
    config: tiling; defaults to ``default_config``.

  Returns:
    [num_groups, k, n] in ``out_dtype``.

  Raises:
    NotImplementedError: for dtypes or shapes this kernel does not take.
  """
  del precision
  sm90.check_device(interpret)
  _check_supported(lhs, rhs, out_dtype)
  m, k = lhs.shape
  n = rhs.shape[1]
  out_dtype = jnp.dtype(out_dtype)
  if k == 0 or n == 0:
    return jnp.zeros((num_groups, k, n), out_dtype)
  if config is None:
    config = default_config(m, k, n, num_groups, lhs.dtype, out_dtype)
  if config.lsu_store and interpret:  # (the interpreter cannot run Mosaic GPU code)
    config = dataclasses.replace(config, lsu_store=False)
  if 0 < m < config.block_m:
    # A TMA box may not be taller than the array it reads (the GPU returns wrong
    # rows; interpret mode does not model it): pad to one block of zero rows.  A
    # group cut at m may now end in them; they add nothing.
    pad = ((0, config.block_m - m), (0, 0))
    return tgmm(jnp.pad(lhs, pad), jnp.pad(rhs, pad), group_sizes, group_offset,
                num_groups=num_groups, out_dtype=out_dtype, interpret=interpret,
                config=config)
  profile = sm90.profile_smem_bytes(_warpgroups(config), interpret)
  need = smem_bytes(config, lhs.dtype, out_dtype) + profile
  if need > config.smem_budget():
    raise NotImplementedError(
        f"{config} needs {need} bytes of SMEM for {lhs.dtype} -> {out_dtype}"
        f"{' with its profile buffer' if profile else ''}; the budget is"
        f" {config.smem_budget()}"
    )
  if num_groups == 0 or m == 0:
    return jnp.zeros((num_groups, k, n), out_dtype)

  bm, bk, bn = config.block_m, config.block_k, config.block_n
  starts, ends, first_row, num_blocks = backends.row_blocks(
      group_sizes, group_offset, m=m, num_local=num_groups, block_m=bm, align=_ROW_ALIGN,
      use_kernel=config.schedule_kernel, interpret=interpret)

  grid_k, grid_n = pl.cdiv(k, bk), pl.cdiv(n, bn)
  num_stages = config.num_stages
  delay_release = 1 if num_stages > 1 else 0
  in_transforms_lhs = sm90.swizzled(bk, lhs.dtype)
  in_transforms_rhs = sm90.swizzled(bn, rhs.dtype)
  out_transforms = sm90.swizzled(config.epilogue_n, out_dtype)

  def body(starts_gmem, ends_gmem, first_gmem, nblocks_gmem, lhs_gmem, rhs_gmem,
           out_gmem, out_smem):

    @plgpu.nd_loop((num_groups, grid_k * grid_n), collective_axes="sm")
    def _item(info: plgpu.NDLoopInfo):
      j, ki, ni, start, end, first, _, nblocks = _work_item(
          info, grid_k, grid_n, config, starts_gmem, ends_gmem, first_gmem, nblocks_gmem,
          num_groups)

      def acc_scope(acc_ref):
        def step(idx, lhs_smem, rhs_smem):
          _mask_own_stage(lhs_smem, rhs_smem, first + idx[0] * bm, start, end,
                          config.banded_mask)
          plgpu.wgmma(acc_ref, lhs_smem.T, rhs_smem)
          if delay_release == 0:
            # Without delayed release the slot may be refilled right after
            # this step, so the wgmma must finish reading it first.
            plgpu.wgmma_wait(0)

        @pl.when(nblocks > 0)
        def _():
          plgpu.emit_pipeline(
              step,
              grid=(nblocks,),
              in_specs=[
                  _row_spec(bm, bk, first, ki, in_transforms_lhs, delay_release),
                  _row_spec(bm, bn, first, ni, in_transforms_rhs, delay_release),
              ],
              max_concurrent_steps=num_stages,
          )(lhs_gmem, rhs_gmem)

        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bk, bn), jnp.float32))
      # The previous item's store must be done reading out_smem.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_smem[...] = acc.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          out_smem, out_gmem.at[j, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)]
      )

    plgpu.wait_smem_to_gmem(0)

  num_sms = config.num_sms
  if num_sms is None:
    num_sms = 1 if interpret else config.ctas_per_sm * sm90.device_sm_count()
  if config.num_compute_wgs == 2:
    flat = dict(num_sms=num_sms) if config.pipeline_across_items else {}
    body = functools.partial(
        _body_2wg_flat if config.pipeline_across_items else _body_2wg,
        config=config, num_groups=num_groups, grid_k=grid_k, grid_n=grid_n,
        out_dtype=out_dtype, in_transforms_lhs=in_transforms_lhs,
        in_transforms_rhs=in_transforms_rhs, out_transforms=out_transforms, **flat,
    )
    scratch_types = []
    extra = dict(num_threads=_warpgroups(config), thread_name="wg")
  else:
    scratch_types = [plgpu.SMEM((bk, bn), out_dtype, transforms=out_transforms)]
    extra = {}

  i32 = lambda x: x.astype(jnp.int32)
  side = ()
  if config.side_rows:
    local = i32(starts[:num_groups]), i32(ends[:num_groups])
    gather = backends.side_rows_kernel(interpret) if config.side_gather_kernel else None
    side = gather.gather(lhs, rhs, *local) if gather else side_buffers(lhs, rhs, *local)
  args = match_varying(i32(starts), i32(ends), i32(first_row), i32(num_blocks), lhs, rhs,
                       *side)
  lhs = args[4]
  kernel = plgpu.kernel(
      body,
      out_type=out_struct((num_groups, k, n), out_dtype, lhs),
      scratch_types=scratch_types,
      grid=(num_sms,),
      grid_names=("sm",),
      compiler_params=sm90.compiler_params(interpret),
      interpret=_interpret_params(interpret),
      **extra,
  )
  # plgpu.kernel drops the shard_map axis type of out_type: restore it.
  return make_varying(kernel(*args), varying_axes(lhs))


def _warpgroups(config: MosaicDwConfig) -> int:
  """Warpgroups of a CTA: the producer, the consumers, the masker if any."""
  if config.num_compute_wgs == 1:
    return 1
  return 4 if config.mask_warpgroup else 3


def _interpret_params(interpret):
  # ``True`` would select Pallas' generic interpreter, which cannot run TMA
  # pipelines; the GPU interpreter models TMA, wgmma and barriers.
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret or None

