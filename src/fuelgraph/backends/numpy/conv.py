"""NumPy kernels for the convolution family: conv2d, conv_transpose2d, conv2d_backward_weight,
causal_conv1d and causal_conv1d_backward (the CPU reference implementations).

Every kernel computes in the accumulation dtype (float32 for float32/bfloat16/float16, float64
for float64) and rounds once to the input dtype. The 2-D convolutions are im2col + BLAS: the
input is zero-padded and split into its stride phases once (`_Unfold`), so that for any stride
the columns of one kernel tap over a few output rows are one contiguous run (whole phase rows;
the few columns past Wo are computed and dropped): the column block is built by memcpy-speed
copies, never a gather of Wo-element pieces or a Python loop over pixels. Each block of output
rows is then ONE GEMM per group, [Cout/g, Cin/g*Kh*Kw] x [Cin/g*Kh*Kw, rows*Wq], whose result
is already in NCHW order (no transpose). With at least SHIFTED_MIN_CHANNELS input channels per
group even that copy is skipped: each tap's window is a strided view BLAS reads directly, one
GEMM per tap (K = Cin/g), summed in the L2-resident output block (BLAS packs its operand
anyway, so the im2col copy was a second pass over the same data); the weight gradient does
the same, one GEMM per tap into its own slice of dW. Blocks run on fuelgraph's pool threads, each GEMM a
single-threaded BLAS call on a per-thread block that stays in the core's L2 (BLAS's own
threads spin between many small calls, and collapse when another process shares the cores).
Depthwise convolutions (one input channel per output channel) skip the GEMM: per chunk of
(sample, channel) rows one vectorized multiply and add per tap (causal_conv1d: per tap over rows
of channels instead when its input is a time-major view, as in Mamba). conv_transpose2d is sh*sw
stride-1 convolutions, one per output phase, written straight into the strided output.
"""
from __future__ import annotations

import contextlib
import math
import threading

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...registry.conv import CAUSAL_CONV1D_BACKWARD, CONV2D_BACKWARD_WEIGHT
from ...registry.core import FusedOps
from ..base import Cost, kernel, row_cost
from . import common
from .common import PARALLEL_MIN_ELEMS, acc_dtype, row_spans, run_spans, store, to_acc



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


def _phase_span(p, s, pad, size, nq):
    """Phase p of stride s over a padded axis (padded index i = p + s*q, q < nq): the first q
    that lands on the input (i - pad >= 0), that input index and how many q do."""
    q0 = min(nq, max(0, -(-(pad - p) // s)))
    i0 = p + s * q0 - pad
    return q0, i0, max(0, min(nq - q0, len(range(i0, size, s))))


class _Unfold:
    """The zero-padded input split into its stride phases, in the accumulation dtype:
    xq[n, c, py*sw + px, q, r] = padded x[n, c, q*sh + py, r*sw + px], plus one spare zero row
    per phase. Tap (ky, kx) of output pixel (oh, ow) reads phase ((ky*dh) % sh, (kx*dw) % sw) at
    (oh + ky*dh // sh, ow + kx*dw // sw), so for every stride the im2col columns of `rows`
    consecutive output rows of one tap are ONE contiguous run of rows*Wq elements (Wq = phase
    width >= Wo; the columns past Wo are computed and dropped): the column copy is a memcpy,
    not a gather of Wo-element pieces."""

    def __init__(self, x, padding, kernel, out_hw, stride, dilation, acc):
        self.x, self.acc = x, acc
        n, c, h, w = x.shape
        self.pad = padding
        self.kh, self.kw = kernel
        self.ho, self.wo = out_hw
        (self.sh, self.sw), (self.dh, self.dw) = stride, dilation
        dh, dw = dilation
        self.hq = -(-(h + padding[0] + padding[1]) // self.sh)
        self.wq = self.wrow = -(-(w + padding[2] + padding[3]) // self.sw)
        self.phases = self.sh * self.sw
        self.xq = np.empty((n, c, self.phases, self.hq + 1, self.wq), acc)
        #: per tap (ky, kx): (phase, offset of output row 0 in the flattened phase)
        self.taps = []
        for ky in range(self.kh):
            for kx in range(self.kw):
                (qy, py), (qx, px) = divmod(ky * dh, self.sh), divmod(kx * dw, self.sw)
                self.taps.append((py * self.sw + px, qy * self.wq + qx))

    def fill(self, n0, n1):
        """Pad and phase-split samples n0:n1 (only the border is zeroed)."""
        x, xq = self.x[n0:n1], self.xq[n0:n1]
        h, w = x.shape[2:]
        pt, _, pl, _ = self.pad
        for py in range(self.sh):
            q0, y0, nq = _phase_span(py, self.sh, pt, h, self.hq)
            for px in range(self.sw):
                r0, x0, nr = _phase_span(px, self.sw, pl, w, self.wq)
                d = xq[:, :, py * self.sw + px]
                d[:, :, :q0], d[:, :, q0 + nq:] = 0, 0
                d[:, :, q0:q0 + nq, :r0], d[:, :, q0:q0 + nq, r0 + nr:] = 0, 0
                src = x[:, :, y0::self.sh, x0::self.sw][:, :, :nq, :nr]
                d[:, :, q0:q0 + nq, r0:r0 + nr] = src if src.dtype == self.acc else \
                    to_acc(src, self.acc)

    def fill_all(self, parallel):
        n = self.xq.shape[0]
        if parallel:
            run_spans(self.fill, [(i, i + 1) for i in range(n)], PARALLEL_MIN_ELEMS)
        else:
            self.fill(0, n)

    def tap_rows(self, t):
        """Window of tap t as rows [N*C, Ho*Wq] (row (n, c) of output pixels, Wq per row)."""
        n, c = self.xq.shape[:2]
        p, off = self.taps[t]
        return self.xq.reshape(n * c, self.phases, -1)[:, p, off:off + self.ho * self.wq]

    def block(self, n, h0, h1, buf):
        """Columns of sample n, output rows [h0, h1): [C*Kh*Kw, (h1-h0)*Wq] copied into `buf`
        (one buffer per thread, reused across blocks so it stays in cache for the GEMM)."""
        c, taps = self.xq.shape[1], len(self.taps)
        run = (h1 - h0) * self.wq
        cols = buf[:c * taps * run].reshape(c, taps, run)
        flat = self.xq[n].reshape(c, self.phases, -1)
        if self.phases == 1:                # [C, Kh, Kw, run] in one copy
            it = flat.itemsize
            v = as_strided(flat[:, 0, h0 * self.wq:], (c, self.kh, self.kw, run),
                           (flat.strides[0], self.dh * self.wq * it, self.dw * it, it),
                           writeable=False)
            np.copyto(cols.reshape(c, self.kh, self.kw, run), v)
        else:
            for t, (p, off) in enumerate(self.taps):
                s0 = h0 * self.wq + off
                np.copyto(cols[:, t], flat[:, p, s0:s0 + run])
        return cols.reshape(c * taps, run)

    def tap_block(self, n, t, h0, h1, groups):
        """Tap t's window over output rows [h0, h1) of sample n, a strided VIEW [g, C/g,
        (h1-h0)*Wq] whose rows are contiguous runs: BLAS reads it without an im2col copy."""
        c = self.xq.shape[1]
        p, off = self.taps[t]
        s0 = h0 * self.wq + off
        flat = self.xq[n].reshape(groups, c // groups, self.phases, -1)
        return flat[:, :, p, s0:s0 + (h1 - h0) * self.wq]

    def row_blocks(self, elems=None):
        """(rows per block, [(sample, h0, h1)]) for blocks of about BLOCK_ELEMS columns."""
        c = self.xq.shape[1]
        per_row = (elems or BLOCK_ELEMS) // (c * len(self.taps) * self.wq) if elems is None \
            else elems // self.wq
        rows = max(1, min(self.ho, per_row))
        return rows, [(i, h0, min(self.ho, h0 + rows)) for i in range(self.xq.shape[0])
                      for h0 in range(0, self.ho, rows)]


#: column-block elements per GEMM (1 MiB of float32: the block, the weights and the output
#: block stay in the core's L2 while its GEMM runs)
BLOCK_ELEMS = 1 << 18
#: convolutions with at least this many input channels per group skip the im2col copy: one GEMM
#: per tap straight from the padded input (K = C/g is long enough for BLAS to run at full
#: speed), summed in an L2-resident block of BLOCK_ELEMS / 4 outputs; fewer channels: im2col
SHIFTED_MIN_CHANNELS = 16
#: convolutions of at least this many flops run their blocks on fuelgraph's pool threads, each
#: block's GEMM a single-threaded BLAS call (BLAS's own threads spin between the many small
#: calls and collapse when another process competes for the cores)
PARALLEL_CONV_FLOPS = 2e7


#: products this large make OpenBLAS start its own threads (M*N*K >= 2^18)
BLAS_THREADS_FLOPS = 5e5
_BLAS_LIBS: list = []


def _blas_libs():
    """threadpoolctl's controllers of the loaded BLAS libraries ([] without threadpoolctl);
    setting their thread count directly costs ~1 us, a `threadpool_limits` context ~40 us."""
    if not _BLAS_LIBS:
        try:
            from threadpoolctl import ThreadpoolController
            _BLAS_LIBS.append(ThreadpoolController().select(user_api="blas").lib_controllers)
        except ImportError:                                    # pragma: no cover
            _BLAS_LIBS.append([])
    return _BLAS_LIBS[0]


@contextlib.contextmanager
def _pool_gemms(flops):
    """Yields whether to spread the blocks over the pool threads. Meanwhile BLAS stays on one
    thread whenever it would start its own: they spin between the many small calls and
    collapse when another process competes for the cores."""
    libs = _blas_libs() if flops >= BLAS_THREADS_FLOPS else []
    old = [lib.num_threads for lib in libs]
    for lib in libs:
        lib.set_num_threads(1)
    try:
        yield bool(libs) and common.NUM_THREADS > 1 and flops >= PARALLEL_CONV_FLOPS
    finally:
        for lib, n in zip(libs, old):
            lib.set_num_threads(n)


def _per_thread(make):
    """get() -> this thread's own scratch array (made on first use)."""
    local = threading.local()

    def get():
        b = getattr(local, "b", None)
        if b is None:
            b = local.b = make()
        return b
    return get


def _run_items(work, items, parallel):
    if parallel and len(items) > 1:
        run_spans(lambda a, b: [work(*it) for it in items[a:b]],
                  [(k, k + 1) for k in range(len(items))], PARALLEL_MIN_ELEMS)
    else:
        for it in items:
            work(*it)


def _store_block(dst, o, bias_a):
    """dst <- o (+ bias per channel, o's leading axis), rounded once to dst's dtype."""
    b = None if bias_a is None else bias_a.reshape((-1,) + (1,) * (o.ndim - 1))
    if dst.dtype == o.dtype:
        if b is None:
            np.copyto(dst, o)
        else:
            np.add(o, b, out=dst)
        return
    if b is not None:
        np.add(o, b, out=o)
    store(dst, np.ascontiguousarray(o))


def _conv_into(dst, x, wa, padding, stride, dilation, groups, acc, bias_a=None):
    """dst[N, Cout, Ho, Wo] (any dtype, any strides) <- conv(x, wa) (+ bias), computed in the
    accumulation dtype: im2col blocks of a few output rows, one GEMM each (per group), the
    blocks spread over the pool's threads."""
    _convs_into([(dst, x, wa, padding, stride, dilation, bias_a)], groups, acc)


def _convs_into(jobs, groups, acc):
    """Several independent convolutions (dst, x, wa, padding, stride, dilation, bias_a) as
    _conv_into does each, their padding and their GEMM blocks each in ONE pass over the pool
    (a transposed conv's phases: fewer thread hand-offs, which cost most when another process
    holds a core)."""
    gemm_jobs = []
    for dst, x, wa, padding, stride, dilation, bias_a in jobs:
        n, c = x.shape[:2]
        co, cg, kh, kw = wa.shape
        ho, wo = dst.shape[2:]
        if cg == 1 and groups > 1:
            _depthwise(dst, x, wa, padding, stride, dilation, acc, bias_a)
        elif (kh, kw) == (1, 1) and stride == (1, 1) and not any(padding):
            # 1x1: x is its own im2col
            xa = to_acc(np.ascontiguousarray(x), acc).reshape(n, groups, c // groups, ho * wo)
            wg = wa.reshape(groups, co // groups, cg)
            with _pool_gemms(2.0 * dst.size * cg) as par:
                _run_items(lambda i: _store_block(
                    dst[i], np.matmul(wg, xa[i]).reshape(co, ho, wo), bias_a),
                    [(i,) for i in range(n)], par)
        else:
            u = _Unfold(x, padding, (kh, kw), (ho, wo), stride, dilation, acc)
            gemm_jobs.append((u, dst, wa.reshape(groups, co // groups, cg * kh * kw), bias_a))
    if not gemm_jobs:
        return
    items, size, flops = [], 0, 0.0
    for j, (u, dst, wg, _) in enumerate(gemm_jobs):
        k = wg.shape[2]
        shifted = k // len(u.taps) >= SHIFTED_MIN_CHANNELS
        rows, blocks = u.row_blocks(BLOCK_ELEMS // (4 * dst.shape[1]) if shifted else None)
        items += [(j,) + b for b in blocks]
        size = max(size, 2 * dst.shape[1] * rows * u.wq if shifted else k * groups * rows * u.wq)
        flops += 2.0 * dst.size * k
    buf = _per_thread(lambda: np.empty(size, acc))
    # shifted GEMMs take the weights tap-major: [T, g, Cout/g, Cin/g]
    taps_w = [np.ascontiguousarray(wg.reshape(wg.shape[:2] + (-1, len(u.taps))).transpose(
        3, 0, 1, 2)) if wg.shape[2] // len(u.taps) >= SHIFTED_MIN_CHANNELS else None
        for u, _, wg, _ in gemm_jobs]

    def work(j, i, h0, h1):
        u, dst, wg, bias_a = gemm_jobs[j]
        if taps_w[j] is None:
            cols = u.block(i, h0, h1, buf()).reshape(groups, wg.shape[2], -1)
            o = np.matmul(wg, cols)
        else:                        # sum over taps of W_t @ window_t, no im2col copy
            wt, m = taps_w[j], wg.shape[1] * (h1 - h0) * u.wq
            o = buf()[:groups * m].reshape(groups, wg.shape[1], -1)
            tmp = buf()[groups * m:2 * groups * m].reshape(o.shape)
            np.matmul(wt[0], u.tap_block(i, 0, h0, h1, groups), out=o)
            for t in range(1, len(wt)):
                np.add(o, np.matmul(wt[t], u.tap_block(i, t, h0, h1, groups), out=tmp), out=o)
        _store_block(dst[i, :, h0:h1], o.reshape(-1, h1 - h0, u.wq)[:, :, :dst.shape[3]],
                     bias_a)
    with _pool_gemms(flops) as par:
        _run_items(lambda j, i: gemm_jobs[j][0].fill(i, i + 1),
                   [(j, i) for j in range(len(gemm_jobs))
                    for i in range(gemm_jobs[j][0].xq.shape[0])], par)
        _run_items(work, items, par)


#: (sample, channel) rows per depthwise chunk: about this many elements, so the accumulator
#: and the product of one tap stay in the core's L2
DEPTHWISE_CHUNK_ELEMS = 1 << 15


def _depthwise(dst, x, wa, padding, stride, dilation, acc, bias_a):
    """Grouped conv with one input channel per group: out[n, co] = sum over taps of
    w[co, 0, ky, kx] * window(ky, kx)[n, co // (Cout/g)], one multiply and one add per tap
    over chunks of (sample, channel) rows, on the pool's threads."""
    n, c = x.shape[:2]
    co, _, kh, kw = wa.shape
    ho, wo = dst.shape[2:]
    mult = co // c
    xr = x if mult == 1 else np.repeat(x, mult, axis=1)
    u = _Unfold(xr, padding, (kh, kw), (ho, wo), stride, dilation, acc)
    rows, run = n * co, ho * u.wq
    par = common.NUM_THREADS > 1 and 2.0 * rows * run * kh * kw >= PARALLEL_CONV_FLOPS
    u.fill_all(par)
    taps = [u.tap_rows(t) for t in range(kh * kw)]
    wt = wa.reshape(co, kh * kw)
    d3 = dst.reshape(rows, ho, wo) if dst.flags.c_contiguous else None
    step = max(1, DEPTHWISE_CHUNK_ELEMS // run)
    scratch = _per_thread(lambda: np.empty(2 * step * run, acc))

    def work(r0, r1):
        ch = np.arange(r0, r1) % co
        wr = wt[ch]
        sbuf = scratch()
        acc_ = sbuf[:(r1 - r0) * run].reshape(r1 - r0, run)
        tmp = sbuf[step * run:step * run + acc_.size].reshape(acc_.shape)
        np.multiply(taps[0][r0:r1], wr[:, :1], out=acc_)
        for t in range(1, kh * kw):
            np.multiply(taps[t][r0:r1], wr[:, t:t + 1], out=tmp)
            np.add(acc_, tmp, out=acc_)
        o = acc_.reshape(r1 - r0, ho, u.wq)[:, :, :wo]
        if d3 is None:                     # a strided destination: row by row
            for r in range(r0, r1):
                _store_block(dst[r // co, r % co], o[r - r0],
                             None if bias_a is None else bias_a[r % co:r % co + 1])
            return
        _store_block(d3[r0:r1], o, None if bias_a is None else bias_a[ch])

    spans = [(r, min(r + step, rows)) for r in range(0, rows, step)]
    run_spans(work, spans, PARALLEL_MIN_ELEMS if par else 0)


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
    # float32 phases write straight into the output, halves into an accumulation-dtype copy
    res = out if out.dtype == acc else np.empty((n, cout, ho, wo), acc)
    ba = to_acc(bias[0], acc) if bias else None
    jobs = []
    for ry in range(sh):
        ph = _phase(ry, kh, dh, sh, h, pt, ho)
        for rx in range(sw):
            pw = _phase(rx, kw, dw, sw, wd, pl, wo)
            dst = res[:, :, (ry - pt) % sh::sh, (rx - pl) % sw::sw]
            if ph is None or pw is None:        # no tap lands here: bias only
                dst[...] = 0 if ba is None else ba[:, None, None]
                continue
            sub = np.ascontiguousarray(wc[:, :, ph[1]][:, :, :, pw[1]])
            xs = x[:, :, ph[3][0]:ph[3][1], pw[3][0]:pw[3][1]]
            jobs.append((res[:, :, ph[0]::sh, pw[0]::sw], xs, sub, ph[4] + pw[4], (1, 1),
                         (ph[2], pw[2]), ba))
    _convs_into(jobs, g, acc)
    if res is not out:
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
    if cg == 1 and g > 1:
        u.fill_all(common.NUM_THREADS > 1 and 2.0 * grad.size * kh * kw >= PARALLEL_CONV_FLOPS)
        ga = np.zeros((n, co, ho, u.wq), acc)      # zero past Wo: those columns are dropped
        ga[..., :wo] = grad if grad.dtype == acc else to_acc(grad, acc)
        dw = _depthwise_weight_grad(u, ga, c, kh, kw)
    else:
        taps = kh * kw
        shifted = cg >= SHIFTED_MIN_CHANNELS
        rows, items = u.row_blocks(BLOCK_ELEMS // (2 * co) if shifted else None)
        buf = _per_thread(lambda: np.empty(0 if shifted else c * taps * rows * u.wq, acc))
        gbuf = _per_thread(lambda: np.zeros((co, rows, u.wq), acc))  # zero past Wo
        # per sample (a fixed summation order on any number of threads): [g, Cout/g, Cin/g, T]
        # from im2col blocks, tap-major [T, g, Cout/g, Cin/g] from per-tap GEMMs
        parts = np.zeros((n, taps, g, cog, cg) if shifted else (n, g, cog, cg * taps), acc)

        def work(i):                 # one sample's blocks of output rows, as in the forward
            for _, h0, h1 in (it for it in items if it[0] == i):
                gb = gbuf()[:, :h1 - h0]
                gb[..., :wo] = grad[i, :, h0:h1]
                g3 = gb.reshape(g, cog, -1)
                if shifted:
                    for t in range(taps):
                        parts[i, t] += np.matmul(g3, u.tap_block(i, t, h0, h1, g).transpose(
                            0, 2, 1))
                else:
                    cols = u.block(i, h0, h1, buf()).reshape(g, cg * taps, -1)
                    parts[i] += np.matmul(g3, cols.transpose(0, 2, 1))
        with _pool_gemms(2.0 * grad.size * cg * taps) as par:
            u.fill_all(par)
            _run_items(work, [(i,) for i in range(n)], par)
        dw = parts.sum(0)
        if shifted:
            dw = dw.transpose(1, 2, 3, 0)
    res = np.empty((co, cg, kh, kw), x.dtype)
    store(res, dw.reshape(co, cg, kh, kw))
    return res


def _depthwise_weight_grad(u, ga, c, kh, kw):
    """dW[co, 0, t] = sum over samples and pixels of grad[:, co] * window_t[:, co // mult]."""
    n, co = ga.shape[:2]
    dw = np.empty((co, kh * kw), ga.dtype)
    g4 = ga.reshape(n, c, co // c, -1)
    for t in range(kh * kw):
        win = u.tap_rows(t).reshape(n, c, 1, -1)
        dw[:, t] = np.vecdot(g4, win).sum(0).reshape(co)
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


def _time_major(x) -> bool:
    """x [B, C, L] is a transposed view of time-major data (channels adjacent in memory), as
    Mamba's conv input sliced out of a projection and permuted."""
    return x.ndim == 3 and x.shape[1] > 1 and x.strides[1] == x.itemsize and \
        x.strides[2] >= x.shape[1] * x.itemsize


#: elements of one part of a time-major causal conv: its [L, channels] temporaries stay in L2
TM_PART_ELEMS = 1 << 16


def _tm_spans(b, c, l=1):
    """(b0, b1, c0, c1) parts of a time-major conv: per sample, blocks of channels of about
    TM_PART_ELEMS elements, and at least as many parts as threads (time shifts never cross a
    part)."""
    parts = max(-(-common.NUM_THREADS // b), -(-(c * l) // TM_PART_ELEMS)) if c >= 256 else 1
    parts = min(parts, max(1, c // 64))
    cuts = [c * i // parts for i in range(parts + 1)]
    return [(i, i + 1, cuts[j], cuts[j + 1]) for i in range(b) for j in range(parts)]


def _run_tm(work, b, c, l):
    items = _tm_spans(b, c, l)
    run_spans(lambda i0, i1: [work(*items[i]) for i in range(i0, i1)],
              [(i, i + 1) for i in range(len(items))], b * c * l)


def _causal_z_tm(xa, wa, ba, k, l):
    """Time-major z [L, Cp] of one sample's channel part xa [L, Cp] (w [Cp, W], bias [Cp])."""
    z = np.multiply(xa, wa[:, k - 1])
    for j in range(k - 1):
        s = k - 1 - j
        if s < l:
            z[s:] += xa[:l - s] * wa[:, j]
    if ba is not None:
        z += ba
    return z


def _causal_tm(x, wa, ba, k, use_silu, acc):
    """causal_conv1d on time-major data: each tap one shifted multiply-add over whole rows of
    channels (no transpose in or out); returns [B, C, L] as a view of a time-major array."""
    b, c, l = x.shape
    xt = x.transpose(0, 2, 1)                                   # [B, L, C] view
    out = np.empty((b, l, c), x.dtype)

    def work(b0, b1, c0, c1):
        z = _causal_z_tm(to_acc(xt[b0, :, c0:c1], acc), wa[c0:c1],
                         None if ba is None else ba[c0:c1], k, l)
        if use_silu:
            np.multiply(z, _sigmoid(z), out=z)
        store(out[b0, :, c0:c1], z)

    with np.errstate(over="ignore"):
        _run_tm(work, b, c, l)
    return out.transpose(0, 2, 1)


def _causal_backward_tm(x, g, wa, ba, k, use_silu, acc):
    """causal_conv1d_backward on time-major x and grad: (dx as a view of a time-major array,
    dw [C, W], dbias [C]) in acc."""
    b, c, l = x.shape
    xt, gt = x.transpose(0, 2, 1), g.transpose(0, 2, 1)
    dx = np.empty((b, l, c), x.dtype)
    dw = np.zeros((b, k, c), acc)
    db = np.zeros((b, c), acc)

    def work(b0, b1, c0, c1):
        xa, wr = to_acc(xt[b0, :, c0:c1], acc), wa[c0:c1]
        dz = np.array(gt[b0, :, c0:c1], acc)
        if use_silu:
            z = _causal_z_tm(xa, wr, None if ba is None else ba[c0:c1], k, l)
            s = _sigmoid(z)                       # dz = g * s * (1 + z * (1 - s))
            t = z * s
            np.subtract(z, t, out=z)
            z += 1
            z *= s
            dz *= z
        db[b0, c0:c1] = dz.sum(0)
        for j in range(k):
            s_ = k - 1 - j
            if s_ < l:
                # (a column sum of products: einsum's loop, ~8x vecdot's over strided columns)
                dw[b0, j, c0:c1] = np.einsum("tc,tc->c", dz[s_:], xa[:l - s_])
        d = np.multiply(dz, wr[:, k - 1])
        for j in range(k - 1):
            s_ = k - 1 - j
            if s_ < l:
                d[:l - s_] += dz[s_:] * wr[:, j]
        store(dx[b0, :, c0:c1], d)

    with np.errstate(over="ignore"):
        _run_tm(work, b, c, l)
    return dx.transpose(0, 2, 1), dw.sum(0).T, db.sum(0)


@kernel(FusedOps.CAUSAL_CONV1D, "numpy", cost=causal_conv1d_cost, strided_input=True)
def causal_conv1d(x, w, *bias, use_silu):
    """CAUSAL_CONV1D: x [B, C, L], w [C, W] or [C, 1, W], bias [C] -> [B, C, L];
    z = bias + sum_k w[:, k] * x[t + k - (W-1)] (zeros before t = 0); silu(z) if use_silu.
    Time-major x (a transposed view) is computed time-major and the result returned as such a
    view too (Mamba's layout: no transposes around the conv)."""
    acc = acc_dtype(x.dtype)
    if _time_major(x):
        _, c, _, k, wa, ba = _causal_rows(x, w, bias, acc)
        return _causal_tm(x, wa, ba, k, use_silu, acc)
    x = np.ascontiguousarray(x)
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


@kernel(CAUSAL_CONV1D_BACKWARD, "numpy", cost=causal_conv1d_backward_cost,
        strided_input=True)
def causal_conv1d_backward(x, w, grad, *bias, use_silu):
    """CAUSAL_CONV1D_BACKWARD: (x, w, grad, [bias]) -> (dx [B, C, L], dw shaped like w,
    dbias [C]); silu' is recomputed from x when use_silu. Time-major x and grad are computed
    time-major (dx returned as a transposed view)."""
    acc = acc_dtype(x.dtype)
    if _time_major(x) and _time_major(grad):
        _, c, _, k, wa, ba = _causal_rows(x, w, bias, acc)
        dx, dw, db = _causal_backward_tm(x, grad, wa, ba, k, use_silu, acc)
        dwt = np.empty(w.shape, w.dtype)
        store(dwt, dw.reshape(w.shape))
        dbias = np.empty(c, x.dtype)
        store(dbias, db)
        return dx, dwt, dbias
    x, grad = np.ascontiguousarray(x), np.ascontiguousarray(grad)
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
