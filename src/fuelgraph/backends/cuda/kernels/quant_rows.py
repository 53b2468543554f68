"""Bandwidth-shaped Triton kernels of the quantized matmuls' forward (`out = x @ W.T`, W [N, K]
for GGUF / NF4; `out = x @ W`, W [K, N] for AWQ) that read the packed weight in its storage
order: each program owns BLOCK_N output features and a share of the reduction (split-K), and
loads the bytes of its rows as [BLOCK_N, groups, bytes] tiles contiguous along K, so every
weight byte is read once, coalesced, and unpacked to all its elements (both nibbles of a byte,
all bit planes) in registers. Instead of reordering the unpacked elements into K order, each
"plane" (e.g. the low nibbles of a Q4_0 block = elements 0..15) is multiplied by the matching
columns of x, gathered with the plane's own offsets (x is small and cache-resident).

Per plane the product is either a broadcast multiply + sum on the CUDA cores (BLOCK_M < 16) or
`tl.dot` with the weight plane as the left operand (acc [BLOCK_N, BLOCK_M] = W_plane @ x.T:
the many weight rows fill the MMA's M side, the few activation rows its N side >= 16).

Small integers become float32 by OR-ing them into the mantissa of 2^23 and subtracting (one
logic op + one add, exact), not the int->float conversion, which runs at a quarter rate. The
float ops per weight element are those of the reference dequantizer in the same order (launch
with enable_fp_fusion=False), so the dequantized weights are bit-identical to gguf-py's /
bitsandbytes' / AutoAWQ's; the dot rounds them to x's dtype first, as the recipe does.

Covered here: Q4_0, Q8_0, Q4_K, Q6_K, NF4 (row layout) and AWQ (column layout); the other
formats and the gradients use the generic tile kernels of `quant.py`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import num_sms
from .quant_tiles import AWQ, NF4, Q4_0, Q4_K, Q6_K, Q8_0

#: formats with a row-layout kernel here, and the elements per format block (QK)
ROW_QK = {Q4_0: 32, Q8_0: 32, Q4_K: 256, Q6_K: 256}
ROW_BB = {Q4_0: 18, Q8_0: 34, Q4_K: 144, Q6_K: 210}
FAST_FORMATS = frozenset(ROW_QK) | {NF4, AWQ}
WORD_FORMATS = frozenset({Q4_0, Q8_0, Q4_K, Q6_K})   # read as 2-byte words (`_word_step`)
#: weight elements of one plane tile row per format block in a step (NF4: per 64-block)
PLANE_PER_BLOCK = {Q4_0: 16, Q8_0: 32, Q4_K: 128, Q6_K: 256, NF4: 32}

_MAGIC = tl.constexpr(0x4B000000)       # bits of 2.0 ** 23
MAGIC_BITS = 0x4B000000


@triton.jit
def _int_to_f32(q, OFFSET: tl.constexpr):
    """q - OFFSET as float32, exactly, for int32 0 <= q < 2**22 (OR into 2^23's mantissa)."""
    return (q | _MAGIC).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _u8(ptr, mask, EVEN: tl.constexpr):
    """Bytes as int32; EVEN: the tile lies inside the weight, no mask (fewer predicates)."""
    if EVEN:
        return tl.load(ptr).to(tl.int32)
    else:
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)
    else:
        return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _q4k_scales(blk, c, g_ok, EVEN: tl.constexpr):
    """Q4_K block at byte offsets `blk`, 32-element groups 2c and 2c+1 of it: the 6-bit scales
    and mins unpacked from bytes 4..15 and times the block's d / dmin -> (d0, m0, d1, m1)."""
    d = _f16(blk, g_ok, EVEN)
    dmin = _f16(blk + 2, g_ok, EVEN)
    s_lo = _u8(blk + (4 + (2 * c) % 4)[None], g_ok, EVEN)
    m_lo = _u8(blk + (8 + (2 * c) % 4)[None], g_ok, EVEN)
    x_lo = _u8(blk + (12 + (2 * c) % 4)[None], g_ok, EVEN)
    s_hi = _u8(blk + (4 + (2 * c + 1) % 4)[None], g_ok, EVEN)
    m_hi = _u8(blk + (8 + (2 * c + 1) % 4)[None], g_ok, EVEN)
    x_hi = _u8(blk + (12 + (2 * c + 1) % 4)[None], g_ok, EVEN)
    first = (c < 2)[None]
    sc0 = tl.where(first, s_lo & 63, (x_lo & 15) | ((s_lo >> 6) << 4))
    mn0 = tl.where(first, m_lo & 63, (x_lo >> 4) | ((m_lo >> 6) << 4))
    sc1 = tl.where(first, s_hi & 63, (x_hi & 15) | ((s_hi >> 6) << 4))
    mn1 = tl.where(first, m_hi & 63, (x_hi >> 4) | ((m_hi >> 6) << 4))
    return (d * sc0.to(tl.float32), dmin * mn0.to(tl.float32), d * sc1.to(tl.float32),
            dmin * mn1.to(tl.float32))


@triton.jit
def _acc_plane(acc, w, x_rows, m_ok, koff, k_ok, USE_DOT: tl.constexpr, PREC: tl.constexpr,
               DEQ: tl.constexpr, ELEM: tl.constexpr, EVEN: tl.constexpr):
    """acc [BN, BM] += W_plane [BN, G, Q] (float32) times x[m, koff] (koff [G, Q]). DEQ: store
    the plane instead, at x_rows [BN] (the dense weight's row pointers) + koff, masked by m_ok."""
    BN: tl.constexpr = w.shape[0]
    G: tl.constexpr = w.shape[1]
    Q: tl.constexpr = w.shape[2]
    if DEQ:
        tl.store(x_rows[:, None, None] + koff[None, :, :],
                 w.to(x_rows.dtype.element_ty), mask=m_ok[:, None, None] & k_ok[None, :, :])
    elif ELEM:      # one activation row: acc [BN, G, Q] += w * x, reduced once after the loop
        if EVEN:
            xt = tl.load(x_rows + koff).to(tl.float32)                       # [G, Q]
        else:
            xt = tl.load(x_rows + koff, mask=k_ok, other=0.0).to(tl.float32)
        acc += w * xt[None, :, :]
    elif USE_DOT:
        kf = tl.reshape(koff, (G * Q,))
        okf = tl.reshape(k_ok, (G * Q,))
        xt = tl.load(x_rows[None, :] + kf[:, None], mask=m_ok[None, :] & okf[:, None],
                     other=0.0)                                            # [KP, BM]
        w2 = tl.reshape(w, (BN, G * Q)).to(xt.dtype)
        acc = tl.dot(w2, xt, acc, input_precision=PREC)
    else:
        xt = tl.load(x_rows[:, None, None] + koff[None, :, :],
                     mask=m_ok[:, None, None] & k_ok[None, :, :], other=0.0).to(tl.float32)
        acc += tl.sum(tl.sum(w[:, None, :, :] * xt[None, :, :, :], axis=3), axis=2)
    return acc


@triton.jit
def _x_pairs(x_rows, m_ok, koff, k_ok, USE_DOT: tl.constexpr, ELEM: tl.constexpr,
             EVEN: tl.constexpr):
    """x at the even offsets koff [G, Q2] and at koff + 1, as one contiguous tile split in two:
    ELEM [G, Q2] float32 each; dot [G * Q2, BM] (transposed, x's dtype); else [BM, G, Q2]."""
    t = tl.arange(0, 2)[None, None, :]
    offs = koff[:, :, None] + t
    if ELEM:
        if EVEN:
            xt = tl.load(x_rows + offs)
        else:
            xt = tl.load(x_rows + offs, mask=k_ok[:, :, None] & (t < 2), other=0.0)
        x0, x1 = tl.split(xt)
        x0 = x0.to(tl.float32)
        x1 = x1.to(tl.float32)
    else:
        xt = tl.load(x_rows[:, None, None, None] + offs[None],
                     mask=m_ok[:, None, None, None] & (k_ok[:, :, None] & (t < 2))[None],
                     other=0.0)
        x0, x1 = tl.split(xt)                                               # [BM, G, Q2]
        if USE_DOT:
            x0 = tl.trans(tl.reshape(x0, (x0.shape[0], x0.shape[1] * x0.shape[2])))
            x1 = tl.trans(tl.reshape(x1, (x1.shape[0], x1.shape[1] * x1.shape[2])))
        else:
            x0 = x0.to(tl.float32)
            x1 = x1.to(tl.float32)
    return x0, x1


@triton.jit
def _acc_x(acc, w, xp, x_rows, m_ok, koff, k_ok, USE_DOT: tl.constexpr, PREC: tl.constexpr,
           DEQ: tl.constexpr, ELEM: tl.constexpr, EVEN: tl.constexpr):
    """acc += W_plane [BN, G, Q] times the preloaded x plane xp (`_x_pairs`); DEQ: store the
    plane at koff as `_acc_plane` does."""
    if DEQ:
        acc = _acc_plane(acc, w, x_rows, m_ok, koff, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
    elif ELEM:
        acc += w * xp[None, :, :]
    elif USE_DOT:
        w2 = tl.reshape(w, (w.shape[0], w.shape[1] * w.shape[2])).to(xp.dtype)
        acc = tl.dot(w2, xp, acc, input_precision=PREC)
    else:
        acc += tl.sum(tl.sum(w[:, None, :, :] * xp[None, :, :, :], axis=3), axis=2)
    return acc


@triton.jit
def _u16_words(ptr, mask, EVEN: tl.constexpr):
    """Little-endian 2-byte words at the (2-aligned) byte pointers `ptr`, as int32."""
    p16 = ptr.to(tl.pointer_type(tl.uint16))
    if EVEN:
        return tl.load(p16).to(tl.int32)
    else:
        return tl.load(p16, mask=mask, other=0).to(tl.int32)


@triton.jit
def _nib_scaled(v, magic, SHIFT: tl.constexpr, OFFSET: tl.constexpr):
    """2**SHIFT * (nibble - OFFSET) for the nibble at bit SHIFT of v (< 2**16), exactly, with
    one logic op and one add (the 2**SHIFT goes into the scale, an exact power of two). `magic`
    (2^23's bits) is a run-time argument so the mask and it fit one 3-input logic op."""
    return ((v & (15 << SHIFT)) | magic).to(tl.float32, bitcast=True) - \
        (8388608.0 + OFFSET * (1 << SHIFT))


@triton.jit
def _int8_pair(v, magic):
    """The two int8 values of the 16-bit word v, exactly, as float32 (low byte, high byte /
    256: the 2^8 goes into the scale): int8 q + 128 = byte ^ 0x80, OR-ed into 2^23's mantissa
    in the same logic op."""
    lo = ((v & 0xFF) ^ (magic | 0x80)).to(tl.float32, bitcast=True) - 8388736.0
    hi = ((v & 0xFF00) ^ (magic | 0x8000)).to(tl.float32, bitcast=True) - 8421376.0
    return lo, hi


@triton.jit
def _word_step(FMT: tl.constexpr, acc, rows, n_ok, x_rows, m_ok, b0, nblk, magic,
               NB: tl.constexpr,
               USE_DOT: tl.constexpr, PREC: tl.constexpr, DEQ: tl.constexpr,
               ELEM: tl.constexpr, EVEN: tl.constexpr):
    """Q4_0, Q8_0, Q4_K, Q6_K read as 2-byte words (4 nibbles / 2 int8 a load): word i of
    a group holds the elements of bytes 2i, 2i + 1; every nibble plane keeps its bits in place
    and folds the power-of-two position into its scale, so dequantized values are unchanged."""
    nm = n_ok[:, None, None]
    if FMT == 0:      # Q4_0: word i: elements 2i, 16 + 2i (byte 2i), 2i + 1, 17 + 2i (byte 2i+1)
        b = b0 + tl.arange(0, NB)[:, None]
        i = tl.arange(0, 8)[None, :]
        k_ok = (b < nblk) & (i < 8)
        blk = rows[:, None, None] + (b * 18)[None]
        v = _u16_words(blk + 2 + 2 * i[None], nm & k_ok[None], EVEN)
        d = _f16(blk, nm & (b < nblk)[None], EVEN)
        ko = b * 32 + 2 * i
        if DEQ:
            xa0 = 0.0
            xa1 = 0.0
            xb0 = 0.0
            xb1 = 0.0
        else:
            xa0, xa1 = _x_pairs(x_rows, m_ok, ko, k_ok, USE_DOT, ELEM, EVEN)
            xb0, xb1 = _x_pairs(x_rows, m_ok, ko + 16, k_ok, USE_DOT, ELEM, EVEN)
        w0 = d * _nib_scaled(v, magic, 0, 8)
        w1 = (d * 0.0625) * _nib_scaled(v, magic, 4, 8)
        w2 = (d * 0.00390625) * _nib_scaled(v, magic, 8, 8)
        w3 = (d * 0.000244140625) * _nib_scaled(v, magic, 12, 8)
        acc = _acc_x(acc, w0, xa0, x_rows, m_ok, ko, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
        acc = _acc_x(acc, w1, xb0, x_rows, m_ok, ko + 16, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
        acc = _acc_x(acc, w2, xa1, x_rows, m_ok, ko + 1, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
        acc = _acc_x(acc, w3, xb1, x_rows, m_ok, ko + 17, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
    elif FMT == 4:    # Q8_0: word i holds int8 elements 2i (low byte) and 2i + 1
        b = b0 + tl.arange(0, NB)[:, None]
        i = tl.arange(0, 16)[None, :]
        k_ok = (b < nblk) & (i < 16)
        blk = rows[:, None, None] + (b * 34)[None]
        v = _u16_words(blk + 2 + 2 * i[None], nm & k_ok[None], EVEN)
        d = _f16(blk, nm & (b < nblk)[None], EVEN)
        ko = b * 32 + 2 * i
        if DEQ:
            x0 = 0.0
            x1 = 0.0
        else:
            x0, x1 = _x_pairs(x_rows, m_ok, ko, k_ok, USE_DOT, ELEM, EVEN)
        lo, hi = _int8_pair(v, magic)
        acc = _acc_x(acc, lo * d, x0, x_rows, m_ok, ko, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
        acc = _acc_x(acc, hi * (d * 0.00390625), x1, x_rows, m_ok, ko + 1, k_ok, USE_DOT, PREC,
                     DEQ, ELEM, EVEN)
    elif FMT == 9:    # Q6_K: group (block, half n, u), words i: elements l = 16u + 2i + t
        g = tl.arange(0, 4 * NB)[:, None]
        b = b0 + g // 4
        hn = (g // 2) % 2
        u = g % 2
        i = tl.arange(0, 8)[None, :]
        k_ok = (b < nblk) & (i < 8)
        km = nm & k_ok[None]
        g_ok = nm & (b < nblk)[None]
        blk = rows[:, None, None] + (b * 210)[None]
        lq = 64 * hn + 16 * u + 2 * i
        ql_a = _u16_words(blk + lq[None], km, EVEN)
        ql_b = _u16_words(blk + (lq + 32)[None], km, EVEN)
        qh = _u16_words(blk + (128 + 32 * hn + 16 * u + 2 * i)[None], km, EVEN)
        d = _f16(blk + 208, g_ok, EVEN)
        sbase = blk + (192 + 8 * hn + u)[None]
        kb = b * 256 + 128 * hn + 16 * u + 2 * i
        for r in tl.static_range(4):
            sc = _u8(sbase + 2 * r, g_ok, EVEN)
            dr = d * tl.where(sc >= 128, sc - 256, sc).to(tl.float32)
            if DEQ:
                x0 = 0.0
                x1 = 0.0
            else:
                x0, x1 = _x_pairs(x_rows, m_ok, kb + 32 * r, k_ok, USE_DOT, ELEM, EVEN)
            if r % 2 == 0:
                ql = ql_a
            else:
                ql = ql_b
            for t in tl.static_range(2):
                # q = lo + 16 hi: the nibble at bit S1 and the crumb at bit S2 stay in place,
                # 2^S1 (q - 32) = (2^S1 lo - 2^S1 32) + 2^(S1 + 4 - S2) (2^S2 hi), exact
                S1 = 8 * t + 4 * (r // 2)
                S2 = 8 * t + 2 * r
                lo = ((ql & (15 << S1)) | magic).to(tl.float32, bitcast=True) - \
                    (8388608.0 + 32.0 * (1 << S1))
                hi = ((qh & (3 << S2)) | magic).to(tl.float32, bitcast=True) - 8388608.0
                q = hi * (1 << (S1 + 4 - S2)) + lo
                w = (dr * (1.0 / (1 << S1))) * q
                if t == 0:
                    acc = _acc_x(acc, w, x0, x_rows, m_ok, kb + 32 * r, k_ok, USE_DOT, PREC,
                                 DEQ, ELEM, EVEN)
                else:
                    acc = _acc_x(acc, w, x1, x_rows, m_ok, kb + 32 * r + 1, k_ok, USE_DOT,
                                 PREC, DEQ, ELEM, EVEN)
    else:             # Q4_K: group (block, c) of 32 bytes, word i = bytes 2i, 2i + 1
        g = tl.arange(0, 4 * NB)[:, None]
        b = b0 + g // 4
        c = g % 4
        i = tl.arange(0, 16)[None, :]
        k_ok = (b < nblk) & (i < 16)
        g_ok = nm & (b < nblk)[None]
        blk = rows[:, None, None] + (b * 144)[None]
        v = _u16_words(blk + (16 + 32 * c + 2 * i)[None], nm & k_ok[None], EVEN)
        d0, m0, d1, m1 = _q4k_scales(blk, c, g_ok, EVEN)
        ko = b * 256 + 64 * c + 2 * i
        if DEQ:
            xa0 = 0.0
            xa1 = 0.0
            xb0 = 0.0
            xb1 = 0.0
        else:
            xa0, xa1 = _x_pairs(x_rows, m_ok, ko, k_ok, USE_DOT, ELEM, EVEN)
            xb0, xb1 = _x_pairs(x_rows, m_ok, ko + 32, k_ok, USE_DOT, ELEM, EVEN)
        w0 = d0 * _nib_scaled(v, magic, 0, 0) - m0
        w1 = (d1 * 0.0625) * _nib_scaled(v, magic, 4, 0) - m1
        w2 = (d0 * 0.00390625) * _nib_scaled(v, magic, 8, 0) - m0
        w3 = (d1 * 0.000244140625) * _nib_scaled(v, magic, 12, 0) - m1
        acc = _acc_x(acc, w0, xa0, x_rows, m_ok, ko, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
        acc = _acc_x(acc, w1, xb0, x_rows, m_ok, ko + 32, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
        acc = _acc_x(acc, w2, xa1, x_rows, m_ok, ko + 1, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
        acc = _acc_x(acc, w3, xb1, x_rows, m_ok, ko + 33, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
    return acc


@triton.jit
def _nf4_value(q, c_ptr, LUT: tl.constexpr):
    """The NF4 code value of 4-bit indices q: LUT 0 a gather from the 64-byte table (L1
    resident), 1 a select tree over the 16 values held in registers, 2 tl.gather."""
    if LUT == 0:
        v = tl.load(c_ptr + q)
    elif LUT == 1:
        b0 = (q & 1) != 0
        b1 = (q & 2) != 0
        b2 = (q & 4) != 0
        lo = tl.where(b2, tl.where(b1, tl.where(b0, tl.load(c_ptr + 7), tl.load(c_ptr + 6)),
                                   tl.where(b0, tl.load(c_ptr + 5), tl.load(c_ptr + 4))),
                      tl.where(b1, tl.where(b0, tl.load(c_ptr + 3), tl.load(c_ptr + 2)),
                               tl.where(b0, tl.load(c_ptr + 1), tl.load(c_ptr + 0))))
        hi = tl.where(b2, tl.where(b1, tl.where(b0, tl.load(c_ptr + 15), tl.load(c_ptr + 14)),
                                   tl.where(b0, tl.load(c_ptr + 13), tl.load(c_ptr + 12))),
                      tl.where(b1, tl.where(b0, tl.load(c_ptr + 11), tl.load(c_ptr + 10)),
                               tl.where(b0, tl.load(c_ptr + 9), tl.load(c_ptr + 8))))
        v = tl.where((q & 8) != 0, hi, lo)
    else:
        table = tl.load(c_ptr + tl.arange(0, 16))
        flat = tl.reshape(q, (q.shape[0] * q.shape[1] * q.shape[2],))
        v = tl.reshape(tl.gather(table, flat, 0), q.shape)
    return v


@triton.jit
def _row_step(FMT: tl.constexpr, acc, rows, n_ok, x_rows, m_ok, s_rows, c_ptr, b0, nblk,
              NB: tl.constexpr, BS: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
              LUT: tl.constexpr, DEQ: tl.constexpr, ELEM: tl.constexpr, EVEN: tl.constexpr):
    """acc += the product over format blocks b0 .. b0 + NB of the rows at byte pointers `rows`
    [BN] (NF4: absmax rows at `s_rows`)."""
    nm = n_ok[:, None, None]
    if FMT == 0:      # Q4_0: group = block, 16 bytes; low nibbles elements 0..15, high 16..31
        b = b0 + tl.arange(0, NB)[:, None]                                  # [G, 1]
        j = tl.arange(0, 16)[None, :]
        k_ok = (b < nblk) & (j < 16)
        mask = nm & k_ok[None]
        blk = rows[:, None, None] + (b * 18)[None]
        qs = _u8(blk + 2 + j[None], mask, EVEN)
        d = _f16(blk, nm & (b < nblk)[None], EVEN)
        acc = _acc_plane(acc, d * _int_to_f32(qs & 15, 8), x_rows, m_ok, b * 32 + j, k_ok,
                         USE_DOT, PREC, DEQ, ELEM, EVEN)
        acc = _acc_plane(acc, d * _int_to_f32(qs >> 4, 8), x_rows, m_ok, b * 32 + 16 + j, k_ok,
                         USE_DOT, PREC, DEQ, ELEM, EVEN)
    elif FMT == 4:    # Q8_0: 32 int8 after d; w = q * d
        b = b0 + tl.arange(0, NB)[:, None]
        j = tl.arange(0, 32)[None, :]
        k_ok = (b < nblk) & (j < 32)
        blk = rows[:, None, None] + (b * 34)[None]
        qs = _u8(blk + 2 + j[None], nm & k_ok[None], EVEN)
        d = _f16(blk, nm & (b < nblk)[None], EVEN)
        acc = _acc_plane(acc, _int_to_f32(qs ^ 128, 128) * d, x_rows, m_ok, b * 32 + j, k_ok,
                         USE_DOT, PREC, DEQ, ELEM, EVEN)
    elif FMT == 7:    # Q4_K: group (block, c) of 32 bytes; low nibbles sub-block 2c, high 2c + 1
        g = tl.arange(0, 4 * NB)[:, None]
        b = b0 + g // 4
        c = g % 4
        j = tl.arange(0, 32)[None, :]
        k_ok = (b < nblk) & (j < 32)
        g_ok = nm & (b < nblk)[None]
        blk = rows[:, None, None] + (b * 144)[None]
        qs = _u8(blk + (16 + 32 * c + j)[None], nm & k_ok[None], EVEN)
        d0, m0, d1, m1 = _q4k_scales(blk, c, g_ok, EVEN)
        kb = b * 256 + 64 * c + j
        acc = _acc_plane(acc, d0 * _int_to_f32(qs & 15, 0) - m0, x_rows, m_ok, kb, k_ok,
                         USE_DOT, PREC, DEQ, ELEM, EVEN)
        acc = _acc_plane(acc, d1 * _int_to_f32(qs >> 4, 0) - m1, x_rows, m_ok, kb + 32, k_ok,
                         USE_DOT, PREC, DEQ, ELEM, EVEN)
    elif FMT == 9:    # Q6_K: group (block, half n, u) of 16 elements l, e = 128n + 32r + 16u + l
        g = tl.arange(0, 4 * NB)[:, None]
        b = b0 + g // 4
        hn = (g // 2) % 2
        u = g % 2
        j = tl.arange(0, 16)[None, :]
        k_ok = (b < nblk) & (j < 16)
        km = nm & k_ok[None]
        g_ok = nm & (b < nblk)[None]
        blk = rows[:, None, None] + (b * 210)[None]
        lq = 64 * hn + 16 * u + j
        ql_a = _u8(blk + lq[None], km, EVEN)
        ql_b = _u8(blk + (lq + 32)[None], km, EVEN)
        qh = _u8(blk + (128 + 32 * hn + 16 * u + j)[None], km, EVEN)
        d = _f16(blk + 208, g_ok, EVEN)
        sbase = blk + (192 + 8 * hn + u)[None]
        kb = b * 256 + 128 * hn + 16 * u + j
        for r in tl.static_range(4):
            sc = _u8(sbase + 2 * r, g_ok, EVEN)
            dr = d * tl.where(sc >= 128, sc - 256, sc).to(tl.float32)
            if r == 0:
                lo = ql_a & 15
            elif r == 1:
                lo = ql_b & 15
            elif r == 2:
                lo = ql_a >> 4
            else:
                lo = ql_b >> 4
            q = lo | (((qh >> (2 * r)) & 3) << 4)
            acc = _acc_plane(acc, dr * _int_to_f32(q, 32), x_rows, m_ok, kb + 32 * r, k_ok,
                             USE_DOT, PREC, DEQ, ELEM, EVEN)
    else:             # NF4: group = absmax block of BS elements, BS // 2 bytes; high nibble even
        b = b0 + tl.arange(0, NB)[:, None]
        j = tl.arange(0, BS // 2)[None, :]
        k_ok = (b < nblk) & (j < BS // 2)
        byte = _u8(rows[:, None, None] + (b * (BS // 2) + j)[None], nm & k_ok[None], EVEN)
        if EVEN:
            s = tl.load(s_rows[:, None, None] + b[None])
        else:
            s = tl.load(s_rows[:, None, None] + b[None], mask=nm & (b < nblk)[None], other=0.0)
        acc = _acc_plane(acc, _nf4_value(byte >> 4, c_ptr, LUT) * s, x_rows, m_ok,
                         b * BS + 2 * j, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
        acc = _acc_plane(acc, _nf4_value(byte & 15, c_ptr, LUT) * s, x_rows, m_ok,
                         b * BS + 2 * j + 1, k_ok, USE_DOT, PREC, DEQ, ELEM, EVEN)
    return acc


@triton.jit
def _rows_kernel(x_ptr, w_ptr, s_ptr, c_ptr, out_ptr, M, N, row_bytes, s_row, nblk, stride_x,
                 stride_o, magic, STEPS: tl.constexpr, FMT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
                 USE_DOT: tl.constexpr, PREC: tl.constexpr, ATOMIC: tl.constexpr,
                 LUT: tl.constexpr, PG: tl.constexpr, PQ: tl.constexpr, ELEM: tl.constexpr,
                 EVEN: tl.constexpr = False, DEQ: tl.constexpr = False,
                 WORDS: tl.constexpr = False):
    """out[M, N] (+)= x[M, K] @ W.T over format blocks [pid_s * STEPS * NB, ...) of W's rows
    [pid_n * BLOCK_N, ...); W row n starts at byte n * row_bytes (NF4 absmax row at n * s_row)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows = w_ptr + offs_n.to(tl.int64) * row_bytes
    s_rows = s_ptr + offs_n.to(tl.int64) * s_row
    if DEQ:     # x_ptr is the dense [N, K] weight to write, stride_x = K
        x_rows = x_ptr + offs_n.to(tl.int64) * stride_x
        m_ok = n_ok
    else:
        x_rows = x_ptr + offs_m.to(tl.int64) * stride_x
    if ELEM:    # x has one row (its pointer x_rows[0]); acc [BN, PG, PQ] as the planes
        acc3 = tl.zeros((BLOCK_N, PG, PQ), tl.float32)
        x_row = x_ptr
        for i in range(STEPS):
            b0 = (pid_s * STEPS + i) * NB
            if WORDS:
                acc3 = _word_step(FMT, acc3, rows, n_ok, x_row, m_ok, b0, nblk, magic, NB,
                                  USE_DOT, PREC, DEQ, ELEM, EVEN)
            else:
                acc3 = _row_step(FMT, acc3, rows, n_ok, x_row, m_ok, s_rows, c_ptr, b0, nblk,
                                 NB, BS, USE_DOT, PREC, LUT, DEQ, ELEM, EVEN)
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)[:, None]
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for i in range(STEPS):
            b0 = (pid_s * STEPS + i) * NB
            if WORDS:
                acc = _word_step(FMT, acc, rows, n_ok, x_rows, m_ok, b0, nblk, magic, NB,
                                 USE_DOT, PREC, DEQ, ELEM, EVEN)
            else:
                acc = _row_step(FMT, acc, rows, n_ok, x_rows, m_ok, s_rows, c_ptr, b0, nblk, NB,
                                BS, USE_DOT, PREC, LUT, DEQ, ELEM, EVEN)
    if not DEQ:
        o_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
        o_mask = n_ok[:, None] & m_ok[None, :]
        if ATOMIC:
            tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")
        else:
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _awq_cols(zw, sc_ptrs, s_ok, P: tl.constexpr):
    """Per column of nibble P ([BW]): 2^23 + 2^SH z and s * 2^-SH (SH = 4 * (P % 4)), for a
    nibble kept in place in its 16-bit half of the word."""
    SH: tl.constexpr = 4 * (P % 4)
    z = (zw >> (4 * P)) & 15
    zm = 8388608.0 + (z << SH).to(tl.float32)
    s = tl.load(sc_ptrs + (2 * (P % 4) + P // 4), mask=s_ok, other=0.0).to(tl.float32)
    return zm, s * (1.0 / (1 << SH))


@triton.jit
def _awq_plane(acc, half, zm, sc, magic, P: tl.constexpr, xt, USE_DOT: tl.constexpr,
               PREC: tl.constexpr, ELEM: tl.constexpr):
    """acc [BM, BW] += x [BM, BK] @ W[:, 8c + e] for the columns e of nibble P of the words
    (ELEM: acc [BK, BW] += x[0, :, None] * W, reduced after the loop). `half`: the words'
    low 16 bits for P < 4, else the words >> 16; the nibble stays in place (2^SH * q), zm and
    sc from `_awq_cols`: W = (q - z) * s exactly."""
    SH: tl.constexpr = 4 * (P % 4)
    qf = ((half & (15 << SH)) | magic).to(tl.float32, bitcast=True)     # 2^23 + 2^SH q
    w = (qf - zm[None, :]) * sc[None, :]
    if ELEM:
        acc += w * tl.reshape(xt.to(tl.float32), (w.shape[0], 1))
    elif USE_DOT:
        acc = tl.dot(xt, w.to(xt.dtype), acc, input_precision=PREC)
    else:
        acc += tl.sum(xt.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    return acc


@triton.jit
def _awq_total(acc, ELEM: tl.constexpr):
    if ELEM:
        return tl.sum(acc, axis=0)[None, :]
    else:
        return acc


@triton.jit
def _awq_store(out_ptr, acc, o_rows, m_ok, col, n_ok, P: tl.constexpr, ATOMIC: tl.constexpr):
    ptrs = o_rows[:, None] + (col + 2 * (P % 4) + P // 4)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _awq_kernel(x_ptr, qw_ptr, qz_ptr, sc_ptr, out_ptr, M, N, K, group_size, stride_x, stride_o,
                magic,
                STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
                ATOMIC: tl.constexpr, ELEM: tl.constexpr, ACC_R: tl.constexpr,
                SUB: tl.constexpr):
    """out[M, N] (+)= x[M, K] @ W[K, N] for AutoAWQ's qweight [K, N/8]: BLOCK_W words (8 * BLOCK_W
    columns) per program, rows [pid_s * STEPS * SUB * BLOCK_K, ...); a step is SUB tiles of
    BLOCK_K rows inside one group (SUB * BLOCK_K divides group_size), so its zeros and scales
    are unpacked once per column for all of them."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    nw = N // 8
    offs_w = pid_n * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    w_ok = offs_w < nw
    m_ok = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    a0 = tl.zeros((ACC_R, BLOCK_W), tl.float32)
    a1 = tl.zeros((ACC_R, BLOCK_W), tl.float32)
    a2 = tl.zeros((ACC_R, BLOCK_W), tl.float32)
    a3 = tl.zeros((ACC_R, BLOCK_W), tl.float32)
    a4 = tl.zeros((ACC_R, BLOCK_W), tl.float32)
    a5 = tl.zeros((ACC_R, BLOCK_W), tl.float32)
    a6 = tl.zeros((ACC_R, BLOCK_W), tl.float32)
    a7 = tl.zeros((ACC_R, BLOCK_W), tl.float32)
    for i in range(STEPS):
        k0 = (pid_s * STEPS + i) * (SUB * BLOCK_K)
        g = k0 // group_size
        s_ok = w_ok & (k0 < K)
        zw = tl.load(qz_ptr + g * nw + offs_w, mask=s_ok, other=0)           # [BW]
        scp = sc_ptr + g.to(tl.int64) * N + 8 * offs_w
        z0, s0 = _awq_cols(zw, scp, s_ok, 0)
        z1, s1 = _awq_cols(zw, scp, s_ok, 1)
        z2, s2 = _awq_cols(zw, scp, s_ok, 2)
        z3, s3 = _awq_cols(zw, scp, s_ok, 3)
        z4, s4 = _awq_cols(zw, scp, s_ok, 4)
        z5, s5 = _awq_cols(zw, scp, s_ok, 5)
        z6, s6 = _awq_cols(zw, scp, s_ok, 6)
        z7, s7 = _awq_cols(zw, scp, s_ok, 7)
        for sub in tl.static_range(SUB):
            kk = k0 + sub * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            words = tl.load(qw_ptr + kk.to(tl.int64)[:, None] * nw + offs_w[None, :],
                            mask=k_ok[:, None] & w_ok[None, :], other=0)
            xt = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_hi = words >> 16
            a0 = _awq_plane(a0, words, z0, s0, magic, 0, xt, USE_DOT, PREC, ELEM)
            a1 = _awq_plane(a1, words, z1, s1, magic, 1, xt, USE_DOT, PREC, ELEM)
            a2 = _awq_plane(a2, words, z2, s2, magic, 2, xt, USE_DOT, PREC, ELEM)
            a3 = _awq_plane(a3, words, z3, s3, magic, 3, xt, USE_DOT, PREC, ELEM)
            a4 = _awq_plane(a4, w_hi, z4, s4, magic, 4, xt, USE_DOT, PREC, ELEM)
            a5 = _awq_plane(a5, w_hi, z5, s5, magic, 5, xt, USE_DOT, PREC, ELEM)
            a6 = _awq_plane(a6, w_hi, z6, s6, magic, 6, xt, USE_DOT, PREC, ELEM)
            a7 = _awq_plane(a7, w_hi, z7, s7, magic, 7, xt, USE_DOT, PREC, ELEM)
    o_rows = out_ptr + offs_m.to(tl.int64) * stride_o
    col = 8 * offs_w
    _awq_store(out_ptr, _awq_total(a0, ELEM), o_rows, m_ok, col, w_ok, 0, ATOMIC)
    _awq_store(out_ptr, _awq_total(a1, ELEM), o_rows, m_ok, col, w_ok, 1, ATOMIC)
    _awq_store(out_ptr, _awq_total(a2, ELEM), o_rows, m_ok, col, w_ok, 2, ATOMIC)
    _awq_store(out_ptr, _awq_total(a3, ELEM), o_rows, m_ok, col, w_ok, 3, ATOMIC)
    _awq_store(out_ptr, _awq_total(a4, ELEM), o_rows, m_ok, col, w_ok, 4, ATOMIC)
    _awq_store(out_ptr, _awq_total(a5, ELEM), o_rows, m_ok, col, w_ok, 5, ATOMIC)
    _awq_store(out_ptr, _awq_total(a6, ELEM), o_rows, m_ok, col, w_ok, 6, ATOMIC)
    _awq_store(out_ptr, _awq_total(a7, ELEM), o_rows, m_ok, col, w_ok, 7, ATOMIC)


# ---- launch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowConfig:
    """One program: block_m activation rows (tl.dot when >= 16, else CUDA cores), block_n
    output features (AWQ: 8 * words), `steps` K-chunks per step (row formats: format blocks,
    NF4: absmax blocks; AWQ: rows of K), `split` programs per output tile along K (0: from
    the SM count). lut: NF4's code lookup (0 table load, 1 select tree, 2 tl.gather)."""
    block_m: int
    block_n: int
    steps: int
    split: int = 0
    num_warps: int = 4
    num_stages: int = 2
    lut: int = 0
    words: int = 1      # Q4_0 / Q8_0 / Q4_K: read 2-byte words (0: bytes)
    x32: int = 1        # one row: x converted to float32 once up front (0: per element)
    sub: int = 4        # AWQ: row tiles per step sharing one group's unpacked zeros / scales
    prefetch: int = 0   # one row of Q4_0 / Q8_0 / NF4: next step's bytes loaded ahead (quant_gemv;
    #                     2: and x read at the weight's positions)

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16

    def tag(self) -> str:
        return (f"rows[m{self.block_m},n{self.block_n},k{self.steps},s{self.split},"
                f"w{self.num_warps},st{self.num_stages}" + (f",lut{self.lut}" if self.lut else "")
                + ("" if self.words else ",bytes") + ("" if self.x32 else ",x16")
                + ("" if self.sub == 4 else f",sub{self.sub}") + (f",pf{self.prefetch}" if self.prefetch else "")
                + "]")


#: default launches by activation rows (up to the key): (block_m, block_n, plane elements per
#: step, warps, stages); AWQ's block_n counts columns (8 per packed word). Untuned starting
#: points sized so one plane tile is 4-8K elements (<= ~64 registers a thread);
#: `bench_cuda_quant.py --sweep` times variants and prints the best per format and M.
ROWS_TABLE = {1: (1, 16, 4096, 4, 2), 4: (4, 8, 1024, 4, 2), 16: (16, 64, 8192, 4, 2),
              1 << 30: (128, 128, 8192, 8, 3)}
AWQ_TABLE = {1: (1, 256, 8192, 8, 2), 4: (4, 64, 1024, 4, 2), 16: (16, 256, 8192, 4, 2),
             1 << 30: (128, 128, 16384, 8, 3)}


def make_config(fmt: int, block_m: int, block_n: int, elems: int, num_warps: int = 4,
                num_stages: int = 2, split: int = 0, lut: int | None = None) -> RowConfig:
    """A RowConfig whose plane tile has about `elems` elements ([block_n, steps * per-block];
    AWQ: all 8 planes of [steps rows, block_n / 8 words]); steps rounded down to a power of 2."""
    per = block_n if fmt == AWQ else block_n * PLANE_PER_BLOCK[fmt]
    steps = 1 << max(0, (max(1, elems // per)).bit_length() - 1)
    if lut is None:     # NF4: tl.gather (a shared-memory lookup) beat the global-table gather
        lut = 2 if fmt == NF4 else 0    # and the select tree: sm_90 SASS, 6.8 / 8.3 / 18 per el.
    return RowConfig(block_m, block_n, steps, split, num_warps, num_stages, lut)


def default_rows_config(fmt: int, m: int) -> RowConfig:
    table = AWQ_TABLE if fmt == AWQ else ROWS_TABLE
    bm, bn, elems, warps, stages = table[min(key for key in table if m <= key)]
    return make_config(fmt, bm, bn, elems, warps, stages)


def _plane_shape(fmt: int, steps: int, i0: int, words: bool) -> dict:
    """(groups, elements) of one plane tile row per step: the ELEM accumulator's shape."""
    g, q = {Q4_0: (1, 16), Q8_0: (1, 32), Q4_K: (4, 32), Q6_K: (4, 16), NF4: (1, i0 // 2)}[fmt]
    return {"PG": g * steps, "PQ": q // 2 if words else q, "WORDS": words}


def _grid_split(tiles: int, total: int, split: int, device) -> tuple[int, int]:
    """(split, steps per split): when the tile grid is under ~2 waves of 4 programs per SM,
    split the reduction until it is (partial sums then meet by atomics)."""
    if split <= 0:
        want = 4 * num_sms(device)
        split = 1 if tiles >= want // 2 else max(1, min(total, want // max(tiles, 1)))
    steps = triton.cdiv(total, split)
    return triton.cdiv(total, steps), steps


def run_rows(fmt: int, x, w0, w1, w2, i0: int, k: int, n: int, config: RowConfig | None = None):
    """x [..., K] @ B [K, N] through the kernels above; arguments as `quant.run` (GGUF: bytes,
    -, -, row_bytes; NF4: packed, absmax, code table, block_size; AWQ: qweight, qzeros, scales,
    group_size). Returns [..., N] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    cfg = config or default_rows_config(fmt, m)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    xk = x2.float() if cfg.block_m == 1 and cfg.x32 else x2     # [1, K]: a tiny copy
    if fmt == AWQ:
        bk = min(cfg.steps, i0)
        while i0 % bk:
            bk //= 2
        sub = cfg.sub
        while sub > 1 and i0 % (sub * bk):
            sub //= 2
        bw = max(1, cfg.block_n // 8)
        tiles = triton.cdiv(n // 8, bw) * triton.cdiv(m, cfg.block_m)
        split, steps = _grid_split(tiles, triton.cdiv(k, sub * bk), cfg.split, x.device)
    else:
        qk = i0 if fmt == NF4 else ROW_QK[fmt]
        nblk = k // qk
        tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
        split, steps = _grid_split(tiles, triton.cdiv(nblk, cfg.steps), cfg.split, x.device)
    atomic = split > 1
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    # fused multiply-adds only where no dequantizer has an a * b + c (Q4_K's d * q - m): the
    # weights stay bit-exact, the products accumulate with one rounding less
    opts = dict(STEPS=steps, BLOCK_M=cfg.block_m, USE_DOT=cfg.use_dot, PREC=prec, ATOMIC=atomic,
                ELEM=cfg.block_m == 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                enable_fp_fusion=fmt != Q4_K)
    if fmt == AWQ:
        grid = (triton.cdiv(n // 8, bw), triton.cdiv(m, cfg.block_m), split)
        _awq_kernel[grid](xk, w0, w1, w2, out, m, n, k, i0, xk.stride(0), out.stride(0),
                          MAGIC_BITS,
                          BLOCK_W=bw, BLOCK_K=bk, ACC_R=bk if cfg.block_m == 1 else cfg.block_m,
                          SUB=sub, **opts)
    else:
        row_bytes = k // 2 if fmt == NF4 else (k // qk) * ROW_BB[fmt]
        s_row = k // i0 if fmt == NF4 else 0
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
        even = n % cfg.block_n == 0 and nblk == split * steps * cfg.steps
        if cfg.prefetch and m == 1 and cfg.block_m == 1 and fmt in (Q4_0, Q8_0, NF4):
            from .quant_gemv import _gemv_prefetch_kernel     # it imports this module's helpers
            _gemv_prefetch_kernel[grid](xk, w0, w1, w2, out, n, row_bytes, s_row, nblk,
                                        MAGIC_BITS, STEPS=steps, FMT=fmt, BLOCK_N=cfg.block_n,
                                        NB=cfg.steps, BS=i0 if fmt == NF4 else 32, LUT=cfg.lut,
                                        PQ={Q4_0: 8, Q8_0: 16}.get(fmt, i0 // 2), ATOMIC=atomic,
                                        XB=cfg.prefetch == 2, num_warps=cfg.num_warps,
                                        num_stages=1)
            return (out.to(x.dtype) if atomic and x.dtype != torch.float32 else
                    out).reshape(*lead, n)
        # a dot needs >= 16 elements along K: one Q4_0 block's word planes have 8 (bytes: 16)
        words = cfg.words and fmt in WORD_FORMATS and not (
            cfg.use_dot and fmt == Q4_0 and cfg.steps < 2)
        _rows_kernel[grid](xk, w0, w1, w2, out, m, n, row_bytes, s_row, nblk, xk.stride(0),
                           out.stride(0), MAGIC_BITS, FMT=fmt, BLOCK_N=cfg.block_n, NB=cfg.steps,
                           BS=i0 if fmt == NF4 else 32, LUT=cfg.lut, EVEN=even,
                           **_plane_shape(fmt, cfg.steps, i0, words), **opts)
    if atomic and x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out.reshape(*lead, n)


def dequantize_rows(fmt: int, w0, w1, w2, i0: int, k: int, n: int, dtype=torch.bfloat16,
                    block_n: int = 32, steps: int = 0, words: bool = False):
    """The dense weight W [N, K] (GGUF / NF4 row formats) in `dtype`, written row by row in the
    storage order (for the many-row GEMM path: then cuBLAS on x @ W.T). Byte reads by default:
    their planes store contiguous runs (2-byte-word planes store every other element)."""
    qk = i0 if fmt == NF4 else ROW_QK[fmt]
    out = torch.empty(n, k, dtype=dtype, device=w0.device)
    steps = steps or max(1, 4096 // block_n // PLANE_PER_BLOCK[fmt])
    grid = (triton.cdiv(n, block_n), 1, triton.cdiv(k // qk, steps))
    row_bytes = k // 2 if fmt == NF4 else (k // qk) * ROW_BB[fmt]
    _rows_kernel[grid](out, w0, w1, w2, out, 1, n, row_bytes, k // i0 if fmt == NF4 else 0,
                       k // qk, k, k, MAGIC_BITS, STEPS=1, FMT=fmt, BLOCK_M=1, BLOCK_N=block_n,
                       NB=steps,
                       BS=i0 if fmt == NF4 else 32, USE_DOT=False, PREC="ieee", ATOMIC=False,
                       LUT=2 if fmt == NF4 else 0, DEQ=True, ELEM=False, num_warps=4, enable_fp_fusion=False,
                       **_plane_shape(fmt, steps, i0, words and fmt in WORD_FORMATS))
    return out
