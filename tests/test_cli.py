"""Smoke runs of the ragdot command on CPU (tiny shapes)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from ragdot import cli
from ragdot.watchdog import Watchdog

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_info(capsys, monkeypatch):
  assert cli.main(["info", "--preset", "small"]) == 0
  out = capsys.readouterr().out
  assert f"jax {jax.__version__}" in out and "platform cpu" in out and "xla" in out
  assert "automatic sharding: per shard" in out
  monkeypatch.setenv("RAGDOT_AUTO_PARTITION", "0")
  assert cli.main(["info", "--preset", "small"]) == 0
  assert "automatic sharding: off" in capsys.readouterr().out


def test_info_explains_h200_choices(capsys):
  assert cli.main(["info", "--device-kind", "NVIDIA H200", "--preset", "qwen3-30b",
                   "--shape", "4096,512,520,16"]) == 0
  out = capsys.readouterr().out
  assert "mosaic" in out and "measured entry" in out and "nvidia_h200.json" in out


def test_info_explains_w8a16_choices(capsys):
  # fp8 weights beside bf16 rows: the W8A16 swap kernel for fwd and dx on an
  # sm90 part (dw reads no weights); f32 rows refused.
  argv = ["info", "--device-kind", "NVIDIA H200", "--compute-capability", "9.0", "--preset",
          "qwen3-30b", "--weights-dtype", "float8_e4m3fn"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "float8_e4m3fn weights" in out and out.count("W8A16") == 8
  assert cli.main(argv + ["--dtype", "float32"]) == 2


def test_bench_tiny_shape(tmp_path, capsys):
  path = tmp_path / "rows.json"
  assert cli.main(["bench", "--shape", "256,64,64,4", "--ops", "fwd", "--iterations", "1",
                   "--json", str(path)]) == 0
  rows = json.loads(path.read_text())
  impls = {r["impl"] for r in rows}
  assert {"ragdot", "ragdot:xla", "dense"} <= impls
  auto = next(r for r in rows if r["impl"] == "ragdot")
  assert auto["ms"] > 0 and auto["peak_mib"] > 0 and auto["choice"].startswith("xla")
  assert auto["compile_s"] > 0  # lower + compile, wall clock
  # On CPU the automatic choice is the xla backend: its explicit row is the same
  # kernels, so it carries the automatic row's timing instead of a second sample.
  explicit = next(r for r in rows if r["impl"] == "ragdot:xla")
  assert explicit["ms"] == auto["ms"] and "automatic choice's kernels" in explicit["method"]
  # Forced rows record what they ran, for `ragdot tune --import-bench`.
  assert explicit["choice"].startswith("xla [") and explicit["backend"] == "xla"
  assert "config" in explicit
  assert all("choice" in r for r in rows if r["impl"].startswith("ragdot"))
  out = capsys.readouterr().out
  assert "auto-choice check" in out and "compile: slowest ragdot call" in out


def test_bench_sustained_rows(tmp_path):
  path = tmp_path / "rows.json"
  assert cli.main(["bench", "--shape", "256,64,64,4", "--ops", "fwd", "--sustained-s", "0.2",
                   "--json", str(path)]) == 0
  rows = json.loads(path.read_text())
  assert {"ragdot", "dense"} <= {r["impl"] for r in rows}
  assert all(r["ms"] > 0 and r["method"].startswith("sustained 0.2 s, wall; dispatch ")
             and r["dispatch_ms"] >= 0 for r in rows)


def test_bench_only_picks_preset_shapes_by_name(tmp_path, monkeypatch):
  from ragdot import bench  # pylint: disable=g-import-not-at-top

  small = bench.PRESETS["small"][0]
  other = dataclasses.replace(small, name="other")
  monkeypatch.setitem(bench.PRESETS, "small", [small, other])
  path = tmp_path / "rows.json"
  assert cli.main(["bench", "--preset", "small", "--only", "other", "--ops", "fwd",
                   "--iterations", "1", "--no-baselines", "--json", str(path)]) == 0
  assert {r["shape"] for r in json.loads(path.read_text())} == {"other"}

def _strict_json(text):
  def refuse(name):
    raise ValueError(f"not strict JSON: {name}")
  return json.loads(text, parse_constant=refuse)


def test_bench_json_is_strict_and_reads_back_failed_rows(tmp_path, monkeypatch, capsys):
  """A failed call's NaN figures are written as null (parsers other than Python's
  refuse NaN) and read back as NaN by --from-json and tune --import-bench."""
  from ragdot import bench  # pylint: disable=g-import-not-at-top

  nan = float("nan")
  failed = dict(shape="s", op="fwd", impl="ragdot:triton", m=8, k=8, n=8, g=2, ms=nan,
                tflops=nan, tbps=nan, vs_dense=nan, vs_tokamax=nan, peak_mib=None,
                compile_s=None, method="error: boom", routing="routed", rounds=2,
                ms_rounds=[1.0, nan], vs_dense_rounds=[nan, nan])
  monkeypatch.setattr(bench, "bench_shape", lambda *a, **k: [dict(failed)])
  path = tmp_path / "rows.json"
  assert cli.main(["bench", "--shape", "8,8,8,2", "--ops", "fwd", "--no-baselines",
                   "--iterations", "1", "--json", str(path)]) == 0
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
  assert _strict_json(lines[0])["ms"] is None
  written = _strict_json(path.read_text())
  assert written[0]["ms"] is None and written[0]["ms_rounds"] == [1.0, None]
  back = bench.rows_from_json(path.read_text())[0]
  assert back["ms"] != back["ms"] and back["ms_rounds"][0] == 1.0
  assert back["ms_rounds"][1] != back["ms_rounds"][1] and back["peak_mib"] is None
  assert cli.main(["bench", "--from-json", str(path)]) == 0
  # older files with bare NaN still read
  old = tmp_path / "old.json"
  old.write_text(json.dumps([failed]))
  assert bench.rows_from_json(old.read_text())[0]["tflops"] != bench.rows_from_json(
      old.read_text())[0]["tflops"]
  old.write_text('{"not": "rows"}')
  assert cli.main(["bench", "--from-json", str(old)]) == 2


def test_bench_usage_errors_name_the_flag_before_any_work(tmp_path, capsys):
  assert cli.main(["bench", "--preset", "small", "--only", "no such shape", "--ops", "fwd"]) == 2
  assert "--only: no such shape" in capsys.readouterr().err
  # --only picks among --shape shapes too (it used to search only the presets)
  assert cli.main(["bench", "--shape", "64,16,16,4,2", "--only", "64,16,16,4,2", "--ops", "fwd",
                   "--no-baselines", "--iterations", "1",
                   "--json", str(tmp_path / "one.json")]) == 0
  assert {r["shape"] for r in json.loads((tmp_path / "one.json").read_text())} == {"64,16,16,4,2"}
  assert cli.main(["bench", "--from-json", str(tmp_path / "missing.json")]) == 2
  assert "--from-json" in capsys.readouterr().err
  assert cli.main(["bench", "--shape", "256,64,64,4", "--no-baselines",
                   "--json", str(tmp_path / "no dir" / "rows.json")]) == 2
  assert "--json" in capsys.readouterr().err
  for flag, value in [("--iterations", "0"), ("--iterations", "-3"), ("--rounds", "0"),
                      ("--warmup-ms", "-1"), ("--implementation", "nope"), ("--impls", "nope")]:
    with pytest.raises(SystemExit) as e:
      cli.main(["bench", "--shape", "256,64,64,4", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
  for args in (["--budget-s", "0"], ["--jobs", "0"], ["--repeats", "-1"],
               ["--compute-capability", "sm_90"]):
    with pytest.raises(SystemExit):
      cli.main(["tune", "--dry-run", "--shape", "256,64,64,4", *args])
    assert f"argument {args[0]}" in capsys.readouterr().err
  assert cli.main(["tune", "--import-bench", str(tmp_path / "missing.json"),
                   "--table", str(tmp_path / "t.json")]) == 2
  assert "--import-bench" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["info", "--device-kind", "NVIDIA H200", "--compute-capability", "abc"])
  assert cli.main(["info", "--compute-capability", "9.0", "--shape", "256,64,64,4"]) == 2


def test_preset_shapes_keeps_the_presets_order_and_rejects_unknown_names():
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  names = [s.name for s in bench.PRESETS["training"]]
  assert [s.name for s in bench.preset_shapes("training")] == names
  assert [s.name for s in bench.preset_shapes(["training", "ep"], [names[3], names[1]])] == [
      names[1], names[3]]
  with pytest.raises(ValueError, match="qwen3-30b gate_up skewed"):  # the other preset's
    bench.preset_shapes("training", [names[0], "qwen3-30b gate_up skewed"])


def test_one_token_preset_routes_each_row_to_its_own_expert():
  """One token (Mixtral's shape: two) over top-k experts: m = tokens x top_k rows,
  each routed group one row."""
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  for s in bench.PRESETS["one-token"]:
    sizes = bench.routed_group_sizes(s)
    assert s.m in (s.top_k, 2 * s.top_k) and int(sizes.sum()) == s.m
    assert int(sizes.max()) <= s.m // s.top_k


def test_training_skewed_preset_is_the_training_shapes_skewed():
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  skewed, training = bench.PRESETS["training-skewed"], bench.PRESETS["training"]
  assert [(s.m, s.k, s.n, s.g, s.top_k) for s in skewed] == [
      (s.m, s.k, s.n, s.g, s.top_k) for s in training]
  assert all(s.skewed and s.name.endswith(" skewed") for s in skewed)
  # A few hot experts: the largest group holds several times the routed one's rows.
  for s, t in zip(skewed, training):
    assert bench.routed_group_sizes(s).max() > 2 * bench.routed_group_sizes(t).max()
    assert bench.routed_group_sizes(s).sum() == s.m


def test_ep_local_preset_is_one_rank_of_each_models_ep8_split():
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  local = {s.name: s for s in bench.PRESETS["ep-local"]}
  full = {s.name: s for p in ("qwen3-30b", "qwen3-235b", "deepseek-v3", "gpt-oss-120b")
          for s in bench.PRESETS[p] if not s.name.endswith("decode")}
  assert sorted(local) == sorted(f"{name} ep8 local" for name in full)
  for name, f in full.items():
    s = local[f"{name} ep8 local"]
    assert (s.m * 8, s.k, s.n, s.g * 8, s.top_k) == (f.m, f.k, f.n, f.g, f.top_k)
    sizes = bench.routed_group_sizes(s)
    # Routed over the rank's own experts: every row in a group, every group used.
    assert sizes.shape == (s.g,) and sizes.sum() == s.m and sizes.min() > 0


@pytest.mark.parametrize("op", ["fwd", "dx", "dw", "fwdbwd"])
def test_bench_baselines_select_their_rows(op, monkeypatch):
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(bench, "_tokamax", lambda: object())  # as if tokamax were installed
  s = bench.Shape("t", 64, 32, 16, 4)
  names = lambda b: set(bench._candidates(op, s, None, ["xla"], baselines=b))  # pylint: disable=protected-access
  every = names(True)
  assert {"dense", "tokamax"} <= every and ("lax" in every) == (op == "fwd")
  own = names(False)
  assert own and not own & set(bench.BASELINES) and names(()) == own
  assert names(("dense",)) == own | {"dense"}
  assert names(("tokamax",)) == own | {"tokamax"}


def test_dense_fwdbwd_reference_is_three_matmuls():
  # The reference differentiates w.r.t. the [k, n] weight it multiplies, not
  # all of w[g, k, n] (whose zero-padded gradient once cost a third of its time).
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  s = bench.Shape("t", 64, 32, 16, 4)
  x = jax.random.normal(jax.random.key(0), (s.m, s.k))
  w = jax.random.normal(jax.random.key(1), (s.g, s.k, s.n))
  dy = jax.random.normal(jax.random.key(2), (s.m, s.n))
  dense = bench._candidates("fwdbwd", s, None, baselines=True)["dense"]  # pylint: disable=protected-access
  value, (dx, dw) = dense(x, w, dy, jnp.full((s.g,), s.m // s.g, jnp.int32))
  assert dw.shape == (s.k, s.n) and dx.shape == (s.m, s.k)
  hi = jax.lax.Precision.HIGHEST
  np.testing.assert_allclose(dw, jnp.dot(x.T, dy, precision=hi), rtol=1e-4, atol=1e-3)
  np.testing.assert_allclose(value, jnp.sum(jnp.dot(x, w[0], precision=hi) * dy), rtol=1e-4)
  jaxpr = str(jax.make_jaxpr(dense)(x, w, dy, jnp.zeros((s.g,), jnp.int32)))
  assert "pad" not in jaxpr and "dynamic_update_slice" not in jaxpr


def test_resolved_kernels_tell_apart_backends_and_ops():
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  s = bench.Shape("t", 256, 64, 64, 4)
  assert bench.resolved_kernels("fwd", s, None) == bench.resolved_kernels("fwd", s, "xla")
  assert bench.resolved_kernels("fwd", s, None) != bench.resolved_kernels("fwd", s, "triton")
  assert len(bench.resolved_kernels("fwdbwd", s, None)) == 3


def test_tune_dry_run_lists_candidates(tmp_path, capsys):
  assert cli.main(["tune", "--dry-run", "--shape", "4096,512,512,16", "--ops", "fwd", "dw",
                   "--table", str(tmp_path / "t.json")]) == 0
  out = capsys.readouterr().out
  assert "MosaicFwdConfig" not in out  # fields, not reprs
  assert "block_m" in out and "gmm/bfloat16/m4096,k512,n512,g16" in out
  assert "tgmm/bfloat16/" in out and "xla" in out
  assert out.count("(today's choice)") == 2  # the dispatcher's config for each call
  assert not (tmp_path / "t.json").exists()  # a dry run writes nothing


def test_tune_dry_run_names_backend_only_entries(tmp_path, capsys):
  # A bucket holding a measured backend choice without a config (v8's bench imports)
  # is skipped, and the listing says its configs were never swept.
  from ragdot import tables  # pylint: disable=g-import-not-at-top
  path = tmp_path / "t.json"
  data = {"format": "ragdot-table/1", "device_kind": "test", "entries": {
      tables.key("gmm", "bfloat16", 4096, 512, 512, 16): {
          "backend": "triton", "config": None, "measured": True, "shape": [4096, 512, 512, 16],
          "ms": 1.0},
      tables.key("tgmm", "bfloat16", 4096, 512, 512, 16): {
          "backend": "mosaic", "config": {"block_m": 64}, "measured": True,
          "shape": [4096, 512, 512, 16], "ms": 1.0}}}
  path.write_text(json.dumps(data))
  args = ["tune", "--dry-run", "--shape", "4096,512,512,16", "--ops", "fwd", "dx", "dw",
          "--table", str(path)]
  assert cli.main(args) == 0
  out = capsys.readouterr().out
  assert "[skip: already measured as a backend choice (triton, its default config)" in out
  assert "[skip: already measured]" in out and "[to tune]" in out  # dw / dx
  assert cli.main(args + ["--force"]) == 0
  out = capsys.readouterr().out
  assert "[skip:" not in out and out.count("[to tune]") == 3


def test_tune_times_the_triton_candidates_before_the_mosaic_sweep():
  from ragdot import tune  # pylint: disable=g-import-not-at-top
  from ragdot.backends import triton  # pylint: disable=g-import-not-at-top

  task = tune.Task("dx", "qwen3-30b gate_up decode", 512, 1536, 2048, 128, 8)
  backends = [b for b, _ in tune.candidates(task, jnp.bfloat16)]
  assert backends[:5] == ["mosaic"] + ["triton"] * 4 and "triton" not in backends[5:]
  deep = triton.TritonConfig(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=3)
  assert ("triton", deep) in tune.candidates(task, jnp.bfloat16)[:5]


def test_tune_tries_todays_choice_right_after_the_defaults():
  # v42b-c: on DeepSeek-V3 down's forward the sweep's winner lost to the config the
  # call had borrowed, which the sweep did not hold; today's choice is now a candidate,
  # timed early.
  from ragdot import dispatch, tune  # pylint: disable=g-import-not-at-top
  h200 = dispatch.Device("gpu", "NVIDIA H200", "9.0")
  task = tune.Task("fwd", "deepseek-v3 down ep8 local", 4096, 2048, 7168, 32, 8)
  today = tune.incumbent_choice(task, jnp.bfloat16, h200)
  dispatch.clear_cache()
  auto = dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=4096, k=2048, n=7168, g=32,
                         num_groups=32, device=h200)
  assert today == ("mosaic", auto.config) and auto.config.swap
  cands = tune.candidates(task, jnp.bfloat16, today)
  assert cands[5] == today and cands.count(today) == 1
  assert cands[:5] + cands[6:] == [c for c in tune.candidates(task, jnp.bfloat16) if c != today]
  # dX: the task's k and n are the backend call's already (the forward's swapped);
  # Qwen3-30B down's dX and the call with them swapped back have different configs.
  dx = tune.Task("dx", "qwen3-30b down", 32768, 2048, 768, 128, 8)
  choose = lambda k, n: dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=32768, k=k, n=n,
                                        g=128, num_groups=128, transpose_rhs=True,
                                        device=h200).config
  assert choose(2048, 768) != choose(768, 2048)
  assert tune.incumbent_choice(dx, jnp.bfloat16, h200) == ("mosaic", choose(2048, 768))
  # No GPU kernel today (the xla backend): nothing to add.
  assert tune.incumbent_choice(task, jnp.bfloat16, dispatch.Device("cpu", "cpu")) is None


def test_tune_tries_todays_dw_choice_dealt_two_groups_at_a_time():
  # v68: Qwen3-30B down's dW ran 0.962-0.966x its table time with group_interleave=2
  # (an H100); the tuner times that variant of today's choice right after it.
  from ragdot import dispatch, tune  # pylint: disable=g-import-not-at-top
  h200 = dispatch.Device("gpu", "NVIDIA H200", "9.0")
  task = tune.Task("dw", "qwen3-30b down", 32768, 768, 2048, 128, 8)
  today = tune.incumbent_choice(task, jnp.bfloat16, h200)
  assert today[0] == "mosaic" and today[1].group_interleave == 1
  cands = tune.candidates(task, jnp.bfloat16, today)
  at = cands.index(today)
  assert cands[at + 1] == ("mosaic", dataclasses.replace(today[1], group_interleave=2))
  assert all(c.group_interleave == 1 for b, c in cands if b == "mosaic" and c is not None
             and c != cands[at + 1][1])
  # Forward tasks, and a call with no Mosaic choice today, get no such variant.
  fwd = tune.Task("fwd", "qwen3-30b down", 32768, 768, 2048, 128, 8)
  assert all(getattr(c, "group_interleave", 1) == 1 for _, c in tune.candidates(
      fwd, jnp.bfloat16, tune.incumbent_choice(fwd, jnp.bfloat16, h200)))
  assert all(getattr(c, "group_interleave", 1) == 1
             for _, c in tune.candidates(task, jnp.bfloat16, None))


def test_tune_fp8_times_the_native_forward_on_mosaic_configs(tmp_path, capsys):
  """``--dtype float8_e4m3fn``: the forward on rhs [g, n, k] (table op gmm_t,
  the forward's own k and n), Mosaic candidates only (k steps of 128 and 64
  one-byte columns), bf16 output; dx / dw refused (the backward runs on bf16
  copies)."""
  from ragdot import bench, dispatch, tune  # pylint: disable=g-import-not-at-top
  s = bench.Shape("qwen3-30b gate_up decode", 512, 2048, 1536, 128)
  (task,) = tune.tasks_for([s], ["fwd"], jnp.float8_e4m3fn)
  assert (task.transpose_rhs, task.table_op, task.k, task.n) == (True, "gmm_t", 2048, 1536)
  assert tune.tasks_for([s], ["fwd"], jnp.bfloat16)[0].table_op == "gmm"
  h200 = dispatch.Device("gpu", "NVIDIA H200", "9.0")
  today = tune.incumbent_choice(task, jnp.float8_e4m3fn, h200)  # the shipped fp8 entry's
  assert today[0] == "mosaic" and today[1].block_k == 128
  cands = tune.candidates(task, jnp.float8_e4m3fn, ("triton", object()))
  assert {b for b, _ in cands} == {"mosaic"}
  assert {c.block_k for _, c in cands} == {64, 128}
  lhs, rhs, _ = tune._inputs(task, jnp.float8_e4m3fn)
  assert lhs.dtype == rhs.dtype == jnp.float8_e4m3fn and rhs.shape == (128, 1536, 2048)
  assert tune.out_dtype_of(jnp.float8_e4m3fn) == jnp.bfloat16
  with pytest.raises(ValueError, match="ops"):
    tune.tasks_for([s], ["fwd", "dx"], jnp.float8_e5m2)
  args = ["tune", "--dry-run", "--dtype", "float8_e5m2", "--shape", "512,2048,1536,128",
          "--table", str(tmp_path / "t.json"), "--device-kind", "NVIDIA H200"]
  assert cli.main(args + ["--ops", "fwd"]) == 0
  out = capsys.readouterr().out
  assert "gmm_t/float8_e4m3fn/m512,k2048,n1536,g128" in out  # e5m2 shares e4m3's entries
  assert "triton" not in out
  assert cli.main(args + ["--ops", "dw"]) == 2
  assert "fp8 operands are tuned for" in capsys.readouterr().err
  assert cli.main(args) == 0  # --ops defaults to fwd for fp8
  assert "gmm_t/float8_e4m3fn/" in capsys.readouterr().out
  table = tmp_path / "imported.json"
  assert cli.main(["tune", "--dtype", "float8_e4m3fn", "--table", str(table),
                   "--device-kind", "NVIDIA H200", "--import-sweep",
                   str(Path(__file__).parents[1] / "docs/data/sweep_h200_v1.jsonl")]) == 2
  assert "bf16 measurements" in capsys.readouterr().err and not table.exists()


def test_tune_fp8_reference_is_the_exact_bf16_sum():
  from ragdot import tune  # pylint: disable=g-import-not-at-top
  task = tune.Task("fwd", "tiny", 64, 64, 32, 4, 2, rhs_nk=True)
  lhs, rhs, sizes = tune._inputs(task, jnp.float8_e4m3fn)
  want = oracle.ref_ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                               np.asarray(sizes).tolist(), None, True)
  np.testing.assert_allclose(tune._reference(task, lhs, rhs, sizes), want, rtol=1e-6,
                             atol=1e-5)


def test_tune_refuses_without_gpu(capsys):
  assert cli.main(["tune", "--shape", "256,64,64,4"]) == 2
  assert "no GPU" in capsys.readouterr().err


def test_python_dash_m():
  env = dict(os.environ, PYTHONPATH=SRC, JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-m", "ragdot", "info", "--preset", "small"],
                       env=env, capture_output=True, text=True, timeout=120, check=True)
  assert "versions" in res.stdout


def test_bench_watchdog_keeps_the_rows_before_a_hung_candidate(tmp_path):
  """A candidate that never returns ends ``ragdot bench`` with status 3, naming it,
  and the rows of the shapes finished before it are in --json."""
  out = tmp_path / "rows.json"
  code = f"""
import time
from ragdot import bench
real, calls = bench.device_time_ms, []
def timed(*args, **kwargs):
  calls.append(1)
  if bench.jax.default_backend() == "cpu" and len(calls) > 1:
    time.sleep(120)  # the second candidate "hangs"
  return real(*args, **kwargs)
bench.device_time_ms = timed
bench.main(["--shape", "256,64,64,4", "--shape", "256,64,128,4", "--ops", "fwd",
            "--iterations", "1", "--no-baselines", "--hang-s", "10",
            "--json", {str(out)!r}])
"""
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=SRC))
  assert p.returncode == 3, p.stderr[-2000:]
  assert "256,64,128,4,4 fwd ragdot ran for more than 10 s" in p.stderr
  rows = json.loads(out.read_text())
  assert rows and {r["shape"] for r in rows} == {"256,64,64,4,4"}
  assert all(r["ms"] > 0 for r in rows)


def test_tune_watchdog_ends_a_hung_candidate(tmp_path):
  """A stretch armed longer than the limit ends the process with status 3 after
  the hook runs; a disarmed one does not."""
  mark = tmp_path / "hung.txt"
  code = f"""
import time
from ragdot.watchdog import Watchdog
w = Watchdog(0.4, on_hang=lambda label: open({str(mark)!r}, "w").write(label))
w.arm("quick"); time.sleep(0.1); w.disarm(); time.sleep(1.0)
print("survived", flush=True)
w.arm("candidate-x"); time.sleep(5)
print("not reached", flush=True)
"""
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert p.returncode == 3, p.stderr
  assert "survived" in p.stdout and "not reached" not in p.stdout
  assert "candidate-x ran for more than 0.4 s" in p.stderr and mark.read_text() == "candidate-x"
  for bad, error in ((0, ValueError), (float("inf"), ValueError), ("5", TypeError),
                     (None, TypeError), (True, TypeError)):
    with pytest.raises(error, match="limit_s"):
      Watchdog(bad)
  Watchdog(np.float32(5)).close()


def test_watchdog_ends_the_process_even_when_its_hooks_block():
  code = """
import threading, time
from ragdot import watchdog
watchdog.ON_HANG_S = watchdog.EXIT_HOOKS_S = 0.5
watchdog.add_exit_hook(lambda: threading.Event().wait())
w = watchdog.Watchdog(0.2, on_hang=lambda label: threading.Event().wait())
w.arm("x"); time.sleep(20)
"""
  t = time.time()
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert p.returncode == 3 and time.time() - t < 15, p.stderr


def test_a_closed_watchdog_stops_watching():
  def watching():
    return sum(t.name == "ragdot-watchdog" for t in threading.enumerate())

  before = watching()
  dogs = [Watchdog(0.1) for _ in range(5)]
  assert watching() == before + 5
  for d in dogs:
    d.close()
  with Watchdog(0.1) as d:
    d.arm("closed before it fires")
  deadline = time.time() + 5
  while watching() > before and time.time() < deadline:
    time.sleep(0.05)
  assert watching() == before
  time.sleep(0.3)  # (armed, but closed: the process lives on)


def test_hang_limit_shorter_than_a_sustained_window_is_refused(capsys, tmp_path, monkeypatch):
  assert cli.main(["bench", "--shape", "256,64,64,4", "--ops", "fwd", "--no-baselines",
                   "--sustained-s", "2", "--hang-s", "1.5"]) == 2
  assert "--hang-s 1.5 must exceed --sustained-s 2" in capsys.readouterr().err
  saved = tmp_path / "rows.json"
  saved.write_text("[]")  # (re-printing saved rows times nothing: no check)
  assert cli.main(["bench", "--from-json", str(saved), "--sustained-s", "200"]) == 0
  monkeypatch.setenv("RAGDOT_TIMING_OUTPUT_GIB", "abc")
  assert cli.main(["bench", "--shape", "256,64,64,4", "--ops", "fwd", "--no-baselines"]) == 2
  assert "RAGDOT_TIMING_OUTPUT_GIB" in capsys.readouterr().err
  monkeypatch.delenv("RAGDOT_TIMING_OUTPUT_GIB")
  assert cli.main(["tune", "--dry-run", "--sustained-s", "2", "--hang-s", "2"]) == 2
  assert "--hang-s 2 must exceed --sustained-s 2" in capsys.readouterr().err


def test_info_refuses_an_empty_device_kind_before_printing(capsys):
  assert cli.main(["info", "--device-kind", ""]) == 2
  assert cli.main(["info", "--compute-capability", "9.0"]) == 2
  captured = capsys.readouterr()
  assert captured.out == "" and "--device-kind" in captured.err


@pytest.mark.parametrize("op", ["fwd", "dw", "fwdbwd"])
def test_ep_bench_strategies_agree(op):
  """The EP rows' three strategies compute the same shard: group_offset, the
  masked workaround and the plain call over the local rows."""
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  s = bench.Shape("t ep", 256, 64, 32, 8, top_k=2, ep=4)
  sizes = bench.routed_group_sizes(s)
  rows = int(sizes[:2].sum())
  ks = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(ks[0], (s.m, s.k), jnp.float32)
  w = jax.random.normal(ks[1], (s.g, s.k, s.n), jnp.float32)
  dy = jax.random.normal(ks[2], (s.m, s.n), jnp.float32)
  gs = jnp.asarray(sizes)
  out = {name: fn(x, w, dy, gs) for name, fn in bench._ep_candidates(op, s, "xla", sizes).items()}
  assert set(out) >= {"ragdot", "masked", "local-rows"}
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)
  if op == "fwd":
    close(out["ragdot"], out["masked"])
    close(out["ragdot"][:rows], out["local-rows"][:rows])
    assert not np.any(np.asarray(out["ragdot"][rows:]))
  elif op == "dw":
    assert out["ragdot"].shape == (2, s.k, s.n)
    close(out["ragdot"], out["masked"])
    close(out["ragdot"], out["local-rows"])
  else:
    (v, (gx, gw)), (vm, (gxm, gwm)), (vl, (gxl, gwl)) = (
        out[n] for n in ("ragdot", "masked", "local-rows"))
    assert gw.shape == (2, s.k, s.n)
    close(v, vm), close(v, vl), close(gw, gwm), close(gw, gwl), close(gx, gxm)
    close(gx[:rows], gxl[:rows])
    assert not np.any(np.asarray(gx[rows:]))


def test_bench_ep_shape_rows_cover_the_ep_ops(tmp_path):
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  s = bench.Shape("t ep", 256, 64, 32, 8, top_k=2, ep=4)
  rows = bench.bench_shape(s, ["fwd", "dx", "dw", "fwdbwd"], None, iterations=1)
  assert {r["op"] for r in rows} == {"fwd", "dw", "fwdbwd"}  # no dX row for a shard
  for r in rows:
    assert r["ms"] > 0, r
  lines = bench.ep_summary(rows)
  assert len(lines) == 3 and all("the local rows' call" in line for line in lines)


def test_compile_summary_names_the_slowest_ragdot_call():
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  rows = [dict(shape="a", op="fwd", impl="ragdot", compile_s=1.5),
          dict(shape="b", op="dx", impl="ragdot:mosaic", compile_s=4.25),
          dict(shape="b", op="dx", impl="dense", compile_s=9.0),      # not a ragdot call
          dict(shape="c", op="fwd", impl="ragdot", compile_s=None)]   # failed to compile
  line = bench.compile_summary(rows)
  assert line.startswith("compile: slowest ragdot call 4.2 s (b dx ragdot:mosaic)"), line
  assert "over 2 timed rows" in line
  assert bench.compile_summary([dict(shape="a", op="fwd", impl="dense", compile_s=1.0)]) is None


def test_minimal_bytes_of_an_ep_shard_count_only_its_rows_and_experts():
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  full = bench.Shape("t", 256, 64, 32, 8, top_k=2)
  shard = bench.Shape("t ep", 256, 64, 32, 8, top_k=2, ep=4)
  sizes = bench.routed_group_sizes(full)
  rows, experts = int(sizes[:2].sum()), int(np.count_nonzero(sizes[:2]))
  w = experts * 64 * 32 * 2
  assert bench.minimal_bytes("fwd", shard, sizes) == rows * 64 * 2 + w + 256 * 32 * 2
  # dW writes every local expert's gradient, an empty one's zeros too
  assert bench.minimal_bytes("dw", shard, sizes) == rows * (64 + 32) * 2 + 2 * 64 * 32 * 2
  assert bench.minimal_bytes("dw", shard, sizes) < bench.minimal_bytes("dw", full, sizes)
  w_all = int(np.count_nonzero(sizes)) * 64 * 32 * 2
  assert bench.minimal_bytes("fwdbwd", full, sizes) == (
      3 * 256 * 96 * 2 + 2 * w_all + 8 * 64 * 32 * 2)


def test_minimal_bytes_of_dw_count_the_empty_experts_output():
  """One token over 8 of 128 experts: dW still returns [128, k, n] (the
  floor used to count only the 8 non-empty experts' gradients, 16x low)."""
  import ragdot  # pylint: disable=g-import-not-at-top
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  s = bench.preset_shapes("one-token", ["qwen3-30b gate_up 1 token"])[0]
  sizes = bench.routed_group_sizes(s)
  assert np.count_nonzero(sizes) == 8
  out = jax.eval_shape(lambda x, dy, gs: ragdot.trans_ragged_dot(x, dy, gs),
                       *(jax.ShapeDtypeStruct(a, jnp.bfloat16) for a in ((s.m, s.k), (s.m, s.n))),
                       jax.ShapeDtypeStruct((s.g,), jnp.int32))
  assert bench.minimal_bytes("dw", s, sizes) == s.m * (s.k + s.n) * 2 + out.size * 2


def test_shape_names_are_unique_across_the_presets():
  """Every name means one shape in every preset (rows, ratios and the plot are
  keyed by name: "mixtral gate_up decode" meant 256 rows in "decode" and 128
  in "mixtral"); --shape names carry top_k."""
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  every = bench.select_shapes([s for p in bench.PRESETS.values() for s in p])
  assert len({s.name for s in every}) == len(every)
  a, b = bench.parse_shape("64,16,16,4,2"), bench.parse_shape("64,16,16,4,4")
  assert a.name != b.name and bench.parse_shape("64,16,16,4").name == "64,16,16,4,4"
  with pytest.raises(ValueError, match="means two shapes"):
    bench.select_shapes([a, dataclasses.replace(b, name=a.name)])


def test_ep_rows_honour_the_baselines_and_local_rows_get_their_own_floor(monkeypatch):
  """--no-baselines / --baselines without tokamax drop the EP shard's
  tokamax-masked row; the local-rows row's TB/s is over its own bytes (its
  rows over the local experts), not the shard's (which writes all m rows)."""
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  s = bench.Shape("t ep", 256, 64, 32, 8, top_k=2, ep=4)
  sizes = bench.routed_group_sizes(s)

  class FakeTokamax:
    ragged_dot = staticmethod(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs))
    ragged_dot_general = staticmethod(jax.lax.ragged_dot_general)

  monkeypatch.setattr(bench, "_tokamax", lambda: FakeTokamax)
  for op in bench.EP_OPS:
    assert "tokamax-masked" in bench._ep_candidates(op, s, "xla", sizes)
    assert "tokamax-masked" in bench._ep_candidates(op, s, "xla", sizes, ("tokamax",))
    for baselines in (False, (), ("dense",)):
      assert set(bench._ep_candidates(op, s, "xla", sizes, baselines)) == {
          "ragdot", "masked", "local-rows"}
  rows = bench.bench_shape(s, ["fwd"], "xla", iterations=1, baselines=False)
  by = {r["impl"]: r for r in rows}
  local, local_sizes = bench.local_rows_shape(s, sizes)
  assert local.m == bench.local_rows8(s, sizes) and local.g == 2 and local.ep == 1
  floor = bench.minimal_bytes("fwd", local, local_sizes)
  assert floor < bench.minimal_bytes("fwd", s, sizes)
  assert by["local-rows"]["tbps"] == pytest.approx(floor / (by["local-rows"]["ms"] * 1e-3) / 1e12)


def test_skew_sets_how_many_rows_the_first_experts_get():
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  routed = bench.Shape("t", 32768, 64, 32, 128, ep=8)
  skewed = dataclasses.replace(routed, skewed=True)
  assert (bench.routed_group_sizes(routed, skew=0) == bench.routed_group_sizes(routed)).all()
  assert (bench.routed_group_sizes(routed, skew=3.0) == bench.routed_group_sizes(skewed)).all()
  shard_rows = [int(bench.ep_shard_sizes(routed, skew=h)[0][:16].sum()) for h in (0, 1, 2, 3)]
  assert shard_rows == sorted(shard_rows) and shard_rows[0] < 4500 < 12000 < shard_rows[-1]
  assert all(int(bench.routed_group_sizes(routed, skew=h).sum()) == 32768 for h in (0, 1.5))
  # The EP presets: the same shards, routed and skewed; shard 0 holds more rows skewed.
  plain, hot = bench.PRESETS["ep-models"], bench.PRESETS["ep-skewed"]
  assert [dataclasses.replace(s, name="", skewed=False) for s in hot] == [
      dataclasses.replace(s, name="") for s in plain]
  assert all(s.ep == 8 and s.skewed for s in hot) and bench.PRESETS["ep"][0] == plain[0]
  for a, b in zip(plain, hot):
    assert bench.ep_shard_sizes(b)[2] > 3 * bench.ep_shard_sizes(a)[2], (a, b)


class _Labels:
  """A bench watchdog that only records what is being compiled or timed."""
  now = None

  def arm(self, label):
    self.now = label

  def disarm(self):
    self.now = None

  def candidate(self) -> str:
    """The candidate of the forward call being timed ("t fwd dense (round 2/3)")."""
    return self.now.split(" fwd ", 1)[1].split(" (round")[0]


def test_bench_rounds_time_every_candidate_in_turn_and_take_per_round_ratios(monkeypatch):
  from ragdot import bench  # pylint: disable=g-import-not-at-top

  seen = _Labels()
  seen.timed = []

  # Round r times "dense" at r ms and ragdot at 2, 3, 9 ms: per round 0.5, 0.67,
  # 0.33 x dense, median 0.5, where the ratio of the medians would read 2 / 3.
  def fake_time(exe, *args, iterations, warmup_s):
    del exe, args, iterations, warmup_s
    name = seen.candidate()
    seen.timed.append(name)
    r = seen.timed.count(name)
    return (float(r) if name == "dense" else [2.0, 3.0, 9.0][r - 1]), "cupti"

  monkeypatch.setattr(bench, "device_time_ms", fake_time)
  s = bench.Shape("t", 128, 64, 64, 4, top_k=2)
  rows = bench.bench_shape(s, ["fwd"], None, iterations=1, impls=["xla"],
                           baselines=("dense",), watchdog=seen, rounds=3)
  by = {r["impl"]: r for r in rows}
  assert set(by) == {"ragdot", "ragdot:xla", "dense"}, by
  # every timed candidate once per round, in an order rotated each round
  calls = seen.timed
  assert len(calls) == 6 and calls[:2] != calls[2:4] and sorted(calls[:2]) == sorted(calls[2:4])
  assert by["dense"]["ms_rounds"] == [1.0, 2.0, 3.0]
  assert by["ragdot"]["ms_rounds"] == [2.0, 3.0, 9.0] and by["ragdot"]["ms"] == 3.0
  assert by["ragdot"]["vs_dense_rounds"] == pytest.approx([0.5, 2 / 3, 1 / 3])
  assert by["ragdot"]["vs_dense"] == 0.5
  # the forced backend resolving to the automatic choice's kernels reuses its times
  assert by["ragdot:xla"]["ms_rounds"] == by["ragdot"]["ms_rounds"]
  assert by["ragdot:xla"]["method"] == "cupti; the automatic choice's kernels"
  assert bench._ratio_text(by["ragdot"]) == "0.50 (0.33-0.67)"


def test_bench_rounds_a_later_failure_makes_an_error_row(monkeypatch):
  # Sustained timing where the dense baseline fails in its second round: its row
  # is an error without the first round's power figures, and the ratios to it
  # are NaN; the ragdot rows keep their three rounds and their power.
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  calls = {}

  seen = _Labels()

  def fake_sustained(exe, *args, seconds):
    del exe, args, seconds
    name = seen.candidate()
    calls[name] = calls.get(name, 0) + 1
    if name == "dense" and calls[name] == 2:
      raise RuntimeError("boom")
    return 1.0, {"sm_mhz": 1500.0, "power_w": 600.0, "power_capped": 0.5}

  monkeypatch.setattr(bench, "sustained_time_ms", fake_sustained)
  s = bench.Shape("t", 128, 64, 64, 4, top_k=2)
  rows = bench.bench_shape(s, ["fwd"], None, iterations=1, impls=["xla"],
                           baselines=("dense",), watchdog=seen, rounds=3, sustained_s=1.0)
  by = {r["impl"]: r for r in rows}
  assert by["dense"]["method"].startswith("error: RuntimeError: boom")
  assert by["dense"]["ms"] != by["dense"]["ms"] and "sm_mhz" not in by["dense"]
  assert calls == {"ragdot": 3, "dense": 2}  # dense skipped after its failure
  assert by["ragdot"]["ms_rounds"] == [1.0, 1.0, 1.0] and by["ragdot"]["sm_mhz"] == 1500.0
  assert by["ragdot"]["vs_dense"] != by["ragdot"]["vs_dense"]  # NaN: no dense rounds
  assert by["ragdot:xla"]["sm_mhz"] == 1500.0


def test_bench_rounds_must_be_positive():
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="rounds"):
    bench.bench_shape(bench.Shape("t", 128, 64, 64, 4, top_k=2), ["fwd"], None,
                      iterations=1, rounds=0)
  with pytest.raises(SystemExit):  # an argparse error, before any work
    cli.main(["bench", "--shape", "256,64,64,4", "--rounds", "0", "--no-baselines"])


def test_ep_summary_takes_the_median_of_per_round_ratios():
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  def row(impl, ts):
    return dict(shape="s", op="fwd", impl=impl, ms=sorted(ts)[1], ms_rounds=ts)
  rows = [row("ragdot", [1.2, 2.6, 1.3]), row("local-rows", [1.0, 2.0, 1.0]),
          row("masked", [6.0, 13.0, 26.0])]
  (line,) = bench.ep_summary(rows)
  # per round 1.2, 1.3, 1.3: median 1.30 (the medians' ratio would be 1.3 / 1.0)
  assert "= 1.30x the local rows' call (1.20-1.30 over 3 rounds)" in line, line
  # masked / ragdot per round 5.0, 5.0, 20.0: median 5.0 (the medians' ratio: 10.0)
  assert "5.0x faster than the masked workaround" in line, line


def test_tune_dry_run_for_fp8_weights(tmp_path, capsys):
  """``--weights-dtype``: W8A16 keys (f16 rows and e5m2 weights under the bf16
  / e4m3 aliases), both forward layouts and dX, today's choice marked."""
  assert cli.main(["tune", "--dry-run", "--shape", "512,768,2048,128", "--dtype", "float16",
                   "--weights-dtype", "float8_e5m2", "--device-kind", "NVIDIA H200",
                   "--compute-capability", "9.0", "--table", str(tmp_path / "t.json")]) == 0
  out = capsys.readouterr().out
  for key in ("gmm/bfloat16+float8_e4m3fn/m512,k768,n2048,g128",
              "gmm_t/bfloat16+float8_e4m3fn/m512,k768,n2048,g128",
              "gmm_t/bfloat16+float8_e4m3fn/m512,k2048,n768,g128"):
    assert key in out
  assert out.count("(today's choice)") == 3 and "widen_staging" in out
  assert cli.main(["tune", "--dry-run", "--shape", "512,768,2048,128", "--weights-dtype",
                   "float8_e4m3fn", "--ops", "dw"]) == 2


def test_info_on_a_simulated_h200_shows_its_w8a16_kernels(capsys):
  # Without --compute-capability the simulated H200 takes its table's (9.0): fp8
  # weights then get the sm90 W8A16 kernel, as on the GPU itself.
  assert cli.main(["info", "--device-kind", "NVIDIA H200", "--weights-dtype", "float8_e4m3fn",
                   "--shape", "512,2048,1536,128"]) == 0
  out = capsys.readouterr().out
  assert "compute capability 9.0 (simulated" in out
  assert out.count("W8A16") >= 2  # fwd and dx
