"""``ragdot tune``: measure kernel configs on this GPU and write the tuning table.

For each shape (a forward projection ``m, k, n, g``) and op:

* ``fwd``: ``gmm``  x[m, k] @ w[g, k, n];
* ``dx``:  ``gmm_t`` dy[m, n] @ w[g, k, n]^T (the call has k and n swapped);
* ``dw``:  ``tgmm``  x[m, k]^T dy[m, n] per group,

and for fp8 operands (``--dtype float8_e4m3fn``; e5m2 shares its entries) the
``fwd`` op only, as the native Mosaic kernel runs it: ``gmm_t`` x[m, k] @
w[g, n, k]^T (a [g, k, n] rhs is copied to that layout first); candidates are
the Mosaic sweep for 1-byte operands,

the candidates are the kernels' ``gpu_sweep_configs`` plus the xla backend.
They are compiled in parallel threads, checked against the xla backend in f32
(relative max error), and timed with ``ragdot.timing.device_time_ms`` (median
of ``--repeats`` medians) on group sizes from top-k routing of random logits.
The candidates within ``--skew-slack`` (2%) of the fastest are timed again on
a skewed routing (a few hot experts, many near-empty ones: ``bench``'s skewed
layout) and the fastest of them there wins: the table is keyed by shape, not by
how the tokens are routed, and a config that is marginally best on balanced
groups can be much slower on skewed ones (docs/performance.md v26d-e).
The winner is merged into the device's table (one entry per
shape bucket; see ``ragdot.tables``) after every op, so an interrupted run
resumes: entries already measured are skipped unless ``--force``.  Each (op,
shape) gets at most ``--budget-s`` seconds (default 60); an entry cut short is
marked ``"complete": false`` and is redone next time.  A candidate whose run
takes longer than ``--hang-s`` (a kernel that deadlocks on the hardware) ends
the process with exit status 3 after naming it (and logging it with ``--log``):
the entries merged so far are already saved, and a calling script's later
stages still run.  A candidate that faults the device (an illegal address: the
CUDA context is lost, so every later run would fail or mislead) ends it the
same way with exit status 4; that task's entry is not written.

Without a GPU only ``--dry-run`` (list candidates and table keys) works.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import datetime
import functools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ragdot import argtypes
from ragdot import tables
from ragdot import validate
from ragdot.dispatch import backend_call
from ragdot.watchdog import Watchdog

OPS = ("fwd", "dx", "dw")
REL_TOL = 2e-2


@dataclasses.dataclass(frozen=True)
class Task:
  """One (op, call shape) to tune."""

  op: str  # fwd, dx, dw
  name: str
  m: int
  k: int  # of the backend call (dx: the forward's n)
  n: int
  g: int
  top_k: int = 8
  rhs_nk: bool = False  # fwd with rhs [g, n, k] (fp8 operands; W8A16 weights so laid out)
  weights: str | None = None  # W8A16: the fp8 weights' dtype beside 16-bit rows

  @property
  def transpose_rhs(self) -> bool:
    """The backend call reads rhs [g, n, k]."""
    return self.op == "dx" or self.rhs_nk

  @property
  def table_op(self) -> str:
    return "tgmm" if self.op == "dw" else ("gmm_t" if self.transpose_rhs else "gmm")


FP8_OPS = ("fwd",)
WEIGHT_ONLY_OPS = ("fwd", "dx")  # W8A16: the forward in both weight layouts, and dX


def dtype_key(dtype, weights: str | None) -> str:
  """The table dtype a task's entry goes under (W8A16: ``rows+weights``)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot import dispatch  # pylint: disable=g-import-not-at-top
  return dispatch.weight_only_dtype(dtype, weights) if weights else jnp.dtype(dtype).name


def out_dtype_of(dtype):
  """The tuned calls' output dtype: the operands', bf16 for fp8 ones (as fp8
  inference calls ask with ``preferred_element_type``)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return jnp.dtype(jnp.bfloat16) if validate.is_fp8(dtype) else jnp.dtype(dtype)


def tasks_for(shapes, ops, dtype=None, weights=None) -> list[Task]:
  """One task per (shape, op), with the k and n the backend call sees (fp8:
  the forward on rhs [g, n, k], the layout 8-bit wgmma reads; W8A16
  (``weights``, fp8 beside 16-bit rows): the forward in both weight layouts,
  and dX)."""
  fp8 = dtype is not None and validate.is_fp8(dtype)
  if fp8 and set(ops) - set(FP8_OPS):
    raise ValueError(f"ops: fp8 operands are tuned for {FP8_OPS} only (the backward runs on"
                     f" bf16 copies), got {list(ops)}")
  if weights is not None:
    if fp8 or not validate.weight_only(dtype, weights):
      raise ValueError(f"weights: fp8 weights beside bf16 / f16 rows, got {weights} beside"
                       f" {dtype}")
    if set(ops) - set(WEIGHT_ONLY_OPS):
      raise ValueError(f"ops: W8A16 is tuned for {WEIGHT_ONLY_OPS} (dW takes no fp8 weights),"
                       f" got {list(ops)}")
  out = []
  for s in shapes:
    for op in ops:
      call = backend_call(op, s.k, s.n)
      task = Task(op, s.name, s.m, call.k, call.n, s.g, min(s.top_k, s.g), fp8, weights)
      out.append(task)
      if weights is not None and op == "fwd":  # the forward on weights laid out [g, n, k]
        out.append(dataclasses.replace(task, rhs_nk=True))
  return out


def config_fields(config: Any) -> dict[str, Any]:
  """A Config dataclass as table fields (None-valued fields dropped)."""
  return {k: v for k, v in dataclasses.asdict(config).items() if v is not None}


def candidates(task: Task, dtype, incumbent: tuple[str, Any] | None = None
               ) -> list[tuple[str, Any]]:
  """(backend, Config) pairs to try: the Mosaic default first, then the first
  four Triton configs, ``incumbent`` (the config the dispatcher runs for the call
  today: ``incumbent_choice``; for a Mosaic dW, also it with ``group_interleave=2``),
  the Mosaic sweep, and (for small problems) the xla backend."""
  from ragdot.backends import mosaic_dw, mosaic_fwd, triton, xla  # pylint: disable=g-import-not-at-top

  if task.weights is not None:
    return weight_only_candidates(task, dtype, incumbent)
  if task.op == "dw":
    cfgs = [mosaic_dw.default_config(task.m, task.k, task.n, task.g, dtype, dtype)]
    cfgs += mosaic_dw.gpu_sweep_configs(task.m, task.k, task.n, task.g, dtype, dtype)
  else:
    tr = task.transpose_rhs
    out = out_dtype_of(dtype)
    cfgs = [mosaic_fwd.default_config(task.m, task.k, task.n, task.g, dtype, tr, out)]
    cfgs += mosaic_fwd.gpu_sweep_configs(task.m, task.k, task.n, task.g, tr, dtype, out)
  fp8 = validate.is_fp8(dtype)  # (the other backends run it on bf16 copies)
  if fp8 and incumbent is not None and incumbent[0] != "mosaic":
    incumbent = None
  tcfgs = [] if fp8 else [("triton", c) for c in triton.gpu_sweep_configs(
      task.table_op, task.m, task.k, task.n, task.g, dtype)[:4]]
  # Both defaults first, so a shape cut short by its time budget still compares
  # them; then the few Triton configs (each compiles in well under a second, a
  # Mosaic one in 2-5 s): a 25 s budget spent on the Mosaic sweep never reached
  # them, and on the decode dX calls they hold the winner (docs/performance.md 28g).
  out = [("mosaic", cfgs[0])] + tcfgs
  # What runs today (a borrowed or fitted entry the sweep may not hold): the pick is
  # then at most the skew slack slower than it on routed sizes, and only where it is
  # faster on skewed ones (docs/performance.md v42b-c).
  if incumbent is not None and incumbent[1] is not None and incumbent not in out:
    out.append(incumbent)
  # dW: what runs today with its items dealt two groups at a time (Qwen3-30B down:
  # 0.962-0.966x; gate_up 1.02x, DeepSeek-V3 down 1.06x; H100, docs/performance.md v68).
  if (task.op == "dw" and incumbent is not None and incumbent[0] == "mosaic"
      and isinstance(incumbent[1], mosaic_dw.MosaicDwConfig)
      and incumbent[1].group_interleave == 1):
    out.append(("mosaic", dataclasses.replace(incumbent[1], group_interleave=2)))
  for c in cfgs[1:]:
    if c is not None and ("mosaic", c) not in out:
      out.append(("mosaic", c))
  if task.m * task.k * task.n <= 2**33 and not fp8:  # the xla fallback loops tiles
    out.append(("xla", xla.default_config(task.m, task.g)))
  return out


def weight_only_candidates(task: Task, dtype, incumbent: tuple[str, Any] | None = None
                           ) -> list[tuple[str, Any]]:
  """W8A16 candidates: the Mosaic swap kernel's config the dispatcher runs
  today (or its own), then its variants: tiles of half and twice the rows, 4, 6
  and 8 stages, k steps of 64 and 128 columns, the widened slices in registers
  ([g, n, k] only) or one or two SMEM buffers, each as ``weight_only_config``
  fits it; then the first four Triton configs (weights widened after each
  load)."""
  import itertools  # pylint: disable=g-import-not-at-top
  from ragdot.backends import mosaic_fwd, triton  # pylint: disable=g-import-not-at-top

  tr = task.transpose_rhs
  fit = lambda c: mosaic_fwd.weight_only_config(c, task.m, task.g, task.k, tr)
  base = (incumbent[1] if incumbent is not None and incumbent[0] == "mosaic"
          else fit(None))
  out = [("mosaic", base)]
  if incumbent is not None and incumbent[0] == "triton":
    out.append(incumbent)
  rows = sorted({r for r in (base.swap_rows // 2, base.swap_rows, base.swap_rows * 2)
                 if mosaic_fwd.MIN_SWAP_ROWS <= r <= 256 and r % 16 == 0})
  stagings = (0, 1, 2) if tr else (1, 2)
  for r, stages, block_k, staging in itertools.product(rows, (4, 6, 8), (64, 128), stagings):
    try:
      c = fit(dataclasses.replace(base, swap_rows=r, num_stages=stages, block_k=block_k,
                                  widen_staging=staging,
                                  tail_rows=base.tail_rows if r == base.swap_rows else 0,
                                  short_tile_rows=0 if r != base.swap_rows
                                  else base.short_tile_rows))
    except ValueError:  # (a field combination the config refuses)
      continue
    if ("mosaic", c) not in out:
      out.append(("mosaic", c))
  for c in triton.gpu_sweep_configs(task.table_op, task.m, task.k, task.n, task.g, dtype)[:4]:
    if ("triton", c) not in out:
      out.append(("triton", c))
  return out


def incumbent_choice(task: Task, dtype, device) -> tuple[str, Any] | None:
  """(backend, config) the dispatcher picks for ``task``'s call on ``device``
  with the installed tables (a kernel backend with a config; else None)."""
  from ragdot import dispatch  # pylint: disable=g-import-not-at-top

  # task.k / task.n are the backend call's already (dX: the forward's n and k).
  c = dispatch.choose("tgmm" if task.op == "dw" else "gmm", None, dtype=dtype,
                      out_dtype=out_dtype_of(dtype), m=task.m, k=task.k, n=task.n, g=task.g,
                      num_groups=task.g, transpose_rhs=task.transpose_rhs, device=device,
                      rhs_dtype=task.weights)
  if c.implementation not in ("mosaic", "triton") or c.config is None:
    return None
  return c.implementation, c.config


def _group_sizes(task: Task, skewed: bool = False, seed: int = 0):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot.bench import Shape, routed_group_sizes  # pylint: disable=g-import-not-at-top

  shape = Shape(task.name, task.m, task.k, task.n, task.g, task.top_k, skewed=skewed)
  return jnp.asarray(routed_group_sizes(shape, seed))


def near_best(rows: list[dict[str, Any]], slack: float) -> list[dict[str, Any]]:
  """The timed rows (each with ``ms``) within ``slack`` of the fastest."""
  fastest = min(r["ms"] for r in rows)
  return [r for r in rows if r["ms"] <= fastest * (1 + slack)]


def pick(rows: list[dict[str, Any]], slack: float) -> dict[str, Any]:
  """The winner among timed rows (each with ``ms``; those re-timed on skewed
  sizes also with ``skewed_ms``): the fastest on skewed sizes among the rows
  within ``slack`` of the fastest ``ms``, or the fastest ``ms`` when none of
  them has a skewed time."""
  near = [r for r in near_best(rows, slack) if "skewed_ms" in r]
  return (min(near, key=lambda r: r["skewed_ms"]) if near
          else min(rows, key=lambda r: r["ms"]))


def _inputs(task: Task, dtype, seed: int = 0):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  sizes = _group_sizes(task, seed=seed)
  keys = jax.random.split(jax.random.key(seed), 2)
  if validate.is_fp8(dtype):  # (no fp8 sampler)
    lhs = jax.random.normal(keys[0], (task.m, task.k)).astype(dtype)
  else:
    lhs = jax.random.normal(keys[0], (task.m, task.k), dtype)
  if task.op == "dw":
    rhs = jax.random.normal(keys[1], (task.m, task.n), dtype)
  else:
    shape = (task.g, task.n, task.k) if task.transpose_rhs else (task.g, task.k, task.n)
    # (W8A16: unit-scale fp8 weights, well inside e4m3's normal range)
    scale, wdtype = (1.0, task.weights) if task.weights else (1 / 32, dtype)
    rhs = (jax.random.normal(keys[1], shape, jnp.float32) * scale).astype(wdtype)
  return lhs, rhs, sizes


def _fn(task: Task, backend: str, config: Any, out_dtype):
  import jax  # pylint: disable=g-import-not-at-top
  from ragdot.backends import get_backend  # pylint: disable=g-import-not-at-top

  mod = get_backend(backend)
  common = dict(out_dtype=out_dtype, precision=None, interpret=False, config=config)
  if task.op == "dw":
    f = functools.partial(mod.tgmm, num_groups=task.g, **common)
  else:
    f = functools.partial(mod.gmm, transpose_rhs=task.transpose_rhs, **common)
  return jax.jit(lambda a, b, gs: f(a, b, gs, None))


def _reference(task: Task, lhs, rhs, sizes):
  """The xla backend's f32 result (fp8 operands: on their exact bf16 copies;
  fp8 weights: on copies in the rows' dtype)."""
  if validate.is_fp8(lhs.dtype):
    lhs, rhs = lhs.astype(validate.widened(lhs.dtype)), rhs.astype(validate.widened(rhs.dtype))
  elif rhs.dtype != lhs.dtype:
    rhs = rhs.astype(lhs.dtype)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return _fn(task, "xla", None, jnp.float32)(lhs, rhs, sizes)


def _rel_err(out, ref) -> float:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


def _new_table(device_kind: str) -> tables.Table:
  """An empty table for ``device_kind`` with the defaults of the table it uses
  today, inheriting that table's entries (unless it is the unknown GPUs' default).
  One of that table's own name (it will shadow it) also serves the kinds it did."""
  base, _ = tables.table_for(device_kind)
  shadows = base.name == tables.slug(device_kind)
  data = {
      "format": tables.FORMAT,
      "device_kind": device_kind,
      # The entries this kind borrowed stay in reach (under the ones measured here).
      **({"inherits": base.name} if base.name != tables.DEFAULT_TABLE else {}),
      **({"compute_capability": base.data["compute_capability"]}
         if "compute_capability" in base.data else {}),
      **{field: dict(base.data[field]) for field in ("also_for", "also_for_compute_capability")
         if shadows and field in base.data},
      "dtype_aliases": dict(base.data.get("dtype_aliases", {})),
      "max_distance": base.data.get("max_distance", tables.DEFAULT_MAX_DISTANCE),
      "defaults": json.loads(json.dumps(base.data.get("defaults", {}))),
      "entries": {},
  }
  return tables.Table(name=tables.slug(device_kind), data=data)


def open_table(path: Path, device_kind: str) -> tables.Table:
  if path.exists():
    return tables.load_file(path)
  t = _new_table(device_kind)
  t.path = path
  return t


def default_table_path(device_kind: str) -> Path:
  """Where ``ragdot tune`` writes without ``--table``: with ``RAGDOT_TABLE_DIR``
  set, this device kind's table there (a new one inherits the table the kind
  uses today); else its shipped table (created if missing), as a developer
  tuning the package's own tables wants."""
  user = os.environ.get(tables.ENV_DIR)
  here = Path(user) if user else tables.TABLE_DIR
  for t in tables.all_tables():
    if (t.device_kind.lower() == device_kind.lower() and t.path is not None
        and t.path.parent.resolve() == here.resolve()):
      return t.path
  return here / tables.slug(device_kind)


def _done(table: tables.Table, task: Task, dtype_name: str) -> str | None:
  """Why ``task``'s bucket is skipped without ``--force`` (None: it is tuned).

  A measured, complete entry is skipped.  One without a config (an older
  bench's backend choice, run with that backend's default config) says so:
  its config was never swept (docs/performance.md v39d)."""
  entry = table.entries.get(tables.key(task.table_op, table.canonical_dtype(dtype_name),
                                       task.m, task.k, task.n, task.g))
  if not (entry and entry.get("measured") and entry.get("complete", True)):
    return None
  if entry.get("config") is None and entry.get("backend") != "xla":
    return (f"already measured as a backend choice ({entry.get('backend')}, its default"
            " config); --force sweeps its configs")
  return "already measured"


# Sticky CUDA errors: after one, every later call in the process fails.
_FAULTS = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
           "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_ILLEGAL_INSTRUCTION")


class DeviceFault(RuntimeError):
  """A candidate left the GPU's context unusable (``_FAULTS``)."""


def _check_fault(error: Exception, label: dict[str, Any]) -> None:
  """Raises DeviceFault naming ``label`` if ``error`` is a sticky CUDA error."""
  if any(f in str(error) for f in _FAULTS):
    raise DeviceFault(f"{label}: {str(error)[:300]}") from error


def tune_task(task: Task, dtype, deadline: float, *, iterations: int, repeats: int,
              jobs: int, progress=None, log=None,
              watchdog: Watchdog | None = None,
              sustained_s: float = 0.0, skew_slack: float = 0.02,
              incumbent: tuple[str, Any] | None = None) -> dict[str, Any] | None:
  """Measures every candidate of ``task`` until ``deadline``; the best as an entry.

  The candidates within ``skew_slack`` of the fastest (and correct there too)
  are timed again on skewed group sizes; the fastest there wins (``pick``).
  ``skew_slack`` < 0 skips that step (the fastest on routed sizes wins).

  ``sustained_s`` > 0 times each candidate back to back for that many seconds
  (``timing.sustained_time_ms``, the power-limited clock of a training step)
  instead of CUPTI bursts; ``repeats`` windows, median.

  ``log``, when given, is called with one dict per candidate tried (backend,
  config, ms or error, rel_err): the A/B record behind the table entry.
  ``watchdog``, when given, is armed while each candidate runs on the device.
  ``incumbent``: the call's config today, tried among the candidates.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot.timing import device_time_ms, sustained_method, sustained_time_ms  # pylint: disable=g-import-not-at-top

  def time_one(compiled, sizes):
    if sustained_s > 0:
      ms, power = sustained_time_ms(compiled, lhs, rhs, sizes, seconds=sustained_s)
      return ms, sustained_method(sustained_s, power)
    return device_time_ms(compiled, lhs, rhs, sizes, iterations=iterations)

  def timed_ms(compiled, sizes, label):
    times = []
    for _ in range(repeats):
      if watchdog is not None:  # each timing gets the full limit (sustained windows)
        watchdog.arm(label)
      times.append(time_one(compiled, sizes))
    return statistics.median(t for t, _ in times), times[0][1]

  lhs, rhs, gs = _inputs(task, dtype)
  ref = _reference(task, lhs, rhs, gs)
  cands = candidates(task, dtype, incumbent)
  bar = progress.add_task(f"{task.op:3s} {task.name}", total=len(cands)) if progress else None

  def compile_one(c):
    backend, config = c
    return _fn(task, backend, config, out_dtype_of(dtype)).lower(lhs, rhs, gs).compile()

  results, complete, compiled_of = [], True, {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
    futures = [pool.submit(compile_one, c) for c in cands]
    for (backend, config), fut in zip(cands, futures):
      row, fault = dict(backend=backend, config=config_fields(config)), None
      if time.time() > deadline:
        complete = False
        fut.cancel()
        if bar is not None:
          progress.advance(bar)
        continue
      try:
        compiled = fut.result()
        if watchdog is not None:
          watchdog.arm(dict(op=task.op, shape=task.name, **row))
        out = jax.block_until_ready(compiled(lhs, rhs, gs))
        row["rel_err"] = _rel_err(out, ref)
        if row["rel_err"] < REL_TOL:
          row["ms"], row["method"] = timed_ms(compiled, gs, dict(op=task.op, shape=task.name,
                                                                 **row))
          compiled_of[id(row)] = compiled
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        fault = e
      finally:
        if watchdog is not None:
          watchdog.disarm()
      results.append(row)
      if log is not None:
        log(dict(op=task.op, shape=task.name, call=[task.m, task.k, task.n, task.g], **row))
      if fault is not None:
        try:
          _check_fault(fault, dict(op=task.op, shape=task.name, **row))
        except DeviceFault:
          for f in futures:  # (the pending compiles; running ones finish)
            f.cancel()
          raise
      if bar is not None:
        progress.advance(bar)
  timed = [r for r in results if "ms" in r]
  if not timed:
    return None
  near = near_best(timed, skew_slack)
  if skew_slack >= 0 and time.time() > deadline:
    complete = False  # the skewed check did not run: redo this entry next time
  elif skew_slack >= 0:
    skewed_gs = _group_sizes(task, skewed=True)
    skewed_ref = _reference(task, lhs, rhs, skewed_gs)
    for row in near:
      label, fault = dict(op=task.op, shape=task.name, routing="skewed", **row), None
      try:
        compiled = compiled_of[id(row)]
        if watchdog is not None:
          watchdog.arm(label)
        err = _rel_err(jax.block_until_ready(compiled(lhs, rhs, skewed_gs)), skewed_ref)
        if err < REL_TOL:
          row["skewed_ms"], _ = timed_ms(compiled, skewed_gs, label)
        else:
          row["skewed_error"] = f"rel_err {err:.3g} on skewed sizes"
      except Exception as e:  # pylint: disable=broad-except
        row["skewed_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        fault = e
      finally:
        if watchdog is not None:
          watchdog.disarm()
      if log is not None:
        log(dict(op=task.op, shape=task.name, call=[task.m, task.k, task.n, task.g],
                 routing="skewed", **row))
      if fault is not None:
        _check_fault(fault, label)
  # A candidate wrong on skewed sizes is out, however fast on routed ones.
  timed = [r for r in timed if "skewed_error" not in r]
  if not timed:
    return None
  best = pick(timed, max(skew_slack, 0.0))
  default = next((r for r in results if r["backend"] == "mosaic"), None)
  flops = 2 * task.m * task.k * task.n
  return {
      "backend": best["backend"],
      "config": best["config"],
      "measured": True,
      "complete": complete,
      "shape": [task.m, task.k, task.n, task.g],
      "ms": round(best["ms"], 5),
      "tflops": round(flops / best["ms"] / 1e9, 1),
      "rel_err": best["rel_err"],
      "default_ms": round(default["ms"], 5) if default and "ms" in default else None,
      "candidates": len(cands),
      "timed": len(timed),
      "method": best["method"],
      "skewed_ms": round(best["skewed_ms"], 5) if "skewed_ms" in best else None,
      "source": (f"ragdot tune {datetime.date.today().isoformat()}, jax {jax.__version__},"
                 f" {task.name} {task.op}, top-{task.top_k} routed sizes"
                 + (f"; the fastest on skewed sizes of the {len(near)} within"
                    f" {skew_slack:.0%} of the best" if "skewed_ms" in best else "")),
  }


# --- import of a config-sweep JSONL (docs/data/sweep_h200_v1.jsonl) -----------------------------------------

_SWEEP_SHAPES = {
    "qwen3-30b gate_up": (32768, 2048, 1536, 128),
    "qwen3-30b down": (32768, 768, 2048, 128),
}


def parse_config_repr(text: str) -> tuple[str, dict[str, Any]]:
  """'MosaicFwdConfig(block_m=64, ..., num_sms=None)' -> (class name, fields)."""
  m = re.fullmatch(r"(\w+)\((.*)\)", text.strip())
  if not m:
    raise ValueError(f"not a config repr: {text!r}")
  fields = {}
  for part in filter(None, (p.strip() for p in m.group(2).split(","))):
    name, value = part.split("=")
    value = ast.literal_eval(value)
    if value is not None:
      if not isinstance(value, (bool, int)):
        raise ValueError(f"{text!r}: {name} is not an integer or a bool")
      fields[name] = value
  return m.group(1), fields


def import_sweep(path: str, table: tables.Table, shapes=None, dtype: str = "bfloat16") -> int:
  """Merges the best rows of a config-sweep JSONL file (one JSON row per config)."""
  shapes = shapes or _SWEEP_SHAPES
  best: dict[str, dict[str, Any]] = {}
  for line in Path(path).read_text().splitlines():
    if not line.startswith("{"):
      continue
    row = json.loads(line)
    if ("tflops" not in row or row.get("rel_err", 1) >= REL_TOL or row["shape"] not in shapes
        or row.get("op") not in OPS):
      continue
    m, fk, fn, g = shapes[row["shape"]]
    call = backend_call(row["op"], fk, fn)
    k, n, top = call.k, call.n, call.table_op
    _, fields = parse_config_repr(row["config"])
    k_ = tables.key(top, dtype, m, k, n, g)
    if k_ not in best or row["tflops"] > best[k_]["tflops"]:
      best[k_] = dict(op=top, shape=(m, k, n, g), tflops=row["tflops"], entry={
          "backend": "mosaic", "config": fields, "measured": True,
          "shape": [m, k, n, g], "ms": round(row["ms"], 5),
          "tflops": round(row["tflops"], 1), "rel_err": row["rel_err"],
          "method": row.get("method"),
          "source": f"{Path(path).name}: best of the sweep for {row['shape']} {row['op']}"})
  for b in best.values():
    table.put(b["op"], dtype, *b["shape"], b["entry"])
  return len(best)


# --- import of a bench run's backend comparison -------------------------------------------

def import_bench(path: str, table: tables.Table, device_kind: str, margin: float = 0.03,
                 dtype: str = "bfloat16") -> list[str]:
  """Merges a ``ragdot bench --json`` run's backend comparison into ``table``.

  For each (shape, op) with rows for forced backends (``ragdot:mosaic``,
  ``ragdot:triton``, each recording the ``backend`` and ``config`` it ran), the
  fastest becomes a measured entry for that exact shape when it beat the
  automatic choice of that run by more than ``margin`` (or the automatic
  choice failed).  This is one run's timing of the configs the table and
  defaults already name, not a tune: it fixes shapes that inherited a nearby
  bucket's backend.  Rows of skewed routings are skipped (they share their
  shape's table key but not its group sizes; files from before the bench
  recorded ``routing`` are told by the shape's name).  Forced rows from before
  the bench recorded their ``backend`` get it and its config from the
  dispatcher for ``device_kind`` with the shipped tables, so import such a
  file before the table it ran with has changed.  Returns the keys written.
  """
  from ragdot import bench, dispatch  # pylint: disable=g-import-not-at-top

  device = dispatch.simulated_device(device_kind)
  rows = bench.rows_from_json(Path(path).read_text())
  by_case: dict[tuple, dict[str, dict[str, Any]]] = {}
  for row in rows:
    if (row.get("op") in OPS and row["impl"].startswith("ragdot") and row["ms"] == row["ms"]
        and row.get("routing", "routed") == "routed" and "skewed" not in row["shape"]):
      by_case.setdefault((row["shape"], row["op"]), {})[row["impl"]] = row
  written = []
  for (name, op), impls in by_case.items():
    auto_ms = impls["ragdot"]["ms"] if "ragdot" in impls else float("inf")  # inf: it failed
    forced = [r for i, r in impls.items() if i.startswith("ragdot:")]
    for r in forced:
      if "backend" not in r:
        shape = bench.Shape(name, r["m"], r["k"], r["n"], r["g"])
        r.update(bench.choice_fields(bench.dispatch_choice(
            op, shape, r["impl"].split(":", 1)[1], device=device)))
    if not forced:
      continue
    best = min(forced, key=lambda r: r["ms"])
    if best["ms"] * (1 + margin) >= auto_ms:
      continue
    backend, config = best["backend"], best["config"]
    call = backend_call(op, best["k"], best["n"])
    shape = (best["m"], call.k, call.n, best["g"])
    key = tables.key(call.table_op, dtype, *shape)
    if key in written:
      raise ValueError(f"{path}: two cases map to table key {key} ({name} {op})")
    flops = 2 * best["m"] * best["k"] * best["n"]
    auto_txt = f"{auto_ms:.4f} ms" if auto_ms < float("inf") else "failed"
    table.put(call.table_op, dtype, *shape, {
        "backend": backend, "config": config, "measured": True, "shape": list(shape),
        "ms": round(best["ms"], 5), "tflops": round(flops / best["ms"] / 1e9, 1),
        "method": best.get("method"),
        "source": (f"{Path(path).name}: {best['impl']} {best['ms']:.4f} ms vs the automatic"
                   f" choice {auto_txt} in one bench run ({name} {op})")})
    written.append(key)
  return written


# --- command line --------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
  from ragdot import bench  # pylint: disable=g-import-not-at-top

  parser.add_argument("--preset", nargs="+", default=[], choices=sorted(bench.PRESETS))
  parser.add_argument("--shape", action="append", default=[], type=bench.parse_shape,
                      help="m,k,n,g[,top_k] of a forward projection (repeatable)")
  parser.add_argument("--ops", nargs="+", default=None, choices=list(OPS),
                      help=f"default: {' '.join(OPS)} ({' '.join(FP8_OPS)} for fp8)")
  parser.add_argument("--dtype", default="bfloat16",
                      choices=["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"],
                      help="operand dtype (fp8: --ops fwd, the native [g, n, k] forward)")
  parser.add_argument("--weights-dtype", default=None, choices=["float8_e4m3fn", "float8_e5m2"],
                      help="W8A16: fp8 expert weights beside --dtype rows (bf16 / f16); --ops"
                           " fwd (both weight layouts) and dx; entries under"
                           " 'bfloat16+float8_e4m3fn'")
  parser.add_argument("--table", default=None,
                      help="table file to merge into (default: this device's table in"
                           " $RAGDOT_TABLE_DIR when set, else its shipped table)")
  parser.add_argument("--force", action="store_true", help="re-measure entries already measured")
  parser.add_argument("--dry-run", action="store_true", help="list candidates; run nothing")
  parser.add_argument("--budget-s", type=argtypes.positive_float, default=60.0, help="seconds per (op, shape)")
  parser.add_argument("--iterations", type=argtypes.positive_int, default=10)
  parser.add_argument("--repeats", type=argtypes.positive_int, default=3)
  parser.add_argument("--sustained-s", type=argtypes.nonnegative_float, default=0.0,
                      help="time candidates back to back for this many seconds each"
                           " (the power-limited clock of training) instead of CUPTI bursts")
  parser.add_argument("--skew-slack", type=float, default=0.02,
                      help="re-time the candidates within this fraction of the fastest on a"
                           " skewed routing and keep the fastest there (< 0: off)")
  parser.add_argument("--jobs", type=argtypes.positive_int, default=min(12, max(4, _cpus())),
                      help="parallel compile threads (default: the usable CPUs, 4 to 12;"
                           " at 4 a 30 s budget left all 10 m-4096 forward / dX sweeps of"
                           " docs/performance.md v42a-b unfinished)")
  parser.add_argument("--hang-s", type=argtypes.nonnegative_float, default=60.0,
                      help="a candidate whose accuracy check, or any one of its timings,"
                           " takes longer than this ends the run with exit status 3; 0: no"
                           " watchdog")
  parser.add_argument("--log", default=None,
                      help="append every timed candidate to this JSONL file")
  parser.add_argument("--import-sweep", default=None,
                      help="merge the best rows of a config-sweep JSONL file and exit")
  parser.add_argument("--import-bench", default=None,
                      help="merge the faster forced backend of each case of a `ragdot bench"
                           " --json` file, where it beat the automatic choice, and exit")
  parser.add_argument("--device-kind", default=None,
                      help="device kind for --dry-run / --import-* (default: this device)")
  parser.add_argument("--compute-capability", default=None, type=argtypes.compute_capability,
                      help="with --device-kind: its compute capability (e.g. 9.0), which"
                           " today's choice of a --dry-run depends on")


def _cpus() -> int:
  """CPUs this process may run on (its affinity mask, where the OS has one)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 4


def run(args: argparse.Namespace) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot import bench  # pylint: disable=g-import-not-at-top

  if error := argtypes.hang_limit_error(args.hang_s, args.sustained_s):
    print(f"ragdot tune: {error}", file=sys.stderr)
    return 2
  on_gpu = jax.default_backend() == "gpu"
  kind = args.device_kind or (jax.devices()[0].device_kind if on_gpu else "NVIDIA H200")
  path = Path(args.table) if args.table else default_table_path(kind)
  try:
    table = open_table(path, kind)
  except (OSError, ValueError) as e:
    print(f"ragdot tune: --table: {e}", file=sys.stderr)
    return 2
  if args.table and not on_gpu and not args.device_kind and table.device_kind != "*":
    kind = table.device_kind  # (a dry run or an import on the CPU: the table's own kind)
  if table.device_kind.lower() != kind.lower():
    print(f"ragdot tune: --table {path} is the table of {table.device_kind!r}, not of"
          f" {kind!r}", file=sys.stderr)
    return 2

  dtype = jnp.dtype(args.dtype)
  weights = getattr(args, "weights_dtype", None)
  key_dtype = dtype_key(dtype, weights)
  if (validate.is_fp8(dtype) or weights) and (args.import_sweep or args.import_bench):
    print("ragdot tune: --import-sweep / --import-bench hold bf16 measurements; fp8"
          " entries come from timing fp8 calls", file=sys.stderr)
    return 2
  for flag, source in (("--import-sweep", args.import_sweep), ("--import-bench", args.import_bench)):
    if source and not Path(source).is_file():
      print(f"ragdot tune: {flag}: no such file {source}", file=sys.stderr)
      return 2
  if args.import_sweep:
    count = import_sweep(args.import_sweep, table, dtype=args.dtype)
    table.save(path)
    _clear_caches()
    print(f"merged {count} entries from {args.import_sweep} into {path}")
    return 0
  if args.import_bench:
    keys = import_bench(args.import_bench, table, kind, dtype=args.dtype)
    table.save(path)
    _clear_caches()
    print(f"merged {len(keys)} entries from {args.import_bench} into {path}")
    for k in keys:
      print(f"  {k}: {table.entries[k]['backend']} {table.entries[k]['source']}")
    return 0

  shapes = [s for p in args.preset for s in bench.PRESETS[p]] + list(args.shape)
  if not shapes:
    print("ragdot tune: give --preset or --shape", file=sys.stderr)
    return 2
  ops = args.ops or (FP8_OPS if validate.is_fp8(dtype) else WEIGHT_ONLY_OPS if weights
                     else OPS)
  try:
    tasks = tasks_for(shapes, ops, dtype, weights)
  except ValueError as e:
    print(f"ragdot tune: {e}", file=sys.stderr)
    return 2

  from ragdot import dispatch  # pylint: disable=g-import-not-at-top
  # Whose choice is "today's" (incumbent_choice): this GPU, or --device-kind's.
  device = (dispatch.current_device() if on_gpu and not args.device_kind
            else dispatch.simulated_device(kind, getattr(args, "compute_capability", None)))
  if args.dry_run:
    print(f"table: {path} ({kind}){'' if on_gpu else '  [no GPU: dry run only]'}")
    for task in tasks:
      k_ = tables.key(task.table_op, table.canonical_dtype(key_dtype), task.m, task.k,
                      task.n, task.g)
      done = None if args.force else _done(table, task, key_dtype)
      state = f"skip: {done}" if done else "to tune"
      layout = " rhs [g,n,k]" if task.weights and task.rhs_nk else ""
      print(f"{task.op:3s} {task.name}{layout}  call m={task.m} k={task.k} n={task.n} g={task.g}"
            f"  key {k_}  [{state}]")
      inc = incumbent_choice(task, dtype, device)
      for backend, config in candidates(task, dtype, inc):
        today = "  (today's choice)" if (backend, config) == inc else ""
        print(f"    {backend:6s} {config_fields(config)}{today}")
    return 0

  if not on_gpu:
    print("ragdot tune: no GPU here (jax.default_backend() is "
          f"{jax.default_backend()!r}); tuning needs the GPU whose table it writes."
          " Use --dry-run to list the candidates.", file=sys.stderr)
    return 2

  from rich.progress import Progress  # pylint: disable=g-import-not-at-top

  print(f"tuning on {kind}: {len(tasks)} (op, shape) pairs -> {path}", flush=True)

  def append_log(row: dict[str, Any]) -> None:
    with open(args.log, "a") as f:
      f.write(json.dumps(row) + "\n")

  log = append_log if args.log else None
  hang_row = lambda label: dict(label, error=f"hang: still running after {args.hang_s:.0f} s")
  watchdog = None if args.hang_s <= 0 else Watchdog(
      args.hang_s, "ragdot tune", on_hang=(lambda label: log(hang_row(label))) if log else None)

  by_shape: dict[str, list[Task]] = {}
  for task in tasks:
    by_shape.setdefault(task.name, []).append(task)
  with Progress() as progress:
    for name, shape_tasks in by_shape.items():
      for task in shape_tasks:
        done = None if args.force else _done(table, task, key_dtype)
        if done:
          progress.console.print(f"skip {task.op} {name}: {done}")
          continue
        deadline = time.time() + args.budget_s
        try:
          entry = tune_task(task, dtype, deadline, iterations=args.iterations,
                            repeats=args.repeats, jobs=args.jobs, progress=progress,
                            sustained_s=args.sustained_s, skew_slack=args.skew_slack,
                            log=log, watchdog=watchdog,
                            incumbent=incumbent_choice(task, dtype, device))
        except DeviceFault as e:
          progress.console.print(f"[red]{task.op} {name}: the device faulted, stopping (this"
                                 f" entry not written): {e}[/red]")
          return 4
        if entry is None:
          progress.console.print(
              f"[red]{task.op} {name}: no candidate timed within {args.budget_s:.0f} s"
              " or passed the accuracy check; table entry unchanged[/red]")
          continue
        text = table.put(task.table_op, key_dtype, task.m, task.k, task.n, task.g, entry)
        table.save(path)
        speedup = (f", {entry['default_ms'] / entry['ms']:.2f}x the default"
                   if entry.get("default_ms") else "")
        progress.console.print(
            f"{task.op} {name}: {entry['backend']} {entry['config']} {entry['ms']:.4f} ms"
            f" {entry['tflops']} TFLOP/s{speedup} -> {text}"
            + ("" if entry["complete"] else " (budget hit: partial)"))
  _clear_caches()
  return 0


def _clear_caches() -> None:
  from ragdot import dispatch  # pylint: disable=g-import-not-at-top

  dispatch.clear_cache()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="ragdot tune", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(parser)
  return run(parser.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
