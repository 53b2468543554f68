"""(fused id, NumPy kernel, flops per element) for the families beyond softmax."""
from __future__ import annotations

from ...registry.core import FusedOps as F
from . import helpers

KERNELS = [
    (F.REDUCE_MAX_TO_BACKWARD, helpers.reduce_max_to_backward, 4),
    (F.POWI_BACKWARD, helpers.powi_backward, 4),
]
