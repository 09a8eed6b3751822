"""The contract every implementation meets, against the f32/HIGHEST lax oracle.

Parametrized over tests/impls.py: a kernel joins by adding its name there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
import ragdot
import strategies as rst
from impls import CONTRACT

HIGHEST = jax.lax.Precision.HIGHEST


def _precision(dtype):
  # f32 on GPUs defaults to tf32: ask for full precision in f32 tests.
  return HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _settings(impl):
  return settings(max_examples=CONTRACT[impl].max_examples)


@st.composite
def trans_case(draw, spec):
  """(m, k, n, sizes, offset, num_local, dtype, preferred, seed) of one call."""
  m = draw(spec.rows)
  k, n = draw(spec.dims), draw(spec.dims)
  num_groups = draw(st.integers(1, 6))
  sizes = draw(rst.group_sizes(m, num_groups))
  offset, num_local = draw(rst.shard(num_groups))
  dtype = draw(st.sampled_from(spec.dtypes))
  preferred = draw(st.sampled_from([None, jnp.float32]))
  seed = draw(st.integers(0, 2**31 - 1))
  return m, k, n, sizes, offset, num_local, dtype, preferred, seed


@st.composite
def forward_case(draw, spec):
  """A trans_case plus transpose_rhs (before the seed)."""
  *head, seed = draw(trans_case(spec))
  return (*head, draw(st.booleans()), seed)


def _run_forward(impl, case, jit_offset):
  m, k, n, sizes, offset, num_local, dtype, preferred, transpose_rhs, seed = case
  rhs_shape = (num_local, n, k) if transpose_rhs else (num_local, k, n)
  lhs, rhs = oracle.random_inputs(jax.random.key(seed), [(m, k), rhs_shape], dtype)
  go = None if offset is None else jnp.asarray(offset, jnp.int32)
  if transpose_rhs:
    dn = ragdot.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    call = functools.partial(ragdot.ragged_dot_general,
                             ragged_dot_dimension_numbers=dn)
  else:
    call = ragdot.ragged_dot
  fn = lambda l, r, g, o: call(
      l, r, g, precision=_precision(dtype), preferred_element_type=preferred,
      group_offset=o, implementation=impl)
  if jit_offset:
    fn = jax.jit(fn)
  out = fn(lhs, rhs, jnp.asarray(sizes), go)
  assert out.shape == (m, n)
  assert out.dtype == (jnp.dtype(preferred) if preferred else jnp.dtype(dtype))
  ref = oracle.ref_ragged_dot(lhs, rhs, sizes, go, transpose_rhs)
  oracle.assert_close(out, ref, dtype)
  oracle.assert_zero_rows(out, sizes, offset, num_local)


@pytest.mark.parametrize("impl", sorted(CONTRACT))
def test_forward_matches_oracle(impl):
  spec = CONTRACT[impl]

  @_settings(impl)
  @given(case=forward_case(spec), jit_offset=st.booleans())
  def check(case, jit_offset):
    _run_forward(impl, case, jit_offset)

  check()


@pytest.mark.parametrize("impl", sorted(CONTRACT))
def test_trans_matches_oracle(impl):
  spec = CONTRACT[impl]

  @_settings(impl)
  @given(case=trans_case(spec))
  def check(case):
    m, k, n, sizes, offset, num_local, dtype, preferred, seed = case
    lhs, rhs = oracle.random_inputs(jax.random.key(seed), [(m, k), (m, n)], dtype)
    go = None if offset is None else jnp.asarray(offset, jnp.int32)
    out = ragdot.trans_ragged_dot(
        lhs, rhs, jnp.asarray(sizes), group_offset=go,
        num_groups=None if offset is None else num_local,
        precision=_precision(dtype), preferred_element_type=preferred,
        implementation=impl)
    assert out.shape == (num_local, k, n)
    ref = oracle.ref_trans_ragged_dot(lhs, rhs, sizes, go,
                                      None if offset is None else num_local)
    oracle.assert_close(out, ref, dtype)
    # Empty local groups are exact zeros (never NaN or garbage).
    gs = np.maximum(sizes, 0)
    ends = np.minimum(np.cumsum(gs), m)
    starts = np.concatenate([[0], ends[:-1]])
    o = offset or 0
    for j in range(num_local):
      if not 0 <= o + j < len(sizes) or ends[o + j] == starts[o + j]:
        assert np.all(np.asarray(out[j], np.float32) == 0)

  check()


@pytest.mark.parametrize("impl", sorted(CONTRACT))
@pytest.mark.parametrize("layout", ["all_zero", "one_owner", "empty_ends", "over"])
def test_every_row_written_on_named_layouts(impl, layout):
  """Deterministic cases that must never regress, whatever hypothesis draws."""
  spec = CONTRACT[impl]
  dtype = spec.dtypes[0]
  m, g = 40, 4
  k = n = 64 if impl != "xla" else 24
  sizes = {
      "all_zero": [0, 0, 0, 0],
      "one_owner": [0, 40, 0, 0],
      "empty_ends": [0, 17, 23, 0],
      "over": [30, 30, 5, 7],
  }[layout]
  for offset, num_local in [(None, g), (1, 2), (3, 1)]:
    case = (m, k, n, np.asarray(sizes, np.int32), offset, num_local, dtype,
            None, False, len(layout) + num_local)
    _run_forward(impl, case, jit_offset=offset is not None)


def _map_over(fn, args, axes):
  """lax.map of ``fn`` over the leading axis of the args whose axis is 0 (the
  others shared)."""
  def one(batched):
    it = iter(batched)
    return fn(*[next(it) if ax == 0 else a for a, ax in zip(args, axes)])

  return jax.lax.map(one, [a for a, ax in zip(args, axes) if ax == 0])


@pytest.mark.parametrize("impl", sorted(CONTRACT))
@pytest.mark.parametrize("batched", ["lhs", "lhs_and_rhs"])
def test_vmap_and_map_match_unbatched_calls(impl, batched):
  """vmap and lax.map over two calls (a shard's forward and its trans_ragged_dot;
  the weights batched too or shared) give each call's own result bitwise."""
  dtype = CONTRACT[impl].dtypes[0]
  m, k, n = 40, 64, 64
  gs, go = jnp.asarray([10, 0, 17, 13], jnp.int32), jnp.int32(1)
  lhs, rhs, dy = oracle.random_inputs(jax.random.key(7), [(2, m, k), (2, 2, k, n), (2, m, n)],
                                      dtype)
  fwd = lambda l, r: ragdot.ragged_dot(l, r, gs, group_offset=go, implementation=impl)
  trans = lambda l, d: ragdot.trans_ragged_dot(l, d, gs, group_offset=go, num_groups=2,
                                               implementation=impl)
  if batched == "lhs":
    rhs = rhs[0]
    fwd_axes = (0, None)
  else:
    fwd_axes = (0, 0)
  for name, fn, args, axes in [("forward", fwd, (lhs, rhs), fwd_axes),
                               ("trans", trans, (lhs, dy), (0, 0))]:
    one = jax.jit(fn)
    want = [np.asarray(one(*[a[i] if ax == 0 else a for a, ax in zip(args, axes)]))
            for i in range(2)]
    by_vmap = np.asarray(jax.jit(jax.vmap(fn, in_axes=axes))(*args))
    by_map = np.asarray(jax.jit(lambda *a: _map_over(fn, a, axes))(*args))
    for i in range(2):
      np.testing.assert_array_equal(by_vmap[i], want[i], err_msg=f"{name} vmap {i}")
      np.testing.assert_array_equal(by_map[i], want[i], err_msg=f"{name} map {i}")
