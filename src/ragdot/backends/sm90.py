"""Hopper (sm90) limits that size the Mosaic kernels' grids and SMEM budgets."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_PER_SM = 228 * 1024  # shared memory of one SM
SMEM_PER_CTA = 227 * 1024  # the most dynamic SMEM one CTA may opt into
_DRIVER_RESERVE = 1024  # the driver keeps 1 KiB per resident CTA
H200_SMS = 132


def gpu_compute_capability() -> str | None:
  """The local GPU's compute capability ("9.0"), None without a GPU."""
  if jax.default_backend() != "gpu":
    return None
  return str(getattr(jax.devices()[0], "compute_capability", "") or "")


@dataclasses.dataclass(frozen=True)
class Profile:
  """Mosaic GPU's on-device profiler: each warpgroup records up to ``space`` - 1
  named ranges (the kernels' ``jax.named_scope`` regions, nested ones counted
  too; later ones are dropped) in SMEM, and a trace JSON per call lands in
  ``directory``."""
  directory: str
  space: int

  def smem_bytes(self, warpgroups: int) -> int:
    """SMEM the profile buffer takes in a CTA of ``warpgroups`` warpgroups
    (4 * space 4-byte entries each: two per event, a 3-entry header among them)."""
    return warpgroups * 4 * (4 * self.space)


_profile: Profile | None = None


@contextlib.contextmanager
def profiling(directory: str, space: int = 256) -> Iterator[Profile]:
  """Kernels traced inside this context record a Mosaic profile (``Profile``);
  jit caches by shapes, so trace a fresh function in it.  Outside it the
  kernels' named scopes cost nothing (they only name MLIR locations)."""
  global _profile
  if space < 1:
    raise ValueError(f"space must be >= 1, got {space}")
  os.makedirs(directory, exist_ok=True)
  saved, _profile = _profile, Profile(directory, space)
  try:
    yield _profile
  finally:
    _profile = saved


def active_profile(interpret=False) -> Profile | None:
  """The ``profiling`` context's settings, None outside one and in interpret
  mode (which has no profiler)."""
  return None if interpret else _profile


def profile_smem_bytes(warpgroups: int, interpret=False) -> int:
  """SMEM the active profile buffer adds to a CTA of ``warpgroups`` warpgroups
  (0 when ``active_profile`` is None): for the kernels' SMEM checks."""
  profile = active_profile(interpret)
  return 0 if profile is None else profile.smem_bytes(warpgroups)


def compiler_params(interpret=False) -> plgpu.CompilerParams:
  """Warpgroup-semantics compiler params, with the active ``profiling``
  context's profiler (``active_profile``)."""
  extra = {}
  if (profile := active_profile(interpret)) is not None:
    extra = dict(profile_space=profile.space, profile_dir=profile.directory,
                 profile_bounds_check=True)
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **extra)


def check_device(interpret) -> None:
  """NotImplementedError unless the kernels run on an sm90 GPU (their wgmma and
  SMEM sizes are Hopper's), in interpret mode, or are only lowered (no GPU)."""
  cc = None if interpret else gpu_compute_capability()
  if cc is not None and not cc.startswith("9."):
    raise NotImplementedError(
        f"the Mosaic kernels need an sm90 (Hopper) GPU; this one is sm{cc.replace('.', '')}")


def smem_budget(ctas_per_sm: int, reserve: int) -> int:
  """Dynamic SMEM one CTA may allocate when ``ctas_per_sm`` CTAs share an SM,
  minus ``reserve`` bytes the kernel keeps for barriers and alignment."""
  if ctas_per_sm < 1:
    raise ValueError(f"ctas_per_sm must be >= 1, got {ctas_per_sm}")
  per_cta = SMEM_PER_CTA if ctas_per_sm == 1 else SMEM_PER_SM // ctas_per_sm - _DRIVER_RESERVE
  return per_cta - reserve


def check_ctas_per_sm(ctas_per_sm: int, num_compute_wgs: int) -> None:
  """1, or 2 resident CTAs per SM for one compute warpgroup (registers); else ValueError."""
  if ctas_per_sm not in (1, 2) or (ctas_per_sm == 2 and num_compute_wgs != 1):
    raise ValueError(
        f"ctas_per_sm must be 1, or 2 with num_compute_wgs=1 (registers), got"
        f" {ctas_per_sm} with num_compute_wgs={num_compute_wgs}")


def swizzled(minor: int, dtype) -> tuple:
  """SMEM transforms (8-row tiling + the widest swizzle) for a tile whose minor
  dimension holds ``minor`` elements: what TMA copies and wgmma operands take."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def widened_operand(ref, dtype, staging=None, wait: bool = True, scale=None):
  """An 8-bit (e4m3 / e5m2) SMEM tile ((64, k) K-major, or (k, 64)) in the
  16-bit ``dtype``, converted in registers (exact: every fp8 value is an f16
  and a bf16).  Returned as registers (a (64, k) tile: wgmma's A operand,
  loaded two to a 16-bit lane and relaid for wgmma), or written to
  ``staging`` (an SMEM buffer of the tile's shape; either tile, loaded in
  wgmma's 8-bit layout) and returned as that buffer.  ``wait``: first wait
  for every wgmma in flight, which may still read the registers (or buffer)
  this overwrites (on the H100 a wgmma left in flight across k steps gave
  wrong sums, 53a); registers always wait.
  ``scale``: (an f32 SMEM vector, the tile's axis it runs along), or one f32
  scalar: the tile times it in f32, then rounded once to ``dtype``."""
  if wait or staging is None:
    plgpu.wgmma_wait(0)
  if staging is None:
    layout = plgpu.Layout.WGMMA
    a = plgpu.load(ref, layout=plgpu.Layout.WGMMA_UPCAST_2X)
    a = plgpu.layout_cast(a, layout).astype(jnp.float16)
  else:
    # Only SMEM reads the result, so the registers keep the 8-bit layout (no
    # relayout): 0.95-0.97x the time of block-scaled [g, k, n] W8A16 calls and
    # 0.96x per-column-scaled ones, the same unscaled (docs/performance.md v58c, g).
    layout = plgpu.Layout.WGMMA_8BIT
    a = plgpu.load(ref, layout=layout)
  if isinstance(scale, tuple):
    vec, axis = scale
    s = plgpu.load(vec, layout=layout.reduce(1 - axis))
    a = (a.astype(jnp.float32) * lax.broadcast_in_dim(s, a.shape, [axis])).astype(dtype)
  elif scale is not None:
    a = (a.astype(jnp.float32) * scale).astype(dtype)
  elif jnp.dtype(dtype) != jnp.float16 or staging is not None:
    a = a.astype(jnp.float32).astype(dtype)
  if staging is None:
    return a
  staging[...] = a
  plgpu.commit_smem()
  return staging


def stage(buf, value, transposed: bool = False) -> None:
  """Writes a register tile into an SMEM staging buffer in the buffer's dtype
  (``transposed``: the (columns, rows) tile into the (rows, columns) buffer)."""
  if transposed:
    buf.transpose((1, 0))[...] = value.astype(buf.dtype)
  else:
    buf[...] = value.astype(buf.dtype)


def column_chunk(acc, c: int, cols: int):
  """Columns [c * cols, (c + 1) * cols) of a register tile (the tile itself when
  it is one chunk wide): one epilogue chunk."""
  return acc if c == 0 and acc.shape[1] == cols else acc[:, c * cols:(c + 1) * cols]


def device_sm_count() -> int:
  """SM count of the first GPU (H200's 132 when no GPU is visible)."""
  try:
    count = jax.devices("gpu")[0].core_count
  except RuntimeError:
    return H200_SMS
  return int(count) if count else H200_SMS
