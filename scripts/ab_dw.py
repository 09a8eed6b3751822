"""The table's dW (tgmm) kernel against variants of its own config, side by
side on the training shapes (GPU machine).

  python3 scripts/ab_dw.py OUT_DIR [--shapes NAME ...]
      [--variants "num_stages=5,epilogue_rows=64" "epilogue_buffers=2" ...] [--rounds 3]
      [--out-dtype float32] [--with-default] [--shape m,k,n,g ...] [--skewed]

Per shape: "table" = the shipped table's dW choice, and one case per variant:
the table's Mosaic config with the variant's comma-separated FIELD=VALUE
changes (Python literals); with ``--with-default``, "default" = the heuristic
default config fitted to the output dtype (what the dispatcher runs when a
table config cannot be refitted to that dtype, or for an f32 output over small
groups, ``mosaic_dw.pingpong_pays``).  Where the dispatcher's choice for that
dtype is not the table's Mosaic ring (an f32 output, v71), "ring" = the
table's bf16 config refitted to the dtype, and the variants change it.
Shapes the Mosaic dW refuses (misaligned ``--shape``) time only the table's
choice.  Interleaved CUPTI timing on one set of fresh
random inputs; prints each case's time over the table's and whether its
output is bitwise equal to the table's; writes OUT_DIR/ab_dw.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from ragdot import backends, bench, dispatch, timing
from ragdot.backends import mosaic_dw

from ab_fwd import case_rows, dw_case, parse_fields  # this folder (the script's sys.path[0])


def shapes(args: argparse.Namespace) -> list[bench.Shape]:
  """``--shape``'s shapes, else the preset's (``--shapes`` picks some), each
  skewed with ``--skewed`` (its name then ends in ' skewed')."""
  chosen = (bench.select_shapes(args.shape, args.shapes) if args.shape
            else bench.preset_shapes(args.preset, args.shapes))
  if args.skewed:
    chosen = [s if s.skewed else dataclasses.replace(s, name=f"{s.name} skewed", skewed=True)
              for s in chosen]
  return chosen


def table_ring(s: bench.Shape, out_dtype) -> mosaic_dw.MosaicDwConfig | None:
  """The table's Mosaic dW config for ``s`` (its bf16-output entry) refitted
  to ``out_dtype``'s staging, as the dispatcher would run it without
  ``pingpong_pays``; None when the table's choice is no Mosaic config or the
  refit does not fit."""
  bf16 = dispatch.choose("tgmm", None, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, m=s.m,
                         k=s.k, n=s.n, g=s.g, num_groups=s.g)
  if bf16.implementation != "mosaic" or bf16.config is None:
    return None
  return mosaic_dw.fit_config(bf16.config, jnp.bfloat16, out_dtype)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--shapes", nargs="+", default=None,
                 help="of the preset's shapes (or --shape's, named m,k,n,g,top_k) time only"
                      " these, named as before --skewed (default: all)")
  p.add_argument("--shape", action="append", default=[], type=bench.parse_shape,
                 help="m,k,n,g[,top_k] (repeatable): these shapes instead of the preset's")
  p.add_argument("--skewed", action="store_true",
                 help="route every shape with the skewed routing (a few hot experts)")
  p.add_argument("--variants", nargs="+", default=[], metavar="F=V,F=V")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--preset", default="training", choices=sorted(bench.PRESETS),
                 help="e.g. training-skewed (shape names then end in ' skewed')")
  p.add_argument("--out-dtype", default="bfloat16", choices=["bfloat16", "float32"])
  p.add_argument("--with-default", action="store_true",
                 help="also time the heuristic default config (fitted to --out-dtype)")
  return p


def main() -> None:
  args = parser().parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  out_dtype = jnp.dtype(args.out_dtype)
  rows = []
  for i, s in enumerate(shapes(args)):
    gs, x, dy, choice = dw_case(s, jax.random.key(i + 3), out_dtype)
    mod = backends.get_backend(choice.implementation)

    def run(module, config):
      return jax.jit(lambda x, dy, gs: module.tgmm(
          x, dy, gs, None, num_groups=s.g, out_dtype=out_dtype, precision=None,
          config=config))

    cases = {"table": run(mod, choice.config)}
    configs = {"table": choice.config}
    base = choice.config
    refused = mosaic_dw.unsupported_shape(s.m, s.k, s.n)
    ring = None if refused else table_ring(s, out_dtype)
    if ring is not None and ring != base:  # the dispatcher runs the default instead
      configs["ring"], cases["ring"] = ring, run(mosaic_dw, ring)
      base = ring
    elif choice.implementation != "mosaic" or base is None:
      base = mosaic_dw.default_config(s.m, s.k, s.n, s.g, jnp.bfloat16, out_dtype)
    if refused and (args.with_default or args.variants):
      print(f"  {s.name}: the Mosaic dW refuses it ({refused}); only the table's choice",
            flush=True)
    elif args.with_default:
      configs["default"] = mosaic_dw.default_config(s.m, s.k, s.n, s.g, jnp.bfloat16, out_dtype)
      cases["default"] = run(mosaic_dw, configs["default"])
    for v in [] if refused else args.variants:
      try:
        cfg = dataclasses.replace(base, **parse_fields([kv for kv in v.split(",") if kv]))
      except (TypeError, ValueError) as e:  # an unknown field, a rejected value
        print(f"  skip {v}: {e}", flush=True)
        continue
      if mosaic_dw.smem_bytes(cfg, jnp.bfloat16, out_dtype) > cfg.smem_budget():
        print(f"  skip {v}: SMEM", flush=True)
        continue
      configs[v] = cfg
      cases[v] = run(mosaic_dw, cfg)
    ref = cases["table"](x, dy, gs)
    equal = {}
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    for name, f in cases.items():  # a variant summing in another order is not bitwise equal
      out = f(x, dy, gs)
      equal[name] = bool(jnp.array_equal(ref, out))
      diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
      print(f"  {name}: max |out - table| / max |table| = {diff / scale:.2e}", flush=True)
      del out
    med = timing.interleaved_median_ms({name: (f, (x, dy, gs)) for name, f in cases.items()},
                                       rounds=args.rounds, iterations=args.iterations)
    rows += case_rows(s.name, "dw", choice, med, equal, configs, 2 * s.m * s.k * s.n,
                      "bitwise_equal_table")
  with open(os.path.join(args.out_dir, "ab_dw.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
