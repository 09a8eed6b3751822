"""scripts/ab_table_variant.py: its B table changes only the named op's Mosaic
entries, and the dispatcher reads it when the script points RAGDOT_TABLE_DIR at
it (checked for an H200 on the CPU)."""

import json
import os
import sys

import jax.numpy as jnp
import pytest

from ragdot import dispatch, tables

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import ab_table_variant  # noqa: E402  (the scripts folder, as on the GPU machine)

H200 = dispatch.Device("gpu", "NVIDIA H200", "9.0")


def _dw_side_rows():
  dispatch.clear_cache()
  return dispatch.choose("tgmm", None, dtype=jnp.bfloat16, m=32768, k=2048, n=1536, g=128,
                         num_groups=128, device=H200).config.side_rows


def test_variant_table_is_what_the_dispatcher_reads(tmp_path, monkeypatch):
  shipped, _ = tables.table_for(H200.kind, H200.compute_capability)
  data, changed = ab_table_variant.variant_table(shipped.data, {"tgmm": {"side_rows": False}})
  mosaic_dw_entries = [k for k, e in shipped.data["entries"].items()
                       if k.startswith("tgmm/") and e["backend"] == "mosaic"]
  assert changed == len(mosaic_dw_entries) > 0
  for key, entry in data["entries"].items():  # nothing else changed
    if key not in mosaic_dw_entries:
      assert entry == shipped.data["entries"][key]
  assert _dw_side_rows()  # the shipped table's dW entry
  (tmp_path / shipped.name).write_text(json.dumps(data))
  monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
  try:
    assert not _dw_side_rows()
  finally:
    monkeypatch.delenv(tables.ENV_DIR)
    dispatch.clear_cache()
  assert _dw_side_rows()


def test_ab_variants_unfitted_case_is_the_entry_before_fitting():
  import ab_variants  # pylint: disable=g-import-not-at-top
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  s = bench.preset_shapes("training-1k", ["qwen3-30b down 1k"])[0]
  call = dispatch.backend_call("fwd", s.k, s.n)
  dispatch.clear_cache()
  fitted = dispatch.choose("gmm", None, dtype=jnp.bfloat16, m=s.m, k=call.k, n=call.n, g=s.g,
                           num_groups=s.g, device=H200)
  fit = mosaic_fwd.fit_rows_per_group
  entry = ab_variants.unfitted_choice(s, call, H200)
  assert mosaic_fwd.fit_rows_per_group is fit  # restored
  assert fitted.config == mosaic_fwd.fit_rows_per_group(entry.config, s.m, s.g) != entry.config
  assert entry.config.swap_rows + entry.config.tail_rows > 96 == (
      fitted.config.swap_rows + fitted.config.tail_rows)
  assert dispatch.choose(  # and the cache holds the fitted choice again
      "gmm", None, dtype=jnp.bfloat16, m=s.m, k=call.k, n=call.n, g=s.g, num_groups=s.g,
      device=H200).config == fitted.config


def test_ab_tables_resolved_choices_read_each_table_and_restore(tmp_path, monkeypatch):
  import ab_tables  # pylint: disable=g-import-not-at-top
  from ragdot import bench  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv(tables.ENV_DIR, raising=False)
  shipped, _ = tables.table_for(H200.kind, H200.compute_capability)
  s = bench.Shape("t", 4096, 768, 2048, 16)  # a bucket the new table gets an entry for
  call = dispatch.backend_call("fwd", s.k, s.n)
  key = tables.key(call.table_op, "bfloat16", s.m, call.k, call.n, s.g)
  data = json.loads(json.dumps(shipped.data))
  data["entries"].pop(key, None)
  old_path = tmp_path / "old.json"
  old_path.write_text(json.dumps(data))
  fields = {"block_m": 128, "block_n": 192, "block_k": 64, "num_stages": 3,
            "num_compute_wgs": 2}
  data["entries"][key] = {"backend": "mosaic", "config": fields, "measured": True,
                          "shape": [s.m, call.k, call.n, s.g]}
  new_path = tmp_path / "new.json"
  new_path.write_text(json.dumps(data))
  old = ab_tables.resolved_choices(str(old_path), [s], H200)
  new = ab_tables.resolved_choices(str(new_path), [s], H200)
  assert set(old) == set(new) == {("t", "fwd"), ("t", "dx"), ("t", "dw")}
  assert new[("t", "fwd")] != old[("t", "fwd")]
  assert (new[("t", "fwd")][1].block_n, new[("t", "fwd")][1].num_stages) == (192, 3)
  assert new[("t", "dx")] == old[("t", "dx")] and new[("t", "dw")] == old[("t", "dw")]
  assert tables.ENV_DIR not in os.environ  # restored, and the caches hold the shipped table
  assert tables.table_for(H200.kind, H200.compute_capability)[0].path == shipped.path
  other = dict(data, device_kind="NVIDIA A100", also_for={})  # (its "H20" would match)
  (tmp_path / "a100.json").write_text(json.dumps(other))
  with pytest.raises(SystemExit, match="NVIDIA A100"):
    ab_tables.resolved_choices(str(tmp_path / "a100.json"), [s], H200)
