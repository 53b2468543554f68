"""`fuelgraph.jit`: trace a step function once, replay its plan many times.

    step = fg.jit(train_step)          # or @fg.jit; fg.jit(fn, cuda_graph=True) on the GPU
    loss = step(x, y)                  # first call: traces fn, compiles, runs
    loss = step(x2, y2)                # same signature: runs the cached plan on the new buffers

Tracing runs the Python function once with the real tensors but computes nothing: it records
the graph of what the function returns and of every tensor handle it rebinds (parameters and
optimizer state updated in place, `.grad` set by backward() and cleared by zero_grad(), the
random generator's state). A replay skips Python entirely: it feeds the current buffers of the
arguments and of those tensors to the cached plan, then rebinds the handles to the results.
Parameters and optimizer state are overwritten in place (their old buffers are handed to the
plan); when something else still holds an old value (a lazy tensor built from it), that value
gets a private copy first, so every tensor keeps reading what it read before.

What makes a call trace again (a new entry; earlier ones stay cached):
- the structure of the arguments (tuple/list/dict nesting), each tensor argument's shape, dtype,
  device and requires_grad, and the value of every other argument (Python scalars, strings,
  None; any other object by identity): all are baked into the trace;
- a module's train()/eval() mode, an optimizer's hyperparameters other than the learning rate
  (the learning rate and step counts are run-time inputs), which parameters have a gradient
  before the call, and the shape/dtype/device of the tensors the trace reads.
Not seen (baked at trace time, documented limits): Python control flow on values other than
the above, tensors created inside the function from host data, and parameters replaced by new
Parameter objects (load new values with `load_state_dict` / `copy_`, or call `step.retrace()`).
Tensor arguments are leaves for the trace: gradients do not flow out of the function through
them. Realizing a tensor inside the traced function (`.item()`, `.numpy()`, printing) raises:
return it instead.

A loop that calls one step back to back with nothing else in between (a decode loop) can skip
even a replay's bookkeeping: `step.replayer()` after a call gives a `Replayer` of that call's
entry, whose `run(buffers)` feeds new argument buffers straight to the plan or CUDA graph."""
from __future__ import annotations

import functools
import weakref

from .api import bind_buffer, rebind
from .backends import get_backend
from .errors import FuelGraphError
from .ir import ops
from .ir.node import Value, built_at
from .ir.tensor import _DATA, _INPUT_UID, GRAD_LEAVES, OWNER, TRACE, Tensor, _leaf
from .runtime.executor import _cut, _key_and_inputs, _known, compile_plan, realize_raw

_SCALARS = (int, float, bool, str, bytes, type(None), complex)
_REPLAY_SITE = ("<fuelgraph.jit replay>", 0, "step")


class _Trace:
    """Recording state of one trace: every (tensor, attr) rebound, with its value before."""

    def __init__(self, name):
        self.name = name
        self.first_uid = next(_INPUT_UID)   # leaves numbered from here on were made by the step
        self.before: dict = {}        # (id(t), attr) -> (t, attr, value before the trace)
        self.guards: list = []        # (fn, value at trace time)
        self.guard_keys: set = set()
        self.grad_reads: dict = {}    # id(t) -> (t, had no grad): .grad read before any write

    def read_grad(self, t):
        if (id(t), "grad") not in self.before:
            self.grad_reads.setdefault(id(t), (t, t._grad is None))

    def rebound(self, t, attr, old):
        self.before.setdefault((id(t), attr), (t, attr, old))

    def guard(self, fn, value=None, key=None):
        """Retrace when fn() no longer returns `value` (fn's value now when omitted); a guard
        with the `key` of an earlier one is not added again."""
        if key is not None:
            if key in self.guard_keys:
                return
            self.guard_keys.add(key)
        self.guards.append((fn, fn() if value is None else value))

    def realize_error(self) -> str:
        return (f"fuelgraph.jit({self.name}): a tensor was realized while the function was being "
                f"traced (.item(), .numpy(), print, bool(...)); a traced step computes nothing "
                f"until it returns: return the tensor instead, or call the function without jit")


def current_trace():
    """The active trace, or None (modules and optimizers add their guards to it)."""
    return TRACE[0]


# ---- argument flattening ------------------------------------------------------------------------
def _flatten(obj, leaves: list, keep=False):
    """Structure key of a pytree of tuples/lists/dicts; Tensor leaves appended to `leaves`.
    Other objects are keyed by identity (kept themselves with keep=True, for results)."""
    if isinstance(obj, Tensor):
        leaves.append(obj)
        return ("T", tuple(obj.shape), obj.dtype, obj.device, obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(_flatten(o, leaves, keep) for o in obj))
    if isinstance(obj, dict):
        return (dict, tuple((k, _flatten(v, leaves, keep)) for k, v in obj.items()))
    if isinstance(obj, _SCALARS):
        return ("S", type(obj).__name__, obj)
    return ("O", obj if keep else id(obj))


def _build(tree, it):
    """The pytree described by `tree` (from _flatten(keep=True)), Tensors taken from `it`."""
    tag = tree[0]
    if tag == "T":
        return next(it)
    if tag == "S":
        return tree[2]
    if tag == "O":
        return tree[1]
    if tag is dict:
        return {k: _build(v, it) for k, v in tree[1]}
    items = [_build(v, it) for v in tree[1]]
    return tag(items) if tag in (list, tuple) else tag(*items)   # namedtuples


def _unflatten(obj, it):
    """Rebuild the pytree `obj` with its Tensor leaves taken from the iterator `it`."""
    if isinstance(obj, Tensor):
        return next(it)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_unflatten(o, it) for o in obj)
    if isinstance(obj, dict):
        return {k: _unflatten(v, it) for k, v in obj.items()}
    return obj


def _as_leaf(t: Tensor) -> Tensor:
    """`t` itself when it is a leaf with data, else a new leaf handle on its computed value."""
    if isinstance(t.value.node.op, ops.Input):
        return t
    buf = realize_raw([t])[0]
    return _leaf(buf, t.dtype, t.device, False)


# ---- entries ---------------------------------------------------------------------------------------
class _Entry:
    """One trace: its plan, where each input buffer comes from, where each output goes, and
    what must still hold for a call to replay it."""
    __slots__ = ("plan", "sources", "donated", "tree", "res_meta", "mutations", "mut_meta", "guards",
                 "cell_meta", "grad_presence", "inplace_of", "graphed")

    def fetch(self, leaves) -> list:
        bufs = []
        for kind, a, b in self.sources:
            if kind == "arg":
                bufs.append(_buffer_of(leaves[a].value))
            elif kind == "cell":
                bufs.append(_buffer_of(_val(a, b)))
            else:                                   # a constant captured at trace time
                bufs.append(_DATA[a])
        return bufs

    def matches(self) -> bool:
        for t, attr, meta in self.cell_meta:
            v = _val(t, attr)
            if v is None or (v.shape, v.dtype, v.node.device) != meta:
                return False
        for t, was_none in self.grad_presence:
            if (t._grad is None) != was_none:
                return False
        return all(fn() == v for fn, v in self.guards)


def _val(t, attr):
    """The current Value of a handle's attribute ("value" or "grad"; None without a grad)."""
    if attr == "value":
        return t.value
    return None if t._grad is None else t._grad.value


def _buffer_of(v: Value):
    b = _known(v)
    return b if b is not None else realize_raw([v])[0]


_PLACEHOLDER: list = []


def _placeholder() -> Value:
    """A value handles point at while their buffers are being updated (never realized)."""
    if not _PLACEHOLDER:
        from .dtype import float32
        from .ir.node import make_node
        _PLACEHOLDER.append(Value(make_node(ops.Input(-1, (), float32, "cpu"), ()), 0))
    return _PLACEHOLDER[0]


def _set_value(t: Tensor, value) -> None:
    """Point `t` at `value` without recording it (restoring, or handing over a buffer)."""
    old = t.value
    if t._requires_grad and GRAD_LEAVES.get(old) is t:
        del GRAD_LEAVES[old]
    t.value = value
    t._cache = None
    if t._requires_grad and (not _PLACEHOLDER or value is not _PLACEHOLDER[0]):
        GRAD_LEAVES[value] = t


class Jitted:
    """A traced function (see the module docstring). `retrace()` drops the cached traces;
    `stats` counts traces and replays."""

    def __init__(self, fn, cuda_graph=False):
        self.fn = fn
        self.cuda_graph = cuda_graph
        self.cache: dict = {}
        self.stats = {"traces": 0, "replays": 0}
        self._last = None               # the entry of the last call (see replayer())
        functools.update_wrapper(self, fn)

    def retrace(self):
        self.cache.clear()
        self._last = None

    def replayer(self):
        """A `Replayer` of the entry the last call ran, or None when that entry cannot be
        replayed without a call's bookkeeping (a handle it rebinds is not updated in place)."""
        e = self._last
        if e is None or e.plan is None:
            return None
        nres = len(e.res_meta)
        if any(a != "value" or nres + j not in e.inplace_of
               for j, (_, a) in enumerate(e.mutations)):
            return None
        return Replayer(self, e)

    def __call__(self, *args, **kwargs):
        if TRACE[0] is not None:        # called inside another trace: part of that graph
            return self.fn(*args, **kwargs)
        leaves: list = []
        key = _flatten((args, kwargs), leaves)
        for e in self.cache.get(key, ()):
            if e.matches():
                self.stats["replays"] += 1
                return self._run(e, leaves)
        fixed = [_as_leaf(t) for t in leaves]
        e = self._trace(args, kwargs, fixed)
        if e is None:                   # a rebound tensor was lazy: it is a leaf now
            e = self._trace(args, kwargs, fixed)
            if e is None:
                raise FuelGraphError(f"fuelgraph.jit({self.__name__}): could not trace")
        self.cache.setdefault(key, []).append(e)
        return self._run(e, fixed)

    # -- tracing --
    def _trace(self, args, kwargs, fixed):
        self.stats["traces"] += 1
        args, kwargs = _unflatten((args, kwargs), iter(fixed))
        tr = _Trace(getattr(self.fn, "__name__", "fn"))
        TRACE[0] = tr
        try:
            result = self.fn(*args, **kwargs)
        finally:
            TRACE[0] = None
        before = list(tr.before.values())
        # restore every handle the trace rebound; the first run then replays from these
        finals = [(t, attr, _val(t, attr)) for t, attr, _ in before]
        for t, attr, old in before:
            if attr == "value":
                _set_value(t, old)
            else:
                t._grad = old
        lazy = [(t, attr) for t, attr, old in before
                if old is not None and (old.value if attr == "grad" else old).node is not None
                and not isinstance((old.value if attr == "grad" else old).node.op, ops.Input)]
        if lazy:                        # make them leaves holding their values, then retrace
            for t, attr in lazy:
                if attr == "value":
                    bind_buffer(t, get_backend(t.device).copy(_buffer_of(t.value)))
                else:
                    t.grad = Tensor(_leaf(_buffer_of(t._grad.value), t.dtype, t.device,
                                          False).value)
            return None
        res_leaves: list = []
        tree = _flatten(result, res_leaves, keep=True)
        muts = [(t, attr) for t, attr, v in finals if v is not None]
        outs = [r.value for r in res_leaves] + [v for _, _, v in finals if v is not None]
        arg_of = {t.value.node: i for i, t in reversed(list(enumerate(fixed)))}

        def source(n):
            if n in arg_of:
                return ("arg", arg_of[n], None)
            own = OWNER.get(n)
            if own is not None:
                v = _val(*own)
                if v is not None and v.node is n:
                    return ("cell", own[0], own[1])
            return ("const", n, None)

        e = _Entry()
        e.tree, e.mutations, e.guards = tree, muts, list(tr.guards)
        e.mut_meta = [(v.dtype, v.node.device) for _, _, v in finals if v is not None]
        e.res_meta = [(r.dtype, r.device) for r in res_leaves]
        e.grad_presence = list(tr.grad_reads.values())
        e.graphed = None
        if outs:
            mut_cells = {id(t) for t, a in muts if a == "value"}
            cut = _cut(outs)
            _, inputs = _key_and_inputs(cut)
            donate = [n for n in inputs if (lambda s: s[0] == "cell" and s[2] == "value" and
                                            id(s[1]) in mut_cells)(source(n))]
            e.plan, inputs = compile_plan(cut, donate=donate)
            e.sources = [source(n) for n in inputs]
            dn = set(donate)
            e.donated = [k for k, n in enumerate(inputs) if n in dn]
            del cut, inputs, donate, dn
        else:
            e.plan, e.sources, e.donated = None, [], []
        e.cell_meta = [(a, b, (_val(a, b).shape, _val(a, b).dtype, _val(a, b).node.device))
                       for kind, a, b in e.sources if kind == "cell"]
        cell_pos = {id(s[1]): k for k, s in enumerate(e.sources)
                    if s[0] == "cell" and s[2] == "value"}
        e.inplace_of = {len(res_leaves) + j: cell_pos[id(t)]
                        for j, (t, a) in enumerate(muts)
                        if a == "value" and cell_pos.get(id(t)) in set(e.donated)}
        for r in res_leaves:            # the trace's lazy results are dropped (the run gives
            r.value = _placeholder()    # new ones): nothing keeps the old values alive
        del tr, before, finals, outs, result, res_leaves
        return e

    # -- replay --
    def _run(self, e: _Entry, leaves):
        self._last = e
        if e.plan is None:
            return _build(e.tree, iter(()))
        bufs = e.fetch(leaves)
        be = e.plan.backend
        # hand the donated buffers over: the cells stop pointing at them; an old value that
        # something else still holds gets a private copy first
        refs = []
        for k in e.donated:
            t = e.sources[k][1]
            refs.append((k, weakref.ref(t.value.node)))
            _set_value(t, _placeholder())
        for k, r in refs:
            n = r()
            if n is not None:
                _DATA[n] = be.copy(bufs[k])
            n = None
        try:
            if self.cuda_graph and be.name == "cuda":
                outs = self._graphed(e, bufs)
            else:
                outs = e.plan.run(bufs)
        except BaseException:
            meta = {id(t): (m[1], m[2]) for t, a, m in e.cell_meta if a == "value"}
            for k in e.donated:
                t = e.sources[k][1]
                rebind(t, _leaf(bufs[k], *meta[id(t)], False).value)
            raise
        outs = _owned(be, outs, bufs, e)
        with built_at(_REPLAY_SITE):    # new leaves: no frame walk for their build site
            return self._rebind(e, outs)

    def _rebind(self, e: _Entry, outs):
        nres = len(e.res_meta)
        done = list(zip(e.mutations, e.mut_meta, outs[nres:]))
        for (t, attr), (d, dev), buf in done:       # values first: a grad's shape is checked
            if attr == "value":                     # against its tensor's value
                rebind(t, _leaf(buf, d, dev, False).value)
        for (t, attr), (d, dev), buf in done:
            if attr == "grad":
                t.grad = Tensor(_leaf(buf, d, dev, False).value)
        res = [_leaf(b, d, dev, False) for b, (d, dev) in zip(outs[:nres], e.res_meta)]
        return _build(e.tree, iter(res))

    def _graphed(self, e: _Entry, bufs):
        moved = ()
        for _ in range(2):
            if e.graphed is None:
                from .backends.cuda.backend import GraphedStep
                # tensors it only reads (parameters, constants) usually keep their buffers:
                # captured where they are, so a replay copies no weights; one that moves
                # between calls is copied in from then on
                persistent = [k for k, s in enumerate(e.sources) if s[0] != "arg"]
                try:
                    e.graphed = GraphedStep(e.plan, bufs, e.inplace_of, persistent, moved)
                except Exception as err:    # a kernel that syncs with the host cannot be captured
                    import warnings
                    warnings.warn(f"fuelgraph.jit({self.__name__}): CUDA graph capture failed "
                                  f"({type(err).__name__}: {err}); replaying the plan without it",
                                  RuntimeWarning, stacklevel=3)
                    e.graphed = False
            if e.graphed is False:
                return e.plan.run(bufs)
            outs = e.graphed.run(bufs)
            if outs is not None:
                return outs
            moved, e.graphed = e.graphed.moved, None      # capture again, those copied in
        return e.plan.run(bufs)


class Replayer:
    """The entry of a jitted step's last call, replayed on new buffers of its tensor arguments
    with none of a call's checks or rebinding: for a loop that runs one step back to back, such
    as decoding tokens, where the host work of a call would cost more than the step itself.

        r = step.replayer()                   # after a call of `step`
        outs = r.run([ids_buf, ...])          # raw buffers of the call's tensor arguments,
                                              # same shapes/dtypes -> the result buffers (flat)

    Valid only while nothing else happens between the runs: no parameter, optimizer state or
    other handle the step reads is rebound or replaced, no mode changes (the caller guarantees
    it; a normal call checks it). Handles the step rebinds must be updated in place (donated
    cells, such as KV-cache pools): they keep their buffers, whose contents each run updates.
    On the GPU a CUDA-graph entry replays its graph, copying in only the arguments."""

    def __init__(self, jitted: Jitted, e: _Entry):
        self.jitted, self.e = jitted, e
        self.nres = len(e.res_meta)
        self.arg_at = [[k for k, s in enumerate(e.sources) if s[0] == "arg" and s[1] == i]
                       for i in range(1 + max((s[1] for s in e.sources if s[0] == "arg"),
                                              default=-1))]
        self._refresh()

    def _refresh(self):
        e = self.e
        self.bufs = [None if kind == "arg" else
                     _buffer_of(_val(a, b)) if kind == "cell" else _DATA[a]
                     for kind, a, b in e.sources]
        self.args = sorted(k for ks in self.arg_at for k in ks)

    def run(self, arg_bufs) -> list:
        """Buffers of the call's tensor arguments, in order (those the step does not read may be
        None) -> the buffers of its tensor results, in the order they appear in its result."""
        e = self.e
        bufs = list(self.bufs)
        for ks, b in zip(self.arg_at, arg_bufs):
            for k in ks:
                bufs[k] = b
        self.jitted.stats["replays"] += 1
        g = e.graphed
        if g:                              # captured: copies in the arguments, replays
            return g.replay_args(self.args, bufs, self.nres)
        outs = e.plan.run(bufs)
        be = e.plan.backend
        outs = _owned(be, outs, bufs, e)
        if any(outs[j] is not bufs[k] for j, k in e.inplace_of.items()):
            # a state the plan did not write in place: the handles take the new buffers
            with built_at(_REPLAY_SITE):
                self.jitted._rebind(e, outs)
            self._refresh()
        return outs[:self.nres]


def _owned(be, outs, bufs, e) -> list:
    """Outputs that share memory with an input (other than a donated cell's own in-place
    result), a constant or an earlier output are copied, so that every handle owns its
    buffer; buffers that cannot be written (broadcast constants) are copied too."""
    in_store = {}
    for k, b in enumerate(bufs):
        in_store.setdefault(be.storage(b), k)
    consts = {be.storage(b) for b in e.plan.const_slots.values()}
    seen = set()
    res = []
    for j, b in enumerate(outs):
        s = be.storage(b)
        k = in_store.get(s)
        ok = s not in seen and s not in consts and (k is None or e.inplace_of.get(j) == k) \
            and not be.writable_copy_needed(b)
        res.append(b if ok else be.copy(b))
        seen.add(be.storage(res[-1]))
    return res


def jit(fn=None, *, cuda_graph: bool = False):
    """Trace `fn` once per signature and replay its cached plan (see the module docstring for
    what retraces). Use as `fg.jit(fn)` or `@fg.jit` / `@fg.jit(cuda_graph=True)`; with
    cuda_graph=True a step on the GPU is captured as one CUDA graph after its first run and
    replayed (parameters and optimizer state stay in their buffers across replays)."""
    if fn is None:
        return lambda f: Jitted(f, cuda_graph)
    return Jitted(fn, cuda_graph)
