"""Test set-up: 8 simulated CPU devices (for shard_map tests) before jax loads."""

import os
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "ragdot", deadline=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile("ragdot")


def pytest_runtest_logreport(report):
  """With RAGDOT_FAILURES=FILE, each failing test's report is appended to FILE as
  it fails (a device call's timeout kills pytest before its summary; xdist
  workers run this hook too)."""
  path = os.environ.get("RAGDOT_FAILURES")
  if path and report.failed:
    with open(path, "a") as f:
      f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
