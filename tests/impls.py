"""Implementations under the shared contract suite, and what shapes each takes.

A kernel issue adds its name here; the whole contract suite then runs it
(in Pallas interpret mode on CPU, natively on the GPU machine).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from hypothesis import strategies as st


@dataclasses.dataclass(frozen=True)
class ImplSpec:
  dims: st.SearchStrategy  # k and n
  rows: st.SearchStrategy  # m
  dtypes: tuple
  max_examples: int


CONTRACT = {
    "xla": ImplSpec(
        dims=st.integers(1, 24),
        rows=st.integers(1, 64),
        dtypes=(jnp.float32, jnp.bfloat16, jnp.float16),
        max_examples=30,
    ),
    # Mosaic GPU kernels (Pallas interpret mode on CPU): TMA-aligned shapes;
    # misaligned ones are refused with NotImplementedError (test_mosaic_*.py).
    "mosaic": ImplSpec(
        dims=st.sampled_from([64, 128]),
        rows=st.integers(1, 12).map(lambda r: 8 * r),
        dtypes=(jnp.bfloat16, jnp.float16),
        max_examples=6,
    ),
    # Pallas-Triton kernels (interpret mode on CPU): any k, n, m (masked
    # loads/stores); f32 runs with precision=HIGHEST (IEEE products on GPU).
    "triton": ImplSpec(
        dims=st.integers(1, 40),
        rows=st.integers(1, 48),
        dtypes=(jnp.float32, jnp.bfloat16, jnp.float16),
        max_examples=6,
    ),
}
