"""Expert parallelism: ep in {1, 2, 4, 8} (8 simulated CPU devices) gives the same
outputs and gradients as ep=1 and as the per-token dense f32 reference.

Tolerances (max |diff| / max |ref| per leaf): f32 1e-5 vs the reference and
vs ep=1; bf16 (bf16 params and activations, f32 accumulation) 3e-2 vs the f32
reference and 1e-2 vs ep=1 in bf16.
"""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragdot.moe import functional as F
from ragdot.moe.config import MoEConfig

F32_TOL, BF16_REF_TOL, BF16_EP1_TOL = 1e-5, 3e-2, 1e-2
T = 48


def _mesh(shape, names):
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _loss_and_grads(fn, params, x):
  cot = jax.random.normal(jax.random.key(9), x.shape, jnp.float32)
  loss = lambda p, x: jnp.sum(fn(p, x).astype(jnp.float32) * cot)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


def _compare(got, ref, tol):
  (lg, gg), (lr, gr) = got, ref
  assert _rel(lg, lr) <= tol, (float(lg), float(lr))
  errs = jax.tree.map(_rel, gg, gr)
  assert max(jax.tree.leaves(errs)) <= tol, errs


@functools.lru_cache(maxsize=None)
def _case(cfg, dtype):
  params = F.init_params(jax.random.key(0), cfg, dtype)
  x = jax.random.normal(jax.random.key(1), (T, cfg.hidden), jnp.float32).astype(dtype)
  ids = None
  if cfg.num_adapters > 1:
    ids = jax.random.randint(jax.random.key(2), (T,), 0, cfg.num_adapters)
  return params, x, ids


CFG = MoEConfig(hidden=32, intermediate=16, num_experts=8, top_k=2, implementation="xla")


@functools.lru_cache(maxsize=None)
def _reference(cfg, dtype):
  params, x, ids = _case(cfg, dtype)
  f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype != jnp.int32 else a, t)
  with jax.default_matmul_precision("highest"):
    return _loss_and_grads(lambda p, x: F.reference_moe_mlp(p, x, cfg, adapter_ids=ids),
                           f32(params), f32(x))


@functools.lru_cache(maxsize=None)
def _ep1(cfg, dtype):
  params, x, ids = _case(cfg, dtype)
  with jax.default_matmul_precision("highest"):
    return _loss_and_grads(lambda p, x: F.moe_mlp(p, x, cfg, adapter_ids=ids), params, x)


@pytest.mark.parametrize("cfg", [CFG], ids=["softmax-fused"])
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_ep_matches_reference_f32(cfg, ep):
  # DeepSeek routing + split gate/up under EP=8 is covered in test_moe_lora.py (NNX block).
  params, x, ids = _case(cfg, jnp.float32)
  mesh = _mesh((ep,), ("ep",))
  with jax.default_matmul_precision("highest"):
    got = _loss_and_grads(lambda p, x: F.moe_mlp(p, x, cfg, adapter_ids=ids, mesh=mesh), params, x)
  _compare(got, _ep1(cfg, jnp.float32), F32_TOL)
  _compare(got, _reference(cfg, jnp.float32), F32_TOL)


def test_ep8_bf16_matches_ep1_and_reference():
  params, x, ids = _case(CFG, jnp.bfloat16)
  mesh = _mesh((8,), ("ep",))
  got = _loss_and_grads(lambda p, x: F.moe_mlp(p, x, CFG, mesh=mesh), params, x)
  one = _loss_and_grads(lambda p, x: F.moe_mlp(p, x, CFG), params, x)
  _compare(got, one, BF16_EP1_TOL)
  _compare(got, _reference(CFG, jnp.bfloat16), BF16_REF_TOL)
  assert got[1][0]["gate_up"].dtype == jnp.bfloat16


@pytest.mark.parametrize("manual", ["all", "ep", "auto"])
def test_two_axis_mesh(manual):
  """A (dp=2, ep=4) mesh with x sharded over "dp" (automatic outside the experts)."""
  params, x, _ = _case(CFG, jnp.float32)
  mesh = _mesh((2, 4), ("dp", "ep"))
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp")))
  with jax.default_matmul_precision("highest"):
    got = _loss_and_grads(lambda p, x: F.moe_mlp(p, x, CFG, mesh=mesh, manual=manual), params, x)
  _compare(got, _reference(CFG, jnp.float32), F32_TOL)


def test_rejects_ep_not_dividing_experts():
  cfg = MoEConfig(hidden=8, intermediate=8, num_experts=6, top_k=2)
  params, x = {}, jnp.zeros((4, 8))
  with pytest.raises(ValueError, match="must divide"):
    F.moe_mlp(params, x, cfg, mesh=_mesh((4,), ("ep",)))


def test_ep_bench_smoke_times_each_strategy_and_the_psum():
  from ragdot.moe import ep_bench  # pylint: disable=g-import-not-at-top
  rows = ep_bench.main(["--small", "--ep", "2", "--iterations", "1"])
  got = {(r["ep"], r["strategy"]) for r in rows}
  assert got == {(2, "psum only"), (2, "group_offset"), (2, "masked")}
  assert all(r["ms"] > 0 and r["method"] == "host: 2 devices" for r in rows)
  assert all(r["wall_ms"] == r["ms"] for r in rows if r["strategy"] != "psum only")


def test_ep_bench_from_json_summarizes_and_plots(tmp_path, capsys):
  from ragdot.moe import ep_bench  # pylint: disable=g-import-not-at-top
  rows = [dict(ep=2, strategy="psum only", ms=0.3),
          dict(ep=2, strategy="group_offset", ms=2.0, wall_ms=2.0),
          dict(ep=2, strategy="masked", ms=5.0), dict(ep=1, strategy="group_offset", ms=2.5,
                                                       wall_ms=3.0),
          dict(ep=1, strategy="masked", ms=2.5)]
  path = tmp_path / "ep.json"
  path.write_text(json.dumps(rows))
  png = tmp_path / "ep.png"
  assert ep_bench.main(["--from-json", str(path), "--plot", str(png)]) == rows
  out = capsys.readouterr().out
  assert "ep=2: group_offset is 2.50x faster" in out and "ep=1: group_offset is 1.00x" in out
  assert "1.50x ep=1's step (wall clock)" in out
  assert png.stat().st_size > 1000
  # The plot compares like with like: wall clocks only where every step has one.
  assert ep_bench.step_times(rows) == ({(2, "group_offset"): 2.0, (2, "masked"): 5.0,
                                        (1, "group_offset"): 2.5, (1, "masked"): 2.5},
                                       "as measured")
  for r in rows:
    r.setdefault("wall_ms", r["ms"] + 0.25)
  times, clock = ep_bench.step_times(rows)
  assert clock == "wall clock" and times[(1, "group_offset")] == 3.0
  assert times[(1, "masked")] == 2.75 and (2, "psum only") not in times


def test_ep_bench_strategies_compute_the_same_block():
  # The masked workaround and group_offset must give the same loss and grads
  # (the benchmark compares their speed, so they must do the same work).
  from ragdot.moe import ep_bench, parallel  # pylint: disable=g-import-not-at-top
  cfg = MoEConfig(hidden=32, intermediate=16, num_experts=8, top_k=2, implementation="xla")
  params = F.init_params(jax.random.key(0), cfg, jnp.float32)
  x = jax.random.normal(jax.random.key(1), (T, cfg.hidden), jnp.float32)
  cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  mesh = _mesh((4,), ("ep",))
  router, experts = F.split_params(params)
  sharded = {**router, **parallel.shard_experts(experts, mesh)}
  with jax.default_matmul_precision("highest"):
    got = ep_bench.make_steps(cfg, mesh, "group_offset")[0](sharded, x, cot)
    want = ep_bench.make_steps(cfg, mesh, "masked")[0](sharded, x, cot)
  _compare(got, want, F32_TOL)


def test_ep_reduces_tokens_not_expert_rows():
  # The forward psum is of the [T, d] partial outputs and the backward's of
  # d(tokens) [T, d]: no collective carries the top_k times larger [T*k, d] rows.
  cfg = MoEConfig(hidden=32, intermediate=16, num_experts=8, top_k=4, implementation="xla")
  params = F.init_params(jax.random.key(0), cfg, jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (T, cfg.hidden), jnp.float32).astype(jnp.bfloat16)
  mesh = _mesh((4,), ("ep",))
  loss = lambda p, x: jnp.sum(F.moe_mlp(p, x, cfg, mesh=mesh).astype(jnp.float32) ** 2)
  hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()
  reduced = re.findall(r"(\w+)\[([\d,]+)\]", "\n".join(
      line.split("all-reduce")[0] for line in hlo.splitlines() if "all-reduce" in line))
  shapes = {tuple(int(d) for d in dims.split(",")) for _, dims in reduced}
  assert (T, cfg.hidden) in shapes, shapes
  assert (T * cfg.top_k, cfg.hidden) not in shapes, shapes


def _row_dims(fn, params, x):
  """Leading dims of the 2-D arrays with ``hidden`` columns in fn's compiled
  (per-device) HLO: the sorted expert rows show up as ``[rows, hidden]``."""
  hlo = jax.jit(fn).lower(params, x).compile().as_text()
  return {int(r) for r in re.findall(rf"\[(\d+),{CFG.hidden}\]", hlo)}


@pytest.mark.parametrize("manual,token_axes,split", [
    ("auto", "auto", True), ("all", "auto", True), ("auto", ("dp",), True),
    ("ep", "auto", False), ("auto", (), False)])
def test_two_axis_mesh_splits_tokens_over_dp(manual, token_axes, split):
  """On a (dp=2, ep=4) mesh each device sorts and computes only its dp slice's
  rows (T * top_k / 2), unless the tokens are not split; results match either way."""
  params, x, _ = _case(CFG, jnp.float32)
  mesh = _mesh((2, 4), ("dp", "ep"))
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp")))
  fn = lambda p, x: F.moe_mlp(p, x, CFG, mesh=mesh, manual=manual, token_axes=token_axes)
  rows = T * CFG.top_k
  dims = _row_dims(fn, params, x)
  assert (rows in dims) != split and (rows // 2 in dims) == split, dims
  with jax.default_matmul_precision("highest"):
    got = _loss_and_grads(fn, params, x)
  _compare(got, _reference(CFG, jnp.float32), F32_TOL)


def test_token_split_rules():
  from ragdot.moe.parallel import token_split  # pylint: disable=g-import-not-at-top
  mesh = _mesh((2, 1, 4), ("dp", "fsdp", "ep"))
  assert token_split(mesh, 48) == ("dp",)  # size-1 axes are left out
  assert token_split(mesh, 48, manual="all") == ("dp",)
  assert token_split(mesh, 47) == ()  # "auto" falls back to replicated tokens
  mesh3 = _mesh((2, 3, 1), ("dp", "tp", "ep"))
  assert token_split(mesh3, 12) == ("dp", "tp")
  assert token_split(mesh3, 10) == ("dp",)  # the axes that divide, in mesh order
  assert token_split(mesh3, 9) == ("tp",)
  assert token_split(mesh, 48, manual="ep") == ()
  assert token_split(mesh, 48, token_axes=("fsdp", "dp")) == ("fsdp", "dp")
  for bad, match in [(("ep",), "other than ep_axis"), (("tp",), "other than ep_axis"),
                     (("dp", "dp"), "distinct"), ("dp", "'auto' or a tuple")]:
    with pytest.raises(ValueError, match=match):
      token_split(mesh, 48, token_axes=bad)
  with pytest.raises(ValueError, match="does not divide the 47 tokens"):
    token_split(mesh, 47, token_axes=("dp",))
  with pytest.raises(ValueError, match="manual='ep'"):
    token_split(mesh, 48, manual="ep", token_axes=("dp",))
  with pytest.raises(ValueError, match="manual must be"):
    token_split(mesh, 48, manual="some")


def test_two_axis_mesh_with_tokens_not_dividing_dp():
  """47 tokens on dp=2: "auto" keeps them whole (replicated over dp); still exact."""
  params, x, _ = _case(CFG, jnp.float32)
  x = x[:47]
  mesh = _mesh((2, 4), ("dp", "ep"))
  with jax.default_matmul_precision("highest"):
    got = _loss_and_grads(lambda p, x: F.moe_mlp(p, x, CFG, mesh=mesh), params, x)
    want = _loss_and_grads(lambda p, x: F.reference_moe_mlp(p, x, CFG), params, x)
  _compare(got, want, F32_TOL)


def test_explicit_two_axis_mesh():
  """A (dp=2, ep=4) mesh of explicit axes, x split over "dp": the router's
  choices stay per token (no sort over the split tokens), each shard sorts its
  own; loss and grads match the reference and x's gradient keeps the split."""
  params, x, _ = _case(CFG, jnp.float32)
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    x = jax.device_put(x, jax.sharding.PartitionSpec("dp"))
    got = _loss_and_grads(lambda p, x: F.moe_mlp(p, x, CFG, mesh=mesh), params, x)
  _compare(got, _reference(CFG, jnp.float32), F32_TOL)
  assert jax.typeof(got[1][1]).sharding.spec[0] == "dp"


def test_explicit_mesh_with_the_sequence_split():
  """x[B, S, d] and the adapter ids split over "dp" along S (sequence
  parallelism) on an explicit mesh: the flattening gathers S, the layer splits
  the tokens again; matches the reference with LoRA adapters."""
  cfg = MoEConfig(hidden=32, intermediate=16, num_experts=8, top_k=2, num_adapters=2,
                  lora_rank=4, implementation="xla")
  params = F.init_params(jax.random.key(0), cfg, jnp.float32)
  x = jax.random.normal(jax.random.key(1), (2, 24, 32), jnp.float32)
  ids = jnp.arange(48).reshape(2, 24) % 2
  want = F.reference_moe_mlp(params, x, cfg, adapter_ids=ids)
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  seq = jax.sharding.PartitionSpec(None, "dp")
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    got = jax.jit(lambda p, x, i: F.moe_mlp(p, x, cfg, adapter_ids=i, mesh=mesh))(
        params, jax.device_put(x, seq), jax.device_put(ids, seq))
  assert _rel(got, want) <= F32_TOL


@pytest.mark.parametrize("ep", [None, 2])
def test_no_tokens(ep):
  """An empty batch (0 tokens, also as a (2, 0) leading shape) gives an empty
  result and empty gradients, with and without expert parallelism (the final
  reshape to ``lead + (-1,)`` could not infer its size from 0 elements)."""
  params, _, _ = _case(CFG, jnp.float32)
  mesh = None if ep is None else _mesh((ep,), ("ep",))
  fn = lambda p, x: F.moe_mlp(p, x, CFG, mesh=mesh)
  for lead in [(0,), (2, 0)]:
    x = jnp.zeros(lead + (CFG.hidden,), jnp.float32)
    assert fn(params, x).shape == x.shape
    assert F.reference_moe_mlp(params, x, CFG).shape == x.shape
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(fn(p, x)), (0, 1)))(params, x)
    assert grads[1].shape == x.shape
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads[0]) if g.size)


@pytest.mark.parametrize("types", [("Explicit", "Auto"), ("Auto", "Explicit")])
@pytest.mark.parametrize("manual", ["auto", "all", "ep"])
def test_mesh_mixing_explicit_and_automatic_axes(types, manual):
  """A (dp=2, ep=4) mesh with one explicit and one automatic axis, x unsplit:
  loss and gradients match the reference (the shard_map operands are split
  over the explicit axes their specs name, or the cotangents' types differ)."""
  params, x, _ = _case(CFG, jnp.float32)
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=jax.devices()[:8],
                       axis_types=tuple(getattr(jax.sharding.AxisType, t) for t in types))
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    got = _loss_and_grads(lambda p, x: F.moe_mlp(p, x, CFG, mesh=mesh, manual=manual),
                          params, x)
  _compare(got, _reference(CFG, jnp.float32), F32_TOL)
