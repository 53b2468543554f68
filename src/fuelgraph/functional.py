"""Public fused-op functions (`import fuelgraph.functional as F`). Each builds one fused node;
the optimizer runs it as a kernel or lowers it to its primitive recipe."""
from __future__ import annotations

from .registry.core import FusedOps, call_fused


def softmax_last_dim(x):
    """Softmax over the last axis. x [..., n] float (rank >= 1) -> same shape and dtype."""
    return call_fused(FusedOps.SOFTMAX_LAST_DIM, x)


def softmax_last_dim_backward(y, grad):
    """Gradient of softmax given its output y [..., n] and upstream grad [..., n]:
    y * (grad - sum(grad * y, -1, keepdim=True))."""
    return call_fused(FusedOps.SOFTMAX_LAST_DIM_BACKWARD, y, grad)


def reduce_max_to_backward(x, grad):
    """Gradient of max(x, axes, keepdim=True): grad has that keepdim shape; tied maxima share
    it evenly (torch amax semantics)."""
    return call_fused(FusedOps.REDUCE_MAX_TO_BACKWARD, x, grad)


def powi_backward(x, grad, exp: int):
    """Gradient of x ** exp for an integer exp: exp * x**(exp-1) * grad (zeros for exp == 0)."""
    return call_fused(FusedOps.POWI_BACKWARD, x, grad, exp=int(exp))
