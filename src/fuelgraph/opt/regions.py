"""Glue regions: the pass after fuse and lower. The primitives left between fused ops (SwiGLU's
`silu(g) * u`, residual adds, scales, casts, masks, biases, the body of a norm written with a
weight) are grouped into maximal fusible regions, and each region becomes ONE run-time fused op
of the registry (family "glue", id from 0x8000) whose recipe is the region itself: `explain`
lists it, `lower_all` never forms it (the reference runs every primitive), and backends
generate its kernel from the recipe's sub-graph (`backends.glue`).

What a region holds: elementwise primitives (unary, binary, compare, where, cast), reshapes of
its own values, broadcasts and reshapes of the values it reads (they become strided loads),
constants (inlined) and reductions over trailing axes of a common row length n, whose row
values may be computed on and broadcast back over their rows (a softmax or a norm with extra
terms is one region). It never crosses a fused op or a primitive that is not listed (matmul,
gather, scatter, scan, concat, pad, slice, permute, reductions over leading axes...).

Rules, and why they keep the result correct and cheap:
* Convexity: a region must not reach one of its own members through a value outside it (the
  fused node would then depend on itself). Every region has an id (creation order, a merged
  region keeps the smaller); `hi(v)` is the largest region id any value v depends on. A node
  joins (or merges) regions only if every value it reads from outside has hi < the region's id,
  and every merged region's own outside reads do too. Region ids then increase along every
  edge between regions, so no cycle can form; each check is O(1) per edge: the pass is linear.
* Intermediates needed outside: a member read by something outside its region (or a graph
  output) becomes an extra output of the region's fused op: computed once, written once, never
  recomputed. The exception is a member that only broadcasts a row value over its rows: the
  region outputs the row value and the outside reader gets a broadcast view of it (a free view
  instead of materializing the broadcast).
* A fused op whose recipe is elementwise glue (e.g. the affine `t * a + b`; not softmax or the
  norms, which have their own row kernels) and that reads or feeds a fusible primitive is
  lowered first, so that it joins
  the region around it: one pass over memory instead of two kernels.
* Regions with fewer than two computing primitives stay primitives (nothing to fuse), and so
  does a region the backend has no kernel for (the kernel factory declines it).
"""
from __future__ import annotations

import math
import os

from ..backends import kernels_for
from ..backends.base import accepts
from ..backends.glue import VIEWS, fusible_op, reduction_length, view_strides
from ..errors import FuelGraphError
from ..ir import ops
from ..ir.node import Node, Value, apply, consumers, make_node, toposort
from ..ir.scan import placeholder
from ..ir.tensor import Tensor
from ..registry.core import NoParams, default_registry, fused_node

FAMILY = "glue"
#: regions need at least this many computing primitives
MIN_OPS = 2
#: FUELGRAPH_GLUE=0 in the environment turns the pass off (each primitive runs on its own);
#: plans cached before a change keep what they were built with
ENABLED = os.environ.get("FUELGRAPH_GLUE", "1") != "0"
#: fused ops whose recipe is glue with row reductions (softmax, the norms and their backward
#: helpers) are lowered into a neighbouring region too, so that a norm followed by `* w + r` is
#: one generated kernel instead of the norm's kernel plus one region. On the GPU by default:
#: on an H200 (2026-12-01, bf16 8192x4096) `rms_norm(x) * w + r` took 0.055 ms so (3.6 TB/s,
#: torch.compile 0.058 ms) against 0.235 ms as the norm kernel plus a region. Off on the CPU,
#: where the NumPy row kernels are the faster path. FUELGRAPH_GLUE_ROW_OPS=1 / 0 forces it.
_ROW_OPS_ENV = os.environ.get("FUELGRAPH_GLUE_ROW_OPS")
ABSORB_ROW_OPS = None if _ROW_OPS_ENV is None else _ROW_OPS_ENV == "1"


def _absorb_rows(backend: str) -> bool:
    return backend == "cuda" if ABSORB_ROW_OPS is None else ABSORB_ROW_OPS


class _Region:
    __slots__ = ("id", "parent", "numel", "n", "ext_hi", "members")

    def __init__(self, rid, numel, n):
        self.id, self.parent, self.numel, self.n = rid, None, numel, n
        self.ext_hi, self.members = -1, []

    @property
    def rows(self):
        return self.numel // self.n if self.n else self.numel


def _find(r: _Region) -> _Region:
    root = r
    while root.parent is not None:
        root = root.parent
    while r.parent is not None and r.parent is not root:
        r.parent, r = root, r.parent
    return root


class _Former:
    def __init__(self, nodes):
        self.nodes = nodes
        self.reg: dict[Node, _Region] = {}
        self.space: dict[Node, str] = {}
        self.hi: dict[Node, int] = {}
        self.next_id = 0

    # ---- helpers --------------------------------------------------------------------------
    def region(self, nd):
        r = self.reg.get(nd)
        return _find(r) if r is not None else None

    def new_region(self, numel, n) -> _Region:
        r = _Region(self.next_id, numel, n)
        self.next_id += 1
        return r

    def join(self, nd, r: _Region, space: str, ext_his=()):
        self.reg[nd] = r
        self.space[nd] = space
        r.members.append(nd)
        r.ext_hi = max([r.ext_hi, *ext_his])
        self.hi[nd] = max([r.id, *ext_his, *(self.hi[s.node] for s in nd.srcs)])

    def merge(self, a: _Region, b: _Region) -> _Region:
        """b into a (a has the smaller id)."""
        if len(b.members) > len(a.members):
            a.members, b.members = b.members, a.members
        a.members += b.members
        b.members = []
        a.ext_hi = max(a.ext_hi, b.ext_hi)
        a.n = a.n or b.n
        b.parent = a
        return a

    @staticmethod
    def constant(v: Value) -> bool:
        """A constant, or a view of one (both inlined as a scalar)."""
        nd = v.node
        while isinstance(nd.op, VIEWS):
            nd = nd.srcs[0].node
        return isinstance(nd.op, ops.Full)

    def outside(self, v: Value):
        """(value a region reads for src v, hi of it) when v is read from outside; view chains
        over outside values are read through strides."""
        nd = v.node
        if isinstance(nd.op, VIEWS):
            got = view_strides(v)
            if got is not None:
                nd = got[0].node
        return nd, self.hi.get(nd, -1)

    # ---- the walk ---------------------------------------------------------------------------
    def run(self):
        for nd in self.nodes:
            if not nd.srcs:
                self.hi[nd] = -1
            elif not self.place(nd):
                self.hi[nd] = max(self.hi[s.node] for s in nd.srcs)

    def place(self, nd) -> bool:
        op = nd.op
        if nd.nout != 1:
            return False
        if isinstance(op, VIEWS):
            return self.place_view(nd)
        if isinstance(op, ops.Reduce):
            return self.place_reduce(nd)
        if fusible_op(nd):
            return self.place_elementwise(nd)
        return False

    def place_view(self, nd) -> bool:
        src = nd.srcs[0].node
        r = self.region(src)
        if r is None:
            return False
        sp = self.space[src]
        if isinstance(nd.op, ops.Reshape):
            self.join(nd, r, sp)
            return True
        # a row value broadcast over its rows: [.., 1, 1] -> [.., a, b] with a*b == n
        shape, target = nd.srcs[0].shape, nd.shapes[0]
        if sp == "R" and r.n and math.prod(target) == r.numel and math.prod(shape) == r.rows:
            grown = [i for i, (a, b) in enumerate(zip(shape, target)) if a != b]
            if grown and all(d == 1 for d in shape[grown[0]:]):
                self.join(nd, r, "F")
                return True
        return False

    def place_reduce(self, nd) -> bool:
        length = reduction_length(nd)
        x = nd.srcs[0]
        if not length:          # leading axes, bool input or an empty row: stays a primitive
            return False
        r = self.region(x.node)
        if r is not None and self.space[x.node] == "F" and (r.n in (None, length) or length == 1):
            if length > 1:
                r.n = length
            self.join(nd, r, "R" if length > 1 else "F")
            return True
        base, h = self.outside(x)
        r = self.new_region(math.prod(x.shape), length if length > 1 else None)
        self.join(nd, r, "R" if length > 1 else "F", (h,))
        return True

    def place_elementwise(self, nd) -> bool:
        numel = math.prod(nd.shapes[0])
        member_srcs, outside = [], []
        banned = set()
        for s in nd.srcs:
            r = self.region(s.node)
            if r is not None:
                member_srcs.append((s, r))
            elif not self.constant(s):
                base, h = self.outside(s)
                outside.append((base, h))
                rb = self.region(base)
                if rb is not None:       # a non-row view of a member: never inside its region
                    banned.add(id(rb))
        if not member_srcs and not outside:
            return False                 # constants only
        cands = {}
        for s, r in member_srcs:
            if id(r) not in banned:
                cands.setdefault(id(r), (r, self.space[s.node]))
        order = sorted(cands.values(), key=lambda rs: -rs[0].id)
        if order:
            prim, sp = order[0]
            if self._fits(prim, sp, numel):
                chosen = [prim]
                for r, rsp in order[1:]:
                    if rsp == sp and self._compatible(prim, r, sp):
                        trial = chosen + [r]
                        if self._legal(trial, nd, member_srcs, outside):
                            chosen = trial
                if self._legal(chosen, nd, member_srcs, outside):
                    target = chosen[-1]          # smallest id
                    for r in chosen[:-1]:
                        if r.n and not target.n:
                            target.n = r.n
                        self.merge(target, r)
                    inside = {id(r) for r in chosen}
                    ext = [h for _, h in outside] + [self.hi[s.node] for s, r in member_srcs
                                                     if id(r) not in inside]
                    self.join(nd, target, sp, ext)
                    return True
        r = self.new_region(numel, None)
        ext = [h for _, h in outside] + [self.hi[s.node] for s, _ in member_srcs]
        self.join(nd, r, "F", ext)
        return True

    @staticmethod
    def _fits(r, sp, numel) -> bool:
        return numel == (r.numel if sp == "F" else r.rows)

    @staticmethod
    def _compatible(a, b, sp) -> bool:
        if sp == "F":
            return a.numel == b.numel and (a.n is None or b.n is None or a.n == b.n)
        return a.n == b.n and a.numel == b.numel

    def _legal(self, chosen, nd, member_srcs, outside) -> bool:
        t = min(r.id for r in chosen)
        inside = {id(r) for r in chosen}
        if any(h >= t for _, h in outside):
            return False
        if any(self.hi[s.node] >= t for s, r in member_srcs if id(r) not in inside):
            return False
        return all(r.ext_hi < t for r in chosen)


def _glueish(nd) -> bool:
    return bool(nd.srcs) and (fusible_op(nd) or isinstance(nd.op, ops.Reduce) and
                              reduction_length(nd) is not None)


def _recipe_is_glue(outs, srcs, rows: bool) -> bool:
    """Whether a fused op's lowered recipe is elementwise glue (with `rows`: glue with
    reductions over trailing axes too)."""
    stop = {s.node for s in srcs}
    seen, stack = set(), [v.node for v in outs]
    while stack:
        nd = stack.pop()
        if nd in stop or nd in seen or not nd.srcs:
            continue
        seen.add(nd)
        ok = fusible_op(nd) or isinstance(nd.op, VIEWS) or (
            rows and isinstance(nd.op, ops.Reduce) and reduction_length(nd))
        if not ok:
            return False
        stack.extend(s.node for s in nd.srcs)
    return bool(seen)


def _dissolve_glue_ops(outputs, log, rows: bool):
    """Lower the fused ops whose recipe is glue when a neighbour is fusible (see the rules)."""
    nodes = toposort(outputs)
    users = consumers(nodes)
    reg = default_registry()
    pick = set()
    for nd in nodes:
        if not isinstance(nd.op, ops.Fused) or nd.nout != 1:
            continue
        e = reg.get(nd.op.id)
        if e is None or e.family == FAMILY:
            continue
        near = [s.node for s in nd.srcs] + list(users.get(id(nd), ()))
        if any(_glueish(m) for m in near):
            pick.add(nd)
    if not pick:
        return outputs, {}
    memo: dict[Node, tuple] = {}
    for nd in nodes:
        srcs = tuple(memo[s.node][s.slot] for s in nd.srcs)
        if nd in pick:
            e = reg.entry(nd.op.id)
            outs = [o.value for o in e.lower([Tensor(s) for s in srcs], nd.op.params)]
            if _recipe_is_glue(outs, srcs, rows):
                memo[nd] = tuple(outs)
                log.events.append(("glue", "dissolve", e.name))
                continue
        if srcs == nd.srcs:
            new = nd
        elif isinstance(nd.op, ops.Fused):
            new = fused_node(nd.op, srcs)
        else:
            new = make_node(nd.op, srcs)
        memo[nd] = tuple(new.out(i) for i in range(new.nout))
    return [memo[v.node][v.slot] for v in outputs], memo


def _counts(members) -> int:
    return sum(1 for m in members if not isinstance(m.op, VIEWS) and not (
        isinstance(m.op, ops.Reduce) and reduction_length(m) == 1))


def form_regions(outputs: list[Value], backend: str, log, report: dict | None = None,
                 mapping: dict | None = None) -> list[Value]:
    """Replace maximal glue regions under `outputs` by run-time fused ops (see the module
    docstring); `report` collects {entry name: number of nodes}; `mapping` (when given and a
    region forms) gets {node of the graph before: node of the graph after}: the node itself
    or its rebuilt copy, or the glue node that runs it. Linear in the graph's size."""
    if not ENABLED:
        return outputs
    before = outputs
    outputs, dissolved = _dissolve_glue_ops(outputs, log, _absorb_rows(backend))
    nodes = toposort(outputs)
    f = _Former(nodes)
    f.run()
    users = consumers(nodes)
    out_nodes = {v.node for v in outputs}
    regions = {}
    for nd in nodes:
        r = f.region(nd)
        if r is not None:
            regions.setdefault(id(r), r)
    plans = {}
    reg = default_registry()
    for r in regions.values():
        members = set(r.members)
        if _counts(members) < MIN_OPS:
            continue
        plan = _region_plan(r, members, users, out_nodes, f.space, f.reg)
        if plan is None:
            continue
        body_in, body_out, ext, outs = plan
        fid = reg.register_graph(FAMILY, body_in, body_out, family=FAMILY,
                                 doc=_doc(members, len(body_in), len(body_out)))
        shapes, dtypes = [v.shape for v in ext], [v.dtype for v in ext]
        if not any(accepts(k, dtypes, shapes, NoParams()) for k in kernels_for(int(fid), backend)):
            continue
        plans[id(r)] = (fid, ext, outs, members)
    if not plans:
        if mapping is not None and dissolved:
            _map(before, dissolved, {}, mapping)
        return outputs
    new, after_of = _rewrite(outputs, nodes, f, plans, log, report)
    if mapping is not None:
        _map(before, dissolved, after_of, mapping)
    return new


def _map(before, dissolved, after_of, mapping):
    for nd in toposort(before):
        vals = dissolved.get(nd) if dissolved else None
        mid = vals[0].node if vals else nd
        mapping[nd] = after_of.get(mid, mid)


def _region_plan(r, members, users, out_nodes, space, in_any_region):
    """(body inputs, body outputs, external input values, [(member, output kind)]) of region
    `r`: the sub-graph rebuilt on placeholders (device-independent, so equal regions on any
    device share one entry)."""
    order = [nd for nd in r.members]
    order.sort(key=lambda nd: nd.uid)      # a topological order (uids increase with building)
    ext: dict[Value, Value] = {}           # outside value -> placeholder
    env: dict[Node, Node] = {}
    ext_list = []

    def read(v: Value) -> Value:
        nd = v.node
        if nd in members:
            return Value(env[nd], v.slot)
        if _Former.constant(v):
            while not isinstance(nd.op, ops.Full):
                nd = nd.srcs[0].node
            return apply(ops.Full(v.shape, nd.op.value, nd.op.dtype, "cpu"))
        if isinstance(nd.op, VIEWS) and nd not in in_any_region and view_strides(v) is not None:
            return apply(nd.op, read(nd.srcs[0]))
        if v not in ext:
            ext[v] = placeholder(v.shape, v.dtype).value
            ext_list.append(v)
        return ext[v]

    for nd in order:
        env[nd] = make_node(nd.op, tuple(read(s) for s in nd.srcs))
    outs = []
    for nd in order:
        outside = nd in out_nodes or any(u not in members for u in users.get(id(nd), ()))
        if not outside:
            continue
        if isinstance(nd.op, ops.BroadcastTo) and space.get(nd) == "F" and \
                space.get(nd.srcs[0].node) == "R" and nd.srcs[0].node in members:
            outs.append((nd, "bcast"))        # the row value is output; readers get a view
        else:
            outs.append((nd, "value"))
    out_vals, seen = [], {}
    for nd, kind in outs:
        src = nd.srcs[0].node if kind == "bcast" else nd
        if src not in seen:
            seen[src] = len(out_vals)
            out_vals.append(Value(env[src], 0))
    if not ext_list or not out_vals:
        return None
    return [ext[v] for v in ext_list], out_vals, ext_list, [(nd, kind, seen[
        nd.srcs[0].node if kind == "bcast" else nd]) for nd, kind in outs]


def _doc(members, n_in, n_out) -> str:
    kinds = sorted({getattr(m.op, "kind", None) or type(m.op).__name__.lower() for m in members})
    return (f"generated glue region: {len(members)} primitives ({', '.join(kinds)}) over "
            f"{n_in} input(s), {n_out} output(s), run as one kernel; its recipe is the region")


def _rewrite(outputs, nodes, f, plans, log, report):
    """Rebuild the graph with each planned region replaced by its fused node, on demand: a
    region's node is built once every value it reads is, which is a topological order of the
    contracted graph (acyclic by construction)."""
    memo: dict[Node, Node] = {}            # outside nodes -> rebuilt node
    outval: dict[Node, Value] = {}         # members read outside -> value in the new graph
    built: set = set()
    glue_node: dict = {}
    region_of = {m: key for key, p in plans.items() for m in p[3]}

    def done(nd) -> bool:
        key = region_of.get(nd)
        return key in built if key is not None else nd in memo

    def deps(nd):
        key = region_of.get(nd)
        return [s.node for s in nd.srcs] if key is None else [v.node for v in plans[key][1]]

    def build(nd):
        key = region_of.get(nd)
        if key is None:
            srcs = tuple(value(s) for s in nd.srcs)
            if srcs == nd.srcs:
                memo[nd] = nd
            elif isinstance(nd.op, ops.Fused):
                memo[nd] = fused_node(nd.op, srcs)
            else:
                memo[nd] = make_node(nd.op, srcs)
            return
        fid, ext, outs, members = plans[key]
        fnode = fused_node(ops.Fused(fid, NoParams()), tuple(value(v) for v in ext))
        built.add(key)
        glue_node[key] = fnode
        name = default_registry().entry(fid).name
        log.events.append(("glue", name, f"{len(members)} primitives"))
        if report is not None:
            report[name] = report.get(name, 0) + 1
        for m, kind, slot in outs:
            out = Value(fnode, slot)
            outval[m] = apply(ops.BroadcastTo(m.shapes[0]), out) if kind == "bcast" else out

    def visit(root):
        stack, waiting = [root], set()
        while stack:
            nd = stack[-1]
            if done(nd):
                stack.pop()
                continue
            pending = [d for d in deps(nd) if not done(d)]
            if pending:
                key = region_of.get(nd, nd)
                if key in waiting:      # unreachable when the convexity rule holds
                    raise FuelGraphError("glue regions: internal error, regions form a cycle")
                waiting.add(key)
                stack.extend(pending)
                continue
            stack.pop()
            build(nd)

    def value(v: Value) -> Value:
        nd = v.node
        if not done(nd):
            visit(nd)
        if nd in region_of:
            return outval[nd]
        return Value(memo[nd], v.slot)

    new = [value(v) for v in outputs]
    after_of = dict(memo)
    for key, fnode in glue_node.items():
        for m in plans[key][3]:
            after_of[m] = fnode
    return new, after_of
