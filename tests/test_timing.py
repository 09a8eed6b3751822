"""ragdot.timing on CPU (host timing; CUPTI needs a GPU)."""

from __future__ import annotations

import jax
import pytest
import jax.numpy as jnp

from ragdot import timing


def test_interleaved_median_ms_times_each_case_every_round(monkeypatch):
  calls = []
  real = timing.device_time_ms

  def spy(fn, *args, iterations):
    calls.append((fn, iterations))
    return real(fn, *args, iterations=iterations)

  monkeypatch.setattr(timing, "device_time_ms", spy)
  x = jnp.ones((64, 64), jnp.float32)
  a, b = jax.jit(lambda x: x @ x), jax.jit(lambda x: x + 1)
  med = timing.interleaved_median_ms({"A": (a, (x,)), "B": (b, (x,))}, rounds=3, iterations=2)
  assert set(med) == {"A", "B"} and all(v > 0 for v in med.values())
  assert calls == [(a, 2), (b, 2)] * 3  # A, B, A, B, A, B


def test_device_time_ms_warms_up_for_warmup_s(monkeypatch):
  # Before the timed calls, fn runs until warmup_s seconds have passed.
  clock = [0.0]
  calls = []

  def fn(x):
    calls.append(clock[0])
    return x + 1

  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
  monkeypatch.setattr(timing, "host_time_ms", lambda *a, **k: 1.0)
  monkeypatch.setattr(timing, "_cupti_median_ms", lambda *a, **k: None)

  def tick(x):  # every call advances the fake clock by 10 ms
    clock[0] += 0.01
    return fn(x)

  x = jnp.ones((4,), jnp.float32)
  timing.device_time_ms(tick, x, warmup=2)
  assert len(calls) == 2  # no warmup_s: the two warm-up calls only
  calls.clear()
  clock[0] = 0.0
  ms, method = timing.device_time_ms(tick, x, warmup=2, warmup_s=0.1)
  assert (ms, method) == (1.0, "host")
  assert len(calls) >= 10 and clock[0] >= 0.1


def test_iteration_chunks_keep_outputs_within_budget():
  assert timing.iteration_chunks(20, 2**20, budget=2**30) == [20]
  assert timing.iteration_chunks(20, 3 * 2**30, budget=4 * 2**30) == [1] * 20
  assert timing.iteration_chunks(10, 2**30, budget=4 * 2**30) == [4, 4, 2]
  assert timing.iteration_chunks(3, 0) == [3]
  with pytest.raises(ValueError, match="iterations"):
    timing.iteration_chunks(0, 1)
  x = {"a": jnp.ones((4, 8), jnp.bfloat16), "b": (jnp.ones((3,), jnp.float32), None)}
  assert timing.output_bytes(x) == 4 * 8 * 2 + 3 * 4


def test_cupti_timing_splits_iterations_by_output_size(monkeypatch):
  """A call with big outputs is measured in several profiler runs (each run
  keeps its iterations' outputs alive), and the median spans all of them."""
  import jax.experimental.mosaic.gpu as mgpu  # pylint: disable=g-import-not-at-top

  runs = []

  class FakeProfiler:
    @staticmethod
    def measure(fn, iterations):
      def run(*args):
        runs.append(iterations)
        t = [float(len(runs))] * iterations
        return fn(*args), (t if iterations > 1 else t[0])
      return run

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(mgpu, "profiler", FakeProfiler, raising=False)
  monkeypatch.setattr(timing, "OUTPUT_BUDGET_BYTES", 3 * 1024)
  x = jnp.ones((256,), jnp.float32)  # 1 KiB per output: 3 iterations per run
  size = timing.output_bytes(x)
  ms = timing._cupti_median_ms(lambda a: a + 1, (x,), 7, size)  # pylint: disable=protected-access
  assert runs == [3, 3, 1]
  assert ms == 2.0  # times 1, 1, 1, 2, 2, 2, 3

  class NoKernels:  # the profiler saw no kernel: no CUPTI time at all
    @staticmethod
    def measure(fn, iterations):
      return lambda *args: (fn(*args), None)

  monkeypatch.setattr(mgpu, "profiler", NoKernels, raising=False)
  assert timing._cupti_median_ms(lambda a: a + 1, (x,), 7, 1024) is None  # pylint: disable=protected-access


def test_sustained_time_ms_times_the_second_half_with_a_full_queue(monkeypatch):
  # A fake device: a call takes 30 ms of clock in the window's first half and
  # 10 ms after it (the clock settling), charged when its output is waited on.
  # Only completions after the midpoint count, and `depth` calls stay queued.
  clock = [0.0]
  waited, issued, queued = [], [], []

  class Out:
    def __init__(self, i):
      self.i = i

  def fn(x):
    issued.append(len(issued))
    queued.append(len(issued) - len(waited))
    return Out(issued[-1])

  def block(out):
    if isinstance(out, Out):
      clock[0] += 0.03 if clock[0] < 0.5 else 0.01
      waited.append(out.i)
    return out

  from ragdot import gpu_power  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(gpu_power.shutil, "which", lambda name: None)  # no nvidia-smi
  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
  monkeypatch.setattr(timing.jax, "block_until_ready", block)
  ms, power = timing.sustained_time_ms(fn, 0, seconds=1.0, depth=4)
  assert ms == pytest.approx(10.0)  # the slow first half is not timed
  assert set(power) == {"dispatch_ms"}  # no power samples without nvidia-smi
  assert power["dispatch_ms"] == 0.0  # the fake clock only moves while waiting
  assert waited == sorted(waited) and len(waited) == len(issued)  # every call waited on, in order
  assert max(queued[1:]) == 5  # depth + the one just issued, never more
  assert clock[0] >= 1.0 and len(issued) >= 60


def test_sustained_time_ms_real_calls():
  x = jnp.ones((128, 128), jnp.float32)
  ms, _ = timing.sustained_time_ms(jax.jit(lambda x: x @ x), x, seconds=0.2)
  assert 0 < ms < 200


def test_sustained_time_ms_summarises_only_the_timed_half(monkeypatch):
  """The power summary covers the samples between the timed half's start and
  its last completion: not the settling half, not the queue's drain after it."""
  clock = [0.0]
  waits = []

  def block(out):
    clock[0] += 0.01
    waits.append(clock[0])
    return out

  class FakeSampler:
    def __init__(self, gpu=None):
      self.samples = []

    def __enter__(self):
      return self

    def __exit__(self, *exc):  # a sample every 5 ms of the fake wall clock, tagged by time
      self.samples = [dict(t=1000 + i / 200, power=float(i), limit=700.0, sm=1500.0,
                           temp=60.0, sw_power_cap=True, hw_slowdown=False)
                      for i in range(int(clock[0] * 200) + 1)]

    def since(self, t0, t1=None):
      windows.append((t0, t1))
      return [s for s in self.samples if s["t"] >= t0 and (t1 is None or s["t"] <= t1)]

  windows = []
  monkeypatch.setattr(timing, "PowerSampler", FakeSampler)
  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
  monkeypatch.setattr(timing.time, "time", lambda: 1000 + clock[0])
  monkeypatch.setattr(timing.jax, "block_until_ready", block)
  ms, power = timing.sustained_time_ms(lambda x: x, 0, seconds=1.0, depth=4)
  assert ms == pytest.approx(10.0)
  ((t0, t1),) = windows
  drain_end = 1000 + waits[-1]
  assert 1000.5 <= t0 < t1 < drain_end  # the second half, without the 4 calls drained after it
  assert t1 == pytest.approx(drain_end - 4 * 0.01)
  want = [i for i in range(int(clock[0] * 200) + 1) if t0 <= 1000 + i / 200 <= t1]
  assert power["power_w"] == pytest.approx(sum(want) / len(want))
  assert power["samples"] == len(want) and power["power_capped"] == 1.0


@pytest.mark.parametrize("kw, error, name", [
    (dict(seconds=float("nan")), ValueError, "seconds"),
    (dict(seconds=0), ValueError, "seconds"),
    (dict(seconds="2"), TypeError, "seconds"),
    (dict(depth=0), ValueError, "depth"),
    (dict(depth="4"), TypeError, "depth")])
def test_sustained_time_ms_refuses_bad_arguments(kw, error, name):
  with pytest.raises(error, match=name):
    timing.sustained_time_ms(lambda x: x, 0, **kw)


def test_output_budget_reads_the_environment_when_used(monkeypatch):
  monkeypatch.setenv("RAGDOT_TIMING_OUTPUT_GIB", "inf")
  assert timing.output_budget_bytes() == 2**62  # every iteration in one measurement
  monkeypatch.setenv("RAGDOT_TIMING_OUTPUT_GIB", "0.5")
  assert timing.output_budget_bytes() == 2**29
  assert timing.iteration_chunks(10, 2**27) == [4, 4, 2]
  monkeypatch.setenv("RAGDOT_TIMING_OUTPUT_GIB", "abc")
  with pytest.raises(ValueError, match="RAGDOT_TIMING_OUTPUT_GIB"):
    timing.output_budget_bytes()
  monkeypatch.setattr(timing, "OUTPUT_BUDGET_BYTES", 1024)  # (an override wins)
  assert timing.output_budget_bytes() == 1024


def test_sustained_method_names_what_was_sampled():
  assert timing.sustained_method(2, {"dispatch_ms": 0.02}) == "sustained 2 s, wall; dispatch 20 us"
  # a GPU that reports its clock but not its power or throttle reasons
  partial = {"dispatch_ms": 0.02, "sm_mhz": 1500.0, "samples": 9}
  assert timing.sustained_method(2, partial).endswith("; 1500 MHz")


def test_sustained_time_ms_takes_numpy_scalars(monkeypatch):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from ragdot import gpu_power  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(gpu_power.shutil, "which", lambda name: None)
  ms, _ = timing.sustained_time_ms(lambda x: x + 1, jnp.ones(4), seconds=np.float32(0.05),
                                   depth=np.int64(2))
  assert ms > 0
