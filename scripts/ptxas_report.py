"""ptxas report (registers, spills, wgmma warnings), SASS counts and device time
of Mosaic forward variants on Qwen3-30B gate_up (GPU machine).

  python3 scripts/ptxas_report.py OUT_DIR [VARIANT ...]

Each variant compiles in its own process with MOSAIC_GPU_DUMP_PTXAS / _SASS set
(the Mosaic GPU compiler prints the ptxas report while compiling; on the
2026-11-29 image no SASS came out, so the SASS counts read 0); this script
keeps the report lines, counts spill (STL/LDL), HGMMA and warpgroup-wait
instructions in any SASS, and prints one summary table.  The report lines go
to OUT_DIR/ptxas_report.txt.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

VARIANTS = {
    "2wg_default": "MosaicFwdConfig(128, 256, 64, 4, grid_tile_width=4, num_compute_wgs=2, epilogue_split=2)",
    "2wg_noskip": "MosaicFwdConfig(128, 256, 64, 4, grid_tile_width=4, num_compute_wgs=2, epilogue_split=2, skip_empty_halves=False)",
    "2wg_split4": "MosaicFwdConfig(128, 256, 64, 4, grid_tile_width=4, num_compute_wgs=2, epilogue_split=4)",
    "2wg_bn128": "MosaicFwdConfig(128, 128, 64, 6, grid_tile_width=4, num_compute_wgs=2)",
    "2wg_chained": "MosaicFwdConfig(128, 256, 64, 4, grid_tile_width=4, num_compute_wgs=2, epilogue_split=2, delay_release=0, pipeline_across_tiles=True)",
    "2wg_split_n": "MosaicFwdConfig(64, 256, 64, 4, grid_tile_width=4, num_compute_wgs=2, epilogue_split=2, split_n=True)",
    "1wg_bn256": "MosaicFwdConfig(64, 256, 64, 4, grid_tile_width=4)",
    "swap0": "MosaicFwdConfig(128, 128, 64, 4, num_compute_wgs=2, ring=True, swap=True)",
    "swap32": "MosaicFwdConfig(128, 128, 64, 4, num_compute_wgs=2, ring=True, swap=True, tail_rows=32)",
    "ring": "MosaicFwdConfig(128, 256, 64, 4, num_compute_wgs=2, epilogue_split=2, ring=True)",
    # the dispatcher's choice for this shape from the shipped table (read, not copied)
    "table": "dispatch.choose('gmm', None, dtype=jnp.bfloat16, m=s.m, k=s.k, n=s.n, g=s.g, num_groups=s.g).config",
    # the same with each step's wgmmas waited for and its stage released at once
    "table_release_each_step": "dataclasses.replace(dispatch.choose('gmm', None, dtype=jnp.bfloat16, m=s.m, k=s.k, n=s.n, g=s.g, num_groups=s.g).config, delay_release=0)",
}

CHILD = r"""
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from ragdot import bench, dispatch, timing
from ragdot.backends import mosaic_fwd
from ragdot.backends.mosaic_fwd import MosaicFwdConfig
s = bench.Shape("qwen3-30b gate_up", 32768, 2048, 1536, 128)
gs = jnp.asarray(bench.routed_group_sizes(s))
x = jax.random.normal(jax.random.key(0), (s.m, s.k), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (s.g, s.k, s.n), jnp.bfloat16)
cfg = %s
f = jax.jit(lambda x, w, gs: mosaic_fwd.gmm(x, w, gs, None, transpose_rhs=False,
                                            out_dtype=jnp.bfloat16, config=cfg))
jax.block_until_ready(f(x, w, gs))
ms, method = timing.device_time_ms(f, x, w, gs, iterations=10)
print(f"RESULT ms={ms:.4f} tflops={2 * s.m * s.k * s.n / ms / 1e9:.1f}", flush=True)
"""


def main(out_dir: str, names: list[str]) -> int:
  os.makedirs(out_dir, exist_ok=True)
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1")
  rows, full = [], []
  for name in names or list(VARIANTS):
    cfg = VARIANTS[name]
    p = subprocess.run([sys.executable, "-c", CHILD % cfg], env=env, capture_output=True,
                       text=True, timeout=120)
    text = p.stdout + p.stderr
    full.append(f"===== {name}: {cfg}\n" + "\n".join(
        line for line in text.splitlines()
        if re.search(r"ptxas|registers|spill|stack|RESULT|warning|error|Error", line)))
    res = re.search(r"RESULT ms=([\d.]+) tflops=([\d.]+)", text)
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    rows.append(dict(
        name=name, ms=res.group(1) if res else "-", tflops=res.group(2) if res else "-",
        regs="/".join(regs) or "?", spills="/".join(f"{a}+{b}" for a, b in spills) or "?",
        stl=len(re.findall(r"\bSTL\b", text)), ldl=len(re.findall(r"\bLDL\b", text)),
        hgmma=len(re.findall(r"\bHGMMA\b", text)),
        depbar=len(re.findall(r"WARPGROUP\.DEPBAR|WARPGROUP\.ARRIVE", text)),
        warn=len(re.findall(r"C75\d\d", text)), rc=p.returncode))
  with open(os.path.join(out_dir, "ptxas_report.txt"), "w") as f:
    f.write("\n\n".join(full))
  keys = ["name", "ms", "tflops", "regs", "spills", "stl", "ldl", "hgmma", "depbar", "warn", "rc"]
  print(" | ".join(keys))
  for r in rows:
    print(" | ".join(str(r[k]) for k in keys))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".", sys.argv[2:]))
