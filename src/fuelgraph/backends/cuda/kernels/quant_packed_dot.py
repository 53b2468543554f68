"""Few-row quantized matmul (`out = x @ W.T`, x [M, K] with 1 < M <= 64) on the chunk-layout
weight copy of `quant_packed` with tensor-core dots: a program owns BLOCK_N weight rows and a
run of chunks; per step it loads the words [BLOCK_N, C, 32] (16-byte loads), dequantizes each
plane j (32 consecutive K elements of every chunk, one scale group) exactly as the GEMV does,
and multiplies it by the matching x rows: acc [BLOCK_N, BLOCK_M] += W_j [BLOCK_N, C * 32] @
x_j [C * 32, BLOCK_M] (the many weight rows fill the MMA's M side, the few activation rows its
N side, padded to 16). The plane is rounded to x's dtype for the dot, as the recipe does.

Variants (PackedDotConfig): four or eight planes joined into one dot (join; fewer dots, each a
shared-memory round trip on sm_90), in K order (nat: x then read with 16-byte loads instead of
gathered element by element), the next step's words loaded ahead (prefetch); on whole tiles
and steps the kernel drops its bounds masks (EVEN; the default split is a divisor of the
steps). For the affine 4-bit formats (Q4_0, AWQ, Q4_K: W = s q + o per 32-element plane) each
plane's two float32 constants can be precomputed once per packed copy (aff, `affine_pairs`,
0.25 bytes a weight more): one 8-byte load and one exact FMA a weight (Q4_K: and an add),
none of the per-plane scale arithmetic. Q6_K's 16-element scale groups are the two halves of
a plane row."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import next_pow2, num_sms
from .quant_packed import (_KIND, AFFINE_FORMATS, CHUNK, INTERPRET, MAGIC_BITS, NF4,
                           PACKED_FORMATS, _affine_plane, _cdiv, _lane_codes, _nf4_shfl, _plane,
                           affine_pairs, affine_ready, packed_weight)

#: formats of the dot kernel (Q6_K: its 16-element scale groups as the two halves of a plane)
DOT_FORMATS = PACKED_FORMATS


@triton.jit
def _wplane_nf4_shfl(words, j: tl.constexpr, ch, ok, s_rows, codes, E: tl.constexpr,
                     BS: tl.constexpr, EVEN: tl.constexpr):
    """NF4 plane j by warp shuffles from the lanes' `codes` (`_lane_codes`), times absmax."""
    g1 = (ch * E + j * 32) // BS
    if EVEN:
        s1 = tl.load(s_rows + g1)
    else:
        s1 = tl.load(s_rows + g1, mask=ok, other=0.0)
    if j < 4:
        h1 = words
    else:
        h1 = words >> 16
    # the shuffle reads only the index's low 5 bits, and lanes l and l + 16 hold the same
    # code: the nibble needs no mask
    return _nf4_shfl(h1 >> (4 * (j % 4)), codes) * s1


@triton.jit
def _wplane_q6k(words, j: tl.constexpr, ch, ok, s_rows, c_ptr, d, magic, E: tl.constexpr,
                BS: tl.constexpr, FMA_DEQ: tl.constexpr, EVEN: tl.constexpr):
    """Q6_K plane j [BN, C, 32]: a scale per half plane row; d [BN, C, 1] of the super-block."""
    BN: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1]
    half = tl.arange(0, 2)[None, None, :, None]
    g6 = ((ch * E + j * 32)[:, :, :, None] + half * 16) // BS                    # [1, C, 2, 1]
    if EVEN:
        s6 = tl.load(s_rows[:, :, :, None] + g6)
    else:
        s6 = tl.load(s_rows[:, :, :, None] + g6, mask=ok[:, :, :, None], other=0)
    # int8 scale through 2^23's mantissa, times d (exact, as gguf-py)
    s6 = d[:, :, :, None] * (((s6.to(tl.int32) ^ 128) | magic).to(tl.float32, bitcast=True)
                             - 8388736.0)
    w6 = _plane(5, tl.reshape(words, (BN, C, 2, 16)), j, s6, 0, c_ptr, magic, FMA_DEQ)
    return tl.reshape(w6, (BN, C, 32))


@triton.jit
def _wplane_scaled(KIND: tl.constexpr, words, j: tl.constexpr, ch, ok, s_rows, z_rows, c_ptr,
                   d, dmin, magic, E: tl.constexpr, BS: tl.constexpr, FMA_DEQ: tl.constexpr,
                   EVEN: tl.constexpr, AFF: tl.constexpr):
    """Plane j of the other formats from its scales (AFF: its (a, b) pair)."""
    g = (ch * E + j * 32) // BS
    if AFF:
        if EVEN:
            pr = tl.load(s_rows + g)
        else:
            pr = tl.load(s_rows + g, mask=ok, other=0)
        a = pr.to(tl.int32).to(tl.float32, bitcast=True)                  # low word
        b = (pr >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        w = _affine_plane(KIND, words, j, a, b, magic)
    else:
        if EVEN:
            s = tl.load(s_rows + g)
        else:
            s = tl.load(s_rows + g, mask=ok, other=0)
        if (KIND == 2 or KIND == 4) and EVEN:
            zq = tl.load(z_rows + g).to(tl.int32)
        elif KIND == 2 or KIND == 4:
            zq = tl.load(z_rows + g, mask=ok, other=0).to(tl.int32)
        else:
            zq = 0
        if KIND == 4:   # 6-bit scale and min to float through 2^23's mantissa (exact; I2F is a
            #             quarter-rate instruction), times d / dmin as gguf-py does
            s = d * ((s.to(tl.int32) | magic).to(tl.float32, bitcast=True) - 8388608.0)
            zq = dmin * ((zq | magic).to(tl.float32, bitcast=True) - 8388608.0)
        else:
            s = s.to(tl.float32)
        w = _plane(KIND, words, j, s, zq, c_ptr, magic, FMA_DEQ)
    return w


@triton.jit
def _wplane(KIND: tl.constexpr, words, j: tl.constexpr, ch, ok, s_rows, z_rows, c_ptr, d, dmin,
            magic, E: tl.constexpr, BS: tl.constexpr, FMA_DEQ: tl.constexpr,
            EVEN: tl.constexpr = False, AFF: tl.constexpr = False, SHFL: tl.constexpr = False):
    """Plane j [BN, C, 32] (float32) of the words: its scales loaded and applied. AFF: s_rows
    holds the plane's (a, b) float32 pair (`affine_pairs`) as one int64. SHFL (NF4): d holds
    the lanes' code values (`_lane_codes`), looked up by warp shuffles."""
    if KIND == 1 and SHFL:
        w = _wplane_nf4_shfl(words, j, ch, ok, s_rows, d, E, BS, EVEN)
    elif KIND == 5:
        w = _wplane_q6k(words, j, ch, ok, s_rows, c_ptr, d, magic, E, BS, FMA_DEQ, EVEN)
    else:
        w = _wplane_scaled(KIND, words, j, ch, ok, s_rows, z_rows, c_ptr, d, dmin, magic, E, BS,
                           FMA_DEQ, EVEN, AFF)
    return w


@triton.jit
def _wquad(KIND: tl.constexpr, words, j0: tl.constexpr, ch, ok, s_rows, z_rows, c_ptr, d, dmin,
           magic, E: tl.constexpr, BS: tl.constexpr, FMA_DEQ: tl.constexpr, DT: tl.constexpr,
           EVEN: tl.constexpr = False, AFF: tl.constexpr = False, SHFL: tl.constexpr = False):
    """Planes j0 .. j0 + 3 side by side, [BN, C, 32, 2, 2] in DT (plane j0 + 2 h + i at
    [..., i, h]): the operand of one dot over four planes."""
    w0 = _wplane(KIND, words, j0, ch, ok, s_rows, z_rows, c_ptr, d, dmin, magic, E, BS, FMA_DEQ,
                 EVEN, AFF, SHFL)
    w1 = _wplane(KIND, words, j0 + 1, ch, ok, s_rows, z_rows, c_ptr, d, dmin, magic, E, BS,
                 FMA_DEQ, EVEN, AFF, SHFL)
    w2 = _wplane(KIND, words, j0 + 2, ch, ok, s_rows, z_rows, c_ptr, d, dmin, magic, E, BS,
                 FMA_DEQ, EVEN, AFF, SHFL)
    w3 = _wplane(KIND, words, j0 + 3, ch, ok, s_rows, z_rows, c_ptr, d, dmin, magic, E, BS,
                 FMA_DEQ, EVEN, AFF, SHFL)
    return tl.join(tl.join(w0.to(DT), w1.to(DT)), tl.join(w2.to(DT), w3.to(DT)))


@triton.jit
def _x_tile(x_cols, k, k_ok, m_ok, EVEN: tl.constexpr):
    """x rows at elements k [KT] of the dot's K order: [KT, BM]."""
    if EVEN:
        return tl.load(x_cols + k[:, None])
    return tl.load(x_cols + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)


@triton.jit
def _packed_dot_kernel(x_ptr, q_ptr, s_ptr, z_ptr, c_ptr, out_ptr, M, N, kw,
                       s_row, nch, stride_x, stride_o, magic, STEPS: tl.constexpr,
                       KIND: tl.constexpr,
                       E: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_M: tl.constexpr, C: tl.constexpr, ATOMIC: tl.constexpr,
                       PREC: tl.constexpr, FMA_DEQ: tl.constexpr,
                       PREFETCH: tl.constexpr = False, JOIN: tl.constexpr = 1,
                       NAT: tl.constexpr = False, EVEN: tl.constexpr = False,
                       AFF: tl.constexpr = False, SHFL: tl.constexpr = False):
    """out[M, N] (+)= x[M, K] @ W.T over chunks [pid_s * STEPS * C, ...) of rows
    [pid_n * BLOCK_N, ...) and x rows [pid_m * BLOCK_M, ...). PREFETCH: the next step's words
    are loaded before the current ones are multiplied (in registers; the loop is otherwise
    one DRAM round trip a step). JOIN = 4: four planes side by side in one dot (K = C * 128,
    x gathered in the matching order): a quarter of the dots, each a shared-memory round trip
    with barriers (wgmma on sm_90); JOIN = 8: all eight planes of 4-bit formats (Q8_0: four).
    NAT (with JOIN): the joined planes permuted back into K order (plane-major, as the chunk
    holds them), so x is read in its own order, 16-byte loads of contiguous elements, rather
    than gathered element by element (the permutation is free: the operand goes through
    shared memory on its way to the MMA anyway). EVEN: no bounds masks (N, M and the chunks
    are whole tiles / steps). AFF: s_ptr holds the (a, b) pairs of `affine_pairs` [N, K / 32]
    (Q4_0, AWQ, Q4_K; BS = 32), one 8-byte load and one FMA (Q4_K: and an add) a weight.
    SHFL (NF4): the code table looked up by warp shuffles (`_nf4_shfl`) instead of tl.gather
    (a shared-memory table behind a barrier per plane)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows = offs_n.to(tl.int64)[:, None, None]
    q_rows = q_ptr + rows * kw
    s_rows = s_ptr + rows * s_row
    z_rows = z_ptr + rows * s_row
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x                # [1, BM]
    if KIND == 4:       # Q4_K: c_ptr holds [N, 2 * nch] f16 (d, dmin) pairs
        c_ptr = c_ptr + rows * (2 * nch)
    if KIND == 5:       # Q6_K: c_ptr holds [N, nch / 2] f16 d
        c_ptr = c_ptr + rows * (nch // 2)
    c = tl.arange(0, C)[None, :, None]
    t = tl.arange(0, 32)[None, None, :]
    kt = tl.arange(0, C * 32)                                                # plane column
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if KIND == 1 and SHFL:
        codes = _lane_codes(c_ptr, tl.zeros((BLOCK_N, C, 32), tl.int32))
    else:
        codes = 0.0
    if PREFETCH:
        ch = pid_s * STEPS * C + c
        if EVEN:
            nxt = tl.load(q_rows + ch * 32 + t)
        else:
            nxt = tl.load(q_rows + ch * 32 + t,
                          mask=n_ok[:, None, None] & (ch < nch) & (t < 32), other=0)
    for i in range(STEPS):
        ch0 = (pid_s * STEPS + i) * C
        ch = ch0 + c
        ok = n_ok[:, None, None] & (ch < nch)
        if PREFETCH:
            words = nxt
            if i + 1 < STEPS:
                if EVEN:
                    nxt = tl.load(q_rows + (ch + C) * 32 + t)
                else:
                    nxt = tl.load(q_rows + (ch + C) * 32 + t,
                                  mask=n_ok[:, None, None] & (ch + C < nch) & (t < 32), other=0)
        elif EVEN:
            words = tl.load(q_rows + ch * 32 + t)
        else:
            words = tl.load(q_rows + ch * 32 + t, mask=ok & (t < 32), other=0)
        k_ok = (ch0 + kt // 32) < nch
        if KIND == 4 and not AFF:
            if EVEN:
                d = tl.load(c_ptr + 2 * ch).to(tl.float32)
                dmin = tl.load(c_ptr + 2 * ch + 1).to(tl.float32)
            else:
                d = tl.load(c_ptr + 2 * ch, mask=ok, other=0.0).to(tl.float32)
                dmin = tl.load(c_ptr + 2 * ch + 1, mask=ok, other=0.0).to(tl.float32)
        elif KIND == 5:
            if EVEN:
                d = tl.load(c_ptr + ch // 2).to(tl.float32)
            else:
                d = tl.load(c_ptr + ch // 2, mask=ok, other=0.0).to(tl.float32)
            dmin = 0.0
        else:
            d = codes
            dmin = 0.0
        if JOIN == 8 and E == 256:     # all 8 planes of a 4-bit chunk in one dot
            kk = tl.arange(0, C * 256)          # (chunk, t, i, h, g): plane 4 g + 2 h + i
            if NAT:                             # (chunk, g, h, i, t): K order
                k = (ch0 + kk // 256) * E + kk % 256
            else:
                k = ((ch0 + kk // 256) * E
                     + (4 * (kk % 2) + 2 * ((kk // 2) % 2) + (kk // 4) % 2) * 32 + (kk // 8) % 32)
            xt = _x_tile(x_cols, k, (ch0 + kk // 256) < nch, m_ok, EVEN)
            wj = tl.join(_wquad(KIND, words, 0, ch, ok, s_rows, z_rows, c_ptr, d, dmin, magic,
                                E, BS, FMA_DEQ, xt.dtype, EVEN, AFF, SHFL),
                         _wquad(KIND, words, 4, ch, ok, s_rows, z_rows, c_ptr, d, dmin, magic,
                                E, BS, FMA_DEQ, xt.dtype, EVEN, AFF, SHFL))  # [BN, C, 32, 2, 2, 2]
            if NAT:
                wj = tl.permute(wj, (0, 1, 5, 4, 3, 2))                 # [BN, C, 2, 2, 2, 32]
            acc = tl.dot(tl.reshape(wj, (BLOCK_N, C * 256)), xt, acc, input_precision=PREC)
        elif JOIN >= 4:
            for jg in tl.static_range(E // 128):
                kk = tl.arange(0, C * 128)      # (chunk, t, i, h): plane 4 jg + 2 h + i
                if NAT:                         # (chunk, h, i, t): K order
                    k = (ch0 + kk // 128) * E + jg * 128 + kk % 128
                else:
                    k = ((ch0 + kk // 128) * E + (4 * jg + 2 * (kk % 2) + (kk // 2) % 2) * 32
                         + (kk // 4) % 32)
                xt = _x_tile(x_cols, k, (ch0 + kk // 128) < nch, m_ok, EVEN)
                wj = _wquad(KIND, words, 4 * jg, ch, ok, s_rows, z_rows, c_ptr, d, dmin, magic,
                            E, BS, FMA_DEQ, xt.dtype, EVEN, AFF, SHFL)  # [BN, C, 32, 2, 2]
                if NAT:
                    wj = tl.permute(wj, (0, 1, 4, 3, 2))                # [BN, C, 2, 2, 32]
                acc = tl.dot(tl.reshape(wj, (BLOCK_N, C * 128)), xt, acc, input_precision=PREC)
        else:
            for j in tl.static_range(E // 32):
                w = _wplane(KIND, words, j, ch, ok, s_rows, z_rows, c_ptr, d, dmin, magic, E, BS,
                            FMA_DEQ, EVEN, AFF, SHFL)                           # [BN, C, 32]
                k = (ch0 + kt // 32) * E + j * 32 + kt % 32                        # [C * 32]
                xt = _x_tile(x_cols, k, k_ok, m_ok, EVEN)
                w2 = tl.reshape(w, (BLOCK_N, C * 32)).to(xt.dtype)
                acc = tl.dot(w2, xt, acc, input_precision=PREC)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
    o_mask = n_ok[:, None] & m_ok[None, :]
    if ATOMIC:
        tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")
    elif EVEN:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty))
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@dataclass(frozen=True)
class PackedDotConfig:
    """block_n weight rows, block_m x rows (>= 16, the dot's N side), `chunks` chunks a step;
    `split` programs along K (0: from the SM count)."""
    block_n: int = 64
    block_m: int = 16
    chunks: int = 2
    split: int = 0
    num_warps: int = 4
    num_stages: int = 1
    fma: int = 1
    prefetch: int = 0   # next step's words loaded ahead into registers
    join: int = 1       # planes a dot (1, 4 or 8; 8 is 4 for Q8_0)
    nat: int = 0        # with join: the joined planes in K order, x read contiguously
    aff: int = 0        # Q4_0 / AWQ / Q4_K: the (a, b) pair of each plane (`affine_pairs`)
    shfl: int = 0       # NF4: the code table read by warp shuffles (compiled kernels only)
    maxnreg: int = 0    # registers a thread at most (0: the compiler's choice; 128 lets four
    #                     programs share an SM)

    def tag(self) -> str:
        return (f"packed_dot[n{self.block_n},m{self.block_m},c{self.chunks},s{self.split},"
                f"w{self.num_warps},st{self.num_stages}" + ("" if self.fma else ",nofma")
                + (",pf" if self.prefetch else "") + (f",j{self.join}" if self.join > 1 else "")
                + (",nat" if self.nat and self.join > 1 else "") + (",aff" if self.aff else "")
                + (",shfl" if self.shfl else "")
                + (f",r{self.maxnreg}" if self.maxnreg else "") + "]")


def _even_split(total: int, want: int) -> int:
    """The divisor of `total` steps nearest to `want` splits (the larger on a tie) within
    2/3..3/2 of it, else `want`: whole steps per program let the kernel drop its bounds
    masks (EVEN; N = K = 8192 on 128 row tiles: 4 rather than 3)."""
    near = [d for d in range(max(1, -(-2 * want // 3)), 3 * want // 2 + 1) if total % d == 0]
    return min(near, key=lambda d: (abs(d - want), -d)) if near else want


def run_packed_dot(fmt: int, x, w0, w1, w2, i0: int, k: int, n: int,
                   config: PackedDotConfig | None = None):
    """x [..., K] @ W.T through the packed copy of the weight and tensor-core dots (arguments as
    `quant.run`). Returns [..., N] in x's dtype."""
    cfg = config or PackedDotConfig()
    pw = packed_weight(fmt, w0, w1, w2, i0, k, n)
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    e = CHUNK[fmt]
    nch = k // e
    c = min(cfg.chunks, next_pow2(nch))
    tiles = _cdiv(n, cfg.block_n) * _cdiv(m, cfg.block_m)
    total = _cdiv(nch, c)
    split = cfg.split
    if split <= 0:      # about 3 programs an SM stream the weight
        want = 3 * num_sms(x.device)
        split = _even_split(total, 1 if tiles >= want else max(1, min(total, want // tiles)))
    steps = _cdiv(total, split)
    split = _cdiv(total, steps)
    even = n % cfg.block_n == 0 and m % cfg.block_m == 0 and nch == split * steps * c
    grid = (_cdiv(n, cfg.block_n), _cdiv(m, cfg.block_m), split)
    atomic = split > 1
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    z = pw.zeros if pw.zeros is not None else pw.scales
    table = pw.table if pw.table is not None else w2 if fmt == NF4 else pw.scales
    aff = bool(cfg.aff) and fmt in AFFINE_FORMATS and affine_ready(pw)
    scales, group = (affine_pairs(pw), 32) if aff else (pw.scales, pw.group)
    _packed_dot_kernel[grid](
        x2, pw.codes, scales, z, table, out, m, n,
        pw.codes.shape[1], scales.shape[1], nch, x2.stride(0), out.stride(0), MAGIC_BITS,
        STEPS=steps, KIND=_KIND[fmt], E=e, BS=group, BLOCK_N=cfg.block_n,
        BLOCK_M=cfg.block_m, C=c, ATOMIC=atomic,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", FMA_DEQ=bool(cfg.fma),
        PREFETCH=bool(cfg.prefetch), JOIN=cfg.join, NAT=bool(cfg.nat) and cfg.join > 1,
        EVEN=even, AFF=aff, SHFL=fmt == NF4 and bool(cfg.shfl) and not INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
