"""A digest of what a training step lowers to for sm90, computed on the CPU.

  PYTHONPATH=src python scripts/lowering_digest.py [--shape 32768,2048,1536,128] [--offset 3]

Traces ``jax.jit(jax.value_and_grad(loss, (0, 1)))`` of a loss through
``ragdot.ragged_dot`` (bf16, the given group_offset, or none with
``--offset -1``) with the dispatcher choosing as on an H200, and lowers it for
CUDA.  Prints the trace and lowering times, then a SHA-256 of each Mosaic GPU
kernel module (parsed back from the lowered text and printed without debug
locations) and of the histogram of StableHLO / func / sdy op names.  Run it on
two commits: the same digests mean that a change to how the ops are traced
(autodiff rules, wrappers) left the kernels and the XLA program alone.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import re
import time

import jax
import jax.numpy as jnp

from ragdot import dispatch


def _unescape(text: str) -> bytes:
  """The bytes of an MLIR string attribute's printed form."""
  out, i = bytearray(), 0
  while i < len(text):
    if text[i] == "\\":
      if text[i + 1] in "\\\"":
        out.append(ord(text[i + 1]))
        i += 2
      else:
        out.append(int(text[i + 1:i + 3], 16))
        i += 3
    else:
      out.extend(text[i].encode())
      i += 1
  return bytes(out)


def kernel_modules(lowered_text: str) -> list[str]:
  """Each Mosaic GPU custom call's module, printed without debug locations."""
  from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
  from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
  modules = []
  for line in lowered_text.splitlines():
    if "custom_call @mosaic_gpu" not in line:
      continue
    match = re.search(r'module = "((?:[^"\\]|\\.)*)"', line)
    ctx = mlir.make_ir_context()
    ctx.allow_unregistered_dialects = True
    with ctx:
      module = ir.Module.parse(_unescape(match.group(1)))
      modules.append(module.operation.get_asm(enable_debug_info=False))
  return sorted(modules)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="32768,2048,1536,128", help="m,k,n,g")
  p.add_argument("--offset", type=int, default=3, help="group_offset (-1: none)")
  args = p.parse_args()
  m, k, n, g = (int(v) for v in args.shape.split(","))
  dispatch.current_device = lambda: dispatch.Device("gpu", "NVIDIA H200", "9.0")
  dispatch.clear_cache()
  import ragdot  # pylint: disable=g-import-not-at-top

  offset = None if args.offset < 0 else jnp.int32(args.offset)
  loss = lambda x, w, gs: jnp.sum(
      ragdot.ragged_dot(x, w, gs, group_offset=offset).astype(jnp.float32))
  types = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
           jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
           jax.ShapeDtypeStruct((g,), jnp.int32))
  t0 = time.perf_counter()
  traced = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(*types)
  t1 = time.perf_counter()
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  t2 = time.perf_counter()
  print(f"trace {t1 - t0:.2f} s, lower {t2 - t1:.2f} s")
  for i, module in enumerate(kernel_modules(text)):
    print(f"kernel {i}: {hashlib.sha256(module.encode()).hexdigest()[:16]} ({len(module)} chars)")
  ops = collections.Counter(re.findall(r"\b(?:stablehlo|mhlo|func|sdy)\.[a-z_]+", text))
  digest = hashlib.sha256(repr(sorted(ops.items())).encode()).hexdigest()[:16]
  print(f"ops: {digest} ({sum(ops.values())} ops, {len(ops)} kinds)")


if __name__ == "__main__":
  main()
