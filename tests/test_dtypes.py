"""Input and result dtypes as ``jax.lax.ragged_dot`` takes them.

lax ranks the two operand dtypes (complex, exponent range, mantissa, bits,
signed) and returns the higher one, or ``preferred_element_type``; it takes
fp8, int4, bool and complex operands, mixed freely.  ragdot computes in a
dtype that holds both operands exactly (fp8 in bf16, int4 in int8), with f32 /
int32 accumulation, and rounds once to the result dtype.
"""

from __future__ import annotations

import dataclasses

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import oracle
import ragdot
from ragdot.backends import get_backend

FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, *FP8, jnp.int8, jnp.uint8, jnp.int4,
          jnp.bool_, jnp.complex64)
GS = jnp.array([5, 11, 0, 14], jnp.int32)  # 30 of 32 rows: two rows past the groups


def _operand(dtype, shape, seed):
  key = jax.random.key(seed)
  if dtype == jnp.bool_:
    return jax.random.bernoulli(key, 0.3, shape)
  if jnp.issubdtype(dtype, jnp.integer):
    lo, hi = (0, 16) if jnp.issubdtype(dtype, jnp.unsignedinteger) else (-8, 8)
    return jax.random.randint(key, shape, lo, hi).astype(dtype)
  x = 3 * jax.random.normal(key, shape)
  if dtype == jnp.complex64:
    x = x + 1j * jax.random.normal(jax.random.fold_in(key, 1), shape)
  return x.astype(dtype)


def _wide(*dtypes):
  """A dtype whose exact products and sums serve as the reference."""
  if any(jnp.issubdtype(d, jnp.complexfloating) for d in dtypes):
    return jnp.complex64
  if all(d == jnp.bool_ or jnp.issubdtype(d, jnp.integer) for d in dtypes):
    return jnp.int32
  return jnp.float32


def _reference(x, w, out_dtype):
  """f32 / int32 / complex64 products of the exact operand values, rounded
  once to the result dtype (bool: any product of trues)."""
  wide = _wide(x.dtype, w.dtype, out_dtype)
  acc = lax.ragged_dot(x.astype(wide), w.astype(wide), GS, precision=lax.Precision.HIGHEST)
  if out_dtype == jnp.bool_:
    return acc != 0
  if jnp.iscomplexobj(acc) and not jnp.issubdtype(out_dtype, jnp.complexfloating):
    acc = jnp.real(acc)  # lax keeps the real part of a complex sum asked for a real result
  return acc.astype(out_dtype)


def _cases():
  for a, b in itertools.product(DTYPES, DTYPES):
    for pref in (None, jnp.float32, jnp.bfloat16):
      yield a, b, pref


@pytest.mark.parametrize("a,b,pref", list(_cases()),
                         ids=lambda d: getattr(d, "__name__", str(d)))
def test_result_dtype_and_values_like_lax(a, b, pref):
  x, w = _operand(a, (32, 16), 0), _operand(b, (4, 16, 8), 1)
  try:
    want = lax.ragged_dot(x, w, GS, preferred_element_type=pref)
  except TypeError:  # e.g. a complex result narrowed to bf16
    with pytest.raises(TypeError, match="preferred_element_type"):
      ragdot.ragged_dot(x, w, GS, preferred_element_type=pref)
    return
  got = ragdot.ragged_dot(x, w, GS, preferred_element_type=pref)
  assert got.dtype == want.dtype
  ref = _reference(x, w, got.dtype)
  if got.dtype == jnp.bool_ or jnp.issubdtype(got.dtype, jnp.integer):
    np.testing.assert_array_equal(got, ref)
    return
  # Floats: the f32 accumulation's order differs from the reference's, so
  # allow a few units of the f32 rounding, then one ulp of the result dtype.
  ref32 = np.asarray(ref.astype(_wide(got.dtype)))
  eps = float(jnp.finfo(got.dtype).eps)
  scale = np.abs(np.asarray(_reference(x, w, _wide(got.dtype))))
  np.testing.assert_allclose(np.asarray(got.astype(_wide(got.dtype))), ref32,
                             atol=1e-5 * float(scale.max()) + 1e-6,
                             rtol=eps if got.dtype.itemsize < 2 else 4 * eps)
  assert not np.asarray(got[30:]).any(), "rows past the groups must be 0"


@pytest.mark.parametrize("x_dtype,w_dtype", [(FP8[0], FP8[0]), (FP8[1], FP8[1]),
                                             (FP8[0], FP8[1]), (jnp.bfloat16, FP8[0])])
def test_fp8_result_is_the_f32_sum_rounded_once(x_dtype, w_dtype):
  # The result dtype is fp8 (e5m2 wins over e4m3: larger exponent range). lax on
  # the CPU rounds through f16 (and casts e4m3 to e5m2 first when mixed);
  # ragdot rounds the f32 accumulation once.
  x, w = _operand(x_dtype, (32, 16), 2), _operand(w_dtype, (4, 16, 8), 3)
  got = ragdot.ragged_dot(x, w, GS)
  want = lax.ragged_dot(x, w, GS)
  assert got.dtype == want.dtype
  exact = lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), GS,
                         precision=lax.Precision.HIGHEST)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(exact.astype(got.dtype).astype(jnp.float32)))


def test_narrowing_an_integer_result_is_refused_like_lax():
  x, w = _operand(jnp.int32, (32, 16), 0), _operand(jnp.int32, (4, 16, 8), 1)
  with pytest.raises(TypeError):
    lax.ragged_dot(x, w, GS, preferred_element_type=jnp.int8)
  with pytest.raises(TypeError, match="preferred_element_type"):
    ragdot.ragged_dot(x, w, GS, preferred_element_type=jnp.int8)


def test_equally_ranked_distinct_dtypes_are_refused_like_lax():
  # float8_e4m3fn and float8_e4m3b11fnuz: same exponent range, mantissa and
  # width, so lax has no result dtype for the pair.
  other = jnp.float8_e4m3b11fnuz
  x, w = _operand(FP8[0], (32, 16), 0), _operand(other, (4, 16, 8), 1)
  try:
    lax.ragged_dot(x, w, GS)
  except TypeError:
    with pytest.raises(TypeError, match="lhs and rhs"):
      ragdot.ragged_dot(x, w, GS)
  else:
    assert ragdot.ragged_dot(x, w, GS).dtype == lax.ragged_dot(x, w, GS).dtype


@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_fp8_operands_run_the_kernels_in_bf16(impl):
  # fp8 values are exact in bf16: the kernels on fp8 operands equal the same
  # kernels on the bf16 copies, forward and weight gradient.
  m, k, n = 128, 64, 64
  gs = jnp.array([40, 0, 56, 24], jnp.int32)
  x = _operand(FP8[0], (m, k), 4)
  w = _operand(FP8[0], (4, k, n), 5)
  dy = _operand(FP8[1], (m, n), 6)
  bf = lambda a: a.astype(jnp.bfloat16)
  got = ragdot.ragged_dot(x, w, gs, preferred_element_type=jnp.bfloat16, implementation=impl)
  want = ragdot.ragged_dot(bf(x), bf(w), gs, implementation=impl)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  got_t = ragdot.trans_ragged_dot(x, dy, gs, preferred_element_type=jnp.float32,
                                  implementation=impl)
  want_t = ragdot.trans_ragged_dot(bf(x), bf(dy), gs, preferred_element_type=jnp.float32,
                                   implementation=impl)
  np.testing.assert_array_equal(got_t, want_t)


@pytest.mark.parametrize("w_dtype", [jnp.int4, FP8[0]])
def test_gradients_through_narrow_weights_like_lax(w_dtype):
  # Quantized experts (int4 or fp8 weights, bf16 activations): the gradient
  # of the activations, and its dtype, as lax gives them.
  x = _operand(jnp.bfloat16, (32, 16), 7)
  w = _operand(w_dtype, (4, 16, 8), 8)

  def loss(f, x):
    return jnp.sum(f(x, w, GS).astype(jnp.float32) ** 2)

  got = jax.grad(lambda x: loss(ragdot.ragged_dot, x))(x)
  want = jax.grad(lambda x: loss(lax.ragged_dot, x))(x)
  assert got.dtype == want.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=1e-2 * float(jnp.abs(want).max()))


def test_complex_operands_with_gradients_like_lax():
  x = _operand(jnp.complex64, (32, 16), 9)
  w = _operand(jnp.complex64, (4, 16, 8), 10)

  def loss(f, x, w):
    return jnp.sum(jnp.abs(f(x, w, GS)) ** 2)

  got = jax.grad(lambda x, w: loss(ragdot.ragged_dot, x, w), (0, 1))(x, w)
  want = jax.grad(lambda x, w: loss(lax.ragged_dot, x, w), (0, 1))(x, w)
  for g, h in zip(got, want):
    np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-3)


# --- native fp8: the Mosaic forward (rhs [g, n, k]; [g, k, n] copied to it) ---

NK = lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
# Mosaic forms (interpret mode): a pipeline per tile (k steps of 128 and of 64
# one-byte columns), the ring, and the ring with rows on wgmma's N axis and a
# folded tail (as the H200 table's dX entries).
FP8_CONFIGS = {
    "pipeline": dict(block_m=128, block_n=128, block_k=128, num_stages=2, num_compute_wgs=2,
                     num_sms=3),
    "pipeline_k64": dict(block_m=128, block_n=128, block_k=64, num_stages=4,
                         num_compute_wgs=2, num_sms=3),
    "ring": dict(block_m=128, block_n=128, block_k=128, num_stages=2, num_compute_wgs=2,
                 ring=True, num_sms=3),
    "swap": dict(block_m=128, block_n=128, block_k=128, num_stages=2, num_compute_wgs=2,
                 ring=True, swap=True, tail_rows=32, producer_zeros=False, num_sms=3),
}


@pytest.mark.parametrize("form", sorted(FP8_CONFIGS))
@pytest.mark.parametrize("dtype,offset", [(FP8[0], None), (FP8[1], 1)])
def test_mosaic_takes_fp8_with_rhs_nk(form, dtype, offset):
  """e4m3 / e5m2 operands straight into wgmma: against the f32 sum, the rows
  outside a shard exactly 0."""
  from ragdot.backends import mosaic_fwd as mf
  sizes, m, k, n = [300, 10, 0, 150], 512, 256, 128
  local = 4 if offset is None else 2
  x = _operand(dtype, (m, k), 11)
  w = _operand(dtype, (local, n, k), 12)
  gs = jnp.asarray(sizes, jnp.int32)
  go = None if offset is None else jnp.int32(offset)
  cfg = mf.MosaicFwdConfig(**FP8_CONFIGS[form])
  out = mf.gmm(x, w, gs, go, transpose_rhs=True, out_dtype=jnp.float32, interpret=True,
               config=cfg)
  want = oracle.ref_ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes, go, True)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
  oracle.assert_zero_rows(out, sizes, offset, local)


def test_mosaic_takes_fp8_with_rhs_kn_through_an_nk_copy():
  """rhs [g, k, n] in fp8: the kernel copies it to [g, n, k] (one byte an
  element) and runs the native path: bitwise the [g, n, k] call on the
  transposed weights, with the shard's other rows 0."""
  from ragdot.backends import mosaic_fwd as mf
  sizes, m, k, n = [100, 0, 156], 256, 256, 128
  x, w = _operand(FP8[0], (m, k), 0), _operand(FP8[0], (2, k, n), 1)
  gs, go = jnp.asarray(sizes, jnp.int32), jnp.int32(1)
  cfg = mf.MosaicFwdConfig(**FP8_CONFIGS["pipeline"])
  call = lambda w, tr: mf.gmm(x, w, gs, go, transpose_rhs=tr, out_dtype=jnp.bfloat16,
                              interpret=True, config=cfg)
  out = call(w, False)
  np.testing.assert_array_equal(out, call(jnp.swapaxes(w, 1, 2), True))
  want = oracle.ref_ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes, go)
  oracle.assert_close(out, want, jnp.bfloat16)
  oracle.assert_zero_rows(out, sizes, 1, 2)


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_explicit_mosaic_runs_the_fp8_forward_natively(monkeypatch, layout):
  """implementation="mosaic": the forward gets the fp8 operands in either
  layout, the weight gradient bf16 copies; gradients through the native call
  as lax gives them."""
  backend = get_backend("mosaic")  # the module whose gmm the api calls
  seen = []
  real = backend.gmm
  monkeypatch.setattr(backend, "gmm", lambda lhs, rhs, *a, **kw: seen.append(
      (lhs.dtype, kw["transpose_rhs"])) or real(lhs, rhs, *a, **kw))
  api_compiled = ragdot.api._compiled
  api_compiled.cache_clear()
  gs = jnp.array([40, 0, 56, 32], jnp.int32)
  nk = layout == "nk"
  x = _operand(FP8[0], (128, 64), 13)
  w = _operand(FP8[0], (4, 128, 64) if nk else (4, 64, 128), 14)
  dims = NK if nk else lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
  f = lambda x, w: ragdot.ragged_dot_general(x, w, gs, dims, preferred_element_type=jnp.float32,
                                             implementation="mosaic")
  out = f(x, w)
  want = oracle.ref_ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), [40, 0, 56, 32],
                               None, nk)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
  assert seen == [(jnp.dtype(FP8[0]), nk)]
  c = jax.random.normal(jax.random.key(15), (128, 128)) / 16  # gradients well inside e4m3
  loss = lambda f, x, w: jnp.sum(f(x, w).astype(jnp.float32) * c)
  got = jax.grad(lambda x, w: loss(f, x, w), (0, 1))(x, w)
  lax_f = lambda x, w: lax.ragged_dot_general(x, w, gs, dims, preferred_element_type=jnp.float32)
  ref = jax.grad(lambda x, w: loss(lax_f, x, w), (0, 1))(x, w)
  exact = jax.grad(lambda x, w: loss(lax_f, x, w), (0, 1))(
      x.astype(jnp.float32), w.astype(jnp.float32))
  for g, h, e in zip(got, ref, exact):
    assert g.dtype == h.dtype == FP8[0]
    # the f32 gradient (cotangent rounded to bf16) rounded once to e4m3
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32),
                               rtol=0.07, atol=0.01 * float(jnp.abs(e).max()))
  assert (jnp.dtype(jnp.bfloat16), not nk) in seen  # dX on bf16 copies


H200 = ("gpu", "NVIDIA H200", "9.0")


@pytest.mark.parametrize("shape", [(32768, 1536, 2048, 128), (32768, 768, 2048, 128),
                                   (8192, 2048, 7168, 256), (4096, 7168, 2048, 256),
                                   (512, 2048, 1536, 128)])
@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_fp8_lowers_for_sm90_with_the_h200_choice(shape, transpose_rhs):
  """The configs the dispatcher picks for e4m3 operands (the H200 table's bf16
  [g, n, k] entries with k steps of 128 one-byte columns: ring, swap, folded
  tails, clusters; the kernel's default where the table says Triton) lower for
  sm90 in both layouts (the real lowering checks wgmma's 8-bit layout rules,
  which interpret mode does not)."""
  import sm90_lowering
  from ragdot import dispatch
  m, k, n, g = shape
  c = dispatch.choose("gmm", None, dtype=FP8[0], out_dtype=jnp.bfloat16, m=m, k=k, n=n, g=g,
                      num_groups=g, transpose_rhs=transpose_rhs,
                      device=dispatch.Device(*H200))
  assert c.implementation == "mosaic"
  if not transpose_rhs:  # the rows widened to bf16, the W8A16 form on [g, k, n] (staged
    # through the rule's 2 buffers, or a tuned W8A16 entry's 1)
    assert c.config.widen_rows and c.config.widen_staging in (1, 2)
  elif c.config is not None:
    assert c.config.block_k == 128
  sm90_lowering.assert_gmm_lowers(c.config, m=m, k=k, n=n, g=g, transpose_rhs=transpose_rhs,
                                  dtype=FP8[0])


def test_fp8_sweep_lowers_for_sm90():
  """Every candidate ``ragdot tune --dtype float8_e4m3fn`` times on a decode
  call (64-column k steps on more stages among them) lowers for sm90."""
  import sm90_lowering
  from ragdot.backends import mosaic_fwd as mf
  m, k, n, g = 512, 768, 2048, 128
  cfgs = mf.gpu_sweep_configs(m, k, n, g, True, FP8[0], jnp.bfloat16)
  assert {c.block_k for c in cfgs} == {64, 128} and any(c.swap for c in cfgs)
  for c in cfgs:
    sm90_lowering.assert_gmm_lowers(c, m=m, k=k, n=n, g=g, transpose_rhs=True, dtype=FP8[0])


@pytest.mark.parametrize("m,k,n,g", [(32768, 1536, 2048, 128), (512, 1536, 2048, 128)])
def test_automatic_choice_takes_fp8_natively_on_sm90(h200_table, m, k, n, g):
  """On an H200 the automatic choice for e4m3 operands is the native Mosaic
  kernel in both layouts, without fp8 entries the bf16 [g, n, k] entry's config
  with k steps of 128 one-byte columns, also where the bf16 table picks Triton
  (512 rows: the kernel's default); an sm80 part keeps the bf16 choice (on bf16
  copies)."""
  from ragdot import dispatch
  from ragdot.backends import mosaic_fwd as mf
  _drop_fp8_entries(h200_table)
  h200 = dispatch.Device(*H200)
  a100 = dispatch.Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0")
  common = dict(m=m, k=k, n=n, g=g, num_groups=g, out_dtype=jnp.bfloat16)
  bf16 = dispatch.choose("gmm", None, dtype=jnp.bfloat16, transpose_rhs=True, device=h200,
                         **common)
  widened = dispatch.choose("gmm", None, dtype=jnp.bfloat16, rhs_dtype=FP8[0],
                            transpose_rhs=False, device=h200, **common)
  kn = dispatch.choose("gmm", None, dtype=FP8[0], transpose_rhs=False, device=h200, **common)
  assert kn.config == dataclasses.replace(widened.config, widen_rows=True)
  for tr in (True,):
    native = dispatch.choose("gmm", None, dtype=FP8[0], transpose_rhs=tr, device=h200,
                             **common)
    assert native.implementation == "mosaic" and native.automatic
    if bf16.implementation == "mosaic":
      assert native.config == mf.for_one_byte(bf16.config, k)
      assert "k step 128 for 1-byte operands" in native.reason
    else:
      assert native.config is None and "native 8-bit wgmma" in native.reason
  for tr in (True, False):
    got = dispatch.choose("gmm", None, dtype=FP8[0], transpose_rhs=tr, device=a100, **common)
    assert got == dispatch.choose("gmm", None, dtype=jnp.bfloat16, transpose_rhs=tr,
                                  device=a100, **common)


def test_the_shipped_fp8_entries_serve_the_qwen3_30b_calls():
  """The H200 table's fp8 entries (``ragdot tune --dtype float8_e4m3fn``, v52a)
  are what the Qwen3-30B forward calls run, in both layouts."""
  from ragdot import dispatch
  for m, k, n in [(512, 2048, 1536), (32768, 768, 2048)]:
    choose = lambda out, tr: dispatch.choose(
        "gmm", None, dtype=FP8[0], out_dtype=out, m=m, k=k, n=n, g=128, num_groups=128,
        transpose_rhs=tr, device=dispatch.Device(*H200))
    c = choose(jnp.bfloat16, True)
    assert c.implementation == "mosaic" and c.measured and c.config.block_k == 128
    assert "float8_e4m3fn" in c.reason or "measured entry" in c.reason
    # [g, k, n] weights: the W8A16 form on widened rows for a 16-bit result,
    # else (an fp8 one) the same entry on an fp8 [g, n, k] copy.
    assert choose(jnp.bfloat16, False).config.widen_rows
    for tr in (True, False):
      kept = choose(FP8[0], tr)
      assert kept.implementation == "mosaic" and kept.config.block_k == 128
      assert not kept.config.widen_rows


def _drop_fp8_entries(table):
  for key in [key for key in table.entries if "float8" in key]:
    del table.entries[key]


def test_fp8_entries_of_the_table_are_taken_literally(h200_table):
  """A tuned fp8 entry (``ragdot tune --dtype float8_e4m3fn``) is used as it
  stands, for e5m2 too (an alias); without one the bf16 entry's k step doubles."""
  from ragdot import dispatch
  _drop_fp8_entries(h200_table)  # (the shipped ones)
  m, k, n, g = 512, 2048, 1536, 128
  fields = dict(block_m=128, block_n=128, block_k=64, num_stages=8, num_compute_wgs=2,
                epilogue_split=2)
  h200_table.put("gmm_t", "float8_e4m3fn", m, k, n, g,
                 {"backend": "mosaic", "config": fields, "measured": True})
  for dtype in FP8:  # (rhs [g, n, k]: a [g, k, n] one takes the W8A16 form on widened rows)
    c = dispatch.choose("gmm", None, dtype=dtype, out_dtype=jnp.bfloat16, m=m, k=k, n=n,
                        g=g, num_groups=g, transpose_rhs=True, device=dispatch.Device(*H200))
    assert c.implementation == "mosaic" and c.measured
    assert (c.config.block_k, c.config.num_stages) == (64, 8)
  other = dispatch.choose("gmm", None, dtype=FP8[0], out_dtype=jnp.bfloat16, m=32768,
                          k=1536, n=2048, g=128, num_groups=128, transpose_rhs=True,
                          device=dispatch.Device(*H200))  # far from it: bf16, doubled
  assert other.config.block_k == 128 and "1-byte" in other.reason


def test_a_borrowed_fp8_entry_keeps_whole_k_steps(h200_table):
  """An fp8 entry with k steps of 128 borrowed by a call whose k is an odd
  multiple of 64 (8-bit TMA tiles need whole steps) runs 64-column steps, and
  lowers for sm90; the kernel refuses a 128-column fp8 k step where k is not a
  multiple of 128 (NotImplementedError: the automatic choice falls back; a
  16-bit partial k step is zero-filled)."""
  import sm90_lowering
  from ragdot import dispatch
  from ragdot.backends import mosaic_fwd as mf
  fields = dict(block_m=128, block_n=256, block_k=128, num_stages=4, num_compute_wgs=2,
                epilogue_split=2)
  h200_table.put("gmm_t", "float8_e4m3fn", 4096, 2048, 2048, 16,
                 {"backend": "mosaic", "config": fields, "measured": True})
  m, k, n, g = 4096, 2880, 2048, 16
  c = dispatch.choose("gmm", None, dtype=FP8[0], out_dtype=jnp.bfloat16, m=m, k=k, n=n, g=g,
                      num_groups=g, transpose_rhs=True, device=dispatch.Device(*H200))
  assert c.config.block_k == 64 and "k step 64" in c.reason
  sm90_lowering.assert_gmm_lowers(c.config, m=m, k=k, n=n, g=g, transpose_rhs=True,
                                  dtype=FP8[0])
  x, w = _operand(FP8[0], (256, 192), 0), _operand(FP8[0], (2, 128, 192), 1)
  with pytest.raises(NotImplementedError, match="k=192 must be a multiple of the 128-column"):
    mf.gmm(x, w, jnp.array([128, 128], jnp.int32), None, transpose_rhs=True,
           out_dtype=jnp.bfloat16, interpret=True,
           config=mf.MosaicFwdConfig(**dict(fields, block_n=128)))


def test_fp8_k_step_stays_below_k_for_the_two_warpgroup_pipeline():
  """The pipeline of two consumer warpgroups needs two k steps or more (its
  last slot is never released): k = 128 keeps block_k 64 for fp8, k = 256
  doubles it."""
  from ragdot.backends import mosaic_fwd as mf
  cfg = mf.MosaicFwdConfig(block_m=128, block_n=128, block_k=64, num_stages=2,
                           num_compute_wgs=2)
  assert mf.for_one_byte(cfg, 128).block_k == 64
  assert mf.for_one_byte(cfg, 256).block_k == 128
  ring = mf.MosaicFwdConfig(block_m=128, block_n=128, block_k=64, num_stages=2,
                            num_compute_wgs=2, ring=True)
  assert mf.for_one_byte(ring, 128).block_k == 128  # the ring releases every slot
  assert mf.default_config(4096, 128, 256, 8, FP8[0], True).block_k == 64
  assert mf.default_config(4096, 256, 256, 8, FP8[0], True).block_k == 128
