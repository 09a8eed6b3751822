"""Where a dW (tgmm) call's cycles go, per warpgroup, from Mosaic's on-device
profiler (GPU machine; a diagnostic, not a bench).

  python3 scripts/dw_timeline.py OUT_DIR [--shapes NAME ...] [--space 384]
      [--set FIELD=VALUE ...] [--preset training]

Per shape: the dispatcher's dW config (``--set``: with those fields replaced)
compiled with the profiler on (``sm90.profiling``); one call to warm up, then a
second whose trace is kept (``OUT_DIR/<shape>/``).  Each warpgroup records its
first ``--space`` ranges (the rest are dropped):
  consumers  wait (a step's stage barrier), mma (issue the step's wgmma and wait
             for the one before), last_mma (the item's last wgmma), store
             (the epilogue: registers -> SMEM -> TMA store, with its waits)
  producer   free (a slot's previous use to be released), load (issue a step's
             TMA loads)
Prints each role's shares of its recorded span and the tensor-core floor of
the recorded steps (a bm x bk x bn step at 2048 bf16 FMA per SM cycle), and
writes OUT_DIR/dw_timeline.json.  The profiled kernel carries ~2 x space SMEM
stores per warpgroup, so its time is not the table's.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os

import jax
import jax.numpy as jnp

from ragdot import bench, kernel_timeline
from ragdot.backends import mosaic_dw, sm90

from ab_fwd import dw_case, parse_fields  # this folder (the script's sys.path[0])

_FMA_PER_CYCLE = 2048  # dense 16-bit wgmma rate of one Hopper SM (989 TFLOP/s / 132 / 1.83 GHz / 2)


def roles(config: mosaic_dw.MosaicDwConfig) -> dict[int, str]:
  """Warpgroup index -> role in the dW ring of ``config``."""
  out = {0: "consumer0", 1: "consumer1", 2: "producer"}
  if config.mask_warpgroup:
    out[3] = "masker"
  return out


def step_floor_cycles(config: mosaic_dw.MosaicDwConfig) -> float:
  """Tensor-core cycles of one ring step's wgmma (bm x bk x bn, all of a
  pingpong consumer's item tile; half of bk per consumer otherwise)."""
  return config.block_m * config.block_k * config.block_n / _FMA_PER_CYCLE


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--shapes", nargs="+", default=["qwen3-30b gate_up", "qwen3-30b down"])
  p.add_argument("--preset", default="training", choices=sorted(bench.PRESETS))
  p.add_argument("--space", type=int, default=384, help="ranges recorded per warpgroup")
  p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE")
  args = p.parse_args()
  results = []
  for s in bench.preset_shapes(args.preset, args.shapes):
    gs, x, dy, choice = dw_case(s, jax.random.key(11))
    if choice.implementation != "mosaic" or choice.config is None:
      print(f"{s.name}: the table's dW is {choice.implementation}, not Mosaic: skipped")
      continue
    cfg = dataclasses.replace(choice.config, **parse_fields(args.set))
    if not cfg.pipeline_across_items or cfg.num_compute_wgs != 2:
      print(f"{s.name}: only the flat ring (pipeline_across_items, 2 consumers) has ranges")
      continue
    space = args.space
    budget = cfg.smem_budget() - mosaic_dw.smem_bytes(cfg, x.dtype, jnp.bfloat16)
    per_range = sm90.Profile("", 1).smem_bytes(len(roles(cfg)))
    space = min(space, budget // per_range)
    where = os.path.join(args.out_dir, s.name.replace(" ", "_"))
    with sm90.profiling(where, space):
      f = jax.jit(lambda x, dy, gs, cfg=cfg: mosaic_dw.tgmm(
          x, dy, gs, None, num_groups=s.g, out_dtype=jnp.bfloat16, config=cfg))
      for _ in range(2):
        jax.block_until_ready(f(x, dy, gs))
        jax.effects_barrier()  # (the trace is written by a host callback)
    traces = sorted(glob.glob(os.path.join(where, "*-trace.json")), key=os.path.getmtime)
    if not traces:
      print(f"{s.name}: no trace written in {where}")
      continue
    events = kernel_timeline.load(traces[-1])
    summary = kernel_timeline.summarize(events, len(roles(cfg)), roles(cfg))
    floor = step_floor_cycles(cfg)
    consumers = [summary[r] for r in ("consumer0", "consumer1") if r in summary]
    steps = sum(c["ranges"].get("wait", {}).get("count", 0.0) for c in consumers)
    span = max(c["span"] for c in consumers) if consumers else 0.0
    tensor = steps * floor / span if span else 0.0
    print(f"== {s.name}: {cfg}\n  space {space} ranges a warpgroup; {steps:.0f} steps a"
          f" CTA recorded, floor {floor:.0f} cycles a step: tensor cores busy >= "
          f"{100 * tensor:.0f}% of the consumers' span")
    print(kernel_timeline.format_summary(summary), flush=True)
    results.append(dict(shape=s.name, config=str(cfg), space=space, trace=traces[-1],
                        step_floor_cycles=floor, steps_per_cta=steps,
                        tensor_share=tensor, summary=summary))
  with open(os.path.join(args.out_dir, "dw_timeline.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=results), f, indent=1)


if __name__ == "__main__":
  main()
