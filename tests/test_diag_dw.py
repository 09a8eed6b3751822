"""scripts/diag_dw.py's patched cases: R (extra barrier arrivals per TMA load;
its stage barriers expect the extra arrivals), W and S (the output's stores
traced out, or all into group 0) lower for sm90, and each patch is undone
afterwards.  (The interpreter rejects a copy's predicate, so
R itself only runs on the GPU.)"""

import dataclasses
import os
import sys

from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import diag_dw  # noqa: E402  (the scripts folder, as on the GPU machine)
from test_mosaic_dw import PINGPONG, lower_for_sm90  # noqa: E402


def test_extra_arrivals_lower_and_are_undone():
  cfg = dataclasses.replace(PINGPONG, num_sms=None, num_stages=4, block_n=192,
                            epilogue_split=3, epilogue_buffers=2)
  copy, barrier = plgpu.copy_gmem_to_smem, plgpu.Barrier
  with diag_dw.extra_arrivals(7):
    assert plgpu.Barrier(num_arrivals=2, num_barriers=8).num_arrivals == 16  # `produced`
    assert plgpu.Barrier(num_arrivals=1, num_barriers=4).num_arrivals == 1  # `consumed`
    assert plgpu.Barrier(num_arrivals=2).num_arrivals == 2  # single barriers
    lower_for_sm90(32768, 2048, 1536, 128, cfg)
  assert plgpu.copy_gmem_to_smem is copy and plgpu.Barrier is barrier


def test_stores_traced_out_lower_and_are_undone():
  from ragdot.backends import mosaic_dw  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(PINGPONG, num_sms=None, num_stages=4, block_n=192,
                            epilogue_split=3, side_rows=True)
  store = mosaic_dw._store_half
  for into_group0 in (False, True):
    with diag_dw.stores_traced_out(into_group0):
      assert mosaic_dw._store_half is not store
      lower_for_sm90(32768, 2048, 1536, 128, cfg)
    assert mosaic_dw._store_half is store


def test_rows_from_l2_window_lower_read_the_window_and_are_undone():
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot.backends import mosaic_dw  # pylint: disable=g-import-not-at-top
  from test_mosaic_dw import SIDE, run  # noqa: E402
  cfg = dataclasses.replace(SIDE, num_sms=None, num_stages=4, block_n=192,
                            epilogue_split=3, epilogue_buffers=2)
  item = mosaic_dw._work_item
  with diag_dw.rows_from_l2_window():
    assert mosaic_dw._work_item is not item
    lower_for_sm90(32768, 2048, 1536, 128, cfg)
  assert mosaic_dw._work_item is item
  # Interpret mode: with a 64-row window, group 2 (rows 64..127) reads rows
  # 0..63 instead (its dW is group 0's); group 0's is unchanged.
  small = dataclasses.replace(SIDE, num_sms=2)
  sizes = [64, 0, 64]
  want, _ = run(192, 128, 128, sizes, config=small, out_dtype=jnp.bfloat16)
  with diag_dw.rows_from_l2_window(64):
    got, _ = run(192, 128, 128, sizes, config=small, out_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[2], want[0])
  assert not np.array_equal(got[2], want[2])
