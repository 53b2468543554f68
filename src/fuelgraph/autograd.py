"""Reverse-mode autograd that builds gradient nodes into the graph (lazily), so gradients can
be differentiated again. Primitive rules live in one table (VJP); fused ops dispatch on their
entry's BackwardKind."""
from __future__ import annotations

import math

from .errors import FuelGraphError
from .ir import ops
from .ir.node import Value, apply, toposort
from .ir.tensor import GRAD_LEAVES as _GRAD_LEAVES
from .ir.tensor import Tensor, full, where, zeros_like
from .opt.passes import prefuse
from .registry.core import FusedOps, call_fused, default_registry
from .scan_grad import scan_vjp


def _unbroadcast(g: Tensor, shape) -> Tensor:
    axes = tuple(i for i, (a, b) in enumerate(zip(shape, g.shape)) if a == 1 and b != 1)
    return g.sum(axes, keepdim=True) if axes else g


def _keep(g: Tensor, x: Tensor, axes, keepdim) -> Tensor:
    """Reshape a reduction's cotangent to the keepdim shape."""
    return g if keepdim else g.reshape(tuple(1 if i in axes else d for i, d in enumerate(x.shape)))


def _unary(n, x, y, g):
    k = n.op.kind
    if k == "neg": return [-g]
    if k == "exp": return [g * y]
    if k == "log": return [g / x]
    if k == "sqrt": return [g / (y * 2.0)]
    if k == "rsqrt": return [g * y * (-0.5) / x]
    if k == "recip": return [-(g * y * y)]
    if k == "abs": return [g * x.sign()]
    if k == "tanh": return [g * (1.0 - y * y)]
    if k == "erf": return [g * (2.0 / math.sqrt(math.pi)) * (-(x * x)).exp()]
    if k == "sin": return [g * x.cos()]
    if k == "cos": return [-(g * x.sin())]
    return [None]  # floor, sign: zero almost everywhere


def _integer_exponent(b: Tensor):
    op = b.node.op
    if isinstance(op, ops.Full) and float(op.value).is_integer() and abs(op.value) < 2 ** 31:
        return int(op.value)
    return None


def _binary(n, a, b, y, g):
    k = n.op.kind
    if k == "add": return [g, g]
    if k == "sub": return [g, -g]
    if k == "mul": return [g * b, g * a]
    if k == "div": return [g / b, -(g * y) / b]
    if k == "pow":
        e = _integer_exponent(b)
        if e is not None:
            return [call_fused(FusedOps.POWI_BACKWARD, a, g, exp=e), None]
        # torch's conventions at the edges: d/da is 0 where b == 0 (a ** 0 is constant, even
        # at a == 0), d/db is 0 where a == 0 and b >= 0 (0 ** b does not depend on b there)
        da = where(b == 0.0, 0.0, g * b * a ** (b - 1.0))
        db = where((a == 0.0) & (b >= 0.0), 0.0, g * y * a.log())
        return [da, db]
    if k in ("maximum", "minimum"):
        win = (a > b) if k == "maximum" else (a < b)
        tie = a == b
        ga = where(win, g, where(tie, g * 0.5, 0.0))
        return [ga, g - ga]
    if k == "rem": return [g, -(g * (a / b).floor())]  # floor remainder, as Python's %
    return [None, None]


def _reduce(n, x, y, g):
    op = n.op
    gk = _keep(g, x, op.axes, op.keepdim)
    if op.kind == "sum":
        return [gk.broadcast_to(x.shape)]
    if op.kind in ("max", "min"):
        return [call_fused(FusedOps.REDUCE_MAX_TO_BACKWARD, x if op.kind == "max" else -x, gk)]
    # prod: d/dx_i = product of the other elements, also where some x are 0 (as torch):
    # no zero in the window -> y / x; exactly one -> at the zero, the product of the rest;
    # two or more -> 0
    zero = x == 0.0
    nz = where(zero, 1.0, x)
    p_nz = nz._new(ops.Reduce("prod", op.axes, True), nz).broadcast_to(x.shape)
    n_zero = where(zero, 1.0, 0.0).astype(x.dtype).sum(op.axes, keepdim=True).broadcast_to(x.shape)
    others = where(n_zero == 0.0, p_nz / nz, where(zero & (n_zero == 1.0), p_nz, 0.0))
    return [gk.broadcast_to(x.shape) * others]


def _slice_grad(n, x, g):
    op = n.op
    lo, hi, interior = [], [], []
    for a, b, s, d, m in zip(op.starts, op.stops, op.steps, x.shape, g.shape):
        if m == 0:
            return [zeros_like(x)]
        lo.append(a)
        interior.append(s - 1)
        hi.append(d - a - (m - 1) * s - 1)
    return [g._new(ops.Pad(tuple(lo), tuple(hi), tuple(interior), 0.0), g)]


def _pad_grad(n, x, g):
    sl = n.op.placement(x.shape)
    return [g._new(ops.Slice(tuple(s.start for s in sl), tuple(s.stop for s in sl),
                             tuple(s.step for s in sl)), g)]


def _concat_grad(n, xs, g):
    out, off, ax = [], 0, n.op.axis
    for x in xs:
        idx = [slice(None)] * x.ndim
        idx[ax] = slice(off, off + x.shape[ax])
        out.append(g[tuple(idx)])
        off += x.shape[ax]
    return out


def _take_grad(n, x, idx, g):
    ax = n.op.axis
    flat = idx.reshape(-1)
    gf = g.reshape(x.shape[:ax] + (flat.shape[0],) + x.shape[ax + 1:])
    ib = flat.reshape((1,) * ax + flat.shape + (1,) * (x.ndim - ax - 1)).broadcast_to(gf.shape)
    return [zeros_like(x).scatter_add(ax, ib, gf), None]


def vjp(n, xs: list[Tensor], ys: list[Tensor], gs: list) -> list:
    """Cotangents for the sources of node `n` given cotangents `gs` of its outputs."""
    op = n.op
    g = gs[0]
    if isinstance(op, ops.Fused):
        return _fused_vjp(n, xs, ys, gs)
    if isinstance(op, ops.Scan):  # multi-output: gs[0] may be None while later slots are not
        return scan_vjp(n, xs, ys, gs, grad)
    if g is None:
        return [None] * len(xs)
    if isinstance(op, ops.Unary): return _unary(n, xs[0], ys[0], g)
    if isinstance(op, ops.Binary): return _binary(n, xs[0], xs[1], ys[0], g)
    if isinstance(op, ops.Where): return [None, where(xs[0], g, 0.0), where(xs[0], 0.0, g)]
    if isinstance(op, ops.Cast):
        return [g.astype(xs[0].dtype) if xs[0].dtype.is_float and g.dtype.is_float else None]
    if isinstance(op, ops.Reduce): return _reduce(n, xs[0], ys[0], g)
    if isinstance(op, ops.Reshape): return [g.reshape(xs[0].shape)]
    if isinstance(op, ops.Permute):
        inv = [0] * len(op.perm)
        for i, p in enumerate(op.perm):
            inv[p] = i
        return [g.permute(*inv)]
    if isinstance(op, ops.BroadcastTo): return [_unbroadcast(g, xs[0].shape)]
    if isinstance(op, ops.Slice): return _slice_grad(n, xs[0], g)
    if isinstance(op, ops.Pad): return _pad_grad(n, xs[0], g)
    if isinstance(op, ops.Concat): return _concat_grad(n, xs, g)
    if isinstance(op, ops.Gather):
        return [zeros_like(xs[0]).scatter_add(op.axis, xs[1], g), None]
    if isinstance(op, ops.Take): return _take_grad(n, xs[0], xs[1], g)
    if isinstance(op, ops.ScatterAdd): return [g, None, g.gather(op.axis, xs[1])]
    if isinstance(op, ops.MatMul): return [g @ xs[1].mT, xs[0].mT @ g]
    return [None] * len(xs)  # compare, bitwise, bitcast, leaves: no gradient


def _fused_vjp(n, xs, ys, gs):
    e = default_registry().entry(n.op.id)
    kind = e.backward.kind
    if kind == "not_differentiable":
        raise FuelGraphError(f"{e.name}: not differentiable (BackwardKind.NOT_DIFFERENTIABLE); "
                             f"detach its inputs or use a differentiable formulation")
    gs = [g if g is not None else zeros_like(y) for g, y in zip(gs, ys)]
    if kind == "fused":
        return list(e.vjp(xs, ys, gs, n.op.params))
    xs = _distinct(xs)
    outs = e.lower(xs, n.op.params)
    wrt = [i for i, x in enumerate(xs) if x.dtype.is_float]
    # partial derivatives: the inputs are independent variables here (one may depend on
    # another, e.g. a helper's `grad` input computed from its `x`): stop at them
    got = grad(list(outs), [xs[i] for i in wrt], gs, _allow_unused=True, _stop_at_inputs=True)
    res = [None] * len(xs)
    for i, r in zip(wrt, got):
        res[i] = r
    return res


def _distinct(xs: list[Tensor]) -> list[Tensor]:
    """The same value passed as two inputs of a fused op gets one partial derivative per
    position: later repeats are wrapped in an identity reshape (a distinct node)."""
    seen, out = set(), []
    for x in xs:
        if x.value in seen:
            x = Tensor(apply(ops.Reshape(x.shape), x.value))
        seen.add(x.value)
        out.append(x)
    return out


def grad(outputs, inputs, grad_outputs=None, _allow_unused=True,
         _stop_at_inputs=False) -> list[Tensor]:
    """d(outputs)/d(inputs) as lazy tensors (themselves differentiable).
    outputs: Tensor or list; inputs: list of Tensors (any values of the graph);
    grad_outputs: cotangents shaped like outputs (default: 1 for scalar outputs)."""
    def as_list(x, what):
        if isinstance(x, Tensor):
            return [x]
        if isinstance(x, (list, tuple)):
            return list(x)
        raise FuelGraphError(f"grad: {what} must be a Tensor or a list of Tensors, got "
                             f"{type(x).__name__}")
    outs, ins = as_list(outputs, "outputs"), as_list(inputs, "inputs")
    for what, ts in (("outputs", outs), ("inputs", ins)):
        bad = [type(t).__name__ for t in ts if not isinstance(t, Tensor)]
        if bad:
            raise FuelGraphError(f"grad: {what} must be Tensors, got {bad[0]}")
    if grad_outputs is None:
        for o in outs:
            if o.shape != ():
                raise FuelGraphError(f"grad: output of shape {o.shape} is not a scalar; pass "
                                     f"grad_outputs")
        grad_outputs = [full((), 1.0, o.dtype, o.device) for o in outs]
    gos = [grad_outputs] if isinstance(grad_outputs, Tensor) else list(grad_outputs)
    if len(gos) != len(outs) or any(g is not None and not isinstance(g, Tensor) for g in gos):
        raise FuelGraphError(f"grad: grad_outputs must be one Tensor (or None) per output, got "
                             f"{[type(g).__name__ for g in gos]} for {len(outs)} output(s)")
    for o, go in zip(outs, gos):
        if go is not None and go.shape != o.shape:
            raise FuelGraphError(f"grad: grad_output shape {go.shape} != output shape {o.shape}")
        if not o.dtype.is_float:
            raise FuelGraphError(f"grad: output dtype {o.dtype.name} is not a float dtype")
    in_vals = {t.value for t in ins}
    out_vals = [o.value for o in outs]
    if not _stop_at_inputs and all(isinstance(v.node.op, ops.Input) for v in in_vals):
        # differentiate the fused form: idioms then use their fused backward helpers, and
        # the forward graph realized beside the gradients fuses to the very same nodes
        out_vals = prefuse(out_vals)
    nodes = toposort(out_vals)
    dep: set = set()
    for n in nodes:
        if any(s in in_vals or s.node in dep for s in n.srcs):
            dep.add(n)
    ct: dict[Value, Tensor] = {}

    def add(v: Value, g: Tensor):
        if g.dtype != v.dtype and v.dtype.is_float:
            g = g.astype(v.dtype)
        ct[v] = ct[v] + g if v in ct else g

    for v, go in zip(out_vals, gos):
        if go is not None:
            add(v, go)
    for n in reversed(nodes):
        if n not in dep:
            continue
        if _stop_at_inputs and any(Value(n, i) in in_vals for i in range(n.nout)):
            continue
        gs = [ct.get(Value(n, i)) for i in range(n.nout)]
        if all(g is None for g in gs):
            continue
        xs = [Tensor(s) for s in n.srcs]
        ys = [Tensor(Value(n, i)) for i in range(n.nout)]
        for s, g in zip(n.srcs, vjp(n, xs, ys, gs)):
            if g is not None and s.dtype.is_float and (s in in_vals or s.node in dep):
                add(s, g)
    return [ct[t.value] if t.value in ct else zeros_like(t) for t in ins]


def backward(t: Tensor, g: Tensor | None = None):
    """Accumulate gradients of `t` into `.grad` of the requires_grad leaves it depends on."""
    leaves = [_GRAD_LEAVES[Value(n, 0)] for n in toposort([t.value])
              if isinstance(n.op, ops.Input) and Value(n, 0) in _GRAD_LEAVES]
    if not leaves:
        raise FuelGraphError("backward: no input with requires_grad=True reaches this tensor")
    gs = grad([t], leaves, None if g is None else [g])
    for leaf, gl in zip(leaves, gs):
        leaf.grad = gl if leaf.grad is None else leaf.grad + gl
