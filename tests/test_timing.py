"""ragdot.timing on CPU (host timing; CUPTI needs a GPU)."""

from __future__ import annotations

import jax
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
