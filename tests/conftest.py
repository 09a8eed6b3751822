"""Test set-up: 8 simulated CPU devices (for shard_map tests) before jax loads."""

import os
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import hypothesis  # noqa: E402
import pytest  # noqa: E402

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


@pytest.fixture
def h200_table():
  """The shipped H200 table, restored (and the dispatcher's caches cleared)
  after the test edits its entries."""
  from ragdot import dispatch, tables
  dispatch.clear_cache()  # (this reloads the tables: edit the one loaded after it)
  table, _ = tables.table_for("NVIDIA H200", "9.0")
  saved = dict(table.entries)
  yield table
  table.entries.clear()
  table.entries.update(saved)
  dispatch.clear_cache()
