"""RMS_NORM_LAST_DIM, LAYER_NORM_LAST_DIM and their backwards on Triton.

No weight / affine (no weight: multiply by one outside the op). ``eps`` is narrowed to float32, all
statistics are float32, the output has the input dtype. Backward kernels recompute the row
statistics from ``x`` (nothing is cached), in one pass over ``x`` and ``grad`` for rows held in
registers. Rows wider than ``MAX_FUSED_N`` use looped kernels (2 or 3 passes per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....registry.core import FusedOps
from ....registry.norm import ADD_RMS_NORM
from ...base import kernel, row_cost
from .common import (HALF_AND_F32, MAX_FUSED_N, ROW_EVICT, flat_rows, launch_rows, row_config,
                     row_tile)


# ----------------------------------------------------------------------------- whole-row kernels


@triton.jit
def _rms_fwd_rows_kernel(x_ptr, y_ptr, R, N, eps, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                         EVICT: tl.constexpr):
    mask, offs = row_tile(R, N, BLOCK_R, BLOCK_N)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    ms = tl.sum(x * x, 1) * (1.0 / N)
    r = 1.0 / tl.sqrt_rn(ms + eps)
    tl.store(y_ptr + offs, (x * r[:, None]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_rows_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, R, N, eps, BLOCK_R: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """s = x + r rounded to the dtype; y = (s * rsqrt(mean(s*s) + eps)) rounded, times w."""
    mask, offs = row_tile(R, N, BLOCK_R, BLOCK_N)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + offs, s, mask=mask)
    sf = s.to(tl.float32)
    rs = 1.0 / tl.sqrt_rn(tl.sum(sf * sf, 1) * (1.0 / N) + eps)
    y = (sf * rs[:, None]).to(y_ptr.dtype.element_ty).to(tl.float32)
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (y * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ln_fwd_rows_kernel(x_ptr, y_ptr, R, N, eps, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        EVICT: tl.constexpr):
    mask, offs = row_tile(R, N, BLOCK_R, BLOCK_N)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    inv_n = 1.0 / N
    mean = tl.sum(x, 1) * inv_n
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, 1) * inv_n
    r = 1.0 / tl.sqrt_rn(var + eps)
    tl.store(y_ptr + offs, (xc * r[:, None]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_bwd_rows_kernel(x_ptr, g_ptr, dx_ptr, R, N, eps,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    mask, offs = row_tile(R, N, BLOCK_R, BLOCK_N)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    den = tl.sum(x * x, 1) * (1.0 / N) + eps
    r = 1.0 / tl.sqrt_rn(den)
    c = tl.sum(g * x, 1) / (N * den)
    dx = r[:, None] * (g - x * c[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ln_bwd_rows_kernel(x_ptr, g_ptr, dx_ptr, R, N, eps,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    mask, offs = row_tile(R, N, BLOCK_R, BLOCK_N)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    inv_n = 1.0 / N
    mean = tl.sum(x, 1) * inv_n
    xc = tl.where(mask, x - mean[:, None], 0.0)
    r = 1.0 / tl.sqrt_rn(tl.sum(xc * xc, 1) * inv_n + eps)
    xhat = xc * r[:, None]
    mg = tl.sum(g, 1) * inv_n
    mgx = tl.sum(g * xhat, 1) * inv_n
    dx = r[:, None] * (g - mg[:, None] - xhat * mgx[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- looped kernels


@triton.jit
def _rms_fwd_loop_kernel(x_ptr, y_ptr, N, eps, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += x * x
    r = 1.0 / tl.sqrt_rn(tl.sum(acc, 0) * (1.0 / N) + eps)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + base + cols, (x * r).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ln_fwd_loop_kernel(x_ptr, y_ptr, N, eps, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * N
    inv_n = 1.0 / N
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + base + cols, mask=cols < N, other=0.0).to(tl.float32)
    mean = tl.sum(acc, 0) * inv_n
    acc2 = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - mean, 0.0)
        acc2 += xc * xc
    r = 1.0 / tl.sqrt_rn(tl.sum(acc2, 0) * inv_n + eps)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + base + cols, ((x - mean) * r).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_bwd_loop_kernel(x_ptr, g_ptr, dx_ptr, N, eps, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * N
    acc_xx = tl.zeros((BLOCK,), tl.float32)
    acc_gx = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        acc_xx += x * x
        acc_gx += g * x
    den = tl.sum(acc_xx, 0) * (1.0 / N) + eps
    r = 1.0 / tl.sqrt_rn(den)
    c = tl.sum(acc_gx, 0) / (N * den)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + base + cols, (r * (g - x * c)).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ln_bwd_loop_kernel(x_ptr, g_ptr, dx_ptr, N, eps, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * N
    inv_n = 1.0 / N
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + base + cols, mask=cols < N, other=0.0).to(tl.float32)
    mean = tl.sum(acc, 0) * inv_n
    acc_cc = tl.zeros((BLOCK,), tl.float32)
    acc_g = tl.zeros((BLOCK,), tl.float32)
    acc_gc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - mean, 0.0)
        acc_cc += xc * xc
        acc_g += g
        acc_gc += g * xc
    r = 1.0 / tl.sqrt_rn(tl.sum(acc_cc, 0) * inv_n + eps)
    mg = tl.sum(acc_g, 0) * inv_n
    mgx = tl.sum(acc_gc, 0) * inv_n * r            # mean(g * xhat)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        xhat = (x - mean) * r
        dx = r * (g - mg - xhat * mgx)
        tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers

_FWD = {"rms": (_rms_fwd_rows_kernel, _rms_fwd_loop_kernel),
        "ln": (_ln_fwd_rows_kernel, _ln_fwd_loop_kernel)}
_BWD = {"rms": (_rms_bwd_rows_kernel, _rms_bwd_loop_kernel),
        "ln": (_ln_bwd_rows_kernel, _ln_bwd_loop_kernel)}


# RMS forward packs ~16384 elements per program for rows >= 2048 wide (4 rows of 4096, 16 warps):
# on an H200 (2026-11-30, bf16 32768x4096) that launch ran at 4093 GB/s against 3997 for one row
# and 8 warps (and led the same sweep with the evict_first hint, 3896 vs 3801). Softmax and
# layer norm showed no such gain (1% or less) and keep one 4096-wide row per program.
RMS_FWD_WIDE_TARGET = 16384


def _norm_fwd(kind: str, x: torch.Tensor, eps: float, *, block_r=None, num_warps=None,
              target=None, evict=ROW_EVICT) -> torch.Tensor:
    x, r, n = flat_rows(x)
    y = torch.empty_like(x)
    if r == 0:
        return y
    if target is None:
        target = RMS_FWD_WIDE_TARGET if (kind == "rms" and n >= 2048) else 4096
    launch_rows(*_FWD[kind], (x, y), r, n, (eps,), block_r=block_r, num_warps=num_warps,
                target=target, evict=evict)
    return y


def _norm_bwd(kind: str, x: torch.Tensor, grad: torch.Tensor, eps: float, *, block_r=None,
              num_warps=None, target=4096, evict=ROW_EVICT) -> torch.Tensor:
    x, r, n = flat_rows(x)
    g = grad.contiguous()
    dx = torch.empty_like(x)
    if r == 0:
        return dx
    launch_rows(*_BWD[kind], (x, g, dx), r, n, (eps,), block_r=block_r, num_warps=num_warps,
                target=target, evict=evict)
    return dx


@kernel(FusedOps.RMS_NORM_LAST_DIM, "cuda", dtypes=HALF_AND_F32, cost=row_cost(4, 2))
def rms_norm_last_dim(x: torch.Tensor, *, eps: float) -> torch.Tensor:
    """``y = x / sqrt(mean(x**2, -1) + eps)`` (no weight)."""
    return _norm_fwd("rms", x, eps)


def _add_rms_supports(shapes, dtypes, params):
    return shapes[0][-1] <= MAX_FUSED_N


@kernel(ADD_RMS_NORM, "cuda", dtypes=HALF_AND_F32, cost=row_cost(6, 2),
        supports=_add_rms_supports)
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *,
                 eps: float, block_r=None, num_warps=None):
    """(s, y): ``s = x + residual``, ``y = rms_norm(s) * weight`` (the norm rounded to the
    dtype first), x/residual [..., n] and weight [n] of one dtype; one pass over the rows."""
    x, rows, n = flat_rows(x)
    res = residual.contiguous()
    s, y = torch.empty_like(x), torch.empty_like(x)
    if rows == 0:
        return s, y
    br, bn, nw = row_config(n, target=4096)
    br = block_r or br
    _add_rms_rows_kernel[(triton.cdiv(rows, br),)](
        x, res, weight.contiguous(), s, y, rows, n, eps, BLOCK_R=br, BLOCK_N=bn,
        num_warps=num_warps or nw)
    return s, y


@kernel(FusedOps.LAYER_NORM_LAST_DIM, "cuda", dtypes=HALF_AND_F32, cost=row_cost(6, 2))
def layer_norm_last_dim(x: torch.Tensor, *, eps: float) -> torch.Tensor:
    """``y = (x - mean) / sqrt(var + eps)``, population variance, no affine."""
    return _norm_fwd("ln", x, eps)


@kernel(FusedOps.RMS_NORM_LAST_DIM_BACKWARD, "cuda", dtypes=HALF_AND_F32, cost=row_cost(6, 2))
def rms_norm_last_dim_backward(x: torch.Tensor, grad: torch.Tensor, *, eps: float) -> torch.Tensor:
    """``dx = r * (g - x * sum(g*x) / (n * (mean(x**2) + eps)))``, ``r = 1/sqrt(mean(x**2)+eps)``."""
    return _norm_bwd("rms", x, grad, eps)


@kernel(FusedOps.LAYER_NORM_LAST_DIM_BACKWARD, "cuda", dtypes=HALF_AND_F32, cost=row_cost(8, 2))
def layer_norm_last_dim_backward(x: torch.Tensor, grad: torch.Tensor, *, eps: float) -> torch.Tensor:
    """``dx = r * (g - mean(g) - xhat * mean(g * xhat))`` with stats recomputed from ``x``."""
    return _norm_bwd("ln", x, grad, eps)
