"""Last-dim normalisations without affine parameters:

* RMS_NORM_LAST_DIM (id 3)            y = x / sqrt(mean(x*x) + eps)          backward: fused(9)
* LAYER_NORM_LAST_DIM (id 4)          y = (x - mu) / sqrt(mean((x-mu)^2) + eps) backward: fused(8)
* LAYER_NORM_LAST_DIM_BACKWARD (id 8) dx of layer norm from (x, grad)        backward: DECOMPOSE
* RMS_NORM_LAST_DIM_BACKWARD (id 9)   dx of RMS norm from (x, grad)          backward: DECOMPOSE
* ADD_RMS_NORM (0x180)                (s = x + residual, rms_norm(s) * weight), explicit only:
                                      a decoder's residual add and next norm in one pass

Every op takes `x [..., n]` (rank >= 1, n > 0, float32/float64/bfloat16/float16); the helpers also
take `grad`, shaped and typed like x. Statistics use the population variance (divide by n).
The forward recipes ARE the recognised idioms: the fuser derives its patterns from them (after
canonicalization `x * rsqrt(v)` reads `x / sqrt(v)` and `x ** 2` reads `x * x`, so those spellings
fuse too); eps is recovered from the graph. The helpers' recipes are differentiable, so gradients
of gradients work."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import FuelGraphError
from .core import BackwardKind, FusedOpEntry, FusedOpId, FusedOps, call_fused
from .rules import (check_arity, check_float, check_same_dtype, pair_float_rowwise, real_param,
                    same_as_input0, unary_float_rowwise)

#: (x + residual, rms_norm(x + residual) * weight): two outputs, no pattern (called explicitly)
ADD_RMS_NORM = FusedOpId(0x180)


@dataclass(frozen=True)
class NormParams:
    """eps: variance floor added under the square root (finite, >= 0)."""
    eps: float


def _check_eps(name, params):
    eps = params.eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise FuelGraphError(f"{name}: param eps must be a real number, got {eps!r}")
    if not math.isfinite(float(eps)) or eps < 0:
        raise FuelGraphError(f"{name}: param eps is {eps!r}, expected a finite number >= 0")


def _unary_validate(name):
    base = unary_float_rowwise(name, min_last=1)

    def validate(srcs, params):
        base(srcs, params)
        _check_eps(name, params)
    return validate


def _pair_validate(name):
    base = pair_float_rowwise(name, ("x", "grad"), min_last=1)

    def validate(srcs, params):
        base(srcs, params)
        _check_eps(name, params)
    return validate


# ---- recipes (primitives only, through the Tensor builders) --------------------------------
def _in_acc(recipe):
    """Run a norm recipe in acc(T) (float32 for 16-bit inputs) and round once at the end, as the
    kernels do: a 16-bit x * x or row sum would overflow otherwise."""
    def wrapped(*xs, eps):
        d = xs[0].dtype
        return recipe(*(x.astype(d.acc) for x in xs), eps=eps).astype(d)
    wrapped.__name__ = wrapped.__qualname__ = recipe.__name__
    wrapped.__doc__ = recipe.__doc__
    return wrapped


def rms_norm_math(x, eps):
    """The idiom in x's own dtype: also a fusion pattern, so a 16-bit RMS norm written without
    an upcast fuses too (the kernel then computes it in float32)."""
    return x / ((x * x).mean(-1, keepdim=True) + eps).sqrt()


def layer_norm_math(x, eps):
    """As rms_norm_math, for layer norm."""
    xc = x - x.mean(-1, keepdim=True)
    return xc / ((xc * xc).mean(-1, keepdim=True) + eps).sqrt()


rms_norm_recipe = _in_acc(rms_norm_math)
layer_norm_recipe = _in_acc(layer_norm_math)


@_in_acc
def layer_norm_backward_recipe(x, grad, eps):
    """dx = r * (g - mean(g) - xhat * mean(g * xhat)), r = 1/sqrt(var + eps), xhat = (x-mu)*r."""
    xc = x - x.mean(-1, keepdim=True)
    istd = ((xc * xc).mean(-1, keepdim=True) + eps).rsqrt()
    xhat = xc * istd
    return istd * (grad - grad.mean(-1, keepdim=True) - xhat * (grad * xhat).mean(-1, keepdim=True))


@_in_acc
def rms_norm_backward_recipe(x, grad, eps):
    """dx = r * (g - x * sum(g*x) / (n * den)), den = mean(x*x) + eps, r = 1/sqrt(den)."""
    n = x.shape[-1]
    den = (x * x).mean(-1, keepdim=True) + eps
    s = (grad * x).sum(-1, keepdim=True)
    return den.rsqrt() * (grad - x * s / (den * float(n)))


def add_rms_norm_recipe(x, residual, weight, eps):
    """s = x + residual (rounded to x's dtype), y = rms_norm(s) rounded, times weight: the
    residual add and RMS norm with weight of a transformers Llama layer, roundings included."""
    s = x + residual
    return s, rms_norm_recipe(s, eps=eps) * weight


def _add_norm_validate(srcs, params):
    name = "add_rms_norm"
    check_arity(name, srcs, 3)
    pair_float_rowwise(name, ("x", "residual"), min_last=1)(srcs[:2], params)
    check_float(name, srcs, labels=("x", "residual", "weight"))
    check_same_dtype(name, srcs, (0, 2), ("x", "residual", "weight"))
    if tuple(srcs[2].shape) != (srcs[0].shape[-1],):
        raise FuelGraphError(f"{name}: weight has shape {tuple(srcs[2].shape)}, expected "
                             f"({srcs[0].shape[-1]},) (the last dimension of x)")
    _check_eps(name, params)


def _add_norm_sample(rng):
    return [rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 8), (2, 3, 8), (8,))]


def _vjp(helper):
    return lambda xs, ys, gs, p: [call_fused(helper, xs[0], gs[0], eps=p.eps)]


def _row_sample(rng):
    return [rng.standard_normal((2, 3, 8)).astype(np.float32)]


def _pair_sample(rng):
    return [rng.standard_normal((2, 3, 8)).astype(np.float32) for _ in range(2)]


def declare(reg):
    reg.add(FusedOpEntry(
        id=FusedOps.RMS_NORM_LAST_DIM, name="rms_norm_last_dim", family="norm", params=NormParams,
        shape_rule=same_as_input0, dtype_rule=same_as_input0,
        validate=_unary_validate("rms_norm_last_dim"),
        decompose=rms_norm_recipe, extra_patterns=(rms_norm_math,),
        backward=BackwardKind.fused(FusedOps.RMS_NORM_LAST_DIM_BACKWARD),
        vjp=_vjp(FusedOps.RMS_NORM_LAST_DIM_BACKWARD),
        sample=_row_sample,
        doc="RMS norm without weight: y = x / sqrt(mean(x * x, -1) + eps). x [..., n] float "
            "(rank >= 1, n > 0) -> y, same shape and dtype; params eps (>= 0). Accumulates in "
            "float32 for 16/32-bit inputs, float64 for float64. Fuses from "
            "x / sqrt(mean(x*x) + eps) and x * rsqrt(mean(x**2) + eps)."))
    reg.add(FusedOpEntry(
        id=FusedOps.LAYER_NORM_LAST_DIM, name="layer_norm_last_dim", family="norm",
        params=NormParams, shape_rule=same_as_input0, dtype_rule=same_as_input0,
        validate=_unary_validate("layer_norm_last_dim"),
        decompose=layer_norm_recipe, extra_patterns=(layer_norm_math,),
        backward=BackwardKind.fused(FusedOps.LAYER_NORM_LAST_DIM_BACKWARD),
        vjp=_vjp(FusedOps.LAYER_NORM_LAST_DIM_BACKWARD),
        sample=_row_sample,
        doc="Layer norm without gamma/beta: xc = x - mean(x, -1); y = xc / sqrt(mean(xc*xc, -1) "
            "+ eps) (population variance, two-pass). x [..., n] float (rank >= 1, n > 0) -> y, "
            "same shape and dtype; params eps (>= 0). Does not fuse from the unbiased-variance "
            "or E[x^2] - mu^2 spellings (numerically different)."))
    reg.add(FusedOpEntry(
        id=FusedOps.LAYER_NORM_LAST_DIM_BACKWARD, name="layer_norm_last_dim_backward",
        family="backward", params=NormParams, shape_rule=same_as_input0,
        dtype_rule=same_as_input0, validate=_pair_validate("layer_norm_last_dim_backward"),
        decompose=layer_norm_backward_recipe, backward=BackwardKind.DECOMPOSE,
        pattern_variants=None, sample=_pair_sample,
        doc="Gradient of layer_norm_last_dim: x [..., n] is the forward INPUT (statistics are "
            "recomputed), grad [..., n] the upstream gradient (same shape and dtype), eps the "
            "forward eps. dx = r * (grad - mean(grad) - xhat * mean(grad * xhat)) with "
            "r = 1/sqrt(var + eps), xhat = (x - mean(x)) * r; shape and dtype of x."))
    reg.add(FusedOpEntry(
        id=FusedOps.RMS_NORM_LAST_DIM_BACKWARD, name="rms_norm_last_dim_backward",
        family="backward", params=NormParams, shape_rule=same_as_input0,
        dtype_rule=same_as_input0, validate=_pair_validate("rms_norm_last_dim_backward"),
        decompose=rms_norm_backward_recipe, backward=BackwardKind.DECOMPOSE,
        pattern_variants=None, sample=_pair_sample,
        doc="Gradient of rms_norm_last_dim: x [..., n] is the forward INPUT, grad [..., n] the "
            "upstream gradient (same shape and dtype), eps the forward eps. "
            "dx = r * (grad - x * sum(grad * x) / (n * den)) with den = mean(x*x) + eps, "
            "r = 1/sqrt(den); shape and dtype of x."))

    reg.add(FusedOpEntry(
        id=ADD_RMS_NORM, name="add_rms_norm", family="norm", params=NormParams,
        shape_rule=lambda shapes, p: [shapes[0], shapes[0]],
        dtype_rule=lambda dtypes, p: [dtypes[0], dtypes[0]],
        validate=_add_norm_validate, decompose=add_rms_norm_recipe, outputs=("sum", "out"),
        backward=BackwardKind.DECOMPOSE, pattern_variants=None, sample=_add_norm_sample,
        doc="Residual add, then RMS norm with weight, in one pass: s = x + residual (rounded to "
            "the dtype), out = rms_norm_last_dim(s, eps) (rounded) * weight. x, residual "
            "[..., n], weight [n], one float dtype -> (s, out), both shaped and typed like x; "
            "params eps (>= 0). Built explicitly (no pattern): a decoder layer's residual "
            "stream and the next norm's output, as transformers' Llama computes them."))


# ---- builders (re-exported by fuelgraph.functional) ----------------------------------------
def rms_norm_last_dim(x, eps: float = 1e-6):
    """RMS norm over the last axis, no weight: x / sqrt(mean(x * x, -1) + eps).
    x [..., n] float (rank >= 1, n > 0) -> same shape and dtype."""
    return call_fused(FusedOps.RMS_NORM_LAST_DIM, x, eps=real_param(eps))


def add_rms_norm(x, residual, weight, eps: float = 1e-6):
    """(s, y): s = x + residual, y = rms_norm_last_dim(s, eps) * weight, in one pass. x and
    residual [..., n], weight [n], one float dtype -> two tensors shaped like x."""
    return call_fused(ADD_RMS_NORM, x, residual, weight, eps=real_param(eps))


def layer_norm_last_dim(x, eps: float = 1e-5):
    """Layer norm over the last axis, no gamma/beta (population variance):
    (x - mean) / sqrt(mean((x - mean)**2) + eps). x [..., n] float (rank >= 1, n > 0) -> same
    shape and dtype."""
    return call_fused(FusedOps.LAYER_NORM_LAST_DIM, x, eps=real_param(eps))


def layer_norm_last_dim_backward(x, grad, eps: float):
    """Gradient of layer_norm_last_dim(x, eps): x [..., n] is the forward input, grad [..., n]
    the upstream gradient (same shape and dtype) -> dx [..., n]:
    r * (grad - mean(grad) - xhat * mean(grad * xhat)), r = 1/sqrt(var + eps), xhat = (x-mu)*r."""
    return call_fused(FusedOps.LAYER_NORM_LAST_DIM_BACKWARD, x, grad, eps=real_param(eps))


def rms_norm_last_dim_backward(x, grad, eps: float):
    """Gradient of rms_norm_last_dim(x, eps): x [..., n] is the forward input, grad [..., n]
    the upstream gradient (same shape and dtype) -> dx [..., n]:
    r * (grad - x * sum(grad * x) / (n * den)), den = mean(x * x) + eps, r = 1/sqrt(den)."""
    return call_fused(FusedOps.RMS_NORM_LAST_DIM_BACKWARD, x, grad, eps=real_param(eps))
