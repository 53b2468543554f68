"""Chunked prefill of paged attention (`paged`: Sq >= PREFILL_MIN_SQ), FlashAttention-2 style:
one program per (query positions, G_T query heads of one kv head's group), autotuned tiles; the
key tiles wholly below the bottom-right causal diagonal run with no mask code, page-aligned
(block ids read a tile ahead, in-page offsets loop-invariant: close to the dense kernel's
instruction count), the diagonal ones gathered row by row with the mask."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import _PRUNE_FWD, FWD_CONFIGS, _key_ranges, _scores
from .common import INTERPRET, next_pow2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)              # not triton.cdiv: a jit function, slow to call from the host


#: query heads of one group per prefill program (each gathered k/v tile serves them all)
PREFILL_GROUP_HEADS = 1
#: the prefill kernel walks its wholly admissible key tiles page by page (one block id per page,
#: read one tile ahead; in-page offsets loop-invariant) when BLOCK_N is a multiple of the block
PREFILL_PAGE_TILES = True
PREFILL_TUNE_KEYS = ["TUNE_Q", "TUNE_K", "BLOCK_D", "G", "G_T", "HAS_ALIBI", "HAS_CAP",
                     "IEEE"]


@triton.jit
def _prefill_tiles(acc, l_i, m_i, n_bad, q, K, V, tab, hk, hkv, nb, start, end, a_pos, L,
                   qk_scale, cap_val, slope, MASK: tl.constexpr, HAS_CAP: tl.constexpr,
                   HAS_ALIBI: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
                   IEEE: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Keys [start, end) of one sequence, BLOCK_N at a time, each tile gathered row by row from
    its pool blocks (tab: the sequence's block-table row). MASK: the elementwise length + causal
    mask (the diagonal tiles); without it the tiles are wholly admissible (no mask code)."""
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + offs_n
        if MASK:
            j_ok = j < end
            phys = tl.load(tab + j // BS, mask=j_ok, other=0).to(tl.int64)
            p_ok = (phys >= 0) & (phys < nb)
            n_bad += (j_ok & (p_ok == 0)).to(tl.int32)
        else:
            phys = tl.load(tab + j // BS).to(tl.int64)
            p_ok = (phys >= 0) & (phys < nb)
            n_bad += (p_ok == 0).to(tl.int32)
        phys = tl.where(p_ok, phys, 0)
        kv_off = ((phys * BS + j % BS) * hkv + hk)[:, None] * D + d[None, :]
        if MASK:
            k = tl.load(K + kv_off, mask=j_ok[:, None] & (d < D)[None, :], other=0.0)
        elif D == BLOCK_D:
            k = tl.load(K + kv_off)
        else:
            k = tl.load(K + kv_off, mask=(d < D)[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s, _t = _scores(qk, a_pos, j[None, :], L, qk_scale, cap_val, slope, 0, 0, MASK, True,
                        False, False, HAS_CAP, HAS_ALIBI, IEEE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if MASK:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK:
            v = tl.load(V + kv_off, mask=j_ok[:, None] & (d < D)[None, :], other=0.0)
        elif D == BLOCK_D:
            v = tl.load(V + kv_off)
        else:
            v = tl.load(V + kv_off, mask=(d < D)[None, :], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i, n_bad


@triton.jit
def _prefill_pages(acc, l_i, m_i, n_bad, q, K, V, tab, hk, hkv, nb, start, end, a_pos, L,
                   qk_scale, cap_val, slope, HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
                   BS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, OFF32: tl.constexpr):
    """The wholly admissible key tiles [start, end) (multiples of BLOCK_N, BLOCK_N a multiple of
    BS) page by page: one block id per page, read one tile ahead, so the k/v loads depend on no
    load of their own iteration (the compiler pipelines them num_stages - 1 deep) and a key's
    address is its page's offset plus a loop-invariant in-page offset."""
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    in_page = (((offs_n % BS) * hkv + hk) * D)[:, None] + d[None, :]      # int32, fixed
    pg_of = offs_n // BS
    pg_next = tl.load(tab + start // BS + pg_of, mask=start < end, other=0)
    for j0 in range(start, end, BLOCK_N):
        pg = pg_next
        pg_next = tl.load(tab + (j0 + BLOCK_N) // BS + pg_of, mask=j0 + BLOCK_N < end, other=0)
        ok = pg.to(tl.uint32, bitcast=True) < tl.cast(nb, tl.uint32)     # 0 <= id < nb
        n_bad += (ok == 0).to(tl.int32)
        if OFF32:                # the pool's element offsets fit int32: cheaper addresses
            row = tl.where(ok, pg, 0) * (BS * hkv * D)
        else:
            row = tl.where(ok, pg, 0).to(tl.int64) * (BS * hkv * D)
        kv_off = row[:, None] + in_page
        if D == BLOCK_D:
            k = tl.load(K + kv_off)
        else:
            k = tl.load(K + kv_off, mask=(d < D)[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        j = j0 + offs_n
        s, _t = _scores(qk, a_pos, j[None, :], L, qk_scale, cap_val, slope, 0, 0, False, True,
                        False, False, HAS_CAP, HAS_ALIBI, IEEE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if D == BLOCK_D:
            v = tl.load(V + kv_off)
        else:
            v = tl.load(V + kv_off, mask=(d < D)[None, :], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i, n_bad


@triton.jit
def _paged_prefill_kernel(
        Q, K, V, BT, CL, SL, O, sq, hq, hkv, mb, nb, qk_scale, cap_val, sl_stride_b,
        TUNE_Q, TUNE_K, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_ALIBI: tl.constexpr, HAS_CAP: tl.constexpr, IEEE: tl.constexpr,
        DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, G_T: tl.constexpr,
        PAGE_TILES: tl.constexpr, OFF32: tl.constexpr):
    """Chunked prefill, FlashAttention-2 style: one program per (BLOCK_M // G_T query
    positions, G_T query heads of one kv head's group; row r = position r // G_T, head r % G_T),
    so each gathered k/v tile serves G_T heads; keys in three ranges (masked / wholly admissible
    / masked diagonal) as the dense flash_attn kernel, each key tile gathered through the block
    table."""
    SQ_T: tl.constexpr = BLOCK_M // G_T
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)    # the longest rows first
    bh = tl.program_id(1)                    # (sequence, group of G_T query heads)
    b = bh // (hq // G_T)
    h0 = (bh % (hq // G_T)) * G_T
    hk = h0 // G
    ctx64 = tl.load(CL + b).to(tl.int64)
    cap = mb * BS
    L = tl.minimum(tl.maximum(ctx64, 0), cap).to(tl.int32)
    bad = (ctx64 > cap) | ((ctx64 > 0) & (ctx64 < sq)) | (ctx64 < 0)
    off = L - sq
    m0 = pid_m * SQ_T
    r = tl.arange(0, BLOCK_M)
    if G_T == 1:
        offs_m = m0 + r
        h = h0
    else:
        offs_m = m0 + r // G_T
        h = h0 + r % G_T
    d = tl.arange(0, BLOCK_D)
    row = (b * hq + h).to(tl.int64) * sq + offs_m
    io_mask = (offs_m < sq)[:, None] & (d < D)[None, :]
    q = tl.load(Q + row[:, None] * D + d[None, :], mask=io_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    slope = 0.0
    if HAS_ALIBI:
        if G_T == 1:
            slope = tl.load(SL + b * sl_stride_b + h).to(tl.float32)
        else:
            slope = tl.load(SL + b * sl_stride_b + h).to(tl.float32)[:, None]
    a_pos = (offs_m + off)[:, None]
    lo, lo_end, mid_lo, mid_hi, hi = _key_ranges(m0 + off, m0 + SQ_T - 1 + off, L, 0, 0,
                                                 BLOCK_N, True, False, False)
    tab = BT + b.to(tl.int64) * mb
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_bad = tl.zeros([BLOCK_N], tl.int32)
    acc, l_i, m_i, n_bad = _prefill_tiles(
        acc, l_i, m_i, n_bad, q, K, V, tab, hk, hkv, nb, lo, lo_end, a_pos, L, qk_scale,
        cap_val, slope, True, HAS_CAP, HAS_ALIBI, DOT_PREC, DOT_F32, IEEE, BS, D, BLOCK_D, BLOCK_N)
    if PAGE_TILES and BLOCK_N % BS == 0:
        acc, l_i, m_i, n_bad = _prefill_pages(
            acc, l_i, m_i, n_bad, q, K, V, tab, hk, hkv, nb, mid_lo, mid_hi, a_pos, L, qk_scale,
            cap_val, slope, HAS_CAP, HAS_ALIBI, DOT_PREC, DOT_F32, IEEE, BS, D, BLOCK_D, BLOCK_N,
            OFF32)
    else:
        acc, l_i, m_i, n_bad = _prefill_tiles(
            acc, l_i, m_i, n_bad, q, K, V, tab, hk, hkv, nb, mid_lo, mid_hi, a_pos, L, qk_scale,
            cap_val, slope, False, HAS_CAP, HAS_ALIBI, DOT_PREC, DOT_F32, IEEE, BS, D, BLOCK_D,
            BLOCK_N)
    acc, l_i, m_i, n_bad = _prefill_tiles(
        acc, l_i, m_i, n_bad, q, K, V, tab, hk, hkv, nb, mid_hi, hi, a_pos, L, qk_scale,
        cap_val, slope, True, HAS_CAP, HAS_ALIBI, DOT_PREC, DOT_F32, IEEE, BS, D, BLOCK_D, BLOCK_N)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out = tl.where(bad | (tl.sum(n_bad, 0) > 0), float("nan"), out)
    tl.store(O + row[:, None] * D + d[None, :], out.to(O.dtype.element_ty), mask=io_mask)


_paged_prefill_tuned = triton.autotune(configs=FWD_CONFIGS, key=PREFILL_TUNE_KEYS,
                                       prune_configs_by=_PRUNE_FWD)(_paged_prefill_kernel)


def _group_heads(g, want):
    """Query heads per prefill program: the largest power of two <= want dividing the group."""
    g_t = 1
    while g_t * 2 <= max(1, int(want)) and g % (g_t * 2) == 0:
        g_t *= 2
    return g_t


def _configure_prefill(q, k_cache, block_table, sl_stride_b, softmax_scale, softcap, has_alibi,
                       dot_prec, dot_f32, block_d, block_m, block_n, num_warps, num_stages,
                       group_heads=None, page_tiles=None, off32=True):
    B, hq, sq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    mb = block_table.shape[1]
    has_cap = softcap is not None
    qk_scale = float(softmax_scale) / float(softcap) if has_cap else float(softmax_scale)
    scal = (sq, hq, hkv, mb, nb, qk_scale, float(softcap) if has_cap else 1.0, sl_stride_b,
            next_pow2(sq), next_pow2(mb * bs))
    g = hq // hkv
    g_t = _group_heads(g, PREFILL_GROUP_HEADS if group_heads is None else group_heads)
    kw = dict(G=g, BS=bs, D=d, BLOCK_D=block_d, HAS_ALIBI=has_alibi, HAS_CAP=has_cap,
              IEEE=q.dtype == torch.float32, DOT_PREC=dot_prec, DOT_F32=dot_f32, G_T=g_t,
              PAGE_TILES=PREFILL_PAGE_TILES if page_tiles is None else bool(page_tiles),
              OFF32=off32)
    if block_m is None and block_n is None and num_warps is None and num_stages is None:
        kernel_ = _paged_prefill_tuned[
            lambda meta: (_cdiv(sq, max(1, meta["BLOCK_M"] // g_t)), B * hq // g_t)]
    else:
        bm, bn = block_m or (16 if INTERPRET else 128), block_n or (16 if INTERPRET else 64)
        bm = max(bm, g_t)
        kw.update(BLOCK_M=bm, BLOCK_N=bn, num_warps=num_warps or (1 if INTERPRET else 8),
                  num_stages=num_stages or (1 if INTERPRET else 3))
        kernel_ = _paged_prefill_kernel[(_cdiv(sq, bm // g_t), B * hq // g_t)]

    def launch(q, kc, vc, bt, cl, sl, out):
        kernel_(q, kc, vc, bt, cl, sl, out, *scal, **kw)
    return launch
