"""NumPy kernels for SOFTMAX_LAST_DIM (id 1) and SOFTMAX_LAST_DIM_BACKWARD (id 7).
Both compute in acc(T) (float32 for 16/32-bit inputs, float64 for float64), round once on
store, and work on row chunks split over the backend's small thread pool."""
from __future__ import annotations

import numpy as np

from ...registry.core import FusedOps
from ..base import kernel, row_cost
from .common import acc_dtype, row_spans, run_spans, store, to_acc


def _rowwise(work, x):
    n = x.shape[-1]
    rows = x.size // n
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        run_spans(work, row_spans(rows, n), rows * n, row_elems=n)


@kernel(FusedOps.SOFTMAX_LAST_DIM, "numpy", cost=row_cost(4))
def softmax_last_dim(x):
    """x [..., n] -> softmax over the last axis, same shape and dtype. Max-subtracted, so huge
    finite values do not overflow; a row of all -inf, or holding +inf or NaN, gives NaN (as
    torch does)."""
    if x.size == 0:
        return x.copy()
    n, acc = x.shape[-1], acc_dtype(x.dtype)
    x2 = x.reshape(-1, n)
    out = np.empty(x.shape, x.dtype)
    o2 = out.reshape(-1, n)
    ones = np.ones(n, acc)

    def work(r0, r1):
        xc = to_acc(x2[r0:r1], acc)
        buf = o2[r0:r1] if o2.dtype == acc else (xc if xc is not x2[r0:r1] else np.empty_like(xc))
        np.subtract(xc, xc.max(axis=1, keepdims=True), out=buf)
        np.exp(buf, out=buf)
        s = np.vecdot(buf, ones)[:, None]           # row sums (BLAS dot with ones)
        np.divide(acc.type(1), s, out=s)
        np.multiply(buf, s, out=buf)
        if buf is not o2[r0:r1] and buf.base is not o2:
            store(o2[r0:r1], buf)

    _rowwise(work, x)
    return out


@kernel(FusedOps.SOFTMAX_LAST_DIM_BACKWARD, "numpy", cost=row_cost(4))
def softmax_last_dim_backward(y, grad):
    """y = softmax output [..., n], grad [..., n] -> dx = y * (grad - sum(grad * y, -1))."""
    if y.size == 0:
        return np.empty(y.shape, y.dtype)
    n, acc = y.shape[-1], acc_dtype(y.dtype)
    y2, g2 = y.reshape(-1, n), grad.reshape(-1, n)
    out = np.empty(y.shape, y.dtype)
    o2 = out.reshape(-1, n)

    def work(r0, r1):
        yc, gc = to_acc(y2[r0:r1], acc), to_acc(g2[r0:r1], acc)
        dot = np.vecdot(gc, yc)[:, None]
        buf = o2[r0:r1] if o2.dtype == acc else np.empty(gc.shape, acc)
        np.subtract(gc, dot, out=buf)
        np.multiply(buf, yc, out=buf)
        if o2.dtype != acc:
            store(o2[r0:r1], buf)

    _rowwise(work, y)
    return out
