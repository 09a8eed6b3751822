"""The forward / dX kernels' configuration (``MosaicFwdConfig``) and how it is
chosen and fitted: the heuristic default, the GPU sweep's candidates, fitting
SMEM and the output dtype, and resolving ``producer_zeros`` for one call.
``mosaic_fwd`` (the kernels) re-exports the public names."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl

from ragdot.backends import sm90

_SMEM_RESERVE = 1024  # barriers and alignment (48 bytes measured for 2 warpgroups)
_WG_ROWS = 64  # wgmma M per warpgroup
SWAP_ROWS = 256  # wgmma's largest N: the default and largest swap_rows
MIN_SWAP_ROWS = 16  # the smallest swap_rows
# Mean rows per group where swap tiles of ~the group's size are measured (v21h,
# v22a, v40): the sweep offers them and the dispatcher fits entries to them.
_SMALL_GROUPS = (96, 192)
# Below that, down to ~48 rows: the folded-tail form (measured at 64, v41a).
_FEW_ROWS = (48, 96)

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
    step's wgmma before releasing its stage (the ring too: there a late stage
    then never holds back the release of the one before it).
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
    with ``swap``); skip_empty_halves, pipeline_across_tiles and
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
  swap_rows: swap only: rows per tile (wgmma's N), a multiple of 16 from 16
    to 256 (with ``tail_on_m``: swap_rows + tail_rows >= 64).  Fewer than 256 fit groups of fewer rows with less padding (e.g.
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
  short_tile_rows: swap only, 0 (off), 64 or 128 (< swap_rows): a tile whose rows
    (from its 8-aligned first row to its group's end) number at most this runs
    wgmmas of N = short_tile_rows instead of swap_rows, and its producer loads
    only those rows: the one tile of a small group, or a group's last tile when
    more rows are left than tail_rows.  For skewed routing, where many groups
    hold far fewer rows than swap_rows (a swap tile computes all R of its rows
    whatever its group holds).  One more copy of the k loop and epilogue in the
    kernel.  Measured on the H200 (docs/performance.md v26e, v27a-d): with skewed
    routing 128 0.84-0.87x the time on the Qwen calls, 64 0.81-0.85x (DeepSeek-V3's
    dX with 160-row tiles 0.87x); with routed group sizes 0.996-1.003x, except
    Qwen3-30B down's forward (12-step k loop: 1.008-1.016x).
  share_rows: swap only: 2-CTA clusters whose two CTAs take one row tile and
    two adjacent n tiles (``n_tile`` 2c and 2c + 1); each loads half of every
    stage's rows and multicasts it to both, so a CTA reads 16 + 16 KB from L2
    per k step instead of 32 + 16 (cuBLAS's batched kernels share an operand
    over 1 x 2 clusters the same way).  A stage is refilled once the consumers
    of both CTAs released it (a cluster barrier).  Needs an even num_sms.
  zero_box_rows: with producer_zeros, the rows of its zero buffer (8, 16, 32
    or 64): each 64-row half of a zero item goes out in stores of at most
    this many rows.  Fewer rows leave room for wider epilogue chunks (a
    128 x 256 ring in 4 stages fits 8 rows beside 128-column chunks, 64 rows
    only beside 64-column ones) at the price of more, smaller TMA stores
    (v17a: 8 rows cost 1.15-1.83x where 64 rows saved 6%).
  zero_front: with producer_zeros, the CTAs whose item list is one compute
    item shorter (the last round of items is partial) each take up to this
    many zero boxes (64 rows x epilogue_n columns) before the round-robin
    split, and write them once their own loads are issued, in the time the
    others still compute; 0: every CTA the same share, spread over its k
    steps.
  shard_ring_above: a swap config of a shard call that keeps swap
    (``producer_zeros=False``, see ``shard_keeps_swap``): when the shard's rows
    (known on the device only) exceed this multiple of its fair share
    ``m * g_local / G``, run ``row_major_ring`` with producer zeros instead.
    Both kernels are launched on one output buffer and the one not chosen
    exits at once (a ``lax.cond`` costs a host round trip: +46 us a call,
    docs/performance.md v45a).  Swap shards measured faster than the ring on
    routed sizes (the ring 1.04-1.17x their time) and slower from 1.46x the
    fair share on (0.80-0.96x; v44f-h, v45a-b).
  widen_staging: swap with 8-bit weights beside 16-bit rows (W8A16) only: 0
    widens each consumer's (64, block_k) weight slice in registers and feeds
    them to wgmma as its A operand (rhs [g, n, k] only; each step waits for its
    own wgmmas, which read those registers); 1 or 2 writes the widened slice
    into that many SMEM buffers per consumer (alternating by k step: with 2
    and ``delay_release`` 1 one step's wgmmas stay in flight while the next
    slice is widened) and feeds wgmma from there, which also takes the
    weights as stored in [g, k, n] (MN-major A).  Ignored with 16-bit weights.
  widen_rows: swap only, 8-bit rows beside 8-bit weights laid out [g, k, n]
    (wgmma takes 8-bit operands K-major only): the rows are widened to bf16
    first (one XLA convert of m x k) and the W8A16 form runs (``widen_staging``),
    reading the weights as stored, instead of an fp8 [g, n, k] copy of all the
    weights and 8-bit wgmma.  Needs a 16-bit output (else the copy).
    Ignored otherwise.
  pair_schedule: with ``shard_ring_above``, both kernels' tile schedules from
    one schedule-kernel launch instead of one each: one kernel of 2.8-3.1 us
    for two of 2.2-2.6 and 1.9-2.1 us, 0.980-0.993x the shard call's time
    (docs/performance.md v46a).  ``shard_keeps_swap`` sets it with its limit.
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
  zero_front: int = 0
  swap: bool = False
  tail_split: bool = False
  tail_on_m: bool = False
  swap_rows: int = SWAP_ROWS
  swizzle_staging: bool = False
  short_tile_rows: int = 0
  share_rows: bool = False
  shard_ring_above: float | None = None
  pair_schedule: bool = False
  widen_staging: int = 0
  widen_rows: bool = False

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
                                        or not MIN_SWAP_ROWS <= self.swap_rows <= SWAP_ROWS):
      raise ValueError(f"swap_rows needs swap=True and a multiple of 16 from 16 to 256, "
                       f"got {self}")
    if self.tail_on_m and self.swap_rows + self.tail_rows < _WG_ROWS:
      raise ValueError(f"tail_on_m needs swap_rows + tail_rows >= 64 (its wgmma reads the "
                       f"tile's last 64 rows), got {self}")
    if self.swizzle_staging and not self.swap:
      raise ValueError(f"swizzle_staging needs swap=True, got {self}")
    if self.short_tile_rows and (not self.swap or self.short_tile_rows not in (64, 128)
                                 or self.short_tile_rows >= self.swap_rows):
      raise ValueError(f"short_tile_rows needs swap=True and 64 or 128 (< swap_rows), "
                       f"got {self}")
    if self.share_rows and (not self.swap or (self.num_sms or 2) % 2):
      raise ValueError(f"share_rows needs swap=True and an even num_sms, got {self}")
    if self.shard_ring_above is not None and (not self.swap or not self.shard_ring_above > 0):
      raise ValueError(f"shard_ring_above needs swap=True and a value > 0, got {self}")
    if self.widen_staging not in (0, 1, 2) or (self.widen_staging and not self.swap):
      raise ValueError(f"widen_staging must be 0, 1 or 2 (1 and 2 need swap=True), got {self}")
    if self.widen_rows and not self.swap:
      raise ValueError(f"widen_rows needs swap=True, got {self}")
    if self.pair_schedule and self.shard_ring_above is None:
      raise ValueError(f"pair_schedule needs shard_ring_above, got {self}")
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
    if self.zero_front < 0 or (self.zero_front and (not self.ring
                                                    or self.producer_zeros is False)):
      raise ValueError(f"zero_front must be >= 0 and needs ring=True with producer_zeros, "
                       f"got {self}")

  @property
  def epilogue_n(self) -> int:
    """Columns of one epilogue chunk (the staging buffer's width)."""
    return self.block_n // self.epilogue_split

  def smem_bytes(self, in_dtype: Any, out_dtype: Any, rhs_dtype: Any = None,
                 scales_per_stage: int = 0) -> int:
    """Static SMEM footprint (pipeline buffers + output staging chunk), with
    weights of ``rhs_dtype`` (default ``in_dtype``; a narrower one: W8A16,
    with its ``widen_staging`` buffers) and ``scales_per_stage`` f32 weight
    scales in every stage (swap only: ``block_n`` per-column scales, or one per
    consumer for blocks of whole 64-column slices).

    Barriers and alignment add a few dozen bytes on top (48 measured at
    lowering for the 2-warpgroup kernel): ``smem_budget`` keeps 1 KiB for them.
    """
    isz, osz = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    wsz = isz if rhs_dtype is None else jnp.dtype(rhs_dtype).itemsize
    if self.swap:  # swap_rows + tail rows and 128 columns per stage; 64 x 64 staging per consumer
      per_stage = ((self.swap_rows + self.tail_rows) * isz + self.block_n * wsz) * self.block_k
      staging = self.num_compute_wgs * _WG_ROWS * _WG_ROWS * osz
      if wsz < isz:  # the widened weight slices, (64, block_k) each
        staging += self.widen_staging * self.num_compute_wgs * _WG_ROWS * self.block_k * isz
      per_stage += scales_per_stage * 4
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
    # the same k steps, at most 4 stages (measured best for Qwen3-30B's EP=8 shard
    # forward, v17, v42e; not measured on other shapes' shards).
    cfg = row_major_ring(cfg)
  if cfg.ring and has_offset and cfg.zero_lead is None:  # (an explicit zero_lead: off)
    fitted = _fit_split(dataclasses.replace(cfg, producer_zeros=True), dtype, out_dtype)
    if fitted is not None:
      return fitted
  return dataclasses.replace(cfg, producer_zeros=False, zero_front=0)


def swap_rows_for_mean(mean_rows: float, share: float = 5 / 4) -> int:
  """Rows per swap tile for groups of ``mean_rows`` rows on average: ``share``
  of that, a multiple of 16 from 64 to SWAP_ROWS, so most groups are one tile."""
  return min(SWAP_ROWS, max(64, 16 * math.ceil(mean_rows * share / 16)))


def one_tile_groups(cfg: MosaicFwdConfig, rows: int) -> MosaicFwdConfig:
  """A swap config in tiles of ``rows`` rows without a folded tail, 64-row short
  tiles and no shared rows: each group of up to ~``rows`` rows is one tile that
  streams its weight block once."""
  return dataclasses.replace(cfg, swap_rows=rows, tail_rows=0, tail_split=False,
                             tail_on_m=False, short_tile_rows=64 if rows > 64 else 0,
                             share_rows=False)


def tail_fold_groups(cfg: MosaicFwdConfig, rows: int) -> MosaicFwdConfig:
  """A swap config in tiles of ``rows`` rows with 16 tail rows folded as a split
  tail, no short tiles and no shared rows: a group of up to ``rows`` + 16 rows
  (counted from its first row rounded down to a multiple of 8) is one tile."""
  return dataclasses.replace(cfg, swap_rows=rows, tail_rows=16, tail_split=True,
                             tail_on_m=False, short_tile_rows=0, share_rows=False)


def _fitted_form(cfg: MosaicFwdConfig, mean: float) -> MosaicFwdConfig | None:
  """The swap tiles for groups of ``mean`` rows on average (None outside the
  windows where they are measured)."""
  if _SMALL_GROUPS[0] <= mean <= _SMALL_GROUPS[1]:
    return one_tile_groups(cfg, swap_rows_for_mean(mean))
  if _FEW_ROWS[0] <= mean < _FEW_ROWS[1]:
    return tail_fold_groups(cfg, swap_rows_for_mean(mean, 9 / 8))
  return None


def fit_rows_per_group(cfg: MosaicFwdConfig, m: int, groups: int) -> MosaicFwdConfig:
  """``cfg`` for a call of ``m`` rows over ``groups`` groups: a swap config whose
  tiles (rows + folded tail) exceed those fitted to the call's mean group takes
  the fitted ones, else ``cfg``.  Groups of 96-192 rows on average:
  ``one_tile_groups`` of ``swap_rows_for_mean``; of 48-96: ``tail_fold_groups``
  of 9/8 the mean (at 64 rows, 80 + 16: 0.78-0.97x the time of the entries tuned
  on 4096 tokens that the Qwen3 calls at 1024 borrow, v41b).

  A swap tile computes all its rows whatever its group holds, so the 256-row
  tiles tuned on groups of ~256 rows run half padding on groups of ~128 (a
  table entry borrowed by a call with fewer rows per group: gpt-oss-120b's
  forward on Qwen3-235B's entry ran 1.6x the time of 160-row tiles,
  docs/performance.md v40a; the Qwen calls at 2048 tokens 1.17-1.25x, v40c).
  Every swap entry of the table on groups of ~128 rows has this form
  (DeepSeek-V3, gpt-oss-120b)."""
  if not cfg.swap or groups <= 0:
    return cfg
  fitted = _fitted_form(cfg, m / groups)
  if fitted is None:
    return cfg
  rows = fitted.swap_rows + fitted.tail_rows
  if cfg.swap_rows + cfg.tail_rows <= rows or m < rows:
    return cfg
  return fitted


# A shard's swap tiles pay off where an expert's weights are this large (bytes), on
# forward calls with groups of 96-192 rows on average: set between measured points (6 MB
# lost at ~128 rows, 17-59 MB won; v41e-g, v42e), not measured at the edges.
_SHARD_SWAP_EXPERT_BYTES = 10 << 20
# Groups of 96-288 rows on average keep swap; past 192 rows only where the call's output
# is at least as wide as its contraction (n >= k), forward and dX alike: there the zero
# rows weigh most against the k loop's work (v43a, v44f).
_SHARD_SWAP_GROUPS = (96, 288)
_SHARD_SWAP_ANY_WIDTH = 192  # up to this many rows per group whatever n / k
# Over 192 rows per group the swap shards keep swap only up to this multiple of
# their fair share of the rows (on the device; the ring above: v45a-b).
_SHARD_RING_ABOVE = 1.25


def shard_keeps_swap(cfg: MosaicFwdConfig, m: int, groups: int, k: int, n: int,
                     itemsize: int, transpose_rhs: bool = False) -> MosaicFwdConfig:
  """``cfg`` for a shard call (contraction ``k``, output width ``n``, elements of
  ``itemsize`` bytes) of a full call of ``m`` rows over ``groups`` groups: a swap
  config (``producer_zeros=None``) stays swap, its consumers writing the zero
  rows (``producer_zeros=False``), instead of becoming the row-major ring, on
  groups of 96-192 rows on average (forward calls: with experts (k x n) of
  >= 10 MB; dX calls, ``transpose_rhs``: any), and on groups of 192-288 rows
  where n >= k.  On the latter the shard's rows pick the kernel at run time
  (``shard_ring_above``): above 1.25x its fair share the row-major ring with
  producer zeros runs instead, both kernels' schedules built by one launch
  (``pair_schedule``: 0.980-0.993x the time of two launches, v46a).

  Measured on EP=8 shards (docs/performance.md v41e-g, v42e-f, v43a, v44f), the ring's
  time over swap's.  ~128 rows: forward gpt-oss-120b (17-33 MB experts) 1.12x,
  Qwen3-235B gate_up at 2048 tokens (25 MB) 1.26x, DeepSeek-V3 gate_up (59 MB) 1.34x,
  Qwen3-30B gate_up (6 MB) 0.96x; dX gpt-oss-120b 1.13-1.21x, DeepSeek-V3 down (29 MB)
  1.21x, Qwen3-30B gate_up / down at 2048 tokens (6 / 3 MB) 1.11x / 1.06x.  ~256 rows,
  n >= k: forward Qwen3-30B down (n 2048, k 768) 1.17x, Qwen3-235B down (4096 / 1536)
  1.07x; dX Qwen3-30B gate_up (2048 / 1536) 1.10-1.12x, Qwen3-235B gate_up (4096 / 3072)
  1.10x.  ~256 rows, n < k: forward Qwen3-30B gate_up (1536 / 2048) 0.80-0.85x; dX
  Qwen3-30B down (768 / 2048) 0.87x, Qwen3-235B down (1536 / 4096) 0.86x.  (A reading:
  the ring's producer spreads the zero rows over its k steps, where swap's consumers
  write them after the ring; where the zero rows outweigh the k loop's bytes, the ring
  pays for its second weight read of every group over 128 rows and its tiles without
  the rows' 2-CTA sharing.)  Under skewed routing the same ~256-row shards hold more
  rows, and the ring took 0.80-0.96x swap's time from 1.46x the fair share on (v45a-b;
  the gated pair 1.02-1.08x swap's time at the fair share, the ring's +0.3-5.4% above,
  with two schedule launches; one launch saves 1.1-1.9 us a call, v46a).
  The ~128-row shards' crossover is not measured: they keep swap whatever their rows."""
  if not cfg.swap or cfg.producer_zeros is not None or groups <= 0:
    return cfg
  mean = m / groups
  lo, hi = _SHARD_SWAP_GROUPS
  if not lo <= mean <= hi or (mean > _SHARD_SWAP_ANY_WIDTH and n < k):
    return cfg
  if (not transpose_rhs and mean <= _SHARD_SWAP_ANY_WIDTH
      and k * n * itemsize < _SHARD_SWAP_EXPERT_BYTES):
    return cfg
  ring_above, pair = cfg.shard_ring_above, cfg.pair_schedule  # (a limit set already stays)
  if ring_above is None and mean > _SHARD_SWAP_ANY_WIDTH:
    ring_above, pair = _SHARD_RING_ABOVE, True
  return dataclasses.replace(cfg, producer_zeros=False, zero_front=0, shard_ring_above=ring_above,
                             pair_schedule=pair)


def row_major_ring(cfg: MosaicFwdConfig) -> MosaicFwdConfig:
  """A swap config's row-major ring counterpart (128 x 256 tiles, no tails, at
  most 4 stages, as measured): what runs where swap cannot (shard calls with
  producer zeros, 32-bit outputs)."""
  return dataclasses.replace(cfg, swap=False, block_n=256, tail_rows=0, tail_split=False,
                             tail_on_m=False, swap_rows=SWAP_ROWS, swizzle_staging=False,
                             short_tile_rows=0, share_rows=False, shard_ring_above=None,
                             pair_schedule=False, widen_staging=0, widen_rows=False,
                             num_stages=min(cfg.num_stages, 4))


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


# A W8A16 call's swap tiles when its config is no swap one: 128 x 64 steps in 4
# stages, 64-row short tiles.
_WEIGHT_ONLY = MosaicFwdConfig(block_m=128, block_n=128, block_k=64, num_stages=4,
                               num_compute_wgs=2, ring=True, swap=True, producer_zeros=False,
                               short_tile_rows=64)


def weight_only_decode(m: int, groups: int) -> bool:
  """Whether a weight-only 8-bit call of ``m`` rows over ``groups`` groups is
  decode-sized: fewer than 48 rows per group on average, where
  ``weight_only_config`` of no config takes ``decode_rows`` tiles."""
  return groups > 0 and m / groups < _FEW_ROWS[0]


def weight_only_tile_rows(m: int, groups: int) -> int | None:
  """The tile rows ``weight_only_config`` of no config gives a decode-sized
  call (``decode_rows`` of its mean group; fewer than 16 rows count as 16), or
  None above decode size (the rows then come from the 16-bit entry's tiles)."""
  m = max(m, MIN_SWAP_ROWS)
  return decode_rows(m / groups) if weight_only_decode(m, groups) else None


def decode_rows(mean_rows: float) -> int:
  """Rows of a W8A16 decode tile for groups of ``mean_rows`` on average: a
  multiple of 16 (wgmma's N) from 16 to 64 covering twice the mean plus 8
  (a tile starts at an 8-aligned row), so most groups are one tile (each
  more tile streams the group's weights again) while a tile loads few rows
  beside its weights.  H100 (docs/performance.md v54e-f): 16 rows for ~4 a
  group 0.85-1.0x the time of 64 (Qwen3 decode, both layouts), 32 and 16
  rows for 32 a group 1.5-1.6x / 2.3-2.4x (Mixtral)."""
  return min(64, max(16, -(-int(2 * mean_rows + 8) // 16) * 16))


def stage_scales(block_n: int, scale_cols: int | None) -> int:
  """f32 weight scales a swap stage holds: one per consumer where the scale
  blocks span whole 64-column consumer slices (``scale_cols`` a multiple of
  64), else a row of ``block_n`` per-column ones (also the bound for
  ``scale_cols`` None: not known)."""
  return 2 if scale_cols and scale_cols % _WG_ROWS == 0 else block_n


def weight_only_config(cfg: MosaicFwdConfig | None, m: int, groups: int,
                       k: int | None = None, transpose_rhs: bool = True,
                       scale_rows: int | None = None,
                       scale_cols: int | None = None) -> MosaicFwdConfig:
  """The swap config a weight-only 8-bit call runs (16-bit rows, fp8 weights
  widened by the consumers as wgmma's A operand): ``cfg``'s tiles if it is a
  swap config, else ``_WEIGHT_ONLY``'s, fitted to the call's rows per group
  (``fit_rows_per_group``, ``groups`` > 0) and to its ``m`` rows; without what
  reads the weights otherwise: a tail on wgmma's M axis (folded as more N
  instead), the row-major ring of shard calls (``shard_ring_above``,
  ``producer_zeros``).  Where the widened slices go (``widen_staging``):
  ``cfg``'s choice, else registers for rhs [g, n, k] and two SMEM buffers per
  consumer for [g, k, n] (read as stored: wgmma takes an MN-major A from SMEM
  only); registers or one buffer: each k step waits for its own wgmmas
  (``delay_release`` 0: the next step's widened weights overwrite what they
  read), two buffers: one step's stay in flight (``delay_release`` 1).  The
  stages are cut until the buffers fit SMEM (to 2; then k steps of 64 columns,
  then one buffer).  Without a swap config, groups
  of fewer than 48 rows on average (decode) take tiles of ``decode_rows``
  with k steps of 128 columns in 4 stages where ``k`` takes them (H100,
  docs/performance.md v53b: 0.90-0.91x the time of 64-column steps in 8
  stages).  Fewer than 16 rows (the smallest swap tile) count as 16: the
  kernel pads such calls.  ``scale_rows``: the weights carry a scale per
  ``scale_rows`` contracting rows (``gmm``'s ``rhs_scale``): each k step then
  lies in one scale block (k steps of 64 columns where 128 do not divide it;
  ValueError where 64 do not either), and a stage holds its scales
  (``stage_scales`` of the blocks' ``scale_cols`` columns)."""
  if scale_rows is not None and scale_rows % 64:
    raise ValueError(f"scale_rows must be a multiple of 64, got {scale_rows}")
  m = max(m, MIN_SWAP_ROWS)
  base = cfg if cfg is not None and cfg.swap else _WEIGHT_ONLY
  staging = base.widen_staging if base.widen_staging or transpose_rhs else 2
  base = dataclasses.replace(base, tail_on_m=False, shard_ring_above=None, pair_schedule=False,
                             producer_zeros=False, zero_front=0, widen_staging=staging,
                             delay_release=int(staging == 2))
  rows = weight_only_tile_rows(m, groups)
  if (cfg is None or not cfg.swap) and rows is not None:
    wide = k is not None and k % 128 == 0
    base = dataclasses.replace(base, swap_rows=rows, tail_rows=0,
                               tail_split=False,
                               short_tile_rows=0, share_rows=False,
                               block_k=128 if wide else 64, num_stages=4 if wide else 8)
  if base.block_k == 128 and ((k is not None and k % 128)  # 128 one-byte columns must tile k
                              or (scale_rows is not None and scale_rows % 128)):
    base = dataclasses.replace(base, block_k=64)
  if base.block_k == 32 and not transpose_rhs:  # (a staged (32, 64) slice: too narrow for
    base = dataclasses.replace(base, block_k=64)  # its 128-byte swizzle)
  base = fit_rows_per_group(base, m, groups)
  if m < base.swap_rows + base.tail_rows:  # tiles no taller than the call
    tail = base.tail_rows if m - base.tail_rows >= 64 else 0
    rows = min(base.swap_rows, (m - tail) // 16 * 16)
    base = dataclasses.replace(
        base, swap_rows=rows, tail_rows=tail, tail_split=base.tail_split and tail > 0,
        short_tile_rows=base.short_tile_rows if base.short_tile_rows < rows else 0)
  scales = 0 if scale_rows is None else stage_scales(base.block_n, scale_cols)
  fits = lambda c: c.smem_bytes(jnp.bfloat16, jnp.bfloat16, jnp.float8_e4m3fn,
                                scales) <= c.smem_budget()
  cut = base
  while cut.num_stages > 2 and not fits(cut):
    cut = dataclasses.replace(cut, num_stages=cut.num_stages - 1)
  if not fits(cut) and (base.block_k == 128 or base.widen_staging == 2):
    # k steps of 64 columns, else one buffer a consumer (each step waits)
    smaller = (dataclasses.replace(base, block_k=64) if base.block_k == 128 else
               dataclasses.replace(base, widen_staging=1))
    return weight_only_config(smaller, m, groups, k, transpose_rhs, scale_rows, scale_cols)
  return cut


def k_tile(config: MosaicFwdConfig, dtype: Any) -> int:
  """Columns of the TMA tiles k is cut in: the k step's swizzle (up to 128
  bytes), so 64 of a 16-bit dtype (a partial last k step is zero-filled), up to
  128 of an 8-bit one; k must be a multiple of it."""
  itemsize = jnp.dtype(dtype).itemsize
  return min(128, config.block_k * itemsize) // itemsize


def for_one_byte(config: MosaicFwdConfig, k: int) -> MosaicFwdConfig:
  """A 16-bit config for 1-byte (fp8) operands: the k step doubled, so each
  stage moves the same bytes (not past 128 columns, the widest swizzle, nor
  where the two-warpgroup pipeline would be left one k step: see ``gmm``)."""
  block_k = 2 * config.block_k
  if block_k > 128 or k % block_k:
    return config
  if config.num_compute_wgs == 2 and not config.ring and k <= block_k:
    return config
  return dataclasses.replace(config, block_k=block_k)


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
  fit (f32 output) the epilogue is split further, then stages drop.  1-byte
  (fp8) operands take k steps of 128 columns (``for_one_byte``).
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
  if jnp.dtype(dtype).itemsize == 1:
    cfg = for_one_byte(cfg, k)
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
  """Candidate configs for a GPU sweep (default first; SMEM-feasible only, <= 23,
  plus for dX the fitted swap forms' copies on 5 and 6 stages: <= 27).

  An f32 output gets a larger epilogue split where that makes a candidate fit.
  1-byte (fp8) operands: each k step holds a 16-bit one's bytes (twice the
  columns), plus the default at 64 columns on more stages (<= 2 more).
  """
  out_dtype = dtype if out_dtype is None else out_dtype
  one_byte = jnp.dtype(dtype).itemsize == 1
  base = default_config(m, k, n, g, dtype, transpose_rhs, out_dtype)
  out = [base]
  extra = 0  # candidates past the cap of 23
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
    if base.block_n == 192:  # the ring in the default's 192-column tiles (no tails)
      c = fit_config(dataclasses.replace(base, ring=True, grid_tile_width=1), dtype, out_dtype)
      if c is not None and c not in out:
        out.append(c)
    # The ring's tails, swap and split_n take tiles of 128 or 256 columns: where
    # the default's are 192 wide (n an odd multiple of 64 such as gpt-oss's 2880,
    # or 5760 = 30 x 192), theirs are 128 wide, the last one partly past n.
    wide = dataclasses.replace(base, block_n=128) if base.block_n == 192 else base
    # The hand-written ring, bare and with folded tails (v14: DeepSeek-V3's
    # 128 +- 11-row groups 0.89x the table with 16; the bare ring 0.94-0.98x on
    # Qwen3-30B).
    if wide.block_n % 128 == 0:
      for tail in (0, 16, 32):  # fit_config drops tails for f32 (a duplicate then)
        c = fit_config(dataclasses.replace(wide, ring=True, tail_rows=tail, grid_tile_width=1),
                       dtype, out_dtype)
        if c is not None and c not in out:
          out.append(c)
      # Rows on wgmma's N axis with 32 tail rows folded as two 144-row wgmmas (v19:
      # 0.93-0.96x the ring / pipeline entries on the Qwen3 gate_up forwards and
      # Qwen3-235B's dX; tails 0, 16 and 64 lost).
      # Staged through a swizzled buffer (v24c-d: 0.95-0.97x the unswizzled one).
      # Short tiles of <= 64 rows as 64-row wgmmas: routed sizes (what the tuner times
      # first) barely reach them (v27a: 0.996-1.003x on five of the six Qwen calls,
      # 1.008-1.016x on Qwen3-30B down's forward), and skewed routing needs them (0.81-0.84x
      # the time; 128-row short tiles 0.84-0.87x).
      # On 2-CTA clusters sharing the tile's rows (v32a-b: 0.970-0.998x on the six
      # Qwen forward / dX calls).
      swap = dataclasses.replace(wide, ring=True, swap=True, block_n=128, tail_rows=32,
                                 tail_split=True, epilogue_split=2, grid_tile_width=1,
                                 num_stages=4, swizzle_staging=True, short_tile_rows=64,
                                 share_rows=wide.num_sms is None or wide.num_sms % 2 == 0)
      # The same with the tail row-major on the first consumer (v20: 0.95 / 0.97x the
      # ring on the Qwen3-30B dX calls, a tie with the split fold on the gate_up forwards).
      swap_m = dataclasses.replace(swap, tail_split=False, tail_on_m=True)
      # Each step's stage released once its wgmmas are done (v38a-b: 0.984-0.987x on
      # Qwen3-30B down's forward / dX, 0.991-1.006x on the gate_up / Qwen3-235B calls).
      swap_r = dataclasses.replace(swap, delay_release=0)
      if (m >= SWAP_ROWS + swap.tail_rows and jnp.dtype(out_dtype).itemsize == 2
          and _fits(swap, dtype, out_dtype)):  # (else gmm would run another config)
        out += [swap, swap_r, swap_m]
      # Groups of 96-192 rows on average: swap tiles of ~9/8 the mean with 16
      # tail rows split, and of ~5/4 the mean without a tail (DeepSeek-V3 down dX,
      # groups of 128 +- 11 rows: 144 + 16 rows 0.932 / 0.921x its Triton entry, 160
      # rows 0.942 / 0.924x in two A/Bs, v21h / v22a, and half the lowering time; the
      # forward lost, 1.02-1.05x the ring).  The one without a tail keeps the 64-row
      # short tiles (v27a-b, its dX: 0.986x routed, 0.874x skewed, with the staging).
      # Groups of 48-96 rows: the same two (at 64, 80 + 16 rows 0.80-0.97x and 80
      # rows 0.82-1.0x the borrowed 4096-token entries, v41a).
      mean = m / max(g, 1)  # (as fit_rows_per_group counts it)
      # (not measured with share_rows)
      small = tail_fold_groups(swap, swap_rows_for_mean(mean, 9 / 8))
      plain = one_tile_groups(swap, swap_rows_for_mean(mean))
      for c in (small, plain):
        if (_FEW_ROWS[0] <= mean <= _SMALL_GROUPS[1] and m >= c.swap_rows + c.tail_rows
            and jnp.dtype(out_dtype).itemsize == 2 and _fits(c, dtype, out_dtype)):
          out.append(c)
          if transpose_rhs:  # dX: the same tiles on 5 and 6 stages, where they fit
            deeper = _deeper(c, dtype, out_dtype)
            out += deeper
            extra += len(deeper)
    # 64-row tiles split by columns: half the padding of a group's last tile,
    # 1.67x the L2 -> SMEM bytes per FLOP (the default already runs the L2 at
    # 81% on Qwen3-30B gate_up), so after the likelier winners.
    if wide.block_n % 128 == 0:
      for stages, split, width in ((4, 2, 4), (5, 4, 8)):
        split = min(split, wide.block_n // 64)  # chunks of >= 64 columns
        c = fit_config(dataclasses.replace(
            wide, block_m=_WG_ROWS, split_n=True, num_stages=stages,
            epilogue_split=split, grid_tile_width=width), dtype, out_dtype)
        if c is not None and c not in out:
          out.append(c)
  for bm, bn, bk, stages, width, split, ctas in _SWEEP:
    if bn > max(base.block_n, 64):
      continue
    if bk is not None and one_byte:
      bk *= 2  # (the bytes of a 16-bit step)
    c = MosaicFwdConfig(bm, bn, bk or base.block_k, stages, 0, width,
                        num_compute_wgs=bm // _WG_ROWS, epilogue_split=split,
                        ctas_per_sm=ctas)
    c = _fit_split(c, dtype, out_dtype)
    if c is not None and c not in out:
      out.append(c)
  out = out[:23 + extra]
  # (23: the swap candidate with delay_release=0, v38, did not push one out; the dX
  # fitted forms' deeper rings come on top)
  if one_byte:
    # fp8 (untuned before v52): the default with its 16-bit k step of 64 columns
    # (half the bytes a stage) on twice the stages: more loads in flight where the
    # calls stream weights (decode read them at 0.81x the bf16 kernel's rate, v51a).
    half = dataclasses.replace(base, block_k=base.block_k // 2,
                               num_stages=2 * base.num_stages)
    for c in (half, dataclasses.replace(half, num_stages=base.num_stages + 2)):
      if base.block_k == 128 and c not in out and _fits(c, dtype, out_dtype):
        out.append(c)
  return out


def _deeper(cfg: MosaicFwdConfig, dtype: Any, out_dtype: Any,
            most: int = 6) -> list[MosaicFwdConfig]:
  """``cfg`` on each stage count from num_stages + 1 to ``most`` that fits SMEM.
  Bytes-bound dX calls on fitted swap tiles ran 2-6% faster on 5 or 6 stages than
  on 4 (docs/performance.md v42g, v43c-g; 5 beat 6 on DeepSeek-V3 down's at 2048
  tokens, v43g); their forwards did not (0.995-1.055x, v43d)."""
  out = []
  for stages in range(cfg.num_stages + 1, most + 1):
    c = dataclasses.replace(cfg, num_stages=stages)
    if _fits(c, dtype, out_dtype):
      out.append(c)
  return out


def _chains_tiles(cfg: MosaicFwdConfig, k: int) -> bool:
  """Whether the 2-warpgroup kernel runs one pipeline across its tiles."""
  return cfg.pipeline_across_tiles and pl.cdiv(k, cfg.block_k) % cfg.num_stages == 0
