"""What does the forward / dX kernels' epilogue cost? (GPU machine; a diagnostic)

  python3 scripts/diag_epilogue.py OUT_DIR [--calls "qwen3-30b down fwd" ...]
      [--swap-on-down] [--rounds 3]

For each call (preset shape, op) times the table's Mosaic config (and with
``--swap-on-down`` also Qwen3-30B down's forward and dX with the config of
Qwen3-30B gate_up's forward entry: a swap split one, unswizzled when 24b ran it,
swizzled since) three ways, interleaved (CUPTI):
  A  as shipped,
  S  without the TMA stores of the output (``mosaic_fwd._store_rows`` traced
     out: the registers are still staged in SMEM),
  T  (swap only) the square (64 x 64) staging chunks written untransposed:
     the (columns, rows) registers into the (rows, columns) buffer as if they
     were (rows, columns), so the SMEM writes are row-major,
S and T write wrong results: they only show what the stores and the transposed
staging cost.  (A case without the staging would let the compiler drop the
wgmmas whose results nothing reads.)  Writes OUT_DIR/diag_epilogue.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from ragdot import bench, dispatch, timing
from ragdot.backends import mosaic_fwd, sm90

from ab_fwd import gmm_inputs  # this folder (the script's sys.path[0])


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--calls", nargs="+", default=["qwen3-30b gate_up fwd", "qwen3-30b gate_up dx",
                                                 "qwen3-30b down fwd", "qwen3-30b down dx"])
  p.add_argument("--swap-on-down", action="store_true")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  shapes = {s.name: s for s in bench.PRESETS["training"]}
  todo = [(*call.rsplit(" ", 1), None) for call in args.calls]  # (shape, op, config)
  if args.swap_on_down:
    s = shapes["qwen3-30b gate_up"]
    swap_cfg = dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=s.m, k=s.k, n=s.n, g=s.g,
                               num_groups=s.g).config
    todo += [("qwen3-30b down", "fwd", swap_cfg), ("qwen3-30b down", "dx", swap_cfg)]
  rows = []
  for name, op, override in todo:
    s = shapes[name]
    gs = jnp.asarray(bench.routed_group_sizes(s))
    call = dispatch.backend_call(op, s.k, s.n)
    tr = call.transpose_rhs
    x, w = gmm_inputs(s, call, jax.random.key(len(rows) + 11))
    cfg = override or dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=s.m, k=call.k,
                                      n=call.n, g=s.g, num_groups=s.g,
                                      transpose_rhs=tr).config
    if not isinstance(cfg, mosaic_fwd.MosaicFwdConfig):
      print(f"skip {name} {op}: the table's choice is not a Mosaic config", flush=True)
      continue

    def make():
      return jax.jit(lambda x, w, gs: mosaic_fwd.gmm(
          x, w, gs, None, transpose_rhs=tr, out_dtype=jnp.bfloat16, precision=None,
          config=cfg))

    cases = {}
    real_store, real_stage = mosaic_fwd._store_rows, sm90.stage
    def untransposed(buf, value, transposed=False):
      square = tuple(buf.shape) == tuple(value.shape)
      real_stage(buf, value, transposed and not square)

    for case in ("A", "S", "T") if cfg.swap else ("A", "S"):
      f = make()
      if case == "S":
        mosaic_fwd._store_rows = lambda *a, **k: None
      if case == "T":
        sm90.stage = untransposed
      try:
        jax.block_until_ready(f(x, w, gs))  # traced and compiled with the patches
      finally:
        mosaic_fwd._store_rows, sm90.stage = real_store, real_stage
      cases[case] = (f, (x, w, gs))
    med = timing.interleaved_median_ms(cases, rounds=args.rounds, iterations=args.iterations)
    label = f"{name} {op}" + (" (gate_up's config)" if override else "")
    print(f"{label}: {cfg}", flush=True)
    for case in cases:
      print(f"  {case}  {med[case]:.4f} ms  x A {med[case] / med['A']:.3f}", flush=True)
    rows.append(dict(call=label, config=dataclasses.asdict(cfg),
                     ms={c: med[c] for c in cases},
                     x_a={c: med[c] / med["A"] for c in cases}))
  with open(os.path.join(args.out_dir, "diag_epilogue.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
