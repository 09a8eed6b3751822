"""The forward / dX grouped matmul on a hand-written ring, with a group's few
last rows optionally riding along with the row tile before them
(``MosaicFwdConfig(ring=True, tail_rows=...)``; ``mosaic_fwd.gmm`` calls here).

The ring (as in ``mosaic_dw``): one sequence of stages through all of a CTA's
(row tile, n tile) items, in the config's grid order (by default row-tile order
with every n tile of a row tile in turn; ``grid_minor_dim=1`` walks strips of
``grid_tile_width`` n tiles down the row tiles); a producer warpgroup and two
consumer warpgroups of 64 rows each.
Rows outside the shard's window: with ``producer_zeros`` (the default for
shard calls, see ``mosaic_fwd.resolve_producer_zeros``) the producer
warpgroup writes them between its loads (stores of at most ``zero_box_rows``
rows from a zeroed buffer; with ``zero_front`` the CTAs with one compute item
fewer first take a front of them, written after their loads); otherwise the
consumers write them after the ring, as zero items, the CTAs with one compute
item fewer taking the first of them (``zero_lead``) while the others still
compute.

Tails: row tiles are aligned to groups, so a group's last tile computes 128
rows whatever it holds.  On top-8 routing a group has 256 +- 15 rows (Qwen3) or
128 +- 11 (DeepSeek-V3): a quarter to a third of all tiles hold 1-16 real rows,
1.24 (Qwen3) and 1.46 (DeepSeek-V3) computed rows per real row.  With
``tail_rows`` the schedule drops a group's last tile when it holds at most that
many rows (and is not the group's only tile); the tile before it then covers
128 + up to ``tail_rows`` rows.  The extra rows are computed with the operands
swapped: wgmma's M must be 64 per warpgroup, but its N can be 8-256, so each
consumer computes ``out[tail, its half of the columns]^T = W[:, half]^T @
x[tail]^T`` into a (block_n / 2, tail_rows) accumulator on the weight block
already in SMEM, and stores it transposed.  Each swapped wgmma reads a
(block_n / 2 x block_k) weight slice from SMEM for a few rows, so a folded tile
costs SMEM bandwidth: measured on the H200 (docs/performance.md v14) it pays
where padding dominates (DeepSeek-V3) and not on the Qwen3 shapes.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ragdot import backends
from ragdot.backends import mosaic_fwd as mf
from ragdot.backends import sm90
from ragdot.manual_axes import make_varying, match_varying, out_struct, varying_axes

_ROWS = 128  # two consumers x 64 rows
ROWS = _ROWS  # rows per tile (the schedule's block_m)
_HALF = _ROWS // 2


def _front_split(cta, num_ctas: int, num_work, total, lead: int):
  """``(unit(j), n_front, n_rest)``: CTA ``cta``'s share of ``total`` zero units
  (items or boxes), the ``n_front`` front ones first.

  CTAs ``[rem, num_ctas)`` run one compute item fewer than the others when
  ``rem = num_work % num_ctas`` is not 0.  The first ``lead`` units of
  each such CTA come from the front of the list (unit ``i`` of that front
  goes to the ``i % short``-th of them); all later units go round-robin
  over every CTA.
  """
  rem = lax.rem(num_work, num_ctas)
  short = jnp.where(rem == 0, 0, num_ctas - rem)
  front = jnp.minimum(short * lead, total)
  idx = cta - rem
  n_front = jnp.where((short > 0) & (idx >= 0),
                      pl.cdiv(jnp.maximum(front - idx, 0), jnp.maximum(short, 1)), 0)
  n_rest = pl.cdiv(jnp.maximum(total - front - cta, 0), num_ctas)

  def unit(j):
    return jnp.where(j < n_front, idx + j * short, front + cta + (j - n_front) * num_ctas)

  return unit, n_front, n_rest


def _zero_items(cta, num_ctas: int, num_work, num_zero_work, lead: int):
  """``(item(j), count)``: CTA ``cta``'s zero items, in order (``_front_split``)."""
  item, n_front, n_rest = _front_split(cta, num_ctas, num_work, num_zero_work, lead)
  return item, n_front + n_rest


def _box_coords(b, chunks: int):
  """(zero item, 64-row half, column chunk) of zero box ``b`` (a zero item's
  boxes are consecutive)."""
  return lax.div(b, 2 * chunks), lax.rem(lax.div(b, chunks), 2), lax.rem(b, chunks)


def _boxes_due(steps, boxes, total_steps, exact: bool):
  """How many of ``boxes`` zero boxes are due once ``steps`` of ``total_steps``
  k steps are issued: spread evenly (``exact``: floor(steps * boxes / total),
  without forming the product, which could overflow int32 only when
  total_steps**2 does), else front-loaded at ceil(boxes / total) per step.
  0 steps: none; all steps: all (none with no steps at all)."""
  total = jnp.maximum(total_steps, 1)
  if exact:
    q, r = lax.div(boxes, total), lax.rem(boxes, total)
    return q * steps + lax.div(r * steps, total)
  return jnp.minimum(boxes, steps * pl.cdiv(boxes, total))


def _box_split(cta, num_ctas: int, num_boxes, num_work, front: int):
  """``(box(i), n_front, n_rest)``: the zero boxes of CTA ``cta``, front ones
  first (``_front_split``).  ``front`` 0 is ``_front_split``'s lead-0 split (box
  ``b`` to CTA ``b % num_ctas``) without its scalar work on ``num_work``, so
  the default kernel is the one measured before ``zero_front`` existed."""
  if front:
    return _front_split(cta, num_ctas, num_work, num_boxes, front)
  return (lambda i: cta + i * num_ctas), 0, pl.cdiv(jnp.maximum(num_boxes - cta, 0), num_ctas)


def _producer_zero_boxes(z_smem, out_gmem, cta, num_ctas: int, num_zero_work, grid_n: int,
                         za, zb, lo, hi, *, m: int, n: int, bn: int, cn: int,
                         num_work, front: int):
  """``(zero_box(i), n_front, n_rest)``: the producer's share of the zero rows.

  Each zero item (a 128-row block outside the shard's window, one n tile) is
  cut into boxes of 64 rows x ``cn`` columns (``_box_coords``).  With
  ``front`` 0, box ``b`` goes to CTA ``b % num_ctas``; otherwise each CTA with
  one compute item fewer (of ``num_work``) first takes up to ``front`` boxes
  (``_front_split``), its ``n_front`` boxes ``i < n_front``, and the rest go
  round-robin.  ``zero_box(i)`` stores this CTA's i-th box: the rows of its 64
  outside the window ``[lo, hi)``, from ``z_smem`` (zeros, at most 64 rows) in
  power-of-two TMA stores of at most its rows each.
  """
  chunks = bn // cn
  box, n_front, n_rest = _box_split(cta, num_ctas, num_zero_work * 2 * chunks, num_work, front)

  def zero_box(i):
    item, half, c = _box_coords(box(i), chunks)
    blk, ni = mf._zero_item(item, grid_n, za, zb)
    hs = blk * _ROWS + half * _HALF
    col = ni * bn + c * cn
    zr = min(z_smem.shape[0], m)

    @pl.when(col < n)
    def _():
      for start, rows in mf._outside_window(hs, jnp.minimum(hs + _HALF, m), lo, hi):
        for q in range(0, _HALF, zr):  # pieces of at most zr rows
          mf._store_rows(z_smem, out_gmem, 0, start + q, jnp.clip(rows - q, 0, zr), col,
                         max_rows=zr, width=cn)

  return zero_box, n_front, n_rest


# The ring's protocol, shared with ``mosaic_fwd_swap``: CTA ``cta`` takes items
# ``cta + j * num_ctas``; ring step ``s`` uses slot ``s % stages``; the producer
# fills a slot once both consumers have released it (``consumed``), and each
# consumer releases a step's slot once the next step's wgmmas are issued and
# its own are done (``delay_release=0``: once its own are done; ``consume_item``).

class ItemSpace(NamedTuple):
  """What a ring body reads off its schedule: n tiles, k steps, the schedule's
  tile capacity and counts (``mf._work_counts``), the rhs block's shape, and
  this CTA (``cta``) with its number of items (``for_each_item``)."""
  grid_n: int
  k_steps: int
  max_tiles: int
  num_tiles: Any
  lo: Any
  hi: Any
  za: Any
  zb: Any
  num_zero_work: Any
  num_work: Any
  b_shape: tuple[int, int]
  cta: Any
  my_items: Any


class RowGate(NamedTuple):
  """A kernel that runs only when its shard's rows (``hi - lo``, counted on the
  device) are above ``limit`` (``above``) or at most ``limit``; otherwise its
  schedule is empty and it exits at once, writing nothing."""
  limit: int
  above: bool


def item_space(tiles_gmem, scal_gmem, *, k: int, n: int, block_n: int, block_k: int,
               transpose_rhs: bool, num_ctas: int, n_tiles_per_item: int = 1,
               gate: RowGate | None = None) -> ItemSpace:
  """The ``ItemSpace`` of a ring body (``launch``'s schedule): items are
  (row tile, n tile) pairs, or (row tile, ``n_tiles_per_item`` n tiles) for a
  cluster of that many CTAs; CTA (or cluster) ``cta`` takes ``cta + j *
  num_ctas``.  With ``gate`` closed there are no items and no zero rows."""
  grid_n = pl.cdiv(n, block_n)
  k_steps = pl.cdiv(k, block_k)
  max_tiles = tiles_gmem.shape[0] // 4
  num_tiles, lo, hi, za, zb, num_zero_work, _ = mf._work_counts(scal_gmem, grid_n)
  if gate is not None:
    rows = hi - lo
    run = rows > gate.limit if gate.above else rows <= gate.limit
    num_tiles = jnp.where(run, num_tiles, 0)
    num_zero_work = jnp.where(run, num_zero_work, 0)
  num_work = num_tiles * pl.cdiv(grid_n, n_tiles_per_item)
  b_shape = (block_n, block_k) if transpose_rhs else (block_k, block_n)
  cta = lax.axis_index("sm")
  my_items = pl.cdiv(jnp.maximum(num_work - cta, 0), num_ctas)
  return ItemSpace(grid_n, k_steps, max_tiles, num_tiles, lo, hi, za, zb, num_zero_work,
                   num_work, b_shape, cta, my_items)


def for_each_item(my_items, cta, num_ctas: int, k_steps, body) -> None:
  """``body(w, step0)`` for this CTA's items (step0: the ring step of item w's
  first k step)."""
  @pl.loop(0, my_items)
  def _(j):
    body(cta + j * num_ctas, j * k_steps)


def free_slot(consumed, step, stages: int):
  """The producer's slot for ring step ``step``, once both consumers released it."""
  slot = lax.rem(step, stages)
  with jax.named_scope("free"):  # (profile ranges: sm90.profiling)
    pl.when(step >= stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))
  return slot


def rhs_block(rhs_gmem, grp, ni, cols, bn: int, transpose_rhs: bool):
  """rhs[grp]'s (k slice ``cols``, n tile ``ni``) block: (bk, bn), or (bn, bk)
  from rhs [g, n, k] for dX."""
  if transpose_rhs:
    return rhs_gmem.at[grp, pl.ds(ni * bn, bn), cols]
  return rhs_gmem.at[grp, cols, pl.ds(ni * bn, bn)]


def drain(consumed, total_steps, stages: int) -> None:
  """Waits for the consumers' last release of every slot (before the CTA exits)."""
  @pl.loop(jnp.maximum(total_steps - stages, 0), total_steps)
  def _(step):
    plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])


def consume_item(produced, consumed, step0, k_steps, stages: int, mma, in_flight: int,
                 delay_release: int = 1) -> None:
  """A consumer's k steps of one item: ``mma(slot, kk)`` issues step kk's
  wgmmas (``in_flight`` of them).  ``delay_release`` 1: the previous step's slot is
  released once they are done (one step's wgmmas stay in flight across the
  next barrier wait), the item's last slot after its last wgmma; 0: each step
  waits for its own wgmmas and releases its slot at once (cuBLAS's consumer,
  docs/performance.md v35f), so a late stage never holds back the release
  of the one before it."""
  @pl.loop(0, k_steps)
  def _(kk):
    step = step0 + kk
    slot = lax.rem(step, stages)
    with jax.named_scope("wait"):
      plgpu.barrier_wait(produced.at[slot])
    with jax.named_scope("mma"):
      mma(slot, kk)
      if delay_release:
        plgpu.wgmma_wait(in_flight)  # the previous step's are done
        pl.when(kk > 0)(lambda: plgpu.barrier_arrive(
            consumed.at[lax.rem(step + stages - 1, stages)]))
      else:
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(consumed.at[slot])

  if delay_release:
    with jax.named_scope("last_mma"):
      plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(consumed.at[lax.rem(step0 + k_steps - 1, stages)])


def _body(tiles_gmem, scal_gmem, lhs_gmem, rhs_gmem, out_gmem, *, m: int, k: int, n: int,
          cfg: mf.MosaicFwdConfig, transpose_rhs: bool, num_ctas: int,
          gate: RowGate | None = None):
  bn, bk, stages, cn = cfg.block_n, cfg.block_k, cfg.num_stages, cfg.epilogue_n
  tn = bn // 2  # tail columns per consumer
  tr = cfg.tail_rows
  (grid_n, k_steps, max_tiles, num_tiles, lo, hi, za, zb, num_zero_work, num_work, b_shape, cta,
   my_items) = item_space(tiles_gmem, scal_gmem, k=k, n=n, block_n=bn, block_k=bk,
                          transpose_rhs=transpose_rhs, num_ctas=num_ctas, gate=gate)
  dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype

  scratch = dict(
      a_smem=plgpu.SMEM((stages, _ROWS, bk), dtype, transforms=sm90.swizzled(bk, dtype)),
      b_smem=plgpu.SMEM((stages, *b_shape), dtype, transforms=sm90.swizzled(b_shape[1], dtype)),
      produced=plgpu.Barrier(num_arrivals=3 if tr else 2, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      # Row-major: stores start at any row.
      o_smem=plgpu.SMEM((2, _HALF, cn), out_dtype),
  )
  if tr:  # tail_rows 0: the same ring without tails (a baseline)
    scratch.update(t_smem=plgpu.SMEM((stages, tr, bk), dtype, transforms=sm90.swizzled(bk, dtype)),
                   to_smem=plgpu.SMEM((2, tr, tn), out_dtype))
  pz = cfg.producer_zeros
  if pz:  # the producer's zero rows (row-major, like o_smem: stores start at any row)
    scratch.update(z_smem=plgpu.SMEM((cfg.zero_box_rows, cn), out_dtype))

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(a_smem, b_smem, produced, consumed, o_smem, t_smem=None, to_smem=None,
             z_smem=None):
    wg = lax.axis_index("wg")

    def tile_of(w):
      """(n tile, group, row0, row_start, row_end) of work item w."""
      return mf._work_item(tiles_gmem, w, num_tiles, max_tiles, grid_n, cfg)

    works = functools.partial(for_each_item, my_items, cta, num_ctas, k_steps)

    @pl.when(wg == 2)
    def _producer():
      if pz:  # (before the register cut: the fill holds a few vectors of zeros)
        z_smem[...] = jnp.zeros(z_smem.shape, z_smem.dtype)
        plgpu.commit_smem()
      plgpu.set_max_registers(40, action="decrease")
      my_steps = my_items * k_steps
      # front: boxes written once this CTA's loads are issued (zero_front); the
      # others are spread over its k steps.
      zero_box, front, my_boxes = _producer_zero_boxes(
          z_smem, out_gmem, cta, num_ctas, num_zero_work, grid_n, za, zb, lo, hi, m=m, n=n,
          bn=bn, cn=cn, num_work=num_work, front=cfg.zero_front) if pz else (None, 0, 0)

      # The most k steps a CTA can have (static): exact spreading below 2**31.
      exact = (pl.cdiv(max_tiles * grid_n, num_ctas) * k_steps) ** 2 < 2**31
      boxes_due = lambda steps: front + _boxes_due(steps, my_boxes, my_steps, exact)

      def load(w, step0):
        ni, grp, row0, _, row_end = tile_of(w)
        has_tail = row_end > row0 + _ROWS

        @pl.loop(0, k_steps)
        def _(kk):
          step = step0 + kk
          slot = free_slot(consumed, step, stages)
          cols = pl.ds(kk * bk, bk)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[pl.ds(row0, _ROWS), cols], a_smem.at[slot],
                                  produced.at[slot])
          if tr:  # the tail's rows, or a bare arrival in their place
            pl.when(has_tail)(lambda: plgpu.copy_gmem_to_smem(
                lhs_gmem.at[pl.ds(row0 + _ROWS, tr), cols], t_smem.at[slot], produced.at[slot]))
            pl.when(~has_tail)(lambda: plgpu.barrier_arrive(produced.at[slot]))
          plgpu.copy_gmem_to_smem(rhs_block(rhs_gmem, grp, ni, cols, bn, transpose_rhs),
                                  b_smem.at[slot], produced.at[slot])
          if pz:  # this step's share of the zero rows, after its loads
            pl.loop(boxes_due(step), boxes_due(step + 1))(zero_box)

      works(load)
      total = my_items * k_steps
      if pz:  # a CTA without compute items writes all of its boxes here
        pl.loop(boxes_due(my_steps), front + my_boxes)(zero_box)
        if cfg.zero_front:
          pl.loop(0, front)(zero_box)

      drain(consumed, total, stages)

      if pz:  # the zero buffer must outlive its stores
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg < 2)
    def _consumers():
      plgpu.set_max_registers(232, action="increase")
      my_smem = o_smem.at[wg]
      my_tail = None if to_smem is None else to_smem.at[wg]

      def compute(w, step0):
        ni, _, row0, row_start, row_end = tile_of(w)
        hs = row0 + wg * _HALF
        s, c = mf._overlap(row_start, row_end, hs, hs + _HALF)
        half = pl.ds(pl.multiple_of(wg * tn, 64), tn)

        def tile(with_tail: bool) -> None:
          # Two copies of the tile, chosen per tile outside the k loop: no
          # accumulator crosses a branch while its wgmmas are in flight.
          def acc_scope(acc_ref, *tail_ref):
            def mma(slot, _):
              b = b_smem.at[slot]
              plgpu.wgmma(acc_ref, a_smem.at[slot].at[pl.ds(wg * _HALF, _HALF)],
                          b.transpose((1, 0)) if transpose_rhs else b)
              if with_tail:
                # The tail's rows, operands swapped: (tn, tr) += W[:, half]^T @ x_tail^T.
                w_t = b.at[half] if transpose_rhs else b.at[:, half].transpose((1, 0))
                plgpu.wgmma(tail_ref[0], w_t, t_smem.at[slot].transpose((1, 0)))

            consume_item(produced, consumed, step0, k_steps, stages, mma,
                         in_flight=2 if with_tail else 1, delay_release=cfg.delay_release)
            return acc_ref[...], tail_ref[0][...] if with_tail else None

          scratch = [plgpu.ACC((_HALF, bn), jnp.float32)]
          if with_tail:
            scratch.append(plgpu.ACC((tn, tr), jnp.float32))
          acc, tacc = pl.run_scoped(acc_scope, *scratch)

          def chunk(ci, col):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            sm90.stage(my_smem, sm90.column_chunk(acc, ci, cn))
            plgpu.commit_smem()
            mf._store_rows(my_smem, out_gmem, s - hs, s, c, col, max_rows=min(_HALF, m),
                           width=cn)

          pl.when(c > 0)(lambda: mf._for_each_chunk(cfg, n, ni, chunk))
          if with_tail:
            ts = row0 + _ROWS
            col = ni * bn + wg * tn
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            sm90.stage(my_tail, tacc, transposed=True)
            plgpu.commit_smem()
            pl.when(col < n)(lambda: mf._store_rows(
                my_tail, out_gmem, 0, ts, row_end - ts, col, max_rows=tr, width=tn))

        if tr:
          has_tail = row_end > row0 + _ROWS
          pl.when(has_tail)(lambda: tile(True))
          pl.when(~has_tail)(lambda: tile(False))
        else:
          tile(False)

      works(compute)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      if pz:  # the producer writes the rows outside the shard's window
        return

      # Rows outside the shard's window, after the ring.
      lead = k_steps // 2 if cfg.zero_lead is None else cfg.zero_lead
      zero_item, num_zero_items = _zero_items(cta, num_ctas, num_work, num_zero_work, lead)

      @pl.loop(0, num_zero_items)
      def _zeros(j):
        blk, ni = mf._zero_item(zero_item(j), grid_n, za, zb)
        mf._zero_fill_once(my_smem, j == 0)
        mf._store_zero_rows(my_smem, out_gmem, cfg, n, m, ni, blk * _ROWS + wg * _HALF,
                            _HALF, lo, hi)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def launch(body, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
           group_offset: jax.Array | None, *, rows: int, transpose_rhs: bool, out_dtype: Any,
           config: mf.MosaicFwdConfig, interpret: Any = False, gate: RowGate | None = None,
           into: jax.Array | None = None,
           schedule: tuple[jax.Array, jax.Array] | None = None,
           rhs_scale: jax.Array | None = None) -> jax.Array:
  """Builds the group-aligned schedule of ``rows``-row tiles (tails folded per
  ``config.tail_rows``) and runs ``body`` (a ring kernel body: producer and two
  consumer warpgroups, one CTA per SM; ``share_rows``: clusters of two, and
  ``num_ctas`` counts clusters) over it.  ``gate``: see ``RowGate``.  ``into``:
  an [m, n] output to write in place (rows the kernel does not write keep their
  values; a gate closed leaves all of them), returned.  ``schedule``: that
  schedule, built already (``backends.flat_schedules``).  ``rhs_scale``: one
  more input, handed to ``body`` as its ``scale_gmem`` keyword."""
  m, k = lhs.shape
  g_local = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tiles, scalars = schedule or backends.flat_schedule(
      group_sizes, group_offset, m=m, num_local=g_local, block_m=rows,
      use_kernel=config.schedule_kernel, interpret=bool(interpret), tail_rows=config.tail_rows)
  tiles, scalars, lhs, rhs = match_varying(tiles, scalars, lhs, rhs)
  num_ctas = mf._num_sms(config, bool(interpret))
  cluster = {}
  if config.share_rows:  # grid over clusters of 2 CTAs ("sm" indexes the cluster)
    num_ctas //= 2
    cluster = dict(cluster=(2,), cluster_names=("cluster",))
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  body = functools.partial(body, m=m, k=k, n=n, cfg=config, transpose_rhs=transpose_rhs,
                           num_ctas=num_ctas, gate=gate)
  inputs = (tiles, scalars, lhs, rhs)
  if rhs_scale is not None:  # (tiles, scalars, lhs, rhs, scale, [into,] out)
    inputs += match_varying(rhs_scale, lhs)[:1]
    body = functools.partial(_scale_last, body)
  mesh = dict(grid=(num_ctas,), grid_names=("sm",), **cluster, num_threads=3, thread_name="wg")
  params = sm90.compiler_params(interpret)
  if into is not None:
    *inputs, into = match_varying(*inputs, into)
    out = _in_place(body, mesh, params, interpret or None)(*inputs, into)
    return make_varying(out, varying_axes(lhs))
  kernel = plgpu.kernel(body, out_type=out_struct((m, n), out_dtype, lhs), **mesh,
                        compiler_params=params, interpret=interpret if interpret else None)
  return make_varying(kernel(*inputs), varying_axes(lhs))


def _scale_last(body, tiles, scalars, lhs, rhs, scale, out):
  """``body`` with the scale input passed as its ``scale_gmem`` keyword."""
  return body(tiles, scalars, lhs, rhs, out, scale_gmem=scale)


# Off only in scripts/probe_in_place_loops.py, which shows what they prevent.
BARRIERS = True


def _in_place(body, mesh: dict, params, interpret):
  """``plgpu.kernel(body)`` whose last operand is its output, written in place
  (an input/output alias: the kernel may leave rows untouched).  plgpu.kernel
  offers no aliases and takes no refs that vary over shard_map axes, so this
  calls the mpmd entry point under it (private in jax 0.11.2, which ragdot pins).

  The aliased operand and the output pass through optimization barriers: inside
  a loop body whose result is stacked (``lax.map``, vmap's one-at-a-time rule)
  XLA's dynamic-slice fusion otherwise had the kernel write into the stacked
  buffer without the operand's contents (docs/performance.md v46b-d)."""
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
  from jax._src.pallas import mpmd  # pylint: disable=g-import-not-at-top

  def aliased(*refs):  # operands, the aliased operand's input ref, the output ref
    body(*refs[:-2], refs[-1])

  @jax.custom_batching.custom_vmap
  def call(*operands):
    out_type = jax.ShapeDtypeStruct(operands[-1].shape, operands[-1].dtype)
    if BARRIERS:
      operands = (*operands[:-1], lax.optimization_barrier(operands[-1]))
    with jax_config._check_vma(False):  # as plgpu.kernel
      (out,) = mpmd._mpmd_map(
          [(plgpu.Mesh(**mesh), aliased)], (out_type,),
          input_output_aliases={len(operands) - 1: 0}, compiler_params=params,
          interpret=interpret, name="ragdot_in_place")(*operands)
    return lax.optimization_barrier(out) if BARRIERS else out

  @call.def_vmap
  def _one_at_a_time(axis_size, in_batched, *operands):
    # (under mpmd_map's own batching rule the call raised NotImplementedError and
    # the dispatcher fell back to another backend)
    del axis_size

    def one(batched):
      it = iter(batched)
      return call(*[next(it) if b else op for op, b in zip(operands, in_batched)])

    return lax.map(one, [op for op, b in zip(operands, in_batched) if b]), True

  return call


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, group_offset: jax.Array | None,
        *, transpose_rhs: bool, out_dtype: Any, config: mf.MosaicFwdConfig,
        interpret: Any = False, **gated: Any) -> jax.Array:
  """``mosaic_fwd.gmm`` for a ``ring=True`` config (checked by ``mosaic_fwd.gmm``:
  supported dtypes and alignments, non-empty operands, m >= 128 + tail_rows, a
  config that fits SMEM).  ``gated``: ``launch``'s ``gate``, ``into`` and ``schedule``."""
  return launch(_body, lhs, rhs, group_sizes, group_offset, rows=_ROWS,
                transpose_rhs=transpose_rhs, out_dtype=out_dtype, config=config,
                interpret=interpret, **gated)
