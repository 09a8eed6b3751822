"""Benchmark: one MoE block forward+backward at Qwen3-30B-A3B dimensions.

4096 tokens, hidden 2048, moe_intermediate 768, 128 experts, top-8, bf16 params
and activations, fused gate_up, softmax routing (routing included in the timing).
The same block (``ragdot.moe.functional.moe_mlp``) runs with its grouped
matmuls from ragdot, ``jax.lax.ragged_dot`` and, when importable,
``tokamax.ragged_dot``; each is timed with ``ragdot.timing.device_time_ms``
(CUPTI kernel time on GPU, host clock otherwise) on the jitted
``value_and_grad`` w.r.t. x and all params.

  python -m ragdot.moe.bench            # full size (GPU)
  python -m ragdot.moe.bench --small    # CPU smoke test
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from ragdot import argtypes
from ragdot.moe import functional as F
from ragdot.moe.config import MoEConfig
from ragdot.timing import SETTLE_S, device_time_ms

FULL = dict(tokens=4096, hidden=2048, intermediate=768, experts=128, top_k=8)
SMALL = dict(tokens=256, hidden=128, intermediate=64, experts=16, top_k=4)


def _tokamax_fn():
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
  except Exception:  # pylint: disable=broad-except
    return None
  return lambda x, w, gs: tokamax.ragged_dot(x, w, gs)


def implementations() -> dict:
  """name -> ragged_dot_fn for ``functional.moe_mlp`` (None: ragdot itself)."""
  fns = {"ragdot": None, "lax.ragged_dot": lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)}
  tk = _tokamax_fn()
  if tk is not None:
    fns["tokamax"] = tk
  return fns


def make_step(cfg: MoEConfig, ragged_dot_fn):
  def loss(params, x, cot):
    y = F.moe_mlp(params, x, cfg, ragged_dot_fn=ragged_dot_fn)
    return jnp.sum(y.astype(jnp.float32) * cot)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
  parser.add_argument("--iterations", type=argtypes.positive_int, default=20)
  parser.add_argument("--implementation", default=None,
                      help="ragdot backend for the ragdot row (default: automatic)")
  parser.add_argument("--only", default=None, help="comma-separated subset of implementations")
  parser.add_argument("--json", default=None, help="write results to this file")
  args = parser.parse_args(argv)
  dims = SMALL if args.small else FULL
  cfg = MoEConfig(hidden=dims["hidden"], intermediate=dims["intermediate"],
                  num_experts=dims["experts"], top_k=dims["top_k"],
                  implementation=args.implementation)
  dtype = jnp.bfloat16
  params = F.init_params(jax.random.key(0), cfg, dtype)
  x = jax.random.normal(jax.random.key(1), (dims["tokens"], cfg.hidden), jnp.float32).astype(dtype)
  cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  rows = dims["tokens"] * cfg.top_k
  flops = 3 * 2 * rows * (cfg.hidden * 2 * cfg.intermediate + cfg.intermediate * cfg.hidden)
  print(f"MoE block fwd+bwd: {dims} bf16 on {jax.devices()[0].device_kind};"
        f" expert matmul work {flops / 1e12:.3f} TFLOP")
  fns = implementations()
  if args.only:
    keep = set(args.only.split(","))
    if keep - set(fns):  # (a mistyped name would measure nothing)
      parser.error(f"--only: {sorted(keep - set(fns))} not among the implementations {list(fns)}")
    fns = {k: v for k, v in fns.items() if k in keep}
  results = []
  for name, fn in fns.items():
    step = make_step(cfg, fn)
    try:
      ms, method = device_time_ms(step, params, x, cot, iterations=args.iterations,
                                  warmup_s=SETTLE_S)
    except Exception as e:  # pylint: disable=broad-except
      print(f"  {name:<15} failed: {type(e).__name__}: {str(e)[:200]}")
      continue
    res = {"impl": name, "ms": ms, "method": method, "tflops": flops / ms / 1e9, **dims}
    results.append(res)
    print(f"  {name:<15} {ms:9.3f} ms ({method})  {res['tflops']:7.1f} TFLOP/s (expert matmuls)"
          f"  {ms / results[0]['ms']:.2f}x ragdot's time" if results[0]["impl"] == "ragdot"
          else f"  {name:<15} {ms:9.3f} ms ({method})  {res['tflops']:7.1f} TFLOP/s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
