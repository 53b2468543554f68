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
    return call_fused(FusedOps.POWI_BACKWARD, x, grad, exp=exp)


def _real(v):
    """A plain float for real numbers (params are hashed); anything else is left for the op's
    validation to reject with a clear error."""
    import numbers
    return float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v


def rms_norm_last_dim(x, eps: float = 1e-6):
    """RMS norm over the last axis, no weight: x / sqrt(mean(x * x, -1) + eps).
    x [..., n] float (rank >= 1, n > 0) -> same shape and dtype."""
    return call_fused(FusedOps.RMS_NORM_LAST_DIM, x, eps=_real(eps))


def layer_norm_last_dim(x, eps: float = 1e-5):
    """Layer norm over the last axis, no gamma/beta (population variance):
    (x - mean) / sqrt(mean((x - mean)**2) + eps). x [..., n] float (rank >= 1, n > 0) -> same
    shape and dtype."""
    return call_fused(FusedOps.LAYER_NORM_LAST_DIM, x, eps=_real(eps))


def rope(x, cos, sin, interleaved: bool = False):
    """Rotary embedding x * cos + rot(x) * sin. x [..., S, D] (rank >= 2, D even), cos/sin
    exactly [S, D] with x's dtype (HF layout, broadcast over the leading dims) -> shape and dtype
    of x. interleaved=False: rotate-half (NeoX / HF), rot(x) = cat(-x[..., D/2:], x[..., :D/2]);
    interleaved=True: GPT-J pairs (2i, 2i+1)."""
    return call_fused(FusedOps.ROPE, x, cos, sin, interleaved=interleaved)


def layer_norm_last_dim_backward(x, grad, eps: float):
    """Gradient of layer_norm_last_dim(x, eps): x [..., n] is the forward input, grad [..., n]
    the upstream gradient (same shape and dtype) -> dx [..., n]:
    r * (grad - mean(grad) - xhat * mean(grad * xhat)), r = 1/sqrt(var + eps), xhat = (x-mu)*r."""
    return call_fused(FusedOps.LAYER_NORM_LAST_DIM_BACKWARD, x, grad, eps=_real(eps))


def rms_norm_last_dim_backward(x, grad, eps: float):
    """Gradient of rms_norm_last_dim(x, eps): x [..., n] is the forward input, grad [..., n]
    the upstream gradient (same shape and dtype) -> dx [..., n]:
    r * (grad - x * sum(grad * x) / (n * den)), den = mean(x * x) + eps, r = 1/sqrt(den)."""
    return call_fused(FusedOps.RMS_NORM_LAST_DIM_BACKWARD, x, grad, eps=_real(eps))


def fused_linear(a, b, bias):
    """a @ b + bias. a [..., M, K]; b [K, N] or [..., K, N] (K x N, not nn.Linear's [N, K];
    batch dims broadcast NumPy-style); bias [N]; one float dtype for all three ->
    [broadcast(a.shape[:-2], b.shape[:-2]), M, N] in that dtype."""
    return call_fused(FusedOps.FUSED_LINEAR, a, b, bias)


def fused_softmax_cross_entropy(logits, targets, reduction: str = "mean", ignore_index=-100):
    """Softmax cross-entropy over the last axis. logits [..., V] float (rank >= 1, V >= 1),
    targets int64 class indices shaped logits.shape[:-1]. Rows whose target equals ignore_index
    (None: no row is ignored) give 0 and are left out of the mean; a target outside [0, V) that
    is not ignore_index raises FuelGraphError when the graph runs. reduction "none" -> shape
    targets.shape; "sum" -> []; "mean" -> [] = sum / (number of non-ignored rows), 0 when every
    row is ignored. Output float32 (float64 for float64 logits)."""
    import numbers
    if isinstance(ignore_index, numbers.Integral) and not isinstance(ignore_index, bool):
        ignore_index = int(ignore_index)
    return call_fused(FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY, logits, targets,
                      reduction=reduction, ignore_index=ignore_index)


def inplace_affine(x, mul, add):
    """mul * x + add, elementwise. x any shape, float -> same shape and dtype. The kernel writes
    into x's buffer when no later reader needs x (otherwise it copies first); the values every
    tensor reads are as if nothing were in place."""
    return call_fused(FusedOps.INPLACE_AFFINE, x, mul=_real(mul), add=_real(add))
