"""The dW ring's side buffers from one Pallas-Triton kernel equal
``mosaic_dw.side_buffers``'s XLA gathers bitwise (interpret mode on CPU)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import strategies as rst
from triton_lowering import lower_for_sm90
from ragdot import backends
from ragdot.backends import mosaic_dw
from ragdot.backends import triton_side_rows as tsr
from ragdot.backends.mosaic_dw import MosaicDwConfig


def _check(m, k, n, sizes, seed=0):
  rng = np.random.default_rng(seed)
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), m)
  starts = np.concatenate([[0], ends[:-1]]).astype(np.int32)
  s, e = jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32)
  want = mosaic_dw.side_buffers(lhs, rhs, s, e)
  got = tsr.gather(lhs, rhs, s, e, interpret=True)
  for w, g in zip(want, got):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16))
  return got


@pytest.mark.parametrize("m, k, n, sizes", [
    (200, 64, 320, [17, 0, 9, 100, 3, 71]),   # heads and tails, an empty group, n > 256
    (64, 192, 128, [5, 59]),                  # a 192-wide operand: 128-column blocks
    (128, 128, 64, [0, 0, 128]),              # aligned: no side rows, all zeros
    (96, 2048, 64, list(range(1, 13)) + [18]),  # groups under 8 rows: head only
    (40, 64, 64, [3, 30, 7]),                 # a group's tail window reaches past m
])
def test_gather_equals_the_xla_side_buffers(m, k, n, sizes):
  got = _check(m, k, n, sizes)
  if sum(sizes) % 8 == 0 and all(s % 8 == 0 for s in sizes):
    assert not np.asarray(got[0]).any()


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_gather_equals_the_xla_side_buffers_on_any_layout(data):
  m = data.draw(st.integers(16, 160)) // 8 * 8
  g = data.draw(st.integers(1, 12))
  sizes = data.draw(rst.group_sizes(m, g))
  k, n = data.draw(st.sampled_from([(64, 64), (128, 320), (192, 64)]))
  _check(m, k, n, sizes, seed=data.draw(st.integers(0, 9)))


def test_gather_checks_its_arguments():
  assert tsr.SIDE_ROWS == mosaic_dw._SIDE_ROWS  # pylint: disable=protected-access
  x = jnp.zeros((8, 64), jnp.bfloat16)
  s = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match="at least 16"):
    tsr.gather(x, x, s, s, interpret=True)
  y = jnp.zeros((32, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="same rows"):
    tsr.gather(y, jnp.zeros((24, 64), jnp.bfloat16), s, s, interpret=True)
  with pytest.raises(ValueError, match="starts and ends"):
    tsr.gather(y, y, s, jnp.zeros((3,), jnp.int32), interpret=True)
  assert [a.shape for a in tsr.gather(y, y, s[:0], s[:0], interpret=True)] == [(0, 64), (0, 64)]
  assert [tsr.column_block(w) for w in (64, 192, 256, 320, 7168)] == [64, 128, 256, 256, 256]


def test_the_flag_is_on_by_default_and_keeps_xla_off_the_gpu(monkeypatch):
  assert MosaicDwConfig().side_gather_kernel
  # Interpret mode (and any call off a GPU) gathers with XLA: same result as without.
  assert backends.side_rows_kernel(True) is None
  calls = []
  monkeypatch.setattr(tsr, "gather", lambda *a, **k: calls.append(a))
  from test_mosaic_dw import SIDE, run, check  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(SIDE, side_gather_kernel=True)
  out, ref = run(296, 128, 128, [17, 0, 160, 10, 90, 3, 16], config=cfg,
                 out_dtype=jnp.bfloat16, seed=23)
  check(out, ref, jnp.bfloat16)
  assert not calls


@pytest.mark.parametrize("m, k, n, g", [(32768, 2048, 1536, 128), (96, 2048, 64, 13),
                                        (200, 64, 320, 6), (64, 192, 128, 2)])
def test_gather_lowers_to_triton_ir_for_sm90(m, k, n, g, monkeypatch):
  s = jax.ShapeDtypeStruct
  (out,) = lower_for_sm90(monkeypatch, tsr.gather, s((m, k), jnp.bfloat16),
                          s((m, n), jnp.bfloat16), s((g,), jnp.int32), s((g,), jnp.int32))
  asm = out.module.operation.get_asm()
  assert asm.count("tt.store") == 2 and asm.count("tt.load") >= 6  # 2 scalars + 2 x 2 windows
