"""The k/v loads of the paged decode kernel (`paged`) when it reads key tiles ahead into
registers (launch knob kv_ahead: one tile, or a ring of several), and the attention step of a
key tile both loops share. Plain loads, which keep their L2 eviction policy: Triton 3.6's
asynchronous copies into shared memory drop it (cp.async, and TMA loads alike: the PTX carries
no L2 cache hint), and after a flush that leaves dirty lines in the L2, evict_first reads
spare most of their write-back."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kv_tile(K, V, phys, j, hi, in_page, d, d_ok, nb, n_bad, hk, hkv, BS: tl.constexpr,
             D: tl.constexpr, BLOCK_N: tl.constexpr, OFF32: tl.constexpr,
             EVICT: tl.constexpr):
    """The k and v tiles [BLOCK_N, BLOCK_D] of keys j (< hi live) whose pool block ids are phys,
    and n_bad plus the live keys whose id is outside the pool (read as block 0)."""
    j_ok = j < hi
    p_ok = phys.to(tl.uint32, bitcast=True) < tl.cast(nb, tl.uint32)     # 0 <= id < nb
    n_bad += (j_ok & (p_ok == 0)).to(tl.int32)
    phys = tl.where(p_ok, phys, 0)
    if BLOCK_N % BS != 0:
        in_page = ((j % BS) * hkv + hk) * D
    if OFF32:
        kv_row = phys * (BS * hkv * D) + in_page
    else:
        kv_row = phys.to(tl.int64) * (BS * hkv * D) + in_page
    kv_off = kv_row[:, None] + d[None, :]
    kv_mask = j_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0, eviction_policy=EVICT)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0, eviction_policy=EVICT)
    return k, v, n_bad

@triton.jit
def _tanh(x):
    e = tl.exp(2.0 * x)                     # inf for large x: 1 - 0 = 1; 0 for very negative: -1
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _scores(q, k, j, j_ok, a, slope, scale, softcap, HAS_ALIBI: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """Scores [BLOCK_M, BLOCK_N] of the rows against key tile k (keys j, live where j_ok),
    in base 2, -inf where masked (causal: key j > the row's absolute position a)."""
    if DOT_F32:
        k = k.to(tl.float32)
    return _finish_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), j, j_ok, a, slope,
                          scale, softcap, HAS_ALIBI, HAS_SOFTCAP)


@triton.jit
def _finish_scores(s, j, j_ok, a, slope, scale, softcap, HAS_ALIBI: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr):
    """`_scores` from the raw dot products s."""
    rel = a[:, None] - j[None, :]
    if HAS_SOFTCAP or HAS_ALIBI:
        s = s * scale
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        if HAS_ALIBI:
            s = s - slope[:, None] * tl.abs(rel).to(tl.float32)
        s = s * 1.4426950408889634
    else:
        s = s * (scale * 1.4426950408889634)
    return tl.where((rel >= 0) & j_ok[None, :], s, float("-inf"))


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step: (max, sum, accumulator) after the key tile of scores s and
    values v."""
    m_new, l_i, alpha, p = _softmax_step(s, m_i, l_i)
    if DOT_F32:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _softmax_step(s, m_i, l_i):
    """(max, sum, the old accumulator's factor, probabilities) after the scores s."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _kv_one(X, phys, j, hi, in_page, d, nb, n_bad, hk, hkv, BS: tl.constexpr, D: tl.constexpr,
            BLOCK_N: tl.constexpr, OFF32: tl.constexpr, EVICT: tl.constexpr,
            COUNT: tl.constexpr, PACK: tl.constexpr):
    """One of the k / v tiles of `_kv_tile` (n_bad counted when COUNT). PACK (16-bit caches):
    read as int32 words, each two adjacent elements, [BLOCK_N, D // 2]: the words stay as
    loaded until `_halves` at their use (loaded 16-bit elements are split and re-packed right
    at the load, which waits for it there)."""
    j_ok = j < hi
    p_ok = phys.to(tl.uint32, bitcast=True) < tl.cast(nb, tl.uint32)     # 0 <= id < nb
    if COUNT:
        n_bad += (j_ok & (p_ok == 0)).to(tl.int32)
    phys = tl.where(p_ok, phys, 0)
    if BLOCK_N % BS != 0:
        in_page = ((j % BS) * hkv + hk) * D
    if OFF32:
        kv_row = phys * (BS * hkv * D) + in_page
    else:
        kv_row = phys.to(tl.int64) * (BS * hkv * D) + in_page
    if PACK:
        w = tl.arange(0, D // 2)
        x = tl.load(X.to(tl.pointer_type(tl.int32)) + (kv_row // 2)[:, None] + w[None, :],
                    mask=j_ok[:, None], other=0, eviction_policy=EVICT)
    else:
        x = tl.load(X + kv_row[:, None] + d[None, :], mask=j_ok[:, None] & (d < D)[None, :],
                    other=0.0, eviction_policy=EVICT)
    return x, n_bad


@triton.jit
def _halves(x, DT: tl.constexpr, DOT_F32: tl.constexpr):
    """The even and odd elements (columns) of a tile of `_kv_one`'s int32 words, as DT (the
    dot's operand type: float32 when DOT_F32)."""
    lo = (x & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(DT, bitcast=True)
    if DOT_F32:
        lo = lo.to(tl.float32)
        hi = hi.to(tl.float32)
    return lo, hi


@triton.jit
def _ring_loop(K, V, tab, q, a, slope, scale, softcap, lo, hi, ids0, ids_early, in_page, d,
               d_ok, nb, hk, hkv, m_i, l_i, acc, n_bad, BS: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr, OFF32: tl.constexpr, EVICT: tl.constexpr,
               RING: tl.constexpr, EARLY: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
               PACK: tl.constexpr):
    """The keys lo .. hi - 1 of a split with RING key tiles in flight in registers: the loop
    steps RING tiles, unrolled; each step consumes the oldest tile of the ring and requests the
    one RING tiles ahead in its slot once the slot's keys (after the scores) and values (after
    the accumulator's update) are used. PACK (16-bit tiles, D == BLOCK_D): they travel as the
    int32 words loaded (`_kv_one`), split into even and odd columns only at their use (the
    dot products and the accumulator run over the two halves apart): so no instruction reads a
    request before the step that uses it, and the RING tiles stay in flight across the loop's
    back-edge (the 16-bit loads of `_kv_tile` are re-packed right after the load, which makes
    every iteration wait for all its requests: bench/sass_paged.py shows it). Ids one tile
    ahead of the requests (ids0: the first tile's; ids_early: the first RING tiles' when
    requested with the length). Tiles past hi compute on masked keys (no loads, no change).
    -> (max, sum, accumulator, bad-id counts)."""
    offs_n = tl.arange(0, BLOCK_N)
    DT: tl.constexpr = K.dtype.element_ty
    BLOCK_M: tl.constexpr = acc.shape[0]
    if PACK:     # dot products and accumulator over the even and the odd columns apart
        q_e, q_o = tl.split(tl.reshape(q, [BLOCK_M, D // 2, 2]))
        acc_e, acc_o = tl.split(tl.reshape(acc, [BLOCK_M, D // 2, 2]))
    ring_k = ()
    ring_v = ()
    for t in tl.static_range(RING):
        jt = lo + t * BLOCK_N + offs_n
        if EARLY:
            ids_t = ids_early[t]
        elif t == 0:
            ids_t = ids0
        else:
            ids_t = tl.load(tab + jt // BS, mask=jt < hi, other=0)
        k_t, n_bad = _kv_one(K, ids_t, jt, hi, in_page, d, nb, n_bad, hk, hkv, BS, D, BLOCK_N,
                             OFF32, EVICT, True, PACK)
        v_t, n_bad = _kv_one(V, ids_t, jt, hi, in_page, d, nb, n_bad, hk, hkv, BS, D, BLOCK_N,
                             OFF32, EVICT, False, PACK)
        ring_k = ring_k + (k_t,)
        ring_v = ring_v + (v_t,)
    j = lo + RING * BLOCK_N + offs_n
    ids_next = tl.load(tab + j // BS, mask=j < hi, other=0)
    for start in range(lo, hi, RING * BLOCK_N):
        for t in tl.static_range(RING):
            j = start + t * BLOCK_N + offs_n
            if PACK:
                k_e, k_o = _halves(ring_k[t], DT, DOT_F32)
                s = tl.dot(q_e, tl.trans(k_e), input_precision=DOT_PREC)
                s = tl.dot(q_o, tl.trans(k_o), s, input_precision=DOT_PREC)
                s = _finish_scores(s, j, j < hi, a, slope, scale, softcap, HAS_ALIBI,
                                   HAS_SOFTCAP)
            else:
                s = _scores(q, ring_k[t], j, j < hi, a, slope, scale, softcap, HAS_ALIBI,
                            HAS_SOFTCAP, DOT_PREC, DOT_F32)
            jr = j + RING * BLOCK_N
            k_new, n_bad = _kv_one(K, ids_next, jr, hi, in_page, d, nb, n_bad, hk, hkv, BS, D,
                                   BLOCK_N, OFF32, EVICT, True, PACK)
            ring_k = ring_k[:t] + (k_new,) + ring_k[t + 1:]
            if PACK:
                m_i, l_i, alpha, p = _softmax_step(s, m_i, l_i)
                v_e, v_o = _halves(ring_v[t], DT, DOT_F32)
                acc_e = acc_e * alpha[:, None] + tl.dot(p.to(v_e.dtype), v_e,
                                                        input_precision=DOT_PREC)
                acc_o = acc_o * alpha[:, None] + tl.dot(p.to(v_o.dtype), v_o,
                                                        input_precision=DOT_PREC)
            else:
                m_i, l_i, acc = _online_softmax(s, ring_v[t], m_i, l_i, acc, DOT_PREC, DOT_F32)
            v_new, n_bad = _kv_one(V, ids_next, jr, hi, in_page, d, nb, n_bad, hk, hkv, BS, D,
                                   BLOCK_N, OFF32, EVICT, False, PACK)
            ring_v = ring_v[:t] + (v_new,) + ring_v[t + 1:]
            j_ids = j + (RING + 1) * BLOCK_N
            ids_next = tl.load(tab + j_ids // BS, mask=j_ids < hi, other=0)
    if PACK:
        acc = tl.reshape(tl.join(acc_e, acc_o), [BLOCK_M, D])
    return m_i, l_i, acc, n_bad
