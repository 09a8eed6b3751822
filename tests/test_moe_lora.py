"""LoRA experts and the flax NNX block.

The LoRA block (several adapters per batch, G = E * A groups, EP=4) equals the
per-token dense f32 block with merged weights ``W + (alpha/r) A @ B`` per
(expert, adapter): outputs and gradients (incl. the LoRA factors), f32 tol 1e-5.
``freeze_base`` zeroes base gradients; the NNX MoEMLP equals the pure function.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragdot.moe import functional as F
from ragdot.moe.block import LoRAParam, MoEMLP, shard_moe_state
from ragdot.moe.config import MoEConfig

TOL = 1e-5
CFG = MoEConfig(hidden=32, intermediate=16, num_experts=8, top_k=2, num_adapters=3,
                lora_rank=4, lora_targets=("gate_up", "down"), implementation="xla")


def _mesh(n):
  return jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _data(cfg, t=40):
  params = F.init_params(jax.random.key(0), cfg, jnp.float32)
  x = jax.random.normal(jax.random.key(1), (t, cfg.hidden))
  ids = jax.random.randint(jax.random.key(2), (t,), 0, cfg.num_adapters)
  cot = jax.random.normal(jax.random.key(3), (t, cfg.hidden))
  return params, x, ids, cot


def test_lora_ep_equals_merged_weights_and_freeze_base():
  params, x, ids, cot = _data(CFG)
  mesh = _mesh(4)

  def vg(fn, cfg):
    loss = lambda p, x: jnp.sum(fn(p, x, cfg).astype(jnp.float32) * cot)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

  ep = lambda p, x, cfg: F.moe_mlp(p, x, cfg, adapter_ids=ids, mesh=mesh)
  ref = lambda p, x, cfg: F.reference_moe_mlp(p, x, cfg, adapter_ids=ids)
  with jax.default_matmul_precision("highest"):
    (l, g), (lr, gr) = vg(ep, CFG), vg(ref, CFG)
    frozen = MoEConfig(**{**CFG.__dict__, "freeze_base": True})
    _, gf = vg(ep, frozen)
  assert _rel(l, lr) <= TOL
  errs = jax.tree.map(_rel, g, gr)
  assert max(jax.tree.leaves(errs)) <= TOL, errs
  assert float(jnp.abs(g[0]["lora"]["down"]["a"]).max()) > 0
  # the adapters matter: dropping them changes the output
  no_lora = MoEConfig(**{**CFG.__dict__, "num_adapters": 0})
  base = F.reference_moe_mlp(params, x, no_lora)
  assert _rel(base, ref(params, x, CFG)) > 1e-2
  # freeze_base: no gradient to router / base experts, LoRA grads unchanged
  for name in ("router", "gate_up", "down"):
    assert float(jnp.abs(gf[0][name]).max()) == 0.0
  assert max(jax.tree.leaves(jax.tree.map(_rel, gf[0]["lora"], g[0]["lora"]))) <= TOL


def test_nnx_block_matches_functional_bf16_ep8():
  """bf16 params, f32 routing: the NNX block under EP=8 equals the functional core
  on one shard, and the per-token f32 reference within bf16 tolerance (3e-2)."""
  cfg = MoEConfig(hidden=32, intermediate=16, num_experts=8, top_k=2, num_adapters=2,
                  lora_rank=4, scoring="deepseek", n_group=2, topk_group=1, fused_gate_up=False)
  mesh = _mesh(8)
  model = MoEMLP(cfg, rngs=nnx.Rngs(0), mesh=mesh, lora_init_b_zero=False)
  assert model.gate[...].dtype == jnp.bfloat16 and model.router_bias[...].dtype == jnp.float32
  graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
  assert set(nnx.to_pure_dict(lora)) == {f"lora_{p}_{f}" for p in cfg.projections for f in "ab"}
  lora, rest = shard_moe_state(lora, mesh), shard_moe_state(rest, mesh)
  x = jax.random.normal(jax.random.key(1), (2, 12, 32)).astype(jnp.bfloat16)
  ids = jax.random.randint(jax.random.key(2), (2, 12), 0, 2)

  @jax.jit
  def run(lora, rest):
    def loss(lora, **kw):
      y = nnx.merge(graphdef, lora, rest)(x, ids, **kw)
      return jnp.sum(y.astype(jnp.float32) ** 2), y
    (l, y), g = jax.value_and_grad(loss, has_aux=True)(lora)
    y_fn = F.moe_mlp(nnx.merge(graphdef, lora, rest).params(), x, cfg, adapter_ids=ids)
    y_ref = nnx.merge(graphdef, lora, rest)(x, ids, reference=True)
    (_, _), g_ref = jax.value_and_grad(loss, has_aux=True)(lora, reference=True)
    return y, y_fn, y_ref, g, g_ref

  y, y_fn, y_ref, g, g_ref = run(lora, rest)
  assert y.shape == x.shape and y.dtype == jnp.bfloat16
  assert _rel(y, y_fn) <= 1e-2
  assert _rel(y, y_ref) <= 3e-2
  errs = jax.tree.map(_rel, g, g_ref)
  assert max(jax.tree.leaves(errs)) <= 3e-2, errs


def _same_lora_training(monkeypatch, cfg, narrow, wide, x, ids, cot, record):
  """The LoRA loss and gradients of the block under EP=4 on ``narrow`` params
  (fp8 experts) equal those on ``wide`` (their bf16 values), bitwise; returns
  ``record(w, kwargs)`` of every ragged_dot call made."""
  mesh = _mesh(4)
  seen = []
  real = F.ragdot.ragged_dot

  def spy(x, w, *a, **kw):
    seen.append(record(w, kw))
    return real(x, w, *a, **kw)

  def vg(p):
    loss = lambda lora, x: jnp.sum(F.moe_mlp({**p, "lora": lora}, x, cfg, adapter_ids=ids,
                                             mesh=mesh).astype(jnp.float32) * cot)
    return jax.jit(jax.value_and_grad(loss))(p["lora"], x.astype(jnp.bfloat16))

  monkeypatch.setattr(F.ragdot, "ragged_dot", spy)
  (l8, g8), (l16, g16) = vg(narrow), vg(wide)
  assert float(l8) == float(l16)
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g16)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  return seen


def test_fp8_experts_beside_bf16_rows_stay_fp8(monkeypatch):
  """Frozen fp8 base experts with bf16 LoRA adapters (EP=4): ragged_dot gets
  the fp8 weights (W8A16; on the CPU's XLA backend widened, exactly), so the
  block equals the one on bf16 copies of them, outputs and LoRA gradients."""
  cfg = MoEConfig(**{**CFG.__dict__, "freeze_base": True})
  params, x, ids, cot = _data(cfg)
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  fp8 = {**params, **{n: params[n].astype(jnp.float8_e4m3fn) for n in cfg.projections}}
  wide = {**params, **{n: fp8[n].astype(jnp.bfloat16) for n in cfg.projections}}
  seen = _same_lora_training(monkeypatch, cfg, fp8, wide, x, ids, cot,
                              lambda w, kw: w.dtype)
  assert jnp.dtype(jnp.float8_e4m3fn) in seen


def test_fp8_experts_with_block_scales(monkeypatch):
  """Frozen experts quantized to e4m3 with 8 x 16 block scales
  (``F.quantize_experts``) and bf16 LoRA adapters, EP=4: each projection's
  ragged_dot gets the fp8 weights and their scales (``rhs_scale``), and the
  block equals the one on the dequantized bf16 weights (outputs and LoRA
  gradients, bitwise: XLA dequantizes the same way), and the f32 reference
  on the scaled weights."""
  cfg = MoEConfig(**{**CFG.__dict__, "freeze_base": True})
  params, x, ids, cot = _data(cfg)
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  quant = F.quantize_experts(params, cfg, block=(8, 16))
  for n in cfg.projections:
    k, m = cfg.proj_shape(n)
    assert quant[n].dtype == jnp.float8_e4m3fn
    assert quant[f"{n}_scale"].shape == (cfg.num_experts, k // 8, m // 16)
  deq = {n: F.scales.dequantize(quant[n], quant[f"{n}_scale"], jnp.bfloat16)
         for n in cfg.projections}
  wide = {**params, **deq}
  scaled = _same_lora_training(monkeypatch, cfg, quant, wide, x, ids, cot,
                                lambda w, kw: kw.get("rhs_scale") is not None)
  assert any(scaled)
  y = F.moe_mlp(quant, x.astype(jnp.bfloat16), cfg, adapter_ids=ids, mesh=_mesh(4))
  xb = x.astype(jnp.bfloat16)  # (the same routing in both)
  assert _rel(y, F.reference_moe_mlp(quant, xb, cfg, adapter_ids=ids)) <= 3e-2
  # the quantized weights are close to the bf16 ones they came from
  for n in cfg.projections:
    assert _rel(deq[n], params[n]) <= 0.07


def test_nnx_block_quantize_experts():
  """``MoEMLP.quantize_experts``: the expert weights become frozen e4m3
  ``QuantizedWeight`` variables with ``WeightScale`` blocks (no longer Params;
  the LoRA factors still are), placed with the experts under EP=4, and the
  block equals the functional block on the same quantized params."""
  from ragdot.moe.block import QuantizedWeight, WeightScale
  cfg = MoEConfig(hidden=32, intermediate=16, num_experts=8, top_k=2, num_adapters=2,
                  lora_rank=4, implementation="xla")
  mesh = _mesh(4)
  model = MoEMLP(cfg, rngs=nnx.Rngs(0), mesh=mesh, lora_init_b_zero=False)
  model.quantize_experts(block=(16, 16))
  assert model.gate_up[...].dtype == jnp.float8_e4m3fn
  assert isinstance(model.gate_up, QuantizedWeight) and isinstance(model.down_scale, WeightScale)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert "gate_up" not in params and "lora_gate_up_a" in params
  state = shard_moe_state(nnx.state(model), mesh)
  assert state["down_scale"][...].sharding.spec[0] == "ep"
  x = jax.random.normal(jax.random.key(1), (2, 12, 32)).astype(jnp.bfloat16)
  ids = jax.random.randint(jax.random.key(2), (2, 12), 0, 2)
  y = model(x, ids)
  p = model.params()
  assert p["gate_up_scale"].shape == (8, 2, 2)
  want = F.moe_mlp(p, x, cfg, adapter_ids=ids)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


def test_reference_with_lora_on_some_projections_and_frozen_scales():
  """reference_moe_mlp with several adapters and LoRA on the down projection
  only (its gate_up has one adapter slot) agrees with moe_mlp; with
  freeze_base and fp8 experts, neither gives the block scales a gradient."""
  cfg = MoEConfig(hidden=32, intermediate=16, num_experts=8, top_k=2, num_adapters=3,
                  lora_rank=4, lora_targets=("down",), implementation="xla", freeze_base=True)
  params, x, ids, cot = _data(cfg)
  with jax.default_matmul_precision("highest"):
    want = F.moe_mlp(params, x, cfg, adapter_ids=ids)
    got = F.reference_moe_mlp(params, x, cfg, adapter_ids=ids)
  assert np.isfinite(np.asarray(got)).all()
  assert _rel(got, want) <= TOL
  quantized = F.quantize_experts(params, cfg, block=(8, 8))
  for fn in (F.moe_mlp, F.reference_moe_mlp):
    grads = jax.grad(lambda p: jnp.sum(fn(p, x, cfg, adapter_ids=ids) * cot))(quantized)
    for name in ("gate_up_scale", "down_scale", "gate_up", "router"):
      assert float(jnp.abs(grads[name].astype(jnp.float32)).max()) == 0, (fn.__name__, name)
    assert float(jnp.abs(grads["lora"]["down"]["a"]).max()) > 0


def test_params_unlike_the_config_are_refused():
  """A LoRA rank, a projection or a router unlike the config raises ValueError
  naming the entry (a rank of 8 under a config of 4 used to run, scaled by
  alpha / 4); a missing adapter raises KeyError, in both the block and the
  reference."""
  params, x, ids, _ = _data(CFG)
  wider = F.init_params(jax.random.key(0), dataclasses.replace(CFG, lora_rank=8), jnp.float32)
  for fn in (F.moe_mlp, F.reference_moe_mlp):
    bad = dict(params, lora=wider["lora"])
    with pytest.raises(ValueError, match="lora/gate_up/a"):
      fn(bad, x, CFG, adapter_ids=ids)
    with pytest.raises(ValueError, match="down"):
      fn(dict(params, down=params["down"][:, :, :-1]), x, CFG, adapter_ids=ids)
    with pytest.raises(ValueError, match="router"):
      fn(dict(params, router=params["router"].T), x, CFG, adapter_ids=ids)
    with pytest.raises(KeyError, match="lora/down"):
      fn(dict(params, lora={"gate_up": params["lora"]["gate_up"]}), x, CFG, adapter_ids=ids)
