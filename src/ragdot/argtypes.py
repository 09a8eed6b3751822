"""argparse ``type=`` checks shared by the ``ragdot`` subcommands: a bad value
is an argparse error naming the flag, not a traceback or a silent wrong run."""

from __future__ import annotations

import argparse
import re


def _int(text: str, minimum: int) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
  if value < minimum:
    raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
  return value


def positive_int(text: str) -> int:
  return _int(text, 1)


def nonnegative_int(text: str) -> int:
  return _int(text, 0)


def _float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
  if value != value or value in (float("inf"), float("-inf")):
    raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
  return value


def positive_float(text: str) -> float:
  value = _float(text)
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
  return value


def nonnegative_float(text: str) -> float:
  value = _float(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
  return value


def compute_capability(text: str) -> str:
  """'9.0', as ``jax.Device.compute_capability`` spells it."""
  if not re.fullmatch(r"\d+\.\d+", text.strip()):
    raise argparse.ArgumentTypeError(f"expected MAJOR.MINOR (e.g. 9.0), got {text!r}")
  return text.strip()


def hang_limit_error(hang_s: float, sustained_s: float) -> str | None:
  """Why ``--hang-s`` cannot hold a ``--sustained-s`` window (each timed
  window alone runs that long, so every candidate would read as hung), else
  None; 0 turns either off."""
  if hang_s > 0 and sustained_s > 0 and sustained_s >= hang_s:
    return (f"--hang-s {hang_s:g} must exceed --sustained-s {sustained_s:g} (one timed window"
            " alone runs that long), or be 0 (no watchdog)")
  return None
