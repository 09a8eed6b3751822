"""A/B/C... of Pallas-Triton configs on a bench preset's shapes (GPU machine).

  python3 scripts/ab_triton.py OUT_DIR --op dw [--preset training] [--from-table]
      [--base FIELD=VALUE ...] --variants "num_stages=4" "block_n=256 num_warps=8" ...
      [--rounds 3]

For each shape of ``--preset`` times the Triton kernel of ``--op`` (dw: tgmm; fwd: gmm;
dx: gmm with rhs [g, n, k]) with the default config (A; ``--from-table``: the
shipped table's config where its entry is a Triton one; ``--base`` replaces
fields of it) and with each variant (A's config with those fields replaced),
plus the dense matmul of the same FLOPs, interleaved with CUPTI on one set of
fresh random inputs. Prints TFLOP/s, x dense, time x A and whether each
variant's output equals A's bitwise; writes OUT_DIR/ab_triton.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from ragdot import bench, timing
from ragdot.backends import triton as tr
from ragdot.dispatch import backend_call

from ab_fwd import parse_fields  # this folder (the script's sys.path[0])


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--op", default="dw", choices=["dw", "fwd", "dx"])
  p.add_argument("--base", nargs="+", default=[], metavar="FIELD=VALUE")
  p.add_argument("--variants", nargs="+", required=True, metavar="'FIELD=VALUE ...'")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--shapes", nargs="+", default=None, help="names of the preset's shapes")
  p.add_argument("--preset", default="training", choices=sorted(bench.PRESETS))
  p.add_argument("--from-table", action="store_true",
                 help="A: the table's Triton config (else the default)")
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []
  for s in bench.preset_shapes(args.preset, args.shapes):
    if s.ep > 1:
      raise SystemExit(f"{s.name}: EP shard shapes are timed by scripts/diag_ep.py")
    sizes = bench.routed_group_sizes(s)
    gs = jnp.asarray(sizes)
    call = backend_call(args.op, s.k, s.n)  # dX: k and n swapped, rhs [g, n, k]
    k, n = call.k, call.n
    kx, kw = jax.random.split(jax.random.key(len(rows) + 1))
    x = jax.random.normal(kx, (s.m, k), jnp.bfloat16)
    if args.op == "dw":
      y = jax.random.normal(kw, (s.m, n), jnp.bfloat16)
      dense = jax.jit(lambda x, y, gs: jnp.dot(x.T, y))
    else:
      wshape = (s.g, n, k) if args.op == "dx" else (s.g, k, n)
      y = (jax.random.normal(kw, wshape, jnp.float32) / 32).astype(jnp.bfloat16)
      dense = jax.jit(lambda x, y, gs: jnp.dot(x, y[0].T if args.op == "dx" else y[0]))
    base = tr.default_config(call.table_op, s.m, k, n, s.g)
    if args.from_table:
      choice = bench.dispatch_choice(args.op, s, "triton")
      base = choice.config if isinstance(choice.config, tr.TritonConfig) else base
    base = dataclasses.replace(base, **parse_fields(args.base))
    configs = {"A": base}
    for i, v in enumerate(args.variants):
      configs[chr(ord("B") + i)] = dataclasses.replace(base, **parse_fields(v.split()))

    def call(c):
      if args.op == "dw":
        return jax.jit(lambda x, y, gs: tr.tgmm(x, y, gs, None, num_groups=s.g,
                                                out_dtype=jnp.bfloat16, precision=None,
                                                config=c))
      return jax.jit(lambda x, y, gs: tr.gmm(x, y, gs, None, transpose_rhs=args.op == "dx",
                                             out_dtype=jnp.bfloat16, precision=None, config=c))

    fns = {name: call(c) for name, c in configs.items()}
    equal, ref = {}, None  # bitwise equality with A's output, compared on the device
    for name, fn in list(fns.items()):
      try:
        out = jax.block_until_ready(fn(x, y, gs))
      except Exception as e:  # pylint: disable=broad-except
        print(f"{s.name} {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del fns[name]
        continue
      ref = out if name == "A" else ref
      equal[name] = ref is not None and bool(jnp.array_equal(out, ref))
      del out
    cases = {name: (fn, (x, y, gs)) for name, fn in fns.items()}
    cases["dense"] = (dense, (x, y, gs))
    med = timing.interleaved_median_ms(cases, rounds=args.rounds, iterations=args.iterations)
    flops = 2 * s.m * k * n
    for name in fns:
      row = dict(shape=s.name, op=args.op, case=name, config=dataclasses.asdict(configs[name]),
                 ms=med[name], tflops=flops / med[name] / 1e9, x_dense=med["dense"] / med[name],
                 x_a=med[name] / med["A"] if "A" in med else float("nan"),
                 bitwise_equal_a=equal[name],
                 dense_ms=med["dense"])
      rows.append(row)
      label = (("table" if args.from_table else "default") if name == "A"
               else args.variants[ord(name) - ord("B")])
      print(f"{s.name:20s} {args.op} {name} {row['ms']:.4f} ms {row['tflops']:6.1f} TFLOP/s "
            f"x dense {row['x_dense']:.3f}  x A {row['x_a']:.3f}  equal {row['bitwise_equal_a']}"
            f"  [{label}]", flush=True)
    print(f"{s.name:20s} dense {med['dense']:.4f} ms {flops / med['dense'] / 1e9:6.1f} TFLOP/s",
          flush=True)
  with open(os.path.join(args.out_dir, "ab_triton.json"), "w") as f:
    json.dump(dict(op=args.op, preset=args.preset, from_table=args.from_table,
                   base=args.base, variants=args.variants,
                   device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
