"""The CUDA backend (optional extra `fuelgraph[cuda]`: torch + triton). Importing fuelgraph
never needs it; `cuda_unavailable_reason()` says why it cannot be used here."""
from __future__ import annotations

import functools

# fused ids with a CUDA kernel (Triton, or cuBLAS for FUSED_LINEAR); kept here so listing them
# needs neither torch nor a GPU
FUSED_KERNEL_IDS = frozenset({1, 2, 3, 4, 5, 7, 8, 9, 10, 15, 16, 17})


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
