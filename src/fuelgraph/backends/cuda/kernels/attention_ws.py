"""FLASH_ATTN's forward as a warp-specialized Hopper kernel (attention.py launches it for
16-bit inputs when VARIANTS["WARP_SPEC"] is on and the inputs suit TMA).

Triton 3.6 warp-specializes a loop marked `tl.range(..., warp_specialize=True)` on sm_90
only when the kernel is written for 4 warps and its loads are tensor descriptors (TMA): it
then builds a producer warpgroup that issues the k/v TMA copies and splits the 128-row query
tile over two consumer warpgroups of 64 rows (12 warps, registers moved to the consumers with
setmaxnreg), synchronised through mbarriers only -- no CTA-wide barrier a block, so one
consumer's softmax can run under the other's tensor-core products (FlashAttention-3's
structure). The pass gives up (silently: a plain 4-warp kernel) on a branch inside the loop
or a second loop, so every key block of a program runs in one loop and the masks are one or
two compares a score against per-row bounds, on every block (a block inside the band passes
them all).

Descriptors: q, k and v as 4-D [B, H, S, D] views with the tensors' own strides; the key
extent is the live length L, so TMA fills rows past it with zeros and never reads them.
The host side (which forwards take this kernel, its launch) is at the end of the file.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import _APPROX_TANH, VARIANTS, _finish, _key_ranges, _online, _scores
from .common import GRAPH_CAPTURE, INTERPRET

#: (BLOCK_M, BLOCK_N, warps of ONE consumer, stages): 128-row tiles (the pass splits them
#: into two 64-row consumers), k and v blocks in 2 buffers each (128 x 64 tiles measured 5-12%
#: slower on the H200; 128 x 128 in 3 stages needs 246 KiB of shared memory)
WS_CHOICES = [(128, 128, 4, 2)]


def _block_shapes(nargs):
    """Autotune pre-hook: the descriptors' block shapes follow the config."""
    m, n, d = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_D"]
    nargs["KD"].block_shape = [1, 1, n, d]
    nargs["VD"].block_shape = [1, 1, n, d]


def ws_config(m, n, warps, stages):
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages,
                         pre_hook=_block_shapes)


#: the CPU interpreter: one small tile (several blocks a row on tiny shapes), no tuning
WS_CONFIGS = [ws_config(*c) for c in (WS_CHOICES if not INTERPRET else [(32, 16, 4, 1)])]
_WS_TUNE_KEYS = ["TUNE_Q", "TUNE_K", "BLOCK_D", "CAUSAL", "HAS_WL", "HAS_WR", "HAS_CAP",
                 "HAS_ALIBI", "ALIBI_COLS", "FMA", "EVEN_L", "PERSIST", "SKIP_MASK", "HEADS",
                 "LAZY_RESCALE", "ALIBI_HOIST", "CAP_FIXED_REF", "EDGE_BOUND", "LEAN_TILE",
                 "EVEN_HEADS"]


def _prune(configs, named_args, **kw):
    from .attention import TUNE
    return configs if TUNE and not INTERPRET else configs[:1]


@triton.autotune(configs=WS_CONFIGS, key=_WS_TUNE_KEYS,
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _fwd_ws_kernel(Q, KD, VD, O, LSE, SLOPES, sqm, sob, soh, som, slb, ROWS, H, G, SQ, L,
                   QK_SCALE, CAP, WL, WR, TUNE_Q, TUNE_K, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_WL: tl.constexpr,
                   HAS_WR: tl.constexpr, HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   ALIBI_COLS: tl.constexpr, FMA: tl.constexpr, EVEN_L: tl.constexpr,
                   BH=1, PERSIST: tl.constexpr = False, GROUP: tl.constexpr = 8,
                   SKIP_MASK: tl.constexpr = False, HEADS: tl.constexpr = 1,
                   LAZY_RESCALE: tl.constexpr = False,
                   ALIBI_HOIST: tl.constexpr = False, CAP_FIXED_REF: tl.constexpr = False,
                   EDGE_BOUND: tl.constexpr = False, LEAN_TILE: tl.constexpr = False,
                   EVEN_HEADS: tl.constexpr = False):
    """Forward of 128-row query tiles (outputs as attention._fwd_kernel); L the live key count
    (static), EVEN_L: L is a multiple of every BLOCK_N (no key-count mask). Grid (query tiles,
    B * H), longest causal rows first; PERSIST: grid (programs,), each program striding over
    the tiles (dealt GROUP heads at a time, longest rows first within the group: the group's
    k and v stay in L2) with the specialized loop around the tiles, so the producer loads the
    next tile's q, k and v while the consumers finish this one. LEAN_TILE with EVEN_HEADS
    (B * H a multiple of the group, GROUP or HEADS): a tile's place from one division by the
    tile count of a head, not three (the same order)."""
    # q's descriptor is made here, 2-D over the [B * H * SQ, D] rows: the specialization
    # splits the q tile between the two consumers, shrinking the copy's box (a host
    # descriptor's encoding, taken from the unsplit tile, would not follow) and offsetting
    # the copy's first coordinate (the batch of a 4-D one)
    QD = tl.make_tensor_descriptor(Q, [ROWS, BLOCK_D], [sqm, 1], [BLOCK_M, BLOCK_D])
    if PERSIST:
        num_m = tl.cdiv(SQ, BLOCK_M)
        per_group = GROUP * num_m
        for tile in tl.range(tl.program_id(0), num_m * BH, tl.num_programs(0),
                             warp_specialize=True):
            if LEAN_TILE and EVEN_HEADS:
                t = tile // GROUP
                rank = t % num_m
                bh = (t // num_m) * GROUP + tile % GROUP
            else:
                g0 = (tile // per_group) * GROUP
                heads = tl.minimum(BH - g0, GROUP)
                rank = (tile % per_group) // heads
                bh = g0 + (tile % per_group) % heads
            pid_m = rank
            if CAUSAL:
                pid_m = num_m - 1 - rank
            _ws_tile(pid_m, bh, QD, KD, VD, O, LSE, SLOPES, sob,
                     soh, som, slb, H, G, SQ, L, QK_SCALE, CAP, WL, WR, BLOCK_D, BLOCK_M,
                     BLOCK_N, CAUSAL, HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI, ALIBI_COLS, FMA,
                     EVEN_L, False, SKIP_MASK, LAZY_RESCALE, ALIBI_HOIST, CAP_FIXED_REF,
                     EDGE_BOUND, LEAN_TILE)
    else:
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        if CAUSAL and HEADS > 1:   # tiles of HEADS heads at a time, longest rows first across
            num_m = tl.num_programs(0)     # them (the k and v of those heads stay in L2)
            pid = bh * num_m + pid_m
            if LEAN_TILE and EVEN_HEADS:
                t = pid // HEADS
                rank = t % num_m
                bh = (t // num_m) * HEADS + pid % HEADS
            else:
                g0 = (pid // (HEADS * num_m)) * HEADS
                heads = tl.minimum(tl.num_programs(1) - g0, HEADS)
                rank = (pid - g0 * num_m) // heads
                bh = g0 + (pid - g0 * num_m) % heads
            pid_m = num_m - 1 - rank
        elif CAUSAL:     # the longest rows of a causal mask first: a shorter tail at the end
            pid_m = tl.num_programs(0) - 1 - pid_m
        _ws_tile(pid_m, bh, QD, KD, VD, O, LSE, SLOPES, sob, soh, som, slb, H, G,
                 SQ, L, QK_SCALE, CAP, WL, WR, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_WL,
                 HAS_WR, HAS_CAP, HAS_ALIBI, ALIBI_COLS, FMA, EVEN_L, True, SKIP_MASK,
                 LAZY_RESCALE, ALIBI_HOIST, CAP_FIXED_REF, EDGE_BOUND, LEAN_TILE)


_KEEP = "@!p mov.b32 ${}, 0fFF800000;"
#: 8 scores an instance ($0-$7, tied to the inputs $8-$15), their columns $16-$23, the
#: branch's flag $24 (of $24-$31), the upper bounds $32-$39 and (two-sided) lower $40-$47
_MASK_HI = tl.constexpr(
    "{ .reg .pred p, q; setp.eq.s32 q, $24, 0; @q bra.uni SKIP;"
    + "".join(f" setp.le.s32 p, ${16 + i}, ${32 + i}; " + _KEEP.format(i) for i in range(8))
    + " SKIP: }")
_MASK_BAND = tl.constexpr(
    "{ .reg .pred p, q; setp.eq.s32 q, $24, 0; @q bra.uni SKIP;"
    + "".join(f" setp.le.s32 p, ${16 + i}, ${32 + i}; setp.ge.and.s32 p, ${16 + i}, ${40 + i}, p;"
              " " + _KEEP.format(i) for i in range(8))
    + " SKIP: }")
#: WS_EDGE_BOUND: $24 as in _MASK_BAND (a block needs a mask), $48 (of $48-$55) which bound:
#: 0 the upper one only (the diagonal block), else the lower one only (the window's far
#: edge); never both (the host takes it only for windows BLOCK_M + BLOCK_N - 2 wide or more)
_HI8 = "".join(f" setp.le.s32 p, ${16 + i}, ${32 + i}; " + _KEEP.format(i) for i in range(8))
_LO8 = "".join(f" setp.ge.s32 p, ${16 + i}, ${40 + i}; " + _KEEP.format(i) for i in range(8))
_MASK_EDGE = tl.constexpr(
    "{ .reg .pred p, q; setp.eq.s32 q, $24, 0; @q bra.uni SKIP; setp.ne.s32 q, $48, 0;"
    " @q bra.uni LO;" + _HI8 + " bra.uni SKIP; LO:" + _LO8 + " SKIP: }")
_TIED = "=r," * 8 + ",".join(str(i) for i in range(8))
_TIED_HI = tl.constexpr(_TIED + ",r" * 24)
_TIED_BAND = tl.constexpr(_TIED + ",r" * 32)
_TIED_EDGE = tl.constexpr(_TIED + ",r" * 40)


#: 8 accumulator entries an instance ($0-$7, tied to $8-$15), their rows' factors $16-$23
_RESCALE = tl.constexpr(
    "{ .reg .pred q; setp.neu.f32 q, $16, 0f3F800000;"
    + "".join(f" setp.neu.or.f32 q, ${16 + i}, 0f3F800000, q;" for i in range(1, 8))
    + " vote.sync.any.pred q, q, 0xffffffff; @!q bra.uni SKIP;"
    + "".join(f" mul.f32 ${i}, ${i}, ${16 + i};" for i in range(8))
    + " SKIP: }")
_TIED_RESCALE = tl.constexpr(_TIED + ",r" * 8)


@triton.jit
def _rescale_if(acc, alpha):
    """acc * alpha (alpha [BLOCK_M, 1]), the multiplies behind a branch taken only by warps
    where a row's reference max moved (alpha != 1: _online LAZY, rarely), in inline PTX as
    _masked_if (a warp-uniform branch: a divergent one is if-converted into predicated
    multiplies, which issue all the same)."""
    return tl.inline_asm_elementwise(_RESCALE, _TIED_RESCALE,
                                     [acc, tl.broadcast_to(alpha, acc.shape)],
                                     dtype=tl.float32, is_pure=True, pack=8)


@triton.jit
def _masked_if(s, col, bound, need, low, BAND: tl.constexpr, EDGE: tl.constexpr = False,
               lower=0):
    """s where col <= bound (and, BAND, col >= low), else -inf, behind a branch on the tile-wide
    `need` (only the edge blocks of a band have keys outside a row's): inline PTX, which the
    warp-specializing pass sees as one elementwise op (it gives up on a branch in the loop);
    8 scores an instance, each output tied to its score (nothing to move when skipped).
    EDGE (with BAND): `lower` picks the one bound a block needs (_MASK_EDGE: one compare a
    score on a wide window's two edge blocks instead of two)."""
    n = need.to(tl.int32) + (col * 0)
    if not BAND:
        return tl.inline_asm_elementwise(_MASK_HI, _TIED_HI, [s, col, n, bound],
                                         dtype=tl.float32, is_pure=True, pack=8)
    if EDGE:
        return tl.inline_asm_elementwise(_MASK_EDGE, _TIED_EDGE,
                                         [s, col, n, bound, low, lower.to(tl.int32) + col * 0],
                                         dtype=tl.float32, is_pure=True, pack=8)
    return tl.inline_asm_elementwise(_MASK_BAND, _TIED_BAND, [s, col, n, bound, low],
                                     dtype=tl.float32, is_pure=True, pack=8)


@triton.jit
def _ws_mask(s, j, offs_n, hi_key, lo_key, a_first, L, WL, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WL: tl.constexpr,
             HI_MASK: tl.constexpr, SKIP_MASK: tl.constexpr, EDGE: tl.constexpr = False):
    """s [BLOCK_M, BLOCK_N] (keys j + offs_n) at -inf outside each row's lo_key..hi_key
    (a_first: the tile's first row's key position)."""
    if HI_MASK and SKIP_MASK and _APPROX_TANH:    # masks behind a branch: edge blocks
        # the first row's upper bound is the tile's smallest (causal: its position)
        past_hi = j + BLOCK_N - 1 > (a_first if CAUSAL else L - 1)
        past_lo = j < a_first + BLOCK_M - 1 - WL    # the last row's lower bound is the largest
        if HAS_WL and EDGE:     # each edge block its own bound (a wide window: never both)
            s = _masked_if(s, offs_n[None, :], hi_key - j, past_hi | past_lo, lo_key - j,
                           True, True, past_lo)
        elif HAS_WL:      # the diagonal block and the window's far edge
            s = _masked_if(s, offs_n[None, :], hi_key - j, past_hi | past_lo, lo_key - j, True)
        else:           # the diagonal block (non-causal: the last block past L)
            s = _masked_if(s, offs_n[None, :], hi_key - j, past_hi, hi_key, False)
    elif HI_MASK and HAS_WL and _APPROX_TANH:     # both bounds: 2 compares + 1 select a score
        s = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ge.s32 p, $2, $3; setp.le.and.s32 p, $2, $4, p; "
            "selp.f32 $0, $1, 0fFF800000, p; }", "=r,r,r,r,r",
            [s, offs_n[None, :], lo_key - j, hi_key - j], dtype=tl.float32, is_pure=True,
            pack=1)
    else:
        if HI_MASK:
            s = tl.where(offs_n[None, :] <= hi_key - j, s, float("-inf"))
        if HAS_WL:
            s = tl.where(offs_n[None, :] >= lo_key - j, s, float("-inf"))
    return s


@triton.jit
def _ws_tile(pid_m, bh, QD, KD, VD, O, LSE, SLOPES, sob, soh, som, slb, H, G, SQ, L, QK_SCALE,
             CAP, WL, WR, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
             HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, ALIBI_COLS: tl.constexpr,
             FMA: tl.constexpr, EVEN_L: tl.constexpr, WS: tl.constexpr,
             SKIP_MASK: tl.constexpr, LAZY_RESCALE: tl.constexpr,
             ALIBI_HOIST: tl.constexpr, CAP_FIXED_REF: tl.constexpr,
             EDGE_BOUND: tl.constexpr = False, LEAN_TILE: tl.constexpr = False):
    """One query tile; WS: its key loop is the specialized one. EDGE_BOUND: see _masked_if's
    EDGE. LEAN_TILE: the epilogue (consumers' time with the tensor cores idle, paid once a
    tile: a 9-block window tile pays it over half the blocks of an average causal one) with
    a reciprocal a row and one multiply an output instead of a division each, the hardware's
    log2 and 32-bit offsets from the tile's base pointers. ALIBI_HOIST (with
    ALIBI_COLS): the per-key bias slope * (j + n) as a loop-invariant slope * n a column plus
    the block's slope * j, which moves into the row max (_online SHIFTED): a fused multiply-add
    a score instead of a convert, a multiply and an add a column besides. CAP_FIXED_REF
    (softcap without ALiBi): a softcapped score lies in [-c, c] (log2 units, c = cap *
    log2(e)), so p = 2^score itself stays a normal number in [2^-c, 2^c] -- softmax is
    shift-invariant: no row max, no online rescale, the same relative accuracy. The host
    allows it for c <= 80 with bfloat16 P (sums of 2^80 p v stay far from float32's range),
    c <= 14 with float16 P (its largest number is 2^16)."""
    b = bh // H
    h = bh % H
    hk = h // G
    off = L - SQ
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = QD.load([bh * SQ + m0, 0])
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + b * slb + h)
    a_pos = (offs_m + off)[:, None]
    lo, _, _, _, hi = _key_ranges(m0 + off, m0 + BLOCK_M - 1 + off, L, WL, WR, BLOCK_N,
                                  CAUSAL, HAS_WL, HAS_WR)
    # admissible keys of a row: lo_key <= key <= hi_key (causal rows past SQ are never stored)
    HI_MASK: tl.constexpr = CAUSAL or HAS_WR or not EVEN_L
    hi_key = a_pos * 0 + (L - 1)
    if CAUSAL:
        hi_key = a_pos
    if HAS_WR:
        hi_key = tl.minimum(hi_key, a_pos + WR)
    lo_key = a_pos - WL
    HOIST: tl.constexpr = HAS_ALIBI and ALIBI_COLS and ALIBI_HOIST
    FIXED: tl.constexpr = HAS_CAP and FMA and not HAS_ALIBI and CAP_FIXED_REF
    col_bias = (slope * 1.4426950408889634) * offs_n.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = KD.load([b, hk, j, 0]).reshape(BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k))
        kn = j + offs_n
        shift = 0.0
        if HOIST:
            s, t = _scores(qk, a_pos, kn[None, :], L, QK_SCALE, CAP, slope, WL, WR, False,
                           CAUSAL, HAS_WL, HAS_WR, HAS_CAP, False, False, False, False, True)
            s += col_bias[None, :]
            shift = (slope * 1.4426950408889634) * j
        else:
            s, t = _scores(qk, a_pos, kn[None, :], L, QK_SCALE, CAP, slope, WL, WR, False,
                           CAUSAL, HAS_WL, HAS_WR, HAS_CAP, HAS_ALIBI, False, ALIBI_COLS, FMA,
                           True)
        s = _ws_mask(s, j, offs_n, hi_key, lo_key, m0 + off, L, WL, BLOCK_M, BLOCK_N, CAUSAL,
                     HAS_WL, HI_MASK, SKIP_MASK, EDGE_BOUND)
        v = VD.load([b, hk, j, 0]).reshape(BLOCK_N, BLOCK_D)
        if FIXED:       # p = 2^score: no row max, no rescale
            p = tl.exp2(s * (CAP * 1.4426950408889634))
            l_i += tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            p, alpha, l_i, m_i = _online(s, l_i, m_i, QK_SCALE, CAP, HAS_CAP, FMA,
                                         HI_MASK or HAS_WL, LAZY_RESCALE, HOIST, shift)
            if LAZY_RESCALE and _APPROX_TANH:     # alpha is 1 unless the reference moved
                acc = tl.dot(p.to(v.dtype), v, _rescale_if(acc, alpha[:, None]))
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    if FIXED:
        m_i = tl.zeros([BLOCK_M], tl.float32)
    rmask = offs_m < SQ
    if LEAN_TILE and _APPROX_TANH:
        out, lse = _finish(acc, l_i, m_i, slope, offs_m + off, ALIBI_COLS, True)
        rows = tl.arange(0, BLOCK_M)
        o_tile = O + (b.to(tl.int64) * sob + h.to(tl.int64) * soh + m0.to(tl.int64) * som)
        tl.store(o_tile + (rows[:, None] * som + offs_d[None, :]), out.to(O.dtype.element_ty),
                 mask=rmask[:, None])
        tl.store(LSE + (bh.to(tl.int64) * SQ + m0) + rows, lse, mask=rmask)
    else:
        out, lse = _finish(acc, l_i, m_i, slope, offs_m + off, ALIBI_COLS)
        tl.store(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
                 + offs_m[:, None].to(tl.int64) * som + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=rmask[:, None])
        tl.store(LSE + bh.to(tl.int64) * SQ + offs_m, lse, mask=rmask)


# ---- variants (attention.VARIANTS["WS_*"]; H200, B4 H32 S4096 bf16 D128) --------------------
# WS_PERSIST (every causal case) / WS_PERSIST_WINDOW (causal left windows; the default) --
# the warp-specialized kernel persistent: one program a multiprocessor striding over the
# tiles, its producer loading the next tile while the consumers finish one. H200, 128 x 128
# tiles, two interleaved repeats: window 1024 400.6 / 396.0 against 378.3 / 371.5 TFLOP/s
# (1.13x / 1.12x the plain causal kernel's 453.6 / 441.7), but plain causal 422 / 430,
# softcap 399 / 387 against 403 / 395, ALiBi 420 / 411 against 430 / 413: so windows only.
# Tried in session 8 and dropped: each program prefetching into L2 the q tile of the program
# one wave later (q is read once, from HBM, before the k/v prefetch starts): plain causal
# 438.8 / 416.8 / 436.6 against 435.4 / 429.9 / 418.4, window 361.2 / 348.7 / 358.0 against
# 369.4 / 360.6 / 355.3 (three interleaved repeats): noise.
# WS_SKIP_MASK (default) -- the warp-specialized kernel's causal mask behind a branch in
# inline PTX (the specialization pass sees one elementwise op; only the diagonal block runs
# the compares): sm_90 SASS of a block 650 -> ~465 instructions executed. H200, plain causal
# B4 H32 S4096, 3 interleaved rounds: 465 / 457 / 446 against 438 / 421 / 433 TFLOP/s.
# WS_SKIP_MASK_WINDOW (default) -- the same for a causal window's two edges: window 1024
# 432 against 402 TFLOP/s (1.08x plain causal's time per unit of work instead of 1.19x;
# not persistent: 380). WS_HEADS (default 4) -- tiles dealt WS_HEADS heads at a time,
# longest rows first across them (a shorter tail: a list schedule of the tile lengths on
# 132 SMs puts the makespan 3.2% over the mean with one head, 0.3% with 4). WS_LAZY_RESCALE
# (default) -- see attention._online's LAZY and _rescale_if. Plain causal, 3 interleaved
# rounds: both 485.5 / 479.7 / 469.7, WS_HEADS=4 alone 479.8 / 469.6 / 463.7, lazy rescale
# alone 472.6 / 471.6 / 469.4, neither 469.0 / 448.3 / 469.2 (mask every block: 451.6 /
# 443.0 / 417.3).
# Tried in session 9 and dropped: FlashAttention-3's ping-pong (the two consumer warpgroups
# taking turns on the tensor cores, through named-barrier rendezvous in inline PTX around
# each block's softmax): plain causal 347 against 433 TFLOP/s, window 1024 236 against 385
# (one warpgroup's 64-row products alone use the tensor cores far less than both at once).
# Session 10 (row 5: window 1024 / softcap 50 / ALiBi against plain causal; do_bench medians
# of 3 rounds interleaved in one process unless said otherwise):
# WS_CAP_FIXED_REF (default) -- softcap 448.8 against 404.1 TFLOP/s (1.057x plain causal's
# time per unit of work instead of 1.178x); timed in 16 batches alternating with plain
# causal: 432.6 against 389.9 (1.13x against 1.29x). SASS: 445 instructions a block and warp
# against 559 (plain causal 431). WS_ALIBI_HOIST (default) -- ALiBi 439.6 against 427.2
# (round 1: 437.6 against 427.6; SASS 502 against 593 instructions a block).
# Tried and removed: softcap's exponentials partly on the FMA pipe (a cubic, FlashAttention-4's
# trick), n of 8: softcap 395 / 401 / 387 / 377 for n = 2 / 3 / 4 / 5 against 413 (MUFU is not
# what limits it: every added instruction costs), 1 of 8 on the other cases: plain causal 453
# against 478; the row max from the products under the scores' tanh (WS_CAP_RAW_MAX): 359
# against 390 (paired); the persistent window kernel's tiles in a balanced static order (a list
# schedule: the program makespan within a tile of the mean instead of 3% over it): window
# 405.9 / 408.9 against 409.2 / 404.4 in two runs, noise; the output tile by a TMA store:
# plain causal 461.4 against 472.6. Not run: q scaled once a tile for softcap (saves the
# multiply before tanh, but the rounding of q * scale to bf16 raised the error 2-15x in a CPU
# model, still within the 16-bit rule); packed f16x2 / bf16x2 tanh and ex2 (sm_90 SASS runs
# them as two MUFU instructions each, plus packing).
# Session 11 (row 5 now timed call by call, interleaved, median of the rounds' ratios; SASS:
# instructions a consumer warp executes, bench/sass_attention.py --ws --ws-flips):
# WS_LEAN_TILE (default) -- the tile's epilogue with a reciprocal a row and a multiply an
# output instead of a full-range division each, lg2.approx, 32-bit offsets from the tile's
# base pointers; a tile's place from one division instead of three (EVEN_HEADS). Outside the
# key loop a tile 761 -> 450 instructions (persistent window), 739 -> 474 (plain causal).
# WS_EDGE_BOUND (default; windows >= BLOCK_M + BLOCK_N - 2) -- _MASK_EDGE: the diagonal block
# 635 -> 595, the far edge 635 -> 587 instructions, an unmasked block unchanged (443).
# H200, window 1024 and plain causal interleaved, 40 rounds: window 1.077x plain causal's time
# per unit of work with both, 1.101x without WS_EDGE_BOUND, 1.135x with neither (window time
# 1.000 / 1.021 / 1.064); plain causal 485.2 / 486.2 / 478.7 TFLOP/s (time 1.000 / 1.000 /
# 1.015). Round 2, the four cases interleaved, 30 rounds, both against neither: plain causal
# 491.9 / 484.6, window 450.9 / 425.7 (1.094x / 1.142x), softcap 436.7 / 438.5 and ALiBi
# 430.9 / 430.0 TFLOP/s (their times 1.004 / 0.997 of neither's: noise) -- so softcap's ratio
# 1.104x -> 1.125x and ALiBi's 1.127x -> 1.141x from plain causal's gain alone.


# ---- host side (attention.flash_attn calls these) ----------------------------------------------
_SM_COUNT = {}


def _resident_programs(device):
    """Forward programs resident at once (one a multiprocessor: the tiles' shared memory)."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _tma_ready(x):
    """TMA can read x: 16-byte aligned base and strides (the last dim contiguous)."""
    item = x.element_size()
    return x.data_ptr() % 16 == 0 and all(st * item % 16 == 0 for st in x.stride()[:-1])


def _warp_specialized(a, q, k, v):
    """Whether the forward runs as the warp-specialized kernel (measured faster for causal
    masks; the others keep the Triton kernel): WARP_SPEC on, causal without a right window,
    16-bit inputs,
    a power-of-two head dim up to 128, a static key length > 0, TMA-ready tensors, q's rows
    [B * H * Sq, D] one strided matrix, and no CUDA-graph capture (q's descriptor is built on
    the device in scratch memory allocated per launch, which a replay would not own). Under
    fuelgraph's own capture the warm-up before it takes the Triton kernel too (GRAPH_CAPTURE),
    so the capture loads no new kernel."""
    f = a.flags
    return (VARIANTS["WARP_SPEC"] and f["CAUSAL"] and not f["HAS_WR"] and not f["IEEE"]
            and not f["DYN_KLEN"]
            and f["HEAD_DIM"] == f["BLOCK_D"] <= 128 and a.klen_static > 0 and a.SQ > 0
            and all(_tma_ready(x) for x in (q, k, v))
            and q.stride(0) == a.H * q.stride(1) and q.stride(1) == a.SQ * q.stride(2)
            and not GRAPH_CAPTURE[0]
            and not (q.is_cuda and torch.cuda.is_current_stream_capturing()))


def _ensure_allocator():
    """Device-side tensor descriptors need global scratch from Triton's allocator: a torch
    one, unless the process set its own."""
    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                     device="cuda"))


def _launch_ws(a, q, k, v, out, lse, grid):
    from triton.tools.tensor_descriptor import TensorDescriptor
    L, D = a.klen_static, a.D
    kd = TensorDescriptor(k, [a.B, a.HK, L, D], list(k.stride()), [1, 1, 64, D])
    vd = TensorDescriptor(v, [a.B, a.HK, L, D], list(v.stride()), [1, 1, 64, D])
    f = a.flags
    persist = VARIANTS["WS_PERSIST"] or (VARIANTS["WS_PERSIST_WINDOW"] and f["HAS_WL"])
    if persist:
        nprog = _resident_programs(q.device)
        grid = lambda meta: (min(nprog, triton.cdiv(a.SQ, meta["BLOCK_M"]) * a.B * a.H),)  # noqa
    _ensure_allocator()
    _fwd_ws_kernel[grid](q, kd, vd, out, lse, a.slopes, q.stride(2), out.stride(0), out.stride(1),
                         out.stride(2), a.slb, a.B * a.H * a.SQ, a.H, a.G, a.SQ, L, a.qk_scale,
                         a.cap, a.wl, a.wr,
                         **a.tune, BLOCK_D=f["BLOCK_D"], CAUSAL=f["CAUSAL"], HAS_WL=f["HAS_WL"],
                         HAS_WR=f["HAS_WR"], HAS_CAP=f["HAS_CAP"], HAS_ALIBI=f["HAS_ALIBI"],
                         ALIBI_COLS=a.fwd_flags["ALIBI_COLS"], FMA=a.fwd_flags["FMA"],
                         EVEN_L=L % 128 == 0, BH=a.B * a.H, PERSIST=persist,
                         SKIP_MASK=VARIANTS["WS_SKIP_MASK_WINDOW" if f["HAS_WL"]
                                            else "WS_SKIP_MASK"],
                         HEADS=int(VARIANTS["WS_HEADS"]),
                         LAZY_RESCALE=VARIANTS["WS_LAZY_RESCALE"],
                         ALIBI_HOIST=VARIANTS["WS_ALIBI_HOIST"] and f["HAS_ALIBI"],
                         EDGE_BOUND=(VARIANTS["WS_EDGE_BOUND"] and f["HAS_WL"]
                                     and a.wl >= max(c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]
                                                     for c in _fwd_ws_kernel.configs) - 2),
                         LEAN_TILE=VARIANTS["WS_LEAN_TILE"],
                         EVEN_HEADS=a.B * a.H % (8 if persist else int(VARIANTS["WS_HEADS"]))
                         == 0,
                         CAP_FIXED_REF=(VARIANTS["WS_CAP_FIXED_REF"] and f["HAS_CAP"]
                                        and a.cap * 1.4426950408889634
                                        <= (80.0 if q.dtype == torch.bfloat16 else 14.0)))
