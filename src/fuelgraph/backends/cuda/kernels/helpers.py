"""The primitives' backward helpers on Triton: REDUCE_MAX_TO_BACKWARD (id 10, torch ``amax``
semantics: ties share evenly, a window holding NaN gets NaN) and POWI_BACKWARD (id 15,
``exp * x**(exp-1) * grad`` by binary exponentiation in float32; ``exp == 0`` gives zeros)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....registry.core import FusedOps
from ...base import kernel, row_cost
from .common import EW_BLOCK, EW_WARPS, HALF_AND_F32, LOOP_BLOCK, MAX_FUSED_N, flat_rows, row_config, row_tile


@triton.jit
def _rmax_bwd_rows_kernel(x_ptr, g_ptr, dx_ptr, R, N,
                          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    mask, offs = row_tile(R, N, BLOCK_R, BLOCK_N)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    x = tl.load(x_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    g = tl.load(g_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    isnan = (x != x).to(tl.int32)
    has_nan = tl.max(isnan, 1) > 0
    m = tl.max(x, 1)
    hit = (x == m[:, None]) & mask
    cnt = tl.sum(hit.to(tl.float32), 1)
    share = g / cnt
    dx = tl.where(hit, share[:, None], 0.0)
    dx = tl.where(has_nan[:, None], float("nan"), dx)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmax_bwd_loop_kernel(x_ptr, g_ptr, dx_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * N
    m = float("-inf")
    cnt = 0.0
    nan = 0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), 0))
        bm = tl.max(x, 0)
        bc = tl.sum(((x == bm) & mask).to(tl.float32), 0)
        cnt = tl.where(bm > m, bc, tl.where(bm == m, cnt + bc, cnt))
        m = tl.maximum(m, bm)
    g = tl.load(g_ptr + row).to(tl.float32)
    share = g / cnt
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        dx = tl.where(x == m, share, 0.0)
        dx = tl.where(nan > 0, float("nan"), dx)
        tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _last_axis_only(shapes, dtypes, params) -> bool:
    """The Triton kernel covers the keepdim max over the last axis only."""
    xs, gs = tuple(shapes[0]), tuple(shapes[1])
    return len(xs) >= 1 and gs == xs[:-1] + (1,) and xs[-1] > 1 and 0 not in xs


@kernel(FusedOps.REDUCE_MAX_TO_BACKWARD, "cuda", dtypes=HALF_AND_F32, cost=row_cost(4, 2),
        supports=_last_axis_only)
def reduce_max_to_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of a keepdim max over the last axis: positions equal to their row's maximum get
    ``grad / #ties``, others 0; a row holding a NaN gets NaN everywhere (torch ``amax``).
    x [..., n], grad [..., 1]. Other reductions lower to the recipe (see `_last_axis_only`)."""
    x, r, n = flat_rows(x)
    g = grad.contiguous()
    dx = torch.empty_like(x)
    if n <= MAX_FUSED_N:
        block_r, block_n, nw = row_config(n)
        _rmax_bwd_rows_kernel[(triton.cdiv(r, block_r),)](
            x, g, dx, r, n, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=nw)
    else:
        _rmax_bwd_loop_kernel[(r,)](x, g, dx, n, BLOCK=LOOP_BLOCK, num_warps=8)
    return dx


# --------------------------------------------------------------------------------------------
# POWI_BACKWARD
# --------------------------------------------------------------------------------------------

@triton.jit
def _powi_bwd_kernel(x_ptr, g_ptr, dx_ptr, numel, expf,
                     M_ABS: tl.constexpr, M_NEG: tl.constexpr, NBITS: tl.constexpr,
                     BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.full((BLOCK,), 1.0, tl.float32)
    base = x
    for i in tl.static_range(NBITS):
        if (M_ABS >> i) & 1:
            acc = acc * base
        if i + 1 < NBITS:
            base = base * base
    if M_NEG:
        acc = 1.0 / acc
    dx = expf * acc * g
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@kernel(FusedOps.POWI_BACKWARD, "cuda", dtypes=HALF_AND_F32, cost=row_cost(4, 2))
def powi_backward(x: torch.Tensor, grad: torch.Tensor, *, exp: int) -> torch.Tensor:
    """``dx = exp * x**(exp-1) * grad`` elementwise (float32 compute); ``exp == 0`` gives zeros."""
    if exp == 0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    m = exp - 1
    g = grad
    dx = torch.empty_like(x)
    numel = x.numel()
    if numel == 0:
        return dx
    m_abs = abs(m)
    _powi_bwd_kernel[(triton.cdiv(numel, EW_BLOCK),)](
        x, g, dx, numel, float(exp),
        M_ABS=m_abs, M_NEG=m < 0, NBITS=max(1, m_abs.bit_length()),
        BLOCK=EW_BLOCK, num_warps=EW_WARPS)
    return dx
