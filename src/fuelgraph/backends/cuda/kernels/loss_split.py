"""Softmax cross-entropy in one pass with each row split over several programs that meet
(the default one pass of ``loss.py`` for rows of up to CE_SPLIT_MAX chunks).

A row is cut into S chunks, one program per (row, chunk) work item, handed out by a ticket
counter in the order programs really start (so a program only ever waits for items already
taken by running programs or taken next: no reliance on the GPU dispatching program ids in
order). Each program takes its chunk's (max, sum exp), publishes them, meets the row's other
programs (`_meet`: an arrival counter, or self-flagging partial words) and writes
``w * (softmax - onehot)`` for its chunk:

- `_ce_split_kernel` streams the chunk twice (the second read mostly from L2);
- `_ce_held_kernel` holds the chunk in registers across the meeting (one read; 16-bit logits
  packed two to a register with inline PTX).

The CPU interpreter runs programs one by one, so it only ever gets S = 1 (tests preset the
partial words to run S > 1 there).
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .common import next_pow2
from .loss import (_INTERPRET, _REDUCTIONS, _lse_chunk, _lse_chunk_grouped, _row_valid,
                   _row_weight, _write_grad)

# the split-row one-pass kernel (_ce_split_kernel; the default for float32 logits and for rows
# of more than CE_SPLIT_MAX held chunks): rows cut into chunks of at most
# CE_SPLIT_CHUNK logits (0: whole rows, one program each), BLOCK-wide loads. Measured on an
# H200 (2026-12-01, bf16 8192x128256, one read + one write counted): chunks of 16384, BLOCK
# 2048, 4 warps, 3 stages 1.60 ms (2.62 TB/s); chunks of 65536 1.62 ms; whole rows 1.66-1.76 ms;
# the persistent kernel at 2-4 programs per SM 2.19 ms; the forward + backward pair 2.08 ms;
# holding 16K-logit chunks in registers instead of re-reading them from L2 3.1-4.2 ms. Those
# times hand out work by program id; the ticket order the kernel now uses (safe whatever the
# dispatch order) measured 1.744 vs 1.708 ms at chunks of 32768. Sweep of 2026-12-01 (later
# run, one session, ticket order; a plain copy of the logits -- one read, one write -- took
# 0.985 ms there): that default 1.631 ms; the light meeting 1.581; + running statistics per 8
# logits (no cross-warp reduction per BLOCK step) 1.496 ms, the default now; chunks of 65536
# (light) 1.523, of 8192 1.640 (grouped) / 1.683; persistent programs (4-7 per SM taking
# tickets, chunks in flight held under the L2 size) 1.67-2.12 ms: a smaller L2 footprint
# does not pay for fewer programs in flight; the first read without evict_last: no change.
CE_SPLIT_CHUNK = 16384
CE_SPLIT_MAX = 32
CE_SPLIT_BLOCK = 2048
CE_SPLIT_WARPS = 4
CE_SPLIT_STAGES = 3
CE_SPLIT_EVICT = "evict_last"    # cache hint of the first read of a chunk
CE_SPLIT_GROUP = 8               # first read: running (max, sum) per group of logits (0: per step)
CE_SPLIT_FAST = False            # exps as one FMA + one ex2.approx.ftz (_ce_split_kernel FAST)
# ... or, the default for 16-bit logits, each chunk held in registers across the meeting, read
# once (_ce_held_kernel): chunks of CE_HOLD_CHUNK logits (a power of two), CE_HOLD_WARPS warps,
# at most CE_HOLD_MAXNREG registers a thread (sm_90, bf16, bench/sass_ce_split.py: 64 without
# spilling, 8 programs per SM; 72 uncapped, 7 per SM). H200 sweep of 2026-12-01 18:13 (bf16
# 8192x128256, one session; the streamed default above 1.515 ms, a plain copy 0.984): chunks
# of 8192, 4 warps, packed bf16 pairs, eager load, word meeting, cap 64 1.096 ms (3.83 TB/s,
# 1.11x the copy), uncapped 1.105; chunks of 16384 on 8 warps 1.184; chunks of 4096 holding
# float32 exps 1.219 (2 warps) / 1.286 (4 warps), packed 1.386; chunks of 8192 waiting for
# the target and meeting through the counter (cap 80) 1.357; persistent programs holding two
# items (loss_flow) 1.384-1.417; the streamed kernel with the word meeting 1.537, with the
# leaner exps 1.459. Rerun 18:31 with this default: the kernel 1.088 ms, through the plan
# 1.113 (copy 0.985, streamed 1.496, Liger 2.45, torch eager 4.63).
CE_SPLIT_HOLD = True
CE_HOLD_CHUNK = 8192
CE_HOLD_WARPS = 4
CE_HOLD_MAXNREG = 64
CE_HOLD_PACK = True      # 16-bit logits held two to a register (else their float32 exps)
CE_HOLD_EAGER = True     # the chunk's load does not wait for the row's target
CE_HOLD_FLOW = False     # held chunks on persistent programs holding two (loss_flow), where
CE_FLOW_PROGRAMS = 6     # it applies (16-bit logits: V even); that many programs per SM
# how the programs of a row meet (_meet), streamed and held: "counter" (an arrival counter,
# acquire-release) or "word" (each partial (max, sum) one 64-bit word that is its own flag)
CE_SPLIT_MEET = "counter"
CE_HOLD_MEET = "word"
LOG2E = tl.constexpr(1.4426950408889634)
#: a partial word not yet written: max 0.0 in the low half, sum -1.0 in the high half
WORD_NOT_YET = int.from_bytes(struct.pack("<ff", 0.0, -1.0), "little", signed=True)


@triton.jit
def _meet(pm_ptr, ps_ptr, sync_ptr, item, r, m, s, S: tl.constexpr, S_P2: tl.constexpr,
          WORD: tl.constexpr):
    """Publish work item `item`'s partial (max, sum) of row r, wait for the row's other S - 1
    programs and return the row's (max, sum).

    WORD false (an arrival counter sync_ptr[r]): only the arrival orders the partials before it
    (release) and the reads after it (acquire, for the last to arrive, which does not poll):
    the partials go out with relaxed atomics, the others poll with acquire loads, and the
    partials are read back with two volatile loads in flight at once (from L2, never a stale
    L1 line). WORD true (pm_ptr: int64 words, preset to `WORD_NOT_YET`): (max, sum) go out as
    one 64-bit word, which is its own flag: the row's S words are polled until none has a
    negative sum -- no counter, no fence, one L2 round trip when the others are done."""
    if WORD:
        _publish_word(pm_ptr, item, m, s)
        return _wait_words(pm_ptr, r, S, S_P2)
    lane = tl.arange(0, S_P2)
    mine = lane < S
    tl.atomic_xchg(pm_ptr + item, m, sem="relaxed")
    tl.atomic_xchg(ps_ptr + item, s, sem="relaxed")
    arrived = tl.atomic_add(sync_ptr + r, 1, sem="acq_rel") + 1
    while arrived < S:
        arrived = tl.atomic_add(sync_ptr + r, 0, sem="acquire")
    pm = tl.load(pm_ptr + r * S + lane, mask=mine, volatile=True)
    ps = tl.load(ps_ptr + r * S + lane, mask=mine, volatile=True)
    return _combine_lanes(pm, ps, mine)


@triton.jit
def _combine_lanes(pm, ps, mine):
    """The (max, sum) of partials (pm, ps) where `mine`."""
    pm = tl.where(mine, pm, float("-inf"))
    ps = tl.where(mine, ps, 0.0)
    m = tl.max(pm, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.sum(ps * tl.exp(pm - m_safe), 0)


@triton.jit
def _publish_word(pm_ptr, item, m, s):
    """Partial (max, sum) of work item `item` as one 64-bit word (max in the low half)."""
    lo = m.to(tl.int32, bitcast=True).to(tl.uint32, bitcast=True).to(tl.int64)
    hi = s.to(tl.int32, bitcast=True).to(tl.int64) << 32
    tl.atomic_xchg(pm_ptr + item, hi | lo, sem="relaxed")


@triton.jit
def _wait_words(pm_ptr, r, S: tl.constexpr, S_P2: tl.constexpr):
    """Row r's (max, sum), once all its S partial words are written (none has a negative
    sum: `WORD_NOT_YET`)."""
    lane = tl.arange(0, S_P2)
    mine = lane < S
    words = tl.load(pm_ptr + r * S + lane, mask=mine, other=0, volatile=True)
    while tl.min((words >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0) < 0:
        words = tl.load(pm_ptr + r * S + lane, mask=mine, other=0, volatile=True)
    pm = words.to(tl.int32).to(tl.float32, bitcast=True)
    ps = (words >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return _combine_lanes(pm, ps, mine)


@triton.jit
def _ce_split_kernel(x_ptr, t_ptr, g_ptr, n_ptr, loss_ptr, dx_ptr, pm_ptr, ps_ptr, sync_ptr, R, V,
                     CHUNK, N_MEAN, ignore_index, HAS_IGNORE: tl.constexpr,
                     REDUCTION: tl.constexpr, STORE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
                     S: tl.constexpr, S_P2: tl.constexpr, BLOCK: tl.constexpr,
                     STAGES: tl.constexpr, EVICT: tl.constexpr, GROUP: tl.constexpr,
                     WORD: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr):
    """One pass with each row cut into S chunks of CHUNK logits, one program per (row, chunk):
    stream the chunk for its running (max, sum) (loads kept in L2; GROUP > 0: one running
    pair per GROUP logits, `_lse_chunk_grouped`), publish them, wait for the row's other S - 1
    programs through a per-row arrival counter (sync_ptr[r]), then stream the chunk again --
    from L2: a chunk is small, so it is mostly still there -- writing w * (softmax - onehot).
    S = 1 is one program per row, no waiting. FAST (GROUP > 0): the exps as in
    `_ce_held_kernel` (one FMA and one ex2.approx.ftz each, no select or compare per logit,
    the target's -w written over its element after a barrier).

    The meeting (`_meet`) has no full fence around every atomic (measured 3% faster than that
    on the H200).

    A program waits only for programs of its own row. With S > 1 the (row, chunk) items are
    handed out by a ticket counter (sync_ptr[R]) in the order programs really start, so no
    program can wait on one still queued behind it: forward progress does not depend on the
    GPU dispatching program ids in order (measured cost on an H200: about 2%). The CPU
    interpreter runs programs one by one: it only ever gets S = 1."""
    if S > 1:
        item = tl.atomic_add(sync_ptr + R, 1)
    else:
        item = tl.program_id(0)
    r = item // S
    c = item % S
    t = tl.load(t_ptr + r)
    valid = _row_valid(t, ignore_index, HAS_IGNORE)
    base = r.to(tl.int64) * V
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    if FAST:
        m, s = _lse_grouped_exp2(x_ptr, base, start, tl.where(valid, end, start), BLOCK,
                                 EVICT, STAGES, GROUP, ASM)
    elif GROUP:
        m, s = _lse_chunk_grouped(x_ptr, base, start, tl.where(valid, end, start), BLOCK,
                                  EVICT, STAGES, GROUP)
    else:
        m, s = _lse_chunk(x_ptr, base, start, tl.where(valid, end, start), BLOCK, EVICT,
                          STAGES)
    if S > 1:
        if valid:   # ignored rows: no program of the row publishes or waits
            m, s = _meet(pm_ptr, ps_ptr, sync_ptr, item, r, m, s, S, S_P2, WORD)
    in_range = (t >= 0) & (t < V)
    lse = tl.where(in_range, m + tl.log(s), float("nan"))
    if STORE_LOSS:
        if c == tl.where(in_range, t // CHUNK, 0):      # the chunk holding the target
            tc = tl.minimum(tl.maximum(t, 0), V - 1)
            xt = tl.load(x_ptr + base + tc, mask=valid, other=0.0).to(tl.float32)
            tl.store(loss_ptr + r, tl.where(valid, lse - xt, 0.0))
        if WRITE_GRAD:
            tl.debug_barrier()  # every warp has read it before any writes over it (dx may be x)
    if WRITE_GRAD:
        w = _row_weight(g_ptr, n_ptr, r, N_MEAN, HAS_IGNORE, REDUCTION)
        if FAST:
            w = tl.where(valid, w, 0.0)
            shift = tl.where(valid, lse * LOG2E, float("inf"))
            owner = (c == tl.where(in_range, t // CHUNK, 0)) & in_range
            # read before the loop, by every warp before any writes (dx may be x itself)
            xt = tl.load(x_ptr + base + t, mask=owner & valid, other=0.0).to(tl.float32)
            tl.debug_barrier()
            for off in tl.range(start, end, BLOCK, num_stages=STAGES):
                cols = off + tl.arange(0, BLOCK)
                mask = cols < end
                x = tl.load(x_ptr + base + cols, mask=mask & valid, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
                d = w * _exp2(tl.fma(x, LOG2E, -shift), ASM)
                tl.store(dx_ptr + base + cols, d.to(dx_ptr.dtype.element_ty), mask=mask,
                         eviction_policy="evict_first")
            tl.debug_barrier()
            if owner:
                dt = w * _exp2(tl.fma(xt, LOG2E, -shift), ASM)
                tl.store(dx_ptr + base + t, (dt - w).to(dx_ptr.dtype.element_ty))
        else:
            _write_grad(x_ptr, dx_ptr, base, start, end, t, lse, w, valid, True, BLOCK,
                        STAGES)


@triton.jit
def _lse_grouped_exp2(x_ptr, base, start, end, BLOCK: tl.constexpr, EVICT: tl.constexpr,
                      STAGES: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr):
    """`loss._lse_chunk_grouped` with its exps as one FMA and one ex2.approx.ftz each."""
    m = tl.full((BLOCK // GROUP,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK // GROUP,), tl.float32)
    for off in tl.range(start, end, BLOCK, num_stages=STAGES):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < end, other=float("-inf"),
                    eviction_policy=EVICT).to(tl.float32)
        x = tl.reshape(x, (BLOCK // GROUP, GROUP))
        m_new = tl.maximum(m, tl.max(x, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new) * LOG2E
        s = (s * _exp2(m * LOG2E - shift, ASM)
             + tl.sum(_exp2(tl.fma(x, LOG2E, -shift[:, None]), ASM), 1))
        m = m_new
    m_all = tl.max(m, 0)
    shift = tl.where(m_all == float("-inf"), 0.0, m_all) * LOG2E
    return m_all, tl.sum(s * _exp2(m * LOG2E - shift, ASM), 0)


@triton.jit
def _pack(xh, CHUNK: tl.constexpr, ASM: tl.constexpr):
    """The 16-bit CHUNK-vector xh as CHUNK // 2 int32, element 2i in the low half of i. ASM:
    one opaque move (compiled kernels: nothing can later undo the packing); else the same bits
    with integer arithmetic (the interpreter)."""
    lo, hi = tl.split(tl.reshape(xh.to(tl.int16, bitcast=True), (CHUNK // 2, 2)))
    if ASM:
        held = tl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        held = (lo.to(tl.uint16, bitcast=True).to(tl.int32)
                | (hi.to(tl.uint16, bitcast=True).to(tl.int32) << 16))
    return held


@triton.jit
def _unpack(held, HALF: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr):
    """Float32 of the low (HALF 0) or high (1) 16-bit logit (bf16 or fp16) of each int32 of
    `held`. ASM: an instruction LLVM takes as not pure, so it does not merge a call with an
    earlier one across the meeting (whose float32 result would then stay alive; measured by
    the registers: bench/sass_ce_split.py)."""
    if ASM:
        if BF16:
            if HALF == 0:
                asm: tl.constexpr = "shl.b32 $0, $1, 16;"
            else:
                asm: tl.constexpr = "and.b32 $0, $1, 0xffff0000;"
        else:
            if HALF == 0:
                asm: tl.constexpr = "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, l; }"
            else:
                asm: tl.constexpr = "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, h; }"
        x = tl.inline_asm_elementwise(asm, "=r,r", [held], dtype=tl.float32, is_pure=False,
                                      pack=1)
    else:
        bits = (held >> (16 * HALF)) & 0xFFFF
        if BF16:
            x = (bits << 16).to(tl.float32, bitcast=True)
        else:
            x = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _ce_held_kernel(x_ptr, t_ptr, g_ptr, n_ptr, loss_ptr, dx_ptr, pm_ptr, ps_ptr, sync_ptr, R, V,
                    N_MEAN, ignore_index, HAS_IGNORE: tl.constexpr, REDUCTION: tl.constexpr,
                    STORE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, S: tl.constexpr,
                    S_P2: tl.constexpr, CHUNK: tl.constexpr, PACK: tl.constexpr,
                    ASM: tl.constexpr, EAGER: tl.constexpr, WORD: tl.constexpr):
    """`_ce_split_kernel` with the chunk held in registers across the meeting instead of read
    twice: each program loads its CHUNK logits (a power of two; the last chunk of a row is
    masked) with one load, takes their (max, sum exp), meets the row's other S - 1 programs
    (`_meet`, work items from the ticket counter sync_ptr[R]) and writes w * (softmax - onehot)
    from what it holds: the logits cross HBM once.

    What is held: with PACK (16-bit logits), the logits as loaded, two to a 32-bit register
    (left to itself the compiler gives each 16-bit value a register of its own; ASM: packed and
    widened with inline PTX, `_pack`/`_unpack`), widened afresh for the statistics and again
    for the gradient (two exps per logit); else exp(x - max of the chunk) in float32 (the
    gradient is that times one scalar: one exp per logit). Each exp is one FMA and one
    ex2.approx.ftz (`_exp2`); an ignored row gets weight 0 and shift +inf instead of a select
    per logit, and the target's -w is written over its one element after a barrier instead
    of a compare per logit. EAGER: the chunk's load does not wait for the row's target (a row that is
    ignored is read all the same; its results are not used). S = 1 is one program per row, no
    waiting (the CPU interpreter gets only that).
    """
    if S > 1:
        item = tl.atomic_add(sync_ptr + R, 1, sem="relaxed")    # a number, orders nothing
    else:
        item = tl.program_id(0)
    r = item // S
    c = item % S
    t = tl.load(t_ptr + r)
    valid = _row_valid(t, ignore_index, HAS_IGNORE)
    base = r.to(tl.int64) * V
    cols = c * CHUNK + tl.arange(0, CHUNK)
    if EAGER:
        live = cols < V
    else:
        live = (cols < V) & valid
    xh = tl.load(x_ptr + base + cols, mask=live, other=float("-inf"),
                 eviction_policy="evict_first")
    in_range = (t >= 0) & (t < V)
    owner = c == tl.where(in_range, t // CHUNK, 0)     # the chunk holding the target
    if WRITE_GRAD:
        w = _row_weight(g_ptr, n_ptr, r, N_MEAN, HAS_IGNORE, REDUCTION)
    # exps as ex2(x * log2 e - shift): one FMA and one MUFU op each (`_exp2`)
    if PACK:
        held = _pack(xh, CHUNK, ASM)
        BF16: tl.constexpr = xh.dtype == tl.bfloat16
        m_mine = tl.maximum(tl.max(_unpack(held, 0, BF16, ASM), 0),
                            tl.max(_unpack(held, 1, BF16, ASM), 0))
        m_mine = tl.where(m_mine == float("-inf"), 0.0, m_mine)
        shift = m_mine * LOG2E
        s = (tl.sum(_exp2(tl.fma(_unpack(held, 0, BF16, ASM), LOG2E, -shift), ASM), 0)
             + tl.sum(_exp2(tl.fma(_unpack(held, 1, BF16, ASM), LOG2E, -shift), ASM), 0))
    else:
        m_mine = tl.max(xh.to(tl.float32), 0)
        m_mine = tl.where(m_mine == float("-inf"), 0.0, m_mine)
        e = _exp2(tl.fma(xh.to(tl.float32), LOG2E, -m_mine * LOG2E), ASM)
        s = tl.sum(e, 0)
    m = m_mine
    # the target's logit (its loss; its gradient is written once more): loaded after the
    # statistics (which wait for the chunk), so that it does not hold up the chunk's loads
    # (its address waits for the target), overlapping the meeting
    xt = tl.load(x_ptr + base + tl.minimum(tl.maximum(t, 0), V - 1), mask=valid & owner,
                 other=0.0).to(tl.float32)
    if WRITE_GRAD:
        tl.debug_barrier()      # every warp has read it before any writes over it (dx may be x)
    if S > 1:
        if valid:   # ignored rows: no program of the row publishes or waits
            m, s = _meet(pm_ptr, ps_ptr, sync_ptr, item, r, m, s, S, S_P2, WORD)
    lse = tl.where(in_range, m + tl.log(s), float("nan"))
    if STORE_LOSS:
        if owner:
            tl.store(loss_ptr + r, tl.where(valid, lse - xt, 0.0))
    if WRITE_GRAD:
        # an ignored row: weight 0 and every exp 0 (no select per logit)
        w = tl.where(valid, w, 0.0)
        shift = tl.where(valid, lse * LOG2E, float("inf"))
        if PACK:
            pair = tl.join(_exp2(tl.fma(_unpack(held, 0, BF16, ASM), LOG2E, -shift), ASM),
                           _exp2(tl.fma(_unpack(held, 1, BF16, ASM), LOG2E, -shift), ASM))
            d = w * tl.reshape(pair, (CHUNK,))
        else:
            d = e * (w * _exp2(m_mine * LOG2E - shift, ASM))
        tl.store(dx_ptr + base + cols, d.to(dx_ptr.dtype.element_ty), mask=cols < V,
                 eviction_policy="evict_first")
        # - w at the target, written over that one element (no compare per logit); the
        # barrier orders it after the store above, whichever thread made that
        tl.debug_barrier()
        if owner & in_range:
            if PACK:
                pt = _exp2(tl.fma(xt, LOG2E, -shift), ASM)
                dt = w * pt
            else:
                pt = _exp2(tl.fma(xt, LOG2E, -m_mine * LOG2E), ASM)
                dt = pt * (w * _exp2(m_mine * LOG2E - shift, ASM))
            tl.store(dx_ptr + base + t, (dt - w).to(dx_ptr.dtype.element_ty))


@triton.jit
def _exp2(x, ASM: tl.constexpr):
    """2 ** x, flushing results below float32's normal range to 0 (ASM: one MUFU op; the
    non-flushing form costs three more instructions)."""
    if ASM:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.exp2(x)
    return y


def split_plan(V: int, chunk=None, hold=None, itemsize=2):
    """(S, CHUNK) of the split-row kernel for rows of V logits, or None when V is too wide.
    Streamed chunks (hold false): S is a power of two (the configuration measured on the GPU):
    when V / CHUNK is not one, the chunks shrink (to a multiple of 64 logits) and a last chunk
    may be empty. Held chunks (hold true; default CE_SPLIT_HOLD for 16-bit logits, itemsize 2:
    float32 ones would take twice the registers): CHUNK is a power of two (one load),
    S = cdiv(V, CHUNK), the last chunk masked."""
    if V <= 0:
        return None
    hold = (CE_SPLIT_HOLD and itemsize == 2) if hold is None else hold
    if hold:
        chunk = next_pow2(chunk if chunk is not None else CE_HOLD_CHUNK)
        if _INTERPRET or chunk >= V:            # the interpreter: no program may wait on another
            return 1, next_pow2(V)
        n = triton.cdiv(V, chunk)
        return (n, chunk) if n <= CE_SPLIT_MAX else None
    chunk = chunk if chunk is not None else CE_SPLIT_CHUNK
    if _INTERPRET or not chunk or chunk >= V:   # the interpreter: no program may wait on another
        return 1, V
    n = triton.cdiv(V, chunk)
    if n > CE_SPLIT_MAX:
        return None
    S = next_pow2(n)
    if S != n:
        chunk = triton.cdiv(triton.cdiv(V, S), 64) * 64
    return S, chunk


def default_plan(V: int, itemsize: int):
    """(plan, hold) of the default one pass for rows of V logits of `itemsize` bytes: held
    chunks (CE_SPLIT_HOLD) for 16-bit logits where a row has at most CE_SPLIT_MAX of them,
    else streamed chunks; plan None: too wide for either (the persistent row kernel)."""
    if CE_SPLIT_HOLD and itemsize == 2:
        plan = split_plan(V, hold=True)
        if plan is not None:
            return plan, True
    return split_plan(V, hold=False), False


def ce_split(x2, t, plan, *, loss_rows=None, dx=None, grad=None, n_valid=None, reduction="mean",
             ignore_index=None, n_mean=None, block=None, num_warps=None, stages=None,
             evict=None, group=None, hold=None, maxnreg=None, pack=None, eager=None,
             meet=None, partials=None, flow=None, fast=None):
    """Launch the split-row one-pass kernel (arguments as `ce_rows`; plan from `split_plan`).

    Streamed chunks (`_ce_split_kernel`): evict, the cache hint of the first read of a chunk
    ("evict_last" or ""); group, running statistics per group of that many logits (0: one
    pair per BLOCK step); fast, the leaner exps (default CE_SPLIT_FAST; group > 0).
    hold: the chunks held in registers (`_ce_held_kernel`; the plan's chunk must be a power of
    two; default CE_SPLIT_HOLD where it is one and the logits are 16-bit); maxnreg, the
    register cap per thread (default CE_HOLD_MAXNREG; 0: none); pack, 16-bit logits held two
    to a register, else their float32 exps (default CE_HOLD_PACK); eager, the chunk loaded
    before its row's target is known (default CE_HOLD_EAGER); flow, on the persistent kernel
    of `loss_flow` where it applies (default CE_HOLD_FLOW; CE_FLOW_PROGRAMS programs per SM,
    the word meeting). block, stages, evict and group do not apply there.
    meet: how a row's programs meet (`_meet`), "counter" or "word" (default CE_SPLIT_MEET,
    held: CE_HOLD_MEET); partials: with "word", the int64 [R * S] words to meet through
    (default: all `WORD_NOT_YET`; a test may preset them)."""
    R, V = x2.shape
    S, chunk = plan
    pow2 = chunk == next_pow2(chunk)
    if hold is None:
        hold = CE_SPLIT_HOLD and pow2 and x2.element_size() == 2
    elif hold and not pow2:
        raise ValueError(f"held chunks are a power of two of logits, not {chunk}")
    if hold and (CE_HOLD_FLOW if flow is None else flow):
        from . import loss_flow as LF       # (it imports this module)
        if LF.flow_plan(V, chunk, x2.element_size()) == (S, chunk):
            return LF.ce_flow(x2, t, plan, loss_rows=loss_rows, dx=dx, grad=grad,
                              n_valid=n_valid, reduction=reduction, ignore_index=ignore_index,
                              n_mean=n_mean, programs_per_sm=CE_FLOW_PROGRAMS,
                              num_warps=num_warps or CE_HOLD_WARPS,
                              maxnreg=CE_HOLD_MAXNREG if maxnreg is None else maxnreg,
                              partials=partials)
    dev = x2.device
    if meet is None:
        meet = CE_HOLD_MEET if hold else CE_SPLIT_MEET
    word = meet == "word"
    sync = torch.zeros(R + 1, dtype=torch.int32, device=dev) if S > 1 else t
    if S > 1 and word:
        pm = ps = partials if partials is not None else \
            torch.full((R * S,), WORD_NOT_YET, dtype=torch.int64, device=dev)
    else:
        pm = torch.empty(R * S, dtype=torch.float32, device=dev) if S > 1 else sync
        ps = torch.empty(R * S, dtype=torch.float32, device=dev) if S > 1 else sync
    dummy = loss_rows if loss_rows is not None else (dx if dx is not None else x2)
    g = grad if grad is not None else dummy
    nv = n_valid if n_valid is not None else g
    has_ignore = ignore_index is not None
    args = (x2, t, g, nv, dummy if loss_rows is None else loss_rows, dummy if dx is None else dx,
            pm, ps, sync, R, V)
    flags = dict(HAS_IGNORE=has_ignore, REDUCTION=_REDUCTIONS[reduction],
                 STORE_LOSS=loss_rows is not None, WRITE_GRAD=dx is not None, S=S,
                 S_P2=next_pow2(S), WORD=word)
    ii = int(ignore_index) if has_ignore else 0
    if hold:
        maxnreg = CE_HOLD_MAXNREG if maxnreg is None else maxnreg
        _ce_held_kernel[(R * S,)](
            *args, float(n_mean or R), ii, **flags, CHUNK=chunk,
            PACK=(CE_HOLD_PACK if pack is None else pack) and x2.element_size() == 2
            and chunk >= 2, ASM=not _INTERPRET,
            EAGER=CE_HOLD_EAGER if eager is None else eager,
            num_warps=num_warps or CE_HOLD_WARPS,
            **({"maxnreg": maxnreg} if maxnreg and not _INTERPRET else {}))
        return
    _ce_split_kernel[(R * S,)](
        *args, chunk, float(n_mean or R), ii, **flags,
        BLOCK=block or CE_SPLIT_BLOCK, STAGES=stages or CE_SPLIT_STAGES,
        EVICT=CE_SPLIT_EVICT if evict is None else evict,
        GROUP=CE_SPLIT_GROUP if group is None else group,
        FAST=(CE_SPLIT_FAST if fast is None else fast) and (group or CE_SPLIT_GROUP) > 0,
        ASM=not _INTERPRET, num_warps=num_warps or CE_SPLIT_WARPS)
