"""The ring on 2-CTA clusters (``MosaicFwdConfig(cluster_pairs=True)``,
``mosaic_fwd_pairs``) on CPU: the pairing of row tiles, the config checks and
the lowering for sm90.

The kernel itself is not run in interpret mode here: JAX 0.11.2's Mosaic GPU
interpreter deadlocks intermittently (about half the runs on a 2-core machine)
once a cluster holds two CTAs, even with the cross-CTA barrier and the
multicast replaced by per-CTA ones, a layout in which the two rings share
nothing.  Its results are checked at real sizes on the H200
(``tests/test_gpu.py::test_cluster_pairs_real_sizes``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sm90_lowering import assert_gmm_lowers
from ragdot import metadata as md
from ragdot.backends import mosaic_fwd as mf
from ragdot.backends import mosaic_fwd_pairs as mp

CFG = mf.MosaicFwdConfig(block_m=128, block_n=256, block_k=64, num_stages=4,
                         num_compute_wgs=2, epilogue_split=2, ring=True, cluster_pairs=True)


def _pairs(sizes, m, offset=None, num_local=None):
  num_local = len(sizes) if num_local is None else num_local
  tiles, scalars = md.flat_schedule(jnp.asarray(sizes, jnp.int32), offset, m, num_local, 128)
  paired, num_pairs = mp.pair_tiles(tiles.reshape(4, -1), scalars[0])
  return np.asarray(tiles).reshape(4, -1)[:, :int(scalars[0])], np.asarray(paired), int(num_pairs)


def test_pair_tiles_groups_then_leftovers():
  # Tiles: g0 x2, g1 x1, g2 x3, g4 x3 (9): pairs (g0, g0), (g2, g2), (g4, g4), then
  # the leftovers g1 | g2's last, g4's last | a no-row copy of it.
  tiles, paired, num_pairs = _pairs([140, 10, 300, 0, 264], 768)
  assert num_pairs == 5
  np.testing.assert_array_equal(paired[0, :10], [0, 0, 2, 2, 4, 4, 1, 2, 4, 4])
  np.testing.assert_array_equal(paired[:, 9], [4, tiles[1, -1], tiles[1, -1], tiles[1, -1]])
  np.testing.assert_array_equal(paired[:, 8], tiles[:, -1])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 400), min_size=1, max_size=9), st.integers(0, 3))
def test_pair_tiles_is_a_pairing_of_the_tiles(sizes, offset_seed):
  offset = offset_seed % len(sizes) if offset_seed else None
  num_local = None if offset is None else max(1, (len(sizes) - offset) // 2)
  m = max(128, sum(sizes) + 5)
  tiles, paired, num_pairs = _pairs(sizes, m, None if offset is None else jnp.int32(offset),
                                    num_local)
  t = tiles.shape[1]
  assert num_pairs == (t + 1) // 2
  body = paired[:, :t]
  # Every tile exactly once ...
  assert sorted(map(tuple, body.T)) == sorted(map(tuple, tiles.T))
  # ... the pad (odd count) stores no rows ...
  if t % 2:
    pad = paired[:, t]
    assert pad[2] == pad[3] == pad[1]
  # ... and at most one pair per group mixes groups: a group's tiles pair up
  # among themselves but for one leftover.
  groups = body[0]
  for grp in set(groups.tolist()):
    mixed = sum(1 for p in range(num_pairs)
                if 2 * p + 1 < t and (groups[2 * p] == grp) != (groups[2 * p + 1] == grp))
    mixed += int(t % 2 == 1 and groups[t - 1] == grp)
    assert mixed == (groups == grp).sum() % 2


@pytest.mark.parametrize("fields", [
    dict(ring=False), dict(tail_rows=16), dict(producer_zeros=True), dict(zero_lead=1),
    dict(num_sms=131)])
def test_config_rejects_what_pairs_cannot_run(fields):
  with pytest.raises(ValueError, match="cluster_pairs"):
    dataclasses.replace(CFG, **fields)


def test_consumers_write_the_zero_rows():
  assert mf.resolve_producer_zeros(CFG, True, jnp.bfloat16, jnp.bfloat16).producer_zeros is False


@pytest.mark.parametrize("m,k,n,g,transpose_rhs,offset", [
    (4096, 2048, 1536, 128, False, False),   # Qwen3-30B gate_up
    (4096, 768, 2048, 128, False, True),     # down, a shard call
    (4096, 2048, 1536, 128, True, False),    # dX
    (1000, 192, 384, 8, True, True),         # ragged m, a partial n tile
])
def test_lowers_for_sm90(m, k, n, g, transpose_rhs, offset):
  assert_gmm_lowers(dataclasses.replace(CFG, num_sms=132), m=m, k=k, n=n, g=g,
                    transpose_rhs=transpose_rhs, local=16 if offset else g, with_offset=offset)
