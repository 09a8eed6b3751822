"""fp8 expert weights beside bf16 / f16 rows (W8A16): ``ragged_dot`` keeps the
pair, the Mosaic swap kernel widens each weight slice in its consumers'
registers (wgmma's A operand, rhs [g, n, k]) or into SMEM buffers (either
layout, read as stored; interpret mode always: the interpreter takes wgmma
operands from SMEM only), every other backend runs on a widened copy of the
weights.  Interpret mode on CPU, lowering for sm90,
the dispatcher's choice."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import oracle
import ragdot
from ragdot import dispatch
from ragdot.backends import get_backend
from ragdot.backends import mosaic_fwd as mf

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
H200 = dispatch.Device("gpu", "NVIDIA H200", "9.0")
A100 = dispatch.Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0")
SWAP = mf.MosaicFwdConfig(block_m=128, block_n=128, block_k=64, num_stages=2, num_compute_wgs=2,
                          ring=True, swap=True, num_sms=3, producer_zeros=False)


def _inputs(m, k, n, local, transpose_rhs, x_dtype, w_dtype, seed):
  rshape = (local, n, k) if transpose_rhs else (local, k, n)
  x, w = oracle.random_inputs(jax.random.key(seed), [(m, k), rshape], jnp.float32)
  return x.astype(x_dtype), w.astype(w_dtype)


@pytest.mark.parametrize("sizes,m,k,n,offset,local,transpose_rhs,x_dtype,w_dtype,tail", [
    # [g, n, k] weights: a folded tail (300 = 256 + 44 at 64 rows), a short group
    # (10), an empty group, rows past the groups; two alternating SMEM buffers
    ([300, 10, 520, 0, 280], 1280, 128, 192, None, 5, True, jnp.bfloat16, E4M3,
     dict(tail_rows=64, widen_staging=2)),
    # [g, k, n] weights read as stored (one SMEM buffer), f16 rows, e5m2, a split
    # tail (270 = 256 + 14 from row 320); 256 rows a group on average, so the
    # tiles stay as given (fewer would be fitted to one-tile groups)
    ([300, 20, 270, 400], 1024, 64, 256, None, 4, False, jnp.float16, E5M2,
     dict(tail_rows=16, tail_split=True, widen_staging=1)),
    # a shard (rows outside it exactly 0), the tail asked on wgmma's M axis (folded
    # as more N instead: the weights are wgmma's A operand only), short tiles;
    # [g, k, n] with no staging asked: two buffers
    ([300, 20, 270, 400], 1024, 128, 128, 1, 2, False, jnp.bfloat16, E4M3,
     dict(tail_rows=16, tail_on_m=True, short_tile_rows=64)),
])
def test_kernel_equals_the_call_on_widened_weights(sizes, m, k, n, offset, local, transpose_rhs,
                                                   x_dtype, w_dtype, tail):
  """Bitwise the swap kernel's result on a 16-bit copy of the weights in the
  same layout (the same tiles, so the same f32 sums), and within the dtype's
  tolerance of the f32 reference; rows outside the shard exactly 0."""
  x, w = _inputs(m, k, n, local, transpose_rhs, x_dtype, w_dtype, m + k)
  gs, go = jnp.asarray(sizes, jnp.int32), None if offset is None else jnp.int32(offset)
  cfg = dataclasses.replace(SWAP, **tail)
  got = mf.gmm(x, w, gs, go, transpose_rhs=transpose_rhs, out_dtype=x_dtype, interpret=True,
               config=cfg)
  assert got.dtype == x_dtype
  run = mf.weight_only_config(cfg, m, len(sizes), k, transpose_rhs)
  assert run.swap and not run.tail_on_m and run.tail_rows == cfg.tail_rows
  assert run.tail_split == cfg.tail_split and run.swap_rows == 256
  assert run.widen_staging == tail.get("widen_staging", 2)
  want = mf.gmm(x, w.astype(x_dtype), gs, go, transpose_rhs=transpose_rhs, out_dtype=x_dtype,
                interpret=True, config=run)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  oracle.assert_close(got, oracle.ref_ragged_dot(x, w, sizes, go, transpose_rhs), x_dtype)
  oracle.assert_zero_rows(got, sizes, offset, local)


def test_kernel_refuses_what_its_swap_form_cannot_write():
  x, w = _inputs(128, 64, 64, 2, True, jnp.bfloat16, E4M3, 1)
  gs = jnp.array([60, 40], jnp.int32)
  with pytest.raises(NotImplementedError, match="bf16/f16 output"):
    mf.gmm(x, w, gs, None, transpose_rhs=True, out_dtype=jnp.float32, interpret=True)
  with pytest.raises(NotImplementedError, match="fp8 weights"):
    mf.gmm(x.astype(jnp.float32), w, gs, None, transpose_rhs=True, out_dtype=jnp.float32,
           interpret=True)


@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_kernel_pads_calls_of_fewer_than_16_rows(transpose_rhs):
  """One token over top-8 experts (8 rows): the call padded to the smallest
  swap tile (16 rows), its own 8 rows returned, against the f32 reference."""
  sizes = [1, 0, 1, 1, 0, 1, 1, 1, 1, 1]
  x, w = _inputs(8, 128, 128, 10, transpose_rhs, jnp.bfloat16, E4M3, 3)
  gs = jnp.asarray(sizes, jnp.int32)
  got = mf.gmm(x, w, gs, None, transpose_rhs=transpose_rhs, out_dtype=jnp.bfloat16,
               interpret=True, config=dataclasses.replace(SWAP, num_sms=2))
  assert got.shape == (8, 128)
  oracle.assert_close(got, oracle.ref_ragged_dot(x, w, sizes, None, transpose_rhs), jnp.bfloat16)


def test_weight_only_config():
  # A swap config keeps its tiles, loses what reads the weights as wgmma's B
  # operand or runs the row-major ring.
  cfg = dataclasses.replace(SWAP, tail_rows=32, tail_on_m=True, swap_rows=256,
                            shard_ring_above=1.25, pair_schedule=True)
  got = mf.weight_only_config(cfg, 32768, 128)
  assert got == dataclasses.replace(cfg, tail_on_m=False, shard_ring_above=None,
                                    pair_schedule=False, delay_release=0)
  # Where the buffers leave no room even at 2 stages: k steps of 64 columns.
  deep = dataclasses.replace(cfg, block_k=128, tail_rows=64, tail_on_m=False, num_stages=4)
  short = mf.weight_only_config(deep, 32768, 128, transpose_rhs=False)
  assert (short.block_k, short.widen_staging) == (64, 2)
  assert short.smem_bytes(jnp.bfloat16, jnp.bfloat16, E4M3) <= short.smem_budget()
  assert mf.weight_only_config(short, 32768, 128, transpose_rhs=False) == short
  # [g, k, n] weights: two SMEM buffers a consumer (wgmma reads an MN-major A
  # from SMEM only), one step's wgmmas in flight, the stages cut to fit SMEM
  # (256 + 64 rows in 4 stages and the buffers need 240 KiB).
  tall = dataclasses.replace(cfg, tail_rows=64, tail_on_m=False, num_stages=4)
  kn = mf.weight_only_config(tall, 32768, 128, transpose_rhs=False)
  assert (kn.widen_staging, kn.delay_release, kn.num_stages) == (2, 1, 3)
  assert kn.smem_bytes(jnp.bfloat16, jnp.bfloat16, E4M3) <= kn.smem_budget()
  assert dataclasses.replace(kn, num_stages=4).smem_bytes(
      jnp.bfloat16, jnp.bfloat16, E4M3) > kn.smem_budget()
  # An explicit staging stays (one buffer: each step waits, delay_release 0),
  # registers only for [g, n, k].
  one = dataclasses.replace(cfg, widen_staging=1)
  for tr in (True, False):
    assert mf.weight_only_config(one, 32768, 128, transpose_rhs=tr).delay_release == 0
    assert mf.weight_only_config(one, 32768, 128, transpose_rhs=tr).widen_staging == 1
  assert mf.weight_only_config(cfg, 32768, 128, transpose_rhs=False).widen_staging == 2
  # No swap config (the row-major pipeline, none): the swap defaults, fitted to
  # ~128 rows per group as the dispatcher fits swap entries.
  plain = mf.MosaicFwdConfig(block_m=128, block_n=256, num_compute_wgs=2)
  for c in (plain, None):
    got = mf.weight_only_config(c, 16384, 128)
    assert got.swap and got.swap_rows == mf.swap_rows_for_mean(128) and not got.tail_rows
  # Decode (4 rows per group on average): 16-row tiles, k steps of 128 columns in
  # 4 stages where k takes them, else 64 in 8.
  dec = mf.weight_only_config(None, 512, 128, 2048)
  assert mf.weight_only_config(cfg, 512, 128).swap_rows == 256  # a swap config's own tiles
  assert (dec.swap_rows, dec.tail_rows, dec.block_k, dec.num_stages) == (16, 0, 128, 4)
  # Tile rows from twice the mean group plus 8, in 16s from 16 to 64: few rows
  # loaded beside the weights, most groups one tile.
  assert [mf.decode_rows(r) for r in (1, 4, 5, 12, 20, 32, 47)] == [16, 16, 32, 32, 48, 64, 64]
  assert mf.weight_only_config(None, 256, 8, 4096).swap_rows == 64  # Mixtral decode
  narrow = mf.weight_only_config(None, 512, 128, 2880)
  assert (narrow.block_k, narrow.num_stages) == (64, 8)
  for c in (dec, narrow, mf.weight_only_config(None, 512, 128, 2048, transpose_rhs=False)):
    assert c.smem_bytes(jnp.bfloat16, jnp.bfloat16, E4M3) <= c.smem_budget()
  wide = dataclasses.replace(cfg, block_k=128)  # an entry's 128 columns where k needs 64
  assert mf.weight_only_config(wide, 32768, 128, 2880).block_k == 64
  # Every k step waits for its own wgmmas (the next one's widened weights reuse
  # their registers).
  assert all(c.delay_release == 0 for c in (got, dec))
  # Tiles no taller than the call: 200 rows take 192 (+ no tail), 16 the
  # smallest (fewer rows count as 16: the kernel pads the call).
  small = mf.weight_only_config(dataclasses.replace(SWAP, tail_rows=16), 200, 1)
  assert small.swap_rows + small.tail_rows <= 200 and small.swap_rows % 16 == 0
  assert mf.weight_only_config(None, 64, 1).swap_rows == 64
  assert mf.weight_only_config(None, 63, 1).swap_rows == 48
  assert mf.weight_only_config(None, 8, 1).swap_rows == 16


@pytest.mark.parametrize("shape", [(32768, 2048, 1536, 128), (32768, 768, 2048, 128),
                                   (512, 2048, 1536, 128), (512, 768, 2048, 128),
                                   (96, 768, 2048, 128)])
@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_lowers_for_sm90_with_the_h200_choice(shape, transpose_rhs):
  """The dispatcher's W8A16 choice on an H200 (the table's Mosaic swap entries,
  or the kernel's own config) lowers for sm90: [g, n, k] weights widened in
  registers, [g, k, n] ones through SMEM, read as stored."""
  import sm90_lowering
  m, k, n, g = shape
  c = dispatch.choose("gmm", None, dtype=jnp.bfloat16, rhs_dtype=E4M3, out_dtype=jnp.bfloat16,
                      m=m, k=k, n=n, g=g, num_groups=g, transpose_rhs=transpose_rhs,
                      device=H200)
  assert c.implementation == "mosaic", c.reason
  # Registers for [g, n, k]; SMEM for [g, k, n]: the rule's 2 buffers, or the tuned 1.
  assert c.config.widen_staging in ((0,) if transpose_rhs else (1, 2))
  sm90_lowering.assert_gmm_lowers(c.config, m=m, k=k, n=n, g=g, transpose_rhs=transpose_rhs,
                                  rhs_dtype=E4M3)


@pytest.mark.parametrize("staging", [1, 2])
@pytest.mark.parametrize("m", [32768, 512])
def test_lowers_for_sm90_with_gnk_weights_staged(staging, m):
  """[g, n, k] weights widened through one or two SMEM buffers a consumer (the
  alternative to registers the benchmark compares) lower for sm90."""
  import sm90_lowering
  cfg = mf.weight_only_config(None, m, 128, 2048)
  cfg = mf.weight_only_config(dataclasses.replace(cfg, widen_staging=staging), m, 128, 2048)
  assert cfg.widen_staging == staging and cfg.delay_release == int(staging == 2)
  sm90_lowering.assert_gmm_lowers(cfg, m=m, k=2048, n=1536, g=128, transpose_rhs=True,
                                  rhs_dtype=E4M3)


def test_lowers_for_sm90_on_a_shard_with_f16_rows():
  import sm90_lowering
  sm90_lowering.assert_gmm_lowers(None, m=4096, k=768, n=2048, g=128, local=16,
                                  with_offset=True, transpose_rhs=False, dtype=jnp.float16,
                                  out_dtype=jnp.float16, rhs_dtype=E5M2)


@pytest.mark.parametrize("m,tuned", [(256, True), (512, True), (1024, False), (4096, False)])
def test_decode_entries_serve_only_their_rows_per_group(m, tuned):
  """The H200's W8A16 decode entries (16-row tiles, tuned on 4 rows a group) serve
  calls whose rule would take 16-row tiles too; with more rows a group the rule's
  taller tiles (16-row ones would read each group's weights 2-3 times)."""
  c = dispatch.choose("gmm", None, dtype=jnp.bfloat16, rhs_dtype=E4M3, out_dtype=jnp.bfloat16,
                      m=m, k=768, n=2048, g=128, num_groups=128, transpose_rhs=False,
                      device=H200)
  assert c.implementation == "mosaic"
  assert ("W8A16 swap kernel" not in c.reason) == tuned, c.reason
  assert c.config.swap_rows == mf.weight_only_tile_rows(m, 128) == (16 if tuned else
                                                                     mf.decode_rows(m / 128))
  assert c.config.widen_staging == (1 if tuned else 2)


def test_dispatcher_takes_the_w8a16_kernel_on_sm90_only():
  common = dict(dtype=jnp.bfloat16, k=768, n=2048, g=128, num_groups=128)
  choose = lambda impl=None, device=H200, **kw: dispatch.choose(
      "gmm", impl, **{**common, "rhs_dtype": E4M3, "m": 512, "out_dtype": jnp.bfloat16, **kw},
      device=device)
  bf16 = lambda device=H200, **kw: dispatch.choose(
      "gmm", None, **{**common, "m": 512, "out_dtype": jnp.bfloat16, **kw}, device=device)
  # The config the kernel runs (its own rule gives it back unchanged): at decode
  # size the tuned W8A16 entry (H200, v59a: 8 stages, one staging buffer), the bf16
  # swap entry's at training size.
  auto, train, entry = choose(), choose(m=32768), bf16(m=32768)
  assert auto.implementation == train.implementation == entry.implementation == "mosaic"
  assert auto.config == mf.weight_only_config(auto.config, 512, 128, 768, transpose_rhs=False)
  assert "W8A16" in auto.reason and auto.config.widen_staging == 1
  assert auto.config.swap_rows == 16 and entry.config.swap
  assert train.config == mf.weight_only_config(entry.config, 32768, 128, 768, transpose_rhs=False)
  for c, m in ((auto, 512), (train, 32768)):
    assert mf.weight_only_config(c.config, m, 128, 768) == c.config
  # 8 to 63 rows in whole TMA row tiles: the kernel too (one token over top-8
  # experts: 8 rows, padded to 16 by the kernel).
  for m in (8, 32):
    few = choose(m=m)
    assert few.implementation == "mosaic" and few.config.swap_rows == 16, few.reason
  # Elsewhere, on sm89+, the Triton kernel on the weights as they are (rows the
  # TMA tiles refuse, an f32 result); on an sm80 part the 16-bit call's choice,
  # on a widened copy.
  assert choose(device=A100) == bf16(device=A100)
  for kw in (dict(m=12), dict(out_dtype=jnp.float32)):
    got = choose(**kw)
    assert got.implementation == "triton" and "Triton W8A16" in got.reason and got.automatic
  assert dispatch.triton_takes_weight_only(jnp.bfloat16, E4M3, H200)
  assert not dispatch.triton_takes_weight_only(jnp.bfloat16, E4M3, A100)
  assert not dispatch.triton_takes_weight_only(jnp.float32, E4M3, H200)
  assert "Triton W8A16" in choose("triton").reason
  assert choose("mosaic", m=12).implementation == "mosaic"  # an explicit Mosaic stays
  # Off the GPU the automatic choice stays XLA's (Triton would run interpreted).
  cpu = dispatch.Device("cpu", "cpu")
  assert choose(device=cpu) == bf16(device=cpu) and choose(device=cpu).implementation == "xla"
  # Unknown shapes (no m): Triton on the weights as they are too.
  assert choose(m=None).implementation == "triton"


@pytest.mark.parametrize("impl", ["mosaic", "triton", "xla"])
def test_ragged_dot_keeps_fp8_weights_for_the_kernel_that_takes_them(monkeypatch, impl):
  """Mosaic and Triton (interpret mode here; sm89+ on a GPU) get the fp8
  weights as they are, XLA a bf16 copy; the results and gradients are lax's
  (dtypes included)."""
  backend = get_backend(impl)
  seen = []
  real = backend.gmm
  monkeypatch.setattr(backend, "gmm", lambda lhs, rhs, *a, **kw: seen.append(
      (lhs.dtype, rhs.dtype)) or real(lhs, rhs, *a, **kw))
  ragdot.api._compiled.cache_clear()
  sizes = [40, 0, 56, 24]
  gs = jnp.asarray(sizes, jnp.int32)
  x, w = _inputs(128, 64, 128, 4, False, jnp.bfloat16, E4M3, 7)
  f = lambda x, w: ragdot.ragged_dot(x, w, gs, implementation=impl)
  out = f(x, w)
  assert out.dtype == lax.ragged_dot(x, w, gs).dtype == jnp.bfloat16
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes), jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, None, 4)
  bf, f8 = jnp.dtype(jnp.bfloat16), jnp.dtype(E4M3)
  assert seen == [(bf, bf if impl == "xla" else f8)]
  c = jax.random.normal(jax.random.key(8), (128, 128)) / 16
  loss = lambda f, x, w: jnp.sum(f(x, w).astype(jnp.float32) * c)
  got = jax.grad(lambda x, w: loss(f, x, w), (0, 1))(x, w)
  lax_f = lambda x, w: lax.ragged_dot(x, w, gs)
  want = jax.grad(lambda x, w: loss(lax_f, x, w), (0, 1))(x, w)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype
    # (the fp8 weight gradient: one e4m3 unit apart where lax rounds through bf16)
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=0.13, atol=0.02 * float(jnp.abs(b.astype(jnp.float32)).max()))
  # dX reads the fp8 weights in the [g, n, k] mode: Mosaic and Triton get them
  # as they are.
  assert seen[1:] == [(bf, bf if impl == "xla" else f8)] * (len(seen) - 1)


@pytest.mark.parametrize("m,out_dtype", [(128, jnp.float32)])
def test_explicit_mosaic_widens_what_the_w8a16_kernel_refuses(monkeypatch, m, out_dtype):
  """An f32 result: implementation="mosaic" runs on the weights widened to
  bf16, as before W8A16."""
  backend = get_backend("mosaic")
  seen = []
  real = backend.gmm
  monkeypatch.setattr(backend, "gmm", lambda lhs, rhs, *a, **kw: seen.append(
      (lhs.dtype, rhs.dtype)) or real(lhs, rhs, *a, **kw))
  ragdot.api._compiled.cache_clear()
  sizes = [m // 2, 0, m // 4, m // 4]
  gs = jnp.asarray(sizes, jnp.int32)
  x, w = _inputs(m, 64, 64, 4, False, jnp.bfloat16, E4M3, m)
  f = lambda x: ragdot.ragged_dot(x, w, gs, preferred_element_type=out_dtype,
                                  implementation="mosaic")
  out = f(x)
  assert out.dtype == (out_dtype or jnp.bfloat16)
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w, sizes), jnp.bfloat16)
  jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32)))(x)
  bf = jnp.dtype(jnp.bfloat16)
  # (the forward traced more than once; dX last: a bf16 result, so with 128 rows
  # the W8A16 kernel takes it)
  assert set(seen[:-1]) == {(bf, bf)}
  assert seen[-1] == (bf, jnp.dtype(E4M3))


def test_only_weights_the_rows_dtype_holds_stay_fp8():
  """e8m0 (exponents to 2^127) beside f16 rows is promoted as before (f16
  cannot hold it); beside bf16 rows, and e4m3 / e5m2 beside either, it stays."""
  from ragdot import validate
  f16, bf16 = jnp.zeros((2, 2), jnp.float16), jnp.zeros((2, 2), jnp.bfloat16)
  e8m0 = jnp.zeros((1, 2, 2), jnp.float8_e8m0fnu)
  assert not validate.weight_only(f16, e8m0) and validate.weight_only(bf16, e8m0)
  for w in (E4M3, E5M2):
    w8 = jnp.zeros((1, 2, 2), w)
    assert validate.weight_only(f16, w8) and validate.weight_only(bf16, w8)
  x = jnp.full((4, 2), 2.0 ** -10, jnp.float16)
  w = jnp.full((1, 2, 2), 2.0 ** 20, jnp.float8_e8m0fnu)
  got = ragdot.ragged_dot(x, w, jnp.array([4], jnp.int32), preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), np.full((4, 2), 2.0 ** 11, np.float32))


def test_trans_ragged_dot_and_fp8_rows_still_promote():
  """Only ragged_dot's rhs (expert weights) stays fp8: trans_ragged_dot's
  operands meet in one dtype, and fp8 rows with bf16 weights are widened."""
  gs = jnp.array([40, 0, 56, 32], jnp.int32)
  x, dy = oracle.random_inputs(jax.random.key(9), [(128, 64), (128, 64)], jnp.bfloat16)
  x8 = x.astype(E4M3)
  out = ragdot.trans_ragged_dot(x8, dy, gs, implementation="xla")
  want = lax.ragged_dot_general(
      x8, dy, gs, lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], []))
  assert out.dtype == want.dtype
  w = jax.random.normal(jax.random.key(3), (4, 64, 64)).astype(jnp.bfloat16)
  assert ragdot.ragged_dot(x8, w, gs).dtype == lax.ragged_dot(x8, w, gs).dtype


@pytest.mark.parametrize("w_dtype,offset", [(E4M3, None), (E5M2, 1)])
def test_fp8_rows_with_kn_weights_run_widened(monkeypatch, w_dtype, offset):
  """fp8 rows beside fp8 [g, k, n] weights with a ``widen_rows`` config: the
  swap kernel gets bf16 rows and the weights as stored (the W8A16 form),
  bitwise the call on bf16 rows; an f32 result (which the swap form cannot
  write) takes the fp8 [g, n, k] copy instead, bitwise that call."""
  from ragdot.backends import mosaic_fwd_swap
  seen = []
  real = mosaic_fwd_swap.gmm
  monkeypatch.setattr(mosaic_fwd_swap, "gmm", lambda lhs, rhs, *a, **kw: seen.append(
      (lhs.dtype, rhs.dtype, kw["transpose_rhs"])) or real(lhs, rhs, *a, **kw))
  sizes, m, k, n = [300, 20, 270, 400], 1024, 128, 128
  local = 4 if offset is None else 2
  x, w = _inputs(m, k, n, local, False, w_dtype, w_dtype, 5)
  gs, go = jnp.asarray(sizes, jnp.int32), None if offset is None else jnp.int32(offset)
  cfg = dataclasses.replace(SWAP, widen_rows=True, tail_rows=16)
  call = lambda x, w, out=jnp.bfloat16, tr=False, cfg=cfg: mf.gmm(
      x, w, gs, go, transpose_rhs=tr, out_dtype=out, interpret=True, config=cfg)
  got = call(x, w)
  assert got.dtype == jnp.bfloat16
  assert seen == [(jnp.dtype(jnp.bfloat16), jnp.dtype(w_dtype), False)]
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(call(x.astype(jnp.bfloat16), w), np.float32))
  oracle.assert_close(got, oracle.ref_ragged_dot(x, w, sizes, go), jnp.bfloat16)
  oracle.assert_zero_rows(got, sizes, offset, local)
  wide = call(x, w, jnp.float32)
  plain = dataclasses.replace(cfg, widen_rows=False)
  np.testing.assert_array_equal(wide, call(x, jnp.swapaxes(w, 1, 2), jnp.float32, True, plain))


def test_dispatcher_widens_fp8_rows_for_kn_weights_on_sm90_only():
  """fp8 x fp8 with [g, k, n] weights and a 16-bit result on sm90: the W8A16
  choice of bf16 rows with ``widen_rows``; [g, n, k] weights, an fp8 result,
  rows the TMA tiles refuse or an sm80 part keep the fp8 choice."""
  common = dict(dtype=E4M3, k=768, n=2048, g=128, num_groups=128)
  choose = lambda m=512, out=jnp.bfloat16, tr=False, device=H200: dispatch.choose(
      "gmm", None, **common, m=m, out_dtype=out, transpose_rhs=tr, device=device)
  for m in (512, 32768):
    got = choose(m)
    w8a16 = dispatch.choose("gmm", None, **{**common, "dtype": jnp.bfloat16}, rhs_dtype=E4M3,
                            m=m, out_dtype=jnp.bfloat16, device=H200)
    assert got.implementation == "mosaic" and "rows widened to bf16" in got.reason
    assert got.config == dataclasses.replace(w8a16.config, widen_rows=True)
  for kept in (choose(tr=True), choose(out=E4M3), choose(m=12), choose(device=A100)):
    assert not getattr(kept.config, "widen_rows", False)


@pytest.mark.parametrize("transpose_rhs,w_dtype,offset", [(True, E4M3, None), (False, E5M2, 1)])
def test_triton_widens_fp8_weights_after_each_load(transpose_rhs, w_dtype, offset):
  """The Triton kernel with fp8 weights beside bf16 rows: bitwise its result on
  a bf16 copy of the weights (each block widened exactly after its load), in
  either layout, rows outside the shard exactly 0; fp8 beside f32 rows refused."""
  from ragdot.backends import triton as tb
  sizes, m, k, n = [40, 0, 56, 24], 128, 96, 80  # k, n not multiples of the blocks
  local = 4 if offset is None else 2
  x, w = _inputs(m, k, n, local, transpose_rhs, jnp.bfloat16, w_dtype, 21)
  gs, go = jnp.asarray(sizes, jnp.int32), None if offset is None else jnp.int32(offset)
  call = lambda x, w: tb.gmm(x, w, gs, go, transpose_rhs=transpose_rhs, out_dtype=jnp.bfloat16,
                             precision=None, interpret=True)
  got = call(x, w)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(call(x, w.astype(jnp.bfloat16)), np.float32))
  oracle.assert_close(got, oracle.ref_ragged_dot(x, w, sizes, go, transpose_rhs), jnp.bfloat16)
  oracle.assert_zero_rows(got, sizes, offset, local)
  assert tb.takes_weight_only(jnp.bfloat16, w_dtype)
  assert not tb.takes_weight_only(jnp.float32, w_dtype)
  with pytest.raises(NotImplementedError, match="rhs dtype"):
    call(x.astype(jnp.float32), w)


# --- W8A16 tuning: `ragdot tune --weights-dtype`, and the dispatcher's use of its entries ---


def test_tune_tasks_and_candidates_for_fp8_weights():
  """``--weights-dtype``: the forward in both weight layouts and dX; the
  candidates start at today's W8A16 config and vary tiles, stages, k step and
  staging, each a swap config ``weight_only_config`` keeps as it is and that
  fits SMEM, then Triton's; dW and fp8 rows refuse."""
  from ragdot import bench, tune
  s = bench.Shape("decode", 512, 2048, 1536, 128, 8)
  tasks = tune.tasks_for([s], ("fwd", "dx"), jnp.bfloat16, "float8_e4m3fn")
  assert [(t.op, t.table_op, t.k, t.n) for t in tasks] == [
      ("fwd", "gmm", 2048, 1536), ("fwd", "gmm_t", 2048, 1536), ("dx", "gmm_t", 1536, 2048)]
  assert tune.dtype_key(jnp.bfloat16, "float8_e4m3fn") == "bfloat16+float8_e4m3fn"
  with pytest.raises(ValueError, match="dW takes no fp8 weights"):
    tune.tasks_for([s], ("dw",), jnp.bfloat16, "float8_e4m3fn")
  with pytest.raises(ValueError, match="beside bf16 / f16 rows"):
    tune.tasks_for([s], ("fwd",), jnp.float32, "float8_e4m3fn")
  for task in tasks:
    inc = tune.incumbent_choice(task, jnp.bfloat16, H200)
    assert inc[0] == "mosaic"
    cands = tune.weight_only_candidates(task, jnp.bfloat16, inc)
    assert cands[0] == inc
    mosaic = [c for b, c in cands if b == "mosaic"]
    assert len(mosaic) == len(set(mosaic)) >= 20
    assert any(b == "triton" for b, _ in cands)
    assert {c.num_stages for c in mosaic} >= {4, 6} and {c.block_k for c in mosaic} == {64, 128}
    assert {c.widen_staging for c in mosaic} == ({0, 1, 2} if task.transpose_rhs else {1, 2})
    for c in mosaic:
      assert c.swap and mf.weight_only_config(c, task.m, task.g, task.k,
                                              task.transpose_rhs) == c
      assert c.smem_bytes(jnp.bfloat16, jnp.bfloat16, E4M3) <= c.smem_budget()


def test_dispatcher_takes_a_tuned_w8a16_entry(h200_table):
  """A W8A16 entry (``gmm/bfloat16+float8_e4m3fn/...``) is what the dispatcher
  runs for fp8 weights beside bf16 rows (its config as ``weight_only_config``
  fits it; e5m2 / f16 through the aliases), and a Triton one where Triton takes
  fp8 weights, unless Mosaic is asked for; without one, today's rule."""
  from ragdot import dispatch
  k, n, g = 2048, 1536, 128
  choose = lambda m, **kw: dispatch.choose(
      "gmm", kw.pop("impl", None), **dict(dict(dtype=jnp.bfloat16, rhs_dtype=E4M3,
                                               out_dtype=jnp.bfloat16), **kw),
      m=m, k=k, n=n, g=g, num_groups=g, device=H200)
  tuned = dataclasses.replace(mf.weight_only_config(None, 512, g, k, False), num_stages=6,
                              swap_rows=32)
  for key in [key for key in h200_table.entries if key.startswith("gmm_t/bfloat16+float8")]:
    del h200_table.entries[key]  # (the shipped [g, n, k] entries)
  h200_table.put("gmm", "bfloat16+float8_e4m3fn", 512, k, n, g,
                 dict(backend="mosaic", config=dataclasses.asdict(tuned), measured=True))
  h200_table.put("gmm", "bfloat16+float8_e4m3fn", 256, k, n, g,
                 dict(backend="triton", measured=True,
                      config=dict(block_m=32, block_n=128, block_k=128, num_warps=4,
                                  num_stages=3)))
  for x_dtype, w_dtype in [(jnp.bfloat16, E4M3), (jnp.float16, E5M2)]:
    c = choose(512, dtype=x_dtype, rhs_dtype=w_dtype, out_dtype=x_dtype)
    assert c.implementation == "mosaic" and "W8A16 measured entry" in c.reason, c.reason
    assert c.config == mf.weight_only_config(tuned, 512, g, k, False)
    assert c.config.num_stages == 6 and c.config.swap_rows == 32
  # the [g, n, k] layout has no entry: today's rule
  assert "W8A16 measured entry" not in choose(512, transpose_rhs=True).reason
  c = choose(256)
  assert c.implementation == "triton" and c.config.block_m == 32, c.reason
  # an explicit mosaic request does not take the Triton entry
  c = choose(256, impl="mosaic")
  assert c.implementation == "mosaic"
  assert c.config == mf.weight_only_config(None, 256, g, k, False)
