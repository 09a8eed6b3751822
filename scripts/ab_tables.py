"""A/B of two tuning tables' entries on the same inputs (GPU machine).

  python3 scripts/ab_tables.py OLD.json NEW.json OUT_DIR [--rounds 3] [--presets training ...]
      [--resolved]

For every entry key that both tables hold with different configs and that an
op (fwd, dX, dW) of a shape of the bench presets (default: training) maps to,
times the old and the new entry's kernel interleaved with CUPTI on one set of
fresh random inputs; prints NEW/OLD and whether the outputs are bitwise equal;
writes OUT_DIR/ab_tables.json.
A check before a re-tuned entry replaces a shipped one.

``--resolved``: compares what the dispatcher runs under each table instead
(each table file the device's only table, as with ``RAGDOT_TABLE_DIR``: nearest
buckets, op defaults and the fitting rules included) for every op of every
shape whose choice differs: the check for entries new to a table, whose calls
borrowed another bucket's entry or the default before.  Plain calls only: EP
shard shapes (``ep`` > 1) are refused (``scripts/diag_ep.py`` times shards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp

from ragdot import backends, bench, dispatch, tables, timing
from ragdot.dispatch import backend_call, make_config


def resolved_choices(table_file: str, shapes, device: dispatch.Device) -> dict:
  """(shape name, op) -> the dispatcher's (backend, config) on ``device`` with
  ``table_file`` as its kind's table (a copy in a temporary RAGDOT_TABLE_DIR)."""
  device_kind = device.kind
  saved = os.environ.get(tables.ENV_DIR)
  with tempfile.TemporaryDirectory() as d:
    table = tables.load_file(table_file)
    if not table.matches(device_kind):
      raise SystemExit(f"{table_file} is a table for {table.device_kind!r}, "
                       f"which does not serve this device ({device_kind!r})")
    shutil.copy(table_file, os.path.join(d, tables.slug(table.device_kind)))
    os.environ[tables.ENV_DIR] = d
    dispatch.clear_cache()
    try:
      return {(s.name, op): (c.implementation, c.config)
              for s in shapes for op in ("fwd", "dx", "dw")
              for c in [bench.dispatch_choice(op, s, device=device)]}
    finally:
      if saved is None:
        os.environ.pop(tables.ENV_DIR, None)
      else:
        os.environ[tables.ENV_DIR] = saved
      dispatch.clear_cache()


def inputs(s, call, seed: int):
  """Fresh random (x, w, group sizes) for the backend call of one op."""
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (s.m, call.k), jnp.bfloat16)
  if call.op == "tgmm":
    w = jax.random.normal(kw, (s.m, call.n), jnp.bfloat16)
  else:
    shape = (s.g, call.n, call.k) if call.transpose_rhs else (s.g, call.k, call.n)
    w = (jax.random.normal(kw, shape, jnp.float32) / 32).astype(jnp.bfloat16)
  return x, w, jnp.asarray(bench.routed_group_sizes(s))


def kernel_fn(s, call, backend: str, cfg):
  """jit(x, w, gs) of one backend call with a built config (None: its default)."""
  mod = backends.get_backend(backend)
  if call.op == "tgmm":
    return jax.jit(lambda x, w, gs: mod.tgmm(
        x, w, gs, None, num_groups=s.g, out_dtype=jnp.bfloat16, precision=None,
        config=cfg))
  return jax.jit(lambda x, w, gs: mod.gmm(
      x, w, gs, None, transpose_rhs=call.transpose_rhs, out_dtype=jnp.bfloat16,
      precision=None, config=cfg))


def time_pair(s, op, call, fa, fb, seed, rounds, iterations):
  """(median ms of old, of new, bitwise equal) interleaved on one set of inputs."""
  args = inputs(s, call, seed)
  equal = bool(jnp.array_equal(fa(*args), fb(*args)))
  med = timing.interleaved_median_ms({"old": (fa, args), "new": (fb, args)},
                                     rounds=rounds, iterations=iterations)
  print(f"{s.name:30s} {op:3s} old {med['old']:.4f} ms  new {med['new']:.4f} ms  "
        f"new/old {med['new'] / med['old']:.3f}  equal {equal}", flush=True)
  return med["old"], med["new"], equal


def main_resolved(args, shapes) -> list[dict]:
  shards = [s.name for s in shapes if s.ep > 1]
  if shards:  # their calls take a group_offset and g / ep experts: not timed here
    raise SystemExit(f"--resolved times plain calls; EP shard shapes {shards}: use "
                     "scripts/diag_ep.py")
  device = dispatch.current_device()
  old = resolved_choices(args.old, shapes, device)
  new = resolved_choices(args.new, shapes, device)
  rows = []
  for s in shapes:
    for op in ("fwd", "dx", "dw"):
      a, b = old[(s.name, op)], new[(s.name, op)]
      if a == b:
        continue
      call = backend_call(op, s.k, s.n)
      old_ms, new_ms, equal = time_pair(
          s, op, call, kernel_fn(s, call, *a), kernel_fn(s, call, *b), len(rows) + 1,
          args.rounds, args.iterations)
      rows.append(dict(shape=s.name, op=op, old_ms=old_ms, new_ms=new_ms,
                       new_over_old=new_ms / old_ms, bitwise_equal=equal,
                       old=[a[0], str(a[1])], new=[b[0], str(b[1])]))
  return rows


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("old")
  p.add_argument("new")
  p.add_argument("out_dir")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--presets", nargs="+", default=["training"], choices=sorted(bench.PRESETS))
  p.add_argument("--resolved", action="store_true",
                 help="compare the dispatcher's choices under each table (see the docstring)")
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  if args.resolved:
    rows = main_resolved(args, [s for name in args.presets for s in bench.PRESETS[name]])
    with open(os.path.join(args.out_dir, "ab_tables.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, resolved=True, rows=rows), f,
                indent=1)
    return
  with open(args.old) as f:
    old = json.load(f)["entries"]
  with open(args.new) as f:
    new = json.load(f)["entries"]
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
      fa, fb = (kernel_fn(s, call, e["backend"], make_config(e["backend"], table_op,
                                                              e.get("config")))
                for e in (a, b))
      old_ms, new_ms, equal = time_pair(s, op, call, fa, fb, len(rows) + 1, args.rounds,
                                        args.iterations)
      row = dict(shape=s.name, op=op, key=key, old_ms=old_ms, new_ms=new_ms,
                 new_over_old=new_ms / old_ms, bitwise_equal=equal,
                 old=a.get("config"), new=b.get("config"))
      rows.append(row)
  with open(os.path.join(args.out_dir, "ab_tables.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
