"""Bad static input raises TypeError/ValueError naming the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ragdot

L = jnp.ones((8, 4), jnp.float32)
R = jnp.ones((3, 4, 5), jnp.float32)
GS = jnp.array([2, 3, 3], jnp.int32)
D = jnp.ones((8, 5), jnp.float32)
DN_FWD = ragdot.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])),
    lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

CASES = [
    # (description, call, exception, text the message must contain)
    ("lhs rank", lambda: ragdot.ragged_dot(L[None], R, GS), TypeError, "lhs"),
    ("rhs rank", lambda: ragdot.ragged_dot(L, R[0], GS), TypeError, "rhs"),
    ("k mismatch", lambda: ragdot.ragged_dot(L, jnp.ones((3, 6, 5)), GS), TypeError, "contracting"),
    ("rhs groups vs group_sizes", lambda: ragdot.ragged_dot(L, R[:2], GS), TypeError, "group_sizes"),
    ("rhs groups > G with offset", lambda: ragdot.ragged_dot(L, jnp.ones((4, 4, 5)), GS, group_offset=jnp.int32(0)), TypeError, "rhs"),
    ("float group_sizes", lambda: ragdot.ragged_dot(L, R, GS.astype(jnp.float32)), TypeError, "group_sizes"),
    ("2-d group_sizes", lambda: ragdot.ragged_dot(L, R, GS[None]), TypeError, "group_sizes"),
    ("list group_sizes", lambda: ragdot.ragged_dot(L, R, [2, 3, 3]), TypeError, "group_sizes"),
    ("float group_offset", lambda: ragdot.ragged_dot(L, R[:1], GS, group_offset=jnp.float32(0)), TypeError, "group_offset"),
    ("group_offset shape", lambda: ragdot.ragged_dot(L, R[:1], GS, group_offset=jnp.zeros((2,), jnp.int32)), TypeError, "group_offset"),
    ("group_offset str", lambda: ragdot.ragged_dot(L, R[:1], GS, group_offset="0"), TypeError, "group_offset"),
    ("PRNG key lhs", lambda: ragdot.ragged_dot(jax.random.split(jax.random.key(0), (8, 4)), R, GS), TypeError, "lhs"),
    ("integer result narrowed", lambda: ragdot.ragged_dot(L.astype(jnp.int32), R.astype(jnp.int32), GS, preferred_element_type=jnp.int8), TypeError, "preferred_element_type"),
    ("bad preferred_element_type", lambda: ragdot.ragged_dot(L, R, GS, preferred_element_type="nope"), TypeError, "preferred_element_type"),
    ("precision lax refuses, on a kernel", lambda: ragdot.ragged_dot(L, R, GS, precision="HIGHEST", implementation="triton"), ValueError, "precision"),
    ("precision triple, on a kernel", lambda: ragdot.ragged_dot(L, R, GS, precision=(jax.lax.Precision.HIGHEST,) * 3, implementation="mosaic"), ValueError, "precision"),
    ("precision unhashable", lambda: ragdot.ragged_dot(L, R, GS, precision={}), TypeError, "precision"),
    ("trans: bad precision", lambda: ragdot.trans_ragged_dot(L, D, GS, precision="bogus", implementation="mosaic"), ValueError, "precision"),
    ("general: bad precision", lambda: ragdot.ragged_dot_general(L, R, GS, DN_FWD, precision="bogus", implementation="triton"), ValueError, "precision"),
    ("unknown implementation", lambda: ragdot.ragged_dot(L, R, GS, implementation="cuda"), ValueError, "implementation"),
    ("implementation not a str", lambda: ragdot.ragged_dot(L, R, GS, implementation=1), ValueError, "implementation"),
    ("trans: lhs rank", lambda: ragdot.trans_ragged_dot(L[None], D, GS), TypeError, "lhs"),
    ("trans: rhs rank", lambda: ragdot.trans_ragged_dot(L, R, GS), TypeError, "rhs"),
    ("trans: rows mismatch", lambda: ragdot.trans_ragged_dot(L, D[:7], GS), TypeError, "rows"),
    ("trans: num_groups without offset", lambda: ragdot.trans_ragged_dot(L, D, GS, num_groups=2), ValueError, "num_groups"),
    ("trans: num_groups too large", lambda: ragdot.trans_ragged_dot(L, D, GS, group_offset=jnp.int32(0), num_groups=4), ValueError, "num_groups"),
    ("trans: num_groups zero", lambda: ragdot.trans_ragged_dot(L, D, GS, group_offset=jnp.int32(0), num_groups=0), ValueError, "num_groups"),
    ("trans: num_groups not int", lambda: ragdot.trans_ragged_dot(L, D, GS, group_offset=jnp.int32(0), num_groups=2.0), TypeError, "num_groups"),
    ("trans: unknown implementation", lambda: ragdot.trans_ragged_dot(L, D, GS, implementation="x"), ValueError, "implementation"),
    ("general: not dimension numbers", lambda: ragdot.ragged_dot_general(L, R, GS, ((1,), (1,))), TypeError, "ragged_dot_dimension_numbers"),
    ("general: num_groups in the forward mode", lambda: ragdot.ragged_dot_general(L, R, GS, DN_FWD, num_groups=2), ValueError, "num_groups"),
    ("general: lhs rank with group_offset", lambda: ragdot.ragged_dot_general(L[None], R, GS, DN_FWD, group_offset=0), TypeError, "contracting"),
    ("general: k mismatch", lambda: ragdot.ragged_dot_general(L, jnp.ones((3, 6, 5)), GS, DN_FWD), TypeError, "contracting"),
]


@pytest.mark.parametrize("desc,call,exc,text", CASES, ids=[c[0] for c in CASES])
def test_bad_static_input_raises_naming_argument(desc, call, exc, text):
  with pytest.raises(exc, match=text):
    call()


def test_at_least_fifteen_distinct_cases():
  assert len({c[0] for c in CASES}) >= 15


def test_group_offset_accepts_scalar_and_length_one():
  for go in (jnp.int32(1), jnp.array([1], jnp.int32), 1):
    out = ragdot.ragged_dot(L, R[:2], GS, group_offset=go)
    assert out.shape == (8, 5)
    assert float(jnp.abs(out[:2]).max()) == 0.0  # group 0 is not in the shard


def test_unsupported_general_mode_with_offset_is_not_implemented():
  # Ragged batch mode: lhs [b,m,k], rhs [b,k,n], ragged dim is a batch dim.
  dn = ragdot.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([2], [1]), ([0], [0])),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  with pytest.raises(NotImplementedError, match="MoE modes"):
    ragdot.ragged_dot_general(jnp.ones((3, 2, 4)), jnp.ones((3, 4, 5)), GS, dn,
                              group_offset=jnp.int32(0))


def test_group_sizes_past_int32_are_clipped_not_wrapped():
  # A uint32 size of 2**31 would wrap to a negative int32 (counted as 0); as lax, it
  # is "more rows than m": the group takes every row after the ones before it.
  x = jnp.ones((6, 1), jnp.float32)
  w = jnp.arange(1.0, 4.0).reshape(3, 1, 1)
  for gs in (jnp.array([2, 2**31, 1], jnp.uint32), np.array([2, 2**40, 1], np.int64)):
    want = jax.lax.ragged_dot(x, w, jnp.array([2, 4, 0], jnp.int32))
    got = ragdot.ragged_dot(x, w, gs)
    np.testing.assert_array_equal(got, want)
    dw = ragdot.trans_ragged_dot(x, jnp.ones((6, 1)), gs)
    np.testing.assert_array_equal(dw.ravel(), [2.0, 4.0, 0.0])


@pytest.mark.parametrize("offset", [jnp.array(2**32 - 1, jnp.uint32), np.uint64(2**63), 2**40, -2**40])
def test_group_offset_past_int32_is_clipped_not_wrapped(offset):
  # 2**32 - 1 as uint32 would wrap to -1 (the shard's second group would be global
  # group 0); clipped it lies past every group, so the output is all zeros.
  out = ragdot.ragged_dot(L, R[:2], GS, group_offset=offset)
  assert float(jnp.abs(out).max()) == 0.0
