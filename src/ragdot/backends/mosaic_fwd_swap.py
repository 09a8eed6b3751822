"""The forward / dX grouped matmul with the rows on wgmma's N axis
(``MosaicFwdConfig(ring=True, swap=True)``; ``mosaic_fwd.gmm`` calls here).

Each item computes ``out[rows, cols]^T = W[:, cols]^T @ x[rows]^T`` for up to
``swap_rows`` (R: 256 by default, wgmma's largest N) rows of one group and 128
output columns: each consumer warpgroup holds a (64 columns, R rows) f32
accumulator and feeds wgmma the weight block as its A operand (M = 64 columns)
and the rows as its B operand (N = R rows).  A
group's last few rows (``tail_rows``, up to 64) then ride along with the tile
before them on the weight block already in SMEM, as more N: a second wgmma of
N = tail_rows, or with ``tail_split`` two wgmmas of (R + tail_rows) / 2 rows;
or with ``tail_on_m`` (up to 32 rows) row-major on the first consumer: one wgmma
of the tile's last 64 rows (M) by the block's 128 columns (N) into a second,
(64, 128) accumulator, of which only the tail rows are stored.
With ``short_tile_rows`` (64 or 128) a tile whose rows end within that many
runs wgmmas of that N instead (skewed routing leaves many groups far smaller
than R).
No tail item streams its weight block again, as in the row-major ring; but a
folded tile measured ~1.47 plain ones of tensor-pipe time, not the 1.125 its
rows say (docs/performance.md v19i: as if each extra wgmma cost ~0.39 of an
N = 256 one; cuBLAS's N = 128 wgmmas, v35f, show that is no rule of the
instruction itself; splitting a tile's rows into two N 128 wgmmas per consumer
cost 2-5%, v36a).

The epilogue writes each consumer's (columns, rows) tile transposed into a
(rows, columns) staging buffer, 64 rows at a time, and stores its rows with TMA;
``swizzle_staging`` swizzles that buffer (spreading the transposed writes over
the shared-memory banks).

Group-aligned tiles: a group's rows start a new tile; a tile's rows past its
group's end are computed and never stored.  Rows outside the shard's window
(group_offset) and past the groups' end are written as zeros by the consumers
after their compute items, R-row blocks dealt round-robin.  One producer
warpgroup runs one ring of stages through all of its CTA's items.

With ``share_rows`` the kernel runs on 2-CTA clusters: an item is a row tile and
two adjacent n tiles, one per CTA; each CTA loads half of every stage's rows by
TMA multicast into both CTAs' SMEM (and its own weight block), and a stage is
refilled once the consumers of both CTAs released it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ragdot.backends import mosaic_fwd as mf
from ragdot.backends import mosaic_fwd_ring as ring
from ragdot.backends import sm90

_COLS = 64  # output columns per consumer: wgmma's M
SCALE_COLS = _COLS  # scale blocks of a multiple of these columns: one scale per consumer
_SCALES_AHEAD = 2  # k steps between reading a per-block scale and storing it into its stage
_CHUNK = 64  # rows per epilogue store


def _parts(cfg: mf.MosaicFwdConfig, layout: str) -> tuple[tuple[int, int], ...]:
  """(first row in the tile, rows) of each wgmma of a tile: one of R = swap_rows
  rows ("plain"); with a folded tail ("tail"), R + tail_rows (``tail_split``: two
  halves of (R + tail_rows) / 2); a short tile ("short"), short_tile_rows."""
  rows = cfg.swap_rows
  if layout == "plain":
    return ((0, rows),)
  if layout == "short":
    return ((0, cfg.short_tile_rows),)
  if cfg.tail_split:
    half = (rows + cfg.tail_rows) // 2
    return ((0, half), (half, half))
  return ((0, rows), (rows, cfg.tail_rows))


def _layouts(cfg: mf.MosaicFwdConfig, row0, row_end) -> list[tuple[str, Any]]:
  """(layout, predicate) of each tile layout of the config; for any tile
  exactly one predicate holds (None: the config has only that layout)."""
  out, plain = [], None
  if cfg.tail_rows:
    has_tail = row_end > row0 + cfg.swap_rows
    out.append(("tail", has_tail))
    plain = ~has_tail
  if cfg.short_tile_rows:
    short = row_end <= row0 + cfg.short_tile_rows
    out.append(("short", short))
    plain = ~short if plain is None else plain & ~short
  return out + [("plain", plain)]


def _per_layout(layouts, fn) -> None:
  """fn(layout) under its predicate (directly when it is the only layout)."""
  for layout, pred in layouts:
    if pred is None:
      fn(layout)
    else:
      pl.when(pred)(functools.partial(fn, layout))


def _body(tiles_gmem, scal_gmem, lhs_gmem, rhs_gmem, out_gmem, *, m: int, k: int, n: int,
          cfg: mf.MosaicFwdConfig, transpose_rhs: bool, num_ctas: int,
          gate: ring.RowGate | None = None, stage_widened: bool = False, scale_gmem=None,
          scale_block: tuple[int, int] = (0, 0)):
  bn, bk, stages, tr = cfg.block_n, cfg.block_k, cfg.num_stages, cfg.tail_rows
  rows_t = cfg.swap_rows  # R, rows per tile
  swizzled, share = cfg.swizzle_staging, cfg.share_rows
  pair = 2 if share else 1  # n tiles per item: one per CTA of the cluster
  (grid_n, k_steps, max_tiles, num_tiles, lo, hi, za, zb, num_zero_work, _, b_shape, cta,
   my_items) = ring.item_space(tiles_gmem, scal_gmem, k=k, n=n, block_n=bn, block_k=bk,
                               transpose_rhs=transpose_rhs, num_ctas=num_ctas,
                               n_tiles_per_item=pair, gate=gate)
  # share: cta counts clusters; each CTA takes its rank's n tile of an item.
  rank = lax.axis_index("cluster") if share else 0
  dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype
  # Weight-only 8-bit (W8A16): 8-bit weights, 16-bit rows.  Each consumer loads
  # its weight slice, widens it in registers and feeds wgmma A from there or,
  # written to one of its `staged` SMEM buffers, from SMEM (wgmma takes only
  # 16-bit pairs from SMEM, and registers only as a K-major A).
  w_dtype = rhs_gmem.dtype
  widen = w_dtype != dtype
  staged = (cfg.widen_staging or int(stage_widened)) if widen else 0
  if widen and (cfg.tail_on_m or not (transpose_rhs or staged)):
    raise NotImplementedError("8-bit weights with 16-bit rows need no tail_on_m (the weights "
                              "are wgmma's A operand only), and widen_staging for rhs [g, k, n]")
  # Scaled weights (scale blocks of scale_block = (t, c); t a multiple of bk, so a
  # k step lies in one block): each stage also holds its k step's scales.  Per
  # column (c = 1, scale_gmem [g, k // t, n]): a row of the n tile's, by TMA.  Per
  # block (c a multiple of 64, scale_gmem in rhs's layout): one per consumer, read
  # and stored by the producer (a TMA box would need 16 bytes).
  scaled = scale_gmem is not None
  if scaled and not widen:
    raise NotImplementedError("weight scales need 8-bit weights beside 16-bit rows")
  scale_rows, scale_cols = scale_block
  per_block = scaled and scale_cols > 1
  if per_block and scale_cols % SCALE_COLS:
    raise ValueError(f"scale blocks of {scale_cols} columns split a consumer's {_COLS}")
  # [g, k, n] 8-bit weights: 64-byte swizzle tiles, so each consumer's 64 columns
  # are whole tiles.
  w_minor = 64 if widen and not transpose_rhs else min(b_shape[1], bk)

  scratch = dict(
      # A stage's rows: R, or R + tail_rows for a tile with a folded tail.
      x_smem=plgpu.SMEM((stages, rows_t + tr, bk), dtype, transforms=sm90.swizzled(bk, dtype)),
      # (forward: wgmma takes the (bk, 64) weight slice as an MN-major A only with a
      # swizzle of at most bk elements; 128 bytes at bk = 64, 64 at bk = 32)
      w_smem=plgpu.SMEM((stages, *b_shape), w_dtype, transforms=sm90.swizzled(w_minor, w_dtype)),
      # (per-block scales: the producer's own arrival)
      produced=plgpu.Barrier(num_arrivals=2 + bool(tr) + scaled, num_barriers=stages),
      # share: the partner's multicast writes this CTA's slots too, so a slot
      # is refilled once the consumers of both CTAs released it.
      consumed=(plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=2,
                                     num_barriers=stages) if share
                else plgpu.Barrier(num_arrivals=2, num_barriers=stages)),
      # Row-major (rows, columns), one per consumer; stores start at any row
      # (swizzled too: the swizzle follows the address bits).
      o_smem=plgpu.SMEM((2, _CHUNK, _COLS), out_dtype,
                        transforms=(plgpu.SwizzleTransform(128),) if swizzled else ()),
  )
  if staged:  # `staged` widened weight slices per consumer, as laid out in w_smem
    a_shape = (_COLS, bk) if transpose_rhs else (bk, _COLS)
    scratch["a_smem"] = plgpu.SMEM((2, staged, *a_shape), dtype,
                                   transforms=sm90.swizzled(a_shape[1], dtype))
  if scaled:
    scratch["s_smem"] = plgpu.SMEM((stages, 2 if per_block else bn), jnp.float32)

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(x_smem, w_smem, produced, consumed, o_smem, a_smem=None, s_smem=None):
    wg = lax.axis_index("wg")

    def tile_of(w):
      """(n tile, group, row0, row_start, row_end) of work item w (row-major)."""
      with jax.named_scope("item"):  # (profile range: its loads from GMEM)
        ni, *rest = mf._work_item(tiles_gmem, w, num_tiles, max_tiles, pl.cdiv(grid_n, pair),
                                  cfg)
      return (ni * pair + rank, *rest)

    works = functools.partial(ring.for_each_item, my_items, cta, num_ctas, k_steps)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def scale_at(grp, kb, col):
        """The block scale of weight column ``col`` (clamped into n) in k block ``kb``."""
        cb = lax.div(jnp.minimum(col, n - 1), scale_cols)
        return scale_gmem[grp, cb, kb] if transpose_rhs else scale_gmem[grp, kb, cb]

      def load(w, step0):
        ni, grp, row0, _, row_end = tile_of(w)
        layouts = _layouts(cfg, row0, row_end)
        # (an odd grid_n leaves the last pair's second tile past n: it loads
        # the last tile's block, computes and stores nothing)
        ni_in = jnp.minimum(ni, grid_n - 1) if grid_n % pair else ni

        def scales_of(kk):  # a step's per-block scales, one per consumer
          kb = lax.div(jnp.minimum(kk, k_steps - 1) * bk, scale_rows)
          return tuple(scale_at(grp, kb, ni_in * bn + c * _COLS) for c in range(2))

        def step(kk, ahead):
          # Per-block scales are plain loads (mostly from DRAM: each is read
          # once), read _SCALES_AHEAD steps before their stage is filled so their
          # latency stays off the producer's path.  (At decode on the H200 the
          # distance made no difference, docs/performance.md v61b: the consumers
          # set the pace there.)
          if per_block:
            ahead = (*ahead, scales_of(kk + _SCALES_AHEAD))
            held, ahead = ahead[0], ahead[1:]
          slot = ring.free_slot(consumed, step0 + kk, stages)
          cols = pl.ds(kk * bk, bk)

          def rows(layout: str) -> None:
            parts = _parts(cfg, layout)
            for r, count in parts:
              # share: this CTA loads half the rows, multicast to both CTAs.
              plgpu.copy_gmem_to_smem(lhs_gmem.at[pl.ds(row0 + r, count), cols],
                                      x_smem.at[slot].at[pl.ds(r, count)], produced.at[slot],
                                      collective_axes="cluster" if share else None)
            if tr and len(parts) == 1:  # a bare arrival for the copy a tail would make
              plgpu.barrier_arrive(produced.at[slot])

          # The weight block first: it comes from DRAM, the rows mostly from L2
          # (docs/performance.md v34d-e: 0.993-0.998x the time of rows first).
          with jax.named_scope("load"):
            plgpu.copy_gmem_to_smem(
                ring.rhs_block(rhs_gmem, grp, ni_in, cols, bn, transpose_rhs),
                w_smem.at[slot], produced.at[slot])
            if per_block:
              for c, value in enumerate(held):
                s_smem[slot, c] = value
              plgpu.barrier_arrive(produced.at[slot])
            elif scaled:
              plgpu.copy_gmem_to_smem(
                  scale_gmem.at[grp, lax.div(kk * bk, scale_rows), pl.ds(ni_in * bn, bn)],
                  s_smem.at[slot], produced.at[slot])
            _per_layout(layouts, rows)
          return ahead

        first = tuple(scales_of(kk) for kk in range(_SCALES_AHEAD)) if per_block else ()
        lax.fori_loop(0, k_steps, step, first)

      works(load)
      ring.drain(consumed, my_items * k_steps, stages)

    @pl.when(wg < 2)
    def _consumers():
      plgpu.set_max_registers(232, action="increase")
      my_smem = o_smem.at[wg]
      mine = pl.ds(pl.multiple_of(wg * _COLS, _COLS), _COLS)

      def compute(w, step0):
        ni, _, row0, row_start, row_end = tile_of(w)
        col = ni * bn + wg * _COLS

        def tile(layout: str, tail_on_m: bool = False) -> None:
          # A copy of the tile per layout of its wgmmas, chosen per tile outside
          # the k loop: no accumulator crosses a branch while its wgmmas run.
          # tail_on_m: this consumer also runs the folded tail, row-major.
          parts = _parts(cfg, "plain" if tail_on_m else layout)
          shapes = [(_COLS, count) for _, count in parts]
          if tail_on_m:  # the tile's last 64 rows x all bn columns
            shapes.append((_COLS, bn))

          def acc_scope(*accs):
            def mma(slot, kk):
              wb = w_smem.at[slot]
              # A: this consumer's 64 columns of the weight block, (64, bk).
              a = wb.at[mine] if transpose_rhs else wb.at[:, mine]
              # (the slice's columns run along its rows for [g, n, k], else along
              # its columns)
              scale = None
              if per_block:  # one scale for the slice
                scale = s_smem[slot, wg]
              elif scaled:
                scale = (s_smem.at[slot, mine], 0 if transpose_rhs else 1)
              if widen and not staged:
                a = sm90.widened_operand(a, dtype, scale=scale)
              elif widen:
                # Two buffers alternate by step: the wgmmas of step kk - 2 are
                # done (consume_item keeps at most the last step's in flight).
                buf = a_smem.at[wg, lax.rem(kk, staged)]
                a = sm90.widened_operand(a, dtype, staging=buf, wait=staged == 1, scale=scale)
              if not transpose_rhs:  # the (bk, 64) slice, as an MN-major A
                a = a.transpose((1, 0))
              for acc_ref, (r, count) in zip(accs, parts):
                plgpu.wgmma(acc_ref, a, x_smem.at[slot].at[pl.ds(r, count)].transpose((1, 0)))
              if tail_on_m:
                plgpu.wgmma(accs[-1], x_smem.at[slot].at[pl.ds(rows_t + tr - _COLS, _COLS)],
                            wb.transpose((1, 0)) if transpose_rhs else wb)

            ring.consume_item(produced, consumed, step0, k_steps, stages, mma,
                              in_flight=len(shapes), delay_release=cfg.delay_release)
            return tuple(acc_ref[...] for acc_ref in accs)

          accs = pl.run_scoped(acc_scope, *[plgpu.ACC(sh, jnp.float32) for sh in shapes])

          def store(chunk, buf, hs, s, rows, col, transposed):
            """Registers -> buf -> out rows [s, s + rows) (buf's row 0 is row hs)."""
            with jax.named_scope("store"):
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)
              sm90.stage(buf, chunk, transposed)
              plgpu.commit_smem()
              mf._store_rows(buf, out_gmem, s - hs, s, rows, col, max_rows=buf.shape[0],
                             width=_COLS)

          @pl.when(col < n)
          def _store():
            for acc, (r, count) in zip(accs, parts):
              for c0 in range(0, count, _CHUNK):  # stores of at most 64 rows
                width = min(_CHUNK, count - c0)
                hs = row0 + r + c0
                s, rows = mf._overlap(row_start, row_end, hs, hs + width)
                chunk = acc if width == count else acc[:, c0:c0 + width]
                buf = my_smem if width == _CHUNK else my_smem.at[pl.ds(0, width)]
                pl.when(rows > 0)(functools.partial(store, chunk, buf, hs, s, rows, col, True))

          if tail_on_m:  # rows [row0 + R, + tail_rows) of the row-major tail, by 64 columns
            hs = row0 + rows_t + tr - _COLS
            s, rows = mf._overlap(row_start, row_end, row0 + rows_t, row0 + rows_t + tr)
            for c0 in range(0, bn, _COLS):
              tcol = ni * bn + c0
              pl.when((tcol < n) & (rows > 0))(functools.partial(
                  store, accs[-1][:, c0:c0 + _COLS], my_smem, hs, s, rows, tcol, False))

        layouts = _layouts(cfg, row0, row_end)
        if cfg.tail_on_m:  # the first consumer runs the tail; the other a plain tile
          preds = dict(layouts)
          on_m = preds["tail"] & (wg == 0)
          pl.when(on_m)(lambda: tile("tail", tail_on_m=True))
          short = preds.get("short")
          layouts = [(layout, pred) for layout, pred in layouts if layout == "short"]
          layouts.append(("plain", ~on_m if short is None else ~on_m & ~short))
        _per_layout(layouts, tile)

      works(compute)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      # Rows outside the shard's window (and past the groups), after the ring:
      # zero items of one R-row block and n tile, round-robin over the CTAs.
      z_cta, z_ctas = cta * pair + rank, num_ctas * pair

      @pl.loop(0, pl.cdiv(jnp.maximum(num_zero_work - z_cta, 0), z_ctas))
      def _zeros(j):
        blk, ni = mf._zero_item(z_cta + j * z_ctas, grid_n, za, zb)
        mf._zero_fill_once(my_smem, j == 0, 128 if swizzled else 0)
        col = ni * bn + wg * _COLS

        # A loop, not unrolled: the stores' code once instead of per chunk (this
        # section was most of the kernel's lowering time, in Mosaic's layout
        # inference).
        @pl.when(col < n)
        def _():
          @pl.loop(0, pl.cdiv(rows_t, _CHUNK))
          def _(c):
            hs = blk * rows_t + c * _CHUNK
            # (the block's last chunk ends at the block's end: R need not divide by 64)
            he = jnp.minimum(jnp.minimum(hs + _CHUNK, (blk + 1) * rows_t), m)
            for start, count in mf._outside_window(hs, he, lo, hi):
              mf._store_rows(my_smem, out_gmem, 0, start, count, col, max_rows=_CHUNK,
                             width=_COLS)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_offset: jax.Array | None,
        *, transpose_rhs: bool, out_dtype: Any, config: mf.MosaicFwdConfig,
        interpret: Any = False, rhs_scale: jax.Array | None = None,
        scale_block: tuple[int, int] = (0, 0), **gated: Any) -> jax.Array:
  """``mosaic_fwd.gmm`` for a ``swap=True`` config (checked by ``mosaic_fwd.gmm``:
  supported dtypes and alignments, non-empty operands, m >= swap_rows + tail_rows,
  a config that fits SMEM, a 16-bit output; ``rhs_scale`` f32: ``[g, k // t, n]``
  when ``scale_block`` = (t, 1), else in rhs's layout with ``scale_block`` =
  (t, c), c a multiple of ``SCALE_COLS``).  ``gated``:
  ``ring.launch``'s ``gate``, ``into`` and ``schedule``."""
  # (the interpreter takes wgmma operands from SMEM only: there the widened
  # weights always go through a buffer; on the GPU [g, n, k] weights stay in
  # registers unless widen_staging is set)
  body = functools.partial(_body, stage_widened=bool(interpret), scale_block=scale_block)
  return ring.launch(body, lhs, rhs, group_sizes, group_offset, rows=config.swap_rows,
                     transpose_rhs=transpose_rhs, out_dtype=out_dtype, config=config,
                     interpret=interpret, rhs_scale=rhs_scale, **gated)
