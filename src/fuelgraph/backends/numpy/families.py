"""(fused id -- or registry name for ids allocated at import --, NumPy kernel, flops per element
-- or a cost function (shapes, params) -> Cost) for the families beyond softmax."""
from __future__ import annotations

import math

from ...registry.core import FusedOps as F
from ..base import Cost
from . import helpers, linear, loss, norm, rope


def _linear_cost(shapes, params=None):
    """Matmul-like: 2*M*K*N flops per output batch plus the bias add; bytes of a, b, bias, out."""
    a, b = shapes[0], shapes[1]
    batch = math.prod(max(x, y) for x, y in zip((1,) * (len(b) - len(a)) + tuple(a[:-2]),
                                                 (1,) * (len(a) - len(b)) + tuple(b[:-2])))
    m, k, n = a[-2], a[-1], b[-1]
    out = batch * m * n
    return Cost(2 * out * k + out, 4 * (math.prod(a) + math.prod(b) + n + out))


KERNELS = [
    (F.REDUCE_MAX_TO_BACKWARD, helpers.reduce_max_to_backward, 4),
    (F.POWI_BACKWARD, helpers.powi_backward, 4),
    (F.RMS_NORM_LAST_DIM, norm.rms_norm_last_dim, 4),
    (F.LAYER_NORM_LAST_DIM, norm.layer_norm_last_dim, 7),
    (F.RMS_NORM_LAST_DIM_BACKWARD, norm.rms_norm_last_dim_backward, 8),
    (F.LAYER_NORM_LAST_DIM_BACKWARD, norm.layer_norm_last_dim_backward, 12),
    (F.ROPE, rope.rope, 4),
    (F.FUSED_LINEAR, linear.fused_linear, _linear_cost),
    (F.FUSED_SOFTMAX_CROSS_ENTROPY, loss.fused_softmax_cross_entropy, 6),
    ("fused_softmax_cross_entropy_backward", loss.fused_softmax_cross_entropy_backward, 6),
    (F.INPLACE_AFFINE, helpers.inplace_affine, 2),
]
