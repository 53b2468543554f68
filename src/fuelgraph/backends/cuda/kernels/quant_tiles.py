"""Triton tile dequantizers of the quantized-matmul kernels (`quant.py`), one per format.

Every function returns the float32 tile B[kk, nn] of the matrix B with `out = x @ B` for the
logical indices kk [BK, 1] (the reduction axis) and nn [1, BN] (output features): B = W.T for
GGUF and NF4 weights ([N, K] row-major, blocks along K), B = W for AWQ ([K, N]). Each element
reads its own code bits and scales (the loads of one block coalesce; redundant addresses in a
warp are one transaction), so tiles need not align with the format's blocks. Masked elements
read zeros and come out 0. The float ops per element are those of the reference dequantizer,
in the same order (launch with enable_fp_fusion=False to keep them unfused, bit-exact)."""
from __future__ import annotations

import triton
import triton.language as tl

# format ids (constexpr FMT of the kernels)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, NF4, AWQ = range(12)
GGUF_IDS = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q8_0": Q8_0, "Q2_K": Q2_K,
            "Q3_K": Q3_K, "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    """The little-endian f16 at byte pointer `ptr` (2-aligned) as float32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _i8(v):
    return tl.where(v >= 128, v - 256, v)


@triton.jit
def _nib32(blk, off, e, mask):
    """32-element formats: low nibbles of qs[16] at `off` are elements 0..15, high 16..31."""
    return (_u8(blk + off + e % 16, mask) >> (4 * (e // 16))) & 15


@triton.jit
def _bit32(blk, off, e, mask):
    """Bit e of the little-endian u32 at `off`."""
    return (_u8(blk + off + e // 8, mask) >> (e % 8)) & 1


@triton.jit
def _k_tile(blk, e, mask, QOFF: tl.constexpr, HIGH_BIT: tl.constexpr):
    """Q4_K / Q5_K: e = 64c + 32t + l, sub-block j = e // 32 = 2c + t with 6-bit (scale, min);
    Q5_K's fifth bit is bit j of qh[l] (at byte 16)."""
    j = e // 32
    q = (_u8(blk + QOFF + 32 * (e // 64) + e % 32, mask) >> (4 * (j % 2))) & 15
    if HIGH_BIT:
        q = q | (((_u8(blk + 16 + e % 32, mask) >> j) & 1) << 4)
    b0 = _u8(blk + 4 + j % 4, mask)
    b1 = _u8(blk + 8 + j % 4, mask)
    b2 = _u8(blk + 12 + j % 4, mask)
    sc = tl.where(j < 4, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(j < 4, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    d = _f16(blk, mask) * sc.to(tl.float32)
    dm = _f16(blk + 2, mask) * mn.to(tl.float32)
    return d * q.to(tl.float32) - dm


@triton.jit
def _gguf_tile(FMT: tl.constexpr, w_ptr, row_bytes, kk, nn, mask):
    base = w_ptr + nn.to(tl.int64) * row_bytes
    if FMT == 0:    # Q4_0
        blk = base + (kk // 32) * 18
        e = kk % 32
        w = _f16(blk, mask) * (_nib32(blk, 2, e, mask) - 8).to(tl.float32)
    elif FMT == 1:  # Q4_1
        blk = base + (kk // 32) * 20
        e = kk % 32
        w = _f16(blk, mask) * _nib32(blk, 4, e, mask).to(tl.float32) + _f16(blk + 2, mask)
    elif FMT == 2:  # Q5_0
        blk = base + (kk // 32) * 22
        e = kk % 32
        q = _nib32(blk, 6, e, mask) | (_bit32(blk, 2, e, mask) << 4)
        w = _f16(blk, mask) * (q - 16).to(tl.float32)
    elif FMT == 3:  # Q5_1
        blk = base + (kk // 32) * 24
        e = kk % 32
        q = _nib32(blk, 8, e, mask) | (_bit32(blk, 4, e, mask) << 4)
        w = _f16(blk, mask) * q.to(tl.float32) + _f16(blk + 2, mask)
    elif FMT == 4:  # Q8_0
        blk = base + (kk // 32) * 34
        w = _i8(_u8(blk + 2 + kk % 32, mask)).to(tl.float32) * _f16(blk, mask)
    elif FMT == 5:  # Q2_K: e = 128n + 32s + 16u + l; sub-block j = e // 16
        blk = base + (kk // 256) * 84
        e = kk % 256
        q = (_u8(blk + 16 + 32 * (e // 128) + e % 32, mask) >> (2 * ((e // 32) % 4))) & 3
        sc = _u8(blk + e // 16, mask)
        dl = _f16(blk + 80, mask) * (sc & 15).to(tl.float32)
        ml = _f16(blk + 82, mask) * (sc >> 4).to(tl.float32)
        w = dl * q.to(tl.float32) - ml
    elif FMT == 6:  # Q3_K: 6-bit signed scales S[j], j = e // 16; hmask bit e // 32 of byte e % 32
        blk = base + (kk // 256) * 110
        e = kk % 256
        j = e // 16
        low = (_u8(blk + 96 + j % 8, mask) >> (4 * (j // 8))) & 15
        high = (_u8(blk + 104 + j % 4, mask) >> (2 * (j // 4))) & 3
        s = (low | (high << 4)) - 32
        ql = (_u8(blk + 32 + 32 * (e // 128) + e % 32, mask) >> (2 * ((e // 32) % 4))) & 3
        hm = (_u8(blk + e % 32, mask) >> (e // 32)) & 1
        dl = _f16(blk + 108, mask) * s.to(tl.float32)
        w = dl * (ql - 4 + 4 * hm).to(tl.float32)
    elif FMT == 7:  # Q4_K
        w = _k_tile(base + (kk // 256) * 144, kk % 256, mask, 16, False)
    elif FMT == 8:  # Q5_K
        w = _k_tile(base + (kk // 256) * 176, kk % 256, mask, 48, True)
    else:           # Q6_K: e = 128n + 32r + l
        blk = base + (kk // 256) * 210
        e = kk % 256
        r = (e // 32) % 4
        n = e // 128
        lo = (_u8(blk + 64 * n + 32 * (r % 2) + e % 32, mask) >> (4 * (r // 2))) & 15
        hi = (_u8(blk + 128 + 32 * n + e % 32, mask) >> (2 * r)) & 3
        d = _f16(blk + 208, mask) * _i8(_u8(blk + 192 + e // 16, mask)).to(tl.float32)
        w = d * ((lo | (hi << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _nf4_tile(packed_ptr, absmax_ptr, code_ptr, block_size, K, kk, nn, mask):
    """B = W.T: byte k // 2 of row n holds element 2j in its high nibble, 2j+1 in its low."""
    n64 = nn.to(tl.int64)
    byte = _u8(packed_ptr + n64 * (K // 2) + kk // 2, mask)
    code = (byte >> (4 - 4 * (kk % 2))) & 15
    v = tl.load(code_ptr + code, mask=mask, other=0.0)
    s = tl.load(absmax_ptr + n64 * (K // block_size) + kk // block_size, mask=mask, other=0.0)
    return v * s


@triton.jit
def _awq_tile(qweight_ptr, qzeros_ptr, scales_ptr, group_size, N, kk, nn, mask):
    """B = W [K, N]: column 8c + e sits in nibble (e // 2) + 4 * (e % 2) of word c."""
    shift = 4 * ((nn % 8) // 2 + 4 * (nn % 2))
    words = N // 8
    k64 = kk.to(tl.int64)
    g = k64 // group_size
    q = (tl.load(qweight_ptr + k64 * words + nn // 8, mask=mask, other=0) >> shift) & 15
    z = (tl.load(qzeros_ptr + g * words + nn // 8, mask=mask, other=0) >> shift) & 15
    s = tl.load(scales_ptr + g * N + nn, mask=mask, other=0.0).to(tl.float32)
    return (q - z).to(tl.float32) * s


@triton.jit
def b_tile(FMT: tl.constexpr, w0, w1, w2, i0, k0, n0, K, N,
           BK: tl.constexpr, BN: tl.constexpr):
    """float32 B[k0:k0+BK, n0:n0+BN] (zeros outside [K, N]). Pointers/ints by format: GGUF
    (bytes, -, -, row_bytes), NF4 (packed, absmax, code table, block_size), AWQ (qweight,
    qzeros, scales, group_size)."""
    kk = k0 + tl.arange(0, BK)[:, None]
    nn = n0 + tl.arange(0, BN)[None, :]
    mask = (kk < K) & (nn < N)
    if FMT == 10:
        w = _nf4_tile(w0, w1, w2, i0, K, kk, nn, mask)
    elif FMT == 11:
        w = _awq_tile(w0, w1, w2, i0, N, kk, nn, mask)
    else:
        w = _gguf_tile(FMT, w0, i0, kk, nn, mask)
    return w
