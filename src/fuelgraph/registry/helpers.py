"""Backward helpers of primitives: REDUCE_MAX_TO_BACKWARD (id 10, emitted by the gradient of
max/min reductions) and POWI_BACKWARD (id 15, emitted by the gradient of x ** n for integer n)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FuelGraphError
from ..ir.tensor import where, zeros_like
from .core import BackwardKind, FusedOpEntry, FusedOps, NoParams, call_fused
from .rules import check_arity, check_float, check_same_dtype, pair_float_rowwise, same_as_input0


def reduced_axes(x_shape, g_shape) -> tuple[int, ...]:
    """Axes a keepdim max reduced: extent 1 in the gradient but not in x."""
    return tuple(i for i, (a, b) in enumerate(zip(x_shape, g_shape)) if b == 1 and a != 1)


def reduce_max_to_backward_recipe(x, grad):
    axes = reduced_axes(x.shape, grad.shape)
    m = x.max(axes, keepdim=True) if axes else x
    mask = where(x == m.broadcast_to(x.shape), 1.0, 0.0).astype(x.dtype)
    ties = mask.sum(axes, keepdim=True) if axes else mask
    return mask * (grad / ties).broadcast_to(x.shape)


def _validate_reduce_max(srcs, params):
    name = "reduce_max_to_backward"
    check_arity(name, srcs, 2)
    check_float(name, srcs, labels=["x", "grad"])
    check_same_dtype(name, srcs, (0, 1), ["x", "grad"])
    x, g = srcs
    if len(g.shape) != len(x.shape) or any(b not in (1, a) for a, b in zip(x.shape, g.shape)):
        raise FuelGraphError(f"{name}: grad has shape {g.shape}, expected the keepdim max shape of "
                             f"x {x.shape} (same rank, each axis 1 or x's extent)")


@dataclass(frozen=True)
class PowIParams:
    exp: int


def _validate_powi(srcs, params):
    pair_float_rowwise("powi_backward", ("x", "grad"), min_rank=0)(srcs, params)
    e = params.exp
    if isinstance(e, (bool, np.bool_)) or not isinstance(e, (int, np.integer)):
        raise FuelGraphError(f"powi_backward: param exp must be an integer, got {e!r}")


def powi_backward_recipe(x, grad, exp):
    if exp == 0:
        return zeros_like(x)
    return grad * (x ** float(exp - 1) * float(exp))


def declare(reg):
    reg.add(FusedOpEntry(
        id=FusedOps.REDUCE_MAX_TO_BACKWARD, name="reduce_max_to_backward", family="backward",
        params=NoParams, shape_rule=same_as_input0, dtype_rule=same_as_input0,
        validate=_validate_reduce_max, decompose=reduce_max_to_backward_recipe,
        backward=BackwardKind.DECOMPOSE, pattern_variants=None,
        sample=lambda rng: [rng.standard_normal((3, 5)).astype(np.float32),
                            rng.standard_normal((3, 1)).astype(np.float32)],
        doc="Gradient of a keepdim max: x [...], grad shaped like max(x, axes, keepdim=True). "
            "dx = (x == max) * grad / (#ties): tied maxima share the gradient evenly (torch amax); "
            "a window whose max is NaN gets NaN, as in torch."))
    reg.add(FusedOpEntry(
        id=FusedOps.POWI_BACKWARD, name="powi_backward", family="backward", params=PowIParams,
        shape_rule=same_as_input0, dtype_rule=same_as_input0,
        validate=_validate_powi,
        decompose=powi_backward_recipe, backward=BackwardKind.DECOMPOSE, pattern_variants=None,
        sample=lambda rng: [rng.standard_normal((3, 5)).astype(np.float32)] * 2,
        doc="dx = exp * x**(exp-1) * grad for an integer exp (negative allowed); exp == 0 gives "
            "zeros. x and grad have one shape and dtype."))



# ---- builders (re-exported by fuelgraph.functional) ----------------------------------------
def reduce_max_to_backward(x, grad):
    """Gradient of max(x, axes, keepdim=True): grad has that keepdim shape; tied maxima share
    it evenly (torch amax semantics)."""
    return call_fused(FusedOps.REDUCE_MAX_TO_BACKWARD, x, grad)


def powi_backward(x, grad, exp: int):
    """Gradient of x ** exp for an integer exp: exp * x**(exp-1) * grad (zeros for exp == 0)."""
    return call_fused(FusedOps.POWI_BACKWARD, x, grad, exp=exp)
