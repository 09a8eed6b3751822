"""The kernels' tile schedules built by one Pallas-Triton kernel each.

``build(group_sizes, group_offset, ...)`` computes what
``metadata.flat_schedule`` computes, in one kernel launch instead of the five
to nine small XLA kernels those ops become on a GPU: on the H200 (2026-11-30)
those took 5-17 us of device time per call and this kernel 2-5 us, which made
Qwen3-30B forward / dX calls 2-6% faster, its decode calls 5-10% and an EP=8
shard 10-12%.  The results are identical entry for entry (tests compare them).

``build_bounds`` does the same for the dW kernel's per-group row blocks.

Every program of ``build`` recomputes the per-group quantities (prefix sums over the local
groups, vectorized) and then fills its own block of ``tile_block`` tiles, so
the launch is one short wave.  Limits (static; ``supported``): at most
``MAX_LOCAL`` local groups (a ``[tile_block, groups]`` compare lives in
registers) and ``num_groups * m < 2**31`` (int32 prefix sums cannot
overflow, so clipping the sums at ``m`` equals the saturating scan of
``metadata``).

Like ``triton.py``, this module holds Triton lowering only.  The kernels reach
it through ``ragdot.backends.flat_schedule`` / ``row_blocks`` (compiled GPU
calls only; see ``schedule_kernels``), which fall back to ``metadata`` wherever
that or ``supported`` says no.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ragdot import metadata as md
from ragdot.manual_axes import match_varying, out_struct

MAX_LOCAL = 1024
_ELEMENTS = 1024  # [tile_block, groups] elements per program (best of 1024-8192, H200)
_PREFIX_BLOCK = 1024  # global groups summed per step for the rows before the shard
NUM_SCALARS = 8  # num_tiles, lo, hi, za, zb, num_zero, 0, 0


def _pow2_at_least(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()


def supported(m: int, num_groups: int, num_local: int) -> bool:
  """Whether ``build`` takes this problem (static)."""
  return (0 < num_local <= MAX_LOCAL and num_groups > 0 and m > 0
          and max(num_groups, num_local) * m < 2**31)


def tile_block(num_local: int, elements: int = _ELEMENTS) -> int:
  """Tiles filled per program (``elements``: of the [tiles, groups] compare, a
  power of two, as every Triton block shape)."""
  if elements < 1 or elements & (elements - 1):
    raise ValueError(f"elements must be a power of two, got {elements}")
  return max(1, min(128, elements // _pow2_at_least(num_local)))


def padded_tiles(m: int, block_m: int, num_local: int, elements: int = _ELEMENTS) -> int:
  """Length of each schedule row: ``metadata.max_tiles`` rounded up to whole
  programs (entries past ``num_tiles`` are padding, as in ``metadata``)."""
  tb = tile_block(num_local, elements)
  return pl.cdiv(md.max_tiles(m, block_m, num_local), tb) * tb


def _iota(size: int, start=0):
  return start + lax.broadcasted_iota(jnp.int32, (size,), 0)


def _local_groups(sizes_ref, offset_ref, *, m: int, num_groups: int, num_local: int,
                  has_offset: bool):
  """Per local group j (a power-of-two vector, lanes >= num_local padding):
  (j, whether j is a group of [0, G), start row, end row), clipped to m, and the
  shard's rows [lo, hi)."""
  gb = _pow2_at_least(num_local)
  o = offset_ref[0] if has_offset else jnp.int32(0)

  def clipped_sizes(idx, valid):
    safe = jnp.clip(idx, 0, num_groups - 1)
    s = plgpu.load(sizes_ref.at[safe], mask=valid, other=0)
    return jnp.where(valid, jnp.clip(s, 0, m), 0)

  # Rows owned by the global groups before the shard's first one.
  before = jnp.int32(0)
  if has_offset:
    pb = min(_PREFIX_BLOCK, _pow2_at_least(num_groups))

    def prefix(i, acc):
      g = _iota(pb, i * pb)
      return acc + jnp.sum(clipped_sizes(g, (g < num_groups) & (g < o)), dtype=jnp.int32)

    before = lax.fori_loop(0, pl.cdiv(num_groups, pb), prefix, jnp.int32(0))

  j = _iota(gb)
  gidx = o + j
  valid = (j < num_local) & (gidx >= 0) & (gidx < num_groups)
  s = clipped_sizes(gidx, valid)
  incl = jnp.cumsum(s, axis=0, dtype=jnp.int32)
  starts = jnp.minimum(before + incl - s, m)
  ends = jnp.minimum(before + incl, m)
  lo = jnp.minimum(before, m)
  hi = jnp.maximum(jnp.minimum(before + jnp.sum(s, dtype=jnp.int32), m), lo)
  return j, valid, starts, ends, lo, hi


def _kernel(sizes_ref, offset_ref, *out_refs, m: int, num_groups: int, num_local: int,
            specs: tuple[tuple[int, int, int, int, int, int], ...], has_offset: bool):
  """Programs [first, first + tiles_len / tb) of each spec (block_m, align, tail_rows,
  tiles_len, tb, first) fill that spec's schedule (``out_refs``: tiles, scalars of
  each spec in turn)."""
  pid = pl.program_id(0)
  groups = _local_groups(sizes_ref, offset_ref, m=m, num_groups=num_groups,
                         num_local=num_local, has_offset=has_offset)
  for i, (block_m, align, tail_rows, tiles_len, tb, first) in enumerate(specs):
    fill = functools.partial(_fill, out_refs[2 * i], out_refs[2 * i + 1],
                             pid - first if first else pid, groups,
                             m=m, num_local=num_local, block_m=block_m, align=align,
                             tail_rows=tail_rows, tiles_len=tiles_len, tb=tb)
    if len(specs) == 1:
      fill()
    else:
      pl.when((pid >= first) & (pid < first + tiles_len // tb))(fill)


def _fill(tiles_ref, scal_ref, pid, groups, *, m: int, num_local: int, block_m: int, align: int,
          tail_rows: int, tiles_len: int, tb: int):
  """Program ``pid``'s block of ``tb`` tiles of one schedule (and its scalars, program 0)."""
  j, _, starts, ends, lo, hi = groups
  base = (starts // align) * align
  count = jnp.where(ends > starts, (ends - base + block_m - 1) // block_m, 0)
  if tail_rows:
    count = count - md.fold_tail(count, base, ends, block_m, tail_rows)
  t_incl = jnp.cumsum(count, axis=0, dtype=jnp.int32)
  t_excl = t_incl - count
  num_tiles = jnp.sum(count, dtype=jnp.int32)

  t = _iota(tb, pid * tb)
  # One-hot of each real tile's group (tiles of a group are consecutive);
  # padding tiles (t >= num_tiles) get the last local group, as in metadata.
  owns = (t_excl[None, :] <= t[:, None]) & (t[:, None] < t_incl[None, :])

  def pick(v):  # v[group of t] for every t of the block (0 for padding)
    return jnp.sum(jnp.where(owns, v[None, :], 0), axis=1, dtype=jnp.int32)

  real = t < num_tiles
  group = jnp.where(real, pick(j), num_local - 1)
  start_t = pick(starts)
  row0 = jnp.where(real, (start_t // align) * align + (t - pick(t_excl)) * block_m, 0)
  row_start = jnp.where(real, jnp.maximum(start_t, row0), 0)
  # (metadata.tile_schedule: a group's last tile ends at the group's end)
  row_end = jnp.where(real, jnp.where(t + 1 == pick(t_incl), pick(ends), row0 + block_m), 0)
  for r, v in enumerate((group, row0, row_start, row_end)):
    plgpu.store(tiles_ref.at[pl.ds(r * tiles_len + pid * tb, tb)], v)

  @pl.when(pid == 0)
  def _scalars():
    num_blocks = pl.cdiv(m, block_m)
    za = (lo + block_m - 1) // block_m
    zb = jnp.minimum(jnp.maximum(hi // block_m, za), num_blocks)
    num_zero = za + jnp.where(hi < m, num_blocks - zb, 0)
    i = _iota(NUM_SCALARS)
    vals = jnp.zeros((NUM_SCALARS,), jnp.int32)
    for pos, v in enumerate((num_tiles, lo, hi, za, zb, num_zero)):
      vals = jnp.where(i == pos, v, vals)
    plgpu.store(scal_ref.at[pl.ds(0, NUM_SCALARS)], vals)


def _kernel_inputs(name: str, group_sizes, group_offset, m: int, num_local: int):
  """(int32 sizes, int32[1] offset (0 when None), G) after the static checks."""
  num_groups = group_sizes.shape[0]
  if not supported(m, num_groups, num_local):
    raise ValueError(
        f"triton_schedule.{name} takes 1..{MAX_LOCAL} local groups and"
        f" num_groups * m < 2**31, got m={m}, num_groups={num_groups},"
        f" num_local={num_local}")
  offset = (jnp.zeros((1,), jnp.int32) if group_offset is None
            else jnp.reshape(group_offset, (1,)).astype(jnp.int32))
  sizes, offset = match_varying(group_sizes.astype(jnp.int32), offset)
  return sizes, offset, num_groups


def build(
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    m: int,
    num_local: int,
    block_m: int,
    align: int = 8,
    tail_rows: int = 0,
    interpret: bool = False,
    elements: int = _ELEMENTS,
) -> tuple[jax.Array, jax.Array]:
  """The schedule of ``metadata.tile_schedule`` and the zero-row counts.

  Args:
    group_sizes: int[G], all groups' sizes in row order.
    group_offset: None or an int scalar (shape () or (1,)): local group j is
      global group ``group_offset + j``.
    m: rows of the ragged operand; num_local: local groups; block_m: rows per
      tile; align: tile windows start at multiples of ``gcd(align, block_m)``;
      tail_rows: folded last tiles, as in ``metadata.tile_schedule``;
      elements: size of each program's [tiles, groups] compare (sets how many
      tiles a program fills).

  Returns:
    The values of ``metadata.flat_schedule``: ``tiles``, int32[4 * T] with
    each of its four rows padded to T = ``padded_tiles`` (entries past
    ``num_tiles`` are padding as there), and ``scalars``, int32[8] whose first
    six are ``metadata.flat_schedule``'s.

  Raises:
    ValueError: a problem ``supported`` refuses.
  """
  (out,) = build_many(group_sizes, group_offset, m=m, num_local=num_local,
                      tiles=((block_m, tail_rows),), align=align, interpret=interpret,
                      elements=elements)
  return out


def build_many(
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    m: int,
    num_local: int,
    tiles: tuple[tuple[int, int], ...],
    align: int = 8,
    interpret: bool = False,
    elements: int = _ELEMENTS,
) -> list[tuple[jax.Array, jax.Array]]:
  """``build``'s ``(tiles, scalars)`` for each ``(block_m, tail_rows)`` of ``tiles``,
  from one kernel launch (programs in turn per schedule).  Same arguments and
  limits as ``build``."""
  sizes, offset, num_groups = _kernel_inputs("build", group_sizes, group_offset, m, num_local)
  tb = tile_block(num_local, elements)
  specs, first = [], 0
  for block_m, tail_rows in tiles:
    tiles_len = padded_tiles(m, block_m, num_local, elements)
    specs.append((block_m, math.gcd(align, block_m), tail_rows, tiles_len, tb, first))
    first += tiles_len // tb
  kernel = functools.partial(_kernel, m=m, num_groups=num_groups, num_local=num_local,
                             specs=tuple(specs), has_offset=group_offset is not None)
  outs = pl.pallas_call(
      kernel,
      out_shape=tuple(struct for spec in specs for struct in (
          out_struct((4 * spec[3],), jnp.int32, sizes),
          out_struct((NUM_SCALARS,), jnp.int32, sizes))),
      grid=(first,),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="ragdot_tile_schedule",
  )(sizes, offset)
  return [(outs[2 * i], outs[2 * i + 1]) for i in range(len(specs))]


def _bounds_kernel(sizes_ref, offset_ref, starts_ref, ends_ref, first_ref, nblocks_ref, *,
                   m: int, num_groups: int, num_local: int, block_m: int, align: int,
                   has_offset: bool):
  _, valid, starts, ends, _, _ = _local_groups(
      sizes_ref, offset_ref, m=m, num_groups=num_groups, num_local=num_local,
      has_offset=has_offset)
  starts = jnp.where(valid, starts, 0)  # groups outside [0, G): (0, 0), as in metadata
  ends = jnp.where(valid, ends, 0)
  first = (starts // align) * align
  nblocks = jnp.where(ends > starts, (ends - first + block_m - 1) // block_m, 0)
  size = starts.shape[0]
  for ref, v in ((starts_ref, starts), (ends_ref, ends), (first_ref, first),
                 (nblocks_ref, nblocks)):
    plgpu.store(ref.at[pl.ds(0, size)], v)


def build_bounds(
    group_sizes: jax.Array,
    group_offset: jax.Array | None,
    *,
    m: int,
    num_local: int,
    block_m: int,
    align: int = 8,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The dW kernel's per-group row blocks in one kernel launch.

  Returns ``metadata.row_blocks``'s ``(starts, ends, first, nblocks)``, each
  padded with zeros to int32[P], P the power of two >= num_local.  Same
  arguments and limits as ``build``.
  """
  sizes, offset, num_groups = _kernel_inputs("build_bounds", group_sizes, group_offset, m,
                                             num_local)
  has_offset = group_offset is not None
  size = _pow2_at_least(num_local)
  kernel = functools.partial(
      _bounds_kernel, m=m, num_groups=num_groups, num_local=num_local, block_m=block_m,
      align=math.gcd(align, block_m), has_offset=has_offset)
  return pl.pallas_call(
      kernel,
      out_shape=tuple(out_struct((size,), jnp.int32, sizes) for _ in range(4)),
      grid=(1,),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="ragdot_group_bounds",
  )(sizes, offset)
