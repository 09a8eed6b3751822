"""Expert parallelism: the experts' ragged_dots under ``jax.shard_map``.

The expert weights are sharded over mesh axis ``ep_axis`` (default "ep"; its
size ``ep`` must divide E).  The tokens are split over the other mesh axes (the
data-parallel ones, ``token_axes``) and replicated over "ep": every device sorts
its slice of the tokens into its copy of their ``tokens * top_k`` expert rows,
computes only the rows of its ``E / ep`` experts through ragdot's native
``group_offset = axis_index * E / ep`` (LoRA groups: times the adapter count;
every other row is exactly 0), and combines its rows into a partial
``[tokens, d]`` sum over k.  One ``psum`` over "ep" of those f32 partials
(``top_k / 2`` times fewer bytes than the bf16 expert rows) makes the output; in
the backward pass the transpose of making the tokens per-shard is one psum of
the f32 ``[tokens, d]`` input cotangent (again ``top_k / 2`` times fewer bytes).

``manual`` says which mesh axes the shard_map makes manual: "auto" (default)
``ep_axis`` and the token axes, other axes stay under automatic sharding; "ep"
only ``ep_axis`` (the tokens are not split, so every device of a data-parallel
group computes all of the group's tokens' rows for its experts); "all" every
mesh axis (tokens replicated over any that is not a token axis).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ragdot import sharded
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


def token_split(mesh: Any, tokens: int, ep_axis: str = "ep", manual: str = "auto",
                token_axes: Sequence[str] | str = "auto") -> tuple[str, ...]:
  """The mesh axes ``sharded_moe_experts`` splits ``tokens`` over.

  ``"auto"``: the mesh axes other than ``ep_axis`` (of size > 1), in mesh
  order, each taken while the product of the sizes taken divides ``tokens``
  (the tokens are replicated over the others: each device there computes all
  of its slice's rows); none with ``manual="ep"``, which leaves those axes to
  automatic sharding.  An explicit tuple is checked.
  """
  if manual not in ("auto", "ep", "all"):
    raise ValueError(f"manual must be 'auto', 'ep' or 'all', got {manual!r}")
  if isinstance(token_axes, str):
    if token_axes != "auto":
      raise ValueError(f"token_axes must be 'auto' or a tuple of mesh axis names, got {token_axes!r}")
    if manual == "ep":
      return ()
    axes: tuple[str, ...] = ()
    for a in mesh.axis_names:
      if a != ep_axis and mesh.shape[a] > 1 and tokens % (
          math.prod(mesh.shape[b] for b in axes) * mesh.shape[a]) == 0:
        axes += (a,)
    return axes
  axes = tuple(token_axes)
  bad = [a for a in axes if a not in mesh.axis_names or a == ep_axis]
  if bad or len(set(axes)) != len(axes):
    raise ValueError(f"token_axes {axes!r} must be distinct mesh axes other than"
                     f" ep_axis {ep_axis!r} (mesh axes {mesh.axis_names})")
  if axes and manual == "ep":
    raise ValueError("token_axes must be () with manual='ep' (it leaves the other axes"
                     " to automatic sharding)")
  size = math.prod(mesh.shape[a] for a in axes)
  if tokens % size:
    raise ValueError(f"token_axes {axes!r} split the tokens {size} ways, which does not"
                     f" divide the {tokens} tokens")
  return axes


def sharded_moe_experts(x: jax.Array, routing: rt.Routing | rt.Assignment, experts: dict,
                        cfg: MoEConfig, mesh: Any, ep_axis: str = "ep", manual: str = "auto",
                        ffn: Callable[..., jax.Array] | None = None,
                        token_axes: Sequence[str] | str = "auto") -> jax.Array:
  """Sort, expert SwiGLU and weighted combine of ``x[tokens, d]`` with the
  experts split over ``ep_axis``; returns ``[tokens, d]`` in x.dtype.

  Each device takes its slice of the tokens along ``token_axes`` (the
  data-parallel axes; see ``token_split``) and sorts that slice's assignments
  itself, so no device computes rows of another slice's tokens.

  Args:
    x: the routed tokens (replicated over ``ep_axis``).
    routing: ``functional.assignment``'s (or ``route``'s) result for x; only
      its per-token fields (weights, experts, groups) are used.
    experts: expert params, leading dim sharded over ``ep_axis``.
    manual: "auto" (``ep_axis`` and the token axes manual, other axes
      automatic), "ep" (only ``ep_axis`` manual; tokens not split) or "all"
      (every mesh axis manual; tokens split over the token axes, replicated
      over any other).
    ffn: ``ffn(rows, group_sizes, local_experts, expert_offset) -> rows``
      replacing ``offset_expert_ffn(cfg)`` (benchmarks: the masked workaround);
      rows of other shards' experts must come out exactly 0.
    token_axes: "auto" or the mesh axes to split the tokens over.
  """
  tok = token_split(mesh, x.shape[0], ep_axis, manual, token_axes)
  axes = (frozenset(mesh.axis_names) if manual == "all" else frozenset((ep_axis,) + tok))
  ep = ep_size(mesh, ep_axis)
  if cfg.num_experts % ep:
    raise ValueError(f"mesh axis {ep_axis!r} of size {ep} must divide num_experts={cfg.num_experts}")
  local = cfg.num_experts // ep
  num_groups = routing.num_groups
  ffn = ffn or offset_expert_ffn(cfg)

  def body(x, weights, chosen, groups, experts):
    # Mark the tokens per-shard here, in f32, so that the backward's psum (the
    # transpose of this step) is over d(tokens) in f32, not over the top_k
    # times larger d(rows) that autodiff would otherwise place after the sort.
    # (The sort itself stays in x.dtype: each shard's share of d(tokens) is
    # rounded once to it before the f32 psum; measured equal accuracy against
    # the f32 reference to ep=1, at half the gather bytes of an f32 sort.)
    xv = jax.lax.pcast(x.astype(jnp.float32), ep_axis, to="varying")
    r = rt.regroup(rt.Assignment(weights, chosen, groups, num_groups))
    xs = rt.sort_tokens(xv.astype(x.dtype), r, cfg.top_k)
    ys = ffn(xs, r.group_sizes, experts, jax.lax.axis_index(ep_axis) * local)
    # Each token's k rows live on up to k shards: sum the shards' f32 partials.
    return jax.lax.psum(rt.combine(ys, r, cfg.top_k, out_dtype=jnp.float32), ep_axis)

  rows = P(tok) if tok else P()
  specs = (rows, rows, rows, rows, expert_specs(experts, ep_axis))
  args = _placed(mesh, specs, (x, routing.weights, routing.experts, routing.groups, experts))
  fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=rows, axis_names=axes)
  return fn(*args).astype(x.dtype)


def _placed(mesh: Any, specs: Any, args: Any) -> Any:
  """``args`` resharded to ``specs``' explicit mesh axes (a shard_map takes
  operands over explicit axes only as their types are split; without this, a
  mesh mixing explicit and automatic axes gave cotangents typed unlike their
  primals); as they are on a mesh of automatic axes only."""
  explicit = {name for name, t in zip(mesh.axis_names, getattr(mesh, "axis_types", ()))
              if t == jax.sharding.AxisType.Explicit}
  if not explicit:
    return args

  def place(spec: P, a: Any) -> Any:
    dims = sharded.spec_dims(spec, a.ndim)
    kept = sharded.partition_spec(*(tuple(n for n in d if n in explicit) for d in dims))
    return jax.sharding.reshard(a, NamedSharding(mesh, kept))
  return jax.tree.map(place, specs, args, is_leaf=lambda s: isinstance(s, P))
