"""kernel_timeline's trace summaries, and the dW kernel with Mosaic's profiler on
(``sm90.profiling``): it lowers for sm90 and its profile buffer counts in the
SMEM check."""

import dataclasses
import functools
import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragdot import kernel_timeline
from ragdot.backends import mosaic_dw, mosaic_fwd, sm90
from sm90_lowering import assert_gmm_lowers
from test_mosaic_dw import PINGPONG


def _events(tid, ranges, start=5000.0):
  """Trace events of one tid: ``ranges`` = [(name, begin, end)] in cycles."""
  out = []
  for name, begin, end in ranges:
    out.append(dict(name=name, ph="B", ts=(start + begin) / 1e3, pid=1, tid=tid))
    out.append(dict(name=name, ph="E", ts=(start + end) / 1e3, pid=1, tid=tid))
  return out


def test_summarize_folds_ctas_per_role_and_counts_outermost_ranges():
  # 2 warpgroups a CTA, 2 CTAs: tids 1, 2 (CTA 0) and 3, 4 (CTA 1).
  events = (_events(1, [("wait", 0, 10), ("mma", 10, 50), ("store", 60, 100)])
            + _events(3, [("wait", 0, 30), ("mma", 30, 70), ("store", 70, 100)])
            + _events(2, [("load", 0, 20), ("load", 40, 60)], start=9000.0)
            + _events(4, [("load", 0, 40)]))
  # A range nested in another counts only through its parent.
  events += [dict(name="outer", ph="B", ts=0.0, pid=2, tid=6),
             dict(name="inner", ph="B", ts=0.01, pid=2, tid=6),
             dict(name="inner", ph="E", ts=0.02, pid=2, tid=6),
             dict(name="outer", ph="E", ts=0.04, pid=2, tid=6)]
  s = kernel_timeline.summarize(events, 2, {0: "consumer"})
  c = s["consumer"]
  assert c["traces"] == 2 and c["span"] == pytest.approx(100)
  assert c["ranges"]["wait"]["cycles"] == pytest.approx(20)  # (10 + 30) / 2
  assert c["ranges"]["mma"]["share"] == pytest.approx(0.4)
  assert c["ranges"]["store"]["count"] == pytest.approx(1)
  assert c["ranges"]["other"]["cycles"] == pytest.approx(5)  # CTA 0 has 50..60 uncovered
  w = s["wg1"]
  assert w["traces"] == 3 and "inner" not in w["ranges"]
  assert w["span"] == pytest.approx((60 + 40 + 40) / 3)
  assert w["ranges"]["load"]["count"] == pytest.approx(1)  # (2 + 1 + 0) / 3
  text = kernel_timeline.format_summary(s)
  assert "consumer: 2 CTAs" in text and "mma" in text


def test_unbalanced_trace_and_bad_arguments_raise():
  bad = [dict(name="a", ph="B", ts=0.0, tid=1), dict(name="b", ph="E", ts=1.0, tid=1)]
  with pytest.raises(ValueError, match="does not close"):
    kernel_timeline.ranges_by_trace(bad)
  with pytest.raises(ValueError, match="phase"):
    kernel_timeline.ranges_by_trace([dict(name="a", ph="X", ts=0.0, tid=1)])
  with pytest.raises(ValueError, match="warpgroups"):
    kernel_timeline.summarize([], 0)
  with pytest.raises(ValueError, match="space"):
    with sm90.profiling("/tmp/unused", 0):
      pass


def test_load_reads_a_trace_file(tmp_path):
  path = tmp_path / "k-1-trace.json"
  events = _events(1, [("mma", 0, 5)])
  path.write_text(json.dumps(dict(displayTimeUnit="ns", traceEvents=events)))
  assert kernel_timeline.load(str(path)) == events
  packed = tmp_path / "k-1-trace.json.gz"
  with gzip.open(packed, "wt") as f:
    json.dump(dict(traceEvents=events), f)
  assert kernel_timeline.load(str(packed)) == events


def _lower_dw(config, m=4096, k=2048, n=1536, g=16):
  f = jax.jit(functools.partial(mosaic_dw.tgmm, num_groups=g, out_dtype=jnp.bfloat16,
                                precision=None, interpret=False, config=config))
  args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
          jax.ShapeDtypeStruct((g,), jnp.int32), None)
  return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_profiled_dw_lowers_and_its_buffer_counts_in_smem(monkeypatch, tmp_path):
  # The trace is written by a host callback, which cannot lower for CUDA on a
  # CPU machine: stand it in with nothing (the kernel itself lowers first).
  monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: None)
  cfg = dataclasses.replace(PINGPONG, num_sms=None, num_stages=4, block_n=192,
                            epilogue_split=3, epilogue_rows=64, epilogue_buffers=2,
                            side_rows=True)
  plain = _lower_dw(cfg)
  with sm90.profiling(str(tmp_path), 128) as profile:
    assert sm90.active_profile() is profile and sm90.active_profile(interpret=True) is None
    assert sm90.profile_smem_bytes(3) == 3 * 16 * 128 and sm90.profile_smem_bytes(3, True) == 0
    assert sm90.compiler_params().profile_space == 128
    assert sm90.compiler_params(interpret=True).profile_space == 0
    profiled = _lower_dw(cfg)
  assert sm90.active_profile() is None and sm90.compiler_params().profile_space == 0
  assert sm90.profile_smem_bytes(3) == 0
  assert "mosaic_gpu" in profiled and profiled != plain
  free = cfg.smem_budget() - mosaic_dw.smem_bytes(cfg, jnp.bfloat16, jnp.bfloat16)
  too_many = free // sm90.Profile("", 1).smem_bytes(3) + 1
  with sm90.profiling(str(tmp_path), too_many):
    with pytest.raises(NotImplementedError, match="profile buffer"):
      _lower_dw(cfg)


def test_profiled_swap_ring_lowers(monkeypatch, tmp_path):
  # (the table's 4-stage swap ring leaves ~3 KB of SMEM: 3 stages leave room)
  monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: None)
  cfg = mosaic_fwd.MosaicFwdConfig(
      block_m=128, block_n=128, block_k=64, num_stages=3, num_compute_wgs=2,
      epilogue_split=2, delay_release=0, ring=True, tail_rows=32, swap=True,
      tail_split=True, swizzle_staging=True, short_tile_rows=64, share_rows=True)
  with sm90.profiling(str(tmp_path), 512):
    assert_gmm_lowers(cfg, m=4096, k=768, n=2048, g=16, transpose_rhs=False)
  free = cfg.smem_budget() - cfg.smem_bytes(jnp.bfloat16, jnp.bfloat16)
  with sm90.profiling(str(tmp_path), free // sm90.Profile("", 1).smem_bytes(3) + 1):
    with pytest.raises(NotImplementedError, match="profile buffer"):
      assert_gmm_lowers(cfg, m=4096, k=768, n=2048, g=16, transpose_rhs=False)


def _raw_trace(path, per_trace, names, base=1000):
  """A ``raw_dumps`` file of one CTA of len(per_trace) warpgroups:
  per_trace[t] = [(name, begin, end)] in cycles from ``base``."""
  ids = {n: i for i, n in enumerate(names)}
  width = 3 + 4 * max(len(r) for r in per_trace)
  buf = np.zeros((len(per_trace), width), np.uint32)
  for t, ranges in enumerate(per_trace):
    body = []
    for name, b, e in ranges:
      body += [ids[name], (base + b) % 2**32, ids[name] | 1 << 31, (base + e) % 2**32]
    buf[t, :3] = (7, 40 + t, len(body))
    buf[t, 3:3 + len(body)] = body
  np.savez_compressed(path, buffer=buf.reshape(-1), grid=np.asarray([1]),
                      block=np.asarray([128 * len(per_trace)]), names=np.asarray(names))


@pytest.mark.parametrize("base", [1000, 2**32 - 120])  # the 32-bit clock wraps mid-CTA
def test_raw_trace_and_ring_latency_of_alternating_consumers(tmp_path, base):
  names = ["wait", "mma", "store", "free", "load"]
  consumer0 = [("wait", 5, 110), ("mma", 110, 115), ("store", 120, 130),  # item 0: step 0
               ("wait", 135, 250), ("mma", 250, 255)]  # item 2 (step 2), cut off
  consumer1 = [("wait", 15, 180), ("mma", 180, 185), ("store", 190, 200)]  # item 1: step 1
  producer = [("free", 0, 1), ("load", 1, 10), ("load", 20, 30), ("load", 40, 50)]
  path = str(tmp_path / "t.npz")
  _raw_trace(path, [consumer0, consumer1, producer], names, base)
  events = kernel_timeline.load_raw(path)
  assert {e["pid"] for e in events} == {41, 42, 43} and {e["tid"] for e in events} == {1, 2, 3}
  ranges = kernel_timeline.ranges_by_trace(events, per_trace_origin=False)
  assert ranges[2][0] == ("wait", 15, 180, 0)  # cycles from the CTA's first event
  lat = kernel_timeline.ring_latency(events, 3, producer=2, alternate=True)
  # item 2 has no store (cut off by the profile buffer): the ring ends before it
  assert lat["steps"] == 2 and lat["waited_share"] == 1.0
  assert lat["latency"]["n"] == 2 and lat["latency"]["p50"] == pytest.approx(125)  # 100, 150
  whole = [r if r[0] != "mma" or r[1] != 250 else ("store", 260, 270) for r in consumer0]
  _raw_trace(path, [whole, consumer1, producer], names, base)
  lat = kernel_timeline.ring_latency(kernel_timeline.load_raw(path), 3, producer=2,
                                     alternate=True)
  assert lat["steps"] == 3 and lat["latency"]["p50"] == pytest.approx(150)  # 100, 150, 200
  # Both consumers waiting for every step (the forward ring): steps 0-1 for
  # consumer 0's two waits, step 0 for consumer 1's one.
  both = kernel_timeline.ring_latency(events, 3, producer=2, alternate=False, min_wait=110)
  assert both["steps"] == 3 and both["latency"]["n"] == 2  # waits of 105 cycles do not count
  s = kernel_timeline.summarize(events, 3, {2: "producer"})
  assert s["producer"]["ranges"]["load"]["count"] == 3


def test_raw_dumps_saves_the_buffer_beside_the_json(tmp_path):
  from jax.experimental.mosaic.gpu import profiler as mgpu_profiler
  spec = mgpu_profiler.ProfilerSpec(8, dump_path=str(tmp_path))
  spec.intern_name("mma")
  buf = np.zeros(2 * 8, np.uint32)
  buf[0:3], buf[3:7] = (1, 2, 4), (0, 100, 1 << 31, 160)
  path = tmp_path / "k-trace.json"
  own = mgpu_profiler.ProfilerSpec.dump
  with kernel_timeline.raw_dumps():
    assert mgpu_profiler.ProfilerSpec.dump is not own
    with open(path, "x") as f:
      spec.dump(buf, f, grid=(1,), block=(256,))
  assert mgpu_profiler.ProfilerSpec.dump is own
  assert kernel_timeline.load(str(path))[0]["name"] == "mma"
  events = kernel_timeline.load_raw(str(path) + ".npz")
  assert [(e["ph"], e["ts"] * 1e3) for e in events] == [("B", 0), ("E", 60)]
