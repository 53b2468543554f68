"""Convolutions on the GPU.

* conv2d, conv_transpose2d, conv2d_backward_weight: cuDNN through torch (the forward, data-grad
  and weight-grad kernels of `aten.convolution`/`convolution_backward`). Padding per side: the
  unequal part of an asymmetric padding ("same" with an even kernel) is padded or cropped around
  the call. Memory format (CHANNELS_LAST): cuDNN's tensor-core kernels run NHWC; "always"
  converts NCHW operands to channels-last (the output stays channels-last, so a chain of convs
  and elementwise ops converts once), "auto" keeps the input's format, "never" forces NCHW.
  The kernels accept strided (channels-last) inputs.
* causal_conv1d and causal_conv1d_backward: Triton, float32/bfloat16/float16 (float64 runs the
  recipe). One program per (row, block of R*8 positions); every thread holds chunks of 8
  positions loaded as aligned vectors, takes the W-1 halo from the neighbouring chunks (aligned
  vector loads too) and splits them into columns in registers, so each x and g element is
  loaded with wide loads and every shifted operand is a register. Forward: bias + taps (+ silu)
  in float32. Backward, ONE kernel: dz = g * silu'(z) once per position (z recomputed from x),
  dx from the W shifted dz, and the program's partial sums of dweight and dbias (float32),
  added by one small torch sum over the programs (deterministic).
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as TF
import triton
import triton.language as tl

from ....registry.conv import CAUSAL_CONV1D_BACKWARD, CONV2D_BACKWARD_WEIGHT
from ....registry.core import FusedOps
from ...base import kernel
from ...numpy.conv import (causal_conv1d_backward_cost, causal_conv1d_cost,
                           conv2d_backward_weight_cost, conv2d_cost, conv_transpose2d_cost)
from .common import HALF_AND_F32, next_pow2

#: "always" | "auto" | "never" (see the module docstring). "auto" by measurement: on an H200
#: (2026-12-01, bf16 N32 C256 56x56 3x3) NCHW inputs took 0.336 ms with "auto" / "never" and
#: 0.387 ms with "always" (the per-call layout conversion costs more than it saves)
CHANNELS_LAST = os.environ.get("FUELGRAPH_CONV_CHANNELS_LAST", "auto")


def _is_cl(t):
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and \
        not t.is_contiguous()


def _layout(*ts):
    """Operands in the memory format cuDNN should see (see CHANNELS_LAST)."""
    mode = CHANNELS_LAST
    if mode == "never":
        return [t.contiguous() for t in ts]
    if mode == "always" or (mode == "auto" and _is_cl(ts[0])):
        return [t.contiguous(memory_format=torch.channels_last) for t in ts]
    return list(ts)


@contextlib.contextmanager
def _exact(dtype):
    """float32 convolutions in float32: cuDNN would otherwise use TF32 (torch's default for
    convs), which rounds the inputs to 10-bit mantissas."""
    cudnn = torch.backends.cudnn
    if dtype != torch.float32 or not cudnn.allow_tf32:
        yield
        return
    cudnn.allow_tf32 = False
    try:
        yield
    finally:
        cudnn.allow_tf32 = True


def _split_pad(lo, hi):
    """(symmetric part, extra before, extra after) of a per-side padding."""
    m = min(lo, hi)
    return m, lo - m, hi - m


@kernel(FusedOps.CONV2D, "cuda", cost=conv2d_cost, strided_input=True, name="cudnn.conv2d",
        precision="cuDNN, fp32 accumulate, no TF32")
def conv2d(x, w, *bias, stride, padding, dilation, groups):
    """CONV2D through cuDNN: x [N, Cin, H, W], w [Cout, Cin/g, Kh, Kw], bias [Cout]."""
    pt, pb, pl, pr = padding
    (mh, eth, ebh), (mw, elw, erw) = _split_pad(pt, pb), _split_pad(pl, pr)
    x, w = _layout(x, w)
    if eth or ebh or elw or erw:
        x = TF.pad(x, (elw, erw, eth, ebh))
    with _exact(x.dtype):
        return TF.conv2d(x, w, bias[0] if bias else None, stride, (mh, mw), dilation, groups)


@kernel(FusedOps.CONV_TRANSPOSE2D, "cuda", cost=conv_transpose2d_cost, strided_input=True,
        name="cudnn.conv_transpose2d", precision="cuDNN, fp32 accumulate, no TF32")
def conv_transpose2d(x, w, *bias, stride, padding, output_padding, dilation, groups):
    """CONV_TRANSPOSE2D through cuDNN: x [N, Cin, H, W], w [Cin, Cout/g, Kh, Kw]."""
    pt, pb, pl, pr = padding
    x, w = _layout(x, w)
    b = bias[0] if bias else None
    with _exact(x.dtype):
        if pt == pb and pl == pr:
            return TF.conv_transpose2d(x, w, b, stride, (pt, pl), output_padding, groups,
                                       dilation)
        # asymmetric: the uncropped output (plus the rows output_padding adds past it), cropped
        oph, opw = max(0, output_padding[0] - pb), max(0, output_padding[1] - pr)
        y = TF.conv_transpose2d(x, w, b, stride, 0, (oph, opw), groups, dilation)
    ho = y.shape[2] - oph - pt - pb + output_padding[0]
    wo = y.shape[3] - opw - pl - pr + output_padding[1]
    return y[:, :, pt:pt + ho, pl:pl + wo]


@kernel(CONV2D_BACKWARD_WEIGHT, "cuda", cost=conv2d_backward_weight_cost, strided_input=True,
        name="cudnn.conv2d_backward_weight", precision="cuDNN, fp32 accumulate, no TF32")
def conv2d_backward_weight(x, grad, *, stride, padding, dilation, groups, kernel_size):
    """CONV2D_BACKWARD_WEIGHT through cuDNN's weight-gradient kernel: x [N, Cin, H, W],
    grad [N, Cout, Ho, Wo] -> [Cout, Cin/g, Kh, Kw]."""
    (sh, sw), (pt, pb, pl, pr), (dh, dw) = stride, padding, dilation
    kh, kw = kernel_size
    ho, wo = grad.shape[2:]
    # the padded rows/columns the conv reads (a transposed conv's grad may stop short)
    need_h, need_w = (ho - 1) * sh + dh * (kh - 1) + 1, (wo - 1) * sw + dw * (kw - 1) + 1
    hp, wp = x.shape[2] + pt + pb, x.shape[3] + pl + pr
    sym = (pt, pl)
    if pt != pb or pl != pr or need_h != hp or need_w != wp:
        x = TF.pad(x, (pl, pr - (wp - need_w), pt, pb - (hp - need_h)))
        sym = (0, 0)
    x, grad = _layout(x, grad)
    wshape = (grad.shape[1], x.shape[1] // groups, kh, kw)
    weight = torch.empty(wshape, dtype=x.dtype, device=x.device)
    with _exact(x.dtype):
        _, dwt, _ = torch.ops.aten.convolution_backward(
            grad, x, weight, None, list(stride), list(sym), list(dilation), False, [0, 0],
            groups, [False, True, False])
    return dwt


# ---- causal depthwise conv1d (Triton) -----------------------------------------------------------
# Layout: a program owns one (sample, channel) row and R*8 consecutive positions; each thread
# owns chunks of 8 consecutive positions, loaded as aligned 16-byte vectors (bf16/fp16). The
# W-1 halo comes from the neighbouring chunks, loaded as aligned vectors too (they are L1/L2
# hits: the neighbouring thread loads the same lines), and the chunk is split into its 8
# columns IN REGISTERS (reshape + split; no shared memory, no shuffles): the shifted operands
# x[t - s] are then plain register picks, where shifted pointer loads would be unaligned
# 2-byte loads, W of them per element.
@triton.jit
def _columns(t):
    """[R, 8] -> its 8 columns, each [R], in order (register moves only)."""
    R: tl.constexpr = t.shape[0]
    e, o = tl.split(tl.reshape(t, [R, 4, 2]))
    ee, eo = tl.split(tl.reshape(e, [R, 2, 2]))
    oe, oo = tl.split(tl.reshape(o, [R, 2, 2]))
    c0, c4 = tl.split(ee)
    c2, c6 = tl.split(eo)
    c1, c5 = tl.split(oe)
    c3, c7 = tl.split(oo)
    return (c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit
def _tile(c):
    """8 columns (a tuple of [R]) -> the [R, 8] tile (the inverse of _columns)."""
    R: tl.constexpr = c[0].shape[0]
    e = tl.reshape(tl.join(tl.join(c[0], c[4]), tl.join(c[2], c[6])), [R, 4])
    o = tl.reshape(tl.join(tl.join(c[1], c[5]), tl.join(c[3], c[7])), [R, 4])
    return tl.reshape(tl.join(e, o), [R, 8])


@triton.jit
def _chunk_columns(ptr, base, pos, shift, L):
    """Columns of the chunks `shift` positions away (a multiple of 8), zeros outside [0, L)."""
    p = pos + shift
    return _columns(tl.load(ptr + base + p, mask=(p >= 0) & (p < L), other=0.0).to(tl.float32))


@triton.jit
def _causal_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, C, L, W: tl.constexpr, HALO: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SILU: tl.constexpr, R: tl.constexpr):
    row = tl.program_id(0)
    c = row % C
    base = row.to(tl.int64) * L
    pos = tl.program_id(1) * (R * 8) + tl.arange(0, R)[:, None] * 8 + tl.arange(0, 8)[None, :]
    xs = _chunk_columns(x_ptr, base, pos, 0, L)           # xs[8*HALO + m]: x at chunk pos + m
    for h in tl.static_range(1, HALO + 1):
        xs = _chunk_columns(x_ptr, base, pos, -8 * h, L) + xs
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + c).to(tl.float32)
    ys = ()
    for v in tl.static_range(8):
        z = tl.zeros([R], tl.float32) + bias
        for k in tl.static_range(W):
            z += xs[8 * HALO + v - (W - 1) + k] * tl.load(w_ptr + c * W + k).to(tl.float32)
        if SILU:
            z = z / (1.0 + tl.exp(-z))
        ys = ys + (z,)
    tl.store(y_ptr + base + pos, _tile(ys).to(y_ptr.dtype.element_ty), mask=pos < L)


@triton.jit
def _causal_bwd_kernel(x_ptr, w_ptr, b_ptr, g_ptr, dx_ptr, part_ptr, C, L, n_lblk,
                       W: tl.constexpr, HALO: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SILU: tl.constexpr, R: tl.constexpr):
    """dx, and this program's partial sums of dbias and dweight (float32, part[program, c, :],
    summed by the caller in a fixed order). dz = g * silu'(z) is computed once per position of the chunk and
    of the W-1 positions after it (z recomputed from x, never stored)."""
    row = tl.program_id(0)
    lblk = tl.program_id(1)
    c = row % C
    base = row.to(tl.int64) * L
    pos = lblk * (R * 8) + tl.arange(0, R)[:, None] * 8 + tl.arange(0, 8)[None, :]
    xs = _chunk_columns(x_ptr, base, pos, 0, L)
    gs = _chunk_columns(g_ptr, base, pos, 0, L)           # gs[m]: g at chunk pos + m
    for h in tl.static_range(1, HALO + 1):
        xs = _chunk_columns(x_ptr, base, pos, -8 * h, L) + xs + \
            _chunk_columns(x_ptr, base, pos, 8 * h, L)
        gs = gs + _chunk_columns(g_ptr, base, pos, 8 * h, L)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + c).to(tl.float32)
    dzs = ()
    for t in tl.static_range(8 + W - 1):
        if SILU:
            z = tl.zeros([R], tl.float32) + bias
            for k in tl.static_range(W):
                z += xs[8 * HALO + t - (W - 1) + k] * tl.load(w_ptr + c * W + k).to(tl.float32)
            sg = 1.0 / (1.0 + tl.exp(-z))
            dzs = dzs + (gs[t] * (sg * (1.0 + z * (1.0 - sg))),)
        else:
            dzs = dzs + (gs[t],)
    dxs = ()
    for v in tl.static_range(8):                          # dx[u] = sum_j w[W-1-j] dz[u+j]
        d = tl.zeros([R], tl.float32)
        for j in tl.static_range(W):
            d += dzs[v + j] * tl.load(w_ptr + c * W + (W - 1 - j)).to(tl.float32)
        dxs = dxs + (d,)
    tl.store(dx_ptr + base + pos, _tile(dxs).to(dx_ptr.dtype.element_ty), mask=pos < L)
    # this program's partial sums: dbias, then dw[k] = sum_t dz[t] x[t - (W-1) + k]
    out = part_ptr + (((row // C) * n_lblk + lblk) * C + c) * (W + 1)
    db = dzs[0]
    for v in tl.static_range(1, 8):
        db += dzs[v]
    sums = (db,)
    for k in tl.static_range(W):
        acc = dzs[0] * xs[8 * HALO - (W - 1) + k]
        for v in tl.static_range(1, 8):
            acc += dzs[v] * xs[8 * HALO + v - (W - 1) + k]
        sums = sums + (acc,)
    if W + 1 <= 8:                  # one reduction of an [R, 8] tile: fewer barriers than W+1
        for _ in tl.static_range(W + 1, 8):
            sums = sums + (tl.zeros([R], tl.float32),)
        i = tl.arange(0, 8)
        tl.store(out + i, tl.sum(_tile(sums), 0), mask=i < W + 1)
    else:
        for k in tl.static_range(W + 1):
            tl.store(out + k, tl.sum(sums[k], 0))


#: launch configs: chunks of 8 positions per program (R, a power of two) and warps; None picks
#: from the length (forward: 2 chunks per thread, for more bytes in flight; backward: 1, it
#: holds ~80 registers per chunk). The benchmark sweeps them (bench_cuda_conv.py --sweep).
FWD_ROWS = None
FWD_WARPS = None
BWD_ROWS = None
BWD_WARPS = None


def _config(length, rows, warps, default_rows, chunks_per_thread):
    r = rows or max(1, min(default_rows, next_pow2(triton.cdiv(length, 8))))
    return r, warps or max(1, min(8, r // (32 * chunks_per_thread)))


def _halo(k):
    return triton.cdiv(k - 1, 8)


@kernel(FusedOps.CAUSAL_CONV1D, "cuda", dtypes=HALF_AND_F32, cost=causal_conv1d_cost)
def causal_conv1d(x, w, *bias, use_silu):
    """CAUSAL_CONV1D: x [B, C, L], w [C, W] or [C, 1, W], bias [C] -> [B, C, L]."""
    b, c, length = x.shape
    k = w.shape[-1]
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty_like(x)
    if y.numel() == 0:
        return y
    rows, warps = _config(length, FWD_ROWS, FWD_WARPS, 512, 2)
    _causal_fwd_kernel[(b * c, triton.cdiv(length, 8 * rows))](
        x, w, bias[0].contiguous() if bias else w, y, c, length, W=k, HALO=_halo(k),
        HAS_BIAS=bool(bias), SILU=bool(use_silu), R=rows, num_warps=warps)
    return y


@kernel(CAUSAL_CONV1D_BACKWARD, "cuda", dtypes=HALF_AND_F32, cost=causal_conv1d_backward_cost)
def causal_conv1d_backward(x, w, grad, *bias, use_silu):
    """CAUSAL_CONV1D_BACKWARD: (x, w, grad, [bias]) -> (dx, dw shaped like w, dbias [C]), in
    one kernel (dx and per-program dweight/dbias partials) plus one small sum of the partials."""
    b, c, length = x.shape
    k = w.shape[-1]
    x, w, grad = x.contiguous(), w.contiguous(), grad.contiguous()
    if x.numel() == 0:
        return (torch.empty_like(x), torch.zeros_like(w),
                torch.zeros(c, dtype=x.dtype, device=x.device))
    rows, warps = _config(length, BWD_ROWS, BWD_WARPS, 256, 1)
    n_lblk = triton.cdiv(length, 8 * rows)
    dx = torch.empty_like(x)
    part = torch.empty((b * n_lblk, c, k + 1), dtype=torch.float32, device=x.device)
    _causal_bwd_kernel[(b * c, n_lblk)](
        x, w, bias[0].contiguous() if bias else w, grad, dx, part, c, length, n_lblk,
        W=k, HALO=_halo(k), HAS_BIAS=bool(bias), SILU=bool(use_silu), R=rows, num_warps=warps)
    sums = part.sum(0)                   # [C, 1 + W]: dbias, dweight
    return dx, sums[:, 1:].to(w.dtype).reshape(w.shape), sums[:, 0].to(x.dtype)
