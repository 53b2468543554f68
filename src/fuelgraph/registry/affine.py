"""INPLACE_AFFINE (id 16): `out = mul * x + add`, written into x's buffer.

    x [...] float (any shape, float32/float64/bfloat16/float16) -> out, same shape and dtype

The value semantics are functional: every tensor reads the value it would read if nothing were
in place. The in-place-ness is a memory contract carried by `destructive_inputs=(0,)`: the
runtime plan (runtime/plan.py `_order_destructive`) lets the kernel overwrite input 0's buffer
only when it can order every other reader of that buffer (and of its views) first; when the
buffer is a graph input or output, a constant, or is read after the op, the kernel writes a fresh
buffer instead (kernels that cannot, copy the input first).

Params `mul`, `add` (floats; the float32/16-bit kernels narrow them to float32). Backward is
DECOMPOSE (dx = mul * g). The recipe is the idiom: `x * mul + add` (either operand order, and
`x / d + add`, which canonicalizes to `x * (1/d) + add`) fuses, mul and add recovered from the
graph."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtype import round_scalar
from ..errors import FuelGraphError
from ..ir.tensor import Tensor
from .core import BackwardKind, FusedOpEntry, FusedOps, call_fused
from .rules import check_arity, check_float, real_param, same_as_input0


@dataclass(frozen=True)
class AffineParams:
    """out = mul * x + add."""
    mul: float
    add: float


def affine_recipe(x, mul, add):
    return x * mul + add


def _validate(srcs, params):
    name = "inplace_affine"
    check_arity(name, srcs, 1)
    check_float(name, srcs, labels=["x"])
    for k in ("mul", "add"):
        v = getattr(params, k)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise FuelGraphError(f"{name}: param {k} must be a real number, got {v!r}")


def declare(reg):
    reg.add(FusedOpEntry(
        id=FusedOps.INPLACE_AFFINE, name="inplace_affine", family="forward", params=AffineParams,
        shape_rule=same_as_input0, dtype_rule=same_as_input0, validate=_validate,
        decompose=affine_recipe, backward=BackwardKind.DECOMPOSE, destructive_inputs=(0,),
        sample=lambda rng: [rng.standard_normal((3, 5)).astype(np.float32)],
        doc="out = mul * x + add, elementwise, computed in x's buffer. x any shape, float -> "
            "same shape and dtype; params mul, add (floats). Functional value semantics; input 0 "
            "is destructive (reused when no later reader needs it, else a fresh buffer). Product and "
            "sum rounded separately in float32 (16/32-bit) or float64. Backward DECOMPOSE. "
            "Fuses from x * mul + add."))



# ---- builders (re-exported by fuelgraph.functional) ----------------------------------------
def inplace_affine(x, mul, add):
    """mul * x + add, elementwise. x any shape, float -> same shape and dtype. The kernel writes
    into x's buffer when no later reader needs x (otherwise it copies first); the values every
    tensor reads are as if nothing were in place. mul and add are rounded to x's dtype, as the
    recipe's constants are (so the kernel and the recipe agree, e.g. on float16 overflow)."""
    mul, add = real_param(mul), real_param(add)
    if isinstance(x, Tensor) and x.dtype.is_float and x.dtype.itemsize < 8:
        mul, add = (round_scalar(v, x.dtype) if isinstance(v, float) else v for v in (mul, add))
    return call_fused(FusedOps.INPLACE_AFFINE, x, mul=mul, add=add)
