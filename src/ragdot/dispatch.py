"""Picks a backend and its config for one call from static facts only.

Cheap at trace time and never syncs to the host.  An explicitly requested
implementation is always honoured (in Pallas interpret mode when no GPU is
present, so CPU tests run real kernel code); a kernel that cannot take the
case raises NotImplementedError and that error reaches the caller.  The
automatic choice falls back to the pure-JAX backend when a kernel refuses.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax

Op = Literal["gmm", "tgmm"]


@dataclasses.dataclass(frozen=True)
class Choice:
  """A backend name, its kernel config (None = the backend's default)."""

  implementation: str
  config: Any = None
  interpret: bool = False
  automatic: bool = False


@functools.cache
def _platform() -> str:
  return jax.default_backend()


def has_gpu() -> bool:
  return _platform() == "gpu"


def choose(op: Op, implementation: str | None) -> Choice:
  """The backend for ``op``; ``implementation`` was validated by the caller."""
  del op  # One rule for both ops until measured tables exist.
  if implementation is not None:
    return Choice(implementation, interpret=not has_gpu())
  return Choice("xla", automatic=True)
