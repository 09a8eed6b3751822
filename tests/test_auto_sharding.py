"""Operands split over automatic mesh axes: the ops are custom-partitioned
(``ragdot.auto_sharding``) and run on each device's block.

Before, XLA gathered the operands of the (opaque) kernels onto every device,
where ``jax.lax.ragged_dot`` keeps row-split operands split.  The xla backend
and the Pallas-Triton kernels (interpret mode) run per shard here; the Mosaic
GPU interpret mode has host callbacks that custom partitioning cannot carry,
so on a CPU it runs unpartitioned (correct, gathered).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import ragdot
from ragdot import auto_sharding

from split_cases import G, GMM_CASES, HIGHEST, K, M, N, SIZES, compiled as _compiled
from split_cases import operands as _operands
import split_cases


def _mesh():
  return split_cases.mesh(AxisType.Auto)


def _put(x, spec):
  return jax.device_put(x, NamedSharding(_mesh(), spec))


def _spec(x):
  spec = tuple(x.sharding.spec)
  spec += (None,) * (x.ndim - len(spec))
  return tuple(None if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec)


def _gmm(impl="xla"):
  return lambda x, w: ragdot.ragged_dot(x, w, jnp.asarray(SIZES), precision=HIGHEST,
                                        implementation=impl)


@pytest.mark.parametrize("lspec,rspec,ospec,colls", GMM_CASES, ids=lambda c: str(c))
def test_ragged_dot_per_shard_matches_unsharded(lspec, rspec, ospec, colls):
  x, w, d = _operands()
  call = _gmm()
  loss = lambda x, w: jnp.sum(call(x, w) * d)
  want, want_grads = call(x, w), jax.grad(loss, (0, 1))(x, w)
  xs, ws = _put(x, lspec), _put(w, rspec)
  out = jax.jit(call)(xs, ws)
  grads = jax.jit(jax.grad(loss, (0, 1)))(xs, ws)
  assert _spec(out) == ospec
  assert set(split_cases.collectives(call, xs, ws)) <= colls
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[SIZES.sum():] == 0)
  for got, exp in zip(grads, want_grads):
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-4)


def test_rows_split_compute_each_devices_rows_only_where_lax_does():
  """Before: lhs gathered to [M, K] on every device and a replicated result."""
  x, w, _ = _operands(1)
  xs = _put(x, P(("dp", "ep")))
  hlo = _compiled(_gmm(), xs, w)
  rows = {int(r) for r in re.findall(rf"f32\[(\d+),{K}\]", hlo)}
  assert M not in rows and M // 8 in rows, rows
  lax_out = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, jnp.asarray(SIZES)))(xs, w)
  assert _spec(jax.jit(_gmm())(xs, w)) == _spec(lax_out) == (("dp", "ep"), None)


def test_triton_kernels_run_per_shard():
  """The Pallas-Triton kernels (interpret mode) on each shard: forward, dX and
  dW against the unsharded call."""
  x, w, d = _operands(2)
  call = _gmm("triton")
  loss = lambda x, w: jnp.sum(call(x, w) * d)
  want, want_grads = call(x, w), jax.grad(loss, (0, 1))(x, w)
  xs, ws = _put(x, P("dp")), _put(w, P("ep"))
  out, grads = jax.jit(call)(xs, ws), jax.jit(jax.grad(loss, (0, 1)))(xs, ws)
  assert _spec(out) == (("dp",), None)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  for got, exp in zip(grads, want_grads):
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-4)


def test_mosaic_interpret_mode_runs_unpartitioned():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((G, K, 64)), jnp.bfloat16)  # the kernel's n: 64s
  call = lambda x, w: ragdot.ragged_dot(x, w, jnp.asarray(SIZES), implementation="mosaic")
  out = jax.jit(call)(_put(x, P("dp")), w)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(call(x, w), np.float32))


def test_weight_gradient_splits_rows_and_the_groups_its_use_asks_for():
  """An update ``w - lr * dW`` with w's experts over "ep" and the tokens over
  "dp": each device computes its 2 experts' dW over its rows (no [G, K, N]
  block), summed over "dp"; the update keeps w's split."""
  x, w, _ = _operands(4)
  loss = lambda w, x: jnp.sum(_gmm()(x, w) ** 2)
  step = lambda w, x: w - 0.01 * jax.grad(loss)(w, x)
  want = step(w, x)
  ws, xs = _put(w, P("ep")), _put(x, P("dp"))
  got = jax.jit(step)(ws, xs)
  hlo = _compiled(step, ws, xs)
  assert f"f32[{G // 4},{K},{N}]" in hlo and f"f32[{G},{K},{N}]" not in hlo
  assert _spec(got) == (("ep",), None, None)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_trans_ragged_dot_with_group_offset_and_split_columns():
  x, _, d = _operands(5)
  call = lambda x, d: ragdot.trans_ragged_dot(x, d, jnp.asarray(SIZES), precision=HIGHEST,
                                              group_offset=jnp.int32(2), num_groups=4,
                                              implementation="xla")
  want = call(x, d)
  got = jax.jit(call)(_put(x, P("dp")), _put(d, P(None, "ep")))
  assert _spec(got) == (None, None, ("ep",))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_group_offset_with_experts_split_and_rhs_laid_out_nk():
  x, w, _ = _operands(6)
  dn_nk = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
  wt = np.swapaxes(w[4:], 1, 2)
  call = lambda x, wt: ragdot.ragged_dot_general(
      x, wt, jnp.asarray(SIZES), dn_nk, precision=HIGHEST, group_offset=jnp.int32(4),
      implementation="xla")
  want = call(x, wt)
  got = jax.jit(call)(_put(x, P("dp")), _put(wt, P("ep")))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[:SIZES[:4].sum()] == 0)


def test_vmap_and_loops_over_split_operands():
  x, w, _ = _operands(7)
  xb = np.stack([x, -x])
  xbs, ws = _put(xb, P(None, "dp")), _put(w, P("ep"))
  out = jax.jit(jax.vmap(_gmm(), (0, None)))(xbs, ws)
  np.testing.assert_allclose(out[1], -np.asarray(_gmm()(x, w)), rtol=1e-5, atol=1e-5)
  # vmap loops over the unbatched op (lax.map), each element custom-partitioned
  # (before: a custom_vmap rule ran the plain call, which XLA cannot split when
  # it is a kernel), and every device computes its own rows.
  vmapped = jax.jit(jax.vmap(_gmm(), (0, None)))
  assert "CustomSPMDPartitioning" in vmapped.lower(xbs, ws).as_text()
  rows = {int(r) for r in re.findall(rf"f32\[(\d+),{K}\]", _compiled(vmapped, xbs, ws))}
  assert M not in rows and M // 2 in rows, rows
  grad_w = jax.jit(jax.vmap(jax.grad(lambda x, w: jnp.sum(_gmm()(x, w)), 1), (0, None)))(xbs, ws)
  np.testing.assert_allclose(grad_w[1], -grad_w[0], rtol=1e-5, atol=1e-5)

  def scanned(x, w):
    step = lambda c, _: (c, jnp.sum(jax.checkpoint(_gmm())(c, w) ** 2))
    return jnp.sum(jax.lax.scan(step, x, None, length=2)[1])
  got = jax.jit(jax.grad(scanned, (0, 1)))(_put(x, P("dp")), ws)
  for a, b in zip(got, jax.grad(scanned, (0, 1))(x, w)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3)


def test_inside_shard_map_over_some_axes():
  """Manual over "ep" (rhs's experts), automatic over "dp": the plain call."""
  x, w, _ = _operands(8)

  def per_ep(x, w):
    offset = jax.lax.axis_index("ep") * (G // 4)
    out = ragdot.ragged_dot(x, w, jnp.asarray(SIZES), precision=HIGHEST, group_offset=offset,
                            implementation="xla")
    return jax.lax.psum(out, "ep")
  fn = jax.jit(jax.shard_map(per_ep, mesh=_mesh(), in_specs=(P(), P("ep")), out_specs=P(),
                             axis_names={"ep"}))
  np.testing.assert_allclose(fn(_put(x, P("dp")), _put(w, P("ep"))), _gmm()(x, w),
                             rtol=1e-5, atol=1e-5)


def test_an_axis_on_both_rows_and_columns_follows_the_result():
  # Rows and rhs columns both over "a": Shardy gives this result the column
  # split (as for jax.lax.ragged_dot); the per-shard call must split columns
  # too, not rows (XLA then replicated the result to re-split it).
  rng = np.random.default_rng(11)
  x, w, d = (rng.standard_normal(s).astype(np.float32) for s in ((96, 32), (8, 32, 24), (96, 24)))
  sizes = jnp.asarray([10, 0, 13, 20, 7, 16, 9, 11], jnp.int32)
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[:8],
                       axis_types=(AxisType.Auto,) * 2)
  xs = jax.device_put(x, NamedSharding(mesh, P("a")))
  ws = jax.device_put(w, NamedSharding(mesh, P(None, None, "a")))
  call = lambda x, w: ragdot.ragged_dot(x, w, sizes, precision=HIGHEST, implementation="xla")
  out = jax.jit(call)(xs, ws)
  assert _spec(out) == (None, ("a",))
  assert split_cases.collectives(call, xs, ws) == ["all-gather"]  # lhs's rows only
  np.testing.assert_allclose(out, call(x, w), rtol=1e-5, atol=1e-5)
  loss = lambda x, w: jnp.sum(call(x, w) * d)
  for a, b in zip(jax.jit(jax.grad(loss, (0, 1)))(xs, ws), jax.grad(loss, (0, 1))(x, w)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_can_be_turned_off(monkeypatch):
  x, w, _ = _operands(9)
  xs = _put(x, P("dp"))
  for off in ("false", "Off", "no"):
    monkeypatch.setenv("RAGDOT_AUTO_PARTITION", off)
    assert not auto_sharding.enabled()
  monkeypatch.setenv("RAGDOT_AUTO_PARTITION", "1")
  assert auto_sharding.enabled()
  monkeypatch.setenv("RAGDOT_AUTO_PARTITION", "0")
  assert not auto_sharding.enabled()
  out = jax.jit(_gmm())(xs, w)
  assert _spec(out) == (None, None)
  np.testing.assert_allclose(out, _gmm()(x, w), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_mlp_keeps_the_weights_split():
  """Megatron-style expert MLP: w1's columns and w2's contraction split over
  "ep": partial products summed (one all-reduce of the [M/2, K] output per
  step, as XLA does for jax.lax.ragged_dot), no gather of a weight; the
  training step's values and the updated weights' split."""
  rng = np.random.default_rng(10)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w1 = rng.standard_normal((G, K, 128)).astype(np.float32) / 8
  w2 = rng.standard_normal((G, 128, K)).astype(np.float32) / 12
  gmm = lambda a, b: ragdot.ragged_dot(a, b, jnp.asarray(SIZES), precision=HIGHEST,
                                       implementation="xla")

  def step(w1, w2, x):
    loss = lambda w1, w2: jnp.sum(gmm(jax.nn.relu(gmm(x, w1)), w2) ** 2)
    value, (g1, g2) = jax.value_and_grad(loss, (0, 1))(w1, w2)
    return value, w1 - 1e-3 * g1, w2 - 1e-3 * g2
  args = (_put(w1, P(None, None, "ep")), _put(w2, P(None, "ep")), _put(x, P("dp")))
  got, want = jax.jit(step)(*args), step(w1, w2, x)
  hlo = _compiled(step, *args)
  assert "all-gather" not in hlo
  assert set(re.findall(r"= (f32\[[\d,]*\])\S* all-reduce", hlo)) <= {f"f32[{M // 2},{K}]", "f32[]"}
  assert _spec(got[1]) == (None, None, ("ep",)) and _spec(got[2]) == (None, ("ep",), None)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_rows_split_over_part_of_an_axis_are_gathered():
  """Micro-batches sliced from tokens split over "ep" reach the op split over
  part of "ep" (no whole-axis form): gathered, where JAX's own decoding of the
  sharding failed to compile before."""
  x, w, _ = _operands(11)
  sizes = jnp.asarray([10, 0, 5, 20, 7, 6, 9, 7], jnp.int32)
  call = lambda x, w: ragdot.ragged_dot(x.reshape(2, M // 2, K)[1], w, sizes,
                                        precision=HIGHEST, implementation="xla")
  np.testing.assert_allclose(jax.jit(call)(_put(x, P("ep")), w), call(x, w),
                             rtol=1e-5, atol=1e-5)


def test_export_and_eager_calls():
  """jax.export inlines the plain call (it cannot serialize the partitioner's
  callback); an eager call on split arrays runs jitted and keeps the split."""
  x, w, _ = _operands(12)
  xs, ws = _put(x, P("dp")), _put(w, P("ep"))
  types = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in (xs, ws)]
  exported = jax.export.export(jax.jit(_gmm()))(*types)
  np.testing.assert_allclose(exported.call(xs, ws), _gmm()(x, w), rtol=1e-5, atol=1e-5)
  eager = _gmm()(xs, ws)
  assert _spec(eager) == (("dp",), None)
  np.testing.assert_allclose(eager, _gmm()(x, w), rtol=1e-5, atol=1e-5)
