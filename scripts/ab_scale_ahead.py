"""W8A16 with 128 x 128 block scales: how far ahead the swap kernel's producer
reads a step's per-block scales (``mosaic_fwd_swap._SCALES_AHEAD``), against
the unscaled call, side by side (GPU machine).

  python3 scripts/ab_scale_ahead.py OUT_DIR [--preset decode] [--only NAME ...]
      [--ahead 0 1 2 4] [--staging 0 1 2] [--rounds 5]

Per forward shape of the preset (Qwen3-30B gate_up and down by default), in
both weight layouts ([g, n, k] and [g, k, n]), each the automatic choice with
fresh random fp8 weights: "plain" (no scales) and "aheadA" (the scales read A
k steps before their stage is filled; 0: at the step, before its wait for a
free slot, the kernel before v61).  Interleaved CUPTI timing; prints each
case's time over "plain" and checks that every ahead gives the same bits (the
distance changes only when a scale is read).  ``--staging B ...``: [g, n, k] only,
"plain sB" / "scaled sB": ``mosaic_fwd.gmm`` on the dispatcher's config with
``widen_staging`` B (0: registers; 1-2: SMEM buffers a consumer, so the next
slice can be widened while the last one's wgmma runs), as
``weight_only_config`` fits it.  Writes OUT_DIR/ab_scale_ahead.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

import ragdot
from ragdot import bench, dispatch, timing
from ragdot.backends import mosaic_fwd, mosaic_fwd_swap

def _call(nk: bool):
  if nk:
    return lambda x, w, gs, sc=None: ragdot.ragged_dot_general(x, w, gs, bench.DN_DX,
                                                                   rhs_scale=sc)
  return lambda x, w, gs, sc=None: ragdot.ragged_dot(x, w, gs, rhs_scale=sc)


def cases(s: bench.Shape, key, aheads: list[int], staging: list[int]) -> dict[str, tuple]:
  """name -> (compiled fn, args): each scaled case traced with its own distance."""
  x = jax.random.normal(key, (s.m, s.k), jnp.bfloat16)
  w = (jax.random.normal(jax.random.fold_in(key, 1), (s.g, s.k, s.n), jnp.float32) / 32
       ).astype(jnp.float8_e4m3fn)
  sc = jax.random.uniform(jax.random.fold_in(key, 2), (s.g, s.k // 128, s.n // 128),
                          jnp.float32, 0.5, 2.0)
  gs = jnp.asarray(bench.routed_group_sizes(s))
  out = {}
  if staging:  # [g, n, k], the dispatcher's config with each widen_staging
    wl, scl = jnp.swapaxes(w, 1, 2), jnp.swapaxes(sc, 1, 2)
    c = dispatch.choose("gmm", None, dtype=jnp.bfloat16, rhs_dtype=w.dtype,
                        out_dtype=jnp.bfloat16, m=s.m, k=s.k, n=s.n, g=s.g, num_groups=s.g,
                        transpose_rhs=True)
    for b in staging:
      for name, scale, rows in (("plain", None, None), ("scaled", scl, 128)):
        cfg = mosaic_fwd.weight_only_config(dataclasses.replace(c.config, widen_staging=b),
                                            s.m, s.g, s.k, True, rows, rows)
        print(f"{s.name} {name} s{b}: {cfg}", flush=True)
        fn = jax.jit(lambda x, w, gs, sc, cfg=cfg: mosaic_fwd.gmm(
            x, w, gs, None, transpose_rhs=True, out_dtype=jnp.bfloat16, config=cfg,
            rhs_scale=sc))
        out[f"nk {name} s{b}"] = (fn, (x, wl, gs, scale))
    return out
  for nk in (True, False):
    lay = "nk" if nk else "kn"
    wl, scl = (jnp.swapaxes(w, 1, 2), jnp.swapaxes(sc, 1, 2)) if nk else (w, sc)
    out[f"{lay} plain"] = (jax.jit(_call(nk)), (x, wl, gs))
    for a in aheads:
      mosaic_fwd_swap._SCALES_AHEAD = a  # pylint: disable=protected-access
      fn = jax.jit(_call(nk))
      jax.block_until_ready(fn(x, wl, gs, scl))  # traced and compiled with this distance
      out[f"{lay} ahead{a}"] = (fn, (x, wl, gs, scl))
  return out


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--preset", default="decode", choices=sorted(bench.PRESETS))
  p.add_argument("--only", nargs="*", default=["qwen3-30b gate_up decode", "qwen3-30b down decode"])
  p.add_argument("--ahead", nargs="*", type=int, default=[0, 1, 2, 4])
  p.add_argument("--staging", nargs="*", type=int, default=[])
  p.add_argument("--rounds", type=int, default=5)
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  shapes = [s for s in bench.PRESETS[args.preset] if not args.only or s.name in args.only]
  if not shapes:
    raise SystemExit(f"no shape of {args.preset} named {args.only}")
  kept = mosaic_fwd_swap._SCALES_AHEAD  # pylint: disable=protected-access
  rows = []
  for i, s in enumerate(shapes):
    cs = cases(s, jax.random.key(60 + i), args.ahead, args.staging)
    mosaic_fwd_swap._SCALES_AHEAD = kept  # pylint: disable=protected-access
    ms = timing.interleaved_median_ms(cs, rounds=args.rounds)
    if args.staging:
      base = ms[f"nk plain s{args.staging[0]}"]
      outs = {b: jax.device_get(cs[f"nk scaled s{b}"][0](*cs[f"nk scaled s{b}"][1]))
              for b in args.staging}
      for name, t in ms.items():
        row = dict(shape=s.name, m=s.m, k=s.k, n=s.n, g=s.g, case=name, ms=t,
                   over_first_plain=t / base)
        rows.append(row)
        print(f"{s.name:20s} {name:14s} {t:8.4f} ms  x{t / base:5.3f}", flush=True)
      ref = outs[args.staging[0]].astype("float32")
      for b, o in outs.items():  # (other tiles sum in another order: close, maybe not bitwise)
        print(f"  scaled s{b}: max |diff| to s{args.staging[0]} "
              f"{float(abs(o.astype('float32') - ref).max()):.3g}", flush=True)
      continue
    for lay in ("nk", "kn"):
      outs = [jax.device_get(cs[f"{lay} ahead{a}"][0](*cs[f"{lay} ahead{a}"][1]))
              for a in args.ahead]
      same = all((o.view("uint16") == outs[0].view("uint16")).all() for o in outs[1:])
      base = ms[f"{lay} plain"]
      for name in [f"{lay} plain"] + [f"{lay} ahead{a}" for a in args.ahead]:
        row = dict(shape=s.name, m=s.m, k=s.k, n=s.n, g=s.g, case=name, ms=ms[name],
                   over_plain=ms[name] / base, same_bits=same)
        rows.append(row)
        print(f"{s.name:20s} {name:10s} {ms[name]:8.4f} ms  x{ms[name] / base:5.3f}"
              f"  same bits across aheads: {same}", flush=True)
  with open(os.path.join(args.out_dir, "ab_scale_ahead.json"), "w") as f:
    json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
