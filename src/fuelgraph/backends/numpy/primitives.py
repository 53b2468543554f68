"""NumPy kernels for the primitive basis. Half types (bfloat16, float16) are computed in
float32 and rounded once per primitive."""
from __future__ import annotations

import math

import numpy as np

from ...errors import FuelGraphError
from ...ir import ops
from ..base import scan_loop

_HALF = {np.dtype("float16")}
try:
    import ml_dtypes
    _HALF.add(np.dtype(ml_dtypes.bfloat16))
except ImportError:  # pragma: no cover
    pass


def _up(a):
    return a.astype(np.float32) if a.dtype in _HALF else a


def _down(r, like):
    return r.astype(like, copy=False) if r.dtype != like else r


def _erf(x):
    try:
        from scipy.special import erf  # optional: faster when present
        return erf(x)
    except ImportError:
        v = np.vectorize(math.erf, otypes=[x.dtype])
        return v(x)


_UNARY = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x), "recip": lambda x: 1.0 / x, "abs": np.abs,
    "tanh": np.tanh, "erf": _erf, "sin": np.sin, "cos": np.cos, "floor": np.floor,
    "sign": np.sign,
}
_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power,
    "maximum": np.maximum, "minimum": np.minimum, "rem": np.remainder, "and": np.bitwise_and,
    "or": np.bitwise_or, "xor": np.bitwise_xor, "shl": np.left_shift, "shr": np.right_shift,
}
_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}
_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


# floating-point warnings are silenced once per plan run (Plan.run), not per kernel
def unary(x, *, op):
    return _down(_UNARY[op.kind](_up(x)), x.dtype)


def binary(a, b, *, op):
    if op.kind == "div" and a.dtype.kind in "iu":
        return np.floor_divide(a, b)
    if op.kind == "pow" and a.dtype.kind in "iu" and (b < 0).any():
        raise FuelGraphError("pow: negative integer exponent on an integer tensor")
    return _down(_BINARY[op.kind](_up(a), _up(b)), a.dtype)


def compare(a, b, *, op):
    return _COMPARE[op.kind](_up(a), _up(b))


def where(c, a, b, *, op):
    return np.where(c, a, b)


def cast(x, *, op):
    return x.astype(op.dtype.np)


def bitcast(x, *, op):
    return np.asarray(x, order="C").view(op.dtype.np)


def reduce(x, *, op):
    if x.dtype in _HALF:
        r = _REDUCE[op.kind](x.astype(np.float32), axis=op.axes, keepdims=op.keepdim)
        return np.asarray(r).astype(x.dtype)
    if op.kind == "sum" and x.dtype.kind in "iub":
        return np.asarray(np.sum(x, axis=op.axes, keepdims=op.keepdim, dtype=x.dtype))
    return np.asarray(_REDUCE[op.kind](x, axis=op.axes, keepdims=op.keepdim))


def reshape(x, *, op):
    return x.reshape(op.shape)


def permute(x, *, op):
    return x.transpose(op.perm)


def broadcast_to(x, *, op):
    return np.broadcast_to(x, op.shape)


def slice_(x, *, op):
    return x[tuple(slice(a, b, s) for a, b, s in zip(op.starts, op.stops, op.steps))]


def concat(*xs, op):
    return np.concatenate(xs, axis=op.axis)


def pad(x, *, op):
    out = np.full(op.out_shape(x.shape), op.value, dtype=x.dtype)
    out[op.placement(x.shape)] = x
    return out


def _check_bounds(name, idx, n):
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad = idx[(idx < 0) | (idx >= n)].flat[0]
        raise FuelGraphError(f"{name}: index {bad} out of range for an axis of size {n}")


def gather(x, idx, *, op):
    _check_bounds("gather", idx, x.shape[op.axis])
    if idx.shape != x.shape:
        x = x[tuple(slice(0, d) if a != op.axis else slice(None) for a, d in enumerate(idx.shape))]
    return np.take_along_axis(x, idx.astype(np.intp, copy=False), axis=op.axis)


def take(x, idx, *, op):
    _check_bounds("take", idx, x.shape[op.axis])
    return np.take(x, idx.astype(np.intp, copy=False), axis=op.axis)


def scatter_add(base, idx, src, *, op):
    _check_bounds("scatter_add", idx, base.shape[op.axis])
    out = _up(base).copy()
    full = list(np.indices(idx.shape, sparse=True))
    full[op.axis] = idx.astype(np.intp, copy=False)
    np.add.at(out, tuple(full), _up(src))
    return _down(out, base.dtype)


def matmul(a, b, *, op):
    if a.dtype in _HALF:
        return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)
    return np.matmul(a, b)


def full(*, op):
    """A read-only broadcast view of one scalar: a constant costs no memory whatever its
    shape (consumers that need contiguous data copy it when they run)."""
    with np.errstate(over="ignore"):
        return np.broadcast_to(np.asarray(op.value).astype(op.dtype.np), op.shape)


def iota(*, op):
    return np.arange(op.n, dtype=op.dtype.np)


def const(*, op):
    return op.array


def scan(*args, op, run_body):
    return scan_loop(op, args, lambda shape, d: np.empty(shape, d.np), run_body)


PRIMITIVES = {
    ops.Unary: unary, ops.Binary: binary, ops.Compare: compare, ops.Where: where,
    ops.Cast: cast, ops.Bitcast: bitcast, ops.Reduce: reduce, ops.Reshape: reshape,
    ops.Permute: permute, ops.BroadcastTo: broadcast_to, ops.Slice: slice_, ops.Concat: concat,
    ops.Pad: pad, ops.Gather: gather, ops.Take: take, ops.ScatterAdd: scatter_add,
    ops.MatMul: matmul, ops.Full: full, ops.Iota: iota, ops.Const: const, ops.Scan: scan,
}
# numpy returns views for these: the planner treats their outputs as aliases of input 0
VIEW_OPS = (ops.Reshape, ops.Permute, ops.BroadcastTo, ops.Slice, ops.Bitcast)
