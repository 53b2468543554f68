"""SELECTIVE_SCAN (Mamba-1) forward and backward on Triton; shared scan helpers.

Forward: one program owns a (batch, channel block) pair and walks time in tiles of T steps,
one channel a thread with all of its N states in registers (no shuffles, no barriers). A
tile's [T, BD] inputs (delta, u, z) are loaded a tile ahead (coalesced along D) and
transformed once per element (bias, softplus); then the T steps run unrolled, with the step's
b_t and c_t as 16-byte broadcast loads (prefetched into L1 a tile ahead); y of the tile is
stored as one [T, BD] tile. The work is one exponential per state and step (B L D N of them):
the MUFU unit's 16 results per clock and SM bound it, with the loop's other ~7 instructions a
state and step close behind, so a few of the N states may take their exponential from an FMA
polynomial instead (config `poly`). Every sum and exponential is float32 (approximate ex2,
relative error ~2e-7); inputs are float32, bfloat16 or float16 (float64 is not covered: the
op runs its recipe there), outputs are written in the input dtype.

Backward: one program per (batch, channel block) first walks time forward and stores the
state entering each tile (float32 scratch), then walks the tiles in reverse: it recomputes
the tile's states from the stored one with an associative scan over the [T, BD, N] tile, runs
the reverse recurrence of the state cotangent (g_t = gy_t c_t + dA_{t+1} g_{t+1}, again an
associative scan) and forms every gradient in registers. Sums over
channel blocks (db, dc) and over the batch (da, dd, ddelta_bias) are written as per-program
partials and added by one torch reduction (deterministic, no atomics)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as TF
import triton
import triton.language as tl

from ....registry.core import FusedOps
from ....registry.ssm import SELECTIVE_SCAN_BACKWARD
from ...base import Cost, kernel
from .common import HALF_AND_F32, INTERPRET


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


class SSFwdConfig(NamedTuple):
    """Forward launch: T steps per tile, BD channels per program on `warps` warps (one or two
    channels a thread, all of N in its registers), `poly` of the N states a step take their
    exponential from an FMA polynomial instead of the MUFU unit (packed float16 ex2 would not
    help: sm_90 runs it as two MUFU ops); pf = 1 loads a step's b, c rows in the step
    before (in registers: ptxas may otherwise use them a few instructions after the load,
    exposing the L1 latency every step). BD < 32 * warps splits each channel's states over
    lanes (y summed by shuffles); poly then counts in whole quarters of the states (the
    per-state choice would vary by lane)."""
    t: int
    bd: int
    warps: int
    poly: int = 0
    pf: int = 0


def ss_fwd_config(B, L, D, N):
    """16-step tiles, one channel a thread on 2 warps (64 channels a program), halved until
    there is a program per SM of the H200 (132 SMs). The MUFU unit bounds the steps (one
    exponential per state and step, 16 results per clock and SM: 8 issue cycles a warp) with
    the ~7 other instructions a state and step close behind (sm_90 SASS: 1872 a 16-step tile
    of 16 states vs 288 MUFU ops); one of 16 states through the FMA polynomial. H200, B8 L2048
    D4096 N16 bf16: 0.713 ms (poly 1; the old kernel 1.545 ms), 0.767 with poly 2, 1.46 with
    poly 0 (ptxas then consumes each step's b, c loads a few instructions after issuing them:
    the step waits on L1), 1.09 / 1.21 with 2 channels a thread (8, 128, 2, 1 / 2), 0.91 with
    a channel's states over 2 lanes (16, 16, 1, 0). Still ~2.6x the MUFU bound: latency."""
    bd = 64
    while bd > 32 and B * triton.cdiv(D, bd) < 132:
        bd //= 2
    poly = 1 if _next_pow2(max(N, 4)) == 16 else 0
    return SSFwdConfig(min(16, _next_pow2(max(L, 1))), bd, max(1, bd // 32), poly)


# ---------------------------------------------------------------------------------- forward
@triton.jit
def exp2_poly(x):
    """2^x on the FMA pipe (rel. error ~2e-7, like MUFU ex2): x = j + f with j = rint(x) (the
    1.5 * 2^23 rounding trick), a degree-5 polynomial for 2^f on [-0.5, 0.5], j added to the
    exponent bits. x is clamped to [-125, 125] (smaller values give ~2^-125, not 0)."""
    x = tl.minimum(tl.maximum(x, -125.0), 125.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = 0.0013276472454890609 * f + 0.009675541892647743
    p = p * f + 0.05550713092088699
    p = p * f + 0.24022120237350464
    p = p * f + 0.6931469440460205
    p = p * f + 1.0
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_mufu(x, ASM: tl.constexpr):
    if ASM:     # one MUFU op (tl.exp2 adds the denormal fix-ups of the non-ftz form)
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _exp2_states(x, j: tl.constexpr, kk, BN: tl.constexpr, POLY: tl.constexpr,
                 ASM: tl.constexpr, POLY_J: tl.constexpr = 0):
    """2^x for the [BN // 4, BD] states n = 4 k + j: the last POLY of the BN states through
    the polynomial (kk: the k index, constant in each register, so the select folds away)."""
    if j >= 4 - POLY_J:         # the whole tensor (any layout)
        return exp2_poly(x)
    elif POLY > 0:
        use_poly = (kk * 4 + j) >= BN - POLY
        return tl.where(use_poly[:, None], exp2_poly(x), _exp2_mufu(x, ASM))
    else:
        return _exp2_mufu(x, ASM)


@triton.jit
def _softplus_fwd(x, ASM: tl.constexpr):
    """softplus in float32 with two MUFU ops (approximate ex2 and lg2; absolute error
    ~1e-7): max(x, 0) + log(1 + exp(-|x|)), exactly exp(-|x|) where 1 + it rounds to 1."""
    if ASM:
        v = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f",
                                      [-tl.abs(x) * 1.4426950408889634], dtype=tl.float32,
                                      is_pure=True, pack=1)
        w = 1.0 + v
        lw = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [w],
                                       dtype=tl.float32, is_pure=True, pack=1)
        return tl.maximum(x, 0.0) + tl.where(w == 1.0, v, lw * 0.6931471805599453)
    else:
        return softplus_f32(x)


@triton.jit
def _load_bc4(ptr, ASM: tl.constexpr):
    """b (or c) at n = 4 k + j, j = 0..3, for the [BN // 4, BD] pointers to n = 4 k
    (the same for every channel): one 16-byte load a k and thread."""
    if ASM:
        return tl.inline_asm_elementwise(
            "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l", [ptr],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)


@triton.jit(do_not_specialize=["zero"])
def _ss_fwd_kernel(u_ptr, dl_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, y_ptr, h_ptr,
                   L, Lp, D: tl.constexpr, zero,
                   T: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
                   HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                   POLY: tl.constexpr, EVEN_L: tl.constexpr, ASM: tl.constexpr,
                   PF: tl.constexpr = False, POLY_J: tl.constexpr = 0):
    """One program: batch pid 0, channels pid 1 * BD + [0, BD), one channel a thread (BD / 32
    / warps of them). a arrives as a log2(e) [BN, D] float32 (transposed, zero-padded), b, c
    as float32 [B, Lp, BN] (zero-padded to whole tiles, + 1 row with PF), h is written as
    [B, BN, D] float32. The state of BN values (a multiple of 4) is held as four
    [BN // 4, BD] tensors h_j (n = 4 k + j) in the thread's registers, so that b_t, c_t come
    by 16-byte broadcast loads straight into them.
    Per tile of T steps the [T, BD] inputs are loaded one tile ahead (coalesced along D,
    softplus once per element), and the next tile's b, c rows are prefetched into L1 (their
    first touch would otherwise wait on L2 every other step); the T steps run unrolled:
    h = exp2(dt a log2 e) h + dt u b_t, y_t = sum_n h c_t. D is a compile-time constant so
    that the rows of a tile are immediate offsets of one address."""
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    K: tl.constexpr = BN // 4
    # `+ zero` (zero == 0, not specialised) keeps the channels contiguous but of unknown
    # alignment: every access along D is then ordered D-fastest with one channel a thread
    # (a known alignment would vectorise it and move the state's N axis to other lanes)
    offs_d = pid_d * BD + zero + tl.arange(0, BD)
    kk = tl.arange(0, K)
    offs_t = tl.arange(0, T)
    dmask = offs_d < D
    kd_mask = (kk[:, None] < K) & dmask[None, :]
    a_base = a_ptr + (kk[:, None] * 4) * D + offs_d[None, :]
    a0 = tl.load(a_base, mask=kd_mask, other=0.0)
    a1 = tl.load(a_base + D, mask=kd_mask, other=0.0)
    a2 = tl.load(a_base + 2 * D, mask=kd_mask, other=0.0)
    a3 = tl.load(a_base + 3 * D, mask=kd_mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    if HAS_D:
        dskip = tl.load(d_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    h0 = tl.zeros((K, BD), tl.float32)
    h1 = tl.zeros((K, BD), tl.float32)
    h2 = tl.zeros((K, BD), tl.float32)
    h3 = tl.zeros((K, BD), tl.float32)
    base_d = pid_b * L * D
    # [K, BD] pointers to b_t[4 k] (the same for every channel)
    bc_off = pid_b * Lp * BN + kk[:, None] * 4 + (offs_d * 0)[None, :]
    # a tile's rows as constant offsets of one [BD] row of pointers (immediate offsets)
    row_off = offs_t[:, None] * D
    dl_row = dl_ptr + base_d + offs_d
    u_row = u_ptr + base_d + offs_d
    y_row = y_ptr + base_d + offs_d
    z_row = z_ptr + base_d + offs_d
    # lane r of each warp prefetches row r % T of the next tile, of b (r < 16) or of c
    lane = tl.arange(0, BD) % 32
    pf_ptr = tl.where(lane < 16, b_ptr, c_ptr) + pid_b * Lp * BN + (lane % T) * BN
    # tile 0's inputs; each iteration loads the next tile's before its steps
    if EVEN_L:
        m2 = (offs_t < T)[:, None] & dmask[None, :]
    else:
        m2 = (offs_t < L)[:, None] & dmask[None, :]
    dl_raw = tl.load(dl_row[None, :] + row_off, mask=m2, other=0.0)
    u_raw = tl.load(u_row[None, :] + row_off, mask=m2, other=0.0)
    if PF:      # b, c of the first step; each step loads the next one's (Lp: a spare row)
        nb0, nb1, nb2, nb3 = _load_bc4(b_ptr + bc_off, ASM)
        nc0, nc1, nc2, nc3 = _load_bc4(c_ptr + bc_off, ASM)
    for t0 in range(0, L, T):
        t = t0 + offs_t
        bc_tile = bc_off + t0 * BN
        if EVEN_L:
            cur_m2 = m2
            nm2 = m2 & (t0 + T < L)
        else:
            cur_m2 = (t < L)[:, None] & dmask[None, :]
            nm2 = (t + T < L)[:, None] & dmask[None, :]
        tile = t0 * D
        dl_next = tl.load((dl_row + (tile + T * D))[None, :] + row_off, mask=nm2, other=0.0)
        u_next = tl.load((u_row + (tile + T * D))[None, :] + row_off, mask=nm2, other=0.0)
        if ASM:
            pf_row = tl.minimum(t0 + T, Lp - T) * BN
            tl.inline_asm_elementwise("prefetch.global.L1 [$1]; mov.u32 $0, 0;", "=r,l",
                                      [pf_ptr + pf_row], dtype=tl.int32, is_pure=False,
                                      pack=1)
        dl = dl_raw.to(tl.float32)
        if HAS_BIAS:
            dl += bias[None, :]
        if SOFTPLUS:
            dl = _softplus_fwd(dl, ASM)
        if not EVEN_L:
            dl = tl.where(cur_m2, dl, 0.0)
        uu = u_raw.to(tl.float32)
        dlu = dl * uu
        yv = tl.zeros((T, BD), tl.float32)
        for i in tl.static_range(T):
            sel = offs_t[:, None] == i
            # one row of the tile (T is within the thread: the selects fold away)
            dl_i = tl.max(tl.where(sel, dl, float("-inf")), 0)[None, :]
            dlu_i = tl.max(tl.where(sel, dlu, float("-inf")), 0)[None, :]
            # steps past L: dl = 0 (the state is unchanged, y is not stored), b, c rows of 0
            row = bc_tile + i * BN
            if PF:
                b0, b1, b2, b3 = nb0, nb1, nb2, nb3
                c0, c1, c2, c3 = nc0, nc1, nc2, nc3
                nb0, nb1, nb2, nb3 = _load_bc4(b_ptr + row + BN, ASM)
                nc0, nc1, nc2, nc3 = _load_bc4(c_ptr + row + BN, ASM)
            else:
                b0, b1, b2, b3 = _load_bc4(b_ptr + row, ASM)
                c0, c1, c2, c3 = _load_bc4(c_ptr + row, ASM)
            e0 = _exp2_states(dl_i * a0, 0, kk, BN, POLY, ASM, POLY_J)
            e1 = _exp2_states(dl_i * a1, 1, kk, BN, POLY, ASM, POLY_J)
            e2 = _exp2_states(dl_i * a2, 2, kk, BN, POLY, ASM, POLY_J)
            e3 = _exp2_states(dl_i * a3, 3, kk, BN, POLY, ASM, POLY_J)
            h0 = e0 * h0 + dlu_i * b0
            h1 = e1 * h1 + dlu_i * b1
            h2 = e2 * h2 + dlu_i * b2
            h3 = e3 * h3 + dlu_i * b3
            y_i = tl.sum(h0 * c0 + h1 * c1 + h2 * c2 + h3 * c3, 0)
            yv = tl.where(sel, y_i[None, :], yv)
        if HAS_D:
            yv += uu * dskip[None, :]
        if HAS_Z:
            zz = tl.load((z_row + tile)[None, :] + row_off, mask=cur_m2, other=0.0)
            zz = zz.to(tl.float32)
            yv *= zz * sigmoid_f32(zz)
        tl.store((y_row + tile)[None, :] + row_off, yv.to(y_ptr.dtype.element_ty), mask=cur_m2)
        dl_raw = dl_next
        u_raw = u_next
    h_base = h_ptr + pid_b * BN * D + (kk[:, None] * 4) * D + offs_d[None, :]
    tl.store(h_base, h0, mask=kd_mask)
    tl.store(h_base + D, h1, mask=kd_mask)
    tl.store(h_base + 2 * D, h2, mask=kd_mask)
    tl.store(h_base + 3 * D, h3, mask=kd_mask)


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
    if L == 0:
        return y, h.zero_()
    cfg = SSFwdConfig(*config) if config else ss_fwd_config(B, L, D, N)
    BN = max(4, _next_pow2(N))
    # b, c as float32 [B, Lp, BN], zero-padded to whole tiles and a multiple of 4 states:
    # every program reads all of them (B L N values, small), widened once here rather than
    # per step and channel in the kernel
    LT = triton.cdiv(L, cfg.t) * cfg.t
    Lp = LT + (1 if cfg.pf else 0)          # pf reads one row past the last tile
    # (and 16-byte aligned: the kernel reads them by 16-byte vector loads)
    if (b.dtype != torch.float32 or BN != N or Lp != L or b.data_ptr() % 16
            or c.data_ptr() % 16):
        pad = (0, BN - N, 0, Lp - L)
        b, c = TF.pad(b.float(), pad).contiguous(), TF.pad(c.float(), pad).contiguous()
    a_t = TF.pad(a.float() * 1.4426950408889634, (0, BN - N)).t().contiguous()
    h_t = torch.empty((B, BN, D), dtype=torch.float32, device=u.device)
    # BD < 32 warps: a channel's states over lanes, where only whole h_j take the polynomial
    split = cfg.bd < 32 * cfg.warps and not INTERPRET
    _ss_fwd_kernel[(B, triton.cdiv(D, cfg.bd))](
        u, delta, a_t, b, c, d, z, bias, y, h_t, L, Lp, D, 0, T=cfg.t, BD=cfg.bd, BN=BN,
        HAS_D=has_d, HAS_Z=has_z, HAS_BIAS=has_delta_bias, SOFTPLUS=bool(delta_softplus),
        POLY=0 if split else min(cfg.poly, BN), POLY_J=cfg.poly * 4 // BN if split else 0,
        EVEN_L=LT == L, PF=bool(cfg.pf),
        ASM=not INTERPRET,
        num_warps=cfg.warps, num_stages=1)
    h.copy_(h_t[:, :N].transpose(1, 2))
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
