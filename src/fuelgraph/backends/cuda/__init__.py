"""The CUDA backend (optional extra `fuelgraph[cuda]`: torch + triton). Importing fuelgraph
never needs it; `cuda_unavailable_reason()` says why it cannot be used here."""
from __future__ import annotations

import functools
from pathlib import Path

from ...registry.core import id_by_label
from ..base import declared_kernels


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


def declared_fused_ids() -> set[int]:
    """Ids of the fused ops that have a CUDA kernel, read from the kernel modules' `@kernel`
    declarations without importing them (listing needs neither torch nor a GPU)."""
    labels = declared_kernels(Path(__file__).parent / "kernels", "cuda")
    return {int(i) for i in map(id_by_label, labels) if i is not None}


