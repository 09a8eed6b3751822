"""Dispatch rules: explicit names honoured, automatic choice safe."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from ragdot import dispatch
from ragdot.backends import mosaic_dw, mosaic_fwd


def test_explicit_implementation_is_honoured_in_interpret_mode_without_gpu():
  choice = dispatch.choose("gmm", "mosaic", dtype=jnp.bfloat16)
  assert choice.implementation == "mosaic" and not choice.automatic
  assert choice.interpret == (jax.default_backend() != "gpu")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_automatic_choice_on_cpu_is_xla(dtype):
  if jax.default_backend() == "gpu":
    pytest.fail("CPU test run on a GPU machine")
  assert dispatch.choose("gmm", None, dtype=dtype).implementation == "xla"


def test_non_default_precision_is_recognised():
  assert dispatch._default_precision(None)
  assert dispatch._default_precision(jax.lax.Precision.DEFAULT)
  assert not dispatch._default_precision(jax.lax.Precision.HIGHEST)
  assert not dispatch._default_precision((jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST))


H200 = dispatch.Device("gpu", "NVIDIA H200", "9.0")
GATE_UP = dict(m=32768, k=2048, n=1536, g=128, num_groups=128)


def test_facts_from_call_arguments():
  lhs = jnp.zeros((32, 16), jnp.bfloat16)
  gs = jnp.zeros((8,), jnp.int32)
  f = dispatch.facts("gmm", lhs=lhs, rhs=jnp.zeros((4, 24, 16), jnp.bfloat16), group_sizes=gs,
                     group_offset=jnp.int32(0), transpose_rhs=True, out_dtype=jnp.float32,
                     precision=None)
  assert (f["m"], f["k"], f["n"], f["g"], f["num_groups"]) == (32, 16, 24, 4, 8)
  assert f["transpose_rhs"] and f["has_offset"]
  f = dispatch.facts("tgmm", lhs=lhs, rhs=jnp.zeros((32, 40), jnp.bfloat16), group_sizes=gs,
                     group_offset=None, num_groups=8, out_dtype=jnp.bfloat16, precision=None)
  assert (f["k"], f["n"], f["g"], f["has_offset"]) == (16, 40, 8, False)


def test_public_op_on_cpu_still_works():
  import ragdot
  out = ragdot.ragged_dot(jnp.ones((8, 16), jnp.bfloat16), jnp.ones((2, 16, 8), jnp.bfloat16),
                          jnp.array([3, 5], jnp.int32))
  assert out.shape == (8, 8) and float(out[0, 0]) == 16


def test_h200_automatic_choice_uses_the_table():
  c = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, **GATE_UP)
  assert c.implementation == "mosaic" and c.automatic and c.measured
  assert "measured entry" in c.reason
  # dX and dW have their own ops in the table.
  dx = dispatch.choose("gmm", None, dtype=jnp.bfloat16, transpose_rhs=True, device=H200,
                       **GATE_UP)
  dw = dispatch.choose("tgmm", None, dtype=jnp.bfloat16, device=H200, **GATE_UP)
  assert "gmm_t" in dx.reason or dx.measured
  want = {"mosaic": "MosaicDwConfig", "triton": "TritonConfig"}[dw.implementation]
  assert type(dw.config).__name__ == want and dw.measured


def test_swap_entry_fitted_to_the_call_rows_per_group():
  # Qwen3-30B gate_up at 2048 tokens borrows the 4096-token entry (256-row swap
  # tiles); with ~128 rows per group it runs 160-row tiles (v40c: 0.80x the time).
  full = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, **GATE_UP)
  half = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200,
                         **dict(GATE_UP, m=16384))
  assert full.config.swap and full.config.swap_rows + full.config.tail_rows > 256
  assert half.config == mosaic_fwd.one_tile_groups(full.config, 160)
  assert "swap tiles of 160 rows for 128 rows per group" in half.reason and not half.measured
  # A shard of that call: the full call's rows per group; Qwen3-30B's 6 MB experts
  # keep the row-major ring (v41f: 0.96x swap's time).
  shard = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, has_offset=True,
                          **dict(GATE_UP, m=16384, g=16))
  assert shard.config.ring and not shard.config.swap and shard.config.producer_zeros
  assert "swap tiles" not in shard.reason  # the ring runs: nothing to fit
  # gpt-oss-120b's shard (~128 rows per group, 17-33 MB experts): swap stays, its
  # consumers writing the zero rows (v41e: 0.83-0.90x the ring's time).
  for k, n in ((2880, 5760), (2880, 2880)):
    full = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, m=16384, k=k, n=n,
                           g=128, num_groups=128)
    ep = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, has_offset=True,
                         m=16384, k=k, n=n, g=16, num_groups=128)
    assert ep.config == dataclasses.replace(full.config, producer_zeros=False, zero_front=0)
    assert "consumer-written zeros for 128 rows per group" in ep.reason and not ep.measured
  # Qwen3-30B gate_up's dX shard at ~256 rows per group keeps swap too (v42f: the
  # ring 1.10-1.12x its time), its forward the ring (v42e).
  dx = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, has_offset=True,
                       transpose_rhs=True, m=32768, k=1536, n=2048, g=16, num_groups=128)
  assert dx.config.swap and dx.config.producer_zeros is False and not dx.config.zero_front
  assert "consumer-written zeros for 256 rows per group" in dx.reason
  # ... up to 1.25x the shard's fair share of rows, the ring above (v45a-b)
  assert dx.config.shard_ring_above == 1.25 and "ring above 1.25x" in dx.reason
  assert ep.config.shard_ring_above is None  # ~128 rows: swap whatever the rows
  fwd = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, has_offset=True,
                        **dict(GATE_UP, g=16))
  assert not fwd.config.swap and fwd.config.producer_zeros


def test_h200_rules_before_the_table():
  assert dispatch.choose("gmm", None, dtype=jnp.float32, device=H200, **GATE_UP).implementation == "xla"
  hi = dispatch.choose("gmm", None, dtype=jnp.bfloat16, precision=jax.lax.Precision.HIGHEST,
                       device=H200, **GATE_UP)
  assert hi.implementation == "xla" and "precision" in hi.reason
  odd = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200,
                        **dict(GATE_UP, k=2047))
  assert odd.implementation == "triton" and "multiples of 64" in odd.reason
  rows = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200,
                         **dict(GATE_UP, m=32765))
  assert rows.implementation == "triton" and "m=32765" in rows.reason
  thin = dispatch.choose("tgmm", None, dtype=jnp.bfloat16, device=H200, **dict(GATE_UP, n=16))
  assert thin.implementation == "triton"
  cpu = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=dispatch.Device("cpu"), **GATE_UP)
  assert cpu.implementation == "xla" and "platform cpu" in cpu.reason
  a100 = dispatch.choose("gmm", None, dtype=jnp.bfloat16,
                         device=dispatch.Device("gpu", "NVIDIA A100", "8.0"), **GATE_UP)
  assert a100.implementation == "triton" and a100.config is None and not a100.measured
  unknown = dispatch.choose("gmm", None, dtype=jnp.bfloat16,
                            device=dispatch.Device("gpu", "NVIDIA L4", "8.9"), **GATE_UP)
  assert unknown.implementation == "xla"


def test_config_shrinks_or_falls_back_to_fit_smem():
  # qwen3-30b down's entry (2 warpgroups, bm 128 x bn 256) with an f32 output
  # staging tile: whatever config comes back must fit, shrunk or replaced.
  c = dispatch.choose("gmm", None, dtype=jnp.bfloat16, out_dtype=jnp.float32, device=H200,
                      m=32768, k=768, n=2048, g=128)
  assert c.implementation == "mosaic"
  if c.config is not None:
    assert mosaic_fwd.fit_config(c.config, jnp.bfloat16, jnp.float32) == c.config


def test_group_offset_shard_uses_the_full_calls_entry():
  # An EP=8 shard (16 of 128 experts) has the full call's rows per group.
  full = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, **GATE_UP)
  shard = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, has_offset=True,
                          **dict(GATE_UP, g=16, num_groups=128))
  assert shard.measured
  # ... run as the shard call runs it: the producer writes the zero rows
  # (ring entries), with the epilogue split widened to fit its buffer.
  assert shard.config == mosaic_fwd.resolve_producer_zeros(full.config, True, jnp.bfloat16,
                                                            jnp.bfloat16)
  if full.config.ring:
    assert shard.config.producer_zeros is True and full.config.producer_zeros is None


@pytest.mark.parametrize("has_offset", [False, True], ids=["full", "shard"])
def test_f32_output_on_a_swap_entry_runs_the_row_major_ring(has_offset):
  # Swap's transposed stores take 16 bits: an f32 output refits the entry to its
  # row-major ring instead of failing (the Qwen3-30B gate_up forward entry is swap).
  got = dispatch.choose("gmm", None, dtype=jnp.bfloat16, out_dtype=jnp.float32, device=H200,
                        has_offset=has_offset,
                        **(dict(GATE_UP, g=16, num_groups=128) if has_offset else GATE_UP))
  full = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, **GATE_UP)
  assert full.config.swap, "the shipped entry is expected to be swap"
  assert got.implementation == "mosaic" and not got.config.swap and got.config.ring
  assert got.config.block_n == 256 and not got.config.tail_rows


def test_explicit_triton_gets_the_table_config_where_the_table_names_triton():
  # Qwen3-30B gate_up's decode forward (64 tokens x top-8 rows).
  decode = dict(GATE_UP, m=512)
  auto = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, **decode)
  if auto.implementation != "triton":
    pytest.fail(f"the shipped H200 table should pick Triton for the gate_up decode, got {auto}")
  explicit = dispatch.choose("gmm", "triton", dtype=jnp.bfloat16, device=H200, **decode)
  assert explicit.config == auto.config and not explicit.automatic


def test_explicit_implementation_on_gpu_gets_the_table_config():
  c = dispatch.choose("gmm", "mosaic", dtype=jnp.bfloat16, device=H200, **GATE_UP)
  assert not c.automatic and not c.interpret and c.config is not None
  x = dispatch.choose("gmm", "xla", dtype=jnp.bfloat16, device=H200, **GATE_UP)
  assert x.implementation == "xla" and x.config is None


def test_choose_is_cached_and_cheap():
  import time
  dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, **GATE_UP)
  t0 = time.perf_counter()
  for _ in range(1000):
    dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, **GATE_UP)
  assert (time.perf_counter() - t0) / 1000 < 1e-3


def test_backend_call_maps_user_ops():
  assert dispatch.backend_call("fwd", 2048, 1536) == dispatch.BackendCall("gmm", 2048, 1536, False)
  assert dispatch.backend_call("fwdbwd", 2048, 1536).table_op == "gmm"
  dx = dispatch.backend_call("dx", 2048, 1536)
  assert (dx.op, dx.k, dx.n, dx.table_op) == ("gmm", 1536, 2048, "gmm_t")
  assert dispatch.backend_call("dw", 2048, 1536).table_op == "tgmm"
  with pytest.raises(ValueError, match="user_op"):
    dispatch.backend_call("bwd", 1, 1)


def test_f32_weight_gradient_keeps_the_table_ring_in_32_column_chunks():
  # The table's dW configs are measured with bf16 output.  Mixtral's (the
  # 128 x 192 pingpong ring, 5 stages, one buffer of 64 x 64 chunks) keeps its
  # stages with an f32 output by staging it in 32-column chunks (v70).
  mixtral = dict(m=16384, k=4096, n=28672, g=8, num_groups=8)
  bf16 = dispatch.choose("tgmm", None, dtype=jnp.bfloat16, device=H200, **mixtral)
  f32 = dispatch.choose("tgmm", None, dtype=jnp.bfloat16, out_dtype=jnp.float32, device=H200,
                        **mixtral)
  assert f32.implementation == "mosaic" and bf16.config.pingpong
  assert f32.config == dataclasses.replace(bf16.config, epilogue_split=6)
  assert "refitted" in f32.reason
  # The shared ring (the f32 default where no table config fits) does not fit its
  # staging tile beside 3 stages either, so its epilogue is split (measured faster
  # than dropping to 2 stages, H200 2026-11-30).
  cfg = mosaic_dw.default_config(mixtral["m"], mixtral["k"], mixtral["n"], mixtral["g"],
                                 jnp.bfloat16, jnp.float32)
  assert cfg.num_compute_wgs == 2 and cfg.epilogue_split == 2 and cfg.num_stages == 3
  # Qwen3-30B down's 192 x 128 ring (4 stages, two buffers of 64 x 64 chunks) and
  # gate_up's 128 x 192 one (4 stages of 40 KiB) would keep their configs with f32
  # staging, but over ~256-row groups an f32 dW runs the shared-ring default
  # instead (pingpong_pays: measured faster, v71 70c).
  for shape, tile in ((dict(GATE_UP, k=768, n=2048), (192, 128)), (GATE_UP, (128, 192))):
    bf16 = dispatch.choose("tgmm", None, dtype=jnp.bfloat16, device=H200, **shape)
    f32 = dispatch.choose("tgmm", None, dtype=jnp.bfloat16, out_dtype=jnp.float32,
                          device=H200, **shape)
    assert (bf16.config.block_k, bf16.config.block_n) == tile and bf16.config.pingpong
    assert f32.implementation == "mosaic" and f32.config is None
    assert "kernel's default" in f32.reason
    fitted = mosaic_dw.fit_config(bf16.config, jnp.bfloat16, jnp.float32)
    assert fitted == bf16.config and fitted.num_stages == 4


def test_1k_token_dx_entries_take_six_stages_and_their_shards_the_four_stage_ring():
  # v41b / v42g: 6 stages on the fitted 80 + 16 swap tiles gained on these two dX calls
  # (0.96-0.98x) and lost on Qwen3-30B down's (1.02x), which keeps its own 4-stage entry.
  for k, n, stages in ((1536, 2048, 6), (3072, 4096, 6), (2048, 768, 4)):
    full = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, transpose_rhs=True,
                           m=8192, k=k, n=n, g=128, num_groups=128)
    assert full.measured and full.config.swap and full.config.num_stages == stages
    assert full.config.swap_rows + full.config.tail_rows == 96
    # Their EP=8 shards (~64 rows per group) run the row-major ring with producer zeros,
    # at no more than the 4 stages it was measured with.
    shard = dispatch.choose("gmm", None, dtype=jnp.bfloat16, device=H200, transpose_rhs=True,
                            has_offset=True, m=8192, k=k, n=n, g=16, num_groups=128)
    assert not shard.config.swap and shard.config.producer_zeros and shard.config.num_stages == 4


def test_fp8_rows_with_a_triton_w8a16_entry_take_the_fp8_form(tmp_path, monkeypatch):
  """fp8 x fp8 [g, k, n] borrows the W8A16 choice to widen its rows; a tuned
  W8A16 entry naming Triton (which cannot widen rows) leaves it the fp8 form."""
  import json  # pylint: disable=g-import-not-at-top
  from ragdot import tables  # pylint: disable=g-import-not-at-top
  data = json.loads((tables.TABLE_DIR / "nvidia_h200.json").read_text())
  data["entries"]["gmm/bfloat16+float8_e4m3fn/m512,k2048,n1536,g128"] = {
      "backend": "triton", "config": {"block_m": 64, "block_n": 128, "block_k": 64},
      "measured": True, "shape": [512, 2048, 1536, 128]}
  (tmp_path / "nvidia_h200.json").write_text(json.dumps(data))
  monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
  dispatch.clear_cache()
  try:
    shape = dict(m=512, k=2048, n=1536, g=128, num_groups=128, device=H200)
    w8a16 = dispatch.choose("gmm", None, dtype=jnp.bfloat16, rhs_dtype=jnp.float8_e4m3fn,
                            **shape)
    assert w8a16.implementation == "triton"
    fp8 = dispatch.choose("gmm", None, dtype=jnp.float8_e4m3fn, **shape)
    assert fp8.implementation == "mosaic" and not fp8.config.widen_rows
  finally:
    monkeypatch.delenv(tables.ENV_DIR)
    dispatch.clear_cache()


@pytest.mark.parametrize("cc", ["8.0", "8.9", "10.0"])
def test_mosaic_kernels_refuse_a_gpu_that_is_not_sm90(monkeypatch, cc):
  """Explicit implementation="mosaic" on an A100 / L4 / B200: NotImplementedError
  (which the automatic path falls back from), not a Mosaic compile error."""
  from ragdot.backends import sm90  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(sm90, "gpu_compute_capability", lambda: cc)
  x, w = jnp.ones((64, 128), jnp.bfloat16), jnp.ones((2, 128, 128), jnp.bfloat16)
  gs = jnp.array([30, 34], jnp.int32)
  with pytest.raises(NotImplementedError, match="sm90"):
    mosaic_fwd.gmm(x, w, gs, None, transpose_rhs=False, out_dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="sm90"):
    mosaic_dw.tgmm(x, x, gs, None, num_groups=2, out_dtype=jnp.bfloat16)


def test_table_config_values_must_match_their_fields():
  """A float where the Config takes an int (``"num_stages": 4.0`` in a JSON
  table) or a bool for an int is refused (dispatch then uses the default
  config); ``shard_ring_above`` takes a float."""
  for fields in ({"num_stages": 4.0}, {"block_m": True}, {"swap": 1}):
    with pytest.raises(TypeError, match=next(iter(fields))):
      dispatch.make_config("mosaic", "gmm", fields)
  from ragdot import tables  # pylint: disable=g-import-not-at-top
  table = tables.load_file(tables.TABLE_DIR / "nvidia_h200.json")
  swap = next(dict(e["config"]) for t, e in table.entries.items()
              if t.startswith("gmm/") and (e.get("config") or {}).get("swap"))
  swap["shard_ring_above"] = 1.5
  assert dispatch.make_config("mosaic", "gmm", swap).shard_ring_above == 1.5
  assert dispatch.make_config("mosaic", "tgmm", {"num_stages": 3}).num_stages == 3
  config, note = dispatch._built_config("mosaic", "gmm", (("num_stages", 4.0),), "bfloat16",
                                        "bfloat16")
  assert config is None and "rejected" in note


def test_a_refit_the_config_refuses_falls_back_to_the_default(monkeypatch):
  """A ValueError from the kernel's own SMEM refit (a refit its Config
  validation refuses) leaves the table config out, with a note, like a config
  that cannot fit at all: the call runs the default instead of failing."""
  from ragdot.backends import mosaic_dw  # pylint: disable=g-import-not-at-top

  def refuses(config, dtype, out_dtype, split=True):
    raise ValueError("epilogue_split must be 1 to 6")

  dispatch._built_config.cache_clear()
  monkeypatch.setattr(mosaic_dw, "fit_config", refuses)
  try:
    config, note = dispatch._built_config("mosaic", "tgmm", (("num_stages", 3),), "bfloat16",
                                          "float32")
  finally:
    dispatch._built_config.cache_clear()
  assert config is None and "not refittable" in note and "epilogue_split" in note


@pytest.mark.parametrize("kind", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_f32_dw_over_small_groups_runs_the_default_not_the_pingpong_ring(kind):
  """The tables' dW entries are pingpong rings on Qwen3-30B gate_up and Mixtral
  gate_up.  An f32 output over ~256-row groups gets the kernel's default (the
  shared ring, measured faster there: v71 70b-c), over ~2048-row groups the
  table's ring refitted to SMEM; a bf16 output keeps the table's ring, and an
  EP shard judges by the full call's rows per group."""
  device = dispatch.simulated_device(kind)

  def choose(out_dtype, m, k, n, g, num_groups=None, has_offset=False):
    return dispatch.choose("tgmm", None, dtype=jnp.bfloat16, out_dtype=out_dtype, m=m, k=k,
                           n=n, g=g, num_groups=num_groups or g, has_offset=has_offset,
                           device=device)

  qwen = (32768, 2048, 1536, 128)
  assert choose(jnp.bfloat16, *qwen).config.pingpong
  small = choose(jnp.float32, *qwen)
  assert small.implementation == "mosaic" and small.config is None
  assert "kernel's default" in small.reason and "256 rows per group" in small.reason
  mixtral = choose(jnp.float32, 16384, 4096, 28672, 8)
  assert mixtral.config.pingpong and mixtral.config.epilogue_n == 32  # refitted, kept
  # A shard of 16 of Qwen's 128 experts: the full call's 256 rows a group.
  shard = choose(jnp.float32, 32768, 2048, 1536, 16, num_groups=128, has_offset=True)
  assert shard.config is None and "256 rows per group" in shard.reason
