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
