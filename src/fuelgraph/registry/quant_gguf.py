"""GGUF (ggml) block formats for QMATMUL: one class per format, each with its block geometry and
its dequantization written in primitives (bit ops on uint8 / int32, casts, one float32 multiply
or multiply-add per element in exactly the order ggml's reference uses, so the result is
bit-identical to `gguf.quants.dequantize`).

A quantized `[N, K]` weight is `N` rows of `K / QK` consecutive blocks of `BB` bytes; every
multi-byte field is little-endian; `f16` fields are IEEE half precision. The layouts:

    Q4_0  32 el / 18 B   d f16 | qs[16]                 w = d * (q - 8), q = 4-bit
    Q4_1  32 el / 20 B   d, m f16 | qs[16]              w = d * q + m
    Q5_0  32 el / 22 B   d | qh u32 | qs[16]            w = d * (q - 16), q = 4 + 1 bits
    Q5_1  32 el / 24 B   d, m | qh u32 | qs[16]         w = d * q + m
    Q8_0  32 el / 34 B   d | qs int8[32]                w = q * d
    Q2_K 256 el / 84 B   scales[16] | qs[64] | d, dmin  w = (d*sc) * q - (dmin*mn), q 2-bit
    Q3_K 256 el / 110 B  hmask[32] | qs[64] | scales[12] | d
    Q4_K 256 el / 144 B  d, dmin | scales[12] | qs[128]
    Q5_K 256 el / 176 B  d, dmin | scales[12] | qh[32] | qs[128]
    Q6_K 256 el / 210 B  ql[128] | qh[64] | scales int8[16] | d

In the 32-element formats the low nibbles of qs are elements 0..15 and the high nibbles
elements 16..31. The K-quant sub-block scales and bit planes follow ggml's `dequantize_row_*`.
"""
from __future__ import annotations

import numpy as np

from .. import dtype as dt
from ..errors import FuelGraphError
from ..ir.tensor import cat, const, where

QK_K = 256


# ---- primitive helpers (Tensor in, Tensor out) ---------------------------------------------
def _const(x, array):
    return const(np.asarray(array), device=x.device)


def _shifts(x, values, shape):
    """A uint8 constant of shift amounts, shaped to broadcast against `x`."""
    return _const(x, np.asarray(values, np.uint8).reshape(shape))


def f16_bits_to_f32(lo, hi):
    """Decode IEEE half floats from their low and high bytes (uint8 tensors) to float32, exactly
    (subnormals, signed zeros, infinities and NaNs included), with integer ops and a bitcast:
    the 15 magnitude bits moved to a float32's exponent/mantissa position read as a float32
    2^-112 times the half's value (subnormals too), so one exact multiply by 2^112 rebiases."""
    h = lo.astype(dt.int32) | (hi.astype(dt.int32) << 8)
    mag = (h & 0x7FFF) << 13
    normal = (mag.bitcast(dt.float32) * 2.0 ** 112).bitcast(dt.int32)
    bits = where((h & 0x7C00) == 0x7C00, mag | 0x7F800000, normal)   # inf / NaN keep payload
    return (bits | ((h & 0x8000) << 16)).bitcast(dt.float32)


def _f16_at(blk, off):
    """The f16 field at byte offset `off` of every block: float32 [nb, 1]."""
    return f16_bits_to_f32(blk[:, off:off + 1], blk[:, off + 1:off + 2])


def _signed(x):
    """uint8 bytes read as int8, as int32."""
    return (x.astype(dt.int32) ^ 128) - 128


def _nibbles(qs):
    """[nb, 16] bytes -> [nb, 32]: low nibbles (elements 0..15), then high nibbles."""
    return cat([qs & 15, qs >> 4], axis=1)


def _bits32(qh):
    """[nb, 4] bytes of a little-endian u32 -> [nb, 32] bits (bit e is element e)."""
    nb = qh.shape[0]
    return ((qh.reshape(nb, 4, 1) >> _shifts(qh, range(8), (1, 1, 8))) & 1).reshape(nb, 32)


def _k_scale_min(scales):
    """Q4_K / Q5_K: eight 6-bit (scale, min) pairs from 12 bytes [nb, 12] -> two uint8 [nb, 8]."""
    nb = scales.shape[0]
    s = scales.reshape(nb, 3, 4)
    d, m, md = s[:, 0, :], s[:, 1, :], s[:, 2, :]
    sc = cat([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = cat([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


# ---- the formats ---------------------------------------------------------------------------
class GGUFFormat:
    """A ggml block format: `name`, ggml type code `code`, `block` elements per block (QK),
    `type_size` bytes per block (BB). `recipe(blk)` maps uint8 blocks [nb, BB] to float32
    [nb, QK] in primitives."""
    name: str
    code: int
    block: int
    type_size: int

    @classmethod
    def row_bytes(cls, k: int) -> int:
        return k // cls.block * cls.type_size

    @classmethod
    def nbytes(cls, n: int, k: int) -> int:
        return n * cls.row_bytes(k)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if not callable(getattr(cls, "recipe", None)):     # every format states its math
            raise TypeError(f"GGUF format {cls.__name__} defines no recipe(blk)")


class Q4_0(GGUFFormat):
    name, code, block, type_size = "Q4_0", 2, 32, 18

    @staticmethod
    def recipe(blk):
        q = (_nibbles(blk[:, 2:18]).astype(dt.int32) - 8).astype(dt.float32)
        return _f16_at(blk, 0) * q


class Q4_1(GGUFFormat):
    name, code, block, type_size = "Q4_1", 3, 32, 20

    @staticmethod
    def recipe(blk):
        q = _nibbles(blk[:, 4:20]).astype(dt.float32)
        return _f16_at(blk, 0) * q + _f16_at(blk, 2)


class Q5_0(GGUFFormat):
    name, code, block, type_size = "Q5_0", 6, 32, 22

    @staticmethod
    def recipe(blk):
        q = _nibbles(blk[:, 6:22]) | (_bits32(blk[:, 2:6]) << 4)
        return _f16_at(blk, 0) * (q.astype(dt.int32) - 16).astype(dt.float32)


class Q5_1(GGUFFormat):
    name, code, block, type_size = "Q5_1", 7, 32, 24

    @staticmethod
    def recipe(blk):
        q = _nibbles(blk[:, 8:24]) | (_bits32(blk[:, 4:8]) << 4)
        return _f16_at(blk, 0) * q.astype(dt.float32) + _f16_at(blk, 2)


class Q8_0(GGUFFormat):
    name, code, block, type_size = "Q8_0", 8, 32, 34

    @staticmethod
    def recipe(blk):
        return _signed(blk[:, 2:34]).astype(dt.float32) * _f16_at(blk, 0)


class Q2_K(GGUFFormat):
    name, code, block, type_size = "Q2_K", 10, QK_K, 84

    @staticmethod
    def recipe(blk):
        nb = blk.shape[0]
        scales, qs = blk[:, 0:16], blk[:, 16:80]
        dl = (_f16_at(blk, 80) * (scales & 15).astype(dt.float32)).reshape(nb, 16, 1)
        ml = (_f16_at(blk, 82) * (scales >> 4).astype(dt.float32)).reshape(nb, 16, 1)
        q = (qs.reshape(nb, 2, 1, 32) >> _shifts(qs, (0, 2, 4, 6), (1, 1, 4, 1))) & 3
        q = q.reshape(nb, 16, 16).astype(dt.float32)
        return (dl * q - ml).reshape(nb, QK_K)


class Q3_K(GGUFFormat):
    name, code, block, type_size = "Q3_K", 11, QK_K, 110

    @staticmethod
    def recipe(blk):
        nb = blk.shape[0]
        hmask, qs, scales = blk[:, 0:32], blk[:, 32:96], blk[:, 96:108]
        low = (scales[:, 0:8].reshape(nb, 1, 8) >> _shifts(blk, (0, 4), (1, 2, 1))).reshape(nb, 16)
        high = (scales[:, 8:12].reshape(nb, 1, 4) >> _shifts(blk, (0, 2, 4, 6), (1, 4, 1)))
        sc = (low & 15) | ((high.reshape(nb, 16) & 3) << 4)
        dl = (_f16_at(blk, 108) * (sc.astype(dt.int32) - 32).astype(dt.float32)).reshape(nb, 16, 1)
        ql = (qs.reshape(nb, 2, 1, 32) >> _shifts(blk, (0, 2, 4, 6), (1, 1, 4, 1)))
        ql = ql.reshape(nb, 16, 16) & 3
        qh = hmask.reshape(nb, 1, 1, 32) >> _shifts(blk, range(8), (1, 1, 8, 1))
        qh = (qh.reshape(nb, 16, 16) & 1) ^ 1              # offset 4 where the mask bit is 0
        q = (ql.astype(dt.int32) - (qh << 2).astype(dt.int32)).astype(dt.float32)
        return (dl * q).reshape(nb, QK_K)


def _k_scaled(blk, nb):
    """Q4_K / Q5_K: the (d*sc) and (dmin*mn) factors of the eight sub-blocks, [nb, 8, 1]."""
    sc, mn = _k_scale_min(blk[:, 4:16])
    d = (_f16_at(blk, 0) * sc.astype(dt.float32)).reshape(nb, 8, 1)
    dm = (_f16_at(blk, 2) * mn.astype(dt.float32)).reshape(nb, 8, 1)
    return d, dm


def _low_high_nibbles(qs, nb, groups):
    """[nb, 32*groups] bytes -> [nb, 2*groups, 32]: per 32 bytes, low then high nibbles."""
    q = qs.reshape(nb, groups, 1, 32) >> _shifts(qs, (0, 4), (1, 1, 2, 1))
    return (q & 15).reshape(nb, 2 * groups, 32)


class Q4_K(GGUFFormat):
    name, code, block, type_size = "Q4_K", 12, QK_K, 144

    @staticmethod
    def recipe(blk):
        nb = blk.shape[0]
        d, dm = _k_scaled(blk, nb)
        q = _low_high_nibbles(blk[:, 16:144], nb, 4).astype(dt.float32)
        return (d * q - dm).reshape(nb, QK_K)


class Q5_K(GGUFFormat):
    name, code, block, type_size = "Q5_K", 13, QK_K, 176

    @staticmethod
    def recipe(blk):
        nb = blk.shape[0]
        d, dm = _k_scaled(blk, nb)
        ql = _low_high_nibbles(blk[:, 48:176], nb, 4)
        qh = blk[:, 16:48].reshape(nb, 1, 1, 32) >> _shifts(blk, range(8), (1, 1, 8, 1))
        q = (ql | ((qh.reshape(nb, 8, 32) & 1) << 4)).astype(dt.float32)
        return (d * q - dm).reshape(nb, QK_K)


class Q6_K(GGUFFormat):
    name, code, block, type_size = "Q6_K", 14, QK_K, 210

    @staticmethod
    def recipe(blk):
        nb = blk.shape[0]
        ql = blk[:, 0:128].reshape(nb, 2, 1, 64) >> _shifts(blk, (0, 4), (1, 1, 2, 1))
        ql = (ql & 15).reshape(nb, 8, 32)
        qh = blk[:, 128:192].reshape(nb, 2, 1, 32) >> _shifts(blk, (0, 2, 4, 6), (1, 1, 4, 1))
        qh = (qh & 3).reshape(nb, 8, 32)
        q = ((ql | (qh << 4)).astype(dt.int32) - 32).reshape(nb, 16, 16).astype(dt.float32)
        d = (_f16_at(blk, 208) * _signed(blk[:, 192:208]).astype(dt.float32)).reshape(nb, 16, 1)
        return (d * q).reshape(nb, QK_K)


FORMATS: dict[str, type[GGUFFormat]] = {
    f.name: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)}
_BY_CODE = {f.code: f for f in FORMATS.values()}


def gguf_format(quant_type, op: str = "qmatmul") -> type[GGUFFormat]:
    """The format class for a name ("Q4_K", case-insensitive) or a ggml type code / gguf's
    GGMLQuantizationType; FuelGraphError for anything else."""
    if isinstance(quant_type, type) and issubclass(quant_type, GGUFFormat):
        return quant_type
    f = None
    if isinstance(quant_type, str):
        f = FORMATS.get(quant_type.upper())
    elif isinstance(quant_type, (int, np.integer)) and not isinstance(quant_type, bool):
        f = _BY_CODE.get(int(quant_type))   # GGMLQuantizationType is an IntEnum
    if f is None:
        raise FuelGraphError(f"{op}: unknown or unsupported quant_type {quant_type!r}; expected "
                             f"one of {list(FORMATS)} (a name or gguf.GGMLQuantizationType)")
    return f


def dequantize_gguf_recipe(w_bytes, fmt: type[GGUFFormat], n: int, k: int):
    """Dequantize raw GGUF bytes (uint8, n * row_bytes(k) of them) to a float32 [n, k] tensor
    in primitives."""
    blk = w_bytes.reshape(n * (k // fmt.block), fmt.type_size)
    return fmt.recipe(blk).reshape(n, k)
