"""ROPE forward and backward on Triton, rotate-half and interleaved (GPT-J) layouts.

``x`` is ``[..., S, D]`` (D even) and ``cos``/``sin`` are tables ending in ``[S, D]`` that
broadcast to x: one ``[S, D]`` table for every leading slice, or per-batch tables whose non-1
leading dims are one contiguous run of x's leading dims (HF's ``[B, 1, S, D]`` for
``[B, H, S, D]``; slice ``o`` reads table block ``(o // inner) % count``). Other layouts are
declared unsupported and run through the recipe. Tables need not repeat their halves (or pair
entries): the backward uses the general transpose of the forward.

rotate-half (``interleaved=False``), ``h = D/2``, ``i < h``::

    y[i]   = x[i]   cos[i]   - x[i+h] sin[i]          dx[i]   = g[i]   cos[i]   + g[i+h] sin[i+h]
    y[i+h] = x[i+h] cos[i+h] + x[i]   sin[i+h]        dx[i+h] = g[i+h] cos[i+h] - g[i]   sin[i]

interleaved (``interleaved=True``), pairs ``(2i, 2i+1)``::

    y[2i]   = x[2i]   cos[2i]   - x[2i+1] sin[2i]     dx[2i]   = g[2i]   cos[2i]   + g[2i+1] sin[2i+1]
    y[2i+1] = x[2i+1] cos[2i+1] + x[2i]   sin[2i+1]   dx[2i+1] = g[2i+1] cos[2i+1] - g[2i]   sin[2i]

Each program owns ``BLOCK_S`` positions and ``OUTER_PER`` leading (batch*head) slices: with one
shared table it loads its cos/sin rows once and reuses them for every slice, so table traffic is
``1/OUTER_PER`` of the ``x`` traffic (per-batch tables are loaded per slice; neighbouring heads
hit the same rows in cache). Compute is float32; output dtype = dtype of ``x``/``grad``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ....registry.core import FusedOps
from ...base import kernel, row_cost
from .common import HALF_AND_F32, next_pow2


@triton.jit
def _rope_half_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, OUTER, S, D, H, N_SBLK, T_INNER, T_COUNT,
                      BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, OUTER_PER: tl.constexpr,
                      BACKWARD: tl.constexpr, PER_SLICE_TABLES: tl.constexpr):
    pid = tl.program_id(0)
    sb = pid % N_SBLK
    ob = pid // N_SBLK
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    h = tl.arange(0, BLOCK_H)
    tmask = (s < S)[:, None] & (h < H)[None, :]
    toff = s.to(tl.int64)[:, None] * D + h[None, :]
    if not PER_SLICE_TABLES:
        c1 = tl.load(cos_ptr + toff, mask=tmask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + toff + H, mask=tmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + toff, mask=tmask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + toff + H, mask=tmask, other=0.0).to(tl.float32)
    for i in tl.static_range(OUTER_PER):
        o = ob * OUTER_PER + i
        mask = tmask & (o < OUTER)
        if PER_SLICE_TABLES:
            tt = ((o // T_INNER) % T_COUNT).to(tl.int64) * S * D + toff
            c1 = tl.load(cos_ptr + tt, mask=mask, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + tt + H, mask=mask, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + tt, mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + tt + H, mask=mask, other=0.0).to(tl.float32)
        off = o.to(tl.int64) * S * D + toff
        a1 = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        a2 = tl.load(x_ptr + off + H, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            b1 = a1 * c1 + a2 * s2
            b2 = a2 * c2 - a1 * s1
        else:
            b1 = a1 * c1 - a2 * s1
            b2 = a2 * c2 + a1 * s2
        tl.store(y_ptr + off, b1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + off + H, b2.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_pair_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, OUTER, S, D, N_SBLK, T_INNER, T_COUNT,
                      BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, OUTER_PER: tl.constexpr,
                      BACKWARD: tl.constexpr, PER_SLICE_TABLES: tl.constexpr):
    pid = tl.program_id(0)
    sb = pid % N_SBLK
    ob = pid // N_SBLK
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    tmask = (s < S)[:, None] & (d < D)[None, :]
    toff = s.to(tl.int64)[:, None] * D + d[None, :]
    if not PER_SLICE_TABLES:
        c = tl.load(cos_ptr + toff, mask=tmask, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + toff, mask=tmask, other=0.0).to(tl.float32)
        ce, co = tl.split(tl.reshape(c, (BLOCK_S, BLOCK_D // 2, 2)))
        se, so = tl.split(tl.reshape(sn, (BLOCK_S, BLOCK_D // 2, 2)))
    for i in tl.static_range(OUTER_PER):
        o = ob * OUTER_PER + i
        mask = tmask & (o < OUTER)
        if PER_SLICE_TABLES:
            tt = ((o // T_INNER) % T_COUNT).to(tl.int64) * S * D + toff
            c = tl.load(cos_ptr + tt, mask=mask, other=0.0).to(tl.float32)
            sn = tl.load(sin_ptr + tt, mask=mask, other=0.0).to(tl.float32)
            ce, co = tl.split(tl.reshape(c, (BLOCK_S, BLOCK_D // 2, 2)))
            se, so = tl.split(tl.reshape(sn, (BLOCK_S, BLOCK_D // 2, 2)))
        off = o.to(tl.int64) * S * D + toff
        a = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        ae, ao = tl.split(tl.reshape(a, (BLOCK_S, BLOCK_D // 2, 2)))
        if BACKWARD:
            be = ae * ce + ao * so
            bo = ao * co - ae * se
        else:
            be = ae * ce - ao * se
            bo = ao * co + ae * so
        b = tl.reshape(tl.join(be, bo), (BLOCK_S, BLOCK_D))
        tl.store(y_ptr + off, b.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------


def _rope_config(s: int, d: int, outer: int):
    """(BLOCK_S, OUTER_PER, num_warps): ~2048 x elements per unrolled step (two half tiles of
    1024 for rotate-half), 8 elements (16 bytes of bf16) per thread and load, 2 slices a program
    (H200 2026-11-30, bf16 8x32x4096x128, q and k: 2 slices 4.05 TB/s, 4: 3.95, 8: 3.90-3.91,
    16: 3.86)."""
    bd = max(2, next_pow2(d))
    block_s = max(1, min(next_pow2(s), 2048 // bd))
    outer_per = min(2, next_pow2(outer))
    num_warps = max(1, min(8, (block_s * bd) // 512))
    return block_s, outer_per, num_warps


def table_layout(x_shape, t_shape):
    """(count, inner) when a table of `t_shape` broadcast to `x_shape` gives leading slice o
    (of x's flattened leading dims) its block (o // inner) % count, i.e. the table's non-1
    leading dims are one contiguous run of x's; None otherwise."""
    lead = tuple(x_shape[:-2])
    if len(t_shape) < 2 or len(t_shape) - 2 > len(lead):
        return None
    t_lead = (1,) * (len(lead) - len(t_shape) + 2) + tuple(t_shape[:-2])
    own = [i for i, (a, b) in enumerate(zip(t_lead, lead)) if a != 1]
    if any(t_lead[i] != lead[i] for i in own):
        return None
    if own and any(t_lead[i] == 1 and lead[i] != 1 for i in range(own[0], own[-1] + 1)):
        return None
    count = math.prod(lead[i] for i in own)
    inner = math.prod(lead[own[-1] + 1:]) if own else 1
    return count, inner


def _supports(shapes, dtypes, params):
    x, cos, sin = (tuple(s) for s in shapes)
    return cos == sin and table_layout(x, cos) is not None


def _rope_launch(x, cos, sin, interleaved, backward, *, block_s=None, outer_per=None,
                 num_warps=None):
    x = x.contiguous()
    S, D = x.shape[-2], x.shape[-1]
    count, inner = table_layout(tuple(x.shape), tuple(cos.shape))
    cos = cos.contiguous().reshape(count, S, D)
    sin = sin.contiguous().reshape(count, S, D)
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    outer = x.numel() // (S * D)
    bs, op_, nw = _rope_config(S, D, outer)
    bs = block_s or bs
    op_ = outer_per or op_
    nw = num_warps or nw
    n_sblk = triton.cdiv(S, bs)
    grid = (n_sblk * triton.cdiv(outer, op_),)
    if interleaved:
        _rope_pair_kernel[grid](x, cos, sin, y, outer, S, D, n_sblk, inner, count, BLOCK_S=bs,
                                BLOCK_D=max(2, next_pow2(D)), OUTER_PER=op_, BACKWARD=backward,
                                PER_SLICE_TABLES=count > 1, num_warps=nw)
    else:
        _rope_half_kernel[grid](x, cos, sin, y, outer, S, D, D // 2, n_sblk, inner, count,
                                BLOCK_S=bs, BLOCK_H=next_pow2(D // 2), OUTER_PER=op_,
                                BACKWARD=backward, PER_SLICE_TABLES=count > 1, num_warps=nw)
    return y


@kernel(FusedOps.ROPE, "cuda", dtypes=HALF_AND_F32, cost=row_cost(3, 2), supports=_supports)
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of ``x [..., S, D]`` with tables ``cos``/``sin`` ``[..., S, D]`` of one
    shape (see `table_layout`)."""
    return _rope_launch(x, cos, sin, interleaved, False)


def rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  interleaved: bool) -> torch.Tensor:
    """``dx`` of :func:`rope` for upstream ``grad [..., S, D]`` (general-table formula)."""
    return _rope_launch(grad, cos, sin, interleaved, True)
