"""One-row quantized matmul (`out = x @ W.T`, x [1, K], W [N, K]; Q4_0, Q8_0, Q4_K, Q6_K, NF4,
AWQ) on a GPU-friendly copy of the weight, repacked once per weight tensor and cached with it
(`packed_weight`).

Why: GGUF blocks (Q4_0: 18 bytes, Q8_0: 34) are not 16-byte aligned, so the storage-order GEMV
(`quant_rows`) reads them in 2-byte words and streams 0.6-1.1 TB/s. Here the codes and the
scales live in separate, aligned arrays:

* codes: int32 words `[N, K / E * 32]`, one "chunk" of E elements of a row = 32 consecutive
  words. 4-bit formats (Q4_0, NF4, AWQ; E = 256): element j * 32 + t of a chunk is nibble j
  (bits 4j..4j+3) of word t. Q8_0 and Q6_K (E = 128): element j * 32 + t is byte j of word
  t, stored as q + 128 / q + 32 (unsigned; Q6_K's 6 bits a byte: 1.0 byte a weight, not 0.82).
  So "plane" j of a [chunks, rows, 32] word tile holds 32 consecutive elements of K, whose x
  values are one contiguous load, and one scale group (groups are multiples of 32 elements;
  Q6_K's 16-element groups: one per half plane row, so a thread's words span one of them).
* scales `[N, K / group]` in the format's own dtype (f16 d for Q4_0 / Q8_0 and AWQ, float32
  absmax for NF4, the caller's tensor itself), AWQ zeros `[N, K / group]` uint8; Q4_K: the
  6-bit sub-block scales and mins as uint8 [N, K / 32] and the (d, dmin) f16 pairs; Q6_K: the
  int8 scales [N, K / 16] and d [N, K / 256].

Dequantized weights equal the format's dequantizer's (checked with DEQ=True in the tests): NF4
as code[q] * absmax, Q4_K as fma(q, d sc, -dmin m) and Q6_K as (d sc) (q - 32) (the same single
rounding as gguf-py), bit for bit; Q4_0 d (q - 8), Q8_0 d q and AWQ (q - z) s are exact
products in float32, formed here by one FMA from the code OR-ed into 2^23's mantissa with both
factors exact (`_q4_0_fma`), which gives the exact product as well (Q6_K: its single rounding,
the code placed so that the constant factor stays exact), for finite scales (an
infinite one gives NaN where the dequantizer gives +-inf, a zero product may be +0 for -0;
fma=0 keeps subtract-then-scale).

A program owns BLOCK_N rows and a run of chunks (split-K by float32 atomics when `split` > 1),
loads C chunks of its rows a step (16-byte loads), optionally the next step's words before
multiplying the current ones into registers (PREFETCH), or, with STAGES > 1, through shared
memory: the loop is a `tl.range(num_stages=STAGES)`, which Triton 3.6 pipelines with cp.async
although no dot consumes the loads (STAGES - 1 steps in flight without holding them in
registers; x is then loaded un-broadcast, XB=False, or it too would be copied once per row).
With 2 warps on 16 rows (4 warps on 32) a thread holds 4 rows of the same words, so an x value
and the per-plane arithmetic on scales serve 4 rows: sm_90 SASS 3.96 instructions a weight for
Q4_0 against 4.20 for the register-prefetching 16 x 4 launch (bench/sass_quant_rows.py).

Optional per launch (PackedConfig): each plane's two float32 constants of the affine 4-bit
formats (Q4_0, AWQ, Q4_K: W = s q + o) precomputed once per packed copy (aff, `affine_pairs`:
0.25 bytes a weight, exact, see there); NF4's code table read by warp shuffles from the
lanes' registers (shfl: no shared-memory table behind a barrier).

Shapes the layout does not take (K not a multiple of E, group sizes not multiples of 32) keep
the storage-order kernels (`packable`)."""
from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from .common import next_pow2, num_sms
from .quant_rows import MAGIC_BITS
from .quant_tiles import AWQ, NF4, Q4_0, Q4_K, Q6_K, Q8_0

#: elements of one chunk (32 words) per format; scale group elements for the GGUF formats
CHUNK = {Q4_0: 256, NF4: 256, AWQ: 256, Q8_0: 128, Q4_K: 256, Q6_K: 128}
PACKED_FORMATS = frozenset(CHUNK)
_KIND = {Q4_0: 0, NF4: 1, AWQ: 2, Q8_0: 3, Q4_K: 4, Q6_K: 5}
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)      # column 8c + e of AWQ sits in nibble AWQ_REVERSE[e]


@triton.jit
def _nibble_view(KIND: tl.constexpr, words, j: tl.constexpr, magic):
    """Plane j's nibble of a Q4_0 (KIND 0) or AWQ (KIND 2) word at bit SH of a view of the word,
    OR-ed into 2^23's mantissa: v = 2^23 + 2^SH q as float32 (exact). Q4_0: SH in 8..16 (j < 2:
    words << 8; j < 5: words; else words >> 12); AWQ: SH = 12 or 16 (words << 12, << 4, >> 4,
    >> 12 for nibbles 0-1, 2-3, 4-5, 6-7). AFFINE_SHIFTS lists the same SH."""
    if KIND == 0:
        SH: tl.constexpr = 8 + 4 * j if j < 2 else (4 * j if j < 5 else 4 * j - 12)
        if j < 2:
            v = words << 8
        elif j < 5:
            v = words
        else:
            v = words >> 12
    else:
        SH: tl.constexpr = 12 + 4 * (j % 2)
        if j < 2:
            v = words << 12
        elif j < 4:
            v = words << 4
        elif j < 6:
            v = words >> 4
        else:
            v = words >> 12
    return ((v & (15 << SH)) | magic).to(tl.float32, bitcast=True)


@triton.jit
def _q4_0_fma(words, j: tl.constexpr, s, magic):
    """Q4_0 plane j as one FMA a weight: with v = 2^23 + 2^SH q (`_nibble_view`),
    d (q - 8) = v * (d 2^-SH) - d (2^(23 - SH) + 8): both factors exact (d has 11 significant
    bits, 2^(23 - SH) + 8 at most 13), so the fused result is the exact product, the
    dequantizer's value for finite d (an infinite d gives NaN instead of +-inf)."""
    SH: tl.constexpr = 8 + 4 * j if j < 2 else (4 * j if j < 5 else 4 * j - 12)
    return tl.fma(_nibble_view(0, words, j, magic), s * (1.0 / (1 << SH)),
                  s * -(8.0 + (1 << (23 - SH))))


@triton.jit
def _awq_fma(words, j: tl.constexpr, s, zq, magic):
    """AWQ plane j as one FMA a weight, as `_q4_0_fma` with the zero z in place of 8:
    (q - z) s = v (s 2^-SH) - s (2^(23 - SH) + z), the second factor at most 12 bits."""
    SH: tl.constexpr = 12 + 4 * (j % 2)
    zf = (zq | magic).to(tl.float32, bitcast=True) - (8388608.0 - (1 << (23 - SH)))  # exact
    return tl.fma(_nibble_view(2, words, j, magic), s * (1.0 / (1 << SH)), -(s * zf))


@triton.jit
def _nf4_lookup(q, c_ptr):
    """NF4 code values of the 4-bit indices q (any shape), by tl.gather from the table."""
    table = tl.load(c_ptr + tl.arange(0, 16))
    flat = tl.reshape(q, (q.numel,))
    return tl.reshape(tl.gather(table, flat, 0), q.shape)


@triton.jit
def _lane_codes(c_ptr, like):
    """NF4's code value of this lane's index (lane % 16), as int32 bits in like's shape: the
    table a warp shuffle reads (`_nf4_shfl`). Sixteen uniform loads and selects, once."""
    lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [like], dtype=tl.int32,
                                     is_pure=True, pack=1) & 15
    v = tl.zeros(like.shape, tl.float32)
    for i in tl.static_range(16):
        v = tl.where(lane == i, tl.load(c_ptr + i), v)
    return v.to(tl.int32, bitcast=True)


@triton.jit
def _nf4_shfl(q, codes):
    """code[q % 16] (float32) by one warp shuffle a weight from the lanes' `codes` (lane l
    holds code[l % 16]; the shuffle takes q's low 5 bits): no shared-memory table, no
    barrier."""
    v = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 31, 0xffffffff;", "=r,r,r",
                                  [codes, q], dtype=tl.int32, is_pure=True, pack=1)
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _nf4_codes(words, j: tl.constexpr, c_ptr, codes=0, SHFL: tl.constexpr = False):
    """NF4 code values of plane j of the words (float32, the words' shape); SHFL: by warp
    shuffles from the lanes' `codes` (`_lane_codes`; the index needs no mask, see there)."""
    if j < 4:
        h = words
    else:
        h = words >> 16
    if SHFL:
        return _nf4_shfl(h >> (4 * (j % 4)), codes)
    return _nf4_lookup((h >> (4 * (j % 4))) & 15, c_ptr)


#: nibble position SH of plane j in the view `_affine_plane` takes of a word (the pairs fold
#: 2^-SH in): Q4_0 and AWQ as `_nibble_view`, Q4_K the word and the word >> 16
AFFINE_SHIFTS = {Q4_0: (8, 12, 8, 12, 16, 8, 12, 16), AWQ: (12, 16) * 4, Q4_K: (0, 4, 8, 12) * 2}
AFFINE_FORMATS = frozenset(AFFINE_SHIFTS)


@triton.jit
def _affine_plane(KIND: tl.constexpr, words, j: tl.constexpr, a, b, magic):
    """Plane j of a 4-bit affine format (W = s q + o per 32-element plane) from its pair (a, b)
    (`affine_pairs`): the nibble at bit SH of a view of the word, OR-ed into 2^23's mantissa,
    is v = 2^23 + 2^SH q (exact). Q4_0 / AWQ: W = fma(v, a, b) with a = s 2^-SH and
    b = o - s 2^(23 - SH), both exact (see `affine_pairs`), so the fused result is the exact
    product. Q4_K: W = fma(v - 2^23, a, b) with a = (d sc) 2^-SH, b = -(dmin m): the product
    (d sc) q is exact (at most 21 significant bits) and the sum is rounded once, as gguf-py
    rounds (d sc) q - dmin m."""
    if KIND != 4:       # Q4_0, AWQ
        return tl.fma(_nibble_view(KIND, words, j, magic), a, b)
    else:               # Q4_K
        if j < 4:
            h = words
        else:
            h = words >> 16
        SH: tl.constexpr = 4 * (j % 4)
        qf = ((h & (15 << SH)) | magic).to(tl.float32, bitcast=True) - 8388608.0   # 2^SH q
        return tl.fma(qf, a, b)


@triton.jit
def _x_plane(x_ptr, e0, t, words, ch, nch, XB: tl.constexpr, EVEN: tl.constexpr):
    """x at elements e0 + t (float32): [C, 1, H, 32 / H], or XB: the words' shape."""
    xp = x_ptr + e0 + t
    if XB:
        xp = tl.broadcast_to(xp, words.shape)
    if EVEN:
        xv = tl.load(xp)
    else:
        xv = tl.load(xp, mask=(ch < nch) & (t < 32), other=0.0)
    return xv.to(tl.float32)


@triton.jit
def _plane(KIND: tl.constexpr, words, j: tl.constexpr, s, zq, c_ptr, magic,
           FMA_DEQ: tl.constexpr):
    """Dequantized plane j (float32, the words' shape) of the int32 words, from its scale s
    (float32) and (AWQ) zero zq (int32), both [C, BN, 1, 1]."""
    if KIND == 5 and FMA_DEQ:   # Q6_K (u = q + 32, 6 bits): byte j to bits 16..21, then
        #   (d sc) q = f (d sc 2^-16) - (d sc) 160 with f = 2^23 + 2^16 u: d sc has at most 19
        #   significant bits (f16 d times an int8), 160 = 5 * 2^5 has 3, so both products are
        #   exact and the FMA rounds the exact (d sc) q once, as gguf-py does
        if j == 0:
            v = words << 16
        elif j == 1:
            v = words << 8
        elif j == 2:
            v = words
        else:
            v = words >> 8
        f = ((v & 0x3F0000) | magic).to(tl.float32, bitcast=True)
        w = tl.fma(f, s * (1.0 / 65536), s * -160.0)
    elif KIND == 3 or KIND == 5:  # Q8_0 (u = q + 128) / Q6_K (u = q + 32): byte j to bits 8..15
        if j == 0:
            v = words << 8
        elif j == 1:
            v = words
        elif j == 2:
            v = words >> 8
        else:
            v = words >> 16
        f = ((v & 0xFF00) | magic).to(tl.float32, bitcast=True)           # 2^23 + 256 u
        if KIND == 5:   # (d sc) q, one rounding as gguf-py: 256 q exact, times (d sc) / 256
            w = (f - 8396800.0) * (s * 0.00390625)
        elif FMA_DEQ:   # d q = f (d / 256) - d (2^15 + 128): exact factors, exact result
            w = tl.fma(f, s * 0.00390625, s * -32896.0)
        else:
            w = (f - 8421376.0) * (s * 0.00390625)                         # 256 q, exact
    elif KIND == 4:     # Q4_K: (d sc) q - dmin m, s = d sc and zq = dmin m (float32) here
        if j < 4:
            h = words
        else:
            h = words >> 16
        SH: tl.constexpr = 4 * (j % 4)
        qf = ((h & (15 << SH)) | magic).to(tl.float32, bitcast=True) - 8388608.0  # 2^SH q
        # exact product, one rounding as gguf-py's; * -1 (not 0 - m) keeps the sign of a zero
        w = tl.fma(qf, s * (1.0 / (1 << SH)), zq * -1.0)
    elif KIND == 0 and FMA_DEQ:
        w = _q4_0_fma(words, j, s, magic)
    elif KIND == 2 and FMA_DEQ:
        w = _awq_fma(words, j, s, zq, magic)
    else:
        if j < 4:
            h = words
        else:
            h = words >> 16
        SH: tl.constexpr = 4 * (j % 4)
        if KIND == 1:   # NF4: code[q] * absmax
            w = _nf4_lookup((h >> SH) & 15, c_ptr) * s
        else:           # the nibble stays in place: 2^23 + 2^SH q, exact
            f = ((h & (15 << SH)) | magic).to(tl.float32, bitcast=True)
            if KIND == 0:   # Q4_0: d * (q - 8)
                w = (f - (8388608.0 + 8.0 * (1 << SH))) * (s * (1.0 / (1 << SH)))
            else:           # AWQ: (q - z) * s
                zm = 8388608.0 + (zq << SH).to(tl.float32)
                w = (f - zm) * (s * (1.0 / (1 << SH)))
    return w


@triton.jit
def _word_index(H: tl.constexpr):
    """Word t of a chunk as [1, 1, H, 32 / H] (t = h * 32 / H + u): with H = 2 a thread's
    16-byte vector covers one half and the layout repeats it over the other half, so each
    thread holds 8 words of a (chunk, row) and loads / converts that row's scale once for 8."""
    W: tl.constexpr = 32 // H
    return (tl.arange(0, H)[:, None] * W + tl.arange(0, W)[None, :])[None, None, :, :]


@triton.jit
def _load_words(q_rows, n_ok, ch, nch, H: tl.constexpr, EVEN: tl.constexpr):
    """The words [C, BN, H, 32 / H] of chunks ch [C, 1, 1, 1] of the rows q_rows [1, BN, 1, 1]."""
    t = _word_index(H)
    ptrs = q_rows + ch * 32 + t
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=n_ok[None, :, None, None] & (ch < nch) & (t < 32), other=0)


@triton.jit
def _chunk_step(KIND: tl.constexpr, acc, words, ch, x_ptr, s_rows, z_rows, c_ptr, out_rows,
                n_ok, nch, magic, E: tl.constexpr, BS: tl.constexpr, DEQ: tl.constexpr,
                EVEN: tl.constexpr, XB: tl.constexpr, FMA_DEQ: tl.constexpr, H: tl.constexpr,
                PAIR: tl.constexpr = False, codes=0, SHFL: tl.constexpr = False,
                AFF: tl.constexpr = False):
    """acc [C, BN, H, 32 / H] += every plane of the word tile `words` (same shape; chunks ch
    [C, 1, 1, 1]) times the matching x; DEQ: store the planes at out_rows [1, BN, 1, 1] +
    element instead. XB: x loaded as a full tile of the words' shape (their own register
    layout; no exchange through shared memory) rather than [C, 1, H, 32 / H] and broadcast."""
    t = _word_index(H)
    g_ok = n_ok[None, :, None, None] & (ch < nch)
    PLANES: tl.constexpr = E // 32
    if KIND == 5:       # Q6_K: the super-block's d (f16 at c_ptr [1, BN, 1, 1], 2 chunks each)
        if EVEN:
            d = tl.load(c_ptr + ch // 2).to(tl.float32)
        else:
            d = tl.load(c_ptr + ch // 2, mask=g_ok, other=0.0).to(tl.float32)
    if AFF:     # Q4_0 / AWQ / Q4_K: each plane's (a, b) pair (`affine_pairs`, int64 at s_rows)
        for ja in tl.static_range(PLANES):
            ea = ch * E + ja * 32
            if EVEN:
                pr = tl.load(s_rows + ea // 32)
            else:
                pr = tl.load(s_rows + ea // 32, mask=g_ok, other=0)
            wa = _affine_plane(KIND, words, ja, pr.to(tl.int32).to(tl.float32, bitcast=True),
                               (pr >> 32).to(tl.int32).to(tl.float32, bitcast=True), magic)
            if DEQ:
                tl.store(out_rows + ea + t, wa, mask=g_ok & (t < 32))
            else:
                acc += wa * _x_plane(x_ptr, ea, t, words, ch, nch, XB, EVEN)
        return acc
    if KIND == 4:       # Q4_K: the super-block's d, dmin (f16 pairs at c_ptr [1, BN, 1, 1])
        if EVEN:
            d = tl.load(c_ptr + 2 * ch).to(tl.float32)
            dmin = tl.load(c_ptr + 2 * ch + 1).to(tl.float32)
        else:
            d = tl.load(c_ptr + 2 * ch, mask=g_ok, other=0.0).to(tl.float32)
            dmin = tl.load(c_ptr + 2 * ch + 1, mask=g_ok, other=0.0).to(tl.float32)
    if PAIR:    # NF4, blocks of 64+: a block's two planes as (c0 x0 + c1 x1) * absmax, one
        #         multiply less a weight than code * absmax * x (the table lookup is the limit)
        for jp in tl.static_range(PLANES // 2):
            e0 = ch * E + jp * 64
            if EVEN:
                s = tl.load(s_rows + e0 // BS)
            else:
                s = tl.load(s_rows + e0 // BS, mask=g_ok, other=0)
            x0 = _x_plane(x_ptr, e0, t, words, ch, nch, XB, EVEN)
            x1 = _x_plane(x_ptr, e0 + 32, t, words, ch, nch, XB, EVEN)
            p = _nf4_codes(words, 2 * jp, c_ptr, codes, SHFL) * x0
            p += _nf4_codes(words, 2 * jp + 1, c_ptr, codes, SHFL) * x1
            acc += p * s.to(tl.float32)
        return acc
    for j in tl.static_range(PLANES):
        e0 = ch * E + j * 32                                                # [C, 1, 1, 1]
        if KIND == 5:   # Q6_K: 16-element scale groups, one per half of a plane row (H >= 2)
            g = (e0 + tl.arange(0, H)[None, None, :, None] * (32 // H)) // BS
        else:
            g = e0 // BS
        if EVEN:
            s = tl.load(s_rows + g)
        else:
            s = tl.load(s_rows + g, mask=g_ok, other=0)
        if KIND == 2 or KIND == 4:
            if EVEN:
                zq = tl.load(z_rows + g).to(tl.int32)
            else:
                zq = tl.load(z_rows + g, mask=g_ok, other=0).to(tl.int32)
        else:
            zq = 0
        if KIND == 4:   # the sub-block's scale and min, as gguf-py forms them (exact); the
            #             6-bit integers become floats through 2^23's mantissa (I2F is slow)
            s = d * ((s.to(tl.int32) | magic).to(tl.float32, bitcast=True) - 8388608.0)
            zq = dmin * ((zq | magic).to(tl.float32, bitcast=True) - 8388608.0)
        elif KIND == 5:     # int8 scale through 2^23's mantissa, times d (exact, as gguf-py)
            s = d * (((s.to(tl.int32) ^ 128) | magic).to(tl.float32, bitcast=True) - 8388736.0)
        else:
            s = s.to(tl.float32)
        w = _plane(KIND, words, j, s, zq, c_ptr, magic, FMA_DEQ)
        if DEQ:
            tl.store(out_rows + e0 + t, w, mask=g_ok & (t < 32))
        else:
            acc += w * _x_plane(x_ptr, e0, t, words, ch, nch, XB, EVEN)
    return acc


@triton.jit
def _packed_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, c_ptr, out_ptr, N, kw, s_row, nch, magic,
                        STEPS: tl.constexpr, KIND: tl.constexpr, E: tl.constexpr,
                        BS: tl.constexpr, BLOCK_N: tl.constexpr, C: tl.constexpr,
                        ATOMIC: tl.constexpr, PREFETCH: tl.constexpr, EVEN: tl.constexpr,
                        XB: tl.constexpr = True, FMA_DEQ: tl.constexpr = False,
                        H: tl.constexpr = 1, DEQ: tl.constexpr = False,
                        STAGES: tl.constexpr = 1, PAIR: tl.constexpr = False,
                        SHFL: tl.constexpr = False, AFF: tl.constexpr = False):
    """out[0, N] (+)= x[0, K] @ W.T over chunks [pid_s * STEPS * C, ...) of rows
    [pid_n * BLOCK_N, ...). kw: words a row; s_row: scales a row; nch: chunks a row.
    DEQ: out is W [N, K] (float32), written instead of the product. PAIR: NF4 with blocks of
    64 elements or more, absmax once per two planes; SHFL (with PAIR): the code values by warp
    shuffles, not a shared-memory table. AFF: s_ptr holds `affine_pairs` [N, K / 32]."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)[None, :, None, None]
    q_rows = q_ptr + rows * kw
    s_rows = s_ptr + rows * s_row
    z_rows = z_ptr + rows * s_row
    out_rows = out_ptr + rows * (nch * E)
    if KIND == 4:       # Q4_K: c_ptr holds [N, 2 * nch] f16 (d, dmin) pairs
        c_ptr = c_ptr + rows * (2 * nch)
    if KIND == 5:       # Q6_K: c_ptr holds [N, nch / 2] f16 d
        c_ptr = c_ptr + rows * (nch // 2)
    c = tl.arange(0, C)[:, None, None, None]
    first = pid_s * STEPS * C
    acc = tl.zeros((C, BLOCK_N, H, 32 // H), tl.float32)
    if SHFL:    # NF4 (PAIR): the code table in the lanes, read by warp shuffles
        codes = _lane_codes(c_ptr, tl.zeros((C, BLOCK_N, H, 32 // H), tl.int32))
    else:
        codes = 0
    if PREFETCH:
        words = _load_words(q_rows, n_ok, first + c, nch, H, EVEN)
        for i in range(STEPS):
            ch = first + i * C + c
            if i + 1 < STEPS:
                nxt = _load_words(q_rows, n_ok, ch + C, nch, H, EVEN)
            else:
                nxt = words
            acc = _chunk_step(KIND, acc, words, ch, x_ptr, s_rows, z_rows, c_ptr, out_rows,
                              n_ok, nch, magic, E, BS, DEQ, EVEN, XB, FMA_DEQ, H, PAIR,
                              codes, SHFL, AFF)
            words = nxt
    else:   # STAGES > 1: Triton's pipeliner streams the words through shared memory (cp.async)
        for i in tl.range(STEPS, num_stages=STAGES):
            ch = first + i * C + c
            words = _load_words(q_rows, n_ok, ch, nch, H, EVEN)
            acc = _chunk_step(KIND, acc, words, ch, x_ptr, s_rows, z_rows, c_ptr, out_rows,
                              n_ok, nch, magic, E, BS, DEQ, EVEN, XB, FMA_DEQ, H, PAIR,
                              codes, SHFL, AFF)
    if not DEQ:
        total = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=0)
        if ATOMIC:
            tl.atomic_add(out_ptr + offs_n, total, mask=n_ok, sem="relaxed")
        else:
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


# ---- the packed weight ----------------------------------------------------------------------
@dataclass(frozen=True)
class PackedWeight:
    """codes int32 [N, K / 8] (4-bit) or [N, K / 4] (Q8_0) in chunk order; scales [N, K / group]
    (f16 or float32; Q4_K: the 6-bit sub-block scales, uint8); zeros uint8 [N, K / group]
    (AWQ; Q4_K: the 6-bit mins) or None; group: elements a scale; table: NF4's code values or
    Q4_K's super-block (d, dmin) f16 pairs [N, 2 K / 256], else None; extra: copies derived
    from it on first use (`affine_pairs`)."""
    fmt: int
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group: int
    n: int
    k: int
    table: torch.Tensor | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)


def packable(fmt: int, i0: int, k: int, n: int) -> bool:
    """Whether the chunk layout takes this weight (else the storage-order kernels run)."""
    if fmt not in PACKED_FORMATS or k % CHUNK[fmt] or n < 1:
        return False
    if fmt in (NF4, AWQ):
        return i0 >= 32 and i0 % 32 == 0 and k % i0 == 0
    return True


def _chunk_words(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes q uint8 [N, K] (values < 2**bits) -> int32 words [N, K * bits / 32] in chunk order:
    element j * 32 + t of a chunk in bits j * bits.. of word t (little-endian bytes)."""
    n, k = q.shape
    planes = 32 // bits
    v = q.reshape(n, k // (32 * planes), planes, 32)                     # (chunk, j, t)
    if bits == 4:
        v = v[:, :, 0::2, :] | (v[:, :, 1::2, :] << 4)                   # byte b of word t
    return v.permute(0, 1, 3, 2).contiguous().view(torch.int32).reshape(n, k * bits // 32)


def q6k_fields(w0, n: int, k: int):
    """Q6_K bytes of an [N, K] weight (per 256 elements: 128 low-nibble bytes, 64 crumb bytes,
    16 int8 scales, an f16 d) -> (q + 32 as uint8 [N, K] in 0..63, d float16 [N, K/256],
    the scales' int8 bits as uint8 [N, K/16])."""
    raw = w0.reshape(n, k // 256, 210)
    shift4 = torch.tensor([0, 4], dtype=torch.uint8, device=w0.device).view(1, 1, 1, 2, 1)
    shift2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=w0.device)
    lo = ((raw[..., :128].reshape(n, -1, 2, 1, 64) >> shift4) & 15).reshape(n, k)
    hi = ((raw[..., 128:192].reshape(n, -1, 2, 1, 32) >> shift2.view(1, 1, 1, 4, 1)) & 3)
    d = raw[..., 208:210].contiguous().view(torch.float16).reshape(n, k // 256)
    return lo | (hi.reshape(n, k) << 4), d, raw[..., 192:208].reshape(n, k // 16).contiguous()


def _q4k_scale_min(b: torch.Tensor):
    """Q4_K's 12 scale bytes [..., 12] (int32) -> 6-bit scales and mins, uint8 [..., 8] each
    flattened to [N, K / 32]: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, 4-7 from
    the nibbles of bytes 8-11 with the top 2 bits of bytes 0-3 / 4-7."""
    lo_s, lo_m, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([lo_s & 63, (hi & 15) | ((lo_s >> 6) << 4)], dim=-1)
    mn = torch.cat([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], dim=-1)
    n = b.shape[0]
    return sc.to(torch.uint8).reshape(n, -1), mn.to(torch.uint8).reshape(n, -1)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ int32 [R, C] -> uint8 codes [R, 8C] in logical column order."""
    cols = [(packed >> (4 * AWQ_REVERSE[e])) & 15 for e in range(8)]
    return torch.stack(cols, dim=-1).reshape(packed.shape[0], -1).to(torch.uint8)


def pack(fmt: int, w0, w1, w2, i0: int, k: int, n: int) -> PackedWeight:
    """The chunk layout of a weight given as `quant.run` takes it (GGUF: bytes, -, -, row bytes;
    NF4: packed [N, K/2], absmax, code, block size; AWQ: qweight, qzeros, scales, group)."""
    if fmt == Q4_0:
        raw = w0.reshape(n, k // 32, 18)
        scales = raw[..., :2].contiguous().view(torch.float16).reshape(n, k // 32)
        qs = raw[..., 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)            # elements 0..15, 16..
        return PackedWeight(fmt, _chunk_words(q, 4), scales, None, 32, n, k)
    if fmt == Q8_0:
        raw = w0.reshape(n, k // 32, 34)
        scales = raw[..., :2].contiguous().view(torch.float16).reshape(n, k // 32)
        q = raw[..., 2:].reshape(n, k) ^ 0x80                              # int8 q + 128
        return PackedWeight(fmt, _chunk_words(q, 8), scales, None, 32, n, k)
    if fmt == Q4_K:     # d, dmin, 12 bytes of 6-bit (scale, min) pairs, 4 x 32 nibble bytes
        raw = w0.reshape(n, k // 256, 144)
        dd = raw[..., :4].contiguous().view(torch.float16).reshape(n, k // 128)
        sc, mn = _q4k_scale_min(raw[..., 4:16].to(torch.int32))
        qs = raw[..., 16:].reshape(n, k // 256, 4, 1, 32)
        q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, k)     # sub-blocks 2c, 2c + 1
        return PackedWeight(fmt, _chunk_words(q, 4), sc, mn, 32, n, k, dd)
    if fmt == Q6_K:
        q, d, sc = q6k_fields(w0, n, k)
        return PackedWeight(fmt, _chunk_words(q, 8), sc, None, 16, n, k, d)
    if fmt == NF4:      # byte i: element 2i in the high nibble, 2i + 1 in the low one
        q = torch.stack([w0 >> 4, w0 & 15], dim=-1).reshape(n, k)
        return PackedWeight(fmt, _chunk_words(q, 4), w1.reshape(n, k // i0), None, i0, n, k)
    if fmt == AWQ:      # W [K, N] -> rows of W.T
        q = _unpack_awq(w0).t().contiguous()                               # [N, K]
        zeros = _unpack_awq(w1).t().contiguous()                           # [N, K / group]
        return PackedWeight(fmt, _chunk_words(q, 4), w2.t().contiguous(), zeros, i0, n, k)
    raise ValueError(f"no chunk layout for format {fmt}")


def affine_pairs(pw: PackedWeight) -> torch.Tensor:
    """Per 32-element plane of the packed weight, W = s q + o as the float32 pair (a, b) of
    `_affine_plane`, one int64 (a in the low word) [N, K / 32]; made once per packed copy.
    Q4_0: s = d, o = -8 d: a = d 2^-SH, b = -d (8 + 2^(23 - SH)); SH >= 8, so the integer
    factor has at most 13 significant bits and d 11: b is exact. AWQ: s, o = -z s:
    b = -s (z + 2^(23 - SH)), SH >= 12: at most 12 + 11 bits, exact. Q4_K: s = d sc and
    o = dmin m as gguf-py forms them (exact: 11 + 6 bits), a = s 2^-SH, b = -o (-0 for +0,
    as gguf-py's subtraction keeps). Powers of two keep a exact (no f16 scale reaches
    float32's subnormals)."""
    hit = pw.extra.get("affine")
    if hit is not None:
        return hit
    n, groups = pw.n, pw.k // 32
    dev = pw.codes.device
    shifts = AFFINE_SHIFTS[pw.fmt]
    lo = torch.tensor([2.0 ** -v for v in shifts], device=dev).repeat(groups // 8)   # 2^-SH
    hi = torch.tensor([2.0 ** (23 - v) for v in shifts], device=dev).repeat(groups // 8)
    if pw.fmt == Q4_0:
        d = pw.scales.float()
        a, b = d * lo, -(d * (8.0 + hi))
    elif pw.fmt == AWQ:
        rep = pw.group // 32
        s = pw.scales.float().repeat_interleave(rep, dim=1)
        z = pw.zeros.float().repeat_interleave(rep, dim=1)
        a, b = s * lo, -(s * (z + hi))
    else:
        dd = pw.table.float().reshape(n, groups // 8, 2)                   # (d, dmin) a chunk
        d = dd[..., 0].repeat_interleave(8, dim=1)
        dmin = dd[..., 1].repeat_interleave(8, dim=1)
        s = d * pw.scales.float()
        a, b = s * lo, -(dmin * pw.zeros.float())
    pairs = torch.stack([a, b], dim=-1).contiguous().view(torch.int64).reshape(n, groups)
    pw.extra["affine"] = pairs
    return pairs


def affine_ready(pw: PackedWeight) -> bool:
    """Whether `affine_pairs` may be used now: made already, or can be made (not while a CUDA
    graph is being captured: the copy would live in the graph's memory pool and be made again
    on every replay; the launch then takes the per-plane scales)."""
    return "affine" in pw.extra or not (pw.codes.is_cuda
                                         and torch.cuda.is_current_stream_capturing())


#: Triton's CPU interpreter runs no inline PTX (SHFL falls back to tl.gather there)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: (id of the first weight's base tensor, geometry of the three) -> (weak references to
#: their base tensors, their in-place versions, PackedWeight)
_CACHE: dict[tuple, tuple] = {}


def _anchor(t):
    """The tensor whose lifetime holds t's memory (a view's base), and where in it t lies: a
    view made afresh for every call (a reshape in a traced plan) still finds its copy."""
    base = t._base if t._base is not None else t
    return base, (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def packed_weight(fmt: int, w0, w1, w2, i0: int, k: int, n: int, build=None, make=True):
    """`pack` (or `build`, another layout with pack's arguments), cached with the weight
    tensors: reused while their memory is alive (held by the same tensors or views of the same
    bases) and unchanged (same in-place versions); dropped when the first one's base is freed.
    make=False: None where no valid copy is cached (nothing is built)."""
    build = build or pack
    tensors = (w0, w1, w2)
    anchors = [_anchor(t) for t in tensors]
    key = (id(anchors[0][0]), fmt, i0, k, n, build.__name__) + tuple(g for _, g in anchors)
    versions = tuple(t._version for t in tensors)
    hit = _CACHE.get(key)
    if hit is not None:
        refs, vers, packed = hit
        if vers == versions and all(r() is a for r, (a, _) in zip(refs, anchors)):
            return packed
    if not make:
        return None
    packed = build(fmt, w0, w1, w2, i0, k, n)
    refs = tuple(weakref.ref(a) for a, _ in anchors)
    _CACHE[key] = (refs, versions, packed)
    weakref.finalize(anchors[0][0], _drop, key, refs[0])
    return packed


def _drop(key, ref):
    hit = _CACHE.get(key)
    if hit is not None and hit[0][0] is ref:
        del _CACHE[key]


# ---- launch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedConfig:
    """block_n rows and `chunks` chunks (32 words each) a step per program; `split` programs
    per row tile along K (0: from the SM count); prefetch: next step's words loaded ahead."""
    block_n: int = 16
    chunks: int = 4
    split: int = 0
    num_warps: int = 4
    prefetch: int = 1
    halves: int = 2     # words of a chunk row as [halves, 32 / halves]: 4 * halves a thread
    fma: int = 1        # Q4_0 / Q8_0 / AWQ / Q6_K: one FMA a dequantized weight (`_q4_0_fma`)
    x32: int = 1        # x converted to float32 by a tiny kernel first (0: converted per load,
    #                     ~1 instruction a weight more for 16-bit x in sm_90 SASS)
    stages: int = 1     # without prefetch: > 1 pipelines the loop's loads (cp.async, stages - 1
    #                     steps ahead in shared memory; more bytes in flight than registers hold)
    pair: int = 1       # NF4 (blocks of 64+): absmax applied once per two planes
    shfl: int = 0       # NF4 with pair: code values by warp shuffles (compiled kernels only)
    aff: int = 0        # Q4_0 / AWQ / Q4_K: each plane's precomputed (a, b) pair

    def tag(self) -> str:
        return (f"packed[n{self.block_n},c{self.chunks},s{self.split},w{self.num_warps}"
                + (",pf" if self.prefetch else "") + f",h{self.halves}"
                + ("" if self.fma else ",nofma") + ("" if self.x32 else ",x16")
                + (f",st{self.stages}" if self.stages > 1 and not self.prefetch else "")
                + ("" if self.pair else ",nopair") + (",shfl" if self.shfl else "")
                + (",aff" if self.aff else "") + "]")


#: default launch per format, H200 N = K = 8192 bf16 CUDA-graph times (session 5 sweep): 16
#: rows x 4 chunks a step, 8 words a thread per chunk row, beat 8 rows or 2 chunks (fewer bytes
#: a step: Q4_0 0.042 / 0.032 vs 0.018 ms), 16 words (0.065), split 2 (0.023), x read as bf16
#: (0.027); Q8_0 best with 32 rows on 8 warps (0.0280 vs 0.0314 split 2). Session 6
#: (bench_cuda_quant_gemv, warm / cold = one weight / 4 weights cycled past L2): NF4 and Q4_K
#: take 16 rows on 2 warps (4 rows a thread), x read in its own dtype, the words through 3
#: cp.async stages: NF4 0.0253 / 0.0262 (before 0.0291 / 0.0316), Q4_K 0.0268 / 0.0287 (0.0290 /
#: 0.0308); the same launch with float32 x lost 2x for Q4_0 / AWQ / Q4_K / Q8_0 / Q6_K (0.048
#: vs 0.018 for Q4_0), and NF4's absmax per plane pair slowed the register-prefetch launch
#: (0.0325 vs 0.0291) but helps on the new one (0.0253 vs 0.0274). Q6_K: the new launch with
#: its one-FMA decode 0.0344-0.0345 vs 0.0348-0.0352 in two runs (the FMA decode on the old
#: launch: 0.0966). Q4_0, AWQ and Q8_0 keep theirs (new launch 0.0232 / 0.0229 / 0.0333)
#: Session 7 (same bench, one run): NF4 with its code table read by warp shuffles 0.0228 /
#: 0.0234 (0.0254 / 0.0263 the same run without); Q4_K on the register-prefetch launch with
#: each plane's precomputed (a, b) pair 0.0239 / 0.0247 (its previous default 0.0270 / 0.0288;
#: the pairs on the 2-warp launch 0.0296 / 0.0303). AWQ with the pairs lost (0.0267 / 0.0294:
#: 0.25 bytes a weight more against one multiply less per plane and 8 weights)
_NEW = PackedConfig(16, 4, 0, 2, 0, 2, 1, 0, 3)
DEFAULT_PACKED = {Q4_0: PackedConfig(), Q8_0: PackedConfig(block_n=32, num_warps=8),
                  NF4: PackedConfig(16, 4, 0, 2, 0, 2, 1, 0, 3, shfl=1), AWQ: PackedConfig(),
                  Q4_K: PackedConfig(aff=1), Q6_K: _NEW}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)       # triton.cdiv costs microseconds a call from Python (a jit wrapper)


def _split(tiles: int, steps_total: int, split: int, device) -> tuple[int, int]:
    """(split, steps each): split K only while the row tiles are under ~3 programs an SM."""
    if split <= 0:
        want = 3 * num_sms(device)
        split = 1 if tiles >= want else max(1, min(steps_total, want // max(tiles, 1)))
    steps = _cdiv(steps_total, split)
    return _cdiv(steps_total, steps), steps


@functools.lru_cache(maxsize=4096)
def _plan_for(fmt: int, n: int, k: int, cfg: PackedConfig, device) -> tuple[int, int, int]:
    nch = k // CHUNK[fmt]
    c = min(cfg.chunks, next_pow2(nch))
    split, steps = _split(_cdiv(n, cfg.block_n), _cdiv(nch, c), cfg.split, device)
    return c, split, steps


def _plan(pw: PackedWeight, cfg: PackedConfig, device) -> tuple[int, int, int]:
    """(chunks a step, split, steps each) of a launch (cached: the host path of a decode step
    is part of its time when it is not a CUDA graph)."""
    return _plan_for(pw.fmt, pw.n, pw.k, cfg, device)


def _launch(pw: PackedWeight, x1, out, code, cfg: PackedConfig, plan, deq: bool = False):
    c, split, steps = plan
    e = CHUNK[pw.fmt]
    nch = pw.k // e
    tiles = _cdiv(pw.n, cfg.block_n)
    even = pw.n % cfg.block_n == 0 and nch == split * steps * c
    z = pw.zeros if pw.zeros is not None else pw.scales
    table = pw.table if pw.table is not None else code if code is not None else pw.scales
    pair = pw.fmt == NF4 and pw.group % 64 == 0 and not deq and bool(cfg.pair)
    aff = bool(cfg.aff) and pw.fmt in AFFINE_FORMATS and affine_ready(pw)
    scales = affine_pairs(pw) if aff else pw.scales
    _packed_gemv_kernel[(tiles, split)](
        x1, pw.codes, scales, z, table, out, pw.n,
        pw.codes.shape[1], scales.shape[1], nch, MAGIC_BITS, STEPS=steps,
        KIND=_KIND[pw.fmt], E=e, BS=pw.group, BLOCK_N=cfg.block_n, C=c, ATOMIC=split > 1,
        PREFETCH=bool(cfg.prefetch), EVEN=even, XB=bool(cfg.prefetch) or cfg.stages <= 1,
        FMA_DEQ=bool(cfg.fma),
        H=max(cfg.halves, 2) if pw.fmt == Q6_K else cfg.halves,
        DEQ=deq, STAGES=1 if cfg.prefetch else cfg.stages,
        PAIR=pair, SHFL=pair and bool(cfg.shfl) and not INTERPRET, AFF=aff,
        num_warps=cfg.num_warps, num_stages=1)


def run_packed(fmt: int, x, w0, w1, w2, i0: int, k: int, n: int,
               config: PackedConfig | None = None):
    """x [..., K] with one row in all @ W.T through the packed copy of the weight (arguments as
    `quant.run`; NF4's w2 is the code table). Returns [..., N] in x's dtype."""
    cfg = config or DEFAULT_PACKED[fmt]
    pw = packed_weight(fmt, w0, w1, w2, i0, k, n)
    x1 = x.reshape(-1)                  # [K]: float32 once (x32), else read in its dtype
    x1 = x1.float() if cfg.x32 else x1.contiguous()
    plan = _plan(pw, cfg, x.device)
    if plan[1] > 1:                     # partial sums meet by float32 atomics
        out = torch.zeros(n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(n, dtype=x.dtype, device=x.device)
    _launch(pw, x1, out, w2 if fmt == NF4 else None, cfg, plan)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def dequantize_packed(pw: PackedWeight, code=None, fma: int = 1, aff: int = 0) -> torch.Tensor:
    """W [N, K] float32 from the packed copy, by the GEMV kernel's own plane decoding (tests);
    aff: from `affine_pairs` (Q4_0, AWQ, Q4_K)."""
    out = torch.empty(pw.n, pw.k, dtype=torch.float32, device=pw.codes.device)
    x1 = torch.zeros(1, dtype=torch.float32, device=pw.codes.device)
    cfg = PackedConfig(block_n=8, chunks=2, split=1, prefetch=0, fma=fma, aff=aff)
    _launch(pw, x1, out, code, cfg, _plan(pw, cfg, out.device), deq=True)
    return out
