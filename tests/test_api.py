"""API surface: ragged_dot_general modes, delegation, dtypes, checked mode, memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import oracle
import ragdot

HIGHEST = lax.Precision.HIGHEST


def _inputs(seed=0, m=30, k=12, n=10, g=4):
  x, w, d = oracle.random_inputs(jax.random.key(seed), [(m, k), (g, k, n), (m, n)], jnp.float32)
  return x, w, d, jnp.array([7, 0, 13, 6], jnp.int32)


def test_general_forward_modes_equal_lax():
  x, w, _, gs = _inputs()
  fwd = lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
  nk = lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
  w_nk = jnp.swapaxes(w, 1, 2)
  want = lax.ragged_dot(x, w, gs, precision=HIGHEST)
  np.testing.assert_allclose(ragdot.ragged_dot_general(x, w, gs, fwd, precision=HIGHEST), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ragdot.ragged_dot_general(x, w_nk, gs, nk, precision=HIGHEST), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lhs_dim,rhs_dim", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_general_ragged_contracting_any_layout_equals_lax(lhs_dim, rhs_dim):
  x, _, d, gs = _inputs(1)
  xl = x if lhs_dim == 0 else x.T
  dl = d if rhs_dim == 0 else d.T
  dn = lax.RaggedDotDimensionNumbers((([lhs_dim], [rhs_dim]), ([], [])), [lhs_dim], [])
  got = ragdot.ragged_dot_general(xl, dl, gs, dn, precision=HIGHEST)
  np.testing.assert_allclose(got, oracle.lax_trans_ragged_dot(x, d, gs), rtol=1e-5, atol=1e-5)


def test_general_other_modes_delegate_to_lax():
  # Ragged batch mode (lax's mode 3): the ragged dimension is a batch dimension.
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((2, 6, 4)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((2, 4, 5)), jnp.float32)
  dn = lax.RaggedDotDimensionNumbers((([2], [1]), ([0], [0])), [0], [])
  g1 = jnp.array([1, 1], jnp.int32)
  np.testing.assert_allclose(
      ragdot.ragged_dot_general(lhs, rhs, g1, dn),
      lax.ragged_dot_general(lhs, rhs, g1, dn), rtol=1e-6)


@pytest.mark.parametrize("a,b,pref,want", [
    (jnp.bfloat16, jnp.bfloat16, None, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32, None, jnp.float32),
    (jnp.float16, jnp.float16, jnp.float32, jnp.float32),
    (jnp.int8, jnp.int8, jnp.int32, jnp.int32),
])
def test_result_dtype_like_lax(a, b, pref, want):
  x = jnp.ones((6, 4), a)
  w = jnp.ones((2, 4, 3), b)
  gs = jnp.array([2, 3], jnp.int32)
  out = ragdot.ragged_dot(x, w, gs, preferred_element_type=pref)
  assert out.dtype == want == lax.ragged_dot(x, w, gs, preferred_element_type=pref).dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(lax.ragged_dot(x, w, gs, preferred_element_type=pref), np.float32))


def test_weak_typed_operand_keeps_its_dtype_like_lax():
  # An f32 array filled from a Python float is weakly typed: jnp's promotion
  # would give bf16 with a bf16 rhs, lax.ragged_dot (and ragdot) give f32.
  x = jnp.full((6, 4), 0.75)
  assert x.weak_type and x.dtype == jnp.float32
  w = jnp.asarray(np.linspace(-2, 2, 24).reshape(2, 4, 3), jnp.bfloat16)
  d = jnp.ones((6, 3), jnp.bfloat16)
  gs = jnp.array([2, 3], jnp.int32)
  want = lax.ragged_dot(x, w, gs)
  got = ragdot.ragged_dot(x, w, gs)
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-6)
  dn = lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])
  want_t = lax.ragged_dot_general(x, d, gs, dn)
  got_t = ragdot.ragged_dot_general(x, d, gs, dn)
  assert got_t.dtype == want_t.dtype == jnp.float32
  np.testing.assert_allclose(got_t, want_t, rtol=1e-6)


def test_negative_sizes_count_as_zero():
  x, w, _, _ = _inputs(2)
  gs = jnp.array([-3, 10, -1, 12], jnp.int32)
  got = ragdot.ragged_dot(x, w, gs, precision=HIGHEST)
  want = lax.ragged_dot(x, w, jnp.maximum(gs, 0), precision=HIGHEST)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_checked_mode_reports_negative_sizes_and_bad_offsets():
  x, w, _, _ = _inputs(3)
  ok = ragdot.checked(lambda gs: ragdot.ragged_dot(x, w, gs, checks=True))
  err, _ = jax.jit(ok)(jnp.array([1, 2, 3, 4], jnp.int32))
  err.throw()  # no error
  err, _ = jax.jit(ok)(jnp.array([1, -2, 3, 4], jnp.int32))
  with pytest.raises(Exception, match="negative"):
    err.throw()
  shard = ragdot.checked(lambda o: ragdot.ragged_dot(x, w[:2], jnp.array([1, 2, 3, 4]), group_offset=o, checks=True))
  err, _ = jax.jit(shard)(jnp.int32(2))
  err.throw()
  err, _ = jax.jit(shard)(jnp.int32(4))
  with pytest.raises(Exception, match="group_offset"):
    err.throw()


def test_traced_group_offset_under_jit_and_vmap_of_offsets():
  x, w, _, gs = _inputs(4)
  fn = jax.jit(lambda o: ragdot.ragged_dot(x, w[:2], gs, group_offset=o, precision=HIGHEST))
  for o in range(4):
    oracle.assert_close(fn(jnp.int32(o)), oracle.ref_ragged_dot(x, w[:2], gs, o), jnp.float32)


def test_no_dense_rewrite_temporaries():
  """The xla backend's compiled temp memory stays O(m*k + g*k*n + m*n)."""
  m, k, n, g = 2048, 128, 128, 64
  x = jax.ShapeDtypeStruct((m, k), jnp.float32)
  w = jax.ShapeDtypeStruct((g, k, n), jnp.float32)
  gs = jax.ShapeDtypeStruct((g,), jnp.int32)
  fn = lambda x, w, gs: ragdot.ragged_dot(x, w, gs, implementation="xla")
  temp = jax.jit(fn).lower(x, w, gs).compile().memory_analysis().temp_size_in_bytes
  io_bytes = 4 * (m * k + g * k * n + m * n)
  dense_rewrite = 4 * g * m * n  # what a per-group dense product would hold
  assert temp <= io_bytes, (temp, io_bytes)
  assert temp < dense_rewrite / 8


@pytest.mark.parametrize("name", ["ragged_dot", "ragged_dot_general"])
def test_signature_is_a_drop_in_for_lax(name):
  """Every parameter of jax.lax's op, at the same position and of the same kind,
  so that calls written for lax (positional or keyword) run unchanged."""
  import inspect  # pylint: disable=g-import-not-at-top
  theirs = list(inspect.signature(getattr(jax.lax, name)).parameters.values())
  ours = list(inspect.signature(getattr(ragdot, name)).parameters.values())
  assert [(p.name, p.kind) for p in ours[:len(theirs)]] == [(p.name, p.kind) for p in theirs]
  assert all(p.kind == p.KEYWORD_ONLY for p in ours[len(theirs):])


def _count_traces(monkeypatch, impl: str, op: str) -> list[int]:
  """Counts the traces of backend ``impl``'s ``op`` from now on (fresh compiled-call cache)."""
  from ragdot import api  # pylint: disable=import-outside-toplevel
  from ragdot.backends import get_backend  # pylint: disable=import-outside-toplevel
  backend = get_backend(impl)
  inner = getattr(backend, op)
  traces = []

  def counting(**kwargs):
    traces.append(1)
    return inner(**kwargs)
  monkeypatch.setattr(backend, op, counting)
  api._compiled.cache_clear()  # pylint: disable=protected-access
  return traces


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_eager_calls_trace_each_kernel_once(monkeypatch, impl):
  # Op by op a kernel call lowered and compiled its kernels on every call (0.56 s a
  # call for the Mosaic forward on the H200, 49a); now one compiled program per choice.
  x, w, d, gs = _inputs(2)
  fwd = _count_traces(monkeypatch, impl, "gmm")
  dw = _count_traces(monkeypatch, impl, "tgmm")
  # A process's first kernel imports modules that add a config option to JAX's
  # tracing context, so the second call of all may trace again; later ones must not.
  for _ in range(2):
    ragdot.ragged_dot(x, w, gs, implementation=impl)
    ragdot.trans_ragged_dot(x, d, gs, implementation=impl)
  fwd.clear()
  dw.clear()
  outs = [ragdot.ragged_dot(x, w, gs, implementation=impl) for _ in range(3)]
  grads = [ragdot.trans_ragged_dot(x, d, gs, implementation=impl) for _ in range(2)]
  assert (len(fwd), len(dw)) == (0, 0)
  np.testing.assert_array_equal(outs[0], outs[2])
  np.testing.assert_array_equal(grads[0], grads[1])
  # Other shapes, static arguments or a group_offset are programs of their own.
  ragdot.ragged_dot(x[:20], w, gs, implementation=impl)
  ragdot.ragged_dot(x, w, gs, implementation=impl, preferred_element_type=jnp.bfloat16)
  ragdot.ragged_dot(x, w[:2], gs, group_offset=jnp.int32(1), implementation=impl)
  assert len(fwd) == 3


def test_refused_automatic_choice_falls_back_and_is_not_retried_eagerly(monkeypatch):
  """An automatic choice whose kernel refuses the call (NotImplementedError
  while tracing) falls back to XLA on the CPU, eagerly and under jit.  Eager
  calls remember the refusal: the refused kernel is traced once, not on every
  call (each eager call traced it again before)."""
  from ragdot import api, dispatch  # pylint: disable=import-outside-toplevel
  x, w, _, gs = _inputs(5)
  want = ragdot.ragged_dot(x, w, gs, implementation="xla")
  monkeypatch.setattr(dispatch, "choose", lambda op, implementation, **facts: dispatch.Choice(
      "triton", automatic=implementation is None))
  traces = []

  def refusing(**kwargs):
    traces.append(kwargs)
    raise NotImplementedError("refused for the test")
  monkeypatch.setattr(ragdot.backends.get_backend("triton"), "gmm", refusing)
  api._compiled.cache_clear()  # pylint: disable=protected-access
  api._REFUSED.clear()  # pylint: disable=protected-access
  outs = [ragdot.ragged_dot(x, w, gs) for _ in range(3)]
  assert len(traces) == 1
  for out in outs:
    np.testing.assert_array_equal(out, want)
  np.testing.assert_array_equal(jax.jit(lambda x, w: ragdot.ragged_dot(x, w, gs))(x, w), want)
  with pytest.raises(NotImplementedError, match="refused for the test"):
    ragdot.ragged_dot(x, w, gs, implementation="triton")  # a chosen backend is not replaced
  api._REFUSED.clear()  # pylint: disable=protected-access


def test_eager_call_equals_the_jitted_call_bitwise():
  x, w, d, gs = _inputs(3)
  for f in (lambda x, w, d, gs: ragdot.ragged_dot(x, w, gs, implementation="triton"),
            lambda x, w, d, gs: ragdot.trans_ragged_dot(x, d, gs, implementation="triton"),
            lambda x, w, d, gs: jax.grad(lambda x, w: ragdot.ragged_dot(
                x, w, gs, implementation="triton").sum(), (0, 1))(x, w)):
    for got, want in zip(jax.tree.leaves(f(x, w, d, gs)), jax.tree.leaves(jax.jit(f)(x, w, d, gs))):
      np.testing.assert_array_equal(got, want)
