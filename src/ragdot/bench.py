"""Side-by-side benchmark: ragdot vs a dense matmul, tokamax and lax.ragged_dot.

``ragdot bench --preset training decode ep`` (or ``python -m ragdot.bench``;
``--shape m,k,n,g`` for any shape) prints one table: ms, TFLOP/s, TB/s of
minimal bytes and its ratio to the copy bandwidth measured in the same run
(GPU), ratios to the dense matmul of the same FLOPs and to tokamax, and peak
device memory of the call from XLA's memory analysis; it can write JSON and a
PNG.  "ragdot" rows are the automatic choice, "ragdot:<impl>" rows force one
backend; the run ends with the check that the automatic choice is within 5% of
the best ragdot implementation on every (shape, op).  Group sizes come from
top-k routing of random logits (or a skewed routing); inputs are fresh random
values, never zeros.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections.abc import Collection
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ragdot
from ragdot import argtypes
from ragdot.backends import IMPLEMENTATIONS
from ragdot.timing import (SETTLE_S, device_time_ms, output_budget_bytes, sustained_method,
                           sustained_time_ms)
from ragdot.watchdog import Watchdog

BASELINES = ("dense", "lax", "tokamax")  # what ragdot is timed against
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


# (hidden, moe_intermediate, experts, top_k, training tokens): CONTEXT.md section 2;
# Mixtral uses 8192 tokens (m = 16384 rows) as in the anchors.  gpt-oss (the
# public configs of gpt-oss-120b / -20b: hidden and expert width 2880, 128 / 32
# experts, top-4): 2880 is an odd multiple of 64, so its k and n take partial
# 128- and 256-wide tiles.
MODELS = {
    "qwen3-30b": (2048, 768, 128, 8, 4096),
    "qwen3-235b": (4096, 1536, 128, 8, 4096),
    "deepseek-v3": (7168, 2048, 256, 8, 4096),
    "mixtral": (4096, 14336, 8, 2, 8192),
    "gpt-oss-120b": (2880, 2880, 128, 4, 4096),
    "gpt-oss-20b": (2880, 2880, 32, 4, 4096),
}


def model_shapes(model: str, decode_tokens: int = 64) -> list[Shape]:
  """Fused gate_up and down projections, training and decode token counts."""
  hidden, inter, experts, top_k, tokens = MODELS[model]
  # (the decode preset's "mixtral gate_up decode" has twice the tokens, as its
  # training shape: this one names its own count)
  decode = " decode" if model != "mixtral" else f" decode {decode_tokens} tokens"
  out = []
  for t, suffix in ((tokens, ""), (decode_tokens, decode)):
    m = t * top_k
    out.append(Shape(f"{model} gate_up{suffix}", m, hidden, 2 * inter, experts, top_k))
    out.append(Shape(f"{model} down{suffix}", m, inter, hidden, experts, top_k))
  return out


def ep_local_shapes(ep: int = 8,
                    models: tuple[str, ...] = ("qwen3-30b", "qwen3-235b", "deepseek-v3",
                                               "gpt-oss-120b")) -> list[Shape]:
  """The plain calls one rank of an ``ep``-way expert-parallel split makes after
  its token all-to-all, at training size: 1/ep of the rows (tokens x top_k) over
  the rank's 1/ep of the experts, gate_up and down, no group_offset."""
  out = []
  for model in models:
    hidden, inter, experts, top_k, tokens = MODELS[model]
    m, g = tokens * top_k // ep, experts // ep
    top_k = min(top_k, g)
    out.append(Shape(f"{model} gate_up ep{ep} local", m, hidden, 2 * inter, g, top_k))
    out.append(Shape(f"{model} down ep{ep} local", m, inter, hidden, g, top_k))
  return out


def ep_shard_shapes(ep: int = 8, skewed: bool = False,
                    models: tuple[str, ...] = ("qwen3-30b", "qwen3-235b")) -> list[Shape]:
  """Shard 0 of an ``ep``-way split of each model's gate_up and down at training
  size (``group_offset``; ``skewed``: shard 0's experts among the hot ones)."""
  tag = " skewed" if skewed else ""
  return [dataclasses.replace(s, name=f"{s.name} ep{ep} shard{tag}", ep=ep, skewed=skewed)
          for model in models for s in model_shapes(model)[:2]]


def seed_sweep_shapes() -> list[Shape]:
  """K, N in {256, 512, 1024, 2048} x G in {16, 32} at M = 4096 and 16384."""
  dims = (256, 512, 1024, 2048)
  return [Shape(f"sweep m{m} k{k} n{n} g{g}", m, k, n, g, top_k=4)
          for m in (4096, 16384) for g in (16, 32) for k in dims for n in dims]


PRESETS: dict[str, list[Shape]] = {
    "training": _model_shapes(4096, ""),
    # Half the tokens: groups of ~128 rows (Qwen), ~64 (DeepSeek-V3), ~1024 (Mixtral),
    # on table entries tuned for twice as many (docs/performance.md v40c).
    "training-2k": _model_shapes(2048, " 2k"),
    # A quarter: ~64 rows per group (Qwen), ~32 (DeepSeek-V3), ~512 (Mixtral).
    "training-1k": _model_shapes(1024, " 1k"),
    "decode": _model_shapes(64, " decode"),
    # Serving one token (two for Mixtral's shape): top_k rows over as many experts.
    "one-token": _model_shapes(1, " 1 token"),
    "ep": [Shape("qwen3-30b gate_up ep8 shard", 32768, 2048, 1536, 128, ep=8)],
    # The Qwen3 projections' EP=8 shards, routed and skewed: a shard's kernel is chosen
    # by shape, and routing moves which one is faster (docs/performance.md v44f-h).
    "ep-models": ep_shard_shapes(8),
    "ep-skewed": ep_shard_shapes(8, skewed=True),
    # What an EP=8 rank runs after its all-to-all: its own rows over its own experts.
    "ep-local": ep_local_shapes(8),
    "skewed": [Shape("qwen3-30b gate_up skewed", 32768, 2048, 1536, 128, skewed=True)],
    # Every training shape under the skewed routing (a table entry serves both routings).
    "training-skewed": [dataclasses.replace(s, skewed=True)
                        for s in _model_shapes(4096, " skewed")],
    "decode-skewed": [dataclasses.replace(s, skewed=True)
                      for s in _model_shapes(64, " decode skewed")],
    "small": [Shape("small", 2048, 512, 512, 16, top_k=2)],
    **{model: model_shapes(model) for model in MODELS},
    "seed-sweep": seed_sweep_shapes(),
}


def preset_shapes(presets: str | list[str], names: Collection[str] | None = None) -> list[Shape]:
  """The shapes of one or more presets, in order; with ``names``, only those
  (ValueError naming any that no preset holds: a mistyped name would
  otherwise measure nothing)."""
  shapes = [s for p in ([presets] if isinstance(presets, str) else presets) for s in PRESETS[p]]
  return select_shapes(shapes, names)


def select_shapes(shapes: list[Shape], names: Collection[str] | None = None) -> list[Shape]:
  """``shapes`` once each, in order; with ``names``, only those (ValueError
  naming any not among them).  ValueError too if one name means two different
  shapes: the bench keys its results, ratios and plot by name."""
  by_name: dict[str, Shape] = {}
  for s in shapes:
    if by_name.setdefault(s.name, s) != s:
      raise ValueError(f"shape name {s.name!r} means two shapes: {by_name[s.name]} and {s}")
  if names:
    unknown = set(names) - set(by_name)
    if unknown:
      raise ValueError(f"no such shape among the presets and --shape: {sorted(unknown)}")
  return [s for name, s in by_name.items() if not names or name in names]


def parse_shape(text: str) -> Shape:
  """'m,k,n,g' or 'm,k,n,g,top_k' (top_k defaults to min(8, g))."""
  try:
    vals = [int(v) for v in text.replace("x", ",").split(",") if v.strip()]
  except ValueError:
    vals = []
  if len(vals) not in (4, 5) or min(vals) < 1:
    raise argparse.ArgumentTypeError(f"shape must be m,k,n,g[,top_k] positive ints, got {text!r}")
  m, k, n, g = vals[:4]
  top_k = vals[4] if len(vals) == 5 else min(8, g)
  top_k = min(top_k, g)
  return Shape(f"{m},{k},{n},{g},{top_k}", m, k, n, g, top_k=top_k)


def routed_group_sizes(shape: Shape, seed: int = 0, skew: float | None = None) -> np.ndarray:
  """Group sizes of top-k routing of random logits for m / top_k tokens.

  ``skew``: the height of a ramp added to the logits from the first expert (that
  much) to the last (0), so the first experts run hot; None: 3.0 for a
  ``skewed`` shape, else no ramp."""
  rng = np.random.default_rng(seed)
  tokens = shape.m // shape.top_k
  logits = rng.standard_normal((tokens, shape.g))
  if skew is None:
    skew = 3.0 if shape.skewed else 0.0
  if skew:
    logits += np.linspace(skew, 0.0, shape.g)[None, :]  # a few hot experts
  top = np.argsort(-logits, axis=1)[:, : shape.top_k]
  sizes = np.bincount(top.reshape(-1), minlength=shape.g).astype(np.int32)
  sizes[-1] += shape.m - sizes.sum()
  return sizes


def local_rows8(shape: Shape, sizes: np.ndarray) -> int:
  """Rows of the plain call over shard 0's local rows: those rows padded to a
  multiple of 8 (the pad rows belong to no group, so their outputs are zero),
  as a fixed-capacity EP buffer would be."""
  return -(-int(sizes[:shape.g // shape.ep].sum()) // 8) * 8


def ep_shard_sizes(shape: Shape, skew: float | None = None
                   ) -> tuple[np.ndarray, np.ndarray, int]:
  """Shard 0 of an EP shape (``shape.ep`` > 1): ``(sizes, emptied, rows)``.

  ``sizes``: the routed group sizes of all ``shape.g`` groups (``skew``: as in
  ``routed_group_sizes``); ``emptied``: the
  same with the shard's ``g / ep`` local groups emptied (their rows moved to the
  next group), so a shard call writes only zero rows; ``rows``: ``local_rows8``.
  """
  local = shape.g // shape.ep
  sizes = routed_group_sizes(shape, skew=skew)
  emptied = sizes.copy()
  emptied[local] += emptied[:local].sum()
  emptied[:local] = 0
  return sizes, emptied, local_rows8(shape, sizes)


def _tokamax():
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
    return tokamax
  except Exception:  # pylint: disable=broad-except
    return None


def _value_and_grads(fwd: Callable) -> Callable:
  """fn(x, w, dy, gs): value_and_grad of ``sum(fwd(x, w, gs) * dy)`` (f32)
  w.r.t. x and w, the fwd+bwd op's step."""
  return jax.value_and_grad(
      lambda x, w, dy, gs: jnp.sum(fwd(x, w, gs).astype(jnp.float32) * dy), (0, 1))


def _ragdot_fns(op: str, impl: str | None) -> Callable:
  """fn(x, w, dy, gs) calling ragdot for ``op`` with ``impl`` (None: automatic)."""
  rd = functools.partial(ragdot.ragged_dot, implementation=impl)
  if op == "fwd":
    return lambda x, w, dy, gs: rd(x, w, gs)
  if op == "dx":
    return lambda x, w, dy, gs: ragdot.ragged_dot_general(dy, w, gs, DN_DX, implementation=impl)
  if op == "dw":
    return lambda x, w, dy, gs: ragdot.trans_ragged_dot(x, dy, gs, implementation=impl)
  if op == "fwdbwd":
    return _value_and_grads(rd)
  raise ValueError(f"unknown op {op!r}")


def ragdot_names(impls: list[str] | None, impl: str | None) -> dict[str, str | None]:
  """Row name -> implementation: "ragdot" is the automatic choice (or ``impl``)."""
  names: dict[str, str | None] = {"ragdot": impl}
  if impl is None:
    for name in impls or []:
      if name != "auto":
        names[f"ragdot:{name}"] = name
  return names


def _wanted(baselines: bool | Collection[str]) -> set[str]:
  """The baseline names ``baselines`` (True: all of BASELINES; False: none) asks for."""
  return set(BASELINES if baselines is True else baselines or ())


def _candidates(op: str, shape: Shape, impl: str | None,
                impls: list[str] | None = None,
                baselines: bool | Collection[str] = True) -> dict[str, Callable]:
  """name -> fn(x, w, dy, gs) for one op (fwd, dx, dw, fwdbwd).

  ``baselines``: True (all of BASELINES), False, or the names to time.
  """
  fns: dict[str, Callable] = {
      name: _ragdot_fns(op, i) for name, i in ragdot_names(impls, impl).items()}
  wanted = _wanted(baselines)
  if not wanted:
    return fns
  tk = _tokamax() if "tokamax" in wanted else None
  if op == "fwd":
    fns["dense"] = lambda x, w, dy, gs: jnp.dot(x, w[0])
    # lax's dense rewrite must fit
    if "lax" in wanted and shape.g * shape.m * shape.n * 2 < 16 * 2**30:
      fns["lax"] = lambda x, w, dy, gs: lax.ragged_dot(x, w, gs)
    if tk:
      fns["tokamax"] = lambda x, w, dy, gs: tk.ragged_dot(x, w, gs)
  elif op == "dx":
    fns["dense"] = lambda x, w, dy, gs: jnp.dot(dy, w[0].T)
    if tk:
      fns["tokamax"] = lambda x, w, dy, gs: tk.ragged_dot_general(dy, w, gs, DN_DX)
  elif op == "dw":
    fns["dense"] = lambda x, w, dy, gs: jnp.dot(x.T, dy)
    if tk:
      fns["tokamax"] = lambda x, w, dy, gs: tk.ragged_dot_general(x, dy, gs, DN_DW)
  elif op == "fwdbwd":
    # Three dense matmuls: the gradient is taken w.r.t. the one [k, n] weight
    # the product uses.  (Differentiating w.r.t. all of w, as before v10, also
    # timed XLA padding that [k, n] gradient with zeros to [g, k, n]: a
    # 474 us kernel of 1285 on Qwen3-30B gate_up.)
    dense = _value_and_grads(lambda x, w0, gs: jnp.dot(x, w0))
    fns["dense"] = lambda x, w, dy, gs: dense(x, w[0], dy, gs)
    if tk:
      fns["tokamax"] = _value_and_grads(lambda x, w, gs: tk.ragged_dot(x, w, gs))
  if "dense" not in wanted:
    del fns["dense"]
  return fns


def dispatch_choice(op: str, shape: Shape, impl: str | None = None,
                    dtype: Any = jnp.bfloat16, device=None, weights_dtype: Any = None):
  """The dispatcher's Choice for the backend call of ``op`` (fwd, dx, dw) on
  ``shape``; an EP shape (``ep > 1``) is its shard 0 (group_offset, g / ep
  local groups).  ``weights_dtype``: the expert weights' dtype when it is not
  ``dtype`` (fp8 beside 16-bit rows; fwd and dx read them, dw does not)."""
  from ragdot import dispatch  # pylint: disable=g-import-not-at-top

  call = dispatch.backend_call(op, shape.k, shape.n)
  local = shape.g // shape.ep if shape.ep > 1 else shape.g
  return dispatch.choose(call.op, impl, dtype=dtype, out_dtype=dtype, m=shape.m, k=call.k,
                         n=call.n, g=local, num_groups=shape.g,
                         transpose_rhs=call.transpose_rhs, has_offset=shape.ep > 1,
                         device=device, rhs_dtype=weights_dtype if op != "dw" else None)


def auto_choice(op: str, shape: Shape, dtype: Any = jnp.bfloat16, device=None) -> str:
  """What the dispatcher picks for ``op`` of ``shape`` (backend, config, why)."""
  return describe_choice(dispatch_choice(op, shape, None, dtype, device))


def choice_fields(c) -> dict[str, Any]:
  """A dispatcher Choice as bench-row fields: ``choice`` (text, for people),
  ``backend`` and ``config`` (table fields; None: the backend's default), for
  ``ragdot tune --import-bench``."""
  from ragdot.tune import config_fields  # pylint: disable=g-import-not-at-top

  return dict(choice=describe_choice(c), backend=c.implementation,
              config=None if c.config is None else config_fields(c.config))


def resolved_kernels(op: str, shape: Shape, impl: str | None, dtype: Any = jnp.bfloat16,
                     device=None) -> tuple:
  """The (backend, config) of each kernel call ``op`` makes with ``impl`` (None:
  automatic); fwdbwd makes three (forward, dX, dW).  Equal tuples: the same
  kernels run."""
  out = []
  for sub in (("fwd", "dx", "dw") if op == "fwdbwd" else (op,)):
    c = dispatch_choice(sub, shape, impl, dtype, device)
    # (The xla backend ignores ``interpret``: plain JAX either way.)
    out.append((c.implementation, c.config, c.interpret and c.implementation != "xla"))
  return tuple(out)


def describe_choice(c) -> str:
  cfg = "default config" if c.config is None else _short_config(c.config)
  return f"{c.implementation} [{cfg}] ({c.reason})"


def _short_config(config: Any) -> str:
  """A config as ``field=value`` words: the block sizes and stages always, the
  other fields only where they differ from the config class's defaults."""
  if not dataclasses.is_dataclass(config):
    return " ".join(f"{k}={v}" for k, v in dict(config).items() if v is not None)
  words = []
  for f in dataclasses.fields(config):
    v = getattr(config, f.name)
    always = f.name.startswith("block_") or f.name == "num_stages"
    if v is not None and (always or v != f.default):
      words.append(f"{f.name}={v}")
  return " ".join(words)


def peak_bytes(compiled: Any) -> int | None:
  """Peak device memory of one call from XLA's memory analysis (None: unknown)."""
  try:
    ma = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if ma is None:
    return None
  peak = getattr(ma, "peak_memory_in_bytes", 0) or 0
  if peak <= 0:
    peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
            - ma.alias_size_in_bytes)
  return int(peak)


EP_OPS = ("fwd", "dw", "fwdbwd")  # what the EP shard rows measure


def _ep_candidates(op: str, shape: Shape, impl: str | None, sizes: np.ndarray,
                   baselines: bool | Collection[str] = True) -> dict[str, Callable]:
  """Shard 0 of an EP split, for ``op`` in ``EP_OPS``: group_offset vs the
  masked workaround vs the plain call over the local rows only (always), and
  tokamax's masked workaround when ``baselines`` (as ``_candidates``'s) takes
  "tokamax".

  fwd: the shard's output rows (zeros outside the shard's rows).  dw: the
  local experts' weight gradients.  fwdbwd: value_and_grad of a loss through
  the forward, w.r.t. the tokens and the local experts' weights.
  """
  local = shape.g // shape.ep
  rows = int(sizes[:local].sum())
  rows8 = local_rows8(shape, sizes)
  mask = (jnp.arange(shape.m) < rows)[:, None]
  off = jnp.int32(0)

  def padded(w):  # the local experts' weights in a full-size weight array
    return jnp.zeros((shape.g,) + w.shape[1:], w.dtype).at[:local].set(w)

  # Forward of each strategy: fn(x, w_local, gs) -> rows.  The local-rows one
  # gets x[:rows8]; its loss uses dy[:rows8].
  # (group sizes sliced on device, as a caller would: a constant would let XLA
  # fold the call's metadata away)
  def offset_fwd(x, w, gs):
    return ragdot.ragged_dot(x, w, gs, group_offset=off, implementation=impl)

  def masked_fwd(x, w, gs):  # what callers do without group_offset
    return jnp.where(mask, ragdot.ragged_dot(x, padded(w), gs, implementation=impl), 0)

  def local_fwd(x, w, gs):
    return ragdot.ragged_dot(x, w, gs[:local], implementation=impl)

  def loss(f, n_rows=None):  # w.r.t. the local experts' weights (and x[:n_rows])
    step = _value_and_grads(f)
    return lambda x, w, dy, gs: step(x[:n_rows], w[:local], dy[:n_rows], gs)

  tk = _tokamax() if "tokamax" in _wanted(baselines) else None
  if op == "fwd":
    fns = {"ragdot": lambda x, w, dy, gs: offset_fwd(x, w[:local], gs),
           "masked": lambda x, w, dy, gs: masked_fwd(x, w[:local], gs),
           "local-rows": lambda x, w, dy, gs: local_fwd(x[:rows8], w[:local], gs)}
    if tk:
      fns["tokamax-masked"] = lambda x, w, dy, gs: jnp.where(
          mask, tk.ragged_dot(x, padded(w[:local]), gs), 0)
  elif op == "dw":
    fns = {"ragdot": lambda x, w, dy, gs: ragdot.trans_ragged_dot(
               x, dy, gs, group_offset=off, num_groups=local, implementation=impl),
           # every expert's gradient from the masked rows, then the local ones
           "masked": lambda x, w, dy, gs: ragdot.trans_ragged_dot(
               x, jnp.where(mask, dy, 0), gs, implementation=impl)[:local],
           "local-rows": lambda x, w, dy, gs: ragdot.trans_ragged_dot(
               x[:rows8], dy[:rows8], gs[:local], implementation=impl)}
    if tk:
      fns["tokamax-masked"] = lambda x, w, dy, gs: tk.ragged_dot_general(
          x, jnp.where(mask, dy, 0), gs, DN_DW)[:local]
  elif op == "fwdbwd":
    fns = {"ragdot": loss(offset_fwd), "masked": loss(masked_fwd),
           "local-rows": loss(local_fwd, rows8)}
    if tk:
      fns["tokamax-masked"] = loss(
          lambda x, w, gs: jnp.where(mask, tk.ragged_dot(x, padded(w), gs), 0))
  else:
    raise ValueError(f"op must be one of {EP_OPS} for an EP shape, got {op!r}")
  return fns


def minimal_bytes(op: str, shape: Shape, sizes: np.ndarray) -> int:
  """Bytes ``op`` must move at least (bf16): the rows it reads, each non-empty
  expert's weights once (forward, dX), and its output: all m rows (forward,
  dX) or every expert's gradient, an empty expert's zeros too (dW).
  fwdbwd: the sum of the three.

  An EP shape (shard 0) reads only the shard's rows and experts; its forward
  and dX still write all m output rows (zeros outside the shard), its dW only
  the local experts' gradients.
  """
  m, k, n = shape.m, shape.k, shape.n
  local = shape.g // shape.ep if shape.ep > 1 else shape.g
  rows = int(sizes[:local].sum()) if shape.ep > 1 else m
  w = int(np.count_nonzero(sizes[:local])) * k * n * 2
  fwd = rows * k * 2 + w + m * n * 2
  dx = rows * n * 2 + w + m * k * 2
  dw = rows * (k + n) * 2 + local * k * n * 2
  return {"fwd": fwd, "dx": dx, "dw": dw, "fwdbwd": fwd + dx + dw}[op]


def local_rows_shape(shape: Shape, sizes: np.ndarray) -> tuple[Shape, np.ndarray]:
  """The EP baseline "local-rows" as a plain shape and its group sizes: shard
  0's rows (padded to ``local_rows8``) over its experts; its byte floor is this
  shape's, not the shard's (which writes all m rows)."""
  local = shape.g // shape.ep
  plain = dataclasses.replace(shape, name=f"{shape.name} local rows",
                              m=local_rows8(shape, sizes), g=local, ep=1)
  return plain, sizes[:local]


def shape_inputs(shape: Shape, seed: int = 0) -> tuple[np.ndarray, tuple[jax.Array, ...]]:
  """(routed group sizes, (x[m, k], w[g, k, n], dy[m, n], group_sizes)): fresh
  random bf16 inputs of every benchmarked function ``fn(x, w, dy, gs)``."""
  sizes = routed_group_sizes(shape, seed)
  keys = jax.random.split(jax.random.key(seed), 3)
  dtype = jnp.bfloat16
  x = jax.random.normal(keys[0], (shape.m, shape.k), dtype)
  w = (jax.random.normal(keys[1], (shape.g, shape.k, shape.n), jnp.float32) / 32).astype(dtype)
  dy = jax.random.normal(keys[2], (shape.m, shape.n), dtype)
  return sizes, (x, w, dy, jnp.asarray(sizes))


def bench_shape(shape: Shape, ops: list[str], impl: str | None, iterations: int,
                seed: int = 0, impls: list[str] | None = None,
                baselines: bool | Collection[str] = True, watchdog: Watchdog | None = None,
                warmup_s: float = 0.0, sustained_s: float = 0.0,
                rounds: int = 1) -> list[dict[str, Any]]:
  """Rows of one shape: per op, every candidate's time, ratios and compile time.

  Every candidate of an op is compiled first, then timed ``rounds`` times in
  turn (each round in a rotated order): a row's ``ms`` is the median over the
  rounds and its ratios the median of the per-round ratios, so drift of the
  GPU's clocks between candidates lands in all of them alike.  With
  ``rounds`` > 1 a row also carries ``ms_rounds`` and ``vs_dense_rounds``.

  A candidate that fails to compile, or in any round, gets an error row (its
  other rounds are dropped); a failed baseline leaves the ratios to it NaN.

  ``sustained_s`` > 0 times each candidate back to back for that many seconds
  (``timing.sustained_time_ms``: the power-limited clock of a training step)
  instead of CUPTI over a short burst; its rows carry the GPU's mean SM clock
  and power over the timed half (of the last round).
  """
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds}")
  sizes, (x, w, dy, gs) = shape_inputs(shape, seed)
  rows = []
  for op in ([o for o in ops if o in EP_OPS] if shape.ep > 1 else ops):
    if shape.ep > 1:
      fns = _ep_candidates(op, shape, impl, sizes, baselines)
    else:
      fns = _candidates(op, shape, impl, impls, baselines)
    rows_done = int(sizes[: shape.g // shape.ep].sum()) if shape.ep > 1 else shape.m
    flops = 2 * rows_done * shape.k * shape.n * (3 if op == "fwdbwd" else 1)
    min_bytes = minimal_bytes(op, shape, sizes)
    floors = {"local-rows": minimal_bytes(op, *local_rows_shape(shape, sizes))} \
        if shape.ep > 1 else {}
    choice = auto_choice(op, shape) if impl is None and shape.ep == 1 else None
    # A "ragdot:<impl>" row that resolves to the automatic choice's kernels is
    # that row's timing, not a second sample of the same kernel (which would
    # only add run-to-run noise to the auto-choice check).
    same_as_auto = set()
    if choice is not None:
      auto_kernels = resolved_kernels(op, shape, None)
      same_as_auto = {name for name, i in ragdot_names(impls, None).items()
                      if i is not None and name in fns
                      and resolved_kernels(op, shape, i) == auto_kernels}
    timed = [name for name in fns if not (name in same_as_auto and "ragdot" in fns)]
    compiled, errors = {}, {}
    for name in timed:
      # Progress on stderr: a run cut by a time limit shows where it stopped.
      print(f"# {shape.name} {op} {name} (compile)", file=sys.stderr, flush=True)
      with _watched(watchdog, f"{shape.name} {op} {name} (compile)"):
        try:
          start = time.perf_counter()
          exe = jax.jit(fns[name]).lower(x, w, dy, gs).compile()
          compiled[name] = (exe, time.perf_counter() - start, peak_bytes(exe))
        except Exception as e:  # pylint: disable=broad-except
          errors[name] = f"error: {type(e).__name__}: {str(e)[:160]}"
    times: dict[str, list[float]] = {name: [] for name in compiled}
    methods: dict[str, set[str]] = {name: set() for name in compiled}
    power = {}
    order = list(compiled)
    for r in range(rounds if order else 0):
      for name in order[r % len(order):] + order[:r % len(order)]:
        if name in errors:
          continue
        label = f"{shape.name} {op} {name}" + (f" (round {r + 1}/{rounds})" if rounds > 1 else "")
        print(f"# {label}", file=sys.stderr, flush=True)
        with _watched(watchdog, label):
          try:
            exe = compiled[name][0]
            if sustained_s > 0:
              ms, power[name] = sustained_time_ms(exe, x, w, dy, gs, seconds=sustained_s)
              method = sustained_method(sustained_s, power[name])
            else:
              ms, method = device_time_ms(exe, x, w, dy, gs, iterations=iterations,
                                          warmup_s=warmup_s)
            times[name].append(ms)
            if sustained_s > 0:  # (its method names the clock and power: the last round's)
              methods[name].clear()
            methods[name].add(method)
          except Exception as e:  # pylint: disable=broad-except
            errors[name] = f"error: {type(e).__name__}: {str(e)[:160]}"
            power.pop(name, None)
    results = {}
    for name in fns:
      src = "ragdot" if name not in timed else name
      reused = "" if src == name else "; the automatic choice's kernels"
      if src in errors:
        results[name] = ([], errors[src] + reused, None, None)
        continue
      _, compile_s, peak = compiled[src]
      # (one method per row; several if rounds fell back differently, e.g. CUPTI / host)
      results[name] = (times[src], " / ".join(sorted(methods[src])) + reused, peak, compile_s)
      if src != name:
        power[name] = power.get(src, {})
    base = results.get("dense", ([],))[0]
    tok = results.get("tokamax", results.get("tokamax-masked", ([],)))[0]
    for name, (ts, method, peak, compile_s) in results.items():
      ms = _median(ts)
      row = dict(
          shape=shape.name, op=op, impl=name, m=shape.m, k=shape.k, n=shape.n,
          g=shape.g, ms=ms, tflops=flops / (ms * 1e-3) / 1e12 if ms == ms else float("nan"),
          tbps=floors.get(name, min_bytes) / (ms * 1e-3) / 1e12 if ms == ms else float("nan"),
          vs_dense=_median(_ratios(base, ts)), vs_tokamax=_median(_ratios(tok, ts)),
          peak_mib=None if peak is None else peak / 2**20, compile_s=compile_s,
          method=method, routing="skewed" if shape.skewed else "routed")
      if rounds > 1:
        row.update(rounds=rounds, ms_rounds=ts, vs_dense_rounds=_ratios(base, ts))
      if power.get(name):
        row.update({k: power[name][k] for k in ("sm_mhz", "power_w", "power_capped",
                                                "dispatch_ms") if k in power[name]})
      if name == "ragdot" and choice is not None:
        row["choice"] = choice
      elif name.startswith("ragdot:") and op != "fwdbwd" and shape.ep == 1:
        # What a forced backend ran with (its table config or its default), so
        # `ragdot tune --import-bench` can keep the faster one.
        row.update(choice_fields(dispatch_choice(op, shape, name.split(":", 1)[1])))
      rows.append(row)
  return rows


@contextlib.contextmanager
def _watched(watchdog: Watchdog | None, label: str):
  """Arms ``watchdog`` (if any) for the block: a hung compile or kernel ends the run."""
  if watchdog is not None:
    watchdog.arm(label)
  try:
    yield
  finally:
    if watchdog is not None:
      watchdog.disarm()


# Measured fields that are NaN when a call failed: strict JSON has no NaN, so
# they are written as null and read back as NaN.
_FLOAT_FIELDS = ("ms", "tflops", "tbps", "vs_dense", "vs_tokamax", "vs_copy", "ms_rounds",
                 "vs_dense_rounds")


def _json_value(value: Any) -> Any:
  if isinstance(value, float) and value != value:
    return None
  if isinstance(value, (list, tuple)):
    return [_json_value(v) for v in value]
  return value


def row_json(row: dict[str, Any], **kwargs: Any) -> str:
  """One bench row as strict JSON (NaN -> null)."""
  return json.dumps({k: _json_value(v) for k, v in row.items()}, allow_nan=False, **kwargs)


def rows_json(rows: list[dict[str, Any]]) -> str:
  """Bench rows as a strict JSON list (NaN -> null), one row a line."""
  return "[\n" + ",\n".join(row_json(r) for r in rows) + "\n]\n"


def rows_from_json(text: str) -> list[dict[str, Any]]:
  """Bench rows from ``rows_json`` (or older files with bare NaN): null
  measurements become NaN again."""
  data = json.loads(text)
  rows = data.get("rows") if isinstance(data, dict) else data
  if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
    raise ValueError("expected a JSON list of bench rows (objects)")
  nan = float("nan")
  for r in rows:
    for key in _FLOAT_FIELDS:
      if key in r and r[key] is None:
        r[key] = nan
      elif isinstance(r.get(key), list):
        r[key] = [nan if v is None else v for v in r[key]]
  return rows


def _median(ts: list[float]) -> float:
  return float(statistics.median(ts)) if ts else float("nan")


def _ratios(base: list[float], ts: list[float]) -> list[float]:
  """Per round, ``base``'s time over ``ts``'s (empty when either is missing)."""
  if len(base) != len(ts):
    return []
  return [b / t for b, t in zip(base, ts)]


def copy_bandwidth_tbps(iterations: int = 10, gib: float = 1.0) -> float:
  """Measured copy bandwidth, TB/s: ``a + 1`` over ``gib`` GiB of f32 (read + write)."""
  x = jax.random.normal(jax.random.key(7), (int(gib * 2**28),), jnp.float32)
  compiled = jax.jit(lambda a: a + 1.0).lower(x).compile()
  ms, _ = device_time_ms(compiled, x, iterations=iterations)
  return 2 * x.nbytes / (ms * 1e-3) / 1e12


def add_copy_ratio(rows: list[dict[str, Any]], copy_tbps: float) -> None:
  """Adds ``vs_copy``: TB/s of minimal bytes over the measured copy bandwidth."""
  for r in rows:
    r["vs_copy"] = r["tbps"] / copy_tbps
    r["copy_tbps"] = copy_tbps


def auto_check(rows: list[dict[str, Any]], tolerance: float = 0.05) -> list[dict[str, Any]]:
  """Per (shape, op): the automatic choice vs the best ragdot implementation run.

  Compares the "ragdot" row (automatic dispatch) with every "ragdot:<impl>" row
  of the same run; passes when auto <= (1 + tolerance) x the best.
  """
  out = []
  groups: dict[tuple[str, str], dict[str, float]] = {}
  for r in rows:
    if r["impl"] == "ragdot" or r["impl"].startswith("ragdot:"):
      groups.setdefault((r["shape"], r["op"]), {})[r["impl"]] = r["ms"]
  for (shape, op), times in groups.items():
    auto = times.get("ragdot", float("nan"))
    valid = {k: v for k, v in times.items() if v == v}
    if "ragdot" not in valid or len(valid) < 2:
      continue
    best_name = min(valid, key=valid.get)
    ratio = auto / valid[best_name]
    out.append(dict(shape=shape, op=op, auto_ms=auto, best=best_name,
                    best_ms=valid[best_name], ratio=ratio, ok=ratio <= 1 + tolerance))
  return out


def print_auto_check(checks: list[dict[str, Any]], tolerance: float = 0.05) -> bool:
  if not checks:
    print("auto-choice check: nothing to compare (run with more than one --impls)")
    return True
  print(f"auto-choice check (automatic within {tolerance:.0%} of the best ragdot"
        " implementation in this run):")
  for c in checks:
    print(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['shape']:32s} {c['op']:6s} auto"
          f" {c['auto_ms']:.4f} ms  best {c['best']} {c['best_ms']:.4f} ms"
          f"  ratio {c['ratio']:.3f}")
  failed = sum(not c["ok"] for c in checks)
  print(f"auto-choice check: {len(checks) - failed}/{len(checks)} within {tolerance:.0%}")
  return failed == 0


def ep_summary(rows: list[dict[str, Any]]) -> list[str]:
  """One line per EP (shape, op): the group_offset call's time against the
  plain call over the local rows and against the masked workaround."""
  times: dict[tuple[str, str], dict[str, float]] = {}
  per_round: dict[tuple[str, str], dict[str, list[float]]] = {}
  for r in rows:
    key = (r["shape"], r["op"])
    times.setdefault(key, {})[r["impl"]] = r["ms"]
    per_round.setdefault(key, {})[r["impl"]] = r.get("ms_rounds") or []
  out = []
  for (shape, op), t in times.items():
    if not {"ragdot", "masked", "local-rows"} <= set(t):
      continue
    rounds = per_round[(shape, op)]
    # (with several rounds: the median of the per-round ratios, and their range)
    per = _ratios(rounds["ragdot"], rounds["local-rows"])  # ragdot / local rows
    vs_local = _median(per) if len(per) > 1 else t["ragdot"] / t["local-rows"]
    spread = f" ({min(per):.2f}-{max(per):.2f} over {len(per)} rounds)" if len(per) > 1 else ""
    masked = _ratios(rounds["masked"], rounds["ragdot"])  # masked / ragdot
    vs_masked = _median(masked) if len(masked) > 1 else t["masked"] / t["ragdot"]
    out.append(f"  {shape} {op}: group_offset {t['ragdot']:.4f} ms = "
               f"{vs_local:.2f}x the local rows' call{spread}, "
               f"{vs_masked:.1f}x faster than the masked workaround")
  return out


def compile_summary(rows: list[dict[str, Any]]) -> str | None:
  """The slowest compile of a ragdot call among ``rows`` (lower + compile,
  wall clock, every kernel of the call), or None when no row has one."""
  timed = [r for r in rows if r["impl"].startswith("ragdot") and r.get("compile_s") is not None]
  if not timed:
    return None
  worst = max(timed, key=lambda r: r["compile_s"])
  return (f"compile: slowest ragdot call {worst['compile_s']:.1f} s ({worst['shape']} "
          f"{worst['op']} {worst['impl']}), over {len(timed)} timed rows")


def print_table(rows: list[dict[str, Any]], title: str = "ragdot bench") -> None:
  try:
    from rich.console import Console  # pylint: disable=g-import-not-at-top
    from rich.table import Table  # pylint: disable=g-import-not-at-top
  except ImportError:
    for r in rows:
      print(r)
    return
  table = Table(title=title)
  for col in ("shape", "op", "impl", "ms", "TFLOP/s", "TB/s", "x copy", "x dense",
              "x tokamax", "peak MiB", "compile s", "note"):
    table.add_column(col)
  for r in rows:
    note = "" if r["method"] in ("cupti", "host") else r["method"]
    peak, compile_s = r.get("peak_mib"), r.get("compile_s")
    table.add_row(r["shape"], r["op"], r["impl"], f"{r['ms']:.4f}", f"{r['tflops']:.1f}",
                  f"{r['tbps']:.2f}", f"{r.get('vs_copy', float('nan')):.2f}",
                  _ratio_text(r), f"{r['vs_tokamax']:.2f}",
                  "" if peak is None else f"{peak:.1f}",
                  "" if compile_s is None else f"{compile_s:.1f}", note[:60])
  Console(width=200).print(table)


def _ratio_text(row: dict[str, Any]) -> str:
  """x dense: the median, and with several rounds their range."""
  text = f"{row['vs_dense']:.2f}"
  if len(row.get("vs_dense_rounds") or ()) > 1:
    text += f" ({min(row['vs_dense_rounds']):.2f}-{max(row['vs_dense_rounds']):.2f})"
  return text


def plot(rows: list[dict[str, Any]], path: str) -> None:
  """Bar chart of TFLOP/s per (shape, op) and implementation (matplotlib)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  keys = list(dict.fromkeys((r["shape"], r["op"]) for r in rows))
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  table = {(r["shape"], r["op"], r["impl"]): r["tflops"] for r in rows}
  fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(keys)), 4.5))
  width = 0.8 / len(impls)
  for i, impl in enumerate(impls):
    vals = [table.get((s, o, impl), float("nan")) for s, o in keys]
    ax.bar([x + i * width for x in range(len(keys))], vals, width, label=impl)
  ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))])
  ax.set_xticklabels([f"{s}\n{o}" for s, o in keys], rotation=60, ha="right", fontsize=7)
  ax.set_ylabel("TFLOP/s")
  ax.legend(fontsize=8)
  ax.set_title("ragdot vs dense / tokamax / lax (bf16)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--preset", nargs="+", default=[], choices=sorted(PRESETS))
  parser.add_argument("--shape", action="append", default=[], type=parse_shape,
                      help="m,k,n,g[,top_k] (repeatable)")
  parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                      help="of the presets' and --shape's shapes, time only these (e.g."
                           " 'deepseek-v3 down'; a --shape is named m,k,n,g,top_k)")
  parser.add_argument("--ops", nargs="+", default=["fwd", "dx", "dw", "fwdbwd"],
                      choices=["fwd", "dx", "dw", "fwdbwd"])
  parser.add_argument("--implementation", default=None, choices=IMPLEMENTATIONS,
                      help="run ragdot with this implementation only (no auto check)")
  parser.add_argument("--impls", nargs="+", default=None, choices=IMPLEMENTATIONS,
                      help="ragdot implementations timed next to the automatic choice"
                           " (default: mosaic triton on a GPU, xla on CPU)")
  parser.add_argument("--no-baselines", action="store_true",
                      help="skip dense / lax / tokamax")
  parser.add_argument("--baselines", nargs="+", default=list(BASELINES), choices=BASELINES,
                      help="which baselines to time (e.g. only dense, where tokamax's"
                           " allocation retries take minutes)")
  parser.add_argument("--iterations", type=argtypes.positive_int, default=20)
  parser.add_argument("--rounds", type=argtypes.positive_int, default=1,
                      help="time every candidate of an op this many times in turn (rotated"
                           " order) and report medians: ratios per round, so clock drift"
                           " between candidates lands in all of them alike")
  parser.add_argument("--warmup-ms", type=argtypes.nonnegative_float, default=1e3 * SETTLE_S,
                      help="each row's calls before its timed ones, in milliseconds of"
                           " wall clock (at least 2 calls): the GPU's clocks settle")
  parser.add_argument("--sustained-s", type=argtypes.nonnegative_float, default=0.0,
                      help="time each row back to back for this many seconds (wall clock"
                           " over the second half) instead of CUPTI over a short burst: the"
                           " power-limited clock of a training step (docs/performance.md v21)")
  parser.add_argument("--json", default=None, help="write rows to this file")
  parser.add_argument("--plot", default=None, help="write a PNG bar chart here")
  parser.add_argument("--from-json", default=None, help="re-plot/print saved rows")
  parser.add_argument("--hang-s", type=argtypes.nonnegative_float, default=180.0,
                      help="a candidate still compiling or running after this many seconds"
                           " (a hung kernel) ends the run with exit status 3, after writing"
                           " the rows so far to --json; 0: no watchdog")


def _usage_error(message: str) -> int:
  print(f"ragdot bench: error: {message}", file=sys.stderr)
  return 2


def run(args: argparse.Namespace) -> int:
  if args.from_json:
    try:
      with open(args.from_json) as f:
        rows = rows_from_json(f.read())
    except (OSError, ValueError) as e:
      return _usage_error(f"--from-json: {e}")
    print_table(rows)
    if lines := ep_summary(rows):
      print("expert-parallel shard (shard 0):", *lines, sep="\n")
    print_auto_check(auto_check(rows))
    if args.plot:
      plot(rows, args.plot)
    return 0
  if error := argtypes.hang_limit_error(args.hang_s, args.sustained_s):
    return _usage_error(error)
  try:  # (read when a timing needs it: a bad value fails here, not in every row)
    output_budget_bytes()
  except ValueError as e:
    return _usage_error(str(e))
  impls = args.impls
  if impls is None:
    impls = ["mosaic", "triton"] if jax.default_backend() == "gpu" else ["xla"]
  try:
    shapes = select_shapes(preset_shapes(args.preset or ([] if args.shape else ["small"]))
                           + list(args.shape), args.only)
  except ValueError as e:
    return _usage_error(f"--preset / --shape / --only: {e}")
  if args.json:
    try:  # before any timing: a bad path fails now, not after the first shape
      with open(args.json, "w") as f:
        json.dump([], f)
    except OSError as e:
      return _usage_error(f"--json: {e}")
  print(f"devices: {jax.devices()}  tokamax: {'yes' if _tokamax() else 'no'}", flush=True)
  copy_tbps = None
  baselines = () if args.no_baselines else tuple(args.baselines)
  if jax.default_backend() == "gpu" and baselines:
    copy_tbps = copy_bandwidth_tbps(args.iterations)
    print(f"copy bandwidth (1 GiB f32 a + 1, read + write): {copy_tbps:.2f} TB/s", flush=True)
  rows = []

  def save(_label=None):
    if args.json:
      with open(args.json, "w") as f:
        f.write(rows_json(rows))

  watchdog = Watchdog(args.hang_s, "ragdot bench", on_hang=save) if args.hang_s > 0 else None
  for shape in shapes:
    shape_rows = bench_shape(shape, args.ops, args.implementation, args.iterations,
                             impls=impls, baselines=baselines,
                             watchdog=watchdog, warmup_s=args.warmup_ms / 1e3,
                             sustained_s=args.sustained_s, rounds=args.rounds)
    if copy_tbps:
      add_copy_ratio(shape_rows, copy_tbps)
    for r in shape_rows:
      print(row_json(r), flush=True)
    rows.extend(shape_rows)
    save()  # after every shape: a run cut short keeps what it measured
  if args.plot:
    plot(rows, args.plot)
  print_table(rows)
  if lines := ep_summary(rows):
    print("expert-parallel shard (shard 0):", *lines, sep="\n")
  if line := compile_summary(rows):
    print(line)
  if args.implementation is None:
    print_auto_check(auto_check(rows))
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  add_arguments(parser)
  return run(parser.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
