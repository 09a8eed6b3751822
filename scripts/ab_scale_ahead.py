"""W8A16 with 128 x 128 block scales: how far ahead the swap kernel's producer
reads a step's per-block scales (``mosaic_fwd_swap._SCALES_AHEAD``), against
the unscaled call, side by side (GPU machine).

  python3 scripts/ab_scale_ahead.py OUT_DIR [--preset decode] [--only NAME ...]
      [--ahead 0 1 2 4] [--rounds 5]

Per forward shape of the preset (Qwen3-30B gate_up and down by default), in
both weight layouts ([g, n, k] and [g, k, n]), each the automatic choice with
fresh random fp8 weights: "plain" (no scales) and "aheadA" (the scales read A
k steps before their stage is filled; 0: at the step, before its wait for a
free slot, the kernel before v61).  Interleaved CUPTI timing; prints each
case's time over "plain" and checks that every ahead gives the same bits (the
distance changes only when a scale is read).  Writes OUT_DIR/ab_scale_ahead.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
from jax import lax

import ragdot
from ragdot import bench, timing
from ragdot.backends import mosaic_fwd_swap

NK = lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])


def _call(nk: bool):
  if nk:
    return lambda x, w, gs, sc=None: ragdot.ragged_dot_general(x, w, gs, NK, rhs_scale=sc)
  return lambda x, w, gs, sc=None: ragdot.ragged_dot(x, w, gs, rhs_scale=sc)


def cases(s: bench.Shape, key, aheads: list[int]) -> dict[str, tuple]:
  """name -> (compiled fn, args): each scaled case traced with its own distance."""
  x = jax.random.normal(key, (s.m, s.k), jnp.bfloat16)
  w = (jax.random.normal(jax.random.fold_in(key, 1), (s.g, s.k, s.n), jnp.float32) / 32
       ).astype(jnp.float8_e4m3fn)
  sc = jax.random.uniform(jax.random.fold_in(key, 2), (s.g, s.k // 128, s.n // 128),
                          jnp.float32, 0.5, 2.0)
  gs = jnp.asarray(bench.routed_group_sizes(s))
  out = {}
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
  p.add_argument("--rounds", type=int, default=5)
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  shapes = [s for s in bench.PRESETS[args.preset] if not args.only or s.name in args.only]
  if not shapes:
    raise SystemExit(f"no shape of {args.preset} named {args.only}")
  kept = mosaic_fwd_swap._SCALES_AHEAD  # pylint: disable=protected-access
  rows = []
  for i, s in enumerate(shapes):
    cs = cases(s, jax.random.key(60 + i), args.ahead)
    mosaic_fwd_swap._SCALES_AHEAD = kept  # pylint: disable=protected-access
    ms = timing.interleaved_median_ms(cs, rounds=args.rounds)
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
