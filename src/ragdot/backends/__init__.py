"""Kernel families.  Each backend module exposes the same two entry points:

``gmm(lhs, rhs, group_sizes, group_offset, *, transpose_rhs, out_dtype,
precision, interpret, config=None) -> out[m, n]``
    Grouped matmul with the ragged (row) dimension on ``lhs[m, k]``.
    ``rhs`` is ``[g_local, k, n]``, or ``[g_local, n, k]`` when
    ``transpose_rhs`` (then each group's rhs is used transposed: the dX mode).
    ``group_sizes`` is int32[G]; ``group_offset`` is None or an int32 scalar
    array (shape ``()``): local group j is global group ``group_offset + j``.
    Rows not owned by a local group are exactly zero.

``tgmm(lhs, rhs, group_sizes, group_offset, *, num_groups, out_dtype,
precision, interpret, config=None) -> out[num_groups, k, n]``
    Ragged contracting dimension: ``out[j] = lhs_rows(j)^T @ rhs_rows(j)`` for
    ``lhs[m, k]``, ``rhs[m, n]``; empty groups give exact zeros.

Arguments reach a backend already validated and canonicalised by
``ragdot.validate``.  A backend that cannot take a case (dtype, alignment,
platform) raises ``NotImplementedError`` naming the reason; it never returns a
wrong answer.  ``interpret=True`` runs kernel code in Pallas interpret mode (CPU).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import jax

IMPLEMENTATIONS = ("xla", "mosaic", "triton")

_MODULES = {
    "xla": "ragdot.backends.xla",
    "mosaic": "ragdot.backends.mosaic",
    "triton": "ragdot.backends.triton",
}


def get_backend(name: str) -> ModuleType:
  """Returns the backend module for ``name`` (one of ``IMPLEMENTATIONS``)."""
  if name not in _MODULES:
    raise ValueError(
        f"implementation must be one of {IMPLEMENTATIONS} or None, got {name!r}"
    )
  return importlib.import_module(_MODULES[name])


def schedule_kernels(interpret) -> ModuleType | None:
  """``ragdot.backends.triton_schedule`` where its kernels can serve this call,
  else None (the caller builds the schedule with ``ragdot.metadata``'s XLA ops).

  Only compiled on a GPU backend: the Pallas interpreter cannot run them under
  ``shard_map`` (varying refs), Pallas-Triton lowering needs a local GPU's
  compute capability (lowering for CUDA on a machine without one must keep
  working), and a JAX without Pallas-Triton must not break the Mosaic kernels.
  """
  if interpret or jax.default_backend() != "gpu":
    return None
  try:
    return importlib.import_module("ragdot.backends.triton_schedule")
  except ImportError:
    return None
