"""The table's forward / dX choice against ``mosaic_fwd`` config variants on a
bench preset's shapes (training by default), side by side (GPU machine).

  python3 scripts/ab_variants.py OUT_DIR [--ops fwd dx] [--preset training] [--shapes NAME ...]
      [--shape m,k,n,g[,top_k] ...]
      [--variants "ring=True" "ring=True,tail_rows=16,epilogue_split=4" ...] [--rounds 3]
      [--triton] [--unfitted] [--group-rows R]

Per (shape, op): "table" = the dispatcher's automatic choice (backend and
config from the shipped table), "mosaic" = ``mosaic_fwd.gmm`` with its default
config, (``--triton``) "triton" = the Triton kernel as ``ragdot bench`` runs it, and one
case per variant: the default config (``--base table``: the
table's config, where it is a Mosaic one) with the variant's comma-separated
FIELD=VALUE changes (Python literals).  The calls have no group_offset: variants
of the shard path (``producer_zeros``) belong in ``diag_ep.py``.  Interleaved
CUPTI timing on one set of fresh random inputs; prints each case's time over
the table choice's and whether its output is bitwise equal to the base
config's (same tile and k order); writes OUT_DIR/ab_variants.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from ragdot import backends, bench, dispatch, timing
from ragdot.backends import mosaic_fwd

from ab_fwd import case_rows, gmm_inputs, parse_fields  # this folder (the script's sys.path[0])


def unfitted_choice(s: bench.Shape, call, device: dispatch.Device | None = None
                    ) -> dispatch.Choice:
  """The dispatcher's choice for preset shape ``s``'s call with
  ``fit_rows_per_group`` left out (the table entry's own swap tiles)."""
  fit = mosaic_fwd.fit_rows_per_group
  mosaic_fwd.fit_rows_per_group = lambda cfg, m, groups: cfg
  dispatch.clear_cache()
  try:
    return dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=s.m, k=call.k, n=call.n,
                           g=s.g, num_groups=s.g, transpose_rhs=call.transpose_rhs,
                           device=device)
  finally:
    mosaic_fwd.fit_rows_per_group = fit
    dispatch.clear_cache()


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--ops", nargs="+", default=["fwd", "dx"], choices=["fwd", "dx"])
  p.add_argument("--shapes", nargs="+", default=None, help="preset names (default: all)")
  p.add_argument("--shape", action="append", default=[], type=bench.parse_shape,
                 help="m,k,n,g[,top_k] (repeatable): these shapes instead of the preset's")
  p.add_argument("--variants", nargs="+", default=["ring=True"], metavar="F=V,F=V")
  p.add_argument("--base", default="default", choices=["default", "table"],
                 help="the config the variants change")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--preset", default="training", choices=sorted(bench.PRESETS))
  p.add_argument("--group-rows", type=int, default=None, metavar="R",
                 help="every group R rows instead of the routed sizes (rows past g x R: "
                      "zeros, the same work in every case)")
  p.add_argument("--unfitted", action="store_true",
                 help="also the table's entry as it stood before fit_rows_per_group "
                      "(case 'unfitted'): the dispatcher's fitting measured against it")
  p.add_argument("--triton", action="store_true",
                 help="also the Triton kernel (its default config unless the table's "
                      "entry for the shape is a Triton one), as the bench's ragdot:triton")
  args = p.parse_args()
  if args.shape and args.shapes:
    p.error("--shape and --shapes: give one of them")
  os.makedirs(args.out_dir, exist_ok=True)
  fields = {v: parse_fields([kv for kv in v.split(",") if kv]) for v in args.variants}
  rows = []
  for s in args.shape or bench.preset_shapes(args.preset, args.shapes):
    if s.ep > 1:
      raise SystemExit(f"{s.name}: EP shard shapes are timed by scripts/diag_ep.py")
    if args.group_rows is not None and args.group_rows * s.g > s.m:
      raise SystemExit(f"--group-rows {args.group_rows}: {s.g} groups exceed m = {s.m}")
    gs = (jnp.full((s.g,), args.group_rows, jnp.int32) if args.group_rows is not None
          else jnp.asarray(bench.routed_group_sizes(s)))
    for op in args.ops:
      call = dispatch.backend_call(op, s.k, s.n)
      tr = call.transpose_rhs
      x, w = gmm_inputs(s, call, jax.random.key(len(rows) + 7))
      choice = dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=s.m, k=call.k, n=call.n,
                               g=s.g, num_groups=s.g, transpose_rhs=tr)
      mod = backends.get_backend(choice.implementation)

      def run(module, config):
        return jax.jit(lambda x, w, gs: module.gmm(
            x, w, gs, None, transpose_rhs=tr, out_dtype=jnp.bfloat16, precision=None,
            config=config))

      base = mosaic_fwd.default_config(s.m, call.k, call.n, s.g, jnp.bfloat16, tr, jnp.bfloat16)
      cases = {"table": run(mod, choice.config), "mosaic": run(mosaic_fwd, base)}
      configs = {"table": choice.config, "mosaic": base}
      if args.unfitted:
        entry = unfitted_choice(s, call)
        if entry.config != choice.config:
          cases["unfitted"] = run(backends.get_backend(entry.implementation), entry.config)
          configs["unfitted"] = entry.config
      if args.triton:
        triton = dispatch.choose("gmm", "triton", dtype=jnp.bfloat16, m=s.m, k=call.k,
                                 n=call.n, g=s.g, num_groups=s.g, transpose_rhs=tr)
        cases["triton"] = run(backends.get_backend("triton"), triton.config)
        configs["triton"] = triton.config
      if args.base == "table" and isinstance(choice.config, mosaic_fwd.MosaicFwdConfig):
        base = choice.config
      for v in args.variants:
        try:
          cfg = dataclasses.replace(base, **fields[v])
        except (ValueError, TypeError) as e:  # e.g. a base whose tails the variant cannot
          # take, or a field the config does not have
          print(f"  skip {v} on {s.name} {op}: {e}", flush=True)
          continue
        if cfg.smem_bytes(jnp.bfloat16, jnp.bfloat16) > cfg.smem_budget():
          print(f"  skip {v}: SMEM", flush=True)
          continue
        configs[v] = cfg
        cases[v] = run(mosaic_fwd, cfg)
      ref = cases["table" if base is choice.config else "mosaic"](x, w, gs)  # the variants' base
      equal = {name: bool(jnp.array_equal(ref, f(x, w, gs))) for name, f in cases.items()}
      med = timing.interleaved_median_ms({name: (f, (x, w, gs)) for name, f in cases.items()},
                                         rounds=args.rounds, iterations=args.iterations)
      rows_used = min(s.m, int(gs.sum()))  # (--group-rows: the rows past g x R are no work)
      rows += case_rows(s.name, op, choice, med, equal, configs, 2 * rows_used * call.k * call.n,
                        "bitwise_equal_base")
      # After every (shape, op): a run cut short keeps what it measured.
      with open(os.path.join(args.out_dir, "ab_variants.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, group_rows=args.group_rows,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
