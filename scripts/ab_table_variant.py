"""The automatic choice under the shipped dispatch table and a variant of it,
interleaved (GPU machine): e.g. what one dW config field is worth inside a
whole forward+backward step.

  python3 scripts/ab_table_variant.py OUT_DIR --set "tgmm:side_rows=False" [--ops fwdbwd dw]
      [--preset training] [--shapes NAME ...] [--rounds 3]

"A" is this device's shipped table; "B" the same table with the ``--set``
changes (``OP:FIELD=VALUE,...``, Python literals) applied to every entry of
that table op (gmm, gmm_t, tgmm) whose backend is Mosaic.  B is written to a
temporary ``RAGDOT_TABLE_DIR``; each (shape, op) call is traced and compiled
under A and under B (the dispatcher decides at trace time), then both are timed
in turn (CUPTI) on one set of fresh inputs.  Prints B's time over A's and
whether the outputs are bitwise equal; writes OUT_DIR/ab_table_variant.json.
(``ab_tables.py`` times two tables' differing entries kernel by kernel; this
times whole calls, fwd+bwd among them.)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax

from ragdot import bench, dispatch, tables, timing

from ab_fwd import parse_fields  # this folder (the script's sys.path[0])


def variant_table(data: dict, changes: dict[str, dict]) -> tuple[dict, int]:
  """(table data with ``changes`` {table op: {field: value}} applied to its
  Mosaic entries, number of entries changed)."""
  data = json.loads(json.dumps(data))
  changed = 0
  for key, entry in data["entries"].items():
    op = key.split("/")[0]
    if op in changes and entry.get("backend") == "mosaic":
      entry.setdefault("config", {}).update(changes[op])
      entry["source"] = f"ab_table_variant.py variant {changes[op]}"
      changed += 1
  return data, changed


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--set", nargs="+", required=True, metavar="OP:FIELD=VALUE,...")
  p.add_argument("--ops", nargs="+", default=["fwdbwd"], choices=["fwd", "dx", "dw", "fwdbwd"])
  p.add_argument("--preset", default="training", choices=sorted(bench.PRESETS))
  p.add_argument("--shapes", nargs="+", default=None, help="preset names (default: all)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  changes: dict[str, dict] = {}
  for item in args.set:
    op, fields = item.split(":", 1)
    changes.setdefault(op, {}).update(parse_fields([kv for kv in fields.split(",") if kv]))

  dev = dispatch.current_device()
  shipped, _ = tables.table_for(dev.kind, dev.compute_capability)
  data, changed = variant_table(shipped.data, changes)
  print(f"A: {shipped.name}; B: {changed} entries changed by {changes}", flush=True)
  tmp = tempfile.mkdtemp()
  with open(os.path.join(tmp, shipped.name), "w") as f:
    json.dump(data, f)

  def under(table_dir: str | None, fn=None, inputs=()):
    """``fn`` compiled ahead of time for ``inputs`` while the dispatcher
    reads ``table_dir`` first (None: the shipped tables).  JAX's trace caches
    are cleared first, so that no cached trace carries the other table's
    choices over."""
    if table_dir is None:
      os.environ.pop(tables.ENV_DIR, None)
    else:
      os.environ[tables.ENV_DIR] = table_dir
    dispatch.clear_cache()
    jax.clear_caches()
    if fn is not None:
      return jax.jit(lambda *a: fn(*a)).lower(*inputs).compile()

  rows = []
  for s in bench.preset_shapes(args.preset, args.shapes):
    _, inputs = bench.shape_inputs(s, seed=len(rows) + 11)
    for op in args.ops:
      fn = bench._ragdot_fns(op, None)  # pylint: disable=protected-access
      cases = {}
      outs = {}
      for name, table_dir in (("A", None), ("B", tmp)):
        compiled = under(table_dir, fn, inputs)
        outs[name] = jax.block_until_ready(compiled(*inputs))
        cases[name] = (compiled, inputs)
      under(None)  # leave the shipped tables in place
      equal = all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(outs["A"]),
                                                      jax.tree.leaves(outs["B"])))
      del outs
      med = timing.interleaved_median_ms(cases, rounds=args.rounds, iterations=args.iterations)
      row = dict(shape=s.name, op=op, a_ms=med["A"], b_ms=med["B"],
                 b_over_a=med["B"] / med["A"], bitwise_equal=equal)
      rows.append(row)
      print(f"{s.name} {op}: A {med['A']:.4f} ms, B {med['B']:.4f} ms, B/A"
            f" {row['b_over_a']:.3f}, equal {equal}", flush=True)
  with open(os.path.join(args.out_dir, "ab_table_variant.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, set=args.set, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
