"""The primitive basis on CUDA through torch ops (storage: torch CUDA tensors). Half types are
computed the way torch computes them (float32 internally, one rounding per op)."""
from __future__ import annotations

import numpy as np
import torch

from ...ir import ops
from ..base import scan_loop

_UNARY = {
    "neg": torch.neg, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "recip": torch.reciprocal, "abs": torch.abs, "tanh": torch.tanh,
    "erf": torch.erf, "sin": torch.sin, "cos": torch.cos, "floor": torch.floor, "sign": torch.sign,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum, "rem": torch.remainder,
    "and": torch.bitwise_and, "or": torch.bitwise_or, "xor": torch.bitwise_xor,
    "shl": torch.bitwise_left_shift, "shr": torch.bitwise_right_shift,
}
_COMPARE = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
            "ge": torch.ge}


def tdtype(d):
    return getattr(torch, d.name)


def unary(x, *, op):
    return _UNARY[op.kind](x)


def binary(a, b, *, op):
    if op.kind == "div" and not a.is_floating_point():
        return torch.floor_divide(a, b)
    return _BINARY[op.kind](a, b)


def compare(a, b, *, op):
    return _COMPARE[op.kind](a, b)


def where(c, a, b, *, op):
    return torch.where(c, a, b)


def cast(x, *, op):
    return x.to(tdtype(op.dtype))


def bitcast(x, *, op):
    return x.contiguous().view(tdtype(op.dtype))


def reduce(x, *, op):
    if op.kind == "sum":
        return x.sum(dim=op.axes, keepdim=op.keepdim, dtype=x.dtype)
    if op.kind == "max":
        return torch.amax(x, dim=op.axes, keepdim=op.keepdim)
    if op.kind == "min":
        return torch.amin(x, dim=op.axes, keepdim=op.keepdim)
    r = x
    for a in sorted(op.axes, reverse=True):
        r = r.prod(dim=a, keepdim=True)
    return r if op.keepdim else r.reshape([d for i, d in enumerate(x.shape) if i not in op.axes])


def reshape(x, *, op):
    return x.reshape(op.shape)


def permute(x, *, op):
    return x.permute(op.perm)


def broadcast_to(x, *, op):
    return x.expand(op.shape)


def slice_(x, *, op):
    return x[tuple(slice(a, b, s) for a, b, s in zip(op.starts, op.stops, op.steps))]


def concat(*xs, op):
    return torch.cat(xs, dim=op.axis)


def pad(x, *, op):
    out = torch.full(op.out_shape(x.shape), op.value, dtype=x.dtype, device=x.device)
    out[op.placement(x.shape)] = x
    return out


def gather(x, idx, *, op):
    return torch.gather(x, op.axis, idx.long())


def take(x, idx, *, op):
    flat = torch.index_select(x, op.axis, idx.reshape(-1).long())
    return flat.reshape(x.shape[:op.axis] + tuple(idx.shape) + x.shape[op.axis + 1:])


def scatter_add(base, idx, src, *, op):
    return base.clone().scatter_add_(op.axis, idx.long(), src)


def matmul(a, b, *, op):
    return torch.matmul(a, b)


def _dev(op):
    return torch.device(op.device)


def full(*, op):
    """A broadcast view of one scalar: a constant costs no memory whatever its shape."""
    return torch.full((), op.value, dtype=tdtype(op.dtype), device=_dev(op)).expand(op.shape)


def iota(*, op):
    return torch.arange(op.n, dtype=tdtype(op.dtype), device=_dev(op))


def const(*, op):
    a = op.array
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(_dev(op))
    return torch.from_numpy(a.copy()).to(_dev(op))


def scan(*args, op, run_body):
    dev = args[0].device if args else torch.device("cuda")
    return scan_loop(op, args, lambda shape, d: torch.empty(shape, dtype=tdtype(d), device=dev),
                     run_body)


PRIMITIVES = {
    ops.Unary: unary, ops.Binary: binary, ops.Compare: compare, ops.Where: where,
    ops.Cast: cast, ops.Bitcast: bitcast, ops.Reduce: reduce, ops.Reshape: reshape,
    ops.Permute: permute, ops.BroadcastTo: broadcast_to, ops.Slice: slice_, ops.Concat: concat,
    ops.Pad: pad, ops.Gather: gather, ops.Take: take, ops.ScatterAdd: scatter_add,
    ops.MatMul: matmul, ops.Full: full, ops.Iota: iota, ops.Const: const, ops.Scan: scan,
}
VIEW_OPS = (ops.Reshape, ops.Permute, ops.BroadcastTo, ops.Slice, ops.Bitcast)
