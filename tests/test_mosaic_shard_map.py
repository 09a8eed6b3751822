"""The Mosaic kernels trace and lower for sm90 inside shard_map (expert parallelism).

Inside shard_map the kernels' inputs and outputs must carry the mesh axes the
operands vary over; this checks the whole EP pattern lowers on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from ragdot.backends import mosaic_dw, mosaic_fwd


def test_kernels_lower_for_sm90_inside_shard_map():
  mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))

  def shard(x, w, gs):
    offset = jax.lax.axis_index("ep") * 2
    y = mosaic_fwd.gmm(x, w, gs, offset, transpose_rhs=False, out_dtype=jnp.bfloat16,
                       precision=None, interpret=False)
    dw = mosaic_dw.tgmm(x, y, gs, offset, num_groups=2, out_dtype=jnp.bfloat16,
                        precision=None, interpret=False)
    return jax.lax.psum(y, "ep"), dw

  fn = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P(), P("ep"), P()),
                             out_specs=(P(), P("ep"))))
  args = (jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16),
          jax.ShapeDtypeStruct((16, 256, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((16,), jnp.int32))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 2


def _training_step(shard, mesh):
  """jit(value_and_grad) w.r.t. x and w of a loss through ``shard(x, w, gs)`` under
  shard_map: x and the group sizes replicated, w's experts split over "ep"."""
  layer = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P("ep"), P()), out_specs=P())
  loss = lambda x, w, gs: jnp.sum(layer(x, w, gs).astype(jnp.float32))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _operands(m: int, k: int, n: int, g: int):
  return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
          jax.ShapeDtypeStruct((g,), jnp.int32))


def test_vjp_through_kernels_traces_inside_shard_map():
  """The ops' cotangents keep the operands' shard_map axis types."""
  import ragdot  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))

  def shard(x, w, gs):
    offset = jax.lax.axis_index("ep") * w.shape[0]
    h = ragdot.ragged_dot(x, w, gs, group_offset=offset, implementation="mosaic")
    y = ragdot.ragged_dot(h, jnp.swapaxes(w, 1, 2), gs, group_offset=offset,
                          implementation="mosaic")
    return jax.lax.psum(y, "ep")

  jaxpr = _training_step(shard, mesh).trace(*_operands(512, 128, 128, 8)).jaxpr
  text = str(jaxpr)
  # Before the fix, tracing raised: the bwd rule returned non-varying cotangents.
  assert text.count("ragdot_gmm[") >= 4 and text.count("ragdot_tgmm[") >= 2


@pytest.fixture
def h200():
  """The dispatcher choosing as on an H200 (its table, compiled kernels)."""
  from ragdot import dispatch  # pylint: disable=g-import-not-at-top
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(dispatch, "current_device",
                  lambda: dispatch.Device("gpu", "NVIDIA H200", "9.0"))
    dispatch.clear_cache()
    try:
      yield
    finally:
      dispatch.clear_cache()


def _sharded_training_step(mesh):
  """jit(value_and_grad) of a loss through ``ragdot.ragged_dot`` (Mosaic) on x
  [4096, 256] with its rows over "dp" and w [32, 256, 512] with its experts over
  "ep": the trace and its lowering for CUDA."""
  import ragdot  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  loss = lambda x, w, gs: jnp.sum(ragdot.ragged_dot(x, w, gs, implementation="mosaic")
                                  .astype(jnp.float32))
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  x, w, gs = _operands(4096, 256, 512, 32)
  x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("dp")))
  w = jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P("ep")))
  traced = step.trace(x, w, gs)
  return traced, traced.lower(lowering_platforms=("cuda",)).as_text()


def test_gated_shard_pair_lowers_through_the_vjp_inside_shard_map(h200):
  """Qwen3-30B down's EP=8 shard as the H200 dispatcher runs it: swap and the
  row-major ring on one output buffer (``shard_ring_above``), forward and dX,
  traced through the gradient inside shard_map and lowered for sm90, the
  second kernel writing the first one's output in place (an aliased operand)."""
  import ragdot  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))

  def shard(x, w, gs):
    offset = jax.lax.axis_index("ep") * w.shape[0]
    return jax.lax.psum(ragdot.ragged_dot(x, w, gs, group_offset=offset), "ep")

  text = _training_step(shard, mesh).trace(*_operands(32768, 768, 2048, 128)).lower(
      lowering_platforms=("cuda",)).as_text()
  # the forward: swap and the ring; dX (its output narrower than its contraction): the
  # ring; dW
  assert text.count("mosaic_gpu") >= 4
  assert "output_operand_alias" in text


def test_explicit_sharding_runs_the_kernels_per_shard_for_sm90(h200):
  """Operands split over explicit mesh axes (rows over "dp", experts over "ep"):
  the training step's forward, dX and dW lower to Mosaic kernels on each
  shard's block (``ragdot.sharded``) with the H200 table's configs."""
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    traced, text = _sharded_training_step(mesh)
  assert "shard_map" in str(traced.jaxpr)
  kernels = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
  assert len(kernels) == 3, len(kernels)  # forward, dX, dW
  # each on its shard's block: 2048 of the 4096 rows, 8 of the 32 experts
  assert all("tensor<2048x" in line and "tensor<8x256x512xbf16>" in line for line in kernels)


def test_auto_sharding_partitions_the_kernels_per_shard_for_sm90(h200):
  """Operands split over automatic mesh axes (rows over "dp", experts over
  "ep"): the training step lowers to three custom-partitioned calls, and the
  partitioner's callback (what XLA calls when it compiles for the GPU; called
  here directly, through jax 0.11.2's private hook) builds each shard's module
  with one Mosaic kernel on its block: 2048 of the 4096 rows, 8 of the 32
  experts; the dW's 32 groups split over "ep" as its result sharding asks."""
  import re  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax._src import custom_partitioning as cp  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from jax._src.lib import xla_client as xc  # pylint: disable=g-import-not-at-top
  from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharding = lambda spec, ndim: NamedSharding(mesh, spec)._to_xla_hlo_sharding(ndim)
  array = lambda shape: xc.Shape.array_shape(np.dtype(jnp.bfloat16), shape)
  rows, weights = ((4096, 256), P("dp")), ((32, 256, 512), P("ep"))
  # (operands, result) of forward, dX, dW: shapes and the shardings XLA hands over
  calls = [([rows, weights], ((4096, 512), P("dp"))),
           ([((4096, 512), P("dp")), weights], ((4096, 256), P("dp"))),
           ([rows, ((4096, 512), P("dp"))], ((32, 256, 512), P("ep")))]
  _, text = _sharded_training_step(mesh)
  keys = re.findall(r'@CustomSPMDPartitioning\(.*backend_config = "(\d+)"', text)
  assert len(keys) == 3 and "mosaic_gpu" not in text, keys
  modules = []
  for key, (operands, (out_shape, out_spec)) in zip(keys, calls):
    module, _, _ = cp._custom_partitioning_partition(  # pylint: disable=protected-access
        [array(s) for s, _ in operands] + [xc.Shape.array_shape(np.dtype(np.int32), (32,))],
        [sharding(p, len(s)) for s, p in operands] + [sharding(P(), 1)],
        array(out_shape), sharding(out_spec, len(out_shape)), key.encode())
    with mlir.make_ir_context():
      modules.append(str(ir.Module.parse(module)))
  for module in modules:
    kernels = [line for line in module.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(kernels) == 1 and "tensor<2048x" in kernels[0], kernels
  assert all("tensor<8x256x512xbf16>" in m for m in modules)
