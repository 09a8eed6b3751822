"""fp8 forward calls (both operands fp8, or fp8 weights beside bf16 rows) in both
weight layouts against the bf16 call (GPU machine).

  python3 scripts/fp8_layouts.py OUT_DIR [--shapes qwen3-30b] [--rounds 3]
      [--only NAME ...] [--shape m,k,n,g[,top_k] ...] [--variant LAYOUT:S,K,B ...]

For each forward shape of the named preset (training and decode token counts),
times interleaved (CUPTI, ``timing.interleaved_median_ms``) on fresh random
inputs, bf16 output, the automatic choice each:
  bf16 [g,k,n]        the bf16 call;
  fp8 [g,k,n]         the automatic choice: with a 16-bit result the rows widened
                      to bf16 and the W8A16 form reading the weights as stored;
  fp8 [g,k,n] copy    an fp8 [g, n, k] copy of the weights, then 8-bit wgmma (the
                      automatic choice before v54);
  fp8 [g,k,n] bf16    the fp8 operands converted to bf16 first (the path before v52);
  fp8 [g,n,k]         native, weights already K-major;
  transpose           the fp8 [g, n, k] copy alone;
  w8a16 [g,n,k]       bf16 rows, fp8 weights (W8A16), the automatic choice: the
                      swap kernel widening the weights in registers (the
                      Triton kernel below where it refuses: fewer than 64 rows);
  w8a16 [g,k,n]       the same with the weights read as stored, widened
                      through two SMEM buffers a consumer;
  w8a16 [g,n,k] smemS the automatic config with ``widen_staging`` S (1, 2);
  w8a16 [g,k,n] smem1 the same, one buffer;
  w8a16 ... r64       at decode, the 64-row tiles the kernel took before v54f;
  w8a16 ... triton    the Triton kernel (the bf16 call's Triton config) widening
                      each weight block after its load, either layout;
  bf16 [g,k,n] triton the bf16 call on that Triton config;
  w8a16 bf16          bf16 rows, the weights converted to bf16 first (the path
                      before v53);
  w8a16 ... scaled api  ``ragged_dot[_general](..., rhs_scale=)``, 128 x 128 block
                      scales, the automatic choice (Mosaic or Triton);
  w8a16 ... scaled     the automatic config with 128 x 128 block scales
                      (``rhs_scale`` as given: one scale a consumer and k step);
  w8a16 ... scaled col  the same scales laid out per column inside the timed call
                      (``scales.kernel_scales``; the kernel's only form before v57);
  w8a16 [g,k,n] scaled col pre  per-column scales laid out before the call;
  kernel_scales       that layout alone ([g, k // 128, n] f32 from [g, k // 128, n // 128]);
  w8a16 [g,k,n] sS kK bB  with ``--variant kn:S,K,B`` (or ``nk:``): the automatic
                      config with S stages, k steps of K columns and ``widen_staging``
                      B, as ``weight_only_config`` fits it (the name gives the result);
checks each fp8 result against the f32 sum of the same values, and writes
OUT_DIR/fp8_layouts.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp

import ragdot
from ragdot import backends, bench, dispatch, scales, timing
from ragdot.backends import mosaic_fwd

NK = bench.DN_DX  # weights [g, n, k]
FP8 = jnp.float8_e4m3fn


def cases(s: bench.Shape, key, variants: tuple[str, ...] = ()) -> tuple[dict, dict]:
  """The timed cases (name: (fn, args)) of shape ``s`` and the fp8 results to check;
  ``variants``: "kn:S,K,B" / "nk:S,K,B" configs of the Mosaic W8A16 kernel."""
  gs = jnp.asarray(bench.routed_group_sizes(s))
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (s.m, s.k), jnp.float32)
  w = jax.random.normal(kw, (s.g, s.k, s.n), jnp.float32) / 32
  x8, w8 = x.astype(FP8), w.astype(FP8)
  w8_nk = jnp.swapaxes(w8, 1, 2)
  bf = jnp.bfloat16
  kn = jax.jit(lambda x, w: ragdot.ragged_dot(x, w, gs, preferred_element_type=bf))
  nk = jax.jit(lambda x, w: ragdot.ragged_dot_general(x, w, gs, NK,
                                                      preferred_element_type=bf))
  widened = jax.jit(lambda x, w: ragdot.ragged_dot(x.astype(bf), w.astype(bf), gs))
  transpose = jax.jit(lambda w: jnp.swapaxes(w, 1, 2))
  xb = x.astype(bf)
  scale = jax.random.uniform(kx, (s.g, s.k // 128, s.n // 128), jnp.float32, 0.5, 2.0)

  def w8a16_config(nk_layout: bool):
    return dispatch.choose("gmm", None, dtype=bf, rhs_dtype=FP8, out_dtype=bf, m=s.m, k=s.k,
                           n=s.n, g=s.g, num_groups=s.g, transpose_rhs=nk_layout).config

  def staged(nk_layout: bool, staging: int = 0, **fields):
    cfg = dataclasses.replace(w8a16_config(nk_layout), **fields)
    if staging:
      cfg = dataclasses.replace(cfg, widen_staging=staging)
    cfg = mosaic_fwd.weight_only_config(cfg, s.m, s.g, s.k, nk_layout)
    return jax.jit(lambda x, w: mosaic_fwd.gmm(x, w, gs, None, transpose_rhs=nk_layout,
                                               out_dtype=bf, config=cfg))

  def triton(nk_layout: bool):
    choice = dispatch.choose("gmm", "triton", dtype=bf, out_dtype=bf, m=s.m, k=s.k, n=s.n,
                             g=s.g, num_groups=s.g, transpose_rhs=nk_layout)
    return jax.jit(lambda x, w: backends.get_backend("triton").gmm(
        x, w, gs, None, transpose_rhs=nk_layout, out_dtype=bf, precision=None,
        config=choice.config))

  def fp8_copy():
    choice = dispatch.choose("gmm", None, dtype=FP8, out_dtype=bf, m=s.m, k=s.k, n=s.n, g=s.g,
                             num_groups=s.g, transpose_rhs=True)
    return jax.jit(lambda x, w: mosaic_fwd.gmm(x, w, gs, None, transpose_rhs=False,
                                               out_dtype=bf, config=choice.config))

  mosaic = isinstance(w8a16_config(True), mosaic_fwd.MosaicFwdConfig)
  scale_nk = jnp.swapaxes(scale, 1, 2)
  kn_scaled = jax.jit(lambda x, w, sc: ragdot.ragged_dot(x, w, gs, rhs_scale=sc))
  nk_scaled = jax.jit(lambda x, w, sc: ragdot.ragged_dot_general(x, w, gs, NK, rhs_scale=sc))
  timed = {
      "w8a16 [g,n,k] scaled api": (nk_scaled, (xb, w8_nk, scale_nk)),
      "w8a16 [g,k,n] scaled api": (kn_scaled, (xb, w8, scale)),
      "bf16 [g,k,n]": (kn, (xb, w.astype(bf))),
      "fp8 [g,k,n]": (kn, (x8, w8)),
      "fp8 [g,k,n] copy": (fp8_copy(), (x8, w8)),
      "fp8 [g,k,n] bf16": (widened, (x8, w8)),
      "fp8 [g,n,k]": (nk, (x8, w8_nk)),
      "transpose": (transpose, (w8,)),
      "w8a16 [g,n,k]": (nk, (xb, w8_nk)),
      "w8a16 [g,k,n]": (kn, (xb, w8)),
      "w8a16 bf16": (widened, (xb, w8)),
      "w8a16 [g,n,k] triton": (triton(True), (xb, w8_nk)),
      "w8a16 [g,k,n] triton": (triton(False), (xb, w8)),
      "bf16 [g,k,n] triton": (triton(False), (xb, w.astype(bf))),
  }
  if mosaic:  # the Mosaic W8A16 kernel's other forms
    timed.update({
        "w8a16 [g,n,k] smem1": (staged(True, 1), (xb, w8_nk)),
        "w8a16 [g,n,k] smem2": (staged(True, 2), (xb, w8_nk)),
        "w8a16 [g,k,n] smem1": (staged(False, 1), (xb, w8)),
    })
    def scaled(nk_layout: bool, per_column: bool = False):
      """128 x 128 blocks as given; ``per_column``: laid out per column in the call."""
      cfg = w8a16_config(nk_layout)
      col = lambda sc, w: columns(sc, w.shape, nk_layout) if per_column else sc
      return jax.jit(lambda x, w, sc: mosaic_fwd.gmm(
          x, w, gs, None, transpose_rhs=nk_layout, out_dtype=bf, config=cfg,
          rhs_scale=col(sc, w)))

    def columns(sc, shape, nk_layout: bool):  # per-column scales in rhs's layout
      ks = scales.kernel_scales(sc, shape, nk_layout)
      return jnp.swapaxes(ks, 1, 2) if nk_layout else ks

    for nk_layout, name, wt, sc in ((True, "n,k", w8_nk, scale_nk), (False, "k,n", w8, scale)):
      timed[f"w8a16 [g,{name}] scaled"] = (scaled(nk_layout), (xb, wt, sc))
      timed[f"w8a16 [g,{name}] scaled col"] = (scaled(nk_layout, True), (xb, wt, sc))
    # ([g, k, n] only: [g, n, k]'s per-column scales in rhs's layout, [g, n, k // t], are
    # transposed for the kernel inside the call, which is no "pre")
    timed["w8a16 [g,k,n] scaled col pre"] = (scaled(False), (xb, w8, columns(scale, w8.shape,
                                                                               False)))
    timed["kernel_scales"] = (jax.jit(functools.partial(
        scales.kernel_scales, rhs_shape=w8.shape, transpose_rhs=False)), (scale,))
    for spec in variants:
      layout, fields = spec.split(":")
      stages, block_k, staging = map(int, fields.split(","))
      nk_layout = layout == "nk"
      cfg = mosaic_fwd.weight_only_config(dataclasses.replace(
          w8a16_config(nk_layout), num_stages=stages, block_k=block_k, widen_staging=staging),
          s.m, s.g, s.k, nk_layout)
      name = (f"w8a16 [g,{'n,k' if nk_layout else 'k,n'}] s{cfg.num_stages} k{cfg.block_k} "
              f"b{cfg.widen_staging}")
      timed[name] = (jax.jit(functools.partial(
          lambda x, w, cfg, nk_layout: mosaic_fwd.gmm(x, w, gs, None, transpose_rhs=nk_layout,
                                                      out_dtype=bf, config=cfg),
          cfg=cfg, nk_layout=nk_layout)), (xb, w8_nk if nk_layout else w8))
    if w8a16_config(True).swap_rows < 64:  # decode: the tiles before v54f
      timed["w8a16 [g,n,k] r64"] = (staged(True, swap_rows=64), (xb, w8_nk))
      timed["w8a16 [g,k,n] r64"] = (staged(False, swap_rows=64), (xb, w8))
  f32 = lambda a: a.astype(jnp.float32)
  exact = ragdot.ragged_dot(f32(x8), f32(w8), gs, implementation="xla")
  exact16 = ragdot.ragged_dot(f32(xb), f32(w8), gs, implementation="xla")
  checks = {"fp8 [g,k,n]": (kn(x8, w8), exact), "fp8 [g,n,k]": (nk(x8, w8_nk), exact),
            "w8a16 [g,n,k]": (nk(xb, w8_nk), exact16), "w8a16 [g,k,n]": (kn(xb, w8), exact16)}
  deq = scales.dequantize(w8, scale, jnp.float32)  # (the scaled forms' weights, [g, k, n])
  exact_scaled = ragdot.ragged_dot(f32(xb), deq, gs, implementation="xla")
  for name in list(timed):
    if name.startswith("w8a16 [g,") or name == "fp8 [g,k,n] copy":
      fn, args = timed[name]
      want = (exact_scaled if "scaled" in name else
              exact16 if name.startswith("w8a16") else exact)
      try:
        checks.setdefault(name, (fn(*args), want))
      except Exception as e:  # pylint: disable=broad-except  (a form that fails: reported, not timed)
        print(f"{s.name}: {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del timed[name]
  return timed, checks


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--shapes", default="qwen3-30b", choices=sorted(bench.PRESETS))
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--only", nargs="*", default=None, help="shape names to keep")
  p.add_argument("--shape", action="append", default=[], type=bench.parse_shape,
                 help="m,k,n,g[,top_k] (repeatable): these shapes after the preset's")
  p.add_argument("--variant", action="append", default=[],
                 help="kn:S,K,B or nk:S,K,B (repeatable): W8A16 configs to time too")
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []
  for i, s in enumerate(list(bench.PRESETS[args.shapes]) + args.shape):
    if args.only and s.name not in args.only:
      continue
    timed, checks = cases(s, jax.random.key(100 + i), tuple(args.variant))
    errs = {name: float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))
                        / jnp.max(jnp.abs(want))) for name, (got, want) in checks.items()}
    ms = timing.interleaved_median_ms(timed, rounds=args.rounds)
    base = ms["bf16 [g,k,n]"]
    row = dict(shape=s.name, m=s.m, k=s.k, n=s.n, g=s.g, ms=ms, rel_err=errs)
    rows.append(row)
    cells = "  ".join(f"{name} {t:.4f} ({t / base:.2f})" for name, t in ms.items())
    print(f"{s.name}: {cells}  max rel err {max(errs.values()):.1e}", flush=True)
    with open(os.path.join(args.out_dir, "fp8_layouts.json"), "w") as f:  # after each shape
      json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
