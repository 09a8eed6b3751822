"""Pure-JAX backend: correct on every platform, the CPU default and the fallback.

It walks the tile schedule of ``ragdot.metadata`` with a ``fori_loop`` whose trip
count is the number of real tiles (so a group_offset shard costs work in
proportion to its rows), doing one ``[block_m, k] x [k, n]`` product per tile.
Memory stays O(m*k + g*k*n + m*n): unlike XLA's dense rewrite of
``jax.lax.ragged_dot`` no g-times-larger temporary is ever built.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ragdot import metadata as md
from ragdot import sharded
from ragdot.manual_axes import make_varying, varying_axes
from ragdot.validate import accumulation_dtype


@dataclasses.dataclass(frozen=True)
class XlaConfig:
  """block_m: rows per loop step (clipped to m)."""

  block_m: int = 128

  def __post_init__(self):
    if not isinstance(self.block_m, int) or self.block_m < 1:
      raise ValueError(f"block_m must be a positive int, got {self.block_m!r}")


def default_config(m: int, num_local: int) -> XlaConfig:
  """Rows per step near the mean group size, a power of two in [8, 128]."""
  mean_rows = max(m // max(num_local, 1), 1)
  block_m = 1 << max(mean_rows - 1, 1).bit_length()
  return XlaConfig(block_m=min(max(block_m, 8), 128))


def _block_m(config: XlaConfig | None, m: int, num_local: int) -> int:
  config = config or default_config(m, num_local)
  return min(config.block_m, m)


def _row_tile(x: jax.Array, first: jax.Array, rows: int) -> jax.Array:
  return lax.dynamic_slice_in_dim(x, first, rows, axis=0)


def _tile_rows(sched: md.TileSchedule, t: jax.Array, m: int, bm: int):
  """First row of the (in-bounds) slice for tile t and its row mask [bm]."""
  first = jnp.minimum(sched.row0[t], m - bm)
  rows = first + jnp.arange(bm, dtype=jnp.int32)
  mask = (rows >= sched.row_start[t]) & (rows < sched.row_end[t])
  return first, mask


def on_operands_mesh(fn):
  """``fn(lhs, rhs, ...)`` under the operands' mesh when none is set and they
  sit whole on a mesh with explicit axes (``sharded.operands_mesh``): the
  zeros it writes into must live on that mesh."""
  @functools.wraps(fn)
  def run(lhs, rhs, *args, **kwargs):
    with sharded.operands_mesh(lhs, rhs):
      return fn(lhs, rhs, *args, **kwargs)
  return run


@on_operands_mesh
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    transpose_rhs: bool,
    out_dtype: Any,
    precision: Any,
    interpret: bool = False,
    config: XlaConfig | None = None,
) -> jax.Array:
  """lhs[m,k] x rhs[g_local,k,n] (or [g_local,n,k] transposed) -> out[m,n]."""
  del interpret  # Plain XLA: nothing to interpret.
  m = lhs.shape[0]
  num_local = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out = jnp.zeros((m, n), out_dtype)
  if m == 0 or n == 0 or num_local == 0:  # varying like the operands (in shard_map)
    return make_varying(out, varying_axes(lhs, rhs, group_sizes, group_offset))
  bm = _block_m(config, m, num_local)
  starts, ends = md.group_bounds(group_sizes, m, group_offset, num_local)
  sched = md.tile_schedule(starts, ends, m, bm)
  contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
  acc_dtype = accumulation_dtype(lhs.dtype, out_dtype)

  def body(t, out):
    first, mask = _tile_rows(sched, t, m, bm)
    w = lax.dynamic_index_in_dim(rhs, sched.group[t], 0, keepdims=False)
    y = lax.dot_general(
        _row_tile(lhs, first, bm), w, (contract, ((), ())),
        precision=precision, preferred_element_type=acc_dtype,
    )
    y = cast_result(y, out_dtype)
    # Each row belongs to exactly one tile: keep the rows already written.
    y = jnp.where(mask[:, None], y, _row_tile(out, first, bm))
    return lax.dynamic_update_slice_in_dim(out, y, first, axis=0)

  out = make_varying(out, varying_axes(lhs, rhs, group_sizes, sched.num_tiles))
  return lax.fori_loop(0, sched.num_tiles, body, out)


def cast_result(acc: jax.Array, out_dtype: Any) -> jax.Array:
  """The accumulator in the result dtype; a complex sum asked for a real
  result keeps its real part (as lax's dot_general does)."""
  if jnp.iscomplexobj(acc) and not jnp.issubdtype(out_dtype, jnp.complexfloating):
    acc = jnp.real(acc)
  return acc.astype(out_dtype)


@on_operands_mesh
def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    num_groups: int,
    out_dtype: Any,
    precision: Any,
    interpret: bool = False,
    config: XlaConfig | None = None,
) -> jax.Array:
  """lhs[m,k], rhs[m,n] -> out[num_groups,k,n] = per-group lhs^T rhs."""
  del interpret
  m, k = lhs.shape
  n = rhs.shape[1]
  acc_dtype = accumulation_dtype(lhs.dtype, out_dtype)
  acc = jnp.zeros((num_groups, k, n), acc_dtype)
  if m == 0 or k == 0 or n == 0 or num_groups == 0:
    return make_varying(cast_result(acc, out_dtype),
                        varying_axes(lhs, rhs, group_sizes, group_offset))
  bm = _block_m(config, m, num_groups)
  starts, ends = md.group_bounds(group_sizes, m, group_offset, num_groups)
  sched = md.tile_schedule(starts, ends, m, bm)

  def body(t, acc):
    first, mask = _tile_rows(sched, t, m, bm)
    # Mask both operands: rows of other groups may hold inf/NaN (0 * inf).
    x = jnp.where(mask[:, None], _row_tile(lhs, first, bm), 0)
    y = jnp.where(mask[:, None], _row_tile(rhs, first, bm), 0)
    part = lax.dot_general(
        x, y, (((0,), (0,)), ((), ())),
        precision=precision, preferred_element_type=acc_dtype,
    )
    g = sched.group[t]
    total = lax.dynamic_index_in_dim(acc, g, 0, keepdims=False) + part
    return lax.dynamic_update_index_in_dim(acc, total, g, 0)

  acc = make_varying(acc, varying_axes(lhs, rhs, group_sizes, sched.num_tiles))
  return cast_result(lax.fori_loop(0, sched.num_tiles, body, acc), out_dtype)
