"""Device timing of jitted calls: CUPTI kernel times when available.

``device_time_ms`` sums the GPU time of every kernel one call launches
(jax.experimental.mosaic.gpu.profiler, CUPTI), takes the median over
iterations, and falls back to a host clock around synchronised calls when
CUPTI is unavailable (reported in the ``method`` field).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax


def device_time_ms(fn: Callable[..., Any], *args: Any, iterations: int = 20,
                   warmup: int = 2) -> tuple[float, str]:
  """(median milliseconds per call, method) for the jitted ``fn(*args)``."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  if jax.default_backend() == "gpu":
    try:
      from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top

      _, times = profiler.measure(fn, iterations=iterations)(*args)
      return float(statistics.median(times)), "cupti"
    except Exception:  # pylint: disable=broad-except
      pass
  samples = []
  for _ in range(iterations):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - start) * 1e3)
  return float(statistics.median(samples)), "host"
