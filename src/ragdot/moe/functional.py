"""Pure-function MoE MLP (no flax): a params pytree in, activations out.

Params (a dict; ``E`` experts, ``A`` adapters, shapes of ``MoEConfig.proj_shape``)::

  router:        [d, E]        router kernel (routing math is f32)
  router_bias:   [E]           DeepSeek score-correction bias (selection only, no grad)
  gate_up | gate, up, down:    [E, k, n] expert weights
  lora: {proj: {"a": [E, A, k, r], "b": [E, A, r, n]}}   LoRA adapters (optional)

``moe_mlp`` routes on device, sorts the ``tokens * top_k`` rows by group, runs
the expert SwiGLU with ragdot ragged_dots (under expert parallelism when given a
mesh, see ``parallel.py``) and takes the weighted sum over k.
``reference_moe_mlp`` is the per-token dense f32 computation with LoRA merged into
the weights (``W + scale * A @ B``), for checking.
"""

from __future__ import annotations

import math

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ragdot
from ragdot import scales
from ragdot import sharded
from ragdot import validate
from ragdot.moe import routing as rt
from ragdot.moe.config import MoEConfig

EXPERT_KEYS = ("gate_up", "gate", "up", "down", "lora",
               # block scales of fp8 expert weights (``quantize_experts``)
               "gate_up_scale", "gate_scale", "up_scale", "down_scale")


def init_params(key: jax.Array, cfg: MoEConfig, dtype: Any = jnp.bfloat16) -> dict:
  """Random params (fan-in scaled normals).  LoRA ``b`` is random too (not the
  usual 0) so that checks see the adapters; ``block.MoEMLP`` zeroes it by default."""
  keys = iter(jax.random.split(key, 4 + 2 * len(cfg.projections)))
  e, d = cfg.num_experts, cfg.hidden
  normal = lambda shape, fan_in: (jax.random.normal(next(keys), shape, jnp.float32)
                                  / np.sqrt(fan_in)).astype(dtype)
  params = {"router": normal((d, e), d)}
  if cfg.scoring == "deepseek":
    params["router_bias"] = jnp.zeros((e,), jnp.float32)
  for name in cfg.projections:
    k, n = cfg.proj_shape(name)
    params[name] = normal((e, k, n), k)
  if cfg.targets:
    a, r = cfg.num_adapters, cfg.lora_rank
    params["lora"] = {}
    for name in cfg.targets:
      k, n = cfg.proj_shape(name)
      params["lora"][name] = {"a": normal((e, a, k, r), k), "b": normal((e, a, r, n), 4 * r)}
  return params


def split_params(params: dict) -> tuple[dict, dict]:
  """(router params, expert params): the latter are sharded over experts."""
  router = {k: v for k, v in params.items() if k not in EXPERT_KEYS}
  experts = {k: v for k, v in params.items() if k in EXPERT_KEYS}
  return router, experts


def route(params: dict, x: jax.Array, cfg: MoEConfig,
          adapter_ids: jax.Array | None = None) -> rt.Routing:
  """Router on ``x[tokens, d]`` (f32 math) -> sorted layout over E*A groups."""
  return rt.regroup(assignment(params, x, cfg, adapter_ids))


def assignment(params: dict, x: jax.Array, cfg: MoEConfig,
               adapter_ids: jax.Array | None = None) -> rt.Assignment:
  """Router on ``x[tokens, d]`` (f32 math) -> each token's choices (per
  token: no sort over the tokens).  ``adapter_ids[tokens]`` picks each token's
  adapter (needed when ``cfg.num_adapters > 1``): concrete ids out of
  ``[0, num_adapters)`` raise ValueError; traced ones are clipped into it, so a
  token never reaches another expert's weights."""
  weights, experts = expert_choices(params, x, cfg)
  if cfg.num_adapters > 1 and adapter_ids is None:
    raise ValueError("num_adapters > 1 needs adapter_ids[tokens]")
  if adapter_ids is not None and cfg.num_adapters > 1:
    adapter_ids = _checked_adapter_ids(adapter_ids, cfg.num_adapters)
  return rt.assign(weights, experts, cfg.num_experts, adapter_ids=adapter_ids,
                   num_adapters=cfg.adapters)


def _checked_adapter_ids(adapter_ids: jax.Array, num_adapters: int) -> jax.Array:
  if not jnp.issubdtype(jnp.result_type(adapter_ids), jnp.integer):
    raise TypeError(f"adapter_ids must be integers, got {jnp.result_type(adapter_ids)}")
  if not isinstance(adapter_ids, jax.core.Tracer):
    ids = np.asarray(adapter_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= num_adapters):
      raise ValueError(f"adapter_ids must be in [0, num_adapters={num_adapters}), got values"
                       f" in [{ids.min()}, {ids.max()}]")
  return jnp.clip(adapter_ids, 0, num_adapters - 1)


def expert_choices(params: dict, x: jax.Array, cfg: MoEConfig
                   ) -> tuple[jax.Array, jax.Array]:
  """Router on ``x[tokens, d]`` (f32 math) -> (weights f32[tokens, top_k],
  experts int32[tokens, top_k]): each token's experts and combine weights."""
  w = params["router"]
  if cfg.freeze_base:
    w = jax.lax.stop_gradient(w)
  logits = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  if cfg.scoring == "deepseek":
    weights, experts = rt.deepseek_top_k(
        logits, cfg.top_k, bias=params.get("router_bias"), n_group=cfg.n_group,
        topk_group=cfg.topk_group, renormalize=cfg.renormalize,
        routed_scaling_factor=cfg.routed_scaling_factor)
  else:
    weights, experts = rt.softmax_top_k(
        logits, cfg.top_k, renormalize=cfg.renormalize,
        routed_scaling_factor=cfg.routed_scaling_factor)
  return weights, experts.astype(jnp.int32)


def expert_ffn(xs: jax.Array, group_sizes: jax.Array, experts: dict, cfg: MoEConfig, *,
               expert_offset: jax.Array | None = None,
               ragged_dot_fn: Any = None) -> jax.Array:
  """SwiGLU of every sorted row through its expert (and adapter).

  Args:
    xs: ``[rows, d]`` rows sorted by group (``expert * A + adapter``).
    group_sizes: ``[E * A]`` rows per group (all experts).
    experts: expert params; under expert parallelism only the shard's
      ``E_local`` experts (leading dim), starting at expert ``expert_offset``.
    expert_offset: first local expert (traced is fine) or None (all experts).
    ragged_dot_fn: optional ``fn(lhs, rhs, group_sizes) -> out`` replacing
      ragdot (benchmarks against other grouped matmuls; no group_offset).

  Returns:
    ``[rows, d]`` in xs.dtype; rows of non-local experts are exactly 0.
  """
  a = cfg.adapters
  expert_sizes = group_sizes.reshape(cfg.num_experts, a).sum(-1).astype(jnp.int32) if a > 1 \
      else group_sizes
  lora_offset = None if expert_offset is None else expert_offset * a
  if ragged_dot_fn is None:
    dot = lambda x, w, gs, go, scale=None: ragdot.ragged_dot(
        x, w, gs, precision=cfg.precision, group_offset=go, implementation=cfg.implementation,
        rhs_scale=scale)
  else:
    if expert_offset is not None:
      raise ValueError("ragged_dot_fn is only supported without expert parallelism")
    dot = lambda x, w, gs, go: ragged_dot_fn(x, w, gs)
  dtype = xs.dtype

  def proj(name: str, x: jax.Array) -> jax.Array:
    w, scale = experts[name], experts.get(f"{name}_scale")
    if scale is not None and ragged_dot_fn is not None:
      w, scale = scales.dequantize(w, scale, dtype), None
    if scale is None and (ragged_dot_fn is not None or not validate.weight_only(x, w)):
      w = w.astype(dtype)  # (fp8 experts beside 16-bit rows stay fp8: W8A16)
    if cfg.freeze_base:
      w = jax.lax.stop_gradient(w)
      scale = None if scale is None else jax.lax.stop_gradient(scale)
    y = (dot(x, w, expert_sizes, expert_offset) if scale is None else
         dot(x, w, expert_sizes, expert_offset, scale))
    if name in cfg.targets:
      la, lb = experts["lora"][name]["a"], experts["lora"][name]["b"]
      la = la.reshape((-1,) + la.shape[2:]).astype(dtype)  # [E_local * A, k, r]
      lb = lb.reshape((-1,) + lb.shape[2:]).astype(dtype)  # [E_local * A, r, n]
      t = dot(x, la, group_sizes, lora_offset)
      y = (y.astype(jnp.float32)
           + cfg.lora_scale * dot(t, lb, group_sizes, lora_offset).astype(jnp.float32))
    return y.astype(jnp.float32)

  if cfg.fused_gate_up:
    gate, up = jnp.split(proj("gate_up", xs), 2, axis=-1)
  else:
    gate, up = proj("gate", xs), proj("up", xs)
  h = (jax.nn.silu(gate) * up).astype(dtype)
  return proj("down", h).astype(dtype)


def flat_tokens(x: jax.Array, adapter_ids: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array | None]:
  """``x[..., d]`` as ``[tokens, d]`` and ``adapter_ids[...]`` as ``[tokens]``.
  On a mesh of explicit axes a split of a token dim other than the first (e.g.
  the sequence of ``[B, S, d]``) is gathered first: the flattening reshape
  cannot keep it (the MoE layer splits the tokens again over its ``token_axes``)."""
  def flat(a: jax.Array, features: int) -> jax.Array:
    lead = a.ndim - features
    dims = sharded.split_dims(a)
    if any(dims[1:lead]):
      a = jax.sharding.reshard(a, sharded.partition_spec(dims[0], *((),) * (lead - 1),
                                                         *dims[lead:]))
    return a.reshape((-1,) + a.shape[lead:])
  return flat(x, 1), None if adapter_ids is None else flat(adapter_ids, 0)


def check_params(params: dict, cfg: MoEConfig) -> None:
  """Raise ValueError naming the first entry of ``params`` whose shape is not the
  one ``cfg`` gives (module docstring), or KeyError naming a missing one: a LoRA
  rank other than ``cfg.lora_rank`` would otherwise run, scaled by the config's
  ``lora_alpha / lora_rank``."""
  e, a, r = cfg.num_experts, cfg.num_adapters, cfg.lora_rank
  want = {("router",): (cfg.hidden, e)}
  if cfg.scoring == "deepseek":
    want[("router_bias",)] = (e,)
  for name in cfg.projections:
    want[(name,)] = (e,) + cfg.proj_shape(name)
  for name in cfg.targets:
    k, n = cfg.proj_shape(name)
    want[("lora", name, "a")] = (e, a, k, r)
    want[("lora", name, "b")] = (e, a, r, n)
  for path, shape in want.items():
    leaf = params
    for i, key in enumerate(path):
      if not isinstance(leaf, dict) or key not in leaf:
        raise KeyError(f"params lack {'/'.join(path[:i + 1])} (needed by the MoEConfig)")
      leaf = leaf[key]
    if tuple(np.shape(leaf)) != shape:
      raise ValueError(f"params {'/'.join(path)} must have shape {shape} for the MoEConfig,"
                       f" got {tuple(np.shape(leaf))}")


def check_ep_mesh(mesh: Any, ep_axis: str, num_experts: int) -> None:
  """Raise ValueError unless ``mesh`` has axis ``ep_axis`` and its size divides
  ``num_experts`` (each shard holds the same number of experts)."""
  if ep_axis not in mesh.axis_names:
    raise ValueError(f"ep_axis={ep_axis!r} is not an axis of the mesh {mesh.axis_names}")
  if num_experts % int(mesh.shape[ep_axis]):
    raise ValueError(f"mesh axis {ep_axis!r} of size {mesh.shape[ep_axis]} must divide"
                     f" num_experts={num_experts}")


def moe_mlp(params: dict, x: jax.Array, cfg: MoEConfig, *,
            adapter_ids: jax.Array | None = None, mesh: Any = None,
            ep_axis: str = "ep", dtype: Any = None, manual: str = "auto",
            token_axes: Any = "auto", ragged_dot_fn: Any = None) -> jax.Array:
  """MoE MLP on ``x[..., d]`` -> same shape (dtype ``dtype`` or x.dtype).

  With ``mesh`` (having axis ``ep_axis``) sort, experts and combine run under
  expert parallelism (``parallel.sharded_moe_experts``); otherwise on one shard.
  ``adapter_ids[...]`` (same leading shape as x) picks each token's adapter.
  ``manual``: which mesh axes the shard_map makes manual; ``token_axes``: the
  mesh axes the tokens are split over (default: the other axes whose sizes
  divide the token count; see ``parallel.token_split``).
  """
  if x.ndim < 1 or x.shape[-1] != cfg.hidden:
    raise ValueError(f"x must be [..., hidden={cfg.hidden}], got shape {x.shape}")
  if adapter_ids is not None and tuple(np.shape(adapter_ids)) != x.shape[:-1]:
    raise ValueError(f"adapter_ids must have x's leading shape {x.shape[:-1]}, got"
                     f" {tuple(np.shape(adapter_ids))}")
  if mesh is not None and ragged_dot_fn is not None:
    raise ValueError("ragged_dot_fn is only supported without expert parallelism (mesh=None)")
  if mesh is not None:
    check_ep_mesh(mesh, ep_axis, cfg.num_experts)
  check_params(params, cfg)
  lead = x.shape[:-1]
  dtype = jnp.dtype(dtype or x.dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"dtype must be a floating dtype (default: x's), got {dtype}")
  if mesh is not None and math.prod(lead) == 0:
    # No tokens: nothing to compute (XLA fails to compile a zero-size
    # shard_map operand: "expected ... GlobalToLocalShape", jax 0.11.2).
    return jnp.zeros(x.shape, dtype)
  x2, ids = flat_tokens(x, adapter_ids)
  chosen = assignment(params, x2, cfg, ids)
  _, experts = split_params(params)
  if mesh is not None:
    from ragdot.moe.parallel import sharded_moe_experts  # pylint: disable=g-import-not-at-top
    y = sharded_moe_experts(x2.astype(dtype), chosen, experts, cfg, mesh, ep_axis, manual,
                            token_axes=token_axes)
    return y.reshape(lead + y.shape[-1:])
  x2, chosen = _gathered((x2, chosen))
  routing = rt.regroup(chosen)
  xs = rt.sort_tokens(x2.astype(dtype), routing, cfg.top_k)
  ys = expert_ffn(xs, routing.group_sizes, experts, cfg, ragged_dot_fn=ragged_dot_fn)
  y = rt.combine(ys, routing, cfg.top_k)
  return y.reshape(lead + y.shape[-1:])


def _gathered(tree: Any) -> Any:
  """``tree``'s arrays that are split over explicit mesh axes, unsplit: one
  shard's sort runs over all the tokens."""
  def gather(a):
    if not any(sharded.split_dims(a)):
      return a
    return jax.sharding.reshard(a, jax.sharding.PartitionSpec())
  return jax.tree.map(gather, tree)


def quantize_experts(params: dict, cfg: MoEConfig, block: tuple[int, int] = (128, 128),
                     dtype: Any = jnp.float8_e4m3fn) -> dict:
  """``params`` with each projection's expert weights in ``dtype`` (e4m3 /
  e5m2) and their f32 scales (one per ``block`` of (k, n); a block larger than
  the weights is cut to their shape, any other must divide it) under
  ``<projection>_scale``, as FP8 checkpoints store them (``scales.quantize``);
  the block runs them through ``rhs_scale``."""
  out = dict(params)
  for name in cfg.projections:
    if f"{name}_scale" in params:
      raise ValueError(f"projection {name!r} is quantized already (params hold {name}_scale)")
    w = params[name]
    out[name], out[f"{name}_scale"] = scales.quantize(
        w, (min(block[0], w.shape[1]), min(block[1], w.shape[2])), dtype)
  return out


def merged_weights(params: dict, cfg: MoEConfig, name: str) -> jax.Array:
  """f32 ``[E, A, k, n]`` = ``W[e] + scale * A[e, a] @ B[e, a]`` (A = 1 without LoRA;
  W dequantized where the params hold its block scales)."""
  w = params[name]
  if f"{name}_scale" in params:
    w = scales.dequantize(w, params[f"{name}_scale"], jnp.float32)
  w = w.astype(jnp.float32)[:, None]
  if name in cfg.targets:
    lo = params["lora"][name]
    w = w + cfg.lora_scale * jnp.einsum(
        "eakr,earn->eakn", lo["a"].astype(jnp.float32), lo["b"].astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST)
  return w


def reference_moe_mlp(params: dict, x: jax.Array, cfg: MoEConfig, *,
                      adapter_ids: jax.Array | None = None) -> jax.Array:
  """Per-token dense f32 reference: every token through its k experts, with
  LoRA merged into the weights; same routing as ``moe_mlp``.  Returns f32."""
  check_params(params, cfg)
  hi = jax.lax.Precision.HIGHEST
  lead = x.shape[:-1]
  x2, ids = flat_tokens(x, adapter_ids)
  chosen = assignment(params, x2, cfg, ids)  # (per token: no sort over split tokens)
  x2 = x2.astype(jnp.float32)
  a_idx = (jnp.zeros(x2.shape[0], jnp.int32) if ids is None or cfg.adapters == 1
           else _checked_adapter_ids(ids, cfg.num_adapters))  # (clipped, as moe_mlp's)
  if cfg.freeze_base:
    params = dict(params)
    params.update({p: jax.lax.stop_gradient(params[p]) for p in params
                   if p.removesuffix("_scale") in cfg.projections})  # (as expert_ffn)

  def apply(name, h, spec):  # h[tokens, (E,) k_in] -> [tokens, E, n], each token's adapter
    w = merged_weights(params, cfg, name)  # [E, A, k, n]; A = 1 without LoRA on it
    y = jnp.einsum(spec, h, w, precision=hi)
    idx = a_idx if w.shape[1] > 1 else jnp.zeros_like(a_idx)
    return jnp.take_along_axis(y, idx[:, None, None, None], axis=2)[:, :, 0]

  if cfg.fused_gate_up:
    gate, up = jnp.split(apply("gate_up", x2, "tk,eakn->tean"), 2, axis=-1)
  else:
    gate, up = apply("gate", x2, "tk,eakn->tean"), apply("up", x2, "tk,eakn->tean")
  y_all = apply("down", jax.nn.silu(gate) * up, "tek,eakn->tean")  # [tokens, E, d]
  # combine matrix: token t gives weight w_tj to expert e_tj.
  one_hot = jax.nn.one_hot(chosen.experts, cfg.num_experts)  # [tokens, k, E]
  comb = jnp.einsum("tk,tke->te", chosen.weights, one_hot, precision=hi)
  y = jnp.einsum("te,ted->td", comb, y_all, precision=hi)
  return y.reshape(lead + y.shape[-1:])
