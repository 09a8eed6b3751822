"""Operands and layouts shared by the tests of split operands (explicit axes:
test_explicit_sharding.py; automatic axes: test_auto_sharding.py)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

HIGHEST = jax.lax.Precision.HIGHEST
M, K, N, G = 256, 64, 32, 8
SIZES = np.array([40, 0, 33, 50, 7, 60, 20, 30], np.int32)  # 240 rows: 16 past the groups

# (lhs spec, rhs spec, the output's spec, the collectives the call may compile to)
GMM_CASES = [
    (P("dp"), P(), (("dp",), None), set()),  # rows: no gather of lhs
    (P(), P(None, None, "ep"), (None, ("ep",)), set()),  # columns
    (P(), P("ep"), (None, None), {"all-reduce"}),  # experts: group_offset per shard + psum
    (P("dp"), P("ep"), (("dp",), None), {"all-reduce"}),
    (P(("dp", "ep")), P(), (("dp", "ep"), None), set()),
    (P(None, "ep"), P(None, "ep"), (None, None), {"all-reduce"}),  # contraction: partials summed
]


def mesh(axis_type: jax.sharding.AxisType) -> jax.sharding.Mesh:
  """A (dp=2, ep=4) mesh of the 8 CPU devices, both axes of ``axis_type``."""
  if len(jax.devices()) < 8:
    pytest.fail(f"needs 8 devices (conftest sets 8 CPU devices), got {len(jax.devices())}")
  return jax.make_mesh((2, 4), ("dp", "ep"), devices=jax.devices()[:8],
                       axis_types=(axis_type,) * 2)


def operands(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """x [M, K], w [G, K, N] and an output cotangent [M, N], f32."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = rng.standard_normal((G, K, N)).astype(np.float32)
  d = rng.standard_normal((M, N)).astype(np.float32)
  return x, w, d


def compiled(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


def collectives(fn, *args) -> list[str]:
  """The collectives in the compiled HLO of ``fn(*args)``."""
  return re.findall(r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(",
                    compiled(fn, *args))
