"""NumPy fused kernels for last-dim norms without affine parameters.

Every kernel views its input as rows `[R, n]` (n = last extent), computes in the accumulation
dtype (float32 for float32/float16/bfloat16 -- eps is narrowed to float32 there -- float64 for
float64) and returns the input dtype. Rows are processed in L2-sized chunks, possibly on two
threads (`helpers.run_spans`); per-row results do not depend on the chunking. Row reductions
use `np.vecdot` (BLAS dot per row; a row sum is a dot with ones), all in the accumulation dtype.
Backward kernels recompute the statistics from `x` (nothing is cached).
"""
from __future__ import annotations

import numpy as np

from ...registry.core import FusedOps
from ...registry.norm import ADD_RMS_NORM
from ..base import kernel, row_cost
from .common import acc_dtype, new_output, row_spans, run_spans, store, to_acc


#: inputs up to this many elements (float32/float64) skip the chunked, threaded evaluation:
#: for a decode step's few rows its set-up cost more than the math (add_rms_norm of [4, 512]:
#: ~35 -> ~12 us)
SMALL_ELEMS = 1 << 14


def _rows(op, x, *others):
    n = x.shape[-1]
    acc = acc_dtype(x.dtype)
    return n, acc, [a.reshape(-1, n) for a in (x,) + others]


def _chunk(a, r0, r1, acc):
    return to_acc(a[r0:r1], acc)


def _run(work, rows, n):
    """Run `work(r0, r1)` over row chunks, with NumPy's ufunc buffer sized to one row (per-row
    broadcasts such as x * r[:, None] are ~3x cheaper that way)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        run_spans(work, row_spans(rows, n), rows * n, row_elems=n)


def _center_rstd(xc, out, ones, inv_n, eps_a, one):
    """Per row of the chunk xc: c = x - mean(x) (written into `out`) and r = 1/sqrt(var + eps)
    (population variance, two-pass)."""
    mu = np.vecdot(xc, ones)
    mu *= inv_n
    c = np.subtract(xc, mu[:, None], out=out)
    r = np.vecdot(c, c)
    r *= inv_n
    r += eps_a
    np.sqrt(r, out=r)
    np.divide(one, r, out=r)
    return c, r


@kernel(FusedOps.RMS_NORM_LAST_DIM, "numpy", cost=row_cost(4))
def rms_norm_last_dim(x, *, eps):
    """RMS_NORM_LAST_DIM: x [..., n] -> y of the same shape/dtype.

    `ms = (sum_j x_j^2) * (1/n)`, `r = 1 / sqrt(ms + eps)`, `y_j = x_j * r` (no weight).
    eps = 0 with an all-zero row gives NaN (0 * inf), as specified.
    """
    n, acc, (x2,) = _rows("rms_norm_last_dim", x)
    out = new_output(x.shape, x.dtype)
    o2 = out.reshape(-1, n)
    inv_n, eps_a, one = acc.type(1.0 / n), acc.type(eps), acc.type(1)
    if x.dtype == acc and x.size <= SMALL_ELEMS:      # a decode step's rows: the math alone
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            r = np.vecdot(x2, x2)
            r *= inv_n
            r += eps_a
            np.sqrt(r, out=r)
            np.divide(one, r, out=r)
            np.multiply(x2, r[:, None], out=o2)
        return out

    def work(r0, r1):
        xc = _chunk(x2, r0, r1, acc)
        r = np.vecdot(xc, xc)
        r *= inv_n
        r += eps_a
        np.sqrt(r, out=r)
        np.divide(one, r, out=r)
        if o2.dtype == acc:
            np.multiply(xc, r[:, None], out=o2[r0:r1])
        else:
            np.multiply(xc, r[:, None], out=xc)
            store(o2[r0:r1], xc)

    _run(work, x2.shape[0], n)
    return out


@kernel(ADD_RMS_NORM, "numpy", cost=row_cost(6))
def add_rms_norm(x, residual, weight, *, eps):
    """ADD_RMS_NORM: x, residual [..., n], weight [n] -> (s, y) shaped/typed as x:
    `s = x + residual` (rounded to the dtype), `y = rms_norm_last_dim(s) * weight` with the
    norm rounded to the dtype before the product (as the unfused ops)."""
    acc = acc_dtype(x.dtype)
    if x.dtype == acc and residual.dtype == acc and weight.dtype == acc:
        # nothing to round: no conversions, no copies (a [256, 512] prompt: ~375 -> ~150 us)
        s = np.add(x, residual)
        y = rms_norm_last_dim(s, eps=eps)
        return s, np.multiply(y, weight, out=y)
    s = np.empty(x.shape, x.dtype)
    store(s, to_acc(x, acc) + to_acc(residual, acc))
    y = rms_norm_last_dim(s, eps=eps)
    out = np.empty(x.shape, x.dtype)
    store(out, to_acc(y, acc) * to_acc(weight, acc))
    return s, out


@kernel(FusedOps.LAYER_NORM_LAST_DIM, "numpy", cost=row_cost(7))
def layer_norm_last_dim(x, *, eps):
    """LAYER_NORM_LAST_DIM: x [..., n] -> y of the same shape/dtype (no gamma/beta).

    Two-pass, population variance: `mu = sum(x) * (1/n)`, `var = sum((x - mu)^2) * (1/n)`,
    `y = (x - mu) * (1 / sqrt(var + eps))`.
    """
    n, acc, (x2,) = _rows("layer_norm_last_dim", x)
    out = new_output(x.shape, x.dtype)
    o2 = out.reshape(-1, n)
    inv_n, eps_a, one = acc.type(1.0 / n), acc.type(eps), acc.type(1)
    ones = np.ones(n, acc)

    def work(r0, r1):
        native = o2.dtype == acc
        xc = _chunk(x2, r0, r1, acc)
        c, r = _center_rstd(xc, o2[r0:r1] if native else xc, ones, inv_n, eps_a, one)
        np.multiply(c, r[:, None], out=c)
        if not native:
            store(o2[r0:r1], c)

    _run(work, x2.shape[0], n)
    return out


@kernel(FusedOps.RMS_NORM_LAST_DIM_BACKWARD, "numpy", cost=row_cost(8))
def rms_norm_last_dim_backward(x, grad, *, eps):
    """RMS_NORM_LAST_DIM_BACKWARD: x, grad [..., n] -> dx of x's shape/dtype.

    Per row: `den = sum(x^2)/n + eps`, `r = 1/sqrt(den)`, `s = sum(grad * x)`,
    `dx = r * (grad - x * s / (n * den))`, evaluated as `grad * r - x * (r * s / (n * den))`.
    """
    n, acc, (x2, g2) = _rows("rms_norm_last_dim_backward", x, grad)
    out = new_output(x.shape, x.dtype)
    o2 = out.reshape(-1, n)
    inv_n, eps_a, one = acc.type(1.0 / n), acc.type(eps), acc.type(1)

    def work(r0, r1):
        native = o2.dtype == acc
        xc, gc = _chunk(x2, r0, r1, acc), _chunk(g2, r0, r1, acc)
        den = np.vecdot(xc, xc)
        den *= inv_n
        den += eps_a
        s = np.vecdot(gc, xc)
        r = np.sqrt(den)
        np.divide(one, r, out=r)
        s *= r
        s *= inv_n
        s /= den                                   # s := r * s / (n * den)
        oc = o2[r0:r1] if native else gc
        t = np.multiply(xc, s[:, None], out=np.empty_like(xc) if native else xc)
        np.multiply(gc, r[:, None], out=oc)
        np.subtract(oc, t, out=oc)
        if not native:
            store(o2[r0:r1], oc)

    _run(work, x2.shape[0], n)
    return out


@kernel(FusedOps.LAYER_NORM_LAST_DIM_BACKWARD, "numpy", cost=row_cost(12))
def layer_norm_last_dim_backward(x, grad, *, eps):
    """LAYER_NORM_LAST_DIM_BACKWARD: x, grad [..., n] -> dx of x's shape/dtype.

    Per row: `mu = mean(x)`, `var = mean((x - mu)^2)`, `r = 1/sqrt(var + eps)`,
    `xhat = (x - mu) * r`, `dx = r * (grad - mean(grad) - xhat * mean(grad * xhat))`, evaluated as
    `grad * r - ((x - mu) * (r^3 * mean(grad * (x - mu))) + r * mean(grad))`.
    """
    n, acc, (x2, g2) = _rows("layer_norm_last_dim_backward", x, grad)
    out = new_output(x.shape, x.dtype)
    o2 = out.reshape(-1, n)
    inv_n, eps_a, one = acc.type(1.0 / n), acc.type(eps), acc.type(1)
    ones = np.ones(n, acc)

    def work(r0, r1):
        native = o2.dtype == acc
        xc, gc = _chunk(x2, r0, r1, acc), _chunk(g2, r0, r1, acc)
        c, r = _center_rstd(xc, o2[r0:r1] if native else xc, ones, inv_n, eps_a, one)
        mg = np.vecdot(gc, ones)
        mg *= inv_n
        mg *= r                                    # r * mean(g)
        k = np.vecdot(gc, c)
        k *= inv_n
        k *= r
        k *= r
        k *= r                                     # r^3 * mean(g * (x - mu))
        t = np.multiply(gc, r[:, None], out=None if native else gc)   # g * r
        np.multiply(c, k[:, None], out=c)
        np.add(c, mg[:, None], out=c)
        np.subtract(t, c, out=c)
        if not native:
            store(o2[r0:r1], c)

    _run(work, x2.shape[0], n)
    return out
