"""The k/v loads of the paged decode kernel (`paged`) when it reads key tiles ahead into
registers (launch knob kv_ahead): plain loads, which keep their L2 eviction policy (Triton's
pipelined copies into shared memory drop it); one key tile of the online softmax (`_attend`);
and the key loop with keys two tiles ahead, values one (kv_ahead=2, `_staggered_tiles`)."""
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
def _x_tile(X, phys, j, hi, in_page, d, d_ok, nb, hk, hkv, BS: tl.constexpr, D: tl.constexpr,
            BLOCK_N: tl.constexpr, OFF32: tl.constexpr, EVICT: tl.constexpr):
    """The tile [BLOCK_N, BLOCK_D] of X (k or v pool) of keys j (< hi live) whose pool block ids
    are phys (ids outside the pool read as block 0; _kv_tile counts them)."""
    p_ok = phys.to(tl.uint32, bitcast=True) < tl.cast(nb, tl.uint32)
    phys = tl.where(p_ok, phys, 0)
    if BLOCK_N % BS != 0:
        in_page = ((j % BS) * hkv + hk) * D
    if OFF32:
        kv_row = phys * (BS * hkv * D) + in_page
    else:
        kv_row = phys.to(tl.int64) * (BS * hkv * D) + in_page
    return tl.load(X + kv_row[:, None] + d[None, :], mask=(j < hi)[:, None] & d_ok[None, :],
                   other=0.0, eviction_policy=EVICT)


@triton.jit
def _l2_evict_first(X, kv_row, ok, ASM: tl.constexpr):
    """Marks the k or v rows of a consumed key tile (X + kv_row[n], n where ok) first to be
    evicted from the L2, with a bulk L2 prefetch carrying an evict_first policy (the rows are
    in the L2: the access only changes their priority). Triton's pipelined copies into shared
    memory carry no eviction policy: marked afterwards, the tile's lines are the ones the next
    copies replace, not the lines other work left in the L2 (dirty ones cost a write-back)."""
    tl.inline_asm_elementwise(ASM, "=r,l,r", [X + kv_row, ok.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


def l2_evict_first_asm(row_bytes: int) -> str:
    """The PTX of `_l2_evict_first` for rows of row_bytes (a multiple of 16; sm_90)."""
    return ("{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_first.b64 pol, 1.0; "
            f"@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], {row_bytes}, pol; "
            "mov.u32 $0, 0; }")


@triton.jit
def _bad_ids(phys, j, hi, nb, n_bad):
    """n_bad plus the live keys j (< hi) whose block id is outside the pool."""
    p_ok = phys.to(tl.uint32, bitcast=True) < tl.cast(nb, tl.uint32)
    return n_bad + ((j < hi) & (p_ok == 0)).to(tl.int32)


@triton.jit
def _tanh(x):
    e = tl.exp(2.0 * x)                     # inf for large x: 1 - 0 = 1; 0 for very negative: -1
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _attend_qk(q, k, j, j_ok, a, scale, softcap, slope, m_i, l_i, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """The scores of one key tile (keys j, live where j_ok) for rows at absolute positions a
    (row sees keys <= a), base 2: (p, alpha, new max, new sum) of the online softmax."""
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
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
    s = tl.where((rel >= 0) & j_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend(q, k, v, j, j_ok, a, scale, softcap, slope, m_i, l_i, acc,
            HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PREC: tl.constexpr,
            DOT_F32: tl.constexpr):
    """One key tile (keys j, live where j_ok) into the online softmax (m_i, l_i, acc)."""
    p, alpha, m_i, l_i = _attend_qk(q, k, j, j_ok, a, scale, softcap, slope, m_i, l_i,
                                    HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, DOT_F32)
    if DOT_F32:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_i, l_i, acc

@triton.jit
def _staggered_tiles(K, V, tab, q, a, scale, softcap, slope, m_i, l_i, acc, n_bad, lo, hi,
                     cnt_ptr, ids_first, ids_second, in_page, d, d_ok, nb, hk, hkv,
                     BS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     OFF32: tl.constexpr, KV_EVICT: tl.constexpr, EARLY_IDS: tl.constexpr,
                     EARLY_LAST: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                     HAS_ALIBI: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
                     LANES: tl.constexpr):
    """Keys [lo, hi) with the key tiles loaded two tiles ahead and the value tiles one (kv_ahead
    = 2): tile i+2's keys are requested before tile i's scores, tile i+1's values after them
    (tile i's keys are dead by then), so as many tiles are held in registers as with both one
    tile ahead while the keys have two iterations to arrive. Returns m_i, l_i, acc, n_bad and
    the one-lane arrival check of EARLY_LAST (as `_dyn_chunks`)."""
    offs_n = tl.arange(0, BLOCK_N)
    lane = tl.arange(0, LANES)
    if EARLY_IDS > 0:
        ph0 = ids_first
    else:
        ph0 = tl.load(tab + (lo + offs_n) // BS, mask=lo + offs_n < hi, other=0)
    if EARLY_IDS > 1:
        ph1 = ids_second
    else:
        ph1 = tl.load(tab + (lo + BLOCK_N + offs_n) // BS, mask=lo + BLOCK_N + offs_n < hi,
                      other=0)
    k_cur = _x_tile(K, ph0, lo + offs_n, hi, in_page, d, d_ok, nb, hk, hkv, BS, D, BLOCK_N,
                    OFF32, KV_EVICT)
    v_cur = _x_tile(V, ph0, lo + offs_n, hi, in_page, d, d_ok, nb, hk, hkv, BS, D, BLOCK_N,
                    OFF32, KV_EVICT)
    n_bad = _bad_ids(ph0, lo + offs_n, hi, nb, n_bad)
    k_next = _x_tile(K, ph1, lo + BLOCK_N + offs_n, hi, in_page, d, d_ok, nb, hk, hkv, BS, D,
                     BLOCK_N, OFF32, KV_EVICT)
    n_bad = _bad_ids(ph1, lo + BLOCK_N + offs_n, hi, nb, n_bad)
    j2 = lo + 2 * BLOCK_N + offs_n
    ph2 = tl.load(tab + j2 // BS, mask=j2 < hi, other=0)
    seen_v = lane * 0 - 1
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        if EARLY_LAST:
            if start + BLOCK_N >= hi:
                seen_v = tl.atomic_add(cnt_ptr + lane * 0, 0, mask=lane == 0, sem="acquire",
                                       scope="gpu")
        k_next2 = _x_tile(K, ph2, j + 2 * BLOCK_N, hi, in_page, d, d_ok, nb, hk, hkv, BS, D,
                          BLOCK_N, OFF32, KV_EVICT)
        n_bad = _bad_ids(ph2, j + 2 * BLOCK_N, hi, nb, n_bad)
        j3 = j + 3 * BLOCK_N
        ph3 = tl.load(tab + j3 // BS, mask=j3 < hi, other=0)
        p, alpha, m_i, l_i = _attend_qk(q, k_cur, j, j < hi, a, scale, softcap, slope, m_i,
                                        l_i, HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, DOT_F32)
        v_next = _x_tile(V, ph1, j + BLOCK_N, hi, in_page, d, d_ok, nb, hk, hkv, BS, D,
                         BLOCK_N, OFF32, KV_EVICT)
        v = v_cur
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        k_cur = k_next
        k_next = k_next2
        v_cur = v_next
        ph1 = ph2
        ph2 = ph3
    return m_i, l_i, acc, n_bad, tl.max(tl.where(lane == 0, seen_v, -1), 0)
