"""Mosaic GPU (Hopper, sm90) backend: forward/dX in ``mosaic_fwd``, dW in ``mosaic_dw``."""

from __future__ import annotations

from ragdot.backends.mosaic_dw import tgmm
from ragdot.backends.mosaic_fwd import gmm

__all__ = ["gmm", "tgmm"]
