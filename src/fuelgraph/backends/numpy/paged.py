"""NumPy kernels of the paged family: paged attention over a block-pool KV cache and the cache
write. The attention kernel gathers only the live blocks of each sequence, a chunk of blocks at a
time, and keeps a blocked online softmax (running max, running sum, rescaled accumulator), so
its cost follows the live tokens, not the table's capacity. It accumulates in float32 for
16/32-bit inputs and float64 for float64, and rounds once on store."""
from __future__ import annotations

import math

import numpy as np

from ...registry.core import FusedOps
from ...registry.paged import (PAGED_CACHE_WRITE, PAGED_CACHE_WRITE_KV, check_lengths,
                               check_slots, index_max, paged_attn_work)
from ..base import Cost, kernel
from .common import NUM_THREADS, acc_dtype, run_spans, store, to_acc

#: keys per online-softmax step (rounded to whole blocks): big enough that NumPy's per-call
#: overhead is small, small enough that one head's gathered rows stay in cache for the matmul
CHUNK_KEYS = 512


class _Checked:
    """The index arrays (and parameters) that passed their data check last. A decode step
    hands the same slot mapping to every layer's cache write and the same lengths and table to
    every layer's attention: checked once per step. Only read-only arrays that own their memory
    (or read-only views of such) are remembered (what they hold cannot have changed since)."""

    def __init__(self):
        self.last = None

    def seen(self, arrays, params) -> bool:
        last = self.last
        return last is not None and last[1] == params and \
            all(a is b for a, b in zip(last[0], arrays))

    def remember(self, arrays, params):
        if all(_frozen(a) for a in arrays):
            self.last = (arrays, params)


def _frozen(a) -> bool:
    """A read-only array that owns its memory, or a read-only view of one (a decode step's
    row of the inputs the cache prepared for all steps at once)."""
    if a.flags.writeable:
        return False
    b = a.base
    return b is None or (isinstance(b, np.ndarray) and b.base is None and
                         not b.flags.writeable)


_LENGTHS, _SLOTS = _Checked(), _Checked()


def paged_attn_cost(shapes, params=None):
    return Cost(*paged_attn_work(shapes))


def paged_cache_write_cost(shapes, params=None):
    n = math.prod(shapes[1])
    return Cost(0, 2 * 2 * n)


@kernel(FusedOps.PAGED_ATTN, "numpy", cost=paged_attn_cost)
def paged_attn(q, k_cache, v_cache, block_table, context_lens, *alibi, softmax_scale,
               softcap=None):
    """q [B, Hq, Sq, D]; caches [NB, BS, Hkv, D]; block_table [B, MB], context_lens [B]
    (int32/uint32); alibi [Hq] or [B, Hq] -> [B, Hq, Sq, D] in q's dtype. Raises FuelGraphError
    for an invalid length or a live table entry outside the pool."""
    B, hq, sq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    if not _LENGTHS.seen((context_lens, block_table), (sq, nb, bs)):
        check_lengths("paged_attn", context_lens, block_table, sq, nb, bs, block_table.shape[1])
        _LENGTHS.remember((context_lens, block_table), (sq, nb, bs))
    acc = acc_dtype(q.dtype)
    slopes = None
    if alibi:
        slopes = np.broadcast_to(np.asarray(alibi[0], np.float64).reshape(-1, hq), (B, hq))
    lens = context_lens.astype(np.int64)
    longest = -(-int(lens.max(initial=0)) // bs) * bs
    if B * hkv * longest * max(d, sq * (hq // hkv)) <= BATCHED_MAX_ELEMS:     # k/v and scores
        with np.errstate(over="ignore", invalid="ignore"):
            o = _attend_batch(q, k_cache, v_cache, block_table, context_lens, acc, softmax_scale,
                              softcap, slopes)
        if o.dtype == q.dtype and o.flags.c_contiguous:    # a fresh array of the kernel's own
            return o
        out = np.empty(q.shape, q.dtype)
        store(out, o)
        return out
    out = np.zeros(q.shape, q.dtype)
    # work units (sequence, kv-head range); with fewer sequences than threads the heads of a
    # sequence are split too, so one long sequence still uses every core
    parts = max(1, min(hkv, -(-NUM_THREADS // max(B, 1))))
    units = [(b, hkv * i // parts, hkv * (i + 1) // parts)
             for b in range(B) if lens[b] and sq for i in range(parts)]
    g = hq // hkv

    def work(u0, u1):
        for b, h0, h1 in units[u0:u1]:
            n = int(lens[b])
            sl = None if slopes is None else slopes[b, h0 * g:h1 * g]
            res = _attend(q[b, h0 * g:h1 * g], k_cache, v_cache,
                          block_table[b, :-(-n // bs)].astype(np.intp), n, acc, softmax_scale,
                          softcap, sl, h0, h1)
            store(out[b, h0 * g:h1 * g], res)

    with np.errstate(over="ignore", invalid="ignore"):
        run_spans(work, [(i, i + 1) for i in range(len(units))],
                  int(lens.sum()) * hkv * d * (2 + sq))
    return out


def _attend(qb, k_cache, v_cache, pages, n, acc, scale, softcap, slopes, h0, h1):
    """One sequence, kv heads [h0, h1): qb [their query heads, Sq, D] over the n live keys in
    blocks `pages`. Keys are walked a
    chunk of blocks at a time; each kv head's rows of the chunk are gathered into one contiguous
    [keys, D] matrix (a single copy, small enough to stay in cache for its matmul), and the
    online softmax keeps a running max, sum and rescaled accumulator per query row."""
    hq, sq, d = qb.shape
    bs = k_cache.shape[1]
    hkv = h1 - h0
    g = hq // hkv
    rows = g * sq                                                   # query rows per kv head
    qt = to_acc(qb, acc).reshape(hkv, rows, d).transpose(0, 2, 1)   # [Hkv, D, rows]
    pos = np.tile(n - sq + np.arange(sq), g)                        # position of each row
    sl = None if slopes is None else np.repeat(np.asarray(slopes, acc).reshape(hkv, g), sq, 1)
    m = np.full((hkv, 1, rows), -np.inf, acc)
    den = np.zeros((hkv, 1, rows), acc)
    o = np.zeros((hkv, rows, d), acc)
    step = max(1, CHUNK_KEYS // bs)
    for c0 in range(0, len(pages), step):
        pg, j0 = pages[c0:c0 + step], c0 * bs
        nk = min(n - j0, len(pg) * bs)
        s = np.empty((hkv, nk, rows), acc)
        for h in range(hkv):
            np.matmul(_rows(k_cache, pg, h0 + h, nk, acc), qt[h], out=s[h])   # [keys, rows]
        s *= acc.type(scale)
        if softcap is not None:
            c = acc.type(softcap)
            s = np.tanh(s / c) * c
        rel = pos[None, :] - (j0 + np.arange(nk))[:, None]                  # a - j, [keys, rows]
        if sl is not None:
            s -= sl[:, None, :] * np.abs(rel).astype(acc)
        if j0 + nk - 1 > pos.min():                                         # causal edge
            s = np.where(rel >= 0, s, -np.inf)
        m_new = np.maximum(m, s.max(axis=1, keepdims=True))
        m_safe = np.where(m_new == -np.inf, 0, m_new)
        alpha = np.exp(m - m_safe)
        s -= m_safe
        p = np.exp(s, out=s)
        den = den * alpha + p.sum(axis=1, keepdims=True)
        o *= alpha.transpose(0, 2, 1)
        for h in range(hkv):
            o[h] += p[h].T @ _rows(v_cache, pg, h0 + h, nk, acc)
        m = m_new
    o /= np.where(den > 0, den, 1).transpose(0, 2, 1)
    return o.reshape(hq, sq, d)


#: gathered k (or v) elements and scores up to which a batch of short sequences is attended in
#: one pass
#: (a few NumPy calls for the whole batch instead of a few per sequence and kv head)
BATCHED_MAX_ELEMS = 1 << 20


def _attend_batch(q, k_cache, v_cache, block_table, context_lens, acc, scale, softcap, slopes):
    """All sequences at once, for short contexts: every sequence's live blocks gathered into
    one padded [B, Hkv, L, D] (L = the longest context, rounded up to whole blocks; a shorter
    sequence's padding reads block 0, masked out of the scores and zeroed in v), batched
    products and one masked softmax -> [B, Hq, Sq, D] in acc. Rows of a sequence with no
    tokens come out zero."""
    B, hq, sq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    lay = _batch_layout(block_table, context_lens, bs, acc)
    if lay is None:
        return np.zeros(q.shape, acc)
    L, pages, short, empty, pad_rows, pad = lay
    g = hq // hkv

    def dense(cache, zero_padding=False):                                  # [B, Hkv, L, D]
        rows = cache[pages].reshape(B * L, hkv, d)         # a fresh gather: zeroed in place,
        if zero_padding:                                   # in its contiguous layout
            rows[pad_rows] = 0
        return to_acc(rows.reshape(B, L, hkv, d).transpose(0, 2, 1, 3), acc)
    qg = to_acc(q, acc).reshape(B, hkv, g * sq, d)
    s = qg @ dense(k_cache).transpose(0, 1, 3, 2)                          # [B, Hkv, g*Sq, L]
    s *= acc.type(scale)
    if softcap is not None:
        c = acc.type(softcap)
        s = np.tanh(s / c) * c
    if sq == 1 and slopes is None:                 # decode: only the length mask
        if short:                                  # (rows past a length may hold NaN)
            np.copyto(s, -np.inf, where=pad)
    else:
        lens = context_lens.astype(np.int64)
        pos = lens[:, None] - sq + np.arange(sq)[None, :]                   # [B, Sq]
        rel = np.tile(pos, (1, g))[:, :, None] - np.arange(L)[None, None, :]   # [B, g*Sq, L]
        if slopes is not None:
            sl = np.repeat(np.asarray(slopes, acc).reshape(B, hkv, g), sq, 2)  # [B, Hkv, g*Sq]
            s -= sl[..., None] * np.abs(rel).astype(acc)[:, None]
        s = np.where((rel >= 0)[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    if empty:                                      # a row with every key masked
        m = np.where(m == -np.inf, 0, m)
    s -= m
    p = np.exp(s, out=s)
    den = p.sum(-1, keepdims=True)
    v = dense(v_cache, short)
    o = p @ v                                                              # [B, Hkv, g*Sq, D]
    if empty:
        o /= np.where(den > 0, den, 1)
        o[context_lens == 0] = 0
    else:
        o /= den
    return o.reshape(B, hq, sq, d)


_LAYOUT: list = [None]        # ((block_table, context_lens, block size, acc), layout)


def _batch_layout(block_table, lens, bs, acc):
    """What `_attend_batch` needs of the table and lengths alone, or None without live blocks:
    (L, pages [B, L / bs] (pads read block 0), whether some sequence is shorter than L, whether
    one is empty, the padding rows of the gathered [B * L] rows, the padding mask
    [B, 1, 1, L] of the scores). A decode step hands every layer the same
    read-only table and lengths: worked out once per step (`_frozen`)."""
    key = (block_table, lens, bs, acc)
    got = _LAYOUT[0]
    if got is not None and all(a is b for a, b in zip(got[0][:2], key[:2])) and \
            got[0][2:] == key[2:]:
        return got[1]
    ln = lens.astype(np.int64)
    mb = -(-int(ln.max(initial=0)) // bs)
    if mb == 0:
        lay = None
    else:
        L = mb * bs
        live = np.arange(mb)[None, :] * bs < ln[:, None]
        pages = np.where(live, block_table[:, :mb].astype(np.int64), 0)
        short, empty = int(ln.min()) < L, int(ln.min()) == 0  # padding rows may hold anything
        pad = np.arange(L)[None, :] >= ln[:, None]                        # [B, L]
        lay = (L, pages, short, empty, np.flatnonzero(pad), pad[:, None, None, :])
    if _frozen(block_table) and _frozen(lens):
        _LAYOUT[0] = (key, lay)
    return lay


def _rows(cache, pages, h, nk, acc):
    """Rows of kv head h in the given pool blocks, first nk of them, as one [nk, D] matrix."""
    x = cache[pages, :, h, :].reshape(-1, cache.shape[3])[:nk]
    return to_acc(x, acc)


@kernel(PAGED_CACHE_WRITE, "numpy", cost=paged_cache_write_cost)
def paged_cache_write(cache, new, slot_mapping, *, out=None, check=True):
    """cache [NB, BS, Hkv, D] <- rows of new [N, Hkv, D] at slot_mapping [N] (slot = block * BS
    + row; the index type's maximum skips a row). Writes into cache and returns it; with `out`
    (a fresh array shaped like cache) the result goes there and cache is only read.
    `check=False` skips the slot check, for callers whose slots are valid by construction."""
    nb, bs = cache.shape[:2]
    if check and not _SLOTS.seen((slot_mapping,), nb * bs):
        check_slots("paged_cache_write", slot_mapping, nb * bs)
        _SLOTS.remember((slot_mapping,), nb * bs)
    dst = cache if out is None else out
    if out is not None:
        np.copyto(out, cache)
    rows, keep = _write_rows(slot_mapping)
    flat = dst.reshape(nb * bs, *cache.shape[2:])
    flat[rows] = new if keep is None else new[keep]
    return dst


_WRITE_ROWS: list = [None]     # (slot_mapping, (rows, keep))


def _write_rows(slot_mapping):
    """(pool rows to write, the mask of the new rows written or None for all) of a slot
    mapping (the index type's maximum skips a row); worked out once for a read-only mapping
    (a decode step writes k and v of every layer with the same one)."""
    got = _WRITE_ROWS[0]
    if got is not None and got[0] is slot_mapping:
        return got[1]
    s = slot_mapping.astype(np.int64)
    keep = s != index_max(slot_mapping.dtype)
    res = (s, None) if keep.all() else (s[keep], keep)
    if _frozen(slot_mapping):
        _WRITE_ROWS[0] = (slot_mapping, res)
    return res


def paged_cache_write_kv_cost(shapes, params=None):
    return Cost(0, 2 * 2 * (math.prod(shapes[2]) + math.prod(shapes[3])))


@kernel(PAGED_CACHE_WRITE_KV, "numpy", cost=paged_cache_write_kv_cost)
def paged_cache_write_kv(k_cache, v_cache, k_new, v_new, slot_mapping):
    """PAGED_CACHE_WRITE_KV: both pools written in place (the slot check once) -> (k, v)."""
    return (paged_cache_write(k_cache, k_new, slot_mapping),
            paged_cache_write(v_cache, v_new, slot_mapping))
