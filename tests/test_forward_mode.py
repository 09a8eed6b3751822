"""Forward-mode autodiff (jvp, linearize, jacfwd, hessian) and vmap of the ops.

The ops are primitives with JVP, transpose and batching rules
(``ragdot.primitives``): forward mode, reverse mode and any mix of the two run
on the kernels, and each rule is checked here against the f32 oracle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
import ragdot
from impls import CONTRACT

HIGHEST = jax.lax.Precision.HIGHEST

# (m, sizes, offset, num_local)
CASES = [
    (24, [5, 0, 11, 6], None, 4),    # sum < m, an empty group
    (24, [9, 9, 9, 9], None, 4),     # sum > m
    (24, [5, 7, 0, 12], 1, 2),       # middle shard
]


def _dims(impl):
  return (8, 16) if impl == "xla" else (64, 64)


def _inputs(impl, key, shapes):
  dtype = CONTRACT[impl].dtypes[0]
  return [a.astype(dtype) for a in oracle.random_inputs(key, shapes, jnp.float32)], dtype


def _f32(*xs):
  return [x.astype(jnp.float32) for x in xs]


@pytest.mark.parametrize("impl", sorted(CONTRACT))
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_ragged_dot_jvp_matches_the_oracle(impl, transpose_rhs, case):
  m, sizes, offset, num_local = case
  k, n = _dims(impl)
  rhs_shape = (num_local, n, k) if transpose_rhs else (num_local, k, n)
  (x, w, tx, tw), dtype = _inputs(impl, jax.random.key(m + 5 * transpose_rhs + (offset or 0)),
                                  [(m, k), rhs_shape, (m, k), rhs_shape])
  gs = jnp.asarray(sizes, jnp.int32)
  go = None if offset is None else jnp.int32(offset)
  dn = ragdot.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [2 if transpose_rhs else 1]), ([], [])),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

  def fn(x, w):
    return ragdot.ragged_dot_general(x, w, gs, dn, precision=HIGHEST,
                                     preferred_element_type=jnp.float32,
                                     group_offset=go, implementation=impl)

  def ref(x, w):
    return oracle.ref_ragged_dot(x, w, sizes, offset, transpose_rhs)

  out, tangent = jax.jit(lambda *a: jax.jvp(fn, a[:2], a[2:]))(x, w, tx, tw)
  want_out, want_tangent = jax.jvp(ref, _f32(x, w), _f32(tx, tw))
  oracle.assert_close(out, want_out, dtype, factor=2)
  oracle.assert_close(tangent, want_tangent, dtype, factor=2)
  # rows outside the shard: exactly 0 in the tangent too
  oracle.assert_zero_rows(tangent, sizes, offset, num_local)


@pytest.mark.parametrize("impl", sorted(CONTRACT))
@pytest.mark.parametrize("case", CASES)
def test_trans_ragged_dot_jvp_matches_the_oracle(impl, case):
  m, sizes, offset, num_local = case
  k, n = _dims(impl)
  count = None if offset is None else num_local
  (x, d, tx, td), dtype = _inputs(impl, jax.random.key(3 * m + (offset or 0)),
                                  [(m, k), (m, n), (m, k), (m, n)])
  gs = jnp.asarray(sizes, jnp.int32)
  go = None if offset is None else jnp.int32(offset)

  def fn(x, d):
    return ragdot.trans_ragged_dot(x, d, gs, group_offset=go, num_groups=count,
                                   precision=HIGHEST, preferred_element_type=jnp.float32,
                                   implementation=impl)

  def ref(x, d):
    return oracle.ref_trans_ragged_dot(x, d, sizes, offset, count)

  out, tangent = jax.jvp(fn, (x, d), (tx, td))
  want_out, want_tangent = jax.jvp(ref, _f32(x, d), _f32(tx, td))
  oracle.assert_close(out, want_out, dtype, factor=2)
  oracle.assert_close(tangent, want_tangent, dtype, factor=2)


def _count(jaxpr, name: str) -> int:
  return sum(1 for eqn in jaxpr.eqns if eqn.primitive.name == name)


def test_autodiff_runs_no_kernel_beyond_the_matmuls_it_needs():
  """Symbolic-zero tangents cost nothing: a jvp in one operand is one more
  forward; the gradient of both operands is forward, dX and dW; of lhs alone,
  forward and dX; of rhs alone, forward and dW."""
  x, w = jnp.ones((16, 8)), jnp.ones((3, 8, 4))
  gs = jnp.array([5, 0, 9], jnp.int32)
  f = lambda x, w: ragdot.ragged_dot(x, w, gs, implementation="xla")
  loss = lambda x, w: jnp.sum(f(x, w) ** 2)
  jvp_x = jax.make_jaxpr(lambda x, t: jax.jvp(lambda x: f(x, w), (x,), (t,)))(x, x)
  assert (_count(jvp_x, "ragdot_gmm"), _count(jvp_x, "ragdot_tgmm")) == (2, 0)
  for argnums, want in [((0, 1), (2, 1)), (0, (2, 0)), (1, (1, 1))]:
    grad = jax.make_jaxpr(jax.grad(loss, argnums))(x, w)
    assert (_count(grad, "ragdot_gmm"), _count(grad, "ragdot_tgmm")) == want, argnums


def _dense_ragged_dot(x, w, sizes):
  """f32 ``ragged_dot`` as a one-hot einsum (jacfwd needs vmap over any
  axis, which lax.ragged_dot lacks: 'vmap over any dim but 0 - NYI')."""
  grp = oracle.group_of_rows(sizes, x.shape[0])
  onehot = jnp.asarray(grp[None, :] == np.arange(w.shape[0])[:, None], jnp.float32)
  return jnp.einsum("gm,mk,gkn->mn", onehot, x, w, precision=HIGHEST)


def test_hessian_and_forward_over_reverse_match_a_dense_reference():
  m, k, n, sizes = 12, 3, 5, [4, 0, 6]
  x, w, c, v = oracle.random_inputs(jax.random.key(7), [(m, k), (3, k, n), (m, n), (3, k, n)],
                                    jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def loss(op):
    return lambda x, w: jnp.sum(jnp.tanh(op(x, w)) * c)

  ours = loss(lambda x, w: ragdot.ragged_dot(x, w, gs, precision=HIGHEST, implementation="xla"))
  ref = loss(lambda x, w: _dense_ragged_dot(x, w, sizes))
  for argnums in [0, 1, (0, 1)]:
    got, want = jax.hessian(ours, argnums)(x, w), jax.hessian(ref, argnums)(x, w)
    for g_, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g_, w_, rtol=1e-4, atol=1e-5)
  # Hessian-vector product, forward over reverse
  hvp = lambda f: jax.jvp(jax.grad(f, 1), (x, w), (jnp.zeros_like(x), v))[1]
  np.testing.assert_allclose(hvp(ours), hvp(ref), rtol=1e-4, atol=1e-5)


def test_linearize_and_its_transpose_match_jvp_and_vjp():
  x, w, tx, tw, ct = oracle.random_inputs(
      jax.random.key(2), [(16, 8), (3, 8, 4), (16, 8), (3, 8, 4), (16, 4)], jnp.float32)
  gs = jnp.array([5, 0, 9], jnp.int32)
  f = lambda x, w: ragdot.ragged_dot(x, w, gs, precision=HIGHEST, implementation="xla")
  out, f_lin = jax.linearize(f, x, w)
  _, tangent = jax.jvp(f, (x, w), (tx, tw))
  np.testing.assert_array_equal(f_lin(tx, tw), tangent)
  _, f_vjp = jax.vjp(f, x, w)
  transposed = jax.linear_transpose(f_lin, x, w)(ct)
  for a, b in zip(transposed, f_vjp(ct)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(out, f(x, w))


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_vmap_is_the_call_per_element_bitwise(impl):
  """Batched over lhs, rhs and group sizes (each alone and together): the
  batching rule maps the op over the batch, so each element is bitwise the
  unbatched call; so are gradients through vmap and vmap of gradients."""
  k, n = 8, 16
  xs, ws = oracle.random_inputs(jax.random.key(4), [(3, 24, k), (3, 2, k, n)], jnp.float32)
  gss = jnp.array([[5, 11], [0, 24], [9, 3]], jnp.int32)
  f = lambda x, w, gs: ragdot.ragged_dot(x, w, gs, precision=HIGHEST, implementation=impl)
  per_element = jnp.stack([f(xs[b], ws[b], gss[b]) for b in range(3)])
  np.testing.assert_array_equal(jax.vmap(f)(xs, ws, gss), per_element)
  np.testing.assert_array_equal(jax.vmap(f, (0, None, None))(xs, ws[0], gss[0]),
                                jnp.stack([f(xs[b], ws[0], gss[0]) for b in range(3)]))
  loss = lambda x, w, gs: jnp.sum(f(x, w, gs) ** 2)
  got = jax.grad(lambda xs, w: sum(jax.vmap(loss, (0, None, 0))(xs, w, gss)), (0, 1))(xs, ws[0])
  want = [jax.grad(loss, (0, 1))(xs[b], ws[0], gss[b]) for b in range(3)]
  np.testing.assert_array_equal(got[0], jnp.stack([g[0] for g in want]))
  np.testing.assert_allclose(got[1], sum(g[1] for g in want), rtol=1e-6)
  per_example = jax.vmap(jax.grad(loss, 1), (0, None, 0))(xs, ws[0], gss)
  np.testing.assert_array_equal(per_example, jnp.stack([g[1] for g in want]))


@pytest.mark.parametrize("ep", [None, 4])
def test_moe_block_jvp_matches_the_dense_reference(ep):
  """Forward mode through the whole MoE MLP (routing gathers, the three ragged
  matmuls, under expert parallelism the shard_map and its psum): the JVP in
  every parameter and the input equals the dense f32 reference's."""
  from ragdot.moe import functional as F  # pylint: disable=g-import-not-at-top
  from ragdot.moe.config import MoEConfig  # pylint: disable=g-import-not-at-top

  cfg = MoEConfig(hidden=32, intermediate=16, num_experts=8, top_k=2, implementation="xla")
  params = F.init_params(jax.random.key(0), cfg, jnp.float32)
  x = jax.random.normal(jax.random.key(1), (24, cfg.hidden), jnp.float32)
  leaves, tree = jax.tree.flatten((params, x))
  keys = jax.random.split(jax.random.key(2), len(leaves))
  tangents = jax.tree.unflatten(tree, [jax.random.normal(k_, a.shape, a.dtype)
                                       for k_, a in zip(keys, leaves)])
  mesh = None if ep is None else jax.make_mesh((ep,), ("ep",), devices=jax.devices()[:ep],
                                               axis_types=(jax.sharding.AxisType.Auto,))
  ours = lambda p, x: F.moe_mlp(p, x, cfg, mesh=mesh)
  ref = lambda p, x: F.reference_moe_mlp(p, x, cfg)
  with jax.default_matmul_precision("highest"):
    out, tangent = jax.jit(lambda a, t: jax.jvp(ours, a, t))((params, x), tangents)
    want_out, want_tangent = jax.jvp(ref, (params, x), tangents)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(tangent, want_tangent, rtol=1e-4, atol=1e-4)
  assert float(jnp.abs(tangent).max()) > 0.1  # not a trivially zero tangent


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_jvp_and_hvp_of_sharded_operands(axis_type):
  """Rows over "dp" and experts over "ep" of a 2 x 4 mesh: under explicit axes
  the tangent ops run per shard (``ragdot.sharded``), under automatic ones they
  are custom-partitioned like the forward; both equal the oracle."""
  m, k, n, sizes = 64, 8, 16, [10, 20, 0, 30]
  x, w, tx, tw = oracle.random_inputs(jax.random.key(6), [(m, k), (4, k, n), (m, k), (4, k, n)],
                                      jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  ref = lambda x, w: oracle.ref_ragged_dot(x, w, sizes)
  want = jax.jvp(ref, (x, w), (tx, tw))
  loss = lambda op: (lambda x, w: jnp.sum(jnp.tanh(op(x, w))))
  hvp = lambda op, *a: jax.jvp(jax.grad(loss(op), 1), a[:2], a[2:])[1]
  want_hvp = hvp(ref, x, w, tx, tw)
  kind = getattr(jax.sharding.AxisType, axis_type)
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(kind, kind))
  f = lambda x, w: ragdot.ragged_dot(x, w, gs, precision=HIGHEST, implementation="xla")
  with jax.set_mesh(mesh):
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    experts = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))
    args = [jax.device_put(a, s) for a, s in zip((x, w, tx, tw), (rows, experts) * 2)]
    out, tangent = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(*args)
    got_hvp = jax.jit(functools.partial(hvp, f))(*args)
  np.testing.assert_allclose(out, want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(tangent, want[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_hvp, want_hvp, rtol=1e-4, atol=1e-4)
  assert tangent.sharding.spec[0] == "dp"


def test_vmap_over_a_batch_split_over_explicit_axes():
  """lax.map cannot scan an axis split over explicit mesh axes; the batching
  rule then maps each device's own elements under shard_map: the result keeps
  the batch's split and equals the per-element calls, gradients too."""
  mesh = jax.make_mesh((2,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
  xs, w = oracle.random_inputs(jax.random.key(8), [(4, 24, 8), (2, 8, 16)], jnp.float32)
  gs = jnp.array([9, 11], jnp.int32)
  f = lambda x, w: ragdot.ragged_dot(x, w, gs, precision=HIGHEST, implementation="xla")
  loss = lambda xs, w: jnp.sum(jax.vmap(f, (0, None))(xs, w) ** 2)
  want = jnp.stack([f(x, w) for x in xs])
  want_grads = jax.grad(loss, (0, 1))(xs, w)
  with jax.set_mesh(mesh):
    xs_split = jax.device_put(xs, jax.sharding.PartitionSpec("dp"))
    for run in (jax.vmap(f, (0, None)), jax.jit(jax.vmap(f, (0, None)))):
      out = run(xs_split, w)
      assert jax.typeof(out).sharding.spec[0] == "dp"
      np.testing.assert_array_equal(out, want)
    grads = jax.jit(jax.grad(loss, (0, 1)))(xs_split, w)
  np.testing.assert_allclose(grads[0], want_grads[0], rtol=1e-6)
  np.testing.assert_allclose(grads[1], want_grads[1], rtol=1e-5)


def test_vmap_with_spmd_axis_name_maps_each_devices_elements():
  """vmap(spmd_axis_name=...) over an automatic mesh axis: each device loops
  over its own elements (a loop over the whole batch had XLA gather the batch
  onto every device); the result stays split, equal to the per-element calls,
  gradients and vmap of a gradient too."""
  mesh = jax.make_mesh((4,), ("s",), axis_types=(jax.sharding.AxisType.Auto,))
  xs, ws = oracle.random_inputs(jax.random.key(9), [(8, 24, 8), (8, 2, 8, 16)], jnp.float32)
  gs = jnp.array([9, 11], jnp.int32)
  f = lambda x, w: ragdot.ragged_dot(x, w, gs, precision=HIGHEST, implementation="xla")
  batched = jax.vmap(f, spmd_axis_name="s")
  loss = lambda xs, ws: jnp.sum(batched(xs, ws) ** 2)
  want = jnp.stack([f(x, w) for x, w in zip(xs, ws)])
  want_grads = [jnp.stack(g) for g in zip(*[
      jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), (0, 1))(x, w) for x, w in zip(xs, ws)])]
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("s"))
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, split) for a in (xs, ws)]
    run = jax.jit(batched)
    out = run(*args)
    hlo = run.lower(*args).compile().as_text()
    grads = jax.jit(jax.grad(loss, (0, 1)))(*args)
    per_element = jax.jit(jax.vmap(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), (0, 1)),
                                   spmd_axis_name="s"))(*args)
  assert out.sharding.spec[0] == "s"
  assert "all-gather" not in hlo
  np.testing.assert_array_equal(out, want)
  for got in (grads, per_element):
    for g, h in zip(got, want_grads):
      np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)


def test_nested_vmaps_with_spmd_axis_names():
  """An spmd vmap inside another (on another mesh axis), also under grad: the
  inner one loops over its batch (JAX cannot batch its shard_map over an
  automatic axis), the outer one splits; results as per-element calls."""
  mesh = jax.make_mesh((2, 4), ("a", "s"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  xs, w = oracle.random_inputs(jax.random.key(10), [(2, 4, 24, 8), (2, 8, 16)], jnp.float32)
  gs = jnp.array([9, 11], jnp.int32)
  f = lambda x: ragdot.ragged_dot(x, w, gs, precision=HIGHEST, implementation="xla")
  want = jnp.stack([jnp.stack([f(x) for x in row]) for row in xs])
  inner = lambda x: jnp.sum(jax.vmap(f, spmd_axis_name="s")(x) ** 2)
  want_grad = jnp.stack([jax.grad(lambda x: jnp.sum(jnp.stack([f(e) for e in x]) ** 2))(row)
                         for row in xs])
  with jax.set_mesh(mesh):
    for outer, inner_axis, a in (("a", "s", xs), ("s", "a", jnp.swapaxes(xs, 0, 1))):
      out = jax.jit(jax.vmap(jax.vmap(f, spmd_axis_name=inner_axis),
                             spmd_axis_name=outer))(a)
      np.testing.assert_allclose(out if outer == "a" else jnp.swapaxes(out, 0, 1), want,
                                 rtol=1e-5, atol=1e-5)
    got_grad = jax.jit(jax.vmap(jax.grad(inner), spmd_axis_name="a"))(xs)
  np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-4)
