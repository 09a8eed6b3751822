"""Flax NNX ``MoEMLP``: router, SwiGLU experts (fused gate_up option), weighted
combine, optional LoRA adapters on the experts, expert parallelism over a mesh.

Parameters are stored in ``param_dtype`` (bf16 by default); routing math is f32;
the expert ragged_dots run in ``dtype`` (default: param_dtype).  Variable types:

* ``nnx.Param``: router kernel and base expert weights.
* ``LoRAParam`` (an ``nnx.Param``): LoRA ``a``/``b``; train only them with
  ``nnx.split(model, LoRAParam, ...)`` or ``wrt=LoRAParam``, or set
  ``MoEConfig.freeze_base`` which stops the base weights' gradients.
* ``RouterBias`` (an ``nnx.Variable``, not a Param): the DeepSeek score-correction
  bias, updated outside the gradient (``update_router_bias``).
* ``QuantizedWeight`` / ``WeightScale`` (``nnx.Variable``s, not Params): after
  ``quantize_experts``, the fp8 expert weights and their block scales (frozen;
  LoRA adapters on top still train).

The module just gathers its variables into ``functional``'s params pytree, so the
NNX block and the pure function compute exactly the same thing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragdot.moe import functional as F
from ragdot.moe import routing as rt
from ragdot.moe.config import MoEConfig


class LoRAParam(nnx.Param):
  """Trainable LoRA factor of an expert projection."""


class RouterBias(nnx.Variable):
  """DeepSeek-V3 per-expert selection bias (not trained by gradient)."""


class QuantizedWeight(nnx.Variable):
  """fp8 expert weights of a projection (``MoEMLP.quantize_experts``; frozen)."""


class WeightScale(nnx.Variable):
  """Block scales of a projection's fp8 expert weights (frozen)."""


_SAME = object()


class MoEMLP(nnx.Module):
  """MoE SwiGLU MLP on ``x[..., hidden]``.

  Args:
    cfg: ``MoEConfig``.
    rngs: ``nnx.Rngs``.
    param_dtype: storage dtype of router/expert/LoRA weights (bf16 default).
    dtype: compute dtype of the expert matmuls (default param_dtype).
    mesh, ep_axis: run the experts under expert parallelism over mesh axis
      ``ep_axis`` (None: no shard_map).  Expert weights are created sharded
      over ``ep_axis`` on their leading dim, with that sharding as metadata
      (``nnx.get_partition_spec`` gives ``P(ep_axis, None, ...)``).
    token_axes: the mesh axes the tokens are split over (``"auto"``: the
      axes other than ``ep_axis`` whose sizes divide the token count; see
      ``parallel.token_split``).
    lora_init_b_zero: standard LoRA init (``b = 0``: adapters start as no-ops).
  """

  def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.bfloat16,
               dtype: Any = None, mesh: Any = None, ep_axis: str = "ep",
               token_axes: Any = "auto", lora_init_b_zero: bool = True):
    self.cfg = cfg
    for name, value in (("param_dtype", param_dtype), ("dtype", dtype or param_dtype)):
      if not jnp.issubdtype(jnp.dtype(value), jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {jnp.dtype(value)}")
    self.param_dtype = jnp.dtype(param_dtype)
    self.dtype = jnp.dtype(dtype or param_dtype)
    if mesh is not None:
      F.check_ep_mesh(mesh, ep_axis, cfg.num_experts)
    self.mesh = mesh
    self.ep_axis = ep_axis
    self.token_axes = token_axes if isinstance(token_axes, str) else tuple(token_axes)
    p = F.init_params(rngs.params(), cfg, jnp.float32)
    cast = lambda a: a.astype(self.param_dtype)
    self.router = nnx.Param(cast(p["router"]))
    if "router_bias" in p:
      self.router_bias = RouterBias(p["router_bias"])
    for name in cfg.projections:
      setattr(self, name, self._expert(nnx.Param, cast(p[name])))
    for name in cfg.targets:
      b = p["lora"][name]["b"]
      setattr(self, f"lora_{name}_a", self._expert(LoRAParam, cast(p["lora"][name]["a"])))
      setattr(self, f"lora_{name}_b",
              self._expert(LoRAParam, cast(jnp.zeros_like(b) if lora_init_b_zero else b)))

  def _expert(self, kind: type, value: jax.Array) -> nnx.Variable:
    """A variable of per-expert ``value`` (leading dim E): with a mesh, sharded
    over ``ep_axis`` and carrying that sharding as metadata."""
    if self.mesh is None:
      return kind(value)
    return kind(value, out_sharding=(self.ep_axis,) + (None,) * (value.ndim - 1),
                mesh=self.mesh)

  def params(self) -> dict:
    """The functional params pytree (current values)."""
    p = {"router": self.router[...]}
    if self.cfg.scoring == "deepseek":
      p["router_bias"] = self.router_bias[...]
    for name in self.cfg.projections:
      p[name] = getattr(self, name)[...]
      if hasattr(self, f"{name}_scale"):
        p[f"{name}_scale"] = getattr(self, f"{name}_scale")[...]
    if self.cfg.targets:
      p["lora"] = {name: {"a": getattr(self, f"lora_{name}_a")[...],
                          "b": getattr(self, f"lora_{name}_b")[...]}
                   for name in self.cfg.targets}
    return p

  def quantize_experts(self, block: tuple[int, int] = (128, 128),
                       dtype: Any = jnp.float8_e4m3fn) -> None:
    """Replaces each projection's expert weights by ``dtype`` (e4m3 / e5m2)
    ones with f32 scales per ``block`` of (k, n) (``functional.quantize_experts``),
    held as frozen ``QuantizedWeight`` / ``WeightScale`` variables; the expert
    ragged_dots then take them through ``rhs_scale`` (W8A16 on Hopper)."""
    p = F.quantize_experts(self.params(), self.cfg, block, dtype)  # (raises if quantized already)
    for name in self.cfg.projections:
      setattr(self, name, self._expert(QuantizedWeight, p[name]))
      setattr(self, f"{name}_scale", self._expert(WeightScale, p[f"{name}_scale"]))

  def __call__(self, x: jax.Array, adapter_ids: jax.Array | None = None, *,
               mesh: Any = _SAME, reference: bool = False) -> jax.Array:
    """``x[..., d] -> [..., d]`` in x.dtype.

    ``mesh`` overrides the module's mesh for this call (None: one shard);
    ``reference=True`` uses the per-token dense f32 path instead (for checks).
    """
    params = self.params()
    if reference:
      return F.reference_moe_mlp(params, x, self.cfg, adapter_ids=adapter_ids).astype(x.dtype)
    mesh = self.mesh if mesh is _SAME else mesh
    y = F.moe_mlp(params, x, self.cfg, adapter_ids=adapter_ids, mesh=mesh,
                  ep_axis=self.ep_axis, token_axes=self.token_axes, dtype=self.dtype)
    return y.astype(x.dtype)

  def routing(self, x: jax.Array, adapter_ids: jax.Array | None = None) -> rt.Routing:
    x2, ids = F.flat_tokens(x, adapter_ids)
    return F.route(self.params(), x2, self.cfg, ids)

  def update_router_bias(self, x: jax.Array, rate: float = 1e-3) -> None:
    """DeepSeek aux-loss-free balancing: raise the bias of under-loaded experts
    and lower it of over-loaded ones by ``rate`` (an expert at exactly the mean
    load keeps its bias).  The load counts experts, whatever the adapters."""
    if self.cfg.scoring != "deepseek":
      return
    x2, _ = F.flat_tokens(x)
    _, experts = F.expert_choices(self.params(), x2, self.cfg)
    e = self.cfg.num_experts
    # (one_hot, not bincount's scatter: tokens may be split over explicit axes)
    count = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.int32), axis=(0, 1))
    # (integers: E * count equals the total exactly when the load is the mean)
    step = jnp.sign(count.sum() - e * count).astype(jnp.float32)
    self.router_bias[...] = self.router_bias[...] + rate * step


def shard_moe_state(state: Any, mesh: Any, ep_axis: str = "ep") -> Any:
  """Places an NNX state (or any pytree with path names): leaves under a MoEMLP
  expert attribute get ``P(ep_axis)`` on their leading dim, others are replicated."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  expert_names = set(F.EXPERT_KEYS)

  def place(path, leaf):
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    is_expert = any(isinstance(k, str) and (k in expert_names or k.startswith("lora_"))
                    for k in keys)
    spec = P(ep_axis) if is_expert and np.ndim(leaf) >= 3 else P()
    return jax.device_put(leaf, NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(place, state)
