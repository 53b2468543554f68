"""FUSED_LINEAR (id 2): `out = a @ b + bias`.

    a [..., M, K], b [K, N] or [..., K, N], bias [N]  ->  out [batch, M, N]

All three inputs share one float dtype (float32, float64, bfloat16, float16). b is in K x N
orientation (not nn.Linear's [N, K]: write `x @ w.mT + bias` for that, it fuses too since the
transpose is just b's producer). Batch dims of a and b broadcast NumPy-style (right-aligned,
extent 1 stretches; the as-built GQA-style repeat with C_d > 1 is not broadcasting and is
rejected); `batch = broadcast(a.shape[:-2], b.shape[:-2])`. Output dtype is a's.

Backward is DECOMPOSE: differentiating the recipe gives grad_a = g @ b^T, grad_b = a^T @ g and
grad_bias = sum(g), each summed over the batch dims its input was broadcast along (H.14).
The recipe is the idiom (`a @ b + bias`), written as one GEMM over the rows of a when b is a
shared 2-D weight; the plain idiom is also declared as a spelling, so `a @ b + bias` and
`bias + a @ b` fuse for every shape (the matcher takes commutative operands either way round)."""
from __future__ import annotations

import numpy as np

from ..errors import FuelGraphError
from ..dtype import result_type
from ..ir.tensor import Tensor, broadcast_shapes
from .core import BackwardKind, FusedOpEntry, FusedOps, NoParams, call_fused
from .rules import check_arity, check_float, check_rank, check_same_dtype

_LABELS = ["a", "b", "bias"]


def linear_spelling(a, b, bias):
    """The idiom as users write it (the fusion pattern)."""
    return a @ b + bias


def linear_recipe(a, b, bias):
    """The decomposition: the idiom, except that a batched a times a shared 2-D b is one GEMM
    over all rows of a (as the kernel does it), so that the lowered forward is one GEMM and the
    gradient DECOMPOSE derives from it gives grad_b = rows(a)^T @ rows(g), one GEMM, instead of
    a batch of products summed afterwards."""
    if b.ndim == 2 and a.ndim > 2:
        rows = a.reshape(-1, a.shape[-1]) @ b
        return rows.reshape(a.shape[:-1] + (b.shape[-1],)) + bias
    return a @ b + bias


def _batch(name, a_shape, b_shape):
    try:
        return broadcast_shapes(a_shape[:-2], b_shape[:-2], op=name)
    except FuelGraphError:
        raise FuelGraphError(f"{name}: batch dims of a {tuple(a_shape)} and b {tuple(b_shape)} "
                             f"do not broadcast (a [..., M, K], b [K, N] or [..., K, N])") from None


def _validate(srcs, params):
    name = "fused_linear"
    check_arity(name, srcs, 3)
    check_float(name, srcs, labels=_LABELS)
    check_same_dtype(name, srcs, (0, 1, 2), _LABELS)
    a, b, bias = srcs
    check_rank(name, a, "a", 2)
    check_rank(name, b, "b", 2)
    if a.shape[-1] != b.shape[-2]:
        raise FuelGraphError(f"fused_linear: b has shape {b.shape}, expected K = {a.shape[-1]} "
                             f"rows (a is {a.shape} = [..., M, K]; b is [..., K, N])")
    if tuple(bias.shape) != (b.shape[-1],):
        raise FuelGraphError(f"fused_linear: bias has shape {bias.shape}, expected "
                             f"({b.shape[-1]},) = [N] (b is {b.shape})")
    _batch(name, a.shape, b.shape)


def _shape_rule(shapes, params):
    a, b = shapes[0], shapes[1]
    return [_batch("fused_linear", a, b) + (a[-2], b[-1])]


def _dtype_rule(dtypes, params):
    return [dtypes[0]]


def _sample(rng):
    # both batches broadcast, so the derived pattern holds a BroadcastTo above a and b: the
    # matcher skips those where a graph has none, and where it has them it captures the
    # un-broadcast operands (the kernel broadcasts without materializing)
    return [rng.standard_normal((2, 1, 3, 4)).astype(np.float32),
            rng.standard_normal((3, 4, 5)).astype(np.float32),
            rng.standard_normal((5,)).astype(np.float32)]


def declare(reg):
    reg.add(FusedOpEntry(
        id=FusedOps.FUSED_LINEAR, name="fused_linear", family="forward", params=NoParams,
        shape_rule=_shape_rule, dtype_rule=_dtype_rule, validate=_validate,
        decompose=linear_recipe, backward=BackwardKind.DECOMPOSE, sample=_sample,
        extra_patterns=(linear_spelling,),
        doc="out = a @ b + bias. a [..., M, K], b [K, N] or [..., K, N] (batch dims broadcast "
            "NumPy-style), bias [N]; one float dtype for all three -> out "
            "[broadcast(a.shape[:-2], b.shape[:-2]), M, N] in that dtype. Accumulates in "
            "float32 for 16/32-bit inputs, float64 for float64. Backward DECOMPOSE (grad_b and "
            "grad_bias summed over broadcast batches). Fuses from a @ b + bias and "
            "bias + a @ b."))



# ---- builders (re-exported by fuelgraph.functional) ----------------------------------------
def fused_linear(a, b, bias):
    """a @ b + bias. a [..., M, K]; b [K, N] or [..., K, N] (K x N, not nn.Linear's [N, K];
    batch dims broadcast NumPy-style); bias [N] -> [broadcast(a.shape[:-2], b.shape[:-2]), M, N].
    Mixed dtypes are promoted first with the table `@` and `+` use (torch's: an int operand
    takes the float one's dtype, float16 with bfloat16 gives float32, wider floats win)."""
    if all(isinstance(t, Tensor) for t in (a, b, bias)) and \
            len({a.dtype, b.dtype, bias.dtype}) > 1:
        d = result_type(result_type(a.dtype, b.dtype), bias.dtype)
        a, b, bias = a.astype(d), b.astype(d), bias.astype(d)
    return call_fused(FusedOps.FUSED_LINEAR, a, b, bias)
