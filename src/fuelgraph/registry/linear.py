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
`bias + a @ b` fuse for every shape (the matcher takes commutative operands either way round).

SILU_MUL (0x190): `silu(g) * u`, the gate of a SwiGLU MLP between its projections (Llama's
`down(silu(gate(x)) * up(x))`), g and u of one shape and float dtype. It fuses from the idiom
(its recipe). Backward: SILU_MUL_BACKWARD (0x191) computes (dg, du) from g, u and the output's
gradient, recomputing the sigmoid; differentiating the primitives instead makes the forward
write the sigmoid's intermediates for the backward (four outputs of g's size instead of one).
On the GPU both run as their recipes (generated glue kernels)."""
from __future__ import annotations

import numpy as np

from ..errors import FuelGraphError
from ..dtype import result_type
from ..ir.tensor import Tensor, broadcast_shapes
from .core import BackwardKind, FusedOpEntry, FusedOpId, FusedOps, NoParams, call_fused
from .rules import (check_arity, check_float, check_rank, check_same_dtype, check_same_shape,
                    same_as_input0)

_LABELS = ["a", "b", "bias"]
#: silu(g) * u and its gradient helper (dg, du)
SILU_MUL = FusedOpId(0x190)
SILU_MUL_BACKWARD = FusedOpId(0x191)


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


def silu_mul_recipe(g, u):
    """silu(g) * u = g / (1 + exp(-g)) * u: `g.silu() * u` in its canonical form (the
    optimizer rewrites g * (1 / d) to g / d), so the recipe lowers to the graph the idiom
    becomes, bit for bit."""
    return g / (1.0 + (-g).exp()) * u


def silu_mul_backward_recipe(g, u, grad):
    """(dg, du) of silu(g) * u: d = 1 + exp(-g), s = 1 / d, du = grad * (g / d),
    dg = grad * u * (s * (1 + g * (1 - s))) (silu's derivative)."""
    d = 1.0 + (-g).exp()
    s = 1.0 / d
    return grad * u * (s * (1.0 + g * (1.0 - s))), grad * (g / d)


def _silu_mul_validate(name, labels):
    def validate(srcs, params):
        check_arity(name, srcs, len(labels))
        check_float(name, srcs, labels=labels)
        check_same_shape(name, srcs, labels)
        check_same_dtype(name, srcs, tuple(range(len(labels))), labels)
    return validate


def _silu_mul_vjp(xs, ys, gs, p):
    return list(call_fused(SILU_MUL_BACKWARD, xs[0], xs[1], gs[0]))


def _same_n(k):
    return lambda shapes_or_dtypes, params: [shapes_or_dtypes[0]] * k


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
    reg.add(FusedOpEntry(
        id=SILU_MUL, name="silu_mul", family="forward", params=NoParams,
        shape_rule=same_as_input0, dtype_rule=same_as_input0,
        validate=_silu_mul_validate("silu_mul", ["g", "u"]), decompose=silu_mul_recipe,
        backward=BackwardKind.fused(SILU_MUL_BACKWARD), vjp=_silu_mul_vjp,
        recipe_only=("cuda",), fuse_late=True,
        sample=lambda rng: [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(2)],
        doc="out = silu(g) * u = g / (1 + exp(-g)) * u, elementwise (a SwiGLU MLP's gate). g, u "
            "one shape and float dtype -> out, same shape and dtype. Computed in float32 for "
            "16/32-bit inputs (float64 for float64), rounded once. Backward "
            "fused(silu_mul_backward), which recomputes the sigmoid. Fuses from silu(g) * u. "
            "On the GPU it runs as its recipe (a generated glue kernel)."))
    reg.add(FusedOpEntry(
        id=SILU_MUL_BACKWARD, name="silu_mul_backward", family="backward", params=NoParams,
        shape_rule=_same_n(2), dtype_rule=_same_n(2),
        validate=_silu_mul_validate("silu_mul_backward", ["g", "u", "grad"]),
        decompose=silu_mul_backward_recipe, backward=BackwardKind.DECOMPOSE,
        outputs=("dg", "du"), pattern_variants=None, recipe_only=("cuda",),
        sample=lambda rng: [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(3)],
        doc="Gradient of silu_mul: g, u (the forward's inputs) and grad (the output's "
            "gradient), one shape and float dtype -> (dg, du) of that shape and dtype: "
            "d = 1 + exp(-g), s = 1 / d, du = grad * (g / d), dg = grad * u * s * (1 + g * "
            "(1 - s)). "
            "Computed in float32 for 16/32-bit inputs, rounded once per output."))



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


def silu_mul(g, u):
    """silu(g) * u (SwiGLU's gate): g, u one shape and float dtype -> same shape and dtype."""
    return call_fused(SILU_MUL, g, u)


def silu_mul_backward(g, u, grad):
    """(dg, du) of silu_mul(g, u) for the output gradient `grad` (all one shape and dtype)."""
    return call_fused(SILU_MUL_BACKWARD, g, u, grad)
