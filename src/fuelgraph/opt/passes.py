"""The fuse and lower passes and the optimizer pipeline:
canonicalize -> fuse (patterns of ops the backend has a kernel for) -> lower (fused ops with
no kernel, or all of them with lower_all; each recipe in canonical form, so it merges with the
same idiom written by hand, and the loss rules run again on what it merged) -> glue regions (the primitives left, grouped into
generated kernels; not with lower_all; see opt.regions) -> CSE/DCE (free: nodes are hash-consed and a graph
is what its outputs reach). Ordering of destructive inputs and kernel selection happen when the
runtime plans the optimized graph."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..backends import kernels_for
from ..backends.base import accepts
from ..ir import ops
from ..ir.node import Node, Value, built_at, consumers, toposort
from ..ir.tensor import Tensor
from ..registry.core import default_registry, fused_node
from .canonicalize import CANONICALIZE
from .engine import Pass, Pat, RewriteLog, Rule, canonical_memo, rebuild, run_pass
from .loss_rules import rewrite as loss_rewrites
from .pattern import _MAX_TRIES, Match, Miss, _op_sig, patterns_of, try_match
from .regions import form_regions


def has_kernel(op_id, backend: str, dtypes=None, shapes=None, params=None) -> bool:
    """Whether `backend` has a kernel for fused op `op_id` (one taking these `dtypes`, and
    covering these input `shapes` and `params`, when given)."""
    ks = kernels_for(int(op_id), backend)
    return any(accepts(k, dtypes, shapes, params) for k in ks) if dtypes is not None else bool(ks)


@dataclass
class OptResult:
    outputs: list[Value]
    log: RewriteLog
    misses: dict[str, Miss] = field(default_factory=dict)   # op name -> best near-miss
    lowered: dict[str, int] = field(default_factory=dict)   # op name -> times lowered
    glue: dict[str, int] = field(default_factory=dict)      # glue region name -> nodes
    # node of the graph before the glue pass -> node after (itself, its copy, or the glue node
    # running it); empty when no region formed
    glue_map: dict = field(default_factory=dict)
    canonical: list = field(default_factory=list)   # the canonical graph the fuser matched
    #                                                 (keeps the nodes misses name alive)


class _GraphOutput:
    """Pseudo-consumer standing for 'is an output of the graph being optimized' (`srcs`: the
    output value, so a later output of a multi-output recipe may be taken over)."""
    uid = "output"

    def __init__(self, v: Value):
        self.srcs = (v,)


def fuse(outputs: list[Value], backend: str | None, log: RewriteLog, misses: dict) -> list[Value]:
    """Replace recipe idioms by fused nodes; backend None fuses every op that has a pattern
    (lowering later expands those a backend has no kernel for). Run-time registered ops always
    fuse from their idiom (and are lowered again where they have no kernel), so explain shows
    that they were recognized."""
    reg = default_registry()
    by_sig: dict = {}
    late: dict = {}                 # the patterns of `fuse_late` entries: matched afterwards
    nodes = toposort(outputs)
    present = None
    for e in reg:
        if e.has_pattern and (has_kernel(e.id, backend) or e.id.is_runtime()
                              if backend is not None else
                              # prefuse for autograd: never turn a differentiable idiom into
                              # an op that refuses to be differentiated
                              e.backward.kind != "not_differentiable"):
            if e.pattern_needs:
                present = present or {type(n.op) for n in nodes}
                if not all(t in present for t in e.pattern_needs):
                    continue
            for p in patterns_of(e):
                (late if e.fuse_late else by_sig).setdefault(p.root_key, []).append((e, p))
    for cands in list(by_sig.values()) + list(late.values()):
        # the larger pattern wins at a root (layer norm before RMS norm, which matches its
        # tail); stable sort
        cands.sort(key=lambda ep: -ep[1].size)
    if not by_sig and not late:
        return outputs
    users = consumers(nodes)
    for v in outputs:   # a graph output is a consumer too: fusing over it would duplicate it
        users.setdefault(id(v.node), []).append(_GraphOutput(v))
    matches: dict[Node, tuple] = {}
    claimed: set = set()
    canon = canonical_memo(nodes)   # re-traced recipes stop at the (canonical) graph
    pos = {n: i for i, n in enumerate(nodes)}
    for n in reversed(nodes):       # roots first: the largest pattern at a node wins
        if n in claimed or n.nout != 1:
            continue
        r = match_at(n, by_sig.get(_op_sig(n.op), ()), users, canon, misses, pos)
        if r is not None:
            matches[n] = r
            claimed |= r[1].interior
    if late:
        # small idioms that larger patterns take in (silu(g) * u inside a conv's silu or a
        # scan's gate), on what the others left: a later root never claims their nodes
        for n in reversed(nodes):
            if n in claimed or n in matches or n.nout != 1:
                continue
            r = match_at(n, late.get(_op_sig(n.op), ()), users, canon, misses, pos)
            if r is not None and not (r[1].interior & claimed or
                                      any(m in r[1].interior for m in matches)):
                matches[n] = r
                claimed |= r[1].interior
    if not matches:
        return loss_rewrites(outputs, backend, log)
    taken = {v: (root, slot, m.interior) for root, (_, m) in matches.items()
             for slot, v in m.extras.items()}
    memo: dict[Node, Node] = {}
    for n in _order(nodes, taken):
        if n in matches:
            e, m = matches[n]
            with built_at(n.site):
                new = fused_node(ops.Fused(e.id, e.params(**m.params)),
                                 tuple(_remap(c, memo) for c in m.captures))
            log.events.append(("fuse", e.name, repr(n)))
        else:
            srcs = tuple(_moved(s, n, memo, taken) for s in n.srcs)
            new = n if srcs == n.srcs else rebuild(n, srcs)
        memo[n] = new
    for name in {e.name for e, _ in matches.values()}:
        misses.pop(name, None)
    return loss_rewrites([_moved(v, None, memo, taken) for v in outputs], backend, log)


def _source(v: Value, reader, taken: dict):
    """(node, slot) that `reader` reads for v after fusion: a later output of a fused recipe
    is read from the fused node (built at the match's root), except inside that match."""
    t = taken.get(v)
    if t is None or reader is t[0] or reader in t[2]:
        return v.node, v.slot
    return t[0], t[1]


def _moved(v: Value, reader, memo: dict, taken: dict) -> Value:
    n, slot = _source(v, reader, taken)
    return Value(memo[n], slot)


def _order(nodes: list, taken: dict) -> list:
    """`nodes` (topologically ordered) reordered so that every reader of a taken-over later
    output comes after the root whose fused node produces it."""
    if not taken:
        return nodes
    pos = {n: i for i, n in enumerate(nodes)}
    if all(pos[_source(s, n, taken)[0]] < pos[n] for n in nodes for s in n.srcs if s in taken):
        return nodes
    out, done = [], set()
    for start in nodes:
        if start in done:
            continue
        stack = [(start, False)]
        while stack:
            n, expanded = stack.pop()
            if n in done:
                continue
            if expanded:
                done.add(n)
                out.append(n)
                continue
            stack.append((n, True))
            stack.extend((d, False) for d in (_source(s, n, taken)[0] for s in n.srcs)
                         if d not in done)
    return out


def match_at(n: Node, cands: list, users: dict, canon: dict, misses: dict,
             pos: dict | None = None):
    """(entry, Match) of the first pattern that fits at n, else None (misses recorded). Every
    pattern is first tried with its preferred inputs (the values the structural match reached);
    the other input candidates (see pattern._alternatives) only after all of them."""
    retry = []
    for tries in ((0, 1), (1, _MAX_TRIES)):
        for e, p in (cands if tries[0] == 0 else retry):
            r = try_match(p, e, n.out(0), users, canon, tries, pos)
            if isinstance(r, Match):
                return e, r
            if r.more:
                retry.append((e, p))
            r.size = p.size
            best = misses.get(e.name)
            if best is None or r.matched > best.matched:
                misses[e.name] = r
    return None


def _remap(v: Value, memo: dict) -> Value:
    """v in the rewired graph; a capture may be a reshape the matcher made of a graph value."""
    if v.node in memo:
        return Value(memo[v.node], v.slot)
    return Value(rebuild(v.node, tuple(_remap(s, memo) for s in v.node.srcs)), v.slot)


def lower_pass(backend: str, lower_all: bool, counts: dict) -> Pass:
    def lower(root: Value):
        n = root.node
        if not lower_all and has_kernel(n.op.id, backend, [s.dtype for s in n.srcs],
                                        [s.shape for s in n.srcs], n.op.params):
            return None
        e = default_registry().entry(n.op.id)
        counts[e.name] = counts.get(e.name, 0) + 1
        outs = [t.value for t in e.lower([Tensor(s) for s in n.srcs], n.op.params)]
        # the recipe in canonical form, so it is the very node of the same idiom written by
        # hand elsewhere in the graph (autograd's prefused copy of a forward lowers onto the
        # forward itself instead of computing it twice); the sources are final already
        done = {s.node: tuple(s.node.out(i) for i in range(s.node.nout)) for s in n.srcs}
        return run_pass(outs, CANONICALIZE, None, done)
    return Pass("lower", [
        # gradients are built by now: a stop-gradient is the identity
        Rule("detach_is_identity", Pat(ops.Detach, src=(Pat.var("x"),)), lambda x: x),
        Rule("lower_fused", Pat(ops.Fused, name="root"), lower)])


def optimize(outputs, backend: str = "numpy", lower_all: bool = False) -> OptResult:
    """Optimize the graph under `outputs` (values or tensors) for `backend`."""
    vals = [o.value if isinstance(o, Tensor) else o for o in outputs]
    log, misses, lowered = RewriteLog(), {}, {}
    vals = canonical = run_pass(vals, CANONICALIZE, log)
    if not lower_all:
        vals = fuse(vals, backend, log, misses)
    vals = run_pass(vals, lower_pass(backend, lower_all, lowered), log)
    glue, glue_map = {}, {}
    if not lower_all:       # the reference mode runs every primitive on its own
        if lowered:         # lowering can make a loss and its helper read one x again
            vals = loss_rewrites(vals, backend, log)
        vals = form_regions(vals, backend, log, glue, glue_map)
    return OptResult(vals, log, misses, lowered, glue, glue_map, canonical)


def prefuse(outputs: list[Value]) -> list[Value]:
    """Canonicalize and fuse for every backend; autograd runs this on a forward graph so that
    hand-written idioms are differentiated through their fused ops' backward kinds."""
    log = RewriteLog()
    vals = run_pass(outputs, CANONICALIZE, log)
    return fuse(vals, None, log, {})
