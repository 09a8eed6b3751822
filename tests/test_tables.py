"""Tuning tables: format, bucket lookup, and configs the kernels accept."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from ragdot import dispatch, tables, tune

H200 = dispatch.Device("gpu", "NVIDIA H200", "9.0")
SRC = str(Path(__file__).resolve().parents[1] / "src")
SWEEP = Path(__file__).resolve().parents[1] / "docs" / "data" / "sweep_h200_v1.jsonl"


def test_buckets_are_powers_of_two_and_one_and_a_half():
  assert [tables.bucket(x) for x in (0, 1, 2, 3, 64, 768, 1000, 1536, 7168, 28672)] == [
      0, 1, 2, 3, 64, 768, 1024, 1536, 8192, 32768]
  assert tables.bucket(1100) == 1024 and tables.bucket(1400) == 1536


def test_key_round_trip():
  text = tables.key("gmm_t", "bfloat16", 32768, 1000, 1536, 128)
  assert text == "gmm_t/bfloat16/m32768,k1024,n1536,g128"
  assert tables.parse_key(text) == ("gmm_t", "bfloat16", (32768, 1024, 1536, 128))
  with pytest.raises(ValueError):
    tables.key("fwd", "bfloat16", 1, 1, 1, 1)


def test_shipped_tables_load_and_cover_h200_and_unknown_gpus():
  names = {t.name for t in tables.all_tables()}
  assert {"nvidia_h200.json", "default.json"} <= names
  h200, why = tables.table_for("NVIDIA H200")
  assert h200.name == "nvidia_h200.json" and "H200" in why
  assert any(e["measured"] for e in h200.entries.values())
  # Every entry says whether it was measured and where it comes from.
  assert all(isinstance(e["measured"], bool) and e.get("source") for e in h200.entries.values())
  for t in tables.all_tables():
    for text, entry in t.entries.items():
      assert tables.key(*tables.parse_key(text)[:2], *entry["shape"]) == text


@pytest.mark.parametrize("table", tables.all_tables(), ids=lambda t: t.name)
def test_every_entry_names_a_config_the_kernel_accepts(table):
  for text, entry in table.entries.items():
    op = tables.parse_key(text)[0]
    cls = dispatch.config_class(entry["backend"], op)
    if entry["config"] is None:  # the backend's default for each call shape
      continue
    config = dispatch.make_config(entry["backend"], op, entry["config"])
    assert isinstance(config, cls), text
    dtype = tables.parse_key(text)[1]
    if entry["backend"] == "mosaic" and "+" in dtype:  # W8A16: the kernel's rule keeps it
      from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
      m, k, _, g = entry["shape"]
      assert config.swap, text
      assert mosaic_fwd.weight_only_config(config, m, g, k, op == "gmm_t") == config, text
    elif entry["backend"] == "mosaic":  # fits SMEM for its inputs (16- or 8-bit), 16-bit out
      module = importlib.import_module(dispatch.CONFIG_CLASSES[("mosaic", op)][0])
      assert module.fit_config(config, dtype, "bfloat16") == config, text
      # ... and refits to a valid config (or to None: the default) for an f32 output.
      wide = module.fit_config(config, dtype, "float32")
      assert wide is None or isinstance(wide, cls), text
  for ops in table.data["defaults"].values():
    for op, default in ops.items():
      assert op in tables.OPS
      dispatch.make_config(default["backend"], op, default["config"])


def test_h200_entries_follow_the_measurements():
  """Tuned entries are at least as fast as the v1 sweep's best for the same op and shape."""
  shipped, _ = tables.table_for("NVIDIA H200")
  sweep = tune._new_table("NVIDIA H200")
  assert tune.import_sweep(str(SWEEP), sweep) == 4
  for text, best in sweep.entries.items():
    entry = shipped.entries[text]
    assert entry["measured"] and entry["tflops"] >= 0.97 * best["tflops"], (text, entry, best)
  c = dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=32768, k=2048, n=1536, g=128,
                      device=H200)
  entry = shipped.entries["gmm/bfloat16/m32768,k2048,n1536,g128"]
  assert (c.implementation, c.measured) == (entry["backend"], True)
  assert c.config == dispatch.make_config(entry["backend"], "gmm", entry["config"])


def test_import_sweep_round_trips(tmp_path):
  t = tune._new_table("NVIDIA H200")
  assert tune.import_sweep(str(SWEEP), t) == 4
  fwd = t.entries["gmm/bfloat16/m32768,k2048,n1536,g128"]
  assert fwd["config"]["grid_tile_width"] == 4 and fwd["tflops"] > 400  # the sweep's best row
  path = t.save(tmp_path / "x.json")
  assert tables.load_file(path).entries == t.entries


def _bench_rows(shape, auto_ms, mosaic_ms, triton_ms, auto="triton"):
  base = dict(shape=shape, op="fwd", m=4096, k=1024, n=2048, g=16)
  cfg = {"triton": dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
         "mosaic": None}
  return [dict(base, impl="ragdot", ms=auto_ms, choice=f"{auto} [...] (auto)"),
          dict(base, impl="ragdot:mosaic", ms=mosaic_ms, backend="mosaic",
               config=cfg["mosaic"]),
          dict(base, impl="ragdot:triton", ms=triton_ms, backend="triton",
               config=cfg["triton"]),
          dict(base, impl="dense", ms=0.01)]


def test_import_bench_keeps_the_faster_forced_backend(tmp_path):
  path = tmp_path / "bench.json"
  rows = (_bench_rows("a", 0.066, 0.063, 0.066)            # mosaic 5% faster: imported
          + [dict(r, m=16384) for r in _bench_rows("b", 0.050, 0.0495, 0.050)])  # 1%: not
  path.write_text(json.dumps(rows))
  t = tune._new_table("NVIDIA H200")
  assert tune.import_bench(str(path), t, "NVIDIA H200") == [
      "gmm/bfloat16/m4096,k1024,n2048,g16"]
  entry = t.entries["gmm/bfloat16/m4096,k1024,n2048,g16"]
  assert entry["backend"] == "mosaic" and entry["config"] is None and entry["measured"]
  assert entry["ms"] == 0.063
  hit = t.lookup("gmm", "bfloat16", 4096, 1024, 2048, 16)
  assert (hit.backend, hit.config, hit.distance) == ("mosaic", None, 0.0)


def test_import_bench_dx_margin_failures_and_skewed_rows(tmp_path):
  def rows(shape, op, auto_ms, mosaic_ms, triton_ms, **extra):
    out = []
    for r in _bench_rows(shape, auto_ms, mosaic_ms, triton_ms):
      out.append(dict(r, op=op, **extra))
    return out
  data = (rows("dx", "dx", 0.066, 0.063, 0.066)           # dX: k and n swapped in the key
          + [dict(r, m=8192) for r in rows("edge", "fwd", 0.0305, 0.03, 0.05)]  # 1.7%: no
          + [dict(r, m=2048) for r in rows("auto failed", "fwd", float("nan"), 0.05, 0.04)]
          + [dict(r, m=1024) for r in rows("x skewed", "fwd", 0.066, 0.01, 0.066,
                                            routing="skewed")])
  path = tmp_path / "bench.json"
  path.write_text(json.dumps(data))
  t = tune._new_table("NVIDIA H200")
  keys = tune.import_bench(str(path), t, "NVIDIA H200")
  assert keys == ["gmm_t/bfloat16/m4096,k2048,n1024,g16", "gmm/bfloat16/m2048,k1024,n2048,g16"]
  assert t.entries[keys[1]]["backend"] == "triton"  # the faster forced row when auto failed
  assert t.entries[keys[1]]["config"]["num_warps"] == 8
  assert "failed" in t.entries[keys[1]]["source"]
  # Two cases that map to one table key are refused, not silently merged.
  path.write_text(json.dumps(rows("a", "fwd", 0.066, 0.063, 0.066)
                             + rows("b", "fwd", 0.066, 0.060, 0.066)))
  with pytest.raises(ValueError, match="two cases"):
    tune.import_bench(str(path), tune._new_table("NVIDIA H200"), "NVIDIA H200")


def test_import_bench_recomputes_a_missing_forced_choice(tmp_path):
  # Older bench files record the choice of the automatic row only: the forced
  # rows' backends and configs come from the dispatcher with the shipped table.
  rows = [{k: v for k, v in r.items() if k not in ("backend", "config")}
          for r in _bench_rows("a", 0.070, 0.075, 0.060, auto="mosaic")]
  for r in rows:  # the training gate_up shape: the shipped table has mosaic there
    r.update(m=32768, k=2048, n=1536, g=128)
  path = tmp_path / "bench.json"
  path.write_text(json.dumps({"rows": rows}))
  t = tune._new_table("NVIDIA H200")
  assert tune.import_bench(str(path), t, "NVIDIA H200") == [
      "gmm/bfloat16/m32768,k2048,n1536,g128"]
  entry = t.entries["gmm/bfloat16/m32768,k2048,n1536,g128"]
  shipped, _ = tables.table_for("NVIDIA H200")
  want = shipped.lookup("gmm", "bfloat16", 32768, 2048, 1536, 128)
  assert entry["backend"] == "triton"
  # The shipped entry names mosaic, so the forced triton row ran triton's default.
  assert want.backend == "mosaic" and entry["config"] is None


def test_nearest_bucket_and_far_shapes():
  t, _ = tables.table_for("NVIDIA H200")
  near = t.lookup("gmm", "bfloat16", 30000, 2048, 1400, 120)
  assert near.key == "gmm/bfloat16/m32768,k2048,n1536,g128" and near.distance == 0
  off = t.lookup("gmm_t", "bfloat16", 32768, 1536, 2048, 128)  # real dX of gate_up
  assert off.key is not None and 0 <= off.distance <= 3
  far = t.lookup("tgmm", "bfloat16", 8, 64, 64, 2)
  assert far.key is None and far.backend == "mosaic" and far.config is None
  assert "table default" in far.reason


def test_dtypes_and_devices():
  f16 = tables.lookup("NVIDIA H200", "gmm", "float16", 32768, 2048, 1536, 128)
  assert f16.measured and "as bfloat16" in f16.reason
  assert tables.lookup("NVIDIA H200", "gmm", "float32", 32768, 2048, 1536, 128) is None
  # The H100's own table holds what was measured there and inherits the rest.
  h100 = tables.lookup("NVIDIA H100 80GB HBM3", "gmm", "bfloat16", 32768, 2048, 1536, 128)
  assert h100.backend == "mosaic" and "borrowed from nvidia_h200.json" in h100.reason
  h100_dw = tables.lookup("NVIDIA H100 80GB HBM3", "tgmm", "bfloat16", 32768, 2048, 1536, 128)
  assert h100_dw.table == "nvidia_h100_80gb_hbm3.json" and h100_dw.config["num_stages"] == 5
  h800 = tables.lookup("NVIDIA H800", "gmm", "bfloat16", 32768, 2048, 1536, 128)
  assert h800.backend == "mosaic" and "reused" in h800.reason
  sm90 = tables.table_for("NVIDIA H123", "9.0")[0]
  assert sm90.name == "nvidia_h200.json"
  for kind in ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe"):
    a100 = tables.lookup(kind, "tgmm", "bfloat16", 32768, 2048, 1536, 128, "8.0")
    assert a100.backend == "triton" and a100.config is None and not a100.measured
    assert "not measured" in a100.reason
  unknown = tables.lookup("NVIDIA GeForce RTX 4090", "gmm", "bfloat16", 32768, 2048, 1536, 128,
                          "8.9")
  assert unknown.backend == "xla" and "unknown GPU" in unknown.reason


def test_user_table_dir_overrides_shipped(tmp_path, monkeypatch):
  data = json.loads((tables.TABLE_DIR / "nvidia_h200.json").read_text())
  data["entries"] = {"gmm/bfloat16/m32768,k2048,n1536,g128": {
      "backend": "xla", "config": {"block_m": 32}, "measured": True,
      "shape": [32768, 2048, 1536, 128]}}
  (tmp_path / "nvidia_h200.json").write_text(json.dumps(data))
  monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
  tables.clear_cache()
  try:
    hit = tables.lookup("NVIDIA H200", "gmm", "bfloat16", 32768, 2048, 1536, 128)
    assert (hit.backend, hit.config) == ("xla", {"block_m": 32})
  finally:
    monkeypatch.delenv(tables.ENV_DIR)
    tables.clear_cache()


def test_also_for_matches_whole_model_names():
  for kind, table in [("NVIDIA RTX A1000 Laptop GPU", "default.json"),
                      ("NVIDIA A10", "default.json"),
                      ("NVIDIA A100-PCIE-40GB", "nvidia_a100_sxm4_80gb.json"),
                      ("NVIDIA H200 NVL", "nvidia_h200.json"),
                      ("NVIDIA H20", "nvidia_h200.json"),
                      ("NVIDIA GH200 480GB", "nvidia_h200.json")]:
    assert tables.table_for(kind)[0].name == table, kind
  assert "H20" in tables.table_for("NVIDIA H20")[1]
  assert "H20:" not in tables.table_for("NVIDIA H200 NVL")[1]


def test_a_simulated_device_takes_its_tables_compute_capability():
  assert dispatch.simulated_device("NVIDIA H200").compute_capability == "9.0"
  assert dispatch.simulated_device("NVIDIA H100 80GB HBM3").compute_capability == "9.0"
  assert dispatch.simulated_device("NVIDIA A100 80GB PCIe").compute_capability == "8.0"
  assert dispatch.simulated_device("NVIDIA L4").compute_capability is None
  assert dispatch.simulated_device("NVIDIA H200", "8.0").compute_capability == "8.0"


@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_a_tuned_table_keeps_the_entries_its_kind_borrowed(tmp_path, monkeypatch, kind):
  # ``ragdot tune`` starts a table with the shipped one's name (the H100's own
  # inherits the H200's): it shadows it and inherits it, so the entries the kind
  # used (the H200's among them) stay in reach under the ones it measures.
  before = tables.lookup(kind, "gmm", "bfloat16", 512, 2048, 1536, 128)
  h100 = tables.lookup("NVIDIA H100 80GB HBM3", "gmm", "bfloat16", 512, 2048, 1536, 128)
  table = tune.open_table(tmp_path / tables.slug(kind), kind)
  assert table.data["inherits"] == tables.slug(kind)  # the shipped table it shadows
  assert table.data["compute_capability"] == "9.0"
  table.put("gmm", "bfloat16", 32768, 2048, 1536, 128,
            {"backend": "triton", "config": None, "measured": True})
  table.save()
  try:
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
    tables.clear_cache()
    own = tables.lookup(kind, "gmm", "bfloat16", 32768, 2048, 1536, 128)
    assert own.backend == "triton" and "borrowed" not in own.reason
    kept = tables.lookup(kind, "gmm", "bfloat16", 512, 2048, 1536, 128)
    assert (kept.backend, kept.config, kept.key) == (before.backend, before.config, before.key)
    assert "borrowed from nvidia_h200.json" in kept.reason
    assert "inherits" not in json.loads((tmp_path / tables.slug(kind)).read_text())["entries"]
    also = tables.lookup("NVIDIA H100 80GB HBM3", "gmm", "bfloat16", 512, 2048, 1536, 128)
    assert (also.backend, also.config) == (h100.backend, h100.config)
  finally:
    monkeypatch.delenv(tables.ENV_DIR)
    tables.clear_cache()


def test_tables_inheriting_each_other_are_refused(tmp_path, monkeypatch):
  for name, parent in (("a.json", "b.json"), ("b.json", "a.json")):
    (tmp_path / name).write_text(json.dumps(
        {"format": tables.FORMAT, "device_kind": name, "inherits": parent, "entries": {}}))
  try:
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
    tables.clear_cache()
    with pytest.raises(ValueError, match="inherits it back"):
      tables.all_tables()
  finally:
    monkeypatch.delenv(tables.ENV_DIR)
    tables.clear_cache()


@pytest.mark.parametrize("entries, match", [
    ({"gmm/bfloat16/m1": {"backend": "xla"}}, "bad entry key"),
    ({"gmm/bfloat16/m1,k1,n1,g1": {"backend": "cuda"}}, "backend"),
    ({"gmm/bfloat16/m1,k1,n1,g1": {"backend": "xla", "config": 3}}, "config"),
    ({"gmm/bfloat16/m1,k1,n1,g1": {"backend": "mosaic", "config": {"num_sms": [132]}}},
     "num_sms"),
    ({"gmm/bfloat16/m1,k1,n1,g1": {"backend": "xla", "shape": [1, 1, 1]}}, "shape"),
])
def test_a_malformed_table_names_its_file_and_entry(tmp_path, entries, match):
  path = tmp_path / "x.json"
  path.write_text(json.dumps({"format": tables.FORMAT, "device_kind": "x", "entries": entries}))
  with pytest.raises(ValueError, match=match) as e:
    tables.load_file(path)
  assert str(path) in str(e.value)


@pytest.mark.parametrize("text, match", [
    ('{"format": ', "not JSON"),
    ('[1, 2]', "format"),
    ('{"format": %s, "defaults": {"bfloat16": {"gmm": {"backend": "xla", "config": "x"}}}}',
     "default bfloat16/gmm"),
    ('{"format": %s, "dtype_aliases": ["float16"]}', "dtype_aliases"),
    ('{"format": %s, "max_distance": "far"}', "max_distance"),
])
def test_a_malformed_table_file_names_itself(tmp_path, text, match):
  path = tmp_path / "x.json"
  path.write_text(text.replace("%s", json.dumps(tables.FORMAT)))
  with pytest.raises(ValueError, match=match) as e:
    tables.load_file(path)
  assert str(path) in str(e.value)


def test_reading_tables_imports_no_kernel_module():
  code = ("import sys, ragdot.tables as t; t.lookup('NVIDIA H200', 'gmm', 'bfloat16', 4096,"
          " 512, 512, 16); bad = [m for m in sys.modules if m.startswith("
          "('ragdot.backends.mosaic', 'jax.experimental.pallas'))]; assert not bad, bad")
  env = dict(os.environ, PYTHONPATH=SRC, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.parametrize("sustained_s", [0.0, 0.1])
def test_tune_task_times_candidates_burst_or_sustained(monkeypatch, sustained_s):
  # On CPU only the xla backend runs; the entry records how it was timed.
  import time as time_mod  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot import tune  # pylint: disable=g-import-not-at-top

  from ragdot.backends import xla  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(tune, "candidates",
                      lambda task, dtype, incumbent=None: [
                          ("xla", xla.default_config(task.m, task.g))])
  task = tune.Task("fwd", "tiny", 256, 64, 64, 4, top_k=2)
  entry = tune.tune_task(task, jnp.bfloat16, time_mod.time() + 60, iterations=2, repeats=1,
                         jobs=1, sustained_s=sustained_s)
  assert entry["backend"] == "xla" and entry["ms"] > 0 and entry["measured"]
  assert entry["method"].startswith("sustained 0.1 s") == (sustained_s > 0)


def test_pick_prefers_the_skew_robust_of_the_near_best():
  from ragdot import tune  # pylint: disable=g-import-not-at-top
  rows = [dict(name="a", ms=1.00, skewed_ms=1.60), dict(name="b", ms=1.015, skewed_ms=1.30),
          dict(name="c", ms=1.10, skewed_ms=1.00), dict(name="d", ms=1.30)]
  assert tune.pick(rows, 0.02)["name"] == "b"  # c is faster on skew but 10% slower routed
  assert tune.pick(rows, 0.0)["name"] == "a"  # only a itself is within 0%
  assert tune.pick(rows, 0.2)["name"] == "c"
  assert tune.pick([dict(name="d", ms=1.3), dict(name="e", ms=1.2)], 0.02)["name"] == "e"


@pytest.mark.parametrize("slack,winner", [(0.02, 1), (-1.0, 0)])
def test_tune_task_checks_the_near_best_on_skewed_sizes(monkeypatch, slack, winner):
  # Two correct xla candidates; a fake timer makes the first 1% faster on routed sizes and
  # twice as slow on skewed ones (told apart by their largest group).
  import time as time_mod  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot import timing, tune  # pylint: disable=g-import-not-at-top
  from ragdot.backends import xla  # pylint: disable=g-import-not-at-top

  configs = [xla.default_config(256, 4), dataclasses.replace(xla.default_config(256, 4),
                                                             block_m=32)]
  assert configs[0] != configs[1]
  monkeypatch.setattr(tune, "candidates",
                      lambda task, dtype, incumbent=None: [("xla", c) for c in configs])
  task = tune.Task("fwd", "tiny", 512, 64, 64, 16, top_k=2)
  routed_max = int(tune._group_sizes(task).max())
  seen = []  # compiled callables in the order first timed: candidate 0, then 1

  def fake_time(compiled, lhs, rhs, gs, iterations):
    del lhs, rhs, iterations
    if compiled not in seen:
      seen.append(compiled)
    i, skewed = seen.index(compiled), int(gs.max()) > routed_max
    return ((2.0, 1.0)[i] if skewed else (1.00, 1.01)[i]), "fake"

  monkeypatch.setattr(timing, "device_time_ms", fake_time)
  rows = []
  entry = tune.tune_task(task, jnp.bfloat16, time_mod.time() + 60, iterations=2, repeats=1,
                         jobs=1, skew_slack=slack, log=rows.append)
  assert entry["config"] == tune.config_fields(configs[winner])
  assert entry["ms"] == (1.00, 1.01)[winner]
  assert entry["skewed_ms"] == ((2.0, 1.0)[winner] if slack >= 0 else None)
  assert sum(r.get("routing") == "skewed" for r in rows) == (2 if slack >= 0 else 0)


def test_tune_task_rearms_the_watchdog_for_each_sustained_window(monkeypatch):
  # Two 0.6 s windows under a 1 s hang limit: each timing gets the full limit, so no
  # false "hang" (the watchdog's exit is recorded here instead of ending the process).
  import time as time_mod  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot import tune, watchdog as wd  # pylint: disable=g-import-not-at-top
  from ragdot.backends import xla  # pylint: disable=g-import-not-at-top

  exits = []
  monkeypatch.setattr(wd.os, "_exit", exits.append)
  monkeypatch.setattr(tune, "candidates",
                      lambda task, dtype, incumbent=None: [
                          ("xla", xla.default_config(task.m, task.g))])
  task = tune.Task("fwd", "tiny", 256, 64, 64, 4, top_k=2)
  dog = wd.Watchdog(1.0, "test")
  entry = tune.tune_task(task, jnp.bfloat16, time_mod.time() + 60, iterations=2, repeats=2,
                         jobs=1, sustained_s=0.6, watchdog=dog)
  time_mod.sleep(0.3)  # one more look by the watchdog after the last window
  dog.close()
  assert entry["ms"] > 0 and exits == []


@pytest.mark.parametrize("where", ["routed", "skewed"])
@pytest.mark.parametrize("message,fault", [
    ("INTERNAL: CUDA error: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access", True),
    ("RESOURCE_EXHAUSTED: out of memory", False)])
def test_tune_task_stops_at_a_device_fault(monkeypatch, message, fault, where):
  # Three xla candidates, all within the skew slack.  The second one's timing fails,
  # on routed sizes or in the skewed check.  A sticky CUDA error (the context is
  # lost: every later run would fail or mislead) ends the task with DeviceFault
  # before anything else is timed; any other error only marks that row.
  import time as time_mod  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot import timing, tune  # pylint: disable=g-import-not-at-top
  from ragdot.backends import xla  # pylint: disable=g-import-not-at-top

  configs = [dataclasses.replace(xla.default_config(256, 4), block_m=b) for b in (16, 32, 64)]
  monkeypatch.setattr(tune, "candidates",
                      lambda task, dtype, incumbent=None: [("xla", c) for c in configs])
  task = tune.Task("fwd", "tiny", 512, 64, 64, 16, top_k=2)
  routed_max = int(tune._group_sizes(task).max())
  timed = {"routed": [], "skewed": []}

  def fake_time(compiled, lhs, rhs, gs, iterations):
    del lhs, rhs, iterations
    kind = "skewed" if int(gs.max()) > routed_max else "routed"
    timed[kind].append(compiled)
    if kind == where and len(timed[kind]) == 2:
      raise RuntimeError(message)
    return 1.0 + 0.01 * len(timed[kind]), "fake"

  monkeypatch.setattr(timing, "device_time_ms", fake_time)
  rows = []
  run = lambda: tune.tune_task(task, jnp.bfloat16, time_mod.time() + 60, iterations=2,
                               repeats=1, jobs=1, skew_slack=0.5, log=rows.append)
  if fault:
    with pytest.raises(tune.DeviceFault, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
      run()
    assert len(timed[where]) == 2
    assert len(timed["skewed"]) == (0 if where == "routed" else 2)
    assert ("error" if where == "routed" else "skewed_error") in rows[-1]
  else:
    entry = run()
    # (a candidate that failed on routed sizes is not checked on skewed ones)
    assert len(timed["routed"]) == 3 and len(timed["skewed"]) == (2 if where == "routed" else 3)
    errors = [r for r in rows if "error" in r or "skewed_error" in r]
    assert len(errors) == 1 and entry is not None


def test_config_reprs_parse_back():
  """``tune.parse_config_repr`` (``--import-sweep``) reads today's configs,
  bool fields among them, back to the same config."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from ragdot.backends.mosaic_dw_config import MosaicDwConfig  # pylint: disable=g-import-not-at-top
  from ragdot.backends.mosaic_fwd_config import MosaicFwdConfig  # pylint: disable=g-import-not-at-top
  from ragdot.backends.triton import TritonConfig  # pylint: disable=g-import-not-at-top
  fwd = MosaicFwdConfig()
  assert any(isinstance(getattr(fwd, f.name), bool) for f in dataclasses.fields(fwd))
  for config in (fwd, MosaicDwConfig(), TritonConfig()):
    name, fields = tune.parse_config_repr(repr(config))
    assert name == type(config).__name__
    assert type(config)(**fields) == config
  with pytest.raises(ValueError, match="block_m"):
    tune.parse_config_repr("MosaicFwdConfig(block_m=1.5)")


def test_tune_writes_into_the_user_table_dir_when_one_is_set(tmp_path, monkeypatch):
  """Without --table, ``ragdot tune`` writes the shipped table unless
  RAGDOT_TABLE_DIR is set: then this kind's table there (it used to write into
  the installed package even then)."""
  from ragdot import tune  # pylint: disable=g-import-not-at-top
  kind = "NVIDIA H200"
  monkeypatch.delenv(tables.ENV_DIR, raising=False)
  tables.clear_cache()
  shipped = tune.default_table_path(kind)
  assert shipped.parent == tables.TABLE_DIR and shipped.exists()
  try:
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
    tables.clear_cache()
    assert tune.default_table_path(kind) == tmp_path / tables.slug(kind)
    table = tune.open_table(tune.default_table_path(kind), kind)
    assert table.data["inherits"] == shipped.name  # (extends the table it shadows)
    table.save()
    tables.clear_cache()
    assert tune.default_table_path(kind) == tmp_path / tables.slug(kind)
    assert tune.default_table_path("NVIDIA A100-SXM4-80GB").parent == tmp_path
  finally:
    monkeypatch.delenv(tables.ENV_DIR)
    tables.clear_cache()
  assert tune.default_table_path(kind) == shipped
