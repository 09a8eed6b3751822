"""On-device token routing for MoE layers: scoring, top-k, sort by group, unsort.

Two scorers produce ``(weights[tokens, top_k] f32, experts[tokens, top_k] int32)``:

* ``softmax_top_k``: softmax over experts, top-k, optional renormalisation
  (Qwen3 / Mixtral style).
* ``deepseek_top_k``: DeepSeek-V3 style: sigmoid scores; a per-expert bias
  (aux-loss-free load balancing) is added for *selection only*; experts are split
  into ``n_group`` groups, each group is scored by the sum of its two best biased
  scores, only the best ``topk_group`` groups may be chosen; the weights are the
  unbiased scores of the chosen experts, optionally renormalised, times
  ``routed_scaling_factor``.

``make_routing`` then lays the ``tokens * top_k`` assignments out for ragged_dot:
sorted by group id (the expert, or ``expert * num_adapters + adapter`` for LoRA
experts), with on-device group sizes.  Nothing here syncs to the host.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import ad
import numpy as np

from ragdot import traced_primitive as tp
from ragdot.manual_axes import make_varying, varying_axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  """How the ``tokens * top_k`` rows are laid out for ragged_dot.

  order: int32[tokens*top_k], row r of the sorted layout is flat assignment
    ``order[r]`` (token ``order[r] // top_k``).
  position: int32[tokens*top_k], the inverse permutation: flat assignment a
    sits at sorted row ``position[a]``.
  group_sizes: int32[num_groups], rows per group in the sorted layout (groups
    are experts, or (expert, adapter) pairs ``expert * A + adapter``).
  weights: [tokens, top_k] f32 combine weights; experts: int32[tokens, top_k].
  groups: int32[tokens, top_k], each assignment's group (``experts``, or
    ``expert * A + adapter``): what ``regroup`` sorts a slice of tokens by.
  """

  order: jax.Array
  group_sizes: jax.Array
  weights: jax.Array
  experts: jax.Array
  position: jax.Array
  groups: jax.Array

  @property
  def num_groups(self) -> int:
    return self.group_sizes.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Assignment:
  """Each token's ``top_k`` choices before the sort (what ``regroup`` lays
  out): weights f32, experts and groups int32, all ``[tokens, top_k]``; groups
  are experts, or ``expert * A + adapter``; ``num_groups`` (static) of them."""

  weights: jax.Array
  experts: jax.Array
  groups: jax.Array
  num_groups: int = dataclasses.field(metadata=dict(static=True))


def softmax_top_k(logits: jax.Array, top_k: int, *, renormalize: bool = True,
                  routed_scaling_factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Softmax top-k of ``logits[tokens, E]`` in f32 -> (weights, experts)."""
  _check_top_k(top_k, logits.shape[-1])
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights * routed_scaling_factor, experts.astype(jnp.int32)


def check_int(name: str, value: Any, *, minimum: int) -> None:
  """Raise TypeError unless ``value`` is an int (numpy's too; not a bool),
  ValueError if it is below ``minimum``; both name ``name``."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {value!r}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_top_k(top_k: int, num_experts: int) -> None:
  check_int("top_k", top_k, minimum=1)
  if top_k > num_experts:
    raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, E={num_experts}")


def check_expert_groups(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
  """Raise ValueError unless DeepSeek's group-limited routing can choose ``top_k``
  of ``num_experts`` experts split into ``n_group`` groups, ``topk_group`` of them
  open to a token."""
  _check_top_k(top_k, num_experts)
  check_int("n_group", n_group, minimum=1)
  check_int("topk_group", topk_group, minimum=1)
  if num_experts % n_group:
    raise ValueError(f"n_group={n_group} must divide num_experts={num_experts}")
  if not 1 <= topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
    raise ValueError(f"need 1 <= topk_group <= n_group and top_k <= topk_group * E / n_group;"
                     f" got top_k={top_k}, n_group={n_group}, topk_group={topk_group}, E={num_experts}")


def deepseek_top_k(logits: jax.Array, top_k: int, *, bias: jax.Array | None = None,
                   n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
                   routed_scaling_factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V3 sigmoid + bias, group-limited top-k -> (weights, experts).

  Args:
    logits: ``[tokens, E]`` router logits (cast to f32).
    bias: optional ``[E]`` score-correction bias, used for choosing experts
      only (it gets no gradient).
    n_group: expert groups (must divide E); topk_group: groups a token may use
      (``top_k <= topk_group * E / n_group``).
  """
  tokens, num_experts = logits.shape
  check_expert_groups(num_experts, top_k, n_group, topk_group)
  per_group = num_experts // n_group
  scores = jax.nn.sigmoid(logits.astype(jnp.float32))
  choice = scores
  if bias is not None:
    choice = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
  choice = jax.lax.stop_gradient(choice)  # selection only; weights carry the gradient
  if n_group > 1 and topk_group < n_group:
    grouped = choice.reshape(tokens, n_group, per_group)
    best2 = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)  # [tokens, n_group]
    _, keep = jax.lax.top_k(best2, topk_group)
    # (one_hot compares, where a scatter would drop the tokens' split on an explicit mesh)
    group_mask = jnp.any(jax.nn.one_hot(keep, n_group, dtype=bool), axis=-2)
    expert_mask = jnp.repeat(group_mask, per_group, axis=1)
    choice = jnp.where(expert_mask, choice, -jnp.inf)
  _, experts = jax.lax.top_k(choice, top_k)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if renormalize:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return weights * routed_scaling_factor, experts.astype(jnp.int32)


def make_routing(weights: jax.Array, experts: jax.Array, num_experts: int, *,
                 adapter_ids: jax.Array | None = None, num_adapters: int = 1) -> Routing:
  """Sorted layout for ``experts[tokens, top_k]``.

  With ``adapter_ids[tokens]`` (LoRA), row groups are (expert, adapter) pairs
  ``expert * num_adapters + adapter``: sorted this way the rows are also sorted
  by expert, so the base weights use ``expert_group_sizes`` of the same layout.
  """
  return regroup(assign(weights, experts, num_experts, adapter_ids=adapter_ids,
                        num_adapters=num_adapters))


def assign(weights: jax.Array, experts: jax.Array, num_experts: int, *,
           adapter_ids: jax.Array | None = None, num_adapters: int = 1) -> Assignment:
  """``make_routing``'s choices per token, without the sort (per token only:
  under data parallelism each shard sorts its own tokens' with ``regroup``)."""
  groups = experts.astype(jnp.int32)
  if adapter_ids is not None and num_adapters > 1:
    groups = groups * num_adapters + adapter_ids.astype(jnp.int32)[:, None]
  return Assignment(weights.astype(jnp.float32), experts.astype(jnp.int32), groups,
                    num_experts * num_adapters)


def regroup(a: Assignment | Routing) -> Routing:
  """The sorted layout of ``a``'s tokens (``a``'s per-token fields: of an
  ``Assignment``, or of a ``Routing`` sliced to some of its tokens)."""
  weights, experts, groups, num_groups = a.weights, a.experts, a.groups, a.num_groups
  flat = groups.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  position = jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=jnp.int32), unique_indices=True)
  group_sizes = jnp.bincount(flat, length=num_groups).astype(jnp.int32)
  return Routing(order, group_sizes, weights.astype(jnp.float32), experts.astype(jnp.int32),
                 position, groups)


def expert_group_sizes(routing: Routing, num_experts: int) -> jax.Array:
  """Rows per expert (sums the adapter groups of each expert)."""
  return routing.group_sizes.reshape(num_experts, -1).sum(-1).astype(jnp.int32)


def top_k_routing(logits: jax.Array, top_k: int, *, renormalize: bool = True) -> Routing:
  """Softmax top-k routing of ``logits[tokens, num_experts]`` (f32 math)."""
  weights, experts = softmax_top_k(logits, top_k, renormalize=renormalize)
  return make_routing(weights, experts, logits.shape[-1])


# Both layout changes are gathers whose transposes are gathers too: autodiff of
# a gather would scatter-add the cotangent (atomics; for bf16 a compare-and-swap
# loop).  Each is a primitive linear in its first operand (the routing is
# integer data): its JVP applies it to the tangent, its transpose is the other
# gather, and under vmap it is one op on the batch's concatenated layouts.


def _expand_fn(params: dict[str, Any]) -> Any:
  del params

  def fn(x, order, position):
    del position
    top_k = order.shape[0] // max(x.shape[0], 1)
    return x[order // max(top_k, 1)]
  return fn


def _expand_transpose(g, x, order, position, **params):
  del order, params
  tokens = x.aval.shape[0]
  if tp.is_zero(g):
    return [None, None, None]
  if tokens == 0:  # varying like the cotangent (in shard_map)
    return [make_varying(jnp.zeros(x.aval.shape, g.dtype), varying_axes(g)), None, None]
  # Token t's rows sit at position[t*top_k : (t+1)*top_k]: gather and sum them.
  dx = g[position].reshape((tokens, -1) + g.shape[1:]).astype(jnp.float32).sum(1)
  return [dx.astype(g.dtype), None, None]


def _unsort_fn(params: dict[str, Any]) -> Any:
  del params
  return lambda y_sorted, order, position: y_sorted[position]


def _unsort_transpose(g, y_sorted, order, position, **params):
  del y_sorted, position, params
  # a permutation: its transpose is the inverse gather
  return [None if tp.is_zero(g) else g[order], None, None]


def _linear_jvp(op, primals, tangents, **params):
  del params
  out = op(*primals)
  if tp.is_zero(tangents[0]):
    return out, ad.Zero.from_primal_value(out)
  return out, op(tangents[0], *primals[1:])


def _batched(op, args, dims, **params):
  """The op on a batch of layouts as one op on their concatenation: batch
  element b's rows are offset by b times its rows, so its indices (order and
  position, over ``tokens * top_k`` rows) are offset by b times that count.
  It stays the primitive, whose transpose is a gather (a plain batched gather
  would scatter-add its cotangent under ``jax.grad`` of a vmapped block)."""
  del params
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  x, order, position = (jnp.moveaxis(a, d, 0) if d is not None
                        else jnp.broadcast_to(a, (size,) + a.shape)
                        for a, d in zip(args, dims))
  rows = order.shape[1]  # tokens * top_k of one element
  shift = (jnp.arange(size, dtype=order.dtype) * rows)[:, None]
  out = op(x.reshape((-1,) + x.shape[2:]), (order + shift).reshape(-1),
           (position + shift).reshape(-1))
  return out.reshape((size, -1) + out.shape[1:]), 0


def _expand(x: jax.Array, order: jax.Array, position: jax.Array) -> jax.Array:
  return tp.bind(_expand_p, x, order, position)


def _unsort(y_sorted: jax.Array, order: jax.Array, position: jax.Array) -> jax.Array:
  return tp.bind(_unsort_p, y_sorted, order, position)


_expand_p = tp.define(
    "ragdot_expand_rows", _expand_fn, jvp=functools.partial(_linear_jvp, _expand),
    transpose=_expand_transpose, batch=functools.partial(_batched, _expand))
_unsort_p = tp.define(
    "ragdot_unsort_rows", _unsort_fn, jvp=functools.partial(_linear_jvp, _unsort),
    transpose=_unsort_transpose, batch=functools.partial(_batched, _unsort))


def sort_tokens(x: jax.Array, routing: Routing, top_k: int) -> jax.Array:
  """``x[tokens, d] -> [tokens*top_k, d]`` rows grouped by expert."""
  del top_k  # implied by the routing's shapes
  return _expand(x, routing.order, routing.position)


def combine(y_sorted: jax.Array, routing: Routing, top_k: int,
            out_dtype: Any = None) -> jax.Array:
  """Unsorts ``y_sorted[tokens*top_k, d]`` and takes the weighted sum over k.

  The sum is f32; the result is ``out_dtype`` (default: y_sorted's dtype).
  """
  tokens = routing.weights.shape[0]
  y = _unsort(y_sorted, routing.order, routing.position)
  y = y.reshape(tokens, top_k, y_sorted.shape[-1]).astype(jnp.float32)
  return jnp.einsum("tkd,tk->td", y, routing.weights).astype(out_dtype or y_sorted.dtype)


def expert_load(routing: Routing, num_experts: int) -> jax.Array:
  """Fraction of the ``tokens * top_k`` assignments each expert got (f32[E])."""
  gs = expert_group_sizes(routing, num_experts).astype(jnp.float32)
  return gs / jnp.maximum(gs.sum(), 1.0)
