"""Device timing of jitted calls: CUPTI kernel times when available.

``device_time_ms`` sums the GPU time of every kernel one call launches
(jax.experimental.mosaic.gpu.profiler, CUPTI) and takes the median over
iterations.  CUPTI adds up kernels of *all* devices, so for a call whose
outputs live on several devices (expert parallelism over GPUs) that sum is not
the step time: such calls, and any call where CUPTI is unavailable, are timed
by the host clock around back-to-back calls instead (``method`` says which).

``sustained_time_ms`` times a call under sustained load instead: back to back
for seconds, as in a training step, where the GPU runs at its power limit and a
lower clock than in the short bursts ``device_time_ms`` measures.
"""

from __future__ import annotations

import collections
import numbers
import os
import statistics
import time
from typing import Any, Callable

import jax

from ragdot.gpu_power import PowerSampler, describe, smi_id, summarise


def _num_devices(out: Any) -> int:
  devices = set()
  for leaf in jax.tree.leaves(out):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      devices |= set(sharding.device_set)
  return max(len(devices), 1)


def host_time_ms(fn: Callable[..., Any], *args: Any, iterations: int = 20,
                 repeats: int = 3) -> float:
  """Median over ``repeats`` of the wall time of ``iterations`` back-to-back calls."""
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = None
    for _ in range(iterations):
      out = fn(*args)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) * 1e3 / iterations)
  return float(statistics.median(per_call))


# Wall-clock warm-up a benchmark gives each timed case (``device_time_ms``'s
# ``warmup_s``): enough for the H200's clocks to settle after compiling (v16e).
SETTLE_S = 0.2


def device_time_ms(fn: Callable[..., Any], *args: Any, iterations: int = 20,
                   warmup: int = 2, warmup_s: float = 0.0) -> tuple[float, str]:
  """(median milliseconds per call, method) for the jitted ``fn(*args)``.

  ``warmup`` calls run first, then more until ``warmup_s`` seconds have
  passed: after seconds of compiling, an idle GPU's clocks need a while of work
  to come back up, longer than 20 iterations of a 0.1 ms kernel last.

  method: "cupti" (summed kernel time of one device), "host" (no CUPTI), or
  "host: N devices" (wall time of a multi-device call).
  """
  out = jax.block_until_ready(fn(*args))  # at least one call: its outputs' devices
  start = time.perf_counter()  # (after it: a first call's one-time costs do not count)
  for _ in range(warmup - 1):
    out = jax.block_until_ready(fn(*args))
  while time.perf_counter() - start < warmup_s:
    for _ in range(4):
      out = fn(*args)
    out = jax.block_until_ready(out)
  ndev, size = _num_devices(out), output_bytes(out)
  del out  # (the timing below holds outputs of its own)
  if ndev == 1:
    ms = _cupti_median_ms(fn, args, iterations, size)
    if ms is not None:
      return ms, "cupti"
  method = "host" if ndev == 1 else f"host: {ndev} devices"
  return host_time_ms(fn, *args, iterations=iterations), method


def sustained_time_ms(fn: Callable[..., Any], *args: Any, seconds: float = 2.0,
                      depth: int = 4) -> tuple[float, dict[str, float]]:
  """(wall milliseconds per call, power summary) of ``fn(*args)`` run back to
  back for ``seconds``, timed over the second half of that window.

  ``depth`` calls stay queued at all times (each new call waits for the one
  ``depth`` before it), so the device never idles and at most ``depth + 1``
  calls' outputs are alive.  Between two completions the device ran exactly
  the calls completed, so the time per call is that of the device, not of the
  dispatch, as long as one call takes longer than its dispatch (~20 us).  The
  first half of the window lets the clock settle at what the load allows (the
  H200 reaches its power limit within ~0.2 s).  The summary holds
  ``dispatch_ms``, the host's mean time per call to enqueue it: a call whose
  time per call is near it is paced by the host, not the device (small
  calls, ~0.1 ms and under), and the power summary (``ragdot.gpu_power``) of
  the timed half (none without ``nvidia-smi``).
  """
  if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
    raise TypeError(f"seconds must be a number, got {seconds!r}")
  if not 0 < seconds < float("inf"):
    raise ValueError(f"seconds must be finite and > 0, got {seconds}")
  if isinstance(depth, bool) or not isinstance(depth, numbers.Integral):
    raise TypeError(f"depth must be an int, got {depth!r}")
  if depth < 1:
    raise ValueError(f"depth must be >= 1, got {depth}")
  jax.block_until_ready(fn(*args))
  queue: collections.deque = collections.deque()
  t0, t0_wall, done = None, 0.0, 0
  enqueue_s = 0.0  # host time spent issuing the timed calls
  # The sampler runs through the whole window (its start-up is not in the
  # timed half); only the timed half's samples are kept.
  with PowerSampler(gpu=_sampled_gpu()) as sampler:
    try:
      start = time.perf_counter()
      while True:
        t_issue = time.perf_counter()
        queue.append(fn(*args))
        if t0 is not None:
          enqueue_s += time.perf_counter() - t_issue
        if len(queue) <= depth:
          continue
        jax.block_until_ready(queue.popleft())
        now = time.perf_counter()
        if t0 is None:
          if now - start >= seconds / 2:
            t0, t0_wall = now, time.time()
        else:
          done += 1
          if now - start >= seconds and done >= 3:
            t1_wall = time.time()
            break
    finally:
      while queue:  # (also on an error: no call left running past the window)
        jax.block_until_ready(queue.popleft())
  power = summarise(sampler.since(t0_wall, t1_wall))
  return (now - t0) * 1e3 / done, dict(power, dispatch_ms=enqueue_s * 1e3 / done)


def _sampled_gpu() -> str:
  """nvidia-smi's id of the GPU of JAX's default device (where an
  unplaced call runs); its first GPU when JAX has none."""
  device = jax.devices()[0]
  return smi_id(device.local_hardware_id if device.platform == "gpu" else 0)


def sustained_method(seconds: float, power: dict[str, float]) -> str:
  """The method string of a ``sustained_time_ms`` measurement (a bench row's
  method column): the window, the enqueue time and, with nvidia-smi, the
  clock and power it ran at."""
  method = f"sustained {seconds:g} s, wall"
  if "dispatch_ms" in power:
    method += f"; dispatch {1e3 * power['dispatch_ms']:.0f} us"
  if described := describe(power):
    method += f"; {described}"
  return method


def interleaved_median_ms(cases: dict[str, tuple[Callable[..., Any], tuple]], *,
                          rounds: int = 3, iterations: int = 10) -> dict[str, float]:
  """Median ``device_time_ms`` of each ``name: (fn, args)`` over ``rounds``
  rounds that time every case in turn (an A/B: drift between the cases' runs
  lands in all of them alike)."""
  times: dict[str, list[float]] = {name: [] for name in cases}
  for _ in range(rounds):
    for name, (fn, args) in cases.items():
      times[name].append(device_time_ms(fn, *args, iterations=iterations)[0])
  return {name: float(statistics.median(t)) for name, t in times.items()}


def kernel_time_sum_ms(fn: Callable[..., Any], *args: Any,
                       iterations: int = 10) -> float | None:
  """Median over iterations of the summed CUPTI kernel time of one call on
  *all* devices (None without CUPTI, e.g. on CPU).

  For a step balanced over d devices, this / d is each device's busy time:
  set against the wall time of a multi-device step it shows how much of that
  step the devices were idle (launch gaps).  Collective kernels count the time
  they wait for their peers as busy, so this is an upper bound.  None also
  when the profiler cannot pair up the kernels of several devices.
  """
  size = output_bytes(jax.block_until_ready(fn(*args)))  # (that output is dropped here)
  return _cupti_median_ms(fn, args, iterations, size)


# The profiler keeps every timed iteration's outputs alive until the last one
# ends; past this many bytes of them the iterations are split over several
# measurements.  (A DeepSeek-V3 dW output is 7.5 GB: 20 of them made XLA's
# allocator retry for minutes, H200 2026-11-30.)  RAGDOT_TIMING_OUTPUT_GIB sets
# it (e.g. inf: every iteration in one measurement, as before v18), read when a
# measurement needs it; OUTPUT_BUDGET_BYTES, when set, overrides it.
OUTPUT_BUDGET_BYTES: int | None = None
_NO_LIMIT = 2**62


def output_budget_bytes() -> int:
  """The output budget of one measurement in bytes (OUTPUT_BUDGET_BYTES, else
  RAGDOT_TIMING_OUTPUT_GIB, 4 GiB by default)."""
  if OUTPUT_BUDGET_BYTES is not None:
    return OUTPUT_BUDGET_BYTES
  text = os.environ.get("RAGDOT_TIMING_OUTPUT_GIB", "4")
  try:
    gib = float(text)
  except ValueError:
    gib = -1.0
  if not gib > 0:  # (NaN too)
    raise ValueError(f"RAGDOT_TIMING_OUTPUT_GIB must be a positive number of GiB (or inf),"
                     f" got {text!r}")
  return _NO_LIMIT if gib * 2**30 >= _NO_LIMIT else int(gib * 2**30)


def output_bytes(out: Any) -> int:
  """Bytes of the arrays in a call's output pytree."""
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(out)
             if hasattr(leaf, "dtype"))


def iteration_chunks(iterations: int, out_bytes: int, budget: int | None = None) -> list[int]:
  """``iterations`` (>= 1) split into measurements whose outputs stay within
  ``budget`` bytes together (default ``output_budget_bytes()``), each of at
  least one iteration."""
  if iterations < 1:
    raise ValueError(f"iterations must be >= 1, got {iterations}")
  budget = output_budget_bytes() if budget is None else budget
  per = max(1, min(iterations, budget // max(out_bytes, 1)))
  full, rest = divmod(iterations, per)
  return [per] * full + ([rest] if rest else [])


def _cupti_median_ms(fn: Callable[..., Any], args: tuple, iterations: int,
                     out_bytes: int) -> float | None:
  """Median summed CUPTI kernel time per call (None off GPU or if CUPTI fails);
  ``out_bytes``: the size of one call's outputs (``output_bytes``)."""
  if jax.default_backend() != "gpu":
    return None
  try:
    from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top

    times = []
    # Each measurement makes one untimed call of its own first: with one
    # iteration per measurement the device does twice the timed work.
    for n in iteration_chunks(iterations, out_bytes):
      t = profiler.measure(fn, iterations=n)(*args)[1]  # its outputs dropped at once
      if t is None:  # no kernel launched
        return None
      times += t if isinstance(t, list) else [t]
    return float(statistics.median(times))
  except Exception:  # pylint: disable=broad-except
    return None
