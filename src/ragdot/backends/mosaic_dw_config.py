"""The dW (``tgmm``) kernel's configuration (``MosaicDwConfig``) and how it
is chosen: the register split of the warp-specialized bodies, the SMEM count,
fitting a config to a shape, the heuristic default and the GPU sweep's
candidates.  ``mosaic_dw`` (the kernels) re-exports the public names."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl

from ragdot.backends import sm90

_SMEM_RESERVE = 2048  # barriers and alignment
_PIECE_ROWS = 64  # block_m of a side_rows ring
_NARROW_CHUNK_COLS = 32  # the one epilogue chunk width below 64: a 64-byte swizzle (16-bit)
_MAX_EPILOGUE_SPLIT = 6
_PRODUCER_REGISTERS = 40  # per thread of the TMA warpgroup (warp-specialized bodies)
# A CTA of 3 warpgroups launches with 168 registers per thread (65536 / 384,
# rounded down to 8); setmaxnreg only moves registers within that allocation,
# so the three warpgroups' counts may sum to at most 3 * 168.  (Asking for
# more makes the increasing warpgroups wait forever: a hang, not an error.)
_REGISTERS_3WG = 3 * (65536 // 384 // 8 * 8)
# With a fourth (masking) warpgroup: 128 per thread at launch.
_REGISTERS_4WG = 4 * (65536 // 512 // 8 * 8)
_MASKER_REGISTERS = 64  # one band of a stage tile and its row indices
# Beside 128 x 192 accumulators the producer and the masker get less, so that
# each consumer keeps 224 (with 200 the consumers spilled: 3.7-4.9x the time).
_PRODUCER_REGISTERS_TIGHT, _MASKER_REGISTERS_TIGHT = 24, 40
# ptxas compiles a kernel within its launch registers, whatever setmaxnreg later
# gives a warpgroup: with a fourth warpgroup that is 128 per thread, and one
# wgmma of N = 256 (128 accumulator registers and its operands) needs 154, so a
# masking warpgroup takes block_n up to 192 (H200 2026-12-03: 64 x 256 failed
# ptxas on every shape, C7602).
_MASKER_MAX_BLOCK_N = 192


def register_split(mask_warpgroup: bool = False,
                   accumulators: int = 128 * 128) -> tuple[int, int, int]:
  """(producer, consumer, masker) registers per thread of the ring body's
  warpgroups (masker 0 without the masking warpgroup) for a consumer
  accumulator of ``accumulators`` f32 values."""
  producer = _PRODUCER_REGISTERS
  masker = _MASKER_REGISTERS if mask_warpgroup else 0
  if mask_warpgroup and accumulators > 128 * 128:
    producer, masker = _PRODUCER_REGISTERS_TIGHT, _MASKER_REGISTERS_TIGHT
  total = _REGISTERS_4WG if mask_warpgroup else _REGISTERS_3WG
  return producer, min(256, (total - producer - masker) // 2) // 8 * 8, masker


@dataclasses.dataclass(frozen=True)
class MosaicDwConfig:
  """Tiling of the dW kernel.

  Attributes:
    block_m: rows (the contracted, ragged dimension) per pipeline step.
    block_k: output rows per work item (wgmma M, in multiples of 64).
    block_n: output columns per work item (wgmma N).  One warpgroup holds
      the block_k x block_n f32 accumulator: beyond 128 x 128 it gets tight.
    num_stages: SMEM buffers in the TMA pipeline (>= 2 overlaps copies and
      wgmma).
    grid_tile_width: the (k tile, n tile) plane of each group is walked in a
      snake of stripes this many n tiles wide (L2 locality of lhs/rhs blocks).
    num_sms: programs in the persistent grid; None = ctas_per_sm x the
      device's SM count.
    ctas_per_sm: 1, or 2 resident CTAs per SM (one compute warpgroup only, SMEM
      halved): one CTA's pipeline fill and epilogue overlap the other's wgmmas.
    num_compute_wgs: 1 (one warpgroup runs the TMA pipeline and the wgmma) or
      2 (warp-specialized: a producer warpgroup issues the TMA loads, two
      consumer warpgroups each own block_k / 2 rows of the output tile and
      share the rhs block; each holds a (block_k / 2) x block_n accumulator,
      at most 128 x 192 (256 x 192 items measured 1.16-1.22x the 128 x 192
      pingpong ring's time, H200 2026-11-30);
      see ``pingpong`` and ``mask_warpgroup`` for the other splits of work).
    pipeline_across_items: with 2 warpgroups, one ring of stages runs through
      all of a CTA's items (the producer loads the next item's row blocks
      during the current item's last wgmmas and store) instead of a pipeline
      filled and drained per item.
    banded_mask: a boundary row block (one holding rows of a neighbouring
      group) is masked band by band, touching only the bands the group
      boundary cuts or excludes, instead of reading and rewriting whole tiles.
    epilogue_split: with 2 warpgroups, each consumer stages its result
      ((block_k / 2, block_n), or (block_k, block_n) with ``pingpong``) through
      SMEM in this many (1 to 6) column chunks (of a multiple of 64 columns, or
      of exactly 32, which a 16-bit output stores with a 64-byte swizzle), each
      waiting until the previous chunk's store has read the buffer: a smaller
      staging buffer, which leaves SMEM for more stages with an f32 output,
      or for a fifth stage beside two buffers (128 x 192 in 64 x 32 chunks).
    epilogue_rows: with 2 warpgroups, rows per epilogue chunk (a multiple of
      64 dividing the consumer's accumulator rows; None: all of them): the
      staging buffer shrinks to epilogue_rows x epilogue_n, and the chunks
      leave one after another, each waiting until the previous one's store
      has read the buffer (e.g. a 128 x 192 pingpong ring in 64 x 64 chunks
      has room for a fifth stage).
    pingpong: with the ring across items, the two consumers take alternate
      items, each accumulating the whole (block_k, block_n) tile (at most
      128 x 192 f32 values), instead of half of every item each: one
      consumer's epilogue and boundary masking run while the other's wgmmas
      keep the tensor cores busy.  (The shared
      kernel measured 52% tensor-busy with L2 at 56% and DRAM at 43% on
      Qwen3-30B gate_up, H200 2026-11-30: latency-bound.)  Each consumer has
      its own staging buffer.
    mask_warpgroup: with ``pingpong``, a fourth warpgroup masks the boundary
      row blocks (in SMEM, as soon as their loads land) and then hands each
      step to its consumer, so a consumer's wgmmas never wait behind its own
      masking (traced out, the masking took 13-15% of the 128 x 192 ring's
      time on the Qwen shapes).  The consumers get fewer registers (4
      warpgroups share the CTA's allocation): 200 each beside 128 x 128
      accumulators, 224 beside 128 x 192 (the producer and the masker then get
      24 and 40; with 200 the consumers spilled, 3.7-4.9x the time), and the
      masker needs ``banded_mask``.  Measured on the H200 (2026-11-30): 0.96-0.97x
      the time of the 128 x 128 ring on the Qwen shapes, 0.90x on Mixtral;
      1.03-1.06x the 128 x 192 ring's.  block_n at most 192 (ptxas: a wgmma
      of N = 256 does not fit the 128 registers per thread a 4-warpgroup CTA
      launches with).
    epilogue_buffers: with 2 warpgroups, staging buffers per consumer (1 or
      2).  With 2, consecutive epilogue chunks alternate between them, so a
      chunk waits only for the store of the chunk before the previous one
      instead of the previous one's.  Measured on the 128 x 192 pingpong ring
      (H200, 2026-11-30): 0.987-1.003x the time with one buffer on the Qwen and
      Mixtral shapes, 0.957x on DeepSeek-V3 down.
    side_rows: with the ring across items (``block_m`` 64, no
      ``mask_warpgroup``), no stage is ever masked.  A group's rows are split
      into its 8-aligned interior ``[ceil8(start), floor8(end))``, loaded in
      whole 64-row blocks, and its <= 14 unaligned end rows, gathered
      beforehand (``side_gather_kernel``: a Pallas-Triton kernel on a GPU,
      else XLA) into a zero-padded side buffer of 16 rows per group.
      The interior's last < 64 rows and the side rows share the item's last
      step (two steps when 56 rows are left): that stage is loaded in four
      pieces per operand (16 side rows, then 24, 16 and 8 interior rows, each
      piece not needed read from past the array: TMA zeros), arriving on a
      second set of ``produced`` barriers that only those steps use.
    schedule_kernel: build the groups' row blocks with one Pallas-Triton
      kernel (``triton_schedule.build_bounds``) where it applies, instead of
      several small XLA kernels; the same values either way.
    delay_release: with ``pipeline_across_items``, 1: a consumer releases a
      step's stage once its next step's wgmma is issued and this one's is
      done; 0: it waits for each step's wgmma and releases that stage at once.
      Measured on the H200 (docs/performance.md v38e-f): 0.982x the time on
      DeepSeek-V3 down's shared 128 x 256 ring (both consumers share every
      item); on the pingpong rings 0.99-1.01x on routed Qwen sizes, 1.05-1.07x
      under skew and 1.17x on Mixtral (a consumer owning whole items then has
      no wgmma queued behind its own).
    l2_prefetch_ahead: (its distance assumes ``group_interleave=1``; with more,
      it prefetches other groups than intended, still only a hint.)  With
      ``pipeline_across_items``, > 0: at each item's
      first step the producer prefetches into L2 up to 4 (64 rows, 256
      columns) boxes of a later group's rows of lhs or rhs (which: the item's
      place in its group; ``mosaic_dw.prefetch_boxes``), that group being
      this many groups past the ones all CTAs work on now
      (``ceil(num_sms / items per group)`` groups on).  The items of a group
      run at once on different SMs and each misses the same lines; the
      prefetch issues those misses early.  0: none.  Measured slower
      (docs/performance.md v57, H100: 1.06x / 1.10x the time on Qwen3-30B
      gate_up / down), so off.  Prefetching instead the rows of the CTA's
      own item 1 or 2 items later (v58, removed) measured 1.12-1.23x.
    lsu_store: with 2 warpgroups, each epilogue chunk leaves its SMEM buffer
      through the warpgroup's own 16-byte stores (coalesced: each row of the
      chunk in whole 128-byte lines, or 64-byte halves of one for 32 columns
      of a 16-bit output) instead of a TMA store, where the chunk lies wholly inside the
      output (a chunk cut at k or n keeps the TMA store, which clips).  The
      question it asks (docs/performance.md v67): whether TMA stores that L2
      backs up delay the TMA loads queued behind them.  Compiled kernels only
      (interpret mode cannot run the Mosaic GPU code; it takes the TMA store).
      Measured on an H100 (docs/performance.md v68): 0.997x the table's time on
      Qwen3-30B gate_up, 1.013x on down, so no.
    side_gather_kernel: with ``side_rows``, the side buffers come from one
      Pallas-Triton kernel (``triton_side_rows.gather``, compiled GPU calls)
      instead of an index computation and two XLA gathers (3.0% of Qwen3-30B
      gate_up's dW time, 4.6% of down's on the H200, docs/performance.md v30e);
      the same values either way.  On by default since v69 (H100: 0.984-1.000x
      the XLA gathers' time on the five training shapes, 0.992-0.995x skewed);
      without ``side_rows`` it has nothing to do.
    group_interleave: 1 to 8 groups whose items the persistent grid deals in
      turn (``mosaic_dw.interleave_groups``): with 1, the CTAs walk one group's
      items after another, so on a shape of about one group's items per SM
      count (Qwen3-30B: 128) they all start a group, and store their tiles, at
      once; with T, each round of items spans T groups of different sizes, so
      the CTAs drift apart and their stores spread out.  Measured on an H100
      (docs/performance.md v68), T = 2: 0.962-0.966x the table's time on
      Qwen3-30B down (64 items a group), 0.988x on Qwen3-235B gate_up (one
      run), 1.02x on Qwen3-30B gate_up, 1.06x on
      DeepSeek-V3 down, 1.17x on Mixtral gate_up; ``ragdot tune`` tries it.
    prefetch_rows: with ``side_rows``, each warpgroup loads the next item's
      group bounds (two GMEM scalars) while it works on the current one, and
      carries them to the next iteration, instead of loading them at the top
      of each item (docs/performance.md v69: the profile's ``item`` range).
  """

  block_m: int = 64
  block_k: int = 128
  block_n: int = 128
  num_stages: int = 4
  grid_tile_width: int = 1
  num_sms: int | None = None
  num_compute_wgs: int = 1
  ctas_per_sm: int = 1
  pipeline_across_items: bool = False
  banded_mask: bool = False
  epilogue_split: int = 1
  epilogue_rows: int | None = None
  pingpong: bool = False
  mask_warpgroup: bool = False
  epilogue_buffers: int = 1
  side_rows: bool = False
  schedule_kernel: bool = True
  delay_release: int = 1
  l2_prefetch_ahead: int = 0
  lsu_store: bool = False
  group_interleave: int = 1
  side_gather_kernel: bool = True
  prefetch_rows: bool = False

  def __post_init__(self):
    if self.block_m <= 0 or self.block_m % 64:
      raise ValueError(f"block_m must be a positive multiple of 64, got {self.block_m}")
    if self.block_k not in (64, 128, 192, 256):
      raise ValueError(f"block_k must be 64, 128, 192 or 256, got {self.block_k}")
    if self.block_n not in (64, 128, 192, 256):
      raise ValueError(f"block_n must be 64, 128, 192 or 256, got {self.block_n}")
    split_k = self.num_compute_wgs == 2 and not self.pingpong  # two accumulators
    if self.block_k * self.block_n > 128 * 256 * (2 if split_k else 1):
      raise ValueError(
          f"block_k * block_n = {self.block_k * self.block_n} f32 accumulators"
          " exceed the compute warpgroups' registers (max 128 * 256 each)"
      )
    if self.num_compute_wgs not in (1, 2):
      raise ValueError(f"num_compute_wgs must be 1 or 2, got {self.num_compute_wgs}")
    if self.pingpong:
      if not (self.num_compute_wgs == 2 and self.pipeline_across_items):
        raise ValueError("pingpong needs num_compute_wgs=2 and pipeline_across_items=True")
      if self.block_k * self.block_n > 128 * 192:
        raise ValueError(
            f"pingpong: a ({self.block_k}, {self.block_n}) f32 accumulator per warpgroup"
            " exceeds its registers (max 128 * 192 elements)")
      if self.num_stages < 2:
        raise ValueError("pingpong needs num_stages >= 2")
    elif self.num_compute_wgs == 2:
      if self.block_k not in (128, 256):
        raise ValueError(
            f"num_compute_wgs=2 needs block_k 128 or 256 (64-row halves), got {self.block_k}"
        )
      if (self.block_k // 2) * self.block_n > 128 * 192:
        raise ValueError(
            f"num_compute_wgs=2: a ({self.block_k // 2}, {self.block_n}) f32 accumulator"
            " per warpgroup exceeds its registers (max 128 * 192 elements)"
        )
      if self.num_stages < 2:
        raise ValueError("num_compute_wgs=2 needs num_stages >= 2")
    if not 1 <= self.num_stages <= 8:
      raise ValueError(f"num_stages must be in [1, 8], got {self.num_stages}")
    if self.grid_tile_width < 1:
      raise ValueError(f"grid_tile_width must be >= 1, got {self.grid_tile_width}")
    if self.num_sms is not None and self.num_sms < 1:
      raise ValueError(f"num_sms must be >= 1 or None, got {self.num_sms}")
    sm90.check_ctas_per_sm(self.ctas_per_sm, self.num_compute_wgs)
    if self.pipeline_across_items and self.num_compute_wgs != 2:
      raise ValueError("pipeline_across_items needs num_compute_wgs=2")
    if (not _valid_chunks(self.block_n, self.epilogue_split)
        or (self.epilogue_split > 1 and self.num_compute_wgs != 2)):
      raise ValueError(
          f"epilogue_split must be 1 to {_MAX_EPILOGUE_SPLIT}, leave chunks of a multiple of 64"
          f" columns or of exactly {_NARROW_CHUNK_COLS}, and (when > 1) have num_compute_wgs=2, got"
          f" {self.epilogue_split} (block_n={self.block_n},"
          f" num_compute_wgs={self.num_compute_wgs})")

    if self.epilogue_buffers not in (1, 2) or (self.epilogue_buffers == 2
                                                and self.num_compute_wgs != 2):
      raise ValueError("epilogue_buffers must be 1, or 2 with num_compute_wgs=2,"
                       f" got {self.epilogue_buffers}")
    if self.mask_warpgroup and (not self.pingpong or not self.banded_mask):
      raise ValueError(f"mask_warpgroup needs pingpong and banded_mask, got {self}")
    if self.mask_warpgroup and self.block_n > _MASKER_MAX_BLOCK_N:
      raise ValueError(f"mask_warpgroup needs block_n <= {_MASKER_MAX_BLOCK_N} (a wgmma of"
                       f" N = {self.block_n} does not compile in a 4-warpgroup CTA's 128"
                       f" registers per thread), got {self}")
    if self.side_rows and (not self.pipeline_across_items or self.block_m != _PIECE_ROWS
                           or self.mask_warpgroup):
      raise ValueError("side_rows needs pipeline_across_items, block_m"
                       f" {_PIECE_ROWS} and no mask_warpgroup, got {self}")
    if self.delay_release not in (0, 1) or (self.delay_release == 0
                                            and not self.pipeline_across_items):
      raise ValueError("delay_release must be 1, or 0 with pipeline_across_items,"
                       f" got {self}")
    if self.l2_prefetch_ahead < 0 or (self.l2_prefetch_ahead
                                      and not self.pipeline_across_items):
      raise ValueError("l2_prefetch_ahead must be 0, or > 0 with pipeline_across_items,"
                       f" got {self}")
    if self.prefetch_rows and not (self.side_rows and self.pipeline_across_items):
      raise ValueError(f"prefetch_rows needs side_rows (a flat ring), got {self}")
    if not 1 <= self.group_interleave <= 8:
      raise ValueError(f"group_interleave must be in [1, 8], got {self.group_interleave}")
    if self.lsu_store and self.num_compute_wgs != 2:
      raise ValueError(f"lsu_store needs num_compute_wgs=2, got {self}")
    if self.epilogue_rows is not None and (
        self.num_compute_wgs != 2 or self.epilogue_rows <= 0 or self.epilogue_rows % 64
        or self.consumer_rows % self.epilogue_rows
        or self.epilogue_rows == self.consumer_rows):
      raise ValueError(
          "epilogue_rows needs num_compute_wgs=2 and a multiple of 64 dividing (and below)"
          f" the consumer's {self.consumer_rows} accumulator rows (None: all),"
          f" got {self.epilogue_rows}")

  @property
  def epilogue_n(self) -> int:
    """Columns of one epilogue chunk (the staging buffer's width)."""
    return self.block_n // self.epilogue_split

  @property
  def consumer_rows(self) -> int:
    """Output rows one compute warpgroup accumulates per item."""
    return self.block_k // 2 if self.num_compute_wgs == 2 and not self.pingpong else self.block_k

  @property
  def epilogue_m(self) -> int:
    """Rows of one epilogue chunk (the staging buffer's height)."""
    return self.epilogue_rows or self.consumer_rows

  def smem_budget(self) -> int:
    """SMEM this config may use (per CTA, with ``ctas_per_sm`` CTAs on an SM)."""
    return sm90.smem_budget(self.ctas_per_sm, _SMEM_RESERVE)


def _valid_chunks(block_n: int, split: int) -> bool:
  """Whether ``split`` epilogue chunks of a ``block_n``-wide tile are allowed:
  1 to 6 of them, each a multiple of 64 columns or exactly 32."""
  if not 1 <= split <= _MAX_EPILOGUE_SPLIT or block_n % split:
    return False
  chunk = block_n // split
  return chunk % 64 == 0 or chunk == _NARROW_CHUNK_COLS


def smem_bytes(config: MosaicDwConfig, dtype, out_dtype) -> int:
  """SMEM the kernel allocates: pipeline buffers plus the output staging
  (the whole tile with one warpgroup; else one epilogue chunk of
  ``epilogue_m x epilogue_n`` per consumer)."""
  itemsize = jnp.dtype(dtype).itemsize
  per_stage = config.block_m * (config.block_k + config.block_n) * itemsize
  staging = config.epilogue_m * config.epilogue_n * jnp.dtype(out_dtype).itemsize
  return (config.num_stages * per_stage
          + staging * config.num_compute_wgs * config.epilogue_buffers)


def _pads_little(block: int, dim: int) -> bool:
  """Whether tiles of ``block`` pad ``dim`` by less than 64, or by one 64-wide
  strip under 1/32 of ``dim`` (an odd multiple of 64 such as gpt-oss's 2880,
  where 64-wide tiles would be the alternative)."""
  pad = pl.cdiv(dim, block) * block - dim
  return pad < 64 or (pad == 64 and dim > 32 * 64)


def _fit(block: int, dim: int) -> int:
  """Halves ``block`` (down to 64) until it pads ``dim`` little (``_pads_little``)."""
  while block > 64 and not _pads_little(block, dim):
    block //= 2
  return block


def fit_config(config: MosaicDwConfig, dtype, out_dtype,
               split: bool = True) -> MosaicDwConfig | None:
  """``config`` made to fit SMEM; None when even 2 stages do not fit (a
  ``pingpong`` config: when no staging below fits beside its own stages).

  At each stage count, from the config's own down to 2, the whole staging tile
  is tried first, then (``split``, 2 warpgroups, whole tile, block_n a
  multiple of 128) the epilogue split in two column chunks.  The split measured faster than one
  stage fewer: 0.62-0.91x the 2-stage time on the five training shapes with an
  f32 output (3 stages split vs 2 whole, H200, 2026-11-30).  A pingpong ring
  keeps its stages: on the Qwen shapes it took 0.92-0.96x the shared ring's
  time with 6 stages, and in its first version 0.96-0.98x with 5 and
  1.09-1.16x with 4 (H200, 2026-11-30).  Where its staging does not fit (an f32
  output), it tries narrower epilogue chunks, widest first (multiples of 64
  columns, then 32), each with the config's buffers and then with one; None when
  none fits.  ``split=False`` allows only the one buffer.
  """
  def fits(c):
    return smem_bytes(c, dtype, out_dtype) <= c.smem_budget()

  can_split = (split and config.num_compute_wgs == 2 and config.epilogue_split == 1
               and config.block_n % 128 == 0)
  if config.pingpong:
    # Its stages stay; a bigger output (f32) stages in narrower chunks, widest
    # first, each with the config's buffers and then one.
    splits = [config.epilogue_split]
    if split:
      splits += [s for s in range(config.epilogue_split + 1, _MAX_EPILOGUE_SPLIT + 1)
                 if _valid_chunks(config.block_n, s)]
    candidates = (dataclasses.replace(config, epilogue_split=s, epilogue_buffers=b)
                  for s in splits for b in dict.fromkeys((config.epilogue_buffers, 1)))
    return next((c for c in candidates if fits(c)), None)
  lowest = min(2, config.num_stages)
  for stages in range(config.num_stages, lowest - 1, -1):
    candidate = dataclasses.replace(config, num_stages=stages)
    if fits(candidate):
      return candidate
    if can_split and fits(chunked := dataclasses.replace(candidate, epilogue_split=2)):
      return chunked
  return None


# Mean rows per group below which a 4-byte output's dW runs the heuristic
# default instead of a pingpong ring (``pingpong_pays``).
_PINGPONG_WIDE_OUT_MIN_ROWS = 1024


def pingpong_pays(config: MosaicDwConfig, out_dtype, m: int, num_groups: int) -> bool:
  """Whether a table's ``pingpong`` ring should run a dW whose output is
  ``out_dtype`` over ``m`` rows in ``num_groups`` groups, rather than the
  heuristic default (the shared ring).  False only for a 4-byte (f32) output
  over groups of fewer than 1024 rows on average: there each item is a few
  steps and its f32 tile's stores weigh as much as its loads, which the
  default's larger items carry better.  Measured on the H100 (f32 output,
  docs/performance.md v71 70b-c): the default took 0.81 / 0.89 / 0.96x the
  refitted 5-stage table ring on Qwen3-30B gate_up / down / Qwen3-235B gate_up
  (256 rows a group), and beat every 4-stage pingpong form on Qwen3-30B
  (0.92-0.97x of the ring); on Mixtral gate_up (2048 rows a group) it took
  1.11x.  Not measured on an H200, where the Qwen rings fit f32 staging at 4
  stages (that form, on the H100: 0.93x the refit on Qwen3-30B gate_up against
  the default's 0.81x, 0.94x on Qwen3-235B against 0.96x).
  """
  if not config.pingpong or jnp.dtype(out_dtype).itemsize < 4:
    return True
  return m >= _PINGPONG_WIDE_OUT_MIN_ROWS * max(num_groups, 1)


def default_config(
    m: int, k: int, n: int, num_groups: int, dtype=jnp.bfloat16, out_dtype=None
) -> MosaicDwConfig:
  """Heuristic config: the warp-specialized ring across items, 128 x 256 tiles.

  Two consumer warpgroups (64 output rows each) over 64-row steps, 3 stages,
  one ring of stages through all of a CTA's items: the best measured H200
  point on Qwen3-30B gate_up / down, Qwen3-235B gate_up and DeepSeek-V3 down
  (1.27-1.59x the same tiles with a pipeline per item, 2026-11-29), with
  ``side_rows`` instead of masking boundary blocks (0.85-0.94x the time of
  row-band masking on those four, 0.97x on Mixtral gate_up; H200,
  2026-12-02).  When k cannot give each consumer 64
  rows (k < 128), one warpgroup with a 128 x 128 tile and 4 stages.
  ``fit_config`` makes it fit ``out_dtype``'s staging tile (None: any output
  dtype, i.e. f32: a split epilogue).
  """
  del m, num_groups
  bk, bn = _fit(128, k), _fit(256, n)
  if bk >= 128:
    config = MosaicDwConfig(block_m=64, block_k=bk, block_n=bn, num_stages=3,
                            num_compute_wgs=2, pipeline_across_items=True,
                            banded_mask=True, side_rows=True)
  else:
    config = MosaicDwConfig(block_m=64, block_k=bk, block_n=_fit(128, n), num_stages=4)
  return fit_config(config, dtype, jnp.float32 if out_dtype is None else out_dtype)


def gpu_sweep_configs(
    m: int, k: int, n: int, num_groups: int, dtype=jnp.bfloat16,
    out_dtype=jnp.bfloat16,
) -> list[MosaicDwConfig]:
  """A short list of candidates for a GPU sweep (default first; all fit in SMEM;
  at most 16, the likelier winners first).

  In this order: the default, the default masking boundary blocks by row
  bands instead of ``side_rows``, the default with its whole staging tile
  when it splits the epilogue (f32 output: 2 stages instead of 3); the
  ``pingpong`` rings (128 x 128 in 6 stages and 64 x 256 in 4; 128 x 192 and
  192 x 128 where those pad k and n little, in 4 stages, in 5 with 64 x 64
  epilogue chunks, in 5 with two buffers of 64 x 32 chunks (side_rows only), and
  in 4 with two buffers of 64 x 64 chunks), each with
  ``side_rows``, masking by bands, and (128 x 128
  and 64 x 256) with a masking warpgroup; four warp-specialized configs with
  one ring of stages across items, two with two resident CTAs per SM, four
  one-warpgroup configs and three warp-specialized ones with a pipeline per
  item (``num_compute_wgs=2``: 256 x 128 or 128 x 256 output tiles, or
  128 x 128).  The cap of 16 cuts the list's tail (on the Qwen shapes, the
  per-item configs).  Stages drop until SMEM fits (f32 outputs need a bigger
  staging tile); configs that no longer fit, or whose k tile is too small for
  two 64-row halves, are left out.
  """
  del m
  out = [default_config(m=0, k=k, n=n, num_groups=num_groups, dtype=dtype,
                        out_dtype=out_dtype)]
  out = [c for c in out if c is not None]
  # The default masking its boundary blocks (row bands), or the other masking
  # when it masks (one warpgroup: whole tiles / row bands).
  out += [dataclasses.replace(c, side_rows=False) if c.side_rows
          else dataclasses.replace(c, banded_mask=not c.banded_mask) for c in out]
  # A default with a split epilogue (f32 output): the whole staging tile,
  # with the stages that leaves room for.
  for c in out[:1]:
    if c.epilogue_split > 1:
      whole = fit_config(dataclasses.replace(c, epilogue_split=1), dtype, out_dtype,
                         split=False)
      if whole is not None:
        out.append(whole)
  # The consumers taking alternate items whole.
  pingpongs = []
  for bk, bn, stages in ((128, 128, 6), (64, 256, 4)):
    bk, bn = min(bk, _fit(256, k)), min(bn, _fit(256, n))
    if bn % 128 == 0 and bk * bn <= 128 * 128:
      pingpongs.append((bk, bn, stages, 2, None, 1, True))
  # 128 x 192 / 192 x 128 tiles (where they pad k and n little): 19% fewer L2 ->
  # SMEM bytes per FLOP than 128 x 128, in 4 stages of 40 KiB, or 5 with the
  # epilogue in 64 x 64 chunks, or 5 with two buffers of 64 x 32 chunks (H100:
  # 0.93-0.98x the 4-stage ring where a group's rows make 4-8 steps an item,
  # 0.98-1.0x the 5-stage one-buffer ring; 1.11-1.13x the 4-stage ring at 2 steps
  # an item; docs/performance.md v70; with side_rows only, which every measured
  # ring of these tiles took), or 4 with two buffers of 64 x 64 chunks (192 x 128
  # on Qwen3-30B down: 0.956x the 5-stage 128 x 192 ring, H200 2026-12-02).
  for bk, bn in ((128, 192), (192, 128)):
    if _pads_little(bk, k) and _pads_little(bn, n):
      pingpongs += [(bk, bn, 4, bn // 64, None, 1, True), (bk, bn, 5, bn // 64, 64, 1, True),
                    (bk, bn, 5, bn // 32, 64, 2, False), (bk, bn, 4, bn // 64, 64, 2, True)]
  for bk, bn, stages, split, rows, buffers, plain in pingpongs:
    config = fit_config(MosaicDwConfig(
        block_m=64, block_k=bk, block_n=bn, num_stages=stages, num_compute_wgs=2,
        pipeline_across_items=True, banded_mask=True, pingpong=True, epilogue_split=split,
        epilogue_rows=rows, epilogue_buffers=buffers), dtype, out_dtype)
    if config is not None and config not in out:
      # (``plain``: also the same ring masking its boundary blocks)
      out += [dataclasses.replace(config, side_rows=True)] + [config] * plain
      # A masking warpgroup beside 128 x 128 accumulators (0.96-0.97x the time
      # on the Qwen shapes, H200 2026-11-30; beside 128 x 192 ones it measured
      # 1.03-1.06x, so the list leaves that out).
      if bk * bn <= 128 * 128 and bn <= _MASKER_MAX_BLOCK_N:
        out.append(dataclasses.replace(config, mask_warpgroup=True))
  # (bm, bk, bn, stages, tile width, warpgroups, CTAs per SM, ring)
  for bm, bk, bn, stages, width, wgs, ctas, flat in (
      # One ring of stages through all of a CTA's items (first: the likely
      # winners when a tuning budget cuts the list short).
      (64, 128, 256, 3, 1, 2, 1, True),  # 144 + 64 KiB
      (64, 256, 128, 3, 1, 2, 1, True),
      (64, 128, 128, 6, 1, 2, 1, True),  # 192 + 32 KiB
      (128, 128, 128, 3, 1, 2, 1, True),
      # Two resident CTAs per SM: one item's fill and epilogue under the other's
      # wgmmas (a group's reduction is only a few row blocks long).
      (64, 128, 128, 2, 1, 1, 2, False),  # 64 + 32 KiB
      (64, 64, 128, 3, 1, 1, 2, False),  # 72 + 16 KiB
      (64, 128, 128, 4, 1, 1, 1, False),  # one warpgroup, pipeline per item
      (64, 128, 128, 6, 1, 1, 1, False),
      (64, 64, 256, 4, 1, 1, 1, False),
      (64, 128, 256, 3, 1, 1, 1, False),
      (64, 256, 128, 3, 1, 2, 1, False),
      (64, 128, 256, 3, 1, 2, 1, False),
      (64, 128, 128, 6, 1, 2, 1, False),
  ):
    bk, bn = min(bk, _fit(256, k)), min(bn, _fit(256, n))
    if wgs == 2 and (bk < 128 or (bk // 2) * bn > 128 * 128):
      continue
    config = MosaicDwConfig(
        block_m=bm, block_k=bk, block_n=bn, num_stages=stages,
        grid_tile_width=width, num_compute_wgs=wgs, ctas_per_sm=ctas,
        pipeline_across_items=flat,
    )
    config = fit_config(config, dtype, out_dtype)
    if config is not None and config not in out:
      out.append(config)
  return out[:16]
