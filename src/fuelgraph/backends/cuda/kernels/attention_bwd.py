"""FLASH_ATTN_BACKWARD's Triton kernels (attention.py launches them): one program per key
block accumulates dk and dv over the query heads of its key/value head (no atomics, no k/v
copies for grouped-query attention), one per query block accumulates dq; both recompute the
probabilities from the forward's saved log-sum-exp. Masks, ranges and configs are shared
with the forward (attention.py's module docstring)."""
from __future__ import annotations

import triton
import triton.language as tl

from .attention import (BWD_KV_CONFIGS, BWD_Q_CONFIGS, _PRUNE_KV, _PRUNE_Q, _TUNE_KEYS,
                        _key_ranges, _live_len, _load, _scores)


# ---- backward: dk, dv per key block -------------------------------------------------------------
@triton.jit
def _query_ranges(n0, off, SQ, WL, WR, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """Query ranges seeing keys n0..n0+BLOCK_N-1 (all < L): [lo, mid_lo) masked,
    [mid_lo, mid_hi) wholly admissible, [mid_hi, hi) masked."""
    n_last = n0 + BLOCK_N - 1
    lo = 0
    full_lo = 0
    if CAUSAL:
        lo = tl.maximum(lo, n0 - off)
        full_lo = tl.maximum(full_lo, n_last - off)
    if HAS_WR:
        lo = tl.maximum(lo, n0 - off - WR)
        full_lo = tl.maximum(full_lo, n_last - off - WR)
    lo = (lo // BLOCK_M) * BLOCK_M
    full_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    hi = SQ
    full_hi = tl.cdiv(SQ, BLOCK_M) * BLOCK_M      # padded rows read lse = +inf: no mask needed
    if HAS_WL:
        hi = tl.minimum(hi, n_last + WL - off + 1)
        full_hi = tl.minimum(full_hi, ((tl.maximum(n0 + WL - off + 1, 0)) // BLOCK_M) * BLOCK_M)
    hi = tl.maximum(hi, 0)
    full_hi = tl.maximum(full_hi, 0)
    mid_lo = tl.maximum(full_lo, lo)
    mid_hi = tl.maximum(tl.minimum(full_hi, hi), mid_lo)
    return lo, tl.minimum(mid_lo, hi), mid_lo, mid_hi, hi


@triton.jit
def _bwd_kv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, sqm, sdom, start, end,
                  k_pos, offs_m, SQ, L, QK_SCALE, CAP, slope, WL, WR, off,
                  MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WL: tl.constexpr,
                  HAS_WR: tl.constexpr, HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  IEEE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    for m0 in range(start, end, BLOCK_M):
        qm = m0 + offs_m
        rmask = qm < SQ
        q = _load(q_ptrs + m0 * sqm, rmask, HEAD_DIM, BLOCK_D, True)
        do = _load(do_ptrs + m0 * sdom, rmask, HEAD_DIM, BLOCK_D, True)
        lse = tl.load(lse_ptr + qm, mask=rmask, other=float("inf")) * 1.4426950408889634
        if IEEE:
            qkT = tl.dot(k, tl.trans(q), input_precision="ieee")
        else:
            qkT = tl.dot(k, tl.trans(q))
        sT, tT = _scores(qkT, (qm + off)[None, :], k_pos, L, QK_SCALE, CAP, slope, WL, WR, MASK,
                         CAUSAL, HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI, IEEE)
        pT = tl.exp2(sT - lse[None, :])
        delta = tl.load(delta_ptr + qm, mask=rmask, other=0.0)
        if IEEE:
            dv = tl.dot(pT, do, dv, input_precision="ieee")
            dpT = tl.dot(v, tl.trans(do), input_precision="ieee")
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv)
            dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        if HAS_CAP:
            dsT = dsT * (1.0 - tT * tT)
        if IEEE:
            dk = tl.dot(dsT, q, dk, input_precision="ieee")
        else:
            dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.autotune(configs=BWD_KV_CONFIGS, key=_TUNE_KEYS, prune_configs_by=_PRUNE_KV)
@triton.jit
def _bwd_kv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, SLOPES, KLEN, sqb, sqh, sqm, skb, skh, skn,
                   svb, svh, svn, sdob, sdoh, sdom, sdkb, sdkh, sdkn, slb, H, G, SQ, SK,
                   KLEN_STATIC, QK_SCALE, CAP, DK_SCALE, WL, WR, TUNE_Q, TUNE_K,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WL: tl.constexpr,
                   HAS_WR: tl.constexpr, HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   DYN_KLEN: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    HK = H // G
    b = (bhk // HK).to(tl.int64)
    hk = (bhk % HK).to(tl.int64)
    L, bad = _live_len(KLEN, KLEN_STATIC, SK, DYN_KLEN)
    off = L - SQ
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d[None, :] < HEAD_DIM
    k = _load(K + b * skb + hk * skh + offs_n[:, None].to(tl.int64) * skn + offs_d[None, :],
              offs_n < L, HEAD_DIM, BLOCK_D, True)
    v = _load(V + b * svb + hk * svh + offs_n[:, None].to(tl.int64) * svn + offs_d[None, :],
              offs_n < L, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    k_pos = offs_n[:, None]
    if n0 < L:
        lo, lo_end, mid_lo, mid_hi, hi = _query_ranges(n0, off, SQ, WL, WR, BLOCK_M, BLOCK_N,
                                                       CAUSAL, HAS_WL, HAS_WR)
        if n0 + BLOCK_N > L:          # the block holds dead keys: mask every tile
            lo_end = hi
            mid_lo = hi
            mid_hi = hi
        for g in range(0, G):
            h = hk * G + g
            bh = b * H + h
            slope = 0.0
            if HAS_ALIBI:
                slope = tl.load(SLOPES + b * slb + h)
            q_ptrs = Q + b * sqb + h * sqh + offs_m[:, None].to(tl.int64) * sqm + offs_d[None, :]
            do_ptrs = (DO + b * sdob + h * sdoh + offs_m[:, None].to(tl.int64) * sdom
                       + offs_d[None, :])
            lse_ptr = LSE + bh * SQ
            delta_ptr = DELTA + bh * SQ
            dk, dv = _bwd_kv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, sqm, sdom,
                                   lo, lo_end, k_pos, offs_m, SQ, L, QK_SCALE, CAP, slope,
                                   WL, WR, off, True, CAUSAL, HAS_WL, HAS_WR, HAS_CAP,
                                   HAS_ALIBI, IEEE, HEAD_DIM, BLOCK_D, BLOCK_M)
            dk, dv = _bwd_kv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, sqm, sdom,
                                   mid_lo, mid_hi, k_pos, offs_m, SQ, L, QK_SCALE, CAP,
                                   slope, WL, WR, off, False, CAUSAL, HAS_WL, HAS_WR, HAS_CAP,
                                   HAS_ALIBI, IEEE, HEAD_DIM, BLOCK_D, BLOCK_M)
            dk, dv = _bwd_kv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, sqm, sdom,
                                   mid_hi, hi, k_pos, offs_m, SQ, L, QK_SCALE, CAP, slope,
                                   WL, WR, off, True, CAUSAL, HAS_WL, HAS_WR, HAS_CAP,
                                   HAS_ALIBI, IEEE, HEAD_DIM, BLOCK_D, BLOCK_M)
    smask = (offs_n[:, None] < SK) & dmask
    base = b * sdkb + hk * sdkh + offs_n[:, None].to(tl.int64) * sdkn + offs_d[None, :]
    dk = dk * DK_SCALE
    if DYN_KLEN:
        dk = tl.where(bad, float("nan"), dk)
        dv = tl.where(bad, float("nan"), dv)
    tl.store(DK + base, dk.to(DK.dtype.element_ty), mask=smask)
    tl.store(DV + base, dv.to(DV.dtype.element_ty), mask=smask)


# ---- backward: dq per query block ---------------------------------------------------------------
@triton.jit
def _bwd_q_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, skn, svn, start, end, a_pos, offs_n,
                 L, QK_SCALE, CAP, slope, WL, WR, MASK: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
                 HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    for j0 in range(start, end, BLOCK_N):
        kn = j0 + offs_n
        k = _load(k_ptrs + j0 * skn, kn < L, HEAD_DIM, BLOCK_D, MASK)
        v = _load(v_ptrs + j0 * svn, kn < L, HEAD_DIM, BLOCK_D, MASK)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, tl.trans(v))
        s, t = _scores(qk, a_pos, kn[None, :], L, QK_SCALE, CAP, slope, WL, WR, MASK, CAUSAL,
                       HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI, IEEE)
        p = tl.exp2(s - lse[:, None])
        ds = p * (dp - delta[:, None])
        if HAS_CAP:
            ds = ds * (1.0 - t * t)
        if IEEE:
            dq = tl.dot(ds, k, dq, input_precision="ieee")
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.autotune(configs=BWD_Q_CONFIGS, key=_TUNE_KEYS, prune_configs_by=_PRUNE_Q)
@triton.jit
def _bwd_q_kernel(Q, K, V, DO, LSE, DELTA, DQ, SLOPES, KLEN, sqb, sqh, sqm, skb, skh, skn,
                  svb, svh, svn, sdob, sdoh, sdom, sdqb, sdqh, sdqm, slb, H, G, SQ, SK,
                  KLEN_STATIC, QK_SCALE, CAP, DQ_SCALE, WL, WR, TUNE_Q, TUNE_K,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WL: tl.constexpr,
                  HAS_WR: tl.constexpr, HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  DYN_KLEN: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:     # the longest rows of a causal mask first: a shorter tail at the grid's end
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // G
    L, bad = _live_len(KLEN, KLEN_STATIC, SK, DYN_KLEN)
    off = L - SQ
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d[None, :] < HEAD_DIM
    rmask = offs_m < SQ
    qmask = rmask[:, None] & dmask
    rows = offs_m[:, None].to(tl.int64)
    q = _load(Q + b * sqb + h * sqh + rows * sqm + offs_d[None, :], rmask, HEAD_DIM, BLOCK_D, True)
    do = _load(DO + b * sdob + h * sdoh + rows * sdom + offs_d[None, :], rmask, HEAD_DIM, BLOCK_D,
               True)
    lse = tl.load(LSE + bh.to(tl.int64) * SQ + offs_m, mask=rmask, other=float("inf"))
    lse = lse * 1.4426950408889634
    delta = tl.load(DELTA + bh.to(tl.int64) * SQ + offs_m, mask=rmask, other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + b * slb + h)
    k_ptrs = K + b * skb + hk * skh + offs_n[:, None].to(tl.int64) * skn + offs_d[None, :]
    v_ptrs = V + b * svb + hk * svh + offs_n[:, None].to(tl.int64) * svn + offs_d[None, :]
    a_pos = (offs_m + off)[:, None]
    lo, lo_end, mid_lo, mid_hi, hi = _key_ranges(m0 + off, m0 + BLOCK_M - 1 + off, L, WL, WR,
                                                 BLOCK_N, CAUSAL, HAS_WL, HAS_WR)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _bwd_q_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, skn, svn, lo, lo_end, a_pos, offs_n,
                      L, QK_SCALE, CAP, slope, WL, WR, True, CAUSAL, HAS_WL, HAS_WR,
                      HAS_CAP, HAS_ALIBI, IEEE, HEAD_DIM, BLOCK_D, BLOCK_N)
    dq = _bwd_q_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, skn, svn, mid_lo, mid_hi, a_pos,
                      offs_n, L, QK_SCALE, CAP, slope, WL, WR, False, CAUSAL, HAS_WL,
                      HAS_WR, HAS_CAP, HAS_ALIBI, IEEE, HEAD_DIM, BLOCK_D, BLOCK_N)
    dq = _bwd_q_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, skn, svn, mid_hi, hi, a_pos, offs_n,
                      L, QK_SCALE, CAP, slope, WL, WR, True, CAUSAL, HAS_WL, HAS_WR,
                      HAS_CAP, HAS_ALIBI, IEEE, HEAD_DIM, BLOCK_D, BLOCK_N)
    dq = dq * DQ_SCALE
    if DYN_KLEN:
        dq = tl.where(bad, float("nan"), dq)
    tl.store(DQ + b * sdqb + h * sdqh + rows * sdqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=qmask)
