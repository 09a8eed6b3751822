"""The test ids that failed for want of GPU memory, from a RAGDOT_FAILURES file
(tests/conftest.py appends each failing report as ``===== NODEID (WHEN)`` and
its text).  ``gpu_run.sh`` reruns them on one worker with most of the memory:
xdist workers share the GPU, and on an H100 a worker's slice (0.22: 17.6 GB)
is too small for the DeepSeek-V3 / gpt-oss-120b cases' poison fills and their
references' XLA autotuning (66c).

  python3 scripts/oom_failures.py FAILURES_FILE   (ids, one a line, each once)
"""

from __future__ import annotations

import re
import sys

_OOM = ("RESOURCE_EXHAUSTED", "Out of memory")


def oom_ids(text: str) -> list[str]:
  """The ids of the reports in ``text`` whose failure is a memory exhaustion,
  in order of first failure, each once (a test may fail in call and teardown)."""
  ids: list[str] = []
  for block in re.split(r"^===== ", text, flags=re.M)[1:]:
    head, _, body = block.partition("\n")
    nodeid = head.rsplit(" (", 1)[0]
    if any(s in body for s in _OOM) and nodeid not in ids:
      ids.append(nodeid)
  return ids


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print(__doc__, file=sys.stderr)
    return 2
  try:
    with open(argv[0]) as f:
      text = f.read()
  except FileNotFoundError:  # no test failed
    return 0
  for nodeid in oom_ids(text):
    print(nodeid)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
