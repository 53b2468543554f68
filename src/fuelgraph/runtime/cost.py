"""FLOPs and bytes moved of one op call, from shapes and dtypes alone (no data).

Primitives are counted analytically: one FLOP per output element of an elementwise op, one per
input element of a reduction, 2*M*N*K per matrix product; movement ops cost no FLOPs. A fused
op is counted by the cost function of the kernel the backend would pick for the call; where no
kernel covers it, by its recipe's primitives (what will run instead). Bytes are what a kernel
reads and writes once: its inputs' distinct elements (a broadcast input is read once) and its
outputs; views move nothing."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..backends import select_kernel
from ..backends.base import op_identity
from ..ir import ops
from ..ir.node import make_node, toposort
from ..ir.node import Value
from ..ir.tensor import Tensor
from ..registry.core import default_registry

#: ops whose kernels return a view of their input (they move no data)
VIEW_OPS = (ops.Reshape, ops.Permute, ops.BroadcastTo, ops.Slice, ops.Bitcast, ops.Detach)
_ELEMENTWISE = (ops.Unary, ops.Binary, ops.Compare, ops.Where)
_FREE = (ops.Input, ops.Const, ops.Full, ops.Iota, ops.Cast, ops.Concat, ops.Pad, ops.Gather,
         ops.Take)
_placeholder_uid = itertools.count(-1, -1)   # negative: never an Input of user data


@dataclass(frozen=True)
class OpCost:
    flops: float
    bytes: float

    def __add__(self, o: "OpCost") -> "OpCost":
        return OpCost(self.flops + o.flops, self.bytes + o.bytes)


ZERO = OpCost(0.0, 0.0)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def op_flops(op, in_shapes, in_dtypes, out_shapes, backend: str) -> float:
    """FLOPs of one call of `op` (see the module docstring for what is counted)."""
    if isinstance(op, VIEW_OPS + _FREE):
        return 0.0
    if isinstance(op, _ELEMENTWISE):
        return float(sum(math.prod(s) for s in out_shapes))
    if isinstance(op, ops.Reduce):
        return float(math.prod(in_shapes[0]))
    if isinstance(op, ops.MatMul):
        a, b = in_shapes
        return 2.0 * math.prod(a) * b[-1]
    if isinstance(op, ops.ScatterAdd):
        return float(math.prod(in_shapes[2]))
    if isinstance(op, ops.Scan):
        body = op.body
        return op.length * sum(node_cost(n, backend).flops for n in toposort(list(body.outputs)))
    if isinstance(op, ops.Fused):
        k = select_kernel(op_identity(op), backend, list(in_shapes), list(in_dtypes), op.params)
        if k is not None:
            return float(k.cost(list(in_shapes), op.params).flops)
        return recipe_cost(op, in_shapes, in_dtypes, backend).flops
    return 0.0


def recipe_cost(op, in_shapes, in_dtypes, backend: str) -> OpCost:
    """Cost of a fused op's recipe on placeholder inputs of these shapes and dtypes."""
    entry = default_registry().entry(op.id)
    srcs = [Tensor(Value(make_node(ops.Input(next(_placeholder_uid), tuple(s), d), ()), 0))
            for s, d in zip(in_shapes, in_dtypes)]
    outs = entry.lower(srcs, op.params)
    total = ZERO
    for n in toposort([t.value for t in outs]):
        if n.srcs:
            total = total + node_cost(n, backend)
    return total


def node_cost(n, backend: str, in_unique=None) -> OpCost:
    """Cost of graph node `n`. `in_unique` (optional) gives the distinct elements each input
    holds (broadcast views hold fewer than their shape says); by default, all of them."""
    if isinstance(n.op, VIEW_OPS) or not n.srcs:
        return ZERO
    in_shapes = [s.shape for s in n.srcs]
    in_dtypes = [s.dtype for s in n.srcs]
    flops = op_flops(n.op, in_shapes, in_dtypes, n.shapes, backend)
    counts = in_unique or [math.prod(s) for s in in_shapes]
    read = sum(c * d.itemsize for c, d in zip(counts, in_dtypes))
    written = sum(_nbytes(s, d) for s, d in zip(n.shapes, n.dtypes))
    return OpCost(flops, float(read + written))
