"""Lowering Mosaic forward / dX calls for sm90 on a CPU machine.

Interpret mode does not check what the real lowering does (e.g. TMA slice
alignment on tiled SMEM); ``lower(lowering_platforms=("cuda",))`` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ragdot.backends import mosaic_fwd


def assert_gmm_lowers(config, *, m: int, k: int, n: int, g: int, transpose_rhs: bool,
                      local: int | None = None, with_offset: bool = False,
                      out_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rhs_dtype=None) -> None:
  """``mosaic_fwd.gmm`` with ``config`` lowers for CUDA: rhs holds ``local``
  (default g) groups of ``rhs_dtype`` (default ``dtype``); ``with_offset``
  passes a traced group_offset."""
  local = g if local is None else local
  f = jax.jit(functools.partial(mosaic_fwd.gmm, transpose_rhs=transpose_rhs,
                                out_dtype=out_dtype, precision=None, interpret=False,
                                config=config))
  rshape = (local, n, k) if transpose_rhs else (local, k, n)
  args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct(rshape, rhs_dtype or dtype),
          jax.ShapeDtypeStruct((g,), jnp.int32),
          jax.ShapeDtypeStruct((), jnp.int32) if with_offset else None)
  assert "mosaic_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
