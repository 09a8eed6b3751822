"""The one-kernel schedule builder equals the XLA builders of ``metadata``
entry for entry (Pallas-Triton interpret mode on CPU)."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import strategies as rst
from ragdot import metadata as md
from ragdot.backends import triton_schedule as ts


def _xla(sizes, offset, m, num_local, block_m, tail_rows=0):
  tiles, scalars = md.flat_schedule(sizes, offset, m, num_local, block_m, tail_rows=tail_rows)
  return np.asarray(tiles).reshape(4, -1), np.asarray(scalars)


def _check(sizes, offset, m, num_local, block_m, tail_rows=0):
  sizes = jnp.asarray(sizes, jnp.int32)
  go = None if offset is None else jnp.int32(offset)
  tiles, scalars = ts.build(sizes, go, m=m, num_local=num_local, block_m=block_m,
                            tail_rows=tail_rows, interpret=True)
  _check_against_xla(tiles, scalars, sizes, go, m, num_local, block_m, tail_rows)


def _check_against_xla(tiles, scalars, sizes, go, m, num_local, block_m, tail_rows):
  rows, want_scalars = _xla(sizes, go, m, num_local, block_m, tail_rows)
  length = ts.padded_tiles(m, block_m, num_local)
  assert tiles.shape == (4 * length,) and scalars.shape == (ts.NUM_SCALARS,)
  tiles = np.asarray(tiles).reshape(4, length)
  t = rows.shape[1]
  np.testing.assert_array_equal(tiles[:, :t], rows)
  # Entries past metadata's static length are padding: no rows, a valid group.
  np.testing.assert_array_equal(tiles[1:, t:], 0)
  assert np.all((tiles[0, t:] >= 0) & (tiles[0, t:] < num_local))
  np.testing.assert_array_equal(np.asarray(scalars)[:6], want_scalars)


@st.composite
def layouts(draw):
  m = draw(st.integers(1, 300))
  g = draw(st.integers(1, 40))
  sizes = draw(rst.group_sizes(m, g))
  offset, num_local = draw(rst.shard(g))
  if draw(st.booleans()):  # any offset, also before group 0 or past the last group
    num_local = draw(st.integers(1, g + 3))
    offset = draw(st.integers(-num_local - 2, g + 2))
  block_m = draw(st.sampled_from([16, 24, 64, 128, 256]))
  return sizes, offset, m, num_local, block_m


@settings(max_examples=25, deadline=None)
@given(layouts(), st.sampled_from([0, 0, 8, 16, 32, 64]))
def test_equals_xla_builders(layout, tail_rows):
  _check(*layout, tail_rows=tail_rows)


def _fold_by_hand(tiles, num_tiles, tail_rows):
  """The folded schedule from the plain one, tile by tile: a group's last tile
  of at most tail_rows rows, after a tile of the same group, is dropped and the
  tile before it ends at the group's end."""
  kept = []
  for t in range(num_tiles):
    grp, row0, row_start, row_end = (int(v) for v in tiles[:, t])
    last = t + 1 == num_tiles or tiles[0, t + 1] != grp
    if last and kept and kept[-1][0] == grp and row_end - row0 <= tail_rows:
      kept[-1][3] = row_end
    else:
      kept.append([grp, row0, row_start, row_end])
  return np.asarray(kept, np.int32).reshape(-1, 4).T


@settings(max_examples=25, deadline=None)
@given(layouts(), st.sampled_from([8, 16, 32, 64]))
def test_folded_tails_equal_folding_by_hand(layout, tail_rows):
  sizes, offset, m, num_local, block_m = layout
  sizes = jnp.asarray(sizes, jnp.int32)
  go = None if offset is None else jnp.int32(offset)
  plain, plain_scalars = _xla(sizes, go, m, num_local, block_m)
  folded, scalars = _xla(sizes, go, m, num_local, block_m, tail_rows)
  want = _fold_by_hand(plain, int(plain_scalars[0]), tail_rows)
  assert int(scalars[0]) == want.shape[1]
  np.testing.assert_array_equal(folded[:, :want.shape[1]], want)
  np.testing.assert_array_equal(scalars[1:], plain_scalars[1:])


@pytest.mark.parametrize("offset", [-3, 5, 14])
def test_offset_outside_groups(offset):
  # Shards that begin before group 0 or run past the last group.
  _check(np.array([5, 0, 9, 3, 7, 2, 4, 1], np.int32), offset, 40, 6, 16)


def test_many_local_groups_and_sums_past_m():
  # 300 local groups (several programs of few tiles each) whose sizes
  # add up to more than m (rows past m belong to no group).
  rng = np.random.default_rng(0)
  sizes = rng.integers(0, 9, 300).astype(np.int32)
  _check(sizes, None, 1000, 300, 64)
  _check(sizes, 17, 1000, 200, 64)


def test_only_compiled_gpu_calls_use_the_kernels():
  # Interpret mode (CPU tests, also under shard_map) and lowering for CUDA on a
  # machine without a GPU keep metadata's XLA ops.
  from ragdot import backends  # pylint: disable=g-import-not-at-top
  assert backends.schedule_kernels(True) is None
  assert (backends.schedule_kernels(False) is None) == (jax.default_backend() != "gpu")


def _interpreted_kernels(calls):
  def counted(fn):
    def call(*args, **kwargs):
      calls.append(fn.__name__)
      return fn(*args, interpret=True, **kwargs)
    return call
  return types.SimpleNamespace(supported=ts.supported, build_many=counted(ts.build_many),
                               build_bounds=counted(ts.build_bounds))


@pytest.mark.parametrize("kernel", ["mosaic_fwd", "mosaic_dx", "triton_fwd", "mosaic_dw",
                                    "mosaic_ring_tails"])
def test_kernels_with_the_schedule_kernel_equal_xla_schedule(kernel, monkeypatch):
  """The consumers read the kernel-built schedule (its padded length, its
  scalars) exactly as the XLA-built one: bitwise-equal outputs."""
  from ragdot import backends  # pylint: disable=g-import-not-at-top
  from ragdot.backends import mosaic_dw, mosaic_fwd, triton  # pylint: disable=g-import-not-at-top
  sizes = jnp.asarray([30, 0, 41, 9, 25, 17], jnp.int32)
  offset = jnp.int32(1)  # local groups 1..4: rows outside are zeros
  m, k, n, g_local = 136, 64, 128, 4
  if kernel == "mosaic_ring_tails":  # local groups of 140 (a folded 12-row tail), 10, 150, 0
    sizes, m = jnp.asarray([20, 140, 10, 150, 0, 30], jnp.int32), 400
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  if kernel == "mosaic_dw":
    cfg = mosaic_dw.MosaicDwConfig(block_m=64, block_k=64, block_n=64, num_stages=2, num_sms=3)
    d = jax.random.normal(kw, (m, n), jnp.float32).astype(jnp.bfloat16)
    run = lambda c: mosaic_dw.tgmm(x, d, sizes, offset, num_groups=g_local,
                                   out_dtype=jnp.float32, interpret=True, config=c)
  else:
    tr = kernel == "mosaic_dx"
    w = jax.random.normal(kw, (g_local, n, k) if tr else (g_local, k, n),
                          jnp.float32).astype(jnp.bfloat16)
    if kernel == "mosaic_ring_tails":
      cfg = mosaic_fwd.MosaicFwdConfig(block_m=128, block_n=128, block_k=64, num_stages=2,
                                       num_compute_wgs=2, epilogue_split=2, ring=True,
                                       tail_rows=16, num_sms=3)
      run = lambda c: mosaic_fwd.gmm(x, w, sizes, offset, transpose_rhs=tr,
                                     out_dtype=jnp.bfloat16, interpret=True, config=c)
    elif kernel == "triton_fwd":
      cfg = triton.TritonConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)
      run = lambda c: triton.gmm(x, w, sizes, offset, transpose_rhs=False,
                                 out_dtype=jnp.float32, precision=None, interpret=True, config=c)
    else:
      cfg = mosaic_fwd.MosaicFwdConfig(block_m=128, block_n=64, block_k=32, num_stages=2,
                                       num_sms=2, num_compute_wgs=2)
      run = lambda c: mosaic_fwd.gmm(x, w, sizes, offset, transpose_rhs=tr,
                                     out_dtype=jnp.float32, interpret=True, config=c)
  calls = []
  monkeypatch.setattr(backends, "schedule_kernels", lambda interpret: _interpreted_kernels(calls))
  with_kernel = np.asarray(run(cfg))
  assert calls == ["build_bounds" if kernel == "mosaic_dw" else "build_many"]
  without = np.asarray(run(dataclasses.replace(cfg, schedule_kernel=False)))
  np.testing.assert_array_equal(with_kernel, without)
  assert np.all(np.isfinite(without)) and np.any(without != 0)


def test_unsupported_is_refused():
  assert not ts.supported(2**20, 4096, 4096)  # too many local groups
  assert not ts.supported(2**22, 1024, 8)  # prefix sums could overflow int32
  assert ts.supported(32768, 256, 32)
  with pytest.raises(ValueError, match="num_local"):
    ts.build(jnp.zeros((4096,), jnp.int32), None, m=8, num_local=4096, block_m=64)
  with pytest.raises(ValueError, match="power of two"):
    ts.tile_block(128, elements=3000)


def test_traced_offset_under_jit():
  sizes = jnp.asarray([3, 0, 8, 5], jnp.int32)
  build = jax.jit(lambda s, o: ts.build(s, o, m=16, num_local=2, block_m=16, interpret=True))
  for o in range(-1, 5):
    tiles, scalars = build(sizes, jnp.int32(o))
    rows, want = _xla(sizes, jnp.int32(o), 16, 2, 16)
    np.testing.assert_array_equal(np.asarray(tiles).reshape(4, -1)[:, :rows.shape[1]], rows)
    np.testing.assert_array_equal(np.asarray(scalars)[:6], want)


@settings(max_examples=20, deadline=None)
@given(layouts())
def test_bounds_equal_xla_builders(layout):
  sizes, offset, m, num_local, block_m = layout
  sizes = jnp.asarray(sizes, jnp.int32)
  go = None if offset is None else jnp.int32(offset)
  got = [np.asarray(v) for v in ts.build_bounds(sizes, go, m=m, num_local=num_local,
                                                 block_m=block_m, interpret=True)]
  for g, want in zip(got, md.row_blocks(sizes, go, m, num_local, block_m)):
    assert g.shape[0] >= num_local
    np.testing.assert_array_equal(g[:num_local], np.asarray(want))
    np.testing.assert_array_equal(g[num_local:], 0)


@settings(max_examples=10, deadline=None)
@given(layouts(), st.sampled_from([((256, 32), (128, 0)), ((160, 16), (128, 0), (64, 0)),
                                   ((24, 8), (256, 0))]))
def test_build_many_equals_the_xla_builders(layout, tiles):
  """One launch for several schedules (the gated swap / ring pair's): each of
  them ``metadata``'s schedule of its own tiles, padding as ``build``'s."""
  sizes, offset, m, num_local, _ = layout
  sizes = jnp.asarray(sizes, jnp.int32)
  go = None if offset is None else jnp.int32(offset)
  many = ts.build_many(sizes, go, m=m, num_local=num_local, tiles=tiles, interpret=True)
  assert len(many) == len(tiles)
  for (block_m, tail_rows), (got_tiles, got_scalars) in zip(tiles, many):
    _check_against_xla(got_tiles, got_scalars, sizes, go, m, num_local, block_m, tail_rows)


@pytest.mark.parametrize("with_offset", [False, True], ids=["all", "shard"])
def test_schedule_kernels_lower_to_triton_ir_for_sm90(with_offset, monkeypatch):
  from triton_lowering import lower_for_sm90  # pylint: disable=g-import-not-at-top
  s = jax.ShapeDtypeStruct
  offset = s((), jnp.int32) if with_offset else None
  local = 16 if with_offset else 128
  for fn in (functools.partial(ts.build, m=32768, num_local=local, block_m=128),
             functools.partial(ts.build_bounds, m=32768, num_local=local, block_m=64)):
    (out,) = lower_for_sm90(monkeypatch, fn, s((128,), jnp.int32), offset)
    assert "tt.store" in out.module.operation.get_asm()
