"""The forward / dX kernel with the rows on wgmma's N axis
(``MosaicFwdConfig(ring=True, swap=True)``, ``mosaic_fwd_swap``) in Mosaic GPU
interpret mode on CPU: against the f32 oracle, the race detector, the config
checks and its lowering for sm90."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from sm90_lowering import assert_gmm_lowers
from ragdot.backends import mosaic_fwd as mf

CFG = mf.MosaicFwdConfig(block_m=128, block_n=128, block_k=64, num_stages=2, num_compute_wgs=2,
                         ring=True, swap=True, num_sms=3)
# How a folded tail runs: more wgmma N (one wgmma), two halves, or row-major on wgmma M.
TAIL = {"fold": {}, "split": dict(tail_split=True), "m": dict(tail_on_m=True)}


@pytest.mark.parametrize("sizes,m,k,n,offset,num_local,transpose_rhs,tail_rows,tail", [
    # 300 = 256 + 44 (a tail item at 32, folded at 64), 10 (one short tile), 520 (its
    # tiles start at row 304, the 8-row granule: 256 + 256 + 14), an empty group,
    # 280 = 256 + 24; n: a 64-column half tile
    ([300, 10, 520, 0, 280], 1280, 128, 192, None, 5, False, 0, "fold"),
    ([300, 10, 520, 0, 280], 1280, 128, 192, None, 5, False, 32, "fold"),
    ([300, 10, 520, 0, 280], 1280, 128, 192, None, 5, True, 64, "fold"),    # dX
    # 296 = 256 + 40 (a tail item), 264 = 256 + 8 from row 296 (folded at 8)
    ([296, 264, 0, 40], 640, 192, 320, None, 4, True, 8, "fold"),
    ([150, 20, 300, 30], 768, 64, 256, 1, 2, False, 16, "fold"),  # a shard: zero rows around it
    ([40, 300, 9, 200], 768, 64, 128, 3, 1, True, 0, "fold"),     # the last group: rows past the end
    ([129, 7, 60, 136, 40], 400, 128, 128, None, 5, False, 16, "fold"),  # rows past the groups
    # split folded tiles: two wgmmas of 144 (160, 136) rows, stores of 64 + 64 + 16 (32, 8)
    ([300, 10, 520, 0, 280], 1280, 128, 192, None, 5, False, 32, "split"),
    ([300, 10, 520, 0, 280], 1280, 128, 192, None, 5, True, 64, "split"),
    ([150, 20, 270, 30], 768, 64, 256, 1, 2, False, 16, "split"),
    # the tail on wgmma's M axis (first consumer): 32, 8 and 16 rows folded, dX, a
    # shard, rows past the groups (272 = 256 + 16 and 270 = 256 + 14 from row 288)
    ([300, 10, 520, 0, 280], 1280, 128, 192, None, 5, False, 32, "m"),
    ([296, 264, 0, 40], 640, 192, 320, None, 4, True, 8, "m"),
    ([150, 20, 270, 30], 768, 64, 256, 1, 2, True, 16, "m"),
    ([272, 16, 270, 30], 640, 128, 128, None, 4, False, 16, "m"),
])
def test_matches_oracle(sizes, m, k, n, offset, num_local, transpose_rhs, tail_rows, tail,
                       swap_rows=256, swizzled=False, short_tile_rows=0):
  rshape = (num_local, n, k) if transpose_rhs else (num_local, k, n)
  x, w = oracle.random_inputs(jax.random.key(m + n + k), [(m, k), rshape], jnp.bfloat16)
  go = None if offset is None else jnp.int32(offset)
  # producer_zeros=False: shard calls stay swap (None would run the row-major ring).
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), go, transpose_rhs=transpose_rhs,
               out_dtype=jnp.bfloat16, interpret=True,
               config=dataclasses.replace(CFG, tail_rows=tail_rows, producer_zeros=False,
                                          swap_rows=swap_rows, swizzle_staging=swizzled,
                                          short_tile_rows=short_tile_rows, **TAIL[tail]))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, go, transpose_rhs), jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, offset, num_local)


@pytest.mark.parametrize("sizes,m,k,n,offset,num_local,transpose_rhs,tail_rows,tail,swap_rows", [
    # Tiles of 144 rows (wgmma N = 144; stores of 64 + 64 + 16): 130 rows from row 0 and
    # 140 from row 130 (its tile starts at 128: 142 rows), 150 from row 270 (its tiles
    # start at 264: 144 + 12, a tail item),
    # an empty group; the zero blocks of a shard are 144 rows too (3 chunks, the last cut).
    ([130, 140, 150, 0, 60], 640, 128, 192, None, 5, False, 0, "fold", 144),
    ([130, 140, 150, 0, 60], 640, 128, 192, None, 5, True, 0, "fold", 144),   # dX
    ([100, 150, 20, 140], 512, 64, 128, 1, 2, False, 0, "fold", 144),   # a shard
    # 144 + 16 folded: 150 and 158 rows (from rows 130 and 280) fold their last rows
    ([130, 150, 158, 40], 640, 128, 128, None, 4, False, 16, "m", 144),
    ([130, 150, 158, 40], 640, 128, 128, None, 4, True, 16, "split", 144),  # halves of 80
    ([100, 150, 20, 140], 512, 64, 128, 0, 3, True, 16, "m", 144),   # a shard, dX
    # 160-row tiles (64 + 64 + 32 stores) and the smallest, 64 (one chunk; 8 folded rows)
    ([130, 140, 150, 0, 60], 640, 128, 192, None, 5, False, 0, "fold", 160),
    ([70, 60, 0, 75, 9], 320, 64, 128, None, 5, False, 8, "fold", 64),
    ([70, 60, 0, 75, 9], 320, 64, 128, 1, 3, True, 0, "fold", 64),
    # 80 + 16 split (groups of ~64 rows, tail_fold_groups): 88 and 96 rows (from rows 0
    # and 88) fold 8 / 16, 100 rows is two tiles, 40 one 80-row tile; rows past the groups
    ([88, 96, 0, 100, 40], 400, 128, 192, None, 5, False, 16, "split", 80),
    ([88, 96, 0, 100, 40], 400, 64, 128, 1, 3, True, 16, "split", 80),  # a shard, dX
])
def test_fewer_rows_per_tile_match_oracle(sizes, m, k, n, offset, num_local, transpose_rhs,
                                          tail_rows, tail, swap_rows):
  test_matches_oracle(sizes, m, k, n, offset, num_local, transpose_rhs, tail_rows, tail,
                      swap_rows)


@pytest.mark.parametrize("sizes,m,k,n,offset,num_local,transpose_rhs,tail_rows,tail,swap_rows", [
    ([300, 10, 520, 0, 280], 1280, 128, 192, None, 5, False, 32, "split", 256),
    ([300, 10, 520, 0, 280], 1280, 128, 192, None, 5, True, 64, "fold", 256),   # dX
    ([296, 264, 0, 40], 640, 192, 320, None, 4, True, 8, "fold", 256),  # 8-row fold
    ([150, 20, 300, 30], 768, 64, 256, 1, 2, False, 16, "split", 256),  # a shard: zero rows
    ([129, 7, 60, 136, 40], 400, 128, 128, None, 5, False, 16, "fold", 256),  # rows past the groups
    ([300, 10, 520, 0, 280], 1280, 128, 192, None, 5, False, 32, "m", 256),
    ([272, 16, 270, 30], 640, 128, 128, None, 4, True, 16, "m", 256),
    ([130, 150, 158, 40], 640, 128, 128, None, 4, True, 16, "split", 144),
    ([100, 150, 20, 140], 512, 64, 128, 1, 2, False, 0, "fold", 144),   # a shard, 144-row blocks
])
def test_swizzled_staging_matches_oracle(sizes, m, k, n, offset, num_local, transpose_rhs,
                                         tail_rows, tail, swap_rows):
  # The swizzled staging buffer: stores of 1-64 rows from any of its rows (tiles
  # start up to 7 rows before their group), zero rows of a shard.
  test_matches_oracle(sizes, m, k, n, offset, num_local, transpose_rhs, tail_rows, tail,
                      swap_rows, swizzled=True)


# Short tiles: groups of 5, 60 and 33 rows (one short tile each; 60 from row 5: its tile
# starts at row 0, 65 rows, short only at 128), 130 (from row 65: its tile starts at 64,
# 131 rows > 128: plain), 300 = 256 + 44 (44 > tail_rows: a short last tile of 44 rows
# from row 451, 8-aligned at 448: 47), empty groups, a shard, rows past the groups.
SKEWED = [5, 60, 0, 130, 300, 33, 0, 200]


@pytest.mark.parametrize("short,m,offset,num_local,transpose_rhs,tail_rows,tail,swizzled", [
    (128, 768, None, 8, False, 32, "split", True),
    (64, 768, None, 8, False, 32, "split", True),
    (128, 768, None, 8, True, 16, "m", False),   # dX, the tail row-major on the first consumer
    (64, 768, None, 8, True, 0, "fold", True),  # dX, no tail
    (128, 800, 2, 4, False, 32, "split", True),  # a shard (zero rows), rows past the groups
    (64, 800, 3, 4, True, 8, "m", True),
])
def test_short_tiles_match_oracle(short, m, offset, num_local, transpose_rhs, tail_rows, tail,
                                  swizzled):
  sizes = SKEWED[:num_local] if offset is None else SKEWED
  test_matches_oracle(sizes, m, 128, 192, offset, num_local, transpose_rhs, tail_rows, tail,
                      swizzled=swizzled, short_tile_rows=short)


# Short tiles beside tiles of fewer than 256 rows (DeepSeek-V3's ~128-row groups): with
# 160-row tiles and 128-row short ones, 100 rows (from row 0) and 120 (from row 100: its
# tile starts at 96, 124 rows) are short, 150 (from row 220, 8-aligned at 216: 154 rows)
# is one 160-row tile, 200 (from row 370, at 368: 160 + 42) a plain tile and a short one;
# with 176-row tiles 169 rows fit one tile (from row 570, at 568: 171).
@pytest.mark.parametrize("swap_rows,short,transpose_rhs,offset,num_local", [
    (160, 128, False, None, 6), (160, 128, True, None, 6), (160, 64, True, None, 6),
    (176, 128, False, 1, 3), (176, 128, True, None, 6)])
def test_short_tiles_with_fewer_rows_per_tile(swap_rows, short, transpose_rhs, offset,
                                              num_local):
  sizes = [100, 120, 150, 200, 169, 0]
  test_matches_oracle(sizes, 768, 128, 192, offset, num_local,
                      transpose_rhs, 0, "fold", swap_rows=swap_rows, swizzled=True,
                      short_tile_rows=short)


def test_short_tile_rows_checked():
  for bad in (32, 96, 256):
    with pytest.raises(ValueError, match="short_tile_rows"):
      dataclasses.replace(CFG, short_tile_rows=bad)
  with pytest.raises(ValueError, match="short_tile_rows"):
    dataclasses.replace(CFG, swap_rows=128, short_tile_rows=128)
  with pytest.raises(ValueError, match="short_tile_rows"):
    dataclasses.replace(CFG, swap=False, block_n=256, short_tile_rows=64)
  # The row-major counterpart (shard calls with producer zeros, f32 outputs) drops it.
  assert mf.row_major_ring(dataclasses.replace(CFG, short_tile_rows=64)).short_tile_rows == 0


def test_swizzled_staging_no_races():
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  sizes = [280, 7, 0, 60, 150]
  x, w = oracle.random_inputs(jax.random.key(5), [(640, 128), (4, 128, 128)], jnp.bfloat16)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), jnp.int32(0), transpose_rhs=False,
               out_dtype=jnp.bfloat16, interpret=plgpu.InterpretGPUParams(detect_races=True),
               config=dataclasses.replace(CFG, tail_rows=32, num_sms=2, tail_split=True,
                                          producer_zeros=False, swizzle_staging=True))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, jnp.int32(0), False),
                      jnp.bfloat16)
  assert not gpu_interpret.get_races().races_found


def test_swizzle_staging_needs_swap():
  with pytest.raises(ValueError, match="swizzle_staging"):
    dataclasses.replace(CFG, swap=False, block_n=256, swizzle_staging=True)
  # The row-major ring that runs a swap config's shard calls drops it.
  assert not mf.row_major_ring(dataclasses.replace(CFG, swizzle_staging=True)).swizzle_staging


@pytest.mark.parametrize("tail,swap_rows,short", [(t, 256, 0) for t in sorted(TAIL)]
                         + [("m", 144, 0), ("split", 256, 128), ("m", 256, 64)])
def test_no_races(tail, swap_rows, short):
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  sizes = [280, 7, 60, 150]
  x, w = oracle.random_inputs(jax.random.key(3), [(640, 128), (4, 128, 128)], jnp.bfloat16)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), None, transpose_rhs=False,
               out_dtype=jnp.bfloat16, interpret=plgpu.InterpretGPUParams(detect_races=True),
               config=dataclasses.replace(CFG, tail_rows=32 if swap_rows == 256 else 16,
                                          num_sms=2, swap_rows=swap_rows,
                                          short_tile_rows=short, **TAIL[tail]))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, None, False), jnp.bfloat16)
  assert not gpu_interpret.get_races().races_found


def test_f32_output_and_small_m_do_not_run_swap(monkeypatch):
  # A 32-bit output (the transposed stores take 16 bits) runs the row-major ring, and
  # m < 256 + tail_rows the default config: the swap kernel is never entered.
  from ragdot.backends import mosaic_fwd_swap  # pylint: disable=g-import-not-at-top

  def refuse(*args, **kwargs):
    raise AssertionError("the swap kernel ran")

  monkeypatch.setattr(mosaic_fwd_swap, "gmm", refuse)
  # f32 with m = 384 >= 256 + 32 (only the dtype rules swap out; its 4-stage row-major
  # ring is refitted to SMEM for the f32 staging); bf16 with m = 256 < 256 + 16.
  for m, sizes, out_dtype, tail, stages in ((384, [100, 250], jnp.float32, 32, 4),
                                            (256, [100, 150], jnp.bfloat16, 16, 2)):
    x, w = oracle.random_inputs(jax.random.key(m), [(m, 64), (2, 64, 128)], jnp.bfloat16)
    out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), None, transpose_rhs=False,
                 out_dtype=out_dtype, interpret=True,
                 config=dataclasses.replace(CFG, tail_rows=tail, tail_split=True,
                                            num_stages=stages))
    assert out.dtype == out_dtype
    oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, None, False), out_dtype)
  # The f32 refit of a swap config is its row-major ring; the 16-bit one is unchanged.
  split = dataclasses.replace(CFG, num_stages=4, tail_rows=32, tail_split=True)
  assert mf.fit_config(split, jnp.bfloat16, jnp.float32) == mf.fit_config(
      mf.row_major_ring(split), jnp.bfloat16, jnp.float32)
  assert mf.fit_config(split, jnp.bfloat16, jnp.bfloat16) == split


def test_swap_tiles_fit_the_rows_per_group():
  # The Qwen3-30B gate_up entry (256 + 32 folded rows, shared rows) on a call
  # with half its rows per group: one 160-row tile per group of ~128.
  entry = dataclasses.replace(CFG, num_sms=None, tail_rows=32, tail_split=True,
                              short_tile_rows=128, share_rows=True, swizzle_staging=True)
  fitted = mf.fit_rows_per_group(entry, 16384, 128)
  assert fitted == mf.one_tile_groups(entry, 160) == dataclasses.replace(
      entry, swap_rows=160, tail_rows=0, tail_split=False, short_tile_rows=64,
      share_rows=False)
  assert mf.fit_rows_per_group(entry, 32768, 128) == entry  # ~256 rows: its own size
  # ~64 rows: 80 + 16 rows folded as a split tail, no short tiles.
  few = mf.fit_rows_per_group(entry, 8192, 128)
  assert few == mf.tail_fold_groups(entry, 80) == dataclasses.replace(
      entry, swap_rows=80, tail_rows=16, tail_split=True, short_tile_rows=0,
      share_rows=False)
  assert mf.fit_rows_per_group(few, 8192, 128) == few
  assert mf.fit_rows_per_group(entry, 5000, 128) == entry  # ~39 rows: not measured, kept
  assert mf.fit_rows_per_group(entry, 90, 1) == entry  # fewer rows than one fitted tile
  assert mf.fit_rows_per_group(fitted, 16384, 128) == fitted
  assert mf.fit_rows_per_group(fitted, 8192, 128) == mf.tail_fold_groups(fitted, 80)
  row_major = mf.MosaicFwdConfig(128, 256, 64, 4, num_compute_wgs=2, ring=True)
  assert mf.fit_rows_per_group(row_major, 16384, 128) == row_major
  assert [mf.swap_rows_for_mean(r) for r in (40, 100, 128, 150, 300)] == [64, 128, 160, 192, 256]
  # Every swap entry of the table already has the fitted form on its own shape.
  from ragdot import tables  # pylint: disable=g-import-not-at-top
  table, _ = tables.table_for("NVIDIA H200", "9.0")
  for key, entry in table.entries.items():
    op, _, (m, _, _, g) = tables.parse_key(key)
    if entry["backend"] == "mosaic" and op != "tgmm" and (entry.get("config") or {}).get("swap"):
      cfg = mf.MosaicFwdConfig(**entry["config"])
      assert mf.fit_rows_per_group(cfg, *entry["shape"][::3]) == cfg, key


def test_shard_keeps_swap_on_96_to_288_row_groups():
  entry = dataclasses.replace(CFG, num_sms=None, swap_rows=160, short_tile_rows=64,
                              swizzle_staging=True)
  gpt_oss = (2880, 2880)  # an expert's (k, n) (gpt-oss-120b down): 16.6 MB
  kept = mf.shard_keeps_swap(entry, 16384, 128, *gpt_oss, 2)
  assert kept == dataclasses.replace(entry, producer_zeros=False, zero_front=0)
  assert mf.resolve_producer_zeros(kept, True, jnp.bfloat16, jnp.bfloat16) == kept
  # over 192 rows per group the shard's rows pick swap or the ring at run time
  gated = dataclasses.replace(kept, shard_ring_above=1.25, pair_schedule=True)
  # Forward: ~64 rows per group, Qwen3-30B gate_up's 6 MB experts at ~128, and ~256
  # where the output is narrower than the contraction (gate_up): the ring as before
  gate_up, down = (2048, 1536), (768, 2048)  # Qwen3-30B's forward calls
  for m, (k, n) in ((8192, gpt_oss), (16384, gate_up), (32768, gate_up),
                    (32768, (4096, 3072))):
    same = mf.shard_keeps_swap(entry, m, 128, k, n, 2)
    assert same == entry, (m, k, n)
    assert not mf.resolve_producer_zeros(same, True, jnp.bfloat16, jnp.bfloat16).swap
  # ... and swap on ~256 rows where n >= k (the down projections), small experts too,
  # up to 288 rows, not past
  for m, (k, n) in ((32768, down), (32768, (1536, 4096)), (32768, gpt_oss), (36864, down)):
    assert mf.shard_keeps_swap(entry, m, 128, k, n, 2) == gated, (m, k, n)
  assert mf.shard_keeps_swap(entry, 36992, 128, *down, 2) == entry
  assert mf.shard_keeps_swap(entry, 16384, 128, *down, 2) == entry  # ~128 rows, 3 MB
  # gpt-oss's experts in f32 would be 33 MB, in a 1-byte type 8 MB: the size is in bytes
  assert mf.shard_keeps_swap(entry, 16384, 128, *gpt_oss, 1) == entry
  explicit = dataclasses.replace(CFG, num_sms=None, swap=False, block_n=256, producer_zeros=True)
  assert mf.shard_keeps_swap(explicit, 16384, 128, *gpt_oss, 2) == explicit
  # dX shards (k the contraction, n the output width) keep swap on groups of 96-192
  # rows, small experts included, and of 192-288 where n >= k (the gate_up
  # projections' dX); not on ~64 or ~512, nor on down's dX (n < k) at ~256.
  gate_up_dx, down_dx = (1536, 2048), (2048, 768)  # Qwen3-30B's dX calls
  for m, (k, n) in ((16384, gate_up_dx), (16384, down_dx), (16384, gpt_oss), (24576, down_dx)):
    assert mf.shard_keeps_swap(entry, m, 128, k, n, 2, transpose_rhs=True) == kept, (m, k, n)
  for m, (k, n) in ((32768, gate_up_dx), (36864, gate_up_dx), (32768, (2048, 2048))):
    assert mf.shard_keeps_swap(entry, m, 128, k, n, 2, transpose_rhs=True) == gated, (m, k, n)
  for m, (k, n) in ((8192, gate_up_dx), (12160, gate_up_dx), (36992, gate_up_dx),
                    (65536, gate_up_dx), (32768, down_dx), (24704, down_dx),
                    (32768, (4096, 1536))):  # 64, 95, 289, 512 rows; down at 256, 193
    assert mf.shard_keeps_swap(entry, m, 128, k, n, 2, transpose_rhs=True) == entry, (m, k, n)
  assert mf.shard_keeps_swap(entry, 12288, 128, *gate_up_dx, 2, transpose_rhs=True) == kept
  assert mf.shard_keeps_swap(explicit, 32768, 128, *gate_up_dx, 2,
                             transpose_rhs=True) == explicit
  # A limit set already stays, with its pair_schedule, on ~256 and ~128 rows alike.
  paired = dataclasses.replace(entry, shard_ring_above=2.0, pair_schedule=True)
  for m, (k, n) in ((32768, down), (16384, gpt_oss)):
    assert mf.shard_keeps_swap(paired, m, 128, k, n, 2) == dataclasses.replace(
        kept, shard_ring_above=2.0, pair_schedule=True), (m, k, n)


def _h200_qwen30b_dx_shard_config(m: int, k: int, n: int) -> mf.MosaicFwdConfig:
  """The config the dispatcher hands an EP=8 shard (16 of 128 groups) of the dX of
  forward projection (m, k, n) on an H200: the gmm call of k and n swapped."""
  from ragdot import dispatch  # pylint: disable=g-import-not-at-top
  h200 = dispatch.Device("gpu", "NVIDIA H200", "9.0")
  dispatch.clear_cache()
  return dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=h200, has_offset=True,
                         transpose_rhs=True, m=m, k=n, n=k, g=16, num_groups=128).config


@pytest.mark.parametrize("m,k,n", [(32768, 2048, 1536), (16384, 768, 2048)],
                         ids=["gate_up", "down_2k"])
def test_qwen30b_dx_shard_keeps_swap_and_lowers_for_sm90(m, k, n):
  # What the dispatcher hands the dX shards of Qwen3-30B gate_up (EP=8, ~256 rows per
  # group) and down at 2048 tokens (~128 rows): the full call's swap entry with
  # consumer-written zeros.
  cfg = _h200_qwen30b_dx_shard_config(m, k, n)
  assert cfg.swap and cfg.producer_zeros is False
  assert_gmm_lowers(cfg, m=m, k=n, n=k, g=128, local=16, with_offset=True,
                    transpose_rhs=True)


def test_gated_pair_under_vmap():
  """vmap over the tokens of a gated shard call (swap's kernel batches through
  plgpu.kernel, the in-place ring one batch element at a time): every element the
  oracle, for a shard within the row limit (swap) and one over it (the ring)."""
  sizes, m, k, n, num_local = [150, 20, 300, 30], 768, 64, 256, 2
  xs, w = oracle.random_inputs(jax.random.key(11), [(2, m, k), (num_local, k, n)],
                               jnp.bfloat16)
  cfg = dataclasses.replace(CFG, tail_rows=16, producer_zeros=False, shard_ring_above=0.5)
  gs = jnp.asarray(sizes, jnp.int32)
  for offset in (0, 1):  # 170 rows (at most 0.5 x 384 = 192: swap), 320 (over: the ring)
    go = jnp.int32(offset)
    out = jax.vmap(lambda x: mf.gmm(x, w, gs, go, transpose_rhs=False, out_dtype=jnp.bfloat16,
                                    interpret=True, config=cfg))(xs)
    for i in range(2):
      oracle.assert_close(out[i], oracle.ref_ragged_dot(xs[i], w, sizes, go, False),
                          jnp.bfloat16)


def test_in_place_kernel_fenced_by_barriers_in_loops():
  """Under lax.map and vmap (loops whose outputs are stacked) the in-place ring's
  aliased operand comes out of an optimization barrier and its result goes into
  one, as lowered for CUDA: without them XLA's dynamic-slice fusion had the
  kernel write into the stacked buffer without the operand's contents (on the
  H200, docs/performance.md v46b-d)."""
  cfg = dataclasses.replace(CFG, tail_rows=16, producer_zeros=False, shard_ring_above=0.5,
                            pair_schedule=True)
  m, k, n, g = 768, 64, 256, 4
  args = (jax.ShapeDtypeStruct((2, m, k), jnp.bfloat16),
          jax.ShapeDtypeStruct((2, k, n), jnp.bfloat16), jax.ShapeDtypeStruct((g,), jnp.int32))
  call = lambda x, w, gs: mf.gmm(x, w, gs, jnp.int32(1), transpose_rhs=False,
                                 out_dtype=jnp.bfloat16, config=cfg)
  loops = {"map": lambda xs, w, gs: jax.lax.map(lambda x: call(x, w, gs), xs),
           "vmap": jax.vmap(call, in_axes=(0, None, None))}
  for name, loop in loops.items():
    text = jax.jit(loop).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    aliased = [line for line in text.splitlines()
               if "stablehlo.custom_call @mosaic_gpu" in line and "output_operand_aliases" in line]
    assert len(aliased) == 1, (name, len(aliased))
    result, operands = re.match(r"\s*(%[\w#:]+) = stablehlo.custom_call @\w+\(([^)]*)\)",
                                aliased[0]).groups()
    operand = operands.split(", ")[-1]
    assert re.search(rf"{re.escape(operand.split('#')[0])}(:\d+)? = stablehlo.optimization_barrier",
                     text), (name, operand)
    assert re.search(rf"stablehlo.optimization_barrier {re.escape(result)}\b", text), (name, result)


def test_gated_shard_below_the_rings_rows_runs_swap_alone(monkeypatch):
  """The ring's loads take 128 rows: a gated shard call of fewer (96, 64-row swap
  tiles) runs swap alone, ungated."""
  from ragdot.backends import mosaic_fwd_ring  # pylint: disable=g-import-not-at-top

  def no_ring(*a, **kw):
    raise AssertionError("the ring was launched")

  monkeypatch.setattr(mosaic_fwd_ring, "gmm", no_ring)
  cfg = dataclasses.replace(CFG, swap_rows=64, tail_rows=16, producer_zeros=False,
                            shard_ring_above=1.0)
  x, w = oracle.random_inputs(jax.random.key(5), [(96, 64), (2, 64, 256)], jnp.bfloat16)
  sizes = [40, 30, 20, 6]
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), jnp.int32(1), transpose_rhs=False,
               out_dtype=jnp.bfloat16, interpret=True, config=cfg)
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, 1, False), jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, 1, 2)


def test_shard_row_limit_is_the_share_rounded_down():
  assert mf.shard_row_limit(768, 2, 4, 0.83) == 318  # 0.83 x 384
  assert mf.shard_row_limit(32768, 16, 128, 1.25) == 5120
  assert mf.shard_row_limit(768, 2, 0, 1.0) == 1536  # no groups: no division by 0


@pytest.mark.parametrize("ring_kernel,limit,above", [
    (True, 319, True), (True, 320, True), (False, 320, False), (False, 319, False)])
def test_row_gate_runs_the_kernel_only_on_its_side(ring_kernel, limit, above):
  """A gated kernel writes all m rows when its gate opens (the shard's 320 rows
  above / at most ``limit``) and not one when it is closed (the sentinel stays)."""
  from ragdot.backends import mosaic_fwd_ring, mosaic_fwd_swap  # pylint: disable=g-import-not-at-top
  sizes, m, k, n, offset, num_local = [150, 20, 300, 30], 768, 64, 256, 1, 2
  x, w = oracle.random_inputs(jax.random.key(3), [(m, k), (num_local, k, n)], jnp.bfloat16)
  go, gs = jnp.int32(offset), jnp.asarray(sizes, jnp.int32)
  cfg = dataclasses.replace(CFG, tail_rows=16, producer_zeros=False)
  module = mosaic_fwd_swap
  if ring_kernel:
    cfg, module = mf.gated_pair_configs(cfg, jnp.bfloat16, jnp.bfloat16)[1], mosaic_fwd_ring
  opens = (320 > limit) if above else (320 <= limit)
  sentinel = jnp.full((m, n), 7.0, jnp.bfloat16)

  out = jax.jit(lambda x, w, gs, go, into: module.gmm(
      x, w, gs, go, transpose_rhs=False, out_dtype=jnp.bfloat16, config=cfg, interpret=True,
      gate=mosaic_fwd_ring.RowGate(limit, above), into=into))(x, w, gs, go, sentinel)
  if opens:
    oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, go, False), jnp.bfloat16)
    oracle.assert_zero_rows(out, sizes, offset, num_local)
  else:
    np.testing.assert_array_equal(np.asarray(out, np.float32), 7.0)


@pytest.mark.parametrize("transpose_rhs,above,pair", [
    (False, 0.5, False), (False, 1.0, False), (True, 0.5, False), (False, 0.5, True),
    (True, 1.0, True)])
def test_shard_ring_above_matches_oracle(transpose_rhs, above, pair, monkeypatch):
  """A shard of 2 of 4 groups with 320 of 768 rows (fair share 384): over half
  its share runs the row-major ring, within its share swap; both kernels are
  launched, on one output buffer, swap's gate open at most at the limit and
  the ring's above it (each gate alone: ``test_row_gate_runs_...``)."""
  from ragdot.backends import mosaic_fwd_ring, mosaic_fwd_swap  # pylint: disable=g-import-not-at-top
  gates = {}
  for name, module in (("swap", mosaic_fwd_swap), ("ring", mosaic_fwd_ring)):
    def spy(*a, _gmm=module.gmm, _name=name, **kw):
      gates[_name] = kw["gate"]
      return _gmm(*a, **kw)
    monkeypatch.setattr(module, "gmm", spy)
  sizes, m, k, n, offset, num_local = [150, 20, 300, 30], 768, 64, 256, 1, 2
  rshape = (num_local, n, k) if transpose_rhs else (num_local, k, n)
  x, w = oracle.random_inputs(jax.random.key(7 + transpose_rhs), [(m, k), rshape], jnp.bfloat16)
  go = jnp.int32(offset)
  cfg = dataclasses.replace(CFG, tail_rows=16, producer_zeros=False, shard_ring_above=above,
                            pair_schedule=pair)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), go, transpose_rhs=transpose_rhs,
               out_dtype=jnp.bfloat16, interpret=True, config=cfg)
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, go, transpose_rhs), jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, offset, num_local)
  limit = int(above * 384)
  assert gates == {"swap": mosaic_fwd_ring.RowGate(limit, above=False),
                   "ring": mosaic_fwd_ring.RowGate(limit, above=True)}


@pytest.mark.parametrize("pair", [False, True])
def test_shard_ring_above_lowers_for_sm90(pair):
  # Qwen3-30B down's forward shard (swap with consumer zeros, v44f) with the ring
  # launched after it on the same output: both kernels lower in one program.
  from ragdot import dispatch  # pylint: disable=g-import-not-at-top
  h200 = dispatch.Device("gpu", "NVIDIA H200", "9.0")
  dispatch.clear_cache()
  cfg = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=h200, has_offset=True,
                        m=32768, k=768, n=2048, g=16, num_groups=128).config
  assert cfg.swap and cfg.producer_zeros is False and cfg.share_rows
  assert_gmm_lowers(dataclasses.replace(cfg, shard_ring_above=2.0, pair_schedule=pair),
                    m=32768, k=768, n=2048,
                    g=128, local=16, transpose_rhs=False, with_offset=True)


def test_down_dx_shard_on_256_row_groups_runs_the_ring():
  # Qwen3-30B down's dX shard at 4096 tokens (output 768 wide, contraction 2048): the
  # row-major ring with producer zeros (0.87x swap's time, v43a).
  cfg = _h200_qwen30b_dx_shard_config(32768, 768, 2048)
  assert not cfg.swap and cfg.producer_zeros is True and cfg.block_n == 256


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_fitted_tiles_on_partial_n_tiles_lower_for_sm90(transpose_rhs):
  # What gpt-oss-120b runs: 160-row tiles over n 2880 (22.5 tiles of 128 columns),
  # and at 2048 tokens (~64 rows per group) 80 + 16.
  base = dataclasses.replace(CFG, num_sms=None, num_stages=4, epilogue_split=2,
                             swizzle_staging=True)
  assert_gmm_lowers(mf.one_tile_groups(base, 160), m=16384, k=2880, n=2880, g=128,
                    transpose_rhs=transpose_rhs)
  assert_gmm_lowers(mf.tail_fold_groups(base, 80), m=8192, k=2880, n=2880, g=128,
                    transpose_rhs=transpose_rhs)
  # An EP=8 shard of the first (swap, consumer-written zeros).
  assert_gmm_lowers(mf.shard_keeps_swap(mf.one_tile_groups(base, 160), 16384, 128,
                                        2880, 2880, 2),
                    m=16384, k=2880, n=2880, g=128, local=16, with_offset=True,
                    transpose_rhs=transpose_rhs)


def test_config_checks():
  with pytest.raises(ValueError, match="swap needs"):
    dataclasses.replace(CFG, block_n=256)
  with pytest.raises(ValueError, match="swap needs"):
    dataclasses.replace(CFG, producer_zeros=True)
  with pytest.raises(ValueError, match="tail_rows must be"):
    dataclasses.replace(CFG, swap=False, tail_rows=64)
  with pytest.raises(ValueError, match="tail_split needs"):
    dataclasses.replace(CFG, tail_rows=8, tail_split=True)
  with pytest.raises(ValueError, match="tail_on_m needs"):
    dataclasses.replace(CFG, tail_rows=64, tail_on_m=True)
  with pytest.raises(ValueError, match="tail_on_m needs"):
    dataclasses.replace(CFG, tail_rows=32, tail_split=True, tail_on_m=True)
  assert not mf.row_major_ring(dataclasses.replace(CFG, tail_rows=32, tail_on_m=True)).tail_on_m
  with pytest.raises(ValueError, match="tail_on_m needs swap_rows"):  # (its last-64-row wgmma)
    dataclasses.replace(CFG, swap_rows=32, tail_rows=16, tail_on_m=True)
  for bad in (8, 136, 272):
    with pytest.raises(ValueError, match="swap_rows needs"):
      dataclasses.replace(CFG, swap_rows=bad)
  with pytest.raises(ValueError, match="swap_rows needs"):
    dataclasses.replace(CFG, swap=False, block_n=256, swap_rows=144)
  for bad in (dict(swap=False, block_n=256), dict(shard_ring_above=0.0)):
    with pytest.raises(ValueError, match="shard_ring_above needs"):
      dataclasses.replace(CFG, **{"shard_ring_above": 2.0, **bad})
  with pytest.raises(ValueError, match="pair_schedule needs shard_ring_above"):
    dataclasses.replace(CFG, pair_schedule=True)
  ring = mf.row_major_ring(dataclasses.replace(CFG, shard_ring_above=2.0, pair_schedule=True))
  assert ring.shard_ring_above is None and not ring.pair_schedule
  # The row-major counterpart of a 144-row swap config is the plain ring.
  assert mf.row_major_ring(dataclasses.replace(CFG, swap_rows=144)).swap_rows == 256
  # SMEM follows the tile's rows.
  assert dataclasses.replace(CFG, swap_rows=144).smem_bytes(jnp.bfloat16, jnp.bfloat16) == (
      CFG.smem_bytes(jnp.bfloat16, jnp.bfloat16) - 2 * 112 * 64 * 2)
  # The tuner times both swap tails (split fold, row-major M tail) where swap runs,
  # and the split fold with each step's stage released at once (delay_release=0).
  sweep = mf.gpu_sweep_configs(32768, 2048, 1536, 128, False)
  assert [(c.tail_split, c.tail_on_m, c.delay_release) for c in sweep if c.swap] == [
      (True, False, 1), (True, False, 0), (False, True, 1)]
  # with 64-row short tiles (the tuner's routed sizes cannot show what skew costs)
  assert all(c.short_tile_rows == 64 for c in sweep if c.swap)
  assert not any(c.swap for c in mf.gpu_sweep_configs(32768, 2048, 1536, 128, False,
                                                      jnp.bfloat16, jnp.float32))
  # Groups of ~128 rows (DeepSeek-V3): also swap tiles of 144 rows with 16 split tail
  # rows and of 160 rows without (the table's entry for its dX), each also on 5 stages
  # for dX (6 do not fit beside them).
  sweep = mf.gpu_sweep_configs(32768, 7168, 2048, 256, True)
  small = [c for c in sweep if c.swap]
  assert [(c.swap_rows, c.tail_rows, c.tail_split, c.short_tile_rows, c.delay_release,
           c.num_stages) for c in small] == [
      (256, 32, True, 64, 1, 4), (256, 32, True, 64, 0, 4), (256, 32, False, 64, 1, 4),
      (144, 16, True, 0, 1, 4), (144, 16, True, 0, 1, 5), (160, 0, False, 64, 1, 4),
      (160, 0, False, 64, 1, 5)]
  # 64 tail rows fit 3 stages; 32 fit 4 (the tail's stores share the staging buffer).
  assert dataclasses.replace(CFG, tail_rows=64, num_stages=3).smem_bytes(
      jnp.bfloat16, jnp.bfloat16) <= CFG.smem_budget()
  assert dataclasses.replace(CFG, tail_rows=32, num_stages=4).smem_bytes(
      jnp.bfloat16, jnp.bfloat16) <= CFG.smem_budget()
  assert dataclasses.replace(CFG, tail_rows=64, num_stages=4).smem_bytes(
      jnp.bfloat16, jnp.bfloat16) > CFG.smem_budget()
  # A shard call runs the row-major ring with producer zeros, unless told not to.
  auto = dataclasses.replace(CFG, producer_zeros=None, tail_rows=32)
  shard = mf.resolve_producer_zeros(auto, True, jnp.bfloat16, jnp.bfloat16)
  assert shard.producer_zeros is True and not shard.swap and shard.block_n == 256
  assert not shard.tail_rows and shard.ring
  assert mf.resolve_producer_zeros(auto, False, jnp.bfloat16, jnp.bfloat16).swap
  off = dataclasses.replace(auto, producer_zeros=False)
  assert mf.resolve_producer_zeros(off, True, jnp.bfloat16, jnp.bfloat16) is off


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
@pytest.mark.parametrize("tail_rows,stages,tail,swap_rows", [
    (0, 4, "fold", 256), (32, 4, "fold", 256), (64, 3, "fold", 256), (32, 4, "split", 256),
    (16, 4, "split", 256), (32, 4, "m", 256), (0, 4, "fold", 160), (16, 4, "m", 144),
    (16, 4, "split", 144), (32, 4, "split", (256, 128)), (32, 4, "m", (256, 64)),
    (0, 4, "fold", (160, 64)), (0, 4, "fold", (160, 128)), (0, 4, "fold", (176, 128)),
    (16, 4, "split", 80)])
def test_lowers_for_sm90(transpose_rhs, tail_rows, stages, tail, swap_rows):
  m, k, n, g = 4096, 2048, 1536, 128
  swap_rows, short = swap_rows if isinstance(swap_rows, tuple) else (swap_rows, 0)
  cfg = dataclasses.replace(CFG, num_stages=stages, tail_rows=tail_rows, num_sms=132,
                            swap_rows=swap_rows, short_tile_rows=short, **TAIL[tail])
  assert_gmm_lowers(cfg, m=m, k=k, n=n, g=g, transpose_rhs=transpose_rhs)
  # Swizzled staging: boxes of 1-64 rows from any row of a swizzled buffer pass
  # Mosaic's slice checks; a shard call (with_offset) runs the row-major ring.
  for with_offset in (False, True):
    assert_gmm_lowers(dataclasses.replace(cfg, swizzle_staging=True), m=m, k=k, n=n, g=g,
                      transpose_rhs=transpose_rhs, with_offset=with_offset)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
@pytest.mark.parametrize("tail,short,n", [("split", 128, 1536), ("m", 0, 1536),
                                          ("fold", 64, 1920)])
def test_share_rows_lowers_for_sm90(transpose_rhs, tail, short, n):
  # 2-CTA clusters multicasting the tile's rows: every wgmma layout (a split fold,
  # the tail on M, short tiles), an odd count of n tiles (1920 / 128 = 15), and
  # a shard call (the row-major ring, which drops share_rows).  Not run in
  # interpret mode: two CTAs per cluster hang the interpreter (docs v23a, v32a).
  cfg = dataclasses.replace(CFG, num_stages=4, tail_rows=32, num_sms=132, swizzle_staging=True,
                            short_tile_rows=short, share_rows=True, **TAIL[tail])
  for with_offset in (False, True):
    assert_gmm_lowers(cfg, m=4096, k=2048, n=n, g=128, transpose_rhs=transpose_rhs,
                      with_offset=with_offset)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
def test_block_k_32_lowers_for_sm90(transpose_rhs):
  # Stages of 32 rows of K (the forward's weight slots then take the 64-byte
  # swizzle: wgmma's MN-major A operand allows no wider one at that K): the
  # table's layout, 8 stages, on clusters.
  cfg = dataclasses.replace(CFG, block_k=32, num_stages=8, tail_rows=32, tail_split=True,
                            num_sms=132, swizzle_staging=True, short_tile_rows=64,
                            share_rows=True)
  assert cfg.smem_bytes(jnp.bfloat16, jnp.bfloat16) <= cfg.smem_budget()
  assert_gmm_lowers(cfg, m=4096, k=768, n=2048, g=128, transpose_rhs=transpose_rhs)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
def test_block_k_32_matches_oracle(transpose_rhs):
  # k = 192: six 32-row k steps; folded tails, a short tile.
  sizes, m, k, n = [300, 10, 520, 0, 280], 1280, 192, 192
  rshape = (5, n, k) if transpose_rhs else (5, k, n)
  x, w = oracle.random_inputs(jax.random.key(32), [(m, k), rshape], jnp.bfloat16)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), None, transpose_rhs=transpose_rhs,
               out_dtype=jnp.bfloat16, interpret=True,
               config=dataclasses.replace(CFG, block_k=32, num_stages=4, tail_rows=32,
                                          tail_split=True, short_tile_rows=64))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, None, transpose_rhs),
                      jnp.bfloat16)


def test_share_rows_checks():
  with pytest.raises(ValueError, match="share_rows needs"):
    dataclasses.replace(CFG, swap=False, block_n=256, share_rows=True)
  with pytest.raises(ValueError, match="share_rows needs"):
    dataclasses.replace(CFG, share_rows=True)  # num_sms=3: clusters of two need an even count
  assert not mf.row_major_ring(dataclasses.replace(CFG, num_sms=4, share_rows=True)).share_rows


def test_share_rows_interprets_unclustered():
  # Interpret mode runs a share_rows config's tiles without clusters (the
  # interpreter hangs with two CTAs per cluster): same results as the oracle.
  sizes = [280, 7, 60, 150]
  x, w = oracle.random_inputs(jax.random.key(5), [(640, 128), (4, 128, 128)], jnp.bfloat16)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), None, transpose_rhs=False,
               out_dtype=jnp.bfloat16, interpret=True,
               config=dataclasses.replace(CFG, num_sms=4, tail_rows=32, share_rows=True,
                                          producer_zeros=False))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, None, False), jnp.bfloat16)


@pytest.mark.parametrize("transpose_rhs,tail,short,offset", [
    (False, "split", 64, None), (True, "m", 0, 1), (False, "fold", 128, 0)],
                         ids=["fwd-split-s64", "dx-m-shard", "fwd-fold-s128-shard"])
def test_release_each_step_no_races(transpose_rhs, tail, short, offset):
  # delay_release=0: each consumer waits for its step's wgmmas and releases that
  # stage at once.  Against the oracle, with zero rows around a shard, under the
  # race detector and the interpreter's barrier counts.  (The interpreter runs a
  # wgmma to completion when issued, so a release placed before the wgmma wait
  # would pass here too: the GPU tests are what check that order.)
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  sizes = [280, 7, 0, 60, 150]
  num_local = 5 if offset is None else 2
  rshape = (num_local, 128, 128)
  x, w = oracle.random_inputs(jax.random.key(11), [(640, 128), rshape], jnp.bfloat16)
  go = None if offset is None else jnp.int32(offset)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), go, transpose_rhs=transpose_rhs,
               out_dtype=jnp.bfloat16, interpret=plgpu.InterpretGPUParams(detect_races=True),
               config=dataclasses.replace(CFG, tail_rows=32, num_sms=2, delay_release=0,
                                          producer_zeros=False, swizzle_staging=True,
                                          short_tile_rows=short, **TAIL[tail]))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, go, transpose_rhs), jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, offset, num_local)
  assert not gpu_interpret.get_races().races_found


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
def test_release_each_step_lowers_for_sm90(transpose_rhs):
  # The table's swap layout (split fold, 64-row short tiles) on 2-CTA clusters.
  cfg = dataclasses.replace(CFG, num_stages=4, tail_rows=32, tail_split=True, num_sms=132,
                            swizzle_staging=True, short_tile_rows=64, share_rows=True,
                            delay_release=0)
  assert_gmm_lowers(cfg, m=4096, k=768, n=2048, g=128, transpose_rhs=transpose_rhs)
