"""Softmax cross-entropy, one pass, persistent programs that keep two work items in registers
(`_ce_flow_kernel`): the variant of the split-row kernels of ``loss_split.py`` in which a program's
next chunk is already loading while it waits for the other programs of its current chunk's
row. A candidate of the GPU sweep (bench/bench_cuda_loss.py), not a default.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_pow2, num_sms
from .loss import _INTERPRET, _REDUCTIONS, _row_valid, _row_weight
from .loss_split import LOG2E, WORD_NOT_YET, _exp2, _publish_word, _unpack, _wait_words

#: -inf in both halves of a packed pair: bf16, fp16
_NEG_INF_PAIR_BF16 = tl.constexpr(-8323200)      # 0xFF80FF80
_NEG_INF_PAIR_F16 = tl.constexpr(-67044352)      # 0xFC00FC00


@triton.jit
def _flow_load(x_ptr, item, n_items, V, S: tl.constexpr, CHUNK: tl.constexpr,
               PACK: tl.constexpr, BF16: tl.constexpr):
    """Work item `item`'s chunk as loaded, not yet used (its load stays in flight): PACK,
    CHUNK // 2 int32 pairs of 16-bit logits (V even); else CHUNK float32. -inf past the row
    and for items past the last."""
    it = tl.minimum(item, n_items - 1)
    r = it // S
    c = it % S
    if PACK:
        half = c * (CHUNK // 2) + tl.arange(0, CHUNK // 2)
        pairs = x_ptr.to(tl.pointer_type(tl.int32)) + r.to(tl.int64) * (V // 2)
        if BF16:
            neg: tl.constexpr = _NEG_INF_PAIR_BF16
        else:
            neg: tl.constexpr = _NEG_INF_PAIR_F16
        raw = tl.load(pairs + half, mask=(half < V // 2) & (item < n_items), other=neg,
                      eviction_policy="evict_first")
    else:
        cols = c * CHUNK + tl.arange(0, CHUNK)
        raw = tl.load(x_ptr + r.to(tl.int64) * V + cols, mask=(cols < V) & (item < n_items),
                      other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
    return raw


@triton.jit
def _flow_stats(raw, PACK: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr):
    """(max, sum exp(x - max)) of a chunk from `_flow_load` (max 0 for an all -inf chunk)."""
    if PACK:
        m = tl.maximum(tl.max(_unpack(raw, 0, BF16, ASM), 0), tl.max(_unpack(raw, 1, BF16, ASM), 0))
        m = tl.where(m == float("-inf"), 0.0, m)
        shift = m * LOG2E
        s = (tl.sum(_exp2(tl.fma(_unpack(raw, 0, BF16, ASM), LOG2E, -shift), ASM), 0)
             + tl.sum(_exp2(tl.fma(_unpack(raw, 1, BF16, ASM), LOG2E, -shift), ASM), 0))
    else:
        m = tl.max(raw, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(_exp2(tl.fma(raw, LOG2E, -m * LOG2E), ASM), 0)
    return m, s


@triton.jit
def _ce_flow_kernel(x_ptr, t_ptr, g_ptr, n_ptr, loss_ptr, dx_ptr, pm_ptr, sync_ptr, R, V, N_MEAN,
                    ignore_index, HAS_IGNORE: tl.constexpr, REDUCTION: tl.constexpr,
                    STORE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, S: tl.constexpr,
                    S_P2: tl.constexpr, CHUNK: tl.constexpr, PACK: tl.constexpr,
                    BF16: tl.constexpr, ASM: tl.constexpr):
    """Persistent over work items (row r = item // S, chunk item % S of CHUNK logits, a power
    of two), taken from the ticket counter sync_ptr[R]; the programs of a row meet through
    partial words (pm_ptr, int64 [R * S] preset to WORD_NOT_YET: `_publish_word`,
    `_wait_words`). Per step a program holds its current item (statistics published) and
    the next one, whose load is issued before the wait on the current row:

        next load in flight -> wait for the current row -> write its gradient -> next ticket
        taken -> statistics of the next item published -> it becomes the current one

    No deadlock with more programs than a row has chunks: while a program waits for row q,
    every item of row q it holds is published (a next item of the same row is published
    before the wait), the others belong to later rows, and a ticket is only taken after a
    wait; so the earliest unfinished row always completes. PACK: 16-bit logits of an even V
    loaded as int32 pairs (the held form; widened with `_unpack`); else float32."""
    n_items = R * S
    if WRITE_GRAD:
        w = _row_weight(g_ptr, n_ptr, 0, N_MEAN, HAS_IGNORE, REDUCTION)   # "none": per row
    cur = tl.atomic_add(sync_ptr + R, 1, sem="relaxed")
    held = _flow_load(x_ptr, cur, n_items, V, S, CHUNK, PACK, BF16)
    t = tl.load(t_ptr + tl.minimum(cur, n_items - 1) // S)
    if cur < n_items:
        if _row_valid(t, ignore_index, HAS_IGNORE):
            m, s = _flow_stats(held, PACK, BF16, ASM)
            _publish_word(pm_ptr, cur, m, s)
    nxt = tl.atomic_add(sync_ptr + R, 1, sem="relaxed")
    while cur < n_items:
        raw = _flow_load(x_ptr, nxt, n_items, V, S, CHUNK, PACK, BF16)     # in flight
        t_next = tl.load(t_ptr + tl.minimum(nxt, n_items - 1) // S)
        r = cur // S
        c = cur % S
        valid = _row_valid(t, ignore_index, HAS_IGNORE)
        same = (nxt // S == r) & (nxt < n_items)
        if same & valid:            # the next item is in this row: published before the wait
            m, s = _flow_stats(raw, PACK, BF16, ASM)
            _publish_word(pm_ptr, nxt, m, s)
        m = 0.0
        s = 1.0
        if valid:
            m, s = _wait_words(pm_ptr, r, S, S_P2)
        in_range = (t >= 0) & (t < V)
        lse = tl.where(in_range, m + tl.log(s), float("nan"))
        base = r.to(tl.int64) * V
        owner = c == tl.where(in_range, t // CHUNK, 0)     # the chunk holding the target
        xt = tl.load(x_ptr + base + tl.minimum(tl.maximum(t, 0), V - 1), mask=valid & owner,
                     other=0.0).to(tl.float32)
        if WRITE_GRAD:
            tl.debug_barrier()  # every warp has read it before any writes over it (dx may be x)
        if STORE_LOSS:
            if owner:
                tl.store(loss_ptr + r, tl.where(valid, lse - xt, 0.0))
        if WRITE_GRAD:
            wr = w
            if REDUCTION == 2:
                wr = _row_weight(g_ptr, n_ptr, r, N_MEAN, HAS_IGNORE, REDUCTION)
            # as in `_ce_held_kernel`: an ignored row through its weight and shift, the
            # target's -w written over that one element after a barrier
            wr = tl.where(valid, wr, 0.0)
            shift = tl.where(valid, lse * LOG2E, float("inf"))
            if PACK:
                pair = tl.join(_exp2(tl.fma(_unpack(held, 0, BF16, ASM), LOG2E, -shift), ASM),
                               _exp2(tl.fma(_unpack(held, 1, BF16, ASM), LOG2E, -shift), ASM))
                d = wr * tl.reshape(pair, (CHUNK,))
            else:
                d = wr * _exp2(tl.fma(held, LOG2E, -shift), ASM)
            cols = c * CHUNK + tl.arange(0, CHUNK)
            tl.store(dx_ptr + base + cols, d.to(dx_ptr.dtype.element_ty), mask=cols < V,
                     eviction_policy="evict_first")
            tl.debug_barrier()
            if owner & in_range:
                dt = wr * _exp2(tl.fma(xt, LOG2E, -shift), ASM)
                tl.store(dx_ptr + base + t, (dt - wr).to(dx_ptr.dtype.element_ty))
        following = tl.atomic_add(sync_ptr + R, 1, sem="relaxed")
        if (nxt < n_items) & ~same:
            if _row_valid(t_next, ignore_index, HAS_IGNORE):
                m, s = _flow_stats(raw, PACK, BF16, ASM)
                _publish_word(pm_ptr, nxt, m, s)
        held = raw
        t = t_next
        cur = nxt
        nxt = following


def flow_plan(V: int, chunk: int, itemsize: int):
    """(S, CHUNK) of the flow kernel (CHUNK a power of two), or None: more than 32 chunks a
    row, or 16-bit logits of an odd V (they are loaded in pairs)."""
    chunk = next_pow2(min(chunk, V))
    S = triton.cdiv(V, chunk)
    if S > 32 or (itemsize == 2 and V % 2):
        return None
    return S, chunk


def ce_flow(x2, t, plan, *, loss_rows=None, dx=None, grad=None, n_valid=None, reduction="mean",
            ignore_index=None, n_mean=None, programs_per_sm=4, num_warps=4, maxnreg=0,
            partials=None):
    """Launch `_ce_flow_kernel` (arguments as `loss_split.ce_split`; plan from `flow_plan`) on
    programs_per_sm programs per SM (at least S + 1 programs in all; the interpreter: 2)."""
    R, V = x2.shape
    S, chunk = plan
    dev = x2.device
    sync = torch.zeros(R + 1, dtype=torch.int32, device=dev)
    words = partials if partials is not None else \
        torch.full((R * S,), WORD_NOT_YET, dtype=torch.int64, device=dev)
    dummy = loss_rows if loss_rows is not None else (dx if dx is not None else x2)
    g = grad if grad is not None else dummy
    nv = n_valid if n_valid is not None else g
    has_ignore = ignore_index is not None
    programs = 2 if _INTERPRET else max(S + 1, programs_per_sm * num_sms(dev))
    pack = x2.element_size() == 2 and chunk >= 2
    _ce_flow_kernel[(min(programs, R * S),)](
        x2, t, g, nv, dummy if loss_rows is None else loss_rows, dummy if dx is None else dx,
        words, sync, R, V, float(n_mean or R), int(ignore_index) if has_ignore else 0,
        HAS_IGNORE=has_ignore, REDUCTION=_REDUCTIONS[reduction],
        STORE_LOSS=loss_rows is not None, WRITE_GRAD=dx is not None, S=S, S_P2=next_pow2(S),
        CHUNK=chunk, PACK=pack, BF16=x2.dtype == torch.bfloat16, ASM=not _INTERPRET,
        num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg and not _INTERPRET else {}))
