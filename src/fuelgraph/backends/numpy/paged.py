"""NumPy kernels of the paged family: paged attention over a block-pool KV cache and the cache
write. The attention kernel gathers only the live blocks of each sequence, a chunk of blocks at a
time, and keeps a blocked online softmax (running max, running sum, rescaled accumulator), so
its cost follows the live tokens, not the table's capacity. It accumulates in float32 for
16/32-bit inputs and float64 for float64, and rounds once on store."""
from __future__ import annotations

import math

import numpy as np

from ...registry.paged import check_lengths, check_slots, index_max
from ..base import Cost
from .helpers import acc_dtype, store, to_acc

#: keys per online-softmax step (rounded to whole blocks): big enough that NumPy's per-call
#: overhead is small, small enough that the gathered chunk stays in cache
CHUNK_KEYS = 2048


def paged_attn(q, k_cache, v_cache, block_table, context_lens, *alibi, softmax_scale,
               softcap=None):
    """q [B, Hq, Sq, D]; caches [NB, BS, Hkv, D]; block_table [B, MB], context_lens [B]
    (int32/uint32); alibi [Hq] or [B, Hq] -> [B, Hq, Sq, D] in q's dtype. Raises FuelGraphError
    for an invalid length or a live table entry outside the pool."""
    B, hq, sq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    mb = block_table.shape[1]
    g = hq // hkv
    check_lengths("paged_attn", context_lens, block_table, sq, nb, bs, mb)
    acc = acc_dtype(q.dtype)
    lens = context_lens.astype(np.int64)
    out = np.zeros(q.shape, q.dtype)
    slopes = None
    if alibi:
        slopes = np.broadcast_to(np.asarray(alibi[0], np.float64).reshape(-1, hq), (B, hq))
    step = max(1, CHUNK_KEYS // bs)                       # blocks per online-softmax step
    scale = acc.type(softmax_scale)
    for b in range(B):
        n = int(lens[b])
        if n == 0 or sq == 0:
            continue
        nblk = -(-n // bs)
        pages = block_table[b, :nblk].astype(np.intp)
        qb = to_acc(q[b], acc).reshape(hkv, g * sq, d)    # the q heads of each kv head
        pos = n - sq + np.arange(sq)                      # absolute position of each query row
        sl = None if slopes is None else slopes[b].astype(acc).reshape(hkv, g, 1, 1)
        m = np.full((hkv, g * sq, 1), -np.inf, acc)
        den = np.zeros((hkv, g * sq, 1), acc)
        o = np.zeros((hkv, g * sq, d), acc)
        for c0 in range(0, nblk, step):
            j0 = c0 * bs
            nk = min(n, (c0 + step) * bs) - j0
            k = _heads_major(k_cache, pages[c0:c0 + step], nk, acc)        # [Hkv, nk, D]
            s = np.matmul(qb, k.transpose(0, 2, 1))                        # [Hkv, G*Sq, nk]
            s *= scale
            if softcap is not None:
                c = acc.type(softcap)
                s = np.tanh(s / c) * c
            rel = pos[:, None] - (j0 + np.arange(nk))[None, :]             # a_i - j, [Sq, nk]
            if sl is not None:
                s = (s.reshape(hkv, g, sq, nk) - sl * np.abs(rel).astype(acc)).reshape(s.shape)
            if j0 + nk - 1 > pos[0]:                                       # causal block edge
                s = np.where(np.broadcast_to(rel >= 0, (hkv, g, sq, nk)).reshape(s.shape),
                             s, -np.inf)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            m_safe = np.where(m_new == -np.inf, 0, m_new)
            alpha = np.exp(m - m_safe)
            p = np.exp(s - m_safe)
            den = den * alpha + p.sum(axis=-1, keepdims=True)
            v = _heads_major(v_cache, pages[c0:c0 + step], nk, acc)
            o = o * alpha + np.matmul(p, v)
            m = m_new
        res = o / np.where(den > 0, den, 1)
        store(out[b], res.reshape(hq, sq, d))
    return out


def _heads_major(cache, pages, nk, acc):
    """The first nk rows of the given pool blocks as [Hkv, nk, D] in acc (one gather copy)."""
    blocks = cache[pages]                                                  # [n, BS, Hkv, D]
    rows = blocks.reshape(-1, cache.shape[2], cache.shape[3])[:nk]
    return np.ascontiguousarray(to_acc(rows, acc).transpose(1, 0, 2))


def paged_attn_cost(shapes, params=None):
    """Upper bound from the table's capacity: the live tokens are unknown until run time."""
    (B, hq, sq, d), (nb, bs, hkv, _) = shapes[0], shapes[1]
    keys = shapes[3][1] * bs
    return Cost(4 * B * hq * sq * keys * d, 2 * (2 * B * hkv * keys * d + 2 * B * hq * sq * d))


def paged_cache_write(cache, new, slot_mapping, *, out=None):
    """cache [NB, BS, Hkv, D] <- rows of new [N, Hkv, D] at slot_mapping [N] (slot = block * BS
    + row; the index type's maximum skips a row). Writes into cache and returns it; with `out`
    (a fresh array shaped like cache) the result goes there and cache is only read."""
    nb, bs = cache.shape[:2]
    check_slots("paged_cache_write", slot_mapping, nb * bs)
    dst = cache if out is None else out
    if out is not None:
        np.copyto(out, cache)
    s = slot_mapping.astype(np.int64)
    keep = s != index_max(slot_mapping.dtype)
    flat = dst.reshape(nb * bs, *cache.shape[2:])
    flat[s[keep]] = new[keep]
    return dst


def paged_cache_write_cost(shapes, params=None):
    n = math.prod(shapes[1])
    return Cost(0, 2 * 2 * n)
