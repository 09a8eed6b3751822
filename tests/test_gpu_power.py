"""ragdot.gpu_power: parsing nvidia-smi's CSV (no GPU needed)."""

from __future__ import annotations

import pytest

from ragdot import gpu_power

_CSV = """timestamp, power.draw [W], power.limit [W], clocks.current.sm [MHz], temperature.gpu, clocks_event_reasons.sw_power_cap, clocks_event_reasons.hw_slowdown
2026/12/01 05:54:27.866, 696.54 W, 700.00 W, 1590 MHz, 61, Active, Not Active
2026/12/01 05:54:27.886, 600.00 W, 700.00 W, 1710 MHz, 63, Not Active, Not Active
garbage line
2026/12/01 05:54:27.906, [N/A], 700.00 W, 1500 MHz, 60, Active, Not Active
"""


def test_parse_samples_skips_header_and_bad_rows():
  rows = gpu_power.parse_samples(_CSV)
  assert len(rows) == 2
  assert rows[0]["power"] == 696.54 and rows[0]["sm"] == 1590 and rows[0]["sw_power_cap"]
  assert not rows[1]["sw_power_cap"] and not rows[1]["hw_slowdown"]
  assert rows[1]["t"] - rows[0]["t"] == pytest.approx(0.02, abs=1e-6)


def test_summarise_means_and_shares():
  s = gpu_power.summarise(gpu_power.parse_samples(_CSV))
  assert s["power_w"] == pytest.approx((696.54 + 600.0) / 2)
  assert s["sm_mhz"] == pytest.approx(1650.0)
  assert s["power_capped"] == 0.5 and s["temp_c"] == 63 and s["samples"] == 2
  assert gpu_power.summarise([]) == {}


def test_sampler_without_nvidia_smi_is_empty(monkeypatch):
  monkeypatch.setattr(gpu_power.shutil, "which", lambda name: None)
  with gpu_power.PowerSampler() as p:
    pass
  assert p.samples == [] and p.summary() == {}


def test_sampler_runs_a_sampling_process_and_keeps_its_window(tmp_path, monkeypatch):
  # A stand-in nvidia-smi: the header, then one sample every 20 ms until stopped.
  fake = tmp_path / "nvidia-smi"
  fake.write_text(
      "#!/usr/bin/env bash\n"
      "echo 'timestamp, power.draw [W], power.limit [W], clocks.current.sm [MHz], "
      "temperature.gpu, clocks_event_reasons.sw_power_cap, clocks_event_reasons.hw_slowdown'\n"
      "while true; do\n"
      "  echo \"$(date +'%Y/%m/%d %H:%M:%S.%3N'), 650.00 W, 700.00 W, 1500 MHz, 60, Active, "
      "Not Active\"\n"
      "  sleep 0.02\n"
      "done\n")
  fake.chmod(0o755)
  monkeypatch.setattr(gpu_power.shutil, "which", lambda name: str(fake))
  import time  # pylint: disable=g-import-not-at-top
  with gpu_power.PowerSampler() as p:
    time.sleep(0.5)
    mid = time.time()
    time.sleep(0.3)
  assert p._proc is None  # stopped on exit
  assert len(p.samples) >= 5
  s = p.summary()
  assert s["power_w"] == 650.0 and s["sm_mhz"] == 1500.0 and s["power_capped"] == 1.0
  later = p.since(mid)
  assert 0 < len(later) < len(p.samples) and all(x["t"] >= mid for x in later)
