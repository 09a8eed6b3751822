"""A/B of the tile schedule builder (GPU machine): XLA ops vs one Triton kernel.

  python3 scripts/ab_schedule.py OUT_DIR [--presets training decode ep] [--rounds 3]

For every shape of the presets and op (fwd, dX, dW), takes the backend and config
the dispatcher picks, then times that config with ``schedule_kernel=False`` (A:
``metadata``'s XLA ops) and ``True`` (B: ``triton_schedule``), interleaved with
CUPTI, on one set of fresh random inputs (EP shapes: shard 0 with
group_offset).  Prints medians, B/A, whether B's output equals A's bitwise and
B's kernels one by one; writes OUT_DIR/ab_schedule.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from ragdot import bench, timing
from ragdot.backends import mosaic_dw, mosaic_fwd, triton
from ragdot.dispatch import backend_call


def _call(backend: str, op: str, tr: bool, offset, g_local: int):
  if op == "dw":  # only the Mosaic dW kernel has the option
    return lambda x, d, gs, c: mosaic_dw.tgmm(x, d, gs, offset, num_groups=g_local,
                                              out_dtype=jnp.bfloat16, config=c)
  if backend == "mosaic":
    return lambda x, w, gs, c: mosaic_fwd.gmm(x, w, gs, offset, transpose_rhs=tr,
                                              out_dtype=jnp.bfloat16, config=c)
  return lambda x, w, gs, c: triton.gmm(x, w, gs, offset, transpose_rhs=tr,
                                        out_dtype=jnp.bfloat16, precision=None, config=c)


def _default(backend: str, op: str, m: int, k: int, n: int, g: int, tr: bool):
  if op == "dw":
    return mosaic_dw.default_config(m, k, n, g, jnp.bfloat16, jnp.bfloat16)
  if backend == "mosaic":
    return mosaic_fwd.default_config(m, k, n, g, jnp.bfloat16, tr, jnp.bfloat16)
  return triton.device_default_config("gmm_t" if tr else "gmm", m, k, n, g, jnp.bfloat16)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--presets", nargs="+", default=["training", "decode", "ep"])
  p.add_argument("--ops", nargs="+", default=["fwd", "dx"], choices=["fwd", "dx", "dw"])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  args = p.parse_args()
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  rows = []
  for s in [s for name in args.presets for s in bench.PRESETS[name]]:
    gs = jnp.asarray(bench.routed_group_sizes(s))
    g_local = s.g // s.ep
    offset = jnp.int32(0) if s.ep > 1 else None
    for op in args.ops:
      call = backend_call(op, s.k, s.n)
      tr = call.transpose_rhs
      choice = bench.dispatch_choice(op, s)
      backend = choice.implementation
      if backend not in ("mosaic", "triton") or (op == "dw" and backend != "mosaic"):
        print(f"{s.name} {op}: {backend} chosen, skipped", flush=True)
        continue
      cfg = choice.config or _default(backend, op, s.m, call.k, call.n, g_local, tr)
      a, b = (dataclasses.replace(cfg, schedule_kernel=v) for v in (False, True))
      kx, kw = jax.random.split(jax.random.key(len(rows)))
      x = jax.random.normal(kx, (s.m, call.k), jnp.bfloat16)
      if op == "dw":  # w is dy [m, n]
        wshape = (s.m, call.n)
      else:
        wshape = (g_local, call.n, call.k) if tr else (g_local, call.k, call.n)
      w = (jax.random.normal(kw, wshape, jnp.float32) / 32).astype(jnp.bfloat16)
      fn = _call(backend, op, tr, offset, g_local)
      fns = [jax.jit(lambda x, w, gs, c=c: fn(x, w, gs, c)) for c in (a, b)]
      outs = [np.asarray(jax.block_until_ready(f(x, w, gs)).astype(jnp.float32)) for f in fns]
      med = timing.interleaved_median_ms({"A": (fns[0], (x, w, gs)), "B": (fns[1], (x, w, gs))},
                                         rounds=args.rounds, iterations=args.iterations)
      kernels = {name: profiler.measure(f, aggregate=False, iterations=3)(x, w, gs)[1][-1]
                 for name, f in zip("AB", fns)}
      ma, mb = med["A"], med["B"]
      row = dict(shape=s.name, op=op, backend=backend, a_ms=ma, b_ms=mb, b_over_a=mb / ma,
                 saved_us=(ma - mb) * 1e3,
                 bitwise_equal=bool(np.array_equal(outs[0], outs[1])), kernels=kernels,
                 config=dataclasses.asdict(b))
      rows.append(row)
      print(f"{s.name:28s} {op:3s} {backend:6s} A {ma:.4f} ms  B {mb:.4f} ms  B/A {mb / ma:.3f}"
            f"  saved {row['saved_us']:5.1f} us  equal {row['bitwise_equal']}", flush=True)
      for name in "AB":
        print(f"    {name}: " + ", ".join(f"{k} {t * 1e3:.1f}" for k, t in kernels[name]),
              flush=True)
  with open(os.path.join(args.out_dir, "ab_schedule.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
