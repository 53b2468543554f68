"""INPLACE_AFFINE (id 16) on Triton: ``x <- mul * x + add`` in x's own storage, a float32
multiply then add (two roundings, no FMA contraction)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....registry.core import FusedOps
from ...base import kernel, row_cost
from .common import EW_BLOCK, EW_WARPS, HALF_AND_F32


@triton.jit
def _affine_kernel(x_ptr, numel, mul, add, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * mul + add          # launched with enable_fp_fusion=False: multiply, then add
    tl.store(x_ptr + offs, y.to(x_ptr.dtype.element_ty), mask=mask)


@kernel(FusedOps.INPLACE_AFFINE, "cuda", dtypes=HALF_AND_F32, cost=row_cost(2, 2))
def inplace_affine(x: torch.Tensor, *, mul: float, add: float) -> torch.Tensor:
    """``x <- mul*x + add`` written into ``x``'s storage (contiguous); returns ``x`` itself.
    float32 math with ``mul``/``add`` narrowed to float32."""
    if x.numel() == 0:
        return x
    numel = x.numel()
    _affine_kernel[(triton.cdiv(numel, EW_BLOCK),)](
        x, numel, mul, add, BLOCK=EW_BLOCK, num_warps=EW_WARPS, enable_fp_fusion=False)
    return x
