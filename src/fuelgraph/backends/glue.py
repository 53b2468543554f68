"""Generated glue kernels, the part every backend shares. A glue region is a run-time fused op of
registry family "glue" whose `entry.body` is the region's own sub-graph (see `opt.regions`).
`build_program(body)` turns it into a `Program`: SSA values in topological order over at most
two iteration spaces,

* F (full): the flat index i over the region's largest values (numel elements), and
* R (row): for regions with reductions, the flat row index r = i // n, n the length of the
  trailing axes every reduction of the region sums (or maxes, ...) over,

plus loads (an input buffer read through the strides of the broadcast/reshape views the body
applies to it), constants (scalars), stores. Each backend turns a Program into one kernel: a
blocked NumPy evaluation, a generated Triton kernel. Values of 16-bit float dtypes are computed
in float32 and rounded only where the graph casts to or from them and when stored."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import dtype as dt
from ..dtype import DType
from ..ir import ops
from ..ir.node import Value, toposort

FULL, ROW, SCALAR = "F", "R", "S"
VIEWS = (ops.Reshape, ops.BroadcastTo)
ELEMENTWISE = (ops.Unary, ops.Binary, ops.Compare, ops.Where, ops.Cast)


def contiguous_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(out))


def reshape_strides(shape, strides, new) -> tuple[int, ...] | None:
    """Strides viewing (shape, strides) as `new` without a copy, or None when impossible (e.g.
    merging a broadcast axis with a real one)."""
    if math.prod(shape) == 0:
        return contiguous_strides(new)
    old = [(d, s) for d, s in zip(shape, strides) if d != 1]
    nd = [d for d in new if d != 1]
    res: list[int] = []
    oi = ni = 0
    while ni < len(nd) and oi < len(old):
        np_, op_ = nd[ni], old[oi][0]
        nj, oj = ni + 1, oi + 1
        while np_ != op_:
            if np_ < op_:
                np_ *= nd[nj]
                nj += 1
            else:
                op_ *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        group = [0] * (nj - ni)
        group[-1] = old[oj - 1][1]
        for k in range(nj - ni - 1, 0, -1):
            group[k - 1] = group[k] * nd[ni + k]
        res += group
        ni, oi = nj, oj
    it = iter(res)
    return tuple(0 if d == 1 else next(it) for d in new)


def view_strides(v: Value):
    """(base value, shape, strides in elements of the base's contiguous buffer) of the chain of
    Reshape/BroadcastTo views ending at `v` (the base is the first value that is not a view),
    or None when some reshape of a broadcast cannot be expressed with strides."""
    chain = []
    while isinstance(v.node.op, VIEWS):
        chain.append(v.node.op)
        v = v.node.srcs[0]
    shape, strides = v.shape, contiguous_strides(v.shape)
    for op in reversed(chain):
        if isinstance(op, ops.Reshape):
            strides = reshape_strides(shape, strides, op.shape)
            if strides is None:
                return None
        else:
            strides = tuple(0 if a != b else s for a, b, s in zip(shape, op.shape, strides))
        shape = op.shape
    return v, shape, strides


def index_terms(shape, strides) -> tuple:
    """The offset of flat (row-major) index i of a view as a sum of terms ((i // div) % mod) *
    stride, after dropping unit axes and merging axes that continue each other (mod None: the
    outermost term, no modulo needed). A contiguous view is ((1, None, 1),)."""
    groups: list[list[int]] = []      # innermost first: [extent, stride]
    for e, s in reversed([(e, s) for e, s in zip(shape, strides) if e != 1]):
        if groups and s == groups[-1][0] * groups[-1][1]:
            groups[-1][0] *= e
        else:
            groups.append([e, s])
    terms, div = [], 1
    for k, (e, s) in enumerate(groups):
        if s:
            terms.append((div, None if k == len(groups) - 1 else e, s))
        div *= e
    return tuple(terms)


@dataclass(frozen=True)
class Load:
    """Input buffer `input` read as a view of `shape`/`strides` in iteration space `space`."""
    input: int
    space: str
    shape: tuple
    strides: tuple
    terms: tuple


@dataclass(frozen=True)
class Instr:
    """One SSA value. op: load (kind: Load), const (kind: the scalar), unary/binary/compare
    (kind: the primitive's kind), where, cast (kind: target DType), reduce (kind: sum, max,
    min, prod over the row), bcast (a row value read in F), alias (same value: reshapes, and
    reductions over unit axes)."""
    op: str
    kind: object
    args: tuple
    dtype: DType
    space: str

    @property
    def cd(self) -> DType:
        """Compute dtype: float32 for 16-bit floats, the dtype itself otherwise."""
        return dt.float32 if self.dtype.is_float and self.dtype.itemsize < 4 else self.dtype


@dataclass
class Program:
    inputs: tuple           # ((shape, DType), ...) of the kernel's input buffers
    values: list            # Instr, topological
    outputs: list           # (value index, shape, DType)
    numel: int              # elements of the F space
    n: int | None           # row length (None: no reduction)

    @property
    def rows(self) -> int:
        return self.numel // self.n if self.n else self.numel


class Unsupported(Exception):
    """The body has something no generated kernel computes (the region stays its recipe)."""


def _int_pow(n) -> bool:
    return isinstance(n.op, ops.Binary) and n.op.kind == "pow" and not n.dtypes[0].is_float


def fusible_op(n) -> bool:
    """Elementwise primitives a glue region may contain (besides views, constants and
    reductions): all but integer pow (NumPy raises on negative exponents; no Triton form)."""
    return isinstance(n.op, ELEMENTWISE) and n.nout == 1 and not _int_pow(n)


def reduction_length(n) -> int | None:
    """Row length of a Reduce over the trailing axes of its input (keepdim), else None."""
    op, x = n.op, n.srcs[0]
    k = len(op.axes)
    if not op.keepdim or op.axes != tuple(range(len(x.shape) - k, len(x.shape))) or \
            x.dtype is dt.bool_:
        return None
    return math.prod(x.shape[a] for a in op.axes)


def build_program(body: ops.Body) -> Program:
    """The Program of a glue region's body; raises Unsupported."""
    nodes = toposort(body.outputs)
    placeholder = {p.node: i for i, p in enumerate(body.inputs)}
    input_view: set = set()
    for nd in nodes:
        if nd in placeholder or (isinstance(nd.op, VIEWS) and nd.srcs[0].node in input_view):
            input_view.add(nd)
    lengths = {reduction_length(nd) for nd in nodes if isinstance(nd.op, ops.Reduce)}
    if None in lengths:
        raise Unsupported("a reduction over other than the trailing axes")
    lengths.discard(1)
    if len(lengths) > 1:
        raise Unsupported(f"reductions over rows of different lengths {sorted(lengths)}")
    n = lengths.pop() if lengths else None
    members = [nd for nd in nodes if nd not in input_view and nd.srcs]
    numel = max((math.prod(nd.shapes[0]) for nd in members), default=0)
    if n:
        numel = max(math.prod(nd.srcs[0].shape) for nd in members
                    if isinstance(nd.op, ops.Reduce))
    rows = numel // n if n else numel
    values: list[Instr] = []
    vid: dict = {}
    loads: dict = {}

    def space_of(shape) -> str:
        size = math.prod(shape)
        if size == numel:
            return FULL
        if n and size == rows:
            return ROW
        raise Unsupported(f"a value of shape {shape} fits neither iteration space")

    def add(ins: Instr) -> int:
        values.append(ins)
        return len(values) - 1

    def arg(v: Value, space: str) -> int:
        nd = v.node
        if nd in input_view:
            got = view_strides(v)
            if got is None:
                raise Unsupported("a view that strides cannot express")
            base, shape, strides = got
            ld = Load(placeholder[base.node], space, shape, strides, index_terms(shape, strides))
            if ld not in loads:
                loads[ld] = add(Instr("load", ld, (), v.dtype, space))
            return loads[ld]
        return vid[nd]

    for nd in nodes:
        op = nd.op
        if nd in input_view:
            continue
        if isinstance(op, ops.Full):
            d = op.dtype
            vid[nd] = add(Instr("const", op.value, (), d, SCALAR))
            continue
        if not nd.srcs or nd.nout != 1:
            raise Unsupported(f"{op.name} in a glue region")
        sp = space_of(nd.shapes[0])
        d = nd.dtypes[0]
        if isinstance(op, ops.Reduce):
            if reduction_length(nd) == 1 or not n:
                vid[nd] = add(Instr("alias", None, (arg(nd.srcs[0], sp),), d, sp))
            else:
                vid[nd] = add(Instr("reduce", op.kind, (arg(nd.srcs[0], FULL),), d, ROW))
        elif isinstance(op, ops.Reshape):
            vid[nd] = add(Instr("alias", None, (arg(nd.srcs[0], sp),), d, sp))
        elif isinstance(op, ops.BroadcastTo):
            src_sp = space_of(nd.srcs[0].shape)
            if not (sp == FULL and src_sp == ROW):
                raise Unsupported("a broadcast other than a row value over its row")
            vid[nd] = add(Instr("bcast", None, (arg(nd.srcs[0], ROW),), d, FULL))
        elif fusible_op(nd):
            kind = op.dtype if isinstance(op, ops.Cast) else getattr(op, "kind", None)
            name = type(op).__name__.lower()
            vid[nd] = add(Instr(name, kind, tuple(arg(s, sp) for s in nd.srcs), d, sp))
        else:
            raise Unsupported(f"{op.name} in a glue region")
    outputs = []
    for o in body.outputs:
        if o.node not in vid:
            raise Unsupported("an output that is not computed by the region")
        outputs.append((vid[o.node], o.shape, o.dtype))
    return Program(tuple((p.shape, p.dtype) for p in body.inputs), values, outputs, numel, n)
