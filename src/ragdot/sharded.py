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
  add exact zeros).  The contraction split over K (lhs columns and rhs's k, as
  in tensor parallelism): each shard's partial product, summed over K in the
  output dtype (as XLA's partitioned dot sums).  fp8 weights' block scales
  (``rhs_scale``) are split as the weights are, rhs's k and n only along
  whole blocks.
* ``trans_ragged_dot`` (``lhs[m, k], rhs[m, n] -> [g, k, n]``): rows over R
  give per-shard sums over their rows, summed over R in the output dtype (as a
  data-parallel gradient is); lhs columns over K and rhs columns over N stay
  split in the output.

An axis named in two roles keeps the first (rows, then columns, groups,
contraction); the other operand is gathered along it, as is a dimension its
axes do not divide.  Gradients flow through ``shard_map``: dX and dW run per shard too,
except inside a user's shard_map, where the tangents run on gathered operands
(``bilinear_nested``: JAX 0.11.2 cannot transpose the nested shard_map), and with
symbolic shapes, where the whole call does (``has_symbolic_dims``).
The per-shard bodies (``gmm_shard``, ``tgmm_shard``) also serve operands split
over automatic axes (``ragdot.auto_sharding``), where a weight gradient's
groups can be split too.
"""

from __future__ import annotations

import contextlib
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
  return spec_dims(getattr(getattr(jax.typeof(x), "sharding", None), "spec", None), jnp.ndim(x))


def spec_dims(spec: P | None, ndim: int) -> tuple[Axes, ...]:
  """Per dimension of an ``ndim``-dim array, the mesh axes ``spec`` names."""
  entries = tuple(spec or ()) + (None,) * (ndim - len(spec or ()))
  return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _mesh(*xs: Any) -> Any:
  for x in xs:
    if x is not None and any(split_dims(x)):
      return jax.typeof(x).sharding.mesh
  return None


def operands_mesh(*xs: Any) -> Any:
  """A context for a call whose operands are not split over explicit axes:
  their mesh when no mesh is set (``jax.set_mesh``) and their types name one
  with explicit axes (arrays placed whole on it), so that the arrays the XLA
  backend creates (zeros, accumulators) live on the operands' mesh; else a
  no-op.  (Without it that backend failed: "dynamic_update_slice operand
  sharding must be equal to update sharding", jax 0.11.2.)  Only the XLA
  backends enter it: around a whole call it would also turn off the custom
  partitioning of kernel calls (``auto_sharding.enabled`` reads the mesh set)."""
  if not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  for x in xs:
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None) \
        if x is not None else None
    if mesh is not None and not mesh.empty and any(
        t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
      return jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh))
  return contextlib.nullcontext()


def in_manual_region() -> bool:
  """Inside a ``shard_map`` (some mesh axes manual).  A per-shard call there
  nests a second shard_map: its forward runs, but JAX 0.11.2 fails to lower its
  transpose ("operand shape ... must match" / "axis already bound"), so such
  calls take their tangents through ``whole`` (``bilinear_nested``)."""
  return bool(jax.sharding.get_abstract_mesh().manual_axes)


def has_symbolic_dims(*arrays: Any) -> bool:
  """Whether any of ``arrays`` has a symbolic dimension (``jax.export``).  A
  per-shard shard_map of such operands crashed the process when the exported
  program was called (jax 0.11.2): such calls run ``whole``."""
  return any(jax.export.is_symbolic_dim(d) for a in arrays if a is not None
             for d in jnp.shape(a))


def whole(mesh: Any, local: Callable[..., jax.Array], out_dims: tuple[Axes, ...],
          *args: Any) -> jax.Array:
  """``local(*args)`` on ``args`` gathered over their explicit axes of ``mesh``
  (each device computes the whole result), then split as the per-shard call's
  result would be (``out_dims``, a slice of it)."""
  args = [a if a is None or not any(split_dims(a))
          else jax.sharding.reshard(a, NamedSharding(mesh, P())) for a in args]
  out = local(*args)
  if not any(out_dims):
    return out
  return jax.sharding.reshard(out, NamedSharding(mesh, partition_spec(*out_dims)))


def bilinear_nested(per_shard: Callable[..., jax.Array],
                    gathered: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """``per_shard(lhs, rhs, *rest)``, an op linear in lhs and in rhs, for use
  inside a shard_map (``in_manual_region``): its value per shard, its tangents
  (hence, transposed, its gradients) through ``gathered`` (the same op on
  gathered operands, ``whole``), whose transpose JAX lowers.  The forward stays
  split; the backward computes whole products on every device."""
  @jax.custom_jvp
  def call(lhs, rhs, *rest):
    return per_shard(lhs, rhs, *rest)

  def jvp(primals, tangents):
    lhs, rhs, *rest = primals
    out = call(*primals)
    zero = lambda t: isinstance(t, jax.custom_derivatives.SymbolicZero)
    terms = ([] if zero(tangents[0]) else [gathered(tangents[0], rhs, *rest)]) + (
        [] if zero(tangents[1]) else [gathered(lhs, tangents[1], *rest)])
    return out, functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(out)

  call.defjvp(jvp, symbolic_zeros=True)
  return call


def split_call(per_shard: Callable[..., jax.Array], gathered: Callable[..., jax.Array],
               lhs: jax.Array, rhs: jax.Array, *rest: Any) -> jax.Array:
  """A bilinear op on operands split over explicit axes: ``per_shard``, or
  ``gathered`` (``whole``) with symbolic shapes, or the per-shard value with
  gathered tangents inside a shard_map (``bilinear_nested``)."""
  if has_symbolic_dims(lhs, rhs):
    return gathered(lhs, rhs, *rest)
  if in_manual_region():
    return bilinear_nested(per_shard, gathered)(lhs, rhs, *rest)
  return per_shard(lhs, rhs, *rest)


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
  """How one call is split: ``rows`` (the ragged m), ``k`` and ``n`` (lhs's
  and rhs's other dims; ragged_dot's k is the contraction) and ``groups``
  (ragged_dot's rhs experts, or trans_ragged_dot's result groups)."""

  mesh: Any
  rows: Axes = ()
  k: Axes = ()
  n: Axes = ()
  groups: Axes = ()


def gmm_layout(lhs: jax.Array, rhs: jax.Array, transpose_rhs: bool,
               *others: jax.Array | None, scale: jax.Array | None = None) -> Layout | None:
  """The split of ``lhs[m, k] x rhs[g, k|n, n|k]`` (with rhs's block scales
  ``scale``, in rhs's layout), or None if no operand (``others``: group sizes
  and offset, gathered when split) carries explicit mesh axes."""
  mesh = _mesh(lhs, rhs, scale, *others)
  if mesh is None:
    return None
  return gmm_split(mesh, split_dims(lhs), split_dims(rhs), lhs.shape, rhs.shape, transpose_rhs,
                   None if scale is None else scale.shape)


def gmm_split(mesh: Any, lhs_dims: tuple[Axes, ...], rhs_dims: tuple[Axes, ...],
              lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...],
              transpose_rhs: bool, scale_shape: tuple[int, ...] | None = None,
              out_cols: Axes = ()) -> Layout:
  """The split of ``lhs[m, k] x rhs[g, k|n, n|k]`` whose dimensions are split
  over the mesh axes ``lhs_dims`` / ``rhs_dims`` (``split_dims``'s form).  With
  rhs's block scales (``scale_shape``, rhs's layout) split alike, rhs's k and n
  are split only where the axes divide the scale's blocks along them, so that
  no block straddles two shards.  An axis splitting both lhs's rows and rhs's
  columns goes to the rows, unless it is among ``out_cols`` (the axes the
  result's columns are wanted split over)."""
  (rows, k_lhs), (groups, *rest) = lhs_dims, rhs_dims
  cols, k_rhs = (rest[0], rest[1]) if transpose_rhs else (rest[1], rest[0])
  used: set[str] = set()
  kn = (2, 1) if transpose_rhs else (1, 2)
  m, k, n, g = lhs_shape[0], lhs_shape[1], rhs_shape[kn[1]], rhs_shape[0]
  if scale_shape is not None:  # (their block counts divide k and n)
    k, n = scale_shape[kn[0]], scale_shape[kn[1]]
  if set(cols) & set(out_cols):
    cols = _take(cols, n, mesh, used)
    rows = _take(rows, m, mesh, used)
  else:
    rows = _take(rows, m, mesh, used)
    cols = _take(cols, n, mesh, used)
  groups = _take(groups, g, mesh, used)
  return Layout(mesh, rows=rows, k=_take(k_lhs or k_rhs, k, mesh, used), n=cols, groups=groups)


def tgmm_layout(lhs: jax.Array, rhs: jax.Array, *others: jax.Array | None) -> Layout | None:
  """The split of ``lhs[m, k], rhs[m, n] -> [g, k, n]``, or None."""
  mesh = _mesh(lhs, rhs, *others)
  if mesh is None:
    return None
  return tgmm_split(mesh, split_dims(lhs), split_dims(rhs), lhs.shape, rhs.shape)


def tgmm_split(mesh: Any, lhs_dims: tuple[Axes, ...], rhs_dims: tuple[Axes, ...],
               lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...],
               groups: Axes = (), num_groups: int = 1) -> Layout:
  """The split of ``lhs[m, k], rhs[m, n] -> [num_groups, k, n]`` (as
  ``gmm_split``); ``groups``: axes the result's groups may be split over."""
  (rows, k), (rows_rhs, n) = lhs_dims, rhs_dims
  used: set[str] = set()
  rows = _take(rows or rows_rhs, lhs_shape[0], mesh, used)
  k = _take(k, lhs_shape[1], mesh, used)
  n = _take(n, rhs_shape[1], mesh, used)
  return Layout(mesh, rows=rows, k=k, n=n, groups=_take(groups, num_groups, mesh, used))


def _per_shard(layout: Layout, body: Callable[..., jax.Array], in_specs: tuple[P, ...],
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
  return shard_sizes(group_sizes, jax.lax.axis_index(layout.rows) * rows, rows,
                     rows * _shards(layout, layout.rows))


def _shards(layout: Layout, axes: Axes) -> int:
  return math.prod(layout.mesh.shape[a] for a in axes)


def _shard_offset(group_offset: jax.Array | None, layout: Layout,
                  g_local: int) -> jax.Array | None:
  """The group_offset of this shard's ``g_local`` groups when the groups are
  split (the call's offset, if any, plus the shard's first group)."""
  if not layout.groups:
    return group_offset
  first = jax.lax.axis_index(layout.groups) * g_local
  return first if group_offset is None else group_offset + first


def gmm_shard(layout: Layout, transpose_rhs: bool, local_gmm: Callable[..., jax.Array],
              lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...],
              num_args: int, scaled: bool = False
              ) -> tuple[Callable[..., jax.Array], tuple[P, ...], P]:
  """One shard's ``ragged_dot`` under ``layout``: its body (``local_gmm`` on
  the shard's rows, columns, groups and part of the contraction, named mesh
  axes in scope), the operands' specs and the result's.  Without a
  group_offset, split groups get one (the shard's first group); the shards of
  the groups and of the contraction are summed (in the output dtype, as XLA
  sums a dot over a split contraction).  ``scaled``: the operands are lhs,
  rhs, rhs's block scales (split as rhs is; ``gmm_split`` with their shape),
  then group sizes and offset, and ``local_gmm`` takes the scales third."""
  m_local = lhs_shape[0] // _shards(layout, layout.rows)
  g_local = rhs_shape[0] // _shards(layout, layout.groups)

  summed = layout.groups + layout.k
  weights = 2 + scaled  # lhs, rhs (and its scales)

  def body(*args):
    group_sizes, group_offset = (args[weights:] + (None,))[:2]
    sizes = _local_sizes(group_sizes, layout, m_local)
    out = local_gmm(*args[:weights], sizes, _shard_offset(group_offset, layout, g_local))
    return jax.lax.psum(out, summed) if summed else out

  rhs_dims = (layout.groups,) + ((layout.n, layout.k) if transpose_rhs else (layout.k, layout.n))
  in_specs = ((partition_spec(layout.rows, layout.k),)
              + (partition_spec(*rhs_dims),) * (weights - 1) + (P(),) * (num_args - weights))
  return body, in_specs, partition_spec(layout.rows, layout.n)


def tgmm_shard(layout: Layout, local_tgmm: Callable[..., jax.Array],
               lhs_shape: tuple[int, ...], num_groups: int,
               num_args: int) -> tuple[Callable[..., jax.Array], tuple[P, ...], P]:
  """One shard's ``trans_ragged_dot`` (``num_groups`` results) under
  ``layout`` (as ``gmm_shard``; ``local_tgmm(lhs, rhs, group_sizes,
  group_offset, num_groups)``): the sum over the shard's rows, summed over the
  row shards in the output dtype; split groups run through group_offset."""
  m_local = lhs_shape[0] // _shards(layout, layout.rows)
  g_local = num_groups // _shards(layout, layout.groups)

  def body(lhs, rhs, group_sizes, group_offset=None):
    sizes = _local_sizes(group_sizes, layout, m_local)
    out = local_tgmm(lhs, rhs, sizes, _shard_offset(group_offset, layout, g_local), g_local)
    return jax.lax.psum(out, layout.rows) if layout.rows else out

  in_specs = ((partition_spec(layout.rows, layout.k), partition_spec(layout.rows, layout.n))
              + (P(),) * (num_args - 2))
  return body, in_specs, partition_spec(layout.groups, layout.k, layout.n)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
        group_offset: jax.Array | None, layout: Layout, transpose_rhs: bool,
        local_gmm: Callable[..., jax.Array], scale: jax.Array | None = None) -> jax.Array:
  """``local_gmm(lhs, rhs, group_sizes, group_offset)`` per shard of ``layout``
  under shard_map (``local_gmm`` should be the same object for the same static
  arguments: it keys the cache of compiled eager calls); with rhs's block
  scales ``scale``, ``local_gmm(lhs, rhs, scale, group_sizes, group_offset)``."""
  args = ([lhs, rhs] + ([] if scale is None else [scale]) + [group_sizes]
          + ([] if group_offset is None else [group_offset]))
  return _gmm_fn(layout, transpose_rhs, local_gmm, lhs.shape, rhs.shape, len(args),
                 scale is not None)(*args)


@functools.lru_cache(maxsize=256)
def _gmm_fn(layout: Layout, transpose_rhs: bool, local_gmm: Callable[..., jax.Array],
            lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...],
            num_args: int, scaled: bool) -> Callable[..., jax.Array]:
  return _per_shard(layout, *gmm_shard(layout, transpose_rhs, local_gmm, lhs_shape,
                                       rhs_shape, num_args, scaled))


def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
         group_offset: jax.Array | None, num_groups: int, layout: Layout,
         local_tgmm: Callable[..., jax.Array]) -> jax.Array:
  """``local_tgmm(lhs, rhs, group_sizes, group_offset, num_groups)`` per shard
  of ``layout`` under shard_map, summed over the row shards (``local_tgmm``
  as in ``gmm``)."""
  args = [lhs, rhs, group_sizes] + ([] if group_offset is None else [group_offset])
  return _tgmm_fn(layout, local_tgmm, lhs.shape, num_groups, len(args))(*args)


@functools.lru_cache(maxsize=256)
def _tgmm_fn(layout: Layout, local_tgmm: Callable[..., jax.Array],
             lhs_shape: tuple[int, ...], num_groups: int,
             num_args: int) -> Callable[..., jax.Array]:
  return _per_shard(layout, *tgmm_shard(layout, local_tgmm, lhs_shape, num_groups, num_args))


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
