"""SOFTMAX_LAST_DIM and SOFTMAX_LAST_DIM_BACKWARD as Triton kernels.

Rows up to ``MAX_FUSED_N`` wide are held whole in registers (several short rows per program);
wider rows use a two-pass looped kernel (online max/sum, then write). Compute is float32; the
output has the input dtype. Edge behaviour: an all ``-inf`` row and any ``+inf``
give NaN, a NaN poisons its row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....registry.core import FusedOps
from ...base import kernel, row_cost
from .common import HALF_AND_F32, ROW_EVICT, flat_rows, launch_rows, row_tile


@triton.jit
def _softmax_fwd_rows_kernel(x_ptr, y_ptr, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                             EVICT: tl.constexpr):
    mask, offs = row_tile(R, N, BLOCK_R, BLOCK_N)
    x = tl.load(x_ptr + offs, mask=mask, other=float("-inf"), eviction_policy=EVICT).to(tl.float32)
    m = tl.max(x, 1)
    e = tl.exp(x - m[:, None])
    inv = 1.0 / tl.sum(e, 1)
    y = e * inv[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd_loop_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * N
    m = float("-inf")
    s = 0.0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
        m = m_new
    inv = 1.0 / s
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - m) * inv
        tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_rows_kernel(y_ptr, g_ptr, dx_ptr, R, N,
                             BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    mask, offs = row_tile(R, N, BLOCK_R, BLOCK_N)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    dot = tl.sum(y * g, 1)
    dx = y * (g - dot[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_loop_kernel(y_ptr, g_ptr, dx_ptr, N, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        y = tl.load(y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        acc += y * g
    dot = tl.sum(acc, 0)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        y = tl.load(y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + base + cols, (y * (g - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------


def _softmax_fwd(x: torch.Tensor, *, block_r=None, num_warps=None, target=4096,
                 evict=ROW_EVICT) -> torch.Tensor:
    x, r, n = flat_rows(x)
    y = torch.empty_like(x)
    if r == 0 or n == 0:
        return y
    launch_rows(_softmax_fwd_rows_kernel, _softmax_fwd_loop_kernel, (x, y), r, n,
                block_r=block_r, num_warps=num_warps, target=target, evict=evict)
    return y


def _softmax_bwd(y: torch.Tensor, grad: torch.Tensor, *, block_r=None, num_warps=None,
                 target=4096, evict=ROW_EVICT) -> torch.Tensor:
    y, r, n = flat_rows(y)
    g = grad.contiguous()
    dx = torch.empty_like(y)
    if r == 0 or n == 0:
        return dx
    launch_rows(_softmax_bwd_rows_kernel, _softmax_bwd_loop_kernel, (y, g, dx), r, n,
                block_r=block_r, num_warps=num_warps, target=target, evict=evict)
    return dx


@kernel(FusedOps.SOFTMAX_LAST_DIM, "cuda", dtypes=HALF_AND_F32, cost=row_cost(4, 2))
def softmax_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis: ``exp(x - max) / sum(exp(x - max))``, float32 compute."""
    return _softmax_fwd(x)


@kernel(FusedOps.SOFTMAX_LAST_DIM_BACKWARD, "cuda", dtypes=HALF_AND_F32, cost=row_cost(4, 2))
def softmax_last_dim_backward(y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``dx = y * (grad - sum(grad * y, -1, keepdim=True))`` from the forward output ``y``."""
    return _softmax_bwd(y, grad)
