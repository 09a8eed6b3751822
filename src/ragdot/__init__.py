"""ragdot: fast, exact grouped matmul (ragged dot) for Mixture-of-Experts in JAX."""

from ragdot.api import RaggedDotDimensionNumbers
from ragdot.api import checked
from ragdot.api import ragged_dot
from ragdot.api import ragged_dot_general
from ragdot.api import trans_ragged_dot
from ragdot import scales
from ragdot.backends import IMPLEMENTATIONS

__version__ = "0.1.0"

__all__ = [
    "IMPLEMENTATIONS",
    "RaggedDotDimensionNumbers",
    "checked",
    "ragged_dot",
    "ragged_dot_general",
    "scales",
    "trans_ragged_dot",
]
