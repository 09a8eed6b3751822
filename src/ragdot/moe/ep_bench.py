"""Expert-parallel scaling of one MoE block on the local devices.

For ep = 1, 2, 4, 8 (up to the device count) one MoE block forward+backward at
Qwen3-30B-A3B sizes (4096 tokens, hidden 2048, moe_intermediate 768, 128
experts, top-8, bf16) runs with the experts sharded over "ep", two ways:

* ``group_offset``: ragdot computes only the shard's rows (every other row 0);
* ``masked``: what callers without group_offset do: each rank zero-pads its
  experts to all E and computes every row (non-local rows come out 0).

Step time (CUPTI device time on one GPU; wall time of back-to-back calls when
the step spans several GPUs, since CUPTI would sum their kernels; the wall time
is also recorded at ep=1 as ``wall_ms``, for a like-with-like scaling line),
tokens/s,
the expert matmuls' share (each rank's expert FFN alone, no collective), and
the time of the two psums over "ep" a step pays (partial outputs forward,
d(tokens) backward, both f32 [tokens, hidden]; see ``moe.parallel``).  With
ep > 1 each step's CUPTI kernel time summed over the GPUs, divided by ep, is
printed as the mean busy time per GPU: a wall time well above it means the
GPUs sat idle for part of the step.

  python -m ragdot.moe.ep_bench            # GPUs
  python -m ragdot.moe.ep_bench --small    # CPU smoke test (8 simulated devices)
  python -m ragdot.moe.ep_bench --from-json ep.json --plot ep.png
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ragdot import argtypes  # noqa: E402
from ragdot.moe import functional as F  # noqa: E402
from ragdot.moe import parallel  # noqa: E402
from ragdot.moe import routing as rt  # noqa: E402
from ragdot.moe.bench import FULL, SMALL  # noqa: E402
from ragdot.moe.config import MoEConfig  # noqa: E402
from ragdot.timing import SETTLE_S, device_time_ms, host_time_ms, kernel_time_sum_ms  # noqa: E402


def _masked_ffn(cfg: MoEConfig, local: int):
  """What callers without group_offset do: each rank zero-pads its experts to
  all E and computes every row (other ranks' rows come out 0)."""
  def ffn(xs, group_sizes, experts, offset):
    pad = lambda w: jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros((cfg.num_experts,) + w.shape[1:], w.dtype), w, offset, 0)
    return F.expert_ffn(xs, group_sizes, jax.tree.map(pad, experts), cfg)
  return ffn


def make_steps(cfg: MoEConfig, mesh, strategy: str):
  """(block step, expert-FFN-only step), each value_and_grad w.r.t. x and params.

  The FFN-only step runs each rank's expert SwiGLU on its own copy of the
  sorted rows (sharded over "ep"): no collective, the expert matmuls' share.
  """
  local = cfg.num_experts // int(mesh.shape["ep"])
  ffn = parallel.offset_expert_ffn(cfg) if strategy == "group_offset" else _masked_ffn(cfg, local)

  def block(params, x, cot):
    routing = F.route(params, x, cfg)
    _, experts = F.split_params(params)
    y = parallel.sharded_moe_experts(x, routing, experts, cfg, mesh, ffn=ffn)
    return jnp.sum(y.astype(jnp.float32) * cot)

  def experts_only(params, xs_per_rank, gs, cot_rows):
    _, experts = F.split_params(params)

    def body(xs, gs, experts, cot):
      ys = ffn(xs[0], gs, experts, jax.lax.axis_index("ep") * local)
      return jax.lax.psum(jnp.sum(ys.astype(jnp.float32) * cot), "ep")

    return jax.shard_map(body, mesh=mesh, out_specs=P(), in_specs=(
        P("ep"), P(), parallel.expert_specs(experts), P()))(xs_per_rank, gs, experts, cot_rows)

  return (jax.jit(jax.value_and_grad(block, argnums=(0, 1))),
          jax.jit(jax.value_and_grad(experts_only, argnums=(0, 1))))


def psum_ms(mesh, rows: int, hidden: int, dtype, iterations: int) -> tuple[float, str]:
  """Time of a psum over "ep" of one [rows, hidden] array per device.  A step
  pays two: the forward's partial outputs and the backward's d(tokens), both
  f32 [tokens, hidden]."""
  ep = mesh.shape["ep"]
  y = jax.random.normal(jax.random.key(4), (ep, rows, hidden), jnp.float32).astype(dtype)
  y = jax.device_put(y, jax.sharding.NamedSharding(mesh, P("ep")))
  f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a[0], "ep"), mesh=mesh,
                            in_specs=P("ep"), out_specs=P()))
  return device_time_ms(f, y, iterations=iterations)


def step_times(rows: list[dict]) -> tuple[dict[tuple[int, str], float], str]:
  """``({(ep, strategy): step ms}, clock)``: each step's wall clock where every
  strategy row has one (ep=1's CUPTI time and ep > 1's wall clock are not
  like with like), else the rows' own ``ms``; ``clock`` says which."""
  steps = [r for r in rows if r["strategy"] != "psum only"]
  wall = bool(steps) and all("wall_ms" in r for r in steps)
  key = "wall_ms" if wall else "ms"
  return ({(r["ep"], r["strategy"]): r[key] for r in steps},
          "wall clock" if wall else "as measured")


def plot(rows: list[dict], path: str, title: str = "MoE block fwd+bwd, expert parallelism") -> None:
  """Step time per ep for each strategy (and the psums' share) as grouped bars."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  eps = sorted({r["ep"] for r in rows})
  strategies = ["group_offset", "masked"]
  by = {(r["ep"], r["strategy"]): r for r in rows}
  times, clock = step_times(rows)
  fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(eps), 3.6))
  width = 0.38
  for i, strategy in enumerate(strategies):
    xs = [e + (i - 0.5) * width for e in range(len(eps))]
    ms = [times.get((ep, strategy), float("nan")) for ep in eps]
    bars = ax.bar(xs, ms, width, label=strategy)
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
  psum = [by[(ep, "psum only")]["ms"] if (ep, "psum only") in by else 0.0 for ep in eps]
  if any(psum):
    ax.bar([e - 0.5 * width for e in range(len(eps))], psum, width, color="none",
           edgecolor="black", hatch="//", label="of which psums (both)")
  ax.set_xticks(range(len(eps)))
  ax.set_xticklabels([f"ep={ep}" for ep in eps])
  ax.set_ylabel(f"step time (ms, {clock})")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def summary(rows: list[dict]) -> list[str]:
  """One line per ep: group_offset's speedup over the masked workaround, and
  its wall-clock speedup over ep=1 where both were measured."""
  by = {(r["ep"], r["strategy"]): r for r in rows}
  base = by.get((1, "group_offset"), {}).get("wall_ms")
  lines = []
  for ep in sorted({r["ep"] for r in rows}):
    if (ep, "masked") not in by or (ep, "group_offset") not in by:
      continue
    off = by[(ep, "group_offset")]
    line = (f"  ep={ep}: group_offset is {by[(ep, 'masked')]['ms'] / off['ms']:.2f}x"
            " faster than the masked workaround")
    if base and off.get("wall_ms") and ep > 1:
      line += f"; {base / off['wall_ms']:.2f}x ep=1's step (wall clock)"
    lines.append(line)
  return lines


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--iterations", type=argtypes.positive_int, default=10)
  parser.add_argument("--json", default=None, help="rows so far are written after each ep")
  parser.add_argument("--plot", default=None, help="bar chart of the step times (PNG)")
  parser.add_argument("--from-json", default=None,
                      help="no run: summary (and --plot) of a JSON written by --json")
  parser.add_argument("--ep", type=argtypes.positive_int, nargs="+", default=[1, 2, 4, 8],
                      help="expert-parallel sizes, run in this order (those that fit)")
  args = parser.parse_args(argv)
  if args.from_json:
    with open(args.from_json) as f:
      results = json.load(f)
    print("\n".join(summary(results)))
    if args.plot:
      plot(results, args.plot)
    return results
  dims = SMALL if args.small else FULL
  cfg = MoEConfig(hidden=dims["hidden"], intermediate=dims["intermediate"],
                  num_experts=dims["experts"], top_k=dims["top_k"])
  devices = jax.devices()
  params = F.init_params(jax.random.key(0), cfg, jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (dims["tokens"], cfg.hidden), jnp.float32).astype(jnp.bfloat16)
  cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  routing = F.route(params, x, cfg)
  xs = rt.sort_tokens(x, routing, cfg.top_k)
  cot_rows = jax.random.normal(jax.random.key(3), xs.shape, jnp.float32)
  print(f"MoE block EP scaling on {len(devices)} x {devices[0].device_kind}: {dims}")
  results = []

  def save():  # the file always holds the rows so far: a run cut short keeps them
    if args.json:
      with open(args.json, "w") as f:
        json.dump(results, f, indent=1)

  save()
  for ep in args.ep:
    if ep > len(devices) or cfg.num_experts % ep:
      continue
    mesh = jax.make_mesh((ep,), ("ep",), devices=devices[:ep],
                         axis_types=(jax.sharding.AxisType.Auto,))
    router, experts = F.split_params(params)
    # Every input lives on the mesh before timing (replicated ones on every
    # GPU): an input left on one GPU would be copied to the others inside each
    # timed call (v5's FFN-only rows at ep=2 carried a 268 MB copy of cot_rows).
    rep = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P()))
    sharded = {**jax.tree.map(rep, router), **parallel.shard_experts(experts, mesh)}
    x_r, cot_r, cot_rows_r, gs_r = (rep(a) for a in (x, cot, cot_rows, routing.group_sizes))
    if ep > 1:
      # Both psums of a step (forward partial outputs, backward d(tokens)) are
      # of one f32 [tokens, hidden] array: timed once, counted twice.
      one_ms, ar_method = psum_ms(mesh, x.shape[0], cfg.hidden, jnp.float32, args.iterations)
      results.append(dict(ep=ep, strategy="psum only", ms=2 * one_ms, method=ar_method,
                          forward_ms=one_ms, backward_ms=one_ms))
      print(f"  ep={ep} psums per step: 2 x f32 {list(x.shape)} (partial outputs, d(tokens))"
            f" {one_ms:.3f} ms each ({ar_method})")
    xs_per_rank = jax.device_put(jnp.broadcast_to(xs, (ep,) + xs.shape),
                                 jax.sharding.NamedSharding(mesh, P("ep")))
    for strategy in ("group_offset", "masked"):
      block, experts_only = make_steps(cfg, mesh, strategy)
      try:
        ms, method = device_time_ms(block, sharded, x_r, cot_r, iterations=args.iterations,
                                    warmup_s=SETTLE_S)
        ffn_ms, _ = device_time_ms(experts_only, sharded, xs_per_rank, gs_r, cot_rows_r,
                                   iterations=args.iterations, warmup_s=SETTLE_S)
      except Exception as e:  # pylint: disable=broad-except
        print(f"  ep={ep} {strategy:<12} failed: {type(e).__name__}: {str(e)[:200]}")
        continue
      row = dict(ep=ep, strategy=strategy, ms=ms, method=method,
                 tokens_per_s=dims["tokens"] / ms * 1e3, expert_ffn_ms=ffn_ms,
                 expert_share=min(ffn_ms / ms, 1.0))
      # Wall clock of back-to-back steps at every ep (what ep > 1 is timed by),
      # so that scaling across ep compares like with like.
      row["wall_ms"] = (ms if method.startswith("host") else
                        host_time_ms(block, sharded, x_r, cot_r, iterations=args.iterations))
      busy = ""
      if ep > 1:
        sums = [kernel_time_sum_ms(f, *a, iterations=args.iterations) for f, a in (
            (block, (sharded, x_r, cot_r)),
            (experts_only, (sharded, xs_per_rank, gs_r, cot_rows_r)))]
        if None not in sums:
          row.update(busy_per_gpu_ms=sums[0] / ep, expert_ffn_busy_per_gpu_ms=sums[1] / ep)
          busy = f"  busy per GPU {sums[0] / ep:.3f} ms (FFN {sums[1] / ep:.3f})"
      results.append(row)
      print(f"  ep={ep} {strategy:<12} step {ms:8.3f} ms ({method}; wall {row['wall_ms']:.3f})"
            f"  {row['tokens_per_s']:10.0f} tok/s"
            f"  expert FFN {ffn_ms:7.3f} ms ({100 * row['expert_share']:.0f}%){busy}", flush=True)
    save()
  print("\n".join(summary(results)))
  if args.plot:
    plot(results, args.plot)
  return results


if __name__ == "__main__":
  main()
