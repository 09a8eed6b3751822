"""Lowering Pallas-Triton kernels for sm90 on a CPU machine.

Pallas-Triton's lowering asks the local GPU for its compute capability and
fails without one; given an H100's answer it builds the Triton module (not
Triton's own compile to PTX, which needs the device), and its checks (power-of-
two blocks, supported primitives) run as on a GPU.
"""

from __future__ import annotations

import jax


def lower_for_sm90(monkeypatch, fn, *args) -> list:
  """Lowers ``jax.jit(fn)`` on ``args`` (ShapeDtypeStructs) for CUDA; the
  Pallas-Triton kernels' lowering results (``.module``, ``.grid``), each module
  verified."""
  from jax._src.pallas.triton import gpu_info  # pylint: disable=g-import-not-at-top
  from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-import-not-at-top
  h100 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100)  # pylint: disable=protected-access
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: h100)
  results = []
  real = registration.lowering.lower_jaxpr_to_triton_module

  def spy(*a, **kw):
    out = real(*a, **kw)
    assert out.module.operation.verify()
    results.append(out)
    return out

  monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", spy)
  jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return results
