"""Expert parallelism: the experts' ragged_dots under ``jax.shard_map``.

The expert weights are sharded over mesh axis ``ep_axis`` (default "ep"; its
size ``ep`` must divide E).  Every shard sees all sorted rows (replicated over
"ep"), computes only the rows of its ``E / ep`` experts through ragdot's native
``group_offset = axis_index * E / ep`` (LoRA groups: times the adapter count),
leaves every other row exactly 0, and the shards' outputs are summed with
``psum``.  Only ``ep_axis`` is manual: other mesh axes stay under automatic
sharding.

``manual="ep"`` (only the ep axis manual, the default via ``"auto"``) leaves the
other axes to automatic sharding; ``manual="all"`` makes every mesh axis manual
inside the expert computation (rows replicated over the other axes).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

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


def sharded_expert_ffn(xs: jax.Array, group_sizes: jax.Array, experts: dict,
                       cfg: MoEConfig, mesh: Any, ep_axis: str = "ep",
                       manual: str = "auto") -> jax.Array:
  """``functional.expert_ffn`` with experts split over ``ep_axis``; psum'd result.

  manual: "ep" (only ``ep_axis`` manual), "all" (every mesh axis manual) or
  "auto" (same as "ep").
  """
  if manual not in ("auto", "ep", "all"):
    raise ValueError(f"manual must be 'auto', 'ep' or 'all', got {manual!r}")
  if manual == "auto":
    manual = "ep"
  axes = frozenset({ep_axis}) if manual == "ep" else frozenset(mesh.axis_names)
  ep = ep_size(mesh, ep_axis)
  if cfg.num_experts % ep:
    raise ValueError(f"mesh axis {ep_axis!r} of size {ep} must divide num_experts={cfg.num_experts}")
  local = cfg.num_experts // ep

  def body(xs, group_sizes, experts):
    offset = jax.lax.axis_index(ep_axis) * local
    ys = expert_ffn(xs, group_sizes, experts, cfg, expert_offset=offset)
    return jax.lax.psum(ys, ep_axis)  # each row is non-zero on exactly one shard

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), expert_specs(experts, ep_axis)),
                     out_specs=P(), axis_names=axes)
  return fn(xs, group_sizes, experts)
