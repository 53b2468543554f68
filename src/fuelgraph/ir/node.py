"""Nodes and values of the graph. Nodes are immutable and hash-consed process-wide: building a
node structurally equal to a live one returns that node, so common subexpressions are shared
for free and a "graph" is simply the set of nodes reachable from some outputs."""
from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

from ..dtype import DType
from .ops import Input

_INTERN: "weakref.WeakValueDictionary[tuple, Node]" = weakref.WeakValueDictionary()
_UID = itertools.count()


class Node:
    """One operation applied to source values. `shapes`/`dtypes` hold one entry per output slot."""
    __slots__ = ("op", "srcs", "shapes", "dtypes", "device", "uid", "__weakref__")

    def __init__(self, op, srcs, shapes, dtypes, device):
        self.op, self.srcs, self.shapes, self.dtypes, self.device = op, srcs, shapes, dtypes, device
        self.uid = next(_UID)

    @property
    def nout(self) -> int:
        return len(self.shapes)

    def out(self, slot: int = 0) -> "Value":
        return Value(self, slot)

    def __repr__(self) -> str:
        return f"%{self.uid}={self.op!r}({', '.join(repr(s) for s in self.srcs)})"


class Value(NamedTuple):
    """Output `slot` of `node`."""
    node: Node
    slot: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shapes[self.slot]

    @property
    def dtype(self) -> DType:
        return self.node.dtypes[self.slot]

    @property
    def op(self):
        return self.node.op

    @property
    def srcs(self) -> tuple["Value", ...]:
        return self.node.srcs

    def __repr__(self) -> str:
        return f"%{self.node.uid}" + (f".{self.slot}" if self.slot else "")


def make_node(op, srcs: tuple[Value, ...], meta=None) -> Node:
    """Return the unique node for (op, srcs), inferring and validating its outputs. `meta`
    ((shapes, dtypes)) is given by builders of ops whose rules live above the IR (fused ops:
    the registry); the device is always derived here."""
    key = (op, srcs)
    n = _INTERN.get(key)
    if n is not None:
        return n
    if meta is None:
        shapes, dtypes, device = op.infer(srcs)
    else:
        (shapes, dtypes), device = meta, op.device_of(srcs)
    n = Node(op, srcs, tuple(tuple(int(d) for d in s) for s in shapes), tuple(dtypes), device)
    _INTERN[key] = n
    return n


def apply(op, *srcs: Value) -> Value:
    """Build a single-output node and return its value."""
    return Value(make_node(op, tuple(srcs)), 0)


def toposort(outputs) -> list[Node]:
    """Nodes reachable from `outputs` (values or nodes), sources before users, deterministic."""
    order: list[Node] = []
    seen: set[int] = set()
    stack = [(v.node if isinstance(v, Value) else v, False) for v in reversed(list(outputs))]
    while stack:
        n, done = stack.pop()
        if done:
            order.append(n)
            continue
        if id(n) in seen:
            continue
        seen.add(id(n))
        stack.append((n, True))
        for s in reversed(n.srcs):
            if id(s.node) not in seen:
                stack.append((s.node, False))
    return order


def consumers(nodes: list[Node]) -> dict[int, list[Node]]:
    """id(node) -> list of nodes (among `nodes`) that read any of its outputs (with repeats)."""
    users: dict[int, list[Node]] = {id(n): [] for n in nodes}
    for n in nodes:
        for s in n.srcs:
            users.setdefault(id(s.node), []).append(n)
    return users


def structural_key(outputs, order_inputs=None) -> tuple:
    """Hashable structure of the graph under `outputs`; Input leaves become ("in", position,
    shape, dtype, device) in first-visit order (or in `order_inputs` order when given)."""
    return key_and_inputs(outputs, order_inputs)[0]


def key_and_inputs(outputs, order_inputs=None) -> tuple[tuple, list[Node]]:
    """(structural key, Input nodes in the order the key numbers them), in one walk."""
    nodes = toposort([v.node for v in outputs])
    index = {n: i for i, n in enumerate(nodes)}
    inputs = {v.node: i for i, v in enumerate(order_inputs)} if order_inputs is not None else {}
    parts = []
    for n in nodes:
        if isinstance(n.op, Input):
            pos = inputs.setdefault(n, len(inputs))
            parts.append(("in", pos, n.op.shape, n.op.dtype, n.op.device))
        else:
            parts.append((n.op, tuple((index[s.node], s.slot) for s in n.srcs)))
    key = (tuple(parts), tuple((index[v.node], v.slot) for v in outputs))
    return key, sorted(inputs, key=inputs.get)
