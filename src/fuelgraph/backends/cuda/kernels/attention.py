"""FLASH_ATTN (12) and FLASH_ATTN_BACKWARD (0x111: dq, dk and dv; FLASH_ATTN_BACKWARD_Q/K/V
lower to it) as Triton kernels in the FlashAttention-2 style.

Forward: one program per (query block, batch x query head); it streams the key/value blocks
its rows can see, keeps an online softmax in registers (base-2 exponent: scores are
pre-multiplied by log2(e)) and writes the output and the row log-sum-exp. Backward: the saved
log-sum-exp lets every tile recompute its probabilities; one kernel per key block accumulates
dk and dv over the query heads of its key/value head (no atomics, no k/v copies for
grouped-query attention) and a second kernel per query block accumulates dq (attention_bwd.py).

Masks: a query row i sits at key position a_i = i + L - Sq (L = k_len or Sk). Every
constraint (causal, window left/right, keys < L) is an interval of keys, so the key blocks of
a query block form at most three ranges: masked blocks at the band's far edge, wholly
admissible blocks (the plain path: no mask arithmetic at all) and masked blocks at its near
edge (the diagonal). The forward runs the admissible range first, then both masked ranges in
one loop (one pipeline ramp for the two edges of a sliding window); a causal window at least
twice the widest tile runs all three in one loop, the edges' masks behind a branch
(_fwd_one_loop). Blocks wholly outside the band are never visited.
Causal / windows / softcap / ALiBi / run-time k_len are compile-time flags: a kernel without
them carries none of their code. A causal 16-bit forward (no right window, a static k_len)
runs as a warp-specialized kernel instead (attention_ws.py: a TMA producer warpgroup feeding
two consumer warpgroups).

Numerics: products accumulate in float32 (`ieee` precision for float32 inputs, not TF32);
probabilities are rounded to the input dtype before the P V / P^T dO products and dS before
dS K / dS^T Q, as FlashAttention does. float64 has no kernel (the planner lowers it to the
recipe). A run-time k_len outside [0, Sk] cannot raise on the device without a host sync: the
outputs become NaN (set FUELGRAPH_CHECK_K_LEN=1 to check on the host and raise instead).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ....errors import fail
from ....registry.attention import FLASH_ATTN_BACKWARD
from ....registry.core import FusedOps
from ...base import Cost, kernel
from .common import HALF_AND_F32, INTERPRET, next_pow2

__all__ = ["flash_attn", "flash_attn_backward", "supports"]

CHECK_K_LEN = os.environ.get("FUELGRAPH_CHECK_K_LEN", "0") == "1"
MAX_HEAD_DIM = 256


# ---- configs ----------------------------------------------------------------------------------
#: autotune over the configs below on the first call per (shape class, flags); False: take the
#: first config that fits (no benchmarking; tests switch tuning off to keep compiles few)
TUNE = os.environ.get("FUELGRAPH_ATTN_TUNE", "1") == "1"


def _configs(choices):
    """(BLOCK_M, BLOCK_N, warps, stages) choices, best guess first. Each is one compile per
    flag set, so the lists are short: FlashAttention-2 tiles for Hopper (128-row query tiles
    forward, 32/64-row query tiles against 128 keys for dk/dv, 128 x 32/64 for dq)."""
    if INTERPRET:      # the CPU interpreter: one small tile, no tuning
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
            for m, n, w, st in choices]


#: shared-memory budget a config may plan for (H100/H200 allow 227 KiB per block; the margin
#: covers layout padding and the compiler's own buffers)
SMEM_BUDGET = 160 * 1024
_SMALLEST = (64, 32, 4, 2)


def _prune_for(resident_rows, staged_rows):
    """early_config_prune for a kernel keeping `resident_rows(BM, BN)` rows of head-dim tiles
    in shared memory and streaming `staged_rows(BM, BN)` rows per pipeline stage."""
    def prune(configs, named_args, **kw):
        args = {**named_args, **kw}
        item = 4 if args.get("IEEE", False) else 2
        d = args.get("BLOCK_D", 128)

        def smem(c):
            m, n, st = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages
            return (resident_rows(m, n) + st * staged_rows(m, n)) * d * item
        out = [c for c in configs if smem(c) <= SMEM_BUDGET]
        if not out:
            m, n, w, st = _SMALLEST
            out = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)]
        return out if TUNE else out[:1]
    return {"early_config_prune": prune}


_PRUNE_FWD = _prune_for(lambda m, n: m, lambda m, n: 2 * n)       # q; k, v per stage
_PRUNE_KV = _prune_for(lambda m, n: 2 * n, lambda m, n: 2 * m)    # k, v; q, dO per stage
_PRUNE_Q = _prune_for(lambda m, n: 2 * m, lambda m, n: 2 * n)     # q, dO; k, v per stage
_TUNE_KEYS = ["TUNE_Q", "TUNE_K", "BLOCK_D", "CAUSAL", "HAS_WL", "HAS_WR", "HAS_CAP",
              "HAS_ALIBI", "DYN_KLEN", "IEEE", "ALIBI_COLS", "FMA", "EDGE1", "ASM", "ONE_LOOP"]


def fwd_config(m, n, warps, stages):
    """A forward launch config (BLOCK_M, BLOCK_N, warps, stages)."""
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)


FWD_CONFIGS = _configs([(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3),
                        (128, 128, 8, 2), (128, 64, 8, 4)])
BWD_KV_CONFIGS = _configs([(64, 128, 8, 3), (32, 128, 4, 4), (64, 64, 4, 3)])
BWD_Q_CONFIGS = _configs([(128, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3)])


#: forward code variants, compile-time (the benchmark's --sweep flips them): ALIBI_COLS --
#: causal ALiBi on 16-bit inputs as a per-key bias (slope * key position; the per-row part of
#: -slope * (row - key) cancels in the softmax and is put back into the lse): one fused
#: multiply-add per score instead of a subtract, abs, convert and multiply-add (sm_90 SASS of
#: the loop: 554 instead of 650 instructions a thread). A float32 (ieee) kernel keeps the exact
#: form: the large per-key terms would cost it digits.
#: FMA_SCORES -- without ALiBi, exp2's argument as one fused multiply-add of the raw product
#: (or tanh) and the row max (the max taken before the multiply): sm_90 SASS of the loop
#: loses a multiply a score. FUELGRAPH_ATTN_VARIANTS="FMA_SCORES=0,ALIBI_COLS=0" overrides.
#: Measured on the H200 (B4 H32 S4096 D128 bf16 causal): FMA_SCORES 427 vs 409 TFLOP/s, ALiBi
#: 395 vs 374 with ALIBI_COLS. Tried and dropped: the unmasked blocks' k/v through TMA tensor
#: descriptors (401), all blocks in one loop with the mask behind a run-time branch (421).
#: Tried in session 5 (H200, same case; plain causal / window 1024 TFLOP/s, against 433 / 354
#: in the same run): tiles dealt in groups of 8 or 16 heads, longest causal rows first across
#: the group (435 / 356 and 428 / 351: noise); a persistent grid (one program an SM striding
#: over the tiles: 404 / 341; with 64-row tiles, two an SM: 362 / 344); the accumulator
#: rescaled only when a row max grows by more than 2^8, behind a CTA-wide test a block (SASS
#: 332 -> ~300 instructions a block, but 384 / 313: the test's barriers cost more); Triton's
#: automatic warp specialization (tl.range warp_specialize): same SASS on sm_90.
#: MASK_ASM -- plain causal diagonal blocks test k <= a with one PTX setp + selp a score
#: (sm_90 SASS of the masked loop 491 -> 443 instructions). EDGE_ONE_TEST -- a causal window
#: at least twice the widest tile needs one test a score in each edge block (508 -> 467).
#: ONE_LOOP (plain causal, softcap, ALiBi) / ONE_LOOP_WINDOW (a causal left window as wide as
#: EDGE_ONE_TEST needs; the default) -- all key blocks in one pipelined loop (one pipeline ramp
#: a program instead of two), the edge blocks' one test behind a run-time branch; the earlier
#: one-loop try (421) had its mask if-converted into every block, here the mask is a non-pure
#: PTX compare + select, which keeps the branch (SASS: ~352 instructions an unmasked block
#: instead of 332, 168 registers instead of 203). H200, two interleaved repeats in one
#: process (B4 H32 S4096, 128 x 64 tiles): window 1024 355.6 / 353.5 TFLOP/s against 348.5 /
#: 342.8 with two loops (+2-3%; a third call 369 / 325, unstable, against 348 / 346);
#: plain causal 418 against 433 / 423, softcap and ALiBi 1-4% slower: so windows only.
#: MASK_ASM and EDGE_ONE_TEST in the two-loop kernel: plain causal 431 / 414, window 341 /
#: 340 -- no gain from their fewer instructions; off.
#: Tried in session 7 and dropped (H200, B4 H32 S4096, 128 x 64 tiles; plain causal / window
#: 1024 TFLOP/s against 427-436 / 351 in the same runs): p v issued one block late, after the
#: next block's q k^T, so that it runs during that block's exponentials (Triton keeps it in
#: flight; 332 -> 313 SASS instructions a block; a branch around that loop made ptxas
#: serialize every wgmma): 409 / 323, with the edge blocks in the same lagged pipeline 394 /
#: 327 (not profiled; presumably the tile's two warpgroups already overlap one's softmax
#: with the other's products); 128 x 128 tiles in 3 stages (224 KiB of shared memory):
#: 421 / 327; 64 x 64 tiles on 4 warps, two programs an SM, lagged: 361 / 326.
#: WARP_SPEC (default) -- causal 16-bit inputs through the warp-specialized kernel
#: (attention_ws.py: a TMA producer warpgroup and two 64-row consumer warpgroups, 128 x 128
#: tiles, masks on every block). H200, B4 H32 S4096, two interleaved repeats in one process
#: against the Triton kernel above: plain causal 446.2 / 460.3 against 437.2 / 428.7 TFLOP/s,
#: window 1024 370.0 / 370.0 against 366.2 / 359.0; with 128 x 64 tiles 417 / 407 and 342 /
#: 340. Session 5's "same SASS on sm_90" try had pointer loads and 8 warps: the Hopper pass
#: needs 4 warps and tensor-descriptor loads (and one loop without branches inside).
#: WS_* -- the warp-specialized kernel's variants: their measurements are in attention_ws.py.
#: The plan gap measured last session (466 kernel vs 444 through a cached plan) was the order
#: of the measurements: interleaved, 437.7 / 420.9 / 433.3 kernel against 437.2 / 429.2 /
#: 433.4 plan (do_bench queues every call before it waits, so host work under ~1 ms a call
#: never shows); the first timed case of a process runs on a cooler GPU.
VARIANTS = {"ALIBI_COLS": True, "FMA_SCORES": True, "EDGE_ONE_TEST": False, "MASK_ASM": False,
            "ONE_LOOP": False, "ONE_LOOP_WINDOW": True, "WARP_SPEC": True,
            "WS_PERSIST": False, "WS_PERSIST_WINDOW": True, "WS_SKIP_MASK": True,
            "WS_SKIP_MASK_WINDOW": True, "WS_HEADS": 4, "WS_LAZY_RESCALE": True,
            "WS_ALIBI_HOIST": True, "WS_CAP_FIXED_REF": True, "WS_EDGE_BOUND": True,
            "WS_LEAN_TILE": True}
for _kv in filter(None, os.environ.get("FUELGRAPH_ATTN_VARIANTS", "").split(",")):
    _k, _v = _kv.split("=")
    VARIANTS[_k.strip()] = (int(_v) if isinstance(VARIANTS.get(_k.strip()), int)
                            and not isinstance(VARIANTS.get(_k.strip()), bool)
                            else _v.strip() not in ("0", "false", "False"))


# ---- shared device helpers ----------------------------------------------------------------------
_APPROX_TANH = tl.constexpr(not INTERPRET)   # the interpreter has no inline PTX


@triton.jit
def _tanh(x, IEEE: tl.constexpr):
    """tanh; for 16-bit inputs the hardware's one-instruction approximation (relative error
    about 2^-11, below a bfloat16/float16 ulp of the scores), which made softcap cost 1.5x the
    plain kernel with the exp-and-divide form."""
    if IEEE or not _APPROX_TANH:
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(x < 0, -t, t)
    else:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    return t


@triton.jit
def _live_len(KLEN, KLEN_STATIC, SK, DYN_KLEN: tl.constexpr):
    """(L, bad): the live key count (clamped into [0, SK]) and whether a run-time one was out
    of range."""
    if DYN_KLEN:
        raw = tl.load(KLEN).to(tl.int32)
        bad = (raw < 0) | (raw > SK)
        L = tl.minimum(tl.maximum(raw, 0), SK)
    else:
        L = KLEN_STATIC
        bad = L < 0
    return L, bad


@triton.jit
def _key_ranges(a_first, a_last, L, WL, WR, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_WL: tl.constexpr, HAS_WR: tl.constexpr):
    """Key ranges of a query block whose rows sit at positions a_first..a_last:
    [lo, mid_lo) masked, [mid_lo, mid_hi) wholly admissible, [mid_hi, hi) masked."""
    lo = 0
    full_lo = 0
    if HAS_WL:
        lo = tl.maximum(a_first - WL, 0)
        full_lo = tl.maximum(a_last - WL, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    hi = L
    full_hi = L
    if CAUSAL:
        hi = tl.minimum(hi, a_last + 1)
        full_hi = tl.minimum(full_hi, a_first + 1)
    if HAS_WR:
        hi = tl.minimum(hi, a_last + WR + 1)
        full_hi = tl.minimum(full_hi, a_first + WR + 1)
    hi = tl.maximum(hi, 0)
    full_hi = (tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N
    mid_lo = tl.maximum(full_lo, lo)
    mid_hi = tl.maximum(tl.minimum(full_hi, hi), mid_lo)
    return lo, tl.minimum(mid_lo, hi), mid_lo, mid_hi, hi


@triton.jit
def _scores(qk, a_pos, k_pos, L, QK_SCALE, CAP, slope, WL, WR, MASK: tl.constexpr,
            CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
            HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr,
            ALIBI_COLS: tl.constexpr = False, RAW: tl.constexpr = False,
            LIVE_ROWS: tl.constexpr = False, ASM: tl.constexpr = False):
    """Scores in log2 units from the raw product tile; a_pos / k_pos are the query and key
    positions broadcast to the tile's shape. Returns (scores, tanh or 0). ALIBI_COLS (causal
    only: every admissible key is <= its row) adds slope * key instead of -slope * (row - key):
    the scores are off by slope * row, a per-row constant the caller takes out of the lse.
    RAW (no ALiBi): the scores before their positive multiplier (QK_SCALE or CAP, times
    log2(e)), which the caller fuses into exp2's argument. LIVE_ROWS: see _mask."""
    if HAS_CAP:
        t = _tanh(qk * QK_SCALE, IEEE)
        s = t if RAW else t * (CAP * 1.4426950408889634)
    else:
        t = 0.0
        s = qk if RAW else qk * (QK_SCALE * 1.4426950408889634)
    if HAS_ALIBI:
        if ALIBI_COLS:
            s += (slope * 1.4426950408889634) * k_pos.to(tl.float32)
        else:
            s -= (slope * 1.4426950408889634) * tl.abs(a_pos - k_pos).to(tl.float32)
    if MASK:
        s = _mask(s, a_pos, k_pos, L, WL, WR, CAUSAL, HAS_WL, HAS_WR, LIVE_ROWS, ASM)
    return s, t


@triton.jit
def _keep_le(s, col, bound, ASM: tl.constexpr, PINNED: tl.constexpr = False):
    """s where col <= bound, else -inf (col, bound int32, broadcast to s). ASM: one compare
    and one select a score in inline PTX, which also keeps the compares after the product
    they mask (ptxas otherwise hoists them above the wgmma wait and packs 32 predicates into
    integers: ~25% more instructions in a masked block)."""
    if ASM and _APPROX_TANH:      # PINNED: not pure, so a branch around it stays a branch
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.le.s32 p, $2, $3; selp.f32 $0, $1, 0fFF800000, p; }",
            "=r,r,r,r", [s, col, bound], dtype=tl.float32, is_pure=not PINNED, pack=1)
    return tl.where(col <= bound, s, float("-inf"))


@triton.jit
def _mask(s, a_pos, k_pos, L, WL, WR, CAUSAL: tl.constexpr, HAS_WL: tl.constexpr,
          HAS_WR: tl.constexpr, LIVE_ROWS: tl.constexpr = False, ASM: tl.constexpr = False):
    """-inf outside the admissible keys. ASM with LIVE_ROWS and a plain causal mask: k <= a
    as one compare and one select in inline PTX (_keep_le; with a window, two of them
    measured more instructions than the two selects below, see EDGE1 instead). LIVE_ROWS
    (the forward, whose rows past Sq are never stored) with a causal left window: k <= a < L
    already keeps a real row's keys below L, and two selects in a row compile to fewer
    instructions than one select of the combined test (sm_90 SASS of the masked loop,
    128 x 64: 508 instead of 556; H200 window 1024: 354 instead of 346 TFLOP/s). A plain
    causal mask keeps the combined form without ASM: with a single compare a score written
    as a select, the compiler packs the predicates into integers (507 instead of 491)."""
    if ASM and LIVE_ROWS and CAUSAL and not HAS_WL and not HAS_WR:
        return _keep_le(s, k_pos, a_pos, True)     # 491 -> 443 a masked block (SASS)
    if LIVE_ROWS and CAUSAL and HAS_WL and not HAS_WR:
        s = tl.where(k_pos <= a_pos, s, float("-inf"))
        return tl.where(k_pos >= a_pos - WL, s, float("-inf"))
    adm = k_pos < L
    if CAUSAL:
        adm &= k_pos <= a_pos
    if HAS_WL:
        adm &= k_pos >= a_pos - WL
    if HAS_WR:
        adm &= k_pos <= a_pos + WR
    return tl.where(adm, s, float("-inf"))


@triton.jit
def _load(ptrs, rows_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """A [rows, BLOCK_D] tile; zeros in padded columns and (ROWS) in rows not rows_ok."""
    if ROWS:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=rows_ok[:, None] & (tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM),
                        other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM, other=0.0)
    return x


# ---- forward ------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, skn, svn, start, end, jump_at, jump, a_pos,
               offs_n, L, QK_SCALE, CAP, slope, WL, WR, MASK: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
               HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               ALIBI_COLS: tl.constexpr, FMA: tl.constexpr, EDGE1: tl.constexpr = False,
               ASM: tl.constexpr = False):
    """Key blocks j0 = start, start + BLOCK_N, ... < end; with MASK, blocks at or past
    jump_at move on by `jump` (one loop, hence one pipeline, over both masked edges of a
    band: [start, jump_at) and [jump_at + jump, end + jump)). EDGE1: see _fwd_softmax."""
    for j in range(start, end, BLOCK_N):
        j0 = j
        if MASK:
            j0 = j + tl.where(j >= jump_at, jump, 0)
        kn = j0 + offs_n
        k = _load(k_ptrs + j0 * skn, kn < L, HEAD_DIM, BLOCK_D, MASK)
        qk = _dot_qk(q, k, IEEE)
        p, alpha, l_i, m_i = _fwd_softmax(qk, l_i, m_i, kn, a_pos, L, QK_SCALE, CAP, slope, WL,
                                          WR, MASK, CAUSAL, HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI,
                                          IEEE, ALIBI_COLS, FMA, EDGE1, j < jump_at, ASM)
        v = _load(v_ptrs + j0 * svn, kn < L, HEAD_DIM, BLOCK_D, MASK)
        acc = _dot_pv(p, v, acc * alpha[:, None], IEEE)
    return acc, l_i, m_i


@triton.jit
def _dot_qk(q, k, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def _dot_pv(p, v, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(p, v, acc, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v, acc)


@triton.jit
def _fwd_softmax(qk, l_i, m_i, kn, a_pos, L, QK_SCALE, CAP, slope, WL, WR, MASK: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
                 HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr,
                 ALIBI_COLS: tl.constexpr, FMA: tl.constexpr, EDGE1: tl.constexpr = False,
                 far=False, ASM: tl.constexpr = False):
    """One key block's online-softmax step from its product tile qk (keys kn): (p, alpha,
    l_i, m_i) with the accumulator to be scaled by alpha before p v is added. EDGE1 (a causal
    left window at least twice the widest tile, live rows only): a block at the band's far
    edge (`far`) holds no key past any row's diagonal and a diagonal block none before any
    row's window, so each needs one test a score, k >= a - WL or k <= a, written as one
    compare of k against a, or of ~k against ~(a - WL)."""
    if EDGE1:
        s, t = _scores(qk, a_pos, kn[None, :], L, QK_SCALE, CAP, slope, WL, WR, False, CAUSAL,
                       HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI, IEEE, ALIBI_COLS, FMA, True)
        flip = tl.where(far, -1, 0)           # x ^ -1 = -x - 1: reverses the order
        s = _keep_le(s, (kn ^ flip)[None, :], (a_pos - tl.where(far, WL, 0)) ^ flip, True)
    else:
        s, t = _scores(qk, a_pos, kn[None, :], L, QK_SCALE, CAP, slope, WL, WR, MASK, CAUSAL,
                       HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI, IEEE, ALIBI_COLS, FMA, True, ASM)
    return _online(s, l_i, m_i, QK_SCALE, CAP, HAS_CAP, FMA, MASK)


@triton.jit
def _online(s, l_i, m_i, QK_SCALE, CAP, HAS_CAP: tl.constexpr, FMA: tl.constexpr,
            GUARD: tl.constexpr, LAZY: tl.constexpr = False, SHIFTED: tl.constexpr = False,
            shift=0.0):
    """The online-softmax update from scores s (raw with FMA): (p, alpha, l_i, m_i). GUARD:
    a row may still have no admissible key (masked blocks): shift it by 0, not -inf. LAZY:
    m_i, the reference the scores are shifted by, moves only when the row max passes it by
    more than 8 (log2 units): p stays <= 2^8 (exact in the 16-bit P V operand's range), and
    alpha is exactly 1 on the blocks that did not move it (their rescale can be skipped).
    SHIFTED (not FMA): the true scores are s + shift (a block-wide constant: attention_ws's
    hoisted ALiBi columns); m_i stays in true units."""
    if FMA:    # s is raw: max(s) * mult is the max of the scores (mult > 0)
        if HAS_CAP:
            mult = CAP * 1.4426950408889634
        else:
            mult = QK_SCALE * 1.4426950408889634
        m_new = tl.maximum(m_i, tl.max(s, 1) * mult)
    elif SHIFTED:
        m_new = tl.maximum(m_i, tl.max(s, 1) + shift)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if LAZY:
        m_new = tl.where(m_new > m_i + 8.0, m_new, m_i)
    m_use = m_new
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    if FMA:    # one fused multiply-add a score
        x = s * mult - m_use[:, None]
    elif SHIFTED:
        x = s - (m_use - shift)[:, None]
    else:
        x = s - m_use[:, None]
    p = tl.exp2(x)
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def _finish(acc, l_i, m_i, slope, a_rows, ALIBI_COLS: tl.constexpr,
            LEAN: tl.constexpr = False):
    """(out, lse) of a query tile from its online-softmax state (a_rows: the rows' key
    positions); rows without an admissible key: out 0, lse +inf. LEAN (not interpreted): a
    reciprocal a row and a multiply an output (not a full-range division each), the
    hardware's log2 (relative error ~2^-22)."""
    if ALIBI_COLS:    # the scores were off by +slope * row: so were m_i and the lse
        m_i -= (slope * 1.4426950408889634) * a_rows.to(tl.float32)
    live = l_i > 0.0
    l_safe = tl.where(live, l_i, 1.0)
    if LEAN:
        out = acc * (1.0 / l_safe)[:, None]
        lg = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [l_safe],
                                       dtype=tl.float32, is_pure=True, pack=1)
    else:
        out = acc / l_safe[:, None]
        lg = tl.log2(l_safe)
    lse = tl.where(live, (m_i + lg) * 0.6931471805599453, float("inf"))
    return out, lse


@triton.jit
def _fwd_one_loop(acc, l_i, m_i, q, k_ptrs, v_ptrs, skn, svn, start, far_end, diag, end, a_pos,
                  offs_n, L, QK_SCALE, CAP, slope, WL, WR, CAUSAL: tl.constexpr,
                  HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, ALIBI_COLS: tl.constexpr,
                  FMA: tl.constexpr):
    """ONE_LOOP (causal, no right window, a left window only as EDGE1 allows): blocks
    [start, end) in one loop (one pipeline ramp a program instead of two); blocks before
    `far_end` (a window's far edge) and from `diag` on take their one test a score behind a
    run-time branch, as a non-pure PTX compare + select (a pure one is if-converted into
    every block)."""
    for j in range(start, end, BLOCK_N):
        kn = j + offs_n
        k = _load(k_ptrs + j * skn, kn < L, HEAD_DIM, BLOCK_D, True)
        qk = _dot_qk(q, k, IEEE)
        s, t = _scores(qk, a_pos, kn[None, :], L, QK_SCALE, CAP, slope, WL, WR, False, CAUSAL,
                       HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI, IEEE, ALIBI_COLS, FMA, True)
        if HAS_WL:
            if (j < far_end) | (j >= diag):
                far = j < far_end
                flip = tl.where(far, -1, 0)
                s = _keep_le(s, (kn ^ flip)[None, :], (a_pos - tl.where(far, WL, 0)) ^ flip,
                             True, True)
        else:
            if j >= diag:
                s = _keep_le(s, kn[None, :], a_pos, True, True)
        p, alpha, l_i, m_i = _online(s, l_i, m_i, QK_SCALE, CAP, HAS_CAP, FMA, True)
        v = _load(v_ptrs + j * svn, kn < L, HEAD_DIM, BLOCK_D, True)
        acc = _dot_pv(p, v, acc * alpha[:, None], IEEE)
    return acc, l_i, m_i


@triton.autotune(configs=FWD_CONFIGS, key=_TUNE_KEYS, prune_configs_by=_PRUNE_FWD)
@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, SLOPES, KLEN, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                sob, soh, som, slb, H, G, SQ, SK, KLEN_STATIC, QK_SCALE, CAP, WL, WR,
                TUNE_Q, TUNE_K, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_CAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, DYN_KLEN: tl.constexpr, IEEE: tl.constexpr,
                ALIBI_COLS: tl.constexpr, FMA: tl.constexpr, EDGE1: tl.constexpr,
                ASM: tl.constexpr, ONE_LOOP: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:     # the longest rows of a causal mask first: a shorter tail at the grid's end
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // G).to(tl.int64)
    L, bad = _live_len(KLEN, KLEN_STATIC, SK, DYN_KLEN)
    off = L - SQ
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d[None, :] < HEAD_DIM
    q = _load(Q + b * sqb + h.to(tl.int64) * sqh + offs_m[:, None].to(tl.int64) * sqm
              + offs_d[None, :], offs_m < SQ, HEAD_DIM, BLOCK_D, True)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + b * slb + h)
    k_ptrs = K + b * skb + hk * skh + offs_n[:, None].to(tl.int64) * skn + offs_d[None, :]
    v_ptrs = V + b * svb + hk * svh + offs_n[:, None].to(tl.int64) * svn + offs_d[None, :]
    a_pos = (offs_m + off)[:, None]
    lo, lo_end, mid_lo, mid_hi, hi = _key_ranges(m0 + off, m0 + BLOCK_M - 1 + off, L, WL, WR,
                                                 BLOCK_N, CAUSAL, HAS_WL, HAS_WR)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # the wholly admissible blocks first (no mask code, the longest pipelined loop), then both
    # masked edges (a window's far edge and the diagonal) in one loop
    if ONE_LOOP:     # every block in one pipelined loop, the edges' masks behind a branch
        acc, l_i, m_i = _fwd_one_loop(acc, l_i, m_i, q, k_ptrs, v_ptrs, skn, svn, lo, lo_end,
                                      mid_hi, hi, a_pos, offs_n, L, QK_SCALE, CAP, slope, WL, WR,
                                      CAUSAL, HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI, IEEE, HEAD_DIM,
                                      BLOCK_D, BLOCK_N, ALIBI_COLS, FMA)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, skn, svn, mid_lo, mid_hi, 0,
                                   0, a_pos, offs_n, L, QK_SCALE, CAP, slope, WL, WR, False,
                                   CAUSAL, HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI, IEEE, HEAD_DIM,
                                   BLOCK_D, BLOCK_N, ALIBI_COLS, FMA)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, skn, svn, lo,
                                   lo_end + tl.maximum(hi - mid_hi, 0), lo_end, mid_hi - lo_end,
                                   a_pos, offs_n, L, QK_SCALE, CAP, slope, WL, WR, True, CAUSAL,
                                   HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI, IEEE, HEAD_DIM, BLOCK_D,
                                   BLOCK_N, ALIBI_COLS, FMA, EDGE1, ASM)
    out, lse = _finish(acc, l_i, m_i, slope, offs_m + off, ALIBI_COLS)
    if DYN_KLEN:
        out = tl.where(bad, float("nan"), out)
        lse = tl.where(bad, float("nan"), lse)
    rmask = offs_m < SQ
    tl.store(O + b * sob + h.to(tl.int64) * soh + offs_m[:, None].to(tl.int64) * som
             + offs_d[None, :], out.to(O.dtype.element_ty), mask=rmask[:, None] & dmask)
    tl.store(LSE + bh.to(tl.int64) * SQ + offs_m, lse, mask=rmask)


# ---- backward (attention_bwd.py: it imports the helpers above) -----------------------------------
from .attention_bwd import _bwd_kv_kernel, _bwd_q_kernel  # noqa: E402
from .attention_ws import _launch_ws, _warp_specialized  # noqa: E402


# ---- host side ----------------------------------------------------------------------------------
def supports(shapes, dtypes, params) -> bool:
    """Head dims up to 256 in float32 / bfloat16 / float16 (float64 lowers to the recipe)."""
    return 1 <= shapes[0][3] <= MAX_HEAD_DIM and all(d.name != "float64" for d in dtypes[:3])


def attention_cost(products):
    """`products` [Sq x L x D] matrix products (halved by a causal mask); 2-byte traffic."""
    def cost(shapes, params=None):
        (B, Hq, Sq, D), (_, Hkv, Sk, _) = shapes[0], shapes[1]
        L = Sk if params is None or params.k_len is None else params.k_len
        frac = 0.5 if params is not None and params.causal else 1.0
        flops = 2.0 * B * Hq * Sq * L * D * products * frac
        return Cost(flops, 2.0 * (B * Hq * Sq * D * (1 + products) + 2 * B * Hkv * Sk * D))
    return cost


def _widest_fwd_tile():
    """The largest BLOCK_M or BLOCK_N among the forward's configs (EDGE1 needs windows at
    least twice as wide)."""
    return max(max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in _fwd_kernel.configs)


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


_PLACEHOLDERS: dict = {}


def _placeholder(device, dtype):
    """A one-element zero tensor for a pointer argument the kernel never reads (no slopes, a
    static k_len), made once per device and dtype: a new one per call cost an allocation and
    a fill kernel each."""
    key = (device, dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = torch.zeros(1, device=device, dtype=dtype)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _PLACEHOLDERS[key] = t       # not memory of a graph's pool
    return t


class _Launch:
    """Strides, flags and scalars shared by the forward and backward launches."""

    def __init__(self, op, q, k, v, opt, p):
        self.q, self.k, self.v = (_last_dim_contiguous(t) for t in (q, k, v))
        B, H, SQ, D = q.shape
        self.B, self.H, self.SQ, self.D = B, H, SQ, D
        self.HK, self.SK = k.shape[1], k.shape[2]
        self.G = H // self.HK
        dev = q.device
        alibi = opt[0] if p["has_alibi"] else None
        if alibi is not None:
            alibi = alibi.to(device=dev, dtype=torch.float32).contiguous()
            self.slopes, self.slb = alibi, (H if alibi.dim() == 2 else 0)
        else:
            self.slopes, self.slb = _placeholder(dev, torch.float32), 0
        dyn = bool(p["k_len_input"])
        if dyn:
            klen = opt[-1].to(device=dev).reshape(1)
            if CHECK_K_LEN:
                val = int(klen.item())
                if not 0 <= val <= self.SK:
                    raise fail(op, f"k_len = {val} is outside [0, Sk = {self.SK}]")
            self.klen, self.klen_static = klen, self.SK
        else:
            self.klen = _placeholder(dev, torch.int32)
            self.klen_static = self.SK if p["k_len"] is None else int(p["k_len"])
        cap = p["softcap"]
        scale = float(p["softmax_scale"])
        self.scale = scale
        self.qk_scale = scale / cap if cap is not None else scale
        self.cap = float(cap) if cap is not None else 1.0
        wl, wr = p["window_size_left"], p["window_size_right"]
        self.wl, self.wr = (int(wl) if wl is not None else 0), (int(wr) if wr is not None else 0)
        self.flags = dict(HEAD_DIM=D, BLOCK_D=max(16, next_pow2(D)), CAUSAL=bool(p["causal"]),
                          HAS_WL=wl is not None, HAS_WR=wr is not None, HAS_CAP=cap is not None,
                          HAS_ALIBI=alibi is not None, DYN_KLEN=dyn,
                          IEEE=q.dtype == torch.float32)
        self.tune = dict(TUNE_Q=next_pow2(SQ), TUNE_K=next_pow2(self.SK))
        f = self.flags
        self.fwd_flags = dict(
            ALIBI_COLS=(f["HAS_ALIBI"] and f["CAUSAL"] and not f["HAS_WR"] and not f["IEEE"]
                        and VARIANTS["ALIBI_COLS"]),
            FMA=(VARIANTS["FMA_SCORES"] and not f["HAS_ALIBI"]
                 and (f["HAS_CAP"] or self.qk_scale > 0)),    # the multiplier must be > 0
            EDGE1=(VARIANTS["EDGE_ONE_TEST"] and f["CAUSAL"] and f["HAS_WL"] and not f["HAS_WR"]
                   and self.wl >= 2 * _widest_fwd_tile()),
            ASM=VARIANTS["MASK_ASM"],
            ONE_LOOP=(f["CAUSAL"] and not f["HAS_WR"]
                      and (VARIANTS["ONE_LOOP"] if not f["HAS_WL"] else
                           VARIANTS["ONE_LOOP_WINDOW"] and self.wl >= 2 * _widest_fwd_tile())))

    def scalars(self):
        return (self.H, self.G, self.SQ, self.SK, self.klen_static)


def _params(softmax_scale, causal, window_size_left, window_size_right, softcap, k_len,
            has_alibi, k_len_input):
    return dict(softmax_scale=softmax_scale, causal=causal, window_size_left=window_size_left,
                window_size_right=window_size_right, softcap=softcap, k_len=k_len,
                has_alibi=has_alibi, k_len_input=k_len_input)


@kernel(FusedOps.FLASH_ATTN, "cuda", dtypes=HALF_AND_F32, cost=attention_cost(2),
        supports=supports, strided_input=True)
def flash_attn(q, k, v, *opt, softmax_scale, causal=False, window_size_left=None,
               window_size_right=None, softcap=None, k_len=None, has_alibi=False,
               k_len_input=False):
    """FLASH_ATTN forward: (out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] float32). Inputs
    and params as the registry op; k/v rows at or past k_len are never read."""
    a = _Launch("flash_attn", q, k, v, opt, _params(
        softmax_scale, causal, window_size_left, window_size_right, softcap, k_len, has_alibi,
        k_len_input))
    q, k, v = a.q, a.k, a.v
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        lse.fill_(float("inf"))
        return out.zero_(), lse
    grid = lambda meta: (triton.cdiv(a.SQ, meta["BLOCK_M"]), a.B * a.H)  # noqa: E731
    if _warp_specialized(a, q, k, v):
        _launch_ws(a, q, k, v, out, lse, grid)
        return out, lse
    _fwd_kernel[grid](q, k, v, out, lse, a.slopes, a.klen, q.stride(0), q.stride(1), q.stride(2),
                      k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                      v.stride(2), out.stride(0), out.stride(1), out.stride(2), a.slb,
                      *a.scalars(), a.qk_scale, a.cap, a.wl, a.wr, **a.tune, **a.flags,
                      **a.fwd_flags)
    return out, lse


def _backward(q, k, v, grad_out, lse, delta, opt, p):
    """(dq, dk, dv): one kernel per key block for dk and dv, one per query block for dq."""
    a = _Launch("flash_attn_backward", q, k, v, opt, p)
    q, k, v = a.q, a.k, a.v
    do = _last_dim_contiguous(grad_out)
    lse = lse.to(torch.float32).contiguous()
    delta = delta.to(torch.float32).contiguous()
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=q.dtype)
    dv = torch.empty(k.shape, device=k.device, dtype=q.dtype)
    if dq.numel():
        grid = lambda meta: (triton.cdiv(a.SQ, meta["BLOCK_M"]), a.B * a.H)  # noqa: E731
        _bwd_q_kernel[grid](q, k, v, do, lse, delta, dq, a.slopes, a.klen, q.stride(0),
                            q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                            v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1),
                            do.stride(2), dq.stride(0), dq.stride(1), dq.stride(2), a.slb,
                            *a.scalars(), a.qk_scale, a.cap, a.scale, a.wl, a.wr, **a.tune,
                            **a.flags)
    if dk.numel():
        # dk = scale * dS^T q: the tile has dS in score units, q un-scaled
        grid = lambda meta: (triton.cdiv(a.SK, meta["BLOCK_N"]), a.B * a.HK)  # noqa: E731
        _bwd_kv_kernel[grid](q, k, v, do, lse, delta, dk, dv, a.slopes, a.klen, q.stride(0),
                             q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                             v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1),
                             do.stride(2), dk.stride(0), dk.stride(1), dk.stride(2), a.slb,
                             *a.scalars(), a.qk_scale, a.cap, a.scale, a.wl, a.wr, **a.tune,
                             **a.flags)
    return dq, dk, dv


@kernel(FLASH_ATTN_BACKWARD, "cuda", dtypes=HALF_AND_F32, cost=attention_cost(7),
        supports=supports, strided_input=True)
def flash_attn_backward(q, k, v, grad_out, lse, delta, *opt, softmax_scale, causal=False,
                        window_size_left=None, window_size_right=None, softcap=None, k_len=None,
                        has_alibi=False, k_len_input=False):
    """FLASH_ATTN_BACKWARD (0x111, what FLASH_ATTN_BACKWARD_Q/K/V lower to): (dq, dk, dv) in
    q's dtype; inputs and params as the registry op."""
    return _backward(q, k, v, grad_out, lse, delta, opt,
                     _params(softmax_scale, causal, window_size_left, window_size_right,
                             softcap, k_len, has_alibi, k_len_input))
