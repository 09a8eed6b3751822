"""Row-tile -> group schedule and the group_offset window, built on device.

Every backend (the pure-JAX one and the kernels) consumes the same schedule, so
the subtle arithmetic lives here once:

* ``group_bounds``: first/last row of each *local* group (the shard's groups
  ``o .. o + num_local - 1`` when ``group_offset = o``), clipped to ``[0, m)``;
  negative sizes count as 0 and groups past ``m`` are cut there.
* ``local_row_window``: the contiguous rows ``[lo, hi)`` owned by local groups;
  every other output row must be exactly zero.
* ``tile_schedule``: the row tiles of each local group.  A group's tiles start
  at its first row rounded down to a multiple of ``align`` (8: the TMA row
  granule) and step by ``block_m``, so only a group's last tile is partial (plus
  < align leading rows of the first).  At most ``cdiv(m, block_m) + num_local -
  1`` entries exist (never more than block-aligned tiling needs); the arrays
  have that static length and entries past ``num_tiles`` are padding
  (``row_end == row_start == row0 == 0``, group clamped to a valid index).

Nothing here syncs to the host: all sizes that shape arrays are static.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax


# Row arithmetic is int32: a tile's end (a row plus a block of up to 512 rows)
# must not wrap.
MAX_ROWS = 2**31 - 1024


def _saturating_cumsum(sizes: jax.Array, cap: int) -> jax.Array:
  """Inclusive cumsum of non-negative ``sizes`` clipped at ``cap`` (no overflow:
  ``a + min(b, cap - a)`` is ``min(a + b, cap)`` for a, b in [0, cap], and never
  sums past cap, which ``a + b`` would for cap > 2**30)."""
  sizes = jnp.clip(sizes, 0, cap)
  return lax.associative_scan(lambda a, b: a + jnp.minimum(b, cap - a), sizes)


def global_group_ends(group_sizes: jax.Array, m: int) -> jax.Array:
  """Exclusive end row of every group, int32[G]; negative sizes count as 0."""
  if isinstance(m, int) and m > MAX_ROWS:  # (m may be a symbolic dimension: jax.export)
    raise ValueError(f"lhs has {m} rows; ragdot takes at most {MAX_ROWS} (int32 row indices)")
  if group_sizes.shape[0] == 0:
    return jnp.zeros((0,), jnp.int32)
  return _saturating_cumsum(group_sizes.astype(jnp.int32), m)


def _offset_scalar(group_offset: jax.Array | None) -> jax.Array:
  if group_offset is None:
    return jnp.int32(0)
  return jnp.reshape(group_offset, ()).astype(jnp.int32)


def group_bounds(
    group_sizes: jax.Array,
    m: int,
    group_offset: jax.Array | None = None,
    num_local: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Row bounds of the local groups.

  Args:
    group_sizes: int[G], sizes of all groups in row order.
    m: number of rows of the ragged operand.
    group_offset: optional int scalar (shape () or (1,)); local group j is
      global group ``group_offset + j``.  A local group whose global index is
      outside ``[0, G)`` owns no rows.
    num_local: number of local groups (defaults to G).

  Returns:
    ``(starts, ends)``, int32[num_local] each, with ``0 <= starts <= ends <= m``.
    Empty groups have ``starts == ends``.
  """
  num_groups = group_sizes.shape[0]
  num_local = num_groups if num_local is None else num_local
  ends_all = global_group_ends(group_sizes, m)
  starts_all = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_all[:-1]])
  if group_offset is None and num_local == num_groups:
    return starts_all, ends_all
  idx = _offset_scalar(group_offset) + jnp.arange(num_local, dtype=jnp.int32)
  valid = (idx >= 0) & (idx < num_groups)
  safe = jnp.clip(idx, 0, max(num_groups - 1, 0))
  if num_groups == 0:
    zeros = jnp.zeros((num_local,), jnp.int32)
    return zeros, zeros
  starts = jnp.where(valid, starts_all[safe], 0)
  ends = jnp.where(valid, ends_all[safe], 0)
  return starts, ends


def local_row_window(
    group_sizes: jax.Array,
    m: int,
    group_offset: jax.Array | None = None,
    num_local: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """``(lo, hi)`` int32 scalars: rows of local groups are exactly ``[lo, hi)``.

  Without ``group_offset`` this is ``[0, min(sum(sizes), m))``.  ``hi >= lo``.
  """
  num_groups = group_sizes.shape[0]
  num_local = num_groups if num_local is None else num_local
  ends_all = global_group_ends(group_sizes, m)
  if num_groups == 0:
    return jnp.int32(0), jnp.int32(0)
  o = _offset_scalar(group_offset)
  last = o + num_local  # one past the last local global index

  def end_before(i):  # rows owned by global groups [0, i)
    return jnp.where(
        i <= 0, 0, ends_all[jnp.clip(i - 1, 0, num_groups - 1)]
    ).astype(jnp.int32)

  lo = end_before(o)
  hi = end_before(last)
  return lo, jnp.maximum(hi, lo)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TileSchedule:
  """Per-tile metadata, each int32[max_tiles] (``num_tiles`` is a scalar).

  Tile t owns rows ``[row_start[t], row_end[t])``, all in local group
  ``group[t]``, inside its window ``[row0[t], row0[t] + block_m)`` (``row0`` a
  multiple of the schedule's alignment; the window may run past ``m``).
  Tiles are ordered by group, then by row, so consecutive tiles reuse one
  group's weights.
  """

  group: jax.Array
  row0: jax.Array
  row_start: jax.Array
  row_end: jax.Array
  num_tiles: jax.Array


def max_tiles(m: int, block_m: int, num_local: int) -> int:
  """Static upper bound on the number of (group, row block) tiles."""
  return max(pl_cdiv(m, block_m) + num_local - 1, 1)


def pl_cdiv(a: int, b: int) -> int:
  return -(-a // b)


def tile_schedule(
    starts: jax.Array, ends: jax.Array, m: int, block_m: int, align: int = 8,
    tail_rows: int = 0,
) -> TileSchedule:
  """Group-aligned row tiles for local groups with the given bounds.

  Args:
    starts, ends: int32[num_local] from ``group_bounds``.
    m: rows of the ragged operand.
    block_m: rows per tile (static).
    align: tile windows start at multiples of ``gcd(align, block_m)``.
    tail_rows: fold a group's last tile into the one before it when it holds
      at most this many rows (static; 0: never).

  A group's tiles cover ``[floor_align(start), end)`` in steps of block_m.  The
  first window starts inside the row block holding ``start`` (align divides
  block_m), so a group never gets more tiles than block-aligned tiling would
  give it: the static bound ``max_tiles`` still holds.  With ``tail_rows``, a
  group of two or more tiles whose last holds at most ``tail_rows`` rows loses
  that tile, and the tile before it ends at the group's end (``row_end - row0``
  up to ``block_m + tail_rows``): the forward ring kernels compute those rows
  with the tile before them.
  """
  num_local = starts.shape[0]
  total = max_tiles(m, block_m, num_local)
  if num_local == 0:
    z = jnp.zeros((total,), jnp.int32)
    return TileSchedule(z, z, z, z, jnp.int32(0))
  align = math.gcd(align, block_m)
  # Optimization barriers make XLA compute the bounds and the prefix counts once
  # each (small kernels).  Without them one fused XLA kernel (reduce_window +
  # select, apparently the group prefix sums fused into the T x G compare
  # below) took 73 us of a 163 us EP shard call on the H200 (2026-11-30), more
  # than the zero rows the call writes.
  starts, ends = lax.optimization_barrier((starts, ends))
  nonempty = ends > starts
  base = (starts // align) * align
  count = jnp.where(nonempty, (ends - base + block_m - 1) // block_m, 0)
  if tail_rows:
    count = count - fold_tail(count, base, ends, block_m, tail_rows)
  incl = jnp.cumsum(count).astype(jnp.int32)
  excl = incl - count
  incl, excl, base = lax.optimization_barrier((incl, excl, base))
  num_tiles = incl[-1]
  t = jnp.arange(total, dtype=jnp.int32)
  # searchsorted(incl, t, side="right") as one fused compare-and-count (T x G
  # int compares; no sort kernels before the GEMM).  jnp.searchsorted's own
  # methods either sort or fail to trace under a partly manual shard_map.
  group = jnp.sum(incl[None, :] <= t[:, None], axis=1, dtype=jnp.int32)
  group = jnp.minimum(group, num_local - 1)
  real = t < num_tiles
  row0 = jnp.where(real, base[group] + (t - excl[group]) * block_m, 0)
  row_start = jnp.where(real, jnp.maximum(starts[group], row0), 0)
  # A group's last tile ends at the group's end (past row0 + block_m when a tail
  # is folded into it); every other tile is full.
  row_end = jnp.where(real, jnp.where(t + 1 == incl[group], ends[group], row0 + block_m), 0)
  return TileSchedule(group, row0, row_start, row_end, num_tiles)


def fold_tail(count, base, ends, block_m: int, tail_rows: int):
  """1 where a group's last tile is folded into the one before it (the group
  has two or more tiles and the last holds at most ``tail_rows`` rows), else 0."""
  last_rows = ends - (base + (count - 1) * block_m)
  return jnp.where((count >= 2) & (last_rows <= tail_rows), 1, 0).astype(count.dtype)


def flat_schedule(
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    m: int,
    num_local: int,
    block_m: int,
    tail_rows: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """The forward / dX kernels' schedule as two flat arrays (``tail_rows``: as
  in ``tile_schedule``).

  Returns ``tiles``: int32[4 * T] (T = ``max_tiles``), the ``TileSchedule``
  rows group, row0, row_start, row_end one after the other; and ``scalars``:
  int32[6]: num_tiles, lo, hi (``local_row_window``), ``za = cdiv(lo,
  block_m)``, ``zb = min(max(hi // block_m, za), cdiv(m, block_m))`` and the
  number of row blocks holding rows outside ``[lo, hi)`` (blocks ``[0, za)``
  and ``[zb, cdiv(m, block_m))``; a block holding both lo and hi is counted
  once, in the first range).
  """
  starts, ends = group_bounds(group_sizes, m, group_offset, num_local)
  sched = tile_schedule(starts, ends, m, block_m, tail_rows=tail_rows)
  lo, hi = local_row_window(group_sizes, m, group_offset, num_local)
  num_blocks = pl_cdiv(m, block_m)
  za = (lo + block_m - 1) // block_m
  zb = jnp.minimum(jnp.maximum(hi // block_m, za), num_blocks)
  num_zero = za + jnp.where(hi < m, num_blocks - zb, 0)
  tiles = jnp.concatenate([sched.group, sched.row0, sched.row_start, sched.row_end])
  scalars = jnp.stack([sched.num_tiles, lo, hi, za, zb, num_zero]).astype(jnp.int32)
  return tiles.astype(jnp.int32), scalars


def row_blocks(
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    m: int,
    num_local: int,
    block_m: int,
    align: int = 8,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The dW kernel's per-group row blocks, int32[num_local] each:
  ``(starts, ends)`` of ``group_bounds``, the first block's start
  ``floor(starts / a) * a`` (``a = gcd(align, block_m)``) and the number of ``block_m``-row blocks
  from there to ``ends`` (0 for an empty group)."""
  starts, ends = group_bounds(group_sizes, m, group_offset, num_local)
  align = math.gcd(align, block_m)
  first = (starts // align) * align
  nblocks = jnp.where(ends > starts, (ends - first + block_m - 1) // block_m, 0)
  return starts, ends, first, nblocks
