"""Triton GPU kernels for fuelgraph's softmax / norm / rope / loss family (spec §1, 3-5, 7-10,
15-17). Every function takes and returns torch tensors (float32, bfloat16 or float16 computed in
float32; float64 goes through torch formulas in float64); parameters are keyword-only.
"""

from .helpers import inplace_affine, powi_backward, reduce_max_to_backward
from .loss import fused_softmax_cross_entropy, fused_softmax_cross_entropy_backward
from .norm import (layer_norm_last_dim, layer_norm_last_dim_backward, rms_norm_last_dim,
                   rms_norm_last_dim_backward)
from .rope import rope, rope_backward
from .softmax import softmax_last_dim, softmax_last_dim_backward

__all__ = [
    "softmax_last_dim",
    "softmax_last_dim_backward",
    "rms_norm_last_dim",
    "layer_norm_last_dim",
    "rms_norm_last_dim_backward",
    "layer_norm_last_dim_backward",
    "rope",
    "rope_backward",
    "fused_softmax_cross_entropy",
    "fused_softmax_cross_entropy_backward",
    "reduce_max_to_backward",
    "powi_backward",
    "inplace_affine",
]
