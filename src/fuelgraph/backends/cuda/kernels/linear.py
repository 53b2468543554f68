"""FUSED_LINEAR (id 2) on the GPU: cuBLAS through torch (addmm / baddbmm with the bias as the
GEMM's epilogue input), which no hand-written kernel beats for a plain GEMM + bias."""
from __future__ import annotations

import math

import torch

from ....registry.core import FusedOps
from ...base import Cost, kernel


def _gemm_cost(shapes, params=None):
    a, b = shapes[0], shapes[1]
    m = math.prod(a[:-1])
    return Cost(2 * m * a[-1] * b[-1], 2 * (math.prod(a) + math.prod(b) + m * b[-1]))


@kernel(FusedOps.FUSED_LINEAR, "cuda", cost=_gemm_cost, precision="fp32 accumulate",
        name="cublas.addmm")
def fused_linear(a, b, bias):
    """a [..., M, K] @ b [K, N] or [..., K, N] + bias [N] through cuBLAS with bias epilogue."""
    if b.dim() == 2:
        out = torch.addmm(bias, a.reshape(-1, a.shape[-1]), b)
        return out.reshape(*a.shape[:-1], b.shape[-1])
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = torch.baddbmm(bias.expand(a3.shape[0], a3.shape[1], b3.shape[2]), a3, b3)
    return out.reshape(*batch, a.shape[-2], b.shape[-1])
