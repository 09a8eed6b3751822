"""A/B of the timing method itself: every timed iteration in one CUPTI
measurement (before v18i: the profiler keeps all their outputs alive) against
measurements split to keep at most ``timing.output_budget_bytes()`` of outputs
alive (since v18i).  GPU machine.

  python3 scripts/ab_timing.py OUT_DIR [--preset training] [--shapes NAME ...]
      [--ops dw fwdbwd] [--names ragdot dense tokamax] [--rounds 3]

For each shape, op and candidate of the bench (``ragdot`` = the automatic
choice), both methods alternate for ``--rounds`` rounds on one set of inputs;
prints the median time of each and split / whole.  If the ratios differ from 1
only for calls with large outputs, earlier benches' dW and fwd+bwd rows are not
comparable with later ones.  Writes OUT_DIR/ab_timing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import jax

from ragdot import bench, timing


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--preset", default="training", choices=sorted(bench.PRESETS))
  p.add_argument("--shapes", nargs="+", default=None, help="preset shape names (default: all)")
  p.add_argument("--ops", nargs="+", default=["dw", "fwdbwd"],
                 choices=["fwd", "dx", "dw", "fwdbwd"])
  p.add_argument("--names", nargs="+", default=["ragdot", "dense", "tokamax"])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=20)
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  split_budget = timing.output_budget_bytes()
  rows = []
  for s in bench.preset_shapes(args.preset, args.shapes):
    if s.ep > 1:
      continue
    _, inputs = bench.shape_inputs(s)
    for op in args.ops:
      fns = bench._candidates(op, s, None)  # pylint: disable=protected-access
      for name in args.names:
        if name not in fns:
          continue
        f = jax.jit(fns[name]).lower(*inputs).compile()
        size = timing.output_bytes(jax.block_until_ready(f(*inputs)))
        times = {"whole": [], "split": []}
        for _ in range(args.rounds):
          for method, budget in (("whole", 2**62), ("split", split_budget)):
            timing.OUTPUT_BUDGET_BYTES = budget
            times[method].append(timing.device_time_ms(
                f, *inputs, iterations=args.iterations, warmup_s=timing.SETTLE_S)[0])
        timing.OUTPUT_BUDGET_BYTES = None
        med = {m: float(statistics.median(t)) for m, t in times.items()}
        row = dict(shape=s.name, op=op, name=name, output_mib=size / 2**20, **med,
                   split_over_whole=med["split"] / med["whole"],
                   chunks=len(timing.iteration_chunks(args.iterations, size)))
        rows.append(row)
        print(f"{s.name:20s} {op:6s} {name:8s} out {row['output_mib']:8.0f} MiB "
              f"whole {med['whole']:.4f} ms  split {med['split']:.4f} ms "
              f"({row['chunks']} measurements)  split/whole {row['split_over_whole']:.3f}",
              flush=True)
        with open(os.path.join(args.out_dir, "ab_timing.json"), "w") as fh:
          json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), fh, indent=1)


if __name__ == "__main__":
  main()
