"""Where does the EP-shard forward's time go? (GPU machine; a diagnostic, not a bench)

  python3 scripts/diag_ep.py OUT_DIR [--op fwd|dx] [--rounds 3] [--variant "FIELD=VALUE ..." ...]
      [--shape m,k,n,g[,top_k] [--ep 8]] [--skewed | --skew H]

On the bench's EP preset (Qwen3-30B gate_up, shard 0 of 8: 16 local experts,
full-m output with zeros outside the shard's rows; ``--shape``: shard 0 of
``--ep`` of that call instead) times, interleaved (CUPTI, all kernels of one call):
  A     the automatic choice (group_offset);
  B     A's Mosaic config with ``guard_last_stage=False`` (only where that field is
        read: the plain two-warpgroup body with delay_release 1, no ring or swap);
  T     the Triton backend (group_offset);
  Z     A with the local groups emptied (their rows moved to the next group):
        only the zero rows are written, so Z is the price of the full-m output;
  L     the plain call over the local rows only (the issue's 1.25x yardstick);
  D1..  with ``--variant``: A's Mosaic config with those fields replaced (e.g.
        ``"epilogue_split=4 num_stages=3"``), one case per variant;
and writes OUT_DIR/diag_ep.json.  ``--op dx``: the same cases for the shard's
dX call (dy[m, n] @ w[g, k, n]^T, the rhs read transposed), as the backward
of the forward makes it.  Outputs of A, B, T and the variants are
compared bitwise; the per-kernel CUPTI times of A, Z, L and the variants are
printed.  ``--host-calls C``: A and the variants also as C back-to-back calls in
one program (on C different x), host clock and CUPTI sum per call: what a
host round trip inside a call (e.g. a ``lax.cond``) costs, which CUPTI's
kernel sum does not see (docs/performance.md v45a).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import ragdot
from ragdot import bench, dispatch, timing
from ragdot.backends import mosaic_fwd

from ab_fwd import parse_fields  # this folder (the script's sys.path[0])


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--op", default="fwd", choices=["fwd", "dx"])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--variant", action="append", default=[], metavar='"FIELD=VALUE ..."',
                 help="MosaicFwdConfig fields replaced in A's config (one case each)")
  p.add_argument("--shape", type=bench.parse_shape, default=None, metavar="m,k,n,g[,top_k]",
                 help="the full call whose shard is timed (default: the EP preset's)")
  p.add_argument("--ep", type=int, default=8, help="shards of --shape's experts")
  p.add_argument("--skewed", action="store_true",
                 help="skewed routing (a few hot experts, shard 0's among them)")
  p.add_argument("--host-calls", type=int, default=0, metavar="C",
                 help="also time A and the variants as C back-to-back calls in one program")
  p.add_argument("--skew", type=float, default=None, metavar="H",
                 help="the logit ramp's height of the skewed routing (--skewed: 3.0; "
                      "0: routed); shard 0 gets more rows the higher it is")
  args = p.parse_args()
  if args.ep < 2:
    p.error("--ep: at least 2 shards")
  if args.ep != 8 and args.shape is None:
    p.error("--ep needs --shape (the EP preset is 8 shards)")
  os.makedirs(args.out_dir, exist_ok=True)
  s = bench.PRESETS["ep"][0]
  if args.shape is not None:
    if args.shape.g % args.ep:
      raise SystemExit(f"--ep {args.ep} must divide the {args.shape.g} experts")
    s = dataclasses.replace(args.shape, name=f"{args.shape.name} ep{args.ep} shard", ep=args.ep)
  if args.skew if args.skew is not None else args.skewed:  # (--skew 0: routed)
    s = dataclasses.replace(s, name=f"{s.name} skewed", skewed=True)
  local = s.g // s.ep
  sizes, empty, rows8 = bench.ep_shard_sizes(s, skew=args.skew)
  rows = int(sizes[:local].sum())
  kx, kw = jax.random.split(jax.random.key(0))
  w = (jax.random.normal(kw, (local, s.k, s.n), jnp.float32) / 32).astype(jnp.bfloat16)
  dx = args.op == "dx"
  # The forward reads x[m, k]; dX reads dy[m, n] against w transposed.
  x = jax.random.normal(kx, (s.m, s.n if dx else s.k), jnp.bfloat16)
  gs, gs_empty = jnp.asarray(sizes), jnp.asarray(empty)
  auto = bench.dispatch_choice(args.op, s)
  print(f"{args.op}: rows {rows} of {s.m}; auto: {bench.describe_choice(auto)}", flush=True)
  off = jnp.int32(0)

  def api(impl=None, offset=off):
    if dx:
      return jax.jit(lambda x, w, gs: ragdot.ragged_dot_general(
          x, w, gs, bench.DN_DX, group_offset=offset, implementation=impl))
    return jax.jit(lambda x, w, gs: ragdot.ragged_dot(x, w, gs, group_offset=offset,
                                                      implementation=impl))

  def mosaic(config):
    return jax.jit(lambda x, w, gs: mosaic_fwd.gmm(x, w, gs, off, transpose_rhs=dx,
                                                   out_dtype=jnp.bfloat16, config=config))

  call = dispatch.backend_call(args.op, s.k, s.n)
  cfg = (auto.implementation == "mosaic" and auto.config) or mosaic_fwd.default_config(
      s.m, call.k, call.n, s.g, jnp.bfloat16, dx, jnp.bfloat16)
  cases = {
      "A": (api(), (x, w, gs)),
      # (guard_last_stage is read only by the plain two-warpgroup body, with
      # delay_release 1: mosaic_fwd._gmm_kernel_2wg)
      **({} if cfg.ring or cfg.swap or cfg.num_compute_wgs != 2 or cfg.delay_release == 0
         else {
          "B": (mosaic(dataclasses.replace(cfg, guard_last_stage=False)), (x, w, gs))}),
      "T": (api("triton"), (x, w, gs)),
      "Z": (api(), (x, w, gs_empty)),
      "L": (api(offset=None), (x[:rows8], w, jnp.asarray(sizes[:local]))),
  }
  variants = {}
  for i, text in enumerate(args.variant, 1):
    variants[f"D{i}"] = text
    fields = parse_fields(text.split())
    if fields.get("producer_zeros") is False:  # a zero front needs producer zeros
      fields.setdefault("zero_front", 0)
    cases[f"D{i}"] = (mosaic(dataclasses.replace(cfg, **fields)),
                      (x, w, gs))
  outs = {}
  for name, (f, a) in cases.items():
    print(f"# compile {name}", flush=True)
    outs[name] = np.asarray(jax.block_until_ready(f(*a)).astype(jnp.float32))
  equal = {n: bool(np.array_equal(outs["A"], outs[n])) for n in cases if n not in ("A", "Z", "L")}
  med = timing.interleaved_median_ms(cases, rounds=args.rounds, iterations=args.iterations)
  for name, ms in med.items():
    print(f"{name} {ms:.4f} ms  x L {ms / med['L']:.2f}  x A {ms / med['A']:.3f}"
          f"  {variants.get(name, '')}", flush=True)
  print(f"bitwise equal to A: {equal}", flush=True)
  # Per-kernel CUPTI times of one call (which kernels A and Z spend it in).
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  kernels = {}
  for name in ["A", "Z", "L", *variants]:
    f, a = cases[name]
    _, per_kernel = profiler.measure(f, aggregate=False, iterations=3)(*a)
    kernels[name] = per_kernel
    print(f"{name} kernels: {per_kernel}", flush=True)
  host = _host_clock(cases, ["A", *variants], args.host_calls, x) if args.host_calls else {}
  with open(os.path.join(args.out_dir, "diag_ep.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, op=args.op, rows=rows, m=s.m, ms=med,
                   equal=equal, variants=variants,
                   # the config A's shard call runs (producer_zeros resolved)
                   config=str(mosaic_fwd.resolve_producer_zeros(cfg, True, jnp.bfloat16,
                                                                jnp.bfloat16)),
                   auto=bench.describe_choice(auto), kernels=kernels, host_calls=host),
              f, indent=1, default=str)


def _host_clock(cases, names, calls: int, x) -> dict:
  """{name: (host-clock us, CUPTI us) per call} of ``calls`` back-to-back calls of
  each case in one jitted program, each on its own x."""
  xs = jnp.stack([jnp.roll(x, i, axis=0) for i in range(calls)])
  out = {}
  for name in names:
    f, (_, w, gs) = cases[name]
    many = jax.jit(lambda xs, w, gs, f=f: [f(xs[i], w, gs) for i in range(calls)])
    jax.block_until_ready(many(xs, w, gs))
    wall = statistics.median(timing.host_time_ms(many, xs, w, gs, iterations=20, repeats=3)
                             for _ in range(3))
    dev, _ = timing.device_time_ms(many, xs, w, gs, iterations=10)
    out[name] = (wall * 1e3 / calls, dev * 1e3 / calls)
    print(f"{name} {calls} calls in one program: host clock {out[name][0]:.1f} us, "
          f"CUPTI {out[name][1]:.1f} us a call", flush=True)
  return out


if __name__ == "__main__":
  main()
