"""The CUDA backend (optional extra `fuelgraph[cuda]`: torch + triton). Importing fuelgraph
never needs it; `cuda_unavailable_reason()` says why it cannot be used here."""
from __future__ import annotations

import functools

# fused ops with a CUDA kernel (Triton, or cuBLAS for FUSED_LINEAR), by registry name; kept
# here so listing them needs neither torch nor a GPU (tests check it against backend.py)
FUSED_KERNEL_NAMES = frozenset({
    "softmax_last_dim", "fused_linear", "rms_norm_last_dim", "layer_norm_last_dim", "rope",
    "softmax_last_dim_backward", "layer_norm_last_dim_backward", "rms_norm_last_dim_backward",
    "reduce_max_to_backward", "powi_backward", "inplace_affine", "fused_softmax_cross_entropy",
    "fused_softmax_cross_entropy_backward"})


@functools.lru_cache(maxsize=None)
def cuda_unavailable_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'fuelgraph[cuda]')"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'fuelgraph[cuda]')"
    return None


def __getattr__(name):
    if name == "CudaBackend":
        from .backend import CudaBackend
        return CudaBackend
    raise AttributeError(name)
