"""ragdot.gpu_power: parsing nvidia-smi's CSV, and the sampler against a stand-in
nvidia-smi (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ragdot import gpu_power

_CSV = """timestamp, power.draw.instant [W], power.limit [W], clocks.current.sm [MHz], temperature.gpu, clocks_event_reasons.sw_power_cap, clocks_event_reasons.hw_slowdown
2026/12/01 05:54:27.866, 696.54 W, 700.00 W, 1590 MHz, 61, Active, Not Active
2026/12/01 05:54:27.886, 600.00 W, 700.00 W, 1710 MHz, 63, Not Active, Not Active
garbage line
2026/12/01 05:54:27.906, [N/A], [N/A], 1500 MHz, 60, [Not Supported], Not Active
"""
_SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_parse_samples_skips_header_and_bad_rows_and_keeps_partial_ones():
  rows = gpu_power.parse_samples(_CSV)
  assert len(rows) == 3
  assert rows[0]["power"] == 696.54 and rows[0]["sm"] == 1590 and rows[0]["sw_power_cap"]
  assert rows[1]["sw_power_cap"] is False and rows[1]["hw_slowdown"] is False
  assert rows[1]["t"] - rows[0]["t"] == pytest.approx(0.02, abs=1e-6)
  # a field the GPU does not report is None; the row's other fields stay
  assert rows[2]["power"] is None and rows[2]["limit"] is None and rows[2]["sm"] == 1500
  assert rows[2]["sw_power_cap"] is None and rows[2]["hw_slowdown"] is False


def test_summarise_means_over_the_samples_that_report_each_figure():
  s = gpu_power.summarise(gpu_power.parse_samples(_CSV))
  assert s["power_w"] == pytest.approx((696.54 + 600.0) / 2)
  assert s["sm_mhz"] == pytest.approx((1590 + 1710 + 1500) / 3)
  assert s["power_capped"] == 0.5  # of the two that report it
  assert s["hw_slowdown"] == 0.0 and s["temp_c"] == 63 and s["samples"] == 3
  assert s["power_limit_w"] == 700.0
  only_clock = gpu_power.summarise([gpu_power.parse_samples(_CSV)[2]])
  assert "power_w" not in only_clock and "power_capped" not in only_clock
  assert only_clock["sm_mhz"] == 1500
  assert gpu_power.summarise([]) == {}


def test_smi_id_follows_cuda_visible_devices():
  assert gpu_power.smi_id(0, "") == "0" and gpu_power.smi_id(2, "") == "2"
  assert gpu_power.smi_id(0, "3,1") == "3" and gpu_power.smi_id(1, "3, 1") == "1"
  assert gpu_power.smi_id(0, "GPU-abc") == "GPU-abc"
  assert gpu_power.smi_id(5, "3,1") == "5"  # (not among them: as numbered)


@pytest.mark.parametrize("kw, name", [
    (dict(period_ms=-5), "period_ms"), (dict(period_ms=2.5), "period_ms"),
    (dict(gpu="0,1"), "gpu"), (dict(gpu=-1), "gpu"), (dict(gpu=""), "gpu"),
    (dict(gpu=True), "gpu")])
def test_sampler_refuses_bad_arguments(kw, name):
  with pytest.raises(ValueError, match=name):
    gpu_power.PowerSampler(**kw)


def test_sampler_without_nvidia_smi_is_empty(monkeypatch):
  monkeypatch.setattr(gpu_power.shutil, "which", lambda name: None)
  with gpu_power.PowerSampler() as p:
    pass
  assert p.samples == [] and p.summary() == {}


def test_sampler_with_an_nvidia_smi_that_cannot_run_is_empty(tmp_path, monkeypatch):
  broken = tmp_path / "nvidia-smi"
  broken.write_bytes(b"")  # on PATH, executable, not a program: exec fails
  broken.chmod(0o755)
  monkeypatch.setattr(gpu_power.shutil, "which", lambda name: str(broken))
  gpu_power.power_field.cache_clear()
  with gpu_power.PowerSampler() as p:
    pass
  assert p.samples == [] and p.summary() == {}


def _fake_smi(tmp_path: Path, instant: str = "650.00 W", setup: str = "") -> Path:
  """A stand-in nvidia-smi: the probe of power.draw.instant answers ``instant``
  (None: fails as an old driver would); a sampling run runs ``setup``, writes
  its pid and arguments, the header, then one sample every 20 ms until stopped."""
  fake = tmp_path / "nvidia-smi"
  fake.write_text(
      "#!/usr/bin/env bash\n"
      "if [[ \"$*\" == *noheader* ]]; then\n"
      + (f"  echo '{instant}'; exit 0\n" if instant else
         "  echo 'not a valid field'; exit 2\n")
      + "fi\n" + setup +
      f"echo $$ > {tmp_path}/pid; echo \"$*\" > {tmp_path}/args\n"
      "echo 'timestamp, power.draw.instant [W], power.limit [W], clocks.current.sm [MHz], "
      "temperature.gpu, clocks_event_reasons.sw_power_cap, clocks_event_reasons.hw_slowdown'\n"
      "while true; do\n"
      "  echo \"$(date +'%Y/%m/%d %H:%M:%S.%3N'), 650.00 W, 700.00 W, 1500 MHz, 60, Active, "
      "Not Active\"\n"
      "  sleep 0.02\n"
      "done\n")
  fake.chmod(0o755)
  return fake


def _alive(pid: int) -> bool:
  """Whether process ``pid`` runs (a zombie waiting for its parent does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def _gone_within(pid: int, seconds: float) -> bool:
  end = time.time() + seconds
  while time.time() < end:
    if not _alive(pid):
      return True
    time.sleep(0.05)
  return not _alive(pid)


@pytest.mark.parametrize("instant", ["650.00 W", "[N/A]", None])
def test_sampler_runs_a_sampling_process_keeps_its_window_and_stops_it(tmp_path, monkeypatch,
                                                                      instant):
  fake = _fake_smi(tmp_path, instant)
  monkeypatch.setattr(gpu_power.shutil, "which", lambda name: str(fake))
  gpu_power.power_field.cache_clear()
  with gpu_power.PowerSampler(gpu="GPU-1234") as p:
    time.sleep(0.5)
    mid = time.time()
    time.sleep(0.3)
    end = time.time()
    time.sleep(0.2)
  pid = int((tmp_path / "pid").read_text())
  assert not _alive(pid)  # stopped (and reaped) on exit
  args = (tmp_path / "args").read_text()
  assert "--id=GPU-1234" in args
  # (instant power only where the driver reports a number for it)
  assert ("power.draw.instant," in args) == (instant == "650.00 W") and "power.draw" in args
  assert len(p.samples) >= 5
  s = p.summary()
  assert s["power_w"] == 650.0 and s["sm_mhz"] == 1500.0 and s["power_capped"] == 1.0
  later = p.since(mid)
  assert 0 < len(later) < len(p.samples) and all(x["t"] >= mid for x in later)
  window = p.since(mid, end)
  assert 0 < len(window) < len(later) and all(mid <= x["t"] <= end for x in window)


def test_sampler_stops_when_a_watchdog_ends_the_process(tmp_path):
  """The watchdog ends the process with os._exit, which skips the sampler's
  exit: its exit hook stops nvidia-smi (this one ignores SIGPIPE, so the closed
  pipe alone would not)."""
  fake = _fake_smi(tmp_path, setup="trap '' PIPE\n")
  code = f"""
import time
from ragdot import gpu_power
from ragdot.watchdog import Watchdog
gpu_power.shutil.which = lambda name: {str(fake)!r}
dog = Watchdog(0.3)
with gpu_power.PowerSampler():
  dog.arm("candidate")
  time.sleep(10)
"""
  env = dict(os.environ, PYTHONPATH=_SRC, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                     env=env)
  assert p.returncode == 3, p.stderr
  assert "candidate ran for more than 0.3 s" in p.stderr
  assert _gone_within(int((tmp_path / "pid").read_text()), 2.0)


def test_nvidia_smi_dies_with_its_process_even_without_an_exit(tmp_path):
  fake = _fake_smi(tmp_path)
  code = f"""
import os, time
from ragdot import gpu_power
gpu_power.shutil.which = lambda name: {str(fake)!r}
s = gpu_power.PowerSampler()
s.__enter__()
time.sleep(0.3)
os._exit(0)
"""
  env = dict(os.environ, PYTHONPATH=_SRC, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", code], timeout=60, env=env, check=True)
  assert _gone_within(int((tmp_path / "pid").read_text()), 2.0)


def test_a_child_holding_the_pipe_does_not_hold_up_the_exit(tmp_path, monkeypatch):
  """nvidia-smi stopped while something it started still holds its output
  (as one stuck in the driver might): the sampler's exit returns at once."""
  fake = _fake_smi(tmp_path, setup=f"sleep 20 & echo $! > {tmp_path}/child\n")
  monkeypatch.setattr(gpu_power.shutil, "which", lambda name: str(fake))
  gpu_power.power_field.cache_clear()
  try:
    t = time.time()
    with gpu_power.PowerSampler() as p:
      time.sleep(0.3)
    p.__exit__(None, None, None)  # (a second exit: nothing left to stop)
    assert time.time() - t < 5 and len(p.samples) >= 3
  finally:
    os.kill(int((tmp_path / "child").read_text()), 9)


def test_describe_names_what_the_samples_reported():
  rows = gpu_power.parse_samples(_CSV)
  assert gpu_power.describe(gpu_power.summarise(rows)) == "1600 MHz, 648 W, power-capped 50%"
  assert gpu_power.describe(gpu_power.summarise(rows[2:])) == "1500 MHz"
  assert gpu_power.describe({}) == ""


def test_numpy_scalars_are_taken():
  import numpy as np  # pylint: disable=g-import-not-at-top
  p = gpu_power.PowerSampler(period_ms=np.int64(20), gpu=np.int64(1))
  assert p.period_ms == 20 and p.gpu == 1 and type(p.gpu) is int
  assert gpu_power.smi_id(0, "MIG-1234") == "0"  # (nvidia-smi --id cannot take a MIG uuid)
