"""scripts/ab_dw.py's shape selection: --shape instead of a preset, --skewed
routing any of them (the GPU timing itself runs on the device)."""

import os
import sys

import pytest

from ragdot import bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import ab_dw  # noqa: E402  (the scripts folder, as on the GPU machine)


def _shapes(*argv):
  return ab_dw.shapes(ab_dw.parser().parse_args(["out", *argv]))


def test_shape_options_replace_the_preset_and_skew_it():
  (s,) = _shapes("--shape", "4096,2048,1536,16", "--skewed")
  assert (s.m, s.k, s.n, s.g, s.top_k, s.skewed) == (4096, 2048, 1536, 16, 8, True)
  assert s.name == "4096,2048,1536,16,8 skewed"
  plain = bench.routed_group_sizes(bench.parse_shape("4096,2048,1536,16"))
  skewed = bench.routed_group_sizes(s)
  assert plain.sum() == skewed.sum() == 4096  # m rows
  assert skewed[:4].sum() > plain[:4].sum()  # the first experts are the hot ones


def test_preset_shapes_by_name_and_skewed_names():
  names = [s.name for s in _shapes("--preset", "ep-local", "--shapes",
                                    "qwen3-30b gate_up ep8 local", "--skewed")]
  assert names == ["qwen3-30b gate_up ep8 local skewed"]
  # A preset that is skewed already keeps its names.
  already = _shapes("--preset", "training-skewed", "--shapes", "qwen3-30b down skewed",
                    "--skewed")
  assert [s.name for s in already] == ["qwen3-30b down skewed"] and already[0].skewed
  assert not any(s.skewed for s in _shapes("--preset", "ep-local"))


def test_unknown_shape_name_is_an_error():
  with pytest.raises(ValueError, match="no such shape"):
    _shapes("--shape", "4096,2048,1536,16", "--shapes", "qwen3-30b down")
  with pytest.raises(SystemExit):
    _shapes("--shape", "4096,2048")


def test_table_ring_is_the_refit_the_dispatcher_no_longer_runs(monkeypatch):
  # On an H200 an f32 dW over Qwen's 256-row groups gets the kernel's default
  # (pingpong_pays); the "ring" case times the table's ring refitted to f32.
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot import dispatch  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(dispatch, "current_device",
                      lambda: dispatch.simulated_device("NVIDIA H200"))
  dispatch.clear_cache()
  try:
    (s,) = _shapes("--shapes", "qwen3-30b gate_up")
    ring = ab_dw.table_ring(s, jnp.float32)
    bf16 = ab_dw.table_ring(s, jnp.bfloat16)
    f32_choice = dispatch.choose("tgmm", None, dtype=jnp.bfloat16, out_dtype=jnp.float32,
                                 m=s.m, k=s.k, n=s.n, g=s.g, num_groups=s.g)
  finally:
    dispatch.clear_cache()
  assert f32_choice.config is None
  assert ring.pingpong and ring == bf16  # its f32 staging fits as it is
