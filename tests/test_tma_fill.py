"""scripts/tma_fill.py (dW's write floor) in the Mosaic GPU interpret mode."""

import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "tma_fill.py")
_spec = importlib.util.spec_from_file_location("tma_fill", _PATH)
tma_fill = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tma_fill)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fill_writes_every_element(dtype):
  # 3 x 2 blocks over 4 programs: programs 0-1 store two blocks, 2-3 one.
  out = tma_fill.tma_fill((192, 512), dtype, value=-2.5, interpret=True)()
  assert out.shape == (192, 512) and out.dtype == dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((192, 512), -2.5, np.float32))


def test_shape_not_a_multiple_of_the_block_is_refused():
  with pytest.raises(ValueError, match="block"):
    tma_fill.tma_fill((100, 512), jnp.bfloat16, interpret=True)
