"""NumPy kernels for SOFTMAX_LAST_DIM (id 1) and SOFTMAX_LAST_DIM_BACKWARD (id 7).
Both compute in acc(T) (float32 for 16-bit inputs) and round once on return."""
from __future__ import annotations

import numpy as np


def _acc_copy(x):
    return x.astype(np.float64 if x.dtype == np.float64 else np.float32)  # always a fresh copy


def softmax_last_dim(x):
    """x [..., n] -> softmax over the last axis. Max-subtracted, so huge finite values do not
    overflow; a row of all -inf, or holding +inf or NaN, gives NaN (as torch does)."""
    if x.size == 0:
        return x.copy()
    e = _acc_copy(x)
    m = e.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        np.subtract(e, m, out=e)
    np.exp(e, out=e)
    s = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.multiply(e, np.reciprocal(s), out=e)
    return e.astype(x.dtype, copy=False)


def softmax_last_dim_backward(y, grad):
    """y = softmax output [..., n], grad [..., n] -> dx = y * (grad - sum(grad * y, -1))."""
    ya, g = _acc_copy(y), _acc_copy(grad)
    dot = np.einsum("...i,...i->...", g, ya)[..., None] if y.size else np.zeros(y.shape[:-1] + (1,))
    np.subtract(g, dot, out=g)
    np.multiply(g, ya, out=g)
    return g.astype(y.dtype, copy=False)
