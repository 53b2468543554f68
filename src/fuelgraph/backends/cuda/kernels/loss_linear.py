"""Fused linear + cross-entropy on the GPU: cuBLAS (through torch) for the matrix products, the
one-pass Triton row kernel of ``loss.py`` for the log-sum-exp and the logits' gradient.

The tokens are processed in chunks of ``chunk_rows(N, V, itemsize)`` rows, so the only
logits-shaped buffer is one ``[chunk, V]`` block in the input dtype (about FLCE_CHUNK_FRACTION
of the full logits, never fewer than FLCE_MIN_CHUNK_ROWS rows, which keeps the dW product
compute-bound). Per chunk:

1. ``z = x_c @ W.T (+ b)`` -- cuBLAS, float32 accumulation, stored in the input dtype (what
   nn.Linear stores);
2. the row kernel computes each row's loss and overwrites ``z`` with
   ``dl = w * (softmax(z) - onehot(t))`` (forward only: the loss, no write);
3. ``dx_c = dl @ W`` (exact per chunk), ``dW += dl.T @ x_c`` (cuBLAS with beta = 1: float32
   inside each chunk's product, one rounding to W's dtype per chunk for 16-bit weights -- an
   fp32 accumulator would cost as much memory as the logits), ``db += colsum(dl)`` in float32.

Forward and backward together cost three GEMMs (the backward alone four: it recomputes the
logits). float64 is not covered: the planner runs the recipe there.
"""
from __future__ import annotations

import torch

from ....registry.loss import (FUSED_LINEAR_CROSS_ENTROPY, FUSED_LINEAR_CROSS_ENTROPY_BACKWARD,
                               FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD)
from ...base import Cost, kernel
from .common import HALF_AND_F32
from .loss import CHECK_TARGETS, _check_targets, ce_rows, grad_weights_inputs, reduce_rows

#: share of the full [N, V] logits one token chunk may take (the issue's budget is 10%)
FLCE_CHUNK_FRACTION = 0.08
#: at least this many rows per chunk (when N allows): dW += dl.T @ x_c reads and writes all of
#: dW per chunk, so a chunk needs a few hundred rows for that product to stay compute-bound
FLCE_MIN_CHUNK_ROWS = 256
#: chunks are multiples of this many rows (GEMM tiles)
FLCE_ROW_ALIGN = 64


def chunk_rows(n: int, v: int, itemsize: int, fraction: float | None = None) -> int:
    """Tokens per chunk for N tokens over V classes."""
    frac = FLCE_CHUNK_FRACTION if fraction is None else fraction
    c = int(n * frac) // FLCE_ROW_ALIGN * FLCE_ROW_ALIGN
    return max(1, min(n, max(c, FLCE_MIN_CHUNK_ROWS)))


def _flce(op, x, weight, targets, bias, grad, reduction, ignore_index, want_loss, want_grads,
          chunk=None, **launch):
    x, weight = x.contiguous(), weight.contiguous()
    n, _ = x.shape
    v = weight.shape[0]
    dev = x.device
    t = targets.reshape(-1).to(torch.int64).contiguous()
    if CHECK_TARGETS and n:
        _check_targets(op, t, v, ignore_index)
    step = chunk or chunk_rows(n, v, x.element_size())
    loss_rows = torch.empty(n, dtype=torch.float32, device=dev) if want_loss else None
    g = n_valid = None
    if want_grads:
        g, n_valid = grad_weights_inputs(grad, t, reduction, ignore_index, dev)
        dx = torch.empty_like(x)
        dw = torch.zeros_like(weight) if n == 0 else torch.empty_like(weight)
        db = torch.zeros(v, dtype=torch.float32, device=dev) if bias is not None else None
    zbuf = torch.empty((min(step, n), v), dtype=x.dtype, device=dev) if n else None
    wt = weight.t()
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        xc, z = x[r0:r1], zbuf[:r1 - r0]
        if bias is None:
            torch.mm(xc, wt, out=z)
        else:
            torch.addmm(bias, xc, wt, out=z)
        ce_rows(z, t[r0:r1], loss_rows=None if loss_rows is None else loss_rows[r0:r1],
                dx=z if want_grads else None,
                grad=None if g is None else (g[r0:r1] if reduction == "none" else g),
                n_valid=n_valid, reduction=reduction, ignore_index=ignore_index, n_mean=n,
                **launch)
        if want_grads:
            torch.mm(z, weight, out=dx[r0:r1])
            if r0 == 0:
                torch.mm(z.t(), xc, out=dw)
            else:
                dw.addmm_(z.t(), xc)
            if db is not None:
                db += z.sum(0, dtype=torch.float32)
    res = []
    if want_loss:
        res.append(reduce_rows(loss_rows, t, reduction, ignore_index, targets.shape))
    if want_grads:
        res += [dx, dw] + ([db.to(bias.dtype)] if db is not None else [])
    return res[0] if len(res) == 1 else tuple(res)


def _cost(gemms):
    def cost(shapes, params=None):
        (n, h), (v, _) = shapes[0], shapes[1]
        return Cost(2 * n * h * v * gemms + 8 * n * v, 2 * (n * h + v * h) * (1 + gemms))
    return cost


@kernel(FUSED_LINEAR_CROSS_ENTROPY, "cuda", dtypes=HALF_AND_F32, cost=_cost(1),
        precision="fp32 accumulate")
def fused_linear_cross_entropy(x, weight, targets, *bias, reduction, ignore_index):
    """Loss of ``cross_entropy(x @ weight.T + bias, targets)`` without the [N, V] logits:
    x [N, H], weight [V, H], targets [N] int64, optional bias [V] (x, weight, bias one dtype:
    float32, bfloat16 or float16). Loss float32: [] for mean/sum, [N] for none."""
    return _flce("fused_linear_cross_entropy", x, weight, targets, bias[0] if bias else None,
                 None, reduction, ignore_index, True, False)


@kernel(FUSED_LINEAR_CROSS_ENTROPY_BACKWARD, "cuda", dtypes=HALF_AND_F32, cost=_cost(4),
        precision="fp32 accumulate; dW rounded to its dtype once per token chunk")
def fused_linear_cross_entropy_backward(x, weight, targets, *rest, reduction, ignore_index):
    """``(dx, dweight[, dbias])``; inputs x, weight, targets, [bias], grad (the loss's shape)."""
    bias = rest[0] if len(rest) == 2 else None
    return _flce("fused_linear_cross_entropy_backward", x, weight, targets, bias, rest[-1],
                 reduction, ignore_index, False, True)


@kernel(FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD, "cuda", dtypes=HALF_AND_F32, cost=_cost(3),
        precision="fp32 accumulate; dW rounded to its dtype once per token chunk")
def fused_linear_cross_entropy_fwd_bwd(x, weight, targets, *rest, reduction, ignore_index):
    """``(loss, dx, dweight[, dbias])`` in one sweep: three GEMMs per chunk."""
    bias = rest[0] if len(rest) == 2 else None
    return _flce("fused_linear_cross_entropy_fwd_bwd", x, weight, targets, bias, rest[-1],
                 reduction, ignore_index, True, True)
