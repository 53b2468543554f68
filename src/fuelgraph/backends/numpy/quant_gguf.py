"""NumPy dequantizers of the GGUF block formats, one class per format: `dequantize(blk, out)`
turns uint8 blocks [nb, type_size] into float32 [nb, block] written to `out`.

Bit-exact with `gguf.quants.dequantize`: the codes become small exact integers in float32 (by
table look-ups of whole bytes, which is faster than shifting and masking element by element),
and each element then sees the same float32 multiplies and adds, in the same order, as ggml's
reference (e.g. Q4_K: `(d * sc) * q - (dmin * mn)`, each product rounded once). The reference
beside each is `Q*.recipe` in `fuelgraph.registry.quant_gguf` (the same math in primitives)."""
from __future__ import annotations

import numpy as np

_B = np.arange(256)
_F32 = np.float32


def _table(*cols):
    return np.ascontiguousarray(np.stack(cols, 1).astype(_F32))


#: code -> float32 value tables (small exact integers)
ARANGE = np.arange(64, dtype=_F32)
CODE4_M8 = ARANGE[:16] - 8        # Q4_0
CODE5_M16 = ARANGE[:32] - 16      # Q5_0
CODE3_M4 = ARANGE[:8] - 4         # Q3_K: 2 low bits + 4 * mask bit, minus 4
CODE6_M32 = ARANGE - 32           # Q6_K
#: int8 reading of a byte
SIGNED = np.where(_B < 128, _B, _B - 256).astype(_F32)
#: per byte: (low nibble, high nibble) as float32 (NF4 / AWQ style unpacking by look-up)
NIB = _table(_B & 15, _B >> 4)


def _f16(blk, off):
    """The f16 field at byte offset `off` of each block, float32 [nb, 1] (exact)."""
    return np.ascontiguousarray(blk[:, off:off + 2]).view(np.float16).astype(_F32)


def _nibbles(qs, shape):
    """uint8 codes: low nibbles of the [..., m] bytes `qs`, then their high nibbles, as an
    array of `shape` (whose axis -2 has extent 2: low, high)."""
    q = np.empty(shape, np.uint8)
    np.bitwise_and(qs, 15, out=q[..., 0, :])
    np.right_shift(qs, 4, out=q[..., 1, :])
    return q


def _bit_planes(b):
    """[nb, m] bytes -> uint8 [nb, 8, m]: plane p holds bit p of every byte."""
    return np.unpackbits(b[:, :, None], axis=2, bitorder="little").transpose(0, 2, 1)


def _to_float(table, codes, out):
    """out[...] = table[codes] (codes are uint8, in range)."""
    np.take(table, codes.reshape(out.shape), out=out)


class Q4_0:
    name, block, type_size = "Q4_0", 32, 18

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        _to_float(CODE4_M8, _nibbles(blk[:, 2:18], (nb, 2, 16)), out)
        out *= _f16(blk, 0)


class Q4_1:
    name, block, type_size = "Q4_1", 32, 20

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        _to_float(ARANGE, _nibbles(blk[:, 4:20], (nb, 2, 16)), out)
        out *= _f16(blk, 0)
        out += _f16(blk, 2)


def _q5(blk, out, qs, qh, table):
    """Q5_0/Q5_1 codes (nibble + 16 * bit e%8 of qh[e//8]) as float32 via `table`."""
    nb = blk.shape[0]
    q = _nibbles(blk[:, qs:qs + 16], (nb, 2, 16)).reshape(nb, 32)
    q |= np.unpackbits(blk[:, qh:qh + 4], axis=1, bitorder="little") << 4
    _to_float(table, q, out)
    out *= _f16(blk, 0)


class Q5_0:
    name, block, type_size = "Q5_0", 32, 22

    @staticmethod
    def dequantize(blk, out):
        _q5(blk, out, 6, 2, CODE5_M16)


class Q5_1:
    name, block, type_size = "Q5_1", 32, 24

    @staticmethod
    def dequantize(blk, out):
        _q5(blk, out, 8, 4, ARANGE)
        out += _f16(blk, 2)


class Q8_0:
    name, block, type_size = "Q8_0", 32, 34

    @staticmethod
    def dequantize(blk, out):
        np.multiply(blk[:, 2:34].view(np.int8), _f16(blk, 0), out=out)


def _crumbs(qs, nb):
    """[nb, 64] bytes -> uint8 [nb, 2, 4, 32]: element 128n + 32s + l is bits 2s..2s+1 of
    byte 32n + l."""
    q = np.empty((nb, 2, 4, 32), np.uint8)
    b = qs.reshape(nb, 2, 32)
    for s in range(4):
        np.bitwise_and(b >> (2 * s) if s else b, 3, out=q[:, :, s])
    return q


class Q2_K:
    name, block, type_size = "Q2_K", 256, 84

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        sc = blk[:, 0:16]
        dl = (_f16(blk, 80) * (sc & 15).astype(_F32)).reshape(nb, 16, 1)
        ml = (_f16(blk, 82) * (sc >> 4).astype(_F32)).reshape(nb, 16, 1)
        _to_float(ARANGE, _crumbs(blk[:, 16:80], nb), out)
        o = out.reshape(nb, 16, 16)
        o *= dl
        o -= ml


class Q3_K:
    name, block, type_size = "Q3_K", 256, 110

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        s = blk[:, 96:108]
        low = np.concatenate([s[:, 0:8] & 15, s[:, 0:8] >> 4], axis=1)        # j < 8, j >= 8
        high = (s[:, 8:12].reshape(nb, 1, 4) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        sc = (low | (high.reshape(nb, 16) << 4)).astype(_F32) - 32
        dl = (_f16(blk, 108) * sc).reshape(nb, 16, 1)
        # element 128n + 32s + l: 2 bits s of qs[32n + l] plus 4 * bit 4n + s of hmask[l]
        q = _crumbs(blk[:, 32:96], nb).reshape(nb, 8, 32)
        q |= _bit_planes(blk[:, 0:32]) << 2
        _to_float(CODE3_M4, q, out)
        out.reshape(nb, 16, 16)[...] *= dl


def _k_scale_min(scales, nb):
    """Q4_K/Q5_K: the eight 6-bit scales and mins as float32 [nb, 8] each."""
    s = scales.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc.astype(_F32), mn.astype(_F32)


def _k_finish(blk, out, q):
    """Q4_K/Q5_K: codes q [nb, 8, 32] (sub-block j = 2c + t) -> (d * sc[j]) * q - dmin * mn[j]."""
    nb = blk.shape[0]
    sc, mn = _k_scale_min(blk[:, 4:16], nb)
    _to_float(ARANGE, q, out)
    o = out.reshape(nb, 8, 32)
    o *= (_f16(blk, 0) * sc).reshape(nb, 8, 1)
    o -= (_f16(blk, 2) * mn).reshape(nb, 8, 1)


class Q4_K:
    name, block, type_size = "Q4_K", 256, 144

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        # element 64c + 32t + l: nibble t of qs[32c + l]
        _k_finish(blk, out, _nibbles(blk[:, 16:144].reshape(nb, 4, 32), (nb, 4, 2, 32)))


class Q5_K:
    name, block, type_size = "Q5_K", 256, 176

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        q = _nibbles(blk[:, 48:176].reshape(nb, 4, 32), (nb, 4, 2, 32)).reshape(nb, 8, 32)
        q |= _bit_planes(blk[:, 16:48]) << 4                       # bit 2c + t of qh[l]
        _k_finish(blk, out, q)


class Q6_K:
    name, block, type_size = "Q6_K", 256, 210

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        # element 128n + 32r + l: nibble r//2 of ql[64n + 32(r%2) + l] (low 4 bits), bits
        # 2r..2r+1 of qh[32n + l] (high 2)
        ql = blk[:, 0:128].reshape(nb, 2, 2, 32)                     # [nb, n, r % 2, l]
        q = np.empty((nb, 2, 2, 2, 32), np.uint8)                    # [nb, n, r // 2, r % 2, l]
        np.bitwise_and(ql, 15, out=q[:, :, 0])
        np.right_shift(ql, 4, out=q[:, :, 1])
        q = q.reshape(nb, 2, 4, 32)
        q |= _crumbs(blk[:, 128:192], nb) << 4
        _to_float(CODE6_M32, q, out)
        out.reshape(nb, 16, 16)[...] *= (_f16(blk, 208) * SIGNED[blk[:, 192:208]])[:, :, None]


FORMATS = {f.name: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)}
