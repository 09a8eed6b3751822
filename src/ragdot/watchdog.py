"""A watchdog that ends the process when one armed stretch of work runs too long.

A GPU kernel that never finishes (a deadlock on the hardware) cannot be
interrupted from Python, and waiting on it would spend a whole device call;
``ragdot tune`` and ``ragdot bench`` arm one around each candidate.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import threading
import time
from typing import Any, Callable

# Run before the watchdog ends the process (``os._exit`` skips ``finally`` blocks
# and ``atexit``): e.g. stopping the power sampler's nvidia-smi.
_EXIT_HOOKS: list[Callable[[], None]] = []
ON_HANG_S = 30.0  # how long ``on_hang`` may take before the process ends anyway
EXIT_HOOKS_S = 10.0  # and the exit hooks, all together


def _within(seconds: float, fn: Callable[..., None], *args: Any) -> None:
  """``fn(*args)`` in a daemon thread, waited for at most ``seconds``: one that
  blocks cannot keep the process alive."""
  thread = threading.Thread(target=fn, args=args, daemon=True)
  thread.start()
  thread.join(seconds)


def _run_hooks() -> None:
  for hook in _EXIT_HOOKS:
    try:
      hook()
    except Exception:  # pylint: disable=broad-except
      pass


def add_exit_hook(hook: Callable[[], None]) -> None:
  """Call ``hook()`` before any watchdog ends the process."""
  if hook not in _EXIT_HOOKS:
    _EXIT_HOOKS.append(hook)


class Watchdog:
  """Ends the process (exit status ``HANG_EXIT``) when one armed stretch runs
  longer than ``limit_s``, after calling ``on_hang(label)`` (given at most
  ``ON_HANG_S`` seconds) and the exit hooks (``EXIT_HOOKS_S``).  ``close()`` (or leaving a
  ``with`` block) stops watching for good."""

  HANG_EXIT = 3

  def __init__(self, limit_s: float, name: str = "ragdot",
               on_hang: Callable[[Any], None] | None = None):
    if isinstance(limit_s, bool) or not isinstance(limit_s, numbers.Real):
      raise TypeError(f"limit_s must be a number of seconds, got {limit_s!r}")
    if not (limit_s > 0 and math.isfinite(limit_s)):
      raise ValueError(f"limit_s must be > 0 and finite, got {limit_s}")
    self.limit_s, self.name, self.on_hang = limit_s, name, on_hang
    self._label, self._since = None, 0.0
    self._lock = threading.Lock()
    self._closed = threading.Event()
    threading.Thread(target=self._watch, name="ragdot-watchdog", daemon=True).start()

  def arm(self, label: Any) -> None:
    with self._lock:
      self._label, self._since = label, time.monotonic()

  def disarm(self) -> None:
    with self._lock:
      self._label = None

  def close(self) -> None:
    self._closed.set()

  def __enter__(self) -> "Watchdog":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _watch(self) -> None:
    while not self._closed.wait(min(1.0, self.limit_s / 4)):
      with self._lock:
        label, since = self._label, self._since
      if label is not None and time.monotonic() - since > self.limit_s:
        self._end(label)

  def _end(self, label: Any) -> None:
    try:
      print(f"{self.name}: {label} ran for more than {self.limit_s:g} s (hung?); stopping",
            file=sys.stderr, flush=True)
      if self.on_hang is not None:
        _within(ON_HANG_S, self.on_hang, label)
      _within(EXIT_HOOKS_S, _run_hooks)
    finally:
      os._exit(self.HANG_EXIT)
