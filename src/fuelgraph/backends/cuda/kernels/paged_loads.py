"""The k/v loads of the paged decode kernel (`paged`) when it reads a key tile ahead into
registers (launch knob kv_ahead), and the attention step of a key tile. Plain loads, which
keep their L2 eviction policy: Triton 3.6's asynchronous copies into shared memory drop it
(cp.async and TMA loads alike, Gluon's too: the PTX carries no L2 cache hint), and after a
flush that leaves dirty lines in the L2, evict_first reads spare most of their write-back."""
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
def _online_softmax(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
                    LAZY_SUM: tl.constexpr = False):
    """One online-softmax step: (max, sum, accumulator) after the key tile of scores s and
    values v. LAZY_SUM: the sum is kept per (row, key slot), l_i [BLOCK_M, BLOCK_N], and summed
    over the slots after the loop (no cross-warp sum each step)."""
    if LAZY_SUM:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha[:, None] + p
    else:
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
