"""Operands sharded over explicit mesh axes: the ops per shard under ``shard_map``.

Under explicit sharding (``jax.sharding.AxisType.Explicit``) an array's type
names the mesh axes each of its dimensions is split over.  The kernels take
whole arrays, so a call whose operands carry such axes runs on each device's
block, and the result's type keeps the split:

* ``ragged_dot`` (``lhs[m, k] x rhs[g, k, n]``, or rhs ``[g, n, k]``):
  lhs rows over axes R: each shard runs its rows with the global groups cut to
  its row range (output rows over R).  rhs columns over N: each shard computes
  its columns (output columns over N).  rhs groups over E (expert parallelism):
  each shard computes only its groups' rows through ``group_offset`` and the
  shards' outputs are summed over E (every row comes from one shard, the others
  add exact zeros).  A split contraction (k) is gathered first.
* ``trans_ragged_dot`` (``lhs[m, k], rhs[m, n] -> [g, k, n]``): rows over R
  give per-shard sums over their rows, summed over R in the output dtype (as a
  data-parallel gradient is); lhs columns over K and rhs columns over N stay
  split in the output.

An axis named in two roles keeps the first (rows, then columns, then groups);
the other operand is gathered along it, as is a dimension its axes do not
divide.  Gradients flow through ``shard_map``: dX and dW run per shard too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ragdot import metadata

Axes = tuple[str, ...]


def split_dims(x: Any) -> tuple[Axes, ...]:
  """Per dimension of ``x``, the explicit mesh axes its type says it is split
  over (all empty outside explicit sharding)."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  out = []
  for i in range(jnp.ndim(x)):
    entry = spec[i] if spec is not None and i < len(spec) else None
    out.append(() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))
  return tuple(out)


def _mesh(*xs: Any) -> Any:
  for x in xs:
    if x is not None and any(split_dims(x)):
      return jax.typeof(x).sharding.mesh
  return None


def _take(axes: Axes, size: int, mesh: Any, used: set[str]) -> Axes:
  """``axes`` less those already used, or () if they do not divide ``size``."""
  axes = tuple(a for a in axes if a not in used)
  if not axes or size % math.prod(mesh.shape[a] for a in axes):
    return ()
  used.update(axes)
  return axes


def partition_spec(*dims: Axes) -> P:
  """The ``PartitionSpec`` of per-dimension axes (``split_dims``'s form)."""
  return P(*(d if d else None for d in dims))


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one call is split: ``rows`` (the ragged m), ``k`` and ``n`` (the
  other dims of lhs / rhs) and ``groups`` (rhs's experts; ragged_dot only)."""

  mesh: Any
  rows: Axes = ()
  k: Axes = ()
  n: Axes = ()
  groups: Axes = ()


def gmm_layout(lhs: jax.Array, rhs: jax.Array, transpose_rhs: bool,
               *others: jax.Array | None) -> Layout | None:
  """The split of ``lhs[m, k] x rhs[g, k|n, n|k]``, or None if no operand
  (``others``: group sizes and offset, gathered when split) carries explicit
  mesh axes."""
  mesh = _mesh(lhs, rhs, *others)
  if mesh is None:
    return None
  (rows, _), (groups, *rest) = split_dims(lhs), split_dims(rhs)
  cols = rest[0] if transpose_rhs else rest[1]
  used: set[str] = set()
  m, n, g = lhs.shape[0], rhs.shape[1 if transpose_rhs else 2], rhs.shape[0]
  rows = _take(rows, m, mesh, used)
  cols = _take(cols, n, mesh, used)
  return Layout(mesh, rows=rows, n=cols, groups=_take(groups, g, mesh, used))


def tgmm_layout(lhs: jax.Array, rhs: jax.Array, *others: jax.Array | None) -> Layout | None:
  """The split of ``lhs[m, k], rhs[m, n] -> [g, k, n]``, or None."""
  mesh = _mesh(lhs, rhs, *others)
  if mesh is None:
    return None
  (rows, k), (rows_rhs, n) = split_dims(lhs), split_dims(rhs)
  used: set[str] = set()
  rows = _take(rows or rows_rhs, lhs.shape[0], mesh, used)
  k = _take(k, lhs.shape[1], mesh, used)
  return Layout(mesh, rows=rows, k=k, n=_take(n, rhs.shape[1], mesh, used))


def _per_shard(body: Callable[..., jax.Array], layout: Layout, in_specs: tuple[P, ...],
               out_spec: P) -> Callable[..., jax.Array]:
  """``body`` under shard_map on its arguments resharded to ``in_specs``, as a
  jit: called eagerly, shard_map would run its body op by op, and the xla
  backend's loop then crashed the CPU runtime (segfault, jax 0.11.2); under a
  trace the jit is inlined.  Callers cache the result (``_gmm_fn``,
  ``_tgmm_fn``) so that eager calls reuse its compilation."""
  def run(*args):
    args = [jax.sharding.reshard(a, NamedSharding(layout.mesh, spec))
            for a, spec in zip(args, in_specs)]
    return jax.shard_map(body, mesh=layout.mesh, in_specs=in_specs, out_specs=out_spec)(*args)
  return jax.jit(run)


def shard_sizes(group_sizes: jax.Array, start: jax.Array, rows: int, m: int) -> jax.Array:
  """Rows of each group within rows ``[start, start + rows)`` of the ragged
  dimension of ``m`` rows (groups own consecutive rows from 0, negative sizes
  count as 0, the ends saturate at m: no int32 overflow)."""
  ends = metadata.global_group_ends(group_sizes, m)
  starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
  lo = jnp.clip(starts - start, 0, rows)
  hi = jnp.clip(ends - start, 0, rows)
  return (hi - lo).astype(jnp.int32)


def _local_sizes(group_sizes: jax.Array, layout: Layout, rows: int) -> jax.Array:
  if not layout.rows:
    return group_sizes
  shards = math.prod(layout.mesh.shape[a] for a in layout.rows)
  return shard_sizes(group_sizes, jax.lax.axis_index(layout.rows) * rows, rows, rows * shards)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
        group_offset: jax.Array | None, layout: Layout, transpose_rhs: bool,
        local_gmm: Callable[..., jax.Array]) -> jax.Array:
  """``local_gmm(lhs, rhs, group_sizes, group_offset)`` per shard of ``layout``
  (``local_gmm`` should be the same object for the same static arguments:
  it keys the cache of compiled eager calls)."""
  g_local = rhs.shape[0] // math.prod(layout.mesh.shape[a] for a in layout.groups)
  m_local = lhs.shape[0] // math.prod(layout.mesh.shape[a] for a in layout.rows)
  if layout.groups and group_offset is None:
    group_offset = jnp.zeros((), jnp.int32)
  args = [lhs, rhs, group_sizes] + ([] if group_offset is None else [group_offset])
  return _gmm_fn(layout, transpose_rhs, local_gmm, m_local, g_local, len(args))(*args)


@functools.lru_cache(maxsize=256)
def _gmm_fn(layout: Layout, transpose_rhs: bool, local_gmm: Callable[..., jax.Array],
            m_local: int, g_local: int, num_args: int) -> Callable[..., jax.Array]:
  def body(lhs, rhs, group_sizes, group_offset=None):
    sizes = _local_sizes(group_sizes, layout, m_local)
    if layout.groups:
      group_offset = group_offset + jax.lax.axis_index(layout.groups) * g_local
    out = local_gmm(lhs, rhs, sizes, group_offset)
    return jax.lax.psum(out, layout.groups) if layout.groups else out

  rhs_dims = (layout.groups,) + (((layout.n, ()) if transpose_rhs else ((), layout.n)))
  in_specs = (partition_spec(layout.rows, ()), partition_spec(*rhs_dims)) + (P(),) * (num_args - 2)
  return _per_shard(body, layout, in_specs, partition_spec(layout.rows, layout.n))


def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
         group_offset: jax.Array | None, layout: Layout,
         local_tgmm: Callable[..., jax.Array]) -> jax.Array:
  """``local_tgmm(lhs, rhs, group_sizes, group_offset)`` per shard of
  ``layout``, summed over the row shards (``local_tgmm`` as in ``gmm``)."""
  m_local = lhs.shape[0] // math.prod(layout.mesh.shape[a] for a in layout.rows)
  args = [lhs, rhs, group_sizes] + ([] if group_offset is None else [group_offset])
  return _tgmm_fn(layout, local_tgmm, m_local, len(args))(*args)


@functools.lru_cache(maxsize=256)
def _tgmm_fn(layout: Layout, local_tgmm: Callable[..., jax.Array], m_local: int,
             num_args: int) -> Callable[..., jax.Array]:
  def body(lhs, rhs, group_sizes, group_offset=None):
    out = local_tgmm(lhs, rhs, _local_sizes(group_sizes, layout, m_local), group_offset)
    return jax.lax.psum(out, layout.rows) if layout.rows else out

  in_specs = ((partition_spec(layout.rows, layout.k), partition_spec(layout.rows, layout.n))
              + (P(),) * (num_args - 2))
  return _per_shard(body, layout, in_specs, partition_spec((), layout.k, layout.n))


def constrain(out: jax.Array, out_sharding: Any) -> jax.Array:
  """``out`` resharded to ``out_sharding`` (a ``NamedSharding`` or a
  ``PartitionSpec`` of the context mesh, over explicit axes), as
  ``jax.lax.ragged_dot`` takes it."""
  if out_sharding is None:
    return out
  if not isinstance(out_sharding, (NamedSharding, P)):
    raise TypeError("out_sharding must be None, a NamedSharding or a PartitionSpec, got"
                    f" {type(out_sharding).__name__}")
  try:
    return jax.sharding.reshard(out, out_sharding)
  except ValueError as e:
    raise ValueError(f"out_sharding {out_sharding}: {e}") from e
