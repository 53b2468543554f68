"""Realization: optimize once per graph structure, plan, cache, run."""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from ..backends import backend_name, get_backend
from ..errors import FuelGraphError
from ..ir import ops
from ..ir.node import Value, key_and_inputs
from ..ir.tensor import _DATA, REALIZED, TRACE, Tensor, _leaf, bound_data
from ..opt import optimize
from ..opt.engine import rebuild
from .plan import build_plan

_PLANS: "OrderedDict[tuple, tuple]" = OrderedDict()
MAX_PLANS = 256
#: bytes of constants that cached plans may keep alive together; least recently used plans
#: are dropped beyond it (a plan's constants are real arrays only for fg.const data: Python
#: scalars are 0-d broadcast views)
MAX_PLAN_BYTES = 1 << 30
STATS = {"plan_hits": 0, "plan_misses": 0}
_CACHE_LOCK = threading.Lock()


def _values(outputs) -> list[Value]:
    vals = []
    for o in outputs:
        if isinstance(o, Tensor):
            vals.append(o.value)
        elif isinstance(o, Value):
            vals.append(o)
        else:
            raise FuelGraphError(f"realize: expected Tensors, got {type(o).__name__}")
    return vals


def _device_of(vals) -> str:
    devs = {v.node.device for v in vals}
    if len(devs) != 1:
        raise FuelGraphError(f"realize: outputs live on several devices {sorted(devs)}")
    return devs.pop()


_KEYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _key_and_inputs(vals: list[Value]):
    """Structural key and Input nodes of the graph under `vals`, memoized on the first output
    node (nodes are immutable, so a graph's structure never changes). The memo holds only weak
    references, so it keeps neither the graph nor its data alive."""
    per = _KEYS.get(vals[0].node)
    if per is None:
        per = _KEYS[vals[0].node] = {}
    k = tuple((weakref.ref(v.node), v.slot) for v in vals)
    hit = per.get(k)
    if hit is not None:
        inputs = [r() for r in hit[1]]
        if all(n is not None for n in inputs):
            return hit[0], inputs
    skey, inputs = key_and_inputs(vals)
    per[k] = (skey, [weakref.ref(n) for n in inputs])
    return skey, inputs


def compile_plan(vals: list[Value], lower_all: bool = False, donate=()):
    """(plan, input nodes in the order Plan.run takes their buffers) for the graph under
    `vals`. Plans are cached by structure and hold no nodes, so the cache keeps no data alive.
    `donate`: Input nodes whose buffers destructive ops may overwrite."""
    device = _device_of(vals)
    bname = backend_name(device)
    skey, inputs = _key_and_inputs(vals)
    donated = ()
    if donate:
        dn = set(donate)
        donated = tuple(i for i, n in enumerate(inputs) if n in dn)
    key = (skey, bname, lower_all, donated)
    with _CACHE_LOCK:
        hit = _PLANS.get(key)
        if hit is not None:
            _PLANS.move_to_end(key)
            STATS["plan_hits"] += 1
            return hit, inputs
        STATS["plan_misses"] += 1
    be = get_backend(device)
    res = optimize(vals, bname, lower_all)
    plan = build_plan(res.outputs, be, bname, inputs, be.view_ops, run_body, donated)
    with _CACHE_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > MAX_PLANS or (len(_PLANS) > 1 and sum(
                p.nbytes() for p in _PLANS.values()) > MAX_PLAN_BYTES):
            _PLANS.popitem(last=False)
    return plan, inputs


_GRAPHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def realize_raw(outputs, lower_all: bool = False, cuda_graph: bool = False) -> list:
    """Run the graph; returns backend buffers (NumPy arrays or torch tensors). Values computed
    before are not recomputed: realized nodes are read as inputs (their buffers are kept, see
    `REALIZED`). Gradients filled by one backward() are computed together (one plan). With
    cuda_graph=True (cuda only) the cached plan is captured once into a CUDA graph and
    replayed, which removes the per-node host overhead for graphs of many small kernels."""
    vals = _values(outputs)
    if not vals:
        return []
    if TRACE[0] is not None:
        raise FuelGraphError(TRACE[0].realize_error())
    if not lower_all:
        known = [_known(v) for v in vals]
        if all(k is not None for k in known):
            return known
        vals = vals + together(vals)
    run = _cut(vals) if not lower_all else vals
    plan, inputs = compile_plan(run, lower_all)
    bufs = [bound_data(n) for n in inputs]
    if cuda_graph and plan.backend.name == "cuda":
        graphed = _GRAPHED.get(plan)
        if graphed is None:
            from ..backends.cuda.backend import GraphedPlan
            graphed = _GRAPHED[plan] = GraphedPlan(plan, bufs)
        outs = graphed.run(bufs)
    else:
        outs = _own(plan, plan.run(bufs), bufs)
    if not lower_all:
        for v, b in zip(vals, outs):
            keep(v, b)
        _rebind_together(vals)
    return outs[:len(_values(outputs))]


def _own(plan, outs, bufs) -> list:
    """Outputs that share memory with an input, a constant or another output are copied:
    every returned buffer is the caller's own."""
    shared = {id(_storage(b)) for b in bufs} | {id(_storage(b)) for b in plan.const_slots.values()}
    seen: set = set()
    res = []
    for b in outs:
        root = _storage(b)
        own = id(root) not in shared and id(root) not in seen and \
            getattr(getattr(b, "flags", None), "writeable", True)
        res.append(b if own else plan.backend.copy(b))
        seen.add(id(_storage(res[-1])))
    return res


def _known(v: Value):
    """The buffer of `v` when it is already computed (an input leaf, or realized before)."""
    n = v.node
    if isinstance(n.op, ops.Input):
        return _DATA.get(n)
    hit = REALIZED.get(n)
    if hit is not None and v.slot in hit:
        return _DATA.get(hit[v.slot])
    return None


def keep(v: Value, buf) -> None:
    """Remember that `v` was computed as `buf` (a leaf bound to it stands for `v` in later
    graphs). Buffers are never written after this (plans copy outputs they would alias)."""
    n = v.node
    if isinstance(n.op, (ops.Input, ops.Const, ops.Full, ops.Iota)):
        return
    if hasattr(buf, "flags"):
        buf.flags.writeable = False
    slots = REALIZED.get(n)
    if slots is None:
        slots = REALIZED[n] = {}
    if v.slot not in slots:
        slots[v.slot] = _leaf(buf, v.dtype, n.device, False).value.node


def _cut(vals: list[Value]) -> list[Value]:
    """The graph under `vals` with every already-computed value replaced by the leaf bound to
    its buffer (the walk stops there, so nothing under it is recomputed or even visited)."""
    if not REALIZED:
        return vals
    memo: dict = {}     # node -> rebuilt node (or the node itself)

    def sub(v: Value) -> Value:
        hit = REALIZED.get(v.node)
        if hit is not None and v.slot in hit:
            return Value(hit[v.slot], 0)
        return Value(memo[v.node], v.slot)

    stack = [v.node for v in vals]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        pending = [s.node for s in n.srcs if s.node not in memo and
                   not (s.node in REALIZED and s.slot in REALIZED[s.node])]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        srcs = tuple(sub(s) for s in n.srcs)
        memo[n] = n if srcs == n.srcs else rebuild(n, srcs)
    return [sub(v) if v.node in REALIZED and v.slot in REALIZED[v.node]
            else Value(memo[v.node], v.slot) for v in vals]


#: node of a gradient filled by backward() -> its group: the parameters whose .grad that
#: backward() filled, and the tensor it started from. Realizing one computes them all.
TOGETHER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class GradGroup:
    __slots__ = ("leaves", "root", "__weakref__")

    def __init__(self, root, leaves):
        self.root = weakref.ref(root)
        self.leaves = [weakref.ref(t) for t in leaves]

    def pending(self) -> list:
        out = []
        for r in self.leaves:
            t = r()
            g = t._grad if t is not None else None
            if g is not None and _known(g.value) is None:
                out.append(g.value)
        root = self.root()
        if root is not None and _known(root.value) is None:
            out.append(root.value)
        return out


def group_gradients(root, leaves) -> None:
    """Realize the .grad of every tensor in `leaves` (and `root`) in one plan, whichever of
    them is read first."""
    g = GradGroup(root, leaves)
    for t in leaves:
        if t._grad is not None:
            TOGETHER[t._grad.value.node] = g


def together(vals: list[Value]) -> list[Value]:
    """Values to compute with `vals`: the rest of the gradient groups any of them belongs to."""
    extra, seen = [], set(vals)
    for v in vals:
        g = TOGETHER.get(v.node)
        if g is not None:
            for w in g.pending():
                if w not in seen:
                    seen.add(w)
                    extra.append(w)
    return extra


def _rebind_together(vals) -> None:
    """Gradients of a group, once computed, become leaves holding their buffers (as torch's
    .grad have no graph): the forward and backward graph they held can be freed."""
    groups = {TOGETHER[v.node] for v in vals if v.node in TOGETHER}
    for g in groups:
        for r in g.leaves:
            t = r()
            if t is None or t._grad is None:
                continue
            gv = t._grad.value
            node = REALIZED.get(gv.node, {}).get(gv.slot)
            if node is not None:
                t.grad = Tensor(Value(node, 0))


def _storage(buf):
    """The buffer owning `buf`'s memory (NumPy .base / torch ._base chain)."""
    while True:
        base = getattr(buf, "_base", None)
        if base is None:
            base = getattr(buf, "base", None)
        if base is None or not hasattr(base, "shape"):
            return buf
        buf = base


def realize(outputs, lower_all: bool = False, cuda_graph: bool = False) -> list:
    """Run the graph under `outputs` (Tensors) and return them computed: each returned
    Tensor holds its buffer on the device that computed it (no host copy; `.numpy()` makes
    one), and the given tensors keep their values too (realizing again costs nothing). With
    lower_all=True every fused op runs as its primitive recipe (the reference mode; nothing is
    kept); cuda_graph=True replays a CUDA graph of the plan (cuda only)."""
    vals = _values(outputs)
    if not vals:
        return []
    bufs = realize_raw(vals, lower_all, cuda_graph)
    return [Tensor(Value(_leaf_node(v, b), 0)) for v, b in zip(vals, bufs)]


def _leaf_node(v: Value, buf):
    n = v.node
    if isinstance(n.op, ops.Input):
        return n
    hit = REALIZED.get(n)
    if hit is not None and v.slot in hit and _DATA.get(hit[v.slot]) is buf:
        return hit[v.slot]
    if hasattr(buf, "flags"):
        buf.flags.writeable = False
    return _leaf(buf, v.dtype, n.device, False).value.node


_BODY_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def run_body(body, args: list) -> list:
    """Run a Scan body (a closed sub-graph) on concrete buffers."""
    hit = _BODY_PLANS.get(body)
    if hit is None:
        vals = list(body.outputs)
        plan, inputs = compile_plan(vals)
        order = [next(i for i, p in enumerate(body.inputs) if p.node is n) for n in inputs]
        hit = _BODY_PLANS[body] = (plan, order)
    plan, order = hit
    return plan.run([args[i] for i in order])
