"""NumPy fused kernels for FUSED_LINEAR (`a @ b + bias`) and SILU_MUL (`silu(g) * u`, with its
gradient helper SILU_MUL_BACKWARD).

The matrix product goes to BLAS (`np.matmul`) in the accumulation dtype (float32 for
float32/float16/bfloat16 -- NumPy has no BLAS path for halves, so they are widened first --
float64 for float64); the bias is added to the accumulator in place and the result is narrowed
once (round to nearest even) to the input dtype. silu_mul and its backward run the recipe's
operations in the same order, in blocks that stay in L2, over the thread pool.
"""
from __future__ import annotations

import math

import numpy as np

from ...registry.core import FusedOps
from ...registry.linear import SILU_MUL, SILU_MUL_BACKWARD
from ..base import Cost, kernel, row_cost
from .common import (PARALLEL_MIN_ELEMS, acc_dtype, new_output, row_spans, run_spans, store,
                     to_acc)
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


#: elements per block of silu_mul's work inside a thread's span: the inputs, the outputs and
#: two temporaries of a block (256 KiB each in float32) stay in L2 across its passes. Measured
#: at [1024, 1024] on 2 threads (min of 60, loaded VM): forward 2^13 2.78 ms, 2^14 2.50, 2^15
#: 1.86, 2^16 1.67, 2^17 1.83; backward 4.89 / 4.21 / 3.83 / 3.62 / 4.20
SILU_BLOCK = 1 << 16


def _blocks(nrows, row, fn) -> None:
    """fn(r0, r1) over `nrows` rows of `row` elements in spans of about SILU_BLOCK elements,
    taken by the pool's threads from one queue."""
    with np.errstate(all="ignore"):
        run_spans(fn, row_spans(nrows, row, SILU_BLOCK), nrows * row)


def _one_plus_exp_neg(x, out, one):
    """out = 1 + exp(-x), as the recipe's primitives compute it."""
    np.negative(x, out=out)
    np.exp(out, out=out)
    np.add(out, one, out=out)
    return out


def _strided_rows(*arrays):
    """The arrays as [R, C] row views (C the last extent) without a copy, when every one has a
    unit-stride last axis that fits a block (a merged product's halves); else None."""
    out = []
    for a in arrays:
        if a.ndim == 0 or a.strides[-1] != a.itemsize or a.shape[-1] > SILU_BLOCK:
            return None
        try:
            out.append(np.reshape(a, (-1, a.shape[-1]), copy=False))
        except ValueError:
            return None
    return out


@kernel(SILU_MUL, "numpy", cost=row_cost(6), strided_input=True)
def silu_mul(g, u):
    """SILU_MUL: g, u [...] (one shape and float dtype, any strides: the halves of a merged
    gate/up product are read in place) -> silu(g) * u = g / (1 + exp(-g)) * u, computed in
    the accumulation dtype and rounded once (the recipe's operations in its order: float32
    results equal its primitives, and the idiom's glue, bit for bit)."""
    dt, acc = g.dtype, acc_dtype(g.dtype)
    one = acc.type(1)

    def block(x, y, o):
        x, y = to_acc(x, acc), to_acc(y, acc)
        d = _one_plus_exp_neg(x, np.empty(x.shape, acc), one)
        r = o if dt == acc else d
        np.divide(x, d, out=r)
        np.multiply(r, y, out=r)
        if dt != acc:
            store(o, r)

    if g.size < PARALLEL_MIN_ELEMS and dt == acc:       # a few rows: whole arrays, as they are
        with np.errstate(all="ignore"):
            o = np.empty(g.shape, acc)
            block(g, u, o)
            return o
    out = new_output(g.shape, dt)
    rows = None if g.flags.c_contiguous and u.flags.c_contiguous else _strided_rows(g, u)
    if rows is not None:                                 # blocks of whole (strided) rows
        (g2, u2), o2 = rows, out.reshape(rows[0].shape)
        _blocks(*g2.shape, lambda a, b: block(g2[a:b], u2[a:b], o2[a:b]))
        return out
    fg_, fu = np.ascontiguousarray(g).reshape(-1), np.ascontiguousarray(u).reshape(-1)
    fo = out.reshape(-1)
    _blocks(fg_.size, 1, lambda a, b: block(fg_[a:b], fu[a:b], fo[a:b]))
    return out


@kernel(SILU_MUL_BACKWARD, "numpy", cost=row_cost(12))
def silu_mul_backward(g, u, grad):
    """SILU_MUL_BACKWARD: g, u (the forward's inputs), grad (the output's gradient), one shape
    and float dtype -> (dg, du): d = 1 + exp(-g) recomputed, s = 1 / d, du = grad * (g / d),
    dg = (grad * u) * (s * (1 + g * (1 - s))), in the accumulation dtype, each rounded once."""
    dt, acc = g.dtype, acc_dtype(g.dtype)
    dg, du = new_output(g.shape, dt), new_output(g.shape, dt)
    ins = [a.reshape(-1) for a in (g, u, grad)]
    fdg, fdu = dg.reshape(-1), du.reshape(-1)
    one = acc.type(1)

    def block(a, b):
        x, y, dy = (to_acc(f[a:b], acc) for f in ins)
        s = _one_plus_exp_neg(x, np.empty(b - a, acc), one)
        t = np.divide(x, s)                              # silu(g)
        odu = fdu[a:b] if dt == acc else np.empty(b - a, acc)
        np.multiply(dy, t, out=odu)
        np.divide(one, s, out=s)                         # sigmoid(g)
        np.subtract(one, s, out=t)                       # silu'(g) = s * (1 + g * (1 - s))
        np.multiply(x, t, out=t)
        np.add(one, t, out=t)
        np.multiply(s, t, out=t)
        odg = fdg[a:b] if dt == acc else s
        np.multiply(dy, y, out=odg)
        np.multiply(odg, t, out=odg)
        if dt != acc:
            store(fdu[a:b], odu)
            store(fdg[a:b], odg)
    _blocks(ins[0].size, 1, block)
    return dg, du
