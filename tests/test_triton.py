"""Kernel-level tests of the Pallas-Triton backend (interpret mode on CPU).

Small 16-wide blocks so that every case crosses several row, k and n tiles
with partial tiles at the ends; the contract suite (tests/impls.py) covers the
public API with hypothesis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import oracle
from ragdot import metadata as md
from ragdot.backends import triton as tr

HIGHEST = lax.Precision.HIGHEST
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

SMALL = tr.TritonConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)


def _gmm(lhs, rhs, sizes, offset, transpose_rhs, out_dtype=None, config=SMALL,
         precision=HIGHEST, jit=False):
  go = None if offset is None else jnp.int32(offset)
  fn = lambda l, r, g, o: tr.gmm(
      l, r, g, o, transpose_rhs=transpose_rhs, out_dtype=out_dtype or lhs.dtype,
      precision=precision, interpret=True, config=config)
  if jit:
    fn = jax.jit(fn)
  return fn(lhs, rhs, jnp.asarray(sizes, jnp.int32), go)


def _tgmm(lhs, rhs, sizes, offset, num_groups, out_dtype=None, config=SMALL):
  go = None if offset is None else jnp.int32(offset)
  return tr.tgmm(lhs, rhs, jnp.asarray(sizes, jnp.int32), go, num_groups=num_groups,
                 out_dtype=out_dtype or lhs.dtype, precision=HIGHEST, interpret=True,
                 config=config)


def _inputs(seed, shapes, dtype):
  return oracle.random_inputs(jax.random.key(seed), shapes, dtype)


def _local_rows(sizes, m, offset, num_local):
  grp = oracle.group_of_rows(sizes, m)
  o = offset or 0
  return (grp >= o) & (grp < o + num_local) & (grp < len(sizes))


# --- forward and dX ---------------------------------------------------------


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_boundary_tiles(transpose_rhs, dtype):
  """m, k, n not multiples of the block; groups start and end inside blocks."""
  m, k, n = 53, 37, 45
  sizes = [7, 0, 20, 3, 15]  # sum 45 < m: rows 45..52 are zero
  g = len(sizes)
  rshape = (g, n, k) if transpose_rhs else (g, k, n)
  lhs, rhs = _inputs(1 + transpose_rhs, [(m, k), rshape], dtype)
  out = _gmm(lhs, rhs, sizes, None, transpose_rhs, out_dtype=jnp.float32)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  ref = oracle.ref_ragged_dot(lhs, rhs, sizes, None, transpose_rhs)
  oracle.assert_close(out, ref, dtype)
  assert np.all(np.asarray(out[45:]) == 0)


@pytest.mark.parametrize(
    "sizes,offset,num_local",
    [
        ([6, 9, 0, 11, 5], 1, 3),    # middle shard with an empty local group
        ([6, 9, 0, 11, 5], 2, 1),    # a shard of one empty group: all zeros
        ([6, 9, 0, 11, 5], 3, 4),    # shard partly past G
        ([6, 9, 0, 11, 5], 5, 2),    # shard wholly past G: all zeros
        ([6, 9, 0, 11, 5], -1, 2),   # local group -1 owns nothing
        ([20, 30, 10], 1, 1),        # sum > m: the shard's group is cut at m
    ],
)
def test_group_offset_shards(sizes, offset, num_local):
  """Only local rows are computed; every other row is exactly 0, even with NaN."""
  m, k, n = 40, 19, 21
  lhs, rhs = _inputs(offset + 7, [(m, k), (num_local, k, n)], jnp.float32)
  local = _local_rows(sizes, m, offset, num_local)
  lhs = jnp.where(jnp.asarray(local)[:, None], lhs, jnp.nan)  # never read
  out = _gmm(lhs, rhs, sizes, offset, False, jit=True)
  ref = oracle.ref_ragged_dot(jnp.where(jnp.isnan(lhs), 0, lhs), rhs, sizes, offset)
  assert np.all(np.isfinite(np.asarray(out)))
  oracle.assert_close(out, ref, jnp.float32)
  assert np.all(np.asarray(out)[~local] == 0)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_all_zero_sizes_write_zeros(transpose_rhs):
  m, k, n = 33, 17, 18
  rshape = (3, n, k) if transpose_rhs else (3, k, n)
  lhs, rhs = _inputs(3, [(m, k), rshape], jnp.float16)
  out = _gmm(lhs, rhs, [0, 0, 0], None, transpose_rhs)
  assert out.dtype == jnp.float16
  assert np.all(np.asarray(out, np.float32) == 0)


def test_default_config_and_tiny_shapes():
  """Default (H200) config shrunk to a 1-row, 1-column problem."""
  lhs, rhs = _inputs(4, [(1, 1), (2, 1, 1)], jnp.bfloat16)
  out = _gmm(lhs, rhs, [0, 1], None, False, config=None, precision=None)
  ref = oracle.ref_ragged_dot(lhs, rhs, [0, 1])
  oracle.assert_close(out, ref, jnp.bfloat16)


def test_grid_is_tiles_times_n_tiles_plus_zero_blocks():
  """Static grid: (cdiv(m, bm) + g - 1) * n_tiles work programs + one per row block."""
  m, k, n, g = 100, 32, 40, 5
  lhs, rhs = _inputs(5, [(m, k), (g, k, n)], jnp.bfloat16)
  gs = jnp.array([30, 0, 30, 20, 20], jnp.int32)
  jaxpr = jax.make_jaxpr(lambda l, r, s: tr.gmm(
      l, r, s, None, transpose_rhs=False, out_dtype=jnp.bfloat16, precision=None,
      interpret=True, config=SMALL))(lhs, rhs, gs)
  grids = [e.params["grid_mapping"].grid for e in jaxpr.jaxpr.eqns
           if e.primitive.name == "pallas_call"]
  n_tiles, blocks = -(-n // 16), -(-m // 16)
  assert grids == [(md.max_tiles(m, 16, g) * n_tiles + blocks,)]


# --- dW -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes,offset,num_local",
    [
        ([13, 0, 17, 0, 9], None, 5),  # empty groups inside, rows past the sum
        ([13, 0, 40, 0, 9], 1, 3),     # shard; group 2 cut at m
        ([13, 0, 17, 0, 9], 4, 3),     # shard partly past G
        ([0, 0, 0], None, 3),          # all empty
    ],
)
def test_tgmm_empty_groups_exact_zeros(sizes, offset, num_local):
  """Partial row chunks; rows outside local groups hold inf and never leak."""
  m, k, n = 45, 21, 35
  lhs, rhs = _inputs(11, [(m, k), (m, n)], jnp.float32)
  local = jnp.asarray(_local_rows(sizes, m, offset, num_local))[:, None]
  lhs_bad = jnp.where(local, lhs, jnp.inf)
  rhs_bad = jnp.where(local, rhs, jnp.nan)
  out = _tgmm(lhs_bad, rhs_bad, sizes, offset, num_local)
  assert out.shape == (num_local, k, n)
  ref = oracle.ref_trans_ragged_dot(jnp.where(local, lhs, 0), jnp.where(local, rhs, 0),
                                    sizes, None if offset is None else jnp.int32(offset),
                                    None if offset is None else num_local)
  oracle.assert_close(out, ref, jnp.float32)
  gs = np.maximum(sizes, 0)
  ends = np.minimum(np.cumsum(gs), m)
  starts = np.concatenate([[0], ends[:-1]])
  o = offset or 0
  for j in range(num_local):
    if not 0 <= o + j < len(sizes) or ends[o + j] == starts[o + j]:
      assert np.all(np.asarray(out[j]) == 0)


def test_tgmm_bf16_default_config_long_group():
  """Default config; one group spans many full row chunks plus a tail."""
  m, k, n = 150, 24, 40
  lhs, rhs = _inputs(12, [(m, k), (m, n)], jnp.bfloat16)
  sizes = [3, 140, 0]
  out = _tgmm(lhs, rhs, sizes, None, 3, out_dtype=jnp.float32, config=None)
  ref = oracle.ref_trans_ragged_dot(lhs, rhs, sizes)
  oracle.assert_close(out, ref, jnp.bfloat16)
  assert np.all(np.asarray(out[2]) == 0)


# --- configs and precision -------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [dict(block_m=48), dict(block_n=8), dict(block_k=1024), dict(block_m=True),
     dict(num_warps=3), dict(num_stages=0), dict(num_stages=2.0)],
)
def test_config_validation(fields):
  with pytest.raises(ValueError):
    tr.TritonConfig(**fields)


def test_sm80_gets_the_a100_paper_config(monkeypatch):
  # With no config given the backend uses the A100 config on an sm80 GPU
  # (what the A100 table's Triton defaults rely on), the H200 one elsewhere.
  args = ("tgmm", 32768, 2048, 1536, 128, jnp.bfloat16)
  assert tr.device_default_config(*args) == tr.default_config(*args)  # CPU
  monkeypatch.setattr(tr, "_on_sm80", lambda: True)
  assert tr.device_default_config(*args) == tr.a100_config(*args)
  assert tr.a100_config(*args) != tr.default_config(*args)


def test_configs_fit_smem():
  for op in ("gmm", "gmm_t", "tgmm"):
    for dtype in (jnp.bfloat16, jnp.float32):
      for m, g in ((32768, 128), (512, 128), (16384, 8)):
        d = tr.default_config(op, m, 2048, 1536, g, dtype)
        assert d.smem_bytes(dtype, op=op) <= tr.H200_SMEM_BYTES
        a = tr.a100_config(op, m, 2048, 1536, g, dtype)
        assert a.smem_bytes(dtype, op=op) <= tr.A100_SMEM_BYTES
        sweep = tr.gpu_sweep_configs(op, m, 2048, 1536, g, dtype)
        assert sweep[0] == d and len(set(sweep)) == len(sweep) > 4
        assert all(c.smem_bytes(dtype, op=op) <= tr.H200_SMEM_BYTES for c in sweep)
  # Decode-sized groups (64-row tiles), forward only: the 2-stage default among the
  # tuner's first four (the dX calls lost with it on the H200).
  decode = tr.gpu_sweep_configs("gmm", 512, 768, 2048, 128)
  assert decode[0].block_m == 64
  assert dataclasses.replace(decode[0], num_stages=2) in decode[:4]
  decode_dx = tr.gpu_sweep_configs("gmm_t", 512, 768, 2048, 128)
  assert all(c.num_stages >= 3 for c in decode_dx)
  # ... and for both, 32-row tiles stepping 128 deep (the decode dX entries' config).
  deep = tr.TritonConfig(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=3)
  assert deep in decode[:4] and deep in decode_dx[:4]
  training = tr.gpu_sweep_configs("gmm", 32768, 2048, 1536, 128)
  assert all(c.num_stages >= 3 for c in training)
  with pytest.raises(ValueError):
    tr.default_config("fwd", 1, 1, 1, 1)
  with pytest.raises(TypeError):
    tr.gmm(jnp.ones((4, 4)), jnp.ones((1, 4, 4)), jnp.array([4]), None,
           transpose_rhs=False, out_dtype=jnp.float32, precision=None,
           interpret=True, config=object())


def test_precision_and_dtype_refusals():
  lhs = jnp.ones((8, 16), jnp.float32)
  rhs = jnp.ones((1, 16, 16), jnp.float32)
  gs = jnp.array([8], jnp.int32)
  kw = dict(transpose_rhs=False, out_dtype=jnp.float32, interpret=True)
  for p in ("highest", (HIGHEST, HIGHEST), lax.Precision.DEFAULT, None):
    assert float(tr.gmm(lhs, rhs, gs, None, precision=p, **kw)[0, 0]) == 16.0
  with pytest.raises(NotImplementedError):
    tr.gmm(lhs, rhs, gs, None, precision=lax.DotAlgorithmPreset.F32_F32_F32, **kw)
  with pytest.raises(NotImplementedError):
    tr.gmm(lhs.astype(jnp.int32), rhs.astype(jnp.int32), gs, None, precision=None,
           transpose_rhs=False, out_dtype=jnp.int32, interpret=True)
  with pytest.raises(NotImplementedError, match="rhs dtype float16 beside lhs bfloat16"):
    tr.tgmm(lhs.astype(jnp.bfloat16), jnp.ones((8, 16), jnp.float16), gs, None, num_groups=1,
            out_dtype=jnp.float32, precision=None, interpret=True)


@pytest.mark.parametrize("n,refused", [(4096, False), (4097, True), (8192, True),
                                       (8193, False)])
def test_one_byte_weights_past_int32_offsets_refused(n, refused, monkeypatch):
  """e4m3 weights of 2**31 < size <= 2**32 elements would wrap Pallas-Triton's
  32-bit offsets (an illegal address on the GPU): the kernel refuses them, and
  ``ragged_dot`` hands it them widened (over 2**32 bytes: 64-bit offsets).  2**31
  elements, and arrays over 2**32 bytes, are taken as they are.  Abstract
  operands only."""
  from ragdot import api  # pylint: disable=g-import-not-at-top
  lhs = jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((256, 2048, n), jnp.float8_e4m3fn)
  gs = jax.ShapeDtypeStruct((256,), jnp.int32)
  assert tr.offsets_wrap(rhs) == refused
  call = functools.partial(tr.gmm, group_offset=None, transpose_rhs=False,
                           out_dtype=jnp.bfloat16, precision=None, interpret=True)
  if refused:
    with pytest.raises(NotImplementedError, match=f"rhs of {256 * 2048 * n} one-byte elements"):
      jax.eval_shape(call, lhs, rhs, gs)
  else:
    assert jax.eval_shape(call, lhs, rhs, gs).shape == (512, n)
  # Through the API: the kernel gets the weights as they are, or widened to bf16.
  seen = []
  real = tr.gmm
  monkeypatch.setattr(tr, "gmm", lambda lhs, rhs, *a, **kw: seen.append(rhs.dtype) or real(
      lhs, rhs, *a, **kw))
  got = jax.eval_shape(lambda x, w, g: api.ragged_dot(x, w, g, implementation="triton"),
                       lhs, rhs, gs)
  assert got.shape == (512, n) and got.dtype == jnp.bfloat16
  assert seen and set(seen) == {jnp.dtype(jnp.bfloat16 if refused else jnp.float8_e4m3fn)}


# --- lowering for a real GPU (no GPU needed: abstract device) ------------------


@pytest.mark.parametrize("kind", ["NVIDIA H200", "NVIDIA A100-SXM4-80GB"])
def test_lowers_for_cuda(kind):
  """Pallas -> Triton IR for sm90 / sm80 works on CPU (the W8A16 call with
  block scales too); PTX needs the GPU."""
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

  m, k, n, g, G = 300, 200, 136, 4, 8
  bf16 = jnp.bfloat16
  s = jax.ShapeDtypeStruct
  gs, go = s((G,), jnp.int32), s((), jnp.int32)
  cases = [
      (lambda l, r, a, o: tr.gmm(l, r, a, o, transpose_rhs=False, out_dtype=bf16,
                                 precision=None), (s((m, k), bf16), s((g, k, n), bf16))),
      (lambda l, r, a, o: tr.gmm(l, r, a, o, transpose_rhs=True, out_dtype=jnp.float32,
                                 precision=None), (s((m, k), bf16), s((g, n, k), bf16))),
      (lambda l, r, a, o: tr.gmm(l, r, a, o, transpose_rhs=False, out_dtype=jnp.float32,
                                 precision=HIGHEST),
       (s((m, k), jnp.float32), s((g, k, n), jnp.float32))),
      (lambda l, r, a, o: tr.tgmm(l, r, a, o, num_groups=g, out_dtype=bf16,
                                  precision=None), (s((m, k), bf16), s((m, n), bf16))),
  ]
  # sm90: W8A16 (Triton widens e4m3 from sm89 on) with block scales gathered from rhs's
  # layout (k = 256: 128-row blocks; n = 136 = 8 blocks of 17 columns, masked fp8 loads;
  # [g, n, k] per column, bf16 scales)
  e4m3 = jnp.float8_e4m3fn
  for nk, sshape, sdt in ((False, (g, 2, 8), jnp.float32), (True, (g, n, 2), bf16))[
      :2 if kind == "NVIDIA H200" else 0]:
    cases.append((
        lambda l, r, a, o, sc, nk=nk: tr.gmm(l, r, a, o, transpose_rhs=nk, out_dtype=bf16,
                                             precision=None, rhs_scale=sc),
        (s((m, 256), bf16), s((g, n, 256) if nk else (g, 256, n), e4m3), s(sshape, sdt))))
  device = AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
  mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
  for fn, operands in cases:
    extra = operands[2:]  # (the scales come after the group sizes and offset)
    with use_abstract_mesh(mesh):
      text = jax.jit(fn).trace(*operands[:2], gs, go, *extra).lower(
          lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


def test_lowers_for_cuda_under_shard_map():
  """Expert parallelism: the kernels lower inside shard_map (outputs varying)."""
  from jax.sharding import (AbstractDevice, AbstractMesh, AxisType, NamedSharding,
                            PartitionSpec as P, use_abstract_mesh)

  G = 4
  device = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
  mesh = AbstractMesh((2,), ("ep",), (AxisType.Explicit,), abstract_device=device)

  def shard(x, w, gs):
    o = lax.axis_index("ep") * (G // 2)
    x, gs = (lax.pcast(v, ("ep",), to="varying") for v in (x, gs))
    y = tr.gmm(x, w, gs, o, transpose_rhs=False, out_dtype=jnp.bfloat16, precision=None)
    dw = tr.tgmm(x, y, gs, o, num_groups=G // 2, out_dtype=jnp.bfloat16, precision=None)
    return lax.psum(y, "ep"), dw

  def fn(x, w, gs):
    return jax.shard_map(shard, mesh=mesh, in_specs=(P(), P("ep"), P()),
                         out_specs=(P(), P("ep")))(x, w, gs)

  s = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, spec))
  with use_abstract_mesh(mesh):
    text = jax.jit(fn).trace(
        s((256, 128), jnp.bfloat16, P()), s((G, 128, 256), jnp.bfloat16, P("ep")),
        s((G,), jnp.int32, P())).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("triton") >= 2


@pytest.mark.parametrize("op", ["gmm", "gmm_t", "tgmm"])
def test_kernels_lower_to_triton_ir_for_sm90(op, monkeypatch):
  """The Triton kernels at a real size and a default config build a Triton module
  that verifies (the schedule kernel's beside them where it applies)."""
  from triton_lowering import lower_for_sm90  # pylint: disable=g-import-not-at-top
  s = jax.ShapeDtypeStruct
  m, k, n, g = 32768, 2048, 1536, 128
  x, sizes = s((m, k), jnp.bfloat16), s((g,), jnp.int32)
  if op == "tgmm":
    fn = functools.partial(tr.tgmm, num_groups=g, out_dtype=jnp.bfloat16, precision=None)
    args = (x, s((m, n), jnp.bfloat16), sizes, None)
  else:
    w = s((g, n, k) if op == "gmm_t" else (g, k, n), jnp.bfloat16)
    fn = functools.partial(tr.gmm, transpose_rhs=op == "gmm_t", out_dtype=jnp.bfloat16,
                           precision=None)
    args = (x, w, sizes, None)
  results = lower_for_sm90(monkeypatch, fn, *args)
  assert results and any("tt.dot" in r.module.operation.get_asm() for r in results)
