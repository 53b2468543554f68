"""SELECTIVE_SCAN (Mamba-1) forward and backward on Triton; shared scan helpers.

Forward: one program owns a (batch, channel block) pair and walks time in tiles of T steps.
A tile's [T, BD] inputs (delta, u, z) are loaded at once (coalesced along D) and transformed
once per element (bias, softplus); then the T steps run unrolled on the [N, BD] state held in
registers (no barrier: the state's N axis stays inside a warp), with the step's b_t and c_t
as small broadcast loads that do not wait on the state; y of the tile is stored as one
[T, BD] tile. Every sum and exponential is float32; inputs are float32, bfloat16 or float16
(float64 is not covered: the op runs its recipe there), outputs are written in the input
dtype.

Backward: one program per (batch, channel block) first walks time forward and stores the
state entering each tile (float32 scratch), then walks the tiles in reverse: it recomputes
the tile's states from the stored one with an associative scan over the [T, BD, N] tile, runs
the reverse recurrence of the state cotangent (g_t = gy_t c_t + dA_{t+1} g_{t+1}, again an
associative scan) and forms every gradient in registers. Sums over
channel blocks (db, dc) and over the batch (da, dd, ddelta_bias) are written as per-program
partials and added by one torch reduction (deterministic, no atomics)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....registry.core import FusedOps
from ....registry.ssm import SELECTIVE_SCAN_BACKWARD
from ...base import Cost, kernel
from .common import HALF_AND_F32


def _cost(shapes, params=None):
    """Bandwidth-bound: every input read once, y written once (2-byte elements assumed)."""
    (B, L, D), N = shapes[0], shapes[2][1]
    n = sum(int(torch.Size(s).numel()) for s in shapes) + B * L * D
    return Cost(10 * B * L * D * N, 2 * n)

__all__ = ["selective_scan", "selective_scan_backward"]


@triton.jit
def lin_combine(a1, b1, a2, b2):
    """Compose two affine steps h -> a h + b (first (a1, b1), then (a2, b2))."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def softplus_f32(x):
    """log(1 + exp(x)) in float32, accurate for large negative x too (log1p trick)."""
    v = tl.exp(-tl.abs(x))
    w = 1.0 + v
    lp = tl.where(w == 1.0, v, tl.log(w) * (v / (w - 1.0)))
    return tl.maximum(x, 0.0) + lp


@triton.jit
def sigmoid_f32(x):
    return 1.0 / (1.0 + tl.exp(-x))


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def ss_config(B, L, D, N, backward=False):
    """Backward: (T, BD, num_warps) so that one [T, BD, BN] tile holds about 2048 float32
    values, more channel blocks when B * D is small. Forward: see ss_fwd_config."""
    if not backward:
        return ss_fwd_config(B, L, D, N)
    bn = _next_pow2(N)
    bd = max(1, min(_next_pow2(D), 32, 2048 // (bn * 8)))
    # keep enough programs to fill a GPU (~132 SMs) when the batch is small
    while bd > 4 and B * triton.cdiv(D, bd) < 264:
        bd //= 2
    t = max(1, min(32, 2048 // (bd * bn), _next_pow2(max(L, 1))))
    return t, bd, 4


def ss_fwd_config(B, L, D, N):
    """(T, BD, num_warps): 16 steps per tile (the [16, BD] inputs of a tile are loaded at
    once), BD = 64 channels on 2 warps (two channels and 8 of N=16 per thread: the bfloat16
    -> float32 conversions of b_t, c_t serve two channels), halved (32 on 2 warps, 16 on one)
    until there is a program per SM of the H200 (132 SMs). The walk is latency-bound
    (B D / 2 threads in all): at B8 L2048 D4096 N16 bfloat16 the H200 took 1.54 ms with
    64 channels on 2 warps, 1.58 ms with 128 on 4, 1.98 ms with 8-step tiles."""
    bd = 64
    while bd > 16 and B * triton.cdiv(D, bd) < 132:
        bd //= 2
    warps = 2 if bd == 64 else max(1, min(4, bd // 16))
    return min(16, _next_pow2(max(L, 1))), bd, warps


# ---------------------------------------------------------------------------------- forward
@triton.jit
def _ss_fwd_kernel(u_ptr, dl_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, y_ptr, h_ptr,
                   L, D, N, zero,
                   T: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
                   HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                   EVEN_N: tl.constexpr):
    """One program: batch pid 0, channels pid 1 * BD + [0, BD). The state is [BN, BD] with the
    channels across threads and all of N in each thread's registers. Per tile of T steps the
    [T, BD] inputs are loaded and transformed at once (coalesced along D, softplus once per
    element), then the T steps run unrolled in registers: h = exp2(dt a log2 e) h + dt u b_t,
    y_t = sum_n h c_t (b_t, c_t: [BN] broadcast loads that do not wait on h)."""
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    # `^ zero` (zero == 0) hides the channels' contiguity from the compiler: loads then keep
    # one channel per thread (coalesced across the warp) instead of 8-wide vectors, which
    # would put the state's N axis across threads and cost a barrier per step
    offs_d = pid_d * BD + (tl.arange(0, BD) ^ zero)
    offs_n = tl.arange(0, BN)
    offs_t = tl.arange(0, T)
    dmask = offs_d < D
    nmask = offs_n < N
    nd_mask = nmask[:, None] & dmask[None, :]
    a2 = tl.load(a_ptr + offs_d[None, :] * N + (offs_n ^ zero)[:, None], mask=nd_mask,
                 other=0.0).to(tl.float32) * 1.4426950408889634
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    if HAS_D:
        dskip = tl.load(d_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    h = tl.zeros((BN, BD), tl.float32)
    base_d = pid_b * L * D
    b_row = b_ptr + pid_b * L * N + offs_n
    c_row = c_ptr + pid_b * L * N + offs_n
    for t0 in range(0, L, T):
        t = t0 + offs_t
        tmask = t < L
        m2 = tmask[:, None] & dmask[None, :]
        off2 = base_d + t[:, None] * D + offs_d[None, :]
        dl = tl.load(dl_ptr + off2, mask=m2, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dl += bias[None, :]
        if SOFTPLUS:
            dl = softplus_f32(dl)
        dl = tl.where(m2, dl, 0.0)
        uu = tl.load(u_ptr + off2, mask=m2, other=0.0).to(tl.float32)
        dlu = dl * uu
        yv = tl.zeros((T, BD), tl.float32)
        for i in tl.static_range(T):
            sel = offs_t[:, None] == i
            dl_i = tl.sum(tl.where(sel, dl, 0.0), 0)
            dlu_i = tl.sum(tl.where(sel, dlu, 0.0), 0)
            # steps past L (dl = 0: the state is unchanged, y is not stored) read row L - 1
            row = tl.minimum(t0 + i, L - 1) * N
            if EVEN_N:
                b_i = tl.load(b_row + row).to(tl.float32)
                c_i = tl.load(c_row + row).to(tl.float32)
            else:
                b_i = tl.load(b_row + row, mask=nmask, other=0.0).to(tl.float32)
                c_i = tl.load(c_row + row, mask=nmask, other=0.0).to(tl.float32)
            h = tl.exp2(dl_i[None, :] * a2) * h + dlu_i[None, :] * b_i[:, None]
            y_i = tl.sum(h * c_i[:, None], 0)
            yv = tl.where(sel, y_i[None, :], yv)
        if HAS_D:
            yv += uu * dskip[None, :]
        if HAS_Z:
            zz = tl.load(z_ptr + off2, mask=m2, other=0.0).to(tl.float32)
            yv *= zz * sigmoid_f32(zz)
        tl.store(y_ptr + off2, yv.to(y_ptr.dtype.element_ty), mask=m2)
    tl.store(h_ptr + pid_b * D * N + offs_d[None, :] * N + offs_n[:, None],
             h.to(h_ptr.dtype.element_ty), mask=nd_mask)


def _ss_opts(u, opt, has_d, has_z, has_delta_bias):
    it = iter(opt)
    d = next(it) if has_d else u
    z = next(it) if has_z else u
    bias = next(it) if has_delta_bias else u
    return d, z, bias


@kernel(FusedOps.SELECTIVE_SCAN, "cuda", dtypes=HALF_AND_F32, cost=_cost,
        precision="fp32 state and sums")
def selective_scan(u, delta, a, b, c, *opt, delta_softplus, has_d, has_z, has_delta_bias,
                   config=None):
    """SELECTIVE_SCAN: u, delta [B, L, D], a [D, N], b, c [B, L, N] (contiguous CUDA tensors,
    one of float32 / bfloat16 / float16), then d [D], z [B, L, D], delta_bias [D] as flagged ->
    (y [B, L, D], last_state [B, D, N]) in u's dtype."""
    B, L, D = u.shape
    N = a.shape[1]
    d, z, bias = _ss_opts(u, opt, has_d, has_z, has_delta_bias)
    y = torch.empty_like(u)
    h = torch.empty((B, D, N), dtype=u.dtype, device=u.device)
    if B * D == 0:
        return y, h
    if N == 0:
        h.zero_()
    T, BD, warps = config or ss_fwd_config(B, L, D, N)
    if b.dtype != torch.float32:
        # every program reads all of b and c (B L N values, small): widened once here rather
        # than per step and channel in the kernel's inner loop
        b, c = b.float(), c.float()
    _ss_fwd_kernel[(B, triton.cdiv(D, BD))](
        u, delta, a, b, c, d, z, bias, y, h, L, D, N, 0, T=T, BD=BD, BN=_next_pow2(N),
        EVEN_N=N == _next_pow2(N),
        HAS_D=has_d, HAS_Z=has_z, HAS_BIAS=has_delta_bias, SOFTPLUS=bool(delta_softplus),
        num_warps=warps)
    return y, h


# ---------------------------------------------------------------------------------- backward
@triton.jit
def _ss_bwd_kernel(u_ptr, dl_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, gy_ptr, gl_ptr,
                   hbuf_ptr, du_ptr, ddl_ptr, da_ptr, db_ptr, dc_ptr, dd_ptr, dz_ptr, dbias_ptr,
                   L, D, N, NT,
                   T: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
                   HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    B = tl.num_programs(0)
    offs_d = pid_d * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    offs_t = tl.arange(0, T)
    dmask = offs_d < D
    nmask = offs_n < N
    dn_mask = dmask[:, None] & nmask[None, :]
    dn_off = offs_d[:, None] * N + offs_n[None, :]
    a = tl.load(a_ptr + dn_off, mask=dn_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    if HAS_D:
        dskip = tl.load(d_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    base_d = pid_b * L * D
    base_n = pid_b * L * N
    # this program's slice of the [B, NT, D, N] scratch of tile-entry states
    hb_base = hbuf_ptr + pid_b * NT * D * N
    # pass 1: states entering every tile
    h = tl.zeros((BD, BN), tl.float32)
    for it in range(0, NT):
        tl.store(hb_base + it * D * N + dn_off, h, mask=dn_mask)
        t = it * T + offs_t
        tmask = t < L
        m2 = tmask[:, None] & dmask[None, :]
        off2 = base_d + t[:, None] * D + offs_d[None, :]
        dl = tl.load(dl_ptr + off2, mask=m2, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dl += bias[None, :]
        if SOFTPLUS:
            dl = softplus_f32(dl)
        dl = tl.where(m2, dl, 0.0)
        uu = tl.load(u_ptr + off2, mask=m2, other=0.0).to(tl.float32)
        offn = base_n + t[:, None] * N + offs_n[None, :]
        bb = tl.load(b_ptr + offn, mask=tmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        dA = tl.exp(dl[:, :, None] * a[None, :, :])
        dBu = (dl * uu)[:, :, None] * bb[:, None, :]
        pa, pb = tl.associative_scan((dA, dBu), 0, lin_combine)
        h = tl.sum(tl.where(offs_t[:, None, None] == T - 1, pa * h[None, :, :] + pb, 0.0), 0)
    tl.debug_barrier()
    # pass 2: tiles in reverse
    gcar = tl.load(gl_ptr + pid_b * D * N + dn_off, mask=dn_mask, other=0.0).to(tl.float32)
    da_acc = tl.zeros((BD, BN), tl.float32)
    dd_acc = tl.zeros((BD,), tl.float32)
    dbias_acc = tl.zeros((BD,), tl.float32)
    for k in range(0, NT):
        it = NT - 1 - k
        h_in = tl.load(hb_base + it * D * N + dn_off, mask=dn_mask, other=0.0)
        t = it * T + offs_t
        tmask = t < L
        m2 = tmask[:, None] & dmask[None, :]
        off2 = base_d + t[:, None] * D + offs_d[None, :]
        pre = tl.load(dl_ptr + off2, mask=m2, other=0.0).to(tl.float32)
        # next step's dt (row t holds dt_{t+1}; 0 past the tile, where the carry takes over)
        nmask2 = (offs_t[:, None] < T - 1) & ((t + 1)[:, None] < L) & dmask[None, :]
        pre_n = tl.load(dl_ptr + off2 + D, mask=nmask2, other=0.0).to(tl.float32)
        if HAS_BIAS:
            pre += bias[None, :]
            pre_n += bias[None, :]
        if SOFTPLUS:
            dl = softplus_f32(pre)
            dl_n = softplus_f32(pre_n)
        else:
            dl = pre
            dl_n = pre_n
        dl = tl.where(m2, dl, 0.0)
        dl_n = tl.where(nmask2, dl_n, 0.0)
        uu = tl.load(u_ptr + off2, mask=m2, other=0.0).to(tl.float32)
        gy = tl.load(gy_ptr + off2, mask=m2, other=0.0).to(tl.float32)
        offn = base_n + t[:, None] * N + offs_n[None, :]
        mn = tmask[:, None] & nmask[None, :]
        bb = tl.load(b_ptr + offn, mask=mn, other=0.0).to(tl.float32)
        cc = tl.load(c_ptr + offn, mask=mn, other=0.0).to(tl.float32)
        dA = tl.exp(dl[:, :, None] * a[None, :, :])
        dBu = (dl * uu)[:, :, None] * bb[:, None, :]
        pa, pb = tl.associative_scan((dA, dBu), 0, lin_combine)
        hs = pa * h_in[None, :, :] + pb
        # output gate: out = (y + u d) * silu(z)
        if HAS_Z:
            zz = tl.load(z_ptr + off2, mask=m2, other=0.0).to(tl.float32)
            sz = sigmoid_f32(zz)
            yp = tl.sum(hs * cc[:, None, :], 2)
            if HAS_D:
                yp += uu * dskip[None, :]
            dz = gy * yp * sz * (1.0 + zz * (1.0 - sz))
            tl.store(dz_ptr + off2, dz.to(dz_ptr.dtype.element_ty), mask=m2)
            gy = gy * zz * sz
        du_v = tl.zeros((T, BD), tl.float32)
        if HAS_D:
            dd_acc += tl.sum(gy * uu, 0)
            du_v = gy * dskip[None, :]
        # reverse recurrence of the state cotangent
        beta = gy[:, :, None] * cc[:, None, :]
        beta += tl.where(offs_t[:, None, None] == T - 1, gcar[None, :, :], 0.0)
        alpha = tl.exp(dl_n[:, :, None] * a[None, :, :])
        _, g = tl.associative_scan((alpha, beta), 0, lin_combine, reverse=True)
        gcar = tl.sum(tl.where(offs_t[:, None, None] == 0, g * dA, 0.0), 0)
        gdec = g * (hs - dBu)                                 # g_t * dA_t * h_{t-1}
        gb = tl.sum(g * bb[:, None, :], 2)
        ddl = tl.sum(gdec * a[None, :, :], 2) + uu * gb
        du_v += dl * gb
        da_acc += tl.sum(gdec * dl[:, :, None], 0)
        if SOFTPLUS:
            ddl = ddl * sigmoid_f32(pre)
        ddl = tl.where(m2, ddl, 0.0)
        dbias_acc += tl.sum(ddl, 0)
        tl.store(du_ptr + off2, du_v.to(du_ptr.dtype.element_ty), mask=m2)
        tl.store(ddl_ptr + off2, ddl.to(ddl_ptr.dtype.element_ty), mask=m2)
        # per channel-block partials of db, dc: [n_db, B, L, N]
        part = (pid_d * B + pid_b) * L * N
        db_v = tl.sum(g * (dl * uu)[:, :, None], 1)
        dc_v = tl.sum(gy[:, :, None] * hs, 1)
        offp = part + t[:, None] * N + offs_n[None, :]
        tl.store(db_ptr + offp, db_v, mask=mn)
        tl.store(dc_ptr + offp, dc_v, mask=mn)
    tl.store(da_ptr + pid_b * D * N + dn_off, da_acc, mask=dn_mask)
    if HAS_D:
        tl.store(dd_ptr + pid_b * D + offs_d, dd_acc, mask=dmask)
    if HAS_BIAS:
        tl.store(dbias_ptr + pid_b * D + offs_d, dbias_acc, mask=dmask)


@kernel(SELECTIVE_SCAN_BACKWARD, "cuda", dtypes=HALF_AND_F32,
        cost=lambda s, p=None: _cost(s[:5], p), precision="fp32 state and sums")
def selective_scan_backward(u, delta, a, b, c, *rest, delta_softplus, has_d, has_z,
                            has_delta_bias, config=None):
    """Backward of SELECTIVE_SCAN: the forward inputs, then grad_y [B, L, D] and
    grad_last_state [B, D, N] -> one gradient per forward input (its shape and dtype)."""
    gy, gl = rest[-2:]
    d, z, bias = _ss_opts(u, rest[:-2], has_d, has_z, has_delta_bias)
    B, L, D = u.shape
    N = a.shape[1]
    T, BD, warps = config or ss_config(B, L, D, N, backward=True)
    n_db = triton.cdiv(D, BD) if D else 0
    NT = triton.cdiv(L, T)
    f32 = dict(dtype=torch.float32, device=u.device)
    du, ddl = torch.empty_like(u), torch.empty_like(delta)
    dz = torch.empty_like(z) if has_z else u
    hbuf = torch.empty((B, NT, D, N), **f32)
    da_p = torch.zeros((B, D, N), **f32)
    db_p = torch.zeros((n_db, B, L, N), **f32)
    dc_p = torch.zeros((n_db, B, L, N), **f32)
    dd_p = torch.zeros((B, D), **f32)
    dbias_p = torch.zeros((B, D), **f32)
    if B * D:
        _ss_bwd_kernel[(B, n_db)](
            u, delta, a, b, c, d, z, bias, gy, gl, hbuf, du, ddl, da_p, db_p, dc_p, dd_p, dz,
            dbias_p, L, D, N, NT, T=T, BD=BD, BN=_next_pow2(N), HAS_D=has_d, HAS_Z=has_z,
            HAS_BIAS=has_delta_bias, SOFTPLUS=bool(delta_softplus), num_warps=warps)
    else:
        du.zero_()
        ddl.zero_()
        if has_z:
            dz.zero_()
    dt = u.dtype
    grads = [du, ddl, da_p.sum(0).to(dt), db_p.sum(0).to(dt), dc_p.sum(0).to(dt)]
    if has_d:
        grads.append(dd_p.sum(0).to(dt))
    if has_z:
        grads.append(dz)
    if has_delta_bias:
        grads.append(dbias_p.sum(0).to(dt))
    return tuple(grads)
