"""scripts/diag_dw.py's case R (extra barrier arrivals per TMA load): the patched
pingpong ring lowers for sm90, its stage barriers expect the extra arrivals, and
the patch is undone afterwards.  (The interpreter rejects a copy's predicate, so
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
