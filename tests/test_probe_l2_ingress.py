"""scripts/probe_l2_ingress.py (the SMs' TMA load rate) in the Mosaic GPU interpret mode."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "probe_l2_ingress.py")
_spec = importlib.util.spec_from_file_location("probe_l2_ingress", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


@pytest.mark.parametrize("stream, num_blocks, stages", [(False, 5, 4), (True, 12, 3),
                                                        (False, 3, 7)])  # more stages than steps
def test_each_sm_ends_holding_its_last_block(stream, num_blocks, stages):
  # Each SM's output is the lhs block of its last step, so every step's
  # loads ran in order through the ring (and landed where they should).
  ka, kb = jax.random.split(jax.random.key(3))
  a = jax.random.normal(ka, (num_blocks * 64, 128), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (num_blocks * 64, 192), jnp.float32).astype(jnp.bfloat16)
  steps, sms = 6, 2
  out = probe.ingress_kernel(num_blocks, steps, stages, sms, stream=stream, interpret=True)(a, b)
  assert out.shape == (sms, 64, 128)
  for sm in range(sms):
    t = steps - 1
    blk = (sm + t * sms) % num_blocks if stream else (7 * sm + t) % num_blocks
    np.testing.assert_array_equal(np.asarray(out[sm]), np.asarray(a[blk * 64:(blk + 1) * 64]))


def test_lowers_for_sm90():
  fn = probe.ingress_kernel(64, 4000, 5, 132, stream=False)
  shapes = (jax.ShapeDtypeStruct((64 * 64, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((64 * 64, 192), jnp.bfloat16))
  assert "mosaic_gpu" in fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
