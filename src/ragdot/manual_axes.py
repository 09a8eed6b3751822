"""Varying-manual-axes bookkeeping for use inside ``jax.shard_map``.

Under shard_map every value's type records the mesh axes it varies over.  A
loop carry or a custom-VJP input built from replicated values must be marked
varying like the values it is combined with, or tracing fails; marking it with
``lax.pcast(..., to="varying")`` also gives the right transpose (a psum) to
cotangents of replicated inputs such as the token activations under expert
parallelism.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax


def varying_axes(*xs: Any) -> tuple[str, ...]:
  """Sorted union of the manual mesh axes the arrays vary over (or ())."""
  axes: set[str] = set()
  for x in xs:
    if x is None:
      continue
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.11: the manual axis type
    axes |= set(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())
  return tuple(sorted(axes))


def make_varying(x: Any, axes: tuple[str, ...]) -> Any:
  """``x`` marked as varying over ``axes`` (no-op outside shard_map)."""
  if x is None or not axes:
    return x
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def match_varying(*xs: Any) -> tuple[Any, ...]:
  """All of ``xs`` marked varying over the union of their axes."""
  axes = varying_axes(*xs)
  return tuple(make_varying(x, axes) for x in xs)


def out_struct(shape: tuple[int, ...], dtype: Any, like: Any) -> jax.ShapeDtypeStruct:
  """A kernel's output type, varying over the same shard_map axes as ``like``."""
  mat = getattr(jax.typeof(like), "mat", None)
  if mat is None:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
