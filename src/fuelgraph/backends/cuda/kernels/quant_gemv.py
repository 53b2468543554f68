"""One-row quantized matmul (`out = x @ W.T`, x [1, K]) for Q4_0, Q8_0 and NF4 with the weight
bytes of the next step loaded before the current step is multiplied (software prefetch in
registers): Triton pipelines only loads that feed a dot, so the storage-order GEMV of
`quant_rows` has one step's bytes in flight per program and waits for them every iteration;
here two are. Same planes, same float ops (bit-exact dequantization) and same launch
(`quant_rows.run_rows` with RowConfig.prefetch) as the ELEM path of `quant_rows._rows_kernel`."""
from __future__ import annotations

import triton
import triton.language as tl

from .quant_rows import _int8_pair, _nf4_value, _nib_scaled, _x_pairs


@triton.jit
def _raw(FMT: tl.constexpr, rows, n_ok, s_rows, b0, lim, NB: tl.constexpr, BS: tl.constexpr):
    """The packed bytes of blocks b0 .. b0 + NB (those < lim) of the rows `rows` [BN]:
    (payload, f16 / float32 scale) tiles, masked."""
    nm = n_ok[:, None, None]
    b = b0 + tl.arange(0, NB)[:, None]
    if FMT == 0:      # Q4_0: 8 2-byte words after d
        i = tl.arange(0, 8)[None, :]
        blk = rows[:, None, None] + (b * 18)[None]
        p16 = (blk + 2 + 2 * i[None]).to(tl.pointer_type(tl.uint16))
        v = tl.load(p16, mask=nm & ((b < lim) & (i < 8))[None], other=0)
        d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=nm & (b < lim)[None], other=0.0)
    elif FMT == 4:    # Q8_0: 16 2-byte words after d
        i = tl.arange(0, 16)[None, :]
        blk = rows[:, None, None] + (b * 34)[None]
        p16 = (blk + 2 + 2 * i[None]).to(tl.pointer_type(tl.uint16))
        v = tl.load(p16, mask=nm & ((b < lim) & (i < 16))[None], other=0)
        d = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=nm & (b < lim)[None], other=0.0)
    else:             # NF4: BS / 2 bytes a block, absmax float32
        j = tl.arange(0, BS // 2)[None, :]
        v = tl.load(rows[:, None, None] + (b * (BS // 2) + j)[None],
                    mask=nm & ((b < lim) & (j < BS // 2))[None], other=0)
        d = tl.load(s_rows[:, None, None] + b[None], mask=nm & (b < lim)[None], other=0.0)
    return v, d


@triton.jit
def _x_at(x_ptr, m_ok, koff, k_ok, like, XB: tl.constexpr):
    """x (float32) at the element offsets koff [G, Q] and koff + 1, shaped to broadcast against
    the weight tiles `like` [BN, G, Q]. XB: read at the weight's own [BN, G, Q] positions (the
    same layout, no exchange through shared memory and its barriers; more L1 reads)."""
    if XB:
        xp = x_ptr + koff[None, :, :] + 0 * like
        km = k_ok[None, :, :]
        return tl.load(xp, mask=km, other=0.0), tl.load(xp + 1, mask=km, other=0.0)
    else:
        x0, x1 = _x_pairs(x_ptr, m_ok, koff, k_ok, False, True, False)
        return x0[None, :, :], x1[None, :, :]


@triton.jit
def _mul(FMT: tl.constexpr, acc, v, d, x_ptr, m_ok, n_ok, c_ptr, b0, nblk, magic,
         NB: tl.constexpr, BS: tl.constexpr, LUT: tl.constexpr, XB: tl.constexpr):
    """acc [BN, NB, Q] += the planes of the raw tiles (v, d) of blocks b0 .. b0 + NB times x."""
    b = b0 + tl.arange(0, NB)[:, None]
    if FMT == 0:
        i = tl.arange(0, 8)[None, :]
        k_ok = (b < nblk) & (i < 8)
        ko = b * 32 + 2 * i
        v = v.to(tl.int32)
        d = d.to(tl.float32)
        xa0, xa1 = _x_at(x_ptr, m_ok, ko, k_ok, v, XB)
        xb0, xb1 = _x_at(x_ptr, m_ok, ko + 16, k_ok, v, XB)
        acc += d * _nib_scaled(v, magic, 0, 8) * xa0
        acc += (d * 0.0625) * _nib_scaled(v, magic, 4, 8) * xb0
        acc += (d * 0.00390625) * _nib_scaled(v, magic, 8, 8) * xa1
        acc += (d * 0.000244140625) * _nib_scaled(v, magic, 12, 8) * xb1
    elif FMT == 4:
        i = tl.arange(0, 16)[None, :]
        k_ok = (b < nblk) & (i < 16)
        ko = b * 32 + 2 * i
        v = v.to(tl.int32)
        d = d.to(tl.float32)
        x0, x1 = _x_at(x_ptr, m_ok, ko, k_ok, v, XB)
        lo, hi = _int8_pair(v, magic)
        acc += (lo * d) * x0
        acc += (hi * (d * 0.00390625)) * x1
    else:
        j = tl.arange(0, BS // 2)[None, :]
        k_ok = (b < nblk) & (j < BS // 2)
        byte = v.to(tl.int32)
        x0, x1 = _x_at(x_ptr, m_ok, b * BS + 2 * j, k_ok, byte, XB)
        acc += (_nf4_value(byte >> 4, c_ptr, LUT) * d) * x0
        acc += (_nf4_value(byte & 15, c_ptr, LUT) * d) * x1
    return acc


@triton.jit
def _gemv_prefetch_kernel(x_ptr, w_ptr, s_ptr, c_ptr, out_ptr, N, row_bytes, s_row, nblk, magic,
                          STEPS: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                          NB: tl.constexpr, BS: tl.constexpr, LUT: tl.constexpr,
                          PQ: tl.constexpr, ATOMIC: tl.constexpr, XB: tl.constexpr = False):
    """out[0, N] (+)= x[0, K] @ W.T over blocks [pid_s * STEPS * NB, ...) of rows
    [pid_n * BLOCK_N, ...); x float32."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    m_ok = tl.arange(0, 1) < 1
    rows = w_ptr + offs_n.to(tl.int64) * row_bytes
    s_rows = s_ptr + offs_n.to(tl.int64) * s_row
    first = pid_s * STEPS * NB
    lim = tl.minimum(nblk, first + STEPS * NB)
    acc = tl.zeros((BLOCK_N, NB, PQ), tl.float32)
    v, d = _raw(FMT, rows, n_ok, s_rows, first, lim, NB, BS)
    for i in range(STEPS):
        b0 = first + i * NB
        v_next, d_next = _raw(FMT, rows, n_ok, s_rows, b0 + NB, lim, NB, BS)
        acc = _mul(FMT, acc, v, d, x_ptr, m_ok, n_ok, c_ptr, b0, nblk, magic, NB, BS, LUT, XB)
        v = v_next
        d = d_next
    total = tl.sum(tl.sum(acc, axis=2), axis=1)
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, total, mask=n_ok, sem="relaxed")
    else:
        tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
