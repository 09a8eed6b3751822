"""Block scales of 8-bit float expert weights (``rhs_scale``).

A quantized checkpoint stores each expert's weights in e4m3 / e5m2 with one
scale per block of them: per output column (channelwise), per block of
contracting rows and columns (DeepSeek-V3 and Qwen3 FP8 checkpoints store
128 x 128 blocks), or one per expert.  ``rhs_scale`` has rhs's rank and
layout, each dimension a divisor of rhs's: for rhs ``[g, k, n]`` it is
``[g, k // bk, n // bn]`` (for the ``[g, n, k]`` layout, ``[g, n // bn,
k // bk]``), and the weights the product uses are

    dequantized = (rhs.astype(f32) * scale repeated over its block).astype(lhs.dtype)

so a scaled call equals the call on those dequantized weights.  The kernels
take the scales in rhs's layout too.  The Mosaic kernel reads one scale per
consumer and k step where a block spans whole 64-column slices (the 128 x 128
blocks of DeepSeek-V3 / Qwen3 checkpoints); for narrower blocks
``kernel_scales`` first lays them out per column: f32 ``[g, k // bk, n]``, one
row of per-column scales per block of contracting rows.  The Triton kernel
gathers each k step's column scales as given.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from ragdot import sharded
from ragdot import validate

def check(lhs_dtype: Any, rhs: Any, scale: Any) -> None:
  """TypeError or ValueError, naming ``rhs_scale``, for a scale that is none of
  rhs's (either layout: the scale follows rhs's)."""
  if jnp.dtype(rhs.dtype) not in validate.FP8_DTYPES:
    raise TypeError(f"rhs_scale needs 8-bit float weights (e4m3 / e5m2), got rhs {rhs.dtype}")
  if jnp.dtype(lhs_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                  jnp.dtype(jnp.float32)):
    raise TypeError(f"rhs_scale needs bf16, f16 or f32 rows (the weights are dequantized to"
                    f" their dtype), got lhs {jnp.dtype(lhs_dtype)}")
  if not jnp.issubdtype(scale.dtype, jnp.floating) or validate.is_fp8(scale.dtype):
    raise TypeError(f"rhs_scale must be f32, bf16 or f16, got {scale.dtype}")
  if jnp.ndim(scale) != 3:
    raise ValueError(f"rhs_scale must have rhs's rank 3, got shape {jnp.shape(scale)}")
  g, a, b = rhs.shape
  sg, sa, sb = scale.shape
  if sg != g or not sa or not sb or a % sa or b % sb:
    raise ValueError(f"rhs_scale's shape {scale.shape} must be [{g}, a, b] with a dividing"
                     f" {a} and b dividing {b} (one scale per block of rhs {rhs.shape})")


def _full(scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The f32 scales repeated over their blocks, to ``shape`` (rhs's)."""
  s = scale.astype(jnp.float32)
  for axis in (1, 2):
    s = jnp.repeat(s, shape[axis] // scale.shape[axis], axis=axis)
  return s


def dequantize(rhs: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """The weights a scaled call uses: rhs times its block's scale in f32,
  rounded once to ``dtype`` (rhs and scale in the same layout).  Operands
  split over explicit mesh axes are dequantized as if those axes were
  automatic (explicit ones cannot repeat a split dimension), the result split
  as rhs is."""
  fn = lambda r, s: (r.astype(jnp.float32) * _full(s, r.shape)).astype(dtype)
  return _on_auto_axes(fn, rhs, lambda sharding: sharding)(rhs, scale)


def _on_auto_axes(fn: Any, w: jax.Array, out_sharding: Any) -> Any:
  """``fn`` run as if ``w``'s explicit mesh axes were automatic (its reshapes
  and repeats of a split dim are refused on explicit ones), its results split
  as ``out_sharding(w's sharding)`` says; ``fn`` itself where w has none."""
  sharding = getattr(jax.typeof(w), "sharding", None)
  axes = tuple(a for a, t in zip(sharding.mesh.axis_names, sharding.mesh.axis_types)
               if t == jax.sharding.AxisType.Explicit) if sharding is not None else ()
  if not axes:
    return fn
  return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_sharding(sharding))


def _scale_sharding(sharding: Any, scale_shape: tuple[int, ...]) -> Any:
  """The weights' split, on the scales' dims it divides (others replicated)."""
  mesh = sharding.mesh
  kept = [axes if n % math.prod(mesh.shape[a] for a in axes) == 0 else ()
          for axes, n in zip(sharded.spec_dims(sharding.spec, len(scale_shape)), scale_shape)]
  return jax.sharding.NamedSharding(mesh, sharded.partition_spec(*kept))


def kernel_scales(scale: jax.Array, rhs_shape: tuple[int, ...],
                  transpose_rhs: bool) -> jax.Array:
  """f32 ``[g, k // bk, n]``: ``scale`` (rhs's layout) with its contracting
  blocks first and each output column its own scale (what the Mosaic kernel
  reads for blocks narrower than 64 columns: one row per k step)."""
  s = jnp.swapaxes(scale, 1, 2) if transpose_rhs else scale
  n = rhs_shape[1] if transpose_rhs else rhs_shape[2]
  return jnp.repeat(s.astype(jnp.float32), n // s.shape[2], axis=2)


def blocks(scale: Any, rhs_shape: tuple[int, ...], transpose_rhs: bool) -> tuple[int, int]:
  """(contracting rows, output columns) of one block of ``scale`` in rhs's
  layout (``[g, k // t, n // c]``, or ``[g, n // c, k // t]`` for rhs ``[g, n,
  k]``): ``(t, c)``; ValueError naming ``rhs_scale`` for any other shape, or a
  dtype but f32, bf16 and f16.  The kernels' own check, beside ``check``'s for
  callers."""
  if not jnp.issubdtype(scale.dtype, jnp.floating) or validate.is_fp8(scale.dtype):
    raise ValueError(f"rhs_scale must be f32, bf16 or f16, got {scale.dtype}")
  g = rhs_shape[0]
  k, n = (rhs_shape[2], rhs_shape[1]) if transpose_rhs else (rhs_shape[1], rhs_shape[2])
  shape = tuple(scale.shape)
  if len(shape) == 3:
    sk, sn = (shape[2], shape[1]) if transpose_rhs else (shape[1], shape[2])
    if shape[0] == g and sk and sn and not k % sk and not n % sn:
      return k // sk, n // sn
  want = f"[{g}, {n} // c, {k} // t]" if transpose_rhs else f"[{g}, {k} // t, {n} // c]"
  raise ValueError(f"rhs_scale must be {want} for rhs {tuple(rhs_shape)}, got {shape}")


def quantize(w: jax.Array, block: tuple[int, int], dtype: Any = jnp.float8_e4m3fn
             ) -> tuple[jax.Array, jax.Array]:
  """``(q, scale)`` with ``dequantize(q, scale, f32)`` close to ``w`` ``[g, a, b]``:
  one f32 scale per ``block`` (rows, columns) of each matrix, the block's
  largest magnitude over ``dtype``'s largest finite value (1 for an all-zero
  block; at least f32's smallest normal, so a block of tiny weights gets a
  nonzero scale that no flush-to-zero removes), and ``q = w / scale`` rounded
  to ``dtype``."""
  g, a, b = w.shape
  ba, bb = block
  if ba < 1 or bb < 1 or a % ba or b % bb:
    raise ValueError(f"block {block} must divide the matrices' shape ({a}, {b})")

  def fn(w):
    blocks = jnp.abs(w.astype(jnp.float32)).reshape(g, a // ba, ba, b // bb, bb)
    amax = blocks.max(axis=(2, 4))
    tiny = float(jnp.finfo(jnp.float32).tiny)
    scale = jnp.where(amax > 0, jnp.maximum(amax / float(jnp.finfo(dtype).max), tiny), 1.0)
    return (w.astype(jnp.float32) / _full(scale, w.shape)).astype(dtype), scale

  scale_shape = (g, a // ba, b // bb)
  return _on_auto_axes(fn, w, lambda sh: (sh, _scale_sharding(sh, scale_shape)))(w)
