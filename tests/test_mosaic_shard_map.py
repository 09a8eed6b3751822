"""The Mosaic kernels trace and lower for sm90 inside shard_map (expert parallelism).

Inside shard_map the kernels' inputs and outputs must carry the mesh axes the
operands vary over; this checks the whole EP pattern lowers on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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


def test_vjp_through_kernels_traces_inside_shard_map():
  """The custom VJP's cotangents keep the operands' shard_map axis types."""
  import ragdot  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))

  def shard(x, w, gs):
    offset = jax.lax.axis_index("ep") * w.shape[0]
    h = ragdot.ragged_dot(x, w, gs, group_offset=offset, implementation="mosaic")
    y = ragdot.ragged_dot(h, jnp.swapaxes(w, 1, 2), gs, group_offset=offset,
                          implementation="mosaic")
    return jax.lax.psum(y, "ep")

  layer = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P("ep"), P()), out_specs=P())
  loss = lambda x, w, gs: jnp.sum(layer(x, w, gs).astype(jnp.float32))
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  args = (jax.ShapeDtypeStruct((512, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((8, 128, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((8,), jnp.int32))
  jaxpr = step.trace(*args).jaxpr
  text = str(jaxpr)
  # Before the fix, tracing raised: the bwd rule returned non-varying cotangents.
  assert text.count("custom_vjp_call") >= 2
