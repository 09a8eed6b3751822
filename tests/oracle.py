"""The test oracle: jax.lax.ragged_dot[_general] in f32 with Precision.HIGHEST.

group_offset is emulated the way callers did it before ragdot: rhs zero-padded to
all G groups, and every row outside the shard's groups zeroed.  Negative sizes
are clipped to 0 first (lax returns garbage for them; ragdot documents 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HIGHEST = lax.Precision.HIGHEST
_CONTRACTING = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def group_of_rows(group_sizes, m: int) -> np.ndarray:
  """Global group index of every row (G for rows past the last group)."""
  gs = np.maximum(np.asarray(group_sizes, np.int64), 0)
  ends = np.cumsum(gs)
  return np.searchsorted(ends, np.arange(m), side="right")


def _local_mask(group_sizes, m, offset, num_local):
  grp = group_of_rows(group_sizes, m)
  return (grp >= offset) & (grp < offset + num_local) & (grp < len(group_sizes))


def ref_ragged_dot(lhs, rhs, group_sizes, group_offset=None, transpose_rhs=False):
  """f32 reference of ragdot.ragged_dot (rhs [g,n,k] if transpose_rhs)."""
  lhs = jnp.asarray(lhs, jnp.float32)
  rhs = jnp.asarray(rhs, jnp.float32)
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  gs = jnp.maximum(jnp.asarray(group_sizes, jnp.int32), 0)
  num_groups, m = gs.shape[0], lhs.shape[0]
  o = 0 if group_offset is None else int(np.asarray(group_offset).reshape(()))
  num_local = rhs.shape[0]
  full = jnp.zeros((num_groups,) + rhs.shape[1:], jnp.float32)
  for j in range(num_local):
    if 0 <= o + j < num_groups:
      full = full.at[o + j].set(rhs[j])
  out = lax.ragged_dot(lhs, full, gs, precision=HIGHEST,
                       preferred_element_type=jnp.float32)
  mask = _local_mask(group_sizes, m, o, num_local)
  return jnp.where(mask[:, None], out, 0.0)


def ref_trans_ragged_dot(lhs, rhs, group_sizes, group_offset=None, num_groups=None):
  """f32 reference of ragdot.trans_ragged_dot -> [num_groups or G, k, n].

  Written as a one-hot einsum (differentiable; lax has no VJP for its ragged
  contracting mode).  test_oracle checks it against lax and against loops.
  """
  lhs = jnp.asarray(lhs, jnp.float32)
  rhs = jnp.asarray(rhs, jnp.float32)
  total, m = len(group_sizes), lhs.shape[0]
  o = 0 if group_offset is None else int(np.asarray(group_offset).reshape(()))
  count = total if num_groups is None else num_groups
  grp = group_of_rows(group_sizes, m)
  onehot = (grp[None, :] == (o + np.arange(count))[:, None]) & (grp[None, :] < total)
  return jnp.einsum("gm,mk,mn->gkn", jnp.asarray(onehot, jnp.float32), lhs, rhs,
                    precision=HIGHEST)


def lax_trans_ragged_dot(lhs, rhs, group_sizes):
  """lax's own ragged contracting mode, f32/HIGHEST (rows past the sum masked)."""
  lhs = jnp.asarray(lhs, jnp.float32)
  rhs = jnp.asarray(rhs, jnp.float32)
  gs = jnp.maximum(jnp.asarray(group_sizes, jnp.int32), 0)
  valid = jnp.asarray(group_of_rows(group_sizes, lhs.shape[0]) < gs.shape[0])[:, None]
  return lax.ragged_dot_general(
      jnp.where(valid, lhs, 0), jnp.where(valid, rhs, 0), gs, _CONTRACTING,
      precision=HIGHEST, preferred_element_type=jnp.float32)


TOLERANCE = {  # relative Frobenius error allowed against the f32 oracle
    "float32": 1e-5,
    "bfloat16": 1.5e-2,
    "float16": 3e-3,
}


def _f64(out) -> np.ndarray:
  """A kernel output (any float dtype, device or host) as a host float64 array."""
  if isinstance(out, np.ndarray) and out.dtype == np.float64:
    return out
  return np.asarray(jnp.asarray(out, jnp.float32), np.float64)


def off_elements(out, ref, rel: float, floor: float) -> np.ndarray:
  """Mask of the elements with |out - ref| > rel * |ref| + floor * rms(ref)
  (NaN counts as off)."""
  out, ref = _f64(out), np.asarray(ref, np.float64)
  rms = np.sqrt(np.mean(np.square(ref))) if ref.size else 0.0
  return ~(np.abs(out - ref) <= rel * np.abs(ref) + floor * rms)


def rel_error(out, ref) -> float:
  out = _f64(out)
  ref = np.asarray(ref, np.float64)
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert np.all(np.isfinite(out)), "non-finite values in the output"
  denom = max(np.linalg.norm(ref), 1e-30)
  return float(np.linalg.norm(out - ref) / denom)


def assert_close(out, ref, dtype, factor: float = 1.0) -> None:
  """Relative (Frobenius) error within the dtype's tolerance, and every element
  within 4x that tolerance of (its own magnitude + the output's rms): a few
  wrong elements (a row's 64 columns left 0, v25c) hide in the whole-output norm."""
  out, ref = _f64(out), np.asarray(ref, np.float64)  # converted once for both checks
  err = rel_error(out, ref)
  tol = TOLERANCE[jnp.dtype(dtype).name] * factor
  assert err <= tol, f"relative error {err:.3g} > {tol:.3g} ({jnp.dtype(dtype).name})"
  wrong = off_elements(out, ref, 4 * tol, 4 * tol)
  if wrong.any():
    where = np.argwhere(wrong)
    raise AssertionError(f"{int(wrong.sum())} elements off by more than 4 x {tol:.3g} x "
                         f"(|ref| + rms), first at {where[:4].tolist()}")


def assert_zero_rows(out, group_sizes, group_offset, num_local) -> None:
  """Rows outside the shard's groups (and past the last group) are exactly 0."""
  out = np.asarray(jnp.asarray(out, jnp.float32))
  o = 0 if group_offset is None else int(np.asarray(group_offset).reshape(()))
  mask = _local_mask(group_sizes, out.shape[0], o, num_local)
  assert np.all(out[~mask] == 0), "a row outside the local groups is not exactly 0"


def random_inputs(key, shapes, dtype):
  """Fresh normal inputs (never zeros) of the given shapes."""
  keys = jax.random.split(key, len(shapes))
  return [jax.random.normal(k_, s, jnp.float32).astype(dtype) for k_, s in zip(keys, shapes)]


def np_ragged_dot(lhs, rhs, group_sizes, group_offset=None, transpose_rhs=False):
  """Host numpy f32 reference (a loop over groups): cheap at real sizes.

  The operands come to the host in their own dtype and each group's slices are
  widened to f32 there (exact for 16-bit floats), so a real-size rhs (e.g.
  DeepSeek-V3's 7.5 GB of bf16 experts) is never held as f32 whole.
  """
  lhs, rhs = np.asarray(lhs), np.asarray(rhs)
  if transpose_rhs:
    rhs = np.swapaxes(rhs, 1, 2)
  m = lhs.shape[0]
  o = 0 if group_offset is None else int(np.asarray(group_offset).reshape(()))
  out = np.zeros((m, rhs.shape[2]), np.float32)
  start = 0
  for gidx, size in enumerate(np.maximum(np.asarray(group_sizes), 0)):
    end = min(start + int(size), m)
    if 0 <= gidx - o < rhs.shape[0] and end > start:
      out[start:end] = lhs[start:end].astype(np.float32) @ rhs[gidx - o].astype(np.float32)
    start = end
  return out


def np_trans_ragged_dot(lhs, rhs, group_sizes, group_offset=None, num_groups=None):
  """Host numpy f32 reference of trans_ragged_dot."""
  lhs = np.asarray(jnp.asarray(lhs, jnp.float32))
  rhs = np.asarray(jnp.asarray(rhs, jnp.float32))
  m = lhs.shape[0]
  o = 0 if group_offset is None else int(np.asarray(group_offset).reshape(()))
  count = len(group_sizes) if num_groups is None else num_groups
  out = np.zeros((count, lhs.shape[1], rhs.shape[1]), np.float32)
  start = 0
  for gidx, size in enumerate(np.maximum(np.asarray(group_sizes), 0)):
    end = min(start + int(size), m)
    if 0 <= gidx - o < count and end > start:
      out[gidx - o] = lhs[start:end].T @ rhs[start:end]
    start = end
  return out
