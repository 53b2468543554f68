"""NumPy kernels of the primitives' backward helpers: REDUCE_MAX_TO_BACKWARD (id 10, torch
`amax` semantics) and POWI_BACKWARD (id 15, `exp == 0` gives zeros)."""
from __future__ import annotations

import numpy as np

from ...registry.core import FusedOps
from ..base import kernel, row_cost
from .common import acc_dtype, row_spans, run_flat, run_spans, store, to_acc


@kernel(FusedOps.REDUCE_MAX_TO_BACKWARD, "numpy", cost=row_cost(4))
def reduce_max_to_backward(x, grad):
    """Backward of the primitive `ReduceMaxTo`: torch `amax` semantics.

    x: [d0, ..., dk]; grad: same rank, `grad.shape[i] == 1` where axis i was reduced
    (`x.shape[i] != 1`), `grad.shape[i] == x.shape[i]` elsewhere. Returns dx, shape/dtype of x:
    `dx = (grad / count) * mask`, `mask = (x == max over the reduced axes)`, `count` = number of
    tied maxima in the window (ties share evenly). A window whose max is NaN has an empty mask
    and count 0, so -- exactly like torch's amax backward -- every element of that window is NaN
    (whatever grad is). Computed in float32 for 16/32-bit inputs, float64 for float64.
    """
    acc = acc_dtype(x.dtype)
    axes = tuple(i for i, (g, s) in enumerate(zip(grad.shape, x.shape)) if g == 1 and s != 1)
    ga = to_acc(grad, acc)
    with np.errstate(divide="ignore", invalid="ignore"):
        if axes and axes == tuple(range(x.ndim - len(axes), x.ndim)) and x.size:
            # reduced axes are trailing: rows of a 2-D view, chunked and threaded
            w = int(np.prod([x.shape[i] for i in axes]))
            x2, g1 = x.reshape(-1, w), ga.reshape(-1)
            out = np.empty(x.shape, x.dtype)
            o2 = out.reshape(-1, w)

            def work(r0, r1):
                xc = to_acc(x2[r0:r1], acc)
                mask = np.equal(xc, xc.max(axis=1, keepdims=True))
                scale = g1[r0:r1, None] / np.count_nonzero(mask, axis=1, keepdims=True)
                if o2.dtype == acc:
                    np.multiply(mask, scale, out=o2[r0:r1])
                else:
                    store(o2[r0:r1], np.multiply(mask, scale, out=xc))

            run_spans(work, row_spans(x2.shape[0], w), x2.size)
            return out
        xa = to_acc(x, acc)
        m = xa.max(axis=axes, keepdims=True) if xa.size else xa
        mask = np.equal(xa, m)
        cnt = np.count_nonzero(mask, axis=axes, keepdims=True) if axes else mask
        out = np.multiply(mask, ga / cnt, dtype=acc)
    if out.dtype == x.dtype:
        return out
    res = np.empty(x.shape, x.dtype)
    store(res, out)
    return res


def _powi_inplace(a, e: int, scratch):
    """Return a**e (e >= 1) by binary exponentiation, as compiler-rt `__powisf2` does;
    `a` is overwritten (it holds the running square)."""
    r = None
    while True:
        if e & 1:
            if r is None:
                np.copyto(scratch, a)
                r = scratch
            else:
                np.multiply(r, a, out=r)
        e >>= 1
        if e == 0:
            return r
        np.multiply(a, a, out=a)


@kernel(FusedOps.POWI_BACKWARD, "numpy", cost=row_cost(4))
def powi_backward(x, grad, *, exp):
    """Backward of `PowI(exp)`: `dx = (exp * powi(x, exp - 1)) * grad`.

    x, grad: same shape and dtype; returns dx of that shape/dtype. `powi` is integer power by
    repeated multiplication (binary exponentiation, like LLVM `powi`): `x**0 == 1` for every x,
    a negative power is `1 / x**|m|` (so x = 0 gives +-inf). `exp` is a Python int, negative
    allowed; `exp == 0` returns zeros (derivative of a constant). Evaluated left to right in
    float32 (16/32-bit inputs) or float64.
    """
    exp = int(exp)
    if exp == 0:
        return np.zeros(x.shape, x.dtype)
    acc = acc_dtype(x.dtype)
    m = exp - 1
    coef = acc.type(exp)
    xf, gf = x.reshape(-1), grad.reshape(-1)
    out = np.empty(x.size, x.dtype)

    def work(i0, i1):
        g = to_acc(gf[i0:i1], acc)
        if m == 0:                                     # exp == 1: dx = 1 * 1 * g
            p = g
        else:
            a = xf[i0:i1].copy() if xf.dtype == acc else to_acc(xf[i0:i1], acc)  # squared in place
            p = _powi_inplace(a, abs(m), np.empty_like(a))
            if m < 0:
                np.divide(acc.type(1), p, out=p)
            np.multiply(p, coef, out=p)
            np.multiply(p, g, out=p)
        store(out[i0:i1], p)

    with np.errstate(all="ignore"):
        run_flat(work, x.size)
    return out.reshape(x.shape)
