"""What the group tails cost the forward, and what one item costs (GPU machine).

  python3 scripts/diag_tails.py OUT_DIR [--shapes NAME ...] [--layouts routed aligned ...]
      [--variants "skip_empty_halves=True" ...] [--rounds 3] [--tag NAME]

On the Qwen3 training shapes (m = 32768, 128 experts, top-8) times, interleaved
with CUPTI, the table's forward config (and each ``--variants`` change of it,
comma-separated FIELD=VALUE; on a swap entry, ``tail_rows=0`` needs
``tail_split=False`` and ``tail_on_m=False`` too) on group-size layouts, and the dense matmul of the
same (m, k, n).  The tile counts below are the row-major ring's (128-row tiles,
what the table held when this was written, v19a); a swap entry tiles by 256:
  routed   top-8 routing of random logits (the bench's sizes: 256 +- 15 rows);
  aligned  every group exactly 256 rows: two full 128-row tiles, no tail;
  halves   groups of 240 and 272 rows in turn: half the groups end in a tile
           of 16 rows, the other half in one of 112;
  g128     every group 128 rows, on the first 16384 rows: one full tile each;
  g64      every group 64 rows, on the first 8192 rows: one tile each, its
           second 64-row half empty (what a tail tile costs on its own).
``aligned`` over ``dense`` is what the kernel reaches with no tail at all; the
gap from ``routed`` to ``aligned`` is what tails cost; ``g64`` over ``g128``
(the same 768 items) is the cost of a half-empty item.  Writes
OUT_DIR/diag_tails[_TAG].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from ragdot import bench, dispatch, timing
from ragdot.backends import mosaic_fwd

from ab_fwd import parse_fields  # this folder (the script's sys.path[0])

LAYOUTS = ("routed", "aligned", "halves", "g128", "g64")


def layout(s: bench.Shape, name: str) -> np.ndarray:
  """Group sizes (int32[g]) of a layout; they sum to the rows the layout uses."""
  per = s.m // s.g
  if name == "routed":
    return bench.routed_group_sizes(s)
  if name == "aligned":
    return np.full((s.g,), per, np.int32)
  if name == "halves":
    return np.where(np.arange(s.g) % 2 == 0, per - 16, per + 16).astype(np.int32)
  if name in ("g128", "g64"):
    return np.full((s.g,), int(name[1:]), np.int32)
  raise ValueError(f"unknown layout {name!r}")


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--shapes", nargs="+", default=None, help="preset names (default: Qwen3)")
  p.add_argument("--layouts", nargs="+", default=["routed", "aligned", "halves"],
                 choices=LAYOUTS)
  p.add_argument("--variants", nargs="+", default=[], metavar="F=V,F=V")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--tag", default="")
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  rows, configs_of = [], {}
  for s in bench.preset_shapes("training", args.shapes):
    if not args.shapes and (s.g != 128 or s.top_k != 8):
      continue
    kx, kw = jax.random.split(jax.random.key(len(rows)))
    x = jax.random.normal(kx, (s.m, s.k), jnp.bfloat16)
    w = (jax.random.normal(kw, (s.g, s.k, s.n), jnp.float32) / 32).astype(jnp.bfloat16)
    choice = dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=s.m, k=s.k, n=s.n, g=s.g,
                             num_groups=s.g, transpose_rhs=False)
    if not isinstance(choice.config, mosaic_fwd.MosaicFwdConfig):
      print(f"{s.name}: the table's choice is not Mosaic ({choice.implementation})", flush=True)
      continue
    configs = {"table": choice.config}
    for v in args.variants:
      configs[v] = dataclasses.replace(choice.config,
                                       **parse_fields([kv for kv in v.split(",") if kv]))
    cases = {}
    for lay in args.layouts:
      sizes = layout(s, lay)
      rows_used = int(sizes.sum())
      xs = x[:rows_used]
      for name, cfg in configs.items():
        fn = jax.jit(lambda x, w, gs, cfg=cfg: mosaic_fwd.gmm(
            x, w, gs, None, transpose_rhs=False, out_dtype=jnp.bfloat16, config=cfg))
        cases[f"{lay} {name}"] = (fn, (xs, w, jnp.asarray(sizes)), rows_used)
    configs_of[s.name] = {k: dataclasses.asdict(v) for k, v in configs.items()}
    cases["dense"] = (jax.jit(jnp.dot), (x, w[0]), s.m)
    med = timing.interleaved_median_ms({k: v[:2] for k, v in cases.items()},
                                       rounds=args.rounds, iterations=args.iterations)
    for name, ms in med.items():
      flops = 2 * cases[name][2] * s.k * s.n
      row = dict(shape=s.name, case=name, rows=cases[name][2], ms=ms, tflops=flops / ms / 1e9,
                 x_dense=flops / ms / (2 * s.m * s.k * s.n / med["dense"]))
      rows.append(row)
      print(f"{s.name:20s} {name:44s} {ms:.4f} ms {row['tflops']:6.1f} TFLOP/s  "
            f"x dense rate {row['x_dense']:.3f}", flush=True)
    out = os.path.join(args.out_dir, f"diag_tails{'_' + args.tag if args.tag else ''}.json")
    with open(out, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, rows=rows,
                     configs=configs_of), f, indent=1)


if __name__ == "__main__":
  main()
