"""NumPy kernels of the quantized matmuls (QMATMUL, NF4_MATMUL, AWQ_MATMUL and their
gradients with respect to the activations).

The weight is never dequantized whole: it is streamed in tiles (whole rows of W for the
forward, whole columns for the gradient, so that every output element comes from one GEMM and
nothing is accumulated across tiles) of `_tile_elems` float32 elements: 1 MiB for a few rows
of activations (M = 1 decode: the tile stays in L2 for the GEMV), up to 8 MiB for many (BLAS
packs the activations again for each tile). Each tile is dequantized into a reused float32
scratch in L2-sized row pieces, then multiplied by BLAS. Products with several tiles run whole
tiles on each pool thread with single-threaded BLAS, so one thread's dequantization overlaps
the other's GEMM; nothing but the tiles scales with the weight. GGUF K-quant tiles come in a
kernel column order (see quant_gguf): the activations' columns are put in that order once
(the gradient's result is put back). The activations are widened once to the accumulation
dtype (float32 for 16/32-bit, float64 for float64) and the result is rounded once to their
dtype. The dequantized values are bit-exact with the formats' references (gguf-py for GGUF).
"""
from __future__ import annotations

import math
import threading

import numpy as np

from ...registry.core import FusedOps
from ...registry.quant import (AWQ_MATMUL_GRAD_A, AWQ_ORDER, NF4_BYTE_PAIRS, NF4_MATMUL_GRAD_A,
                               QMATMUL_GRAD_A, qmatmul_nk)
from ...registry.quant_gguf import FORMATS as GGUF_GEOMETRY
from ..base import Cost, kernel
from .common import NUM_THREADS, acc_dtype, row_spans, run_spans, store, to_acc
from .primitives import _one_blas_thread
from .quant_gguf import FORMATS, LO4

#: float32 elements of weight dequantized per tile (1 MiB of scratch; see _tile_elems)
TILE_ELEMS = 1 << 18
_F32 = np.float32
_ORDER = np.array(AWQ_ORDER)
if not np.little_endian:  # pragma: no cover - the word-level unpacking reads bytes as LE words
    raise ImportError("fuelgraph's NumPy quantized kernels need a little-endian host")


def _cost(weight_bits, rows_out):
    """Cost of x [..., R] times a packed weight: 2 * rows * R * C flops, bytes of x, the
    packed weight (weight_bits(shapes, params) bits per element), the output and the float32
    scratch each weight element passes through."""
    def cost(shapes, params=None):
        x = shapes[0]
        m, r = math.prod(x[:-1]), x[-1]
        c = rows_out(shapes, params)
        w = r * c
        return Cost(2 * m * w + 4 * w, 4 * (m * (r + c)) + w * weight_bits(shapes, params) / 8
                    + 8 * w)
    return cost


def _gguf_bits(shapes, p):
    f = GGUF_GEOMETRY[p.quant_type]
    return 8 * f.type_size / f.block


_QMATMUL_COST = _cost(_gguf_bits, lambda s, p: qmatmul_nk(
    p.quant_type, p.n, p.k, s[0], math.prod(s[1]))[0])
_QMATMUL_GRAD_COST = _cost(_gguf_bits, lambda s, p: qmatmul_nk(
    p.quant_type, p.n, p.k, s[0], math.prod(s[1]), grad=True)[1])
_NF4_COST = _cost(lambda s, p: 4 + 32 / p.block_size, lambda s, p: s[1][0])
_NF4_GRAD_COST = _cost(lambda s, p: 4 + 32 / p.block_size, lambda s, p: 2 * s[1][1])
_AWQ_COST = _cost(lambda s, p: 4 + 20 / p.group_size, lambda s, p: 8 * s[1][1])
_AWQ_GRAD_COST = _cost(lambda s, p: 4 + 20 / p.group_size, lambda s, p: s[1][0])


def _spans(total: int, other: int, align: int, x=None):
    """Tiles of `align`-aligned extent over `total`, each about tile_elems(x) / other long, and
    at least two per pool thread (so that a large product always runs whole tiles on the pool,
    never one tile whose GEMM would need BLAS's own threads)."""
    elems = _tile_elems(x)
    step = (elems // max(other, 1)) // align * align
    if NUM_THREADS > 1:
        step = min(step, -(-total // (2 * NUM_THREADS * align)) * align)
    step = max(align, step)
    return [(s, min(s + step, total)) for s in range(0, total, step)]


def _tile_elems(x) -> int:
    """Weight elements per tile: TILE_ELEMS (1 MiB of float32, which stays in a core's L2:
    a GEMV or thin GEMM then reads it from cache) for a few rows of activations; for many
    rows up to 8x that, since BLAS packs the whole activation matrix again for every tile
    (dequantization still runs in L2-sized pieces, see _parallel_rows)."""
    m = 1 if x is None else math.prod(x.shape[:-1])
    return TILE_ELEMS * max(1, min(8, m // 32))


#: products of at least this many flops (and more than one tile) run whole tiles on the pool
#: threads: each thread dequantizes a tile and multiplies it with single-threaded BLAS while
#: the other does the same with the next tile, so dequantization overlaps the GEMMs
PARALLEL_TILES_MIN_FLOPS = 4e6
_LOCAL = threading.local()      # .inline: dequantize on this thread (already one of the pool)


def _tiled_product(x, nout: int, spans, make_tile, transpose: bool):
    """out[..., nout] with out[:, s0:s1] = x2 @ T (or T.T) for T = make_tile(s0, s1). Products
    with several tiles run whole tiles (dequantize + single-threaded GEMM) on each pool thread;
    small ones run tiles in turn, each dequantized by the pool, then multiplied by BLAS."""
    acc = acc_dtype(x.dtype)
    x2 = to_acc(np.ascontiguousarray(x).reshape(-1, x.shape[-1]), acc)
    out = np.empty((x2.shape[0], nout), acc)

    def gemm(s0, s1):
        t = make_tile(s0, s1)
        if acc != _F32:
            t = t.astype(acc)
        np.matmul(x2, t.T if transpose else t, out=out[:, s0:s1])

    flops = 2 * out.size * x2.shape[1]
    limits = _one_blas_thread() if NUM_THREADS > 1 and len(spans) > 1 and \
        flops >= PARALLEL_TILES_MIN_FLOPS else None
    if out.size and limits is not None:
        def group(i0, i1):
            _LOCAL.inline = True
            try:
                for s0, s1 in spans[i0:i1]:
                    gemm(s0, s1)
            finally:
                _LOCAL.inline = False
        with limits:
            run_spans(group, [(i, i + 1) for i in range(len(spans))], flops)
    elif out.size:
        for s0, s1 in spans:
            gemm(s0, s1)
    if x.dtype != acc:
        res = np.empty(out.shape, x.dtype)
        store(res, out)
        out = res
    return out.reshape(x.shape[:-1] + (nout,))


def _parallel_rows(fn, nrows: int, row_elems: int):
    """fn(r0, r1) over row spans of about TILE_ELEMS elements (so that the several passes of a
    dequantizer over them stay in L2), split over the thread pool (in turn on this thread when
    it is already a pool thread working on a whole tile)."""
    spans = row_spans(nrows, row_elems, TILE_ELEMS)
    if getattr(_LOCAL, "inline", False):
        for r0, r1 in spans:
            fn(r0, r1)
    else:
        run_spans(fn, spans, nrows * row_elems)


class _Scratch:
    """A float32 buffer per thread, reused by every tile that thread dequantizes in a call."""

    def __init__(self):
        self.local = threading.local()

    def get(self, shape):
        n = int(np.prod(shape))
        buf = getattr(self.local, "buf", None)
        if buf is None or buf.size < n:
            buf = self.local.buf = np.empty(n, _F32)
        return buf[:n].reshape(shape)


# ---- GGUF --------------------------------------------------------------------------------------
def _gguf_tile(fmt, blocks, scratch, rows, cols):
    """Dequantize uint8 blocks [rows, cols / QK, BB] into a float32 [rows, cols] tile, each
    block's columns in the format's kernel order (`fmt.order`)."""
    t = scratch.get((rows, cols))
    blk = np.ascontiguousarray(blocks).reshape(-1, fmt.type_size)
    out = t.reshape(-1, fmt.block)

    def work(r0, r1):
        fmt.tile(blk[r0:r1], out[r0:r1])
    _parallel_rows(work, blk.shape[0], fmt.block)
    return t


_PERMS: dict = {}


def _kernel_columns(fmt, k: int):
    """Natural column of each kernel-order column of a K-wide row (blocks in turn), or None."""
    if fmt.order is None:
        return None
    key = (fmt.name, k)
    if key not in _PERMS:
        starts = np.arange(0, k, fmt.block, dtype=np.intp)
        _PERMS[key] = (starts[:, None] + fmt.order[None, :]).reshape(-1)
    return _PERMS[key]


def _natural_columns(x_kernel_order, perm):
    """[..., K] with columns in kernel order -> natural order."""
    if perm is None:
        return x_kernel_order
    out = np.empty_like(x_kernel_order)
    out[..., perm] = x_kernel_order
    return out


def dequantize_gguf(w_bytes, quant_type: str, n: int, k: int):
    """The whole float32 [n, k] weight (for tests and small weights)."""
    fmt = FORMATS[quant_type]
    t = _gguf_tile(fmt, w_bytes.reshape(n, k // fmt.block, fmt.type_size), _Scratch(), n, k)
    return _natural_columns(t, _kernel_columns(fmt, k))


@kernel(FusedOps.QMATMUL, "numpy", cost=_QMATMUL_COST)
def qmatmul(a, w_bytes, *, quant_type, n=None, k=None):
    """QMATMUL: a [..., k] @ W.T -> [..., n] in a's dtype; W from raw GGUF bytes. The tiles
    come in the format's kernel column order, so a's columns are put in that order once."""
    n, k = qmatmul_nk(quant_type, n, k, a.shape, w_bytes.size)
    fmt = FORMATS[quant_type]
    wb = w_bytes.reshape(n, k // fmt.block, fmt.type_size)
    perm = _kernel_columns(fmt, k)
    if perm is not None:
        a = np.take(a, perm, axis=-1)
    scratch = _Scratch()
    return _tiled_product(a, n, _spans(n, k, 1, a),
                          lambda r0, r1: _gguf_tile(fmt, wb[r0:r1], scratch, r1 - r0, k), True)


@kernel(QMATMUL_GRAD_A, "numpy", cost=_QMATMUL_GRAD_COST)
def qmatmul_grad_a(g, w_bytes, *, quant_type, n=None, k=None):
    """Gradient of QMATMUL in a: g [..., n] @ W -> [..., k] in g's dtype (computed in kernel
    column order, put back in order once)."""
    n, k = qmatmul_nk(quant_type, n, k, g.shape, w_bytes.size, grad=True)
    fmt = FORMATS[quant_type]
    wb = w_bytes.reshape(n, k // fmt.block, fmt.type_size)
    scratch = _Scratch()

    def tile(c0, c1):
        return _gguf_tile(fmt, wb[:, c0 // fmt.block:c1 // fmt.block], scratch, n, c1 - c0)
    out = _tiled_product(g, k, _spans(k, n, fmt.block, g), tile, False)
    return _natural_columns(out, _kernel_columns(fmt, k))


# ---- NF4 ---------------------------------------------------------------------------------------
#: NF4 byte -> its (high nibble, low nibble) float32 pair as one uint64: a byte becomes both its
#: values with one 8-byte look-up
_NF4_PAIR_WORDS = np.ascontiguousarray(NF4_BYTE_PAIRS, _F32).view(np.uint64).reshape(256)


def _nf4_tile(w_packed, absmax, block_size, scratch, r0, r1, c0, c1):
    """float32 W[r0:r1, c0:c1] (c0, c1 multiples of block_size, c1 - c0 even): NF4 code value *
    absmax."""
    rows, cols = r1 - r0, c1 - c0
    t = scratch.get((rows, cols))
    codes = w_packed[r0:r1, c0 // 2:c1 // 2]
    scale = absmax[r0:r1, c0 // block_size:c1 // block_size]

    def work(i0, i1):
        o = t[i0:i1]
        idx = codes[i0:i1].astype(np.intp)
        # mode="clip": no bounds error possible (bytes < 256), and "raise" would buffer `out`
        np.take(_NF4_PAIR_WORDS, idx, out=o.view(np.uint64).reshape(idx.shape), mode="clip")
        o3 = o.reshape(i1 - i0, -1, block_size)
        np.multiply(o3, scale[i0:i1, :, None], out=o3)
    _parallel_rows(work, rows, cols)
    return t


def dequantize_nf4(w_packed, absmax, block_size: int = 64):
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    return _nf4_tile(w_packed, absmax, block_size, _Scratch(), 0, n, 0, k)


@kernel(FusedOps.NF4_MATMUL, "numpy", cost=_NF4_COST)
def nf4_matmul(a, w_packed, absmax, *, block_size):
    """NF4_MATMUL: a [..., K] @ W.T -> [..., N] in a's dtype."""
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    scratch = _Scratch()
    return _tiled_product(
        a, n, _spans(n, k, 1, a),
        lambda r0, r1: _nf4_tile(w_packed, absmax, block_size, scratch, r0, r1, 0, k), True)


@kernel(NF4_MATMUL_GRAD_A, "numpy", cost=_NF4_GRAD_COST)
def nf4_matmul_grad_a(g, w_packed, absmax, *, block_size):
    """Gradient of NF4_MATMUL in a: g [..., N] @ W -> [..., K]."""
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    scratch = _Scratch()
    align = block_size if block_size % 2 == 0 else 2 * block_size
    return _tiled_product(
        g, k, _spans(k, n, align, g),
        lambda c0, c1: _nf4_tile(w_packed, absmax, block_size, scratch, 0, n, c0, c1), False)


# ---- AWQ ---------------------------------------------------------------------------------------
# Kernel layout: W's columns in *packed* order (column 8c + p holds nibble p of word c, logical
# column 8c + AWQ_ORDER[p]): the nibbles then come out of a byte table in memory order, and the
# permutation is applied once to the small operands (scales, the output or the incoming grad).
def _awq_nibbles(packed):
    """int32 [R, C] -> uint8 codes [R, 8C] in packed order (nibble p of word c at 8c + p): each
    word's nibbles spread to the bytes of a uint64 by three shift-or-mask rounds."""
    r = packed.shape[0]
    x = np.ascontiguousarray(packed).view(np.uint32).astype(np.uint64)
    for shift, mask in ((16, 0x0000FFFF0000FFFF), (8, 0x00FF00FF00FF00FF)):
        x |= x << np.uint64(shift)
        x &= np.uint64(mask)
    x |= x << np.uint64(4)
    x &= LO4
    return x.view(np.uint8).reshape(r, -1)


def _awq_tile(qweight, qzeros, scales, group_size, scratch, k0, k1, n0, n1):
    """float32 W[k0:k1, n0:n1] in packed column order (k0, k1 multiples of the group; n0, n1
    multiples of 8): (q - z) * s, exact."""
    rows, cols = k1 - k0, n1 - n0
    t = scratch.get((rows, cols))
    g0, c0, c1 = k0 // group_size, n0 // 8, n1 // 8
    ng = rows // group_size
    z = _awq_nibbles(qzeros[g0:g0 + ng, c0:c1])                                     # [ng, cols]
    s = scales[g0:g0 + ng, n0:n1].astype(_F32).reshape(ng, -1, 8)[:, :, _ORDER].reshape(ng, cols)
    q = qweight[k0:k1, c0:c1]
    t3 = t.reshape(ng, group_size, cols)

    def work(i0, i1):              # over groups
        o = t3[i0:i1]
        qi = _awq_nibbles(q[i0 * group_size:i1 * group_size]).reshape(o.shape)
        np.subtract(qi, z[i0:i1, None, :], out=qi)         # q - z as int8 (uint8 wraps)
        np.copyto(o, qi.view(np.int8), casting="unsafe")
        o *= s[i0:i1, None, :]
    _parallel_rows(work, ng, group_size * cols)
    return t


def _logical_columns(x_packed_order):
    """[..., N] in packed column order -> logical order."""
    sh = x_packed_order.shape
    out = np.empty_like(x_packed_order)
    out.reshape(-1, sh[-1] // 8, 8)[:, :, _ORDER] = x_packed_order.reshape(-1, sh[-1] // 8, 8)
    return out


def dequantize_awq(qweight, qzeros, scales, group_size: int = 128):
    """The whole float32 [K, N] weight in logical column order (for tests)."""
    k, n = qweight.shape[0], 8 * qweight.shape[1]
    return _logical_columns(_awq_tile(qweight, qzeros, scales, group_size, _Scratch(), 0, k, 0, n))


@kernel(FusedOps.AWQ_MATMUL, "numpy", cost=_AWQ_COST)
def awq_matmul(a, qweight, qzeros, scales, *, group_size):
    """AWQ_MATMUL: a [..., K] @ W -> [..., N] in a's dtype."""
    k, n = qweight.shape[0], 8 * qweight.shape[1]
    scratch = _Scratch()
    out = _tiled_product(
        a, n, _spans(n, k, 8, a),
        lambda n0, n1: _awq_tile(qweight, qzeros, scales, group_size, scratch, 0, k, n0, n1),
        False)
    return _logical_columns(out)


@kernel(AWQ_MATMUL_GRAD_A, "numpy", cost=_AWQ_GRAD_COST)
def awq_matmul_grad_a(g, qweight, qzeros, scales, *, group_size):
    """Gradient of AWQ_MATMUL in a: g [..., N] @ W.T -> [..., K]."""
    k, n = qweight.shape[0], 8 * qweight.shape[1]
    g_packed = np.ascontiguousarray(g.reshape(-1, n // 8, 8)[:, :, _ORDER])
    scratch = _Scratch()
    return _tiled_product(
        g_packed.reshape(g.shape), k, _spans(k, n, group_size, g),
        lambda k0, k1: _awq_tile(qweight, qzeros, scales, group_size, scratch, k0, k1, 0, n),
        True)
