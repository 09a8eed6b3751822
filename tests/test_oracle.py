"""The oracle itself against plain numpy loops (so a wrong oracle cannot hide bugs)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import oracle


def _loops(lhs, rhs, sizes, offset, num_local):
  m = lhs.shape[0]
  out = np.zeros((m, rhs.shape[2]))
  trans = np.zeros((num_local, lhs.shape[1], rhs.shape[2]))
  start = 0
  for gidx, size in enumerate(np.maximum(sizes, 0)):
    end = min(start + size, m)
    j = gidx - offset
    if 0 <= j < num_local:
      out[start:end] = lhs[start:end] @ rhs[j]
    start = end
  return out


def _trans_loops(lhs, d, sizes, offset, num_local):
  m = lhs.shape[0]
  res = np.zeros((num_local, lhs.shape[1], d.shape[1]))
  start = 0
  for gidx, size in enumerate(np.maximum(sizes, 0)):
    end = min(start + size, m)
    j = gidx - offset
    if 0 <= j < num_local:
      res[j] = lhs[start:end].T @ d[start:end]
    start = end
  return res


@pytest.mark.parametrize("sizes,offset,num_local", [
    ([3, 0, 5, 2], 0, 4), ([3, 0, 5, 2], 1, 2), ([6, 9, 4, 0], 2, 2),
    ([0, 0, 0, 0], 0, 4), ([-2, 4, 3, 1], 0, 4), ([1, 2, 1, 1], 3, 2),
])
def test_oracle_matches_loops(sizes, offset, num_local):
  rng = np.random.default_rng(0)
  m, k, n = 12, 5, 3
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  rhs = rng.standard_normal((num_local, k, n)).astype(np.float32)
  d = rng.standard_normal((m, n)).astype(np.float32)
  sizes = np.asarray(sizes, np.int32)
  go = None if offset == 0 and num_local == len(sizes) else offset
  np.testing.assert_allclose(
      oracle.ref_ragged_dot(lhs, rhs, sizes, go), _loops(lhs, rhs, sizes, offset, num_local),
      rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      oracle.ref_trans_ragged_dot(lhs, d, sizes, go, None if go is None else num_local),
      _trans_loops(lhs, d, sizes, offset, num_local), rtol=1e-5, atol=1e-5)


def test_einsum_trans_oracle_matches_lax():
  rng = np.random.default_rng(1)
  lhs = rng.standard_normal((15, 4)).astype(np.float32)
  d = rng.standard_normal((15, 6)).astype(np.float32)
  for sizes in ([3, 0, 5, 2], [10, 10, 1, 0], [0, 0, 0, 0]):
    np.testing.assert_allclose(
        oracle.ref_trans_ragged_dot(lhs, d, np.asarray(sizes, np.int32)),
        oracle.lax_trans_ragged_dot(lhs, d, np.asarray(sizes, np.int32)),
        rtol=1e-5, atol=1e-5)


def test_numpy_oracles_match_lax_oracles():
  rng = np.random.default_rng(2)
  lhs = rng.standard_normal((20, 6)).astype(np.float32)
  rhs = rng.standard_normal((2, 6, 5)).astype(np.float32)
  d = rng.standard_normal((20, 5)).astype(np.float32)
  sizes = np.array([4, 0, 9, 3], np.int32)
  np.testing.assert_allclose(oracle.np_ragged_dot(lhs, rhs, sizes, 1),
                             oracle.ref_ragged_dot(lhs, rhs, sizes, 1), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(oracle.np_ragged_dot(lhs, np.swapaxes(rhs, 1, 2), sizes, 2, True),
                             oracle.ref_ragged_dot(lhs, np.swapaxes(rhs, 1, 2), sizes, 2, True), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(oracle.np_trans_ragged_dot(lhs, d, sizes, 1, 2),
                             oracle.ref_trans_ragged_dot(lhs, d, sizes, 1, 2), rtol=1e-5, atol=1e-5)


def test_assert_close_catches_a_few_wrong_elements():
  """63 zeros in a 4096 x 960 output pass the whole-output norm (25c's miss);
  the per-element bound fails them, and bf16 rounding passes it."""
  ref = np.random.default_rng(0).standard_normal((4096, 960)).astype(np.float32) * 32
  rounded = np.asarray(jnp.asarray(ref, jnp.bfloat16).astype(jnp.float32))
  oracle.assert_close(rounded, ref, jnp.bfloat16)
  bad = rounded.copy()
  bad[489, 1:64] = 0
  assert oracle.rel_error(bad, ref) < oracle.TOLERANCE["bfloat16"]
  with pytest.raises(AssertionError, match="elements off"):
    oracle.assert_close(bad, ref, jnp.bfloat16)
