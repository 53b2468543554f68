"""SSD_CHUNK_SCAN (Mamba-2) forward and backward on Triton: the chunked state-space-dual
algorithm, split so the forward is parallel over chunks.

Forward, three kernels (Q = the kernels' chunk length, their own choice: the op's chunk_size
does not change the result):
  1. dt:    per (batch, chunk, head block): dt' = softplus(dt + bias) and its within-chunk
            cumulative sum of dt' a, stored as float32 [B, H, L] rows.
  2. state: per (batch, head, P block, N block): walks the chunks in order with the [BP, BN]
            state in registers, stores the state entering every chunk and moves it on by
            exp(Acum_end) h + (x w)^T B (tensor-core matmuls over blocks of BK steps).
  3. scan:  per (batch, head, chunk, block of rows, P block), fully parallel: the entering
            state's contribution exp(Acum_t) C h^T plus the within-chunk part
            sum_{s<=t} exp(Acum_t - Acum_s) (C_t . B_s) dt_s x_s (C B^T and its product with x
            on tensor cores, column blocks up to the diagonal only), then d and the silu(z) gate.
            When b and c are one group broadcast over the heads, C B^T of every chunk is formed
            once by its own kernel ([B, NC, Q, Q] in x's dtype) and read by every head's program.
Dots take the input dtype (bfloat16 / float16 operands, float32 accumulation; the decay
weights are rounded to that dtype before the second matmul, as mamba_ssm does); float32 inputs
use exact float32 dots ("ieee": Triton's "tf32x3" split faulted on the H200).

Backward: by default the split kernels of ssm_ssd_bwd (chunks of 128, dx / dB / dC over
blocks of rows and of P / N; H200, target shape: fwd+bwd 2.945 ms, backward alone 2.339
against 3.763 for the fused one). The fused one (config split=0 or FUELGRAPH_SSD_BWD=fused),
also parallel over chunks (at its own, shorter chunk length):
kernel 1; kernel 2 storing the entering states; kernel 2 in reverse (the state cotangent
g_c = exp(Acum_end) g_{c+1} + (exp(Acum) gy)^T c, walked from the last chunk, storing the
cotangent at every chunk's end and the initial state's); kernel 3 for the ungated y when a
gate z is present; then one program per (batch, head, chunk) forms dx, ddt, db, dc, dz and
the partial sums of da, dd, ddt_bias from matmuls of the same shapes (the forward algorithm
transposed). Partials are added by one torch sum (deterministic, no atomics).

Inputs may be strided along batch, time and head (e.g. B/C groups broadcast over heads with
stride 0); the last axis must be contiguous."""
from __future__ import annotations

import os
from collections import namedtuple

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
#: dot precision of float32 operands ("ieee": the "tf32x3" split faulted on the H200 and gave
#: wrong dt gradients); 16-bit inputs multiply in their own dtype on tensor cores
F32_DOT = os.environ.get("FUELGRAPH_SSD_DOT_PRECISION", "ieee")

#: forward launch shape: chunk length q, scan row block bm and column block bk (also the
#: state kernel's step block), P block bp, state-kernel N block bn, warps and pipeline stages
#: of the scan kernel (warps, stages) and of the state kernel (swarps, sstages)
#: and cb: when b and c are one group broadcast over the heads (head stride 0), 1 computes
#: the C B^T of every chunk once per batch (float32, [B, NC, Q, Q]) for all heads to read,
#: and orders the scan programs heads-fastest so that they read it from L2; 2 the same stored
#: in x's dtype (half the reads, one more rounding); 0 computes it in every head's program;
#: sbp: the state kernel's P block when it differs from the scan's (0: bp)
SSDConfig = namedtuple("SSDConfig", "q bm bk bp bn warps stages swarps sstages cb sbp",
                       defaults=(8, 3, 2, 0))
#: backward: chunk length, warps, pipeline stages; split: 1 runs the split kernels of
#: ssm_ssd_bwd (bm rows, bp / bn blocks of P / N per program), 0 the one per-chunk kernel
#: (None: FUELGRAPH_SSD_BWD, "split" by default or "fused"); zcb: with b and c shared by the
#: heads, 1 has dB and dC sum their decay terms for the Acum gradient from the shared C B^T
#: (30-40% more loop instructions), 0 (default) from R . out (as accurate: both cancel the
#: pairs at float32 rounding)
SSDBwdConfig = namedtuple("SSDBwdConfig", "q warps stages split bm bp bn zcb",
                          defaults=(None, 64, 64, 64, 0))
SSD_BWD_SPLIT = os.environ.get("FUELGRAPH_SSD_BWD", "split") != "fused"


def _op_type(dtype):
    """Dot operand type: the input's (Triton's CPU interpreter multiplies bfloat16 as raw
    integers, so it gets float32 there)."""
    if dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16):
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def _p2(n, lo=16):
    return max(lo, 1 << (max(int(n), 1) - 1).bit_length())


def ssd_config(B, L, H, P, N):
    """Forward: Q = 256 (few stored states: the state traffic is B H (L / Q) P N), 64 x 64
    tiles of the masked C B^T with all of N per scan program (4 warps, ~190 registers: two
    programs per SM), the state kernel split in N blocks of 64 so that B H P / 64 * N / 64
    programs walk the sequence (8 warps, 80 registers, 3 stages of prefetch). C B^T shared by
    the heads stored in x's dtype (cb = 2): on the H200 at B4 L4096 H80 P64 N128 the scan
    kernel took 0.40 ms so, 0.44 ms with it in float32, 0.53 ms formed per head. The chunk-
    parallel alternative to the state walk (every chunk's own state, then a pass) measured
    0.27 ms against the walk's 0.20 ms."""
    q = min(256, _p2(L))
    bm = min(64, q)
    return SSDConfig(q, bm, bm, min(64, _p2(P)), min(64, _p2(N)), 4, 2, 8, 3, 2)


def ssd_fwd_config(B, L, H, P, N):
    """The forward's launch: ssd_config with the state walk over all of N (up to 128) in P
    blocks of 32 on 4 warps, so that x is read once by it (N blocks of 64 read it twice). H200,
    B4 L4096 H80 P64 N128 bf16, whole forward: 0.587 ms (0.590 with N 128 in P blocks of 64
    on 8 warps) against 0.612 ms with ssd_config's N blocks of 64; a scan on 8 warps (0.78 ms)
    or in 128-row blocks (0.65-0.86 ms) lost. ssd_config's state settings stay those of the
    backward's walks."""
    return ssd_config(B, L, H, P, N)._replace(bn=min(128, _p2(N)), swarps=4,
                                              sbp=min(32, _p2(P)))


def ssd_bwd_config(B, L, H, P, N, dtype=None, split=None):
    """Backward, split (the default, see the module docstring): chunks of 128, 64-row blocks,
    dx over 64-wide P blocks, dB and dC over all N = 128 at once (one program computes the
    [64, 64] decay-weighted products for all of N), 4 warps: on sm_90 dB 236 and dC 228
    registers, dx 168 (maxnreg) with b and c shared by the heads (3 programs an SM), no
    spill (zcb=1: dB / dC 255, 8 bytes of spill, 30-40% more loop instructions). H200, B4
    L4096 H80 P64 N128 bf16, backward alone: 2.339 ms (fwd+bwd 2.945; fused 3.763 / 4.354;
    kernels: the two state walks 185 + 178 us, dx 713, dB 619, dC 595, ddt 31), zcb=1
    2.640, chunk 256 2.558. Before the 16-bit fix (first GPU run, N blocks of 64): chunk 256
    3.48 ms (fused 3.74; the dB and dC kernels 1.30 ms each against dx's 0.50: per-program
    latency, twice the programs), chunk 128 3.20 ms, 8 warps 6.44 ms (8 warps, N at once: 4.45);
    weighing the blocks off the diagonal by a row and a column factor instead of an exp an
    entry gained nothing (3.56 against 3.48; dropped). float32 (exact dots on CUDA cores)
    32-row blocks on 8 warps (64 rows spill).
    Fused (split=0): the per-chunk gradient kernel keeps [Q, N], [P, N] and [Q, Q] float32
    tiles live across ~11 dots: Q = 32 on 8 warps keeps N = 128, P = 64 in registers (255,
    no spill; Q = 64 spills), at the price of stored states and cotangents every 32 steps.
    float32 inputs (exact dots on CUDA cores, operands in registers) take Q = 32 too."""
    if SSD_BWD_SPLIT if split is None else split:
        if dtype == torch.float32:
            return SSDBwdConfig(min(256, _p2(L)), 8, 1, 1, 32, 64, 64)
        return SSDBwdConfig(min(128, _p2(L)), 4, 2, 1, 64, 64, 128)
    big = _p2(P) * _p2(N) >= 8192 or dtype == torch.float32
    return SSDBwdConfig(32 if big else 64, 8 if big else 4, 1, 0)


def _cost(shapes, params=None, q=64):
    (B, L, H, P), N = shapes[0], shapes[3][3]
    flops = 2 * B * L * H * (q * (N + P) + 2 * P * N)
    n = sum(int(torch.Size(s).numel()) for s in shapes) + B * L * H * P
    return Cost(flops, 2 * n)


def _strides3(t):
    return t.stride(0), t.stride(1), t.stride(2)


# ---------------------------------------------------------------------------------- forward
@triton.jit
def _ssd_dt_kernel(dt_ptr, a_ptr, bias_ptr, dtp_ptr, acum_ptr, L, H, NC, sdt_b, sdt_l, sdt_h,
                   Q: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr,
                   SOFTPLUS: tl.constexpr):
    """dt' and its within-chunk cumsum of dt' a for one chunk of one batch and BH heads,
    written to [B, H, L] float32 rows (0 past L)."""
    pid = tl.program_id(0).to(tl.int64)
    bi = pid // NC
    ci = pid % NC
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    t = ci * Q + tl.arange(0, Q)
    hmask = offs_h < H
    m2 = (t < L)[:, None] & hmask[None, :]
    dtr = tl.load(dt_ptr + bi * sdt_b + t[:, None] * sdt_l + offs_h[None, :] * sdt_h, mask=m2,
                  other=0.0).to(tl.float32)
    if HAS_BIAS:
        dtr += tl.load(bias_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)[None, :]
    if SOFTPLUS:
        dtr = softplus_f32(dtr)
    dtp = tl.where(m2, dtr, 0.0)
    a_h = tl.load(a_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)
    acum = tl.cumsum(dtp * a_h[None, :], 0)
    off = (bi * H + offs_h[None, :]) * L + t[:, None]
    tl.store(dtp_ptr + off, dtp, mask=m2)
    tl.store(acum_ptr + off, acum, mask=m2)


@triton.jit
def _ssd_state_kernel(x_ptr, b_ptr, z_ptr, dtp_ptr, acum_ptr, h0_ptr, st_ptr, hl_ptr,
                      L, H, P, N, NC, sx_b, sx_l, sx_h, sb_b, sb_l, sb_h, sz_b, sz_l, sz_h,
                      Q: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                      HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, HAS_Z: tl.constexpr,
                      F32_PREC: tl.constexpr, OP_T: tl.constexpr):
    """Chunk-to-chunk passing for one (batch, head, P block, N block), st [B H, NC, P, N].
    Forward: h_{c+1} = exp(Acum_end) h_c + sum_t (exp(Acum_end - Acum_t) dt_t x_t)^T b_t,
    storing the state entering every chunk and the last one (hl). REVERSE (the backward's
    state cotangent; x = grad_y, gated by silu(z) if HAS_Z, b = c): g_c = exp(Acum_end)
    g_{c+1} + sum_t (exp(Acum_t) gy_t)^T c_t from the last chunk down, storing the cotangent
    at the end of every chunk and the one of the initial state (hl)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    bi = pid_bh // H
    hi = pid_bh % H
    offs_p = tl.program_id(1) * BP + tl.arange(0, BP)
    offs_n = tl.program_id(2) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    pmask = offs_p < P
    nmask = offs_n < N
    pn_off = offs_p[:, None] * N + offs_n[None, :]
    pn_mask = pmask[:, None] & nmask[None, :]
    op_t: tl.constexpr = OP_T
    if HAS_INIT:
        state = tl.load(h0_ptr + pid_bh * P * N + pn_off, mask=pn_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BP, BN), tl.float32)
    row = pid_bh * L
    x_base = x_ptr + bi * sx_b + hi * sx_h
    b_base = b_ptr + bi * sb_b + hi * sb_h
    st_base = st_ptr + pid_bh * NC * P * N + pn_off
    NKB = tl.cdiv(L, BK)
    # one flat loop over blocks of BK steps (Q % BK == 0), so that the loads of the next
    # blocks are prefetched across chunk boundaries; at a chunk's first block (in walking
    # order) the carried state is stored and decayed by the chunk's total exp(Acum_end)
    for kk in range(0, NKB):
        if REVERSE:
            k0 = (NKB - 1 - kk) * BK
        else:
            k0 = kk * BK
        ci = k0 // Q
        cend = tl.minimum(ci * Q + Q, L)
        if REVERSE:
            edge = k0 + BK >= cend
        else:
            edge = (k0 % Q) == 0
        tl.store(st_base + ci * P * N, state.to(st_ptr.dtype.element_ty), mask=pn_mask & edge)
        total = tl.load(acum_ptr + row + cend - 1)
        t = k0 + offs_k
        tmask = t < cend
        ac = tl.load(acum_ptr + row + t, mask=tmask, other=0.0)
        tp_mask = tmask[:, None] & pmask[None, :]
        X = tl.load(x_base + t[:, None] * sx_l + offs_p[None, :], mask=tp_mask,
                    other=0.0).to(tl.float32)
        if REVERSE:
            w = tl.where(tmask, tl.exp(ac), 0.0)
            if HAS_Z:
                zz = tl.load(z_ptr + bi * sz_b + t[:, None] * sz_l + hi * sz_h + offs_p[None, :],
                             mask=tp_mask, other=0.0).to(tl.float32)
                X = X * zz * sigmoid_f32(zz)
        else:
            dtp = tl.load(dtp_ptr + row + t, mask=tmask, other=0.0)
            w = tl.where(tmask, tl.exp(total - ac) * dtp, 0.0)
        Bm = tl.load(b_base + t[:, None] * sb_l + offs_n[None, :],
                     mask=tmask[:, None] & nmask[None, :], other=0.0)
        Xw = (X * w[:, None]).to(op_t)
        state = state * tl.where(edge, tl.exp(total), 1.0)
        state = tl.dot(tl.trans(Xw), Bm.to(op_t), state, input_precision=F32_PREC)
    tl.store(hl_ptr + pid_bh * P * N + pn_off, state.to(hl_ptr.dtype.element_ty), mask=pn_mask)


@triton.jit
def _ssd_cb_kernel(b_ptr, c_ptr, cb_ptr, L, N, NC, sb_b, sb_l, sc_b, sc_l,
                   Q: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, F32_PREC: tl.constexpr,
                   OP_T: tl.constexpr):
    """C B^T of one chunk of one batch (b, c: one group shared by every head), one [BM, BM]
    tile (rows m, columns k), into cb [B, NC, Q, Q] (its dtype); tiles above the diagonal are
    written as zeros (a scan block may read past the diagonal, where its mask drops them)."""
    pid = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    bi = pid // NC
    ci = pid % NC
    c0 = ci * Q
    cend = tl.minimum(c0 + Q, L)
    offs_m = c0 + pid_m * BM + tl.arange(0, BM)
    offs_k = c0 + pid_k * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    mmask = offs_m < cend
    kmask = offs_k < cend
    acc = tl.zeros((BM, BM), tl.float32)
    if pid_k <= pid_m:
        for n0 in range(0, N, BN):
            nmask = (n0 + offs_n) < N
            Cm = tl.load(c_ptr + bi * sc_b + offs_m[:, None] * sc_l + n0 + offs_n[None, :],
                         mask=mmask[:, None] & nmask[None, :], other=0.0).to(OP_T)
            Bk = tl.load(b_ptr + bi * sb_b + offs_k[:, None] * sb_l + n0 + offs_n[None, :],
                         mask=kmask[:, None] & nmask[None, :], other=0.0).to(OP_T)
            acc = tl.dot(Cm, tl.trans(Bk), acc, input_precision=F32_PREC)
    rows = (pid * Q + pid_m * BM + tl.arange(0, BM)) * Q
    tl.store(cb_ptr + rows[:, None] + pid_k * BM + tl.arange(0, BM)[None, :],
             acc.to(cb_ptr.dtype.element_ty))


@triton.jit
def _ssd_scan_kernel(x_ptr, b_ptr, c_ptr, dtp_ptr, acum_ptr, st_ptr, d_ptr, z_ptr, y_ptr,
                     cb_ptr, L, H, P, N, NC, sx_b, sx_l, sx_h, sb_b, sb_l, sb_h, sc_b, sc_l, sc_h,
                     sz_b, sz_l, sz_h,
                     Q: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                     BN: tl.constexpr, HAS_D: tl.constexpr, D_PER_P: tl.constexpr,
                     HAS_Z: tl.constexpr, F32_PREC: tl.constexpr,
                     OP_T: tl.constexpr, HAS_CB: tl.constexpr = False):
    """Outputs of one block of BM rows of one chunk (batch, head, chunk, rows, P block):
    y = exp(Acum) C h_in^T + (C B^T o decay o dt) x over the columns up to the diagonal.
    HAS_CB: C B^T read from cb [B, NC, Q, Q] (shared by the heads), programs ordered (rows,
    head, chunk, batch) from the fastest, so that the heads of a chunk run together."""
    NM: tl.constexpr = Q // BM
    pid = tl.program_id(0).to(tl.int64)
    pid_m = NM - 1 - pid % NM                 # the longest rows first
    if HAS_CB:
        hi = (pid // NM) % H
        ci = (pid // (NM * H)) % NC
        bi = pid // (NM * H * NC)
        pid_bh = bi * H + hi
    else:
        ci = (pid // NM) % NC
        pid_bh = pid // (NM * NC)
        bi = pid_bh // H
        hi = pid_bh % H
    c0 = ci * Q
    m0 = c0 + pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_p = tl.program_id(1) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    cend = tl.minimum(c0 + Q, L)
    mmask = offs_m < cend
    pmask = offs_p < P
    nmask = offs_n < N
    op_t: tl.constexpr = OP_T
    row = pid_bh * L
    ac_m = tl.load(acum_ptr + row + offs_m, mask=mmask, other=0.0)
    Cm = tl.load(c_ptr + bi * sc_b + offs_m[:, None] * sc_l + hi * sc_h + offs_n[None, :],
                 mask=mmask[:, None] & nmask[None, :], other=0.0).to(op_t)
    h_in = tl.load(st_ptr + (pid_bh * NC + ci) * P * N + offs_p[:, None] * N + offs_n[None, :],
                   mask=pmask[:, None] & nmask[None, :], other=0.0).to(op_t)
    acc = tl.dot(Cm, tl.trans(h_in), input_precision=F32_PREC) * tl.exp(ac_m)[:, None]
    x_base = x_ptr + bi * sx_b + hi * sx_h
    b_base = b_ptr + bi * sb_b + hi * sb_h
    for k0 in range(c0, tl.minimum(m0 + BM, cend), BK):
        t = k0 + offs_k
        kmask = t < cend
        ac_k = tl.load(acum_ptr + row + t, mask=kmask, other=0.0)
        dtp_k = tl.load(dtp_ptr + row + t, mask=kmask, other=0.0)
        Xk = tl.load(x_base + t[:, None] * sx_l + offs_p[None, :],
                     mask=kmask[:, None] & pmask[None, :], other=0.0).to(op_t)
        if HAS_CB:
            CB = tl.load(cb_ptr + ((bi * NC + ci) * Q + (offs_m - c0))[:, None] * Q
                         + (t - c0)[None, :]).to(tl.float32)
        else:
            Bk = tl.load(b_base + t[:, None] * sb_l + offs_n[None, :],
                         mask=kmask[:, None] & nmask[None, :], other=0.0).to(op_t)
            CB = tl.dot(Cm, tl.trans(Bk), input_precision=F32_PREC)
        causal = (offs_m[:, None] >= t[None, :]) & kmask[None, :]
        seg = tl.where(causal, ac_m[:, None] - ac_k[None, :], float("-inf"))
        Mx = CB * tl.exp(seg) * dtp_k[None, :]
        acc = tl.dot(Mx.to(op_t), Xk, acc, input_precision=F32_PREC)
    mp_mask = mmask[:, None] & pmask[None, :]
    if HAS_D:
        X = tl.load(x_base + offs_m[:, None] * sx_l + offs_p[None, :], mask=mp_mask,
                    other=0.0).to(tl.float32)
        if D_PER_P:
            dsk = tl.load(d_ptr + hi * P + offs_p, mask=pmask, other=0.0).to(tl.float32)
            acc += X * dsk[None, :]
        else:
            acc += X * tl.load(d_ptr + hi).to(tl.float32)
    if HAS_Z:
        zz = tl.load(z_ptr + bi * sz_b + offs_m[:, None] * sz_l + hi * sz_h + offs_p[None, :],
                     mask=mp_mask, other=0.0).to(tl.float32)
        acc *= zz * sigmoid_f32(zz)
    y_off = ((bi * L + offs_m[:, None]) * H + hi) * P + offs_p[None, :]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mp_mask)


def _ssd_opts(x, opt, has_d, has_z, has_dt_bias, has_init):
    it = iter(opt)
    return tuple(next(it) if f else x for f in (has_d, has_z, has_dt_bias, has_init))


def _last_contig(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_dt(dt, a, bias, B, L, H, Q, has_bias, softplus):
    """Kernel 1 -> dtp, acum [B, H, L] float32."""
    NC = triton.cdiv(L, Q)
    f32 = dict(dtype=torch.float32, device=dt.device)
    dtp, acum = torch.empty((B, H, L), **f32), torch.empty((B, H, L), **f32)
    bh = min(_p2(H, 1), max(1, 4096 // Q))
    _ssd_dt_kernel[(B * NC, triton.cdiv(H, bh))](
        dt, a, bias, dtp, acum, L, H, NC, *_strides3(dt), Q=Q, BH=bh, HAS_BIAS=has_bias,
        SOFTPLUS=softplus, num_warps=4)
    return dtp, acum


def _launch_state(x, bm, z, dtp, acum, init, st, last, Q, cfg, has_init, reverse=False,
                  has_z=False):
    """Kernel 2 (or its reverse): x [B, L, H, P] against bm [B, L, H, N] -> st, last."""
    B, L, H, P = x.shape
    N = bm.shape[3]
    bp, bn = min(cfg.sbp or cfg.bp, _p2(P)), min(cfg.bn, _p2(N))
    _ssd_state_kernel[(B * H, triton.cdiv(P, bp), triton.cdiv(N, bn))](
        x, bm, z, dtp, acum, init, st, last, L, H, P, N, triton.cdiv(L, Q),
        *_strides3(x), *_strides3(bm), *_strides3(z),
        Q=Q, BK=min(cfg.bk, Q), BP=bp, BN=bn, HAS_INIT=has_init, REVERSE=reverse,
        HAS_Z=has_z, F32_PREC=F32_DOT, OP_T=_op_type(x.dtype), num_warps=cfg.swarps,
        num_stages=cfg.sstages)


def _heads_share_bc(b, c):
    return b.shape[2] > 1 and b.stride(2) == 0 and c.stride(2) == 0


def _launch_cb(b, c, Q, bm, dtype=torch.float32):
    """C B^T of every chunk, [B, NC, Q, Q] in dtype (b, c [B, L, H, N], head stride 0)."""
    B, L, _, N = b.shape
    NC = triton.cdiv(L, Q)
    cb = torch.empty((B, NC, Q, Q), dtype=dtype, device=b.device)
    _ssd_cb_kernel[(B * NC, Q // bm, Q // bm)](
        b, c, cb, L, N, NC, b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        Q=Q, BM=bm, BN=min(64, _p2(N)), F32_PREC=F32_DOT, OP_T=_op_type(b.dtype), num_warps=4)
    return cb


def _launch_scan(x, b, c, d, z, dtp, acum, st, y, Q, cfg, has_d, has_z):
    B, L, H, P = x.shape
    N = b.shape[3]
    NC = triton.cdiv(L, Q)
    bm, bp = min(cfg.bm, Q), min(cfg.bp, _p2(P))
    has_cb = bool(cfg.cb) and _heads_share_bc(b, c)
    cb = x
    if has_cb:
        cb = _launch_cb(b, c, Q, bm, x.dtype if cfg.cb == 2 else torch.float32)
    _ssd_scan_kernel[(B * H * NC * (Q // bm), triton.cdiv(P, bp))](
        x, b, c, dtp, acum, st, d, z, y, cb, L, H, P, N, NC,
        *_strides3(x), *_strides3(b), *_strides3(c), *_strides3(z),
        Q=Q, BM=bm, BK=min(cfg.bk, Q), BP=bp, BN=_p2(N), HAS_D=has_d,
        D_PER_P=has_d and d.dim() == 2, HAS_Z=has_z, F32_PREC=F32_DOT,
        OP_T=_op_type(x.dtype), HAS_CB=has_cb, num_warps=cfg.warps, num_stages=cfg.stages)


@kernel(FusedOps.SSD_CHUNK_SCAN, "cuda", dtypes=HALF_AND_F32, cost=_cost, strided_input=True,
        precision="fp32 state and sums; 16-bit (fp32: exact) dot operands")
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
    cfg = SSDConfig(*config) if config else ssd_fwd_config(B, L, H, P, N)
    dtp, acum = _launch_dt(dt, a, bias, B, L, H, cfg.q, has_dt_bias, bool(dt_softplus))
    # entering states feed a 16-bit dot: stored in x's dtype (float32 for float32 inputs)
    st = torch.empty((B * H, triton.cdiv(L, cfg.q), P, N), dtype=x.dtype, device=x.device)
    _launch_state(x, b, z, dtp, acum, h0, st, hl, cfg.q, cfg, has_initial_states)
    _launch_scan(x, b, c, d, z, dtp, acum, st, y, cfg.q, cfg, has_d, has_z)
    return y, hl


# ---------------------------------------------------------------------------------- backward
@triton.jit
def _mm(a, b, op_t: tl.constexpr, prec: tl.constexpr):
    """a @ b with float32 accumulation, operands rounded to op_t (the input dtype)."""
    return tl.dot(a.to(op_t), b.to(op_t), input_precision=prec)


@triton.jit
def _ssd_bwd_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, gy_ptr, st_ptr,
                    dst_ptr, ys_ptr,
                    dx_ptr, ddt_ptr, db_ptr, dc_ptr, dz_ptr, da_ptr, dd_ptr, dbias_ptr,
                    L, H, P, N, NC,
                    sx_b, sx_l, sx_h, sdt_b, sdt_l, sdt_h, sb_b, sb_l, sb_h, sc_b, sc_l, sc_h,
                    sz_b, sz_l, sz_h, sg_b, sg_l, sg_h,
                    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
                    D_PER_P: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SOFTPLUS: tl.constexpr, PREC: tl.constexpr,
                    OP_T: tl.constexpr):
    """One chunk of one (batch, head), given the state entering it (st) and the cotangent of
    the state at its end (dst): dx, ddt, db, dc, dz of the chunk and its partial sums of da,
    dd, ddt_bias (written per program: [B H NC], [B H NC, P])."""
    pid = tl.program_id(0).to(tl.int64)
    pid_bh = pid // NC
    ci = pid % NC
    bi = pid_bh // H
    hi = pid_bh % H
    op_t: tl.constexpr = OP_T
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
    # cotangent of the state at the end of this chunk
    # (kept in their stored dtype: dot operands, widened only for the one sum below)
    Dst = tl.load(dst_ptr + pid * P * N + pn_off, mask=pn_mask, other=0.0)
    dd_acc = tl.zeros((BP,), tl.float32)
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
    Hin = tl.load(st_ptr + pid * P * N + pn_off, mask=pn_mask, other=0.0)
    eA = tl.exp(acum)
    wend = tl.exp(total - acum)
    dec = tl.exp(total)
    CB = _mm(Cm, tl.trans(Bm), op_t, PREC)
    Lm = tl.exp(tl.where(causal, acum[:, None] - acum[None, :], float("-inf")))
    QB = _mm(Bm, tl.trans(Dst), op_t, PREC)                    # [Q, BP]
    gB = _mm(tl.trans(CB * Lm), GY, op_t, PREC) + wend[:, None] * QB
    dX = dtp[:, None] * gB
    if HAS_D:
        dd_acc += tl.sum(GY * X, 0)
        dX += GY * dsk
    ddt = tl.sum(X * gB, 1)
    W = _mm(GY, tl.trans(X), op_t, PREC) * Lm                  # [Q, Q]
    dBv = _mm(tl.trans(W), Cm, op_t, PREC) + \
        wend[:, None] * _mm(X, Dst, op_t, PREC)
    dBv = dBv * dtp[:, None]
    V = W * dtp[None, :]
    yoffH = _mm(GY, Hin, op_t, PREC)                            # [Q, BN]
    dCv = _mm(V, Bm, op_t, PREC) + eA[:, None] * yoffH
    Zm = V * CB
    r = wend * dtp * tl.sum(X * QB, 1)
    dAc = tl.sum(Zm, 1) - tl.sum(Zm, 0) + eA * tl.sum(yoffH * Cm, 1) - r
    dHH = tl.sum(tl.sum(Dst.to(tl.float32) * Hin.to(tl.float32), 1), 0)
    dAc += tl.where(offs_q == Q - 1, tl.sum(r, 0) + dec * dHH, 0.0)
    ds = tl.sum(dAc, 0) - tl.cumsum(dAc, 0) + dAc                           # suffix sums
    ddt += ds * a_h
    da_acc = tl.sum(ds * dtp, 0)
    if SOFTPLUS:
        ddt = ddt * sigmoid_f32(pre)
    ddt = tl.where(tmask, ddt, 0.0)
    dbias_acc = tl.sum(ddt, 0)
    tl.store(dx_ptr + y_off, dX.to(dx_ptr.dtype.element_ty), mask=qp_mask)
    tl.store(ddt_ptr + (bi * L + t) * H + hi, ddt.to(ddt_ptr.dtype.element_ty), mask=tmask)
    n_off = ((bi * L + t[:, None]) * H + hi) * N + offs_n[None, :]
    tl.store(db_ptr + n_off, dBv.to(db_ptr.dtype.element_ty), mask=qn_mask)
    tl.store(dc_ptr + n_off, dCv.to(dc_ptr.dtype.element_ty), mask=qn_mask)
    tl.store(da_ptr + pid, da_acc)
    tl.store(dbias_ptr + pid, dbias_acc)
    if HAS_D:
        tl.store(dd_ptr + pid * P + offs_p, dd_acc, mask=pmask)


@kernel(SSD_CHUNK_SCAN_BACKWARD, "cuda", dtypes=HALF_AND_F32, strided_input=True,
        cost=lambda s, p=None: _cost(s[:5], p),
        precision="fp32 state and sums; 16-bit (fp32: exact) dot operands")
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
    cfg = SSDBwdConfig(*config) if config else ssd_bwd_config(B, L, H, P, N, dtype)
    if cfg.split is None:
        cfg = cfg._replace(split=SSD_BWD_SPLIT)
    if cfg.split and BH * P and L:
        from .ssm_ssd_bwd import ssd_backward_split
        dx, ddt, db, dc, dz, da_p, dd_p, dbias_p, dh0 = ssd_backward_split(
            x, dt, a, b, c, d, z, bias, h0, gy, gl, dt_softplus=dt_softplus, has_d=has_d,
            has_z=has_z, has_dt_bias=has_dt_bias, has_initial_states=has_initial_states,
            cfg=cfg)
        return _ssd_bwd_grads(dx, ddt, db, dc, dz, da_p, dd_p, dbias_p, dh0, d, B, H, P, N,
                              dtype, has_d, has_z, has_dt_bias, has_initial_states)
    Q = min(cfg.q, _p2(L))
    NC = triton.cdiv(L, Q)
    dx = torch.empty((B, L, H, P), dtype=dtype, device=dev)
    ddt = torch.empty((B, L, H), dtype=dtype, device=dev)
    db = torch.empty((B, L, H, N), dtype=dtype, device=dev)
    dc = torch.empty((B, L, H, N), dtype=dtype, device=dev)
    dz = torch.empty((B, L, H, P), dtype=dtype, device=dev) if has_z else x
    da_p, dbias_p = torch.zeros((BH, NC), **f32), torch.zeros((BH, NC), **f32)
    dd_p = torch.zeros((BH, NC, P), **f32)
    dh0 = gl.to(torch.float32).clone()
    if BH * P and L:
        fcfg = ssd_config(B, L, H, P, N)._replace(q=Q, bm=min(64, Q), bk=min(64, Q))
        dtp, acum = _launch_dt(dt, a, bias, B, L, H, Q, has_dt_bias, bool(dt_softplus))
        # states entering each chunk, and the cotangents at each chunk's end (reverse walk);
        # in x's dtype (they feed 16-bit dots)
        st = torch.empty((BH, NC, P, N), dtype=dtype, device=dev)
        dst = torch.empty((BH, NC, P, N), dtype=dtype, device=dev)
        hl = torch.empty((B, H, P, N), **f32)
        _launch_state(x, b, z, dtp, acum, h0, st, hl, Q, fcfg, has_initial_states)
        _launch_state(gy, c, z, dtp, acum, gl, dst, dh0, Q, fcfg, True, reverse=True,
                      has_z=has_z)
        ys = x
        if has_z:                            # the ungated y, for dz
            ys = torch.empty((B, L, H, P), **f32)
            _launch_scan(x, b, c, d, z, dtp, acum, st, ys, Q, fcfg, False, False)
        _ssd_bwd_kernel[(BH * NC,)](
            x, dt, a, b, c, d, z, bias, gy, st, dst, ys, dx, ddt, db, dc, dz, da_p, dd_p,
            dbias_p, L, H, P, N, NC,
            *_strides3(x), *_strides3(dt), *_strides3(b), *_strides3(c), *_strides3(z),
            *_strides3(gy),
            Q=Q, BP=_p2(P), BN=_p2(N), HAS_D=has_d, D_PER_P=has_d and d.dim() == 2,
            HAS_Z=has_z, HAS_BIAS=has_dt_bias, SOFTPLUS=bool(dt_softplus), PREC=F32_DOT,
            OP_T=_op_type(dtype), num_warps=cfg.warps, num_stages=cfg.stages)
    else:                                    # no steps: only dh0 = grad_last_state is nonzero
        for t in (dx, ddt, db, dc, dz):
            t.zero_()
    return _ssd_bwd_grads(dx, ddt, db, dc, dz, da_p, dd_p, dbias_p, dh0, d, B, H, P, N,
                          dtype, has_d, has_z, has_dt_bias, has_initial_states)


def _ssd_bwd_grads(dx, ddt, db, dc, dz, da_p, dd_p, dbias_p, dh0, d, B, H, P, N, dtype,
                   has_d, has_z, has_dt_bias, has_initial_states):
    """The gradient tuple, the per-program partial sums (da_p, dbias_p [B H, *], dd_p
    [B H, *, P], float32) added up."""
    grads = [dx, ddt, da_p.reshape(B, H, -1).sum((0, 2)).to(dtype), db, dc]
    if has_d:
        ddp = dd_p.reshape(B, H, -1, P).sum((0, 2))
        grads.append((ddp if d.dim() == 2 else ddp.sum(1)).to(dtype))
    if has_z:
        grads.append(dz)
    if has_dt_bias:
        grads.append(dbias_p.reshape(B, H, -1).sum((0, 2)).to(dtype))
    if has_initial_states:
        grads.append(dh0.reshape(B, H, P, N).to(dtype))
    return tuple(grads)
