"""Side-by-side benchmark: ragdot vs a dense matmul, tokamax and lax.ragged_dot.

``python -m ragdot.bench --preset training decode ep`` prints one table (ms,
TFLOP/s, TB/s of minimal bytes, ratio to the dense matmul of the same FLOPs and
to tokamax) and can write JSON.  Group sizes come from top-k routing of random
logits (or a skewed routing); inputs are fresh random values, never zeros.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ragdot
from ragdot.timing import device_time_ms

DN_DX = lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
DN_DW = lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  m: int
  k: int
  n: int
  g: int
  top_k: int = 8
  skewed: bool = False
  ep: int = 1  # >1: benchmark shard 0 of an expert-parallel split


def _model_shapes(tokens: int, suffix: str) -> list[Shape]:
  t = tokens
  return [
      Shape(f"qwen3-30b gate_up{suffix}", 8 * t, 2048, 1536, 128),
      Shape(f"qwen3-30b down{suffix}", 8 * t, 768, 2048, 128),
      Shape(f"qwen3-235b gate_up{suffix}", 8 * t, 4096, 3072, 128),
      Shape(f"deepseek-v3 down{suffix}", 8 * t, 2048, 7168, 256),
      Shape(f"mixtral gate_up{suffix}", 2 * t * 2, 4096, 28672, 8, top_k=2),
  ]


PRESETS: dict[str, list[Shape]] = {
    "training": _model_shapes(4096, ""),
    "decode": _model_shapes(64, " decode"),
    "ep": [Shape("qwen3-30b gate_up ep8 shard", 32768, 2048, 1536, 128, ep=8)],
    "skewed": [Shape("qwen3-30b gate_up skewed", 32768, 2048, 1536, 128, skewed=True)],
    "small": [Shape("small", 2048, 512, 512, 16, top_k=2)],
}


def routed_group_sizes(shape: Shape, seed: int = 0) -> np.ndarray:
  """Group sizes of top-k routing of random logits for m / top_k tokens."""
  rng = np.random.default_rng(seed)
  tokens = shape.m // shape.top_k
  logits = rng.standard_normal((tokens, shape.g))
  if shape.skewed:
    logits += np.linspace(3.0, 0.0, shape.g)[None, :]  # a few hot experts
  top = np.argsort(-logits, axis=1)[:, : shape.top_k]
  sizes = np.bincount(top.reshape(-1), minlength=shape.g).astype(np.int32)
  sizes[-1] += shape.m - sizes.sum()
  return sizes


def _tokamax():
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
    return tokamax
  except Exception:  # pylint: disable=broad-except
    return None


def _candidates(op: str, shape: Shape, impl: str) -> dict[str, Callable]:
  """name -> fn(x, w, dy, gs) for one op (fwd, dx, dw, fwdbwd)."""
  tk = _tokamax()
  r = functools.partial
  rd = r(ragdot.ragged_dot, implementation=impl)
  fns: dict[str, Callable] = {}
  if op == "fwd":
    fns["ragdot"] = lambda x, w, dy, gs: rd(x, w, gs)
    fns["dense"] = lambda x, w, dy, gs: jnp.dot(x, w[0])
    if shape.g * shape.m * shape.n * 2 < 16 * 2**30:  # lax's dense rewrite must fit
      fns["lax"] = lambda x, w, dy, gs: lax.ragged_dot(x, w, gs)
    if tk:
      fns["tokamax"] = lambda x, w, dy, gs: tk.ragged_dot(x, w, gs)
  elif op == "dx":
    fns["ragdot"] = lambda x, w, dy, gs: ragdot.ragged_dot_general(dy, w, gs, DN_DX, implementation=impl)
    fns["dense"] = lambda x, w, dy, gs: jnp.dot(dy, w[0].T)
    if tk:
      fns["tokamax"] = lambda x, w, dy, gs: tk.ragged_dot_general(dy, w, gs, DN_DX)
  elif op == "dw":
    fns["ragdot"] = lambda x, w, dy, gs: ragdot.trans_ragged_dot(x, dy, gs, implementation=impl)
    fns["dense"] = lambda x, w, dy, gs: jnp.dot(x.T, dy)
    if tk:
      fns["tokamax"] = lambda x, w, dy, gs: tk.ragged_dot_general(x, dy, gs, DN_DW)
  elif op == "fwdbwd":
    def loss(f):
      return jax.value_and_grad(
          lambda x, w, dy, gs: jnp.sum(f(x, w, gs).astype(jnp.float32) * dy), (0, 1))
    fns["ragdot"] = loss(lambda x, w, gs: rd(x, w, gs))
    fns["dense"] = loss(lambda x, w, gs: jnp.dot(x, w[0]))
    if tk:
      fns["tokamax"] = loss(lambda x, w, gs: tk.ragged_dot(x, w, gs))
  return fns


def _ep_candidates(shape: Shape, impl: str, sizes: np.ndarray) -> dict[str, Callable]:
  """Shard 0 of an EP split: group_offset vs the masked workaround vs local rows."""
  local = shape.g // shape.ep
  rows = int(sizes[:local].sum())
  gs_local = jnp.asarray(sizes[:local])
  mask = (jnp.arange(shape.m) < rows)[:, None]

  def masked(x, w, dy, gs):  # what callers do without group_offset
    full = jnp.zeros((shape.g,) + w.shape[1:], w.dtype).at[:local].set(w[:local])
    return jnp.where(mask, ragdot.ragged_dot(x, full, gs, implementation=impl), 0)

  fns = {
      "ragdot": lambda x, w, dy, gs: ragdot.ragged_dot(
          x, w[:local], gs, group_offset=jnp.int32(0), implementation=impl),
      "masked": masked,
      "local-rows": lambda x, w, dy, gs: ragdot.ragged_dot(
          x[:rows], w[:local], gs_local, implementation=impl),
  }
  tk = _tokamax()
  if tk:
    def tk_masked(x, w, dy, gs):
      full = jnp.zeros((shape.g,) + w.shape[1:], w.dtype).at[:local].set(w[:local])
      return jnp.where(mask, tk.ragged_dot(x, full, gs), 0)
    fns["tokamax-masked"] = tk_masked
  return fns


def bench_shape(shape: Shape, ops: list[str], impl: str | None, iterations: int,
                seed: int = 0) -> list[dict[str, Any]]:
  sizes = routed_group_sizes(shape, seed)
  keys = jax.random.split(jax.random.key(seed), 3)
  dtype = jnp.bfloat16
  x = jax.random.normal(keys[0], (shape.m, shape.k), dtype)
  w = (jax.random.normal(keys[1], (shape.g, shape.k, shape.n), jnp.float32) / 32).astype(dtype)
  dy = jax.random.normal(keys[2], (shape.m, shape.n), dtype)
  gs = jnp.asarray(sizes)
  rows = []
  for op in (["fwd"] if shape.ep > 1 else ops):
    fns = _ep_candidates(shape, impl, sizes) if shape.ep > 1 else _candidates(op, shape, impl)
    flops = 2 * shape.m * shape.k * shape.n * (3 if op == "fwdbwd" else 1)
    if shape.ep > 1:
      flops = 2 * int(sizes[: shape.g // shape.ep].sum()) * shape.k * shape.n
    nonempty = int(np.count_nonzero(sizes))
    w_bytes = nonempty * shape.k * shape.n * 2
    min_bytes = {"fwd": shape.m * shape.k * 2 + w_bytes + shape.m * shape.n * 2,
                 "dx": shape.m * shape.n * 2 + w_bytes + shape.m * shape.k * 2,
                 "dw": shape.m * (shape.k + shape.n) * 2 + w_bytes,
                 "fwdbwd": 3 * (shape.m * (shape.k + shape.n) * 2 + w_bytes)}[op]
    results = {}
    for name, fn in fns.items():
      try:
        jfn = jax.jit(fn)
        ms, method = device_time_ms(jfn, x, w, dy, gs, iterations=iterations)
        results[name] = (ms, method)
      except Exception as e:  # pylint: disable=broad-except
        results[name] = (float("nan"), f"error: {type(e).__name__}: {str(e)[:160]}")
    base = results.get("dense", (float("nan"),))[0]
    tok = results.get("tokamax", results.get("tokamax-masked", (float("nan"),)))[0]
    for name, (ms, method) in results.items():
      rows.append(dict(
          shape=shape.name, op=op, impl=name, m=shape.m, k=shape.k, n=shape.n,
          g=shape.g, ms=ms, tflops=flops / (ms * 1e-3) / 1e12 if ms == ms else float("nan"),
          tbps=min_bytes / (ms * 1e-3) / 1e12 if ms == ms else float("nan"),
          vs_dense=base / ms if ms == ms else float("nan"),
          vs_tokamax=tok / ms if ms == ms else float("nan"),
          method=method))
  return rows


def print_table(rows: list[dict[str, Any]], title: str = "ragdot bench") -> None:
  try:
    from rich.console import Console  # pylint: disable=g-import-not-at-top
    from rich.table import Table  # pylint: disable=g-import-not-at-top
  except ImportError:
    for r in rows:
      print(r)
    return
  table = Table(title=title)
  for col in ("shape", "op", "impl", "ms", "TFLOP/s", "TB/s", "x dense", "x tokamax", "note"):
    table.add_column(col)
  for r in rows:
    note = "" if r["method"] in ("cupti", "host") else r["method"]
    table.add_row(r["shape"], r["op"], r["impl"], f"{r['ms']:.4f}", f"{r['tflops']:.1f}",
                  f"{r['tbps']:.2f}", f"{r['vs_dense']:.2f}", f"{r['vs_tokamax']:.2f}", note[:60])
  Console(width=200).print(table)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--preset", nargs="+", default=["small"], choices=sorted(PRESETS))
  parser.add_argument("--ops", nargs="+", default=["fwd", "dx", "dw", "fwdbwd"])
  parser.add_argument("--implementation", default=None)
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--json", default=None, help="write rows to this file")
  args = parser.parse_args(argv)
  print(f"devices: {jax.devices()}  tokamax: {'yes' if _tokamax() else 'no'}", flush=True)
  rows = []
  for preset in args.preset:
    for shape in PRESETS[preset]:
      shape_rows = bench_shape(shape, args.ops, args.implementation, args.iterations)
      for r in shape_rows:
        print(json.dumps(r), flush=True)
      rows.extend(shape_rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  print_table(rows)


if __name__ == "__main__":
  sys.exit(main())
