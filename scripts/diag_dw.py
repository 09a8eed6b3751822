"""Where does the dW kernel's time go? (GPU machine; a diagnostic, not a bench)

  python3 scripts/diag_dw.py OUT_DIR [--base FIELD=VALUE ...]
      [--set FIELD=VALUE ...] [--cases ABC] [--extra-arrivals 7] [--rounds 3]

For each training shape times the default Mosaic dW kernel (with ``--base``:
the default with those fields replaced, e.g. a pingpong ring; CUPTI,
interleaved rounds) on
  A  routed group sizes (the bench's),
  B  the same inputs with the boundary-block row masking traced out (wrong
     results: it only shows what the masking costs),
  C  group sizes rounded to multiples of 64 (same m; no group straddles a row
     block, so nothing is masked and no block is partly padding; groups under
     32 rows become empty, which also changes the mix of items a little),
  E  (only when --cases has E) routed sizes with the masking code compiled in but
     never run: its condition is false at run time, which the compiler cannot
     know (wrong results; E/A near B/A means the masking work is the cost, E/A
     near 1 that the code's mere presence is, e.g. waits the compiler puts
     around the wgmmas),
  R  (only when --cases has R) A with every TMA load of the ring followed by
     ``--extra-arrivals`` copies whose predicate is false: they move nothing but
     still arrive on the stage's barrier (from all 128 producer threads, with 0
     bytes), as the padding of a design with pieces would (same results; R/A
     is what the arrivals alone cost),
  W  (only when --cases has W) A with the output's TMA stores traced out (the
     epilogue still converts and stages every tile; nothing reaches HBM; wrong
     results: W/A is what writing the [g, k, n] output costs beyond the rest),
  S  (only when --cases has S) A with every output tile stored into group 0's
     [k, n] block (wrong results): the same TMA stores, but into a few MB that
     stay in L2, so next to no DRAM writes.  S near W: the DRAM writes are the
     cost; S near A: issuing and draining the stores is,
  H  (only when --cases has H) A with every item's rows read from ``[first mod
     1024, ...)``: the same loads, from a window of rows that stays in L2
     (wrong results: H/A is the ceiling of any prefetch of the rows),
  D  with ``--set``: routed sizes, A's config with those fields replaced (an
     A/B; its output is compared with A's bitwise),
and writes OUT_DIR/diag_dw.json.  ``--table``: every case starts from the
dispatcher's dW config of the shape (the shipped table) instead of the
default.  With MOSAIC_GPU_DUMP_PTXAS=1 the ptxas report of each case follows
its ``# compile CASE SHAPE`` line.  B/A is the masking's share, C/A the share
of masking plus boundary blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ragdot import bench, timing
from ragdot.backends import mosaic_dw

from ab_fwd import dw_case, parse_fields  # this folder (the script's sys.path[0])


def aligned_sizes(sizes: np.ndarray, m: int, align: int = 64) -> np.ndarray:
  """``sizes`` rounded to multiples of ``align``; the largest group takes the
  rest so they still sum to ``m`` (m a multiple of ``align``)."""
  out = (np.round(sizes / align) * align).astype(np.int32)
  out[np.argmax(out)] += m - out.sum()
  assert out.min() >= 0 and out.sum() == m and not np.any(out % align)
  return out


def row_blocks(sizes: np.ndarray, block: int = 64, align: int = 8) -> int:
  """Row blocks the kernel runs over all groups: each non-empty group's blocks
  start at its first row rounded down to ``align``."""
  ends = np.cumsum(sizes)
  starts = ends - sizes
  first = starts // align * align
  return int(np.sum(np.where(sizes > 0, -(-(ends - first) // block), 0)))


@contextlib.contextmanager
def extra_arrivals(extra: int):
  """While tracing: every ``copy_gmem_to_smem`` is followed by ``extra`` copies
  predicated off, and the multi-slot barriers (the ring's ``produced``; a
  pingpong ring's other barriers are single-arrival or unused) expect
  ``1 + extra`` times the arrivals."""
  real_copy, real_barrier = plgpu.copy_gmem_to_smem, plgpu.Barrier

  def copy(src, dst, barrier=None, **kw):
    real_copy(src, dst, barrier, **kw)
    for _ in range(extra):
      real_copy(src, dst, barrier, predicate=jnp.bool_(False), **kw)

  def barrier(num_arrivals=1, num_barriers=1, **kw):
    if num_barriers > 1 and num_arrivals == 2:
      num_arrivals *= 1 + extra
    return real_barrier(num_arrivals=num_arrivals, num_barriers=num_barriers, **kw)

  plgpu.copy_gmem_to_smem, plgpu.Barrier = copy, barrier
  try:
    yield
  finally:
    plgpu.copy_gmem_to_smem, plgpu.Barrier = real_copy, real_barrier


@contextlib.contextmanager
def stores_traced_out(into_group0: bool = False):
  """While tracing: the dW kernel's output chunks are staged in SMEM as usual
  but never stored (each counts as stored, so the staging buffers' waits stay
  as they are); ``into_group0``: stored, but every group's into group 0's."""
  real = mosaic_dw._store_half
  if into_group0:
    mosaic_dw._store_half = lambda src_smem, out_gmem, j, row, col, *rest: real(
        src_smem, out_gmem, jnp.int32(0), row, col, *rest)
  else:
    mosaic_dw._store_half = lambda src_smem, out_gmem, j, row, col, *rest: jnp.bool_(True)
  try:
    yield
  finally:
    mosaic_dw._store_half = real


@contextlib.contextmanager
def rows_from_l2_window(window: int = 1024):
  """While tracing: each dW item's rows start at ``first mod window`` (its
  loads read a few MB that stay in L2)."""
  real = mosaic_dw._work_item

  def item(*args, **kwargs):
    it = real(*args, **kwargs)
    return it._replace(first=pl.multiple_of(lax.rem(it.first, window), 8))

  mosaic_dw._work_item = item
  try:
    yield
  finally:
    mosaic_dw._work_item = real


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--cases", default="ABC", help="which of A, B, C, E, R, W, S, H to run (A always runs)")
  p.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                 help="MosaicDwConfig fields of case D (Python literals)")
  p.add_argument("--base", nargs="+", default=[], metavar="FIELD=VALUE",
                 help="MosaicDwConfig fields replaced in the config of every case")
  p.add_argument("--extra-arrivals", type=int, default=7,
                 help="case R: predicated-off copies per TMA load")
  p.add_argument("--table", action="store_true",
                 help="start from the table's dW config of each shape (not the default)")
  p.add_argument("--shapes", nargs="+", default=None, help="preset names (default: all)")
  p.add_argument("--out-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                 help="dW's dtype (float32 gets the default's 2-stage f32 config)")
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  out_dtype = jnp.dtype(args.out_dtype)
  changes = parse_fields(args.set)
  rows = []
  for s in bench.preset_shapes("training", args.shapes):
    gs, x, dy, choice = dw_case(s, jax.random.key(len(rows)), out_dtype)
    sizes = np.asarray(gs)
    gs64 = jnp.asarray(aligned_sizes(sizes, s.m))

    default = mosaic_dw.default_config(s.m, s.k, s.n, s.g, jnp.bfloat16, out_dtype)
    if args.table:
      if choice.implementation != "mosaic" or choice.config is None:
        print(f"{s.name}: the table's dW is {choice.implementation}; skipped", flush=True)
        continue
      default = choice.config
    if args.base:
      asked = dataclasses.replace(default, **parse_fields(args.base))
      default = mosaic_dw.fit_config(asked, jnp.bfloat16, out_dtype)
      if default is None:
        raise SystemExit(f"--base {' '.join(args.base)} does not fit SMEM for {out_dtype}")
      if default != asked:  # say so: the timed kernel is not quite the one asked for
        changed = {f.name: getattr(default, f.name) for f in dataclasses.fields(default)
                   if getattr(default, f.name) != getattr(asked, f.name)}
        print(f"{s.name}: --base refitted to SMEM for {jnp.dtype(out_dtype).name}: {changed}",
              flush=True)
    # B patches the two-warpgroup bodies' masking; the one-warpgroup body masks inline.
    assert default.num_compute_wgs == 2, default
    cases_here = args.cases
    if default.side_rows and {"B", "E", "R"} & set(cases_here):
      # side_rows masks nothing (B and E would time A's kernel again), and its piece
      # barriers are not scaled by extra_arrivals (R would hang).
      skipped = [c for c in cases_here if c in "BER"]
      cases_here = "".join(c for c in cases_here if c not in "BER")
      print(f"{s.name}: case(s) {', '.join(skipped)} skipped: they need a masking ring, the"
            " config has side_rows (--base side_rows=False runs them)", flush=True)

    def make(config=default):
      return jax.jit(lambda x, dy, gs: mosaic_dw.tgmm(
          x, dy, gs, None, num_groups=s.g, out_dtype=out_dtype, config=config))

    def compile_(name, f, g=gs):
      # A marker for the ptxas report that MOSAIC_GPU_DUMP_PTXAS=1 prints next.
      print(f"# compile {name} {s.name}", flush=True)
      jax.block_until_ready(f(x, dy, g))

    fa = make()
    compile_("A", fa)
    cases = [("A", fa, gs)]
    out_a = np.asarray(fa(x, dy, gs).astype(jnp.float32))

    def equals_a(f):
      """Whether ``f`` gives A's output bitwise on the routed sizes."""
      return bool(np.array_equal(out_a, np.asarray(f(x, dy, gs).astype(jnp.float32))))
    if "B" in cases_here:
      fb = make()
      # Traced out of B only: the shared ring's masking (with its barrier) and
      # a pingpong consumer's masking of its own stage.
      real = mosaic_dw._consumers_mask, mosaic_dw._mask_stage
      mosaic_dw._consumers_mask = mosaic_dw._mask_stage = lambda *a, **k: None
      try:
        compile_("B", fb)
      finally:
        mosaic_dw._consumers_mask, mosaic_dw._mask_stage = real
      cases.append(("B", fb, gs))
    if "R" in cases_here:
      # (extra_arrivals scales only the pingpong ring's barriers right.)
      assert default.pingpong and not default.mask_warpgroup, default
      fr = make()
      with extra_arrivals(args.extra_arrivals):
        compile_("R", fr)
      cases.append(("R", fr, gs))
      # The predicated-off copies move nothing: R computes what A does.
      r_equal = equals_a(fr)
    if "C" in cases_here:
      fc = make()
      compile_("C", fc, gs64)
      cases.append(("C", fc, gs64))
    if "E" in cases_here:
      fe = make()
      real_straddles = mosaic_dw._straddles
      # Row blocks start at row >= 0, so this never holds; it is traced all the same.
      mosaic_dw._straddles = lambda row0, rows, start, end: row0 < -1
      try:
        compile_("E", fe)
      finally:
        mosaic_dw._straddles = real_straddles
      cases.append(("E", fe, gs))
    if "W" in cases_here:
      fw = make()
      with stores_traced_out():
        compile_("W", fw)
      cases.append(("W", fw, gs))
    if "H" in cases_here:
      # (only `first` moves: a masking config would mask every block as straddling)
      assert default.side_rows, "case H needs a side_rows config"
      fh = make()
      with rows_from_l2_window():
        compile_("H", fh)
      cases.append(("H", fh, gs))
    if "S" in cases_here:
      fs = make()
      with stores_traced_out(into_group0=True):
        compile_("S", fs)
      cases.append(("S", fs, gs))
    equal = None
    if changes:
      fd = make(dataclasses.replace(default, **changes))
      compile_("D", fd)
      equal = equals_a(fd)
      cases.append(("D", fd, gs))
    med = timing.interleaved_median_ms({name: (f, (x, dy, g)) for name, f, g in cases},
                                       rounds=args.rounds, iterations=args.iterations)
    flops = 2 * s.m * s.k * s.n
    row = dict(shape=s.name, ms=med, tflops={k: flops / v / 1e9 for k, v in med.items()},
               b_over_a=med["B"] / med["A"] if "B" in med else None,
               c_over_a=med["C"] / med["A"] if "C" in med else None,
               e_over_a=med["E"] / med["A"] if "E" in med else None,
               r_over_a=med["R"] / med["A"] if "R" in med else None,
               w_over_a=med["W"] / med["A"] if "W" in med else None,
               s_over_a=med["S"] / med["A"] if "S" in med else None,
               h_over_a=med["H"] / med["A"] if "H" in med else None,
               config=str(default),
               blocks_routed=row_blocks(sizes),
               blocks_aligned=row_blocks(np.asarray(gs64)))
    line = "".join(f"  {name}/A {row[f'{name.lower()}_over_a']:.3f}" for name in "BCERWSH"
                   if name in med)
    if "R" in med:
      row.update(r_equal_a=r_equal)
      line += f" equal {r_equal}"
    if changes:
      row.update(d_over_a=med["D"] / med["A"], d_equal_a=equal)
      line += f"  D({' '.join(args.set)}) {row['d_over_a']:.3f} equal {equal}"
    rows.append(row)
    print(f"{s.name:20s} A {med['A']:.4f} ms {row['tflops']['A']:6.1f}"
          f"  blocks {row['blocks_routed']} -> {row['blocks_aligned']}{line}", flush=True)
  name = "diag_dw.json" if out_dtype == jnp.bfloat16 else f"diag_dw_{out_dtype.name}.json"
  with open(os.path.join(args.out_dir, name), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, set=changes,
                   base=parse_fields(args.base), out_dtype=out_dtype.name,
                   rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
