"""Static argument checks shared by every public op.

Bad static input raises ``TypeError`` (ranks, shapes, dtypes: as ``jax.lax``
does) or ``ValueError`` (out-of-range options), always naming the argument.
Traced values (negative sizes, offsets out of range) are only checked in the
optional checked mode (``ragdot.checked``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ragdot.backends import IMPLEMENTATIONS


@dataclasses.dataclass(frozen=True)
class Problem:
  """Canonical static description of one grouped matmul call."""

  m: int
  k: int
  n: int
  num_groups: int  # G = len(group_sizes)
  num_local: int  # groups held by rhs (gmm) / returned (tgmm)
  dtype: jnp.dtype  # common input dtype after promotion
  out_dtype: jnp.dtype
  has_offset: bool



def common_dtype(lhs: Any, rhs: Any) -> np.dtype:
  """The operands' common dtype as ``jax.lax.ragged_dot`` takes it: a weak type
  (e.g. an f32 array made from a Python float) does not yield to the other
  operand's dtype, as it would in ``jnp.result_type``."""
  return jnp.promote_types(jnp.result_type(lhs), jnp.result_type(rhs))

def check_implementation(implementation: Any) -> str | None:
  if implementation is None:
    return None
  if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be None or one of {IMPLEMENTATIONS}, got"
        f" {implementation!r}"
    )
  return implementation


def _check_numeric(name: str, x: Any) -> None:
  dtype = getattr(x, "dtype", None)
  if dtype is None or not (
      jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  ):
    raise TypeError(f"{name} must be a floating or integer array, got dtype {dtype}")


def _check_rank(name: str, x: Any, rank: int, layout: str) -> None:
  if np.ndim(x) != rank:
    raise TypeError(
        f"{name} must have rank {rank} ({layout}), got shape {np.shape(x)}"
    )


def check_group_sizes(group_sizes: Any) -> jax.Array:
  """int32[G]; TypeError naming group_sizes for wrong dtype or rank."""
  dtype = getattr(group_sizes, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f"group_sizes must be an integer array, got dtype {dtype}"
    )
  if np.ndim(group_sizes) != 1:
    raise TypeError(
        f"group_sizes must be 1-D [G], got shape {np.shape(group_sizes)}"
    )
  return jnp.asarray(group_sizes).astype(jnp.int32)


def check_group_offset(group_offset: Any) -> jax.Array | None:
  """None, or an int32 scalar array; accepts shape () or (1,)."""
  if group_offset is None:
    return None
  dtype = getattr(group_offset, "dtype", None)
  if dtype is None:
    if isinstance(group_offset, (int, np.integer)) and not isinstance(
        group_offset, bool
    ):
      return jnp.int32(group_offset)
    raise TypeError(
        "group_offset must be an integer array of shape () or (1,), got"
        f" {type(group_offset).__name__}"
    )
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"group_offset must have an integer dtype, got {dtype}")
  if np.shape(group_offset) not in ((), (1,)):
    raise TypeError(
        f"group_offset must have shape () or (1,), got {np.shape(group_offset)}"
    )
  return jnp.reshape(group_offset, ()).astype(jnp.int32)


def _out_dtype(dtype: jnp.dtype, preferred_element_type: Any) -> jnp.dtype:
  if preferred_element_type is None:
    return dtype
  try:
    return jnp.dtype(preferred_element_type)
  except TypeError as e:
    raise TypeError(
        f"preferred_element_type must be a dtype, got {preferred_element_type!r}"
    ) from e


def check_ragged_dot(
    lhs: Any,
    rhs: Any,
    group_sizes: Any,
    group_offset: Any,
    preferred_element_type: Any,
    *,
    transpose_rhs: bool = False,
) -> tuple[Problem, jax.Array, jax.Array | None]:
  """Checks ``lhs[m,k] x rhs[g,k,n]`` (``rhs[g,n,k]`` if transpose_rhs).

  Returns the problem, group_sizes as int32[G] and group_offset as an int32
  scalar or None.
  """
  _check_numeric("lhs", lhs)
  _check_numeric("rhs", rhs)
  _check_rank("lhs", lhs, 2, "[m, k]")
  _check_rank("rhs", rhs, 3, "[g, n, k]" if transpose_rhs else "[g, k, n]")
  gs = check_group_sizes(group_sizes)
  go = check_group_offset(group_offset)
  m, k = lhs.shape
  if transpose_rhs:
    g_local, n, k_rhs = rhs.shape
  else:
    g_local, k_rhs, n = rhs.shape
  if k != k_rhs:
    raise TypeError(
        f"contracting dimension mismatch: lhs has k={k} (shape {lhs.shape}),"
        f" rhs has k={k_rhs} (shape {rhs.shape})"
    )
  num_groups = gs.shape[0]
  if go is None and g_local != num_groups:
    raise TypeError(
        f"rhs has {g_local} groups but group_sizes has {num_groups} entries;"
        " they must match unless group_offset is given"
    )
  if go is not None and g_local > num_groups:
    raise TypeError(
        f"rhs has {g_local} groups, more than len(group_sizes)={num_groups}"
        " (with group_offset rhs holds a shard of the groups)"
    )
  dtype = common_dtype(lhs, rhs)
  problem = Problem(
      m=m, k=k, n=n, num_groups=num_groups, num_local=g_local, dtype=dtype,
      out_dtype=_out_dtype(dtype, preferred_element_type),
      has_offset=go is not None,
  )
  return problem, gs, go


def check_trans_ragged_dot(
    lhs: Any,
    rhs: Any,
    group_sizes: Any,
    group_offset: Any,
    num_groups: Any,
    preferred_element_type: Any,
) -> tuple[Problem, jax.Array, jax.Array | None]:
  """Checks ``lhs[m,k], rhs[m,n]`` ragged along m; returns like check_ragged_dot."""
  _check_numeric("lhs", lhs)
  _check_numeric("rhs", rhs)
  _check_rank("lhs", lhs, 2, "[m, k]")
  _check_rank("rhs", rhs, 2, "[m, n]")
  gs = check_group_sizes(group_sizes)
  go = check_group_offset(group_offset)
  m, k = lhs.shape
  m_rhs, n = rhs.shape
  if m != m_rhs:
    raise TypeError(
        f"lhs and rhs must have the same number of rows (the ragged dimension):"
        f" lhs shape {lhs.shape}, rhs shape {rhs.shape}"
    )
  total = gs.shape[0]
  if num_groups is None:
    num_local = total
  else:
    if isinstance(num_groups, bool) or not isinstance(
        num_groups, (int, np.integer)
    ):
      raise TypeError(
          f"num_groups must be a static int, got {type(num_groups).__name__}"
      )
    if go is None:
      raise ValueError(
          "num_groups is only meaningful with group_offset (the shard size);"
          " without group_offset the output has len(group_sizes) groups"
      )
    if not 1 <= num_groups <= total:
      raise ValueError(
          f"num_groups must be in [1, len(group_sizes)={total}], got {num_groups}"
      )
    num_local = int(num_groups)
  dtype = common_dtype(lhs, rhs)
  problem = Problem(
      m=m, k=k, n=n, num_groups=total, num_local=num_local, dtype=dtype,
      out_dtype=_out_dtype(dtype, preferred_element_type),
      has_offset=go is not None,
  )
  return problem, gs, go


def accumulation_dtype(dtype: jnp.dtype, out_dtype: jnp.dtype) -> jnp.dtype:
  """f32 (or wider) for floats, int32 (or wider) for integers."""
  wide = jnp.promote_types(dtype, out_dtype)
  if jnp.issubdtype(wide, jnp.floating):
    return jnp.promote_types(wide, jnp.float32)
  return jnp.promote_types(wide, jnp.int32)
