"""Element-wise check of the table's kernels at real sizes (GPU machine; a
correctness diagnostic, not a bench).

  python3 scripts/check_elements.py OUT_DIR [--preset training] [--shapes NAME ...]
      [--ops fwd dx dw] [--repeats 3] [--ring-t16]

Per (shape, op): the dispatcher's choice from the shipped table, called
``--repeats`` times on NaN-poisoned memory with fresh random inputs; each output
is compared element by element with the f32 host oracle (an element is wrong
when |out - ref| > |ref| / 64 + rms(ref) / 32: bf16 rounding is <= |ref| / 256)
and bitwise with the first call.  Prints, per case, the wrong elements' count,
rows, 64-column blocks and the groups those rows lie in; ``--ring-t16`` adds
the GPU test's 3-stage 128 x 256 ring with 16-row tails on 8192 x 1024 x 960
(32 routed groups), plain and without tails.  Writes OUT_DIR/check_elements.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ragdot import backends, bench, dispatch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import oracle  # noqa: E402  (tests/: the f32 host oracle)
from test_gpu import _poison, _sizes  # noqa: E402  (NaN-poisoned memory; test group sizes)
from ab_fwd import gmm_inputs  # noqa: E402  (this folder: the script's sys.path[0])


def wrong_elements(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
  """Elements outside bf16's rounding of the f32 reference (NaN: wrong)."""
  return oracle.off_elements(out, ref, 1 / 64, 1 / 32)


def describe(mask: np.ndarray, sizes: np.ndarray, out, ref) -> dict:
  rows, cols = np.nonzero(mask)
  ends = np.cumsum(sizes)
  groups = sorted(set(np.searchsorted(ends, rows, side="right").tolist()))
  info = dict(wrong=int(mask.sum()), rows=sorted(set(rows.tolist()))[:16],
              col_blocks=sorted(set((cols // 64).tolist()))[:16], groups=groups[:16])
  if len(rows):
    info["group_spans"] = [(int(ends[gi] - sizes[gi]), int(ends[gi]))
                           for gi in groups[:8] if gi < len(sizes)]
    info["examples"] = [(int(r), int(c), float(out[r, c]), float(ref[r, c]))
                        for r, c in list(zip(rows, cols))[:6]]
  return info


def check(name: str, run, args, ref_fn, sizes, repeats: int, nbytes: int) -> dict:
  ref = np.asarray(ref_fn(), np.float32)
  outs, infos = [], []
  for _ in range(repeats):
    _poison(nbytes)
    out = np.asarray(jax.block_until_ready(run(*args)).astype(jnp.float32))
    outs.append(out)
    infos.append(describe(wrong_elements(out, ref), sizes, out, ref))
  same = [bool(np.array_equal(o.view(np.uint32), outs[0].view(np.uint32))) for o in outs]
  row = dict(case=name, calls=infos, bitwise_same_as_first=same)
  print(f"{name}: wrong {[i['wrong'] for i in infos]} same {same}", flush=True)
  for i, info in enumerate(infos):
    if info["wrong"]:
      print(f"  call {i}: {info}", flush=True)
  return row


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out_dir")
  p.add_argument("--preset", default="training", choices=sorted(bench.PRESETS))
  p.add_argument("--shapes", nargs="+", default=None)
  p.add_argument("--ops", nargs="+", default=["fwd", "dx", "dw"], choices=["fwd", "dx", "dw"])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--ring-t16", action="store_true")
  args = p.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  rows = []

  def save():
    with open(os.path.join(args.out_dir, "check_elements.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)

  if args.ring_t16:
    from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
    m, k, n, g = 8192, 1024, 960, 32
    sizes = _sizes(m, g, "routed")
    x, w = oracle.random_inputs(jax.random.key(m + k + n), [(m, k), (g, k, n)], jnp.bfloat16)
    for label, tails in (("ring t16", 16), ("ring t0", 0)):
      cfg = mosaic_fwd.MosaicFwdConfig(128, 256, 64, 3, num_compute_wgs=2, epilogue_split=2,
                                       ring=True, tail_rows=tails)
      run = jax.jit(lambda x, w, gs, cfg=cfg: mosaic_fwd.gmm(
          x, w, gs, None, transpose_rhs=False, out_dtype=jnp.bfloat16, config=cfg))
      rows.append(check(label, run, (x, w, jnp.asarray(sizes)),
                        lambda: oracle.np_ragged_dot(x, w, sizes), sizes, args.repeats,
                        4 * m * max(n, k)))
      save()

  for s in bench.preset_shapes(args.preset, args.shapes):
    sizes = np.asarray(bench.routed_group_sizes(s))
    gs = jnp.asarray(sizes)
    for op in args.ops:
      key = jax.random.key(len(rows) + 101)
      if op == "dw":
        kx, ky = jax.random.split(key)
        x = jax.random.normal(kx, (s.m, s.k), jnp.bfloat16)
        dy = jax.random.normal(ky, (s.m, s.n), jnp.bfloat16)
        choice = dispatch.choose("tgmm", None, dtype=jnp.bfloat16, m=s.m, k=s.k, n=s.n,
                                 g=s.g, num_groups=s.g)
        mod = backends.get_backend(choice.implementation)
        run = jax.jit(lambda x, dy, gs, mod=mod, cfg=choice.config: mod.tgmm(
            x, dy, gs, None, num_groups=s.g, out_dtype=jnp.bfloat16, precision=None,
            config=cfg))
        operands, out_elems = (x, dy, gs), s.g * s.k * s.n
        # a dW row is one expert's (k, n) block flattened: report rows as experts x k
        sizes_for_rows = np.full(s.g, s.k)
        run = lambda *a, run=run: run(*a).reshape(s.g * s.k, s.n)
        ref = lambda x=x, dy=dy: np.asarray(oracle.np_trans_ragged_dot(x, dy, sizes),
                                            np.float32).reshape(s.g * s.k, s.n)
      else:
        call = dispatch.backend_call(op, s.k, s.n)
        tr = call.transpose_rhs
        x, w = gmm_inputs(s, call, key)
        choice = dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=s.m, k=call.k, n=call.n,
                                 g=s.g, num_groups=s.g, transpose_rhs=tr)
        mod = backends.get_backend(choice.implementation)
        run = jax.jit(lambda x, w, gs, mod=mod, cfg=choice.config, tr=tr: mod.gmm(
            x, w, gs, None, transpose_rhs=tr, out_dtype=jnp.bfloat16, precision=None,
            config=cfg))
        ref = lambda x=x, w=w, tr=tr: oracle.np_ragged_dot(x, w, sizes, transpose_rhs=tr)
        operands, out_elems = (x, w, gs), s.m * call.n
        sizes_for_rows = sizes
      label = f"{s.name} {op} ({choice.implementation})"
      row = check(label, run, operands, ref, sizes_for_rows, args.repeats,
                  min(4 * out_elems, 8 << 30))
      row["config"] = str(choice.config)
      rows.append(row)
      save()


if __name__ == "__main__":
  main()
