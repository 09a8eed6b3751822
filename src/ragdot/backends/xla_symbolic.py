"""The XLA backend for shapes with symbolic dimensions (``jax.export`` shape
polymorphism, e.g. a token count exported as ``m``).

The tiled loop of ``ragdot.backends.xla`` and the kernels size their tiles from
concrete dimensions, so these calls run ``jax.lax.ragged_dot_general`` itself.
A group_offset shard's rows are contiguous (``[lo, hi)``): they are rotated to
the front, multiplied with the shard's group sizes (rows past their sum give
0 in lax), and rotated back; rows outside the shard are zeroed on the way in
and out, so that NaN or inf there cannot reach the result.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ragdot import metadata as md
from ragdot.backends.xla import cast_result, on_operands_mesh
from ragdot.validate import accumulation_dtype


def _unsplit() -> Any:
  """``out_sharding`` for lax's ragged dot on unsplit operands: ``P()`` under a
  mesh with explicit axes (lax cannot infer it there), else None.  (Operands
  split over explicit axes reach this backend whole: ``sharded.whole``.)"""
  mesh = jax.sharding.get_abstract_mesh()
  explicit = not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types
  return jax.sharding.PartitionSpec() if explicit else None


def _rotate(x: jax.Array, shift: jax.Array) -> jax.Array:
  """Rows ``[shift, shift + m)`` of ``x`` stacked twice: row i of the result
  is row ``(i + shift) % m`` of ``x``, for ``0 <= shift <= m``."""
  m = x.shape[0]
  return lax.dynamic_slice_in_dim(jnp.concatenate([x, x]), shift, m, axis=0)


def _shard(group_sizes: jax.Array, m: Any, group_offset: jax.Array | None,
           num_local: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(local_sizes int32[num_local], lo, hi)``: the local groups' row counts
  (0 for groups outside ``[0, G)``) and their row window ``[lo, hi)``."""
  starts, ends = md.group_bounds(group_sizes, m, group_offset, num_local)
  lo, hi = md.local_row_window(group_sizes, m, group_offset, num_local)
  return ends - starts, lo, hi


def _in_window(x: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
  rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
  return jnp.where((rows >= lo) & (rows < hi), x, jnp.zeros((), x.dtype))


@on_operands_mesh
def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
        group_offset: jax.Array | None, *, transpose_rhs: bool, out_dtype: Any,
        precision: Any) -> jax.Array:
  """``ragdot.backends.xla.gmm``'s result: lhs[m,k] x rhs[g_local,k,n] (or
  [g_local,n,k] with ``transpose_rhs``) -> out[m,n]."""
  m, num_local = lhs.shape[0], rhs.shape[0]
  sizes, lo, hi = _shard(group_sizes, m, group_offset, num_local)
  contract = (([1], [2]) if transpose_rhs else ([1], [1]))
  dims = lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(contract, ([], [])),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
  out = lax.ragged_dot_general(
      _rotate(_in_window(lhs, lo, hi), lo), rhs, sizes, dims, precision=precision,
      preferred_element_type=accumulation_dtype(lhs.dtype, out_dtype), out_sharding=_unsplit())
  return _in_window(cast_result(_rotate(out, m - lo), out_dtype), lo, hi)


@on_operands_mesh
def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
         group_offset: jax.Array | None, *, num_groups: int, out_dtype: Any,
         precision: Any) -> jax.Array:
  """``ragdot.backends.xla.tgmm``'s result: lhs[m,k], rhs[m,n] ->
  out[num_groups,k,n], per local group lhs^T rhs over its rows."""
  m = lhs.shape[0]
  sizes, lo, hi = _shard(group_sizes, m, group_offset, num_groups)
  dims = lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([0], [0]), ([], [])),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  acc = lax.ragged_dot_general(
      _rotate(_in_window(lhs, lo, hi), lo), _rotate(_in_window(rhs, lo, hi), lo), sizes,
      dims, precision=precision,
      preferred_element_type=accumulation_dtype(lhs.dtype, out_dtype), out_sharding=_unsplit())
  return cast_result(acc, out_dtype)
