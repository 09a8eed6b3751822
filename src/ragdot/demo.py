"""End-to-end example (`make demo`): an MoE layer's ragged_dots, forward and
backward, with expert parallelism over every device (8 simulated CPU devices
when there is no GPU), checked against a per-token dense reference.

Prints one summary line starting with ``demo:``.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Only affects the CPU platform: a GPU machine keeps its GPUs.
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ragdot  # noqa: E402
from ragdot.moe import routing as rt  # noqa: E402


def moe_mlp(x, w_gate_up, w_down, routing, top_k, *, ep_axis=None, experts_per_shard=None):
  """SwiGLU MoE MLP on ``x[tokens, hidden]``; inside shard_map when ep_axis is set."""
  xs = rt.sort_tokens(x, routing, top_k)
  offset = None
  if ep_axis is not None:
    offset = jax.lax.axis_index(ep_axis) * experts_per_shard
  h = ragdot.ragged_dot(xs, w_gate_up, routing.group_sizes, group_offset=offset)
  gate, up = jnp.split(h, 2, axis=-1)
  a = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
  y = ragdot.ragged_dot(a, w_down, routing.group_sizes, group_offset=offset)
  if ep_axis is not None:
    y = jax.lax.psum(y, ep_axis)
  return rt.combine(y, routing, top_k)


def reference_mlp(x, w_gate_up, w_down, routing, top_k):
  """Per-token dense computation in f32: each token through its k experts."""
  x = x.astype(jnp.float32)
  wg, wd = w_gate_up.astype(jnp.float32), w_down.astype(jnp.float32)
  hi = jax.lax.Precision.HIGHEST
  out = jnp.zeros(x.shape, jnp.float32)
  for j in range(top_k):
    e = routing.experts[:, j]
    h = jnp.einsum("td,tdf->tf", x, wg[e], precision=hi)
    gate, up = jnp.split(h, 2, axis=-1)
    y = jnp.einsum("tf,tfd->td", jax.nn.silu(gate) * up, wd[e], precision=hi)
    out = out + routing.weights[:, j:j + 1] * y
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--tokens", type=int, default=512)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--intermediate", type=int, default=128)
  parser.add_argument("--experts", type=int, default=32)
  parser.add_argument("--top-k", type=int, default=4)
  parser.add_argument("--dtype", default="bfloat16")
  args = parser.parse_args(argv)

  devices = jax.devices()
  ep = len(devices)
  while args.experts % ep:
    ep -= 1
  mesh = jax.make_mesh((ep,), ("ep",), devices=devices[:ep],
                       axis_types=(jax.sharding.AxisType.Auto,))
  dtype = jnp.dtype(args.dtype)
  kx, kr, kg, kd, kc = jax.random.split(jax.random.key(0), 5)
  t, d, f, e, k = args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
  x = jax.random.normal(kx, (t, d), jnp.float32).astype(dtype)
  w_gate_up = (jax.random.normal(kg, (e, d, 2 * f), jnp.float32) / np.sqrt(d)).astype(dtype)
  w_down = (jax.random.normal(kd, (e, f, d), jnp.float32) / np.sqrt(f)).astype(dtype)
  cot = jax.random.normal(kc, (t, d), jnp.float32)
  routing = rt.top_k_routing(jax.random.normal(kr, (t, e)), k)

  def sharded(x, wg, wd, routing):
    return moe_mlp(x, wg, wd, routing, k, ep_axis="ep", experts_per_shard=e // ep)

  layer = jax.jit(jax.shard_map(sharded, mesh=mesh, in_specs=(P(), P("ep"), P("ep"), P()),
                                out_specs=P()))
  loss = lambda x, wg, wd: jnp.sum(layer(x, wg, wd, routing).astype(jnp.float32) * cot)
  ref_loss = lambda x, wg, wd: jnp.sum(reference_mlp(x, wg, wd, routing, k) * cot)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  start = time.perf_counter()
  value, grads = jax.block_until_ready(step(x, w_gate_up, w_down))
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(3):
    value, grads = jax.block_until_ready(step(x, w_gate_up, w_down))
  step_ms = (time.perf_counter() - start) / 3 * 1e3

  f32 = lambda a: a.astype(jnp.float32)
  ref_value, ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(f32(x), f32(w_gate_up), f32(w_down))
  out = layer(x, w_gate_up, w_down, routing)
  ref_out = reference_mlp(x, w_gate_up, w_down, routing, k)
  rel = lambda a, b: float(jnp.linalg.norm(f32(a) - b) / jnp.linalg.norm(b))
  errors = {"out": rel(out, ref_out)}
  errors.update({name: rel(g, r) for name, g, r in zip(("dx", "dw_gate_up", "dw_down"), grads, ref_grads)})
  tol = 3e-2 if dtype in (jnp.bfloat16, jnp.float16) else 1e-4
  ok = all(v <= tol for v in errors.values()) and bool(jnp.isfinite(value))
  for name, err in errors.items():
    print(f"  {name:<11} relative error vs f32 per-token reference: {err:.2e}")
  print(f"  loss {float(value):.4f} (reference {float(ref_value):.4f}); first call {compile_s:.1f} s,"
        f" step {step_ms:.1f} ms")
  platform = devices[0].platform
  print(f"demo: {ep} {platform} devices, ep={ep}, {t} tokens x top-{k} over {e} experts"
        f" (hidden {d}, intermediate {f}, {dtype.name}): forward+backward with group_offset"
        f" {'matches' if ok else 'DOES NOT match'} the reference (max rel err"
        f" {max(errors.values()):.1e}, tol {tol:.0e}) -> {'PASS' if ok else 'FAIL'}")
  if not ok:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
