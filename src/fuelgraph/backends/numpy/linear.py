"""NumPy fused kernel for FUSED_LINEAR: `a @ b + bias`.

The matrix product goes to BLAS (`np.matmul`) in the accumulation dtype (float32 for
float32/float16/bfloat16 -- NumPy has no BLAS path for halves, so they are widened first --
float64 for float64); the bias is added to the accumulator in place and the result is narrowed
once (round to nearest even) to the input dtype.
"""
from __future__ import annotations

import math

import numpy as np

from ...registry.core import FusedOps
from ..base import Cost, kernel
from .common import acc_dtype, row_spans, run_spans, store, to_acc
from .primitives import gemm


def _linear_cost(shapes, params=None):
    """2*M*K*N flops per output batch plus the bias add; bytes of a, b, bias and out."""
    a, b = shapes[0], shapes[1]
    batch = math.prod(np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))
    m, k, n = a[-2], a[-1], b[-1]
    out = batch * m * n
    return Cost(2 * out * k + out, 4 * (math.prod(a) + math.prod(b) + n + out))


@kernel(FusedOps.FUSED_LINEAR, "numpy", cost=_linear_cost)
def fused_linear(a, b, bias):
    """FUSED_LINEAR: `out = a @ b + bias`.

    a: [..., M, K]; b: [K, N] or [..., K, N] (K x N orientation, not nn.Linear's [N, K]);
    bias: [N]; all one float dtype. Batch dims broadcast NumPy-style, so the result has shape
    `broadcast(a.shape[:-2], b.shape[:-2]) + [M, N]` and the dtype of `a`. (The as-built kernel's
    "GQA-style" repeat of b batches, B_d % C_d == 0 with C_d > 1, is not NumPy broadcasting and
    is rejected.)
    """
    dt, acc = a.dtype, acc_dtype(a.dtype)
    if dt != acc:
        a, b, bias = to_acc(a, acc), to_acc(b, acc), to_acc(bias, acc)
    n = b.shape[-1]
    if b.ndim == 2:
        # one big GEMM over all leading rows of a (a is C-contiguous)
        rows = int(np.prod(a.shape[:-1]))
        out = gemm(a.reshape(rows, a.shape[-1]), b).reshape(*a.shape[:-1], n)
    else:
        out = gemm(a, b)
    res = out if dt == acc else np.empty(out.shape, dt)
    if out.size == 0:
        return res
    o2, r2 = out.reshape(-1, n), res.reshape(-1, n)

    def work(r0, r1):
        np.add(o2[r0:r1], bias, out=o2[r0:r1])
        if r2 is not o2:
            store(r2[r0:r1], o2[r0:r1])

    run_spans(work, row_spans(o2.shape[0], n), o2.size)
    return res
