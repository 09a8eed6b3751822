"""Where a Mosaic ring kernel's cycles go, per warpgroup, from Mosaic's
on-device profiler (GPU machine; a diagnostic, not a bench).

  python3 scripts/timeline.py OUT_DIR [--ops dw fwd dx] [--shapes NAME ...]
      [--space 384] [--set FIELD=VALUE ...] [--preset training]

Per shape and op: the dispatcher's config (``--set``: with those fields
replaced; dW's flat ring or the forward / dX swap ring) compiled with the
profiler on (``sm90.profiling``); one call to warm up, then a second whose
trace's raw buffer is kept (``OUT_DIR/<shape>_<op>.npz``: ``kernel_timeline.load_raw``).  Each warpgroup records its first
``--space`` - 1 ranges (the rest are dropped; fewer when SMEM is short):
  consumers  wait (a step's stage barrier), mma (issue the step's wgmmas and
             wait for the ones before), last_mma (the item's last wgmmas), store
             (the epilogue: registers -> SMEM -> TMA store, with its waits)
  producer   free (a slot's previous use to be released), load (issue a step's
             TMA loads)
  all        item (a work item's group rows, or tile, read from GMEM)
Prints each role's shares of its recorded span (for dW also the tensor-core
floor of the recorded steps: a bm x bk x bn step at 2048 bf16 FMA per SM
cycle) and the ring steps' load latency (``kernel_timeline.ring_latency``),
and writes OUT_DIR/timeline.json.  The profiled kernel carries ~2 x
space SMEM stores per warpgroup, so its time is not the table's.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp

from ragdot import bench, dispatch, kernel_timeline
from ragdot.backends import mosaic_dw, mosaic_fwd, sm90

from ab_fwd import dw_case, gmm_inputs, parse_fields  # this folder (the script's sys.path[0])

_FMA_PER_CYCLE = 2048  # dense 16-bit wgmma rate of one Hopper SM (989 TFLOP/s / 132 / 1.83 GHz / 2)


def roles(config) -> dict[int, str]:
  """Warpgroup index -> role in the ring of ``config`` (dW or forward)."""
  out = {0: "consumer0", 1: "consumer1", 2: "producer"}
  if getattr(config, "mask_warpgroup", False):
    out[3] = "masker"
  return out


def dw_call(s: bench.Shape, changes: dict):
  """(fn, args, config, free SMEM bytes) of shape ``s``'s dW, or a reason to skip."""
  gs, x, dy, choice = dw_case(s, jax.random.key(11))
  if choice.implementation != "mosaic" or choice.config is None:
    return f"the table's dW is {choice.implementation}, not Mosaic"
  cfg = dataclasses.replace(choice.config, **changes)
  if not cfg.pipeline_across_items or cfg.num_compute_wgs != 2:
    return "only the flat ring (pipeline_across_items, 2 consumers) has ranges"
  fn = lambda x, dy, gs: mosaic_dw.tgmm(x, dy, gs, None, num_groups=s.g,
                                         out_dtype=jnp.bfloat16, config=cfg)
  free = cfg.smem_budget() - mosaic_dw.smem_bytes(cfg, x.dtype, jnp.bfloat16)
  return fn, (x, dy, gs), cfg, free


def gmm_call(s: bench.Shape, op: str, changes: dict):
  """As ``dw_call``, for the forward (``op`` "fwd") or dX ("dx") call."""
  call = dispatch.backend_call(op, s.k, s.n)
  x, w = gmm_inputs(s, call, jax.random.key(12))
  gs = jnp.asarray(bench.routed_group_sizes(s))
  choice = dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=s.m, k=call.k, n=call.n,
                           g=s.g, num_groups=s.g, transpose_rhs=call.transpose_rhs)
  if choice.implementation != "mosaic" or choice.config is None:
    return f"the table's {op} is {choice.implementation}, not Mosaic"
  cfg = dataclasses.replace(choice.config, **changes)
  if not (cfg.ring and cfg.swap):
    return "only the swap ring has ranges"
  fn = lambda x, w, gs: mosaic_fwd.gmm(x, w, gs, None, transpose_rhs=call.transpose_rhs,
                                        out_dtype=jnp.bfloat16, config=cfg)
  free = cfg.smem_budget() - cfg.smem_bytes(jnp.bfloat16, jnp.bfloat16)
  return fn, (x, w, gs), cfg, free


def step_floor_cycles(config: mosaic_dw.MosaicDwConfig) -> float:
  """Tensor-core cycles of one consumer's wgmma in a ring step (bm x bk x bn:
  a pingpong consumer's whole item tile; half of bk per consumer otherwise,
  where both consumers wait for every step)."""
  rows = config.block_k if config.pingpong else config.block_k // 2
  return config.block_m * rows * config.block_n / _FMA_PER_CYCLE


def profile_one(s: bench.Shape, op: str, args) -> dict | None:
  """Profiles shape ``s``'s ``op`` call; its row of timeline.json (None: skipped)."""
  changes = parse_fields(args.set)
  made = dw_call(s, changes) if op == "dw" else gmm_call(s, op, changes)
  if isinstance(made, str):
    print(f"{s.name} {op}: {made}: skipped")
    return None
  f, call_args, cfg, free = made
  space = min(args.space, free // sm90.Profile("", 1).smem_bytes(len(roles(cfg))))
  where = os.path.join(args.out_dir, f"{s.name.replace(' ', '_')}_{op}")
  with sm90.profiling(where, space), kernel_timeline.raw_dumps():
    f = jax.jit(f)
    for _ in range(2):  # the warm-up call's trace (and raw buffer) go before the second
      for stale in glob.glob(os.path.join(where, "*-trace.json*")):
        os.remove(stale)
      jax.block_until_ready(f(*call_args))
      jax.effects_barrier()  # (the trace is written by a host callback)
  traces = glob.glob(os.path.join(where, "*-trace.json.npz"))
  if len(traces) != 1:
    print(f"{s.name} {op}: {len(traces)} traces written in {where}, expected 1")
    return None
  kept = f"{where}.npz"  # (beside the folder: the device returns 2 levels of $OUT)
  shutil.move(traces[0], kept)
  shutil.rmtree(where)
  events = kernel_timeline.load_raw(kept)
  summary = kernel_timeline.summarize(events, len(roles(cfg)), roles(cfg))
  latency = kernel_timeline.ring_latency(events, len(roles(cfg)), producer=2,
                                         alternate=op == "dw" and cfg.pingpong)
  floor = step_floor_cycles(cfg) if op == "dw" else 0.0
  consumers = [summary[r] for r in ("consumer0", "consumer1") if r in summary]
  steps = sum(c["ranges"].get("wait", {}).get("count", 0.0) for c in consumers)
  span = max(c["span"] for c in consumers) if consumers else 0.0
  tensor = steps * floor / span if span else 0.0
  print(f"== {s.name} {op}: {cfg}\n  space {space} ranges a warpgroup; {steps:.0f} steps a"
        f" CTA recorded (consumers' waits, summed)" + (f", floor {floor:.0f} cycles a step: tensor cores busy >= "
                            f"{100 * tensor:.0f}% of the consumers' span" if floor else ""))
  print(kernel_timeline.format_summary(summary))
  print(f"  ring steps: latency (load issued -> landed, steps a consumer waited for)"
        f" {latency['latency']}; waits {latency['wait']};"
        f" {100 * latency['waited_share']:.0f}% of {latency['steps']} steps waited for",
        flush=True)
  return dict(latency=latency, shape=s.name, op=op, config=str(cfg), space=space, trace=kept,
              step_floor_cycles=floor, steps_per_cta=steps, tensor_share=tensor,
              summary=summary)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--shapes", nargs="+", default=["qwen3-30b gate_up", "qwen3-30b down"])
  p.add_argument("--ops", nargs="+", default=["dw"], choices=["dw", "fwd", "dx"])
  p.add_argument("--preset", default="training", choices=sorted(bench.PRESETS))
  p.add_argument("--space", type=int, default=384, help="ranges recorded per warpgroup")
  p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE")
  args = p.parse_args()
  rows = []
  for s in bench.preset_shapes(args.preset, args.shapes):
    for op in args.ops:
      try:
        row = profile_one(s, op, args)
      except Exception as e:  # (a diagnostic: report, and go on to the next case)
        print(f"{s.name} {op}: failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
        row = None
      if row:
        rows.append(row)
  with open(os.path.join(args.out_dir, "timeline.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
