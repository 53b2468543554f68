"""Plans: a topological schedule of an optimized graph with kernels pre-resolved, buffer
lifetimes (free after last use) and in-place decisions for destructive inputs. A plan is
cached by the structural key of the graph it was built for, with Input leaves abstracted to
their position, shape and dtype, so re-running the same model on new data skips optimization."""
from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from dataclasses import dataclass, field

from ..errors import FuelGraphError
from ..ir import ops
from ..backends import select_kernel
from ..backends.base import op_identity
from ..ir.node import Node, Value, consumers, format_site, toposort
from ..registry.core import default_registry
from . import collectives


@dataclass
class Step:
    """One kernel call. Holds its op but no graph nodes, so a cached plan keeps no data alive."""
    op: object
    fn: object                 # bound kernel: fn(*buffers) -> buffer or tuple
    srcs: tuple[int, ...]      # buffer slots read
    outs: tuple[int, ...]      # buffer slots written
    free: tuple[int, ...]      # slots dead after this step
    inplace: tuple[int, ...] = ()   # destructive op: indices of the inputs it overwrites
    copy_first: tuple[bool, ...] = ()  # per destructive input: ordering could not prove the
    #                                    overwrite safe, so copy that input first
    takes_out: bool = False    # ...or, if the kernel can (one destructive input), have it
    #                            write a fresh buffer instead
    contiguous: bool = True    # kernel wants contiguous inputs
    name: str = ""
    site: tuple | None = None  # the user's source line that built the op (for errors)
    asynchronous: bool = False  # the kernel returns (handle, outputs) (a collective in flight)
    waits: tuple[int, ...] = ()  # slots written by asynchronous steps that this step reads:
    #                              their handles are waited for before it runs
    group: tuple = ()          # independent products run together (see _group_products):
    #                            (op, number of srcs) per product, srcs and outs concatenated


@dataclass(eq=False)
class Plan:
    backend: object
    steps: list[Step]
    input_slots: list[int]     # slot of each Input in structural order
    const_slots: dict[int, object]
    output_slots: list[int]
    n_slots: int
    stats: dict = field(default_factory=dict)
    #: (shape, dtype) of every slot, for memory planning before a run (runtime/memory.py)
    slot_types: list = field(default_factory=list)
    #: called before every run (the collectives' agreement check), or None
    prologue: object = None

    def run(self, inputs: list) -> list:
        if self.prologue is not None:
            self.prologue()
        ctx = getattr(self.backend, "run_context", None)
        if ctx is None:
            return self._run(inputs)
        with ctx():
            return self._run(inputs)

    def _run(self, inputs: list) -> list:
        prog = self._program()
        env: list = [None] * self.n_slots
        for slot, buf in zip(self.input_slots, inputs):
            if slot >= 0:
                env[slot] = buf
        for slot, buf in self.const_slots.items():
            env[slot] = buf
        be = self.backend
        if prog.dynamic or (prog.alias_targets and _inputs_alias(be, env, prog)):
            return self._run_counted(env)
        writable_needed = be.writable_copy_needed
        pending: dict = {}      # slot -> handle of the asynchronous step still writing it
        for st, srcs, out, free, contig, special in prog.steps:
            if special is not None:         # the general path; `special`: the copy decisions
                self._special_step(st, env, pending,
                                   lambda j, k, a: special[j] or writable_needed(a))
                continue
            if contig:
                _make_contiguous(be, env, srcs)
            args = [env[i] for i in srcs]
            try:
                r = st.fn(*args)
            except Exception as e:
                raise _run_error(st, e) from e
            env[out] = r[0] if isinstance(r, tuple) else r
            for i in free:
                env[i] = None
            # this step's references go before the next step allocates (a view it returned
            # would otherwise keep the storage its slot just gave up alive one step longer)
            r = args = None
        for h in {id(h): h for h in pending.values()}.values():
            h.wait()
        return [env[i] for i in self.output_slots]

    def _special_step(self, st, env, pending, must_copy, refs=None):
        """A step with more than the common case: destructive inputs (overwritten in place
        unless `must_copy(j, k, buffer)` says the j-th of them, argument k, must be copied
        first), waits on asynchronous steps, an asynchronous kernel, several outputs. Returns
        the buffers of the slots it frees. `refs`: the run's storage counts, kept up to date
        when an input slot takes a contiguous copy."""
        for i in st.waits:
            h = pending.pop(i, None)
            if h is not None:
                h.wait()
        be = self.backend
        if st.contiguous:
            _make_contiguous(be, env, st.srcs, refs)
        args = [env[i] for i in st.srcs]
        kw = {}
        for j, k in enumerate(st.inplace):
            if must_copy(j, k, args[k]):
                if st.takes_out:
                    kw["out"] = self.backend.empty_like(args[k])
                else:
                    args[k] = self.backend.copy(args[k])
                self.stats["inplace_copies"] = self.stats.get("inplace_copies", 0) + 1
            else:
                self.stats["inplace_reused"] = self.stats.get("inplace_reused", 0) + 1
        try:
            r = st.fn(*args, **kw)
        except Exception as e:
            raise _run_error(st, e) from e
        if st.asynchronous:
            h, r = r
            if h is not None:
                pending.update((o, h) for o in st.outs)
        if len(st.outs) == 1:
            env[st.outs[0]] = r[0] if isinstance(r, tuple) else r
        else:
            for i, o in enumerate(st.outs):
                env[o] = r[i]
        freed = [env[i] for i in st.free]
        for i in st.free:
            env[i] = None
        return freed

    def _run_counted(self, env: list) -> list:
        """The run with live buffers counted per storage, for plans whose in-place overwrites
        could not be proved safe when the plan was built (or whose input buffers alias each
        other this time): aliasing is read off the buffers themselves (not a list of view
        ops), so an op whose output happens to alias its input (a scan returning its init
        carry, a kernel returning its argument) can never be overwritten while another live
        slot still reads it."""
        be = self.backend
        refs = _StorageRefs(be, env)
        pending: dict = {}
        for st in self.steps:
            def must_copy(j, k, a, st=st):
                s = st.srcs[k]
                return (st.copy_first[j] or be.writable_copy_needed(a) or s not in st.free
                        or refs.shared(env[s]) or st.srcs.count(s) > 1)
            freed = self._special_step(st, env, pending, must_copy, refs)
            refs.add(env[o] for o in st.outs)
            refs.drop(freed)
            freed = None                # the freed buffers go now, not after the next step
        for h in {id(h): h for h in pending.values()}.values():
            h.wait()
        return [env[i] for i in self.output_slots]

    def _program(self) -> "_Program":
        """The run's per-step data, prepared once (steps are read each run, so a kernel
        swapped into a step, as profilers do, is the one called)."""
        key = (id(self.steps), len(self.steps))
        prog = self.__dict__.get("_prog")
        if prog is None or prog.key != key:
            prog = self.__dict__["_prog"] = _Program(self, key)
        return prog

    @property
    def destructive(self) -> bool:
        return any(st.inplace for st in self.steps)

    def nbytes(self) -> int:
        """Bytes the plan keeps alive between runs (its materialized constants)."""
        return sum(self.backend.storage_nbytes(b) for b in self.const_slots.values())


class _Program:
    """What a run needs per step, prepared once per plan: (step, srcs, output slot, slots
    freed, wants contiguous inputs, needs the general path), and for the destructive steps
    whether each overwritten input must be copied first.

    Whether an overwrite is safe depends on which live buffers share the overwritten one's
    storage. That is decided here, from the plan alone, where it can be: a kernel's output can
    only alias memory it was given, so a buffer may share storage only with the slots it
    derives from (and the slots derived from those). When no other slot live at a destructive
    step may alias its input, the overwrite is safe whatever the kernels return, provided the
    run's input buffers do not alias each other (checked per run, for the inputs such a proof
    relied on: `alias_inputs`). When the plan cannot be proved safe (`dynamic`), every run
    counts live buffers per storage instead (`Plan._run_counted`)."""

    #: above this much work (destructive inputs x slots) the proof is not attempted
    MAX_WORK = 4_000_000

    def __init__(self, plan: Plan, key):
        self.key = key
        steps = plan.steps
        copy = self._copies(plan)
        self.steps = [(st, st.srcs, st.outs[0] if st.outs else -1, st.free, st.contiguous,
                       copy.get(id(st), ()) if st.inplace or st.waits or st.asynchronous or
                       len(st.outs) != 1 else None)
                      for st in steps]

    def _copies(self, plan) -> dict:
        """{id(step): per destructive input, whether it is copied before the step}, and sets
        `dynamic`, `alias_targets`, `alias_inputs`."""
        steps = plan.steps
        copy: dict = {}
        self.dynamic = False
        self.alias_targets: tuple = ()      # input/const slots an in-place proof relied on,
        self.alias_inputs: tuple = ()       # which must not share storage with these
        destructive = [st for st in steps if st.inplace]
        if not destructive:
            return copy
        if len(destructive) * max(plan.n_slots, 1) > self.MAX_WORK:
            self.dynamic = True
            return copy
        producer_srcs: dict[int, tuple] = {}    # slot -> slots its step read
        readers: dict[int, list] = {}           # slot -> output slots of the steps reading it
        for st in steps:
            for o in st.outs:
                producer_srcs[o] = st.srcs
            for s in set(st.srcs):
                readers.setdefault(s, []).extend(st.outs)
        leaves = [s for s in plan.input_slots if s >= 0] + list(plan.const_slots)
        live = set(leaves)
        targets: set = set()
        for st in steps:
            if st.inplace:
                copies = []
                for k, static_copy in zip(st.inplace, st.copy_first):
                    s = st.srcs[k]
                    if static_copy or s not in st.free or st.srcs.count(s) > 1:
                        copies.append(True)
                        continue
                    roots = _closure([s], lambda x: producer_srcs.get(x, ()))
                    near = _closure(roots, lambda x: readers.get(x, ()))
                    if (live - {s}) & near:
                        self.dynamic = True
                        return copy
                    targets.update(r for r in roots if r not in producer_srcs)
                    copies.append(False)
                copy[id(st)] = tuple(copies)
            live.update(st.outs)
            live.difference_update(st.free)
        self.alias_targets = tuple(sorted(targets))
        self.alias_inputs = tuple(s for s in leaves if s not in targets) if targets else ()
        return copy


def _make_contiguous(be, env, srcs, refs=None) -> None:
    """Replace each non-contiguous buffer among the slots `srcs` by a contiguous copy, in
    `env` itself: a later step that wants the same slot contiguous (attention's grad_out read by
    its delta and by the backward, v read by the forward and the backward) reads the copy
    instead of making its own. Same values, and the copy shares no storage, so in-place
    decisions stay safe; the view's memory goes when nothing else holds it."""
    for s in srcs:
        a = env[s]
        if not be.is_contiguous(a):
            c = env[s] = be.contiguous(a)
            if refs is not None:
                refs.drop([a])
                refs.add([c])


def _closure(start, nxt) -> set:
    """`start` and everything reachable from it through `nxt(slot) -> slots`."""
    seen, stack = set(start), list(start)
    while stack:
        for y in nxt(stack.pop()):
            if y not in seen:
                seen.add(y)
                stack.append(y)
    return seen


def _inputs_alias(be, env, prog: _Program) -> bool:
    """Whether the buffer of an input (or constant) that an in-place proof relied on shares
    storage with another input or constant of this run."""
    storage = be.storage
    mine = {storage(env[s]) for s in prog.alias_targets}
    if len(mine) < len(prog.alias_targets):
        return True
    return any(storage(env[s]) in mine for s in prog.alias_inputs)


class _StorageRefs:
    """How many live slots read each storage (by the backend's storage identity)."""

    def __init__(self, backend, env):
        self.backend, self.count = backend, {}
        self.add(b for b in env if b is not None)

    def add(self, bufs):
        for b in bufs:
            k = self.backend.storage(b)
            self.count[k] = self.count.get(k, 0) + 1

    def drop(self, bufs):
        for b in bufs:
            if b is not None:
                self.count[self.backend.storage(b)] -= 1

    def shared(self, buf) -> bool:
        """Whether a live slot other than `buf`'s own reads `buf`'s storage."""
        return self.count.get(self.backend.storage(buf), 0) > 1


def _run_error(st: Step, e: Exception) -> FuelGraphError:
    """The error of a kernel that failed while a plan ran, naming the op and the user's line
    that built it."""
    where = format_site(st.site)
    msg = str(e) if isinstance(e, FuelGraphError) else f"{type(e).__name__}: {e}"
    if not msg.startswith(f"{st.op.name}:"):
        msg = f"{st.op.name}: {msg}"
    tail = (f"built at {where}; " if where else "") + f"kernel {st.name}"
    return FuelGraphError(f"{msg} ({tail})")


def _bind(impl, node: Node, run_body):
    k = impl.kernel
    if isinstance(node.op, ops.Fused):
        kw = dataclasses.asdict(node.op.params) if dataclasses.is_dataclass(node.op.params) else {}
    elif isinstance(node.op, ops.Scan):
        body = node.op.body
        kw = {"op": node.op, "run_body": lambda args: run_body(body, args)}
    else:
        kw = {"op": node.op}
    return functools.partial(k, **kw) if kw else k


def build_plan(outputs: list[Value], backend, backend_name: str, input_order: list[Node],
               view_ops=(), run_body=None, donated=()) -> Plan:
    """Schedule the optimized graph under `outputs` for `backend`; buffers of the Input nodes
    are passed to `Plan.run` in `input_order` (inputs the optimized graph no longer reads are
    ignored). `run_body(body, buffers)` runs a Scan body (the executor's cached body plans).
    `donated`: positions in `input_order` whose buffers destructive ops may overwrite (the
    caller hands them over: optimizer state and parameters updated in place)."""
    nodes = toposort([v.node for v in outputs])
    users = consumers(nodes)
    donated_nodes = {input_order[i] for i in donated}
    order, inplace_ok, extra = _order_destructive(nodes, users, outputs, view_ops,
                                                  donated_nodes)
    order = collectives.schedule(order, extra)      # unchanged when there is no collective
    groups: dict = {}
    accepts = getattr(backend, "groups_product", None)
    if accepts is not None:
        order, groups = _group_products(order, accepts, view_ops)
    in_group = {m for g in groups.values() for m in g[1:]}
    slot_of: dict[tuple[Node, int], int] = {}
    slot_types = []
    for n in order:
        for i in range(n.nout):
            slot_of[(n, i)] = len(slot_types)
            slot_types.append((n.shapes[i], n.dtypes[i]))
    n_slots = len(slot_types)
    last_use: dict[int, int] = {}
    for pos, n in enumerate(order):
        for s in n.srcs:
            last_use[slot_of[(s.node, s.slot)]] = pos
    keep = {slot_of[(v.node, v.slot)] for v in outputs}
    out_nodes = {v.node for v in outputs}
    input_slots, const_slots, steps = [], {}, []
    async_slots: set = set()
    for pos, n in enumerate(order):
        op = n.op
        if isinstance(op, ops.Input):
            continue
        impl = select_kernel(op_identity(op), backend_name, [s.shape for s in n.srcs],
                             [s.dtype for s in n.srcs],
                             op.params if isinstance(op, ops.Fused) else op)
        if impl is None:
            raise FuelGraphError(f"{op.name}: no {backend_name} kernel for dtypes "
                                 f"{[s.dtype.name for s in n.srcs]}")
        fn = _bind(impl, n, run_body)
        _check_size(n, backend, n in out_nodes)
        if not n.srcs and isinstance(op, (ops.Const, ops.Full, ops.Iota)):
            buf = fn()
            if hasattr(buf, "flags"):
                buf.flags.writeable = False  # shared by every run of the plan
            const_slots[slot_of[(n, 0)]] = buf
            continue
        if n in in_group:                   # runs inside its group's step
            continue
        if n in groups:
            steps.append(_group_step(groups[n], backend, slot_of, last_use, pos, keep, impl, fn,
                                     async_slots))
            continue
        srcs = tuple(slot_of[(s.node, s.slot)] for s in n.srcs)
        free = tuple(sorted({s for s in srcs if last_use.get(s) == pos and s not in keep}))
        d = _destructive(n)
        outs = tuple(slot_of[(n, i)] for i in range(n.nout))
        steps.append(Step(op, fn, srcs, outs, free,
                          d, tuple((n, k) not in inplace_ok for k in d),
                          impl.takes_out and len(d) == 1, not impl.strided_input,
                          impl.name or op.name, n.site, impl.asynchronous,
                          tuple(sorted({s for s in srcs if s in async_slots}))))
        if impl.asynchronous:
            async_slots.update(outs)
    input_slots = [slot_of.get((n, 0), -1) for n in input_order]
    check = collectives.agreement_check(collectives.sequence(order)) \
        if collectives.check_enabled() else None
    return Plan(backend, steps, input_slots, const_slots,
                [slot_of[(v.node, v.slot)] for v in outputs], n_slots, slot_types=slot_types,
                prologue=check)


#: how far ahead (nodes of the schedule) a product looks for independent partners, and the
#: largest group. Far: a backward pass schedules the weight gradients last, and pairing each
#: with its layer's input gradient also frees the activations it reads earlier (the training
#: step's measured peak went down, 189 -> 182 MiB)
GROUP_WINDOW = 1024
GROUP_MAX = 4


def _group_products(order: list[Node], accepts, view_ops) -> tuple[list[Node], dict]:
    """Put independent products that the backend runs together (`accepts(node)`: the NumPy
    backend's large 2-D products) next to each other: a product joins an earlier one when all
    its inputs exist by then, possibly through views that are moved up with it (views copy
    nothing). Only moves nodes earlier, past nodes they do not depend on, so the order stays
    topological and every reader of a buffer a destructive op overwrites still runs before it.
    Returns the new order and {leader: [leader, member, ...]} (members follow their leader)."""
    pos = {n: i for i, n in enumerate(order)}
    moved: set = set()
    groups: dict = {}
    before: dict = {}                       # leader -> views moved up to run just before it

    def ready(n, at, chain) -> bool:
        if pos[n] < at or n in moved or not n.srcs:
            return True
        if not isinstance(n.op, view_ops):
            return False
        if all(ready(s.node, at, chain) for s in n.srcs):
            if n not in chain:
                chain.append(n)
            return True
        return False

    for i, n in enumerate(order):
        if n in moved or not accepts(n):
            continue
        members, views = [n], []
        for m in order[i + 1:i + GROUP_WINDOW]:
            if len(members) >= GROUP_MAX:
                break
            if m in moved or not accepts(m):
                continue
            chain: list = []
            if all(ready(s.node, i, chain) for s in m.srcs):
                views += chain
                moved.update(chain)
                members.append(m)
                moved.add(m)
        if len(members) > 1:
            groups[n], before[n] = members, views
    if not groups:
        return order, {}
    out = []
    for n in order:
        if n in moved:
            continue
        if n in groups:
            out += before[n]
            out += groups[n]
        else:
            out.append(n)
    return out, groups


def _group_step(members, backend, slot_of, last_use, pos, keep, impl, fn, async_slots) -> Step:
    """One step running the products `members` (adjacent in the order, the leader at `pos`)
    together through the backend's `run_products`."""
    srcs, outs, parts = [], [], []
    for n in members:
        srcs += [slot_of[(s.node, s.slot)] for s in n.srcs]
        outs += [slot_of[(n, i)] for i in range(n.nout)]
        parts.append((n.op, len(n.srcs)))
    end = pos + len(members) - 1
    free = tuple(sorted({s for s in srcs if pos <= last_use.get(s, -1) <= end and
                         s not in keep}))
    run = backend.run_products
    sizes = [k for _, k in parts]

    def run_group(*args):
        i, pairs = 0, []
        for k in sizes:
            pairs.append(args[i:i + k])
            i += k
        return tuple(run(pairs))
    lead = members[0]
    return Step(lead.op, run_group, tuple(srcs), tuple(outs), free, (), (), False,
                not impl.strided_input, f"{impl.name or lead.op.name}_group", lead.site,
                False, tuple(sorted({s for s in srcs if s in async_slots})), tuple(parts))


# ops whose kernels return views (no allocation of their own)
_NO_ALLOC = (ops.Full, ops.Input, ops.Reshape, ops.Permute, ops.BroadcastTo, ops.Slice,
             ops.Bitcast, ops.Detach)


def _check_size(n: Node, backend, is_output: bool) -> None:
    """Refuse, before anything is allocated, a buffer larger than the device's memory (views
    allocate nothing, unless they are outputs, which are materialized)."""
    if isinstance(n.op, _NO_ALLOC) and not is_output:
        return
    cap = backend.capacity_bytes()
    for shape, d in zip(n.shapes, n.dtypes):
        size = math.prod(shape) * d.itemsize
        if size > cap:
            raise FuelGraphError(f"{n.op.name}: output of shape {shape} {d.name} needs "
                                 f"{size / 2**30:.1f} GiB, more than the {cap / 2**30:.1f} GiB "
                                 f"this device has")


def _destructive(n: Node) -> tuple[int, ...]:
    """Indices of the inputs fused node `n` overwrites (only those the node has: optional
    inputs may be absent)."""
    if not isinstance(n.op, ops.Fused):
        return ()
    return tuple(k for k in default_registry().entry(n.op.id).destructive_inputs
                 if k < len(n.srcs))


def _order_destructive(nodes, users, outputs, view_ops, donated=frozenset()) \
        -> tuple[list[Node], set]:
    """Topological order in which every destructive op runs after all other readers of the
    buffer it overwrites (and of views aliasing it). Where that is impossible (the value is a
    leaf that was not donated, a graph output, or read after the op by something that depends
    on it) the op is marked to copy that input instead. Returns the order, the set of
    (node, input index) pairs that may overwrite and the ordering edges it added (node ->
    nodes that must run before it)."""
    extra: dict[Node, set] = {}
    before: dict[Node, set] = {}                # reader -> destructive ops ordered after it
    ok: set = set()
    out_nodes = {v.node for v in outputs}
    for n in nodes:
        for k in _destructive(n):
            root = n.srcs[k].node
            group = {root}
            while isinstance(root.op, view_ops):    # walk up to the owner of the storage
                root = root.srcs[0].node
                group.add(root)
            if not root.srcs and root not in donated:
                continue                            # a leaf (constant, input) nobody handed over
            stack = list(group)                     # every view derived from the owner (or from
            while stack:                            # a view between it and n) aliases it
                for u in users.get(id(stack.pop()), ()):
                    if isinstance(u.op, view_ops) and u not in group:
                        group.add(u)
                        stack.append(u)
            # a graph output that is the value or any view of it (e.g. x.reshape(-1)) needs the
            # old contents after the run
            if any(g in out_nodes or (isinstance(g.op, ops.Input) and g not in donated)
                   for g in group):
                continue
            readers = {u for g in group for u in users.get(id(g), ())
                       if u is not n and u not in group}
            # readers that must come after n, through data or through the ordering edges
            # granted so far (another destructive op on the same buffer, or on a buffer n's
            # readers feed)
            if readers and readers & _descendants(n, users, before):
                continue
            # the same buffer passed twice to n (as another input) is a reader inside n
            if any(j != k and s.node in group for j, s in enumerate(n.srcs)):
                continue
            extra.setdefault(n, set()).update(readers)
            for r in readers:
                before.setdefault(r, set()).add(n)
            ok.add((n, k))
    return (_toposort_with(nodes, extra) if extra else nodes), ok, extra


def _descendants(n: Node, users, before=None) -> set:
    """Nodes that run after `n`: its data descendants, following the ordering edges `before`
    (node -> nodes ordered after it) too."""
    out, stack = set(), [n]
    while stack:
        m = stack.pop()
        for u in list(users.get(id(m), ())) + list((before or {}).get(m, ())):
            if u not in out:
                out.add(u)
                stack.append(u)
    return out


def _toposort_with(nodes: list[Node], extra: dict[Node, set]) -> list[Node]:
    """Kahn's algorithm over src edges plus `extra` (node -> nodes that must run first),
    keeping the original relative order where free."""
    pos = {n: i for i, n in enumerate(nodes)}
    deps = {n: {s.node for s in n.srcs} | extra.get(n, set()) for n in nodes}
    rev: dict[Node, list] = {n: [] for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            rev[d].append(n)
    indeg = {n: len(ds) for n, ds in deps.items()}
    ready = [(pos[n], n.uid, n) for n in nodes if indeg[n] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, _, n = heapq.heappop(ready)
        out.append(n)
        for u in rev[n]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (pos[u], u.uid, u))
    if len(out) != len(nodes):
        raise FuelGraphError("ordering: destructive-input constraints form a cycle")
    return out
