"""Weight-gradient grouped matmul (``tgmm``) as a Pallas Mosaic GPU kernel (sm90).

``tgmm(lhs[m, k], rhs[m, n], group_sizes[G], group_offset) -> out[g_local, k, n]``
with ``out[j] = lhs[rows_j]^T @ rhs[rows_j]`` (f32 accumulation), where
``rows_j`` are the rows of global group ``group_offset + j`` (see
``ragdot.metadata.group_bounds``).  Local groups without rows give exact zeros.

Kernel layout: a persistent grid (one program per SM) walks the work items
``(local group, k tile, n tile)``.  For each item a TMA pipeline streams the
group's row blocks of ``lhs`` (``block_m x block_k``) and ``rhs``
(``block_m x block_n``) through SMEM, and one warpgroup accumulates
``lhs_tile^T @ rhs_tile`` with wgmma, reading ``lhs^T`` through a transposed
SMEM view.  A group's row blocks start at its first row rounded down to a
multiple of 8 (the TMA row granule), so only its last block (and a first block
starting up to 7 rows early) can hold rows of a neighbouring group, and only
those blocks are masked (in SMEM, before the wgmma).  Items of empty groups skip the pipeline
and store zeros.  Partial k/n tiles and row blocks past ``m`` rely on TMA:
out-of-bounds loads read zeros and out-of-bounds stores are dropped.

``num_compute_wgs=2`` (warp-specialized, ``_body_2wg``): a producer warpgroup
issues the TMA loads (``plgpu.emit_pipeline_warp_specialized``) and two
consumer warpgroups each accumulate half of the item's k-tile rows, reading the
same lhs/rhs stage; each stores its half of the output tile asynchronously.
This allows 256 x 128 / 128 x 256 output tiles per item (twice the work per
pipeline fill and epilogue) and lets the producer load the next item while the
consumers run their epilogue.  With ``pingpong`` the two consumers instead take
alternate items whole, so one's epilogue runs under the other's wgmmas, and
with ``mask_warpgroup`` a fourth warpgroup masks the boundary blocks' stages.
With ``side_rows`` (the table's and default rings) nothing is masked: a group's
unaligned end rows come from a zero-padded side buffer gathered before the
kernel, and its last row block is loaded in TMA pieces (``split_rows``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

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
_MIN_DIM = 64  # k, n granule: one 128-byte swizzle atom of 16-bit elements
_ROW_ALIGN = 8  # TMA row granule of the tiled GMEM view: row blocks start here
_SMEM_RESERVE = 2048  # barriers and alignment
# side_rows: a group's <= 7 + 7 unaligned end rows, zero-padded, in the side
# buffer; its last step's stage holds them in rows [0, 16) and up to 48
# interior rows in the pieces below.
_SIDE_ROWS = 16
_PIECE_ROWS = 64  # block_m of a side_rows ring
_PIECES = ((16, 24), (40, 16), (56, 8))  # (stage row, rows): any multiple of 8 up to 48
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
      SMEM in this many (1 to 4) column chunks (of a multiple of 64 columns),
      each waiting until the previous chunk's store has read the buffer: a
      smaller staging buffer, which leaves SMEM for more stages with an f32
      output.
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
      beforehand (XLA) into a zero-padded side buffer of 16 rows per group.
      The interior's last < 64 rows and the side rows share the item's last
      step (two steps when 56 rows are left): that stage is loaded in four
      pieces per operand (16 side rows, then 24, 16 and 8 interior rows, each
      piece not needed read from past the array: TMA zeros), arriving on a
      second set of ``produced`` barriers that only those steps use.
    schedule_kernel: build the groups' row blocks with one Pallas-Triton
      kernel (``triton_schedule.build_bounds``) where it applies, instead of
      several small XLA kernels; the same values either way.
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
    if (self.epilogue_split not in (1, 2, 3, 4) or self.block_n % (64 * self.epilogue_split)
        or (self.epilogue_split > 1 and self.num_compute_wgs != 2)):
      raise ValueError(
          "epilogue_split must be 1 to 4, leave chunks of a multiple of 64 columns and"
          f" (when > 1) have num_compute_wgs=2, got {self.epilogue_split}"
          f" (block_n={self.block_n}, num_compute_wgs={self.num_compute_wgs})")

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


def smem_bytes(config: MosaicDwConfig, dtype, out_dtype) -> int:
  """SMEM the kernel allocates: pipeline buffers plus the output staging
  (the whole tile with one warpgroup; else one epilogue chunk of
  ``epilogue_m x epilogue_n`` per consumer)."""
  itemsize = jnp.dtype(dtype).itemsize
  per_stage = config.block_m * (config.block_k + config.block_n) * itemsize
  staging = config.epilogue_m * config.epilogue_n * jnp.dtype(out_dtype).itemsize
  return (config.num_stages * per_stage
          + staging * config.num_compute_wgs * config.epilogue_buffers)


def _fit(block: int, dim: int) -> int:
  """Halves ``block`` (down to 64) while its padding past ``dim`` is >= 64."""
  while block > 64 and pl.cdiv(dim, block) * block - dim >= 64:
    block //= 2
  return block


def fit_config(config: MosaicDwConfig, dtype, out_dtype,
               split: bool = True) -> MosaicDwConfig | None:
  """``config`` made to fit SMEM; None when even 2 stages do not fit (a
  ``pingpong`` config: when it does not fit with its own stage count).

  At each stage count, from the config's own down to 2, the whole staging tile
  is tried first, then (``split``, 2 warpgroups, whole tile, block_n a
  multiple of 128) the epilogue split in two column chunks.  The split measured faster than one
  stage fewer: 0.62-0.91x the 2-stage time on the five training shapes with an
  f32 output (3 stages split vs 2 whole, H200, 2026-11-30).  A pingpong ring
  keeps its stages: on the Qwen shapes it took 0.92-0.96x the shared ring's
  time with 6 stages, and in its first version 0.96-0.98x with 5 and
  1.09-1.16x with 4 (H200, 2026-11-30).
  """
  def fits(c):
    return smem_bytes(c, dtype, out_dtype) <= c.smem_budget()

  can_split = (split and config.num_compute_wgs == 2 and config.epilogue_split == 1
               and config.block_n % 128 == 0)
  lowest = config.num_stages if config.pingpong else min(2, config.num_stages)
  for stages in range(config.num_stages, lowest - 1, -1):
    candidate = dataclasses.replace(config, num_stages=stages)
    if fits(candidate):
      return candidate
    if can_split and fits(chunked := dataclasses.replace(candidate, epilogue_split=2)):
      return chunked
  return None


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
  192 x 128 where those divide k and n, in 4 stages, in 5 with 64 x 64
  epilogue chunks, and in 4 with two buffers of 64 x 64 chunks), each with
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
      pingpongs.append((bk, bn, stages, 2, None, 1))
  # 128 x 192 / 192 x 128 tiles (where they divide k and n): 19% fewer L2 ->
  # SMEM bytes per FLOP than 128 x 128, in 4 stages of 40 KiB, or 5 with the
  # epilogue in 64 x 64 chunks, or 4 with two buffers of them (192 x 128 on
  # Qwen3-30B down: 0.956x the 5-stage 128 x 192 ring, H200 2026-12-02).
  for bk, bn in ((128, 192), (192, 128)):
    if k % bk == 0 and n % bn == 0:
      pingpongs += [(bk, bn, 4, bn // 64, None, 1), (bk, bn, 5, bn // 64, 64, 1),
                    (bk, bn, 4, bn // 64, 64, 2)]
  for bk, bn, stages, split, rows, buffers in pingpongs:
    config = fit_config(MosaicDwConfig(
        block_m=64, block_k=bk, block_n=bn, num_stages=stages, num_compute_wgs=2,
        pipeline_across_items=True, banded_mask=True, pingpong=True, epilogue_split=split,
        epilogue_rows=rows, epilogue_buffers=buffers), dtype, out_dtype)
    if config is not None and config not in out:
      out += [dataclasses.replace(config, side_rows=True), config]
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


def _check_supported(lhs: jax.Array, rhs: jax.Array, out_dtype) -> None:
  if lhs.dtype != rhs.dtype or lhs.dtype not in _IN_DTYPES:
    raise NotImplementedError(
        "mosaic tgmm takes bf16 or f16 lhs/rhs of one dtype, got"
        f" {lhs.dtype} and {rhs.dtype}"
    )
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise NotImplementedError(f"mosaic tgmm: unsupported out_dtype {out_dtype}")
  reason = unsupported_shape(lhs.shape[0], lhs.shape[1], rhs.shape[1])
  if reason:
    raise NotImplementedError(f"mosaic tgmm: {reason}")


def unsupported_shape(m: int, k: int, n: int) -> str | None:
  """Why this kernel refuses lhs[m, k], rhs[m, n] (static; None: it takes it)."""
  if k < _MIN_DIM or n < _MIN_DIM:
    return f"thin k={k} or n={n} (< {_MIN_DIM}) is not supported"
  # Mosaic builds its TMA descriptors on the swizzle-tiled view of GMEM, so the
  # tiled dims must be whole tiles: rows by 8, columns by one 128-byte atom.
  if k % _MIN_DIM or n % _MIN_DIM:
    return f"k={k} and n={n} must be multiples of {_MIN_DIM}"
  if m % 8:
    return f"m={m} must be a multiple of 8"
  return None


class RowSplit(NamedTuple):
  """How a ``side_rows`` ring covers a group's rows ``[start, end)``."""
  first: jax.Array  # ceil8(start): the 8-aligned interior's first row
  full: jax.Array  # whole _PIECE_ROWS-row blocks of the interior from ``first``
  rest: jax.Array  # the interior rows after them (a multiple of 8, < _PIECE_ROWS)
  nblocks: jax.Array  # ``full`` + the steps holding ``rest`` and the side rows (0 to 2)


def split_rows(start, end) -> RowSplit:
  """``RowSplit`` of rows ``[start, end)`` (int32 scalars or arrays: the kernel
  and the side buffer's gather use the same arithmetic).  The side rows are
  those outside ``[first, floor8(end))``: at most 7 at each end."""
  first = lax.div(start + (_ROW_ALIGN - 1), _ROW_ALIGN) * _ROW_ALIGN
  interior = jnp.maximum(lax.div(end, _ROW_ALIGN) * _ROW_ALIGN - first, 0)
  full = lax.div(interior, _PIECE_ROWS)
  rest = interior - full * _PIECE_ROWS
  side = end - start - interior
  room = _PIECE_ROWS - _SIDE_ROWS  # interior rows beside the side rows
  tail_steps = jnp.where((rest == 0) & (side == 0), 0, jnp.where(rest > room, 2, 1))
  return RowSplit(first, full, rest, full + tail_steps)


def side_row_index(starts: jax.Array, ends: jax.Array, m: int) -> jax.Array:
  """int32[g * 16]: for each group (``starts``/``ends``: int32[g]) the rows
  of lhs/rhs its side buffer rows copy, ``m`` (zeros) past its side rows."""
  first = split_rows(starts, ends).first
  head_end = jnp.minimum(first, ends)
  tail_start = jnp.maximum(ends // _ROW_ALIGN * _ROW_ALIGN, head_end)
  heads, tails = (head_end - starts)[:, None], (ends - tail_start)[:, None]
  t = jnp.arange(_SIDE_ROWS, dtype=jnp.int32)[None]
  index = jnp.where(t < heads, starts[:, None] + t,
                    jnp.where(t < heads + tails, tail_start[:, None] + t - heads, m))
  return index.reshape(-1)


def side_buffers(lhs: jax.Array, rhs: jax.Array, starts: jax.Array,
                 ends: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The ``side_rows`` ring's side buffers ([g * 16, k] and [g * 16, n]):
  each group's unaligned end rows of lhs and rhs (``side_row_index``), zeros
  past them.  ``starts``/``ends``: int32[g] of the local groups."""
  index = side_row_index(starts, ends, lhs.shape[0])
  return tuple(jnp.take(x, index, axis=0, mode="fill", fill_value=0) for x in (lhs, rhs))


class WorkItem(NamedTuple):
  """One (group, k tile, n tile) item of a CTA and the rows it contracts."""
  group: jax.Array
  k_tile: jax.Array
  n_tile: jax.Array
  start: jax.Array  # the group's rows [start, end)
  end: jax.Array
  first: jax.Array  # the first row block's first row (a multiple of 8)
  full: jax.Array  # side_rows: the steps before the piece steps (else nblocks)
  nblocks: jax.Array  # row block steps


def _work_item(info, grid_k: int, grid_n: int, config: MosaicDwConfig,
               starts_gmem, ends_gmem, first_gmem, nblocks_gmem) -> WorkItem:
  """Item ``info`` of the CTA's loop; with ``side_rows`` its rows come from
  ``split_rows`` (the interior's first row and steps)."""
  j = info.index[0]
  ki, ni = plgpu.planar_snake(info.index[1], (grid_k, grid_n), 1, config.grid_tile_width)
  start, end = starts_gmem[j], ends_gmem[j]
  if config.side_rows:
    split = split_rows(start, end)
    return WorkItem(j, ki, ni, start, end, pl.multiple_of(split.first, _ROW_ALIGN),
                    split.full, split.nblocks)
  first = pl.multiple_of(first_gmem[j], _ROW_ALIGN)
  nblocks = nblocks_gmem[j]
  return WorkItem(j, ki, ni, start, end, first, nblocks, nblocks)


def _row_spec(rows: int, cols: int, first, col_block, transforms, delay_release: int):
  """Block i of a group: rows [first + i * rows, +rows), column block col_block."""
  return plgpu.BlockSpec((pl.Element(rows), cols), lambda i: (first + i * rows, col_block),
                         transforms=transforms, delay_release=delay_release)


def _mask_rows(tile_smem, row0, start, end):
  """Zeroes the rows of an SMEM tile that lie outside [start, end)."""
  tile = tile_smem[...]
  rows = plgpu.layout_cast(
      lax.broadcasted_iota(jnp.int32, tile.shape, 0), plgpu.Layout.WGMMA
  ) + row0
  keep = (rows >= start) & (rows < end)
  tile_smem[...] = jnp.where(keep, tile, jnp.zeros_like(tile))


def _straddles(row0, rows: int, start, end):
  """Whether the row block [row0, row0 + rows) holds rows outside [start, end).

  Only a group's first and last blocks can: those are the ones masked.
  """
  return (row0 < start) | (row0 + rows > end)


def _mask_stage(tiles, wg, num_wgs: int, row0, start, end, banded: bool) -> None:
  """Zeroes the rows outside [start, end) of a stage's SMEM tiles, split among
  ``num_wgs`` warpgroups (``wg`` is this one): by row bands (``banded``), else
  whole tiles for one warpgroup or 64-column chunks for several."""
  if banded:
    _mask_bands(tiles, wg, num_wgs, row0, start, end)
  elif num_wgs == 1:
    for tile in tiles:
      _mask_rows(tile, row0, start, end)
  else:
    chunks = [(t, c) for t in tiles for c in range(0, t.shape[1], 64)]
    for i, (ref, col) in enumerate(chunks):
      pl.when(wg == i % num_wgs)(functools.partial(
          _mask_rows, ref.at[:, pl.ds(col, 64)], row0, start, end))


def _mask_own_stage(lhs_t, rhs_t, row0, start, end, banded: bool) -> None:
  """One warpgroup zeroes the rows outside [start, end) of a stage's tiles
  when the row block at ``row0`` holds any, and makes its writes visible to
  the wgmma (async proxy) that reads the stage next."""
  @pl.when(_straddles(row0, lhs_t.shape[0], start, end))
  def _():
    _mask_stage((lhs_t, rhs_t), 0, 1, row0, start, end, banded)
    plgpu.commit_smem()


def _consumers_mask(lhs_t, rhs_t, wg, row0, start, end, mask_barrier,
                    banded: bool = False) -> None:
  """The two consumers split the masking of a shared stage, then both wait
  until all of it is masked before their wgmmas read it."""
  _mask_stage((lhs_t, rhs_t), wg, 2, row0, start, end, banded)
  plgpu.commit_smem()
  plgpu.barrier_arrive(mask_barrier)
  plgpu.barrier_wait(mask_barrier)


def _band_rows(cols: int) -> int:
  """Rows of a masking band of a tile ``cols`` (64, 128 or 256) wide: a whole
  number of 8 x 64 swizzle tiles that one warpgroup's SMEM transfer layout
  covers (it needs 4 of them)."""
  return 8 * (4 // (cols // 64))


def _mask_bands(tiles, wg, num_wgs: int, row0, start, end) -> None:
  """Zeroes the rows outside [start, end) of SMEM tiles (each [rows, cols],
  swizzled, rows from ``row0``) band by band: a band wholly outside is
  overwritten with zeros, one that straddles a boundary is read, masked and
  written back, one wholly inside is left alone.  Bands go round-robin to the
  ``num_wgs`` warpgroups (``wg`` is this one's index).

  Each group boundary in a block cuts at most one band per tile, so on a
  typical boundary block this moves a fraction of the bytes of masking the
  whole tiles.
  """
  i = 0
  # A 192-column tile is masked as three 64-column slices: its own bands would
  # be 32 x 192 (48 values per thread, beside a pingpong consumer's 192
  # accumulator registers).
  tiles = [t.at[:, pl.ds(c, 64)] if t.shape[1] == 192 else t
           for t in tiles for c in (range(0, 192, 64) if t.shape[1] == 192 else (0,))]
  for tile in tiles:
    rows, cols = tile.shape
    band = min(_band_rows(cols), rows)
    layout = plgpu.Layout.SMEM_GMEM_COPY((band, cols), tile.dtype, 128)
    for b0 in range(0, rows, band):
      ref = tile.at[pl.ds(b0, band)]
      r0 = row0 + b0
      outside = (r0 + band <= start) | (r0 >= end)
      straddles = jnp.logical_not(outside) & ((r0 < start) | (r0 + band > end))

      def zero(ref=ref):
        ref[...] = plgpu.layout_cast(jnp.zeros(ref.shape, ref.dtype), layout)

      def mask(ref=ref, r0=r0):
        idx = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0), layout) + r0
        keep = (idx >= start) & (idx < end)
        val = plgpu.load(ref, layout=layout)
        ref[...] = jnp.where(keep, val, jnp.zeros_like(val))

      mine = wg == i % num_wgs
      pl.when(mine & outside)(zero)
      pl.when(mine & straddles)(mask)
      i += 1


def _store_consumer_half(acc, my_smem, out_gmem, j, row, col) -> None:
  """A consumer's epilogue: its f32 accumulator through its own SMEM buffers
  (``my_smem``: [buffers, rows, cols]) to output tile j at (row, col)."""
  nbuf, rm, cn = my_smem.shape
  t, stored = 0, None  # chunk count; whether the previous chunk was stored
  for r in range(0, acc.shape[0], rm):  # epilogue_rows chunks
    rows = acc if rm == acc.shape[0] else acc[r:r + rm]
    for c in range(acc.shape[1] // cn):  # epilogue_split chunks
      # The buffer's previous store must be done reading it: with one buffer
      # the last store; with two, all but the last one, which read the other
      # buffer (unless the previous chunk, wholly out of bounds, stored
      # nothing; and at an item's first chunk all are waited for).
      if nbuf == 1 or stored is None:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      else:
        pl.when(stored)(lambda: plgpu.wait_smem_to_gmem(1, wait_read_only=True))
        pl.when(~stored)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))
      buf = my_smem.at[t % nbuf]
      buf[...] = sm90.column_chunk(rows, c, cn).astype(buf.dtype)
      plgpu.commit_smem()
      stored = _store_half(buf, out_gmem, j, row + r, col + c * cn)
      t += 1


def _store_half(src_smem, out_gmem, j, row, col):
  """One consumer's (epilogue_m, epilogue_n) chunk of output tile j at (row, col).

  Skipped when it lies wholly past k (a k tile wider than k's remainder) or n
  (an epilogue chunk of the last n tile): a TMA box entirely out of bounds is
  not left to the hardware to drop.  Returns whether it was stored.
  """
  hk, bn = src_smem.shape
  inside = (row < out_gmem.shape[1]) & (col < out_gmem.shape[2])
  pl.when(inside)(lambda: plgpu.copy_smem_to_gmem(
      src_smem, out_gmem.at[j, pl.ds(row, hk), pl.ds(col, bn)]))
  return inside


def _body_2wg(starts_gmem, ends_gmem, first_gmem, nblocks_gmem, lhs_gmem, rhs_gmem,
              out_gmem, *, config, num_groups, grid_k, grid_n, out_dtype,
              in_transforms_lhs, in_transforms_rhs, out_transforms):
  """Warp-specialized dW: warpgroups 0, 1 compute, warpgroup 2 issues TMA loads.

  Work item (group j, k tile ki, n tile ni): consumer ``w`` accumulates
  ``lhs[rows, ki*bk + w*hk : +hk]^T @ rhs[rows, ni*bn : +bn]`` over the group's
  row blocks (both consumers read the same SMEM stage) and stores its
  (hk, bn) half of the output tile asynchronously from its own SMEM buffer.

  Synchronization beyond the pipeline's own produced/consumed barriers:
  * ``mask_barrier`` (2 arrivals): on a boundary row block the two consumers
    split the masking of the shared lhs/rhs stage by 64-column chunks, then
    both wait until both halves are masked before their wgmma reads it.
  * ``done_barrier`` (2 arrivals): the pipeline never releases the slot of an
    item's last step, so before the producer starts the next item's loads it
    waits until both consumers have finished their last wgmma (read the
    accumulator).  Only items with row blocks use it, so the consumers can never
    be more than one phase ahead of the producer.
  """
  bm, bk, bn = config.block_m, config.block_k, config.block_n
  hk = bk // 2

  def make_pipeline(step, compute_context, nblocks, first=0, ki=0, ni=0):
    return plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(nblocks,),
        memory_registers=_PRODUCER_REGISTERS,
        in_specs=[
            _row_spec(bm, bk, first, ki, in_transforms_lhs, 1),
            _row_spec(bm, bn, first, ni, in_transforms_rhs, 1),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=config.num_stages,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None
  # A static grid of num_stages steps allocates the same num_stages slots as
  # the dynamic grids used below.
  allocs = make_pipeline(ignore, ignore, config.num_stages).get_allocations(
      lhs_gmem, rhs_gmem)

  @functools.partial(
      pl.run_scoped,
      allocs=allocs,
      o_smem=plgpu.SMEM((2, config.epilogue_buffers, config.epilogue_m, config.epilogue_n),
                        out_dtype, transforms=out_transforms),
      mask_barrier=plgpu.Barrier(num_arrivals=2),
      done_barrier=plgpu.Barrier(num_arrivals=2),
      collective_axes="wg",
  )
  def _scope(allocs, o_smem, mask_barrier, done_barrier):
    wg = lax.axis_index("wg")
    is_consumer = wg < 2

    @plgpu.nd_loop((num_groups, grid_k * grid_n), collective_axes="sm")
    def _item(info: plgpu.NDLoopInfo):
      j, ki, ni, start, end, first, _, nblocks = _work_item(
          info, grid_k, grid_n, config, starts_gmem, ends_gmem, first_gmem, nblocks_gmem)

      def step(idx, lhs_smem, rhs_smem, acc_ref):
        row0 = first + idx[0] * bm
        pl.when(_straddles(row0, bm, start, end))(functools.partial(
            _consumers_mask, lhs_smem, rhs_smem, wg, row0, start, end, mask_barrier,
            config.banded_mask))

        plgpu.wgmma(acc_ref, lhs_smem.at[:, pl.ds(wg * hk, hk)].T, rhs_smem)
        # delay_release=1: this step's slot is released one step later, once
        # at most this step's wgmma is still in flight.
        plgpu.wgmma_wait(1)
        return acc_ref

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((hk, bn), jnp.float32))
        def _acc(acc_ref):
          eval_pipeline(acc_ref)
          acc = acc_ref[...]  # waits for the last wgmma
          pl.when(nblocks > 0)(lambda: plgpu.barrier_arrive(done_barrier))
          _store_consumer_half(acc, o_smem.at[wg], out_gmem, j, ki * bk + wg * hk, ni * bn)

      # Items of empty groups run a zero-step pipeline: the consumers store
      # the zero-initialized accumulator, the producer loads nothing.
      make_pipeline(step, compute_context, nblocks, first, ki, ni)(
          lhs_gmem, rhs_gmem, allocations=allocs
      )

      @pl.when(jnp.logical_not(is_consumer) & (nblocks > 0))
      def _():
        plgpu.barrier_wait(done_barrier)

    pl.when(is_consumer)(lambda: plgpu.wait_smem_to_gmem(0))


def _body_2wg_flat(starts_gmem, ends_gmem, first_gmem, nblocks_gmem, lhs_gmem, rhs_gmem,
                   *refs, config, num_groups, grid_k, grid_n, out_dtype,
                   in_transforms_lhs, in_transforms_rhs, out_transforms):
  """Warp-specialized dW with one pipeline through all of a CTA's items.

  The same roles and tiles as ``_body_2wg`` (consumers 0 and 1 each own half of
  the item's k tile; warpgroup 2 issues the TMA loads), but the stages form
  one ring that runs through the CTA's whole item sequence: the producer loads
  the next item's row blocks while the consumers finish an item and store it,
  so an item of a few row blocks (a group of ~256 rows) no longer pays a
  pipeline fill and drain.  Step ``s`` (counted over all items of the CTA)
  uses slot ``s % num_stages``; ``produced[slot]`` (TMA bytes landed) and
  ``consumed[slot]`` (both consumers' wgmmas done with it) are the ring's
  barriers, and each thread tracks their phases by waiting once per use.  The
  two consumers split a boundary block's row masking between their wgmmas.

  ``pingpong``: consumer ``q % 2`` owns the CTA's item q whole (a (bk, bn)
  accumulator, its own staging buffer, its own masking) and alone releases
  its steps (``consumed`` takes one arrival).  Each consumer has its own
  ``produced`` barriers (the producer signals the owner's), so a consumer
  waits only for its own steps, once each, and can start its next item while
  the other still works on its own.  A slot is reloaded only after its
  previous use was released, so no barrier runs a phase ahead of its waiter.

  ``mask_warpgroup`` (pingpong only): warpgroup 3 waits for every step's
  ``produced`` barrier, masks the boundary blocks' stages, and arrives on the
  owner's ``masked`` barrier, which the consumers wait for instead of
  ``produced``: each barrier still has exactly one waiter per phase.

  ``side_rows`` (``refs`` then starts with the side buffers of lhs and rhs):
  nothing is masked.  An item's steps from ``split_rows(...).full`` on are
  loaded in pieces (see ``MosaicDwConfig.side_rows``) and signal
  ``pieces_in`` (8 TMA arrivals) instead of ``produced``; the producer and
  the consumers both know which steps those are, and each thread keeps every
  barrier's phase, so waiting on one set or the other per step is safe.
  """
  side = config.side_rows
  if side:
    side_lhs_gmem, side_rhs_gmem, out_gmem = refs
  else:
    (out_gmem,) = refs
  bm, bk, bn = config.block_m, config.block_k, config.block_n
  pingpong = config.pingpong
  masker = config.mask_warpgroup
  hk = bk if pingpong else bk // 2  # rows of a consumer's accumulator
  stages = config.num_stages
  regs_producer, regs_consumer, regs_masker = register_split(masker, hk * bn)

  def items(body, init):
    """Runs ``body(item, carry) -> carry`` over this CTA's items in order; the
    final carry."""
    @plgpu.nd_loop((num_groups, grid_k * grid_n), collective_axes="sm", init_carry=init)
    def steps(info: plgpu.NDLoopInfo, carry):
      item = _work_item(info, grid_k, grid_n, config, starts_gmem, ends_gmem, first_gmem,
                        nblocks_gmem)
      return body(item, carry)
    return steps

  def ring_steps(per_step):
    """Calls ``per_step(item, i, step, slot, owner)`` for row block ``i`` of
    every item of this CTA in order: ``step`` counts the ring's steps over all
    items, ``slot = step % stages``, and ``owner`` is the first of the item's
    consumer's ``produced`` / ``masked`` barriers with ``pingpong`` (else 0).
    Returns the number of steps."""
    def item(it, carry):
      step0, q = carry
      owner = lax.rem(q, 2) * stages if pingpong else 0

      def one(i, step):
        per_step(it, i, step, lax.rem(step, stages), owner)
        return step + 1

      return lax.fori_loop(0, it.nblocks, one, step0), q + 1

    total, _ = items(item, (jnp.int32(0), jnp.int32(0)))
    return total

  @functools.partial(
      pl.run_scoped,
      lhs_smem=plgpu.SMEM((stages, bm, bk), lhs_gmem.dtype, transforms=in_transforms_lhs),
      rhs_smem=plgpu.SMEM((stages, bm, bn), rhs_gmem.dtype, transforms=in_transforms_rhs),
      # Two TMA arrivals (lhs, rhs) per step; pingpong: one set per consumer.
      produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages * (2 if pingpong else 1)),
      consumed=plgpu.Barrier(num_arrivals=1 if pingpong else 2, num_barriers=stages),
      o_smem=plgpu.SMEM((2, config.epilogue_buffers, config.epilogue_m, config.epilogue_n),
                        out_dtype, transforms=out_transforms),
      # The shared ring's consumers mask a boundary block together.
      **(dict(mask_barrier=plgpu.Barrier(num_arrivals=2)) if not (pingpong or side) else {}),
      # mask_warpgroup: the masker -> the owner of a step (one set per consumer).
      **(dict(masked=plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages))
         if masker else {}),
      # side_rows: the piece steps' barriers (2 x 4 pieces).
      **(dict(pieces_in=plgpu.Barrier(num_arrivals=2 * (1 + len(_PIECES)),
                                      num_barriers=stages * (2 if pingpong else 1)))
         if side else {}),
      collective_axes="wg",
  )
  def _scope(lhs_smem, rhs_smem, produced, consumed, o_smem, mask_barrier=None,
             masked=None, pieces_in=None):
    wg = lax.axis_index("wg")

    def load_pieces(it, i, slot, barrier):
      """Stage ``slot`` of a piece step: the group's side rows (first piece
      step only) and the interior rows left after its whole blocks."""
      j, ki, ni, start, end, first, full, _ = it
      rest = split_rows(start, end).rest
      p = i - full  # 0, or 1 for the second piece step
      room = _PIECE_ROWS - _SIDE_ROWS
      left = jnp.clip(rest - p * room, 0, room)
      row = first + full * bm + p * room
      past_m, past_side = lhs_gmem.shape[0], side_lhs_gmem.shape[0]
      side_row = jnp.where(p == 0, j * _SIDE_ROWS, past_side)
      pieces = [(pl.ds(0, _SIDE_ROWS), side_row, True)]
      for at, rows in _PIECES:  # 24, 16, 8: takes any multiple of 8 up to 48
        take = left >= rows
        pieces.append((pl.ds(at, rows), jnp.where(take, row, past_m), False))
        row, left = row + jnp.where(take, rows, 0), left - jnp.where(take, rows, 0)
      for src, side_src, cols, dst in (
          (lhs_gmem, side_lhs_gmem, pl.ds(ki * bk, bk), lhs_smem.at[slot]),
          (rhs_gmem, side_rhs_gmem, pl.ds(ni * bn, bn), rhs_smem.at[slot])):
        for at, r, from_side in pieces:
          rows = pl.ds(pl.multiple_of(r, _ROW_ALIGN), at.size)
          plgpu.copy_gmem_to_smem((side_src if from_side else src).at[rows, cols],
                                  dst.at[at], barrier)

    if masker:
      @pl.when(wg == 3)
      def _masker():
        plgpu.set_max_registers(regs_masker, action="decrease")

        def mask_step(it, i, step, slot, owner):
          del step
          _, _, _, start, end, first, _, _ = it
          plgpu.barrier_wait(produced.at[owner + slot])
          _mask_own_stage(lhs_smem.at[slot], rhs_smem.at[slot], first + i * bm, start, end,
                          config.banded_mask)
          plgpu.barrier_arrive(masked.at[owner + slot])

        ring_steps(mask_step)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(regs_producer, action="decrease")

      def load(it, i, step, slot, owner):
        _, ki, ni, _, _, first, full, _ = it
        # The slot's previous use (step - stages) must be consumed first.
        pl.when(step >= stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))

        def whole_block():
          rows = pl.ds(pl.multiple_of(first + i * bm, _ROW_ALIGN), bm)
          plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, pl.ds(ki * bk, bk)],
                                  lhs_smem.at[slot], produced.at[owner + slot])
          plgpu.copy_gmem_to_smem(rhs_gmem.at[rows, pl.ds(ni * bn, bn)],
                                  rhs_smem.at[slot], produced.at[owner + slot])

        if side:
          in_pieces = i >= full
          pl.when(~in_pieces)(whole_block)
          pl.when(in_pieces)(lambda: load_pieces(it, i, slot, pieces_in.at[owner + slot]))
        else:
          whole_block()

      total = ring_steps(load)

      # Observe the consumption of the last stages too (every barrier phase is
      # waited for before the barriers go away).
      @pl.loop(jnp.maximum(total - stages, 0), total)
      def _drain(step):
        plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

    @pl.when(wg < 2)
    def _consumers():
      plgpu.set_max_registers(regs_consumer, action="increase")

      def compute(it, step0):
        """Accumulates this consumer's part of item ``it`` (from ring step
        ``step0``) and stores it."""
        j, ki, ni, start, end, first, full, nblocks = it

        def acc_scope(acc_ref):
          def mma(i, step):
            slot = lax.rem(step, stages)
            lhs_t, rhs_t = lhs_smem.at[slot], rhs_smem.at[slot]
            ready = masked if masker else produced
            mine = (wg * stages if pingpong else 0) + slot
            if side:
              in_pieces = i >= full
              pl.when(~in_pieces)(lambda: plgpu.barrier_wait(ready.at[mine]))
              pl.when(in_pieces)(lambda: plgpu.barrier_wait(pieces_in.at[mine]))
            else:
              plgpu.barrier_wait(ready.at[mine])
            row0 = first + i * bm
            # (side_rows: the stage holds only the group's rows and zeros.)
            if pingpong and not (masker or side):  # this consumer's own stage
              _mask_own_stage(lhs_t, rhs_t, row0, start, end, config.banded_mask)
            elif not (pingpong or side):
              pl.when(_straddles(row0, bm, start, end))(functools.partial(
                  _consumers_mask, lhs_t, rhs_t, wg, row0, start, end, mask_barrier,
                  config.banded_mask))

            lhs_rows = lhs_t if pingpong else lhs_t.at[:, pl.ds(wg * hk, hk)]
            plgpu.wgmma(acc_ref, lhs_rows.T, rhs_t)
            plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release it
            pl.when(i > 0)(lambda: plgpu.barrier_arrive(
                consumed.at[lax.rem(step + stages - 1, stages)]))
            return step + 1

          step = lax.fori_loop(0, nblocks, mma, step0)
          acc = acc_ref[...]  # waits for the last wgmma
          pl.when(nblocks > 0)(lambda: plgpu.barrier_arrive(
              consumed.at[lax.rem(step + stages - 1, stages)]))
          return acc

        acc = pl.run_scoped(acc_scope, plgpu.ACC((hk, bn), jnp.float32))
        row = ki * bk if pingpong else ki * bk + wg * hk
        _store_consumer_half(acc, o_smem.at[wg], out_gmem, j, row, ni * bn)

      def item(it, carry):
        step0, q = carry
        if pingpong:  # the other consumer's items: only their steps are counted
          pl.when(lax.rem(q, 2) == wg)(lambda: compute(it, step0))
        else:
          compute(it, step0)
        return step0 + it.nblocks, q + 1

      items(item, (jnp.int32(0), jnp.int32(0)))
      plgpu.wait_smem_to_gmem(0)


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    num_groups: int,
    out_dtype,
    precision=None,
    interpret=False,
    config: MosaicDwConfig | None = None,
) -> jax.Array:
  """``out[j] = lhs[rows_j]^T @ rhs[rows_j]`` for the ``num_groups`` local groups.

  Args:
    lhs: [m, k] bf16/f16, rows grouped by ``group_sizes``.
    rhs: [m, n], same dtype and row grouping.
    group_sizes: int32[G] (device array, may be traced).
    group_offset: None (local = global groups, ``num_groups == G``) or an int32
      scalar: local group j is global group ``group_offset + j``.
    num_groups: number of local groups (static).
    out_dtype: bf16, f16 or f32; accumulation is always f32.
    precision: ignored (16-bit products are exact in the f32 accumulator).
    interpret: False, True, or ``plgpu.InterpretGPUParams`` (CPU interpret mode).
    config: tiling; defaults to ``default_config``.

  Returns:
    [num_groups, k, n] in ``out_dtype``.

  Raises:
    NotImplementedError: for dtypes or shapes this kernel does not take.
  """
  del precision
  _check_supported(lhs, rhs, out_dtype)
  m, k = lhs.shape
  n = rhs.shape[1]
  out_dtype = jnp.dtype(out_dtype)
  if config is None:
    config = default_config(m, k, n, num_groups, lhs.dtype, out_dtype)
  if smem_bytes(config, lhs.dtype, out_dtype) > config.smem_budget():
    raise NotImplementedError(
        f"{config} needs {smem_bytes(config, lhs.dtype, out_dtype)} bytes of"
        f" SMEM for {lhs.dtype} -> {out_dtype}; the budget is {config.smem_budget()}"
    )
  if num_groups == 0 or m == 0:
    return jnp.zeros((num_groups, k, n), out_dtype)

  bm, bk, bn = config.block_m, config.block_k, config.block_n
  starts, ends, first_row, num_blocks = backends.row_blocks(
      group_sizes, group_offset, m=m, num_local=num_groups, block_m=bm, align=_ROW_ALIGN,
      use_kernel=config.schedule_kernel, interpret=interpret)

  grid_k, grid_n = pl.cdiv(k, bk), pl.cdiv(n, bn)
  num_stages = config.num_stages
  delay_release = 1 if num_stages > 1 else 0
  in_transforms_lhs = sm90.swizzled(bk, lhs.dtype)
  in_transforms_rhs = sm90.swizzled(bn, rhs.dtype)
  out_transforms = sm90.swizzled(config.epilogue_n, out_dtype)

  def body(starts_gmem, ends_gmem, first_gmem, nblocks_gmem, lhs_gmem, rhs_gmem,
           out_gmem, out_smem):

    @plgpu.nd_loop((num_groups, grid_k * grid_n), collective_axes="sm")
    def _item(info: plgpu.NDLoopInfo):
      j, ki, ni, start, end, first, _, nblocks = _work_item(
          info, grid_k, grid_n, config, starts_gmem, ends_gmem, first_gmem, nblocks_gmem)

      def acc_scope(acc_ref):
        def step(idx, lhs_smem, rhs_smem):
          _mask_own_stage(lhs_smem, rhs_smem, first + idx[0] * bm, start, end,
                          config.banded_mask)
          plgpu.wgmma(acc_ref, lhs_smem.T, rhs_smem)
          if delay_release == 0:
            # Without delayed release the slot may be refilled right after
            # this step, so the wgmma must finish reading it first.
            plgpu.wgmma_wait(0)

        @pl.when(nblocks > 0)
        def _():
          plgpu.emit_pipeline(
              step,
              grid=(nblocks,),
              in_specs=[
                  _row_spec(bm, bk, first, ki, in_transforms_lhs, delay_release),
                  _row_spec(bm, bn, first, ni, in_transforms_rhs, delay_release),
              ],
              max_concurrent_steps=num_stages,
          )(lhs_gmem, rhs_gmem)

        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bk, bn), jnp.float32))
      # The previous item's store must be done reading out_smem.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_smem[...] = acc.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          out_smem, out_gmem.at[j, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)]
      )

    plgpu.wait_smem_to_gmem(0)

  if config.num_compute_wgs == 2:
    body = functools.partial(
        _body_2wg_flat if config.pipeline_across_items else _body_2wg,
        config=config, num_groups=num_groups, grid_k=grid_k, grid_n=grid_n,
        out_dtype=out_dtype, in_transforms_lhs=in_transforms_lhs,
        in_transforms_rhs=in_transforms_rhs, out_transforms=out_transforms,
    )
    scratch_types = []
    extra = dict(num_threads=4 if config.mask_warpgroup else 3, thread_name="wg")
  else:
    scratch_types = [plgpu.SMEM((bk, bn), out_dtype, transforms=out_transforms)]
    extra = {}

  i32 = lambda x: x.astype(jnp.int32)
  side = ()
  if config.side_rows:
    side = side_buffers(lhs, rhs, i32(starts[:num_groups]), i32(ends[:num_groups]))
  args = match_varying(i32(starts), i32(ends), i32(first_row), i32(num_blocks), lhs, rhs,
                       *side)
  lhs = args[4]
  num_sms = config.num_sms
  if num_sms is None:
    num_sms = 1 if interpret else config.ctas_per_sm * sm90.device_sm_count()
  kernel = plgpu.kernel(
      body,
      out_type=out_struct((num_groups, k, n), out_dtype, lhs),
      scratch_types=scratch_types,
      grid=(num_sms,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup
      ),
      interpret=_interpret_params(interpret),
      **extra,
  )
  # plgpu.kernel drops the shard_map axis type of out_type: restore it.
  return make_varying(kernel(*args), varying_axes(lhs))


def _interpret_params(interpret):
  # ``True`` would select Pallas' generic interpreter, which cannot run TMA
  # pipelines; the GPU interpreter models TMA, wgmma and barriers.
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret or None

