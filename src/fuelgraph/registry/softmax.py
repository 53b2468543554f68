"""SOFTMAX_LAST_DIM (id 1) and its backward helper SOFTMAX_LAST_DIM_BACKWARD (id 7)."""
from __future__ import annotations

import numpy as np

from .core import BackwardKind, FusedOpEntry, FusedOps, NoParams, call_fused
from .rules import pair_float_rowwise, same_as_input0, unary_float_rowwise


def softmax_recipe(x):
    if x.shape[-1] == 0:  # nothing to normalize (max over an empty axis is undefined)
        return x
    m = x.max(-1, keepdim=True)
    e = (x - m).exp()
    return e / e.sum(-1, keepdim=True)


def softmax_detached_shift(x):
    """Spelling with a stop-gradient on the max shift (`x.max(-1, keepdim=True).detach()`):
    the shift does not change the value, and its gradient is zero, so it is the same op."""
    e = (x - x.max(-1, keepdim=True).detach()).exp()
    return e / e.sum(-1, keepdim=True)


def softmax_from_logsumexp(x):
    """Spelling through a stable logsumexp: exp(x - (m + log(sum(exp(x - m)))))."""
    m = x.max(-1, keepdim=True)
    return (x - (m + (x - m).exp().sum(-1, keepdim=True).log())).exp()


def softmax_backward_recipe(y, grad):
    return y * (grad - (grad * y).sum(-1, keepdim=True))


def _row_sample(rng):
    return [rng.standard_normal((2, 3, 8)).astype(np.float32)]


def declare(reg):
    reg.add(FusedOpEntry(
        id=FusedOps.SOFTMAX_LAST_DIM, name="softmax_last_dim", family="forward", params=NoParams,
        shape_rule=same_as_input0, dtype_rule=same_as_input0,
        validate=unary_float_rowwise("softmax_last_dim"),
        decompose=softmax_recipe, extra_patterns=(softmax_detached_shift, softmax_from_logsumexp),
        backward=BackwardKind.fused(FusedOps.SOFTMAX_LAST_DIM_BACKWARD),
        vjp=lambda xs, ys, gs, p: [call_fused(FusedOps.SOFTMAX_LAST_DIM_BACKWARD, ys[0], gs[0])],
        sample=_row_sample,
        doc="y[..., j] = exp(x[..., j] - max x[..., :]) / sum_k exp(x[..., k] - max x[..., :]). "
            "x [..., n] float (rank >= 1) -> y, same shape and dtype. Also fuses from the max shift "
            "written with a stop-gradient (x.max(-1, keepdim=True).detach()) and from "
            "exp(x - logsumexp(x)) with logsumexp written m + log(sum(exp(x - m)))."))
    reg.add(FusedOpEntry(
        id=FusedOps.SOFTMAX_LAST_DIM_BACKWARD, name="softmax_last_dim_backward", family="backward",
        params=NoParams, shape_rule=same_as_input0, dtype_rule=same_as_input0,
        validate=pair_float_rowwise("softmax_last_dim_backward", ("y", "grad")),
        decompose=softmax_backward_recipe, backward=BackwardKind.DECOMPOSE,
        sample=lambda rng: _row_sample(rng) * 2,
        doc="dx = y * (grad - sum(grad * y, -1, keepdim)). y is the softmax OUTPUT [..., n], "
            "grad the upstream gradient (same shape and dtype)."))



# ---- builders (re-exported by fuelgraph.functional) ----------------------------------------
def softmax_last_dim(x):
    """Softmax over the last axis. x [..., n] float (rank >= 1) -> same shape and dtype."""
    return call_fused(FusedOps.SOFTMAX_LAST_DIM, x)


def softmax_last_dim_backward(y, grad):
    """Gradient of softmax given its output y [..., n] and upstream grad [..., n]:
    y * (grad - sum(grad * y, -1, keepdim=True))."""
    return call_fused(FusedOps.SOFTMAX_LAST_DIM_BACKWARD, y, grad)
