"""A/B of two tuning tables' entries on the same inputs (GPU machine).

  python3 scripts/ab_tables.py OLD.json NEW.json OUT_DIR [--rounds 3] [--presets training ...]

For every entry key that both tables hold with different configs and that an
op (fwd, dX, dW) of a shape of the bench presets (default: training) maps to,
times the old and the new entry's kernel interleaved with CUPTI on one set of
fresh random inputs; prints NEW/OLD and whether the outputs are bitwise equal;
writes OUT_DIR/ab_tables.json.
A check before a re-tuned entry replaces a shipped one.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from ragdot import backends, bench, timing
from ragdot.dispatch import backend_call, make_config


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("old")
  p.add_argument("new")
  p.add_argument("out_dir")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--presets", nargs="+", default=["training"], choices=sorted(bench.PRESETS))
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  old = json.load(open(args.old))["entries"]
  new = json.load(open(args.new))["entries"]
  rows = []
  for s in [s for name in args.presets for s in bench.PRESETS[name]]:
    for op in ("fwd", "dx", "dw"):
      call = backend_call(op, s.k, s.n)
      table_op = call.table_op
      # Table keys round k and n up to a bucket; match on the entry's call shape.
      matches = [k for k, e in new.items() if k.startswith(table_op + "/bfloat16/")
                 and e.get("shape") == [s.m, call.k, call.n, s.g]]
      if not matches:
        continue
      key = matches[0]
      a, b = old.get(key), new.get(key)
      if not a or not b or (a["backend"], a.get("config")) == (b["backend"], b.get("config")):
        continue
      kx, kw = jax.random.split(jax.random.key(len(rows) + 1))
      x = jax.random.normal(kx, (s.m, call.k), jnp.bfloat16)
      if call.op == "tgmm":
        w = jax.random.normal(kw, (s.m, call.n), jnp.bfloat16)
      else:
        shape = (s.g, call.n, call.k) if call.transpose_rhs else (s.g, call.k, call.n)
        w = (jax.random.normal(kw, shape, jnp.float32) / 32).astype(jnp.bfloat16)
      gs = jnp.asarray(bench.routed_group_sizes(s))

      def fn(entry):
        mod = backends.get_backend(entry["backend"])
        cfg = make_config(entry["backend"], table_op, entry.get("config"))
        if call.op == "tgmm":
          return jax.jit(lambda x, w, gs: mod.tgmm(
              x, w, gs, None, num_groups=s.g, out_dtype=jnp.bfloat16, precision=None,
              config=cfg))
        return jax.jit(lambda x, w, gs: mod.gmm(
            x, w, gs, None, transpose_rhs=call.transpose_rhs, out_dtype=jnp.bfloat16,
            precision=None, config=cfg))

      fa, fb = fn(a), fn(b)
      equal = bool(jnp.array_equal(fa(x, w, gs), fb(x, w, gs)))
      med = timing.interleaved_median_ms({"old": (fa, (x, w, gs)), "new": (fb, (x, w, gs))},
                                         rounds=args.rounds, iterations=args.iterations)
      row = dict(shape=s.name, op=op, key=key, old_ms=med["old"], new_ms=med["new"],
                 new_over_old=med["new"] / med["old"], bitwise_equal=equal,
                 old=a.get("config"), new=b.get("config"))
      rows.append(row)
      print(f"{s.name:20s} {op:3s} old {med['old']:.4f} ms  new {med['new']:.4f} ms  "
            f"new/old {row['new_over_old']:.3f}  equal {equal}", flush=True)
  with open(os.path.join(args.out_dir, "ab_tables.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
