"""The MoE block's checks of its configuration and inputs, the sharding its
expert weights are created with, and DeepSeek's router-bias update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ragdot.moe import functional as F
from ragdot.moe.block import MoEMLP
from ragdot.moe.config import MoEConfig

BASE = dict(hidden=16, intermediate=8, num_experts=8, top_k=2, implementation="xla")


def _mesh(n, name="ep", axis_type=jax.sharding.AxisType.Auto):
  return jax.make_mesh((n,), (name,), devices=jax.devices()[:n], axis_types=(axis_type,))


@pytest.mark.parametrize("change, error, names", [
    (dict(hidden=0), ValueError, "hidden"),
    (dict(intermediate=-1), ValueError, "intermediate"),
    (dict(num_experts=8.0), TypeError, "num_experts"),
    (dict(top_k=True), TypeError, "top_k"),
    (dict(top_k=9), ValueError, "top_k"),
    (dict(num_adapters=-1), ValueError, "num_adapters"),
    (dict(num_adapters=2, lora_rank=0), ValueError, "lora_rank"),
    (dict(scoring="deepseek", n_group=0), ValueError, "n_group"),
    (dict(scoring="deepseek", n_group=3), ValueError, "n_group"),
    (dict(scoring="deepseek", n_group=4, topk_group=5), ValueError, "topk_group"),
    (dict(scoring="deepseek", n_group=4, topk_group=1, top_k=3), ValueError, "top_k"),
    (dict(num_adapters=2, lora_targets="down"), TypeError, "lora_targets"),
    (dict(num_adapters=2, lora_targets=["gate"]), ValueError, "lora_targets"),
    (dict(num_adapters=2, lora_targets=["down", "down"]), ValueError, "duplicates"),
    (dict(routed_scaling_factor="2.5"), TypeError, "routed_scaling_factor"),
    (dict(routed_scaling_factor=None), TypeError, "routed_scaling_factor"),
    (dict(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor"),
    (dict(routed_scaling_factor=-1.0), ValueError, "routed_scaling_factor"),
    (dict(renormalize="False"), TypeError, "renormalize"),
    (dict(fused_gate_up=2), TypeError, "fused_gate_up"),
    (dict(freeze_base=None), TypeError, "freeze_base"),
    (dict(num_adapters=2, lora_alpha="x"), TypeError, "lora_alpha"),
    (dict(implementation=3), ValueError, "implementation"),
    (dict(implementation="cuda"), ValueError, "implementation"),
])
def test_bad_config_raises_naming_the_field(change, error, names):
  with pytest.raises(error, match=names):
    MoEConfig(**{**BASE, **change})


def test_numpy_and_jax_scalars_are_stored_as_python_values():
  assert MoEConfig(**BASE, renormalize=jnp.bool_(False), lora_alpha=None).renormalize is False
  cfg = MoEConfig(**BASE, routed_scaling_factor=jnp.float32(2.5), renormalize=np.bool_(False),
                  fused_gate_up=1, num_adapters=2, lora_alpha=np.float32(8))
  assert cfg.routed_scaling_factor == 2.5 and type(cfg.routed_scaling_factor) is float
  assert cfg.renormalize is False and cfg.fused_gate_up is True and cfg.lora_scale == 1.0
  assert hash(cfg) == hash(MoEConfig(**BASE, routed_scaling_factor=2.5, renormalize=False,
                                     num_adapters=2, lora_alpha=8.0))


def test_lora_targets_list_keeps_the_config_hashable():
  cfg = MoEConfig(**BASE, num_adapters=2, lora_rank=4, lora_targets=["down"])
  assert cfg.lora_targets == ("down",) and cfg.targets == ("down",)
  f = jax.jit(lambda x, cfg: x * cfg.top_k, static_argnums=1)
  assert float(f(jnp.float32(1), cfg)) == 2.0


@pytest.mark.parametrize("kw, error, names", [
    (dict(param_dtype=jnp.int8), TypeError, "param_dtype"),
    (dict(dtype=jnp.int32), TypeError, "dtype"),
    (dict(mesh="data"), ValueError, "ep_axis"),
    (dict(mesh="ep3"), ValueError, "num_experts"),
])
def test_bad_block_arguments_raise(kw, error, names):
  if kw.get("mesh") == "data":
    kw = dict(mesh=_mesh(2, "data"))
  elif kw.get("mesh") == "ep3":
    kw = dict(mesh=_mesh(3))
  with pytest.raises(error, match=names):
    MoEMLP(MoEConfig(**BASE), rngs=nnx.Rngs(0), **kw)


def test_bad_call_inputs_raise_naming_them():
  cfg = MoEConfig(**BASE, num_adapters=2, lora_rank=4)
  params = F.init_params(jax.random.key(0), cfg, jnp.float32)
  x = jnp.ones((4, 16))
  ids = jnp.zeros((4,), jnp.int32)
  with pytest.raises(ValueError, match="hidden=16"):
    F.moe_mlp(params, x[:, :12], cfg, adapter_ids=ids)
  with pytest.raises(ValueError, match="adapter_ids"):
    F.moe_mlp(params, x, cfg, adapter_ids=ids[:3])
  with pytest.raises(ValueError, match="ep_axis"):
    F.moe_mlp(params, x, cfg, adapter_ids=ids, mesh=_mesh(2, "data"))
  with pytest.raises(TypeError, match="adapter_ids"):
    F.moe_mlp(params, x, cfg, adapter_ids=ids.astype(jnp.float32))
  with pytest.raises(TypeError, match="dtype"):  # (its rows would all be 0)
    F.moe_mlp(params, x.astype(jnp.int32), cfg, adapter_ids=ids)
  with pytest.raises(TypeError, match="dtype"):
    F.moe_mlp(params, x, cfg, adapter_ids=ids, dtype=jnp.int32)


def test_adapter_ids_out_of_range():
  # Concrete ids past the adapters raise; traced ones are clipped, so a token
  # never runs through another expert's weights.
  cfg = MoEConfig(**BASE, num_adapters=2, lora_rank=4)
  params = F.init_params(jax.random.key(0), cfg, jnp.float32)
  x = jax.random.normal(jax.random.key(1), (6, 16))
  ids = jnp.array([0, 1, 2, 1, -1, 0], jnp.int32)
  for bad in (ids, ids.at[4].set(0)):
    with pytest.raises(ValueError, match=r"adapter_ids must be in \[0, num_adapters=2\)"):
      F.moe_mlp(params, x, cfg, adapter_ids=bad)
  got = jax.jit(lambda ids: F.moe_mlp(params, x, cfg, adapter_ids=ids))(ids)
  want = F.reference_moe_mlp(params, x, cfg, adapter_ids=jnp.clip(ids, 0, 1))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  ref = jax.jit(lambda ids: F.reference_moe_mlp(params, x, cfg, adapter_ids=ids))(ids)
  np.testing.assert_allclose(ref, want, rtol=1e-6, atol=1e-6)  # (clipped there too)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])  # Explicit: make_mesh's default
def test_expert_weights_are_created_sharded_over_ep(axis_type):
  mesh = _mesh(4, axis_type=getattr(jax.sharding.AxisType, axis_type))
  cfg = MoEConfig(**BASE, num_adapters=2, lora_rank=4)
  model = MoEMLP(cfg, rngs=nnx.Rngs(0), mesh=mesh)
  specs = nnx.get_partition_spec(nnx.state(model))
  assert specs["gate_up"].get_value() == P("ep", None, None)
  assert specs["lora_down_a"].get_value() == P("ep", None, None, None)
  assert specs["router"].get_value() == P()
  for name in ("gate_up", "down", "lora_gate_up_b"):
    assert len(getattr(model, name)[...].sharding.device_set) == 4, name
  alone = MoEMLP(cfg, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(model.down[...], np.float32),
                                np.asarray(alone.down[...], np.float32))
  model.quantize_experts(block=(8, 8))
  specs = nnx.get_partition_spec(nnx.state(model))
  assert specs["down"].get_value() == P("ep", None, None)
  assert specs["down_scale"].get_value() == P("ep", None, None)
  x = jax.random.normal(jax.random.key(1), (8, 16)).astype(jnp.bfloat16)
  ids = jnp.arange(8, dtype=jnp.int32) % 2
  np.testing.assert_array_equal(np.asarray(model(x, ids), np.float32),
                                np.asarray(model(x, ids, mesh=None), np.float32))


def test_update_router_bias_with_lora_adapters():
  # One-hot tokens on an identity router send each token to its own expert
  # (top_k 1): loads [2, 3, 2, 1] of 8, mean 2.  Adapters do not change the load.
  cfg = MoEConfig(hidden=4, intermediate=8, num_experts=4, top_k=1, scoring="deepseek",
                  num_adapters=2, lora_rank=2, implementation="xla")
  model = MoEMLP(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32)
  model.router[...] = 10 * jnp.eye(4)
  x = jax.nn.one_hot(jnp.array([0, 0, 1, 1, 1, 2, 2, 3]), 4)
  before = np.asarray(model.router_bias[...])
  # (a small rate: the biased scores still pick the same experts on the second update)
  model.update_router_bias(x, rate=0.01)
  np.testing.assert_allclose(np.asarray(model.router_bias[...]) - before,
                             [0.0, -0.01, 0.0, 0.01], atol=1e-7)
  nnx.jit(lambda m, x: m.update_router_bias(x, rate=0.01))(model, x)
  np.testing.assert_allclose(np.asarray(model.router_bias[...]) - before,
                             [0.0, -0.02, 0.0, 0.02], atol=1e-7)


def test_block_on_an_explicit_mesh_with_the_tokens_split():
  """A (dp=2, ep=2) mesh of explicit axes (make_mesh's default), x split over
  dp, DeepSeek routing limited to 2 of 4 expert groups: the call (expert
  parallel, one shard, and reference=True) and update_router_bias run and
  agree with the unsplit call (no scatter or sort over the split tokens)."""
  cfg = MoEConfig(hidden=16, intermediate=8, num_experts=8, top_k=2, scoring="deepseek",
                  n_group=4, topk_group=2, implementation="xla")
  x = jax.random.normal(jax.random.key(1), (8, 16))
  mesh = jax.make_mesh((2, 2), ("dp", "ep"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  alone = MoEMLP(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32)
  want = alone(x, reference=True)
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    model = MoEMLP(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32, mesh=mesh)
    xs = jax.device_put(x, P("dp"))
    for got in (model(xs), model(xs, mesh=None), model(xs, reference=True)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    model.update_router_bias(xs, rate=0.01)
  alone.update_router_bias(x, rate=0.01)
  np.testing.assert_array_equal(np.asarray(model.router_bias[...]),
                                np.asarray(alone.router_bias[...]))
