"""Canonicalization: equivalent spellings meet one form so that one pattern per op suffices.
Forms chosen: `a / b` (not `a * (1/b)` or `a * rsqrt(..)` -> `a / sqrt(..)`), constants as
`x * c` (not `x / k`), keepdim reductions, `x * x` for `x ** 2`, commutative operands
ordered, no identity movement ops."""
from __future__ import annotations

import math

import ml_dtypes

from ..ir import ops
from ..ir.node import Node, Value, apply
from .engine import Pass

COMMUTATIVE = {"add", "mul", "maximum", "minimum", "and", "or", "xor", "eq", "ne"}


def _full_value(v: Value):
    op = v.node.op
    return op.value if isinstance(op, ops.Full) else None


def _unwrap_bcast(v: Value):
    """(inner, shape) when v = BroadcastTo(inner), else (v, None)."""
    if isinstance(v.node.op, ops.BroadcastTo):
        return v.node.srcs[0], v.shape
    return v, None


def _rewrap(v: Value, shape):
    return v if shape is None else apply(ops.BroadcastTo(shape), v)


def movement(n: Node):
    op, srcs = n.op, n.srcs
    if isinstance(op, (ops.Reshape, ops.BroadcastTo)):
        x = srcs[0]
        if x.shape == op.shape:
            return x
        if isinstance(x.node.op, ops.Full):
            f = x.node.op
            return apply(ops.Full(op.shape, f.value, f.dtype, f.device))
        if type(x.node.op) is type(op):
            return apply(type(op)(op.shape), x.node.srcs[0])
        if isinstance(op, ops.Reshape):
            return _undo_reshape_through_scalar_op(op, x)
    if isinstance(op, ops.Permute):
        if op.perm == tuple(range(len(op.perm))):
            return srcs[0]
        if isinstance(srcs[0].node.op, ops.Permute):
            inner = srcs[0].node.op.perm
            return apply(ops.Permute(tuple(inner[p] for p in op.perm)), srcs[0].node.srcs[0])
    if isinstance(op, ops.Cast) and srcs[0].dtype == op.dtype:
        return srcs[0]
    if isinstance(op, ops.Reduce) and not op.keepdim:
        kept = apply(ops.Reduce(op.kind, op.axes, True), srcs[0])
        return apply(ops.Reshape(n.shapes[0]), kept)
    return None


def _undo_reshape_through_scalar_op(op, x: Value):
    """Reshape(f(Reshape(r), c)) -> f(r, c) when r is a reduction, the outer reshape restores
    its shape and c is a constant: `x.mean(-1)[..., None]` (a squeezed reduction, scaled,
    unsqueezed again) meets the keepdim spelling `x.mean(-1, keepdim=True)`. Elementwise and
    value-preserving; limited to reduced tensors so that a duplicate of f (when its squeezed
    result has other readers) costs next to nothing."""
    node = x.node
    if not isinstance(node.op, (ops.Binary, ops.Unary)):
        return None
    inner = [s for s in node.srcs if not isinstance(s.node.op, ops.Full)]
    if len(inner) != 1 or not isinstance(inner[0].node.op, ops.Reshape):
        return None
    r = inner[0].node.srcs[0]
    if r.shape != op.shape or not isinstance(r.node.op, ops.Reduce):
        return None
    srcs = tuple(r if s is inner[0] else apply(ops.Full(op.shape, s.node.op.value, s.dtype,
                                                         s.node.device))
                 for s in node.srcs)
    return apply(node.op, *srcs)


def arithmetic(n: Node):
    op, srcs = n.op, n.srcs
    if isinstance(op, ops.Binary) and srcs[0].dtype.is_float:
        a, b = srcs
        if op.kind == "div":
            if _full_value(a) == 1:
                return apply(ops.Unary("recip"), b)
            c = _full_value(b)
            if c is not None and _exact_enough_reciprocal(c, b.dtype):
                return apply(ops.Binary("mul"), a, apply(ops.Full(b.shape, 1.0 / c, b.dtype, b.node.device)))
        if op.kind == "mul":
            for x, y in ((a, b), (b, a)):
                inner, shape = _unwrap_bcast(y)
                k = inner.node.op
                if isinstance(k, ops.Unary) and k.kind in ("recip", "rsqrt"):
                    den = inner.node.srcs[0]
                    if k.kind == "rsqrt":
                        den = apply(ops.Unary("sqrt"), den)
                    return apply(ops.Binary("div"), x, _rewrap(den, shape))
                if _full_value(y) == -1:
                    return apply(ops.Unary("neg"), x)
        if op.kind == "sub" and _full_value(a) == 0 and math.copysign(1, _full_value(a)) < 0:
            return apply(ops.Unary("neg"), b)  # exact only for -0.0: +0.0 - (+0.0) is +0.0
        if op.kind == "pow":
            e = _full_value(b)
            simple = {1: None, 2: "sq", 0.5: "sqrt", -1: "recip", -0.5: "rsqrt"}
            if e in simple:
                if e == 1:
                    return a
                if e == 2:
                    return apply(ops.Binary("mul"), a, a)
                return apply(ops.Unary(simple[e]), a)
    if isinstance(op, ops.Unary):
        x = srcs[0]
        if op.kind == "neg" and isinstance(x.node.op, ops.Unary) and x.node.op.kind == "neg":
            return x.node.srcs[0]
        if op.kind == "recip" and isinstance(x.node.op, ops.Unary) and x.node.op.kind == "sqrt":
            return apply(ops.Unary("rsqrt"), x.node.srcs[0])
    return None


def _exact_enough_reciprocal(c, d) -> bool:
    """x / c -> x * (1/c) changes a result by at most an ulp only when 1/c (and c) are normal
    numbers of the dtype; otherwise the reciprocal over- or underflows."""
    if c == 0 or not math.isfinite(c):
        return False
    info = ml_dtypes.finfo(d.np)       # NumPy's finfo does not know bfloat16
    r = abs(1.0 / c)
    return float(info.tiny) <= r <= float(info.max) and float(info.tiny) <= abs(c)


def _order_key(v: Value):
    return (isinstance(v.node.op, ops.Full), v.node.uid, v.slot)


def commutative(n: Node):
    op = n.op
    if isinstance(op, (ops.Binary, ops.Compare)) and op.kind in COMMUTATIVE:
        a, b = n.srcs
        if _order_key(b) < _order_key(a):
            return apply(type(op)(op.kind), b, a)
    return None


CANONICALIZE = Pass("canonicalize", [("movement", movement), ("arithmetic", arithmetic),
                                     ("commutative", commutative)])
