"""Forward / dX grouped matmul as a Pallas Mosaic GPU kernel (Hopper, sm90).

``gmm(lhs[m, k], rhs[g_local, k, n], group_sizes[G], group_offset) -> out[m, n]``
(``rhs[g_local, n, k]`` when ``transpose_rhs``: the dX mode, read in place and
fed to wgmma through a transposed SMEM view).

Rows of local group ``j`` (global group ``group_offset + j``) get
``lhs_rows @ rhs[j]``; every other row of ``out`` is exactly zero.

Design:
* A persistent grid of ``num_sms`` CTAs walks a flat work list with
  ``plgpu.nd_loop``: first the *zero tiles* (row blocks, or parts of them,
  outside the local row window, stored from a zeroed SMEM buffer), then the
  *compute tiles* (``metadata.tile_schedule`` entries x n tiles: group-aligned
  row windows, so only a group's last tile is partial; on a GPU the schedule
  comes from one ``triton_schedule`` kernel).  Both counts
  are device scalars, so the loop length is dynamic and nothing syncs to host.
  Zero tiles come first in every CTA's sequence, so its staging buffer is
  zeroed once.  Their async TMA stores are not hidden under the compute: on
  the EP=8 shard the kernel takes the local compute's time plus the zero
  rows' time (51 + 26 us, H200, 2026-11-30), also with the zeros issued by
  the producer warpgroup, and 1.23x that with half of the CTAs taking their
  compute tiles first (zero stores beside the compute slow it down more than
  they save).
* Compute tile: ``emit_pipeline`` streams (block_m, block_k) lhs and
  (block_k, block_n) rhs blocks through ``num_stages`` TMA buffers into wgmma
  with an f32 register accumulator.  The lhs window starts at the tile's
  ``row0`` (a multiple of 8, the TMA row granule) and may hold rows of a
  neighbouring group: only rows ``[row_start, row_end)`` are stored, as a
  ladder of power-of-two-row TMA stores, so other groups' rows are never
  touched.
* Partial blocks along m, k or n rely on TMA: out-of-bounds loads are zero
  filled, out-of-bounds stores are dropped.
* ``num_compute_wgs=2``: a warp-specialized variant (one TMA producer
  warpgroup, two consumer warpgroups each owning 64 rows of a 128-row tile and
  sharing the rhs block; with ``split_n``, both consumers share a 64-row tile
  and each owns half of its columns).  Options (``MosaicFwdConfig``): a consumer whose 64
  rows hold none of the tile's rows may skip its wgmmas, and one pipeline may
  run through all of a CTA's tiles.
* ``epilogue_split``: the f32 accumulator leaves through an SMEM staging buffer
  of block_n / split columns (per compute warpgroup), chunk after chunk, each
  chunk waiting until the previous chunk's TMA stores have read the buffer.
  This is what lets 2 warpgroups x 128x256 x bk64 run 4 stages (192 KiB of
  pipeline + 32 KiB of staging instead of 64 KiB).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ragdot.manual_axes import make_varying, match_varying, out_struct, varying_axes
from ragdot import backends
from ragdot.backends import sm90

_IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_OUT_DTYPES = _IN_DTYPES + (jnp.dtype(jnp.float32),)
_SMEM_RESERVE = 1024  # barriers and alignment (48 bytes measured for 2 warpgroups)
_WG_ROWS = 64  # wgmma M per warpgroup
SWAP_ROWS = 256  # wgmma's largest N: the default and largest swap_rows
_INTERPRET_SMS = 4


_EPILOGUE_SPLITS = (1, 2, 3, 4)


def _split_ok(block_n: int, split: int) -> bool:
  """Whether ``block_n`` columns leave in ``split`` chunks of a multiple of 64."""
  return (split in _EPILOGUE_SPLITS and block_n % split == 0
          and (split == 1 or (block_n // split) % 64 == 0))


@dataclasses.dataclass(frozen=True)
class MosaicFwdConfig:
  """Tiling of the forward / dX kernel.

  block_m: rows per tile (64 per compute warpgroup; 64 with ``split_n``).
  block_n, block_k: output columns per tile, contraction step per pipeline stage.
  num_stages: TMA pipeline depth (buffers in flight).
  grid_minor_dim: 0 walks ``grid_tile_width`` row tiles across all n tiles
    before moving on (one expert's rows stay together); 1 walks
    ``grid_tile_width`` n tiles down all row tiles.  Snake order either way
    (``plgpu.planar_snake``).
  grid_tile_width: width of the snake strips.
  num_compute_wgs: 1 (plain pipeline) or 2 (warp-specialized, block_m 128).
  epilogue_split: the epilogue stages the (rows, block_n) result through SMEM
    in this many column chunks of block_n / epilogue_split (a multiple of 64),
    one chunk buffer per compute warpgroup, reused chunk after chunk.  Frees
    SMEM for pipeline stages (e.g. 2 warpgroups x 128x256 with 4 stages).
  num_sms: persistent CTAs; None = ctas_per_sm x the device's SM count (132 on
    H200), or 4 in interpret mode.
  ctas_per_sm: 1, or 2 resident CTAs per SM (one warpgroup only, SMEM halved):
    the hardware overlaps one CTA's pipeline fill and epilogue with the other's
    wgmmas.
  skip_empty_halves: with 2 compute warpgroups, a warpgroup whose 64 rows hold
    none of the tile's rows runs the tile's pipeline with a body that issues no
    wgmma (one branch per tile, outside the k loop); False: both always compute.
  delay_release: 2 warpgroups only: 1 keeps one wgmma in flight per consumer
    across pipeline steps (a stage is released one step late); 0 waits for each
    step's wgmma before releasing its stage.
  split_n: 2 warpgroups with block_m 64: both consumers read the tile's 64
    lhs rows and each computes half of its block_n columns (64 x block_n / 2).
    A group's last tile pads to 64 rows instead of 128 (Qwen3-30B routing:
    1.12 computed rows per real row instead of 1.24), at the price of half the
    rows per rhs block loaded.  Needs block_n 128 or 256 and epilogue_split 2
    or 4 (each consumer stores its own chunks).
  guard_last_stage: 2 warpgroups with delay_release=1 and per-tile pipelines:
    the producer starts a tile's loads only after both consumers' last wgmma
    of the previous tile is done.  The pipeline releases every stage but a
    tile's last one, so without this the next tile's first loads could
    overwrite that stage while the last wgmma still reads it (in practice
    the metadata read and TMA latency come first).  False only for A/B runs.
  schedule_kernel: build the tile schedule with one Pallas-Triton kernel
    (``triton_schedule``) where it applies, instead of the five to nine small
    XLA kernels of ``metadata``; the same entries either way.
  pipeline_across_tiles: 2 warpgroups only (needs delay_release=0): the
    producer runs one pipeline through all of its CTA's tiles, loading the
    next tile's first stages while the consumers finish a tile and run its
    epilogue, instead of draining and refilling the pipeline per tile.  Used
    when the tile's k steps are a multiple of num_stages (otherwise per tile).
  ring: 2 warpgroups (block_m 128) only: run ``mosaic_fwd_ring``, one
    hand-written ring of stages through all of a CTA's items (in grid order,
    see ``_work_item``), instead of a pipeline per tile (``mosaic_fwd_swap``
    with ``swap``); skip_empty_halves, delay_release, pipeline_across_tiles and
    guard_last_stage do not apply.
  tail_rows: ring only, 0, 8, 16 or 32 (or 64 with ``swap``): a group's last
    tile holding at most this many rows is folded into the tile before it,
    whose consumers compute those rows with swapped wgmma operands (see
    ``mosaic_fwd_ring``), or with ``swap`` as more rows on wgmma's N axis
    (or row-major, ``tail_on_m``); needs block_n a multiple of 128.
  zero_lead: ring only, with producer_zeros off: the calls with a
    group_offset write the rows outside the shard as zero items after the
    compute items.  The CTAs whose item
    list is one item shorter than others' (the last round of items is
    partial) first take up to this many zero items each, while the others
    still compute; the rest of the zero items go round-robin over all CTAs.
    0: round-robin only; None: half the k steps of an item (measured on the
    H200's EP=8 shard of Qwen3-30B gate_up, 32 k steps: lead 15 saved 5.5%,
    25 and more lost, docs/performance.md v15).
  producer_zeros: ring only: the TMA producer warpgroup writes those zero
    rows instead, from a zeroed (zero_box_rows, epilogue_n) buffer, its share
    of them spread over its k steps, while the consumers compute: the zeros go out
    while the compute leaves DRAM bandwidth unused (the local rows' call reads
    the shard's weights at ~2.4 TB/s of ~4.2), and the consumers skip the
    zero items after the ring.  (zero_lead does not apply.)  None (the
    default): on for ring calls with a group_offset and no explicit
    zero_lead, with the epilogue chunks narrowed until the buffer fits
    (``resolve_producer_zeros``), off for the others.  Measured on the
    H200's EP=8 shard of Qwen3-30B gate_up: 0.927-0.937x the time of the
    zero_lead ring (docs/performance.md v16h, v17a, v17b).
  swap: ring only: run ``mosaic_fwd_swap``, tiles of up to ``swap_rows`` (R,
    256 by default) rows x block_n = 128 columns with the rows on wgmma's N
    axis (each consumer: 64 columns x R rows), so a folded tail (``tail_rows`` up to 64) rides on the weight
    block already in SMEM as more N.  A 16-bit output (a 32-bit one runs
    ``row_major_ring``); the consumers write the rows outside the shard's
    window after the ring (no ``producer_zeros``; with its default None a
    shard call runs ``row_major_ring`` with producer zeros instead, see
    ``resolve_producer_zeros``); epilogue_split does not apply (64-row stores).
  tail_split: swap with tail_rows 16, 32 or 64: a tile with a folded tail runs
    two wgmmas of (R + tail_rows) / 2 rows each instead of one of R and one
    of tail_rows.  Measured 0.972-0.988x the unsplit fold on the Qwen3 shapes
    (docs/performance.md v19g-h); by tensor-pipe time both cost ~1.47 plain
    tiles (v19i: each wgmma instruction has a fixed cost of ~0.39 of an N = 256
    one).
  tail_on_m: swap with tail_rows 8, 16 or 32, not split: the folded tail runs
    row-major on the first consumer only, one wgmma of M = 64 rows (the tile's
    last 64, so its first 64 - tail_rows are computed twice and not stored) by
    N = 128 columns, beside the R-row wgmma of each consumer.  Measured on
    the H200 (docs/performance.md v20d, v20f): 0.95x / 0.97x the row-major ring
    on the Qwen3-30B gate_up / down dX calls, 0.91x the split fold on the down
    forward, a tie with it on the gate_up forwards.
  swap_rows: swap only: rows per tile (wgmma's N), a multiple of 16 from 64
    to 256.  Fewer than 256 fit groups of fewer rows with less padding (e.g.
    144 or 160 for groups of 128 +- 11 rows, DeepSeek-V3's): every group of at
    most swap_rows - 7 rows is one tile that streams its weight block once.
    Measured on the H200 (docs/performance.md v21h, one A/B): DeepSeek-V3
    down dX 0.932-0.942x its Triton entry with 144 (+ 16 tail rows) or 160
    rows; its forward 1.02-1.05x the row-major ring.
  swizzle_staging: swap only: each 64-row epilogue chunk (the consumer's
    (columns, rows) registers, written transposed into a (rows, columns)
    buffer) is staged through a 128-byte-swizzled buffer instead of a plain
    one, so the transposed writes spread over the shared-memory banks.  The
    TMA stores of its rows start at any row, as from the plain buffer (the
    swizzle follows the address bits).  Measured on the H200
    (docs/performance.md v24c-d): 0.95-0.97x the time on the Qwen3-30B calls
    with the split fold, 0.97x Qwen3-235B's dX; two alternating 32-row buffers
    were no faster.
  zero_box_rows: with producer_zeros, the rows of its zero buffer (8, 16, 32
    or 64): each 64-row half of a zero item goes out in stores of at most
    this many rows.  Fewer rows leave room for wider epilogue chunks (a
    128 x 256 ring in 4 stages fits 8 rows beside 128-column chunks, 64 rows
    only beside 64-column ones) at the price of more, smaller TMA stores
    (v17a: 8 rows cost 1.15-1.83x where 64 rows saved 6%).
  """

  block_m: int = 64
  block_n: int = 256
  block_k: int = 64
  num_stages: int = 4
  grid_minor_dim: int = 0
  grid_tile_width: int = 1
  num_compute_wgs: int = 1
  num_sms: int | None = None
  epilogue_split: int = 1
  ctas_per_sm: int = 1
  skip_empty_halves: bool = False
  delay_release: int = 1
  pipeline_across_tiles: bool = False
  split_n: bool = False
  guard_last_stage: bool = True
  schedule_kernel: bool = True
  ring: bool = False
  tail_rows: int = 0
  zero_lead: int | None = None
  producer_zeros: bool | None = None
  zero_box_rows: int = 64
  swap: bool = False
  tail_split: bool = False
  tail_on_m: bool = False
  swap_rows: int = SWAP_ROWS
  swizzle_staging: bool = False

  def __post_init__(self):
    if self.num_compute_wgs not in (1, 2):
      raise ValueError(f"num_compute_wgs must be 1 or 2, got {self.num_compute_wgs}")
    rows = _WG_ROWS if self.split_n else _WG_ROWS * self.num_compute_wgs
    if self.block_m != rows:
      raise ValueError(
          f"block_m must be {rows} (64 per compute warpgroup, 64 with split_n),"
          f" got {self.block_m}"
      )
    if self.split_n and (self.num_compute_wgs != 2 or self.block_n % 128
                         or self.epilogue_split not in (2, 4) or self.skip_empty_halves):
      raise ValueError(
          "split_n needs num_compute_wgs=2, block_n 128 or 256, epilogue_split 2 or 4"
          f" and skip_empty_halves=False, got {self}"
      )
    if not (self.block_n % 64 == 0 and 64 <= self.block_n <= 256):
      raise ValueError(f"block_n must be a multiple of 64 in [64, 256], got {self.block_n}")
    if self.block_k not in (32, 64, 128):
      raise ValueError(f"block_k must be 32, 64 or 128, got {self.block_k}")
    if not 2 <= self.num_stages <= 8:
      raise ValueError(f"num_stages must be in [2, 8], got {self.num_stages}")
    if self.grid_minor_dim not in (0, 1):
      raise ValueError(f"grid_minor_dim must be 0 or 1, got {self.grid_minor_dim}")
    if self.grid_tile_width < 1:
      raise ValueError(f"grid_tile_width must be >= 1, got {self.grid_tile_width}")
    if self.num_sms is not None and self.num_sms < 1:
      raise ValueError(f"num_sms must be >= 1, got {self.num_sms}")
    sm90.check_ctas_per_sm(self.ctas_per_sm, self.num_compute_wgs)
    if self.delay_release not in (0, 1):
      raise ValueError(f"delay_release must be 0 or 1, got {self.delay_release}")
    if self.pipeline_across_tiles and (self.num_compute_wgs != 2 or self.delay_release):
      raise ValueError("pipeline_across_tiles needs num_compute_wgs=2 and delay_release=0")
    if not _split_ok(self.block_n, self.epilogue_split):
      raise ValueError(
          f"epilogue_split must be 1 to 4 with block_n / epilogue_split a multiple"
          f" of 64, got {self.epilogue_split} (block_n={self.block_n})"
      )
    if self.ring and (self.num_compute_wgs != 2 or self.split_n or self.ctas_per_sm != 1):
      raise ValueError(f"ring needs num_compute_wgs=2, split_n=False and ctas_per_sm=1, "
                       f"got {self}")
    if self.tail_rows not in (0, 8, 16, 32) and not (self.swap and self.tail_rows == 64):
      raise ValueError(f"tail_rows must be 0, 8, 16 or 32 (64 with swap), got {self.tail_rows}")
    if self.swap and (not self.ring or self.block_n != 128 or self.producer_zeros
                      or self.zero_lead is not None):
      raise ValueError(f"swap needs ring=True, block_n=128, producer_zeros off and no "
                       f"zero_lead, got {self}")
    if self.tail_split and (not self.swap or self.tail_rows not in (16, 32, 64)):
      raise ValueError(f"tail_split needs swap=True and tail_rows 16, 32 or 64, got {self}")
    if self.tail_on_m and (not self.swap or self.tail_split or self.tail_rows not in (8, 16, 32)):
      raise ValueError(f"tail_on_m needs swap=True, tail_split off and tail_rows 8, 16 or 32, "
                       f"got {self}")
    if self.swap_rows != SWAP_ROWS and (not self.swap or self.swap_rows % 16
                                        or not 64 <= self.swap_rows <= SWAP_ROWS):
      raise ValueError(f"swap_rows needs swap=True and a multiple of 16 from 64 to 256, "
                       f"got {self}")
    if self.swizzle_staging and not self.swap:
      raise ValueError(f"swizzle_staging needs swap=True, got {self}")
    if self.tail_rows and (not self.ring or self.block_n % 128):
      raise ValueError(f"tail_rows needs ring=True and block_n a multiple of 128, got {self}")
    if self.zero_lead is not None and (self.zero_lead < 0 or (self.zero_lead and not self.ring)):
      raise ValueError(f"zero_lead must be >= 0 and needs ring=True, got {self}")
    if self.producer_zeros not in (True, False, None):
      raise ValueError(f"producer_zeros must be True, False or None, got {self.producer_zeros}")
    if self.producer_zeros and not self.ring:
      raise ValueError(f"producer_zeros needs ring=True, got {self}")
    if self.producer_zeros and self.zero_lead is not None:
      raise ValueError(f"zero_lead does not apply with producer_zeros=True, got {self}")
    if self.zero_box_rows not in (8, 16, 32, 64):
      raise ValueError(f"zero_box_rows must be 8, 16, 32 or 64, got {self.zero_box_rows}")

  @property
  def epilogue_n(self) -> int:
    """Columns of one epilogue chunk (the staging buffer's width)."""
    return self.block_n // self.epilogue_split

  def smem_bytes(self, in_dtype: Any, out_dtype: Any) -> int:
    """Static SMEM footprint (pipeline buffers + output staging chunk).

    Barriers and alignment add a few dozen bytes on top (48 measured at
    lowering for the 2-warpgroup kernel): ``smem_budget`` keeps 1 KiB for them.
    """
    isz, osz = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    if self.swap:  # swap_rows + tail rows and 128 columns per stage; 64 x 64 staging per consumer
      per_stage = (self.swap_rows + self.tail_rows + self.block_n) * self.block_k * isz
      staging = self.num_compute_wgs * _WG_ROWS * _WG_ROWS * osz
      return self.num_stages * per_stage + staging
    per_stage = (self.block_m + self.block_n) * self.block_k * isz
    # One (64, epilogue_n) staging buffer per compute warpgroup.
    staging = self.num_compute_wgs * _WG_ROWS * self.epilogue_n * osz
    # Tails: their lhs rows in every stage, a (tail_rows, block_n / 2) buffer each.
    per_stage += self.tail_rows * self.block_k * isz
    staging += self.num_compute_wgs * self.tail_rows * (self.block_n // 2) * osz
    if self.producer_zeros:  # the producer's zero buffer
      staging += self.zero_box_rows * self.epilogue_n * osz
    return self.num_stages * per_stage + staging


  def smem_budget(self) -> int:
    """SMEM this config may use (per CTA, with ``ctas_per_sm`` CTAs on an SM)."""
    return sm90.smem_budget(self.ctas_per_sm, _SMEM_RESERVE)


def resolve_producer_zeros(cfg: MosaicFwdConfig, has_offset: bool, dtype: Any,
                           out_dtype: Any) -> MosaicFwdConfig:
  """``cfg`` with ``producer_zeros=None`` made concrete for one call: on for a
  ring call with a group_offset (with the smallest epilogue_split that fits
  the producer's zero buffer), off otherwise or where no split fits.  A swap
  config with a group_offset becomes the row-major ring (block_n 256, no
  tails) with producer zeros; ``producer_zeros=False`` keeps it swap."""
  if cfg.producer_zeros is not None:
    return cfg
  if cfg.swap and has_offset:
    # swap has no producer zeros: a shard call runs the row-major ring with them,
    # the same k steps and stages (measured best for Qwen3-30B's EP=8 shard, v17;
    # not measured on other shapes' shards).
    cfg = row_major_ring(cfg)
  if cfg.ring and has_offset and cfg.zero_lead is None:  # (an explicit zero_lead: off)
    fitted = _fit_split(dataclasses.replace(cfg, producer_zeros=True), dtype, out_dtype)
    if fitted is not None:
      return fitted
  return dataclasses.replace(cfg, producer_zeros=False)


def row_major_ring(cfg: MosaicFwdConfig) -> MosaicFwdConfig:
  """A swap config's row-major ring counterpart (128 x 256 tiles, no tails):
  what runs where swap cannot (shard calls with producer zeros, 32-bit outputs)."""
  return dataclasses.replace(cfg, swap=False, block_n=256, tail_rows=0, tail_split=False,
                             tail_on_m=False, swap_rows=SWAP_ROWS, swizzle_staging=False)


def _fits(cfg: MosaicFwdConfig, dtype: Any, out_dtype: Any) -> bool:
  return cfg.smem_bytes(dtype, out_dtype) <= cfg.smem_budget()


def _fit_split(cfg: MosaicFwdConfig, dtype: Any, out_dtype: Any) -> MosaicFwdConfig | None:
  """``cfg`` with the smallest epilogue_split >= its own that fits SMEM, or None."""
  for split in _EPILOGUE_SPLITS:
    if split < cfg.epilogue_split or not _split_ok(cfg.block_n, split):
      continue
    c = dataclasses.replace(cfg, epilogue_split=split)
    if _fits(c, dtype, out_dtype):
      return c
  return None


def fit_config(cfg: MosaicFwdConfig, dtype: Any, out_dtype: Any) -> MosaicFwdConfig | None:
  """``cfg`` made to fit SMEM: a larger epilogue split first, then fewer stages
  (down to 2); None when nothing fits.  Folded tails and swap need a 16-bit
  output (their transposed stores): for f32 tails are dropped and swap becomes
  the row-major ring (``row_major_ring``)."""
  if jnp.dtype(out_dtype).itemsize != 2:
    if cfg.swap:
      cfg = row_major_ring(cfg)
    elif cfg.tail_rows:
      cfg = dataclasses.replace(cfg, tail_rows=0)
  while True:
    fitted = _fit_split(cfg, dtype, out_dtype)
    if fitted is not None:
      return fitted
    if cfg.num_stages <= 2:
      return None
    cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)


def default_config(
    m: int, k: int, n: int, g_local: int, dtype: Any, transpose_rhs: bool,
    out_dtype: Any = None,
) -> MosaicFwdConfig:
  """Heuristic default: 2 warpgroups, 128 x 256 x 64 tiles, 4 stages, split 2.

  The best measured H200 point on group-aligned tiles for Qwen3-30B gate_up
  and down (forward and dX); both consumers always compute (skipping an empty
  64-row half measured 2-3% slower on gate_up, in the k loop and hoisted).
  One warpgroup (64 x 256) when k fits one k step (the 2-warpgroup pipeline
  needs two) or m < 128.  block_n is the candidate in
  (256, 192, 128, 64) that wastes the fewest padded columns; if SMEM does not
  fit (f32 output) the epilogue is split further, then stages drop.
  """
  del g_local, transpose_rhs
  out_dtype = dtype if out_dtype is None else out_dtype
  block_n = min((256, 192, 128, 64), key=lambda b: (pl.cdiv(n, b) * b, -b))
  block_k = 64 if k > 32 else 32
  wgs = 2 if k > block_k and m >= 2 * _WG_ROWS else 1
  split = 2 if block_n % 128 == 0 else 1
  cfg = MosaicFwdConfig(block_m=_WG_ROWS * wgs, block_n=block_n, block_k=block_k,
                        num_stages=4, grid_tile_width=4, num_compute_wgs=wgs,
                        epilogue_split=split if wgs == 2 else 1)
  return fit_config(cfg, dtype, out_dtype) or cfg


# (block_m, block_n, block_k (None = the default's), stages, tile width, epilogue split,
#  CTAs per SM)
_SWEEP = (
    # Two consumer warpgroups + TMA producer, bm 128 (first: the likely winners
    # when a tuning budget cuts the list short).
    (128, 256, None, 4, 1, 2, 1),  # 192 + 32 KiB
    (128, 256, None, 4, 4, 2, 1),
    (128, 256, None, 4, 8, 2, 1),
    (128, 256, None, 4, 4, 4, 1),  # 192 + 16 KiB
    (128, 256, None, 3, 4, 1, 1),
    (128, 256, 32, 8, 4, 2, 1),  # 192 + 32 KiB
    (128, 128, None, 4, 4, 1, 1),
    (128, 128, None, 6, 4, 1, 1),  # 192 + 32 KiB
    # One compute warpgroup, bm 64.
    (64, 256, None, 4, 4, 1, 1),
    (64, 256, None, 4, 1, 1, 1),
    (64, 256, None, 5, 4, 2, 1),  # 200 + 16 KiB
    (64, 256, 32, 8, 4, 2, 1),  # 160 + 16 KiB
    (64, 128, None, 6, 4, 1, 1),  # small-n fallback
    # Two resident CTAs per SM (<= 113 KiB each): one CTA's fill and epilogue
    # under the other's wgmmas (short k loops, decode).
    (64, 256, 32, 4, 4, 2, 2),  # 80 + 16 KiB
    (64, 128, None, 3, 4, 1, 2),  # 72 + 16 KiB
)


def gpu_sweep_configs(
    m: int, k: int, n: int, g: int, transpose_rhs: bool, dtype: Any = jnp.bfloat16,
    out_dtype: Any = None,
) -> list[MosaicFwdConfig]:
  """Candidate configs for a GPU sweep (default first; SMEM-feasible only, <= 22).

  An f32 output gets a larger epilogue split where that makes a candidate fit.
  """
  out_dtype = dtype if out_dtype is None else out_dtype
  base = default_config(m, k, n, g, dtype, transpose_rhs, out_dtype)
  out = [base]
  if base.num_compute_wgs == 2:
    # Next to the default: skipping empty 64-row halves, one pipeline across
    # tiles, and the per-step release that needs on its own.
    out.append(dataclasses.replace(base, skip_empty_halves=True))
    per_step = dataclasses.replace(base, delay_release=0)
    if _chains_tiles(dataclasses.replace(per_step, pipeline_across_tiles=True), k):
      out.append(dataclasses.replace(per_step, pipeline_across_tiles=True))
    out.append(per_step)
    # Walk n-tile strips down the row tiles: each expert's weight block is read
    # from DRAM once per strip instead of once per row-tile strip (ncu: Mixtral
    # gate_up moved ~6x its minimal DRAM bytes with grid_minor_dim=0).
    out += [dataclasses.replace(base, grid_minor_dim=1, grid_tile_width=w) for w in (4, 8)]
    # The hand-written ring, bare and with folded tails (v14: DeepSeek-V3's
    # 128 +- 11-row groups 0.89x the table with 16; the bare ring 0.94-0.98x on
    # Qwen3-30B).
    if base.block_n % 128 == 0:
      for tail in (0, 16, 32):  # fit_config drops tails for f32 (a duplicate then)
        c = fit_config(dataclasses.replace(base, ring=True, tail_rows=tail, grid_tile_width=1),
                       dtype, out_dtype)
        if c is not None and c not in out:
          out.append(c)
      # Rows on wgmma's N axis with 32 tail rows folded as two 144-row wgmmas (v19:
      # 0.93-0.96x the ring / pipeline entries on the Qwen3 gate_up forwards and
      # Qwen3-235B's dX; tails 0, 16 and 64 lost).
      # Staged through a swizzled buffer (v24c-d: 0.95-0.97x the unswizzled one).
      swap = dataclasses.replace(base, ring=True, swap=True, block_n=128, tail_rows=32,
                                 tail_split=True, epilogue_split=2, grid_tile_width=1,
                                 num_stages=4, swizzle_staging=True)
      # The same with the tail row-major on the first consumer (v20: 0.95 / 0.97x the
      # ring on the Qwen3-30B dX calls, a tie with the split fold on the gate_up forwards).
      swap_m = dataclasses.replace(swap, tail_split=False, tail_on_m=True)
      if (m >= SWAP_ROWS + swap.tail_rows and jnp.dtype(out_dtype).itemsize == 2
          and _fits(swap, dtype, out_dtype)):  # (else gmm would run another config)
        out += [swap, swap_m]
      # Groups of 96-192 rows on average: swap tiles of ~9/8 the mean with 16
      # tail rows split, and of ~5/4 the mean without a tail (DeepSeek-V3 down dX,
      # groups of 128 +- 11 rows: 144 + 16 rows 0.932 / 0.921x its Triton entry, 160
      # rows 0.942 / 0.924x in two A/Bs, v21h / v22a, and half the lowering time; the
      # forward lost, 1.02-1.05x the ring).
      mean = m // max(g, 1)
      rows = min(SWAP_ROWS, max(64, 16 * math.ceil(mean * 9 / 8 / 16)))
      small = dataclasses.replace(swap, swap_rows=rows, tail_rows=16)
      plain = dataclasses.replace(
          swap, swap_rows=min(SWAP_ROWS, max(64, 16 * math.ceil(mean * 5 / 4 / 16))),
          tail_rows=0, tail_split=False)
      for c in (small, plain):
        if (96 <= mean <= 192 and m >= c.swap_rows + c.tail_rows
            and jnp.dtype(out_dtype).itemsize == 2 and _fits(c, dtype, out_dtype)):
          out.append(c)
    # 64-row tiles split by columns: half the padding of a group's last tile,
    # 1.67x the L2 -> SMEM bytes per FLOP (the default already runs the L2 at
    # 81% on Qwen3-30B gate_up), so after the likelier winners.
    if base.block_n % 128 == 0:
      for stages, split, width in ((4, 2, 4), (5, 4, 8)):
        split = min(split, base.block_n // 64)  # chunks of >= 64 columns
        c = fit_config(dataclasses.replace(
            base, block_m=_WG_ROWS, split_n=True, num_stages=stages,
            epilogue_split=split, grid_tile_width=width), dtype, out_dtype)
        if c is not None and c not in out:
          out.append(c)
  for bm, bn, bk, stages, width, split, ctas in _SWEEP:
    if bn > max(base.block_n, 64):
      continue
    c = MosaicFwdConfig(bm, bn, bk or base.block_k, stages, 0, width,
                        num_compute_wgs=bm // _WG_ROWS, epilogue_split=split,
                        ctas_per_sm=ctas)
    c = _fit_split(c, dtype, out_dtype)
    if c is not None and c not in out:
      out.append(c)
  return out[:22]


def _check_supported(lhs, rhs, out_dtype, transpose_rhs) -> None:
  if lhs.dtype != rhs.dtype:
    raise NotImplementedError(
        f"mosaic gmm needs equal lhs/rhs dtypes, got {lhs.dtype} and {rhs.dtype}"
    )
  if jnp.dtype(lhs.dtype) not in _IN_DTYPES:
    raise NotImplementedError(
        f"mosaic gmm supports bf16/f16 inputs only, got {lhs.dtype}"
    )
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise NotImplementedError(
        f"mosaic gmm supports bf16/f16/f32 outputs only, got {out_dtype}"
    )
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  reason = unsupported_shape(lhs.shape[0], lhs.shape[1], n)
  if reason:
    raise NotImplementedError(f"mosaic gmm needs {reason}")


def unsupported_shape(m: int, k: int, n: int) -> str | None:
  """Why this kernel refuses lhs[m, k] -> out[m, n] (static; None: it takes it).

  Mosaic builds TMA descriptors on the swizzle-tiled views: rows in tiles of 8
  and 64 (128-byte) columns, checked only when lowering for the real GPU
  (interpret mode accepts more), so refuse what sm90 lowering rejects.
  """
  if k % 64 or n % 64:
    return f"k and n to be multiples of 64 (swizzled TMA tiles), got k={k}, n={n}"
  if m % 8 and m > 8:
    return f"m % 8 == 0 (TMA row tiles), got m={m}"
  return None


def _num_sms(config: MosaicFwdConfig, interpret: bool) -> int:
  if config.num_sms is not None:
    return config.num_sms
  if interpret:
    return _INTERPRET_SMS  # each simulated CTA is a CPU thread
  return config.ctas_per_sm * sm90.device_sm_count()


def _store_rows(src_smem, out_gmem, src_row, dst_row, count, col, *, max_rows: int,
                width: int) -> None:
  """Stores ``count`` (dynamic, 0..max_rows) rows src_smem[src_row:] -> out[dst_row:].

  TMA boxes are static, so the count is split into its binary digits: one
  predicated store of 2**i rows per set bit, largest first.  A 1-row box that
  may run past the output's last column goes out in 64-column pieces, each
  only where it starts before n: on the H200 the hardware did not clip such a
  box at the row's end, and its columns past n landed at the start of the next
  row (docs/performance.md v25c; n is a multiple of 64, so no piece crosses it).
  """
  n = out_gmem.shape[-1]
  done = 0
  p = 1 << (max_rows.bit_length() - 1)
  while p >= 1:
    @pl.when((count & p) != 0)
    def _():
      src = src_smem.at[pl.ds(src_row + done, p)]
      dst_rows = pl.ds(dst_row + done, p)
      if p == 1 and n % width:
        for j in range(0, width, 64):
          pl.when(col + j < n)(functools.partial(
              plgpu.copy_smem_to_gmem, src.at[:, pl.ds(j, 64)],
              out_gmem.at[dst_rows, pl.ds(col + j, 64)]))
      else:
        plgpu.copy_smem_to_gmem(src, out_gmem.at[dst_rows, pl.ds(col, width)])
    done = done + (count & p)
    p //= 2


def _work_item(tiles_gmem, w, num_tiles, max_tiles: int, grid_n: int,
               cfg: MosaicFwdConfig):
  """(n tile, group, row0, row_start, row_end) of compute item w.

  Items go in ``plgpu.planar_snake`` order, except that the ring with strips of
  one row tile keeps plain row-major order (every n tile of a row tile in
  turn, no snake): the order its table entries were measured in.
  """
  if cfg.ring and cfg.grid_minor_dim == 0 and cfg.grid_tile_width == 1:
    ti, ni = lax.div(w, grid_n), lax.rem(w, grid_n)
  else:
    ti, ni = plgpu.planar_snake(
        w, (num_tiles, grid_n), cfg.grid_minor_dim, cfg.grid_tile_width
    )
  row0 = pl.multiple_of(tiles_gmem[max_tiles + ti], 8)
  return (ni, tiles_gmem[ti], row0, tiles_gmem[2 * max_tiles + ti],
          tiles_gmem[3 * max_tiles + ti])


def _lhs_spec(cfg: MosaicFwdConfig, row0, delay_release: int = 1):
  """The (block_m, block_k) lhs window at row ``row0`` (any multiple of 8)."""
  return plgpu.BlockSpec((pl.Element(cfg.block_m), cfg.block_k),
                         lambda ki: (row0, ki), delay_release=delay_release)


def _rhs_spec(cfg: MosaicFwdConfig, ni, transpose_rhs: bool, delay_release: int = 1):
  """The (block_k, block_n) rhs block of n tile ``ni``; (block_n, block_k) of
  rhs[g, n, k] in the dX mode."""
  bn, bk = cfg.block_n, cfg.block_k
  if transpose_rhs:
    return plgpu.BlockSpec((bn, bk), lambda ki: (ni, ki), delay_release=delay_release)
  return plgpu.BlockSpec((bk, bn), lambda ki: (ki, ni), delay_release=delay_release)


class _PipelinePhase:
  """``pipeline_state`` of one tile in a chain of warp-specialized pipelines.

  The pipeline compares its state with START (fill the stages first) and STOP
  (drain at the end); a CTA's only tile is both, which no single
  ``PipelinePipeline`` value can say, so the comparisons answer from two flags.
  """

  def __init__(self, first, last):
    self.first, self.last = first, last

  def __eq__(self, other):
    if other == plgpu.PipelinePipeline.START:
      return self.first
    if other == plgpu.PipelinePipeline.STOP:
      return self.last
    return jnp.logical_not(self.first | self.last)

  __hash__ = None


def _work_counts(scal_gmem, grid_n: int):
  """(num_tiles, lo, hi, za, zb, zero items, all items) from the metadata scalars."""
  num_tiles = scal_gmem[0]
  lo, hi, za, zb, num_zero = (scal_gmem[i] for i in range(1, 6))
  num_zero_work = num_zero * grid_n
  return num_tiles, lo, hi, za, zb, num_zero_work, num_zero_work + num_tiles * grid_n


def _zero_item(w, grid_n: int, za, zb):
  """(row block, n tile) of zero item w: blocks [0, za), then [zb, ...)."""
  zi, ni = lax.div(w, grid_n), lax.rem(w, grid_n)
  return jnp.where(zi < za, zi, zi - za + zb), ni


def _overlap(lo, hi, a, b):
  """Start and length of [max(lo, a), min(hi, b)) (length 0 when empty)."""
  start = jnp.maximum(lo, a)
  return start, jnp.maximum(jnp.minimum(hi, b) - start, 0)


def _outside_window(hs, he, lo, hi):
  """The pieces of rows [hs, he) below ``lo`` and at or above ``hi``."""
  return _overlap(hs, lo, hs, he), _overlap(hi, he, hs, he)


def _for_each_chunk(cfg: MosaicFwdConfig, n: int, ni, fn, wg=None) -> None:
  """Calls ``fn(c, col)`` for every epilogue chunk ``c`` of n tile ``ni``.

  ``col`` is the chunk's first output column.  Chunks that start at or past
  ``n`` (possible only in the last n tile) are skipped: their TMA box would lie
  wholly out of bounds.  With ``wg`` (``split_n``): only consumer ``wg``'s
  half of the chunks, ``c`` counted within that half.
  """
  cn = cfg.epilogue_n
  tail = n % cfg.block_n  # columns of the last n tile (0: a full tile)
  count = cfg.epilogue_split if wg is None else cfg.epilogue_split // 2
  first = 0 if wg is None else wg * count  # dynamic with wg: no static bound check
  for c in range(count):
    col = ni * cfg.block_n + (first + c) * cn
    if tail == 0 or (wg is None and c * cn < tail):
      fn(c, col)  # in bounds in every n tile
    else:
      pl.when(col < n)(functools.partial(fn, c, col))


def _store_zero_rows(zero_smem, out_gmem, cfg: MosaicFwdConfig, n: int, m: int, ni,
                     row_start, rows: int, lo, hi, chunks_wg=None) -> None:
  """Stores zeros from ``zero_smem`` (zeroed, ``rows`` rows) over the rows
  outside the shard's window [lo, hi) of the ``rows``-row block starting at
  ``row_start``, in every epilogue chunk of n tile ``ni`` (``chunks_wg``: only
  that consumer's chunks, with split_n)."""
  pieces = _outside_window(row_start, jnp.minimum(row_start + rows, m), lo, hi)

  def chunk(c, col):
    del c
    for start, count in pieces:
      _store_rows(zero_smem, out_gmem, 0, start, count, col, max_rows=min(rows, m),
                  width=cfg.epilogue_n)

  _for_each_chunk(cfg, n, ni, chunk, chunks_wg)


def _gmm_kernel_1wg(tiles_gmem, scal_gmem, lhs_gmem, rhs_gmem, out_gmem, *,
                    m: int, k: int, n: int, cfg: MosaicFwdConfig, transpose_rhs: bool):
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  grid_n = pl.cdiv(n, bn)
  k_steps = pl.cdiv(k, bk)
  max_tiles = tiles_gmem.shape[0] // 4
  max_rows = min(bm, m)
  out_dtype = out_gmem.dtype
  cn = cfg.epilogue_n
  num_tiles, lo, hi, za, zb, num_zero_work, total = _work_counts(scal_gmem, grid_n)

  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, cn), out_dtype))
  def _scope(o_smem):

    def zero_tile(w, first):
      blk, ni = _zero_item(w, grid_n, za, zb)
      _zero_fill_once(o_smem, first)
      _store_zero_rows(o_smem, out_gmem, cfg, n, m, ni, blk * bm, bm, lo, hi)

    def compute_tile(w):
      ni, grp, row0, row_start, row_end = _work_item(
          tiles_gmem, w, num_tiles, max_tiles, grid_n, cfg)

      def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            lambda _, lhs_smem, rhs_smem: _mma_step(acc_ref, lhs_smem, rhs_smem, transpose_rhs),
            grid=(k_steps,),
            in_specs=[_lhs_spec(cfg, row0), _rhs_spec(cfg, ni, transpose_rhs)],
            max_concurrent_steps=cfg.num_stages,
        )(lhs_gmem, rhs_gmem.at[grp])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))

      def chunk(c, col):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores read o_smem
        o_smem[...] = sm90.column_chunk(acc, c, cn).astype(out_dtype)
        plgpu.commit_smem()
        _store_rows(o_smem, out_gmem, row_start - row0, row_start,
                    row_end - row_start, col, max_rows=max_rows, width=cn)

      _for_each_chunk(cfg, n, ni, chunk)

    @plgpu.nd_loop((total,), collective_axes="sm")
    def _loop(info: plgpu.NDLoopInfo):
      (w,) = info.index
      is_zero = w < num_zero_work
      pl.when(is_zero)(lambda: zero_tile(w, info.local_index == 0))
      pl.when(jnp.logical_not(is_zero))(lambda: compute_tile(w - num_zero_work))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _zero_fill_once(smem, first, swizzle: int = 0) -> None:
  """Zeroes the staging buffer on this CTA's first zero item (``first``).

  A CTA's zero items run back to back (before its compute tiles here, after
  them in ``mosaic_fwd_ring``, which waits for the compute stores first), so a
  zero item that is not the first follows another one and the buffer still
  holds zeros: no refill, and no wait for in-flight stores, which only read it.
  ``swizzle``: the buffer's swizzle in bytes (0: none).
  """
  @pl.when(first)
  def _():
    zeros = jnp.zeros(smem.shape, smem.dtype)
    if swizzle:  # a swizzled buffer takes the zeros in its copy layout
      zeros = plgpu.layout_cast(zeros, plgpu.Layout.SMEM_GMEM_COPY(smem.shape, smem.dtype,
                                                                   swizzle))
    smem[...] = zeros
    plgpu.commit_smem()


def _mma_step(acc_ref, lhs_smem, rhs_smem, transpose_rhs: bool, delay_release: int = 1):
  # dX: rhs blocks arrive as (block_n, block_k) slices of rhs[g, n, k] and feed
  # wgmma through a transposed SMEM view (no transposed copy in HBM).
  rhs_op = rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem
  plgpu.wgmma(acc_ref, lhs_smem, rhs_op)
  # A step's buffers are refilled delay_release steps later: wait until at
  # most that many wgmmas are in flight.
  plgpu.wgmma_wait(delay_release)
  return acc_ref


def _chains_tiles(cfg: MosaicFwdConfig, k: int) -> bool:
  """Whether the 2-warpgroup kernel runs one pipeline across its tiles."""
  return cfg.pipeline_across_tiles and pl.cdiv(k, cfg.block_k) % cfg.num_stages == 0


def _gmm_kernel_2wg(tiles_gmem, scal_gmem, lhs_gmem, rhs_gmem, out_gmem, *,
                    m: int, k: int, n: int, cfg: MosaicFwdConfig, transpose_rhs: bool,
                    num_ctas: int):
  """Two consumer warpgroups (64 rows each, or half the columns each with
  ``split_n``) + one TMA producer warpgroup."""
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  hm = _WG_ROWS
  grid_n = pl.cdiv(n, bn)
  k_steps = pl.cdiv(k, bk)
  max_tiles = tiles_gmem.shape[0] // 4
  max_rows = min(hm, m)
  out_dtype = out_gmem.dtype
  cn = cfg.epilogue_n
  dr = cfg.delay_release
  chain = _chains_tiles(cfg, k)
  split = cfg.split_n
  acc_n = bn // 2 if split else bn  # accumulator columns per consumer
  guard = cfg.guard_last_stage and dr > 0 and not chain
  num_tiles, lo, hi, za, zb, num_zero_work, total = _work_counts(scal_gmem, grid_n)

  def make_pipeline(body, compute_context, row0=0, ni=0, state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_steps,),
        memory_registers=40,
        in_specs=[_lhs_spec(cfg, row0, dr), _rhs_spec(cfg, ni, transpose_rhs, dr)],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=cfg.num_stages,
        compute_context=compute_context,
        pipeline_state=state,
    )

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(ignore, ignore).get_allocations(lhs_gmem, rhs_gmem.at[0]),
      o_smem=plgpu.SMEM((2, hm, cn), out_dtype),
      # Consumers -> producer: a tile's last wgmma is done (see guard_last_stage).
      tile_done=plgpu.Barrier(num_arrivals=2),
      collective_axes="wg",
  )
  def _scope(allocs, o_smem, tile_done):
    wg = lax.axis_index("wg")
    my_smem = o_smem.at[wg]
    my_chunks = wg if split else None  # split_n: each consumer stores its own columns
    store = functools.partial(_store_rows, my_smem, out_gmem, max_rows=max_rows, width=cn)

    def zero_tile(w, first):
      # Each consumer zeroes its own 64-row half (split_n: its column half).
      blk, ni = _zero_item(w, grid_n, za, zb)
      _zero_fill_once(my_smem, first)
      _store_zero_rows(my_smem, out_gmem, cfg, n, m, ni, blk * bm + (0 if split else wg * hm),
                       hm, lo, hi, my_chunks)

    def compute_tile(w, state):
      ni, grp, row0, row_start, row_end = _work_item(
          tiles_gmem, w, num_tiles, max_tiles, grid_n, cfg)
      wg_rows = pl.ds(wg * hm, hm)
      hs = row0 + (0 if split else wg * hm)  # this consumer's first row

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((hm, acc_n), jnp.float32))
        def _acc(acc_ref):
          eval_pipeline(acc_ref)
          acc = acc_ref[...]  # waits for this consumer's last wgmma
          if guard:
            plgpu.barrier_arrive(tile_done)
          s, c = _overlap(row_start, row_end, hs, hs + hm)
          def chunk(ci, col):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores read it
            my_smem[...] = sm90.column_chunk(acc, ci, cn).astype(out_dtype)
            plgpu.commit_smem()
            store(s - hs, s, c, col)

          pl.when(c > 0)(lambda: _for_each_chunk(cfg, n, ni, chunk, my_chunks))

      def mma(_, lhs_smem, rhs_smem, acc_ref):
        if split:
          # The column offset is a whole number of 64-column swizzle tiles.
          cols = pl.ds(pl.multiple_of(wg * acc_n, acc_n), acc_n)
          rhs_half = rhs_smem.at[cols] if transpose_rhs else rhs_smem.at[:, cols]
          return _mma_step(acc_ref, lhs_smem, rhs_half, transpose_rhs, delay_release=dr)
        return _mma_step(acc_ref, lhs_smem.at[wg_rows], rhs_smem, transpose_rhs,
                         delay_release=dr)

      def idle(_, lhs_smem, rhs_smem, acc_ref):
        del lhs_smem, rhs_smem  # the stage is released untouched
        return acc_ref

      def run(body):
        make_pipeline(body, compute_context, row0, ni, state)(
            lhs_gmem, rhs_gmem.at[grp], allocations=allocs
        )

      if cfg.skip_empty_halves:
        # A consumer without rows in this tile walks the same pipeline (its
        # barrier arrivals are part of the protocol) with a body that issues no
        # wgmma.  The branch sits outside the k loop: a wgmma under a condition
        # inside the loop measured slower than no skip at all.
        empty = (wg < 2) & (hs >= row_end)
        pl.when(jnp.logical_not(empty))(lambda: run(mma))
        pl.when(empty)(lambda: run(idle))
      else:
        run(mma)
      # The producer moves on (to the next tile's loads) only once both
      # consumers' last wgmma of this tile is done with its stage.
      if guard:
        pl.when(wg == 2)(lambda: plgpu.barrier_wait(tile_done))

    @plgpu.nd_loop((total,), collective_axes="sm")
    def _loop(info: plgpu.NDLoopInfo):
      (w,) = info.index
      is_zero = w < num_zero_work
      pl.when(is_zero & (wg < 2))(lambda: zero_tile(w, info.local_index == 0))  # producer idles
      # Chained: this CTA's first compute tile fills the pipeline and its last
      # drains it (items of a CTA are w, w + num_ctas, ...).
      state = _PipelinePhase(w - num_ctas < num_zero_work,
                             w + num_ctas >= total) if chain else None
      pl.when(jnp.logical_not(is_zero))(lambda: compute_tile(w - num_zero_work, state))

    pl.when(wg < 2)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    transpose_rhs: bool,
    out_dtype: Any,
    precision: Any = None,
    interpret: Any = False,
    config: MosaicFwdConfig | None = None,
) -> jax.Array:
  """Grouped matmul ``out[m, n]``; see the module docstring for semantics.

  Args:
    lhs: [m, k] bf16/f16.
    rhs: [g_local, k, n], or [g_local, n, k] when ``transpose_rhs``; lhs dtype.
    group_sizes: int32[G] (G = g_local when ``group_offset`` is None).
    group_offset: None or int32 scalar; local group j is global group o + j.
    transpose_rhs: use each rhs[j] transposed (dX), without an HBM transpose.
    out_dtype: bf16, f16 or f32 (accumulation is always f32).
    precision: ignored (bf16/f16 wgmma with f32 accumulation is exact-product).
    interpret: False, True or ``plgpu.InterpretGPUParams`` (CPU interpret mode).
    config: tiling; ``default_config`` when None.

  Raises:
    NotImplementedError: dtypes or alignments the TMA path cannot take.
  """
  del precision
  _check_supported(lhs, rhs, out_dtype, transpose_rhs)
  m, k = lhs.shape
  g_local = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out_dtype = jnp.dtype(out_dtype)
  if m == 0 or n == 0:
    return jnp.zeros((m, n), out_dtype)
  if g_local == 0 or k == 0 or group_sizes.shape[0] == 0:
    return jnp.zeros((m, n), out_dtype)
  has_offset = group_offset is not None
  if config is not None and config.swap and out_dtype.itemsize != 2:
    # swap's transposed stores take 16 bits: its row-major ring, fitted to SMEM
    # for this output (None: the default below).
    config = fit_config(config, lhs.dtype, out_dtype)
  if config is not None:
    config = resolve_producer_zeros(config, has_offset, lhs.dtype, out_dtype)
  if config is None or (config.num_compute_wgs == 2 and not config.ring
                        and k <= config.block_k) or (
      config.ring and m < (config.swap_rows if config.swap else config.block_m)
      + config.tail_rows):
    # The warp-specialized pipeline never releases a tile's last slot: with a
    # single k step the producer could refill it early, so use one warpgroup
    # (the ring releases every slot).  The ring's loads need 128 + tail_rows rows
    # (swap: swap_rows + tail_rows).
    config = default_config(m, k, n, g_local, lhs.dtype, transpose_rhs, out_dtype)
    config = resolve_producer_zeros(config, has_offset, lhs.dtype, out_dtype)
  if config.smem_bytes(lhs.dtype, out_dtype) > config.smem_budget():
    raise NotImplementedError(
        f"config {config} needs {config.smem_bytes(lhs.dtype, out_dtype)} bytes of SMEM"
    )

  if config.ring:
    if config.tail_rows and out_dtype.itemsize != 2:
      raise NotImplementedError(f"tail_rows needs a bf16/f16 output, got {out_dtype}")
    if config.swap:
      from ragdot.backends import mosaic_fwd_swap  # pylint: disable=g-import-not-at-top  (imports this module)
      return mosaic_fwd_swap.gmm(lhs, rhs, group_sizes, group_offset,
                                 transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                                 config=config, interpret=interpret)
    from ragdot.backends import mosaic_fwd_ring  # pylint: disable=g-import-not-at-top  (imports this module)
    return mosaic_fwd_ring.gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs=transpose_rhs,
                               out_dtype=out_dtype, config=config, interpret=interpret)
  tiles, scalars = backends.flat_schedule(
      group_sizes, group_offset, m=m, num_local=g_local, block_m=config.block_m,
      use_kernel=config.schedule_kernel, interpret=bool(interpret))
  tiles, scalars, lhs, rhs = match_varying(tiles, scalars, lhs, rhs)
  num_ctas = _num_sms(config, bool(interpret))
  if config.num_compute_wgs == 1:
    body, extra = _gmm_kernel_1wg, {}
  else:
    body = functools.partial(_gmm_kernel_2wg, num_ctas=num_ctas)
    extra = dict(num_threads=3, thread_name="wg")
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  kernel = plgpu.kernel(
      functools.partial(body, m=m, k=k, n=n, cfg=config, transpose_rhs=transpose_rhs),
      out_type=out_struct((m, n), out_dtype, lhs),
      grid=(num_ctas,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup
      ),
      interpret=interpret if interpret else None,
      **extra,
  )
  # plgpu.kernel drops the shard_map axis type of out_type: restore it.
  return make_varying(kernel(tiles, scalars, lhs, rhs), varying_axes(lhs))
