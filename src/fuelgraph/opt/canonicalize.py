"""Canonicalization: equivalent spellings meet one form so that one pattern per op suffices.

Every rewrite is a named `Rule` (a pattern + a function of its bindings, see `engine`); `fg.explain`
reports which fired and how often. The forms chosen:
- arithmetic: `a / b` (not `a * (1/b)`; `a * rsqrt(..)` -> `a / sqrt(..)`), constant divisors
  as multipliers `x * c`, `x * x` for `x ** 2`, commutative operands ordered;
- movement: no identity movement, chains of one kind collapsed, keepdim reductions, a
  reduction over size-1 axes is a reshape, squeeze/unsqueeze reshapes sit after elementwise
  ops and after reductions;
- negation and constant scaling sit after permutes, slices, other reshapes and gathers/takes,
  before broadcasts, and fold into a constant multiplier. Neither crosses a sum: -(a + b) and
  (-a) + (-b) differ in the sign of an exact zero, c * (a + b) and c*a + c*b in rounding
  (spellings with the negation outside a reduction are declared as extra patterns instead);
- stop-gradients sit after movement ops.
Every rule is exact, except `x / c -> x * (1/c)` (at most an ulp, only where 1/c is normal) and
changes of reduction layout (a reduction's summation order is the backend's choice). Rules
only build nodes over already-rewritten values, so one walk canonicalizes a graph."""
from __future__ import annotations

import math

import ml_dtypes

from ..ir import ops
from ..ir.node import Value, apply
from .engine import Pass, Pat, Rule

COMMUTATIVE = {"add", "mul", "maximum", "minimum", "and", "or", "xor", "eq", "ne"}

_MOVES_AFTER = (ops.Reshape, ops.Permute, ops.Slice)   # elementwise-with-constant ops move
_GATHERS = (ops.Gather, ops.Take)                       # after these (same or fewer elements)
_X = Pat.var("x")


def _val(v: Value):
    op = v.node.op
    return op.value if isinstance(op, ops.Full) else None


def _full_like(v: Value, shape, value) -> Value:
    return apply(ops.Full(tuple(shape), value, v.dtype, v.node.device))


def _is_float(v: Value) -> bool:
    return v.dtype.is_float


def _neg(v: Value) -> Value:
    return apply(ops.Unary("neg"), v)


def _mul_const(x: Value, c) -> Value:
    return apply(ops.Binary("mul"), x, _full_like(x, x.shape, c))


def _moved(root: Value, x: Value) -> Value:
    """root's movement/gather op applied to x instead of root's first source."""
    return apply(root.node.op, x, *root.node.srcs[1:])


def _mul(a, b, **kw):
    return Pat(ops.Binary, "mul", (a, b), commutative=True, **kw)


# ---- movement ------------------------------------------------------------------------------
def _movement_noop(root, x):
    return x if x.shape == root.shape else None


def _movement_of_constant(root, c):
    return _full_like(c, root.shape, c.node.op.value)


def _collapse(root, x):
    return apply(type(root.node.op)(root.shape), x)


def _permute_identity(root, x):
    p = root.node.op.perm
    return x if p == tuple(range(len(p))) else None


def _permute_of_permute(root, inner, x):
    p, q = root.node.op.perm, inner.node.op.perm
    return apply(ops.Permute(tuple(q[i] for i in p)), x)


def _cast_noop(root, x):
    return x if x.dtype == root.dtype else None


def _detach_after_movement(root, x):
    return apply(ops.Detach(), _moved(root, x))


# ---- reductions ----------------------------------------------------------------------------
def _reduce_keepdim(root, x):
    op = root.node.op
    if op.keepdim:
        return None
    return apply(ops.Reshape(root.shape), apply(ops.Reduce(op.kind, op.axes, True), x))


def _reduce_size1_is_reshape(root, x):
    """Axes of extent 1 add nothing to a reduction (with keepdim not even a reshape): they are
    dropped. A reduction over such axes only is the identity, except that a sum starts from
    +0.0 (NumPy's and torch's too), so it is `x + 0.0` (-0.0 becomes +0.0, all else stays)."""
    op = root.node.op
    if not op.keepdim:
        return None
    axes = tuple(a for a in op.axes if x.shape[a] != 1)
    if axes == op.axes:
        return None
    if axes:
        return apply(ops.Reduce(op.kind, axes, True), x)
    if op.kind == "sum" and _is_float(x):
        return apply(ops.Binary("add"), x, _full_like(x, x.shape, 0.0))
    return x


def _unit_axes_map(src, dst):
    """For a reshape src -> dst that only inserts or removes extent-1 axes: {dst axis: src
    axis} for the axes of extent > 1; None for any other reshape."""
    a = [i for i, d in enumerate(src) if d != 1]
    b = [i for i, d in enumerate(dst) if d != 1]
    if [src[i] for i in a] != [dst[i] for i in b]:
        return None
    return dict(zip(b, a))


def _reduce_of_unit_reshape(root, r, x):
    """Reduce(Reshape(x)) -> Reshape(Reduce(x)) when the reshape only adds or drops extent-1
    axes (squeeze/unsqueeze): the reduction reads the same elements."""
    op = root.node.op
    if not op.keepdim:
        return None
    m = _unit_axes_map(x.shape, r.shape)
    if m is None or any(a not in m for a in op.axes):
        return None
    red = apply(ops.Reduce(op.kind, tuple(sorted(m[a] for a in op.axes)), True), x)
    return apply(ops.Reshape(root.shape), red)


# ---- negation and constant scaling ---------------------------------------------------------
def _is_unit_reshape(v: Value) -> bool:
    """v = Reshape(x) that only inserts or removes extent-1 axes (squeeze/unsqueeze)."""
    n = v.node
    return isinstance(n.op, ops.Reshape) and _unit_axes_map(n.srcs[0].shape, v.shape) is not None


def _unit_reshape_after_elementwise(root):
    """f(Reshape(a), Reshape(b) or a constant) -> Reshape(f(a, b)) when the reshapes are the
    same squeeze/unsqueeze: squeezes and unsqueezes sit after elementwise work (and then meet
    reductions, see _reduce_of_unit_reshape), so `x.mean(-1)[..., None]`, `-(g[:, 0]).sum()` and
    `m[:, 0] + log(s[:, 0])` meet their keepdim spellings. Exact: f sees the same elements."""
    n = root.node
    inner = {s.node.srcs[0].shape for s in n.srcs if _is_unit_reshape(s)}
    if len(inner) != 1 or not all(_is_unit_reshape(s) or isinstance(s.node.op, ops.Full)
                                  for s in n.srcs):
        return None
    (shape,) = inner
    srcs = [s.node.srcs[0] if _is_unit_reshape(s) else _full_like(s, shape, s.node.op.value)
            for s in n.srcs]
    return apply(ops.Reshape(root.shape), apply(n.op, *srcs))


def _neg_after_move(root, x):
    if _is_unit_reshape(root):
        return None            # squeezes/unsqueezes go the other way
    return _neg(_moved(root, x))


def _neg_before_broadcast(b, x):
    return apply(b.node.op, _neg(x))


def _scale_after_move(root, x, c):
    if not _is_float(x) or _is_unit_reshape(root):
        return None
    return _mul_const(_moved(root, x), c.node.op.value)


def _scale_before_broadcast(b, x, c):
    if not _is_float(x):
        return None
    return apply(b.node.op, _mul_const(x, c.node.op.value))


def _neg_into_scale(x, c):
    if not _is_float(x) or _val(c) == -1:       # (-x) * -1 is x: left to the -1 rule
        return None
    return _mul_const(x, -c.node.op.value)


# ---- arithmetic ----------------------------------------------------------------------------
def _div_one_to_recip(a, b):
    return apply(ops.Unary("recip"), b) if _is_float(b) and _val(a) == 1 else None


def _div_by_const_to_mul(a, c):
    v = c.node.op.value
    if not _is_float(a) or not _exact_enough_reciprocal(v, c.dtype):
        return None
    return apply(ops.Binary("mul"), a, _full_like(c, c.shape, 1.0 / v))


def _exact_enough_reciprocal(c, d) -> bool:
    """x / c -> x * (1/c) changes a result by at most an ulp only when 1/c (and c) are normal
    numbers of the dtype; otherwise the reciprocal over- or underflows."""
    if c == 0 or not math.isfinite(c):
        return False
    info = ml_dtypes.finfo(d.np)       # NumPy's finfo does not know bfloat16
    r = abs(1.0 / c)
    return float(info.tiny) <= r <= float(info.max) and float(info.tiny) <= abs(c)


def _den(r):
    d = r.node.srcs[0]
    return apply(ops.Unary("sqrt"), d) if r.node.op.kind == "rsqrt" else d


def _mul_reciprocal_to_div(x, r):
    return apply(ops.Binary("div"), x, _den(r)) if _is_float(x) else None


def _mul_broadcast_reciprocal_to_div(x, b, r):
    if not _is_float(x):
        return None
    return apply(ops.Binary("div"), x, apply(b.node.op, _den(r)))


def _mul_by_minus_one(x, c):
    return _neg(x) if _is_float(x) and _val(c) == -1 else None


def _neg_zero_sub(a, b):
    v = _val(a)
    if _is_float(a) and v == 0 and math.copysign(1, v) < 0:
        return _neg(b)   # exact only for -0.0: +0.0 - (+0.0) is +0.0
    return None


_POW_UNARY = {0.5: "sqrt", -1: "recip", -0.5: "rsqrt"}


def _pow_simplify(x, c):
    e = _val(c)
    if not _is_float(x):
        return None
    if e == 1:
        return x
    if e == 2:
        return apply(ops.Binary("mul"), x, x)
    if e in _POW_UNARY:
        return apply(ops.Unary(_POW_UNARY[e]), x)
    return None


def _recip_sqrt(x):
    return apply(ops.Unary("rsqrt"), x)


def _order_key(v: Value):
    return (isinstance(v.node.op, ops.Full), v.node.uid, v.slot)


def _order_commutative(root, a, b):
    if _order_key(b) < _order_key(a):
        return apply(type(root.node.op)(root.node.op.kind), b, a)
    return None


_COMMUTATIVE_KINDS = tuple(sorted(COMMUTATIVE))
_MOVEMENT = (ops.Reshape, ops.BroadcastTo, ops.Permute, ops.Slice)

RULES = [
    # movement
    Rule("movement_noop", Pat((ops.Reshape, ops.BroadcastTo), src=(_X,), name="root"),
         _movement_noop),
    Rule("movement_of_constant",
         Pat((ops.Reshape, ops.BroadcastTo), src=(Pat.const("c"),), name="root"),
         _movement_of_constant),
    Rule("reshape_of_reshape", Pat(ops.Reshape, src=(Pat(ops.Reshape, src=(_X,)),), name="root"),
         _collapse),
    Rule("broadcast_of_broadcast",
         Pat(ops.BroadcastTo, src=(Pat(ops.BroadcastTo, src=(_X,)),), name="root"), _collapse),
    Rule("unit_reshape_after_elementwise", Pat((ops.Unary, ops.Binary, ops.Compare), name="root"),
         _unit_reshape_after_elementwise),
    Rule("permute_identity", Pat(ops.Permute, src=(_X,), name="root"), _permute_identity),
    Rule("permute_of_permute",
         Pat(ops.Permute, src=(Pat(ops.Permute, src=(_X,), name="inner"),), name="root"),
         _permute_of_permute),
    Rule("cast_noop", Pat(ops.Cast, src=(_X,), name="root"), _cast_noop),
    Rule("detach_after_movement",
         Pat(_MOVEMENT, src=(Pat(ops.Detach, src=(_X,)),), name="root"), _detach_after_movement),
    # reductions
    Rule("reduce_keepdim", Pat(ops.Reduce, src=(_X,), name="root"), _reduce_keepdim),
    Rule("reduce_size1_is_reshape", Pat(ops.Reduce, src=(_X,), name="root"),
         _reduce_size1_is_reshape),
    Rule("reduce_of_unit_reshape",
         Pat(ops.Reduce, src=(Pat(ops.Reshape, src=(_X,), name="r"),), name="root"),
         _reduce_of_unit_reshape),
    # negation and constant scaling
    Rule("neg_through_movement",
         Pat(_MOVES_AFTER, src=(Pat(ops.Unary, "neg", src=(_X,)),), name="root"),
         _neg_after_move),
    Rule("neg_through_gather",
         Pat(_GATHERS, src=(Pat(ops.Unary, "neg", src=(_X,)), Pat()), name="root"),
         _neg_after_move),
    Rule("neg_before_broadcast",
         Pat(ops.Unary, "neg", src=(Pat(ops.BroadcastTo, src=(_X,), name="b"),)),
         _neg_before_broadcast),
    Rule("scale_through_movement",
         Pat(_MOVES_AFTER, src=(_mul(_X, Pat.const("c")),), name="root"), _scale_after_move),
    Rule("scale_through_gather",
         Pat(_GATHERS, src=(_mul(_X, Pat.const("c")), Pat()), name="root"),
         _scale_after_move),
    Rule("scale_before_broadcast",
         _mul(Pat(ops.BroadcastTo, src=(_X,), name="b"), Pat.const("c")),
         _scale_before_broadcast),
    Rule("neg_into_scale", _mul(Pat(ops.Unary, "neg", src=(_X,)), Pat.const("c")),
         _neg_into_scale),
    Rule("neg_of_scale", Pat(ops.Unary, "neg", src=(_mul(_X, Pat.const("c")),)),
         _neg_into_scale),
    # arithmetic
    Rule("div_one_to_recip", Pat(ops.Binary, "div", (Pat.const("a"), Pat.var("b"))),
         _div_one_to_recip),
    Rule("div_by_const_to_mul", Pat(ops.Binary, "div", (Pat.var("a"), Pat.const("c"))),
         _div_by_const_to_mul),
    Rule("mul_reciprocal_to_div",
         _mul(_X, Pat(ops.Unary, ("recip", "rsqrt"), name="r")), _mul_reciprocal_to_div),
    Rule("mul_broadcast_reciprocal_to_div",
         _mul(_X, Pat(ops.BroadcastTo, src=(Pat(ops.Unary, ("recip", "rsqrt"), name="r"),),
                      name="b")),
         _mul_broadcast_reciprocal_to_div),
    Rule("mul_by_minus_one_to_neg", _mul(_X, Pat.const("c")), _mul_by_minus_one),
    Rule("neg_zero_minus_to_neg", Pat(ops.Binary, "sub", (Pat.const("a"), Pat.var("b"))),
         _neg_zero_sub),
    Rule("pow_by_constant", Pat(ops.Binary, "pow", (_X, Pat.const("c"))), _pow_simplify),
    Rule("neg_neg", Pat(ops.Unary, "neg", src=(Pat(ops.Unary, "neg", src=(_X,)),)),
         lambda x: x),
    Rule("recip_sqrt_to_rsqrt", Pat(ops.Unary, "recip", src=(Pat(ops.Unary, "sqrt", src=(_X,)),)),
         _recip_sqrt),
    Rule("order_commutative_operands",
         Pat((ops.Binary, ops.Compare), _COMMUTATIVE_KINDS, (Pat.var("a"), Pat.var("b")),
             name="root"),
         _order_commutative),
]

CANONICALIZE = Pass("canonicalize", RULES)
