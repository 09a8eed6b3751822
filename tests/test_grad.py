"""Reverse mode of the ops equals lax autodiff of the oracle, first and second order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import ragdot
from impls import CONTRACT

HIGHEST = jax.lax.Precision.HIGHEST

# (m, k, n, sizes, offset, num_local)
CASES = [
    (24, 8, 16, [5, 0, 11, 6], None, 4),       # sum < m, an empty group
    (24, 8, 16, [9, 9, 9, 9], None, 4),        # sum > m
    (24, 8, 16, [5, 7, 0, 12], 1, 2),          # middle shard
    (24, 8, 16, [0, 0, 0, 0], 0, 2),           # all empty
    (24, 8, 16, [6, 6, 6, 6], 3, 2),           # shard past G
]


def _dims(impl, k, n):
  return (k, n) if impl == "xla" else (64, 64)


def _grads(fn, args, argnums):
  return jax.grad(fn, argnums)(*args)


@pytest.mark.parametrize("impl", sorted(CONTRACT))
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_ragged_dot_grads_match_lax(impl, transpose_rhs, case):
  m, k, n, sizes, offset, num_local = case
  k, n = _dims(impl, k, n)
  dtype = CONTRACT[impl].dtypes[0]
  key = jax.random.key(m + k + (offset or 0) + 7 * transpose_rhs)
  rhs_shape = (num_local, n, k) if transpose_rhs else (num_local, k, n)
  x, w, c = oracle.random_inputs(key, [(m, k), rhs_shape, (m, n)], jnp.float32)
  x, w = x.astype(dtype), w.astype(dtype)
  gs = jnp.asarray(sizes, jnp.int32)
  go = None if offset is None else jnp.int32(offset)
  dn = ragdot.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [2 if transpose_rhs else 1]), ([], [])),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

  def loss(x, w):
    out = ragdot.ragged_dot_general(x, w, gs, dn, precision=HIGHEST,
                                    preferred_element_type=jnp.float32,
                                    group_offset=go, implementation=impl)
    return jnp.sum(out * c)

  def ref_loss(x, w):
    return jnp.sum(oracle.ref_ragged_dot(x, w, sizes, offset, transpose_rhs) * c)

  got = jax.jit(jax.grad(loss, (0, 1)))(x, w)
  want = jax.grad(ref_loss, (0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
  for g_, w_ in zip(got, want):
    assert g_.dtype == dtype
    oracle.assert_close(g_, w_, dtype, factor=2)


@pytest.mark.parametrize("impl", sorted(CONTRACT))
@pytest.mark.parametrize("ct_scale,operand_scale", [(1e5, 1e-3), (1e-8, 1e4)])
def test_f16_gradients_of_an_f32_result_keep_the_cotangent_range(impl, ct_scale, operand_scale):
  """f16 operands, f32 result: an f32 cotangent past f16's range (above 65504 or
  below its smallest subnormal, ~6e-8) still gives the finite, nonzero f16
  gradients lax gives, for both ops."""
  m, k, n, sizes, offset, num_local = CASES[2]
  k, n = _dims(impl, k, n)
  key = jax.random.key(int(ct_scale > 1))
  x, w, c, d = oracle.random_inputs(key, [(m, k), (num_local, k, n), (m, n), (m, n)],
                                    jnp.float32)
  x, w, d = (operand_scale * a for a in (x, w, d))
  c = ct_scale * c
  gs = jnp.asarray(sizes, jnp.int32)
  f16 = lambda *a: tuple(b.astype(jnp.float16) for b in a)

  def loss(x, w):
    out = ragdot.ragged_dot(x, w, gs, group_offset=offset, precision=HIGHEST,
                            preferred_element_type=jnp.float32, implementation=impl)
    return jnp.sum(out * c)

  def ref_loss(x, w):
    return jnp.sum(oracle.ref_ragged_dot(x, w, sizes, offset, False) * c)

  got = jax.jit(jax.grad(loss, (0, 1)))(*f16(x, w))
  want = jax.grad(ref_loss, (0, 1))(*(a.astype(jnp.float32) for a in f16(x, w)))
  for g_, w_ in zip(got, want):
    assert g_.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(g_)))
    assert 1e-5 < float(jnp.max(jnp.abs(w_))) < 6e4  # the gradients themselves fit f16
    oracle.assert_close(g_, w_, jnp.float16, factor=2)
  # trans_ragged_dot: its [g, k, n] cotangent, f32, goes the same way
  cy = ct_scale * jax.random.normal(jax.random.key(3), (num_local, k, n), jnp.float32)
  tloss = lambda x, d: jnp.sum(ragdot.trans_ragged_dot(
      x, d, gs, group_offset=offset, num_groups=num_local, precision=HIGHEST,
      preferred_element_type=jnp.float32, implementation=impl) * cy)
  ref_tloss = lambda x, d: jnp.sum(oracle.ref_trans_ragged_dot(x, d, sizes, offset, num_local)
                                   * cy)
  got = jax.jit(jax.grad(tloss, (0, 1)))(*f16(x, d))
  want = jax.grad(ref_tloss, (0, 1))(*(a.astype(jnp.float32) for a in f16(x, d)))
  for g_, w_ in zip(got, want):
    assert bool(jnp.all(jnp.isfinite(g_)))
    oracle.assert_close(g_, w_, jnp.float16, factor=2)


@pytest.mark.parametrize("impl", sorted(CONTRACT))
@pytest.mark.parametrize("case", CASES[:3] + CASES[4:])
def test_trans_ragged_dot_grads_match_lax(impl, case):
  m, k, n, sizes, offset, num_local = case
  k, n = _dims(impl, k, n)
  dtype = CONTRACT[impl].dtypes[0]
  count = None if offset is None else num_local
  out_groups = len(sizes) if offset is None else num_local
  x, d, cy = oracle.random_inputs(jax.random.key(3 * m + n), [(m, k), (m, n), (out_groups, k, n)], jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  go = None if offset is None else jnp.int32(offset)

  def loss(x, d):
    y = ragdot.trans_ragged_dot(x, d, gs, group_offset=go, num_groups=count,
                                precision=HIGHEST, implementation=impl)
    return jnp.sum(y * cy)

  def ref_loss(x, d):
    return jnp.sum(oracle.ref_trans_ragged_dot(x, d, sizes, offset, count) * cy)

  got = jax.grad(loss, (0, 1))(x.astype(dtype), d.astype(dtype))
  want = jax.grad(ref_loss, (0, 1))(x, d)
  for g_, w_ in zip(got, want):
    oracle.assert_close(g_, w_, dtype, factor=2)


@pytest.mark.parametrize("impl", sorted(CONTRACT))
def test_second_order_grad_of_grad(impl):
  """d/dw <v, d/dx loss(x, w)>: runs through the VJP of the VJP (trans_ragged_dot)."""
  m, k, n = 20, 8, 12
  k, n = _dims(impl, k, n)
  m = m if impl == "xla" else 24  # the Mosaic dW kernel takes m % 8 == 0
  sizes = [4, 0, 9, 5]
  dtype = CONTRACT[impl].dtypes[0]
  x, w, c, v = oracle.random_inputs(jax.random.key(11), [(m, k), (4, k, n), (m, n), (m, k)], jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def inner(x, w):
    return jnp.sum(ragdot.ragged_dot(x, w, gs, precision=HIGHEST,
                                     preferred_element_type=jnp.float32,
                                     implementation=impl) * c)

  def ref_inner(x, w):
    return jnp.sum(oracle.ref_ragged_dot(x, w, sizes) * c)

  outer = lambda f: (lambda x, w: jnp.sum(jax.grad(f, 0)(x, w).astype(jnp.float32) * v))
  got = jax.grad(outer(inner), 1)(x.astype(dtype), w.astype(dtype))
  want = jax.grad(outer(ref_inner), 1)(x, w)
  oracle.assert_close(got, want, dtype, factor=2)


def test_group_sizes_and_offset_get_no_gradient():
  x = jnp.ones((6, 4))
  w = jnp.ones((2, 4, 3))
  fn = lambda x, w, gs, go: jnp.sum(ragdot.ragged_dot(x, w, gs, group_offset=go))
  gs = jnp.array([2, 2, 2], jnp.int32)
  grads = jax.grad(fn, (0, 1, 2, 3), allow_int=True)(x, w, gs, jnp.int32(1))
  assert grads[2].dtype == jax.dtypes.float0 and grads[3].dtype == jax.dtypes.float0
  np.testing.assert_array_equal(grads[0][:2], 0)  # rows of group 0: not in the shard


@pytest.mark.parametrize("m", [5, 16])
def test_explicit_mosaic_differentiates_every_call_its_forward_takes(m):
  # (the forward takes fewer than 8 rows and an empty k: so must dX and dW)
  for k in (64, 0):
    x, w, c = oracle.random_inputs(jax.random.key(m + k), [(m, k), (2, k, 64), (m, 64)],
                                   jnp.float32)
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    gs = jnp.array([2, m], jnp.int32)

    def loss(x, w, impl):
      out = ragdot.ragged_dot(x, w, gs, preferred_element_type=jnp.float32,
                              implementation=impl)
      return jnp.sum(out * c)

    got = jax.grad(loss, (0, 1))(x, w, "mosaic")
    want = jax.grad(loss, (0, 1))(x, w, "xla")
    for g_, w_ in zip(got, want):
      np.testing.assert_allclose(np.asarray(g_, np.float32), np.asarray(w_, np.float32),
                                 rtol=2e-2, atol=2e-2)
