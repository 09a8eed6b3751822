"""On the GPU machine (scripts/gpu_run.sh): kernels at real sizes.

Every output element must be written (memory is NaN-poisoned beforehand), rows
outside the shard must be exact zeros, and repeated runs must agree bitwise.
Deselected on CPU by ``-m "not gpu"``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import oracle
import ragdot
from ragdot import dispatch
from ragdot.backends import mosaic_fwd as mf
from ragdot.bench import PRESETS, Shape, dispatch_choice, routed_group_sizes

pytestmark = pytest.mark.gpu

GPU_IMPLS = ["mosaic"]
DN_DX = ragdot.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
DN_FWD = ragdot.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])


@pytest.fixture(autouse=True)
def _require_gpu():
  if jax.default_backend() != "gpu":
    pytest.fail("GPU tests need a GPU (run them through scripts/gpu_run.sh)")


def _poison(nbytes: int) -> None:
  """Fill then free device memory with NaNs so unwritten outputs show up."""
  junk = jnp.full((nbytes // 2 + 1,), jnp.nan, jnp.bfloat16)
  junk.block_until_ready()
  del junk


def _check_dispatched_call(op, m, k, n, local, sizes, go, seed, config=None):
  """ragdot's automatic forward (``op`` "fwd") or dX ("dx") call over ``local``
  groups' weights on NaN-poisoned memory: the f32 oracle, exact zeros outside
  the shard (``go``: its group_offset, or None), bitwise the same on a second call.
  With ``config``, the Mosaic forward kernel run with that config instead."""
  dx = op == "dx"
  x, w = oracle.random_inputs(jax.random.key(seed), [(m, n if dx else k), (local, k, n)],
                              jnp.bfloat16)
  gs = jnp.asarray(sizes)
  if config is None:
    run = jax.jit(lambda x, w: ragdot.ragged_dot_general(x, w, gs, DN_DX if dx else DN_FWD,
                                                         group_offset=go))
  else:
    run = jax.jit(lambda x, w: mf.gmm(x, w, gs, go, transpose_rhs=dx, out_dtype=x.dtype,
                                      config=config))
  _poison(4 * m * max(n, k))
  out = run(x, w)
  oracle.assert_close(out, oracle.np_ragged_dot(x, w, sizes, go, transpose_rhs=dx), jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, go, local)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(run(x, w)))


SHAPES = [  # m, k, n, g, layout
    (4096, 2048, 1536, 128, "routed"),
    (4000, 768, 2048, 128, "routed"),      # m not a multiple of the row tile
    (2048, 512, 512, 16, "all_zero"),
    (2048, 512, 512, 16, "under"),          # rows past sum(group_sizes)
    (2048, 512, 1024, 16, "skewed"),
]


def _sizes(m, g, layout, seed=0):
  if layout == "all_zero":
    return np.zeros(g, np.int32)
  sizes = routed_group_sizes(Shape("t", m - m % 8, 1, 1, g, top_k=min(8, g), skewed=layout == "skewed"), seed)
  if layout == "under":
    sizes = (sizes * 0.7).astype(np.int32)
  return sizes


@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}g{s[3]}-{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("shard", [None, (0, 16), (112, 16)], ids=["all", "first", "last"])
def test_forward_and_dx_real_sizes(impl, shape, shard):
  m, k, n, g, layout = shape
  sizes = _sizes(m, g, layout)
  offset, local = (None, g) if shard is None else (shard[0] * g // 128, max(shard[1] * g // 128, 1))
  x, w, dy = oracle.random_inputs(jax.random.key(m + n + local), [(m, k), (local, k, n), (m, n)], jnp.bfloat16)
  go = None if offset is None else jnp.int32(offset)
  gs = jnp.asarray(sizes)
  fwd = jax.jit(lambda x, w, gs, go: ragdot.ragged_dot(x, w, gs, group_offset=go, implementation=impl))
  dx = jax.jit(lambda d, w, gs, go: ragdot.ragged_dot_general(d, w, gs, DN_DX, group_offset=go, implementation=impl))
  _poison(4 * m * max(n, k))
  out = fwd(x, w, gs, go)
  oracle.assert_close(out, oracle.np_ragged_dot(x, w, sizes, go), jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, offset, local)
  again = fwd(x, w, gs, go)
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(again).view(np.uint16)), "not bitwise deterministic"
  _poison(4 * m * max(n, k))
  got_dx = dx(dy, w, gs, go)
  oracle.assert_close(got_dx, oracle.np_ragged_dot(dy, w, sizes, go, transpose_rhs=True), jnp.bfloat16)
  oracle.assert_zero_rows(got_dx, sizes, offset, local)


@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}g{s[3]}-{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("shard", [None, (112, 16)], ids=["all", "last"])
def test_dw_real_sizes(impl, shape, shard):
  m, k, n, g, layout = shape
  sizes = _sizes(m, g, layout)
  offset, local = (None, None) if shard is None else (shard[0] * g // 128, max(shard[1] * g // 128, 1))
  x, dy = oracle.random_inputs(jax.random.key(m + k), [(m, k), (m, n)], jnp.bfloat16)
  go = None if offset is None else jnp.int32(offset)
  fn = jax.jit(lambda x, d, gs, go: ragdot.trans_ragged_dot(
      x, d, gs, group_offset=go, num_groups=local, implementation=impl))
  _poison(4 * g * k * n)
  out = fn(x, dy, jnp.asarray(sizes), go)
  ref = oracle.np_trans_ragged_dot(x, dy, sizes, go, local)
  oracle.assert_close(out, ref, jnp.bfloat16)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  again = fn(x, dy, jnp.asarray(sizes), go)
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(again).view(np.uint16))


@pytest.mark.parametrize("m, sizes, offset, local", [
    (1, [0, 1, 0], None, None),       # one token
    (5, [2, 4], None, None),          # the last group cut at m
    (3, [0, 1, 1, 1], 1, 2),          # a shard
    (40, [11, 20, 9], None, None),    # fewer rows than one 64-row block
    (60, [7, 0, 50, 9], 1, 2),
    (64, [5, 0, 59], None, None),     # one block, not padded
    (72, [30, 0, 42], None, None),    # a block past the last row
])
def test_mosaic_dw_fewer_rows_than_a_block(m, sizes, offset, local):
  # A TMA box taller than the array reads wrong rows on the GPU (interpret mode
  # does not model it): the dW kernel pads such calls to one block of zero rows.
  k, n = 256, 512
  x, dy = oracle.random_inputs(jax.random.key(m), [(m, k), (m, n)], jnp.bfloat16)
  go = None if offset is None else jnp.int32(offset)
  _poison(4 * len(sizes) * k * n)
  out = jax.jit(lambda x, d, gs, go: ragdot.trans_ragged_dot(
      x, d, gs, group_offset=go, num_groups=local, implementation="mosaic"))(
          x, dy, jnp.asarray(sizes, jnp.int32), go)
  oracle.assert_close(out, oracle.np_trans_ragged_dot(x, dy, sizes, go, local), jnp.bfloat16)
  assert np.abs(np.asarray(out, np.float32)).max() > 0


@pytest.mark.parametrize("m, sizes", [(1, [0, 1, 0]), (5, [2, 4]), (40, [11, 20, 9])])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["gkn", "gnk"])
def test_mosaic_grads_of_a_few_rows(m, sizes, transpose_rhs):
  # Forward, dX and dW of a call of a few tokens, all on the kernels.
  k, n, g = 256, 512, len(sizes)
  x, w, c = oracle.random_inputs(jax.random.key(m), [(m, k), (g, k, n), (m, n)], jnp.bfloat16)
  if transpose_rhs:
    w = jnp.swapaxes(w, 1, 2)
  dims = lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((1,), (2 if transpose_rhs else 1,)), ((), ())),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
  gs = jnp.asarray(sizes, jnp.int32)
  def loss(impl):
    return lambda x, w: jnp.sum(ragdot.ragged_dot_general(
        x, w, gs, dims, implementation=impl).astype(jnp.float32) * c.astype(jnp.float32))
  got = jax.jit(jax.grad(loss("mosaic"), (0, 1)))(x, w)
  want = jax.jit(jax.grad(loss("xla"), (0, 1)))(x, w)
  for a, b in zip(got, want):
    oracle.assert_close(a, b, jnp.bfloat16, factor=2)


@pytest.mark.parametrize("k, n", [(0, 512), (256, 0)])
def test_mosaic_dw_empty_k_or_n(k, n):
  out = ragdot.trans_ragged_dot(jnp.ones((64, k), jnp.bfloat16), jnp.ones((64, n), jnp.bfloat16),
                                jnp.array([30, 34], jnp.int32), implementation="mosaic")
  assert out.shape == (2, k, n)


@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_grads_through_kernels_real_size(impl):
  m, k, n, g = 2048, 512, 256, 8
  sizes = _sizes(m, g, "routed")
  x, w, c = oracle.random_inputs(jax.random.key(9), [(m, k), (g, k, n), (m, n)], jnp.bfloat16)
  loss = lambda x, w: jnp.sum(ragdot.ragged_dot(x, w, jnp.asarray(sizes), implementation=impl).astype(jnp.float32) * c.astype(jnp.float32))
  ref = lambda x, w: jnp.sum(oracle.ref_ragged_dot(x, w, sizes) * c.astype(jnp.float32))
  got = jax.jit(jax.grad(loss, (0, 1)))(x, w)
  want = jax.grad(ref, (0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
  for a, b in zip(got, want):
    oracle.assert_close(a, b, jnp.bfloat16, factor=2)


@pytest.mark.parametrize("offset", [None, 2])
def test_forward_mode_through_kernels_real_size(offset):
  """jax.jvp of the dispatched call (two forwards on the kernels) and a
  Hessian-vector product (forward over reverse: the JVP of dX and dW) against
  the f32 oracle's, on NaN-poisoned memory."""
  m, k, n, g = 2048, 512, 256, 8
  local = g if offset is None else 4
  sizes = _sizes(m, g, "routed")
  x, w, tx, tw, c = oracle.random_inputs(
      jax.random.key(10), [(m, k), (local, k, n), (m, k), (local, k, n), (m, n)], jnp.bfloat16)
  gs, go = jnp.asarray(sizes), None if offset is None else jnp.int32(offset)
  f = lambda x, w: ragdot.ragged_dot(x, w, gs, group_offset=go,
                                     preferred_element_type=jnp.float32)
  ref = lambda x, w: oracle.ref_ragged_dot(x, w, sizes, offset)
  _poison(16 * m * n)
  _, tangent = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(x, w, tx, tw)
  f32 = lambda *a: [v.astype(jnp.float32) for v in a]
  _, want = jax.jvp(ref, f32(x, w), f32(tx, tw))
  oracle.assert_close(tangent, want, jnp.bfloat16, factor=2)
  oracle.assert_zero_rows(tangent, sizes, offset, local)
  loss = lambda f: (lambda x, w: jnp.sum(jnp.tanh(f(x, w)) * c.astype(jnp.float32)))
  hvp = lambda f, x, w, tx, tw: jax.jvp(jax.grad(loss(f), (0, 1)), (x, w), (tx, tw))[1]
  got = jax.jit(functools.partial(hvp, f))(x, w, tx, tw)
  want = hvp(ref, *f32(x, w, tx, tw))
  for a, b in zip(got, want):
    oracle.assert_close(a, b, jnp.bfloat16, factor=4)


@pytest.mark.parametrize("offset", [None, 2])
def test_fp8_operands_through_kernels_real_size(offset):
  """fp8 operands, rhs [g, k, n]: the forward runs the native kernel (on an
  fp8 [g, n, k] copy), the gradients the dispatched bf16 kernels on converted
  copies (exact); each fp8 result is the kernel's f32 result rounded once,
  bitwise; the forward against the f32 oracle."""
  m, k, n, g = 2048, 512, 256, 8
  local = g if offset is None else 4
  sizes = _sizes(m, g, "routed")
  x, w, c = oracle.random_inputs(jax.random.key(11), [(m, k), (local, k, n), (m, n)],
                                 jnp.float32)
  x, w = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
  gs, go = jnp.asarray(sizes), None if offset is None else jnp.int32(offset)
  f = lambda x, w, out: ragdot.ragged_dot(x, w, gs, group_offset=go,
                                          preferred_element_type=out)
  bf = lambda a: a.astype(jnp.bfloat16)
  fp8 = lambda a: np.asarray(a.astype(jnp.float8_e4m3fn).astype(jnp.float32))
  _poison(16 * m * n)
  got = jax.jit(lambda x, w: f(x, w, None))(x, w)
  assert got.dtype == jnp.float8_e4m3fn
  f32 = jax.jit(lambda x, w: f(x, w, jnp.float32))(x, w)
  np.testing.assert_array_equal(fp8(got), fp8(f32))
  oracle.assert_close(f32, oracle.ref_ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32),
                                                 sizes, offset), jnp.bfloat16, factor=2)
  oracle.assert_zero_rows(got.astype(jnp.float32), sizes, offset, local)
  c = c / 64  # gradients well inside e4m3's range
  loss = lambda x, w: jnp.sum(f(x, w, jnp.bfloat16).astype(jnp.float32) * c)
  gx, gw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
  assert gx.dtype == gw.dtype == jnp.float8_e4m3fn
  ct = bf(c)  # the cotangent, rounded to the operands' compute dtype
  nk = lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
  hx = jax.jit(lambda ct, w: ragdot.ragged_dot_general(
      ct, w, gs, nk, preferred_element_type=jnp.float32, group_offset=go))(ct, bf(w))
  hw = jax.jit(lambda x, ct: ragdot.trans_ragged_dot(
      x, ct, gs, group_offset=go, num_groups=None if offset is None else local,
      preferred_element_type=jnp.float32))(bf(x), ct)
  np.testing.assert_array_equal(fp8(gx), fp8(hx))
  np.testing.assert_array_equal(fp8(gw), fp8(hw))


@pytest.mark.parametrize("m,k,n,g,offset,impl,nk", [
    (4096, 2048, 1536, 16, None, "mosaic", True), (4096, 2048, 1536, 16, 2, "mosaic", True),
    (4096, 2048, 1536, 16, 2, None, True),
    (512, 1536, 2048, 128, None, None, True),  # the bf16 table picks Triton here
    (4096, 2048, 1536, 16, 2, None, False), (512, 1536, 2048, 128, None, "mosaic", False),
])
def test_native_fp8_forward_real_size(m, k, n, g, offset, impl, nk):
  """e4m3 operands straight into wgmma (explicit, and the automatic choice),
  rhs laid out [g, n, k] (k steps of 128 one-byte columns) or [g, k, n] (the
  rows widened to bf16, the W8A16 form reading the weights as stored): against
  the f32 oracle, on NaN-poisoned memory, every row written."""
  local = g if offset is None else 4
  choice = dispatch.choose("gmm", impl, dtype=jnp.float8_e4m3fn, out_dtype=jnp.bfloat16, m=m,
                           k=k, n=n, g=local, num_groups=g, transpose_rhs=nk,
                           has_offset=offset is not None)
  assert choice.implementation == "mosaic"
  assert (choice.config is not None and choice.config.widen_rows) == (not nk)
  sizes = _sizes(m, g, "routed")
  x, w = oracle.random_inputs(jax.random.key(12), [(m, k), (local, n, k) if nk else
                                                    (local, k, n)], jnp.float32)
  x, w = x.astype(jnp.float8_e4m3fn), (w / 4).astype(jnp.float8_e4m3fn)
  gs, go = jnp.asarray(sizes), None if offset is None else jnp.int32(offset)
  dims = lax.RaggedDotDimensionNumbers((([1], [2 if nk else 1]), ([], [])), [0], [0])
  _poison(16 * m * n)
  out = jax.jit(lambda x, w: ragdot.ragged_dot_general(
      x, w, gs, dims, preferred_element_type=jnp.bfloat16, group_offset=go,
      implementation=impl))(x, w)
  want = oracle.ref_ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes, offset,
                               nk)
  oracle.assert_close(out, want, jnp.bfloat16, factor=2)
  oracle.assert_zero_rows(out, sizes, offset, local)


def _for_bf16_weights(cfg):
  """A W8A16 config fitted to SMEM for the same call on bf16 weights (twice the
  bytes a stage: a tuned 8-stage config keeps 5).  The stages do not change the
  order of the k steps' sums, so the results stay comparable bitwise."""
  fitted = mf.fit_config(cfg, jnp.bfloat16, jnp.bfloat16)
  assert fitted is not None and dataclasses.replace(fitted, num_stages=cfg.num_stages) == cfg
  return fitted


@pytest.mark.parametrize("m,k,n,g,offset,layout,nk", [
    (32768, 2048, 1536, 128, None, "routed", True),   # the bf16 swap entry's tiles
    (32768, 768, 2048, 128, 16, "routed", False),     # a shard, [g, k, n] staged through SMEM
    (512, 2048, 1536, 128, None, "routed", True),     # decode: 64-row tiles, 128-column steps
    (512, 768, 2048, 128, 64, "routed", True),        # a decode shard
    (2048, 2880, 5760, 32, None, "skewed", True),     # k % 128 != 0: 64-column steps
    (8, 2048, 1536, 128, None, "routed", True),       # one token, top-8: padded to 16 rows
    (8, 768, 2048, 128, None, "routed", False),
    (4096, 768, 2048, 128, None, "skewed", False),
])
def test_w8a16_forward_real_size(m, k, n, g, offset, layout, nk):
  """bf16 rows with e4m3 weights through the automatic choice (the swap kernel
  widening the weights in registers, or through SMEM for [g, k, n]), rhs laid
  out [g, n, k] or [g, k, n]: bitwise the same kernel's result on bf16 copies
  of the weights in the same layout (its config), the f32 oracle, NaN-poisoned
  memory, every row written, exact zeros outside a shard, bitwise repeatable."""
  local = g if offset is None else g // 8
  sizes = _sizes(m, g, layout)
  x, w = oracle.random_inputs(jax.random.key(m + k), [(m, k), (local, n, k) if nk else
                                                       (local, k, n)], jnp.float32)
  x, w = x.astype(jnp.bfloat16), (w / 4).astype(jnp.float8_e4m3fn)
  gs, go = jnp.asarray(sizes), None if offset is None else jnp.int32(offset)
  choice = dispatch.choose("gmm", None, dtype=jnp.bfloat16, rhs_dtype=jnp.float8_e4m3fn,
                           out_dtype=jnp.bfloat16, m=m, k=k, n=n, g=local, num_groups=g,
                           transpose_rhs=nk, has_offset=offset is not None)
  assert choice.implementation == "mosaic", choice.reason
  dims = lax.RaggedDotDimensionNumbers((([1], [2 if nk else 1]), ([], [])), [0], [0])
  run = jax.jit(lambda x, w: ragdot.ragged_dot_general(x, w, gs, dims, group_offset=go))
  _poison(8 * m * n)
  out = run(x, w)
  assert out.dtype == jnp.bfloat16
  cfg = mf.weight_only_config(choice.config, m, g, k, nk)
  # (registers for [g, n, k]; SMEM for [g, k, n]: the rule's 2 buffers or a tuned 1)
  assert cfg == choice.config and cfg.widen_staging in ((0,) if nk else (1, 2))
  pad = max(0, mf.MIN_SWAP_ROWS - m)  # (the kernel pads fewer rows to its smallest tile)
  same = jax.jit(lambda x, w: mf.gmm(x, w, gs, go, transpose_rhs=nk, out_dtype=jnp.bfloat16,
                                     config=_for_bf16_weights(cfg)))(
                                         jnp.pad(x, ((0, pad), (0, 0))), w.astype(jnp.bfloat16))[:m]
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(same).view(np.uint16))
  want = oracle.ref_ragged_dot(x, w.astype(jnp.float32), sizes, offset, nk)
  oracle.assert_close(out, want, jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, offset, local)
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16),
                                np.asarray(run(x, w)).view(np.uint16))


@pytest.mark.parametrize("m,k,n,g", [(32768, 2048, 1536, 128), (512, 768, 2048, 128)])
@pytest.mark.parametrize("nk,staging", [(True, 1), (True, 2), (False, 1)])
def test_w8a16_staging_variants(m, k, n, g, nk, staging):
  """The W8A16 kernel with its weight slices widened through one or two SMEM
  buffers a consumer (two: one step's wgmmas in flight while the next slice is
  widened into the other buffer) at training and decode size: bitwise its
  result on bf16 weights with the same config, every row written."""
  sizes = _sizes(m, g, "routed")
  x, w = oracle.random_inputs(jax.random.key(m + staging), [(m, k), (g, n, k) if nk else
                                                            (g, k, n)], jnp.float32)
  x, w = x.astype(jnp.bfloat16), (w / 4).astype(jnp.float8_e4m3fn)
  gs = jnp.asarray(sizes)
  cfg = mf.weight_only_config(None, m, g, k, nk)
  cfg = mf.weight_only_config(dataclasses.replace(cfg, widen_staging=staging), m, g, k, nk)
  assert cfg.widen_staging == staging
  run = jax.jit(lambda x, w: mf.gmm(x, w, gs, None, transpose_rhs=nk, out_dtype=jnp.bfloat16,
                                    config=cfg))
  _poison(8 * m * n)
  out = run(x, w)
  same = run(x, w.astype(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(same).view(np.uint16))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w.astype(jnp.float32), sizes, None, nk),
                      jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, None, g)


@pytest.mark.parametrize("m,k,n,g,offset,nk,block", [
    (32768, 2048, 1536, 128, None, True, (128, 128)),  # 128 x 128 blocks (DeepSeek-V3's)
    (4096, 768, 2048, 128, 16, False, (128, 128)),     # a shard, [g, k, n] staged
    (512, 2048, 1536, 128, None, False, (128, 128)),   # decode
    (8, 768, 2048, 128, None, True, (768, 1)),         # one token, per column
    (512, 768, 2048, 128, None, False, (768, 1)),      # decode, per column, [g, k, n] staged
    # 64-column blocks over n = 2880 (an odd count of 128-column tiles: the last tile's
    # second consumer past n), [g, n, k], a shard
    (512, 2048, 2880, 32, 4, True, (128, 64)),
])
def test_w8a16_scaled_real_size(m, k, n, g, offset, nk, block):
  """fp8 weights with block scales (``rhs_scale`` in rhs's layout): bitwise
  the same kernel's result on the dequantized bf16 weights (its config), the f32
  oracle on those weights, NaN-poisoned memory, every row written, exact zeros
  outside a shard, bitwise repeatable."""
  from ragdot import scales
  local = g if offset is None else g // 8
  bk, bn = block
  sizes = _sizes(m, g, "routed")
  rshape = (local, n, k) if nk else (local, k, n)
  sshape = (local, n // bn, k // bk) if nk else (local, k // bk, n // bn)
  x, w = oracle.random_inputs(jax.random.key(m + k + 1), [(m, k), rshape], jnp.float32)
  x, w = x.astype(jnp.bfloat16), (w / 4).astype(jnp.float8_e4m3fn)
  scale = jax.random.uniform(jax.random.key(5), sshape, jnp.float32, 0.5, 2.0) / 64
  gs, go = jnp.asarray(sizes), None if offset is None else jnp.int32(offset)
  choice = dispatch.choose("gmm", None, dtype=jnp.bfloat16, rhs_dtype=jnp.float8_e4m3fn,
                           out_dtype=jnp.bfloat16, m=m, k=k, n=n, g=local, num_groups=g,
                           transpose_rhs=nk, has_offset=offset is not None)
  assert choice.implementation == "mosaic", choice.reason
  run = jax.jit(lambda x, w, s: mf.gmm(x, w, gs, go, transpose_rhs=nk, out_dtype=jnp.bfloat16,
                                       config=choice.config,
                                       rhs_scale=s))
  _poison(8 * max(m, 64) * n)
  out = run(x, w, scale)
  deq = scales.dequantize(w, scale, jnp.bfloat16)
  cfg = _for_bf16_weights(mf.weight_only_config(choice.config, m, g, k, nk, bk))
  pad = max(0, mf.MIN_SWAP_ROWS - m)
  same = jax.jit(lambda x, w: mf.gmm(x, w, gs, go, transpose_rhs=nk, out_dtype=jnp.bfloat16,
                                     config=cfg))(jnp.pad(x, ((0, pad), (0, 0))), deq)[:m]
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(same).view(np.uint16))
  want = oracle.ref_ragged_dot(x, deq.astype(jnp.float32), sizes, offset, nk)
  oracle.assert_close(out, want, jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, offset, local)
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16),
                                np.asarray(run(x, w, scale)).view(np.uint16))


@pytest.mark.parametrize("m,k,n,g,nk,out_dtype", [
    (12, 2048, 1536, 128, False, jnp.bfloat16),  # rows the Mosaic W8A16 kernel refuses
    (512, 768, 2048, 128, True, jnp.float32),
])
def test_w8a16_scaled_through_the_api_real_size(m, k, n, g, nk, out_dtype):
  """``ragged_dot[_general](..., rhs_scale=)`` with 128 x 128 block scales where
  the automatic choice is the Triton W8A16 kernel: it scales each widened block
  (one Triton call with the scales), within one bf16 unit (f32: the sums'
  order) of Triton on the dequantized weights, the f32 oracle, every row
  written."""
  from ragdot import scales
  sizes = _sizes(m, g, "routed")
  rshape = (g, n, k) if nk else (g, k, n)
  sshape = (g, n // 128, k // 128) if nk else (g, k // 128, n // 128)
  x, w = oracle.random_inputs(jax.random.key(m + 3), [(m, k), rshape], jnp.float32)
  x, w = x.astype(jnp.bfloat16), (w / 4).astype(jnp.float8_e4m3fn)
  scale = jax.random.uniform(jax.random.key(6), sshape, jnp.float32, 0.5, 2.0) / 64
  gs = jnp.asarray(sizes)
  dims = lax.RaggedDotDimensionNumbers((([1], [2 if nk else 1]), ([], [])), [0], [0])
  call = lambda x, w, s: ragdot.ragged_dot_general(x, w, gs, dims, rhs_scale=s,
                                                   preferred_element_type=out_dtype)
  text = jax.jit(call).lower(x, w, scale).as_text()
  assert "ragdot_triton_gmm" in text
  _poison(8 * max(m, 64) * n)
  out = jax.jit(call)(x, w, scale)
  deq = scales.dequantize(w, scale, jnp.bfloat16)
  same = jax.jit(lambda x, w: ragdot.ragged_dot_general(
      x, w, gs, dims, preferred_element_type=out_dtype, implementation="triton"))(x, deq)
  if out_dtype == jnp.float32:
    np.testing.assert_allclose(np.asarray(out), np.asarray(same), rtol=1e-5, atol=1e-4)
  else:
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(same, np.float32),
                               rtol=2 ** -7, atol=0)
  oracle.assert_close(out, oracle.ref_ragged_dot(x, deq.astype(jnp.float32), sizes, None, nk),
                      jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, None, g)


@pytest.mark.parametrize("m,k,n,g,nk,out_dtype", [
    (12, 2048, 1536, 128, True, jnp.bfloat16),   # rows the TMA row tiles refuse
    (44, 768, 2048, 128, False, jnp.bfloat16),
    (512, 2048, 1536, 128, True, jnp.float32),   # an f32 result (the swap form writes 16 bits)
])
def test_w8a16_triton_real_size(m, k, n, g, nk, out_dtype):
  """Where the Mosaic W8A16 kernel refuses (rows not in whole 8-row tiles, an
  f32 result) the automatic choice is the Triton kernel widening each fp8
  weight block after its load: the f32 oracle, NaN-poisoned memory, every row
  written, bitwise repeatable, and its result on bf16 weights with the same
  config within the f32 sums' order (f32) or one unit of the last place
  (bf16): Triton compiles the two calls' sums in different orders (f32
  results differed by up to 1.5e-5 on values ~25, one bf16 element by one
  unit, 54g-h)."""
  from ragdot.backends import triton as tb
  sizes = _sizes(m, g, "routed")
  x, w = oracle.random_inputs(jax.random.key(m + k + nk), [(m, k), (g, n, k) if nk else
                                                            (g, k, n)], jnp.float32)
  x, w = x.astype(jnp.bfloat16), (w / 4).astype(jnp.float8_e4m3fn)
  gs = jnp.asarray(sizes)
  choice = dispatch.choose("gmm", None, dtype=jnp.bfloat16, rhs_dtype=jnp.float8_e4m3fn,
                           out_dtype=out_dtype, m=m, k=k, n=n, g=g, num_groups=g,
                           transpose_rhs=nk)
  assert choice.implementation == "triton" and "Triton W8A16" in choice.reason
  dims = lax.RaggedDotDimensionNumbers((([1], [2 if nk else 1]), ([], [])), [0], [0])
  _poison(8 * max(m, 64) * n)
  out = jax.jit(lambda x, w: ragdot.ragged_dot_general(
      x, w, gs, dims, preferred_element_type=out_dtype))(x, w)
  assert out.dtype == out_dtype
  same = jax.jit(lambda x, w: tb.gmm(x, w, gs, None, transpose_rhs=nk, out_dtype=out_dtype,
                                     precision=None, config=choice.config))
  same = np.asarray(same(x, w.astype(jnp.bfloat16)), np.float32)
  # (f32: the sums' order; bf16: one unit in the last place)
  tol = 1e-5 if out_dtype == jnp.float32 else 2.0 ** -7
  np.testing.assert_allclose(np.asarray(out, np.float32), same, rtol=tol,
                             atol=tol * np.abs(same).max())
  again = jax.jit(lambda x, w: ragdot.ragged_dot_general(
      x, w, gs, dims, preferred_element_type=out_dtype))(x, w)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32))
  oracle.assert_close(out, oracle.ref_ragged_dot(x, w.astype(jnp.float32), sizes, None, nk),
                      out_dtype)
  oracle.assert_zero_rows(out, sizes, None, g)


def _training_call(m, seed):
  """Routed group sizes over 128 experts, bf16 operands x [m, 768], w [128, 768,
  2048] and a cotangent, ``ragged_dot`` on them and its value and gradients
  (jitted)."""
  k, n, g = 768, 2048, 128
  sizes = _sizes(m, g, "routed")
  x, w, c = oracle.random_inputs(jax.random.key(seed), [(m, k), (g, k, n), (m, n)], jnp.bfloat16)
  gs = jnp.asarray(sizes)
  fwd = lambda x, w: ragdot.ragged_dot(x, w, gs)
  step = jax.jit(jax.value_and_grad(
      lambda x, w: jnp.sum(fwd(x, w).astype(jnp.float32) * c.astype(jnp.float32)), (0, 1)))
  return sizes, (x, w, c), fwd, step


def test_explicit_sharding_per_shard_path_on_one_gpu():
  """``ragdot.sharded`` with the kernels: on a 1 x 1 mesh of explicit axes (rows
  over "dp", experts over "ep") the call runs under shard_map with the shard's
  group sizes and group_offset; forward and both gradients bitwise equal to the
  plain call's, the forward against the f32 oracle."""
  from jax.sharding import AxisType, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  sizes, (x, w, c), fwd, step = _training_call(4000, 11)
  want_out, want = jax.jit(fwd)(x, w), step(x, w)
  mesh = jax.make_mesh((1, 1), ("dp", "ep"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    xs, ws = jax.device_put(x, P("dp")), jax.device_put(w, P("ep"))
    assert "shard_map" in str(jax.make_jaxpr(fwd)(xs, ws))
    out, got = jax.jit(fwd)(xs, ws), step(xs, ws)
  oracle.assert_close(out, oracle.np_ragged_dot(x, w, sizes, None), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_auto_sharding_over_the_gpus():
  """``ragdot.auto_sharding`` with the kernels: the tokens split over "dp" of
  an automatic mesh of every GPU present.  One GPU: the custom-partitioned call
  is inlined; two or more: each GPU runs its rows (the result keeps the split).
  Forward and dX bitwise equal to the plain call (a row's dot does not depend
  on the rows around it), dW (summed over the GPUs in bf16) against the f32
  oracle and, on one GPU, bitwise."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  gpus = len(jax.devices())
  sizes, (x, w, c), fwd, step = _training_call(8192, 12)
  want_out, (_, (want_dx, want_dw)) = jax.jit(fwd)(x, w), step(x, w)
  mesh = jax.make_mesh((gpus,), ("dp",), axis_types=(AxisType.Auto,))
  xs = jax.device_put(x, NamedSharding(mesh, P("dp")))
  _poison(4 * 8192 * 2048)
  out, (_, (dx, dw)) = jax.jit(fwd)(xs, w), step(xs, w)
  assert gpus == 1 or tuple(out.sharding.spec)[:1] == ("dp",), out.sharding
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(want_dx))
  oracle.assert_close(dw, oracle.np_trans_ragged_dot(x, c, sizes), jnp.bfloat16)
  if gpus == 1:
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(want_dw))


@pytest.mark.parametrize("shape", SHAPES[:2], ids=[f"{s[0]}x{s[1]}x{s[2]}g{s[3]}" for s in SHAPES[:2]])
def test_triton_real_sizes(shape):
  """The Pallas-Triton fallback: forward, dX (last shard) and dW at real sizes."""
  m, k, n, g, layout = shape
  sizes = _sizes(m, g, layout)
  x, w, dy = oracle.random_inputs(jax.random.key(m + 1), [(m, k), (16, k, n), (m, n)], jnp.bfloat16)
  go, gs = jnp.int32(g - 16), jnp.asarray(sizes)
  _poison(4 * m * max(n, k))
  out = jax.jit(lambda x, w: ragdot.ragged_dot(x, w, gs, group_offset=go, implementation="triton"))(x, w)
  oracle.assert_close(out, oracle.np_ragged_dot(x, w, sizes, go), jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, g - 16, 16)
  got_dx = jax.jit(lambda d, w: ragdot.ragged_dot_general(d, w, gs, DN_DX, group_offset=go, implementation="triton"))(dy, w)
  oracle.assert_close(got_dx, oracle.np_ragged_dot(dy, w, sizes, go, transpose_rhs=True), jnp.bfloat16)
  dw = jax.jit(lambda x, d: ragdot.trans_ragged_dot(x, d, gs, implementation="triton"))(x, dy)
  oracle.assert_close(dw, oracle.np_trans_ragged_dot(x, dy, sizes), jnp.bfloat16)


@pytest.mark.parametrize("layout", ["routed", "under", "skewed"])
def test_triton_dw_real_size(layout):
  """Triton dW (the partial row chunk inside the pipelined loop) at a real size,
  with rows past the groups (``under``: a missing row mask would add them to the
  last group) and skewed sizes (one- and many-chunk groups side by side):
  against the oracle, bitwise the same on a second call.  (That inf / NaN in
  other groups' rows cannot leak is the CPU tests' job.)"""
  from ragdot.backends import triton as tr  # pylint: disable=g-import-not-at-top
  m, k, n, g = 8192, 512, 384, 32
  sizes = _sizes(m, g, layout)
  x, dy = oracle.random_inputs(jax.random.key(77), [(m, k), (m, n)], jnp.bfloat16)
  gs = jnp.asarray(sizes)
  run = jax.jit(lambda x, d: tr.tgmm(x, d, gs, None, num_groups=g, out_dtype=jnp.bfloat16,
                                     precision=None))
  _poison(4 * m * max(n, k))
  got = run(x, dy)
  oracle.assert_close(got, oracle.np_trans_ragged_dot(x, dy, sizes), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(run(x, dy)))


# shard_swap: whether the call's EP=8 shard keeps swap (consumer-written zeros) rather
# than the row-major ring (docs/performance.md v41e-g, v42e-f, v43a, v44f).
@pytest.mark.parametrize("op,shape,shard_swap", [
    ("fwd", (32768, 2048, 1536, 128), False), ("dx", (32768, 2048, 1536, 128), True),
    ("dx", (32768, 768, 2048, 128), False), ("dx", (32768, 2048, 7168, 256), True),
    ("fwd", (32768, 4096, 3072, 128), False), ("fwd", (32768, 768, 2048, 128), True),
    ("dx", (16384, 768, 2048, 128), True), ("fwd", (32768, 1536, 4096, 128), True)],
                         ids=["qwen30b_gate_up_fwd", "qwen30b_gate_up_dx", "qwen30b_down_dx",
                              "deepseek_down_dx", "qwen235b_gate_up_fwd", "qwen30b_down_fwd",
                              "qwen30b_down_2k_dx", "qwen235b_down_fwd"])
@pytest.mark.parametrize("shard,layout", [(False, "routed"), (True, "routed"),
                                          (False, "skewed")],
                         ids=["all", "shard", "all-skewed"])
def test_table_swap_entries_real_size(op, shape, shard_swap, shard, layout):
  """The automatic choice on the shapes whose table entries run the swap kernel
  (Qwen3-30B: split fold, M tail; DeepSeek-V3's dX: 160-row tiles; short tiles
  of 64 / 128 rows, which skewed routing reaches): a swap config is chosen, and
  the call through ``ragdot`` (a shard call: swap with consumer-written zeros
  where ``shard_keeps_swap`` keeps it, ``shard_swap``, else the row-major ring
  the swap entry maps to)
  matches the oracle on NaN-poisoned memory, zero rows outside, bitwise repeatable."""
  m, k, n, g = shape
  local = g // 8 if shard else g
  sizes = _sizes(m, g, layout)
  choice = dispatch_choice(op, Shape("t", m, k, n, g, ep=8 if shard else 1))
  assert choice.implementation == "mosaic" and choice.config.ring
  # A shard call: swap with consumer-written zeros where shard_keeps_swap says so,
  # else the entry's row-major ring.
  assert choice.config.swap == (not shard or shard_swap), choice.reason
  assert not shard or choice.config.producer_zeros is (not shard_swap), choice.reason
  _check_dispatched_call(op, m, k, n, local, sizes, jnp.int32(local) if shard else None,
                         m + k + n + shard)


@pytest.mark.parametrize("op,shape", [
    ("fwd", (32768, 768, 2048, 128)), ("fwd", (32768, 1536, 4096, 128)),
    ("dx", (32768, 2048, 1536, 128)), ("dx", (32768, 4096, 3072, 128))],
                         ids=["qwen30b_down_fwd", "qwen235b_down_fwd", "qwen30b_gate_up_dx",
                              "qwen235b_gate_up_dx"])
@pytest.mark.parametrize("skew", [0.0, 0.5, 3.0])
@pytest.mark.parametrize("pair", [False, True], ids=["two_schedules", "pair_schedule"])
def test_gated_shard_pair_real_size(op, shape, skew, pair):
  """EP=8 shard 0 of the ~256-row-group calls whose shard runs swap or the
  row-major ring by its rows (``shard_ring_above``, v45b): routed (the fair share:
  swap runs, the ring exits), skew 0.5 and 3 (1.46x / 3.8x the share: swap exits
  on NaN-poisoned memory and the ring writes every row): the oracle, exact zeros
  outside the shard, bitwise repeatable.  ``pair``: the dispatched config, whose
  one launch builds both schedules (``pair_schedule``); else a launch each."""
  m, k, n, g = shape
  s = Shape("t", m, k, n, g, ep=8, skewed=skew > 0)
  choice = dispatch_choice(op, s)
  assert choice.config.swap and choice.config.shard_ring_above == 1.25, choice.reason
  sizes = routed_group_sizes(s, skew=skew)
  local = g // 8
  limit = mf.shard_row_limit(m, local, g, choice.config.shard_ring_above)
  assert (int(sizes[:local].sum()) > limit) == (skew > 0)
  assert choice.config.pair_schedule, choice.config
  config = None if pair else dataclasses.replace(choice.config, pair_schedule=False)
  _check_dispatched_call(op, m, k, n, local, sizes, jnp.int32(0), m + k + n + int(skew * 2),
                         config)


def _loop_twice(mode: str, f, xs):
  """``f`` over the two leading-axis elements of ``xs`` by ``mode``: "vmap",
  "map" (lax.map: a loop whose outputs are stacked in place) or "scan_sum" (a
  lax.scan summing the outputs in f32)."""
  if mode == "vmap":
    return jax.vmap(f)(xs)
  if mode == "map":
    return lax.map(f, xs)
  return lax.scan(lambda acc, x: (acc + f(x).astype(jnp.float32), None),
                  jnp.zeros(jax.eval_shape(f, xs[0]).shape, jnp.float32), xs)[0]


@pytest.mark.parametrize("kernel", ["dispatched", "swap_shard", "ring_shard", "gated_pair",
                                    "dw"])
@pytest.mark.parametrize("mode", ["vmap", "map", "scan_sum"])
def test_kernels_under_vmap_and_loops_real_size(kernel, mode):
  """Qwen3-30B down (EP=8 shard 0, routed: the gated pair runs swap and its ring
  exits) under vmap, lax.map and lax.scan over two inputs: each result bitwise
  equal to the unbatched calls (summed in f32 for the scan), nothing left NaN."""
  m, k, n, g = 32768, 768, 2048, 128
  s = Shape("t", m, k, n, g, ep=8)
  sizes = routed_group_sizes(s)
  gs, go, local = jnp.asarray(sizes), jnp.int32(0), g // 8
  xs, w, dys = oracle.random_inputs(jax.random.key(41), [(2, m, k), (local, k, n), (2, m, n)],
                                    jnp.bfloat16)
  config = dispatch_choice("fwd", s).config
  assert config.shard_ring_above == 1.25, config
  swap, ring = mf.gated_pair_configs(config, jnp.bfloat16, jnp.bfloat16)
  assert ring.producer_zeros and not ring.swap, ring
  configs = {"swap_shard": swap, "ring_shard": ring, "gated_pair": config}
  if kernel == "dispatched":
    f = lambda x: ragdot.ragged_dot(x, w, gs, group_offset=go)
  elif kernel == "dw":
    f = lambda xd: ragdot.trans_ragged_dot(xd[:, :k], xd[:, k:], gs, group_offset=go,
                                           num_groups=local)
    xs = jnp.concatenate([xs, dys], axis=2)
  else:
    f = lambda x: mf.gmm(x, w, gs, go, transpose_rhs=False, out_dtype=x.dtype,
                         config=configs[kernel])
  one = jax.jit(f)
  _poison(8 * m * n)
  got = np.asarray(jax.jit(functools.partial(_loop_twice, mode, f))(xs), np.float32)
  assert not np.isnan(got).any()
  want = [np.asarray(one(xs[i]), np.float32) for i in range(2)]
  if mode == "scan_sum":
    np.testing.assert_array_equal(got, (np.float32(0) + want[0]) + want[1])
  else:
    for i in range(2):
      np.testing.assert_array_equal(got[i], want[i], err_msg=f"element {i}")


@pytest.mark.parametrize("op,skew", [("dx", 0.0), ("fwd", 3.0), ("dx", 3.0)],
                         ids=["dx_routed", "fwd_skewed", "dx_skewed"])
@pytest.mark.parametrize("mode", ["vmap", "map"])
def test_gated_pair_in_loops_dx_and_skewed_real_size(op, skew, mode):
  """The dispatched gated shard call in stacking loops beyond the case above:
  Qwen3-30B gate_up's dX shard (swap runs, the ring exits) and both shards at 3.8x
  their fair share (the in-place ring writes every row, swap exits), under vmap and
  lax.map: each element bitwise equal to the unbatched call, nothing left NaN."""
  m, k, n, g = (32768, 2048, 1536, 128) if op == "dx" else (32768, 768, 2048, 128)
  s = Shape("t", m, k, n, g, ep=8, skewed=skew > 0)
  sizes = routed_group_sizes(s, skew=skew)
  gs, go, local = jnp.asarray(sizes), jnp.int32(0), g // 8
  assert dispatch_choice(op, s).config.shard_ring_above == 1.25
  xs, w = oracle.random_inputs(jax.random.key(43 + int(skew)),
                               [(2, m, n if op == "dx" else k), (local, k, n)], jnp.bfloat16)
  f = lambda x: ragdot.ragged_dot_general(x, w, gs, DN_DX if op == "dx" else DN_FWD,
                                          group_offset=go)
  _poison(8 * m * max(k, n))
  got = np.asarray(jax.jit(functools.partial(_loop_twice, mode, f))(xs), np.float32)
  assert not np.isnan(got).any()
  one = jax.jit(f)
  for i in range(2):
    np.testing.assert_array_equal(got[i], np.asarray(one(xs[i]), np.float32),
                                  err_msg=f"element {i}")


@pytest.mark.parametrize("op,shape", [
    ("fwd", (8192, 2048, 1536, 128)), ("dx", (8192, 768, 2048, 128)),
    ("fwd", (8192, 4096, 3072, 128)), ("dx", (16384, 2048, 7168, 256)),
    ("fwd", (8192, 2880, 5760, 128)), ("dx", (8192, 2880, 2880, 128))],
                         ids=["qwen30b_gate_up_1k_fwd", "qwen30b_down_1k_dx",
                              "qwen235b_gate_up_1k_fwd", "deepseek_down_2k_dx",
                              "gpt_oss_120b_gate_up_2k_fwd", "gpt_oss_120b_down_2k_dx"])
@pytest.mark.parametrize("layout", ["routed", "skewed"])
def test_fitted_swap_tiles_real_size(op, shape, layout):
  """The automatic choice on calls of ~64 rows per group, whose swap entries
  (borrowed, or their own for DeepSeek-V3 / gpt-oss-120b) the dispatcher fits
  to 80 + 16 rows (a split tail, no short tiles): the oracle on NaN-poisoned
  memory, bitwise repeatable; skewed routing puts most rows in a few groups
  (many tiles each) and leaves others empty."""
  m, k, n, g = shape
  sizes = _sizes(m, g, layout)
  choice = dispatch_choice(op, Shape("t", m, k, n, g))
  assert choice.implementation == "mosaic" and choice.config.swap
  assert (choice.config.swap_rows, choice.config.tail_rows) == (80, 16), choice.reason
  _check_dispatched_call(op, m, k, n, g, sizes, None, m + k + n)


@pytest.mark.parametrize("shape,shard", [
    ((4096, 2048, 7168, 32), False), ((4096, 7168, 4096, 32), False),
    ((2048, 2880, 2880, 16), False), ((2048, 2880, 5760, 16), False),
    ((2048, 2880, 2880, 16), True), ((8192, 2048, 7168, 256), False)],
                         ids=["deepseek_down_ep8_local", "deepseek_gate_up_ep8_local",
                              "gpt_oss_120b_down_ep8_local", "gpt_oss_120b_gate_up_ep8_local",
                              "gpt_oss_120b_down_ep8_local-shard", "deepseek_down_1k"])
@pytest.mark.parametrize("layout", ["routed", "skewed"])
def test_five_stage_dx_entries_real_size(shape, shard, layout):
  """The dX entries with 5 stages on 160-row swap tiles (v43c-d: the ep-local
  DeepSeek-V3 / gpt-oss-120b calls, DeepSeek-V3 down at 1024 tokens), through the
  dispatcher, whole and as a shard of half the groups (swap with consumer-written
  zeros): the oracle on NaN-poisoned memory, zero rows outside, bitwise repeatable."""
  m, k, n, g = shape
  local = g // 2 if shard else g
  sizes = _sizes(m, g, layout)
  choice = dispatch_choice("dx", Shape("t", m, k, n, g, ep=2 if shard else 1))
  cfg = choice.config
  assert choice.implementation == "mosaic" and cfg.swap and cfg.num_stages == 5, choice.reason
  assert (cfg.swap_rows, cfg.short_tile_rows, cfg.producer_zeros) == (
      160, 64, False if shard else None), choice.reason
  _check_dispatched_call("dx", m, k, n, local, sizes, jnp.int32(local) if shard else None,
                         m + k + n + shard)


# (op, (m, k, n, g, top_k), ep): the entries tuned in v44a with today's sweep.
@pytest.mark.parametrize("op,shape,ep", [
    ("fwd", (4096, 4096, 28672, 8, 2), 1), ("dx", (4096, 4096, 28672, 8, 2), 1),
    ("fwd", (4096, 4096, 28672, 8, 2), 2), ("dx", (8192, 4096, 28672, 8, 2), 1),
    ("dx", (16384, 2048, 1536, 128, 8), 1), ("dx", (16384, 2048, 1536, 128, 8), 8),
    ("dx", (16384, 768, 2048, 128, 8), 8)],
                         ids=["mixtral_1k_fwd", "mixtral_1k_dx", "mixtral_1k_fwd-shard",
                              "mixtral_2k_dx", "qwen30b_gate_up_2k_dx",
                              "qwen30b_gate_up_2k_dx-shard", "qwen30b_down_2k_dx-shard"])
@pytest.mark.parametrize("layout", ["routed", "skewed"])
def test_2048_token_entries_real_size(op, shape, ep, layout):
  """The 2048- / 4096-token entries of v44a through the dispatcher: Mixtral's
  swap tiles on 2-CTA clusters (``share_rows``; ~512 rows per group), the
  Qwen3-30B dX on 5 stages; whole and as a shard (a forward shard runs the
  row-major ring with producer zeros, a dX shard of ~128-row groups keeps swap
  with consumer-written zeros): the oracle on NaN-poisoned memory, zero rows
  outside, bitwise repeatable."""
  m, k, n, g, top_k = shape
  local = g // ep
  sizes = routed_group_sizes(Shape("t", m, k, n, g, top_k=top_k, skewed=layout == "skewed"))
  choice = dispatch_choice(op, Shape("t", m, k, n, g, top_k=top_k, ep=ep))
  cfg = choice.config
  assert choice.implementation == "mosaic" and cfg.ring, choice.reason
  if g == 8:  # Mixtral: swap with share_rows, whole; the shard its row-major ring
    assert (cfg.swap, cfg.share_rows) == ((True, True) if ep == 1 else (False, False)), choice.reason
  else:
    assert cfg.swap and cfg.num_stages == 5, choice.reason
  # zeros outside a shard: the ring's producer (forward), swap's consumers (dX)
  assert ep == 1 or cfg.producer_zeros is (op == "fwd"), choice.reason
  _check_dispatched_call(op, m, k, n, local, sizes, jnp.int32(local) if ep > 1 else None,
                         m + k + n + ep)


def _check_mosaic_gmm(cfg, shape, transpose_rhs, offset, seed):
  """mosaic_fwd.gmm with ``cfg`` at a real size on NaN-poisoned memory: against
  the f32 oracle, exact zeros outside the shard (``offset``: half the groups),
  bitwise the same on a second call."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  m, k, n, g, layout = shape
  sizes = _sizes(m, g, layout)
  local = g if offset is None else g // 2
  rshape = (local, n, k) if transpose_rhs else (local, k, n)
  x, w = oracle.random_inputs(jax.random.key(seed), [(m, k), rshape], jnp.bfloat16)
  go = None if offset is None else jnp.int32(offset)
  fn = jax.jit(lambda x, w, gs: mosaic_fwd.gmm(
      x, w, gs, go, transpose_rhs=transpose_rhs, out_dtype=jnp.bfloat16, config=cfg))
  _poison(4 * m * max(n, k))
  out = fn(x, w, jnp.asarray(sizes))
  oracle.assert_close(out, oracle.np_ragged_dot(x, w, sizes, go, transpose_rhs=transpose_rhs),
                      jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, offset, local)
  again = fn(x, w, jnp.asarray(sizes))
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(again).view(np.uint16))


RING_SHAPES = SHAPES + [(8192, 1024, 960, 32, "routed")]  # ~256 rows per group: tails
_PZ = dict(producer_zeros=True)  # the producer writes the shard's zero rows
_CZ = dict(producer_zeros=False)  # the consumers do, after the ring


def test_auto_choice_with_n_past_a_128_column_box():
  """The automatic forward on 32768 x 2048 x 7104 with 256 experts (n % 128 == 64):
  DeepSeek-V3's entry, the ring with 16-row tails 128 columns wide, whose 1-row
  tail stores in the last n tile ran past n (v25c); every element checked."""
  m, k, n, g = 32768, 2048, 7104, 256
  choice = dispatch_choice("fwd", Shape("t", m, k, n, g))
  assert choice.implementation == "mosaic" and choice.config.ring and choice.config.tail_rows
  sizes = _sizes(m, g, "routed")
  x, w = oracle.random_inputs(jax.random.key(71), [(m, k), (g, k, n)], jnp.bfloat16)
  run = jax.jit(lambda x, w: ragdot.ragged_dot(x, w, jnp.asarray(sizes)))
  _poison(4 * m * n)
  out = run(x, w)
  oracle.assert_close(out, oracle.np_ragged_dot(x, w, sizes), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(run(x, w)))


@pytest.mark.parametrize("shape", RING_SHAPES,
                         ids=[f"{s[0]}x{s[1]}x{s[2]}g{s[3]}-{s[4]}" for s in RING_SHAPES])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
@pytest.mark.parametrize("tail_rows,offset,zero_lead,strips,fields", [
    (16, None, None, 1, {}), (32, 8, None, 1, _CZ), (0, None, None, 1, {}), (0, 8, 12, 1, {}),
    (16, 8, None, 4, _CZ),
    (0, 8, None, 1, dict(_PZ, epilogue_split=4)),
    (16, 8, None, 1, dict(_PZ, epilogue_split=4)),
    (0, 8, None, 1, dict(_PZ, zero_box_rows=8)),
    (0, 8, None, 1, dict(_PZ, epilogue_split=4, num_stages=4)),
    (0, 8, None, 1, dict(_PZ, zero_box_rows=8, num_stages=4)),  # SMEM full to the byte
    # automatic: 3 stages leave room for a 64 x 128 zero buffer beside 128-column chunks
    (0, 8, None, 1, dict(producer_zeros=None)),
    # the short CTAs' front of zero boxes, written after their loads
    (0, 8, None, 1, dict(_PZ, epilogue_split=4, num_stages=4, zero_front=256)),
], ids=["t16", "t32-shard", "t0", "t0-shard-lead12", "t16-shard-strips4",
        "t0-shard-producer-zeros", "t16-shard-producer-zeros", "t0-shard-producer-zeros-8-rows",
        "t0-shard-producer-zeros-4-stages", "t0-shard-producer-zeros-8-rows-4-stages",
        "t0-shard-producer-zeros-auto", "t0-shard-zero-front"])
def test_ring_real_sizes(shape, transpose_rhs, tail_rows, offset, zero_lead, strips, fields):
  """The ring forward / dX (mosaic_fwd_ring), with and without folded tails, a
  shard whose short CTAs take zero items first (or whose producers write the
  zero rows: ``fields``, replacing the 3-stage config's), and strips of n tiles."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  cfg = mosaic_fwd.MosaicFwdConfig(128, 256, 64, 3, num_compute_wgs=2, epilogue_split=2,
                                   ring=True, tail_rows=tail_rows, zero_lead=zero_lead,
                                   grid_minor_dim=int(strips > 1), grid_tile_width=strips)
  _check_mosaic_gmm(dataclasses.replace(cfg, **fields), shape, transpose_rhs, offset,
                    seed=sum(shape[:3]))


SWAP_SHAPES = SHAPES + [(32768, 2048, 1536, 128, "routed")]  # ~256 rows per group: tails


@pytest.mark.parametrize("shape", SWAP_SHAPES,
                         ids=[f"{s[0]}x{s[1]}x{s[2]}g{s[3]}-{s[4]}" for s in SWAP_SHAPES])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
@pytest.mark.parametrize("tail_rows,stages,offset,tail", [
    (0, 4, None, "fold"), (32, 4, None, "fold"), (64, 3, 8, "fold"), (16, 4, 8, "fold"),
    (32, 4, None, "split"), (64, 3, 8, "split"), (32, 4, None, "m"), (16, 4, 8, "m"),
    (8, 4, None, "m")],
                         ids=["t0", "t32", "t64-shard", "t16-shard", "t32-split",
                              "t64-shard-split", "t32-m", "t16-shard-m", "t8-m"])
def test_swap_real_sizes(shape, transpose_rhs, tail_rows, stages, offset, tail):
  """The forward / dX with the rows on wgmma's N axis (mosaic_fwd_swap): folded
  tails of up to 64 rows (as more N, two halves, or row-major on wgmma's M),
  shards whose zero rows the consumers write."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  cfg = mosaic_fwd.MosaicFwdConfig(128, 128, 64, stages, num_compute_wgs=2, ring=True,
                                   swap=True, tail_rows=tail_rows, producer_zeros=False,
                                   tail_split=tail == "split", tail_on_m=tail == "m")
  _check_mosaic_gmm(cfg, shape, transpose_rhs, offset, seed=sum(shape[:3]) + 1)


@pytest.mark.parametrize("shape", SWAP_SHAPES,
                         ids=[f"{s[0]}x{s[1]}x{s[2]}g{s[3]}-{s[4]}" for s in SWAP_SHAPES])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
@pytest.mark.parametrize("tail_rows,offset,tail", [
    (32, None, "split"), (16, 8, "fold"), (8, None, "fold"), (32, None, "m"), (16, 8, "split")],
                         ids=["t32-split", "t16-shard", "t8", "t32-m", "t16-shard-split"])
def test_swap_swizzled_staging_real_sizes(shape, transpose_rhs, tail_rows, offset, tail):
  """Swap tiles staged through a swizzled buffer (swizzle_staging): TMA stores of
  1-64 rows starting at any row of the buffer, a shard's zero rows; every output
  row checked on NaN-poisoned memory."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  cfg = mosaic_fwd.MosaicFwdConfig(128, 128, 64, 4, num_compute_wgs=2, ring=True,
                                   swap=True, tail_rows=tail_rows, producer_zeros=False,
                                   tail_split=tail == "split", tail_on_m=tail == "m",
                                   swizzle_staging=True)
  _check_mosaic_gmm(cfg, shape, transpose_rhs, offset, seed=sum(shape[:3]) + 64)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
@pytest.mark.parametrize("swap_rows,tail_rows,offset,tail,short", [
    (160, 0, None, "fold", 0), (144, 16, 8, "m", 0), (144, 16, None, "split", 0),
    (160, 0, None, "fold", 128), (176, 0, 8, "fold", 128)],
                         ids=["r160", "r144-t16-shard-m", "r144-t16-split", "r160-s128",
                              "r176-s128-shard"])
def test_swap_rows_real_size(transpose_rhs, swap_rows, tail_rows, offset, tail, short):
  """Swap tiles of fewer than 256 rows on groups of ~128 rows (DeepSeek-V3's
  layout), folded tails, a shard, 128-row short tiles for the groups that fit
  them; NaN-poisoned memory."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  cfg = mosaic_fwd.MosaicFwdConfig(128, 128, 64, 4, num_compute_wgs=2, ring=True, swap=True,
                                   swap_rows=swap_rows, tail_rows=tail_rows,
                                   producer_zeros=False, tail_split=tail == "split",
                                   tail_on_m=tail == "m", swizzle_staging=bool(short),
                                   short_tile_rows=short)
  _check_mosaic_gmm(cfg, (16384, 2048, 1792, 128, "routed"), transpose_rhs, offset,
                    seed=swap_rows + tail_rows + short)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
@pytest.mark.parametrize("short,tail_rows,offset,tail,kn", [
    (128, 32, None, "split", (2048, 1536)), (64, 32, None, "split", (2048, 1536)),
    (128, 32, 8, "m", (2048, 1536)), (64, 0, None, "fold", (2048, 1536)),
    (64, 32, None, "split", (768, 2048))],
                         ids=["s128-t32-split", "s64-t32-split", "s128-t32-shard-m", "s64-t0",
                              "s64-t32-split-down"])
def test_swap_short_tiles_real_size(transpose_rhs, short, tail_rows, offset, tail, kn):
  """Swap tiles of at most 64 / 128 rows run as wgmmas of that N
  (short_tile_rows) on Qwen3-30B gate_up's (or down's) size with skewed routing
  (many groups far below 256 rows, a few above 1000), swizzled staging, a shard;
  NaN-poisoned memory, every element checked."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  cfg = mosaic_fwd.MosaicFwdConfig(128, 128, 64, 4, num_compute_wgs=2, ring=True, swap=True,
                                   tail_rows=tail_rows, producer_zeros=False,
                                   tail_split=tail == "split", tail_on_m=tail == "m",
                                   swizzle_staging=True, short_tile_rows=short)
  _check_mosaic_gmm(cfg, (32768, *kn, 128, "skewed"), transpose_rhs, offset,
                    seed=short + tail_rows + kn[0])


@pytest.mark.parametrize("variant", ["1wg", "2wg", "2wg_chained", "2wg_split_n",
                                     "2wg_split_n_ntail", "1wg_ntail", "2wg_ntail"])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
def test_mosaic_fwd_both_bodies_real_size(variant, transpose_rhs):
  """Both kernel bodies (1 and 2 compute warpgroups; the latter skipping the
  wgmmas of empty 64-row halves, per tile or with one pipeline through each
  CTA's tiles, or with 64-row tiles split by columns, also with a last n tile
  whose second half lies past n; ``ntail`` without split_n: an epilogue chunk
  that runs 128 (1wg, n 640) or 64 (2wg, n 704) columns past n, whose 1-row
  stores go in 64-column pieces, v25c) on group-aligned tiles, with a shard."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  wgs = 1 if variant.startswith("1wg") else 2
  chained, split_n = variant.startswith("2wg_chained"), variant.startswith("2wg_split_n")
  n = {"2wg_ntail": 704}.get(variant, 640 if variant.endswith("ntail") else 768)
  m, k, g = 4096, 1024, 64
  sizes = _sizes(m, g, "routed")
  cfg = mosaic_fwd.MosaicFwdConfig(block_m=64 if split_n else 64 * wgs, block_n=256,
                                   block_k=64, num_stages=4, grid_tile_width=4,
                                   num_compute_wgs=wgs,
                                   epilogue_split=2 if wgs == 2 else 1,
                                   delay_release=0 if chained else 1,
                                   pipeline_across_tiles=chained,
                                   skip_empty_halves=wgs == 2 and not split_n,
                                   split_n=split_n)
  local, offset = 24, 20
  wshape = (local, n, k) if transpose_rhs else (local, k, n)
  x, w = oracle.random_inputs(jax.random.key(wgs + 2 * split_n), [(m, k), wshape], jnp.bfloat16)
  go = jnp.int32(offset)
  fn = jax.jit(lambda x, w, gs: mosaic_fwd.gmm(x, w, gs, go, transpose_rhs=transpose_rhs,
                                               out_dtype=jnp.bfloat16, config=cfg))
  _poison(4 * m * n)
  out = fn(x, w, jnp.asarray(sizes))
  oracle.assert_close(out, oracle.np_ragged_dot(x, w, sizes, go, transpose_rhs=transpose_rhs),
                      jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, offset, local)


@pytest.mark.parametrize("kernel", ["fwd", "dw", "dw_banded"])
def test_two_ctas_per_sm_real_size(kernel):
  """The ctas_per_sm=2 tune candidates write every element, on hardware (dW with
  whole-tile and with banded masking in the one-warpgroup body)."""
  from ragdot.backends import mosaic_dw, mosaic_fwd  # pylint: disable=g-import-not-at-top
  m, k, n, g = 4096, 1024, 768, 64
  sizes = _sizes(m, g, "routed")
  gs = jnp.asarray(sizes)
  if kernel == "fwd":
    cfg = mosaic_fwd.MosaicFwdConfig(64, 256, 32, 4, grid_tile_width=4, epilogue_split=2,
                                     ctas_per_sm=2)
    x, w = oracle.random_inputs(jax.random.key(3), [(m, k), (g, k, n)], jnp.bfloat16)
    _poison(4 * m * n)
    out = jax.jit(lambda x, w: mosaic_fwd.gmm(x, w, gs, None, transpose_rhs=False,
                                              out_dtype=jnp.bfloat16, config=cfg))(x, w)
    oracle.assert_close(out, oracle.np_ragged_dot(x, w, sizes), jnp.bfloat16)
  else:
    cfg = mosaic_dw.MosaicDwConfig(block_m=64, block_k=128, block_n=128, num_stages=2,
                                   ctas_per_sm=2, banded_mask=kernel == "dw_banded")
    x, dy = oracle.random_inputs(jax.random.key(4), [(m, k), (m, n)], jnp.bfloat16)
    _poison(4 * g * k * n)
    out = jax.jit(lambda x, d: mosaic_dw.tgmm(x, d, gs, None, num_groups=g,
                                              out_dtype=jnp.bfloat16, config=cfg))(x, dy)
    oracle.assert_close(out, oracle.np_trans_ragged_dot(x, dy, sizes), jnp.bfloat16)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


def _fields(words):
  """``["flag", "name=3"]`` -> ``{"flag": True, "name": 3}``."""
  return {w.split("=")[0]: int(w.split("=")[1]) if "=" in w else True for w in words}


@pytest.mark.parametrize(
    "bm,bk,bn,stages,k,out_dtype,mask",
    [(64, 128, 256, 3, 1024, jnp.bfloat16, "banded_mask"),  # the default
     (64, 128, 256, 3, 1024, jnp.bfloat16, None),  # ... masking whole tiles
     (64, 256, 128, 3, 1024, jnp.bfloat16, None),
     (64, 128, 256, 2, 1024, jnp.float32, "banded_mask"),  # f32 output, whole staging tile
     (128, 128, 128, 3, 1024, jnp.bfloat16, "banded_mask"),
     (64, 256, 128, 3, 320, jnp.bfloat16, None),  # partial k tile; consumer 1's half past k
     (64, 128, 64, 4, 1024, jnp.bfloat16, "banded_mask"),  # rhs in 32-row bands
     (64, 128, 192, 3, 1024, jnp.bfloat16, "banded_mask"),  # 192 columns in 64-column slices
     # two 128 x 192 accumulators (a 256 x 192 item), its epilogue in 64-column chunks
     (64, 256, 192, 3, 1024, jnp.bfloat16, "banded_mask epilogue_split=3"),
     # f32 output staged in two 128-column chunks, room for a third stage: the
     # default for f32 output
     (64, 128, 256, 3, 1024, jnp.float32, "banded_mask epilogue_split=2"),
     # consumers taking alternate items whole: 128 x 128, and 64 x 256 (f32)
     (64, 128, 128, 6, 1024, jnp.bfloat16, "banded_mask pingpong epilogue_split=2"),
     (64, 64, 256, 3, 1024, jnp.float32, "banded_mask pingpong epilogue_split=2"),
     # ... 128 x 192 and 192 x 128 (192 accumulator registers per consumer thread)
     (64, 128, 192, 4, 768, jnp.bfloat16, "banded_mask pingpong epilogue_split=3"),
     (64, 128, 192, 4, 768, jnp.float32, "banded_mask pingpong epilogue_split=3"),  # f32 staging
     (64, 192, 128, 4, 768, jnp.bfloat16, "banded_mask pingpong epilogue_split=2"),
     # ... 128 x 192 in 5 stages, its epilogue in 64 x 64 chunks
     (64, 128, 192, 5, 768, jnp.bfloat16,
      "banded_mask pingpong epilogue_split=3 epilogue_rows=64"),
     # ... with a fourth warpgroup masking the boundary stages
     (64, 128, 128, 6, 1024, jnp.bfloat16, "banded_mask pingpong epilogue_split=2 mask_warpgroup"),
     # ... 128 x 192 with two staging buffers per consumer
     (64, 128, 192, 4, 768, jnp.bfloat16,
      "banded_mask pingpong epilogue_split=3 epilogue_buffers=2"),
     # ... beside 128 x 192 accumulators (a smaller producer and masker)
     (64, 128, 192, 4, 768, jnp.bfloat16, "banded_mask pingpong epilogue_split=3 mask_warpgroup"),
     # ... nothing masked: end rows from the side buffer, tails in TMA pieces
     (64, 128, 192, 4, 768, jnp.bfloat16,
      "pingpong epilogue_split=3 epilogue_buffers=2 side_rows"),
     (64, 128, 128, 6, 1024, jnp.bfloat16, "pingpong epilogue_split=2 side_rows"),
     (64, 128, 256, 3, 1024, jnp.float32, "epilogue_split=2 side_rows"),
     # ... 192 x 128 (Qwen3-30B down's k = 768 in whole tiles), two buffers of 64 x 64
     # epilogue chunks (the table's entry for that shape)
     (64, 192, 128, 4, 768, jnp.bfloat16,
      "pingpong epilogue_split=2 epilogue_rows=64 epilogue_buffers=2 side_rows"),
     (64, 192, 128, 4, 768, jnp.float32,  # the same entry with f32 output (it fits)
      "pingpong epilogue_split=2 epilogue_rows=64 epilogue_buffers=2 side_rows"),
     # ... 128 x 192 the same way (the tuner's Qwen3-30B / 235B gate_up entries, v35b)
     (64, 128, 192, 4, 768, jnp.bfloat16,
      "pingpong epilogue_split=3 epilogue_rows=64 epilogue_buffers=2 side_rows"),
     # ... in 5 stages with one buffer (the H100 table's entries, v69)
     (64, 128, 192, 5, 768, jnp.bfloat16, "pingpong epilogue_split=3 epilogue_rows=64 side_rows"),
     (64, 192, 128, 5, 768, jnp.bfloat16, "pingpong epilogue_split=2 epilogue_rows=64 side_rows"),
     # ... in 5 stages beside two buffers of 64 x 32 chunks (64-byte swizzle), and 32-column
     # chunks of an f32 output (128-byte swizzle) in 4 stages
     (64, 128, 192, 5, 768, jnp.bfloat16,
      "pingpong epilogue_split=6 epilogue_rows=64 epilogue_buffers=2 side_rows"),
     (64, 192, 128, 5, 768, jnp.bfloat16,
      "pingpong epilogue_split=4 epilogue_rows=64 epilogue_buffers=2 side_rows"),
     (64, 128, 192, 4, 768, jnp.float32,
      "pingpong epilogue_split=6 epilogue_rows=64 epilogue_buffers=2 side_rows"),
     # ... what fit_config makes of 5- and 6-stage table rings for an f32 output (v70)
     (64, 128, 192, 5, 768, jnp.float32, "pingpong epilogue_split=6 epilogue_rows=64 side_rows"),
     (64, 192, 128, 5, 768, jnp.float32, "pingpong epilogue_split=4 epilogue_rows=64 side_rows"),
     (64, 128, 128, 6, 1024, jnp.float32, "banded_mask pingpong epilogue_split=4 mask_warpgroup")],
    ids=["default", "whole_tile_mask", "256x128", "f32_2_stages",
         "bm128_banded", "partial_k", "bn64_banded", "bn192_banded", "256x192",
         "f32_split_3_stages",
         "pingpong", "pingpong_64x256_f32", "pingpong_128x192", "pingpong_128x192_f32",
         "pingpong_192x128", "pingpong_128x192_rows64", "pingpong_masker",
         "pingpong_128x192_2_buffers", "pingpong_masker_128x192",
         "pingpong_128x192_side_rows", "pingpong_side_rows", "shared_side_rows_f32",
         "pingpong_192x128_side_rows", "pingpong_192x128_side_rows_f32",
         "pingpong_128x192_rows64_2_buffers_side_rows",
         "pingpong_128x192_5_stages_side_rows", "pingpong_192x128_5_stages_side_rows",
         "pingpong_128x192_5_stages_32_columns", "pingpong_192x128_5_stages_32_columns",
         "pingpong_128x192_32_columns_f32", "pingpong_128x192_5_stages_32_columns_f32",
         "pingpong_192x128_5_stages_32_columns_f32", "pingpong_masker_6_stages_32_columns_f32"])
def test_mosaic_dw_ring_across_items_real_size(bm, bk, bn, stages, k, out_dtype, mask):
  """The warp-specialized dW with one ring of stages across items, on hardware:
  every group's tile written (NaN-poisoned memory), empty groups zero, a shard,
  and a shard of 2 groups (fewer items than CTAs: idle CTAs)."""
  from ragdot.backends import mosaic_dw  # pylint: disable=g-import-not-at-top
  m, n, g = 4096, 768, 64
  sizes = _sizes(m, g, "routed")
  sizes[6] += sizes[5]  # an empty group (its rows go to the next one)
  sizes[5] = 0
  gs = jnp.asarray(sizes)
  cfg = mosaic_dw.MosaicDwConfig(block_m=bm, block_k=bk, block_n=bn, num_stages=stages,
                                 num_compute_wgs=2, pipeline_across_items=True,
                                 **_fields((mask or "").split()))
  x, dy = oracle.random_inputs(jax.random.key(5), [(m, k), (m, n)], jnp.bfloat16)
  for offset, local in [(None, g), (20, 24), (4, 2)]:
    go = None if offset is None else jnp.int32(offset)
    _poison(4 * g * k * n)
    out = jax.jit(lambda x, d: mosaic_dw.tgmm(x, d, gs, go, num_groups=local,
                                              out_dtype=out_dtype, config=cfg))(x, dy)
    want = oracle.np_trans_ragged_dot(x, dy, sizes, offset, local)
    oracle.assert_close(out, want, out_dtype)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


@pytest.mark.parametrize("fields", [
    dict(block_k=128, block_n=128, num_stages=3),
    dict(block_k=128, block_n=128, num_stages=3, num_compute_wgs=2, pipeline_across_items=True,
         banded_mask=True, pingpong=True),
    dict(block_k=256, block_n=128, num_stages=3, num_compute_wgs=2, pipeline_across_items=True)],
                         ids=["1wg", "pingpong", "2wg_256"])
def test_mosaic_dw_full_width_boxes_past_k(fields):
  """dW tiles as wide as the output (n = block_n = 128) on k = 2880, whose last k
  tile runs 64 rows past k: every element of every expert.  (From a plain SMEM
  buffer such a box was not clipped at k, v25d; dW's swizzle-tiled staging is.)"""
  from ragdot.backends import mosaic_dw  # pylint: disable=g-import-not-at-top
  m, k, n, g = 8192, 2880, 128, 32
  sizes = _sizes(m, g, "routed")
  cfg = mosaic_dw.MosaicDwConfig(block_m=64, **fields)
  x, dy = oracle.random_inputs(jax.random.key(13), [(m, k), (m, n)], jnp.bfloat16)
  run = jax.jit(lambda x, d: mosaic_dw.tgmm(x, d, jnp.asarray(sizes), None, num_groups=g,
                                            out_dtype=jnp.bfloat16, config=cfg))
  _poison(4 * g * k * n)
  out = run(x, dy)
  oracle.assert_close(out, oracle.np_trans_ragged_dot(x, dy, sizes), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(run(x, dy)))


@pytest.mark.parametrize("m,g,g_local,offset,layout", [
    (32768, 128, 128, None, "routed"),
    (32768, 128, 16, 0, "routed"),
    (32768, 128, 16, 112, "skewed"),
    (512, 128, 128, None, "routed"),        # decode
    (4000, 256, 32, 240, "under"),          # shard partly past G, rows past the sum
    (2048, 16, 16, None, "all_zero"),
    (4096, 64, 24, -5, "negative"),         # shard starting before group 0, negative sizes
    (4096, 64, 64, None, "over"),           # sizes summing past m
    (65536, 2000, 600, 1500, "routed"),     # one tile per program, a 2-step prefix loop
])
@pytest.mark.parametrize("block_m", [64, 128, 256])
@pytest.mark.parametrize("tail_rows", [0, 32])
def test_schedule_kernel_equals_xla_builders_real_sizes(m, g, g_local, offset, layout, block_m,
                                                       tail_rows):
  """The compiled Triton schedule kernels (not their interpreter) against metadata's XLA ops."""
  from ragdot import metadata as md
  from ragdot.backends import triton_schedule as ts

  if layout in ("negative", "over"):
    rng = np.random.default_rng(1)
    raw = rng.multinomial(m + (m // 3 if layout == "over" else 0), np.ones(g) / g)
    if layout == "negative":
      raw[rng.integers(g, size=5)] = -7
    sizes = jnp.asarray(raw.astype(np.int32))
  else:
    sizes = jnp.asarray(_sizes(m, g, layout))
  go = None if offset is None else jnp.int32(offset)
  tiles, scalars = jax.jit(lambda s, o: ts.build(s, o, m=m, num_local=g_local, block_m=block_m,
                                                 tail_rows=tail_rows))(sizes, go)
  want_tiles, want_scalars = md.flat_schedule(sizes, go, m, g_local, block_m, tail_rows=tail_rows)
  want_tiles = np.asarray(want_tiles).reshape(4, -1)
  np.testing.assert_array_equal(np.asarray(tiles).reshape(4, -1)[:, :want_tiles.shape[1]],
                                want_tiles)
  np.testing.assert_array_equal(np.asarray(scalars)[:6], np.asarray(want_scalars))
  # The dW kernel's bounds: group_bounds, the 8-row-aligned first block, block counts.
  got = jax.jit(lambda s, o: ts.build_bounds(s, o, m=m, num_local=g_local, block_m=block_m))(
      sizes, go)
  for g_arr, want in zip(got, md.row_blocks(sizes, go, m, g_local, block_m)):
    np.testing.assert_array_equal(np.asarray(g_arr)[:g_local], np.asarray(want))


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
@pytest.mark.parametrize("kn,tail_rows,offset,tail,short,layout", [
    ((768, 2048), 32, None, "split", 64, "routed"), ((2048, 1536), 32, None, "split", 128, "routed"),
    ((2048, 1536), 16, 8, "m", 0, "routed"), ((768, 1920), 0, None, "fold", 0, "routed"),
    ((2048, 1536), 32, None, "split", 128, "skewed")],
                         ids=["down-t32-split-s64", "gate_up-t32-split-s128", "gate_up-t16-shard-m",
                              "odd-n-tiles-t0", "gate_up-skewed"])
def test_swap_share_rows_real_size(transpose_rhs, kn, tail_rows, offset, tail, short, layout):
  """Swap tiles on 2-CTA clusters that share the tile's rows by TMA multicast
  (share_rows): folded tails, short tiles, a shard, an odd count of n tiles (the
  last pair's second CTA computes and stores nothing); NaN-poisoned memory."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  cfg = mosaic_fwd.MosaicFwdConfig(128, 128, 64, 4, num_compute_wgs=2, ring=True, swap=True,
                                   tail_rows=tail_rows, producer_zeros=False,
                                   tail_split=tail == "split", tail_on_m=tail == "m",
                                   swizzle_staging=True, short_tile_rows=short,
                                   share_rows=True)
  _check_mosaic_gmm(cfg, (32768, *kn, 128, layout), transpose_rhs, offset,
                    seed=kn[0] + kn[1] + tail_rows + short)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dx"])
@pytest.mark.parametrize("kn,offset,layout", [((768, 2048), None, "routed"),
                                              ((2048, 1536), 8, "routed"),
                                              ((2048, 1536), None, "skewed")],
                         ids=["down", "gate_up-shard", "gate_up-skewed"])
def test_release_each_step_real_size(transpose_rhs, kn, offset, layout):
  """The table's swap layout (split fold, short tiles, share_rows clusters) with
  ``delay_release=0`` (each step's wgmmas waited for and its stage released at
  once; a release ahead of its wgmmas would let the producer overwrite operands
  still being read): NaN-poisoned memory, against the oracle, bitwise
  repeatable."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  cfg = mosaic_fwd.MosaicFwdConfig(128, 128, 64, 4, num_compute_wgs=2, ring=True, swap=True,
                                   tail_rows=32, producer_zeros=False, tail_split=True,
                                   swizzle_staging=True, short_tile_rows=64,
                                   share_rows=True, delay_release=0)
  _check_mosaic_gmm(cfg, (32768, *kn, 128, layout), transpose_rhs, offset,
                    seed=kn[0] + kn[1] + 5)


@pytest.mark.parametrize("shape,shard", [((32768, 2048, 1536, 128), None),
                                         ((32768, 768, 2048, 128), (8, 64)),
                                         ((32768, 2048, 7168, 256), (64, 32))],
                         ids=["qwen30b_gate_up", "qwen30b_down_shard", "deepseek_down_shard"])
def test_dw_release_each_step_real_size(shape, shard):
  """The dispatcher's dW ring (pingpong 128 x 192 on the Qwen shapes, the shared
  128 x 256 ring on DeepSeek-V3) with ``delay_release=0``: each step's wgmma
  waited for and its stage released at once (a release ahead of its wgmma would
  let the producer overwrite operands still being read).  NaN-poisoned memory,
  against the oracle, bitwise repeatable.  (DeepSeek-V3 as a 32-expert shard:
  the host oracle of all 256 experts' 15 GB f32 gradient crashed a test worker,
  v38e.)"""
  from ragdot.backends import mosaic_dw  # pylint: disable=g-import-not-at-top
  m, k, n, g = shape
  offset, local = (None, g) if shard is None else shard
  sizes = _sizes(m, g, "routed")
  choice = dispatch_choice("dw", Shape("t", m, k, n, g))
  assert choice.implementation == "mosaic" and choice.config.pipeline_across_items
  cfg = dataclasses.replace(choice.config, delay_release=0)
  x, dy = oracle.random_inputs(jax.random.key(m + k + n), [(m, k), (m, n)], jnp.bfloat16)
  go = None if offset is None else jnp.int32(offset)
  fn = jax.jit(lambda x, d, gs: mosaic_dw.tgmm(x, d, gs, go, num_groups=local,
                                              out_dtype=jnp.bfloat16, config=cfg))
  _poison(4 * g * k * n)
  out = fn(x, dy, jnp.asarray(sizes))
  oracle.assert_close(out, oracle.np_trans_ragged_dot(x, dy, sizes, go, local), jnp.bfloat16)
  again = fn(x, dy, jnp.asarray(sizes))
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(again).view(np.uint16))


def _assert_dw_variant_bitwise(x, dy, sizes, shard, g, base, variant) -> None:
  """``mosaic_dw.tgmm`` with config ``variant`` gives ``base``'s result bitwise and
  matches the f32 oracle (each call on NaN-poisoned memory); ``shard``: None or
  (group_offset, local groups)."""
  from ragdot.backends import mosaic_dw  # pylint: disable=g-import-not-at-top
  offset, local = (None, g) if shard is None else shard
  go = None if offset is None else jnp.int32(offset)
  outs = []
  for cfg in (base, variant):
    fn = jax.jit(lambda x, d, gs, cfg=cfg: mosaic_dw.tgmm(x, d, gs, go, num_groups=local,
                                                        out_dtype=jnp.bfloat16, config=cfg))
    _poison(4 * g * x.shape[1] * dy.shape[1])
    outs.append(np.asarray(fn(x, dy, jnp.asarray(sizes))).view(np.uint16))
  oracle.assert_close(outs[1].view(jnp.bfloat16), oracle.np_trans_ragged_dot(
      x, dy, sizes, go, local), jnp.bfloat16)
  assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("shape,shard", [((32768, 2048, 1536, 128), None),
                                         ((32768, 768, 2048, 128), (8, 64)),
                                         ((4096, 1088, 1024, 16), None)],
                         ids=["qwen30b_gate_up", "qwen30b_down_shard", "k_cut"])
@pytest.mark.parametrize("variant", [dict(lsu_store=True), dict(group_interleave=2)],
                         ids=["lsu_store", "group_interleave"])
def test_dw_variant_real_size(shape, shard, variant):
  """The dispatcher's dW ring with ``lsu_store`` (epilogue chunks stored by the
  consumer's threads; the last case's 128-row chunks cut at k keep TMA) or with its
  items dealt two groups at a time: bitwise the table config's result, against the
  oracle, NaN-poisoned memory."""
  m, k, n, g = shape
  sizes = _sizes(m, g, "routed")
  choice = dispatch_choice("dw", Shape("t", m, k, n, g))
  assert choice.implementation == "mosaic" and choice.config.num_compute_wgs == 2
  base = choice.config
  if k % 128:  # whole 128-row chunks (the table's 64-row ones are never cut at k)
    base = dataclasses.replace(base, block_k=128, block_n=128, epilogue_rows=None,
                               epilogue_split=2, mask_warpgroup=False, side_rows=False,
                               num_stages=3, epilogue_buffers=1)
  x, dy = oracle.random_inputs(jax.random.key(m + k + n + 1), [(m, k), (m, n)], jnp.bfloat16)
  _assert_dw_variant_bitwise(x, dy, sizes, shard, g, base, dataclasses.replace(base, **variant))


@pytest.mark.parametrize("shape,shard,layout", [
    ((32768, 2048, 1536, 128), None, "routed"), ((32768, 768, 2048, 128), (8, 64), "routed"),
    ((32768, 2048, 1536, 128), None, "skewed"), ((8192, 768, 2048, 128), None, "under")],
    ids=["qwen30b_gate_up", "qwen30b_down_shard", "qwen30b_gate_up_skewed", "rows_past_groups"])
def test_dw_side_gather_kernel_real_size(shape, shard, layout, monkeypatch):
  """The side buffers from the Pallas-Triton kernel (``side_gather_kernel``, on by
  default) equal the XLA gathers bitwise, and the dispatcher's dW ring with them
  gives the result of the ring with XLA's gathers bitwise, against the oracle, on
  NaN-poisoned memory."""
  from ragdot.backends import mosaic_dw, triton_side_rows  # pylint: disable=g-import-not-at-top
  m, k, n, g = shape
  sizes = _sizes(m, g, layout)
  choice = dispatch_choice("dw", Shape("t", m, k, n, g))
  assert choice.implementation == "mosaic" and choice.config.side_rows
  x, dy = oracle.random_inputs(jax.random.key(m + k + n + 2), [(m, k), (m, n)], jnp.bfloat16)
  ends = np.minimum(np.cumsum(sizes), m).astype(np.int32)
  starts = np.concatenate([[0], ends[:-1]]).astype(np.int32)
  want = jax.jit(mosaic_dw.side_buffers)(x, dy, starts, ends)
  got = jax.jit(triton_side_rows.gather)(x, dy, starts, ends)
  for a, b in zip(want, got):
    assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
  calls = []
  real = triton_side_rows.gather
  monkeypatch.setattr(triton_side_rows, "gather", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  assert choice.config.side_gather_kernel
  _assert_dw_variant_bitwise(x, dy, sizes, shard, g,
                             dataclasses.replace(choice.config, side_gather_kernel=False),
                             choice.config)
  assert calls == [1]  # traced once, by the second config's call


_GPT_OSS = [s for p in ("gpt-oss-120b", "gpt-oss-20b") for s in PRESETS[p] if s.m > 1024]


@pytest.mark.parametrize("op", ["fwd", "dx", "dw"])
@pytest.mark.parametrize("shape", _GPT_OSS, ids=[s.name.replace(" ", "_") for s in _GPT_OSS])
@pytest.mark.parametrize("shard,layout", [(False, "routed"), (True, "routed"),
                                          (False, "skewed")],
                         ids=["all", "shard", "all-skewed"])
def test_gpt_oss_calls_real_size(op, shape, shard, layout):
  """gpt-oss's training calls (k and n 2880 or 5760: partial 128-column tiles)
  through the automatic choice: against the f32 oracle on NaN-poisoned memory,
  exact zeros outside an EP=8 shard, bitwise repeatable."""
  m, k, n, g = shape.m, shape.k, shape.n, shape.g
  local = g // 8 if shard else g
  sizes = routed_group_sizes(dataclasses.replace(shape, skewed=layout == "skewed"), 0)
  go = jnp.int32(local) if shard else None  # shard 1 of 8
  gs = jnp.asarray(sizes)
  if op == "dw":
    x, dy = oracle.random_inputs(jax.random.key(m + k + n), [(m, k), (m, n)], jnp.bfloat16)
    run = jax.jit(lambda a, b: ragdot.trans_ragged_dot(a, b, gs, group_offset=go,
                                                       num_groups=local if shard else None))
    ref = None  # checked in blocks of 16 experts below (the whole f64 check of
    # gpt-oss-120b gate_up's 4.2 GB output took ~60 GB of host memory per worker)
  else:
    dx = op == "dx"
    x, w = oracle.random_inputs(jax.random.key(m + k + n), [(m, n if dx else k), (local, k, n)],
                                jnp.bfloat16)
    dn = DN_DX if dx else DN_FWD
    run = jax.jit(lambda a, b: ragdot.ragged_dot_general(a, b, gs, dn, group_offset=go))
    ref = oracle.np_ragged_dot(x, w, sizes, go, transpose_rhs=dx)
  args = (x, dy) if op == "dw" else (x, w)
  _poison(4 * max(m * max(n, k), g * k * n))
  out = run(*args)
  if op == "dw":
    first = local if shard else 0
    for i in range(0, local, 16):
      block = oracle.np_trans_ragged_dot(x, dy, sizes, jnp.int32(first + i), min(16, local - i))
      oracle.assert_close(out[i:i + 16], block, jnp.bfloat16)
  else:
    oracle.assert_close(out, ref, jnp.bfloat16)
    oracle.assert_zero_rows(out, sizes, go, local)
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16),
                                np.asarray(run(*args)).view(np.uint16))


def test_w8a16_triton_weights_past_int32_offsets():
  """DeepSeek-V3 down's e4m3 weights, [g, k, n] (256 x 2048 x 7168: 3.76e9 one-byte
  elements), through the Triton kernel: Pallas-Triton's 32-bit offsets would wrap
  on them as they are (an illegal address, docs/performance.md v59), so the kernel
  gets them widened to bf16 (64-bit offsets): bitwise its result on bf16 weights
  with the same config, every row outside the groups zero, bitwise repeatable."""
  from ragdot.backends import triton as tb
  m, k, n, g = 512, 2048, 7168, 256
  sizes = _sizes(m, g, "routed")
  x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(2), (g, k, n), jnp.bfloat16) / 4).astype(
      jnp.float8_e4m3fn)
  assert tb.offsets_wrap(w)
  gs = jnp.asarray(sizes)
  choice = dispatch.choose("gmm", "triton", dtype=jnp.bfloat16, rhs_dtype=jnp.float8_e4m3fn,
                           out_dtype=jnp.bfloat16, m=m, k=k, n=n, g=g, num_groups=g,
                           transpose_rhs=False)
  call = jax.jit(lambda x, w: ragdot.ragged_dot(x, w, gs, implementation="triton"))
  _poison(8 * m * n)
  out = call(x, w)
  again = call(x, w)
  same = jax.jit(lambda x, w: tb.gmm(x, w.astype(jnp.bfloat16), gs, None, transpose_rhs=False,
                                     out_dtype=jnp.bfloat16, precision=None,
                                     config=choice.config))(x, w)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(same, np.float32))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32))
  assert np.isfinite(np.asarray(out, np.float32)).all() and float(jnp.abs(out).max()) > 0
  oracle.assert_zero_rows(out, sizes, None, g)


@pytest.mark.parametrize("op, k, n", [("dw", 128, 2048), ("fwd", 128, 2048), ("dx", 2048, 128)])
def test_auto_choice_on_a_small_k_or_n_real_size(op, k, n):
  """The dispatcher borrows the nearest entry's config, whose blocks may run
  past a small k or n (dW at k = 128 gets block_k 192 from a k = 768 entry):
  every element right, through the automatic choice, with a shard."""
  m, g = 32768, 128
  sizes = _sizes(m, g, "routed")
  if op != "dw":
    _check_dispatched_call(op, m, k, n, 16, sizes, jnp.int32(16), seed=k + n)
    return
  x, dy = oracle.random_inputs(jax.random.key(k), [(m, k), (m, n)], jnp.bfloat16)
  for go, local in ((None, None), (jnp.int32(16), 16)):  # (num_groups only with an offset)
    _poison(4 * g * k * n)
    out = jax.jit(lambda x, d, go, local=local: ragdot.trans_ragged_dot(
        x, d, jnp.asarray(sizes), group_offset=go, num_groups=local))(x, dy, go)
    oracle.assert_close(out, oracle.np_trans_ragged_dot(x, dy, sizes, go, local or g),
                        jnp.bfloat16)


@pytest.mark.parametrize("impl", [None, "mosaic"])
def test_export_for_cuda_round_trips(impl):
  """``jax.export`` of concrete shapes for CUDA: an automatic call exports its
  XLA form, an explicit Mosaic call its kernel with the schedule built by XLA
  ops (the Pallas-Triton schedule kernels' custom call does not export); both
  serialize, load and agree with the oracle, rows outside the shard zero."""
  from jax import export  # pylint: disable=g-import-not-at-top
  sizes = [700, 0, 1300, 41, 2000]
  x, w = oracle.random_inputs(jax.random.key(9), [(4096, 512), (3, 512, 768)], jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)

  def f(x, w):
    return ragdot.ragged_dot(x, w, gs, group_offset=jnp.int32(1), implementation=impl)

  exp = export.export(jax.jit(f), platforms=("cuda",))(x, w)
  if impl == "mosaic":
    assert "mosaic_gpu" in exp.mlir_module()
  got = export.deserialize(exp.serialize()).call(x, w)
  oracle.assert_close(got, oracle.ref_ragged_dot(x, w, sizes, 1, False), jnp.bfloat16)
  oracle.assert_zero_rows(got, sizes, 1, 3)
