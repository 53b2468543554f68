"""Softmax cross-entropy on Triton: forward, backward, and both in one pass (the kernels the
fused linear + cross-entropy of ``loss_linear.py`` runs on each token chunk, too).

The logits are streamed in ``BLOCK``-wide chunks with an online (running max, rescaled sum)
log-sum-exp; no logits-sized scratch buffer is ever allocated. Forward and backward: one program
per row, rows split over several programs (partial max/sum per split, combined afterwards) only
when there are too few rows to fill the GPU. One pass (loss and gradient together, and the
backward alone): ``loss_split.py`` cuts each row into chunks, one program each; a program
takes its chunk's partial (max, sum), meets the row's other programs, then writes
``w * (softmax - onehot)`` for its chunk -- streaming the chunk again (from L2 as far as it is
still there; on the H200 that pass took 1.5x a plain copy of the logits) or from registers
(one read). ``_ce_rows_kernel`` (persistent over rows) remains for rows too wide to split.

Numerics: the log-sum-exp, the per-row losses and the weights are float32 (the chunked float32
reduction lands ~1e-6 relative); the mean/sum over rows is accumulated in float64 in a
single-program reduction kernel, then stored as float32.

Targets outside ``[0, V)`` that are not ``ignore_index``: the kernels never read out of bounds
(the gather index is clamped) and give that row a NaN loss (so a mean/sum becomes NaN) and a NaN
gradient row; they cannot raise cheaply on the GPU. Set ``CHECK_TARGETS = True`` in this module
(or ``FUELGRAPH_CHECK_TARGETS=1`` in the environment) to have the Python wrapper run one torch
reduction over ``targets`` first and raise ``FuelGraphError`` instead (costs a device sync).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ....errors import fail
from ....registry.core import FusedOps
from ....registry.loss import (FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD,
                               FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD)
from ...base import kernel, row_cost
from .common import HALF_AND_F32, next_pow2, num_sms

CHECK_TARGETS = os.environ.get("FUELGRAPH_CHECK_TARGETS", "0") == "1"

_REDUCTIONS = {"mean": 0, "sum": 1, "none": 2}
# launch settings measured on an H200 (2026-11-30, bf16 8192x128256): forward BLOCK 4096, 4 warps,
# no software pipelining (1 stage) 4.25 TB/s; 3 stages 4.07-4.09, 2 stages 4.02; 8 warps
# 3.69-3.70 (3 stages) and 3.93 (1 stage); BLOCK 2048/8192 3.70-3.81; the evict_first hint made
# no difference. Backward (two passes over each row): 3 stages 2.85 (counting one read + one
# write) against 2.54-2.63 with 1 or 2 stages.
CE_BLOCK = 4096          # chunk of the V loop
CE_WARPS = 4
CE_FWD_STAGES = 1        # software-pipelining depth of the forward V loop
CE_STAGES = 3            # ... and of the backward V loops
CE_EVICT = ""
MIN_SPLIT_CHUNK = 16384  # fewest logits one split program streams
# the one-pass kernel (loss and/or dlogits, persistent over rows): untuned defaults, swept by
# bench/bench_cuda_loss.py. Rows in flight x row bytes is held to about CE_L2_BYTES so that the
# gradient pass re-reads each row from L2 instead of HBM (H200: 50 MB of L2).
CE_ROWS_BLOCK = 4096
CE_ROWS_WARPS = 8
CE_ROWS_STAGES = 3
CE_L2_BYTES = 24 << 20
CE_MAX_PROGRAMS_PER_SM = 8
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _row_valid(t, ignore_index, HAS_IGNORE: tl.constexpr):
    if HAS_IGNORE:
        valid = t != ignore_index
    else:
        valid = t == t
    return valid


@triton.jit
def _lse_chunk(x_ptr, base, start, end, BLOCK: tl.constexpr, EVICT: tl.constexpr,
               STAGES: tl.constexpr):
    """Running (max, sum exp(x - max)) over x[base + start : base + end]."""
    m = float("-inf")
    s = 0.0
    for off in tl.range(start, end, BLOCK, num_stages=STAGES):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < end, other=float("-inf"),
                    eviction_policy=EVICT).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
        m = m_new
    return m, s


@triton.jit
def _lse_chunk_grouped(x_ptr, base, start, end, BLOCK: tl.constexpr, EVICT: tl.constexpr,
                       STAGES: tl.constexpr, GROUP: tl.constexpr):
    """`_lse_chunk` with a running (max, sum) per group of GROUP consecutive logits (one
    thread's vector load), combined across the block once at the end: no cross-warp reduction
    (and no barrier) per BLOCK step, for one more exp per group."""
    m = tl.full((BLOCK // GROUP,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK // GROUP,), tl.float32)
    for off in tl.range(start, end, BLOCK, num_stages=STAGES):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < end, other=float("-inf"),
                    eviction_policy=EVICT).to(tl.float32)
        x = tl.reshape(x, (BLOCK // GROUP, GROUP))
        m_new = tl.maximum(m, tl.max(x, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), 1)
        m = m_new
    m_all = tl.max(m, 0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    return m_all, tl.sum(s * tl.exp(m - m_safe), 0)


@triton.jit
def _ce_fwd_kernel(x_ptr, t_ptr, loss_ptr, mpart_ptr, spart_ptr, V, CHUNK, NSPLIT, ignore_index,
                   HAS_IGNORE: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                   EVICT: tl.constexpr, STAGES: tl.constexpr):
    r = tl.program_id(0)
    sp = tl.program_id(1)
    t = tl.load(t_ptr + r)
    valid = _row_valid(t, ignore_index, HAS_IGNORE)
    base = r.to(tl.int64) * V
    start = sp * CHUNK
    end = tl.minimum(start + CHUNK, V)
    end = tl.where(valid, end, start)          # ignored rows stream nothing
    m, s = _lse_chunk(x_ptr, base, start, end, BLOCK, EVICT, STAGES)
    if SPLIT:
        tl.store(mpart_ptr + r * NSPLIT + sp, m)
        tl.store(spart_ptr + r * NSPLIT + sp, s)
    else:
        in_range = (t >= 0) & (t < V)
        tc = tl.minimum(tl.maximum(t, 0), V - 1)
        xt = tl.load(x_ptr + base + tc, mask=valid, other=0.0).to(tl.float32)
        loss = m + tl.log(s) - xt
        loss = tl.where(in_range, loss, float("nan"))
        tl.store(loss_ptr + r, tl.where(valid, loss, 0.0))


@triton.jit
def _combine_partials(mpart_ptr, spart_ptr, r, NSPLIT, BLOCK_SPLIT: tl.constexpr):
    idx = tl.arange(0, BLOCK_SPLIT)
    pm = tl.load(mpart_ptr + r * NSPLIT + idx, mask=idx < NSPLIT, other=float("-inf"))
    ps = tl.load(spart_ptr + r * NSPLIT + idx, mask=idx < NSPLIT, other=0.0)
    m = tl.max(pm, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(ps * tl.exp(pm - m_safe), 0)
    return m + tl.log(s)


@triton.jit
def _ce_combine_kernel(x_ptr, t_ptr, loss_ptr, mpart_ptr, spart_ptr, V, NSPLIT, ignore_index,
                       HAS_IGNORE: tl.constexpr, BLOCK_SPLIT: tl.constexpr):
    r = tl.program_id(0)
    t = tl.load(t_ptr + r)
    valid = _row_valid(t, ignore_index, HAS_IGNORE)
    lse = _combine_partials(mpart_ptr, spart_ptr, r, NSPLIT, BLOCK_SPLIT)
    in_range = (t >= 0) & (t < V)
    tc = tl.minimum(tl.maximum(t, 0), V - 1)
    xt = tl.load(x_ptr + r.to(tl.int64) * V + tc, mask=valid, other=0.0).to(tl.float32)
    loss = tl.where(in_range, lse - xt, float("nan"))
    tl.store(loss_ptr + r, tl.where(valid, loss, 0.0))


@triton.jit
def _ce_reduce_kernel(loss_ptr, t_ptr, out_ptr, R, ignore_index,
                      HAS_IGNORE: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), tl.float64)
    cnt = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, R, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < R
        acc += tl.load(loss_ptr + idx, mask=mask, other=0.0).to(tl.float64)
        if MEAN:
            t = tl.load(t_ptr + idx, mask=mask, other=0)
            valid = _row_valid(t, ignore_index, HAS_IGNORE) & mask
            cnt += valid.to(tl.int32)
    total = tl.sum(acc, 0)
    if MEAN:
        n = tl.sum(cnt, 0)
        total = tl.where(n > 0, total / tl.maximum(n, 1).to(tl.float64), 0.0)
    tl.store(out_ptr, total.to(tl.float32))


@triton.jit
def _ce_bwd_kernel(x_ptr, t_ptr, g_ptr, n_ptr, dx_ptr, mpart_ptr, spart_ptr, R, V, CHUNK, NSPLIT,
                   ignore_index, HAS_IGNORE: tl.constexpr, REDUCTION: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SPLIT: tl.constexpr,
                   STAGES: tl.constexpr):
    r = tl.program_id(0)
    sp = tl.program_id(1)
    t = tl.load(t_ptr + r)
    valid = _row_valid(t, ignore_index, HAS_IGNORE)
    base = r.to(tl.int64) * V
    w = _row_weight(g_ptr, n_ptr, r, R, HAS_IGNORE, REDUCTION)
    if SPLIT:
        lse = _combine_partials(mpart_ptr, spart_ptr, r, NSPLIT, BLOCK_SPLIT)
    else:
        # first pass keeps the row in L2 for the second (the write pass streams it out)
        m, s = _lse_chunk(x_ptr, base, 0, tl.where(valid, V, 0), BLOCK, "", STAGES)
        lse = m + tl.log(s)
    in_range = (t >= 0) & (t < V)
    lse = tl.where(in_range, lse, float("nan"))
    start = sp * CHUNK
    _write_grad(x_ptr, dx_ptr, base, start, tl.minimum(start + CHUNK, V), t, lse, w, valid, True,
                BLOCK, STAGES)


@triton.jit
def _row_weight(g_ptr, n_ptr, r, N_MEAN, HAS_IGNORE: tl.constexpr, REDUCTION: tl.constexpr):
    """The gradient weight of row r: grad[r] (none), grad (sum), grad / N_valid (mean)."""
    if REDUCTION == 2:
        w = tl.load(g_ptr + r).to(tl.float32)
    else:
        w = tl.load(g_ptr).to(tl.float32)
    if REDUCTION == 0:
        if HAS_IGNORE:
            w = w / tl.maximum(tl.load(n_ptr), 1).to(tl.float32)
        else:
            w = w / N_MEAN
    return w


@triton.jit
def _write_grad(x_ptr, dx_ptr, base, start, end, t, lse, w, valid, live, BLOCK: tl.constexpr,
                STAGES: tl.constexpr):
    """dx[base + start : base + end] = w * (softmax - onehot(t)) (0 where not valid), streaming
    the logits once more (evict_first: nothing reads them again)."""
    for off in tl.range(start, end, BLOCK, num_stages=STAGES):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < end
        x = tl.load(x_ptr + base + cols, mask=mask & valid, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        d = w * (tl.exp(x - lse) - (cols == t).to(tl.float32))
        d = tl.where(valid, d, 0.0)
        tl.store(dx_ptr + base + cols, d.to(dx_ptr.dtype.element_ty), mask=mask & live,
                 eviction_policy="evict_first")


@triton.jit
def _ce_rows_kernel(x_ptr, t_ptr, g_ptr, n_ptr, loss_ptr, dx_ptr, R, V, NPROG, ITERS, N_MEAN,
                    ignore_index, HAS_IGNORE: tl.constexpr, REDUCTION: tl.constexpr,
                    STORE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
                    STAGES: tl.constexpr):
    """Persistent over rows (program p takes rows p, p + NPROG, ...; ITERS = cdiv(R, NPROG)):
    per row one streaming pass for the running (max, sum) -- loads marked evict_last so the row
    stays in L2 -- then, with WRITE_GRAD, a second pass that re-reads the row (from L2) and
    writes w * (softmax - onehot) into dx (which may be x itself: every element is read before
    the same thread overwrites it). N_MEAN divides "mean" when no row can be ignored."""
    pid = tl.program_id(0)
    for i in range(0, ITERS):
        r = pid + i * NPROG
        live = r < R
        r = tl.minimum(r, R - 1)
        t = tl.load(t_ptr + r)
        valid = _row_valid(t, ignore_index, HAS_IGNORE) & live
        base = r.to(tl.int64) * V
        m, s = _lse_chunk(x_ptr, base, 0, tl.where(valid, V, 0), BLOCK, "evict_last", STAGES)
        in_range = (t >= 0) & (t < V)
        lse = tl.where(in_range, m + tl.log(s), float("nan"))
        if STORE_LOSS:
            tc = tl.minimum(tl.maximum(t, 0), V - 1)
            xt = tl.load(x_ptr + base + tc, mask=valid, other=0.0).to(tl.float32)
            tl.store(loss_ptr + r, tl.where(valid, lse - xt, 0.0), mask=live)
        if WRITE_GRAD:
            w = _row_weight(g_ptr, n_ptr, r, N_MEAN, HAS_IGNORE, REDUCTION)
            _write_grad(x_ptr, dx_ptr, base, 0, V, t, lse, w, valid, live, BLOCK, STAGES)


# ---------------------------------------------------------------------------------------------


def _check_targets(op, t, V, ignore_index):
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return              # a host sync cannot be captured into a CUDA graph
    bad = (t < 0) | (t >= V)
    if ignore_index is not None:
        bad &= t != ignore_index
    if bool(bad.any()):
        raise fail(op, f"a target is outside [0, {V}) and is not ignore_index={ignore_index}")


def _split_plan(R: int, V: int, device: torch.device, splits=None):
    """(NSPLIT, CHUNK): split rows over programs only when R alone cannot fill the GPU."""
    if splits is None:
        want = 4 * num_sms(device)
        splits = 1 if R >= want else min(triton.cdiv(V, MIN_SPLIT_CHUNK), triton.cdiv(want, R))
    splits = max(1, min(int(splits), triton.cdiv(V, CE_BLOCK)))
    chunk = triton.cdiv(triton.cdiv(V, splits), CE_BLOCK) * CE_BLOCK
    return triton.cdiv(V, chunk), chunk


def _fsce_forward(logits, targets, reduction, ignore_index, *, splits=None, block=None,
                  num_warps=None, stages=CE_FWD_STAGES, evict=CE_EVICT):
    x = logits.contiguous()
    V = x.shape[-1]
    R = x.numel() // V if V > 0 else targets.numel()
    t = targets.reshape(-1).to(torch.int64).contiguous()
    dev = x.device
    red = _REDUCTIONS[reduction]
    if R == 0 or V == 0:
        if red == 2:
            return torch.zeros(targets.shape, dtype=torch.float32, device=dev)
        return torch.zeros((), dtype=torch.float32, device=dev)
    has_ignore = ignore_index is not None
    ii = int(ignore_index) if has_ignore else 0
    blk = block or CE_BLOCK
    nw = num_warps or CE_WARPS
    nsplit, chunk = _split_plan(R, V, dev, splits)
    loss = torch.empty(R, dtype=torch.float32, device=dev)
    if nsplit == 1:
        _ce_fwd_kernel[(R, 1)](x, t, loss, loss, loss, V, V, 1, ii, HAS_IGNORE=has_ignore,
                               SPLIT=False, BLOCK=blk, EVICT=evict, STAGES=stages,
                               num_warps=nw)
    else:
        mpart = torch.empty(R * nsplit, dtype=torch.float32, device=dev)
        spart = torch.empty(R * nsplit, dtype=torch.float32, device=dev)
        _ce_fwd_kernel[(R, nsplit)](x, t, loss, mpart, spart, V, chunk, nsplit, ii,
                                    HAS_IGNORE=has_ignore, SPLIT=True, BLOCK=blk, EVICT=evict,
                                    STAGES=stages, num_warps=nw)
        _ce_combine_kernel[(R,)](x, t, loss, mpart, spart, V, nsplit, ii, HAS_IGNORE=has_ignore,
                                 BLOCK_SPLIT=next_pow2(nsplit), num_warps=1)
    if red == 2:
        return loss.reshape(targets.shape)
    out = torch.empty((), dtype=torch.float32, device=dev)
    blk, nw = _one_program_launch(R)
    _ce_reduce_kernel[(1,)](loss, t, out, R, ii, HAS_IGNORE=has_ignore, MEAN=(red == 0),
                            BLOCK=blk, num_warps=nw)
    return out


def _fsce_backward(logits, targets, grad, reduction, ignore_index, *, splits=None, block=None,
                   num_warps=None, stages=CE_STAGES):
    x = logits.contiguous()
    V = x.shape[-1]
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx
    R = x.numel() // V
    t = targets.reshape(-1).to(torch.int64).contiguous()
    dev = x.device
    red = _REDUCTIONS[reduction]
    g = torch.as_tensor(grad, device=dev)
    g = g.to(torch.float32).reshape(-1).contiguous()
    has_ignore = ignore_index is not None
    ii = int(ignore_index) if has_ignore else 0
    n_valid = (t != ii).sum() if (red == 0 and has_ignore) else g
    from . import loss_split as LS      # (it imports this module)
    plan, hold = LS.default_plan(V, x.element_size()) \
        if splits is None and block is None and R >= num_sms(dev) else (None, False)
    if plan is not None:
        LS.ce_split(x.view(R, V), t, plan, hold=hold, dx=dx.view(R, V), grad=g,
                 n_valid=n_valid if (red == 0 and has_ignore) else None, reduction=reduction,
                 ignore_index=ignore_index)
        return dx
    blk = block or CE_BLOCK
    nw = num_warps or CE_WARPS
    nsplit, chunk = _split_plan(R, V, dev, splits)
    if nsplit == 1:
        _ce_bwd_kernel[(R, 1)](x, t, g, n_valid, dx, g, g, R, V, V, 1, ii,
                               HAS_IGNORE=has_ignore, REDUCTION=red, SPLIT=False, BLOCK=blk,
                               BLOCK_SPLIT=1, STAGES=stages, num_warps=nw)
    else:
        mpart = torch.empty(R * nsplit, dtype=torch.float32, device=dev)
        spart = torch.empty(R * nsplit, dtype=torch.float32, device=dev)
        _ce_fwd_kernel[(R, nsplit)](x, t, mpart, mpart, spart, V, chunk, nsplit, ii,
                                    HAS_IGNORE=has_ignore, SPLIT=True, BLOCK=blk, EVICT="",
                                    STAGES=stages, num_warps=nw)
        _ce_bwd_kernel[(R, nsplit)](x, t, g, n_valid, dx, mpart, spart, R, V, chunk, nsplit, ii,
                                    HAS_IGNORE=has_ignore, REDUCTION=red, SPLIT=True, BLOCK=blk,
                                    BLOCK_SPLIT=next_pow2(nsplit), STAGES=stages, num_warps=nw)
    return dx


@kernel(FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY, "cuda", dtypes=HALF_AND_F32, cost=row_cost(6, 2))
def fused_softmax_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, reduction: str,
                                ignore_index: int | None) -> torch.Tensor:
    """Softmax cross-entropy of ``logits [..., V]`` against int64 ``targets [...]``.

    ``reduction``: "mean" (over non-ignored rows; 0 when all are ignored), "sum" or "none"
    (shape ``targets.shape``, 0 on ignored rows). Output is float32.
    """
    V = logits.shape[-1]
    if CHECK_TARGETS and targets.numel() and V:
        _check_targets("fused_softmax_cross_entropy", targets, V, ignore_index)
    return _fsce_forward(logits, targets, reduction, ignore_index)


@kernel(FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD, "cuda", dtypes=HALF_AND_F32, cost=row_cost(6, 2))
def fused_softmax_cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor,
                                         grad, *, reduction: str,
                                         ignore_index: int | None) -> torch.Tensor:
    """``dlogits = w_r * (softmax(logits_r) - onehot(t_r))`` in the logits dtype, with
    ``w_r = grad / N_valid`` (mean), ``grad`` (sum) or ``grad[r]`` (none); 0 on ignored rows."""
    V = logits.shape[-1]
    if CHECK_TARGETS and targets.numel() and V:
        _check_targets("fused_softmax_cross_entropy_backward", targets, V, ignore_index)
    return _fsce_backward(logits, targets, grad, reduction, ignore_index)


# --- one pass: loss and dlogits ----------------------------------------------------------------


def rows_programs(R: int, V: int, itemsize: int, device: torch.device, programs=None) -> int:
    """Programs of the persistent row kernel: enough rows in flight to fill every SM, few enough
    (rows x row bytes <= CE_L2_BYTES) that the second pass over a row finds it in L2."""
    if programs:
        return max(1, min(R, int(programs)))
    sms = num_sms(device)
    by_l2 = CE_L2_BYTES // max(1, V * itemsize)
    return max(1, min(R, max(sms, min(by_l2, CE_MAX_PROGRAMS_PER_SM * sms))))


def ce_rows(x2, t, *, loss_rows=None, dx=None, grad=None, n_valid=None, reduction="mean",
            ignore_index=None, n_mean=None, programs=None, block=None, num_warps=None,
            stages=None):
    """One pass over ``x2 [R, V]`` (contiguous) and int64 ``t [R]``: the split-row kernel when
    the rows are narrow enough and no persistent-kernel launch setting is given, else the
    persistent row kernel.

    loss_rows: float32 [R] for the per-row losses (or None); dx: [R, V] for
    ``w * (softmax - onehot)`` (may be ``x2`` itself; or None). grad: float32 0-d/[1] (mean,
    sum) or [R] (none); n_valid: int 0-d device tensor, the mean's divisor when rows can be
    ignored; n_mean: the mean's divisor otherwise (default R)."""
    R, V = x2.shape
    if R == 0:
        return
    from . import loss_split as LS      # (it imports this module)
    plan, hold = LS.default_plan(V, x2.element_size()) \
        if programs is None and block is None and stages is None else (None, False)
    if plan is not None:
        return LS.ce_split(x2, t, plan, hold=hold, loss_rows=loss_rows, dx=dx, grad=grad,
                           n_valid=n_valid, reduction=reduction, ignore_index=ignore_index,
                           n_mean=n_mean, num_warps=num_warps)
    has_ignore = ignore_index is not None
    red = _REDUCTIONS[reduction]
    dummy = loss_rows if loss_rows is not None else (dx if dx is not None else x2)
    g = grad if grad is not None else dummy
    nv = n_valid if n_valid is not None else g
    nprog = rows_programs(R, V, x2.element_size(), x2.device, programs)
    _ce_rows_kernel[(nprog,)](
        x2, t, g, nv, dummy if loss_rows is None else loss_rows, dummy if dx is None else dx,
        R, V, nprog, triton.cdiv(R, nprog), float(n_mean or R), int(ignore_index) if has_ignore else 0,
        HAS_IGNORE=has_ignore, REDUCTION=red, STORE_LOSS=loss_rows is not None,
        WRITE_GRAD=dx is not None, BLOCK=block or CE_ROWS_BLOCK, STAGES=stages or CE_ROWS_STAGES,
        num_warps=num_warps or CE_ROWS_WARPS)


def reduce_rows(loss_rows, t, reduction, ignore_index, shape):
    """The loss from float32 per-row losses (0 on ignored rows): float64 sum, float32 result."""
    if reduction == "none":
        return loss_rows.reshape(shape)
    has_ignore = ignore_index is not None
    out = torch.empty((), dtype=torch.float32, device=loss_rows.device)
    if loss_rows.numel() == 0:
        return out.zero_()
    blk, nw = _one_program_launch(loss_rows.numel())
    _ce_reduce_kernel[(1,)](loss_rows, t, out, loss_rows.numel(),
                            int(ignore_index) if has_ignore else 0, HAS_IGNORE=has_ignore,
                            MEAN=(reduction == "mean"), BLOCK=blk, num_warps=nw)
    return out


def _one_program_launch(R: int):
    """(BLOCK, warps) of a one-program pass over R rows: all of them in one step up to 8192
    (one round trip to memory instead of R / 1024; ~10 us less at 8192 rows)."""
    blk = min(max(next_pow2(R), 128), 8192)
    return blk, 8 if blk >= 4096 else 4


def grad_weights_inputs(grad, t, reduction, ignore_index, device):
    """(grad as float32 flat, n_valid device tensor or None) for the row kernel."""
    g = torch.as_tensor(grad, device=device).to(torch.float32).reshape(-1).contiguous()
    n_valid = None
    if reduction == "mean" and ignore_index is not None:
        n_valid = torch.empty((), dtype=torch.int64, device=t.device)
        blk, nw = _one_program_launch(t.numel())
        _count_valid_kernel[(1,)](t, n_valid, t.numel(), int(ignore_index), BLOCK=blk,
                                  num_warps=nw)       # one kernel, not a compare and a sum
    return g, n_valid


@triton.jit
def _count_valid_kernel(t_ptr, out_ptr, R, ignore_index, BLOCK: tl.constexpr):
    """out = the number of t[:R] that are not ignore_index (int64)."""
    cnt = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, R, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        t = tl.load(t_ptr + idx, mask=idx < R, other=ignore_index)
        cnt += (t != ignore_index).to(tl.int32)
    tl.store(out_ptr, tl.sum(cnt, 0).to(tl.int64))


def _fsce_fwd_bwd(logits, targets, grad, reduction, ignore_index, **launch):
    x = logits.contiguous()
    V = x.shape[-1]
    dx = torch.empty_like(x)
    R = x.numel() // V if V else targets.numel()
    t = targets.reshape(-1).to(torch.int64).contiguous()
    if R == 0 or V == 0:
        return _fsce_forward(x, targets, reduction, ignore_index), dx.zero_()
    if R < num_sms(x.device) and not launch:     # too few rows for one program each: split V
        return (_fsce_forward(x, targets, reduction, ignore_index),
                _fsce_backward(x, targets, grad, reduction, ignore_index))
    g, n_valid = grad_weights_inputs(grad, t, reduction, ignore_index, x.device)
    loss_rows = torch.empty(R, dtype=torch.float32, device=x.device)
    ce_rows(x.view(R, V), t, loss_rows=loss_rows, dx=dx.view(R, V), grad=g, n_valid=n_valid,
            reduction=reduction, ignore_index=ignore_index, **launch)
    return reduce_rows(loss_rows, t, reduction, ignore_index, targets.shape), dx


@kernel(FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD, "cuda", dtypes=HALF_AND_F32, cost=row_cost(8, 2))
def fused_softmax_cross_entropy_fwd_bwd(logits: torch.Tensor, targets: torch.Tensor, grad, *,
                                        reduction: str, ignore_index: int | None):
    """``(loss, dlogits)`` of the softmax cross-entropy. Same results as
    ``fused_softmax_cross_entropy`` and ``fused_softmax_cross_entropy_backward``; float32,
    bfloat16 and float16 logits. One pass (``loss_split``): 16-bit logits are read once, held
    in registers (float32 ones, and rows of more than CE_SPLIT_MAX held chunks, are streamed
    twice, the second read mostly from L2; rows wider than ``CE_SPLIT_MAX * CE_SPLIT_CHUNK``
    take the persistent kernel, which re-reads a row from L2)."""
    op = "fused_softmax_cross_entropy_fwd_bwd"
    V = logits.shape[-1]
    if CHECK_TARGETS and targets.numel() and V:
        _check_targets(op, targets, V, ignore_index)
    return _fsce_fwd_bwd(logits, targets, grad, reduction, ignore_index)


one_pass_fwd_bwd = _fsce_fwd_bwd
