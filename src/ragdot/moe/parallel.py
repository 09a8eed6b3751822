"""Expert parallelism: the experts' ragged_dots under ``jax.shard_map``.

The expert weights are sharded over mesh axis ``ep_axis`` (default "ep"; its
size ``ep`` must divide E).  Every shard sees all tokens (replicated over
"ep"), sorts them into its copy of the ``tokens * top_k`` expert rows, computes
only the rows of its ``E / ep`` experts through ragdot's native
``group_offset = axis_index * E / ep`` (LoRA groups: times the adapter count;
every other row is exactly 0), and combines its rows into a partial
``[tokens, d]`` sum over k.  One ``psum`` of those f32 partials (``top_k / 2``
times fewer bytes than the bf16 expert rows) makes the output; in the backward
pass the transpose of making the tokens per-shard is one psum of the f32
``[tokens, d]`` input cotangent (again ``top_k / 2`` times fewer bytes).  Only
``ep_axis`` is manual: other mesh axes stay under automatic sharding.

``manual="ep"`` (only the ep axis manual, the default via ``"auto"``) leaves the
other axes to automatic sharding; ``manual="all"`` makes every mesh axis manual
inside the expert computation (tokens replicated over the other axes).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ragdot.moe import routing as rt
from ragdot.moe.config import MoEConfig
from ragdot.moe.functional import expert_ffn


def ep_size(mesh: Any, ep_axis: str = "ep") -> int:
  return int(mesh.shape[ep_axis])


def expert_specs(experts: Any, ep_axis: str = "ep") -> Any:
  """PartitionSpec per expert-param leaf: leading (expert) dim over ``ep_axis``."""
  return jax.tree.map(lambda _: P(ep_axis), experts)


def shard_experts(experts: Any, mesh: Any, ep_axis: str = "ep") -> Any:
  """device_put of expert params with their leading dim sharded over ``ep_axis``."""
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(ep_axis))), experts)


def offset_expert_ffn(cfg: MoEConfig) -> Callable[..., jax.Array]:
  """``ffn(rows, group_sizes, local_experts, expert_offset)``: the shard's
  experts through ragdot's ``group_offset`` (other rows exactly 0)."""
  return lambda xs, gs, ex, offset: expert_ffn(xs, gs, ex, cfg, expert_offset=offset)


def sharded_moe_experts(x: jax.Array, routing: rt.Routing, experts: dict, cfg: MoEConfig,
                        mesh: Any, ep_axis: str = "ep", manual: str = "auto",
                        ffn: Callable[..., jax.Array] | None = None) -> jax.Array:
  """Sort, expert SwiGLU and weighted combine of ``x[tokens, d]`` with the
  experts split over ``ep_axis``; returns ``[tokens, d]`` in x.dtype.

  Args:
    x: the routed tokens (replicated over ``ep_axis``).
    routing: ``functional.route``'s result for x (replicated).
    experts: expert params, leading dim sharded over ``ep_axis``.
    manual: "ep" (only ``ep_axis`` manual), "all" (every mesh axis manual) or
      "auto" (same as "ep").
    ffn: ``ffn(rows, group_sizes, local_experts, expert_offset) -> rows``
      replacing ``offset_expert_ffn(cfg)`` (benchmarks: the masked workaround);
      rows of other shards' experts must come out exactly 0.
  """
  if manual not in ("auto", "ep", "all"):
    raise ValueError(f"manual must be 'auto', 'ep' or 'all', got {manual!r}")
  axes = frozenset({ep_axis}) if manual in ("auto", "ep") else frozenset(mesh.axis_names)
  ep = ep_size(mesh, ep_axis)
  if cfg.num_experts % ep:
    raise ValueError(f"mesh axis {ep_axis!r} of size {ep} must divide num_experts={cfg.num_experts}")
  local = cfg.num_experts // ep
  ffn = ffn or offset_expert_ffn(cfg)

  def body(x, routing, experts):
    # Mark the tokens per-shard here, in f32, so that the backward's psum (the
    # transpose of this step) is over d(tokens) in f32, not over the top_k
    # times larger d(rows) that autodiff would otherwise place after the sort.
    # (The sort itself stays in x.dtype: each shard's share of d(tokens) is
    # rounded once to it before the f32 psum; measured equal accuracy against
    # the f32 reference to ep=1, at half the gather bytes of an f32 sort.)
    xv = jax.lax.pcast(x.astype(jnp.float32), ep_axis, to="varying")
    xs = rt.sort_tokens(xv.astype(x.dtype), routing, cfg.top_k)
    ys = ffn(xs, routing.group_sizes, experts, jax.lax.axis_index(ep_axis) * local)
    # Each token's k rows live on up to k shards: sum the shards' f32 partials.
    return jax.lax.psum(rt.combine(ys, routing, cfg.top_k, out_dtype=jnp.float32), ep_axis)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), expert_specs(experts, ep_axis)),
                     out_specs=P(), axis_names=axes)
  return fn(x, routing, experts).astype(x.dtype)
