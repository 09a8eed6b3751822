"""Operands split over explicit mesh axes: the ops run per shard (``ragdot.sharded``).

jax.lax.ragged_dot under explicit sharding needs ``out_sharding`` and (on CPU)
fails on row-split operands; ragdot infers the result's split, computes only
each device's block, and matches the unsharded op.  Kernels in interpret mode
do not run under shard_map, so these run the xla backend; the kernels' sm90
lowering of the same calls is in test_mosaic_shard_map.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import ragdot
from ragdot import sharded

from split_cases import G, HIGHEST, K, M, N, SIZES
from split_cases import collectives as _collectives
from split_cases import operands as _operands
import split_cases


def _mesh():
  return split_cases.mesh(AxisType.Explicit)


def _spec(x):
  return tuple(jax.typeof(x).sharding.spec) + (None,) * (jnp.ndim(x) - len(jax.typeof(x).sharding.spec))


GMM_CASES = split_cases.GMM_CASES + [
    (P("dp"), P("dp"), (("dp",), None), {"all-gather"}),  # dp taken by the rows: rhs gathered
]


@pytest.mark.parametrize("lspec,rspec,ospec,colls", GMM_CASES, ids=lambda c: str(c))
def test_ragged_dot_per_shard_matches_unsharded(lspec, rspec, ospec, colls):
  x, w, d = _operands()
  want = ragdot.ragged_dot(x, w, SIZES, precision=HIGHEST, implementation="xla")
  loss = lambda f: lambda x, w: jnp.sum(f(x, w) * d)
  call = lambda x, w: ragdot.ragged_dot(x, w, jnp.asarray(SIZES), precision=HIGHEST,
                                        implementation="xla")
  want_grads = jax.grad(loss(call), (0, 1))(x, w)
  with jax.set_mesh(_mesh()):
    xs, ws = jax.device_put(x, lspec), jax.device_put(w, rspec)
    out = jax.jit(call)(xs, ws)
    grads = jax.jit(jax.grad(loss(call), (0, 1)))(xs, ws)
    found = set(_collectives(call, xs, ws))
  norm = lambda s: tuple(None if e is None else (e,) if isinstance(e, str) else tuple(e) for e in s)
  assert norm(_spec(out)) == ospec
  assert found <= colls, found
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[SIZES.sum():] == 0)
  for got, exp in zip(grads, want_grads):
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-4)
  assert _spec(grads[0]) == _spec(xs) or lspec == P(None, "ep")


def test_rows_split_run_each_shard_on_its_rows_only():
  x, w, _ = _operands(1)
  with jax.set_mesh(_mesh()):
    xs = jax.device_put(x, P(("dp", "ep")))
    hlo = jax.jit(lambda x, w: ragdot.ragged_dot(x, w, jnp.asarray(SIZES), implementation="xla")
                  ).lower(xs, w).compile().as_text()
  dims = {int(r) for r in re.findall(rf"f32\[(\d+),{K}\]", hlo)}
  assert M not in dims and M // 8 in dims, dims


def test_shard_sizes_cut_the_groups_at_each_shards_rows():
  sizes = jnp.asarray([5, -2, 0, 9, 3, 100])
  got = [np.asarray(sharded.shard_sizes(sizes, jnp.asarray(s), 4, 20)) for s in (0, 4, 8, 12, 16)]
  np.testing.assert_array_equal(got, [[4, 0, 0, 0, 0, 0], [1, 0, 0, 3, 0, 0],
                                      [0, 0, 0, 4, 0, 0], [0, 0, 0, 2, 2, 0],
                                      [0, 0, 0, 0, 1, 3]])
  # sizes whose sum overflows int32: the ends saturate at m
  big = jnp.asarray([10, 2**31 - 1, 2**31 - 1, 3], jnp.int32)
  got = [np.asarray(sharded.shard_sizes(big, jnp.asarray(s), 8, 64)) for s in range(0, 64, 8)]
  np.testing.assert_array_equal(np.sum(got, 0), [10, 54, 0, 0])
  np.testing.assert_array_equal(got[1], [2, 6, 0, 0])


def test_group_offset_with_experts_split():
  """rhs holds groups 4..7 (group_offset 4), one per "ep" shard."""
  x, w, _ = _operands(2)
  want = ragdot.ragged_dot(x, w[4:], SIZES, precision=HIGHEST, group_offset=jnp.asarray(4),
                           implementation="xla")
  with jax.set_mesh(_mesh()):
    ws = jax.device_put(w[4:], P("ep"))
    out = jax.jit(lambda x, w: ragdot.ragged_dot(
        x, w, jnp.asarray(SIZES), precision=HIGHEST, group_offset=jnp.asarray(4),
        implementation="xla"))(jax.device_put(x, P("dp")), ws)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[:SIZES[:4].sum()] == 0)


@pytest.mark.parametrize("lspec,dspec,ospec", [
    (P("dp"), P("dp"), (None, None, None)),  # rows: per-shard sums, psum over dp
    (P(None, "ep"), P(), (None, "ep", None)),
    (P("dp"), P("dp", "ep"), (None, None, "ep")),
], ids=str)
def test_trans_ragged_dot_per_shard_matches_unsharded(lspec, dspec, ospec):
  x, _, d = _operands(3)
  want = ragdot.trans_ragged_dot(x, d, SIZES, precision=HIGHEST, implementation="xla")
  with jax.set_mesh(_mesh()):
    out = jax.jit(lambda x, d: ragdot.trans_ragged_dot(
        x, d, jnp.asarray(SIZES), precision=HIGHEST, implementation="xla"))(
            jax.device_put(x, lspec), jax.device_put(d, dspec))
  assert _spec(out) == ospec
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
  assert np.all(np.asarray(out)[1] == 0)  # the empty group


def test_general_modes_and_out_sharding():
  x, w, d = _operands(4)
  dn_nk = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
  dn_dw = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [1], [])
  wt = np.swapaxes(w, 1, 2)
  want_nk = ragdot.ragged_dot(x, w, SIZES, precision=HIGHEST, implementation="xla")
  want_dw = ragdot.trans_ragged_dot(x, d, SIZES, precision=HIGHEST, implementation="xla")
  with jax.set_mesh(_mesh()):
    gs = jnp.asarray(SIZES)
    nk = jax.jit(lambda x, w: ragdot.ragged_dot_general(
        x, w, gs, dn_nk, precision=HIGHEST, implementation="xla"))(
            jax.device_put(x, P("dp")), jax.device_put(wt, P(None, "ep")))
    dw = jax.jit(lambda x, d: ragdot.ragged_dot_general(
        x.T, d.T, gs, dn_dw, precision=HIGHEST, implementation="xla"))(
            jax.device_put(x, P("dp")), jax.device_put(d, P("dp")))
    moved = jax.jit(lambda x, w: ragdot.ragged_dot(
        x, w, gs, precision=HIGHEST, implementation="xla", out_sharding=P(None, "ep")))(
            jax.device_put(x, P("dp")), w)
    named = jax.jit(lambda x, w: ragdot.ragged_dot(
        x, w, gs, None, None, None, NamedSharding(_mesh(), P("ep")), implementation="xla"))(x, w)
  assert _spec(nk) == ("dp", "ep")
  np.testing.assert_allclose(nk, want_nk, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-4)
  assert _spec(moved) == (None, "ep") and _spec(named) == ("ep", None)
  np.testing.assert_allclose(moved, want_nk, rtol=1e-5, atol=1e-5)


def test_vmap_over_row_split_operands():
  x, w, _ = _operands(5)
  xb = np.stack([x, -x])
  want = np.stack([ragdot.ragged_dot(v, w, SIZES, precision=HIGHEST, implementation="xla")
                   for v in xb])
  with jax.set_mesh(_mesh()):
    out = jax.jit(jax.vmap(lambda x: ragdot.ragged_dot(
        x, w, jnp.asarray(SIZES), precision=HIGHEST, implementation="xla")))(
            jax.device_put(xb, P(None, "dp")))
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_spec, w_spec", [
    (P("a"), P("b")), (P("a"), P(None, None, "b")), (P("a", "b"), P())])
def test_gradient_of_a_vmap_split_over_two_axes(x_spec, w_spec):
  # The batch over "a", another dim over "b": vmap reaches the per-shard body,
  # manual over "b", with the batch still split over "a" (a second shard_map
  # nested there failed to lower its transpose).
  x, w, _ = _operands(8)
  xb = np.stack([x, -2 * x])
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[:8],
                       axis_types=(AxisType.Explicit,) * 2)
  f = lambda x, w: ragdot.ragged_dot(x, w, jnp.asarray(SIZES), precision=HIGHEST,
                                     implementation="xla")
  loss = lambda xb, w: jnp.sum(jax.vmap(f, (0, None))(xb, w) ** 2)
  want = jax.grad(loss, (0, 1))(xb, w)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss, (0, 1)))(jax.device_put(xb, x_spec), jax.device_put(w, w_spec))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


def test_bad_out_sharding_is_named():
  x, w, _ = _operands(6)
  with pytest.raises(TypeError, match="out_sharding must be"):
    ragdot.ragged_dot(x, w, SIZES, out_sharding="dp", implementation="xla")
  auto = jax.make_mesh((8,), ("dp",), devices=jax.devices()[:8], axis_types=(AxisType.Auto,))
  with pytest.raises(ValueError, match="out_sharding"):  # as lax: explicit axes only
    ragdot.trans_ragged_dot(x, x, SIZES, implementation="xla",
                            out_sharding=NamedSharding(auto, P("dp")))


def test_eager_calls_and_a_shard_of_the_weight_gradient():
  """Eager calls (no jit), with and without a mesh context: before the per-shard
  path ran in a jit, the eager xla backend under shard_map crashed the process.
  trans_ragged_dot's shard (group_offset, num_groups) over row-split operands."""
  x, w, d = _operands(7)
  mesh = _mesh()
  xs = jax.device_put(x, NamedSharding(mesh, P("dp")))
  ws = jax.device_put(w, NamedSharding(mesh, P("ep")))
  want = ragdot.ragged_dot(x, w, SIZES, precision=HIGHEST, implementation="xla")
  eager = lambda: ragdot.ragged_dot(xs, ws, jnp.asarray(SIZES), precision=HIGHEST,
                                    implementation="xla")
  with jax.set_mesh(mesh):
    in_context = eager()
  before = sharded._gmm_fn.cache_info()  # pylint: disable=protected-access
  again = eager()
  after = sharded._gmm_fn.cache_info()  # pylint: disable=protected-access
  # the second eager call reuses the first one's jitted per-shard function
  assert after.hits == before.hits + 1 and after.misses == before.misses
  for out in (in_context, again):
    assert _spec(out) == ("dp", None)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  go = jnp.asarray(3)
  want_dw = ragdot.trans_ragged_dot(x, d, SIZES, group_offset=go, num_groups=4,
                                    precision=HIGHEST, implementation="xla")
  dw = jax.jit(lambda x, d: ragdot.trans_ragged_dot(
      x, d, jnp.asarray(SIZES), group_offset=go, num_groups=4, precision=HIGHEST,
      implementation="xla"))(xs, jax.device_put(d, NamedSharding(mesh, P("dp"))))
  assert dw.shape == (4, K, N)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-4)


def test_checked_calls_and_split_group_sizes():
  """``checks=True`` on split operands still reports bad sizes (checkify failed
  on them while the checks ran before the per-shard shard_map); group sizes
  split over an axis while lhs and rhs are whole take the per-shard path too."""
  x, w, _ = _operands(8)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P("dp"))
    for sizes, bad in [(SIZES, False), (np.where(np.arange(G) == 2, -1, SIZES), True)]:
      fn = jax.jit(ragdot.checked(lambda x, s: ragdot.ragged_dot(
          x, w, s, implementation="xla", checks=True)))
      err, out = fn(xs, jnp.asarray(sizes, jnp.int32))
      assert (err.get() is not None) == bad, err.get()
      assert _spec(out) == ("dp", None)
    gs = jax.device_put(jnp.asarray(SIZES), P("dp"))
    out = jax.jit(lambda x, w, s: ragdot.ragged_dot(x, w, s, precision=HIGHEST,
                                                   implementation="xla"))(x, w, gs)
  np.testing.assert_allclose(out, ragdot.ragged_dot(x, w, SIZES, precision=HIGHEST,
                                                    implementation="xla"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("types", ["explicit", "mixed"])
def test_operands_placed_whole_on_an_explicit_mesh_without_set_mesh(types):
  """Arrays placed unsplit (``P()``) on a mesh with explicit axes, called with no
  mesh set: every op and its gradient run (the backends' zeros used to live on
  no mesh: "dynamic_update_slice operand sharding must be equal to update
  sharding"); on a mixed mesh the operands may also be split over the
  automatic axis alone."""
  axis_types = (AxisType.Explicit,) * 2 if types == "explicit" else (
      AxisType.Explicit, AxisType.Auto)
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=axis_types)
  x, w, d = _operands()
  gs = jnp.asarray(SIZES)
  call = lambda x, w: ragdot.ragged_dot(x, w, gs, precision=HIGHEST, implementation="xla")
  trans = lambda x, d: ragdot.trans_ragged_dot(x, d, gs, precision=HIGHEST, implementation="xla")
  loss = lambda x, w: jnp.sum(call(x, w) * d)
  want, want_t = call(x, w), trans(x, d)
  want_grads = jax.grad(loss, (0, 1))(x, w)
  specs = [(P(), P())] + ([(P(None, "ep"), P(None, "ep"))] if types == "mixed" else [])
  for lspec, rspec in specs:
    xs = jax.device_put(x, NamedSharding(mesh, lspec))
    ws = jax.device_put(w, NamedSharding(mesh, rspec))
    ds = jax.device_put(d, NamedSharding(mesh, P()))
    np.testing.assert_allclose(jax.jit(call)(xs, ws), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(call(xs, ws), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(trans)(xs, ds), want_t, rtol=1e-5, atol=1e-5)
    for got, exp in zip(jax.jit(jax.grad(loss, (0, 1)))(xs, ws), want_grads):
      np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)
  # the kernels too (interpret mode): the operands' mesh is entered by the XLA
  # backend alone, so the custom partitioning of kernel calls stays on
  xs = jax.device_put(x, NamedSharding(mesh, specs[-1][0]))
  ws = jax.device_put(w, NamedSharding(mesh, specs[-1][1]))
  got = jax.jit(lambda x, w: ragdot.ragged_dot(x, w, gs, implementation="triton"))(xs, ws)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("types", ["explicit", "mixed-dp-explicit", "mixed-ep-explicit"])
def test_inside_a_shard_map_over_some_axes_with_operands_split_over_others(types):
  """ragdot inside a user's shard_map over "ep" (expert parallelism through
  group_offset) with the tokens still split over an explicit "dp", and inside
  one over "dp" with the contraction split over an explicit "ep": forward and
  gradients match the unsplit op (a nested per-shard shard_map failed to lower
  its transpose in jax 0.11.2; such calls now take their tangents through the
  op on gathered operands), and the forward gathers nothing."""
  axis_types = {"explicit": (AxisType.Explicit,) * 2,
                "mixed-dp-explicit": (AxisType.Explicit, AxisType.Auto),
                "mixed-ep-explicit": (AxisType.Auto, AxisType.Explicit)}[types]
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=axis_types)
  x, w, d = _operands()
  gs = jnp.asarray(SIZES)
  m = x.shape[0]
  want = ragdot.ragged_dot(x, w, gs, precision=HIGHEST, implementation="xla")
  want_grads = jax.grad(lambda x, w: jnp.sum(ragdot.ragged_dot(
      x, w, gs, precision=HIGHEST, implementation="xla") * d), (0, 1))(x, w)
  want_t = ragdot.trans_ragged_dot(x, d, gs, precision=HIGHEST, implementation="xla")

  def per_ep(x, w):
    off = jax.lax.axis_index("ep") * (G // 4)
    return jax.lax.psum(ragdot.ragged_dot(x, w, gs, precision=HIGHEST, group_offset=off,
                                          implementation="xla"), "ep")

  def per_ep_trans(x, d):
    off = jax.lax.axis_index("ep") * (G // 4)
    return ragdot.trans_ragged_dot(x, d, gs, precision=HIGHEST, group_offset=off,
                                   num_groups=G // 4, implementation="xla")

  def per_dp(x, w):
    rows = x.shape[0]
    local = sharded.shard_sizes(gs, jax.lax.axis_index("dp") * rows, rows, m)
    return ragdot.ragged_dot(x, w, local, precision=HIGHEST, implementation="xla")

  with jax.set_mesh(mesh):
    by_ep = jax.shard_map(per_ep, in_specs=(P(), P("ep")), out_specs=P(), axis_names={"ep"})
    by_ep_t = jax.shard_map(per_ep_trans, in_specs=(P(), P()), out_specs=P("ep"),
                            axis_names={"ep"})
    by_dp = jax.shard_map(per_dp, in_specs=(P("dp"), P()), out_specs=P("dp"),
                          axis_names={"dp"})
    cases = [(by_ep, jax.device_put(x, P("dp")), jax.device_put(w, P("ep"))),
             (by_dp, jax.device_put(x, P("dp", "ep")), jax.device_put(w, P(None, "ep")))]
    for fn, xs, ws in cases:
      np.testing.assert_allclose(jax.jit(fn)(xs, ws), want, rtol=1e-5, atol=1e-5)
      # the forward still runs per shard: nothing gathered (only the psum's all-reduce;
      # rows over an automatic "dp" are XLA's to split, and it gathers them)
      if types != "mixed-ep-explicit":
        assert set(_collectives(fn, xs, ws)) <= {"all-reduce"}, _collectives(fn, xs, ws)
      grads = jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w) * d), (0, 1)))(xs, ws)
      for got, exp in zip(grads, want_grads):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)
    got_t = jax.jit(by_ep_t)(jax.device_put(x, P("dp")), jax.device_put(d, P("dp")))
    np.testing.assert_allclose(got_t, want_t, rtol=1e-5, atol=1e-5)
