"""jax.export with a symbolic row count (a MoE layer exported for any token
count): the calls run the XLA backend's lax form and agree with the oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import oracle
import ragdot

HIGHEST = jax.lax.Precision.HIGHEST
K, N, SIZES = 16, 24, [5, 0, 9, 4]  # 18 rows in groups; calls get 23 (5 past the sum)
(M,) = export.symbolic_shape("m")


def _spec(*shapes, dtype=jnp.float32):
  return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


def _poisoned(x, sizes, offset, num_local):
  """x with NaN in every row outside the shard (none may reach the result)."""
  keep = oracle._local_mask(sizes, x.shape[0], offset or 0, num_local)  # pylint: disable=protected-access
  return jnp.where(keep[:, None], x, jnp.nan)


@pytest.mark.parametrize("offset,num_local", [(None, 4), (1, 2), (-1, 2), (3, 2), (4, 1)])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_exported_forward_matches_oracle(offset, num_local, transpose_rhs):
  x, w = oracle.random_inputs(jax.random.key(11 + num_local),
                              [(23, K), (num_local, N, K) if transpose_rhs else (num_local, K, N)],
                              jnp.float32)
  gs = jnp.asarray(SIZES, jnp.int32)
  dn = ragdot.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [2 if transpose_rhs else 1]), ([], [])),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
  go = None if offset is None else jnp.int32(offset)

  def f(x, w, gs):
    return ragdot.ragged_dot_general(x, w, gs, dn, precision=HIGHEST, group_offset=go)

  exp = export.export(jax.jit(f))(*_spec((M, K), w.shape), jax.ShapeDtypeStruct((4,), jnp.int32))
  for rows in (23, 7):  # one export, two token counts
    xr = _poisoned(x[:rows], SIZES, offset, num_local)
    out = exp.call(xr, w, gs)
    assert out.shape == (rows, N)
    ref = oracle.ref_ragged_dot(x[:rows], w, SIZES, offset, transpose_rhs)
    oracle.assert_close(out, ref, jnp.float32)
    oracle.assert_zero_rows(out, SIZES, offset, num_local)


def test_exported_gradients_match_unexported():
  x, w, c = oracle.random_inputs(jax.random.key(5), [(23, K), (2, K, N), (23, N)], jnp.float32)
  gs = jnp.asarray(SIZES, jnp.int32)

  def loss(x, w, c):
    out = ragdot.ragged_dot(x, w, gs, precision=HIGHEST, group_offset=jnp.int32(2))
    return jnp.sum(out * c)

  grads = jax.jit(jax.grad(loss, (0, 1)))
  exp = export.export(grads)(*_spec((M, K), (2, K, N), (M, N)))
  for got, want in zip(exp.call(x, w, c), grads(x, w, c)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("offset,num_groups", [(None, None), (1, 2), (3, 2)])
def test_exported_trans_ragged_dot_matches_oracle(offset, num_groups):
  x, dy = oracle.random_inputs(jax.random.key(3), [(23, K), (23, N)], jnp.float32)
  gs = jnp.asarray(SIZES, jnp.int32)
  go = None if offset is None else jnp.int32(offset)

  def f(x, dy):
    return ragdot.trans_ragged_dot(x, dy, gs, group_offset=go, num_groups=num_groups,
                                   precision=HIGHEST)

  exp = export.export(jax.jit(f))(*_spec((M, K), (M, N)))
  local = num_groups or len(SIZES)
  keep = oracle._local_mask(SIZES, 23, offset or 0, local)  # pylint: disable=protected-access
  out = exp.call(jnp.where(keep[:, None], x, jnp.inf), jnp.where(keep[:, None], dy, jnp.nan))
  oracle.assert_close(out, oracle.ref_trans_ragged_dot(x, dy, SIZES, offset, num_groups),
                      jnp.float32)


def test_exported_scaled_fp8_weights():
  x, w = oracle.random_inputs(jax.random.key(8), [(23, K), (4, K, N)], jnp.float32)
  wq, scale = ragdot.scales.quantize(w, block=(8, 8))
  gs = jnp.asarray(SIZES, jnp.int32)

  def f(x):
    return ragdot.ragged_dot(x.astype(jnp.bfloat16), wq, gs, rhs_scale=scale,
                             preferred_element_type=jnp.float32)

  exp = export.export(jax.jit(f))(*_spec((M, K)))
  np.testing.assert_allclose(exp.call(x), f(x), rtol=1e-5, atol=1e-5)  # (summed in another order)


def test_kernels_refuse_symbolic_shapes():
  w = jnp.ones((4, K, N), jnp.bfloat16)
  gs = jnp.asarray(SIZES, jnp.int32)
  for impl in ("mosaic", "triton"):
    f = lambda x, impl=impl: ragdot.ragged_dot(x, w, gs, implementation=impl)
    with pytest.raises(NotImplementedError, match="concrete shapes"):
      export.export(jax.jit(f))(*_spec((M, K), dtype=jnp.bfloat16))


def test_exported_moe_layer_takes_any_token_count():
  from ragdot.moe import MoEConfig, init_params, moe_mlp  # pylint: disable=g-import-not-at-top
  cfg = MoEConfig(hidden=32, intermediate=16, num_experts=4, top_k=2)
  params = init_params(jax.random.key(0), cfg, jnp.float32)
  (tokens,) = export.symbolic_shape("t")
  layer = jax.jit(lambda x: moe_mlp(params, x, cfg))
  exp = export.export(layer)(jax.ShapeDtypeStruct((tokens, 32), jnp.float32))
  for rows in (5, 12):
    x = jax.random.normal(jax.random.key(rows), (rows, 32))
    np.testing.assert_allclose(exp.call(x), layer(x), rtol=1e-5, atol=1e-5)
  grad = jax.jit(jax.grad(lambda p, x: moe_mlp(p, x, cfg).sum()))
  spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
  exp = export.export(grad)(spec, jax.ShapeDtypeStruct((tokens, 32), jnp.float32))
  x = jax.random.normal(jax.random.key(3), (7, 32))
  for got, want in zip(jax.tree.leaves(exp.call(params, x)), jax.tree.leaves(grad(params, x))):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def pretend_h200(monkeypatch):
  """The dispatcher believes it runs on an H200: automatic calls trace
  compiled GPU kernels (which cannot lower for this CPU)."""
  from ragdot import dispatch  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(dispatch, "current_device",
                      lambda: dispatch.Device("gpu", "NVIDIA H200", "9.0"))
  dispatch.clear_cache()
  yield
  dispatch.clear_cache()


@pytest.mark.parametrize("platforms", [("cpu",), ("cpu", "cuda")])
def test_export_of_concrete_shapes_lowers_the_portable_form(pretend_h200, platforms):
  """An automatic call's exported artifact holds the XLA form, not the kernels
  the exporting host chose: it serializes, and runs on this CPU (and would on
  any GPU).  Its forward, dX and dW (through jax.grad), with a shard."""
  del pretend_h200
  x, w = oracle.random_inputs(jax.random.key(3), [(23, K), (3, K, N)], jnp.bfloat16)
  gs = jnp.asarray(SIZES, jnp.int32)

  def f(x, w):
    return ragdot.ragged_dot(x, w, gs, group_offset=jnp.int32(1))

  from ragdot import dispatch  # pylint: disable=g-import-not-at-top
  assert dispatch.choose("gmm", None, **dispatch.facts(
      "gmm", lhs=x, rhs=w, group_sizes=gs, group_offset=jnp.int32(1))).implementation in ("mosaic", "triton")
  with pytest.raises(Exception):  # the kernel (compiled, for a GPU) does not lower here
    jax.jit(f).lower(x, w).compile()
  def loss(impl):
    return lambda x, w: jnp.sum(ragdot.ragged_dot(
        x, w, gs, group_offset=jnp.int32(1), implementation=impl).astype(jnp.float32) ** 2)

  for fn, want in ((f, None), (jax.grad(loss(None), argnums=(0, 1)),
                               jax.grad(loss("xla"), argnums=(0, 1))(x, w))):
    exp = export.deserialize(export.export(jax.jit(fn), platforms=platforms)(x, w).serialize())
    got = exp.call(x, w)
    if want is None:
      oracle.assert_close(got, oracle.ref_ragged_dot(x, w, SIZES, 1, False), jnp.bfloat16)
      oracle.assert_zero_rows(got, SIZES, 1, 3)
    else:
      for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


_SYMBOLIC_EXPLICIT = """
import jax, jax.numpy as jnp, numpy as np
from jax import export
from jax.sharding import AxisType, PartitionSpec as P
import ragdot
mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(AxisType.Explicit,) * 2)
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 32), np.float32)
w = rng.standard_normal((8, 32, 16), np.float32)
gs = jnp.asarray([8, 0, 12, 4, 16, 8, 0, 10], jnp.int32)
f = lambda x, w: ragdot.ragged_dot(x, w, gs, implementation="xla")
want = jax.lax.ragged_dot(x, w, gs, precision="highest")
(m,) = export.symbolic_shape("m")
xs = jax.device_put(x, jax.NamedSharding(mesh, P(None, "ep")))
ws = jax.device_put(w, jax.NamedSharding(mesh, P(None, "ep")))
args = (jax.ShapeDtypeStruct((m, 32), jnp.float32, sharding=xs.sharding),
        jax.ShapeDtypeStruct(w.shape, jnp.float32, sharding=ws.sharding))
# no mesh set: exports and runs
out = export.export(jax.jit(f))(*args).call(xs, ws)
np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)
with jax.set_mesh(mesh):
  exp = export.export(jax.jit(f))(*args)
  try:
    out = exp.call(xs, ws)
  except ValueError as e:  # as a plain jnp.dot's export fails here (jax 0.11.2)
    print("refused:", str(e)[:80])
  else:
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)
    print("ran")
"""


def test_symbolic_export_of_operands_split_over_explicit_axes_does_not_crash():
  """A symbolic-shape export of a call whose contraction is split over
  explicit axes: calling it crashed the process (segfault: the per-shard
  shard_map with symbolic shapes).  Such calls now run on gathered operands,
  so the call returns the product or raises ValueError as jax 0.11.2 does for
  any symbolic export under an explicit mesh, a plain ``jnp.dot``'s too.
  With no mesh set the export runs and matches."""
  import os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", _SYMBOLIC_EXPLICIT], env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.startswith(("ran", "refused:")), done.stdout


def test_exported_kernel_call_is_traced_again_while_exporting(pretend_h200, monkeypatch):
  """An explicit Mosaic call, exported for CUDA: its kernel is traced again
  with ``exporting()`` true, so that its schedule is built by XLA ops (the
  GPU's Pallas-Triton schedule kernels do not export).  custom_partitioning
  caches its trace per function, so the partitioned call would reuse the
  bind's trace, built for the GPU (test_gpu's export_for_cuda[mosaic], 66a)."""
  del pretend_h200
  from ragdot import backends  # pylint: disable=g-import-not-at-top
  from ragdot import traced_primitive  # pylint: disable=g-import-not-at-top
  seen = []
  kernels = backends.schedule_kernels

  def spy(interpret):
    seen.append(traced_primitive.exporting())
    return kernels(interpret)

  monkeypatch.setattr(backends, "schedule_kernels", spy)
  x, w = oracle.random_inputs(jax.random.key(4), [(256, 64), (3, 64, 128)], jnp.bfloat16)
  gs = jnp.asarray([70, 0, 130], jnp.int32)
  f = lambda x, w: ragdot.ragged_dot(x, w, gs, group_offset=jnp.int32(1),
                                     implementation="mosaic")
  exp = export.export(jax.jit(f), platforms=("cuda",))(x, w)
  assert "mosaic_gpu" in exp.mlir_module()
  assert seen and not seen[0] and seen[-1], seen  # the bind's trace, then the export's
