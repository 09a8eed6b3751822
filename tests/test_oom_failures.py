"""scripts/oom_failures.py: which failed GPU tests gpu_run.sh reruns alone."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import oom_failures  # noqa: E402  (the scripts folder, as on the GPU machine)

_REPORTS = """===== tests/test_gpu.py::test_a[x-1] (call)
tests/test_gpu.py:41: in _poison
E   jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 7.91GiB
===== tests/test_gpu.py::test_b (call)
E   AssertionError: Not equal to tolerance rtol=0.02
===== tests/test_gpu.py::test_a[x-1] (teardown)
E   jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory
===== tests/test_gpu.py::test_c[(1, 2)] (call)
E   Out of memory while trying to allocate 32.02GiB with allocator GPU_0_bfc
"""


def test_only_memory_failures_each_once_in_order():
  assert oom_failures.oom_ids(_REPORTS) == ["tests/test_gpu.py::test_a[x-1]",
                                            "tests/test_gpu.py::test_c[(1, 2)]"]


def test_no_file_means_no_failures(tmp_path, capsys):
  assert oom_failures.main([str(tmp_path / "none.txt")]) == 0
  path = tmp_path / "f.txt"
  path.write_text(_REPORTS)
  assert oom_failures.main([str(path)]) == 0
  assert capsys.readouterr().out.split("\n")[:2] == ["tests/test_gpu.py::test_a[x-1]",
                                                      "tests/test_gpu.py::test_c[(1, 2)]"]
  assert oom_failures.main([]) == 2


def test_no_memory_failure_prints_nothing_and_bodies_may_hold_the_marker(tmp_path, capsys):
  path = tmp_path / "f.txt"
  path.write_text("===== tests/test_gpu.py::t (call)\nE   assert '===== x' == 'y'\n"
                  "E   AssertionError\n")
  assert oom_failures.main([str(path)]) == 0
  assert capsys.readouterr().out == ""  # (a blank line would rerun the whole suite)
  path.write_text("===== tests/test_gpu.py::t (call)\nlog: ===== tests/test_gpu.py::u (call)"
                  " RESOURCE_EXHAUSTED\n")
  assert oom_failures.oom_ids(path.read_text()) == ["tests/test_gpu.py::t"]
