"""Mosaic GPU forward / dX kernel (``backends.mosaic_fwd``) in interpret mode on CPU.

Every output row is checked against an f32 ``lax.ragged_dot`` (HIGHEST)
reference; rows outside the local groups must be exactly zero (interpret mode
fills fresh buffers with NaN, so unwritten rows fail).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
from jax.experimental.pallas import mosaic_gpu as plgpu
from sm90_lowering import assert_gmm_lowers

from ragdot.backends import mosaic_fwd
from ragdot.backends.mosaic_fwd import MosaicFwdConfig

CFG1 = MosaicFwdConfig(block_m=64, block_n=64, block_k=32, num_stages=2, num_sms=3)
CFG2 = MosaicFwdConfig(block_m=128, block_n=64, block_k=32, num_stages=2, num_sms=2,
                       num_compute_wgs=2, skip_empty_halves=True)
# Split epilogues: the (rows, 128) result leaves through a (rows, 64) buffer.
CFG1S = MosaicFwdConfig(block_m=64, block_n=128, block_k=32, num_stages=3, num_sms=3,
                        grid_tile_width=2, epilogue_split=2)
CFG2S = MosaicFwdConfig(block_m=128, block_n=128, block_k=32, num_stages=3, num_sms=2,
                        num_compute_wgs=2, epilogue_split=2)
# One pipeline through each CTA's tiles (k steps a multiple of the stages).
CFG2C = MosaicFwdConfig(block_m=128, block_n=64, block_k=32, num_stages=2, num_sms=2,
                        num_compute_wgs=2, delay_release=0, pipeline_across_tiles=True,
                        skip_empty_halves=True)

# 64-row tiles, the two consumers splitting the columns.
CFG2N = MosaicFwdConfig(block_m=64, block_n=128, block_k=32, num_stages=3, num_sms=2,
                        num_compute_wgs=2, epilogue_split=2, split_n=True)


@pytest.fixture(autouse=True)
def _reset_interpreter():
  yield
  gpu_interpret.reset_gpu_interpret_mode_state()


def _reference(lhs, rhs, sizes, offset, transpose_rhs):
  """f32 out[m, n]: pad rhs to all G groups, then zero the non-local rows."""
  m = lhs.shape[0]
  sizes = np.maximum(np.asarray(sizes), 0)  # negative sizes count as 0 (metadata.group_bounds)
  big_g, g_local = len(sizes), rhs.shape[0]
  o = 0 if offset is None else int(offset)
  rhs32 = np.asarray(rhs, np.float32)
  if transpose_rhs:
    rhs32 = rhs32.transpose(0, 2, 1)
  full = np.zeros((big_g, *rhs32.shape[1:]), np.float32)
  for j in range(g_local):
    if 0 <= o + j < big_g:
      full[o + j] = rhs32[j]
  ref = jax.lax.ragged_dot(
      jnp.asarray(lhs, jnp.float32), jnp.asarray(full), jnp.asarray(sizes, jnp.int32),
      precision=jax.lax.Precision.HIGHEST,
  )
  ref = np.array(ref)
  ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), m)
  starts = np.concatenate([[0], ends[:-1]])
  local = np.zeros(m, bool)
  for j in range(g_local):
    if 0 <= o + j < big_g:
      local[starts[o + j]:ends[o + j]] = True
  ref[~local] = 0.0
  return ref, local


def _run_and_check(m, k, n, sizes, *, g_local=None, offset=None, transpose_rhs=False,
                   dtype=jnp.bfloat16, out_dtype=jnp.float32, config=CFG1, seed=0):
  sizes = np.asarray(sizes, np.int32)
  g_local = len(sizes) if g_local is None else g_local
  kl, kr = jax.random.split(jax.random.key(seed))
  lhs = jax.random.normal(kl, (m, k), jnp.float32).astype(dtype)
  rshape = (g_local, n, k) if transpose_rhs else (g_local, k, n)
  rhs = jax.random.normal(kr, rshape, jnp.float32).astype(dtype)
  go = None if offset is None else jnp.asarray(offset, jnp.int32)
  out = mosaic_fwd.gmm(
      lhs, rhs, jnp.asarray(sizes), go, transpose_rhs=transpose_rhs,
      out_dtype=out_dtype, precision=None, interpret=True, config=config,
  )
  assert out.shape == (m, n) and out.dtype == jnp.dtype(out_dtype)
  out = np.asarray(out.astype(jnp.float32))
  ref, local = _reference(lhs, rhs, sizes, offset, transpose_rhs)
  assert np.all(out[~local] == 0.0), "rows outside the local groups must be exactly 0"
  assert np.all(np.isfinite(out)), "unwritten (NaN) output rows"
  scale = max(float(np.abs(ref).max()), 1.0)
  np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2 * scale)
  return out, local


# (m, sizes): partial tiles at boundaries, empty groups at both ends and in the
# middle, m not a multiple of block_m, sum < m and sum > m.
@pytest.mark.parametrize(
    "m,sizes,transpose_rhs,dtype,out_dtype",
    [
        (80, [10, 0, 50, 7], False, jnp.bfloat16, jnp.float32),  # sum < m, middle empty
        (96, [0, 30, 25, 0, 20, 0], True, jnp.float16, jnp.float16),  # empty at both ends
        (96, [40, 30, 50], True, jnp.bfloat16, jnp.bfloat16),  # sum > m: cut at m
        (72, [3, 64, 1, 4], False, jnp.float16, jnp.float32),  # tiny groups straddling
        (64, [64], False, jnp.bfloat16, jnp.bfloat16),  # one exact tile
    ],
)
def test_no_offset(m, sizes, transpose_rhs, dtype, out_dtype):
  _run_and_check(m, 64, 128, sizes, transpose_rhs=transpose_rhs, dtype=dtype,
                 out_dtype=out_dtype)


def test_all_zero_sizes_gives_zeros():
  out, local = _run_and_check(72, 64, 64, [0, 0, 0, 0, 0])
  assert not local.any() and np.all(out == 0.0)


SHARD_SIZES = [12, 0, 20, 9, 0, 25]  # G = 6, sum 66 < m = 80


@pytest.mark.parametrize(
    "offset,g_local,transpose_rhs",
    [
        (0, 2, False),  # first shard
        (2, 2, True),  # middle shard
        (4, 2, False),  # last shard
        (3, 3, True),  # runs past G: local group 2 = global 5, 3 -> nothing
    ],
)
def test_group_offset(offset, g_local, transpose_rhs):
  _run_and_check(80, 64, 128, SHARD_SIZES, g_local=g_local, offset=offset,
                 transpose_rhs=transpose_rhs, out_dtype=jnp.bfloat16, seed=offset)


def test_empty_shard_is_all_zero():
  out, local = _run_and_check(80, 64, 64, [30, 0, 0, 40], g_local=2, offset=1)
  assert not local.any() and np.all(out == 0.0)


def test_offset_past_all_groups():
  out, local = _run_and_check(48, 64, 64, [20, 20], g_local=2, offset=2)
  assert not local.any() and np.all(out == 0.0)


def test_multiple_k_steps_and_n_tiles():
  # k = 128 over block_k 32 (4 pipeline steps, 2 stages), 2 n tiles.
  cfg = dataclasses.replace(CFG1, num_stages=3)
  _run_and_check(96, 128, 128, [17, 33, 0, 46], transpose_rhs=True, config=cfg)


def test_partial_k_and_n_blocks():
  # k % block_k != 0 and n % block_n != 0: TMA zero-fill / clipped stores.
  cfg = dataclasses.replace(CFG1, block_n=128, block_k=128)
  _run_and_check(80, 192, 192, [25, 30, 5], transpose_rhs=False, config=cfg)
  _run_and_check(40, 192, 64, [7, 33], transpose_rhs=True, config=cfg)


@pytest.mark.parametrize("minor,width", [(1, 2), (0, 2)])
def test_grid_orders(minor, width):
  cfg = dataclasses.replace(CFG1, grid_minor_dim=minor, grid_tile_width=width)
  _run_and_check(96, 64, 128, [20, 0, 41, 30], config=cfg)


@pytest.mark.parametrize(
    "m,sizes,offset,g_local,transpose_rhs",
    [
        (96, [10, 0, 50, 7, 20], None, None, False),
        (160, [0, 70, 3, 0, 60, 11], 1, 4, True),  # 2 row tiles, offset, dX
    ],
)
def test_two_consumer_warpgroups(m, sizes, offset, g_local, transpose_rhs):
  _run_and_check(m, 64, 64, sizes, offset=offset, g_local=g_local,
                 transpose_rhs=transpose_rhs, config=CFG2, out_dtype=jnp.bfloat16)


@pytest.mark.parametrize(
    "m,k,n,sizes,offset,g_local,transpose_rhs,num_sms,stages",
    [
        (160, 128, 128, [0, 70, 3, 0, 60, 11], 1, 4, True, 2, 2),  # several tiles per CTA
        (96, 64, 64, [10, 0, 50, 7, 20], None, None, False, 2, 2),  # one tile per CTA
        (96, 64, 128, [40, 0, 56], None, None, False, 3, 2),  # a CTA without compute tiles
        (160, 128, 64, [30, 50, 40], None, None, True, 2, 4),  # 4 k steps, 4 stages
        (160, 192, 64, [30, 50, 40], None, None, True, 2, 4),  # 6 k steps: per-tile pipelines
    ],
)
def test_pipeline_across_tiles(m, k, n, sizes, offset, g_local, transpose_rhs, num_sms,
                               stages):
  cfg = dataclasses.replace(CFG2C, num_sms=num_sms, num_stages=stages)
  _run_and_check(m, k, n, sizes, offset=offset, g_local=g_local,
                 transpose_rhs=transpose_rhs, config=cfg, out_dtype=jnp.bfloat16)


def test_delay_release_zero_per_tile():
  cfg = dataclasses.replace(CFG2C, pipeline_across_tiles=False)
  _run_and_check(160, 128, 64, [0, 70, 3, 0, 60, 11], offset=1, g_local=4, config=cfg)


@pytest.mark.parametrize("config", [CFG1S, CFG2S], ids=["1wg", "2wg"])
@pytest.mark.parametrize(
    "m,k,n,sizes,offset,g_local,transpose_rhs",
    [
        (96, 64, 256, [10, 0, 50, 7, 20], None, None, False),  # 2 full n tiles
        (160, 128, 192, [0, 70, 3, 0, 60, 11], 1, 4, True),  # offset; last tile 64 cols
        (80, 64, 64, [25, 30, 5], None, None, False),  # chunk 1 wholly past n
        (144, 64, 192, [12, 0, 20, 9, 0, 25], 2, 3, True),  # zero tiles, half tile past n
    ],
)
def test_split_epilogue(config, m, k, n, sizes, offset, g_local, transpose_rhs):
  _run_and_check(m, k, n, sizes, offset=offset, g_local=g_local,
                 transpose_rhs=transpose_rhs, config=config, out_dtype=jnp.bfloat16)


@pytest.mark.parametrize(
    "m,k,n,sizes,offset,g_local,transpose_rhs,bn,split,out_dtype",
    [
        # groups of 70 (64 + 6) and 130 rows, a small group, an empty one
        (320, 64, 256, [70, 0, 130, 20, 90], None, None, False, 128, 2, jnp.bfloat16),
        (320, 128, 256, [70, 0, 130, 20, 90], None, None, True, 256, 2, jnp.bfloat16),  # dX
        # offset (zero tiles); n = 192: consumer 1's half of the last n tile is past n
        (264, 64, 192, [5, 60, 129, 0, 61, 9], 1, 4, False, 128, 2, jnp.bfloat16),
        (264, 64, 192, [5, 60, 129, 0, 61, 9], 1, 4, True, 128, 2, jnp.float32),  # dX, f32
        # two 64-column chunks per consumer, the last one past n
        (264, 64, 192, [5, 60, 129, 0, 61, 9], 2, 3, True, 256, 4, jnp.bfloat16),
        (200, 64, 128, [64, 64, 8, 64], None, None, False, 128, 2, jnp.bfloat16),  # 64 rows
        (104, 64, 128, [30, 30], None, None, False, 128, 2, jnp.float32),  # rows past the sizes
    ],
)
def test_split_n(m, k, n, sizes, offset, g_local, transpose_rhs, bn, split, out_dtype):
  cfg = dataclasses.replace(CFG2N, block_n=bn, epilogue_split=split)
  _run_and_check(m, k, n, sizes, offset=offset, g_local=g_local,
                 transpose_rhs=transpose_rhs, config=cfg, out_dtype=out_dtype)


def test_split_n_chained_across_tiles():
  cfg = dataclasses.replace(CFG2N, num_stages=2, delay_release=0, pipeline_across_tiles=True)
  _run_and_check(264, 64, 128, [5, 60, 129, 0, 61, 9], offset=1, g_local=4, config=cfg,
                 out_dtype=jnp.bfloat16)


def test_default_config_in_interpret_mode():
  _run_and_check(64, 64, 64, [30, 30], config=None)


@pytest.mark.parametrize("config", [CFG1, CFG2, CFG2S, CFG2C, CFG2N],
                         ids=["1wg", "2wg", "2wg_split", "2wg_chained", "2wg_split_n"])
@pytest.mark.parametrize(
    "m,k,n,sizes,offset,g_local,transpose_rhs",
    [
        (160, 128, 128, [0, 70, 3, 0, 60, 11], 2, 3, True),  # zero rows below and above
        (144, 64, 192, [12, 0, 20, 9, 0, 25], 2, 3, False),  # a half n tile past n
        (96, 64, 128, [40, 0, 56], 1, 1, False),  # an empty shard: zero tiles only
        (104, 64, 128, [30, 30], 0, 2, True),  # only the rows past sum(sizes) are zero
    ],
)
def test_zero_rows_around_the_shard(config, m, k, n, sizes, offset, g_local, transpose_rhs):
  _run_and_check(m, k, n, sizes, offset=offset, g_local=g_local,
                 transpose_rhs=transpose_rhs, config=config, out_dtype=jnp.bfloat16)


@pytest.mark.parametrize(
    "config", [CFG1, CFG2, CFG1S, CFG2S, CFG2C, CFG2N],
    ids=["1wg", "2wg", "1wg_split", "2wg_split", "2wg_chained", "2wg_split_n"])
def test_no_races(config):
  lhs = jax.random.normal(jax.random.key(1), (96, 64), jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(2), (2, 64, 128), jnp.bfloat16)
  sizes = jnp.asarray([10, 0, 50, 7], jnp.int32)
  cfg = dataclasses.replace(config, num_stages=2, num_sms=2)
  out = mosaic_fwd.gmm(
      lhs, rhs, sizes, jnp.int32(1), transpose_rhs=False, out_dtype=jnp.bfloat16,
      precision=None, interpret=plgpu.InterpretGPUParams(detect_races=True), config=cfg,
  )
  out.block_until_ready()
  assert not gpu_interpret.get_races().races_found


@pytest.mark.parametrize(
    "k,n,dtype,rhs_dtype,out_dtype",
    [
        (60, 64, jnp.bfloat16, None, jnp.float32),  # k not a multiple of 8
        (64, 36, jnp.bfloat16, None, jnp.float32),  # n not a multiple of 8
        (72, 64, jnp.bfloat16, None, jnp.float32),  # k: sm90 lowering needs 64-col tiles
        (64, 200, jnp.bfloat16, None, jnp.float32),  # n: likewise
        (64, 64, jnp.float32, None, jnp.float32),  # f32 inputs
        (64, 64, jnp.bfloat16, jnp.float16, jnp.float32),  # mixed inputs
        (64, 64, jnp.bfloat16, None, jnp.int32),  # unsupported out dtype
    ],
)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_unsupported_raises(k, n, dtype, rhs_dtype, out_dtype, transpose_rhs):
  lhs = jnp.ones((32, k), dtype)
  rshape = (2, n, k) if transpose_rhs else (2, k, n)
  rhs = jnp.ones(rshape, rhs_dtype or dtype)
  with pytest.raises(NotImplementedError):
    mosaic_fwd.gmm(lhs, rhs, jnp.asarray([16, 16], jnp.int32), None,
                   transpose_rhs=transpose_rhs, out_dtype=out_dtype, precision=None,
                   interpret=True, config=CFG1)


def test_rows_not_in_tiles_of_8_raise():
  # sm90 lowering rejects TMA descriptors over m % 8 != 0 rows (seen on the H200).
  with pytest.raises(NotImplementedError, match="m % 8"):
    mosaic_fwd.gmm(jnp.ones((4079, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16),
                   jnp.asarray([16, 16], jnp.int32), None, transpose_rhs=False,
                   out_dtype=jnp.bfloat16, precision=None, interpret=True, config=CFG1)


def test_config_validation():
  with pytest.raises(ValueError):
    MosaicFwdConfig(block_m=128)  # one warpgroup holds 64 rows
  with pytest.raises(ValueError):
    MosaicFwdConfig(block_n=96)
  with pytest.raises(ValueError):
    MosaicFwdConfig(num_stages=1)
  with pytest.raises(ValueError):
    MosaicFwdConfig(block_n=128, epilogue_split=4)  # 32-column chunks
  with pytest.raises(ValueError):
    MosaicFwdConfig(block_n=192, epilogue_split=2)
  with pytest.raises(ValueError):
    MosaicFwdConfig(epilogue_split=3)
  with pytest.raises(ValueError):
    MosaicFwdConfig(delay_release=2)
  with pytest.raises(ValueError):  # chaining tiles releases each stage at once
    MosaicFwdConfig(128, num_compute_wgs=2, pipeline_across_tiles=True)
  with pytest.raises(ValueError):
    MosaicFwdConfig(64, delay_release=0, pipeline_across_tiles=True)
  two = dict(block_m=64, num_compute_wgs=2, epilogue_split=2, split_n=True)
  MosaicFwdConfig(**two)
  for bad in (dict(two, block_m=128), dict(two, num_compute_wgs=1),
              dict(two, block_n=192), dict(two, epilogue_split=1),
              dict(two, skip_empty_halves=True)):
    with pytest.raises(ValueError, match="split_n|block_m"):
      MosaicFwdConfig(**bad)


@pytest.mark.parametrize(
    "m,k,n,g,transpose_rhs",
    [(32768, 2048, 1536, 128, False), (32768, 2048, 768, 128, True),
     (32768, 7168, 2048, 256, True), (8192, 1536, 2048, 128, True),
     (512, 2048, 1536, 128, False), (64, 16, 16, 4096, False),
     (4096, 2048, 640, 8, False)],  # block_n 128: split_n chunks stay >= 64 columns
)
def test_configs_fit_smem(m, k, n, g, transpose_rhs):
  for out_dtype in (jnp.bfloat16, jnp.float32):
    cfg = mosaic_fwd.default_config(m, k, n, g, jnp.bfloat16, transpose_rhs, out_dtype)
    assert cfg.smem_bytes(jnp.bfloat16, out_dtype) <= 227 * 1024
    sweep = mosaic_fwd.gpu_sweep_configs(m, k, n, g, transpose_rhs, jnp.bfloat16, out_dtype)
    assert sweep and sweep[0] == cfg and len(sweep) <= (27 if transpose_rhs else 23)
    assert len(set(sweep)) == len(sweep)
    assert all(c.smem_bytes(jnp.bfloat16, out_dtype) <= 227 * 1024 for c in sweep)


def test_default_and_sweep_on_qwen_shapes():
  for m, k, n, tr in [(32768, 2048, 1536, False), (32768, 768, 2048, False),
                      (32768, 2048, 768, True)]:
    cfg = mosaic_fwd.default_config(m, k, n, 128, jnp.bfloat16, tr)
    # The 2-warpgroup 128x256 tile gets 4 stages through a split epilogue.
    assert cfg == MosaicFwdConfig(128, 256, 64, 4, grid_tile_width=4, num_compute_wgs=2,
                                  epilogue_split=2)
    sweep = mosaic_fwd.gpu_sweep_configs(m, k, n, 128, tr)
    assert MosaicFwdConfig(64, 256, 64, 4, grid_tile_width=4) in sweep
  # f32 output: 4 stages still fit with the epilogue split in 4 (192 + 32 KiB).
  cfg = mosaic_fwd.default_config(32768, 2048, 1536, 128, jnp.bfloat16, False, jnp.float32)
  assert (cfg.num_stages, cfg.epilogue_split) == (4, 4)
  # A single k step: one warpgroup.
  assert mosaic_fwd.default_config(4096, 64, 512, 8, jnp.bfloat16, False).num_compute_wgs == 1


@pytest.mark.parametrize("m,k,n,g,rows,deep", [
    (32768, 7168, 2048, 256, (144, 160), (5,)),  # DeepSeek-V3 down's dX, ~128 rows per group
    (8192, 1536, 2048, 128, (80, 80), (5, 6))])  # Qwen3-30B gate_up's at 1024 tokens, ~64
def test_dx_sweep_offers_the_fitted_swap_tiles_on_more_stages(m, k, n, g, rows, deep):
  # Bytes-bound dX calls ran 2-6% faster on 5 / 6 stages (docs/performance.md v43c-g):
  # each fitted form (folded tail, then one tile) comes with its rings of 5 and 6
  # stages that fit (6 does not beside 160-row tiles), on top of the 23 others; the
  # forward sweep has none (its 5 stages lost, v43d).
  sweep = mosaic_fwd.gpu_sweep_configs(m, k, n, g, True)
  fitted = [c for c in sweep if c.swap and c.swap_rows < 256]
  stages = (4,) + deep
  assert [(c.swap_rows, c.num_stages) for c in fitted] == [
      (r, st) for r in rows for st in stages]
  first = fitted[:len(stages)]
  assert first[1:] == [dataclasses.replace(first[0], num_stages=st) for st in deep]
  assert len(sweep) == 23 + 2 * len(deep)
  for c in fitted:
    if c.num_stages > 4:
      assert c.smem_bytes(jnp.bfloat16, jnp.bfloat16) <= c.smem_budget()
      assert_gmm_lowers(c, m=m, k=k, n=n, g=g, transpose_rhs=True)
  forward = mosaic_fwd.gpu_sweep_configs(m, n, k, g, False)
  assert len(forward) <= 23
  assert all(c.num_stages == 4 for c in forward if c.swap and c.swap_rows < 256)


# Qwen3-30B gate_up and down, forward and dX (rhs read transposed), bf16 out;
# f32 out (larger epilogue splits) on gate_up forward.
@pytest.mark.parametrize(
    "k,n,transpose_rhs,out_dtype",
    [(2048, 1536, False, jnp.bfloat16), (2048, 1536, True, jnp.bfloat16),
     (768, 2048, False, jnp.bfloat16), (768, 2048, True, jnp.bfloat16),
     (2048, 1536, False, jnp.float32),
     # gpt-oss down / gate_up dX: 192-column tiles, 128-column rings past n
     (2880, 2880, False, jnp.bfloat16), (2880, 5760, True, jnp.bfloat16)],
)
def test_sweep_lowers_for_sm90(k, n, transpose_rhs, out_dtype):
  m, g = 32768, 128
  for cfg in mosaic_fwd.gpu_sweep_configs(m, k, n, g, transpose_rhs, jnp.bfloat16, out_dtype):
    assert_gmm_lowers(cfg, m=m, k=k, n=n, g=g, transpose_rhs=transpose_rhs, with_offset=True,
                      out_dtype=out_dtype)


@pytest.mark.parametrize("m,k,n", [(4088, 192, 320), (5, 64, 64), (4096, 2048, 1536)])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_every_accepted_shape_lowers_for_sm90(m, k, n, transpose_rhs):
  """What _check_supported accepts must pass the real sm90 lowering (layout checks)."""
  assert_gmm_lowers(None, m=m, k=k, n=n, g=16, transpose_rhs=transpose_rhs)


def test_two_ctas_per_sm_halves_the_smem_budget():
  one = MosaicFwdConfig(64, 128, 64, 3, grid_tile_width=4)
  two = dataclasses.replace(one, ctas_per_sm=2)
  assert two.smem_budget() < one.smem_budget() // 2
  assert two.smem_bytes(jnp.bfloat16, jnp.bfloat16) <= two.smem_budget()
  # 4 stages of 64x256x64 fit one CTA per SM but not two.
  big = MosaicFwdConfig(64, 256, 64, 4, ctas_per_sm=2)
  assert mosaic_fwd.fit_config(big, jnp.bfloat16, jnp.bfloat16).num_stages < 4
  with pytest.raises(ValueError, match="ctas_per_sm"):
    MosaicFwdConfig(128, 256, 64, 4, num_compute_wgs=2, ctas_per_sm=2)


def test_two_ctas_per_sm_config_runs():
  cfg = MosaicFwdConfig(64, 128, 32, 3, grid_tile_width=2, ctas_per_sm=2, num_sms=3)
  _run_and_check(96, 64, 128, [20, 0, 41, 30], config=cfg)


def test_two_warpgroups_without_the_skip():
  cfg = dataclasses.replace(CFG2, skip_empty_halves=False)
  _run_and_check(160, 64, 64, [0, 70, 3, 0, 60, 11], offset=1, g_local=4, config=cfg,
                 out_dtype=jnp.bfloat16)
  sweep = mosaic_fwd.gpu_sweep_configs(32768, 2048, 1536, 128, False)
  base = sweep[0]
  assert not base.skip_empty_halves  # measured 2-3% faster on gate_up (2026-11-29)
  assert sum(c.split_n and c.block_m == 64 for c in sweep) == 2
  assert sweep[1:4] == [
      dataclasses.replace(base, skip_empty_halves=True),
      dataclasses.replace(base, delay_release=0, pipeline_across_tiles=True),
      dataclasses.replace(base, delay_release=0)]
  assert dataclasses.replace(base, grid_minor_dim=1, grid_tile_width=8) in sweep
  # 6 k steps of 64 over 4 stages cannot chain: no chained candidate.
  sweep = mosaic_fwd.gpu_sweep_configs(32768, 384, 1536, 128, False)
  assert not any(c.pipeline_across_tiles for c in sweep)


@pytest.mark.parametrize("n", [2880, 5760])
def test_sweep_offers_the_rings_where_the_default_tile_is_192_wide(n):
  # gpt-oss (k 2880; n 2880 / 5760 = 15 / 30 x 192): the default's 192-column
  # tiles, and the ring in them; the ring's tails and swap in 128-column tiles.
  for tr in (False, True):
    sweep = mosaic_fwd.gpu_sweep_configs(16384, 2880, n, 128, tr)
    assert sweep[0].block_n == 192 and not sweep[0].ring
    assert any(c.ring and c.block_n == 192 and not c.tail_rows for c in sweep)
    assert any(c.ring and c.block_n == 128 and c.tail_rows == 32 and not c.swap for c in sweep)
    assert any(c.swap and c.share_rows for c in sweep)
    assert {c.swap_rows for c in sweep if c.swap} == {256, 144, 160}  # 128 rows per group
    assert any(c.split_n for c in sweep)


def test_default_is_one_warpgroup_below_128_rows():
  assert mosaic_fwd.default_config(64, 2048, 1536, 128, jnp.bfloat16, False).num_compute_wgs == 1
  assert mosaic_fwd.default_config(128, 2048, 1536, 128, jnp.bfloat16, False).num_compute_wgs == 2
