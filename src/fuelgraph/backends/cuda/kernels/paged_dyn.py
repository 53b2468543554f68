"""The key loop of the paged decode kernel (`paged`) with dynamic chunks (launch knob dyn_tiles):
a program's keys are not one fixed range but chunks of TILES key tiles, the first its own
(chunk pid_s), the next ones taken from a ticket counter per (sequence, kv head, tile) as it
goes, so programs that stream faster take more chunks and the programs of a launch finish
together. Online softmax does not depend on the order of the keys, so any set of chunks gives
a valid partial for the split merge. k/v tiles are loaded one tile ahead into registers
(kv_ahead, `paged_loads`), block ids two tiles ahead, the next ticket one chunk ahead (its
latency hidden behind TILES tiles)."""
from __future__ import annotations

import triton
import triton.language as tl

from .paged_loads import _attend, _kv_tile


@triton.jit
def _dyn_chunks(K, V, tab, q, a, scale, softcap, slope, m_i, l_i, acc, n_bad, lo, hi, n_prog,
                tck_ptr, cnt_ptr, ids_first, ids_second, in_page, d, d_ok, nb, hk, hkv,
                BS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, OFF32: tl.constexpr,
                KV_EVICT: tl.constexpr, TILES: tl.constexpr, EARLY_IDS: tl.constexpr,
                EARLY_LAST: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, LANES: tl.constexpr):
    """Keys < hi of one (sequence, kv head, tile) in chunks of TILES * BLOCK_N (TILES >= 2):
    chunk lo // (TILES * BLOCK_N) first, then chunk n_prog + t for each ticket t taken from
    tck_ptr. ids_first / ids_second: the block ids of the first two tiles when EARLY_IDS asked
    for them with the length. Returns m_i, l_i, acc, n_bad and, with EARLY_LAST, the arrival
    count seen (acquire) when the program started its last tile (-1 if it had none)."""
    offs_n = tl.arange(0, BLOCK_N)
    C: tl.constexpr = TILES * BLOCK_N
    # tickets and the arrival count are atomics of one lane of a [LANES] tile (one element per
    # thread: no replica to broadcast to), summed over the tile only where the value is used: a
    # scalar atomic is broadcast through shared memory at once, the whole program waiting out
    # its round trip there
    lane = tl.arange(0, LANES)
    one = lane == 0
    tk_v = tl.atomic_add(tck_ptr + lane * 0, 1, mask=one, sem="relaxed", scope="gpu")
    tk = lo * 0
    if EARLY_IDS > 0:
        phys = ids_first
    else:
        phys = tl.load(tab + (lo + offs_n) // BS, mask=lo + offs_n < hi, other=0)
    k_next, v_next, n_bad = _kv_tile(K, V, phys, lo + offs_n, hi, in_page, d, d_ok, nb, n_bad,
                                     hk, hkv, BS, D, BLOCK_N, OFF32, KV_EVICT)
    nxt = lo + BLOCK_N                       # TILES >= 2: still in the first chunk
    if EARLY_IDS > 1:
        phys_next = ids_second
    else:
        phys_next = tl.load(tab + (nxt + offs_n) // BS, mask=nxt + offs_n < hi, other=0)
    cur = lo
    seen_v = lane * 0 - 1
    while cur < hi:
        if EARLY_LAST:   # the last tile of this program (the next one is past the keys)
            if nxt >= hi:
                seen_v = tl.atomic_add(cnt_ptr + lane * 0, 0, mask=one, sem="acquire",
                                       scope="gpu")
        k = k_next
        v = v_next
        k_next, v_next, n_bad = _kv_tile(K, V, phys_next, nxt + offs_n, hi, in_page, d, d_ok,
                                         nb, n_bad, hk, hkv, BS, D, BLOCK_N, OFF32, KV_EVICT)
        new_chunk = (nxt + BLOCK_N) % C == 0
        if new_chunk:    # the ticket asked for a chunk ago is used: ask for the next one
            tk = n_prog + tl.sum(tl.where(one, tk_v, 0), 0)
            tk_v = tl.atomic_add(tck_ptr + lane * 0, 1, mask=one, sem="relaxed", scope="gpu")
        after = tl.where(new_chunk, tk * C, nxt + BLOCK_N)
        phys_next = tl.load(tab + (after + offs_n) // BS, mask=after + offs_n < hi, other=0)
        j = cur + offs_n
        m_i, l_i, acc = _attend(q, k, v, j, j < hi, a, scale, softcap, slope, m_i, l_i, acc,
                                HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, DOT_F32)
        cur = nxt
        nxt = after
    return m_i, l_i, acc, n_bad, tl.max(tl.where(one, seen_v, -1), 0)
