"""Measured bytes floors of dW and fwd+bwd on the training shapes (GPU machine).

  python3 scripts/dw_floors.py OUT_DIR [--preset training] [--shapes NAME ...] [--rounds 3]

The dW kernel writes a [g, k, n] output: on DeepSeek-V3 down 7.5 GB, which at
DRAM speed takes longer than the dense matmul of the same FLOPs.  How long the
GPU needs to write (and read) that many bytes is measured here rather than
taken from the copy bandwidth, in one interleaved CUPTI run per shape:

* ``dw``: the automatic ``trans_ragged_dot``; ``dense``: ``x^T @ dy``;
* ``write_dw``: a kernel that only writes the dW output's bytes: the fastest of
  XLA fills (a traced value, as bf16 and as f32 of half the elements) and a
  Mosaic kernel of TMA stores only (``scripts/tma_fill.py``, the kernels' own
  write path);
* ``read_xdy``: one that only reads x and dy (a sum of each), ``read_w``: one
  that only reads the weights [g, k, n];
* ``write_x`` / ``write_dy``: fills of the dX's / forward's output bytes.

dW's floor is write_dw + read_xdy (DRAM's reads and writes share its
bandwidth); fwd+bwd's is the sum of its three calls' floors: the forward reads
x and w and writes dy's bytes, dX reads dy and w and writes x's, dW as above.
Prints each floor, the ratio to dense the floor allows (dense / floor), and the
kernel's time over its floor; writes OUT_DIR/dw_floors.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import ragdot
from ragdot import bench, timing
from tma_fill import tma_fill


def _fill(shape, dtype):
  return jax.jit(lambda v: jnp.full(shape, v, dtype))


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--preset", default="training", choices=sorted(bench.PRESETS))
  p.add_argument("--shapes", nargs="+", default=None, help="preset shape names (default: all)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []
  for s in bench.preset_shapes(args.preset, args.shapes):
    sizes, (x, w, dy, gs) = bench.shape_inputs(s)
    v = jnp.bfloat16(1.5)
    read = jax.jit(lambda *a: [jnp.sum(t, dtype=jnp.float32) for t in a])
    cases = {
        "dw": (jax.jit(lambda x, dy, gs: ragdot.trans_ragged_dot(x, dy, gs)), (x, dy, gs)),
        "dense": (jax.jit(lambda x, dy: jnp.dot(x.T, dy)), (x, dy)),
        "read_xdy": (read, (x, dy)),
        "read_w": (read, (w,)),
    }
    # Fills of the same bytes as bf16, as f32 (half the elements) and by TMA
    # stores: XLA writes bf16 two bytes per store, which ran at 1.70 TB/s (27e),
    # slower than the dW kernel's own writes; the fastest of the three is the
    # write time (the TMA fill: 4.38-4.44 TB/s in 28a).
    for name, shape in (("dw", (s.g, s.k, s.n)), ("x", x.shape), ("dy", dy.shape)):
      cases[f"write_{name}_bf16"] = (_fill(shape, jnp.bfloat16), (v,))
      cases[f"write_{name}_f32"] = (_fill(shape[:-1] + (shape[-1] // 2,), jnp.float32),
                                    (jnp.float32(1.5),))
      cases[f"write_{name}_tma"] = (tma_fill((s.g * s.k, s.n) if name == "dw" else shape,
                                             jnp.bfloat16), ())
    print(f"# {s.name}", flush=True)
    med = timing.interleaved_median_ms(cases, rounds=args.rounds, iterations=args.iterations)
    for name in ("dw", "x", "dy"):
      med[f"write_{name}"] = min(med[f"write_{name}_{kind}"] for kind in ("bf16", "f32", "tma"))
    read_x = med["read_xdy"] * s.k / (s.k + s.n)  # x's share of the x + dy read
    read_dy = med["read_xdy"] - read_x
    floor_dw = med["write_dw"] + med["read_xdy"]
    floor_fwd = read_x + med["read_w"] + med["write_dy"]
    floor_dx = read_dy + med["read_w"] + med["write_x"]
    row = dict(shape=s.name, m=s.m, k=s.k, n=s.n, g=s.g, **{f"{k}_ms": v for k, v in med.items()},
               floor_dw_ms=floor_dw, floor_fwdbwd_ms=floor_fwd + floor_dx + floor_dw,
               dw_bytes=s.g * s.k * s.n * 2, write_tbps=s.g * s.k * s.n * 2 / med["write_dw"] / 1e9,
               read_tbps=w.nbytes / med["read_w"] / 1e9)
    row["dw_cap_x_dense"] = med["dense"] / floor_dw
    row["dw_x_floor"] = med["dw"] / floor_dw
    row["fwdbwd_cap_x_3dense"] = 3 * med["dense"] / row["floor_fwdbwd_ms"]
    rows.append(row)
    print(f"  dw {med['dw']:.4f} ms  dense {med['dense']:.4f}  write dW bytes {med['write_dw']:.4f}"
          f" ({row['write_tbps']:.2f} TB/s)  read x+dy {med['read_xdy']:.4f}  read w"
          f" {med['read_w']:.4f} ({row['read_tbps']:.2f} TB/s)", flush=True)
    print(f"  dW floor {floor_dw:.4f} ms: at most {row['dw_cap_x_dense']:.3f}x dense; dW runs"
          f" {row['dw_x_floor']:.3f}x its floor; fwd+bwd floor {row['floor_fwdbwd_ms']:.4f} ms:"
          f" at most {row['fwdbwd_cap_x_3dense']:.3f}x three dense dW matmuls", flush=True)
    with open(os.path.join(args.out_dir, "dw_floors.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
