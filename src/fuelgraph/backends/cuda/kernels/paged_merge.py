"""Merging the split-K partials of the paged decode kernel (`paged`): each split of a row wrote
an unnormalised float32 accumulator acc_s [D], its running max m_s (base 2) and sum l_s; the row
is o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s. The merge runs inside
the split kernel (the last arriving program of a (sequence, kv head, tile)) or, for the
benchmark, as a second launch."""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _merge_row(PO, PM, PL, O, row, n_split, n_live, bad, D: tl.constexpr, BLOCK_D: tl.constexpr,
               S_P2: tl.constexpr, S_CHUNK: tl.constexpr):
    """One output row from its first n_live splits' partials:
    o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, the accumulators S_CHUNK splits at a
    time (few registers: it runs inside the split kernel). Loads bypass L1 (.cg): the partials
    were written by other programs of the same launch."""
    s = tl.arange(0, S_P2)
    s_ok = s < n_live
    m = tl.load(PM + row * n_split + s, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(PL + row * n_split + s, mask=s_ok, other=0.0, cache_modifier=".cg")
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.sum(tl.where(s_ok, tl.exp2(m - mx), 0.0) * l, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    if S_CHUNK >= S_P2:      # one step: the three loads are independent, one round trip
        po = tl.load(PO + (row * n_split + s)[:, None] * D + d[None, :],
                     mask=s_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
        w = tl.where(s_ok, tl.exp2(m - mx), 0.0)
        out = tl.sum(w[:, None] * po, 0)
    else:
        out = tl.zeros([BLOCK_D], tl.float32)
        for c0 in range(0, n_live, S_CHUNK):
            sc = c0 + tl.arange(0, S_CHUNK)
            c_ok = sc < n_live
            m_c = tl.load(PM + row * n_split + sc, mask=c_ok, other=float("-inf"),
                          cache_modifier=".cg")
            w = tl.where(c_ok, tl.exp2(m_c - mx), 0.0)
            po = tl.load(PO + (row * n_split + sc)[:, None] * D + d[None, :],
                         mask=c_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
            out += tl.sum(w[:, None] * po, 0)
    out = out / tl.where(den > 0, den, 1.0)
    out = tl.where(bad, float("nan"), out)
    tl.store(O + row * D + d, out.to(O.dtype.element_ty), mask=d_ok)


@triton.jit
def _merge_group(PO, PM, PL, O, row0, n_rows, n_split, n_live, bad, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, ROWS: tl.constexpr, S_P2: tl.constexpr,
                 S_CHUNK: tl.constexpr):
    """Rows row0 .. row0 + n_rows - 1 (n_rows <= ROWS; decode: the query heads of one kv head,
    whose rows are consecutive) merged together: the maxima and sums as one [ROWS, S_P2] tile,
    the accumulators [ROWS, S_CHUNK, D] at a time in an unrolled loop, so every load is
    independent of the others (one round trip for the group instead of one per row)."""
    rr = tl.arange(0, ROWS)
    r_ok = rr < n_rows
    rows = row0 + rr
    s = tl.arange(0, S_P2)
    ok = r_ok[:, None] & (s < n_live)[None, :]
    idx = rows[:, None] * n_split + s[None, :]
    m = tl.load(PM + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(PL + idx, mask=ok, other=0.0, cache_modifier=".cg")
    mx = tl.max(m, 1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.sum(tl.where(ok, tl.exp2(m - mx[:, None]), 0.0) * l, 1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    out = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for c0 in tl.static_range(0, S_P2, S_CHUNK):
        sc = c0 + tl.arange(0, S_CHUNK)
        okc = r_ok[:, None] & (sc < n_live)[None, :]
        idc = rows[:, None] * n_split + sc[None, :]
        m_c = tl.load(PM + idc, mask=okc, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(okc, tl.exp2(m_c - mx[:, None]), 0.0)
        po = tl.load(PO + idc[:, :, None] * D + d[None, None, :],
                     mask=okc[:, :, None] & d_ok[None, None, :], other=0.0,
                     cache_modifier=".cg")
        out += tl.sum(w[:, :, None] * po, 1)
    out = out / tl.where(den > 0, den, 1.0)[:, None]
    out = tl.where(bad, float("nan"), out)
    tl.store(O + rows[:, None] * D + d[None, :], out.to(O.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _paged_merge_kernel(PO, PM, PL, CL, O, sq, hq, cap, keys_per_split, n_split,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, S_P2: tl.constexpr,
                        S_CHUNK: tl.constexpr):
    """The unfused merge (a second launch; kept for the benchmark sweep): one row per program."""
    row = tl.program_id(0).to(tl.int64)
    b = row // (hq * sq)
    ctx = tl.load(CL + b).to(tl.int64)
    n_live = (tl.maximum(tl.minimum(tl.maximum(ctx, 0), cap), 1) + keys_per_split - 1) \
        // keys_per_split
    bad = (ctx > cap) | ((ctx > 0) & (ctx < sq)) | (ctx < 0)
    _merge_row(PO, PM, PL, O, row, n_split, n_live, bad, D, BLOCK_D, S_P2, S_CHUNK)
