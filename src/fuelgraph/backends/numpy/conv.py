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
    its im2col windows. Output column j of row oh reads xp[oh*sh + ky*dh, j*sw + kx*dw]; with
    a width stride of 1, j runs over the whole padded row (Wrow = padded width; the spare row
    keeps the last window inside the buffer)."""

    def __init__(self, x, padding, kernel, out_hw, stride, dilation, acc):
        n, c, h, w = x.shape
        pt, pb, pl, pr = padding
        self.kh, self.kw = kernel
        self.ho, self.wo = out_hw
        (self.sh, self.sw), (self.dh, self.dw) = stride, dilation
        hp, self.wp = h + pt + pb, w + pl + pr
        self.wrow = self.wp if self.sw == 1 else self.wo
        xp = self.xp = np.empty((n, c, hp + 1, self.wp), acc)
        xp[:, :, :pt], xp[:, :, pt + h:], xp[:, :, pt:pt + h, :pl] = 0, 0, 0
        xp[:, :, pt:pt + h, pl + w:] = 0                     # only the border is zeroed
        xp[:, :, pt:pt + h, pl:pl + w] = x if x.dtype == acc else to_acc(x, acc)

    def view(self, n0=0, n1=None):
        """[n, C, Kh, Kw, Ho, Wrow] windows of samples n0:n1."""
        xp = self.xp[n0:n1]
        sn, sc, _, it = xp.strides
        row = self.wp * it
        return as_strided(xp, xp.shape[:2] + (self.kh, self.kw, self.ho, self.wrow),
                          (sn, sc, self.dh * row, self.dw * it, self.sh * row, self.sw * it),
                          writeable=False)

    def tap_rows(self, ky, kx):
        """Window of tap (ky, kx) as rows [N*C, Ho*Wrow] (one contiguous run per row when the
        height stride is 1 too) or [N*C, Ho, Wrow]."""
        n, c = self.xp.shape[:2]
        it = self.xp.itemsize
        base = self.xp.reshape(n * c, -1)[:, ky * self.dh * self.wp + kx * self.dw:]
        if self.sh == 1 and self.sw == 1:
            return as_strided(base, (n * c, self.ho * self.wp), (base.strides[0], it),
                              writeable=False)
        return as_strided(base, (n * c, self.ho, self.wrow),
                          (base.strides[0], self.sh * self.wp * it, self.sw * it),
                          writeable=False)

    def block(self, n, h0, h1, buf):
        """Columns of sample n, output rows [h0, h1): [C*Kh*Kw, (h1-h0)*Wrow] copied into
        `buf` (reused across blocks, so it stays in cache for the GEMM that reads it)."""
        xp = self.xp[n, :, h0 * self.sh:]
        sc, row, it = xp.strides[0], self.wp * xp.itemsize, xp.itemsize
        v = as_strided(xp, (xp.shape[0], self.kh, self.kw, h1 - h0, self.wrow),
                       (sc, self.dh * row, self.dw * it, self.sh * row, self.sw * it),
                       writeable=False)
        b = buf[:v.size].reshape(v.shape)
        np.copyto(b, v)
        return b.reshape(-1, (h1 - h0) * self.wrow)


#: column-block elements per GEMM (2 MiB of float32: the block stays in cache for its GEMM,
#: which is still large enough to amortize BLAS threading)
BLOCK_ELEMS = 1 << 19


def _store_block(dst, o, bias_a):
    """dst <- o (+ bias per channel, o's leading axis), rounded once to dst's dtype."""
    if bias_a is not None:
        np.add(o, bias_a.reshape((-1,) + (1,) * (o.ndim - 1)), out=o)
    if dst.dtype == o.dtype:
        np.copyto(dst, o)
    else:
        store(dst, np.ascontiguousarray(o))


def _conv_into(dst, x, wa, padding, stride, dilation, groups, acc, bias_a=None):
    """dst[N, Cout, Ho, Wo] (any dtype, any strides) <- conv(x, wa) (+ bias), computed in the
    accumulation dtype: im2col blocks of a few output rows, one GEMM each (per group)."""
    n, c = x.shape[:2]
    co, cg, kh, kw = wa.shape
    ho, wo = dst.shape[2:]
    if cg == 1 and groups > 1:
        return _depthwise(dst, x, wa, padding, stride, dilation, acc, bias_a)
    if (kh, kw) == (1, 1) and stride == (1, 1) and not any(padding):  # 1x1: x is its own im2col
        xa = to_acc(np.ascontiguousarray(x), acc).reshape(n, groups, c // groups, ho * wo)
        o = np.matmul(wa.reshape(groups, co // groups, cg), xa).reshape(n, co, ho, wo)
        if bias_a is not None:
            np.add(o, bias_a[:, None, None], out=o)
        return _store_block(dst, o, None)
    u = _Unfold(x, padding, (kh, kw), (ho, wo), stride, dilation, acc)
    wg = wa.reshape(groups, co // groups, cg * kh * kw)
    rows = max(1, min(ho, BLOCK_ELEMS // (c * kh * kw * u.wrow)))
    buf = np.empty(c * kh * kw * rows * u.wrow, acc)
    for i in range(n):
        for h0 in range(0, ho, rows):
            h1 = min(ho, h0 + rows)
            cols = u.block(i, h0, h1, buf).reshape(groups, cg * kh * kw, -1)
            o = np.matmul(wg, cols).reshape(co, h1 - h0, u.wrow)[:, :, :wo]
            _store_block(dst[i, :, h0:h1], o, bias_a)


def _depthwise(dst, x, wa, padding, stride, dilation, acc, bias_a):
    """Grouped conv with one input channel per group: out[n, co] = sum over taps of
    w[co, 0, ky, kx] * window(ky, kx)[n, co // (Cout/g)], one multiply-add per tap over
    chunks of (sample, channel) rows, on the pool's threads."""
    n, c = x.shape[:2]
    co, _, kh, kw = wa.shape
    ho, wo = dst.shape[2:]
    mult = co // c
    xr = x if mult == 1 else np.repeat(x, mult, axis=1)
    u = _Unfold(xr, padding, (kh, kw), (ho, wo), stride, dilation, acc)
    rows = n * co
    taps = [u.tap_rows(ky, kx) for ky in range(kh) for kx in range(kw)]
    wt = wa.reshape(co, kh * kw)
    row_shape = (ho, u.wrow)
    extra = (None,) * (taps[0].ndim - 1)
    d3 = dst.reshape(rows, ho, wo) if dst.flags.c_contiguous else None

    def work(r0, r1):
        ch = np.arange(r0, r1) % co
        wr = wt[ch]
        acc_ = np.multiply(taps[0][r0:r1], wr[(slice(None), 0) + extra])
        tmp = np.empty_like(acc_)
        for t in range(1, kh * kw):
            np.multiply(taps[t][r0:r1], wr[(slice(None), t) + extra], out=tmp)
            np.add(acc_, tmp, out=acc_)
        o = acc_.reshape((r1 - r0,) + row_shape)[:, :, :wo]
        target = d3[r0:r1] if d3 is not None else None
        if target is None:
            for r in range(r0, r1):        # a strided destination: row by row
                _store_block(dst[r // co, r % co], o[r - r0],
                             None if bias_a is None else bias_a[r % co:r % co + 1])
            return
        _store_block(target, o, None if bias_a is None else bias_a[ch])

    run_spans(work, row_spans(rows, ho * u.wrow, 1 << 16), rows * ho * u.wrow)


@kernel(FusedOps.CONV2D, "numpy", cost=conv2d_cost)
def conv2d(x, w, *bias, stride, padding, dilation, groups):
    """CONV2D: x [N, Cin, H, W], w [Cout, Cin/g, Kh, Kw], bias [Cout] -> [N, Cout, Ho, Wo]
    (cross-correlation; padding per side (top, bottom, left, right))."""
    acc = acc_dtype(x.dtype)
    n, _, h, wd = x.shape
    co, _, kh, kw = w.shape
    (pt, pb, pl, pr), (sh, sw), (dh, dw) = padding, stride, dilation
    out = np.empty((n, co, _out_size(h, pt, pb, kh, sh, dh), _out_size(wd, pl, pr, kw, sw, dw)),
                   x.dtype)
    if out.size:
        _conv_into(out, x, to_acc(w, acc), padding, stride, dilation, groups, acc,
                   to_acc(bias[0], acc) if bias else None)
    return out


def _phase(r, k, d, s, n_in, crop_lo, n_out):
    """Rows of a transposed conv's output (window [crop_lo, crop_lo + n_out) of the full
    output, full row i = ih*s + ky*d) that are congruent to r mod s, as a stride-1 correlation
    of x: (first window row j0, taps ky in correlation order, their spacing, x rows [a, b),
    padding (lo, hi), count) or None when no tap or no row falls in this phase."""
    j0 = (r - crop_lo) % s
    taps = [ky for ky in range(k - 1, -1, -1) if (ky * d - r) % s == 0]
    if j0 >= n_out or not taps:
        return None
    count = len(range(j0, n_out, s))
    q0 = (j0 + crop_lo - r) // s
    spacing = d // np.gcd(d, s)
    lo = (taps[0] * d - r) // s - q0             # left zero padding (negative: crop x)
    a = max(0, -lo)
    need = (count - 1) + (len(taps) - 1) * spacing + 1
    b = min(n_in, need - max(lo, 0) + a)
    if b <= a:
        return None
    return j0, taps, spacing, (a, b), (max(lo, 0), need - max(lo, 0) - (b - a)), count


@kernel(FusedOps.CONV_TRANSPOSE2D, "numpy", cost=conv_transpose2d_cost)
def conv_transpose2d(x, w, *bias, stride, padding, output_padding, dilation, groups):
    """CONV_TRANSPOSE2D: x [N, Cin, H, W], w [Cin, Cout/g, Kh, Kw], bias [Cout] ->
    [N, Cout, Ho, Wo], Ho = (H-1)*sh - top - bottom + dh*(Kh-1) + output_padding + 1.
    Computed as sh*sw stride-1 convolutions (one per output phase, each with the kernel taps
    that land on it, flipped), so no work is spent on zeros and each runs as conv2d does."""
    acc = acc_dtype(x.dtype)
    n, cin, h, wd = x.shape
    _, cog, kh, kw = w.shape
    g = groups
    cout = cog * g
    (pt, pb, pl, pr), (sh, sw), (dh, dw) = padding, stride, dilation
    ho = (h - 1) * sh - pt - pb + dh * (kh - 1) + output_padding[0] + 1
    wo = (wd - 1) * sw - pl - pr + dw * (kw - 1) + output_padding[1] + 1
    out = np.empty((n, cout, ho, wo), x.dtype)
    if out.size == 0:
        return out
    # as conv2d weights: [Cout, Cin/g, Kh, Kw]
    wc = to_acc(w, acc).reshape(g, cin // g, cog, kh, kw).transpose(0, 2, 1, 3, 4)
    wc = wc.reshape(cout, cin // g, kh, kw)
    res = np.zeros((n, cout, ho, wo), acc)
    for ry in range(sh):
        ph = _phase(ry, kh, dh, sh, h, pt, ho)
        for rx in range(sw):
            pw = _phase(rx, kw, dw, sw, wd, pl, wo)
            if ph is None or pw is None:
                continue
            sub = np.ascontiguousarray(wc[:, :, ph[1]][:, :, :, pw[1]])
            xs = x[:, :, ph[3][0]:ph[3][1], pw[3][0]:pw[3][1]]
            _conv_into(res[:, :, ph[0]::sh, pw[0]::sw], xs, sub, ph[4] + pw[4], (1, 1),
                       (ph[2], pw[2]), g, acc)
    if bias:
        np.add(res, to_acc(bias[0], acc)[:, None, None], out=res)
    store(out, res)
    return out


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
        rows = max(1, min(ho, BLOCK_ELEMS // (c * kh * kw * u.wrow)))
        buf = np.empty(c * kh * kw * rows * u.wrow, acc)
        part = np.empty_like(dw)
        for i in range(n):                   # blocks of output rows, as in the forward
            for h0 in range(0, ho, rows):
                h1 = min(ho, h0 + rows)
                cols = u.block(i, h0, h1, buf).reshape(g, cg * kh * kw, -1)
                gb = ga[i, :, h0:h1].reshape(g, cog, -1)
                dw += np.matmul(gb, cols.transpose(0, 2, 1), out=part)
    res = np.empty((co, cg, kh, kw), x.dtype)
    store(res, dw.reshape(co, cg, kh, kw))
    return res


def _depthwise_weight_grad(u, ga, c, kh, kw):
    """dW[co, 0, t] = sum over samples and pixels of grad[:, co] * window_t[:, co // mult]."""
    n, co = ga.shape[:2]
    dw = np.empty((co, kh * kw), ga.dtype)
    for ky in range(kh):
        for kx in range(kw):
            win = u.tap_rows(ky, kx)
            win = win.reshape((n, c, 1) + win.shape[1:])
            g5 = ga.reshape((n, c, co // c) + win.shape[3:])
            prod = np.vecdot(g5, win)
            dw[:, ky * kw + kx] = prod.sum(tuple(i for i in range(prod.ndim) if i not in (1, 2))
                                           ).reshape(co)
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
