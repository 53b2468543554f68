"""SSD_CHUNK_SCAN (Mamba-2) forward and backward on Triton: the chunked state-space-dual
algorithm in one kernel per direction.

Forward: one program per (batch, head, block of P) walks the chunks of Q steps in order with
the [BP, N] state in registers. Per chunk: the within-chunk outputs are two tensor-core
matmuls (C B^T masked by the segment decays exp(Acum_t - Acum_s), then times dt x), the
contribution of the entering state is C h^T scaled by exp(Acum_t), and the state moves on by
exp(Acum_end) h + (x w)^T B. Nothing but inputs and outputs touches memory.

Backward: the forward kernel is rerun to store the state entering each chunk (float32
scratch, and the ungated y when a gate z is present); then one program per (batch, head)
walks the chunks in reverse with the cotangent of the chunk-end state in registers and forms
dx, ddt, db, dc, dz and the partial sums of da, dd, ddt_bias from matmuls of the same shapes
(the forward algorithm transposed). Partials over heads/batch are added by one torch sum.

Inputs may be strided along batch, time and head (e.g. B/C groups broadcast over heads with
stride 0); the last axis must be contiguous. Dots take float32 operands: "tf32" for 16-bit
inputs (inputs are exact in tf32, products carry ~11 bits, well under the output's rounding),
"tf32x3" for float32 inputs. The chunk length Q is the kernel's own choice (ssd_config); the
op's chunk_size does not change the result."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ....registry.core import FusedOps
from ....registry.ssm import SSD_CHUNK_SCAN_BACKWARD
from ...base import Cost, kernel
from .common import HALF_AND_F32
from .ssm import sigmoid_f32, softplus_f32

__all__ = ["ssd_chunk_scan", "ssd_chunk_scan_backward"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: dot precision for float32 inputs and for 16-bit inputs (tunable from the benchmark)
# float32 dots in exact fp32 ("ieee"): on the H200 (Triton 3.6) the "tf32x3" split faulted
# (illegal address) and gave wrong dt gradients in the backward kernel, which "ieee" does not
DOT_PRECISION = {torch.float32: "ieee", torch.bfloat16: "tf32", torch.float16: "tf32"}
if os.environ.get("FUELGRAPH_SSD_DOT_PRECISION"):      # diagnosis: e.g. "ieee" everywhere
    DOT_PRECISION = dict.fromkeys(DOT_PRECISION, os.environ["FUELGRAPH_SSD_DOT_PRECISION"])


def _p2(n, lo=16):
    return max(lo, 1 << (max(int(n), 1) - 1).bit_length())


def ssd_config(B, L, H, P, N, backward=False):
    """(Q, BP, num_warps). Q = 64 keeps the masked Q x Q work small; the forward splits P in
    two when there are few (batch, head) programs."""
    q = 64 if L >= 64 else _p2(L)
    bp = _p2(P)
    if not backward and B * H < 264 and bp >= 64:
        bp //= 2
    return q, bp, 8 if backward or _p2(N) * bp >= 8192 else 4


def _cost(shapes, params=None, q=64):
    (B, L, H, P), N = shapes[0], shapes[3][3]
    flops = 2 * B * L * H * (q * (N + P) + 2 * P * N)
    n = sum(int(torch.Size(s).numel()) for s in shapes) + B * L * H * P
    return Cost(flops, 2 * n)


def _strides3(t):
    return t.stride(0), t.stride(1), t.stride(2)


# ---------------------------------------------------------------------------------- forward
@triton.jit
def _ssd_fwd_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, h0_ptr,
                    y_ptr, hl_ptr, st_ptr,
                    L, H, P, N, NC,
                    sx_b, sx_l, sx_h, sdt_b, sdt_l, sdt_h, sb_b, sb_l, sb_h, sc_b, sc_l, sc_h,
                    sz_b, sz_l, sz_h,
                    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
                    D_PER_P: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SOFTPLUS: tl.constexpr, HAS_INIT: tl.constexpr, STORE_STATES: tl.constexpr,
                    PREC: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_p = tl.program_id(1)
    bi = pid_bh // H
    hi = pid_bh % H
    offs_q = tl.arange(0, Q)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    pmask = offs_p < P
    nmask = offs_n < N
    pn_off = offs_p[:, None] * N + offs_n[None, :]
    pn_mask = pmask[:, None] & nmask[None, :]
    a_h = tl.load(a_ptr + hi).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + hi).to(tl.float32)
    if HAS_D:
        if D_PER_P:
            dsk = tl.load(d_ptr + hi * P + offs_p, mask=pmask, other=0.0).to(tl.float32)[None, :]
        else:
            dsk = tl.load(d_ptr + hi).to(tl.float32)
    if HAS_INIT:
        state = tl.load(h0_ptr + pid_bh * P * N + pn_off, mask=pn_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BP, BN), tl.float32)
    causal = offs_q[:, None] >= offs_q[None, :]
    for ci in range(0, NC):
        t = ci * Q + offs_q
        tmask = t < L
        dtr = tl.load(dt_ptr + bi * sdt_b + t * sdt_l + hi * sdt_h, mask=tmask,
                      other=0.0).to(tl.float32)
        if HAS_BIAS:
            dtr += bias
        if SOFTPLUS:
            dtr = softplus_f32(dtr)
        dtp = tl.where(tmask, dtr, 0.0)
        s = dtp * a_h
        acum = tl.cumsum(s, 0)
        total = tl.sum(s, 0)
        qp_mask = tmask[:, None] & pmask[None, :]
        qn_mask = tmask[:, None] & nmask[None, :]
        X = tl.load(x_ptr + bi * sx_b + t[:, None] * sx_l + hi * sx_h + offs_p[None, :],
                    mask=qp_mask, other=0.0).to(tl.float32)
        Bm = tl.load(b_ptr + bi * sb_b + t[:, None] * sb_l + hi * sb_h + offs_n[None, :],
                     mask=qn_mask, other=0.0).to(tl.float32)
        Cm = tl.load(c_ptr + bi * sc_b + t[:, None] * sc_l + hi * sc_h + offs_n[None, :],
                     mask=qn_mask, other=0.0).to(tl.float32)
        if STORE_STATES:
            tl.store(st_ptr + (pid_bh * NC + ci) * P * N + pn_off, state, mask=pn_mask)
        yv = tl.dot(Cm, tl.trans(state), input_precision=PREC) * tl.exp(acum)[:, None]
        CB = tl.dot(Cm, tl.trans(Bm), input_precision=PREC)
        seg = tl.where(causal, acum[:, None] - acum[None, :], float("-inf"))
        M = tl.exp(seg) * CB * dtp[None, :]
        yv += tl.dot(M, X, input_precision=PREC)
        w = tl.exp(total - acum) * dtp
        state = state * tl.exp(total) + tl.dot(tl.trans(X * w[:, None]), Bm,
                                                input_precision=PREC)
        if HAS_D:
            yv += X * dsk
        y_off = ((bi * L + t[:, None]) * H + hi) * P + offs_p[None, :]
        if HAS_Z:
            zz = tl.load(z_ptr + bi * sz_b + t[:, None] * sz_l + hi * sz_h + offs_p[None, :],
                         mask=qp_mask, other=0.0).to(tl.float32)
            yv *= zz * sigmoid_f32(zz)
        tl.store(y_ptr + y_off, yv.to(y_ptr.dtype.element_ty), mask=qp_mask)
    tl.store(hl_ptr + pid_bh * P * N + pn_off, state.to(hl_ptr.dtype.element_ty), mask=pn_mask)


def _ssd_opts(x, opt, has_d, has_z, has_dt_bias, has_init):
    it = iter(opt)
    return tuple(next(it) if f else x for f in (has_d, has_z, has_dt_bias, has_init))


def _last_contig(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_fwd(x, dt, a, b, c, d, z, bias, h0, y, hl, st, flags, cfg, prec):
    B, L, H, P = x.shape
    N = b.shape[3]
    Q, BP, warps = cfg
    NC = triton.cdiv(L, Q)
    has_d, has_z, has_bias, softplus, has_init, store = flags
    _ssd_fwd_kernel[(B * H, triton.cdiv(P, BP))](
        x, dt, a, b, c, d, z, bias, h0, y, hl, st, L, H, P, N, NC,
        *_strides3(x), *_strides3(dt), *_strides3(b), *_strides3(c), *_strides3(z),
        Q=Q, BP=BP, BN=_p2(N), HAS_D=has_d, D_PER_P=has_d and d.dim() == 2, HAS_Z=has_z,
        HAS_BIAS=has_bias, SOFTPLUS=softplus, HAS_INIT=has_init, STORE_STATES=store,
        PREC=prec, num_warps=warps)


@kernel(FusedOps.SSD_CHUNK_SCAN, "cuda", dtypes=HALF_AND_F32, cost=_cost, strided_input=True,
        precision="fp32 state; tf32 (16-bit) / tf32x3 (fp32) dots")
def ssd_chunk_scan(x, dt, a, b, c, *opt, chunk_size, dt_softplus, has_d, has_z, has_dt_bias,
                   has_initial_states, config=None):
    """SSD_CHUNK_SCAN: x [B, L, H, P], dt [B, L, H], a [H], b, c [B, L, H, N] (N >= 1; CUDA tensors,
    float32 / bfloat16 / float16, strided along batch, time and head allowed), then d [H] or
    [H, P], z [B, L, H, P], dt_bias [H], initial_states [B, H, P, N] as flagged ->
    (y [B, L, H, P], last_state [B, H, P, N]) in x's dtype."""
    x, b, c, a = _last_contig(x), _last_contig(b), _last_contig(c), a.contiguous()
    d, z, bias, h0 = _ssd_opts(x, opt, has_d, has_z, has_dt_bias, has_initial_states)
    z = _last_contig(z)
    d, h0, bias = d.contiguous(), h0.contiguous(), bias.contiguous()
    B, L, H, P = x.shape
    N = b.shape[3]
    y = torch.empty((B, L, H, P), dtype=x.dtype, device=x.device)
    hl = torch.empty((B, H, P, N), dtype=x.dtype, device=x.device)
    if B * H * P == 0:
        return y, hl
    if L == 0:                               # no steps: the state is the initial one
        return y, (hl.copy_(h0) if has_initial_states else hl.zero_())
    cfg = config or ssd_config(B, L, H, P, N)
    _launch_fwd(x, dt, a, b, c, d, z, bias, h0, y, hl, x,
                (has_d, has_z, has_dt_bias, bool(dt_softplus), has_initial_states, False),
                cfg, DOT_PRECISION[x.dtype])
    return y, hl


# ---------------------------------------------------------------------------------- backward
@triton.jit
def _ssd_bwd_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, gy_ptr, gl_ptr,
                    st_ptr, ys_ptr,
                    dx_ptr, ddt_ptr, db_ptr, dc_ptr, dz_ptr, da_ptr, dd_ptr, dbias_ptr, dh0_ptr,
                    L, H, P, N, NC,
                    sx_b, sx_l, sx_h, sdt_b, sdt_l, sdt_h, sb_b, sb_l, sb_h, sc_b, sc_l, sc_h,
                    sz_b, sz_l, sz_h, sg_b, sg_l, sg_h,
                    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
                    D_PER_P: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SOFTPLUS: tl.constexpr, PREC: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)
    bi = pid_bh // H
    hi = pid_bh % H
    offs_q = tl.arange(0, Q)
    offs_p = tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    pmask = offs_p < P
    nmask = offs_n < N
    pn_off = offs_p[:, None] * N + offs_n[None, :]
    pn_mask = pmask[:, None] & nmask[None, :]
    a_h = tl.load(a_ptr + hi).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + hi).to(tl.float32)
    if HAS_D:
        if D_PER_P:
            dsk = tl.load(d_ptr + hi * P + offs_p, mask=pmask, other=0.0).to(tl.float32)[None, :]
        else:
            dsk = tl.load(d_ptr + hi).to(tl.float32)
    causal = offs_q[:, None] >= offs_q[None, :]
    # cotangent of the state at the end of the current chunk
    Dst = tl.load(gl_ptr + pid_bh * P * N + pn_off, mask=pn_mask, other=0.0).to(tl.float32)
    da_acc = tl.sum(tl.zeros((Q,), tl.float32), 0)
    dbias_acc = tl.sum(tl.zeros((Q,), tl.float32), 0)
    dd_acc = tl.zeros((BP,), tl.float32)
    for k in range(0, NC):
        ci = NC - 1 - k
        t = ci * Q + offs_q
        tmask = t < L
        pre = tl.load(dt_ptr + bi * sdt_b + t * sdt_l + hi * sdt_h, mask=tmask,
                      other=0.0).to(tl.float32)
        if HAS_BIAS:
            pre += bias
        if SOFTPLUS:
            dtp = softplus_f32(pre)
        else:
            dtp = pre
        dtp = tl.where(tmask, dtp, 0.0)
        s = dtp * a_h
        acum = tl.cumsum(s, 0)
        total = tl.sum(s, 0)
        qp_mask = tmask[:, None] & pmask[None, :]
        qn_mask = tmask[:, None] & nmask[None, :]
        X = tl.load(x_ptr + bi * sx_b + t[:, None] * sx_l + hi * sx_h + offs_p[None, :],
                    mask=qp_mask, other=0.0).to(tl.float32)
        Bm = tl.load(b_ptr + bi * sb_b + t[:, None] * sb_l + hi * sb_h + offs_n[None, :],
                     mask=qn_mask, other=0.0).to(tl.float32)
        Cm = tl.load(c_ptr + bi * sc_b + t[:, None] * sc_l + hi * sc_h + offs_n[None, :],
                     mask=qn_mask, other=0.0).to(tl.float32)
        GY = tl.load(gy_ptr + bi * sg_b + t[:, None] * sg_l + hi * sg_h + offs_p[None, :],
                     mask=qp_mask, other=0.0).to(tl.float32)
        y_off = ((bi * L + t[:, None]) * H + hi) * P + offs_p[None, :]
        if HAS_Z:
            zz = tl.load(z_ptr + bi * sz_b + t[:, None] * sz_l + hi * sz_h + offs_p[None, :],
                         mask=qp_mask, other=0.0).to(tl.float32)
            sz = sigmoid_f32(zz)
            yp = tl.load(ys_ptr + y_off, mask=qp_mask, other=0.0)
            if HAS_D:
                yp += X * dsk
            dz = GY * yp * sz * (1.0 + zz * (1.0 - sz))
            tl.store(dz_ptr + y_off, dz.to(dz_ptr.dtype.element_ty), mask=qp_mask)
            GY = GY * zz * sz
        Hin = tl.load(st_ptr + (pid_bh * NC + ci) * P * N + pn_off, mask=pn_mask, other=0.0)
        eA = tl.exp(acum)
        wend = tl.exp(total - acum)
        dec = tl.exp(total)
        CB = tl.dot(Cm, tl.trans(Bm), input_precision=PREC)
        Lm = tl.exp(tl.where(causal, acum[:, None] - acum[None, :], float("-inf")))
        QB = tl.dot(Bm, tl.trans(Dst), input_precision=PREC)                    # [Q, BP]
        gB = tl.dot(tl.trans(CB * Lm), GY, input_precision=PREC) + wend[:, None] * QB
        dX = dtp[:, None] * gB
        if HAS_D:
            dd_acc += tl.sum(GY * X, 0)
            dX += GY * dsk
        ddt = tl.sum(X * gB, 1)
        W = tl.dot(GY, tl.trans(X), input_precision=PREC) * Lm                  # [Q, Q]
        dBv = tl.dot(tl.trans(W), Cm, input_precision=PREC) + \
            wend[:, None] * tl.dot(X, Dst, input_precision=PREC)
        dBv = dBv * dtp[:, None]
        V = W * dtp[None, :]
        yoffH = tl.dot(GY, Hin, input_precision=PREC)                            # [Q, BN]
        dCv = tl.dot(V, Bm, input_precision=PREC) + eA[:, None] * yoffH
        Zm = V * CB
        r = wend * dtp * tl.sum(X * QB, 1)
        dAc = tl.sum(Zm, 1) - tl.sum(Zm, 0) + eA * tl.sum(yoffH * Cm, 1) - r
        dAc += tl.where(offs_q == Q - 1, tl.sum(r, 0) + dec * tl.sum(tl.sum(Dst * Hin, 1), 0),
                        0.0)
        ds = tl.sum(dAc, 0) - tl.cumsum(dAc, 0) + dAc                           # suffix sums
        ddt += ds * a_h
        da_acc += tl.sum(ds * dtp, 0)
        if SOFTPLUS:
            ddt = ddt * sigmoid_f32(pre)
        ddt = tl.where(tmask, ddt, 0.0)
        dbias_acc += tl.sum(ddt, 0)
        tl.store(dx_ptr + y_off, dX.to(dx_ptr.dtype.element_ty), mask=qp_mask)
        tl.store(ddt_ptr + (bi * L + t) * H + hi, ddt.to(ddt_ptr.dtype.element_ty), mask=tmask)
        n_off = ((bi * L + t[:, None]) * H + hi) * N + offs_n[None, :]
        tl.store(db_ptr + n_off, dBv.to(db_ptr.dtype.element_ty), mask=qn_mask)
        tl.store(dc_ptr + n_off, dCv.to(dc_ptr.dtype.element_ty), mask=qn_mask)
        Dst = dec * Dst + tl.dot(tl.trans(GY * eA[:, None]), Cm, input_precision=PREC)
    tl.store(dh0_ptr + pid_bh * P * N + pn_off, Dst, mask=pn_mask)
    tl.store(da_ptr + pid_bh, da_acc)
    tl.store(dbias_ptr + pid_bh, dbias_acc)
    if HAS_D:
        tl.store(dd_ptr + pid_bh * P + offs_p, dd_acc, mask=pmask)


@kernel(SSD_CHUNK_SCAN_BACKWARD, "cuda", dtypes=HALF_AND_F32, strided_input=True,
        cost=lambda s, p=None: _cost(s[:5], p),
        precision="fp32 state; tf32 (16-bit) / tf32x3 (fp32) dots")
def ssd_chunk_scan_backward(x, dt, a, b, c, *rest, chunk_size, dt_softplus, has_d, has_z,
                            has_dt_bias, has_initial_states, config=None):
    """Backward of SSD_CHUNK_SCAN: the forward inputs, then grad_y [B, L, H, P] and
    grad_last_state [B, H, P, N] -> one gradient per forward input (its shape and dtype)."""
    gy, gl = _last_contig(rest[-2]), rest[-1].contiguous()
    x, b, c, a = _last_contig(x), _last_contig(b), _last_contig(c), a.contiguous()
    d, z, bias, h0 = _ssd_opts(x, rest[:-2], has_d, has_z, has_dt_bias, has_initial_states)
    z = _last_contig(z)
    d, h0, bias = d.contiguous(), h0.contiguous(), bias.contiguous()
    B, L, H, P = x.shape
    N = b.shape[3]
    BH = B * H
    dev, dtype = x.device, x.dtype
    f32 = dict(dtype=torch.float32, device=dev)
    Q, BP, warps = config or ssd_config(B, L, H, P, N, backward=True)
    BP = _p2(P)
    NC = triton.cdiv(L, Q)
    prec = DOT_PRECISION[dtype]
    dx = torch.empty((B, L, H, P), dtype=dtype, device=dev)
    ddt = torch.empty((B, L, H), dtype=dtype, device=dev)
    db = torch.empty((B, L, H, N), dtype=dtype, device=dev)
    dc = torch.empty((B, L, H, N), dtype=dtype, device=dev)
    dz = torch.empty((B, L, H, P), dtype=dtype, device=dev) if has_z else x
    da_p, dbias_p = torch.zeros(BH, **f32), torch.zeros(BH, **f32)
    dd_p = torch.zeros((BH, P), **f32)
    dh0 = gl.to(torch.float32).clone()
    if BH * P and L:
        st = torch.empty((BH, NC, P, N), **f32)
        ys = torch.empty((B, L, H, P), **f32)
        hl = torch.empty((B, H, P, N), **f32)
        _launch_fwd(x, dt, a, b, c, d, z, bias, h0, ys, hl, st,
                    (False, False, has_dt_bias, bool(dt_softplus), has_initial_states, True),
                    (Q, _p2(P), warps), prec)
        _ssd_bwd_kernel[(BH,)](
            x, dt, a, b, c, d, z, bias, gy, gl, st, ys, dx, ddt, db, dc, dz, da_p, dd_p,
            dbias_p, dh0, L, H, P, N, NC,
            *_strides3(x), *_strides3(dt), *_strides3(b), *_strides3(c), *_strides3(z),
            *_strides3(gy),
            Q=Q, BP=BP, BN=_p2(N), HAS_D=has_d, D_PER_P=has_d and d.dim() == 2, HAS_Z=has_z,
            HAS_BIAS=has_dt_bias, SOFTPLUS=bool(dt_softplus), PREC=prec, num_warps=warps)
    else:                                    # no steps: only dh0 = grad_last_state is nonzero
        for t in (dx, ddt, db, dc, dz):
            t.zero_()
    grads = [dx, ddt, da_p.reshape(B, H).sum(0).to(dtype), db, dc]
    if has_d:
        ddp = dd_p.reshape(B, H, P).sum(0)
        grads.append((ddp if d.dim() == 2 else ddp.sum(1)).to(dtype))
    if has_z:
        grads.append(dz)
    if has_dt_bias:
        grads.append(dbias_p.reshape(B, H).sum(0).to(dtype))
    if has_initial_states:
        grads.append(dh0.reshape(B, H, P, N).to(dtype))
    return tuple(grads)
