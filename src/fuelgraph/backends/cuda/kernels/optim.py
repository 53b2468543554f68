"""Triton kernels of the optimizer updates (registry/optim.py): one pass over the flat
parameter, gradient and state, written back into the same buffers (the runtime hands over
copies where it may not overwrite). Scalars are read from their 0-d device tensors (no host
sync, and a CUDA graph replays with new values). float32 math, the recipe's order of
operations, no FMA contraction (`enable_fp_fusion=False`), one rounding per output."""

from __future__ import annotations

import triton
import triton.language as tl

from ....registry.optim import ADAMW_STEP, SGD_STEP
from ...base import kernel, row_cost
from .common import EW_BLOCK, EW_WARPS, HALF_AND_F32


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, decay_ptr, ss_ptr, bc_ptr, numel, w1, b2, w2, eps,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    decay = tl.load(decay_ptr)
    ss = tl.load(ss_ptr)
    bc = tl.load(bc_ptr)
    p = p * decay
    m = m + w1 * (g - m)
    v = v * b2 + (w2 * g) * g
    denom = tl.sqrt_rn(v) / bc + eps
    p = p + (-ss) * (m / denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


@kernel(ADAMW_STEP, "cuda", dtypes=HALF_AND_F32, cost=row_cost(12, 2))
def adamw_step(p, g, m, v, decay, step_size, bc2_sqrt, *, beta1, beta2, eps):
    """(p, m, v) updated in their own storage (contiguous); returns them."""
    n = p.numel()
    if n:
        _adamw_kernel[(triton.cdiv(n, EW_BLOCK),)](
            p, g, m, v, decay, step_size, bc2_sqrt, n, 1.0 - beta1, beta2, 1.0 - beta2, eps,
            BLOCK=EW_BLOCK, num_warps=EW_WARPS, enable_fp_fusion=False)
    return p, m, v


@triton.jit
def _sgd_kernel(p_ptr, g_ptr, lr_ptr, b_ptr, first_ptr, numel, wd, mo, dm,
                HAS_WD: tl.constexpr, HAS_MOM: tl.constexpr, NESTEROV: tl.constexpr,
                BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lr = tl.load(lr_ptr)
    if HAS_WD:
        d = d + wd * p
    if HAS_MOM:
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        first = tl.load(first_ptr)
        b = tl.where(first > 0.5, d, b * mo + dm * d)
        if NESTEROV:
            d = d + mo * b
        else:
            d = b
        tl.store(b_ptr + offs, b.to(b_ptr.dtype.element_ty), mask=mask)
    p = p + (-lr) * d
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


@kernel(SGD_STEP, "cuda", dtypes=HALF_AND_F32, cost=row_cost(6, 2))
def sgd_step(p, g, lr, *state, momentum, dampening, weight_decay, nesterov):
    """p (and buf) updated in their own storage; returns p (or (p, buf))."""
    n = p.numel()
    buf, first = state if state else (p, lr)
    if n:
        _sgd_kernel[(triton.cdiv(n, EW_BLOCK),)](
            p, g, lr, buf, first, n, weight_decay, momentum, 1.0 - dampening,
            HAS_WD=weight_decay != 0.0, HAS_MOM=bool(state), NESTEROV=bool(nesterov),
            BLOCK=EW_BLOCK, num_warps=EW_WARPS, enable_fp_fusion=False)
    return (p, state[0]) if state else p
