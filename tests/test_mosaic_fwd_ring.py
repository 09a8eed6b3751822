"""The ring forward / dX kernel (``MosaicFwdConfig(ring=True)``, ``mosaic_fwd_ring``)
in Mosaic GPU interpret mode on CPU: the tail folding and the kernel against the
f32 oracle, the race detector, and its lowering for sm90."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from sm90_lowering import assert_gmm_lowers
import strategies as rst
from ragdot import metadata as md
from ragdot.backends import mosaic_fwd as mf
from ragdot.backends import mosaic_fwd_ring as mr

CFG = mf.MosaicFwdConfig(block_m=128, block_n=256, block_k=64, num_stages=2,
                         num_compute_wgs=2, epilogue_split=2, ring=True, num_sms=3)


def test_schedule_folds_short_last_tiles():
  # Groups: 140 rows (128 + 12: folded), 10 (a lone short tile: kept), 300
  # (128 + 128 + 44: kept at tail_rows 16), 0, 264 (two tiles + 8: folded).
  sizes = jnp.array([140, 10, 300, 0, 264], jnp.int32)
  tiles, scalars = md.flat_schedule(sizes, None, 1024, 5, 128, tail_rows=16)
  plain, plain_scalars = md.flat_schedule(sizes, None, 1024, 5, 128)
  count = int(scalars[0])
  assert count == 7 and int(plain_scalars[0]) == 9
  np.testing.assert_array_equal(scalars[1:], plain_scalars[1:])  # the zero rows' counts
  got = np.asarray(tiles).reshape(4, -1)[:, :count]
  np.testing.assert_array_equal(got[0], [0, 1, 2, 2, 2, 4, 4])
  np.testing.assert_array_equal(got[1], [0, 136, 144, 272, 400, 448, 576])
  np.testing.assert_array_equal(got[2], [0, 140, 150, 272, 400, 450, 576])
  np.testing.assert_array_equal(got[3], [140, 150, 272, 400, 450, 576, 714])


@pytest.mark.parametrize("sizes,m,k,offset,num_local,transpose_rhs,fields", [
    ([140, 10, 300, 0, 264], 768, 128, None, 5, False, dict(tail_rows=16)),  # folded tails, zero rows
    ([140, 10, 300, 0, 264], 768, 128, None, 5, True, dict(tail_rows=16)),   # dX
    ([129, 7, 60, 136, 40], 400, 192, None, 5, False, dict(tail_rows=8)),    # tail of 1 row, m % 128
    ([150, 20, 170, 30], 384, 64, 1, 2, False,  # a group_offset shard, zeros by the consumers
     dict(tail_rows=32, producer_zeros=False)),
    ([140, 10, 300, 0, 264], 768, 128, None, 5, False, {}),                  # the bare ring
    ([150, 20, 200, 398], 768, 64, 2, 1, False, dict(zero_lead=2)),  # 4 items, 2 short CTAs
    ([140, 10, 300, 0, 264], 768, 128, None, 5, True,                        # strips of n tiles
     dict(tail_rows=16, grid_minor_dim=1, grid_tile_width=2)),
    ([129, 7, 60, 136, 40], 400, 128, 1, 3, False,  # snaking row strips, consumers' zeros
     dict(grid_tile_width=3, producer_zeros=False)),
    # the producer writes the zero rows (its zero buffer takes 64-column epilogue chunks)
    ([150, 20, 170, 30], 384, 64, 1, 2, False, dict(producer_zeros=True, epilogue_split=4)),
    ([150, 20, 170, 30], 384, 128, 1, 2, True,
     dict(producer_zeros=True, epilogue_split=4, tail_rows=16)),
    ([150, 20, 100, 498], 768, 64, 2, 1, False, dict(producer_zeros=True)),  # a CTA w/o items
    ([150, 20, 170, 30], 384, 64, 1, 2, False,  # 2 CTAs with one item fewer: a front
     dict(producer_zeros=True, zero_front=3, num_sms=4)),
    ([40, 300, 9, 200, 51], 640, 64, 3, 2, False,  # rows past the groups, a window cut mid-block
     dict(producer_zeros=True, num_sms=2)),
    # automatic: on for this shard call (128-column boxes: 2 stages leave room)
    ([150, 20, 170, 30], 384, 64, 1, 2, True, dict(producer_zeros=None)),
    # 192-column tiles in three 64-column epilogue chunks; a shard with producer zeros
    ([140, 10, 300, 0, 264], 768, 128, None, 5, False, dict(block_n=192, epilogue_split=3)),
    ([150, 20, 170, 30], 384, 64, 1, 2, True,
     dict(block_n=192, epilogue_split=3, producer_zeros=True)),
    # an 8-row zero buffer: every 64-row box in pieces of at most 8 rows
    ([40, 300, 9, 200, 51], 640, 64, 3, 2, True,
     dict(producer_zeros=True, zero_box_rows=8, tail_rows=16)),
])
def test_matches_oracle(sizes, m, k, offset, num_local, transpose_rhs, fields):
  n = 384  # an n tile and a half
  rshape = (num_local, n, k) if transpose_rhs else (num_local, k, n)
  x, w = oracle.random_inputs(jax.random.key(len(sizes) + m), [(m, k), rshape], jnp.bfloat16)
  go = None if offset is None else jnp.int32(offset)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), go, transpose_rhs=transpose_rhs,
               out_dtype=jnp.bfloat16, interpret=True,
               config=dataclasses.replace(CFG, **fields))
  ref = oracle.ref_ragged_dot(x, w, sizes, go, transpose_rhs)
  oracle.assert_close(out, ref, jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, offset, num_local)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
def test_192_column_tiles_with_a_partial_last_tile(transpose_rhs):
  """block_n 192 in three 64-column chunks; n 320: the last n tile holds 128
  columns, so its third chunk lies past n and is skipped."""
  sizes, m, k, n = [140, 10, 300, 0, 264], 768, 128, 320
  rshape = (5, n, k) if transpose_rhs else (5, k, n)
  x, w = oracle.random_inputs(jax.random.key(19), [(m, k), rshape], jnp.bfloat16)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), None, transpose_rhs=transpose_rhs,
               out_dtype=jnp.bfloat16, interpret=True,
               config=dataclasses.replace(CFG, block_n=192, epilogue_split=3))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, None, transpose_rhs),
                      jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, None, 5)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
def test_one_row_stores_past_n(transpose_rhs):
  """n 448 (a last n tile of 192 columns): folded tails of odd row counts end in
  1-row stores of 128 columns that run past n, sent as 64-column pieces."""
  sizes, m, k, n = [239, 250, 242, 133], 864, 64, 448
  rshape = (4, n, k) if transpose_rhs else (4, k, n)
  x, w = oracle.random_inputs(jax.random.key(29), [(m, k), rshape], jnp.bfloat16)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), None, transpose_rhs=transpose_rhs,
               out_dtype=jnp.bfloat16, interpret=True,
               config=dataclasses.replace(CFG, tail_rows=16))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, None, transpose_rhs),
                      jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, None, 4)
  # ... and they lower for sm90
  assert_gmm_lowers(dataclasses.replace(CFG, tail_rows=16, num_sms=132), m=4096, k=1024,
                    n=960, g=32, transpose_rhs=transpose_rhs)


@st.composite
def _near_tiles(draw, num_groups: int) -> np.ndarray:
  """Group sizes of 128 * j + t rows (t in 0..40): tails of every foldable size."""
  j = draw(st.lists(st.integers(0, 2), min_size=num_groups, max_size=num_groups))
  t = draw(st.lists(st.integers(0, 40), min_size=num_groups, max_size=num_groups))
  return np.asarray([128 * a + b for a, b in zip(j, t)], np.int32)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_property_matches_oracle(data):
  """Random layouts (near-multiples of 128 that fit m, and the shared ones), shards,
  tail sizes."""
  g = data.draw(st.integers(2, 3))
  near = data.draw(st.booleans())
  sizes = data.draw(_near_tiles(g) if near else rst.group_sizes(512, g))
  # Near-multiples fit m (plus up to 40 rows past the groups); the shared layouts
  # bring their own under / over / negative cases.
  m = int(8 * -(-(sizes.sum() + data.draw(st.integers(0, 40))) // 8)) if near else 512
  m = max(m, 256)
  offset, num_local = data.draw(rst.shard(g))
  tail_rows = data.draw(st.sampled_from([8, 16, 32]))
  producer_zeros = data.draw(st.booleans())  # (the producer writes the zeros: no lead)
  zero_lead = None if producer_zeros else data.draw(st.sampled_from([None, 0, 1, 3]))
  minor, width = data.draw(st.sampled_from([(0, 1), (1, 1), (1, 2), (0, 2)]))
  transpose_rhs = data.draw(st.booleans())
  k, n = data.draw(st.sampled_from([64, 128])), 384  # one k step or two
  rshape = (num_local, n, k) if transpose_rhs else (num_local, k, n)
  x, w = oracle.random_inputs(jax.random.key(data.draw(st.integers(0, 2**31 - 1))),
                              [(m, k), rshape], jnp.bfloat16)
  go = None if offset is None else jnp.int32(offset)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), go, transpose_rhs=transpose_rhs,
               out_dtype=jnp.bfloat16, interpret=True,
               config=dataclasses.replace(CFG, tail_rows=tail_rows, zero_lead=zero_lead,
                                         grid_minor_dim=minor, grid_tile_width=width,
                                         producer_zeros=producer_zeros))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, go, transpose_rhs), jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, offset, num_local)


@pytest.mark.parametrize("num_ctas,num_work,num_zero,lead", [
    (4, 6, 10, 2),    # two short CTAs take 2 zero items each first
    (4, 8, 10, 2),    # no short CTAs: round-robin
    (5, 1, 3, 5),     # the front takes every zero item
    (132, 240, 1344, 20), (132, 240, 1344, 0), (3, 0, 7, 1), (3, 2, 0, 4),
])
def test_zero_items_partition(num_ctas, num_work, num_zero, lead):
  """Every zero item goes to exactly one CTA; short CTAs take theirs first."""
  got = []
  for cta in range(num_ctas):
    item, count = mr._zero_items(jnp.int32(cta), num_ctas, jnp.int32(num_work),
                                 jnp.int32(num_zero), lead)
    got.append([int(item(jnp.int32(j))) for j in range(int(count))])
  assert sorted(sum(got, [])) == list(range(num_zero))
  rem = num_work % num_ctas
  short = list(range(rem, num_ctas)) if rem else []
  front = min(len(short) * lead, num_zero)
  for cta in short:  # its first items: its share of the front
    mine = [z for z in got[cta] if z < front]
    assert got[cta][:len(mine)] == mine and len(mine) == len(range(cta - rem, front, len(short)))
  for cta in range(rem):
    assert all(z >= front for z in got[cta])


def test_no_races():
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  sizes = [140, 7, 60, 136]
  x, w = oracle.random_inputs(jax.random.key(3), [(384, 128), (4, 128, 256)], jnp.bfloat16)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), None, transpose_rhs=False,
               out_dtype=jnp.bfloat16, interpret=plgpu.InterpretGPUParams(detect_races=True),
               config=dataclasses.replace(CFG, tail_rows=16, num_sms=2))
  jax.block_until_ready(out)
  assert not gpu_interpret.get_races().races_found


@pytest.mark.parametrize("seed,fields", [(4, {}), (6, dict(tail_rows=16, delay_release=0)),
                                         (5, dict(zero_front=4))],
                         ids=["default", "release_each_step", "zero_front"])
def test_no_races_producer_zeros(seed, fields):
  # The producer's zero stores beside its loads and the consumers' stores; also
  # with delay_release=0 (each step's stage released once its wgmmas are done)
  # and folded 16-row tails.
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  sizes = [30, 140, 7, 200]
  x, w = oracle.random_inputs(jax.random.key(seed), [(512, 128), (2, 128, 256)], jnp.bfloat16)
  go = jnp.int32(1)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), go, transpose_rhs=False,
               out_dtype=jnp.bfloat16, interpret=plgpu.InterpretGPUParams(detect_races=True),
               config=dataclasses.replace(CFG, producer_zeros=True, num_sms=2, **fields))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, go, False), jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, 1, 2)
  assert not gpu_interpret.get_races().races_found


@pytest.mark.parametrize("num_ctas,num_zero_work,bn,cn,num_work,front", [
    (132, 1344 * 1, 256, 64, 240, 0), (4, 7, 256, 128, 0, 0), (3, 0, 256, 64, 2, 0),
    (5, 2, 128, 128, 3, 0),
    (132, 1344, 256, 64, 240, 200),  # 24 short CTAs take 200 boxes each first
    (4, 7, 256, 128, 6, 3),          # 2 short CTAs, the front 6 of 28 boxes
    (5, 2, 128, 128, 3, 9),          # the front takes every box
    (4, 7, 256, 128, 8, 3),          # no short CTAs: round-robin
])
def test_producer_zero_boxes_partition(num_ctas, num_zero_work, bn, cn, num_work, front):
  # Every (zero item, half, column chunk) box goes to exactly one CTA; with a
  # front, the CTAs with one compute item fewer hold the front's boxes.
  chunks = bn // cn
  got, fronts = [], {}
  for cta in range(num_ctas):
    box, n_front, n_rest = mr._box_split(jnp.int32(cta), num_ctas,
                                         jnp.int32(num_zero_work * 2 * chunks),
                                         jnp.int32(num_work), front)
    mine = [int(box(jnp.int32(i))) for i in range(int(n_front) + int(n_rest))]
    fronts[cta] = mine[:int(n_front)]
    if not front:  # the lead-0 split of _front_split, without its scalar work
      unit, f0, r0 = mr._front_split(jnp.int32(cta), num_ctas, jnp.int32(num_work),
                                     jnp.int32(num_zero_work * 2 * chunks), 0)
      assert int(f0) == 0 and int(r0) == int(n_rest)
      assert [int(unit(jnp.int32(i))) for i in range(int(r0))] == mine
    got += [tuple(int(v) for v in mr._box_coords(jnp.int32(b), chunks)) for b in mine]
  want = [(z, h, c) for z in range(num_zero_work) for h in range(2) for c in range(chunks)]
  assert sorted(got) == want
  rem = num_work % num_ctas
  num_front = min((num_ctas - rem) * front, len(want)) if rem else 0
  assert sorted(sum(fronts.values(), [])) == list(range(num_front))
  assert all(not fronts[cta] for cta in range(rem))  # the full CTAs take none of it
  # ... and the short ones at most `front` each, evenly (shares differ by <= 1)
  shares = [len(fronts[cta]) for cta in range(rem, num_ctas)] if rem else []
  assert all(n <= front for n in shares) and (not shares or max(shares) - min(shares) <= 1)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("boxes,total", [(82, 64), (41, 32), (7, 64), (0, 32), (5, 0), (64, 64)])
def test_boxes_due_spreads_all_boxes(exact, boxes, total):
  due = [int(mr._boxes_due(jnp.int32(s), jnp.int32(boxes), jnp.int32(total), exact))
         for s in range(total + 1)]
  assert due[0] == 0 and all(a <= b for a, b in zip(due, due[1:]))
  assert due[-1] == (boxes if total else 0)  # no steps: the caller issues them after
  if exact and total:  # evenly: never more than one step's share ahead
    assert all(d <= s * boxes / total + 1e-9 for s, d in enumerate(due))


def test_resolve_producer_zeros():
  auto = dataclasses.replace(CFG, num_stages=4, producer_zeros=None)
  on = mf.resolve_producer_zeros(auto, True, jnp.bfloat16, jnp.bfloat16)
  # A shard call: on, in the 64-column chunks its buffer needs beside 4 stages.
  assert on.producer_zeros is True and on.epilogue_split == 4
  assert on.smem_bytes(jnp.bfloat16, jnp.bfloat16) <= on.smem_budget()
  # No group_offset, or not the ring: off, the rest unchanged.
  assert mf.resolve_producer_zeros(auto, False, jnp.bfloat16, jnp.bfloat16) == (
      dataclasses.replace(auto, producer_zeros=False))
  plain = mf.MosaicFwdConfig(block_m=128, num_compute_wgs=2, producer_zeros=None)
  assert mf.resolve_producer_zeros(plain, True, jnp.bfloat16, jnp.bfloat16).producer_zeros is False
  # Explicit values stay; an explicit zero_lead keeps the consumers' zero items.
  fixed = dataclasses.replace(CFG, producer_zeros=True)
  assert mf.resolve_producer_zeros(fixed, False, jnp.bfloat16, jnp.bfloat16) is fixed
  lead = dataclasses.replace(auto, zero_lead=3)
  assert mf.resolve_producer_zeros(lead, True, jnp.bfloat16, jnp.bfloat16).producer_zeros is False
  # A front of zero boxes rides along on a shard call and is dropped without one.
  front = dataclasses.replace(auto, zero_front=8)
  assert mf.resolve_producer_zeros(front, True, jnp.bfloat16, jnp.bfloat16).zero_front == 8
  assert mf.resolve_producer_zeros(front, False, jnp.bfloat16, jnp.bfloat16).zero_front == 0


def test_config_checks():
  with pytest.raises(ValueError, match="tail_rows"):
    dataclasses.replace(CFG, tail_rows=12)
  with pytest.raises(ValueError, match="tail_rows needs ring"):
    dataclasses.replace(CFG, ring=False, tail_rows=16)
  with pytest.raises(ValueError, match="zero_lead"):
    dataclasses.replace(CFG, ring=False, zero_lead=2)
  with pytest.raises(ValueError, match="ring needs"):
    mf.MosaicFwdConfig(block_m=64, ring=True)
  with pytest.raises(ValueError, match="producer_zeros"):
    dataclasses.replace(CFG, ring=False, producer_zeros=True)
  # The producer's zero buffer is counted: with 4 stages it needs 64-column chunks.
  pz = dataclasses.replace(CFG, num_stages=4, producer_zeros=True)
  assert pz.smem_bytes(jnp.bfloat16, jnp.bfloat16) > pz.smem_budget()
  pz = dataclasses.replace(pz, epilogue_split=4)
  assert pz.smem_bytes(jnp.bfloat16, jnp.bfloat16) <= pz.smem_budget()
  # ... or an 8-row buffer beside 128-column chunks.
  pz8 = dataclasses.replace(CFG, num_stages=4, producer_zeros=True, zero_box_rows=8)
  assert pz8.smem_bytes(jnp.bfloat16, jnp.bfloat16) <= pz8.smem_budget()
  with pytest.raises(ValueError, match="zero_box_rows"):
    dataclasses.replace(CFG, zero_box_rows=12)
  with pytest.raises(ValueError, match="producer_zeros must be"):
    dataclasses.replace(CFG, producer_zeros=8)
  with pytest.raises(ValueError, match="zero_lead does not apply"):
    dataclasses.replace(CFG, producer_zeros=True, zero_lead=2)
  with pytest.raises(ValueError, match="zero_front"):
    dataclasses.replace(CFG, producer_zeros=False, zero_front=2)
  with pytest.raises(ValueError, match="zero_front"):
    dataclasses.replace(CFG, zero_front=-1)
  # The tails' SMEM is counted: 4 stages of 128 x 256 with 16 tail rows need
  # 64-column epilogue chunks to fit.
  four = dataclasses.replace(CFG, num_stages=4, tail_rows=16)
  assert four.smem_bytes(jnp.bfloat16, jnp.bfloat16) > four.smem_budget()
  four = dataclasses.replace(four, epilogue_split=4)
  assert four.smem_bytes(jnp.bfloat16, jnp.bfloat16) <= four.smem_budget()
  # Folded tails store bf16/f16 only: fitting for an f32 output drops them, and an
  # explicit f32 call with tails is refused.
  assert mf.fit_config(four, jnp.bfloat16, jnp.float32).tail_rows == 0
  x, w = oracle.random_inputs(jax.random.key(1), [(256, 128), (2, 128, 256)], jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="tail_rows"):
    mf.gmm(x, w, jnp.array([100, 150], jnp.int32), None, transpose_rhs=False,
           out_dtype=jnp.float32, interpret=True, config=dataclasses.replace(CFG, tail_rows=16))


def test_f32_output_bare_ring():
  sizes = [140, 10, 300, 0, 264]
  x, w = oracle.random_inputs(jax.random.key(9), [(768, 128), (5, 128, 256)], jnp.bfloat16)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), None, transpose_rhs=False,
               out_dtype=jnp.float32, interpret=True,
               config=dataclasses.replace(CFG, epilogue_split=4))
  assert out.dtype == jnp.float32
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, None, False), jnp.float32)
  oracle.assert_zero_rows(out, sizes, None, 5)


def test_small_m_falls_back():
  # m < 128 + tail_rows: the default (non-ring) config runs instead.
  sizes = [50, 80]
  x, w = oracle.random_inputs(jax.random.key(5), [(136, 64), (2, 64, 256)], jnp.bfloat16)
  out = mf.gmm(x, w, jnp.asarray(sizes, jnp.int32), None, transpose_rhs=False,
               out_dtype=jnp.bfloat16, interpret=True,
               config=dataclasses.replace(CFG, tail_rows=16))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes, None, False), jnp.bfloat16)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
@pytest.mark.parametrize("tail_rows,stages,split,width,pz,front", [
    (16, 4, 4, 1, False, 0), (0, 4, 2, 1, False, 0), (0, 4, 2, 4, False, 0),
    (0, 4, 4, 1, True, 0), (16, 3, 4, 1, True, 0), (0, 4, 2, 1, 8, 0), (0, 5, 3, 1, False, 0),
    (0, 4, 4, 1, True, 64)])
def test_lowers_for_sm90(transpose_rhs, tail_rows, stages, split, width, pz, front):
  m, k, n, g = 4096, 2048, 1536, 128
  bn = 192 if split == 3 else CFG.block_n  # three 64-column chunks of 192-column tiles
  cfg = dataclasses.replace(CFG, block_n=bn, num_stages=stages, epilogue_split=split,
                            tail_rows=tail_rows,
                            num_sms=132, grid_minor_dim=int(width > 1), grid_tile_width=width,
                            producer_zeros=bool(pz), zero_box_rows=64 if pz is True else pz or 64,
                            zero_front=front)
  # producer zeros: a shard call of 16 local groups
  assert_gmm_lowers(cfg, m=m, k=k, n=n, g=g, transpose_rhs=transpose_rhs,
                    local=16 if pz else g, with_offset=bool(pz))
