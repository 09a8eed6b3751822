"""Static argument checks shared by every public op.

Bad static input raises ``TypeError`` (the operands' ranks, shapes and dtypes:
as ``jax.lax`` does) or ``ValueError`` (out-of-range options, and a malformed
``rhs_scale``: ``scales.check``), always naming the argument.
Traced values (negative sizes, offsets out of range) are only checked in the
optional checked mode (``ragdot.checked``).
"""

from __future__ import annotations

import dataclasses
import functools
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

  @property
  def backend_out_dtype(self) -> jnp.dtype:
    return backend_out_dtype(self.out_dtype)


def backend_out_dtype(out_dtype: Any) -> jnp.dtype:
  """The dtype the backends write for a result of ``out_dtype``: itself, but
  f32 for a float narrower than 16 bits (fp8), which the caller then rounds to
  once."""
  if jnp.issubdtype(out_dtype, jnp.floating) and jnp.finfo(out_dtype).bits < 16:
    return jnp.dtype(jnp.float32)
  return jnp.dtype(out_dtype)



def _input_dtype(x: Any) -> np.dtype:
  # jnp.result_type canonicalizes (f64 -> f32 without x64); alone, a weak type
  # keeps its dtype: lax does not let it yield to the other operand's.
  return np.dtype(jnp.result_type(x))


def _rank(dtype: np.dtype) -> tuple[bool, int, int, int, bool]:
  """Where ``jax.lax.dot_general`` ranks an input dtype for its result type
  (XLA's HigherPrecisionType): complex, exponent range, mantissa, bits, signed."""
  complex_ = jnp.issubdtype(dtype, jnp.complexfloating)
  real = np.dtype(jnp.finfo(dtype).dtype) if complex_ else dtype
  floating = jnp.issubdtype(real, jnp.floating)
  if floating:
    bits = jnp.finfo(real).bits
  elif real == np.dtype(bool):
    bits = 1
  else:
    bits = jnp.iinfo(real).bits
  return (complex_, jnp.finfo(real).maxexp if floating else -1,
          jnp.finfo(real).nmant if floating else -1, bits,
          not jnp.issubdtype(real, jnp.unsignedinteger))


def result_dtype(lhs: Any, rhs: Any) -> np.dtype:
  """The result dtype of ``jax.lax.ragged_dot`` without preferred_element_type:
  the operand dtype lax ranks higher (bf16 over f16, int8 over uint8, any
  float over any integer); TypeError for two distinct dtypes it ranks equal."""
  a, b = _input_dtype(lhs), _input_dtype(rhs)
  if _rank(a) > _rank(b):
    return a
  if _rank(b) > _rank(a):
    return b
  if a != b:
    raise TypeError(f"lhs and rhs dtypes {a} and {b} have no common result dtype")
  return a


def widened(dtype: Any) -> np.dtype:
  """A dtype the backends compute in that holds every value of ``dtype``:
  floats narrower than 16 bits as bf16, sub-byte integers as int8."""
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 16:
    return np.dtype(jnp.bfloat16)
  if jnp.issubdtype(dtype, jnp.integer) and jnp.iinfo(dtype).bits < 8:
    return np.dtype(jnp.int8)
  return np.dtype(dtype)


# The 8-bit floats the kernels take (natively, as W8A16 weights, with block scales).
FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def is_fp8(dtype: Any) -> bool:
  """An 8-bit float (e4m3, e5m2, ...): exact in bf16, where the backends that
  do not take it compute it."""
  return bool(jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 8)


def _holds(wide: np.dtype, narrow: np.dtype) -> bool:
  """Whether the float dtype ``wide`` holds every finite value of ``narrow``."""
  w, n = jnp.finfo(wide), jnp.finfo(narrow)
  return (w.nmant >= n.nmant and w.maxexp >= n.maxexp
          and float(w.smallest_subnormal) <= float(n.smallest_subnormal))


def weight_only(lhs: Any, rhs: Any) -> bool:
  """bf16 / f16 rows with fp8 weights the rows' dtype holds exactly (W8A16;
  not e8m0 beside f16): ``ragged_dot`` keeps the pair, each backend call
  widens the weights to the rows' dtype unless its kernel takes them; the
  result dtype is the rows' (as lax ranks them)."""
  a, b = _input_dtype(lhs), _input_dtype(rhs)
  return (a in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)) and is_fp8(b)
          and _holds(a, b))


def common_dtype(lhs: Any, rhs: Any) -> np.dtype:
  """The dtype both operands are cast to before the ops: the operands' dtype,
  else one that holds both exactly (bf16 and f16 meet in f32, mixed fp8 in
  bf16, int4 in int8; an integer meets a float in that float). One fp8 dtype
  stays as it is: each backend call widens it to bf16 unless its kernel takes it."""
  a, b = _input_dtype(lhs), _input_dtype(rhs)
  if a == b and (widened(a) == a or is_fp8(a)):
    return a  # fp8: the backend call widens it to bf16 unless its kernel takes it
  return np.dtype(jnp.promote_types(widened(a), widened(b)))


def check_implementation(implementation: Any) -> str | None:
  if implementation is None:
    return None
  if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be None or one of {IMPLEMENTATIONS}, got"
        f" {implementation!r}"
    )
  return implementation


def check_precision(precision: Any) -> Any:
  """``precision`` (a list as a tuple) if ``jax.lax.dot`` takes it, else the
  error lax raises for it (ValueError / TypeError), naming precision: every
  backend then refuses what lax refuses, though the kernels ignore it."""
  if isinstance(precision, list):
    precision = tuple(precision)
  try:
    hash(precision)
  except TypeError as e:
    raise TypeError(f"precision must be None, a lax.Precision, a string, a pair of them or a "
                    f"lax.DotAlgorithmPreset, got {precision!r}") from e
  _check_precision_with_lax(precision)
  return precision


@functools.lru_cache(maxsize=64)
def _check_precision_with_lax(precision: Any) -> None:
  one = jax.ShapeDtypeStruct((1, 1), jnp.float32)
  try:
    jax.eval_shape(functools.partial(jax.lax.dot, precision=precision), one, one)
  except (TypeError, ValueError) as e:
    raise type(e)(f"precision {precision!r} is not one jax.lax.dot takes: {e}") from e


def _check_numeric(name: str, x: Any) -> None:
  dtype = getattr(x, "dtype", None)
  if dtype is None or not (
      jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
  ):
    raise TypeError(f"{name} must be a numeric or bool array, got dtype {dtype}")


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
  return _as_int32(group_sizes)


def _as_int32(a: Any) -> jax.Array:
  """``a`` as int32, values past int32's range clipped to its ends rather than
  wrapped (a uint32 size of 2**31 stays "more than any m", an offset of
  2**32 - 1 stays past every group); numpy arrays are clipped before they
  become jax arrays, which without x64 would wrap them."""
  info, i32 = np.iinfo(a.dtype), np.iinfo(np.int32)
  if info.min < i32.min or info.max > i32.max:
    lo, hi = max(info.min, i32.min), min(info.max, i32.max)
    a = np.clip(a, lo, hi) if isinstance(a, (np.ndarray, np.generic)) else jnp.clip(a, lo, hi)
  return jnp.asarray(a).astype(jnp.int32)


def check_group_offset(group_offset: Any) -> jax.Array | None:
  """None, or an int32 scalar array; accepts shape () or (1,)."""
  if group_offset is None:
    return None
  dtype = getattr(group_offset, "dtype", None)
  if dtype is None:
    if isinstance(group_offset, (int, np.integer)) and not isinstance(
        group_offset, bool
    ):
      i32 = np.iinfo(np.int32)
      return jnp.int32(min(max(int(group_offset), i32.min), i32.max))
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
  return jnp.reshape(_as_int32(group_offset), ())


def _out_dtype(result: np.dtype, preferred_element_type: Any) -> jnp.dtype:
  """preferred_element_type if given, else ``result``; as lax, a non-float
  result may not be narrowed (int32 inputs cannot give int8)."""
  if preferred_element_type is None:
    return result
  try:
    preferred = jnp.dtype(preferred_element_type)
  except TypeError as e:
    raise TypeError(
        f"preferred_element_type must be a dtype, got {preferred_element_type!r}"
    ) from e
  if (preferred != result and not jnp.issubdtype(result, jnp.floating)
      and _rank(preferred)[3] < _rank(result)[3]):
    raise TypeError(
        f"preferred_element_type {preferred} is narrower than the inputs' result"
        f" dtype {result}")
  return preferred


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
      out_dtype=_out_dtype(result_dtype(lhs, rhs), preferred_element_type),
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
      out_dtype=_out_dtype(result_dtype(lhs, rhs), preferred_element_type),
      has_offset=go is not None,
  )
  return problem, gs, go


def accumulation_dtype(dtype: jnp.dtype, out_dtype: jnp.dtype) -> jnp.dtype:
  """f32 (or wider) for floats, int32 (or wider) for integers."""
  wide = jnp.promote_types(widened(np.dtype(dtype)), widened(np.dtype(out_dtype)))
  if jnp.issubdtype(wide, jnp.floating):
    return jnp.promote_types(wide, jnp.float32)
  return jnp.promote_types(wide, jnp.int32)
