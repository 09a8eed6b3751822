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

from ragdot import metadata
from ragdot import traced_primitive

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
  working), and a JAX without Pallas-Triton must not break the Mosaic kernels;
  not for ``jax.export`` either (it refuses Pallas-Triton's custom call).
  """
  if interpret or jax.default_backend() != "gpu" or traced_primitive.exporting():
    return None
  try:
    return importlib.import_module("ragdot.backends.triton_schedule")
  except ImportError:
    return None


def side_rows_kernel(interpret) -> ModuleType | None:
  """``ragdot.backends.triton_side_rows`` where its kernel can serve this call
  (the same conditions as ``schedule_kernels``), else None (the caller gathers
  the side rows with XLA ops)."""
  if schedule_kernels(interpret) is None:
    return None
  return importlib.import_module("ragdot.backends.triton_side_rows")


def _kernels_for(use_kernel: bool, interpret, m: int, num_groups: int, num_local: int):
  kernels = schedule_kernels(interpret) if use_kernel else None
  if kernels is not None and kernels.supported(m, num_groups, num_local):
    return kernels
  return None


def flat_schedule(group_sizes, group_offset, *, m: int, num_local: int, block_m: int,
                  use_kernel: bool, interpret, tail_rows: int = 0
                  ) -> tuple[jax.Array, jax.Array]:
  """``metadata.flat_schedule``'s values (tiles int32[4 * T'], scalars
  int32[>= 6]; the kernel pads T to whole programs), from one schedule kernel
  where ``use_kernel`` and ``schedule_kernels`` allow, else from XLA ops."""
  (out,) = flat_schedules(group_sizes, group_offset, m=m, num_local=num_local,
                          tiles=((block_m, tail_rows),), use_kernel=use_kernel,
                          interpret=interpret)
  return out


def flat_schedules(group_sizes, group_offset, *, m: int, num_local: int,
                   tiles: tuple[tuple[int, int], ...], use_kernel: bool, interpret
                   ) -> list[tuple[jax.Array, jax.Array]]:
  """``flat_schedule``'s values for each ``(block_m, tail_rows)`` of ``tiles``,
  all from one schedule-kernel launch where the kernel serves the call."""
  kernels = _kernels_for(use_kernel, interpret, m, group_sizes.shape[0], num_local)
  if kernels is not None:
    return kernels.build_many(group_sizes, group_offset, m=m, num_local=num_local, tiles=tiles)
  return [metadata.flat_schedule(group_sizes, group_offset, m, num_local, block_m,
                                 tail_rows=tail_rows) for block_m, tail_rows in tiles]


def row_blocks(group_sizes, group_offset, *, m: int, num_local: int, block_m: int, align: int,
               use_kernel: bool, interpret) -> tuple[jax.Array, ...]:
  """``metadata.row_blocks``'s values (the kernel pads each array to a power of
  two with zeros), from one kernel where allowed, else from XLA ops."""
  kernels = _kernels_for(use_kernel, interpret, m, group_sizes.shape[0], num_local)
  if kernels is not None:
    return kernels.build_bounds(group_sizes, group_offset, m=m, num_local=num_local,
                                block_m=block_m, align=align)
  return metadata.row_blocks(group_sizes, group_offset, m, num_local, block_m, align)
