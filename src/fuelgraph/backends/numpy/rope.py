"""NumPy fused kernel for ROPE: rotary position embedding with explicit cos/sin tables.

Both layouts are written as `y = x * cos + rot(x) * sin`, evaluated per element in the
accumulation dtype (float32 for float32/float16/bfloat16, float64 for float64) and narrowed once
to x's dtype. The sign of `rot` is folded into a signed copy of the (small) sin table, so the
big array only sees contiguous multiplies/adds plus one pair-swapping copy:

* rotate-half (GPT-NeoX / HF, `interleaved=False`): pairs feature i with i + D/2,
  `rot(x) = concat(-x[..., D/2:], x[..., :D/2])`;
* interleaved (GPT-J, `interleaved=True`): pairs features 2i and 2i+1,
  `rot(x)[2i] = -x[2i+1]`, `rot(x)[2i+1] = x[2i]`.

The tables end in [S, D] and broadcast to x: one [S, D] table for every leading dim, or per-batch
tables (e.g. [B, 1, S, D] for x [B, H, S, D]); each sequence of x reads the table row block that
broadcasting assigns it.
"""
from __future__ import annotations

import numpy as np

from ...registry.core import FusedOps
from ..base import kernel, row_cost
from . import common as _h
from .common import acc_dtype, run_spans, store, to_acc

_OP = "rope"
#: elements per block of the computation inside a thread's span (128 KiB of float32 each for
#: x, the output and one temporary: the three passes stay in L2)
BLOCK_ELEMS = 1 << 15


def _spans(batch: int, s: int, d: int) -> list[tuple[int, int]]:
    """Row spans over the [batch * s, d] view that either stay inside one sequence or cover
    whole sequences (so the tables are a plain slice or a broadcast of the full table)."""
    per, nthr = max(1, _h.CHUNK_ELEMS // d), _h.NUM_THREADS
    if per >= s:                                         # several whole sequences per span
        k = max(1, min(per // s, -(-batch // nthr)))
        return [(b * s, min(b + k, batch) * s) for b in range(0, batch, k)]
    if batch < nthr:
        per = min(per, -(-s // nthr))
    return [(b * s + i, b * s + min(i + per, s)) for b in range(batch) for i in range(0, s, per)]


def _table_blocks(table, lead):
    """(table as [n, S, D], the block index of each of x's prod(lead) sequences)."""
    t_lead = table.shape[:-2]
    n = int(np.prod(t_lead, dtype=np.int64))
    shape = (1,) * (len(lead) - len(t_lead)) + tuple(t_lead)
    idx = np.broadcast_to(np.arange(n).reshape(shape), lead).reshape(-1)
    return table.reshape((n,) + table.shape[-2:]), idx


def _heads_view(x):
    """x [..., H, S, D] as [outer, H, S, D] without a copy, when its last axis is unit-stride
    (a heads-first view of a [B, S, H, D] projection: q.reshape(B, S, H, D).permute(0, 2, 1, 3));
    None when that is impossible (the caller then copies x)."""
    if x.ndim < 3 or x.strides[-1] != x.itemsize:
        return None
    try:
        return np.reshape(x, (-1,) + x.shape[-3:], copy=False)
    except ValueError:
        return None


@kernel(FusedOps.ROPE, "numpy", cost=row_cost(4), strided_input=True)
def rope(x, cos, sin, *, interleaved):
    """ROPE: x [..., S, D] (rank >= 2, D even), cos/sin [..., S, D] broadcastable to x -> y,
    shape/dtype of x.

    interleaved=False (rotate-half, the default layout), for i < h = D/2:
        y[i]     = x[i]     * cos[i]     - x[i + h] * sin[i]
        y[i + h] = x[i + h] * cos[i + h] + x[i]     * sin[i + h]
    interleaved=True (GPT-J pairs):
        y[2i]     = x[2i]     * cos[2i]     - x[2i + 1] * sin[2i]
        y[2i + 1] = x[2i + 1] * cos[2i + 1] + x[2i]     * sin[2i + 1]
    Each output element is `x*cos + (+-x_partner)*sin`: two products and one sum, rounded in
    the accumulation dtype.
    """
    s, d = x.shape[-2], x.shape[-1]
    dt, acc = x.dtype, acc_dtype(x.dtype)
    if dt == acc and 0 < x.size < _h.PARALLEL_MIN_ELEMS:
        return _rope_small(x, to_acc(cos, acc), to_acc(sin, acc), interleaved)
    out = _h.new_output(x.shape, dt)
    if x.size == 0:
        return out
    # a strided x (heads permuted out of a projection) is read in place, sequence blocks at a
    # time, instead of being copied to a contiguous array first
    x4 = None if x.flags.c_contiguous else _heads_view(x)
    if x4 is None and not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    inner = x4.shape[1] if x4 is not None else 0
    h = d // 2
    lead = x.shape[:-2]
    cs, ci = _table_blocks(np.ascontiguousarray(to_acc(cos, acc)), lead)
    sn, si = _table_blocks(np.array(to_acc(sin, acc)), lead)   # private copy, sign folded in
    if interleaved:
        sn[..., 0::2] *= -1
    else:
        sn[..., :h] *= -1
    x2 = x.reshape(-1, d) if x4 is None else None
    o2 = out.reshape(-1, d)
    batch = o2.shape[0] // s

    def x_rows(a, n, shp):
        """Rows a:a+n of x as `shp`: (k, s, d) whole sequences or (n, d) inside one."""
        if x4 is None:
            return x2[a:a + n].reshape(shp)
        b = a // s
        if len(shp) == 3:
            return x4[b // inner, b % inner:b % inner + shp[0]]
        return x4[b // inner, b % inner, a % s:a % s + n]

    def rows(t, idx, b0, b1):
        """The table for sequences b0..b1-1: one shared [S, D] block, or one per sequence."""
        if len(t) == 1:
            return t[0]
        k = idx[b0:b1]
        return t[k[0]] if (k == k[0]).all() else t[k]

    def block(a, n, c, sg, shp, tmp):
        """Rows a:a+n of x (shape shp) with their tables c, sg into out."""
        xc = to_acc(x_rows(a, n, shp), acc)
        y = o2[a:a + n].reshape(shp) if dt == acc else np.empty(shp, acc)
        t = tmp[:xc.size].reshape(shp)
        np.multiply(xc, c, out=y)
        if interleaved:                                  # t = pair-swapped x
            t[..., 0::2] = xc[..., 1::2]
            t[..., 1::2] = xc[..., 0::2]
            np.multiply(t, sg, out=t)
        else:                                            # t = half-swapped x * signed sin
            hv = shp[:-1] + (2, h)
            np.multiply(xc.reshape(hv)[..., ::-1, :], sg.reshape(sg.shape[:-1] + (2, h)),
                        out=t.reshape(hv))
        np.add(y, t, out=y)
        if dt != acc:
            store(o2[a:a + n], y.reshape(n, d))

    def work(r0, r1):
        # blocks of about BLOCK_ELEMS inside the span: x, y and the temporary pass over each
        # block stay in L2 (whole spans of 1 MiB went to memory three times)
        tmp = np.empty(min((r1 - r0) * d, max(BLOCK_ELEMS, s * d)), acc)
        a = r0
        while a < r1:
            s0 = a % s
            if s0 == 0 and r1 - a >= s and s * d <= BLOCK_ELEMS:     # whole sequences
                k = min((r1 - a) // s, BLOCK_ELEMS // (s * d))
                b0 = a // s
                if x4 is not None:                   # one strided block: one outer index
                    k = min(k, inner - b0 % inner)
                c, sg, shp = rows(cs, ci, b0, b0 + k), rows(sn, si, b0, b0 + k), (k, s, d)
                n = k * s
            else:                                        # rows inside one sequence
                n = min(r1 - a, s - s0, max(1, BLOCK_ELEMS // d))
                b = a // s
                c, sg, shp = cs[ci[b], s0:s0 + n], sn[si[b], s0:s0 + n], (n, d)
            block(a, n, c, sg, shp, tmp)
            a += n

    with np.errstate(over="ignore", invalid="ignore"):
        run_spans(work, _spans(batch, s, d), x.size)
    return out


def _rope_small(x, cos, sin, interleaved):
    """The whole of a small float32/float64 x at once (a decode step's few rows: the span
    machinery would cost more than the arithmetic), the tables broadcast: the same operations
    per element as `rope` (x*cos plus the partner times the signed sin), so the same bits."""
    swap, sign = _pairing(x.shape[-1], interleaved, x.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.multiply(x, cos)                     # the tables broadcast to x: x's shape
        ss = np.multiply(sin, sign)
        if interleaved:
            t = np.take(x, swap, axis=-1)
            np.multiply(t, ss, out=t)
        else:                                       # halves swapped by two slice products
            h = x.shape[-1] // 2
            t = np.empty(y.shape, y.dtype)
            np.multiply(x[..., h:], ss[..., :h], out=t[..., :h])
            np.multiply(x[..., :h], ss[..., h:], out=t[..., h:])
        np.add(y, t, out=y)
    return y


_PAIRING: dict = {}


def _pairing(d: int, interleaved: bool, dtype):
    """(index of each feature's partner [D], sign of the partner's term [D]) of a layout."""
    key = (d, interleaved, np.dtype(dtype))
    got = _PAIRING.get(key)
    if got is None:
        i = np.arange(d)
        if interleaved:
            swap, neg = i ^ 1, i % 2 == 0
        else:
            swap, neg = (i + d // 2) % d, i < d // 2
        got = _PAIRING[key] = (swap.astype(np.intp), np.where(neg, -1, 1).astype(dtype))
    return got
