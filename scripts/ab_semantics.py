"""The table's Mosaic kernels lowered with Pallas' Warpgroup semantics against
Lane semantics (``sm90.LOWERING_SEMANTICS``), side by side (GPU machine).

  python3 scripts/ab_semantics.py OUT_DIR [--preset training] [--shapes NAME ...]
      [--ops fwd dx dw fwdbwd] [--rounds 3]

Per (shape, op), the bench's own function (``ragdot`` through the dispatcher)
is traced, lowered and compiled once per semantics (the module value is read
at trace time); prints both lowering and compile times, whether the outputs
are bitwise equal, and the interleaved CUPTI time of Lane over Warpgroup;
writes OUT_DIR/ab_semantics.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from ragdot import bench, timing
from ragdot.backends import sm90

SEMANTICS = {"warpgroup": plgpu.LoweringSemantics.Warpgroup,
             "lane": plgpu.LoweringSemantics.Lane}


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--preset", default="training", choices=sorted(bench.PRESETS))
  p.add_argument("--shapes", nargs="+", default=None, help="preset names (default: all)")
  p.add_argument("--ops", nargs="+", default=["fwd", "dx", "dw", "fwdbwd"],
                 choices=["fwd", "dx", "dw", "fwdbwd"])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []
  for s in bench.PRESETS[args.preset]:
    if args.shapes and s.name not in args.shapes:
      continue
    _, inputs = bench.shape_inputs(s, 0)
    for op in args.ops:
      cases, row = {}, dict(shape=s.name, op=op)
      for name, sem in SEMANTICS.items():
        sm90.LOWERING_SEMANTICS = sem
        fn = bench._ragdot_fns(op, None)  # pylint: disable=protected-access  (a fresh function: no jit cache hit)
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(*inputs)
        t1 = time.perf_counter()
        cases[name] = (lowered.compile(), inputs)
        row[f"{name}_lower_s"], row[f"{name}_compile_s"] = t1 - t0, time.perf_counter() - t1
      sm90.LOWERING_SEMANTICS = SEMANTICS["lane"]
      outs = {name: jax.tree.leaves(f(*a)) for name, (f, a) in cases.items()}
      row["bitwise_equal"] = all(
          np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
          for a, b in zip(outs["warpgroup"], outs["lane"]))
      del outs
      med = timing.interleaved_median_ms(cases, rounds=args.rounds, iterations=args.iterations)
      row.update({f"{name}_ms": ms for name, ms in med.items()})
      row["lane_over_warpgroup"] = med["lane"] / med["warpgroup"]
      rows.append(row)
      print(f"{s.name} {op}: lane / warpgroup time {row['lane_over_warpgroup']:.3f}"
            f" ({med['lane']:.4f} / {med['warpgroup']:.4f} ms), bitwise equal"
            f" {row['bitwise_equal']}; lower {row['lane_lower_s']:.2f} / "
            f"{row['warpgroup_lower_s']:.2f} s, compile {row['lane_compile_s']:.2f} / "
            f"{row['warpgroup_compile_s']:.2f} s", flush=True)
      with open(os.path.join(args.out_dir, "ab_semantics.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
