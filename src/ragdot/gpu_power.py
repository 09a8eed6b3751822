"""Power draw and SM clock of an NVIDIA GPU, sampled by ``nvidia-smi`` in the background.

Under seconds of matmul load the H200 runs at its power limit (700 W) and its
SM clock drops from 1.98 GHz to ~1.5 GHz; a benchmark's short bursts run at the
boost clock instead (docs/performance.md, v21).  ``PowerSampler`` records what
the GPU ran at while a timed window lasted:

  with PowerSampler() as p:
    ...  # the calls
  p.summary()  # {"sm_mhz": ..., "power_w": ..., "power_capped": ..., "samples": ...}

Where ``nvidia-smi`` is missing or cannot run (CPU machines) the summary is
empty: the samples only describe a measurement, they never stop one.
"""

from __future__ import annotations

import csv
import functools
import io
import numbers
import os
import shutil
import subprocess
import threading
import time
import weakref
from typing import Any

from ragdot import watchdog

QUERY = ("timestamp,{power},power.limit,clocks.sm,temperature.gpu,"
         "clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown")
_NUMBERS = ("power", "limit", "sm", "temp")  # columns 1-4
_FLAGS = ("sw_power_cap", "hw_slowdown")  # columns 5-6


def _number(field: str) -> float | None:
  try:
    return float(field.strip().split()[0])  # "412.30 W" -> 412.3; "[N/A]" -> None
  except (ValueError, IndexError):
    return None


def _flag(field: str) -> bool | None:
  field = field.strip()
  return {"Active": True, "Not Active": False}.get(field)  # "[Not Supported]" -> None


def parse_samples(text: str) -> list[dict[str, Any]]:
  """Rows of ``nvidia-smi --query-gpu=QUERY --format=csv`` output as dicts
  (t: POSIX seconds, power, limit: W, sm: MHz, temp: C, sw_power_cap and
  hw_slowdown: bool); a field the GPU does not report ("[N/A]", "[Not
  Supported]") is None.  The header and lines without a timestamp are skipped."""
  out = []
  for row in csv.reader(io.StringIO(text)):
    if len(row) < 7 or row[0].startswith("timestamp"):
      continue
    try:
      stamp, frac = row[0].strip().split(".")
      t = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
    except ValueError:
      continue
    sample: dict[str, Any] = dict(t=t)
    sample.update({k: _number(f) for k, f in zip(_NUMBERS, row[1:5])})
    sample.update({k: _flag(f) for k, f in zip(_FLAGS, row[5:7])})
    out.append(sample)
  return out


def summarise(samples: list[dict[str, Any]]) -> dict[str, float]:
  """Mean power (W), mean SM clock (MHz), shares of samples under the software
  power cap and in hardware slowdown, max temperature, over the samples that
  report each; a figure no sample reports is left out; {} without samples."""
  if not samples:
    return {}
  out: dict[str, float] = {}

  def reported(key):
    return [s[key] for s in samples if s.get(key) is not None]

  for key, name in (("power", "power_w"), ("sm", "sm_mhz")):
    if values := reported(key):
      out[name] = sum(values) / len(values)
  for key, name in (("sw_power_cap", "power_capped"), ("hw_slowdown", "hw_slowdown")):
    if values := reported(key):
      out[name] = sum(values) / len(values)
  if values := reported("limit"):
    out["power_limit_w"] = values[0]
  if values := reported("temp"):
    out["temp_c"] = max(values)
  out["samples"] = len(samples)
  return out


def describe(summary: dict[str, float]) -> str:
  """The clock, power and power-capped share of a ``summarise`` result, as far
  as its samples reported them ("" without any)."""
  parts = []
  if "sm_mhz" in summary:
    parts.append(f"{summary['sm_mhz']:.0f} MHz")
  if "power_w" in summary:
    parts.append(f"{summary['power_w']:.0f} W")
  if "power_capped" in summary:
    parts.append(f"power-capped {100 * summary['power_capped']:.0f}%")
  return ", ".join(parts)


def smi_id(local_id: int, visible: str | None = None) -> str:
  """nvidia-smi's ``--id`` of the GPU a process numbers ``local_id`` (a JAX
  device's ``local_hardware_id``): nvidia-smi ignores ``CUDA_VISIBLE_DEVICES``
  (``visible``; default: the environment's), whose entries (indices or GPU
  UUIDs) name the process's GPUs in order.  An entry nvidia-smi's ``--id``
  cannot take (a MIG instance's UUID) leaves ``local_id`` itself."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
  names = [v.strip() for v in (visible or "").split(",") if v.strip()]
  if names and 0 <= local_id < len(names):
    name = names[local_id]
    if name.isdigit() or name.startswith("GPU-"):
      return name
  return str(local_id)


@functools.lru_cache(maxsize=None)
def power_field(exe: str, gpu: int | str) -> str:
  """``power.draw.instant`` where this driver reports it, else ``power.draw``
  (on Ampere and later GPUs a 1 s trailing average, which blends a timed
  window with what ran before it; nvidia-smi --help-query-gpu)."""
  try:
    probe = subprocess.run([exe, f"--id={gpu}", "--query-gpu=power.draw.instant",
                            "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=10, stdin=subprocess.DEVNULL)
  except (OSError, subprocess.TimeoutExpired):
    return "power.draw"
  answers = [_number(line) for line in probe.stdout.splitlines() if line.strip()]
  # (a driver may know the field yet answer "[N/A]": then the average is better than nothing)
  ok = probe.returncode == 0 and answers and all(a is not None for a in answers)
  return "power.draw.instant" if ok else "power.draw"


_LIVE: "weakref.WeakSet[PowerSampler]" = weakref.WeakSet()


def stop_all() -> None:
  """Stop every running sampler's nvidia-smi (the watchdog calls it before it
  ends the process, which skips the ``with`` blocks' exits)."""
  for sampler in list(_LIVE):
    sampler._stop()  # pylint: disable=protected-access


watchdog.add_exit_hook(stop_all)


class PowerSampler:
  """Samples one GPU (nvidia-smi's ``--id``: an index, UUID or PCI bus id;
  default: the GPU behind ``CUDA_VISIBLE_DEVICES``' first entry) every
  ``period_ms`` while the ``with`` block runs.

  ``samples`` holds what was sampled inside the block; ``since(t0, t1)`` the
  part between POSIX times ``t0`` and ``t1``.  A thread reads nvidia-smi's
  output as it comes (a pipe read only at the end would fill and stall it on
  long blocks); should this process die without stopping it, nvidia-smi's
  next write fails on the closed pipe and ends it.
  """

  def __init__(self, period_ms: int = 20, gpu: int | str | None = None):
    if isinstance(period_ms, bool) or not isinstance(period_ms, numbers.Integral) or (
        period_ms < 1):
      raise ValueError(f"period_ms must be an int >= 1, got {period_ms!r}")
    if gpu is None:
      gpu = smi_id(0)
    if isinstance(gpu, bool) or not isinstance(gpu, (numbers.Integral, str)) or (
        isinstance(gpu, numbers.Integral) and gpu < 0) or (isinstance(gpu, str) and (
            not gpu.strip() or "," in gpu)):
      raise ValueError(f"gpu must name one GPU (an index >= 0, a UUID or a bus id), got {gpu!r}")
    self.period_ms = int(period_ms)
    self.gpu = gpu if isinstance(gpu, str) else int(gpu)
    self._proc: subprocess.Popen | None = None
    self._reader: threading.Thread | None = None
    self._lines: list[str] = []
    self.samples: list[dict[str, Any]] = []

  def __enter__(self) -> "PowerSampler":
    self._lines, self.samples = [], []
    exe = shutil.which("nvidia-smi")
    if exe is not None:
      try:
        self._proc = subprocess.Popen(
            [exe, f"--id={self.gpu}",
             f"--query-gpu={QUERY.format(power=power_field(exe, self.gpu))}", "--format=csv",
             "-lms", str(self.period_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            text=True)
      except OSError:  # on PATH but cannot run: no samples
        self._proc = None
      else:
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,),
                                        daemon=True)
        self._reader.start()
        _LIVE.add(self)
    self._t0 = time.time()
    return self

  def _read(self, stream) -> None:
    for line in stream:
      self._lines.append(line)

  def _stop(self) -> None:
    proc, self._proc = self._proc, None
    if proc is None:
      return
    _LIVE.discard(self)
    proc.terminate()
    try:
      proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # stuck in the driver: kill it, reap it if it goes
      proc.kill()
      try:
        proc.wait(timeout=1)
      except subprocess.TimeoutExpired:
        pass
    if self._reader is not None:
      self._reader.join(timeout=1)
      if self._reader.is_alive():  # a child of nvidia-smi still holds the pipe: leave it
        return                     # to the (daemon) reader; closing would wait on it
    proc.stdout.close()

  def __exit__(self, *exc) -> None:
    t1 = time.time()
    if self._proc is None:
      return
    self._stop()
    # Only what was sampled inside the block (nvidia-smi's first line may predate it).
    self.samples = [s for s in parse_samples("".join(self._lines))
                    if self._t0 - 0.05 <= s["t"] <= t1 + 0.05]

  def since(self, t0: float, t1: float | None = None) -> list[dict[str, Any]]:
    """The samples taken at or after POSIX time ``t0`` (and at or before ``t1``)."""
    return [s for s in self.samples if s["t"] >= t0 and (t1 is None or s["t"] <= t1)]

  def summary(self) -> dict[str, float]:
    return summarise(self.samples)
