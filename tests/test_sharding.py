"""Expert parallelism: shards with group_offset, psum'd, equal the unsharded op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import oracle
import ragdot

HIGHEST = jax.lax.Precision.HIGHEST


def _mesh(ep):
  if len(jax.devices()) < ep:
    pytest.fail(f"needs {ep} devices (conftest sets 8 CPU devices), got {len(jax.devices())}")
  return jax.make_mesh((ep,), ("ep",), devices=jax.devices()[:ep],
                       axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_ep_forward_and_grads_equal_unsharded(ep):
  m, k, n, num_groups = 64, 16, 24, 16
  rng = np.random.default_rng(ep)
  sizes = rng.multinomial(m - 5, np.ones(num_groups) / num_groups).astype(np.int32)
  sizes[3] = 0
  x, w, c = oracle.random_inputs(jax.random.key(ep), [(m, k), (num_groups, k, n), (m, n)], jnp.float32)
  gs = jnp.asarray(sizes)
  per_shard = num_groups // ep

  def sharded(x, w_local, gs):
    offset = jax.lax.axis_index("ep") * per_shard
    out = ragdot.ragged_dot(x, w_local, gs, precision=HIGHEST, group_offset=offset)
    return jax.lax.psum(out, "ep")

  fn = jax.jit(jax.shard_map(sharded, mesh=_mesh(ep), in_specs=(P(), P("ep"), P()),
                             out_specs=P()))
  out = fn(x, w, gs)
  want = ragdot.ragged_dot(x, w, gs, precision=HIGHEST)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes), jnp.float32)

  loss = lambda x, w: jnp.sum(fn(x, w, gs) * c)
  ref_loss = lambda x, w: jnp.sum(ragdot.ragged_dot(x, w, gs, precision=HIGHEST) * c)
  got = jax.grad(loss, (0, 1))(x, w)
  exp = jax.grad(ref_loss, (0, 1))(x, w)
  for g_, e_ in zip(got, exp):
    np.testing.assert_allclose(g_, e_, rtol=1e-4, atol=1e-4)


def test_ep_trans_ragged_dot_shards_concatenate_to_full():
  ep, m, k, n, num_groups = 4, 40, 8, 8, 8
  sizes = np.array([5, 0, 9, 3, 7, 0, 6, 10], np.int32)
  x, d = oracle.random_inputs(jax.random.key(5), [(m, k), (m, n)], jnp.float32)
  per_shard = num_groups // ep

  def sharded(x, d, gs):
    offset = jax.lax.axis_index("ep") * per_shard
    return ragdot.trans_ragged_dot(x, d, gs, group_offset=offset,
                                   num_groups=per_shard, precision=HIGHEST)

  fn = jax.jit(jax.shard_map(sharded, mesh=_mesh(ep), in_specs=(P(), P(), P()),
                             out_specs=P("ep")))
  out = fn(x, d, jnp.asarray(sizes))
  oracle.assert_close(out, oracle.ref_trans_ragged_dot(x, d, sizes), jnp.float32)
