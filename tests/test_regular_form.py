"""scripts/regular_form.py's batched form of each op computes what ragdot
computes on equal groups (checked on the CPU, small shapes)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragdot import bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import regular_form  # noqa: E402  (the scripts folder, as on the GPU machine)


@pytest.mark.parametrize("op", ["fwd", "dx", "dw"])
def test_batched_form_equals_ragdot_on_equal_groups(op):
  s = bench.Shape("tiny", 64, 32, 48, 4)
  kx, kw, ky = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(kx, (s.m, s.k), jnp.float32)
  w = jax.random.normal(kw, (s.g, s.k, s.n), jnp.float32)
  dy = jax.random.normal(ky, (s.m, s.n), jnp.float32)
  gs = jnp.full((s.g,), s.m // s.g, jnp.int32)
  want = bench._ragdot_fns(op, None)(x, w, dy, gs)  # pylint: disable=protected-access
  got = regular_form.batched_fn(op, s.g)(x, w, dy, gs)
  assert got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
