"""scripts/ab_table_variant.py: its B table changes only the named op's Mosaic
entries, and the dispatcher reads it when the script points RAGDOT_TABLE_DIR at
it (checked for an H200 on the CPU)."""

import json
import os
import sys

import jax.numpy as jnp

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
