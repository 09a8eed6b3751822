"""Hardware counters of the main kernels, for ``ncu`` (scripts/gpu_run.sh stage ``profile``).

Compiles and warms up each case, then runs it once between cudaProfilerStart and
cudaProfilerStop, so ``ncu --profile-from-start off`` sees only those launches:

  ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
      python3 scripts/profile_kernels.py [case ...]

Cases: Qwen3-30B gate_up forward and dW with the automatic choice, the dense
matmul of the same (m, k, n), and Mixtral gate_up forward (the shape where the
forward kernel is closest to dense) for contrast; ``dw_qwen_p6`` /
``dw_qwen_masker``: the dW 128 x 128 pingpong ring without / with the masking
warpgroup (where does the boundary masking's time go?); ``dw_qwen_masker192``:
the 128 x 192 ring with the masking warpgroup; ``dw_qwen_triton``: the
Pallas-Triton dW (one program per group and output tile); ``fwd_deepseek``:
DeepSeek-V3 down forward, the automatic choice; ``fwd_ep`` / ``fwd_ep_local`` /
``fwd_ep_zeros``: the EP=8 shard forward (group_offset), its local rows alone,
and its zero rows alone; ``fwd_down_decode`` / ``fwd_deepseek_decode``: the
decode forwards of Qwen3-30B down and DeepSeek-V3 down; ``fwd_down`` /
``fwd_down_aligned`` / ``batched_down`` / ``dense_down``: Qwen3-30B down forward
on routed and on 256-row groups, XLA's batched matmul (cuBLAS) of those
groups, and the dense matmul; ``w8a16_kn`` / ``w8a16_kn_scaled`` / ``w8a16_nk`` /
``w8a16_nk_scaled``: W8A16 decode of Qwen3-30B gate_up, fp8 weights in either
layout, without and with 128 x 128 block scales.  Inputs are routed
random data, never zeros.  Extra ncu sections (e.g. SourceCounters for the
stall sampling by instruction): ``PROFILE_SECTIONS`` in scripts/gpu_run.sh.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys

import jax
import jax.numpy as jnp

import ragdot
from ragdot import bench
from ragdot.backends import mosaic_dw


def _cudart():
  for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
    try:
      return ctypes.CDLL(name)
    except OSError:
      continue
  import cupy  # pylint: disable=g-import-not-at-top  (on the device image)
  return cupy.cuda.runtime


def _qwen_cases() -> dict:
  """Qwen3-30B gate_up forward, dW (Mosaic variants, Triton) and its dense
  matmul; Mixtral gate_up forward."""
  qwen = bench.Shape("qwen3-30b gate_up", 32768, 2048, 1536, 128, 8)
  mixtral = bench.Shape("mixtral gate_up", 16384, 4096, 28672, 8, top_k=2)
  out = {}
  for name, s, op in [("fwd_qwen", qwen, "fwd"), ("dw_qwen", qwen, "dw"),
                      ("fwd_mixtral", mixtral, "fwd")]:
    key = jax.random.key(len(out))
    sizes = jnp.asarray(bench.routed_group_sizes(s, seed=len(out)))
    x = jax.random.normal(key, (s.m, s.k), jnp.bfloat16)
    if op == "fwd":
      w = jax.random.normal(jax.random.fold_in(key, 1), (s.g, s.k, s.n), jnp.bfloat16)
      fn = jax.jit(lambda x, w, gs: ragdot.ragged_dot(x, w, gs))
    else:
      w = jax.random.normal(jax.random.fold_in(key, 1), (s.m, s.n), jnp.bfloat16)
      fn = jax.jit(lambda x, d, gs: ragdot.trans_ragged_dot(x, d, gs))
    out[name] = (fn, (x, w, sizes))
  x = jax.random.normal(jax.random.key(7), (32768, 2048), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(8), (2048, 1536), jnp.bfloat16)
  out["dense_qwen"] = (jax.jit(jnp.dot), (x, w))
  p6 = mosaic_dw.MosaicDwConfig(block_m=64, block_k=128, block_n=128, num_stages=6,
                                num_compute_wgs=2, pipeline_across_items=True,
                                banded_mask=True, epilogue_split=2, pingpong=True)
  _, _, sizes = out["dw_qwen"][1]
  dy = jax.random.normal(jax.random.key(9), (qwen.m, qwen.n), jnp.bfloat16)
  wide = dataclasses.replace(p6, block_n=192, num_stages=4, epilogue_split=3)
  for name, cfg in (("dw_qwen_p6", p6),
                    ("dw_qwen_masker", dataclasses.replace(p6, mask_warpgroup=True)),
                    ("dw_qwen_masker192", dataclasses.replace(wide, mask_warpgroup=True))):
    fn = jax.jit(lambda x, d, gs, cfg=cfg: mosaic_dw.tgmm(
        x, d, gs, None, num_groups=qwen.g, out_dtype=jnp.bfloat16, config=cfg))
    out[name] = (fn, (x, dy, sizes))
  # The Pallas-Triton dW (issue #5), its default config.
  from ragdot.backends import triton  # pylint: disable=g-import-not-at-top
  cfg = triton.default_config("tgmm", qwen.m, qwen.k, qwen.n, qwen.g)
  out["dw_qwen_triton"] = (jax.jit(lambda x, d, gs: triton.tgmm(
      x, d, gs, None, num_groups=qwen.g, out_dtype=jnp.bfloat16, precision=None,
      config=cfg)), (x, dy, sizes))
  return out


def _swap_cases() -> dict:
  """Qwen3-30B gate_up forward with the rows on wgmma's N axis
  (``mosaic_fwd_swap``): no tails folded, tails of up to 32 rows folded, and
  folded as two 144-row wgmmas (where does a folded item's extra time go?); the
  tail row-major on the first consumer (``tail_on_m``), and the split and M-tail
  folds on the dX call too (v20: the M tail ties the split fold on the forward
  but runs 0.95x the ring on the dX, whose weight blocks are K-major)."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  qwen = bench.Shape("qwen3-30b gate_up", 32768, 2048, 1536, 128, 8)
  sizes = jnp.asarray(bench.routed_group_sizes(qwen, seed=0))
  x = jax.random.normal(jax.random.key(0), (qwen.m, qwen.k), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (qwen.g, qwen.k, qwen.n), jnp.bfloat16)
  out = {}
  dy = jax.random.normal(jax.random.key(2), (qwen.m, qwen.n), jnp.bfloat16)
  for name, tail, fields, dx in (
      ("fwd_qwen_swap0", 0, {}, False), ("fwd_qwen_swap32", 32, {}, False),
      ("fwd_qwen_split32", 32, dict(tail_split=True), False),
      ("fwd_qwen_mtail32", 32, dict(tail_on_m=True), False),
      ("dx_qwen_split32", 32, dict(tail_split=True), True),
      ("dx_qwen_mtail32", 32, dict(tail_on_m=True), True)):
    cfg = mosaic_fwd.MosaicFwdConfig(128, 128, 64, 4, num_compute_wgs=2, ring=True, swap=True,
                                     tail_rows=tail, **fields)
    # dX: dy [m, n] against the weights read as [g, k, n] -> [m, k].
    out[name] = (jax.jit(lambda x, w, gs, cfg=cfg, dx=dx: mosaic_fwd.gmm(
        x, w, gs, None, transpose_rhs=dx, out_dtype=jnp.bfloat16, config=cfg)),
                 (dy if dx else x, w, sizes))
  return out


def _deepseek_cases() -> dict:
  """DeepSeek-V3 down forward (its groups of 128 +- 11 rows pad most): the
  automatic choice."""
  deepseek = bench.Shape("deepseek-v3 down", 32768, 2048, 7168, 256, 8)
  dsizes = jnp.asarray(bench.routed_group_sizes(deepseek, seed=3))
  dx_ = jax.random.normal(jax.random.key(10), (deepseek.m, deepseek.k), jnp.bfloat16)
  dw_ = (jax.random.normal(jax.random.key(11), (deepseek.g, deepseek.k, deepseek.n),
                           jnp.float32) / 32).astype(jnp.bfloat16)
  return {"fwd_deepseek": (jax.jit(lambda x, w, gs: ragdot.ragged_dot(x, w, gs)),
                           (dx_, dw_, dsizes))}


def _ep_cases() -> dict:
  """The EP=8 shard of Qwen3-30B gate_up (bench preset "ep"): the group_offset
  call (full-m output), the plain call over the local rows only, and the shard
  call with its local groups emptied (only the zero rows)."""
  s = bench.PRESETS["ep"][0]
  local = s.g // s.ep
  sizes, emptied, rows8 = bench.ep_shard_sizes(s)
  x = jax.random.normal(jax.random.key(12), (s.m, s.k), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(13), (local, s.k, s.n), jnp.float32) / 32
       ).astype(jnp.bfloat16)
  shard = jax.jit(lambda x, w, gs: ragdot.ragged_dot(x, w, gs, group_offset=jnp.int32(0)))
  return {"fwd_ep": (shard, (x, w, jnp.asarray(sizes))),
          "fwd_ep_local": (jax.jit(lambda x, w, gs: ragdot.ragged_dot(x, w, gs)),
                           (x[:rows8], w, jnp.asarray(sizes[:local]))),
          "fwd_ep_zeros": (shard, (x, w, jnp.asarray(emptied)))}


def _decode_cases() -> dict:
  """Decode forwards (64 tokens): Qwen3-30B down (0.946x the copy rate) against
  DeepSeek-V3 down (1.06x), both the automatic choice."""
  out = {}
  for i, (name, s) in enumerate((("fwd_down_decode", bench.PRESETS["decode"][1]),
                                 ("fwd_deepseek_decode", bench.PRESETS["decode"][3]))):
    key = jax.random.key(20 + i)
    w = (jax.random.normal(key, (s.g, s.k, s.n), jnp.float32) / 32).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 1), (s.m, s.k), jnp.bfloat16)
    out[name] = (jax.jit(lambda x, w, gs: ragdot.ragged_dot(x, w, gs)),
                 (x, w, jnp.asarray(bench.routed_group_sizes(s))))
  return out


def _down_cases() -> dict:
  """Qwen3-30B down forward (k = 768: the Qwen shape furthest from 0.75x dense):
  the automatic choice on routed groups and on groups of exactly 256 rows (no
  tails), XLA's batched matmul (cuBLAS) of those 256-row groups, and the dense
  matmul of the same (m, k, n)."""
  s = bench.Shape("qwen3-30b down", 32768, 768, 2048, 128, 8)
  x = jax.random.normal(jax.random.key(20), (s.m, s.k), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(21), (s.g, s.k, s.n), jnp.float32) / 32
       ).astype(jnp.bfloat16)
  fwd = jax.jit(lambda x, w, gs: ragdot.ragged_dot(x, w, gs))
  batched = jax.jit(lambda x, w: jnp.einsum(
      "gmk,gkn->gmn", x.reshape(s.g, s.m // s.g, s.k), w).reshape(s.m, s.n))
  return {"fwd_down": (fwd, (x, w, jnp.asarray(bench.routed_group_sizes(s)))),
          "fwd_down_aligned": (fwd, (x, w, jnp.full((s.g,), s.m // s.g, jnp.int32))),
          "batched_down": (batched, (x, w)),
          "dense_down": (jax.jit(jnp.dot), (x, w[0]))}


def _w8a16_cases() -> dict:
  """W8A16 decode (Qwen3-30B gate_up, 512 rows): fp8 weights [g, k, n] and [g, n, k],
  unscaled and with 128 x 128 block scales (v58b: [g, k, n]'s cost 8-11% against
  [g, n, k]'s 2% before its staged slices kept the 8-bit layout), each the
  automatic choice."""
  s = bench.PRESETS["decode"][0]
  fp8, bf = jnp.float8_e4m3fn, jnp.bfloat16
  key = jax.random.key(30)
  x = jax.random.normal(key, (s.m, s.k), bf)
  w = (jax.random.normal(jax.random.fold_in(key, 1), (s.g, s.k, s.n), jnp.float32) / 32
       ).astype(fp8)
  scale = jax.random.uniform(jax.random.fold_in(key, 2), (s.g, s.k // 128, s.n // 128),
                             jnp.float32, 0.5, 2.0)
  w_nk, scale_nk = jnp.swapaxes(w, 1, 2), jnp.swapaxes(scale, 1, 2)
  gs = jnp.asarray(bench.routed_group_sizes(s))
  kn = jax.jit(lambda x, w, gs, sc=None: ragdot.ragged_dot(x, w, gs, rhs_scale=sc))
  nk = jax.jit(lambda x, w, gs, sc=None: ragdot.ragged_dot_general(
      x, w, gs, bench.DN_DX, rhs_scale=sc))  # weights [g, n, k]
  return {"w8a16_kn": (kn, (x, w, gs)), "w8a16_kn_scaled": (kn, (x, w, gs, scale)),
          "w8a16_nk": (nk, (x, w_nk, gs)), "w8a16_nk_scaled": (nk, (x, w_nk, gs, scale_nk))}


# Each builder's case names: only the builders of the requested cases allocate.
_BUILDERS = (
    (_qwen_cases, ("fwd_qwen", "dw_qwen", "fwd_mixtral", "dense_qwen", "dw_qwen_p6",
                   "dw_qwen_masker", "dw_qwen_masker192", "dw_qwen_triton")),
    (_swap_cases, ("fwd_qwen_swap0", "fwd_qwen_swap32", "fwd_qwen_split32",
                   "fwd_qwen_mtail32", "dx_qwen_split32", "dx_qwen_mtail32")),
    (_deepseek_cases, ("fwd_deepseek",)),
    (_ep_cases, ("fwd_ep", "fwd_ep_local", "fwd_ep_zeros")),
    (_decode_cases, ("fwd_down_decode", "fwd_deepseek_decode")),
    (_down_cases, ("fwd_down", "fwd_down_aligned", "batched_down", "dense_down")),
    (_w8a16_cases, ("w8a16_kn", "w8a16_kn_scaled", "w8a16_nk", "w8a16_nk_scaled")),
)


def _cases(names: list[str]) -> dict:
  """The named cases (all of them for no names): name -> (jitted fn, args)."""
  known = [n for _, ns in _BUILDERS for n in ns]
  unknown = sorted(set(names) - set(known))
  if unknown:
    raise SystemExit(f"unknown cases {unknown}; known: {known}")
  out = {}
  for build, ns in _BUILDERS:
    if not names or set(ns) & set(names):
      out.update(build())
  return out


def main(argv: list[str]) -> int:
  cases = _cases(argv)
  names = argv or list(cases)
  for name in names:
    fn, args = cases[name]
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
  rt = _cudart()
  for name in names:
    fn, args = cases[name]
    print(f"profiling {name}", flush=True)
    (rt.cudaProfilerStart if hasattr(rt, "cudaProfilerStart") else rt.profilerStart)()
    jax.block_until_ready(fn(*args))
    (rt.cudaProfilerStop if hasattr(rt, "cudaProfilerStop") else rt.profilerStop)()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
