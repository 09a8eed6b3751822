"""On-device token routing for MoE layers: top-k, sort by expert, unsort.

Everything is jit-safe: group sizes are computed on device and never synced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  """How the ``tokens * top_k`` rows are laid out for ragged_dot.

  order: int32[tokens*top_k], row r of the sorted layout is flat assignment
    ``order[r]`` (token ``order[r] // top_k``).
  group_sizes: int32[num_experts], rows per expert in the sorted layout.
  weights: [tokens, top_k] combine weights; experts: int32[tokens, top_k].
  """

  order: jax.Array
  group_sizes: jax.Array
  weights: jax.Array
  experts: jax.Array


def top_k_routing(logits: jax.Array, top_k: int, *, renormalize: bool = True) -> Routing:
  """Softmax top-k routing of ``logits[tokens, num_experts]`` (f32 math)."""
  num_experts = logits.shape[-1]
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return Routing(order, group_sizes, weights, experts.astype(jnp.int32))


def sort_tokens(x: jax.Array, routing: Routing, top_k: int) -> jax.Array:
  """``x[tokens, d] -> [tokens*top_k, d]`` rows grouped by expert."""
  return x[routing.order // top_k]


def combine(y_sorted: jax.Array, routing: Routing, top_k: int) -> jax.Array:
  """Unsorts ``y_sorted[tokens*top_k, d]`` and takes the weighted sum over k."""
  tokens = routing.weights.shape[0]
  y = jnp.zeros_like(y_sorted).at[routing.order].set(y_sorted)
  y = y.reshape(tokens, top_k, -1).astype(jnp.float32)
  return jnp.einsum("tkd,tk->td", y, routing.weights).astype(y_sorted.dtype)
