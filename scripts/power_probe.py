"""Power draw and SM clock of the GPU while one call runs back to back (GPU machine).

  python3 scripts/power_probe.py OUT_DIR [--shape "qwen3-30b gate_up"] [--op fwd]
      [--variants "swap=True,tail_rows=32,tail_split=True" ...] [--seconds 3]

Phases of the same call on one set of fresh random inputs: a dense ``jnp.dot``
of the same (m, k, n), the dispatcher's choice ("table"), one ``mosaic_fwd``
config per variant (the table's config with the variant's FIELD=VALUE
changes), the table's choice on groups of exactly m / g rows, and dense again.
Each phase runs ``--seconds`` back to back and is timed as ``ragdot bench
--sustained-s`` times a row (``timing.sustained_time_ms``: four calls queued,
wall clock over the second half); per phase the script prints the time per
call, the mean power and SM clock over the timed half, the share of samples
under the software power cap, and the host's enqueue time per call.  Writes
OUT_DIR/power_probe.json.  (v21b ran an earlier loop that waited every 10
calls, leaving the device briefly idle: its times ran 3-4% above 21d's.)

Why: under ncu the ring and swap kernels run at 1.55-1.62 GHz, as does the
dense matmul, far under the 1.98 GHz this GPU reaches when idle; if that is
the power cap, every wasted tensor instruction (padding, folds) also lowers
the clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

from ragdot import backends, bench, dispatch, gpu_power, timing
from ragdot.backends import mosaic_fwd

from ab_fwd import parse_fields  # this folder (the script's sys.path[0])


def _phase(name: str, fn, args, seconds: float) -> dict:
  ms, power = timing.sustained_time_ms(fn, *args, seconds=seconds)
  ph = dict(name=name, ms_per_call=ms, **power)
  if "samples" in ph:
    extra = [f"{label} {fmt.format(ph[key])}" for key, label, fmt in (
        ("power_limit_w", "limit", "{:.0f} W"), ("hw_slowdown", "hw slowdown", "{:.1%}"),
        ("temp_c", "max", "{:.0f} C")) if key in ph]
    print(f"{name:44s} {ms:.4f} ms/call  {gpu_power.describe(ph)}  {'  '.join(extra)}  "
          f"({ph['samples']} samples)  dispatch {1e3 * ph['dispatch_ms']:.0f} us", flush=True)
  else:
    print(f"{name:44s} {ms:.4f} ms/call (no nvidia-smi)", flush=True)
  return ph


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--shape", default="qwen3-30b gate_up")
  p.add_argument("--op", default="fwd", choices=["fwd", "dx"])
  p.add_argument("--variants", nargs="*", default=[], metavar="F=V,F=V")
  p.add_argument("--seconds", type=float, default=3.0)
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  (s,) = [s for s in bench.PRESETS["training"] if s.name == args.shape]
  call = dispatch.backend_call(args.op, s.k, s.n)
  tr = call.transpose_rhs
  kx, kw, kd = jax.random.split(jax.random.key(int(time.time())), 3)
  x = jax.random.normal(kx, (s.m, call.k), jnp.bfloat16)
  shape = (s.g, call.n, call.k) if tr else (s.g, call.k, call.n)
  w = (jax.random.normal(kw, shape, jnp.float32) / 32).astype(jnp.bfloat16)
  wd = (jax.random.normal(kd, (call.k, call.n), jnp.float32) / 32).astype(jnp.bfloat16)
  gs = jnp.asarray(bench.routed_group_sizes(s))
  choice = dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=s.m, k=call.k, n=call.n,
                           g=s.g, num_groups=s.g, transpose_rhs=tr)

  def grouped(module, config):
    return jax.jit(lambda x, w, gs: module.gmm(
        x, w, gs, None, transpose_rhs=tr, out_dtype=jnp.bfloat16, precision=None,
        config=config))

  cases = [("dense", jax.jit(jnp.dot), (x, wd)),
           ("table", grouped(backends.get_backend(choice.implementation), choice.config),
            (x, w, gs))]
  base = choice.config if isinstance(choice.config, mosaic_fwd.MosaicFwdConfig) else \
      mosaic_fwd.default_config(s.m, call.k, call.n, s.g, jnp.bfloat16, tr, jnp.bfloat16)
  for v in args.variants:
    cfg = dataclasses.replace(base, **parse_fields([kv for kv in v.split(",") if kv]))
    cases.append((v, grouped(mosaic_fwd, cfg), (x, w, gs)))
  # Every group exactly m / g rows: no tails, the same FLOPs and weight bytes.
  aligned = jnp.full((s.g,), s.m // s.g, jnp.int32)
  cases.append(("table, groups of m / g rows", cases[1][1], (x, w, aligned)))
  cases.append(("dense again", cases[0][1], cases[0][2]))
  print(f"{s.name} {args.op}: table = {choice.implementation} {choice.config}", flush=True)
  for _, fn, a in cases:  # compile everything before sampling starts
    jax.block_until_ready(fn(*a))

  phases = []
  for name, fn, a in cases:
    phases.append(_phase(name, fn, a, args.seconds))
    time.sleep(0.5)  # a gap between phases
  with open(os.path.join(args.out_dir, "power_probe.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, shape=s.name, op=args.op,
                   phases=phases), f, indent=1)


if __name__ == "__main__":
  main()
