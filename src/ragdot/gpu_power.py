"""Power draw and SM clock of an NVIDIA GPU, sampled by ``nvidia-smi`` in the background.

Under seconds of matmul load the H200 runs at its power limit (700 W) and its
SM clock drops from 1.98 GHz to ~1.5 GHz; a benchmark's short bursts run at the
boost clock instead (docs/performance.md, v21).  ``PowerSampler`` records what
the GPU ran at while a timed window lasted:

  with PowerSampler() as p:
    ...  # the calls
  p.summary()  # {"sm_mhz": ..., "power_w": ..., "power_capped": ..., "samples": ...}

Where ``nvidia-smi`` is missing (CPU machines) the summary is empty.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
import tempfile
import time
from typing import Any

QUERY = ("timestamp,power.draw,power.limit,clocks.sm,temperature.gpu,"
         "clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown")


def _number(field: str) -> float:
  return float(field.strip().split()[0])  # "412.30 W" -> 412.3


def parse_samples(text: str) -> list[dict[str, Any]]:
  """Rows of ``nvidia-smi --query-gpu=QUERY --format=csv`` output as dicts
  (t: POSIX seconds, power, limit: W, sm: MHz, temp: C, sw_power_cap and
  hw_slowdown: bool); header and malformed lines are skipped."""
  out = []
  for row in csv.reader(io.StringIO(text)):
    if len(row) < 7 or row[0].startswith("timestamp"):
      continue
    try:
      stamp, frac = row[0].strip().split(".")
      t = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
      out.append(dict(t=t, power=_number(row[1]), limit=_number(row[2]), sm=_number(row[3]),
                      temp=_number(row[4]), sw_power_cap=row[5].strip() == "Active",
                      hw_slowdown=row[6].strip() == "Active"))
    except (ValueError, IndexError):
      continue
  return out


def summarise(samples: list[dict[str, Any]]) -> dict[str, float]:
  """Mean power (W), mean SM clock (MHz), share of samples under the software
  power cap, max temperature; {} without samples."""
  if not samples:
    return {}
  n = len(samples)
  return dict(power_w=sum(s["power"] for s in samples) / n, power_limit_w=samples[0]["limit"],
              sm_mhz=sum(s["sm"] for s in samples) / n,
              power_capped=sum(s["sw_power_cap"] for s in samples) / n,
              hw_slowdown=sum(s["hw_slowdown"] for s in samples) / n,
              temp_c=max(s["temp"] for s in samples), samples=n)


class PowerSampler:
  """Samples the first GPU every ``period_ms`` while the ``with`` block runs.

  ``samples`` holds what was sampled inside the block; ``since(t)`` the part
  from POSIX time ``t`` on.  nvidia-smi writes to a temporary file (a pipe
  read only at the end would fill and stall it on long blocks).
  """

  def __init__(self, period_ms: int = 20, gpu: int = 0):
    self.period_ms = period_ms
    self.gpu = gpu
    self._proc: subprocess.Popen | None = None
    self._out = None
    self.samples: list[dict[str, Any]] = []

  def __enter__(self) -> "PowerSampler":
    exe = shutil.which("nvidia-smi")
    if exe is not None:
      self._out = tempfile.TemporaryFile("w+")
      self._proc = subprocess.Popen(
          [exe, f"--id={self.gpu}", f"--query-gpu={QUERY}", "--format=csv",
           "-lms", str(self.period_ms)],
          stdout=self._out, stderr=subprocess.DEVNULL, text=True)
    self._t0 = time.time()
    return self

  def __exit__(self, *exc) -> None:
    t1 = time.time()
    if self._proc is None:
      return
    self._proc.terminate()
    try:
      self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # stuck in the driver: do not wait for it
      self._proc.kill()
    self._out.seek(0)
    text = self._out.read()
    self._out.close()
    self._proc = None
    # Only what was sampled inside the block (nvidia-smi's first line may predate it).
    self.samples = [s for s in parse_samples(text) if self._t0 - 0.05 <= s["t"] <= t1 + 0.05]

  def since(self, t: float) -> list[dict[str, Any]]:
    """The samples taken at or after POSIX time ``t``."""
    return [s for s in self.samples if s["t"] >= t]

  def summary(self) -> dict[str, float]:
    return summarise(self.samples)
