"""NumPy dequantizers of the GGUF block formats, one class per format: `dequantize(blk, out)`
turns uint8 blocks [nb, type_size] into float32 [nb, block] written to `out`; `tile(blk, out)`
does the same in the format's *kernel order*: column j of each block holds element `order[j]`
(`order` None: the natural order). The matmul kernels use `tile` and permute the activations'
columns (or the gradient's) once instead: K-quant codes then come out of whole-word bit
operations plane by plane, where the natural order would interleave 32-byte pieces.

Bit-exact with `gguf.quants.dequantize`: the codes become small exact integers, and each element
then sees the same float32 multiplies and adds, in the same order, as ggml's reference (e.g.
Q4_K: `(d * sc) * q - (dmin * mn)`, each product rounded once). The reference beside each is
`Q*.recipe` in `fuelgraph.registry.quant_gguf` (the same math in primitives).

Why it is written this way (NumPy costs ~1 us per call plus ~10 ns per inner loop, and
`np.take` with uint8 indices ~2-4 ns per element): the codes are computed with bit operations
on whole uint64 words (8 codes per operation; `_rep(b)` is byte b in every byte of a word), over
whole contiguous fields of the tile (a field is cut out of the blocks by one copy of w-byte
items, `_field`); the 32-element formats put nibble halves back in place as 16-byte items
(`_place`), the K-quants write whole planes in kernel order instead; signed codes come from
byte arithmetic without borrows (`_minus`) and the integer -> float32 step is one contiguous
cast. Only the scale multiply (and the min subtract) runs per element in float32, broadcast
over each (sub-)block. Measured on one core: ~0.8-1.6 ns per element against 3-6 before."""
from __future__ import annotations

import numpy as np

_F32 = np.float32
_U32 = np.uint32
_U64 = np.uint64


def _rep(byte: int):
    """uint64 with `byte` in each of its 8 bytes."""
    return _U64(byte * 0x0101010101010101)


def _rep32(byte: int):
    """uint32 with `byte` in each of its 4 bytes."""
    return _U32(byte * 0x01010101)


LO4 = _rep(0x0F)


def _field(blk, off: int, w: int):
    """Bytes off:off+w of every block as a contiguous uint8 [nb, w] (one copy of w-byte items)."""
    v = blk[:, off:off + w].view(np.dtype((np.void, w)))
    return np.ascontiguousarray(v).view(np.uint8).reshape(blk.shape[0], w)


def _words(blk, off: int, w: int):
    """Bytes off:off+w (w a multiple of 8) of every block as uint64 [nb, w / 8]."""
    return _field(blk, off, w).view(_U64)


def _f16(blk, off: int):
    """The f16 field at byte offset `off` of each block, float32 [nb, 1] (exact)."""
    return blk[:, off:off + 2].view(np.float16)[:, 0].astype(_F32)[:, None]


def _place(dst, src):
    """dst[...] = src for a uint8 view `dst` whose last axis is contiguous, `src` any contiguous
    array of the same bytes (e.g. uint64 words): copied as whole last-axis items."""
    w = dst.shape[-1]
    item = np.dtype((np.void, w))
    np.copyto(dst.view(item), np.ascontiguousarray(src).view(np.uint8).reshape(dst.shape).view(item))


def _minus(words, c: int):
    """Bytes b (0 <= b < 2c, c in 4, 8, 16, 32) -> the int8 bytes of b - c, in place: b + (128 - c)
    stays below 256 (no carry into the next byte), and flipping bit 7 subtracts 128 mod 256."""
    words += _rep(128 - c)
    words ^= _rep(0x80)
    return words


def _to_float(codes, out, signed: bool):
    """out[...] = codes (uint8, or int8 when `signed`), one contiguous cast."""
    np.copyto(out, codes.view(np.int8 if signed else np.uint8).reshape(out.shape), casting="unsafe")


def _nibble_halves(qs_words, q):
    """32-element formats: low nibbles of the 16 qs bytes (uint64 words [nb, 2]) into
    q[:, 0] (elements 0..15), high nibbles into q[:, 1] (uint8 q [nb, 2, 16], in place)."""
    lo = qs_words & LO4
    hi = qs_words >> _U64(4)
    hi &= LO4
    _place(q[:, 0], lo)
    _place(q[:, 1], hi)


def _k_order(*extents_and_strides):
    """A kernel order: the natural index of each kernel position, from (extent, natural stride)
    pairs, outermost first."""
    idx = np.zeros(1, np.intp)
    for n, stride in extents_and_strides:
        idx = (idx[:, None] + stride * np.arange(n)).reshape(-1)
    return idx


def _reorder(factor, shape, axes):
    """Per-sub-block factors [nb, S] (natural order) -> kernel order, contiguous [nb, S]."""
    nb = factor.shape[0]
    return np.ascontiguousarray(factor.reshape((nb,) + shape).transpose((0,) + axes)).reshape(nb, -1)


def _scale(out, factor, run: int):
    """out (float32 [nb, block]) *= factor ([nb, block / run]), each factor over `run` elements."""
    nb = out.shape[0]
    o = out.reshape(nb, -1, run)
    np.multiply(o, factor.reshape(nb, -1, 1), out=o)


def _offset(out, term, run: int, sign: int):
    """out += sign * term, each term over `run` elements (as _scale)."""
    nb = out.shape[0]
    o = out.reshape(nb, -1, run)
    (np.add if sign > 0 else np.subtract)(o, term.reshape(nb, -1, 1), out=o)


class _Format:
    """A GGUF block format: geometry, `tile` (kernel order) and `dequantize` (natural order)."""
    name, block, type_size = "", 0, 0
    order = None

    @classmethod
    def dequantize(cls, blk, out):
        """uint8 blocks [nb, type_size] -> float32 [nb, block] in element order, into `out`."""
        if cls.order is None:
            cls.tile(blk, out)
        else:
            t = np.empty_like(out)
            cls.tile(blk, t)
            out[:, cls.order] = t

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if not callable(getattr(cls, "tile", None)):       # every format has its kernel
            raise TypeError(f"GGUF format {cls.__name__} defines no tile(blk, out)")


class Q4_0(_Format):
    name, block, type_size = "Q4_0", 32, 18

    @staticmethod
    def tile(blk, out):
        nb = blk.shape[0]
        q = np.empty((nb, 2, 16), np.uint8)
        _nibble_halves(_words(blk, 2, 16), q)
        _minus(q.reshape(-1).view(_U64), 8)
        _to_float(q, out, True)
        out *= _f16(blk, 0)


class Q4_1(_Format):
    name, block, type_size = "Q4_1", 32, 20

    @staticmethod
    def tile(blk, out):
        nb = blk.shape[0]
        q = np.empty((nb, 2, 16), np.uint8)
        _nibble_halves(_words(blk, 4, 16), q)
        _to_float(q, out, False)
        out *= _f16(blk, 0)
        out += _f16(blk, 2)


def _q5(blk, out, qs: int, qh: int, signed: bool):
    """Q5_0/Q5_1 codes (nibble + 16 * bit e of the little-endian u32 qh) as float32 in `out`."""
    nb = blk.shape[0]
    q = np.empty((nb, 2, 16), np.uint8)
    _nibble_halves(_words(blk, qs, 16), q)
    q64 = q.reshape(-1).view(_U64)
    bits = np.unpackbits(_field(blk, qh, 4).reshape(-1), bitorder="little")   # element order
    q64 |= bits.view(_U64) << _U64(4)
    if signed:
        _minus(q64, 16)
    _to_float(q, out, signed)
    out *= _f16(blk, 0)


class Q5_0(_Format):
    name, block, type_size = "Q5_0", 32, 22

    @staticmethod
    def tile(blk, out):
        _q5(blk, out, 6, 2, True)


class Q5_1(_Format):
    name, block, type_size = "Q5_1", 32, 24

    @staticmethod
    def tile(blk, out):
        _q5(blk, out, 8, 4, False)
        out += _f16(blk, 2)


class Q8_0(_Format):
    name, block, type_size = "Q8_0", 32, 34

    @staticmethod
    def tile(blk, out):
        _to_float(_field(blk, 2, 32), out, True)
        out *= _f16(blk, 0)


class Q2_K(_Format):
    name, block, type_size = "Q2_K", 256, 84
    # kernel position 64s + 32n + l holds element 128n + 32s + l (bits 2s..2s+1 of qs[32n + l])
    order = _k_order((4, 32), (2, 128), (32, 1))

    @staticmethod
    def tile(blk, out):
        nb = blk.shape[0]
        sc = _field(blk, 0, 16)
        dl = _reorder(_f16(blk, 80) * (sc & 15).astype(_F32), (2, 4, 2), (2, 1, 3))
        ml = _reorder(_f16(blk, 82) * (sc >> 4).astype(_F32), (2, 4, 2), (2, 1, 3))
        _to_float(_crumb_planes(_words(blk, 16, 64), nb), out, False)
        _scale(out, dl, 16)
        _offset(out, ml, 16, -1)


def _crumb_planes(qs_words, nb):
    """qs words [nb, 8] -> uint64 [nb, 4, 8]: plane s holds bits 2s..2s+1 of every byte."""
    q = np.empty((nb, 4, 8), _U64)
    for s in range(4):
        np.right_shift(qs_words, _U64(2 * s), out=q[:, s])
    q &= _rep(3)
    return q


def _shift(words, left: int):
    return words << _U64(left) if left >= 0 else words >> _U64(-left)


class Q3_K(_Format):
    name, block, type_size = "Q3_K", 256, 110
    # kernel position 64s + 32n + l holds element 128n + 32s + l: bits 2s..2s+1 of qs[32n + l]
    # plus 4 * bit 4n + s of hmask[l]
    order = _k_order((4, 32), (2, 128), (32, 1))

    @staticmethod
    def tile(blk, out):
        nb = blk.shape[0]
        # the 16 6-bit scales: low 4 bits from bytes 0..7 (low then high nibbles), high 2 bits
        # from bytes 8..11 (bits 2i..2i+1 of byte 8 + j % 4 for scale j, i = j // 4)
        a, b, c = _u32_columns(blk, 96, 3)
        m4, m30 = _rep32(0x0F), _rep32(0x30)
        sc = np.empty((nb, 4), _U32)
        sc[:, 0] = (a & m4) | ((c << _U32(4)) & m30)
        sc[:, 1] = (b & m4) | ((c << _U32(2)) & m30)
        sc[:, 2] = ((a >> _U32(4)) & m4) | (c & m30)
        sc[:, 3] = ((b >> _U32(4)) & m4) | ((c >> _U32(2)) & m30)
        sc.view(np.uint8)[...] -= np.uint8(32)                         # int8 scale - 32
        dl = _reorder(_f16(blk, 108) * sc.view(np.int8).astype(_F32), (2, 4, 2), (2, 1, 3))
        hm = _words(blk, 0, 32).reshape(nb, 1, 4)
        hmd = np.right_shift(hm, np.array([[0], [4]], _U64)).reshape(nb, 8)  # [hm, hm >> 4]
        q = _crumb_planes(_words(blk, 32, 64), nb)
        for s in range(4):
            h = _shift(hmd, 2 - s)
            h &= _rep(4)
            np.bitwise_or(q[:, s], h, out=q[:, s])
        _minus(q.reshape(-1), 4)
        _to_float(q, out, True)
        _scale(out, dl, 16)


def _u32_columns(blk, off: int, words: int):
    """`words` little-endian u32 fields from byte `off` of every block, each a uint32 [nb]."""
    f = _field(blk, off, 4 * words).view(_U32)
    return [f[:, i] for i in range(words)]


def _even_odd_bytes(x):
    """uint64 [nb] of bytes b0..b7 -> bytes b0 b2 b4 b6 b1 b3 b5 b7 (in place)."""
    lanes = _U64(0x00FF00FF00FF00FF)
    odd = x >> _U64(8)
    for v in (x, odd):
        v &= lanes
        v |= v >> _U64(8)
        v &= _U64(0x0000FFFF0000FFFF)
        v |= v >> _U64(16)
        v &= _U64(0xFFFFFFFF)
    odd <<= _U64(32)
    x |= odd
    return x


def _k_scale_min(blk):
    """Q4_K/Q5_K: (d * sc, dmin * mn) of the eight sub-blocks in kernel order (t, c), float32
    [nb, 8] each; the 6-bit scales and mins come from 12 bytes read as three u32 words, the
    natural order j = 2c + t is turned into (t, c) by an even/odd byte split."""
    nb = blk.shape[0]
    d, m, md = _u32_columns(blk, 4, 3)
    m3f, m4, m30 = _rep32(0x3F), _rep32(0x0F), _rep32(0x30)
    res = []
    for off, lo, hi in ((0, d & m3f, (md & m4) | ((d >> _U32(2)) & m30)),
                        (2, m & m3f, ((md >> _U32(4)) & m4) | ((m >> _U32(2)) & m30))):
        x = lo.astype(_U64)
        x |= hi.astype(_U64) << _U64(32)
        codes = _even_odd_bytes(x).view(np.uint8).reshape(nb, 8).astype(_F32)
        res.append(_f16(blk, off) * codes)
    return res


def _k_finish(blk, out, q):
    """Q4_K/Q5_K: codes q (kernel order) -> (d * sc[j]) * q - dmin * mn[j]."""
    dsc, dmn = _k_scale_min(blk)
    _to_float(q, out, False)
    _scale(out, dsc, 32)
    _offset(out, dmn, 32, -1)


def _k_nibbles(qs_words, nb):
    """qs words [nb, 16] -> uint64 [nb, 2, 16]: low nibbles, then high nibbles."""
    q = np.empty((nb, 2, 16), _U64)
    np.copyto(q[:, 0], qs_words)
    np.right_shift(qs_words, _U64(4), out=q[:, 1])
    q &= LO4
    return q


#: Q4_K/Q5_K kernel position 128t + 32c + l holds element 64c + 32t + l (nibble t of qs[32c + l])
_K45_ORDER = _k_order((2, 32), (4, 64), (32, 1))


class Q4_K(_Format):
    name, block, type_size = "Q4_K", 256, 144
    order = _K45_ORDER

    @staticmethod
    def tile(blk, out):
        _k_finish(blk, out, _k_nibbles(_words(blk, 16, 128), blk.shape[0]))


class Q5_K(_Format):
    name, block, type_size = "Q5_K", 256, 176
    order = _K45_ORDER
    #: bit 2c + t of qh[l] is bit 4 of element 64c + 32t + l, kernel plane (t, c)
    _PLANE_BITS = np.array([2 * c + t for t in range(2) for c in range(4)], _U64)[:, None]

    @staticmethod
    def tile(blk, out):
        nb = blk.shape[0]
        q = _k_nibbles(_words(blk, 48, 128), nb)
        qh = _words(blk, 16, 32)                                       # [nb, 4]
        planes = qh[:, None, :] >> Q5_K._PLANE_BITS                    # [nb, 8, 4]
        planes <<= _U64(4)
        planes &= _rep(0x10)
        q.reshape(-1)[...] |= planes.reshape(-1)
        _k_finish(blk, out, q)


class Q6_K(_Format):
    name, block, type_size = "Q6_K", 256, 210
    # element 128n + 64t + 32u + l: nibble t of ql[64n + 32u + l] (low 4 bits) and bits
    # 2r..2r+1 (r = 2t + u) of qh[32n + l] (high 2 bits); kernel position 128t + 64n + 32u + l
    order = _k_order((2, 64), (2, 128), (2, 32), (32, 1))

    @staticmethod
    def tile(blk, out):
        nb = blk.shape[0]
        ql = _words(blk, 0, 128)                                       # [nb, (n, u, l)]
        qh = _words(blk, 128, 64).reshape(nb, 2, 1, 4)                 # [nb, n, 1, l]
        qhu = np.right_shift(qh, np.array([[0], [2]], _U64)).reshape(nb, 16)   # qh >> 2u
        q = np.empty((nb, 2, 16), _U64)                                # [nb, t, (n, u, l)]
        low = ql & LO4
        h = qhu << _U64(4)
        h &= _rep(0x30)
        low |= h
        np.copyto(q[:, 0], low)
        high = ql >> _U64(4)
        high &= LO4
        qhu &= _rep(0x30)
        high |= qhu
        np.copyto(q[:, 1], high)
        _minus(q.reshape(-1), 32)
        _to_float(q, out, True)
        # scales of the 16-element sub-blocks: natural 8n + 4t + 2u + h -> kernel (t, n, u, h),
        # i.e. the two words' (n) low halves (t = 0), then their high halves
        sw = _words(blk, 192, 16)
        w0, w1 = sw[:, 0], sw[:, 1]
        sc = np.empty((nb, 2), _U64)
        np.bitwise_or(w0 & _U64(0xFFFFFFFF), w1 << _U64(32), out=sc[:, 0])
        np.bitwise_or(w0 >> _U64(32), w1 & _U64(0xFFFFFFFF00000000), out=sc[:, 1])
        _scale(out, _f16(blk, 208) * sc.view(np.int8).astype(_F32), 16)


FORMATS = {f.name: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)}
