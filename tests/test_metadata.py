"""The tile schedule covers every local row exactly once, within its tile window."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
import strategies as rst
from ragdot import metadata as md


@st.composite
def layouts(draw):
  m = draw(st.integers(1, 80))
  g = draw(st.integers(1, 7))
  sizes = draw(rst.group_sizes(m, g))
  offset, num_local = draw(rst.shard(g))
  block_m = draw(st.sampled_from([1, 3, 8, 16, 64, 128]))
  return m, sizes, offset, num_local, block_m


@settings(max_examples=60)
@given(layouts(), st.sampled_from([0, 0, 8, 16]))
def test_schedule_covers_local_rows_exactly_once(layout, tail_rows):
  # tail_rows: a group's last tile may also hold the rows of a folded tail.
  m, sizes, offset, num_local, block_m = layout
  go = None if offset is None else jnp.int32(offset)
  starts, ends = md.group_bounds(jnp.asarray(sizes), m, go, num_local)
  sched = md.tile_schedule(starts, ends, m, block_m, tail_rows=tail_rows)
  lo, hi = md.local_row_window(jnp.asarray(sizes), m, go, num_local)
  sched = {f: np.asarray(getattr(sched, f)) for f in ("group", "row0", "row_start", "row_end", "num_tiles")}

  ends_np = np.asarray(ends)
  o = offset or 0
  grp = oracle.group_of_rows(sizes, m)
  local = (grp >= o) & (grp < o + num_local) & (grp < len(sizes))
  covered = np.zeros(m, np.int32)
  n_tiles = int(sched["num_tiles"])
  assert n_tiles <= md.max_tiles(m, block_m, num_local) == len(sched["group"])
  for t in range(len(sched["group"])):
    a, b = sched["row_start"][t], sched["row_end"][t]
    if t >= n_tiles:
      assert a == b  # padding tiles own no rows
      continue
    assert a < b, "a real tile must own rows"
    r0 = sched["row0"][t]
    assert r0 % math.gcd(8, block_m) == 0
    assert r0 <= a and b <= r0 + block_m + tail_rows
    # Only a group's last tile may end before its window does (or past it).
    assert b == r0 + block_m or b == ends_np[sched["group"][t]]
    assert np.all(grp[a:b] == o + sched["group"][t])
    covered[a:b] += 1
  np.testing.assert_array_equal(covered, local.astype(np.int32))
  # Never more tiles than block-aligned tiling of the same groups.
  s_np, e_np = np.asarray(starts), ends_np
  aligned = np.where(e_np > s_np, (e_np - 1) // block_m - s_np // block_m + 1, 0).sum()
  assert n_tiles <= aligned
  # The local rows form the window [lo, hi).
  rows = np.nonzero(local)[0]
  if rows.size:
    assert (int(lo), int(hi)) == (rows[0], rows[-1] + 1)
  else:
    assert int(lo) == int(hi)


@settings(max_examples=30)
@given(st.integers(0, 2**31 - 1), st.integers(1, 50))
def test_tiles_ordered_by_group_then_row(seed, m):
  rng = np.random.default_rng(seed)
  sizes = rng.multinomial(m, np.ones(5) / 5).astype(np.int32)
  starts, ends = md.group_bounds(jnp.asarray(sizes), m)
  sched = md.tile_schedule(starts, ends, m, 8)
  n = int(sched.num_tiles)
  key = list(zip(np.asarray(sched.group)[:n], np.asarray(sched.row0)[:n]))
  assert key == sorted(key)


def test_group_ends_saturate_without_overflow():
  sizes = jnp.array([2**30, 2**30, 2**30, 5], jnp.int32)
  np.testing.assert_array_equal(md.global_group_ends(sizes, 100), [100] * 4)


def test_group_ends_past_2_to_the_30_rows_do_not_wrap():
  """Sizes saturate at m without an int32 sum past 2**31 (m = 2**30 + 8 rows: a
  k = 1 call of 2 GiB): every group's bounds stay in [0, m]."""
  m = 2**30 + 8
  for sizes, ends in (([m, m, 5], [m, m, m]), ([2**30] * 3, [2**30, m, m]),
                      ([3, -2, 4, 2**31 - 1], [3, 3, 7, m])):
    gs = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_array_equal(md.global_group_ends(gs, m), ends)
    starts, got_ends = md.group_bounds(gs, m)
    np.testing.assert_array_equal(got_ends, ends)
    np.testing.assert_array_equal(starts, [0] + ends[:-1])
  lo, hi = md.local_row_window(jnp.asarray([m, m, 5], jnp.int32), m)
  assert (int(lo), int(hi)) == (0, m)
  with pytest.raises(ValueError, match="rows"):
    md.global_group_ends(jnp.ones((2,), jnp.int32), md.MAX_ROWS + 1)
