"""Many-row quantized matmuls (`out = x @ W.T`, W [N, K] for GGUF / NF4; `out = x @ W`, W [K, N]
for AWQ) as one Triton GEMM that dequantizes the weight tile in registers next to the tensor-core
dot, instead of writing a dense bf16 copy of the weight (2 bytes an element written, then read
again by cuBLAS) first.

Unlike `quant_rows` (which multiplies each storage "plane", e.g. the low nibbles of a Q4_0
block, by x gathered at the plane's offsets), the tiles here are put back in K order in
registers: the two nibbles of a byte (or the two bytes of a 2-byte word) are `tl.join`-ed, which
interleaves them with no data movement between threads. What cannot be interleaved that way
(Q4_0's low nibbles are elements 0..15 of a block, its high nibbles 16..31; Q4_K's 32-element
halves; Q6_K's four 32-element quarters) stays a separate dot over a contiguous run of x. The
dequantizer ops per element are those of `quant_rows` (bit-exact with gguf-py, bitsandbytes,
AutoAWQ; launch with enable_fp_fusion off except where noted), then the tile is rounded to x's
dtype for the dot, as the recipe does.

The same row-format tiles also write the dense weight in K order (`dequantize_natural`, DEQ):
contiguous runs of 16..64 elements, the fallback dense-copy + cuBLAS path."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import num_sms
from .quant_rows import (MAGIC_BITS, ROW_BB, ROW_QK, _f16, _int8_pair, _nf4_value,
                         _nib_scaled, _q4k_scales, _u16_words, _u8)
from .quant_tiles import AWQ, NF4, Q4_0, Q4_K, Q6_K, Q8_0

#: elements of K in one "unit" of each row format (a step covers G units)
UNIT = {Q4_0: 32, Q8_0: 32, Q4_K: 64, Q6_K: 128}
GEMM_FORMATS = frozenset(UNIT) | {NF4, AWQ}


@triton.jit
def _use(acc, w, koff, k_ok, x_rows, m_ok, n_ok, W_LEFT: tl.constexpr, PREC: tl.constexpr,
         DEQ: tl.constexpr, EVEN: tl.constexpr):
    """acc += x[:, koff] @ w.T for the K-ordered runs w [BN, G, R] at offsets koff [G, R]
    (W_LEFT: acc [BN, BM] += w @ x[:, koff].T). DEQ: store w at x_rows [BN] (rows of the dense
    weight) + koff instead."""
    BN: tl.constexpr = w.shape[0]
    G: tl.constexpr = w.shape[1]
    R: tl.constexpr = w.shape[2]
    if DEQ:
        ptrs = x_rows[:, None, None] + koff[None, :, :]
        if EVEN:
            tl.store(ptrs, w.to(x_rows.dtype.element_ty))
        else:
            tl.store(ptrs, w.to(x_rows.dtype.element_ty),
                     mask=n_ok[:, None, None] & k_ok[None, :, :])
    else:
        BM: tl.constexpr = x_rows.shape[0]
        ptrs = x_rows[:, None, None] + koff[None, :, :]
        if EVEN:    # the weight tiles divide W; rows of x may not fill the tile
            xt = tl.load(ptrs, mask=m_ok[:, None, None], other=0.0)
        else:
            xt = tl.load(ptrs, mask=m_ok[:, None, None] & k_ok[None, :, :], other=0.0)
        x2 = tl.reshape(xt, (BM, G * R))
        w2 = tl.reshape(w, (BN, G * R)).to(xt.dtype)
        if W_LEFT:
            acc = tl.dot(w2, tl.trans(x2), acc, input_precision=PREC)
        else:
            acc = tl.dot(x2, tl.trans(w2), acc, input_precision=PREC)
    return acc


@triton.jit
def _pair(a, b, BN: tl.constexpr, G: tl.constexpr, R: tl.constexpr):
    """[BN, G, R // 2] a (even elements) and b (odd ones) interleaved into [BN, G, R]."""
    return tl.reshape(tl.join(a, b), (BN, G, R))


@triton.jit
def _raw_words(FMT: tl.constexpr, rows, n_ok, u0, lim, G: tl.constexpr, EVEN: tl.constexpr):
    """Q4_0 / Q8_0: the 2-byte words [BN, G, 8 | 16] and f16 scales [BN, G, 1] of blocks u0 ..
    u0 + G (those < lim), as loaded (converted where used, so a prefetch does not wait)."""
    nm = n_ok[:, None, None]
    W: tl.constexpr = 8 if FMT == 0 else 16
    b = u0 + tl.arange(0, G)[:, None]
    i = tl.arange(0, W)[None, :]
    blk = rows[:, None, None] + (b * (2 + 2 * W))[None]
    p16 = (blk + 2 + 2 * i[None]).to(tl.pointer_type(tl.uint16))
    pd = blk.to(tl.pointer_type(tl.float16))
    if EVEN:
        return tl.load(p16), tl.load(pd)
    else:
        return (tl.load(p16, mask=nm & ((b < lim) & (i < W))[None], other=0),
                tl.load(pd, mask=nm & (b < lim)[None], other=0.0))


@triton.jit
def _mul_words(FMT: tl.constexpr, acc, v, d, u0, nunit, magic, x_rows, m_ok, n_ok,
               G: tl.constexpr, W_LEFT: tl.constexpr, PREC: tl.constexpr, DEQ: tl.constexpr,
               EVEN: tl.constexpr):
    """acc += the K-ordered Q4_0 / Q8_0 tiles of the raw words and scales of `_raw_words`."""
    BN: tl.constexpr = v.shape[0]
    v = v.to(tl.int32)
    d = d.to(tl.float32)
    b = u0 + tl.arange(0, G)[:, None]
    if FMT == 0:      # word i = bytes 2i, 2i + 1: elements 2i, 2i + 1 (low), 16 + 2i, ... (high)
        w0 = d * _nib_scaled(v, magic, 0, 8)
        w1 = (d * 0.0625) * _nib_scaled(v, magic, 4, 8)
        w2 = (d * 0.00390625) * _nib_scaled(v, magic, 8, 8)
        w3 = (d * 0.000244140625) * _nib_scaled(v, magic, 12, 8)
        j = tl.arange(0, 16)[None, :]
        k_ok = (b < nunit) & (j < 16)
        acc = _use(acc, _pair(w0, w2, BN, G, 16), b * 32 + j, k_ok, x_rows, m_ok, n_ok,
                   W_LEFT, PREC, DEQ, EVEN)
        acc = _use(acc, _pair(w1, w3, BN, G, 16), b * 32 + 16 + j, k_ok, x_rows, m_ok, n_ok,
                   W_LEFT, PREC, DEQ, EVEN)
    else:             # Q8_0: word i = int8 elements 2i, 2i + 1
        lo, hi = _int8_pair(v, magic)
        j = tl.arange(0, 32)[None, :]
        acc = _use(acc, _pair(lo * d, hi * (d * 0.00390625), BN, G, 32), b * 32 + j,
                   (b < nunit) & (j < 32), x_rows, m_ok, n_ok, W_LEFT, PREC, DEQ, EVEN)
    return acc


@triton.jit
def _gemm_step(FMT: tl.constexpr, acc, rows, n_ok, x_rows, m_ok, s_rows, c_ptr, u0, nunit,
               magic, G: tl.constexpr, BS: tl.constexpr, LUT: tl.constexpr,
               W_LEFT: tl.constexpr, PREC: tl.constexpr, DEQ: tl.constexpr, EVEN: tl.constexpr):
    """acc += the product over units u0 .. u0 + G (see UNIT; NF4: absmax blocks of BS) of the
    weight rows at byte pointers `rows` [BN]."""
    BN: tl.constexpr = rows.shape[0]
    nm = n_ok[:, None, None]
    if FMT == 0 or FMT == 4:
        v, d = _raw_words(FMT, rows, n_ok, u0, nunit, G, EVEN)
        acc = _mul_words(FMT, acc, v, d, u0, nunit, magic, x_rows, m_ok, n_ok, G, W_LEFT, PREC,
                         DEQ, EVEN)
    elif FMT == 7:    # Q4_K: unit (block, c) = 32 bytes, low nibbles 64c + 0..31, high + 32..63
        u = u0 + tl.arange(0, G)[:, None]
        b = u // 4
        c = u % 4
        i = tl.arange(0, 16)[None, :]
        g_ok = nm & (u < nunit)[None]
        blk = rows[:, None, None] + (b * 144)[None]
        # the 32 bytes of (b, c) start 16-aligned: addressed as 2-byte words and said so, they
        # load as 16-byte vectors (and asynchronously, ahead of the dot)
        u1 = u0 + tl.arange(0, G)
        qoff = tl.multiple_of((u1 // 4) * 72 + 8 + 16 * (u1 % 4), 8)
        p16 = rows.to(tl.pointer_type(tl.uint16))[:, None, None] + (qoff[:, None] + i)[None]
        if EVEN:
            v = tl.load(p16).to(tl.int32)
        else:
            v = tl.load(p16, mask=nm & ((u < nunit) & (i < 16))[None], other=0).to(tl.int32)
        d0, m0, d1, m1 = _q4k_scales(blk, c, g_ok, EVEN)
        w0 = d0 * _nib_scaled(v, magic, 0, 0) - m0
        w1 = (d1 * 0.0625) * _nib_scaled(v, magic, 4, 0) - m1
        w2 = (d0 * 0.00390625) * _nib_scaled(v, magic, 8, 0) - m0
        w3 = (d1 * 0.000244140625) * _nib_scaled(v, magic, 12, 0) - m1
        j = tl.arange(0, 32)[None, :]
        k_ok = (u < nunit) & (j < 32)
        acc = _use(acc, _pair(w0, w2, BN, G, 32), u * 64 + j, k_ok, x_rows, m_ok, n_ok,
                   W_LEFT, PREC, DEQ, EVEN)
        acc = _use(acc, _pair(w1, w3, BN, G, 32), u * 64 + 32 + j, k_ok, x_rows, m_ok, n_ok,
                   W_LEFT, PREC, DEQ, EVEN)
    elif FMT == 9:    # Q6_K: unit (block, half hn), e = 128 hn + 32 r + l; words [2, 8] = l / 2
        u = u0 + tl.arange(0, G)[:, None, None]
        b = u // 2
        hn = u % 2
        h = tl.arange(0, 2)[None, :, None]
        l2 = 16 * h + 2 * tl.arange(0, 8)[None, None, :]                   # even l, [1, 2, 8]
        n4 = n_ok[:, None, None, None]
        km = n4 & ((u < nunit) & (l2 < 32))[None]
        g_ok = n4 & ((u < nunit) & (h < 2))[None]                           # [BN, G, 2, 1]
        blk = rows[:, None, None, None] + (b * 210)[None]
        ql_a = _u16_words(blk + (64 * hn + l2)[None], km, EVEN)
        ql_b = _u16_words(blk + (64 * hn + 32 + l2)[None], km, EVEN)
        qh = _u16_words(blk + (128 + 32 * hn + l2)[None], km, EVEN)
        d = _f16(blk + 208, n4 & (u < nunit)[None], EVEN)
        j = tl.arange(0, 32)[None, :]
        u2 = tl.reshape(u, (G, 1))
        k_ok = (u2 < nunit) & (j < 32)
        for r in tl.static_range(4):
            sc = _u8(blk + (192 + 8 * hn + 2 * r + h)[None], g_ok, EVEN)
            dr = d * tl.where(sc >= 128, sc - 256, sc).to(tl.float32)
            if r % 2 == 0:
                ql = ql_a
            else:
                ql = ql_b
            S1a = 4 * (r // 2)
            S2a = 2 * r
            S1b = 8 + 4 * (r // 2)
            S2b = 8 + 2 * r
            lo = ((ql & (15 << S1a)) | magic).to(tl.float32, bitcast=True) - \
                (8388608.0 + 32.0 * (1 << S1a))
            hi = ((qh & (3 << S2a)) | magic).to(tl.float32, bitcast=True) - 8388608.0
            wa = (dr * (1.0 / (1 << S1a))) * (hi * (1 << (S1a + 4 - S2a)) + lo)
            lo = ((ql & (15 << S1b)) | magic).to(tl.float32, bitcast=True) - \
                (8388608.0 + 32.0 * (1 << S1b))
            hi = ((qh & (3 << S2b)) | magic).to(tl.float32, bitcast=True) - 8388608.0
            wb = (dr * (1.0 / (1 << S1b))) * (hi * (1 << (S1b + 4 - S2b)) + lo)
            w = tl.reshape(tl.join(wa, wb), (BN, G, 32))
            acc = _use(acc, w, u2 * 128 + 32 * r + j, k_ok, x_rows, m_ok, n_ok, W_LEFT, PREC,
                       DEQ, EVEN)
    else:             # NF4: unit = absmax block of BS elements, BS / 2 bytes, high nibble even
        b = u0 + tl.arange(0, G)[:, None]
        j = tl.arange(0, BS // 2)[None, :]
        byte = _u8(rows[:, None, None] + (b * (BS // 2) + j)[None],
                   nm & ((b < nunit) & (j < BS // 2))[None], EVEN)
        if EVEN:
            s = tl.load(s_rows[:, None, None] + b[None])
        else:
            s = tl.load(s_rows[:, None, None] + b[None], mask=nm & (b < nunit)[None], other=0.0)
        w = _pair(_nf4_value(byte >> 4, c_ptr, LUT) * s, _nf4_value(byte & 15, c_ptr, LUT) * s,
                  BN, G, BS)
        jj = tl.arange(0, BS)[None, :]
        acc = _use(acc, w, b * BS + jj, (b < nunit) & (jj < BS), x_rows, m_ok, n_ok, W_LEFT,
                   PREC, DEQ, EVEN)
    return acc


@triton.jit
def _qgemm_kernel(x_ptr, w_ptr, s_ptr, c_ptr, out_ptr, M, N, row_bytes, s_row, nunit, stride_x,
                  stride_o, magic, STEPS: tl.constexpr, FMT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
                  BS: tl.constexpr, LUT: tl.constexpr, W_LEFT: tl.constexpr,
                  PREC: tl.constexpr, ATOMIC: tl.constexpr, EVEN: tl.constexpr,
                  DEQ: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """out[M, N] (+)= x[M, K] @ W.T over units [pid_s * STEPS * G, ...) of W's rows
    [pid_n * BLOCK_N, ...). DEQ: x_ptr is the dense W [N, K] to write (stride_x = K)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows = w_ptr + offs_n.to(tl.int64) * row_bytes
    s_rows = s_ptr + offs_n.to(tl.int64) * s_row
    if DEQ:
        x_rows = x_ptr + offs_n.to(tl.int64) * stride_x
    else:
        x_rows = x_ptr + offs_m.to(tl.int64) * stride_x
    if W_LEFT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if PREFETCH and (FMT == 0 or FMT == 4):     # next step's words loaded before this one's dot
        first = pid_s * STEPS * G
        lim = tl.minimum(nunit, first + STEPS * G)
        v, d = _raw_words(FMT, rows, n_ok, first, lim, G, False)
        for i in range(STEPS):
            u0 = first + i * G
            v_next, d_next = _raw_words(FMT, rows, n_ok, u0 + G, lim, G, False)
            acc = _mul_words(FMT, acc, v, d, u0, nunit, magic, x_rows, m_ok, n_ok, G, W_LEFT,
                             PREC, DEQ, EVEN)
            v = v_next
            d = d_next
    else:
        for i in range(STEPS):
            acc = _gemm_step(FMT, acc, rows, n_ok, x_rows, m_ok, s_rows, c_ptr,
                             (pid_s * STEPS + i) * G, nunit, magic, G, BS, LUT, W_LEFT, PREC,
                             DEQ, EVEN)
    if not DEQ:
        if W_LEFT:
            acc = tl.trans(acc)
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
        o_mask = m_ok[:, None] & n_ok[None, :]
        if ATOMIC:
            tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")
        else:
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _awq_nib(half, zw, magic, P: tl.constexpr):
    """2^SH (q - z) of nibble P (SH = 4 * (P % 4), kept in place in its 16-bit half), exact."""
    SH: tl.constexpr = 4 * (P % 4)
    zm = 8388608.0 + (((zw >> (4 * P)) & 15) << SH).to(tl.float32)
    return ((half & (15 << SH)) | magic).to(tl.float32, bitcast=True) - zm[None, :]


@triton.jit
def _awq_gemm_kernel(x_ptr, qw_ptr, qz_ptr, sc_ptr, out_ptr, M, N, K, group_size, stride_x,
                     stride_o, magic, STEPS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                     ATOMIC: tl.constexpr, EVEN: tl.constexpr):
    """out[M, N] (+)= x[M, K] @ W[K, N] for AutoAWQ's qweight [K, N / 8]: BLOCK_W words (8 *
    BLOCK_W columns) a program, BLOCK_K rows a step inside one group (BLOCK_K divides
    group_size). The 8 nibble planes of a word (columns 0, 2, 4, 6, 1, 3, 5, 7) are joined back
    into column order; W = (q - z) * s with the plane's power of two folded into the scale."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    nw = N // 8
    offs_w = pid_n * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_c = pid_n * (8 * BLOCK_W) + tl.arange(0, 8 * BLOCK_W)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    w_ok = offs_w < nw
    c_ok = offs_c < N
    m_ok = offs_m < M
    # scale of column c divided by the power of two 2^(4 * ((c % 8) // 2)) its nibble sits at
    q = (tl.arange(0, 8 * BLOCK_W) % 8) // 2
    shift = tl.where(q == 0, 1.0, tl.where(q == 1, 0.0625,
                                           tl.where(q == 2, 0.00390625, 0.000244140625)))
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, 8 * BLOCK_W), tl.float32)
    for i in range(STEPS):
        k0 = (pid_s * STEPS + i) * BLOCK_K
        g = k0 // group_size
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            zw = tl.load(qz_ptr + g * nw + offs_w)
            s = tl.load(sc_ptr + g.to(tl.int64) * N + offs_c).to(tl.float32)
            words = tl.load(qw_ptr + kk.to(tl.int64)[:, None] * nw + offs_w[None, :])
            xt = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        else:
            zw = tl.load(qz_ptr + g * nw + offs_w, mask=w_ok & (k0 < K), other=0)
            s = tl.load(sc_ptr + g.to(tl.int64) * N + offs_c, mask=c_ok & (k0 < K),
                        other=0.0).to(tl.float32)
            k_ok = kk < K
            words = tl.load(qw_ptr + kk.to(tl.int64)[:, None] * nw + offs_w[None, :],
                            mask=k_ok[:, None] & w_ok[None, :], other=0)
            xt = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_hi = words >> 16
        even = tl.join(tl.join(_awq_nib(words, zw, magic, 0), _awq_nib(words, zw, magic, 2)),
                       tl.join(_awq_nib(words, zw, magic, 1), _awq_nib(words, zw, magic, 3)))
        odd = tl.join(tl.join(_awq_nib(w_hi, zw, magic, 4), _awq_nib(w_hi, zw, magic, 6)),
                      tl.join(_awq_nib(w_hi, zw, magic, 5), _awq_nib(w_hi, zw, magic, 7)))
        qz = tl.reshape(tl.join(even, odd), (BLOCK_K, 8 * BLOCK_W))
        w = qz * (s * shift)[None, :]
        acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=PREC)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_c[None, :]
    if ATOMIC:
        tl.atomic_add(o_ptrs, acc, mask=m_ok[:, None] & c_ok[None, :], sem="relaxed")
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & c_ok[None, :])


# ---- launch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    """One program: block_m activation rows, block_n output features (AWQ: columns, 8 a word),
    block_k elements of K a step (rounded to the format's unit; AWQ: rows, at most the group),
    `split` programs per output tile along K (0: from the SM count; partial sums by atomics),
    w_left: the weight tile as the dot's left operand (acc [BN, BM]); lut: NF4 code lookup."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    split: int = 0
    num_warps: int = 8
    num_stages: int = 3
    w_left: int = 0
    lut: int = 2
    prefetch: int = 0   # Q4_0 / Q8_0: next step's words loaded ahead in registers

    def tag(self) -> str:
        return (f"gemm[m{self.block_m},n{self.block_n},k{self.block_k},s{self.split},"
                f"w{self.num_warps},st{self.num_stages}" + (",wl" if self.w_left else "")
                + ("" if self.lut == 2 else f",lut{self.lut}") + (",pf" if self.prefetch else "")
                + "]")


def _split_steps(tiles: int, total: int, split: int, block_m: int, device) -> tuple[int, int]:
    """(split, steps per split): split K until the grid has about 4 programs per SM for the
    weight-streaming few-row tiles (block_m <= 32), one wave for GEMM tiles."""
    if split <= 0:
        want = (4 if block_m <= 32 else 1) * num_sms(device)
        split = 1 if tiles >= want * 3 // 4 else max(1, min(total, want // max(tiles, 1)))
    steps = triton.cdiv(total, split)
    return triton.cdiv(total, steps), steps


def run_gemm(fmt: int, x, w0, w1, w2, i0: int, k: int, n: int, config: GemmConfig | None = None):
    """x [..., K] @ B [K, N] by the fused dequantizing GEMM; arguments as `quant.run` (GGUF:
    bytes, -, -, row_bytes; NF4: packed, absmax, code table, block_size; AWQ: qweight, qzeros,
    scales, group_size). Returns [..., N] in x's dtype."""
    cfg = config or GemmConfig()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    if fmt == AWQ:
        bk = min(cfg.block_k, i0)
        while i0 % bk:
            bk //= 2
        bw = max(1, cfg.block_n // 8)
        tiles = triton.cdiv(n // 8, bw) * triton.cdiv(m, cfg.block_m)
        split, steps = _split_steps(tiles, triton.cdiv(k, bk), cfg.split, cfg.block_m,
                                    x.device)
    else:
        unit = i0 if fmt == NF4 else UNIT[fmt]
        nunit = k // unit
        g = 1 << max(0, (max(1, cfg.block_k // unit)).bit_length() - 1)
        tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
        split, steps = _split_steps(tiles, triton.cdiv(nunit, g), cfg.split, cfg.block_m,
                                    x.device)
    atomic = split > 1
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    opts = dict(STEPS=steps, BLOCK_M=cfg.block_m, PREC=prec, ATOMIC=atomic,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                enable_fp_fusion=fmt not in (Q4_K, AWQ))
    if fmt == AWQ:
        even = (n // 8) % bw == 0 and k == split * steps * bk
        grid = (triton.cdiv(n // 8, bw), triton.cdiv(m, cfg.block_m), split)
        _awq_gemm_kernel[grid](x2, w0, w1, w2, out, m, n, k, i0, x2.stride(0), out.stride(0),
                               MAGIC_BITS, BLOCK_W=bw, BLOCK_K=bk, EVEN=even, **opts)
    else:
        row_bytes = k // 2 if fmt == NF4 else (k // ROW_QK[fmt]) * ROW_BB[fmt]
        even = n % cfg.block_n == 0 and nunit == split * steps * g
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
        _qgemm_kernel[grid](x2, w0, w1, w2, out, m, n, row_bytes, k // i0 if fmt == NF4 else 0,
                            nunit, x2.stride(0), out.stride(0), MAGIC_BITS, FMT=fmt,
                            BLOCK_N=cfg.block_n, G=g, BS=i0 if fmt == NF4 else 32, LUT=cfg.lut,
                            W_LEFT=bool(cfg.w_left), EVEN=even, PREFETCH=bool(cfg.prefetch),
                            **opts)
    if atomic and x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out.reshape(*lead, n)


def dequantize_natural(fmt: int, w0, w1, w2, i0: int, k: int, n: int, dtype=torch.bfloat16,
                       block_n: int = 32, block_k: int = 256, lut: int = 2):
    """The dense weight W [N, K] (GGUF row formats / NF4) in `dtype`, tiles written in K order
    (contiguous runs of 16..64 elements): for the dense-copy + cuBLAS path."""
    unit = i0 if fmt == NF4 else UNIT[fmt]
    nunit = k // unit
    g = 1 << max(0, (max(1, block_k // unit)).bit_length() - 1)
    row_bytes = k // 2 if fmt == NF4 else (k // ROW_QK[fmt]) * ROW_BB[fmt]
    out = torch.empty(n, k, dtype=dtype, device=w0.device)
    grid = (triton.cdiv(n, block_n), 1, triton.cdiv(nunit, g))
    even = n % block_n == 0 and nunit % g == 0
    _qgemm_kernel[grid](out, w0, w1, w2, out, 1, n, row_bytes, k // i0 if fmt == NF4 else 0,
                        nunit, k, k, MAGIC_BITS, STEPS=1, FMT=fmt, BLOCK_M=1, BLOCK_N=block_n,
                        G=g, BS=i0 if fmt == NF4 else 32, LUT=lut, W_LEFT=False, PREC="ieee",
                        ATOMIC=False, EVEN=even, DEQ=True, num_warps=4, enable_fp_fusion=False)
    return out
