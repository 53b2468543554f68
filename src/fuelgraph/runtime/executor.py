"""Realization: optimize once per graph structure, plan, cache, run."""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from ..backends import backend_name, get_backend
from ..errors import FuelGraphError
from ..ir.node import Value
from ..ir.tensor import Tensor, bound_data
from ..opt import optimize
from ..ir.node import key_and_inputs
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


def compile_plan(vals: list[Value], lower_all: bool = False):
    """(plan, input nodes in the order Plan.run takes their buffers) for the graph under
    `vals`. Plans are cached by structure and hold no nodes, so the cache keeps no data alive."""
    device = _device_of(vals)
    bname = backend_name(device)
    skey, inputs = _key_and_inputs(vals)
    key = (skey, bname, lower_all)
    with _CACHE_LOCK:
        hit = _PLANS.get(key)
        if hit is not None:
            _PLANS.move_to_end(key)
            STATS["plan_hits"] += 1
            return hit, inputs
        STATS["plan_misses"] += 1
    be = get_backend(device)
    res = optimize(vals, bname, lower_all)
    plan = build_plan(res.outputs, be, bname, inputs, be.view_ops, run_body)
    with _CACHE_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > MAX_PLANS or (len(_PLANS) > 1 and sum(
                p.nbytes() for p in _PLANS.values()) > MAX_PLAN_BYTES):
            _PLANS.popitem(last=False)
    return plan, inputs


_GRAPHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def realize_raw(outputs, lower_all: bool = False, cuda_graph: bool = False) -> list:
    """Run the graph; returns backend buffers (NumPy arrays or torch tensors). With
    cuda_graph=True (cuda only) the cached plan is captured once into a CUDA graph and
    replayed, which removes the per-node host overhead for graphs of many small kernels."""
    vals = _values(outputs)
    if not vals:
        return []
    plan, inputs = compile_plan(vals, lower_all)
    bufs = [bound_data(n) for n in inputs]
    if cuda_graph and plan.backend.name == "cuda":
        graphed = _GRAPHED.get(plan)
        if graphed is None:
            from ..backends.cuda.backend import GraphedPlan
            graphed = _GRAPHED[plan] = GraphedPlan(plan, bufs)
        return graphed.run(bufs)
    outs = plan.run(bufs)
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
    """Run the graph under `outputs` (Tensors) and return NumPy arrays. With lower_all=True
    every fused op runs as its primitive recipe (the reference mode); cuda_graph=True replays
    a CUDA graph of the plan (cuda only)."""
    vals = _values(outputs)
    if not vals:
        return []
    be = get_backend(_device_of(vals))
    return [be.to_numpy(b) for b in realize_raw(vals, lower_all, cuda_graph)]


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
