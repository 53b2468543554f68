"""What the optimizer did to one graph, node by node: the graph before and after optimization
and the link between them (which primitives each fused op replaced, which nodes came from
lowering a fused op, which nodes passed through unchanged), with per-node shape, dtype, bytes
and FLOPs.

The links are recovered without hooks in the optimizer: the canonical graph is held alive while
`optimize` runs, so its fuse events name live nodes (graph nodes are hash-consed); each fused
idiom is matched again to learn its region, and every canonical node is mapped forward by
rebuilding it on the images of its inputs, which yields exactly the optimized graph's node when
the optimizer kept it. A node the mapping cannot follow (a later pass rewrote it) is simply
left unlinked: the views never show a wrong link, at worst a missing one."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field

from ..errors import FuelGraphError
from ..ir import ops
from ..ir.node import Node, Value, consumers, toposort
from ..ir.tensor import Tensor
from ..opt.canonicalize import CANONICALIZE
from ..opt.engine import canonical_memo, rebuild, run_pass
from ..opt.passes import OptResult, match_at, optimize
from ..opt.pattern import Match, patterns_of
from ..registry.core import default_registry, fused_node
from ..runtime.cost import VIEW_OPS, node_cost
from ..runtime.strides import c_strides, unique_elements, view_strides


@dataclass
class NodeInfo:
    """One node as the views show it. kind: input | const | view | primitive | fused | lowered;
    `srcs` are the ids of its inputs (same graph); `link` the id of the corresponding node in
    the other graph (the fused op it went into, or the node it became); `replaced` (fused nodes
    of the optimized graph): ids of the original nodes it stands for; `lowered_from`: the fused
    op whose recipe produced this node."""
    id: str
    uid: int
    op: str
    label: str
    kind: str
    params: str = ""
    shapes: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)
    out_bytes: int = 0
    flops: float = 0.0
    moved: float = 0.0
    srcs: list = field(default_factory=list)
    is_output: bool = False
    link: str | None = None
    status: str = ""
    replaced: list = field(default_factory=list)
    replaced_ops: dict = field(default_factory=dict)
    lowered_from: str | None = None
    group: str | None = None     # repeated-subgraph group ("g3") and copy index, set by repeats
    copy: int = 0


@dataclass
class NearMiss:
    op: str
    reason: str
    matched: int
    at: str | None          # id of the original node where the best partial match was rooted


@dataclass
class GraphTrace:
    backend: str
    before: list[NodeInfo]
    after: list[NodeInfo]
    near_misses: list[NearMiss]
    lower_all: bool = False

    def node(self, nid: str) -> NodeInfo:
        for n in (self.before if nid.startswith("b") else self.after):
            if n.id == nid:
                return n
        raise KeyError(nid)


class _Output:
    """Stands for 'is graph output `v`' among a node's consumers (as the fuser counts it)."""
    uid = "output"

    def __init__(self, v):
        self.srcs = (v,)


def _uid_of(text: str) -> int | None:
    """The node uid at the start of a node repr ("%12=..."), or None."""
    if not text.startswith("%"):
        return None
    head = text[1:].split("=", 1)[0].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _params_text(op) -> str:
    p = getattr(op, "params", None)
    if p is None or not dataclasses.is_dataclass(p):
        return ""
    return ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(p).items())


def _label(op) -> tuple[str, str]:
    """(short label, params text) of an op."""
    if isinstance(op, ops.Fused):
        return op.name, _params_text(op)
    if isinstance(op, ops.Reduce):
        return f"{op.kind}", f"axes={op.axes}" + (", keepdim" if op.keepdim else "")
    if isinstance(op, ops.Full):
        return "full", f"value={op.value!r}"
    if isinstance(op, ops.Input):
        return "input", ""
    if isinstance(op, ops.Const):
        return "const", ""
    if isinstance(op, (ops.Reshape, ops.BroadcastTo)):
        return op.name, f"shape={op.shape}"
    if isinstance(op, ops.Permute):
        return "permute", f"perm={op.perm}"
    if isinstance(op, ops.Slice):
        return "slice", ", ".join(f"{a}:{b}" + (f":{s}" if s != 1 else "")
                                  for a, b, s in zip(op.starts, op.stops, op.steps))
    if isinstance(op, (ops.Concat, ops.Gather, ops.Take, ops.ScatterAdd)):
        return op.name, f"axis={op.axis}"
    if isinstance(op, ops.Cast):
        return "cast", op.dtype.name
    if isinstance(op, ops.Scan):
        return "scan", f"length={op.length}, carries={op.n_carry}, xs={op.n_xs}"
    return op.name, ""


def _kind(n: Node) -> str:
    if isinstance(n.op, ops.Input):
        return "input"
    if not n.srcs and not isinstance(n.op, ops.Scan):
        return "const"
    if isinstance(n.op, ops.Fused):
        return "fused"
    if isinstance(n.op, VIEW_OPS):
        return "view"
    return "primitive"


def _describe(nodes: list[Node], prefix: str, outputs, backend: str) -> tuple[list, dict]:
    """NodeInfo per node (ids prefix + position) with costs; broadcast views are read once."""
    ids = {n: f"{prefix}{i}" for i, n in enumerate(nodes)}
    outs = {v.node for v in outputs}
    strides: dict = {}
    infos = []
    for n in nodes:
        op = n.op
        if isinstance(op, ops.Full):
            strides[n] = (0,) * len(n.shapes[0])
        elif isinstance(op, VIEW_OPS) and n.srcs:
            src = n.srcs[0]
            strides[n] = view_strides(op, src.shape, strides[src.node]) or c_strides(n.shapes[0])
        else:
            strides[n] = c_strides(n.shapes[0]) if n.shapes else ()
        unique = [unique_elements(s.shape, strides[s.node]) if s.slot == 0 else math.prod(s.shape)
                  for s in n.srcs]
        try:
            cost = node_cost(n, backend, unique)
        except FuelGraphError:
            cost = None
        label, params = _label(op)
        infos.append(NodeInfo(
            ids[n], n.uid, type(op).__name__, label, _kind(n), params,
            [list(s) for s in n.shapes], [d.name for d in n.dtypes],
            sum(math.prod(s) * d.itemsize for s, d in zip(n.shapes, n.dtypes)),
            cost.flops if cost else 0.0, cost.bytes if cost else 0.0,
            [ids[s.node] for s in n.srcs], n in outs))
    return infos, ids


def _rematch(entry, root: Node, users, canon, pos) -> Match | None:
    """The match the fuser made at `root` (the fuser's own matching, largest pattern first)."""
    cands = sorted(((entry, p) for p in patterns_of(entry)), key=lambda ep: -ep[1].size)
    r = match_at(root, cands, users, canon, {}, pos)
    return r[1] if r is not None else None


def _lower_region(entry, params, srcs: list[Value], final: set):
    """(output values, nodes created) of `entry`'s recipe on `srcs`, when every node it builds
    is in the optimized graph (else None: a later rewrite changed them)."""
    try:
        outs = [t.value for t in entry.lower([Tensor(s) for s in srcs], params)]
    except FuelGraphError:
        return None
    stop = {s.node for s in srcs}
    region, stack = set(), [v.node for v in outs]
    while stack:
        n = stack.pop()
        if n in stop or n in region:
            continue
        if n.srcs:
            region.add(n)
        stack.extend(s.node for s in n.srcs)
    if not all(v.node in final for v in outs) or not region <= final:
        return None
    return outs, region


def trace(outputs, backend: str, lower_all: bool = False, result: OptResult | None = None,
          min_matched: int = 3) -> tuple[GraphTrace, OptResult]:
    """Optimize `outputs` (values) for `backend` as realize would, keeping what is needed to
    link the original graph to the optimized one."""
    vals = list(outputs)
    cmemo: dict = {}
    canon = run_pass(vals, CANONICALIZE, memo=cmemo)     # held alive while optimize runs
    res = result if result is not None else optimize(vals, backend, lower_all)
    cnodes = toposort(canon)
    by_uid = {n.uid: n for n in cnodes}
    users = consumers(cnodes)
    for v in canon:
        users.setdefault(id(v.node), []).append(_Output(v))
    reg = default_registry()
    canon_memo = canonical_memo(cnodes)
    pos = {n: i for i, n in enumerate(cnodes)}

    matches: dict[Node, tuple] = {}
    interior_of: dict[Node, Node] = {}
    for pas, rule, text in res.log.events:
        if pas != "fuse":
            continue
        root, entry = by_uid.get(_uid_of(text)), reg.get(rule)
        if root is None or entry is None:
            continue
        m = _rematch(entry, root, users, canon_memo, pos)
        if m is None:
            continue
        matches[root] = (entry, m)
        for n in m.interior:
            interior_of[n] = root
        interior_of[root] = root

    before_nodes = toposort(vals)
    after_nodes = toposort(res.outputs)
    # links are made against the graph before glue regions formed (what the fuser and the
    # lowering produced), then carried to the node that runs each one (`res.glue_map`)
    glue_map = getattr(res, "glue_map", None) or {}
    final = set(glue_map) if glue_map else set(after_nodes)

    def after_of(nd):
        return glue_map.get(nd, nd)
    image: dict[Node, tuple | None] = {}
    made_by: dict[Node, Node] = {}          # optimized fused node -> canonical root it replaced
    lowered_by: dict[Node, str] = {}        # optimized node -> fused op whose recipe made it

    def lowered(entry, params, srcs, n):
        r = _lower_region(entry, params, srcs, final)
        if r is None:
            return None
        outs, region = r
        for m in region:
            lowered_by.setdefault(m, entry.name)
        return tuple(outs)

    for n in cnodes:
        if n in interior_of and n not in matches:     # replaced by the fused op at its root
            image[n] = None
            continue
        srcs = [image.get(s.node) for s in n.srcs]
        if n not in matches and any(s is None for s in srcs):
            image[n] = None
            continue
        srcs = [s[v.slot] if s is not None else None for s, v in zip(srcs, n.srcs)]
        img = None
        try:
            if n in matches:
                entry, m = matches[n]
                caps = [image.get(c.node) for c in m.captures]
                if any(c is None for c in caps):
                    image[n] = None
                    continue
                caps = [c[v.slot] for c, v in zip(caps, m.captures)]
                params = entry.params(**m.params)
                f = fused_node(ops.Fused(entry.id, params), tuple(caps))
                if f in final:
                    made_by[f] = n
                    img = tuple(f.out(i) for i in range(f.nout))
                else:
                    img = lowered(entry, params, caps, n)
            elif not n.srcs:
                img = tuple(n.out(i) for i in range(n.nout)) if n in final else None
            else:
                r = rebuild(n, tuple(srcs))
                if r in final:
                    img = tuple(r.out(i) for i in range(r.nout))
                elif isinstance(n.op, ops.Detach):
                    img = (srcs[0],)
                elif isinstance(n.op, ops.Fused):
                    img = lowered(reg.entry(n.op.id), n.op.params, srcs, n)
        except FuelGraphError:
            img = None
        image[n] = img

    before, bids = _describe(before_nodes, "b", vals, backend)
    after, aids = _describe(after_nodes, "a", res.outputs, backend)
    binfo = {n: before[i] for i, n in enumerate(before_nodes)}
    ainfo = {n: after[i] for i, n in enumerate(after_nodes)}
    canon_to_before: dict[Node, list] = {}
    for o in before_nodes:
        cv = cmemo.get(o)
        if cv:
            canon_to_before.setdefault(cv[0].node, []).append(o)

    for f, root in made_by.items():
        info = ainfo[after_of(f)]
        entry, m = matches[root]
        region = set(m.interior) | {root}
        orig = [o for c in region for o in canon_to_before.get(c, ())]
        orig.sort(key=lambda o: bids[o])
        info.replaced = [bids[o] for o in orig]
        info.replaced_ops = dict(Counter(binfo[o].label for o in orig if binfo[o].kind != "view"))
        info.status = f"fused {entry.name}: replaced {len(region)} canonical nodes"
        for o in orig:
            binfo[o].link, binfo[o].status = info.id, f"fused into {entry.name} ({info.id})"
    for node, name in lowered_by.items():
        if after_of(node) is not node:       # runs inside a glue region now
            continue
        ainfo[node].lowered_from = name
        ainfo[node].kind = "lowered" if ainfo[node].kind != "view" else "view"
        ainfo[node].status = f"from the recipe of {name} (lowered)"
    for o in before_nodes:
        b = binfo[o]
        if b.status:
            continue
        cv = cmemo.get(o)
        img = image.get(cv[0].node) if cv else None
        if img is not None:
            a = ainfo.get(after_of(img[cv[0].slot].node))
            if a is not None:
                b.link = a.id
                b.status = "kept" if img[cv[0].slot].node is o else f"becomes {a.label} ({a.id})"
                if isinstance(o.op, ops.Fused) and a.lowered_from:
                    b.status = f"lowered to its recipe (no {backend} kernel" + \
                        (", lower_all)" if lower_all else ")")
                if not a.status:
                    a.link = b.id
                continue
        if cv and isinstance(o.op, ops.Fused):
            b.status = "lowered to its recipe"
        elif cv and cv[0].node is not o and cv[0].node not in final:
            b.status = "rewritten by canonicalization"
    for a in after:
        if a.status:
            continue
        if a.kind == "fused" and a.link:
            a.status = "already fused in the input graph"   # a call, or autograd's own
        else:
            a.status = "kept" if a.link or a.kind in ("input", "const") else "new"

    misses = []
    for name, m in sorted(res.misses.items()):
        if m.matched < min_matched:
            continue
        at = None
        c = by_uid.get(_uid_of(m.node))
        if c is not None and canon_to_before.get(c):
            at = bids[canon_to_before[c][0]]
        misses.append(NearMiss(name, m.reason, m.matched, at))
    return GraphTrace(backend, before, after, misses, lower_all), res
