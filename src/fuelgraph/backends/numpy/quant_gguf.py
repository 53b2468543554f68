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


#: per byte: (low nibble, high nibble), and the same minus 8
NIB = _table(_B & 15, _B >> 4)
NIB_M8 = NIB - 8
#: per byte: the four 2-bit fields (bits 0-1, 2-3, 4-5, 6-7), and Q6_K's 16 * field - 32
CRUMBS = _table(*((_B >> s) & 3 for s in (0, 2, 4, 6)))
CRUMBS_Q6 = CRUMBS * 16 - 32
#: per byte: the eight bits (bit 0 first) as a fifth code bit (0 / 16), the same minus 16
#: (Q5_0), or Q3_K's offset (-4 where the bit is 0)
BITS16 = _table(*(((_B >> b) & 1) * 16 for b in range(8)))
BITS16_M16 = BITS16 - 16
BITS_Q3 = _table(*(((_B >> b) & 1) * 4 - 4 for b in range(8)))
#: int8 reading of a byte
SIGNED = np.where(_B < 128, _B, _B - 256).astype(_F32)


def _f16(blk, off):
    """The f16 field at byte offset `off` of each block, float32 [nb, 1] (exact)."""
    return np.ascontiguousarray(blk[:, off:off + 2]).view(np.float16).astype(_F32)


def _look(table, idx):
    """table[idx] for uint8 idx (always in range): [*idx.shape, ncols] float32."""
    return table.take(idx, axis=0)


class Q4_0:
    name, block, type_size = "Q4_0", 32, 18

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        q = _look(NIB_M8, blk[:, 2:18]).transpose(0, 2, 1)            # [nb, 2, 16]
        np.multiply(_f16(blk, 0)[:, :, None], q, out=out.reshape(nb, 2, 16))


class Q4_1:
    name, block, type_size = "Q4_1", 32, 20

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        o = out.reshape(nb, 2, 16)
        np.multiply(_f16(blk, 0)[:, :, None], _look(NIB, blk[:, 4:20]).transpose(0, 2, 1), out=o)
        o += _f16(blk, 2)[:, :, None]


def _q5(blk, out, qs, qh, bits):
    """Q5_0/Q5_1: out = d * (nibble + 16 * bit [- 16]); element e's bit is bit e%8 of qh[e//8]."""
    nb = blk.shape[0]
    o = out.reshape(nb, 2, 16)
    np.add(_look(NIB, blk[:, qs:qs + 16]).transpose(0, 2, 1),
           _look(bits, blk[:, qh:qh + 4]).reshape(nb, 2, 16), out=o)
    o *= _f16(blk, 0)[:, :, None]


class Q5_0:
    name, block, type_size = "Q5_0", 32, 22

    @staticmethod
    def dequantize(blk, out):
        _q5(blk, out, 6, 2, BITS16_M16)


class Q5_1:
    name, block, type_size = "Q5_1", 32, 24

    @staticmethod
    def dequantize(blk, out):
        _q5(blk, out, 8, 4, BITS16)
        out += _f16(blk, 2)


class Q8_0:
    name, block, type_size = "Q8_0", 32, 34

    @staticmethod
    def dequantize(blk, out):
        np.multiply(blk[:, 2:34].view(np.int8), _f16(blk, 0), out=out)


class Q2_K:
    name, block, type_size = "Q2_K", 256, 84

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        sc = blk[:, 0:16]
        dl = (_f16(blk, 80) * (sc & 15).astype(_F32)).reshape(nb, 2, 4, 2, 1)
        ml = (_f16(blk, 82) * (sc >> 4).astype(_F32)).reshape(nb, 2, 4, 2, 1)
        # byte 32n + l holds element 128n + 32s + l in bits 2s..2s+1
        q = _look(CRUMBS, blk[:, 16:80].reshape(nb, 2, 32)).transpose(0, 1, 3, 2)
        o = out.reshape(nb, 2, 4, 2, 16)
        np.multiply(dl, q.reshape(nb, 2, 4, 2, 16), out=o)
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
        dl = (_f16(blk, 108) * sc).reshape(nb, 2, 4, 2, 1)
        # element 128n + 32s + l: 2 bits s of qs[32n + l], offset from bit 4n + s of hmask[l]
        q = _look(CRUMBS, blk[:, 32:96].reshape(nb, 2, 32))                    # [nb, n, l, s]
        q += _look(BITS_Q3, blk[:, 0:32]).reshape(nb, 32, 2, 4).transpose(0, 2, 1, 3)
        np.multiply(dl, q.transpose(0, 1, 3, 2).reshape(nb, 2, 4, 2, 16),
                    out=out.reshape(nb, 2, 4, 2, 16))


def _k_scale_min(scales, nb):
    """Q4_K/Q5_K: the eight 6-bit scales and mins as float32 [nb, 8] each."""
    s = scales.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc.astype(_F32), mn.astype(_F32)


def _k_finish(blk, out, q):
    """Q4_K/Q5_K: out[c, t, l] = (d * sc[2c+t]) * q[c, l, t] - (dmin * mn[2c+t])."""
    nb = blk.shape[0]
    sc, mn = _k_scale_min(blk[:, 4:16], nb)
    o = out.reshape(nb, 4, 2, 32)
    np.multiply((_f16(blk, 0) * sc).reshape(nb, 4, 2, 1), q.transpose(0, 1, 3, 2), out=o)
    o -= (_f16(blk, 2) * mn).reshape(nb, 4, 2, 1)


class Q4_K:
    name, block, type_size = "Q4_K", 256, 144

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        _k_finish(blk, out, _look(NIB, blk[:, 16:144].reshape(nb, 4, 32)))   # [nb, c, l, t]


class Q5_K:
    name, block, type_size = "Q5_K", 256, 176

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        q = _look(NIB, blk[:, 48:176].reshape(nb, 4, 32))                     # [nb, c, l, t]
        q += _look(BITS16, blk[:, 16:48]).reshape(nb, 32, 4, 2).transpose(0, 2, 1, 3)
        _k_finish(blk, out, q)


class Q6_K:
    name, block, type_size = "Q6_K", 256, 210

    @staticmethod
    def dequantize(blk, out):
        nb = blk.shape[0]
        # element 128n + 32r + l: 2 bits r of qh[32n + l] (high), nibble r//2 of
        # ql[64n + 32(r%2) + l] (low)
        q = _look(CRUMBS_Q6, blk[:, 128:192].reshape(nb, 2, 32))              # [nb, n, l, r]
        ql = _look(NIB, blk[:, 0:128].reshape(nb, 2, 2, 32))                  # [nb, n, r%2, l, r//2]
        q.reshape(nb, 2, 32, 2, 2)[...] += ql.transpose(0, 1, 3, 4, 2)
        dd = (_f16(blk, 208) * SIGNED[blk[:, 192:208]]).reshape(nb, 2, 4, 2, 1)
        np.multiply(dd, q.transpose(0, 1, 3, 2).reshape(nb, 2, 4, 2, 16),
                    out=out.reshape(nb, 2, 4, 2, 16))


FORMATS = {f.name: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)}
