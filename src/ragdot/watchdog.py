"""A watchdog that ends the process when one armed stretch of work runs too long.

A GPU kernel that never finishes (a deadlock on the hardware) cannot be
interrupted from Python, and waiting on it would spend a whole device call;
``ragdot tune`` and ``ragdot bench`` arm one around each candidate.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable


class Watchdog:
  """Ends the process (exit status ``HANG_EXIT``) when one armed stretch runs
  longer than ``limit_s``, after calling ``on_hang(label)``."""

  HANG_EXIT = 3

  def __init__(self, limit_s: float, name: str = "ragdot",
               on_hang: Callable[[Any], None] | None = None):
    if not limit_s > 0:
      raise ValueError(f"limit_s must be > 0, got {limit_s}")
    self.limit_s, self.name, self.on_hang = limit_s, name, on_hang
    self._label, self._since = None, 0.0
    self._lock = threading.Lock()
    threading.Thread(target=self._watch, daemon=True).start()

  def arm(self, label: Any) -> None:
    with self._lock:
      self._label, self._since = label, time.monotonic()

  def disarm(self) -> None:
    with self._lock:
      self._label = None

  def _watch(self) -> None:
    while True:
      time.sleep(min(1.0, self.limit_s / 4))
      with self._lock:
        label, since = self._label, self._since
      if label is not None and time.monotonic() - since > self.limit_s:
        try:
          print(f"{self.name}: {label} ran for more than {self.limit_s:.0f} s (hung?);"
                " stopping", file=sys.stderr, flush=True)
          if self.on_hang is not None:
            self.on_hang(label)
        finally:
          os._exit(self.HANG_EXIT)
