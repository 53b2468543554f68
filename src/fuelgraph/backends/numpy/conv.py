"""NumPy kernels for the convolution family: conv2d, conv_transpose2d, conv2d_backward_weight,
causal_conv1d and causal_conv1d_backward (the CPU reference implementations).

Every kernel computes in the accumulation dtype (float32 for float32/bfloat16/float16, float64
for float64) and rounds once to the input dtype. The 2-D convolutions are im2col + BLAS: the
padded input is viewed through `as_strided` as [N, C, Kh, Kw, Ho, Wrow] (no Python loop over
pixels or taps), copied once into a column buffer and multiplied by the weight in one batched
GEMM per chunk of samples. When the width stride is 1 the column buffer spans whole padded rows
(Wrow = padded width, the few columns past Wo are computed and dropped): each copy is then a
long contiguous run instead of Wo-element pieces, which makes the copy several times faster.
Depthwise convolutions (one input channel per output channel) skip the GEMM: a loop over the
kernel taps does one vectorized multiply-add each. conv_transpose2d is the GEMM to the column
stack followed by an overlap-add loop over the taps (col2im).
"""
from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...registry.conv import CAUSAL_CONV1D_BACKWARD, CONV2D_BACKWARD_WEIGHT
from ...registry.core import FusedOps
from ..base import Cost, kernel, row_cost
from .common import acc_dtype, row_spans, run_spans, store, to_acc

#: column-buffer elements per chunk of samples (32 MiB of float32)
COLS_CHUNK = 1 << 23


def _out_size(size, lo, hi, k, s, d):
    return (size + lo + hi - d * (k - 1) - 1) // s + 1


# ---- costs (shared with the CUDA kernels): 2 flops per multiply-add, float32 bytes ------------
def conv2d_cost(shapes, p):
    (n, c, h, w), (co, cg, kh, kw) = shapes[0], shapes[1]
    ho = _out_size(h, p.padding[0], p.padding[1], kh, p.stride[0], p.dilation[0])
    wo = _out_size(w, p.padding[2], p.padding[3], kw, p.stride[1], p.dilation[1])
    out = n * co * ho * wo
    return Cost(2 * out * cg * kh * kw, 4 * (n * c * h * w + co * cg * kh * kw + out))


def conv_transpose2d_cost(shapes, p):
    (n, c, h, w), (_, cog, kh, kw) = shapes[0], shapes[1]
    return Cost(2 * n * c * h * w * cog * kh * kw,
                4 * (n * c * h * w * (1 + cog * p.groups / c) + c * cog * kh * kw))


def conv2d_backward_weight_cost(shapes, p):
    (n, c, h, w), (_, co, ho, wo) = shapes
    kk = p.kernel_size[0] * p.kernel_size[1]
    return Cost(2 * n * co * ho * wo * (c // p.groups) * kk,
                4 * (n * c * h * w + n * co * ho * wo + co * (c // p.groups) * kk))


def causal_conv1d_cost(shapes, p):
    n = math.prod(shapes[0])
    return Cost(2 * n * shapes[1][-1] + (4 * n if p.use_silu else 0), 4 * 2 * n)


causal_conv1d_backward_cost = row_cost(12)


class _Unfold:
    """The padded input `xp` (acc dtype, one spare zero row at the bottom) and strided views of
    its im2col windows. Output column j of row oh reads xp[oh*sh + ky*dh, j*sw + kx*dw]."""

    def __init__(self, x, padding, kernel, out_hw, stride, dilation, acc, extra_rows=1):
        n, c, h, w = x.shape
        pt, pb, pl, pr = padding
        self.kh, self.kw = kernel
        self.ho, self.wo = out_hw
        (self.sh, self.sw), (self.dh, self.dw) = stride, dilation
        hp, wp = h + pt + pb, w + pl + pr
        self.flat = self.sw == 1
        self.wrow = wp if self.flat else self.wo
        self.xp = np.zeros((n, c, hp + extra_rows, wp), acc)
        self.xp[:, :, pt:pt + h, pl:pl + w] = x if x.dtype == acc else to_acc(x, acc)
        self.wp = wp

    def view(self, n0=0, n1=None):
        """[n, C, Kh, Kw, Ho, Wrow] windows of samples n0:n1."""
        xp = self.xp[n0:n1]
        sn, sc, _, it = xp.strides
        row = self.wp * it
        return as_strided(xp, xp.shape[:2] + (self.kh, self.kw, self.ho, self.wrow),
                          (sn, sc, self.dh * row, self.dw * it, self.sh * row, self.sw * it),
                          writeable=False)

    def tap(self, ky, kx):
        """[N, C, Ho, Wrow] window of tap (ky, kx)."""
        return self.view()[:, :, ky, kx]

    def cols(self, n0, n1, groups):
        """Column buffer [n, g, Cg*Kh*Kw, Ho*Wrow] of samples n0:n1."""
        v = self.view(n0, n1)
        buf = np.empty(v.shape, v.dtype)
        np.copyto(buf, v)
        n, c = buf.shape[:2]
        return buf.reshape(n, groups, (c // groups) * self.kh * self.kw, self.ho * self.wrow)


def _sample_chunks(n, per_sample):
    step = max(1, COLS_CHUNK // max(1, per_sample))
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _finish(o, out, bias, acc, wo):
    """out <- o[..., :wo] (+ bias per channel), rounded once to out's dtype."""
    o = o[..., :wo]
    if bias:
        np.add(o, to_acc(bias[0], acc)[:, None, None], out=o)
    if out.dtype == o.dtype:
        np.copyto(out, o)
    else:
        store(out, np.ascontiguousarray(o))
    return out


@kernel(FusedOps.CONV2D, "numpy", cost=conv2d_cost)
def conv2d(x, w, *bias, stride, padding, dilation, groups):
    """CONV2D: x [N, Cin, H, W], w [Cout, Cin/g, Kh, Kw], bias [Cout] -> [N, Cout, Ho, Wo]
    (cross-correlation; padding per side (top, bottom, left, right))."""
    acc = acc_dtype(x.dtype)
    n, c, h, wd = x.shape
    co, cg, kh, kw = w.shape
    (pt, pb, pl, pr), (sh, sw), (dh, dw) = padding, stride, dilation
    ho, wo = _out_size(h, pt, pb, kh, sh, dh), _out_size(wd, pl, pr, kw, sw, dw)
    out = np.empty((n, co, ho, wo), x.dtype)
    if out.size == 0:
        return out
    wa = to_acc(w, acc)
    if cg == 1 and groups > 1:
        return _depthwise(x, wa, bias, out, padding, stride, dilation, acc)
    if (kh, kw, sh, sw) == (1, 1, 1, 1) and not any(padding):     # 1x1: x is its own im2col
        xa = to_acc(x, acc).reshape(n, groups, c // groups, h * wd)
        o = np.matmul(wa.reshape(groups, co // groups, cg), xa)
        return _finish(o.reshape(n, co, ho, wo), out, bias, acc, wo)
    u = _Unfold(x, padding, (kh, kw), (ho, wo), stride, dilation, acc)
    wg = wa.reshape(groups, co // groups, cg * kh * kw)
    o = np.empty((n, groups, co // groups, ho * u.wrow), acc)
    for n0, n1 in _sample_chunks(n, c * kh * kw * ho * u.wrow):
        np.matmul(wg, u.cols(n0, n1, groups), out=o[n0:n1])
    return _finish(o.reshape(n, co, ho, u.wrow), out, bias, acc, wo)


def _depthwise(x, wa, bias, out, padding, stride, dilation, acc):
    """Grouped conv with one input channel per group: out[n, co] = sum over taps of
    w[co, 0, ky, kx] * window(ky, kx)[n, co // (Cout/g)], one multiply-add per tap over
    chunks of (sample, channel) rows."""
    n, c = x.shape[:2]
    co, _, kh, kw = wa.shape
    ho, wo = out.shape[2:]
    mult = co // c
    xr = x if mult == 1 else np.repeat(x, mult, axis=1)
    u = _Unfold(xr, padding, (kh, kw), (ho, wo), stride, dilation, acc)
    rows = n * co
    taps = [u.tap(ky, kx).reshape(rows, ho, u.wrow) for ky in range(kh) for kx in range(kw)]
    wt = wa.reshape(co, kh * kw)
    o = np.empty((rows, ho, u.wrow), acc)

    def work(r0, r1):
        ch = np.arange(r0, r1) % co
        wr = wt[ch][:, :, None, None]
        acc_ = o[r0:r1]
        tmp = np.empty_like(acc_)
        np.multiply(taps[0][r0:r1], wr[:, 0], out=acc_)
        for t in range(1, kh * kw):
            np.multiply(taps[t][r0:r1], wr[:, t], out=tmp)
            np.add(acc_, tmp, out=acc_)

    run_spans(work, row_spans(rows, ho * u.wrow, 1 << 16), rows * ho * u.wrow)
    return _finish(o.reshape(n, co, ho, u.wrow), out, bias, acc, wo)


@kernel(FusedOps.CONV_TRANSPOSE2D, "numpy", cost=conv_transpose2d_cost)
def conv_transpose2d(x, w, *bias, stride, padding, output_padding, dilation, groups):
    """CONV_TRANSPOSE2D: x [N, Cin, H, W], w [Cin, Cout/g, Kh, Kw], bias [Cout] ->
    [N, Cout, Ho, Wo], Ho = (H-1)*sh - top - bottom + dh*(Kh-1) + output_padding + 1."""
    acc = acc_dtype(x.dtype)
    n, cin, h, wd = x.shape
    _, cog, kh, kw = w.shape
    g = groups
    cig, cout = cin // g, cog * g
    (pt, pb, pl, pr), (sh, sw), (dh, dw) = padding, stride, dilation
    ho = (h - 1) * sh - pt - pb + dh * (kh - 1) + output_padding[0] + 1
    wo = (wd - 1) * sw - pl - pr + dw * (kw - 1) + output_padding[1] + 1
    out = np.empty((n, cout, ho, wo), x.dtype)
    if out.size == 0:
        return out
    # full (uncropped) output, large enough for every tap and for the cropped window
    hf = max((h - 1) * sh + dh * (kh - 1) + 1, pt + ho)
    wf = max((wd - 1) * sw + dw * (kw - 1) + 1, pl + wo)
    full = np.zeros((n, cout, hf, wf), acc)
    wt = to_acc(w, acc).reshape(g, cig, cog * kh * kw).transpose(0, 2, 1)   # [g, Cog*K, Cig]
    for n0, n1 in _sample_chunks(n, cout * kh * kw * h * wd):
        xa = to_acc(x[n0:n1], acc).reshape(n1 - n0, g, cig, h * wd)
        cols = np.matmul(wt, xa).reshape(n1 - n0, g, cog, kh * kw, h, wd)
        dst = full[n0:n1]
        for ky in range(kh):
            for kx in range(kw):
                sl = dst[:, :, ky * dh: ky * dh + (h - 1) * sh + 1: sh,
                         kx * dw: kx * dw + (wd - 1) * sw + 1: sw]
                np.add(sl, cols[:, :, :, ky * kw + kx].reshape(n1 - n0, cout, h, wd), out=sl)
    return _finish(full[:, :, pt:pt + ho, pl:], out, bias, acc, wo)


@kernel(CONV2D_BACKWARD_WEIGHT, "numpy", cost=conv2d_backward_weight_cost)
def conv2d_backward_weight(x, grad, *, stride, padding, dilation, groups, kernel_size):
    """CONV2D_BACKWARD_WEIGHT: x [N, Cin, H, W], grad [N, Cout, Ho, Wo] -> dW [Cout, Cin/g,
    Kh, Kw] = sum over n and output pixels of grad times the padded input under each tap."""
    acc = acc_dtype(x.dtype)
    n, c = x.shape[:2]
    co, ho, wo = grad.shape[1:]
    kh, kw = kernel_size
    g = groups
    cg, cog = c // g, co // g
    u = _Unfold(x, padding, (kh, kw), (ho, wo), stride, dilation, acc)
    ga = np.zeros((n, co, ho, u.wrow), acc)          # zero past Wo: those columns are dropped
    ga[..., :wo] = grad if grad.dtype == acc else to_acc(grad, acc)
    if cg == 1 and g > 1:
        dw = _depthwise_weight_grad(u, ga, c, kh, kw)
    else:
        dw = np.zeros((g, cog, cg * kh * kw), acc)
        for n0, n1 in _sample_chunks(n, c * kh * kw * ho * u.wrow):
            gc = ga[n0:n1].reshape(n1 - n0, g, cog, ho * u.wrow)
            dw += np.matmul(gc, u.cols(n0, n1, g).transpose(0, 1, 3, 2)).sum(0)
    res = np.empty((co, cg, kh, kw), x.dtype)
    store(res, dw.reshape(co, cg, kh, kw))
    return res


def _depthwise_weight_grad(u, ga, c, kh, kw):
    """dW[co, 0, t] = sum over samples and pixels of grad[:, co] * window_t[:, co // mult]."""
    n, co = ga.shape[:2]
    g5 = ga.reshape(n, c, co // c, u.ho, u.wrow)
    dw = np.empty((co, kh * kw), ga.dtype)
    for ky in range(kh):
        for kx in range(kw):
            win = u.tap(ky, kx)[:, :, None]                     # [n, c, 1, ho, wrow]
            dw[:, ky * kw + kx] = np.vecdot(g5, win).sum((0, 3)).reshape(co)
    return dw


# ---- causal depthwise conv1d -------------------------------------------------------------------
def _causal_rows(x, w, bias, acc):
    b, c, l = x.shape
    k = w.shape[-1]
    return b * c, c, l, k, to_acc(w.reshape(c, k), acc), (to_acc(bias[0], acc) if bias else None)


def _causal_z(xa, wr, br, k, l, tmp):
    """z = bias + sum_j w[:, j] * x shifted right by k-1-j (zeros shifted in), per row."""
    z = np.multiply(xa, wr[:, k - 1:k])
    for j in range(k - 1):
        s = k - 1 - j
        if s >= l:
            continue
        np.multiply(xa[:, :l - s], wr[:, j:j + 1], out=tmp[:, :l - s])
        np.add(z[:, s:], tmp[:, :l - s], out=z[:, s:])
    if br is not None:
        np.add(z, br[:, None], out=z)
    return z


def _sigmoid(z):
    s = np.negative(z)
    np.exp(s, out=s)
    s += 1
    return np.divide(1, s, out=s)


@kernel(FusedOps.CAUSAL_CONV1D, "numpy", cost=causal_conv1d_cost)
def causal_conv1d(x, w, *bias, use_silu):
    """CAUSAL_CONV1D: x [B, C, L], w [C, W] or [C, 1, W], bias [C] -> [B, C, L];
    z = bias + sum_k w[:, k] * x[t + k - (W-1)] (zeros before t = 0); silu(z) if use_silu."""
    acc = acc_dtype(x.dtype)
    rows, c, l, k, wa, ba = _causal_rows(x, w, bias, acc)
    x2 = x.reshape(rows, l)
    out = np.empty(x.shape, x.dtype)
    o2 = out.reshape(rows, l)

    def work(r0, r1):
        ch = np.arange(r0, r1) % c
        xa = to_acc(x2[r0:r1], acc)
        z = _causal_z(xa, wa[ch], None if ba is None else ba[ch], k, l, np.empty_like(xa))
        if use_silu:
            np.multiply(z, _sigmoid(z), out=z)
        store(o2[r0:r1], z)

    with np.errstate(over="ignore"):
        run_spans(work, row_spans(rows, l, 1 << 16), rows * l, row_elems=l)
    return out


@kernel(CAUSAL_CONV1D_BACKWARD, "numpy", cost=causal_conv1d_backward_cost)
def causal_conv1d_backward(x, w, grad, *bias, use_silu):
    """CAUSAL_CONV1D_BACKWARD: (x, w, grad, [bias]) -> (dx [B, C, L], dw shaped like w,
    dbias [C]); silu' is recomputed from x when use_silu."""
    acc = acc_dtype(x.dtype)
    rows, c, l, k, wa, ba = _causal_rows(x, w, bias, acc)
    b = x.shape[0]
    x2, g2 = x.reshape(rows, l), grad.reshape(rows, l)
    dx = np.empty(x.shape, x.dtype)
    dx2 = dx.reshape(rows, l)
    dw_rows = np.empty((rows, k), acc)
    db_rows = np.empty(rows, acc)

    def work(r0, r1):
        ch = np.arange(r0, r1) % c
        xa, wr = to_acc(x2[r0:r1], acc), wa[ch]
        dz = to_acc(g2[r0:r1], acc)
        tmp = np.empty_like(xa)
        if use_silu:
            z = _causal_z(xa, wr, None if ba is None else ba[ch], k, l, tmp)
            s = _sigmoid(z)                       # dz = g * s * (1 + z * (1 - s))
            np.multiply(z, s, out=tmp)
            np.subtract(z, tmp, out=z)
            z += 1
            np.multiply(z, s, out=z)
            dz = np.multiply(dz, z, out=z)
        db_rows[r0:r1] = dz.sum(1)
        for j in range(k):
            s_ = k - 1 - j
            dw_rows[r0:r1, j] = np.vecdot(dz[:, s_:], xa[:, :l - s_]) if s_ < l else 0
        d = np.multiply(dz, wr[:, k - 1:k], out=tmp)
        for j in range(k - 1):
            s_ = k - 1 - j
            if s_ < l:
                d[:, :l - s_] += dz[:, s_:] * wr[:, j:j + 1]
        store(dx2[r0:r1], d)

    with np.errstate(over="ignore"):
        run_spans(work, row_spans(rows, l, 1 << 16), rows * l, row_elems=l)
    dwt = np.empty(w.shape, w.dtype)
    store(dwt, dw_rows.reshape(b, c, k).sum(0).reshape(w.shape))
    dbias = np.empty(c, x.dtype)
    store(dbias, db_rows.reshape(b, c).sum(0))
    return dx, dwt, dbias
