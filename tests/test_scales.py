"""fp8 expert weights with block scales (``rhs_scale``): a scaled call equals
the call on the dequantized weights (``ragdot.scales``), through XLA and the
Mosaic W8A16 kernel (interpret mode: it scales each widened slice), in both
weight layouts, with shards; its gradients, JVP and vmap; bad scales raise
naming ``rhs_scale``; the scaled kernel lowers for sm90."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import oracle
import ragdot
from ragdot import dispatch, scales
from ragdot.backends import mosaic_fwd as mf

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
H200 = dispatch.Device("gpu", "NVIDIA H200", "9.0")
NK = lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
SWAP = mf.MosaicFwdConfig(block_m=128, block_n=128, block_k=64, num_stages=2, num_compute_wgs=2,
                          ring=True, swap=True, num_sms=3, producer_zeros=False)


def _case(m, k, n, local, nk, block, x_dtype=jnp.bfloat16, w_dtype=E4M3, seed=0):
  """Rows, fp8 weights ([g, n, k] when nk) and f32 scales of (bk, bn) blocks."""
  bk, bn = block
  kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
  rshape = (local, n, k) if nk else (local, k, n)
  sshape = (local, n // bn, k // bk) if nk else (local, k // bk, n // bn)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(x_dtype)
  w = jax.random.normal(kw, rshape, jnp.float32).astype(w_dtype)
  s = jax.random.uniform(ks, sshape, jnp.float32, 0.25, 2.0)
  return x, w, s


def _call(x, w, gs, nk, **kw):
  if nk:
    return ragdot.ragged_dot_general(x, w, gs, NK, **kw)
  return ragdot.ragged_dot(x, w, gs, **kw)


def _bits(a):
  return np.asarray(a.astype(jnp.float32))


def test_dequantize_and_kernel_layout_against_numpy():
  w = np.arange(2 * 4 * 6, dtype=np.float32).reshape(2, 4, 6) / 8
  s = np.array([[[1, 2, 3], [4, 5, 6]], [[7, 8, 9], [10, 11, 12]]], np.float32)  # 2 x 2 blocks
  want = w * np.repeat(np.repeat(s, 2, axis=1), 2, axis=2)
  got = scales.dequantize(jnp.asarray(w, E4M3), jnp.asarray(s), jnp.float32)
  np.testing.assert_array_equal(got, np.asarray(jnp.asarray(w, E4M3), np.float32)
                                * np.repeat(np.repeat(s, 2, axis=1), 2, axis=2))
  assert want.shape == got.shape
  # the kernels' layout: [g, k // bk, n], one scale a column; from [g, n, k] too
  np.testing.assert_array_equal(scales.kernel_scales(jnp.asarray(s), (2, 4, 6), False),
                                np.repeat(s, 2, axis=2))
  st = np.swapaxes(s, 1, 2)  # the same scales for the weights laid out [g, n, k]
  np.testing.assert_array_equal(scales.kernel_scales(jnp.asarray(st), (2, 6, 4), True),
                                np.repeat(s, 2, axis=2))


def test_blocks_reads_either_layout_and_names_rhs_scale():
  """``scales.blocks``: (contracting rows, columns) of a block for rhs [g, k, n]
  and [g, n, k] alike; ValueError naming ``rhs_scale`` for a shape or dtype
  that is none of rhs's block scales."""
  s = jnp.ones((3, 4, 6), jnp.float32)  # [g, k // t, n // c] for rhs [3, 512, 384]
  assert scales.blocks(s, (3, 512, 384), False) == (128, 64)
  assert scales.blocks(jnp.swapaxes(s, 1, 2), (3, 384, 512), True) == (128, 64)
  assert scales.blocks(s.astype(jnp.bfloat16), (3, 4, 6), False) == (1, 1)
  for bad, rhs_shape in [(s, (2, 512, 384)), (s, (3, 512, 380)), (s[:, :0], (3, 512, 384)),
                         (s[0], (3, 512, 384)), (s, (3, 384, 512)),
                         (s.astype(jnp.int32), (3, 512, 384)), (s.astype(E4M3), (3, 512, 384))]:
    with pytest.raises(ValueError, match="rhs_scale must be"):
      scales.blocks(bad, rhs_shape, False)


@pytest.mark.parametrize("nk,block,offset,x_dtype,w_dtype", [
    (False, (64, 64), None, jnp.bfloat16, E4M3),
    (True, (128, 1), None, jnp.float16, E5M2),     # per column and k block
    (False, (128, 128), 1, jnp.bfloat16, E4M3),    # one scale per expert, a shard
    (True, (32, 64), None, jnp.float32, E4M3),     # f32 rows: dequantized to f32
])
def test_xla_call_equals_the_call_on_dequantized_weights(nk, block, offset, x_dtype, w_dtype):
  m, k, n, sizes = 200, 128, 128, [90, 0, 70, 30]
  local = 4 if offset is None else 2
  x, w, s = _case(m, k, n, local, nk, block, x_dtype, w_dtype)
  gs, go = jnp.asarray(sizes, jnp.int32), None if offset is None else jnp.int32(offset)
  got = _call(x, w, gs, nk, rhs_scale=s, group_offset=go, implementation="xla")
  deq = scales.dequantize(w, s, x_dtype)
  want = _call(x, deq, gs, nk, group_offset=go, implementation="xla")
  assert got.dtype == x_dtype
  np.testing.assert_array_equal(_bits(got), _bits(want))
  oracle.assert_close(got, oracle.ref_ragged_dot(x, deq, sizes, offset, nk), x_dtype)
  oracle.assert_zero_rows(got, sizes, offset, local)


@pytest.mark.parametrize("nk,block,offset,staging,s_dtype", [
    (True, (128, 1), None, 2, jnp.float32),  # [g, n, k]: per column, a row per k step
    (False, (64, 64), 1, 1, jnp.float32),  # [g, k, n] as stored, one buffer, a shard: per block
    # one block over all 192 columns and k (the second tile's second consumer past n)
    (False, (256, 192), None, 2, jnp.float32),
    (True, (128, 64), 1, 1, jnp.bfloat16),  # [g, n, k] per block, a shard, bf16 scales
    (False, (128, 32), None, 2, jnp.float16),  # 32-column blocks: laid out per column
])
def test_kernel_equals_the_kernel_on_dequantized_weights(monkeypatch, nk, block, offset,
                                                          staging, s_dtype):
  """The W8A16 kernel scaling each widened slice (by one scale per 64-column
  slice where the blocks span such slices, else per column): bitwise the same
  kernel (its config) on the dequantized bf16 weights; a folded tail, an
  empty group, rows past the groups."""
  m, k, n, sizes = 1280, 256, 192, [300, 10, 520, 0, 280]
  local = 5 if offset is None else 3
  x, w, s = _case(m, k, n, local, nk, block, seed=7)
  s = s.astype(s_dtype)
  gs, go = jnp.asarray(sizes, jnp.int32), None if offset is None else jnp.int32(offset)
  cfg = dataclasses.replace(SWAP, tail_rows=64, widen_staging=staging)
  from ragdot.backends import mosaic_fwd_swap
  seen = []
  swap_gmm = mosaic_fwd_swap.gmm

  def spy(*args, **kw):  # the form of the scales the swap kernel gets
    seen.append((kw["scale_block"], kw["rhs_scale"].shape))
    return swap_gmm(*args, **kw)

  monkeypatch.setattr(mosaic_fwd_swap, "gmm", spy)
  got = mf.gmm(x, w, gs, go, transpose_rhs=nk, out_dtype=jnp.bfloat16, interpret=True,
               config=cfg, rhs_scale=s)
  cols = n // (n // block[1])
  # 64-column multiples: rhs's layout as given; else per column, [g, k // t, n]
  want_form = (((block[0], cols), s.shape) if cols % 64 == 0
               else ((block[0], 1), (local, k // block[0], n)))
  assert seen == [want_form], seen
  monkeypatch.undo()
  run = mf.weight_only_config(cfg, m, len(sizes), k, nk, block[0])
  assert run.block_k == 64 and run.widen_staging == staging
  deq = scales.dequantize(w, s, jnp.bfloat16)
  want = mf.gmm(x, deq, gs, go, transpose_rhs=nk, out_dtype=jnp.bfloat16, interpret=True,
                config=run)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  oracle.assert_close(got, oracle.ref_ragged_dot(x, deq, sizes, offset, nk), jnp.bfloat16)
  oracle.assert_zero_rows(got, sizes, offset, local)


def test_stages_hold_only_the_scales_the_kernel_keeps(monkeypatch):
  """A stage holds one f32 scale per consumer for blocks of whole 64-column
  slices, a row of per-column ones otherwise: a config 48 bytes under the SMEM
  budget with the first keeps its stages (and the kernel takes it), one stage
  less with per-column scales (its 4 KB would not fit)."""
  assert mf.stage_scales(128, 128) == mf.stage_scales(128, 64) == 2
  assert mf.stage_scales(128, 32) == mf.stage_scales(128, 1) == mf.stage_scales(128, None) == 128
  base = mf.weight_only_config(None, 512, 128, 2048, False)
  cfg = dataclasses.replace(base, swap_rows=32, tail_rows=0, num_stages=6, widen_staging=2,
                            delay_release=1, block_k=128)
  e4m3 = jnp.float8_e4m3fn
  assert cfg.smem_bytes(jnp.bfloat16, jnp.bfloat16, e4m3, 2) <= cfg.smem_budget()
  assert cfg.smem_bytes(jnp.bfloat16, jnp.bfloat16, e4m3, 128) > cfg.smem_budget()
  assert mf.weight_only_config(cfg, 512, 128, 2048, False, 128, 128) == cfg
  assert mf.weight_only_config(cfg, 512, 128, 2048, False, 128, 1).num_stages == 5
  from ragdot.backends import mosaic_fwd_swap
  seen = []
  monkeypatch.setattr(mosaic_fwd_swap, "gmm", lambda *a, **kw: seen.append(kw["config"]))
  x, w, s = _case(512, 2048, 128, 4, False, (128, 128))
  mf.gmm(x, w, jnp.asarray([128] * 4, jnp.int32), None, transpose_rhs=False,
         out_dtype=jnp.bfloat16, config=cfg, rhs_scale=s)
  assert seen == [cfg], seen


def test_kernel_refuses_scale_blocks_not_in_whole_k_steps():
  x, w, s = _case(128, 128, 64, 2, True, (32, 1))
  gs = jnp.array([60, 40], jnp.int32)
  with pytest.raises(NotImplementedError, match="multiple of 64"):
    mf.gmm(x, w, gs, None, transpose_rhs=True, out_dtype=jnp.bfloat16, interpret=True,
           config=SWAP, rhs_scale=s)
  with pytest.raises(NotImplementedError, match="fp8 weights"):
    mf.gmm(x, w.astype(jnp.bfloat16), gs, None, transpose_rhs=True, out_dtype=jnp.bfloat16,
           interpret=True, config=SWAP, rhs_scale=s)


@pytest.mark.parametrize("kernel", ["mosaic", "triton"])
def test_kernels_raise_value_error_for_a_malformed_scale(kernel):
  """Both kernels: a scale that is no block scale of rhs (in its layout) is a
  ValueError (a caller's bug), bf16 weights with scales a NotImplementedError
  (a call the dispatcher routes elsewhere)."""
  from ragdot.backends import triton as tb
  x, w, s = _case(128, 128, 64, 2, True, (64, 1))  # rhs [2, 64, 128], scales [2, 64, 2]
  gs = jnp.array([60, 40], jnp.int32)
  good = s
  call = (functools.partial(mf.gmm, config=SWAP) if kernel == "mosaic"
          else functools.partial(tb.gmm, precision=None))
  run = lambda w, sc: call(x, w, gs, None, transpose_rhs=True, out_dtype=jnp.bfloat16,
                           interpret=True, rhs_scale=sc)
  for bad in (good[:, :48], good[:1], good[:, :0], good[..., None], good[:, :, :0],
              good.astype(jnp.int32), good.astype(E4M3)):
    with pytest.raises(ValueError, match="rhs_scale must be"):
      run(w, bad)
  with pytest.raises(NotImplementedError, match="fp8 weights"):
    run(w.astype(jnp.bfloat16), good)


def test_mosaic_call_scales_in_the_kernel_and_falls_back_where_it_refuses(monkeypatch):
  """implementation="mosaic": the kernel takes 64-row scale blocks (one call
  with rhs_scale), and 32-row ones run on dequantized weights; each equals
  bitwise the kernel that ran on the dequantized weights: the scaled
  kernel's config (the sums' order of its swap tiles), or the plain call."""
  import ragdot.backends.mosaic  # pylint: disable=unused-import  (its gmm bound before the spy)
  calls = []
  gmm = mf.gmm

  def spy(*args, **kw):  # each call with scales: whether the kernel ran or refused
    scaled = kw.get("rhs_scale") is not None
    try:
      out = gmm(*args, **kw)
    except NotImplementedError:
      calls.append((scaled, "refused", None))
      raise
    calls.append((scaled, "ran", kw["config"]))
    return out

  monkeypatch.setattr(mf, "gmm", spy)
  m, k, n, sizes = 256, 128, 128, [100, 0, 120]
  gs = jnp.asarray(sizes, jnp.int32)
  for block, outcome in [((64, 64), "ran"), ((32, 64), "refused")]:
    calls.clear()
    x, w, s = _case(m, k, n, 3, False, block, seed=3)
    got = ragdot.ragged_dot(x, w, gs, rhs_scale=s, implementation="mosaic")
    assert [c[:2] for c in calls] == [(True, outcome)], calls
    deq = scales.dequantize(w, s, jnp.bfloat16)
    if outcome == "ran":  # (the plain call's own tiles may sum in another order)
      run = mf.weight_only_config(calls[0][2], m, len(sizes), k, False, block[0])
      want = gmm(x, deq, gs, None, transpose_rhs=False, out_dtype=jnp.bfloat16,
                 interpret=True, config=run)
    else:
      want = ragdot.ragged_dot(x, deq, gs, implementation="mosaic")
    np.testing.assert_array_equal(_bits(got), _bits(want))
    oracle.assert_close(got, oracle.ref_ragged_dot(x, deq, sizes, None, False), jnp.bfloat16)


def test_gradients_equal_those_through_the_dequantized_weights():
  """d/dx, d/dw (fp8) and d/dscale: those of the same loss through
  ``scales.dequantize`` and a plain call."""
  m, k, n, sizes = 200, 128, 128, [90, 0, 70, 30]
  x, w, s = _case(m, k, n, 4, False, (64, 32))
  gs = jnp.asarray(sizes, jnp.int32)
  c = jax.random.normal(jax.random.key(9), (m, n), jnp.float32)

  def loss(f):
    return lambda x, w, s: jnp.sum(f(x, w, s).astype(jnp.float32) * c)

  scaled = lambda x, w, s: ragdot.ragged_dot(x, w, gs, rhs_scale=s, implementation="xla")
  plain = lambda x, w, s: ragdot.ragged_dot(x, scales.dequantize(w, s, x.dtype), gs,
                                            implementation="xla")
  got = jax.jit(jax.grad(loss(scaled), (0, 1, 2)))(x, w, s)
  want = jax.jit(jax.grad(loss(plain), (0, 1, 2)))(x, w, s)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(_bits(a), _bits(b))
  assert float(jnp.max(jnp.abs(got[2]))) > 0  # the scales' gradient is not zero


def test_dx_runs_the_scaled_kernel_transposed(monkeypatch):
  """Under jax.grad with implementation="mosaic" the rows' cotangent runs the
  scaled kernel on the weights as stored, transposed (no dequantized copy):
  equal to the dX of the same kernel on the dequantized weights."""
  import ragdot.backends.mosaic  # pylint: disable=unused-import  (its gmm bound before the spy)
  calls = []
  gmm = mf.gmm

  def spy(*args, **kw):
    calls.append((kw.get("rhs_scale") is not None, kw["transpose_rhs"]))
    return gmm(*args, **kw)

  monkeypatch.setattr(mf, "gmm", spy)
  m, k, n, sizes = 256, 128, 128, [100, 0, 120]
  x, w, s = _case(m, k, n, 3, False, (64, 64), seed=4)
  gs = jnp.asarray(sizes, jnp.int32)
  c = jax.random.normal(jax.random.key(2), (m, n), jnp.float32)
  loss = lambda x: jnp.sum(ragdot.ragged_dot(x, w, gs, rhs_scale=s, implementation="mosaic")
                           .astype(jnp.float32) * c)
  got = jax.grad(loss)(x)
  assert (True, True) in calls, calls
  deq = scales.dequantize(w, s, jnp.bfloat16)
  want = jax.grad(lambda x: jnp.sum(ragdot.ragged_dot(x, deq, gs, implementation="mosaic")
                                    .astype(jnp.float32) * c))(x)
  oracle.assert_close(got, want, jnp.bfloat16)


@pytest.mark.parametrize("nk", [False, True])
def test_linear_transpose_in_the_weights_or_the_scales(nk):
  """The op is linear in the fp8 weights (scales fixed) and in the scales
  (weights fixed): jax.linear_transpose of either equals that of the same call
  on the dequantized weights, over a middle shard with rows past the sum."""
  m, k, n, sizes = 96, 64, 64, [10, 30, 0, 25, 12]
  x, w, s = _case(m, k, n, 3, nk, (32, 32), seed=3)
  gs = jnp.asarray(sizes, jnp.int32)

  def call(w_, **kw):
    if nk:
      return ragdot.ragged_dot_general(x, w_, gs, NK, group_offset=1, implementation="xla", **kw)
    return ragdot.ragged_dot(x, w_, gs, group_offset=1, implementation="xla", **kw)

  ct = jax.random.normal(jax.random.key(5), (m, n), jnp.bfloat16)
  in_scales = lambda s_: call(w, rhs_scale=s_)
  via_deq = lambda s_: call(scales.dequantize(w, s_, x.dtype))
  got = jax.jit(jax.linear_transpose(in_scales, s))(ct)[0]
  want = jax.jit(jax.linear_transpose(via_deq, s))(ct)[0]
  assert got.dtype == want.dtype and float(jnp.max(jnp.abs(got))) > 0
  oracle.assert_close(got, want, jnp.bfloat16)
  in_weights = lambda w_: call(w_, rhs_scale=s)
  via_deq = lambda w_: call(scales.dequantize(w_, s, x.dtype))
  got = jax.linear_transpose(in_weights, w)(ct)[0]
  want = jax.linear_transpose(via_deq, w)(ct)[0]
  assert got.dtype == w.dtype
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_jvp_and_vmap():
  m, k, n, sizes = 128, 64, 64, [50, 60]
  x, w, s = _case(m, k, n, 2, True, (64, 1))
  gs = jnp.asarray(sizes, jnp.int32)
  f = lambda x, s: ragdot.ragged_dot_general(x, w, gs, NK, rhs_scale=s, implementation="xla")
  deq = lambda s: scales.dequantize(w, s, jnp.bfloat16)
  g = lambda x, s: ragdot.ragged_dot_general(x, deq(s), gs, NK, implementation="xla")
  tx, ts = jnp.ones_like(x), jnp.full_like(s, 0.5)
  for a, b in zip(jax.jvp(f, (x, s), (tx, ts)), jax.jvp(g, (x, s), (tx, ts))):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  xs = jnp.stack([x, -x])
  got = jax.vmap(f, in_axes=(0, None))(xs, s)
  np.testing.assert_array_equal(_bits(got[1]), _bits(f(-x, s)))


@pytest.mark.parametrize("bad,err,match", [
    (dict(w_dtype=jnp.bfloat16), TypeError, "8-bit float weights"),
    (dict(shape=(3, 2, 2)), ValueError, "rhs_scale's shape"),
    (dict(shape=(2, 3, 2)), ValueError, "rhs_scale's shape"),
    (dict(shape=(2, 2)), ValueError, "rank 3"),
    (dict(s_dtype=jnp.int32), TypeError, "rhs_scale must be f32"),
])
def test_bad_scales_raise_naming_rhs_scale(bad, err, match):
  x = jnp.ones((8, 64), jnp.bfloat16)
  w = jnp.ones((2, 64, 64), bad.get("w_dtype", E4M3))
  s = jnp.ones(bad.get("shape", (2, 2, 2)), bad.get("s_dtype", jnp.float32))
  with pytest.raises(err, match=match) as e:
    ragdot.ragged_dot(x, w, jnp.array([4, 4], jnp.int32), rhs_scale=s)
  assert "rhs_scale" in str(e.value)


def test_rhs_scale_in_the_ragged_contracting_mode_raises():
  dn = lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])
  with pytest.raises(ValueError, match="rhs_scale applies to the forward modes"):
    ragdot.ragged_dot_general(jnp.ones((8, 4)), jnp.ones((8, 4)), jnp.array([8], jnp.int32),
                              dn, rhs_scale=jnp.ones((1, 1, 1)))


@pytest.mark.parametrize("m,nk,block,staging", [
    (32768, True, (128, 128), None), (512, False, (128, 128), None),
    (8, True, (2048, 1), None), (512, False, (2048, 1), None),
    (512, True, (2048, 1), 2), (512, True, (128, 128), 1)])
def test_scaled_kernel_lowers_for_sm90_with_the_h200_choice(m, nk, block, staging):
  """The dispatcher's W8A16 config on an H200 with scales lowers for sm90
  (registers for [g, n, k], SMEM buffers for [g, k, n]; one scale a consumer
  and stage for 128-column blocks, a row of per-column scales for one-column
  ones, in either register layout); ``staging``: the config with that many
  SMEM buffers instead ([g, n, k] staged)."""
  import functools
  k, n, g = 2048, 1536, 128
  c = dispatch.choose("gmm", None, dtype=jnp.bfloat16, rhs_dtype=E4M3, out_dtype=jnp.bfloat16,
                      m=m, k=k, n=n, g=g, num_groups=g, transpose_rhs=nk, device=H200)
  config = c.config
  if staging:
    config = mf.weight_only_config(dataclasses.replace(config, widen_staging=staging), m, g, k,
                                   nk)
    assert config.widen_staging == staging
  f = jax.jit(functools.partial(mf.gmm, transpose_rhs=nk, out_dtype=jnp.bfloat16,
                                config=config))
  rshape = (g, n, k) if nk else (g, k, n)
  args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct(rshape, E4M3),
          jax.ShapeDtypeStruct((g,), jnp.int32), None)
  sshape = (g, n // block[1], k // block[0]) if nk else (g, k // block[0], n // block[1])
  scale = jax.ShapeDtypeStruct(sshape, jnp.float32)
  lowered = f.trace(*args, rhs_scale=scale).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def test_quantize_round_trips_within_the_dtype():
  """``scales.quantize``: one scale per block (its largest magnitude over e4m3's
  448; 1 for an all-zero block), weights within e4m3's relative step of the
  originals after ``dequantize``; a block that does not divide raises."""
  w = jax.random.normal(jax.random.key(0), (2, 64, 96), jnp.float32)
  w = w.at[1, :32, :48].set(0.0)
  q, s = scales.quantize(w, (32, 48))
  assert q.dtype == E4M3 and s.shape == (2, 2, 2)
  np.testing.assert_allclose(s[0, 0, 0], jnp.abs(w[0, :32, :48]).max() / 448, rtol=1e-6)
  assert float(s[1, 0, 0]) == 1.0
  back = scales.dequantize(q, s, jnp.float32)
  np.testing.assert_allclose(back, w, rtol=2 ** -3, atol=float(s.max()) * 2 ** -9)
  with pytest.raises(ValueError, match="must divide"):
    scales.quantize(w, (48, 48))


@pytest.mark.parametrize("dtype", [E4M3, jnp.float8_e5m2])
def test_quantize_keeps_blocks_of_tiny_weights_finite(dtype):
  """A block whose largest weight over the fp8 maximum is below f32's normals
  (1e-36 / 448) still gets a nonzero scale: finite fp8 values that
  dequantize close to the weights, and a finite call."""
  w = jnp.full((1, 32, 32), 1e-36, jnp.float32).at[0, 0, 0].set(-3e-37)
  q, s = scales.quantize(w, (32, 32), dtype)
  assert float(s[0, 0, 0]) > 0 and bool(jnp.all(jnp.isfinite(q.astype(jnp.float32))))
  np.testing.assert_allclose(scales.dequantize(q, s, jnp.float32), w, rtol=2 ** -2)
  x = jnp.ones((8, 32), jnp.float32)
  out = ragdot.ragged_dot(x, q, jnp.array([8], jnp.int32), rhs_scale=s, implementation="xla")
  assert bool(jnp.all(jnp.isfinite(out))) and float(jnp.max(jnp.abs(out))) > 0


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("rspec", [P("ep"), P(None, None, "ep")])
def test_split_weights_and_scales_match_the_unsplit_call(axis_type, rspec):
  """fp8 weights and their scales split over a mesh axis (experts, or output
  columns), rows over another: under explicit axes (the per-shard ops) and
  automatic ones (the partitioned op), the same result as the unsplit call."""
  from split_cases import mesh as split_mesh
  m, k, n, sizes = 256, 64, 32, [40, 0, 33, 50, 7, 60, 20, 30]
  x, w, s = _case(m, k, n, 8, False, (32, 8))
  gs = jnp.asarray(sizes, jnp.int32)
  call = lambda x, w, s: ragdot.ragged_dot(x, w, gs, rhs_scale=s, implementation="xla")
  want = call(x, w, s)
  with jax.set_mesh(split_mesh(getattr(jax.sharding.AxisType, axis_type))):
    xs = jax.device_put(x, P("dp"))
    ws, ss = jax.device_put(w, rspec), jax.device_put(s, rspec)
    got = jax.jit(call)(xs, ws, ss)
  np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("wspec", [P("ep"), P(None, None, "ep"), P(None, "dp", "ep")])
def test_quantize_weights_split_over_a_mesh(axis_type, wspec):
  """``scales.quantize`` of split weights (the MoE block's experts under
  ``jax.make_mesh``'s default explicit axes): the unsplit values, q split as the
  weights, the scales along the dims the split divides."""
  from split_cases import mesh as split_mesh
  w = jax.random.normal(jax.random.key(4), (8, 64, 32), jnp.float32)
  want_q, want_s = scales.quantize(w, (32, 32))
  with jax.set_mesh(split_mesh(getattr(jax.sharding.AxisType, axis_type))):
    q, s = scales.quantize(jax.device_put(w, wspec), (32, 32))  # eager, as the MoE block calls it
  np.testing.assert_array_equal(_bits(q), _bits(want_q))
  np.testing.assert_array_equal(s, want_s)
  if axis_type == "Explicit":
    padded = lambda spec: tuple(spec) + (None,) * (3 - len(spec))
    assert padded(jax.typeof(q).sharding.spec) == padded(wspec)
    # scales [8, 2, 1]: experts split as the weights; n's one block replicated
    assert padded(jax.typeof(s).sharding.spec) == (padded(wspec)[0], padded(wspec)[1], None)


# (rhs [g, n, k], group_offset, specs of lhs, rhs and scale, scale blocks (k rows, n
# columns), the lhs, rhs and scale shapes each shard's kernel gets, the output's spec):
# experts, columns along whole blocks, the contraction (partials summed), columns whose
# scale's two blocks cannot follow a split in 4 (the weights gathered along n; the result
# split as the plain call's), and the [g, n, k] layout with a group_offset (4 local experts)
_SPLIT_SCALED = {
    "experts": (False, None, P("dp"), P("ep"), P("ep"), (64, 8), (128, 128), (2, 128, 32),
                (2, 2, 4), (("dp",), None)),
    "columns": (False, None, P("dp"), P(None, None, "ep"), P(None, None, "ep"), (64, 8),
                (128, 128), (8, 128, 8), (8, 2, 1), (("dp",), ("ep",))),
    "contraction": (False, None, P("ep", "dp"), P(None, "dp"), P(None, "dp"), (64, 32),
                    (64, 64), (8, 64, 32), (8, 1, 1), (("ep",), None)),
    "gathered": (False, None, P("dp"), P(None, None, "ep"), P(), (64, 16), (128, 128),
                 (8, 128, 32), (8, 2, 2), (("dp",), ("ep",))),
    "nk experts": (True, 2, P("dp"), P("ep"), P("ep"), (64, 8), (128, 128), (1, 32, 128),
                   (1, 4, 2), (("dp",), None)),
    "nk columns": (True, 2, P("dp"), P(None, "ep"), P(None, "ep"), (64, 8), (128, 128),
                   (4, 8, 128), (4, 1, 2), (("dp",), ("ep",))),
}


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("case", list(_SPLIT_SCALED))
def test_split_calls_run_the_fused_kernel_per_shard(monkeypatch, axis_type, case):
  """Weights and scales split over mesh axes, rows over another: the fused
  W8A16 kernel (Triton, interpret mode) runs on each shard's rows, weights and
  scales (not on weights dequantized by XLA), and the result equals the
  unsplit call's (bitwise, but for the contraction's summed partials); rhs's k
  or n split only along whole scale blocks."""
  nk, offset, lspec, rspec, sspec, block, local_x, local_w, local_s, ospec = _SPLIT_SCALED[case]
  from ragdot.backends import triton as tb
  from split_cases import mesh as split_mesh
  seen = []
  gmm = tb.gmm

  def spy(lhs, rhs, *args, **kw):  # the operands each kernel call gets
    scale = kw.get("rhs_scale")
    seen.append((tuple(lhs.shape), tuple(rhs.shape),
                 None if scale is None else tuple(scale.shape)))
    return gmm(lhs, rhs, *args, **kw)

  monkeypatch.setattr(tb, "gmm", spy)
  m, k, n, sizes = 256, 128, 32, [40, 0, 33, 50, 7, 60, 20, 30]
  local = 8 if offset is None else 4
  x, w, s = _case(m, k, n, local, nk, block, seed=11)
  gs, go = jnp.asarray(sizes, jnp.int32), None if offset is None else jnp.int32(offset)
  call = lambda x, w, s: _call(x, w, gs, nk, rhs_scale=s, group_offset=go,
                               implementation="triton")
  want = call(x, w, s)
  assert seen == [((m, k), w.shape, s.shape)], seen
  seen.clear()
  with jax.set_mesh(split_mesh(getattr(jax.sharding.AxisType, axis_type))):
    args = [jax.device_put(a, spec) for a, spec in zip((x, w, s), (lspec, rspec, sspec))]
    got = jax.jit(call)(*args)
  # (automatic axes: the partitioner traces the call on the whole operands first)
  assert (local_x, local_w, local_s) in seen and all(c[2] is not None for c in seen), seen
  if axis_type == "Explicit":  # (automatic axes: XLA may reshard the result after the call)
    assert set(seen) == {(local_x, local_w, local_s)}, seen
    spec = tuple(got.sharding.spec) + (None,) * (2 - len(got.sharding.spec))
    assert tuple(None if e is None else (e,) if isinstance(e, str) else tuple(e)
                 for e in spec) == ospec
  if case == "contraction":  # (partial sums rounded to bf16, then added)
    np.testing.assert_allclose(_bits(got), _bits(want), atol=2e-2 * np.abs(_bits(want)).max())
  else:
    np.testing.assert_array_equal(_bits(got), _bits(want))
  oracle.assert_zero_rows(got, sizes, offset, local)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_split_calls_gradient_in_rows_runs_the_fused_kernel_per_shard(monkeypatch, axis_type):
  """Frozen fp8 weights split over experts, rows over another axis: the
  rows' gradient (dX) runs the fused kernel transposed on each shard's
  weights and scales, and equals the unsplit call's."""
  from ragdot.backends import triton as tb
  from split_cases import mesh as split_mesh
  seen = []
  gmm = tb.gmm

  def spy(lhs, rhs, *args, **kw):
    seen.append((tuple(rhs.shape), kw["transpose_rhs"], kw.get("rhs_scale") is not None))
    return gmm(lhs, rhs, *args, **kw)

  monkeypatch.setattr(tb, "gmm", spy)
  m, k, n, sizes = 256, 128, 128, [40, 0, 33, 50, 7, 60, 20, 30]
  x, w, s = _case(m, k, n, 8, False, (64, 64), seed=13)  # (dX contracts n: 64-row blocks)
  gs = jnp.asarray(sizes, jnp.int32)
  c = jax.random.normal(jax.random.key(4), (m, n), jnp.float32)
  loss = lambda x, w, s: jnp.sum(ragdot.ragged_dot(
      x, w, gs, rhs_scale=s, implementation="triton").astype(jnp.float32) * c)
  want = jax.grad(loss)(x, w, s)
  with jax.set_mesh(split_mesh(getattr(jax.sharding.AxisType, axis_type))):
    args = [jax.device_put(a, spec) for a, spec in zip((x, w, s), (P("dp"), P("ep"), P("ep")))]
    seen.clear()
    got = jax.jit(jax.grad(loss))(*args)
  assert ((2, k, n), True, True) in seen and all(c[2] for c in seen), seen
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_layout_splits_scaled_weights_along_whole_blocks():
  """``sharded.gmm_split`` with the scales' shape: rhs's k and n split only
  where the axes divide the scale's blocks along them (either layout)."""
  from ragdot import sharded
  from split_cases import mesh as split_mesh
  mesh = split_mesh(jax.sharding.AxisType.Auto)
  lhs_dims, rhs_dims = ((), ("dp",)), (("ep",), ("dp",), ())
  split = lambda rshape, sshape, nk, rdims=rhs_dims: sharded.gmm_split(
      mesh, lhs_dims, rdims, (256, 64), rshape, nk, sshape)
  assert split((8, 64, 32), None, False).k == ("dp",)  # no scales
  assert split((8, 64, 32), (8, 2, 4), False).k == ("dp",)  # 2 k blocks over dp = 2
  assert split((8, 64, 32), (8, 1, 4), False).k == ()  # one k block
  assert split((8, 32, 64), (8, 4, 1), True, (("ep",), (), ("dp",))).k == ()  # [g, n, k]
  assert split((8, 64, 32), (8, 2, 2), False, (("dp",), (), ("ep",))).n == ()  # 2 over 4
  assert split((8, 64, 32), (8, 2, 4), False, (("dp",), (), ("ep",))).n == ("ep",)
  assert split((8, 64, 32), (8, 2, 4), False).groups == ("ep",)


@pytest.mark.parametrize("nk,block,offset", [(False, (64, 32), None), (True, (64, 1), 1)])
def test_triton_scales_each_widened_block(monkeypatch, nk, block, offset):
  """implementation="triton": the Triton kernel takes the scales (one call with
  rhs_scale, interpret mode) and equals itself on the dequantized weights
  bitwise (k = 192: a masked last k step), rows outside a shard exactly 0."""
  from ragdot.backends import triton as tb
  calls = []
  gmm = tb.gmm

  def spy(*args, **kw):
    out = gmm(*args, **kw)
    calls.append(kw.get("rhs_scale") is not None)
    return out

  monkeypatch.setattr(tb, "gmm", spy)
  m, k, n, sizes = 200, 192, 96, [90, 0, 70, 30]
  local = 4 if offset is None else 2
  x, w, s = _case(m, k, n, local, nk, block, seed=5)
  gs, go = jnp.asarray(sizes, jnp.int32), None if offset is None else jnp.int32(offset)
  got = _call(x, w, gs, nk, rhs_scale=s, group_offset=go, implementation="triton")
  assert calls == [True], calls
  deq = scales.dequantize(w, s, jnp.bfloat16)
  want = _call(x, deq, gs, nk, group_offset=go, implementation="triton")
  np.testing.assert_array_equal(_bits(got), _bits(want))
  oracle.assert_close(got, oracle.ref_ragged_dot(x, deq, sizes, offset, nk), jnp.bfloat16)
  oracle.assert_zero_rows(got, sizes, offset, local)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("specs,block", [
    ((P("dp"), P("ep"), P("ep")), (32, 8)), ((P(), P(), P("ep")), (32, 8)),
    ((P("dp"), P(), P()), (32, 8)),
    ((P("dp"), P(None, None, "ep"), P()), (32, 16)),  # n split held back by the blocks
])
def test_split_operands_gradients_match_the_unsplit_ones(axis_type, specs, block):
  """Gradients in rows, fp8 weights and scales with operands split over mesh
  axes (the scale alone too): those of the unsplit call."""
  from split_cases import mesh as split_mesh
  m, k, n, sizes = 256, 64, 32, [40, 0, 33, 50, 7, 60, 20, 30]
  x, w, s = _case(m, k, n, 8, False, block, x_dtype=jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  c = jax.random.normal(jax.random.key(3), (m, n), jnp.float32)
  loss = lambda x, w, s: jnp.sum(
      ragdot.ragged_dot(x, w, gs, rhs_scale=s, implementation="xla") * c)
  grad = jax.grad(loss, (0, 1, 2))
  want = grad(x, w, s)
  with jax.set_mesh(split_mesh(getattr(jax.sharding.AxisType, axis_type))):
    args = [jax.device_put(a, spec) for a, spec in zip((x, w, s), specs)]
    got = jax.jit(grad)(*args)
  for a, b in zip(got, want):  # (f32 sums split over shards: their order differs)
    b = _bits(b)
    np.testing.assert_allclose(_bits(a), b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_e8m0_weights_and_a_second_quantization_raise():
  x = jnp.ones((8, 64), jnp.float16)
  w = jnp.ones((2, 64, 64), jnp.float8_e8m0fnu)
  with pytest.raises(TypeError, match="rhs_scale needs 8-bit float weights"):
    ragdot.ragged_dot(x, w, jnp.array([4, 4], jnp.int32), rhs_scale=jnp.ones((2, 1, 1)))
  from ragdot.moe import functional as F
  from ragdot.moe.config import MoEConfig
  cfg = MoEConfig(hidden=32, intermediate=16, num_experts=4, top_k=2)
  params = F.quantize_experts(F.init_params(jax.random.key(0), cfg), cfg, block=(16, 16))
  with pytest.raises(ValueError, match="quantized already"):
    F.quantize_experts(params, cfg)
