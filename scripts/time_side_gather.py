"""What the dW ring's ``side_rows`` gather costs, per training shape (GPU machine).

  python3 scripts/time_side_gather.py OUT_DIR [--shapes NAME ...] [--rounds 3]

Interleaved CUPTI device time of three calls on the same fresh inputs and
routed group sizes: "dw" = the table's dW call (schedule + side gather + ring
kernel), "schedule" = its row-block schedule alone, "gather" = the schedule and
the two side-buffer gathers (XLA) alone.  Prints gather - schedule as a share
of the dW call; writes OUT_DIR/side_gather.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from ragdot import backends, bench, timing
from ragdot.backends import mosaic_dw

from ab_fwd import dw_case  # this folder (the script's sys.path[0])


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--shapes", nargs="+", default=None, help="preset names (default: all)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []
  for s in bench.preset_shapes("training", args.shapes):
    gs, x, dy, choice = dw_case(s, jax.random.key(len(rows) + 7))
    config = choice.config
    if choice.implementation != "mosaic" or config is None or not config.side_rows:
      print(f"{s.name}: the table's dW ({choice.implementation}) has no side rows", flush=True)
      continue

    def schedule(gs):
      return backends.row_blocks(gs, None, m=s.m, num_local=s.g, block_m=config.block_m,
                                 align=8, use_kernel=config.schedule_kernel, interpret=False)

    def gather(x, dy, gs):
      starts, ends, _, _ = schedule(gs)
      return mosaic_dw.side_buffers(x, dy, starts[:s.g], ends[:s.g])

    dw = jax.jit(lambda x, dy, gs: mosaic_dw.tgmm(
        x, dy, gs, None, num_groups=s.g, out_dtype=jnp.bfloat16, config=config))
    cases = {"dw": (dw, (x, dy, gs)), "schedule": (jax.jit(schedule), (gs,)),
             "gather": (jax.jit(gather), (x, dy, gs))}
    med = timing.interleaved_median_ms(cases, rounds=args.rounds, iterations=args.iterations)
    share = (med["gather"] - med["schedule"]) / med["dw"]
    rows.append(dict(shape=s.name, **{f"{k}_ms": v for k, v in med.items()},
                     gather_share=share))
    print(f"{s.name}: dw {med['dw']:.4f} ms, schedule {med['schedule'] * 1e3:.1f} us,"
          f" schedule + gather {med['gather'] * 1e3:.1f} us: the gather is {share:.1%}"
          " of the dW call", flush=True)
  with open(os.path.join(args.out_dir, "side_gather.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
