"""Convolutions on the GPU.

* conv2d, conv_transpose2d, conv2d_backward_weight: cuDNN through torch (the forward, data-grad
  and weight-grad kernels of `aten.convolution`/`convolution_backward`). Padding per side: the
  unequal part of an asymmetric padding ("same" with an even kernel) is padded or cropped around
  the call. Memory format (CHANNELS_LAST): cuDNN's tensor-core kernels run NHWC; "always"
  converts NCHW operands to channels-last (the output stays channels-last, so a chain of convs
  and elementwise ops converts once), "auto" keeps the input's format, "never" forces NCHW.
  The kernels accept strided (channels-last) inputs.
* causal_conv1d and causal_conv1d_backward: Triton, float32/bfloat16/float16 (float64 runs the
  recipe). Forward: one program per (row, block of positions) loads the W shifted windows of x
  (the shifted loads hit L1) and computes bias + taps (+ silu) in float32. Backward: one program
  per (channel, split of the batch x length range) recomputes z (for silu') at the W positions
  each dx needs, writes dx, and reduces the weight/bias gradients of its range in registers;
  the splits' partial sums (float32) are added by one small torch sum, so the result is
  deterministic.
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
from .common import HALF_AND_F32, next_pow2, num_sms

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
@triton.jit
def _causal_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, C, L, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SILU: tl.constexpr, BLOCK_L: tl.constexpr):
    row = tl.program_id(0)
    c = row % C
    t = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    base = row.to(tl.int64) * L
    acc = tl.zeros([BLOCK_L], tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c).to(tl.float32)
    for k in tl.static_range(W):
        src = t + (k - (W - 1))
        xv = tl.load(x_ptr + base + src, mask=(src >= 0) & (src < L), other=0.0)
        acc += xv.to(tl.float32) * tl.load(w_ptr + c * W + k).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + base + t, acc.to(y_ptr.dtype.element_ty), mask=t < L)


@triton.jit
def _causal_bwd_kernel(x_ptr, w_ptr, b_ptr, g_ptr, dx_ptr, dw_ptr, db_ptr, C, L, n_lblk, total,
                       PER_PROG: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_L: tl.constexpr):
    c = tl.program_id(0)
    split = tl.program_id(1)
    kk = tl.arange(0, WP)
    kmask = kk < W
    wv = tl.load(w_ptr + c * W + kk, mask=kmask, other=0.0).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + c).to(tl.float32)
    acc_w = tl.zeros([WP, BLOCK_L], tl.float32)
    acc_b = tl.zeros([BLOCK_L], tl.float32)
    for i in range(0, PER_PROG):                        # items: (sample, block of positions)
        it = split * PER_PROG + i
        valid = it < total
        bi = it // n_lblk
        u = (it % n_lblk) * BLOCK_L + tl.arange(0, BLOCK_L)
        base = (bi * C + c).to(tl.int64) * L
        dx = tl.zeros([BLOCK_L], tl.float32)
        for j in tl.static_range(W):
            t = u + j                                       # dx[u] needs dz[u + j]
            g = tl.load(g_ptr + base + t, mask=(t < L) & valid, other=0.0).to(tl.float32)
            if SILU or j == 0:
                src = t[None, :] + kk[:, None] - (W - 1)    # x under each tap of position t
                xt = tl.load(x_ptr + base + src,
                             mask=(src >= 0) & (src < L) & kmask[:, None] & valid,
                             other=0.0).to(tl.float32)
            if SILU:
                z = tl.sum(xt * wv[:, None], 0) + bias
                sg = 1.0 / (1.0 + tl.exp(-z))
                dz = g * (sg * (1.0 + z * (1.0 - sg)))
            else:
                dz = g
            dx += dz * tl.load(w_ptr + c * W + (W - 1 - j)).to(tl.float32)
            if j == 0:
                acc_w += xt * dz[None, :]
                acc_b += dz
        tl.store(dx_ptr + base + u, dx.to(dx_ptr.dtype.element_ty), mask=(u < L) & valid)
    tl.store(dw_ptr + (split * C + c) * W + kk, tl.sum(acc_w, 1), mask=kmask)
    tl.store(db_ptr + split * C + c, tl.sum(acc_b, 0))


#: forward launch config: positions per program and warps (None: from the length); the
#: benchmark sweeps them (bench/bench_cuda_conv.py --sweep)
FWD_BLOCK_L = None
FWD_WARPS = None


def _fwd_config(length):
    block = FWD_BLOCK_L or max(16, min(2048, next_pow2(length)))
    return block, FWD_WARPS or max(1, min(8, block // 256))


@kernel(FusedOps.CAUSAL_CONV1D, "cuda", dtypes=HALF_AND_F32, cost=causal_conv1d_cost)
def causal_conv1d(x, w, *bias, use_silu):
    """CAUSAL_CONV1D: x [B, C, L], w [C, W] or [C, 1, W], bias [C] -> [B, C, L]."""
    b, c, length = x.shape
    k = w.shape[-1]
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty_like(x)
    if y.numel() == 0:
        return y
    block, warps = _fwd_config(length)
    _causal_fwd_kernel[(b * c, triton.cdiv(length, block))](
        x, w, bias[0].contiguous() if bias else w, y, c, length, W=k, HAS_BIAS=bool(bias),
        SILU=bool(use_silu), BLOCK_L=block, num_warps=warps)
    return y


#: backward: positions per iteration, programs per SM it aims for, warps (None: from the block)
BWD_BLOCK_L = 1024
BWD_PROGRAMS_PER_SM = 4
BWD_WARPS = None


@kernel(CAUSAL_CONV1D_BACKWARD, "cuda", dtypes=HALF_AND_F32, cost=causal_conv1d_backward_cost)
def causal_conv1d_backward(x, w, grad, *bias, use_silu):
    """CAUSAL_CONV1D_BACKWARD: (x, w, grad, [bias]) -> (dx, dw shaped like w, dbias [C])."""
    b, c, length = x.shape
    k = w.shape[-1]
    x, w, grad = x.contiguous(), w.contiguous(), grad.contiguous()
    if x.numel() == 0:
        return (torch.empty_like(x), torch.zeros_like(w),
                torch.zeros(c, dtype=x.dtype, device=x.device))
    block = max(16, min(BWD_BLOCK_L, next_pow2(length)))
    n_lblk = triton.cdiv(length, block)
    total = b * n_lblk
    splits = max(1, min(total, triton.cdiv(BWD_PROGRAMS_PER_SM * num_sms(x.device), c)))
    per_prog = next_pow2(triton.cdiv(total, splits))    # a power of two: few compiled variants
    splits = triton.cdiv(total, per_prog)
    dx = torch.empty_like(x)
    dw_part = torch.empty((splits, c, k), dtype=torch.float32, device=x.device)
    db_part = torch.empty((splits, c), dtype=torch.float32, device=x.device)
    _causal_bwd_kernel[(c, splits)](
        x, w, bias[0].contiguous() if bias else w, grad, dx, dw_part, db_part, c, length, n_lblk,
        total, PER_PROG=per_prog, W=k, WP=next_pow2(k), HAS_BIAS=bool(bias), SILU=bool(use_silu),
        BLOCK_L=block, num_warps=BWD_WARPS or max(1, min(8, block // 128)))
    dwt = dw_part.sum(0).to(w.dtype).reshape(w.shape)
    return dx, dwt, db_part.sum(0).to(x.dtype)
