"""Pallas-Triton backend: portable kernels for Ampere (sm80) and the Hopper fallback.

``gmm(lhs[m, k], rhs[g_local, k, n] | rhs[g_local, n, k], ...) -> out[m, n]``
(forward, and the dX mode with ``transpose_rhs``) and
``tgmm(lhs[m, k], rhs[m, n], ...) -> out[g_local, k, n]`` (dW).

All Triton lowering of ragdot lives in this module and in ``triton_schedule`` (the
tile schedule kernel, which has a pure-JAX fallback): JAX 0.11 deprecates the
Pallas-Triton lowering, and a replacement should only have to touch these two files.

Design (see CONTEXT.md §5):
* gmm: a static 1-D grid of ``max_tiles * n_tiles + num_row_blocks`` programs.
  The first ``max_tiles * n_tiles`` programs are (row tile, n tile) pairs of the
  on-device ``metadata.tile_schedule``: program ``t * n_tiles + j`` reads tile
  t's (group, row0, row_start, row_end) from HBM and exits at once when
  ``t >= num_tiles`` (read on device), so a group_offset shard only costs work
  for its own rows.  A tile computes a ``[block_m, block_n]`` product over a
  k loop and stores only rows ``[row_start, row_end)`` (masked store), so rows
  of a neighbouring group are never touched.  The last ``num_row_blocks``
  programs write exact zeros to the rows outside the local row window (and
  exit at once for row blocks inside it).  dX loads the ``[block_n, block_k]``
  rhs block of ``rhs[g, n, k]`` and multiplies it transposed
  (``plgpu.dot(..., trans_b=True)``): no transposed copy in HBM.
* tgmm: one program per (local group, k tile, n tile) loops over the group's
  rows in ``block_m`` chunks starting at the group's first row, every chunk
  row-masked at the group's end.  Empty groups (and local groups outside
  ``[0, G)``) store exact zeros.  No atomics, no split over rows:
  deterministic.  (One loop per program over all of its items' chunks ran
  1.2-3.8x this kernel's time, and one over a segment of groups' chunks read
  from a chunk list 1.07-1.6x: docs/performance.md 29a, 29c.)
* Masks along k and n exist only when the block does not divide the dimension
  (static), so any k, n, m work; f32 accumulation; f32 inputs use tf32 unless
  ``precision`` asks for HIGHEST (then IEEE f32 products).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ragdot import metadata as md
from ragdot import backends
from ragdot import scales
from ragdot import validate
from ragdot.backends import sm90
from ragdot.manual_axes import match_varying, out_struct

_IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_OUT_DTYPES = _IN_DTYPES
_OPS = ("gmm", "gmm_t", "tgmm")
_MIN_BLOCK = 16  # tl.dot needs every dimension >= 16
_MAX_BLOCK = 512
H200_SMEM_BYTES = sm90.SMEM_PER_CTA
A100_SMEM_BYTES = 163 * 1024  # 164 KiB per SM, 163 KiB per block (opt-in)


def _pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  """Tiling of one Pallas-Triton kernel.

  gmm / dX: ``block_m`` rows x ``block_n`` columns per program, ``block_k`` per
  k step.  tgmm (dW): the output tile is ``block_k x block_n`` of ``out[g]``
  and ``block_m`` rows are contracted per step.  Blocks are powers of two in
  [16, 512]; they are shrunk to the problem (never below 16) at call time.
  ``num_warps`` and ``num_stages`` (software pipelining depth) go to Triton.
  ``schedule_kernel`` (gmm / dX): build the tile schedule with one kernel
  (``triton_schedule``) where it applies instead of several XLA kernels.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3
  schedule_kernel: bool = True

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      v = getattr(self, name)
      if (not isinstance(v, int) or isinstance(v, bool) or not _pow2(v)
          or not _MIN_BLOCK <= v <= _MAX_BLOCK):
        raise ValueError(
            f"{name} must be a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}], got {v!r}")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
    if (not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool)
        or not 1 <= self.num_stages <= 8):
      raise ValueError(f"num_stages must be an int in [1, 8], got {self.num_stages!r}")

  def smem_bytes(self, dtype: Any = jnp.bfloat16, out_dtype: Any = None,
                 op: str = "gmm") -> int:
    """Estimated shared memory of the operand pipeline (Triton's stages)."""
    del out_dtype  # The epilogue goes from registers to HBM.
    size = jnp.dtype(dtype).itemsize
    if op == "tgmm":
      per_stage = self.block_m * (self.block_k + self.block_n)
    else:
      per_stage = self.block_k * (self.block_m + self.block_n)
    return per_stage * size * max(self.num_stages, 1)


def _check_op(op: str) -> None:
  if op not in _OPS:
    raise ValueError(f"op must be one of {_OPS}, got {op!r}")


def _rows_block(m: int, g: int) -> int:
  """Rows per tile: 128 for groups of >= 128 rows on average, else 64.

  Tiny groups (decode) are weight-bandwidth bound: 64-row tiles waste MMA work
  that is free there, and fewer row blocks mean fewer tiles straddling two
  groups (each tile reads its group's whole weight).  Shrunk to m at call time.
  """
  mean = max(m // max(g, 1), 1)
  return 128 if mean >= 128 else 64


def default_config(op: str, m: int, k: int, n: int, g: int,
                   dtype: Any = jnp.bfloat16) -> TritonConfig:
  """H200-sized defaults (measured public anchor: 128x256x64, 8 warps, 3 stages).

  gmm / gmm_t: ``block_m`` 128 for groups of >= 128 rows (else 64), ``block_n``
  256 when n allows (8 warps) else 128 (4 warps), ``block_k`` 64 (32 for f32
  inputs), 3 stages.  tgmm: 128 x 128 output tiles, 64-row steps, 8 warps.
  Not measured by this module on a GPU (see the report of issue #5).
  """
  _check_op(op)
  f32 = jnp.dtype(dtype) == jnp.float32
  bk = 32 if f32 else 64
  if op == "tgmm":
    return TritonConfig(block_m=bk, block_n=128, block_k=128, num_warps=8,
                        num_stages=3)
  bm = _rows_block(m, g)
  wide = n >= 256 and bm == 128
  return TritonConfig(block_m=bm, block_n=256 if wide else 128, block_k=bk,
                      num_warps=8 if wide else 4, num_stages=3)


def a100_config(op: str, m: int, k: int, n: int, g: int,
                dtype: Any = jnp.bfloat16) -> TritonConfig:
  """sm80 (A100: 164 KiB SMEM/SM, 108 SMs) config chosen on paper: NOT MEASURED.

  The classic Ampere Triton matmul tile 128x256 with 8 warps, but ``block_k``
  32 and 4 stages: 96 KiB of bf16 operand pipeline (the 128x256x64 x 3 stage
  H200 tile, 144 KiB, fits only one CTA per SM with nothing to spare).
  Small groups (< 128 rows on average) use 64x128 tiles with 4 warps so that
  108 SMs still get enough tiles.  f32 inputs: 128x128x32, 3 stages (96 KiB).
  tgmm: 128x128 output tiles, 32-row steps, 8 warps, 4 stages (64 KiB bf16).
  """
  _check_op(op)
  f32 = jnp.dtype(dtype) == jnp.float32
  if op == "tgmm":
    return TritonConfig(block_m=32, block_n=128, block_k=128, num_warps=8,
                        num_stages=3 if f32 else 4)
  bm = _rows_block(m, g)
  if f32:
    return TritonConfig(block_m=bm, block_n=128, block_k=32, num_warps=4 if bm == 64 else 8,
                        num_stages=3)
  if bm == 64 or n < 256:
    return TritonConfig(block_m=bm, block_n=128, block_k=32, num_warps=4, num_stages=4)
  return TritonConfig(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=4)


def _on_sm80() -> bool:
  """Whether the default device is an Ampere-class GPU (compute capability 8.x)."""
  from ragdot import dispatch  # pylint: disable=g-import-not-at-top  (the layer above)

  dev = dispatch.current_device()
  return dev.platform == "gpu" and (dev.compute_capability or "").startswith("8.")


def device_default_config(op: str, m: int, k: int, n: int, g: int,
                          dtype: Any = jnp.bfloat16) -> TritonConfig:
  """The config used when none is given: ``a100_config`` (chosen on paper, not
  measured) on an sm80 GPU, else ``default_config`` (H200-tuned; also the
  interpret-mode default)."""
  if _on_sm80():
    return a100_config(op, m, k, n, g, dtype)
  return default_config(op, m, k, n, g, dtype)


def gpu_sweep_configs(op: str, m: int, k: int, n: int, g: int,
                      dtype: Any = jnp.bfloat16,
                      smem_limit: int = H200_SMEM_BYTES) -> list[TritonConfig]:
  """Candidates for ``ragdot tune`` (those fitting ``smem_limit``), default first."""
  _check_op(op)
  out = [default_config(op, m, k, n, g, dtype)]
  if op == "gmm" and out[0].block_m == 64:
    # Decode-sized groups, forward: the default tile in 2 stages next (4 programs
    # per SM by SMEM; the Qwen3-30B down decode forward ran 0.98x the 3-stage one
    # and every decode dX lost 2-26%, H200, docs/performance.md 18c-18d), inside
    # the first four that `ragdot tune` times.
    out.append(dataclasses.replace(out[0], num_stages=2))
  if op != "tgmm" and out[0].block_m == 64:
    # Decode-sized groups: 32-row tiles stepping 128 deep (256-byte pieces of
    # each weight row): 0.950-0.975x the default on the 128/256-expert decode
    # dX calls and no extra weight reads under skew, where 16-row tiles re-read
    # a group's weights per 16 rows (H200, docs/performance.md 28c-28d).
    deep = TritonConfig(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=3)
    if deep.smem_bytes(dtype, op=op) <= smem_limit:
      out.append(deep)
  if op == "tgmm":
    shapes = [(bm, bn, bk, w) for bm in (32, 64) for (bk, bn, w) in
              ((128, 128, 8), (128, 256, 8), (64, 128, 4), (128, 64, 4))]
  else:
    tiles = ((128, 256, 8), (64, 256, 8), (128, 128, 8), (128, 128, 4), (64, 128, 4),
             (32, 128, 4), (16, 128, 4))
    # Every tile shape at block_k 64 (4, then 3 stages) before any at block_k
    # 32: a tune cut short by its budget (or taking only the first few Triton
    # candidates) still sees 64-row tiles, which halve the padding of a group's
    # last tile.
    shapes = [(bm, bn, 64, w) for (bm, bn, w) in tiles]
    shapes += [(bm, bn, 32, w) for (bm, bn, w) in tiles]
    shapes += [(bm, 128, 128, 4) for bm in (64, 32, 16)]
  for bm, bn, bk, w in shapes:
    for stages in ((4, 3) if op != "tgmm" else (3, 4)):
      c = TritonConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                       num_stages=stages)
      if c not in out and c.smem_bytes(dtype, op=op) <= smem_limit:
        out.append(c)
  return out


# --- helpers -------------------------------------------------------------------


def _fit(block: int, dim: int) -> int:
  """Block shrunk to the next power of two >= dim (never below 16)."""
  return max(_MIN_BLOCK, min(block, _next_pow2(max(dim, 1))))


def _dot_precision(precision: Any) -> Any:
  """None (tf32 for f32 inputs) or (HIGHEST, HIGHEST) (IEEE f32 products)."""
  if precision is None:
    return None
  values = precision if isinstance(precision, (tuple, list)) else (precision,)
  canon = []
  for v in values:
    if v is None:
      v = lax.Precision.DEFAULT
    elif isinstance(v, str):
      try:
        v = lax.Precision(v.lower())
      except ValueError:
        try:
          v = lax.Precision[v.upper()]
        except KeyError:
          raise NotImplementedError(f"triton: unsupported precision {precision!r}") from None
    if not isinstance(v, lax.Precision):
      # DotAlgorithm / presets: not mapped here; the dispatcher can route to xla.
      raise NotImplementedError(f"triton: unsupported precision {precision!r}")
    canon.append(v)
  if lax.Precision.HIGHEST in canon:
    return (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
  return None


def takes_weight_only(lhs_dtype: Any, rhs_dtype: Any) -> bool:
  """Whether ``gmm`` takes bf16 / f16 rows with e4m3 / e5m2 weights as they
  are (W8A16): each weight block is widened to the rows' dtype after its load
  (exact), in either layout.  Needs sm89 or later for e4m3 (Triton's
  conversion)."""
  return (jnp.dtype(lhs_dtype) in _IN_DTYPES[:2] and jnp.dtype(rhs_dtype) in validate.FP8_DTYPES)


# The most elements a 1-byte operand of at most 2**32 bytes may have (``offsets_wrap``).
_MAX_1BYTE_ELEMENTS = 2**31


def offsets_wrap(array: Any) -> bool:
  """Whether Pallas-Triton (jax 0.11.2) would index ``array`` with wrapping
  offsets: it takes 32-bit signed element offsets for arrays of at most 2**32
  bytes, which wrap past 2**31 one-byte elements (an illegal address on
  DeepSeek-V3's 256 x 2048 x 7168 e4m3 weights, docs/performance.md v59).  The
  kernels take such weights widened (then over 2**32 bytes: 64-bit offsets)."""
  return jnp.dtype(array.dtype).itemsize == 1 and _MAX_1BYTE_ELEMENTS < array.size <= 2**32


def _check_dtypes(dtype: Any, out_dtype: Any) -> None:
  if jnp.dtype(dtype) not in _IN_DTYPES:
    raise NotImplementedError(f"triton: input dtype {jnp.dtype(dtype)} (takes bf16/f16/f32)")
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise NotImplementedError(f"triton: out dtype {jnp.dtype(out_dtype)} (gives bf16/f16/f32)")


def _iota(size: int, start: Any = 0) -> jax.Array:
  return start + lax.broadcasted_iota(jnp.int32, (size,), 0)


def _and(*masks):
  masks = [x for x in masks if x is not None]
  if not masks:
    return None
  out = masks[0]
  for x in masks[1:]:
    out = out & x
  return out


def _load(ref, mask):
  if mask is None:
    return plgpu.load(ref)
  # (a zero of the ref's dtype: Triton casts no int32 0 to 8-bit floats)
  return plgpu.load(ref, mask=mask, other=jnp.zeros((), ref.dtype))


def _store(ref, val, mask):
  if mask is None:
    plgpu.store(ref, val)
  else:
    plgpu.store(ref, val, mask=mask)


def _compiler_params(config: TritonConfig) -> Any:
  return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


# --- gmm: forward and dX -------------------------------------------------------


def _gmm_kernel(tiles_ref, info_ref, lhs_ref, rhs_ref, *refs, m, k, n, bm,
                bn, bk, n_tiles, work, transpose_rhs, precision, scale_block=None):
  # refs: (scale_ref, out_ref) with weight scales (scale_block: (t, c)), else (out_ref,)
  scale_ref, out_ref = refs if scale_block else (None, refs[0])
  pid = pl.program_id(0)
  k_steps = pl.cdiv(k, bk)

  @pl.when(pid < work)
  def _compute():
    t = pid // n_tiles
    j = pid % n_tiles

    @pl.when(t < info_ref[0])
    def _tile():
      grp = tiles_ref[0, t]
      row0 = pl.multiple_of(tiles_ref[1, t], 8)  # group-aligned window
      rows = _iota(bm, row0)
      row_mask = (rows >= tiles_ref[2, t]) & (rows < tiles_ref[3, t])
      n0 = pl.multiple_of(j * bn, bn)
      col_mask = _iota(bn, n0) < n if n % bn else None
      # Each column's scale block (columns past n read the last one's).
      col_block = jnp.minimum(_iota(bn, n0), n - 1) // scale_block[1] if scale_block else None

      def step(kk, acc):
        k0 = pl.multiple_of(kk * bk, bk)
        k_mask = _iota(bk, k0) < k if k % bk else None
        x = _load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)],
                  _and(row_mask[:, None], None if k_mask is None else k_mask[None, :]))
        if transpose_rhs:  # rhs[g, n, k]: a [bn, bk] block, used transposed
          w = _load(rhs_ref.at[grp, pl.ds(n0, bn), pl.ds(k0, bk)],
                    _and(None if col_mask is None else col_mask[:, None],
                         None if k_mask is None else k_mask[None, :]))
        else:
          w = _load(rhs_ref.at[grp, pl.ds(k0, bk), pl.ds(n0, bn)],
                    _and(None if k_mask is None else k_mask[:, None],
                         None if col_mask is None else col_mask[None, :]))
        if scale_ref is not None:  # each column's scale over this k step's block
          kb = k0 // scale_block[0]  # (gathered from rhs's layout)
          sc = scale_ref[grp, col_block, kb] if transpose_rhs else scale_ref[grp, kb, col_block]
          sc = sc.astype(jnp.float32)
          w = w.astype(jnp.float32) * (sc[:, None] if transpose_rhs else sc[None, :])
        if w.dtype != x.dtype:  # W8A16: 8-bit weights widened in registers (exact)
          w = w.astype(x.dtype)
        return acc + plgpu.dot(x, w, trans_b=transpose_rhs, precision=precision)

      acc = lax.fori_loop(0, k_steps, step, jnp.zeros((bm, bn), jnp.float32))
      _store(out_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)], acc.astype(out_ref.dtype),
             _and(row_mask[:, None], None if col_mask is None else col_mask[None, :]))

  @pl.when(pid >= work)
  def _zeros():
    row0 = pl.multiple_of((pid - work) * bm, bm)
    lo, hi = info_ref[1], info_ref[2]

    @pl.when((row0 < lo) | (jnp.minimum(row0 + bm, m) > hi))
    def _outside():
      rows = _iota(bm, row0)
      row_mask = ((rows < lo) | (rows >= hi)) & (rows < m)
      zeros = jnp.zeros((bm, bn), out_ref.dtype)

      def col_tile(j, carry):
        n0 = pl.multiple_of(j * bn, bn)
        col_mask = _iota(bn, n0) < n if n % bn else None
        _store(out_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)], zeros,
               _and(row_mask[:, None], None if col_mask is None else col_mask[None, :]))
        return carry

      lax.fori_loop(0, n_tiles, col_tile, 0)


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    transpose_rhs: bool,
    out_dtype: Any,
    precision: Any,
    interpret: bool = False,
    config: TritonConfig | None = None,
    rhs_scale: jax.Array | None = None,
) -> jax.Array:
  """lhs[m,k] x rhs[g_local,k,n] (or [g_local,n,k] with transpose_rhs) -> out[m,n].
  rhs in lhs's dtype, or e4m3 / e5m2 beside bf16 / f16 lhs (``takes_weight_only``);
  then optionally ``rhs_scale`` in rhs's layout (``[g_local, k // t, n // c]``,
  or ``[g_local, n // c, k // t]`` with transpose_rhs; see ``ragdot.scales``),
  read as given (each k step gathers its columns' scales): each widened
  weight block times its columns' scales in f32, rounded once to lhs's dtype
  (t a multiple of the k step)."""
  m, k = lhs.shape
  num_local = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  _check_dtypes(lhs.dtype, out_dtype)
  if rhs.dtype != lhs.dtype and not takes_weight_only(lhs.dtype, rhs.dtype):
    raise NotImplementedError(f"triton: rhs dtype {rhs.dtype} beside lhs {lhs.dtype} (takes the"
                              " same dtype, or e4m3 / e5m2 weights beside bf16 / f16 rows)")
  if offsets_wrap(rhs):
    raise NotImplementedError(f"triton: rhs of {rhs.size} one-byte elements (Pallas-Triton's"
                              f" 32-bit offsets reach {_MAX_1BYTE_ELEMENTS}; arrays over 2**32"
                              " bytes get 64-bit ones)")
  prec = _dot_precision(precision)
  if m == 0 or n == 0 or k == 0 or num_local == 0:
    return jnp.zeros((m, n), out_dtype)
  op = "gmm_t" if transpose_rhs else "gmm"
  config = config or device_default_config(op, m, k, n, num_local, lhs.dtype)
  if not isinstance(config, TritonConfig):
    raise TypeError(f"config must be a TritonConfig, got {type(config).__name__}")
  bm, bn, bk = _fit(config.block_m, m), _fit(config.block_n, n), _fit(config.block_k, k)
  scale_block = None
  if rhs_scale is not None:
    if rhs.dtype == lhs.dtype:
      raise NotImplementedError(f"triton: rhs_scale needs fp8 weights beside 16-bit rows, got"
                                f" {rhs.dtype} weights")
    scale_block = scales.blocks(rhs_scale, rhs.shape, transpose_rhs)
    if scale_block[0] % bk:
      raise NotImplementedError(f"triton: scale blocks of {scale_block[0]} rows must hold whole"
                                f" k steps of {bk}")

  tiles, info = backends.flat_schedule(  # info: num_tiles, lo, hi, ...
      group_sizes, group_offset, m=m, num_local=num_local, block_m=bm,
      use_kernel=config.schedule_kernel, interpret=interpret)
  tiles = tiles.reshape(4, -1)

  max_t = md.max_tiles(m, bm, num_local)
  n_tiles = pl.cdiv(n, bn)
  num_blocks = pl.cdiv(m, bm)
  work = max_t * n_tiles
  kernel = functools.partial(
      _gmm_kernel, m=m, k=k, n=n, bm=bm, bn=bn, bk=bk, n_tiles=n_tiles, work=work,
      transpose_rhs=transpose_rhs, precision=prec, scale_block=scale_block)
  tiles, info, lhs, rhs = match_varying(tiles, info, lhs, rhs)
  operands = (tiles, info, lhs, rhs)
  if rhs_scale is not None:
    operands += match_varying(rhs_scale, lhs)[:1]
  return pl.pallas_call(
      kernel,
      out_shape=out_struct((m, n), out_dtype, lhs),
      grid=(work + num_blocks,),
      compiler_params=_compiler_params(config),
      interpret=interpret,
      name="ragdot_triton_gmm_t" if transpose_rhs else "ragdot_triton_gmm",
  )(*operands)


# --- tgmm: dW --------------------------------------------------------------------


def _tgmm_kernel(bounds_ref, lhs_ref, rhs_ref, out_ref, *, k, n, bm, bn, bk,
                 k_tiles, n_tiles, precision):
  pid = pl.program_id(0)
  grp = pid // (k_tiles * n_tiles)
  rest = pid % (k_tiles * n_tiles)
  k0 = pl.multiple_of((rest // n_tiles) * bk, bk)
  n0 = pl.multiple_of((rest % n_tiles) * bn, bn)
  start, end = bounds_ref[0, grp], bounds_ref[1, grp]
  k_mask = _iota(bk, k0) < k if k % bk else None
  n_mask = _iota(bn, n0) < n if n % bn else None
  k_row = None if k_mask is None else k_mask[None, :]
  n_row = None if n_mask is None else n_mask[None, :]

  # One pipelined loop over the group's row chunks, the last (partial) one
  # included: rows past `end` load as 0 in both operands, so inf/NaN in a
  # neighbour's rows cannot leak.  (A partial chunk run after the loop has
  # loads Triton's software pipeline does not cover: 1.06-1.09x the time on
  # the Qwen shapes, docs/performance.md v20b.)
  def chunk(i, acc):
    r0 = start + i * bm
    row_mask = (_iota(bm, r0) < end)[:, None]
    x = _load(lhs_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], _and(row_mask, k_row))
    y = _load(rhs_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], _and(row_mask, n_row))
    return acc + plgpu.dot(x, y, trans_a=True, precision=precision)

  acc = lax.fori_loop(0, pl.cdiv(end - start, bm), chunk, jnp.zeros((bk, bn), jnp.float32))
  _store(out_ref.at[grp, pl.ds(k0, bk), pl.ds(n0, bn)], acc.astype(out_ref.dtype),
         _and(None if k_mask is None else k_mask[:, None], n_row))


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    num_groups: int,
    out_dtype: Any,
    precision: Any,
    interpret: bool = False,
    config: TritonConfig | None = None,
) -> jax.Array:
  """lhs[m,k], rhs[m,n] -> out[num_groups,k,n] = per-group lhs^T rhs."""
  m, k = lhs.shape
  n = rhs.shape[1]
  _check_dtypes(lhs.dtype, out_dtype)
  if rhs.dtype != lhs.dtype:
    raise NotImplementedError(f"triton tgmm: rhs dtype {rhs.dtype} beside lhs {lhs.dtype}"
                              " (takes one dtype for both)")
  prec = _dot_precision(precision)
  if m == 0 or k == 0 or n == 0 or num_groups == 0:
    return jnp.zeros((num_groups, k, n), out_dtype)
  config = config or device_default_config("tgmm", m, k, n, num_groups, lhs.dtype)
  if not isinstance(config, TritonConfig):
    raise TypeError(f"config must be a TritonConfig, got {type(config).__name__}")
  bm, bn, bk = _fit(config.block_m, m), _fit(config.block_n, n), _fit(config.block_k, k)
  starts, ends = md.group_bounds(group_sizes, m, group_offset, num_groups)
  bounds = jnp.stack([starts, ends]).astype(jnp.int32)
  k_tiles, n_tiles = pl.cdiv(k, bk), pl.cdiv(n, bn)
  kernel = functools.partial(
      _tgmm_kernel, k=k, n=n, bm=bm, bn=bn, bk=bk, k_tiles=k_tiles,
      n_tiles=n_tiles, precision=prec)
  bounds, lhs, rhs = match_varying(bounds, lhs, rhs)
  return pl.pallas_call(
      kernel,
      out_shape=out_struct((num_groups, k, n), out_dtype, lhs),
      grid=(num_groups * k_tiles * n_tiles,),
      compiler_params=_compiler_params(config),
      interpret=interpret,
      name="ragdot_triton_tgmm",
  )(bounds, lhs, rhs)
