"""Patterns derived from recipes. A pattern is the canonicalized DAG of an op's recipe traced on
placeholder inputs: placeholders are captures, Full nodes carrying a sentinel are parameter
slots. Matching is structural (op kinds, shared sub-terms bind once, commutative operands in
either order, shape-only Reshape/BroadcastTo may be skipped on either side); every match is
then re-checked exactly by re-tracing the recipe on the captured inputs with the recovered
params: the canonical result must be the very same (hash-consed) node. So lowering and fusion
cannot drift, and constants and shapes are always checked."""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from ..dtype import round_scalar
from ..errors import FuelGraphError
from ..ir import ops
from ..ir.node import Node, Value, apply, make_node, structural_key, toposort
from ..ir.tensor import Tensor
from ..registry.core import FusedOpRegistry, Traced
from ..registry.core import trace_recipe as trace_raw
from .canonicalize import CANONICALIZE
from .canonicalize import COMMUTATIVE as _COMMUTATIVE
from .engine import run_pass

_SKIPPABLE = (ops.Reshape, ops.BroadcastTo)
# the structural matcher may also step over casts (e.g. the float32 accumulation a 16-bit mean
# inserts); the exact re-trace check decides whether they belong to the recipe
_MATCH_SKIPPABLE = _SKIPPABLE + (ops.Cast,)


@dataclass
class Pattern:
    """One derived pattern: `root` (a value of the traced recipe DAG), `placeholders` in input
    order, `slots` {pattern Full node: param name}, `fixed` discrete params of this variant."""
    name: str
    root: Value
    placeholders: list[Node]
    slots: dict
    fixed: dict
    recipe: object
    root_key: tuple = ()
    size: int = 0          # operation nodes in the pattern: larger patterns are tried first
    kinds: int = 0         # distinct op kinds among them
    scans: bool = False    # holds a Scan: re-traced, its body has other placeholders


@dataclass
class Match:
    """`extras`: {output slot >= 1 of the fused op: the graph value it replaces}, for recipes
    with several outputs whose later outputs the graph also reads (a scan's last state)."""
    captures: list[Value]
    params: dict
    interior: set = field(default_factory=set)
    extras: dict = field(default_factory=dict)


@dataclass
class Bound:
    """A structural match before its params are verified: `bind` maps pattern nodes to the
    graph values they matched. Entries' `read_params(bound)` read discrete params from it."""
    pattern: "Pattern"
    bind: dict
    root: Value

    def nodes_of(self, op_type) -> list[Node]:
        """Graph nodes bound to the pattern's nodes of `op_type`, in pattern (topological)
        order."""
        order = toposort([self.pattern.root])
        return [self.bind[p].node for p in order
                if isinstance(p.op, op_type) and p in self.bind and p not in self.pattern.placeholders]

    def capture(self, i: int) -> Value:
        """The graph value bound to the recipe's i-th input."""
        return self.bind[self.pattern.placeholders[i]]


@dataclass
class Miss:
    """A failed attempt: how many pattern nodes matched before `reason`."""
    op: str
    node: str
    matched: int
    reason: str
    more: bool = False     # other input candidates are left to verify (try_match's `tries`)
    size: int = 0          # operation nodes in the pattern tried
    kinds: int = 0         # distinct op kinds among the matched nodes
    pattern_kinds: int = 0  # ... and among the pattern's


def trace_recipe(recipe, sample, params=None) -> Traced:
    """Trace `recipe` on fresh placeholder inputs shaped like `sample(rng)`; canonicalized."""
    t = trace_raw(recipe, sample, params)
    return Traced(t.inputs, run_pass(t.outputs, CANONICALIZE))


_PATTERNS: dict[int, list] = {}


def reject_degenerate(entry) -> None:
    """Registry validator: a recipe that canonicalizes to one of its own inputs (e.g.
    `-(-t)`) would match every value of every graph; refuse it with a clear error."""
    if not entry.has_pattern:
        return
    for p in derive_patterns(entry):
        if p.size == 0 or p.root.node in p.placeholders:
            raise FuelGraphError(f"registry.register({entry.name!r}): the recipe reduces to one of "
                                 f"its inputs after canonicalization (nothing to fuse)")


FusedOpRegistry.validators.append(reject_degenerate)


def patterns_of(entry) -> list:
    """Patterns derived from `entry`'s recipe (and extra spellings); built once, cached."""
    pats = _PATTERNS.get(int(entry.id))
    if pats is None:
        pats = _PATTERNS[int(entry.id)] = derive_patterns(entry)
    return pats


def _sentinel(i: int) -> float:
    return 1.2345678e-3 + i * 1.1e-5


def _int_sentinel(i: int) -> int:
    return -987_654_321 - i


_FLOAT_TYPES = (float, "float")
_INT_TYPES = (int, "int", "int | None")


def _op_sig(op):
    return (type(op), getattr(op, "kind", None))


def derive_patterns(entry) -> list[Pattern]:
    """Patterns of `entry`: one per pattern variant of its recipe, plus its extra spellings."""
    pats = []
    fields = [f for f in dataclasses.fields(entry.params)]
    recipes = ([(entry.decompose, v) for v in (entry.pattern_variants or ())] +
               [(r, {}) if callable(r) else (r[0], dict(r[1])) for r in entry.extra_patterns])
    for k, (recipe, fixed) in enumerate(recipes):
        params, sentinels = {}, {}
        for i, f in enumerate(fields):
            if f.name in fixed:
                params[f.name] = fixed[f.name]
            elif f.type in _FLOAT_TYPES:
                params[f.name] = sentinels[f.name] = _sentinel(i)
            elif f.type in _INT_TYPES:     # an int constant of the graph (e.g. ignore_index)
                params[f.name] = sentinels[f.name] = _int_sentinel(i)
            elif f.default is not dataclasses.MISSING:
                params[f.name] = f.default
            else:
                raise FuelGraphError(f"{entry.name}: cannot derive a pattern; param {f.name} "
                                     f"needs a value in pattern_variants")
        # a spelling may bring its own sample (e.g. one per GGUF format: block sizes differ)
        traced = trace_recipe(recipe, getattr(recipe, "sample", entry.sample), params)
        slots = {}
        for n in toposort(traced.outputs):
            if isinstance(n.op, ops.Full):
                for name, s in sentinels.items():
                    if n.op.value == s:
                        slots[n] = name
        missing = set(sentinels) - set(slots.values())
        if missing:
            raise FuelGraphError(f"{entry.name}: params {sorted(missing)} do not appear as "
                                 f"constants in the recipe; cannot derive its pattern")
        fixed_all = {k2: v for k2, v in params.items() if k2 not in sentinels}
        root = traced.outputs[0]
        holes = {p.node for p in traced.inputs}
        body = [n for n in toposort([root]) if n not in holes and n.srcs]
        pats.append(Pattern(f"{entry.name}#{k}", root, [p.node for p in traced.inputs], slots,
                            fixed_all, recipe, _op_sig(root.node.op), len(body),
                            len({_op_sig(n.op) for n in body}),
                            any(isinstance(n.op, ops.Scan) for n in body)))
    return pats


class _Matcher:
    def __init__(self, pat: Pattern):
        self.pat = pat
        self.bind: dict[Node, Value] = {}
        self.params: dict = {}
        self.param_dtypes: dict = {}
        self.count = 0
        self.sigs: set = set()
        self.reason = ""
        # recipe input -> graph values it may stand for, preferred first (see _alternatives)
        self.cands: dict[Node, list[Value]] = {}

    def match(self, p: Value, g: Value, chain: tuple = ()) -> bool:
        """Match pattern value `p` against graph value `g`. `chain` lists the pattern's
        shape-only nodes just above `p` with the graph values they met (outermost first)."""
        pn, gn = p.node, g.node
        if pn in self.pat.placeholders:
            return self._bind_input(pn, g, chain)
        if pn in self.bind:
            if self.bind[pn] == g:
                return True
            old = self.bind[pn].node.op
            if isinstance(old, ops.Full) and isinstance(gn.op, ops.Full):
                self.reason = (f"the recipe uses one constant in two places, the graph has "
                               f"{old.value!r} and {gn.op.value!r} (%{gn.uid})")
            else:
                self.reason = f"shared term {pn.op!r} binds two different values"
            return False
        if isinstance(pn.op, ops.Full):
            if not isinstance(gn.op, ops.Full):
                if isinstance(gn.op, _MATCH_SKIPPABLE):
                    return self.match(p, gn.srcs[0])
                self.reason = f"expected a constant at %{gn.uid}, found {gn.op.name}"
                return False
            if pn in self.pat.slots:
                name = self.pat.slots[pn]
                if name in self.params and self.params[name] != gn.op.value:
                    self.reason = f"param {name} has two values"
                    return False
                self.params[name] = gn.op.value
                self.param_dtypes[name] = gn.op.dtype
            self.bind[pn] = g
            self.count += 1
            return True
        below = chain + ((pn, g),) if isinstance(pn.op, _SKIPPABLE) else ()
        if _op_sig(pn.op) != _op_sig(gn.op) or p.slot != g.slot or len(pn.srcs) != len(gn.srcs):
            if isinstance(pn.op, _MATCH_SKIPPABLE):
                return self.match(pn.srcs[0], g, below)
            if isinstance(gn.op, _MATCH_SKIPPABLE):
                return self.match(p, gn.srcs[0], chain)
            self.reason = f"expected {pn.op.name} at %{gn.uid}, found {gn.op.name}"
            return False
        self.count += 1
        self.sigs.add(_op_sig(pn.op))
        saved = (dict(self.bind), dict(self.params), self.count, dict(self.cands), set(self.sigs))
        if self._srcs(pn.srcs, gn.srcs, below):
            self.bind[pn] = g
            return True
        kind = getattr(pn.op, "kind", None)
        if kind in _COMMUTATIVE and len(pn.srcs) == 2:
            why = self.reason
            self.bind, self.params, self.count = dict(saved[0]), dict(saved[1]), saved[2]
            self.cands, self.sigs = dict(saved[3]), saved[4]
            if self._srcs(pn.srcs[::-1], gn.srcs, below):
                self.bind[pn] = g
                return True
            self.reason = why
        return False

    def _srcs(self, ps, gs, chain=()) -> bool:
        return all(self.match(p, g, chain) for p, g in zip(ps, gs))

    def _bind_input(self, pn: Node, g: Value, chain: tuple) -> bool:
        """A recipe input reached again must stand for one value: keep the candidates that
        every reach allows."""
        alts = _alternatives(g, chain)
        have = self.cands.get(pn)
        keep = alts if have is None else [c for c in have if c in alts]
        if not keep:
            i = self.pat.placeholders.index(pn)
            self.reason = (f"recipe input {i} binds two different values (%{have[0].node.uid} "
                           f"and %{g.node.uid})")
            return False
        self.cands[pn] = keep
        self.bind[pn] = keep[0]
        return True


def _alternatives(g: Value, chain: tuple) -> list[Value]:
    """The graph values a recipe input reached through the recipe's own reshapes/broadcasts
    (`chain`, outermost first) may stand for, preferred first: the value the structural match
    reached (`g`); the value the recipe's squeeze/unsqueeze would turn into what the graph has
    there (e.g. targets `[N]` when the graph holds `labels[:, 1:].reshape(-1, 1)` where the
    recipe says `t.unsqueeze(-1)`); then the graph values along the chain, inside out, except
    broadcast outputs (e.g. a `[B, 1, S, D]` table that the recipe broadcasts itself).
    Verification picks the first combination that re-traces to the graph, so a wrong candidate
    is never used."""
    out = [g]
    for pn, gv in reversed(chain):
        if isinstance(pn.op, ops.Reshape):
            s = _undo_unit_reshape(pn.srcs[0].shape, pn.shapes[0], gv.shape)
            if s is not None:
                out.append(_reshaped(gv, s))
    # never a broadcast's output: the op would read a materialized broadcast
    out += [gv for _, gv in reversed(chain) if not isinstance(gv.node.op, ops.BroadcastTo)]
    seen, uniq = set(), []
    for v in out:
        if v not in seen:
            seen.add(v)
            uniq.append(v)
    return uniq


def _unit_edit(a: tuple, b: tuple):
    """Positions (from the right, negative) of the extent-1 axes that a reshape a -> b inserts
    (len(b) > len(a)), aligning the other axes from the right; None when it does more."""
    i, j, pos = len(a) - 1, len(b) - 1, []
    while j >= 0:
        if i >= 0 and a[i] == b[j]:
            i -= 1
        elif b[j] == 1:
            pos.append(j - len(b))
        else:
            return None
        j -= 1
    return pos if i < 0 else None


def _undo_unit_reshape(p_in: tuple, p_out: tuple, g_out: tuple):
    """The shape the graph value would have before the recipe's squeeze/unsqueeze p_in ->
    p_out (positions counted from the right, as recipes write them: `t.unsqueeze(-1)`), given
    the graph's shape g_out after it; None when the reshape is not one or does not fit."""
    if len(p_out) > len(p_in):                       # unsqueeze: drop the inserted axes
        pos = _unit_edit(p_in, p_out)
        if pos is None or any(-k > len(g_out) or g_out[k] != 1 for k in pos):
            return None
        drop = {len(g_out) + k for k in pos}
        return tuple(d for k, d in enumerate(g_out) if k not in drop)
    if len(p_out) < len(p_in):                       # squeeze: put the removed axes back
        pos = _unit_edit(p_out, p_in)
        if pos is None:
            return None
        rank = len(g_out) + len(pos)
        put = {rank + k for k in pos}
        if any(k < 0 for k in put):
            return None
        it = iter(g_out)
        return tuple(1 if k in put else next(it) for k in range(rank))
    return None


def _reshaped(v: Value, shape: tuple) -> Value:
    """v reshaped to `shape`, in canonical form (no reshape of a reshape)."""
    while isinstance(v.node.op, ops.Reshape):
        v = v.node.srcs[0]
    return v if v.shape == shape else apply(ops.Reshape(tuple(shape)), v)


_MAX_TRIES = 16     # combinations of input candidates verified per structural match


def try_match(pat: Pattern, entry, root: Value, users: dict, memo: dict | None = None,
              tries: tuple[int, int] = (0, _MAX_TRIES), pos: dict | None = None) -> "Match | Miss":
    """Match `pat` at `root` (see `_try_match`); a miss records how many kinds of op the
    partial match covered, so `explain` can tell a near miss from a reshape over a matrix
    product that many patterns share. `pos`: node -> position in a topological order of the
    graph; without it, the later outputs of a multi-output recipe are never taken over."""
    m = _Matcher(pat)
    r = _try_match(m, pat, entry, root, users, memo, tries, pos)
    if isinstance(r, Miss):
        r.kinds, r.pattern_kinds = len(m.sigs), pat.kinds
    return r


def _try_match(m, pat: Pattern, entry, root: Value, users: dict, memo: dict | None = None,
              tries: tuple[int, int] = (0, _MAX_TRIES), pos: dict | None = None) -> "Match | Miss":
    """Match `pat` at `root`; the recipe is re-traced on the captures to verify, for the
    combinations of input candidates numbered tries[0] .. tries[1] - 1 (0: the preferred one).
    `memo`: a canonicalization memo holding the (canonical) graph, so a re-trace stops at its
    inputs."""
    if not m.match(pat.root, root):
        return Miss(entry.name, repr(root), m.count, m.reason)
    if any(p not in m.cands for p in pat.placeholders):
        return Miss(entry.name, repr(root), m.count, "recipe input not reached by the match")
    combos = math.prod(len(m.cands[p]) for p in pat.placeholders)
    first = None
    for caps in itertools.islice(itertools.product(*(m.cands[p] for p in pat.placeholders)),
                                 *tries):
        got = _verify(pat, entry, m, list(caps), root, memo)
        if isinstance(got, str):
            first = first or got
            continue
        params, outs = got
        return _check_region(entry, m, list(caps), params, root, users, outs[1:], pos)
    return Miss(entry.name, repr(root), m.count, first or "no candidate inputs left",
                more=min(combos, _MAX_TRIES) > tries[1])


def _verify(pat: Pattern, entry, m: _Matcher, caps: list, root: Value, memo: dict | None):
    """(params, the re-traced outputs) when the recipe re-traced on `caps` is the graph at
    `root`, else why not."""
    bind = {**m.bind, **dict(zip(pat.placeholders, caps))}
    params = {**pat.fixed, **m.params}
    try:
        if entry.read_params is not None:
            try:
                params.update(entry.read_params(Bound(pat, bind, root)) or {})
            except (LookupError, ValueError, TypeError, AttributeError) as e:
                return f"params not readable here: {e!r}"
        p = entry.params(**params)
        entry.validate(caps, p)
        out = pat.recipe(*(Tensor(c) for c in caps), **dataclasses.asdict(p))
    except FuelGraphError as e:
        return f"captured inputs rejected: {e}"
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    # the graph is canonical already: stop at it (a fresh walk below the captures would make
    # fusing a chain of n idioms cost O(n^2)); fuse passes a memo of the whole graph
    if memo is None:
        memo = {c.node: tuple(c.node.out(i) for i in range(c.node.nout)) for c in caps}
    outs = run_pass([o.value for o in outs], CANONICALIZE, memo=memo)
    got = outs[0]
    if got != root and pat.scans:
        corr = _same_up_to_bodies(got, root)
        if corr is not None:        # a scan traced again has fresh body placeholders
            outs = [_translate(v, corr) for v in outs]
            got = outs[0]
    if got != root:
        return ("structure matched but the recipe re-traced on the captured inputs differs "
                f"(a constant, axis or shape does not fit: {_first_difference(got, root)})")
    # the fused op must compute with the constants the graph holds: a float param read off a
    # 16-bit constant is that constant's rounded value (70000.0 in float16 is inf; the
    # kernels narrow params to float32 themselves)
    for name, d in m.param_dtypes.items():
        v = params.get(name)
        if isinstance(v, float) and d.is_float and d.itemsize < 4:
            params[name] = round_scalar(v, d)
    return params, outs


def _same_scan(a, b) -> bool:
    """Two Scan ops equal up to the names of their body's placeholders."""
    if not (isinstance(a, ops.Scan) and isinstance(b, ops.Scan)) or \
            (a.n_carry, a.n_xs, a.length, a.reverse) != (b.n_carry, b.n_xs, b.length, b.reverse):
        return False
    key = lambda body: structural_key(body.outputs, order_inputs=body.inputs)   # noqa: E731
    return len(a.body.inputs) == len(b.body.inputs) and key(a.body) == key(b.body)


def _same_up_to_bodies(got: Value, root: Value) -> dict | None:
    """{re-traced node: graph node} when the re-traced recipe `got` is the graph at `root` but
    for scan bodies traced apart (the same sub-graph over other placeholders; commutative
    operands may then be ordered the other way); else None."""
    corr: dict = {}
    return corr if _pair(got, root, corr) else None


def _pair(a: Value, b: Value, corr: dict) -> bool:
    if a == b:
        return True
    if a.slot != b.slot or len(a.node.srcs) != len(b.node.srcs):
        return False
    if a.node in corr:
        return corr[a.node] is b.node
    if a.node.op != b.node.op and not _same_scan(a.node.op, b.node.op):
        return False
    corr[a.node] = b.node
    saved = dict(corr)
    if all(_pair(x, y, corr) for x, y in zip(a.node.srcs, b.node.srcs)):
        return True
    if getattr(a.node.op, "kind", None) in _COMMUTATIVE and len(a.node.srcs) == 2:
        corr.clear()
        corr.update(saved)
        if all(_pair(x, y, corr) for x, y in zip(a.node.srcs[::-1], b.node.srcs)):
            return True
    corr.clear()
    corr.update(saved)
    del corr[a.node]
    return False


def _translate(v: Value, corr: dict) -> Value:
    """A re-traced value in terms of the graph's nodes (`corr`), rebuilt above them."""
    if v.node in corr:
        return Value(corr[v.node], v.slot)
    if not v.node.srcs:
        return v
    srcs = tuple(_translate(s, corr) for s in v.node.srcs)
    n = v.node if srcs == v.node.srcs else make_node(v.node.op, srcs)
    corr[v.node] = n
    return Value(n, v.slot)


def _check_region(entry, m: _Matcher, caps: list, params: dict, root: Value, users: dict,
                  others: list = (), pos: dict | None = None):
    """The match, unless fusing would duplicate work another consumer reads. `others`: the
    recipe's later outputs re-traced on the captures; those the graph reads (with `pos`, and
    when no capture depends on them) become outputs of the fused node instead."""
    stop = set()
    for c in caps:                  # a capture may be a reshape the graph reaches directly
        stop.add(c.node)
        while isinstance(c.node.op, ops.Reshape):
            c = c.node.srcs[0]
            stop.add(c.node)
    interior = _region(root.node, stop)
    extras = _read_outputs(others, root, users, stop, pos) if pos is not None else {}
    for v in extras.values():
        if v.node is not root.node:
            interior.add(v.node)
            interior |= _region(v.node, stop)
    replaced = set(extras.values())
    limit = max((math.prod(c.shape) for c in caps), default=0)
    for n in interior:
        outside = [u for u in users.get(id(n), ()) if u not in interior and u is not root.node
                   and not _reads_only(u, n, replaced)]
        if outside and not _view_of_captures(n, stop) and not _cheap_copy(n, stop, limit):
            return Miss(entry.name, repr(root), m.count,
                        f"intermediate %{n.uid} ({n.op.name}) has another consumer "
                        f"(%{outside[0].uid}); fusing would duplicate it")
    return Match(caps, params, interior, extras)


def _reads_only(u, n: Node, replaced: set) -> bool:
    """Whether consumer `u` reads node `n` only through outputs the fused node takes over."""
    srcs = getattr(u, "srcs", None)
    return bool(replaced) and srcs is not None and all(s in replaced for s in srcs
                                                       if s.node is n)


def _read_outputs(others: list, root: Value, users: dict, stop: set, pos: dict) -> dict:
    """{slot: value} of the recipe's later outputs (slot 1, 2, ...) that the graph reads,
    leaving out any a captured input depends on (the fused node would feed itself)."""
    out = {}
    for slot, v in enumerate(others, 1):
        n = v.node
        if n not in pos or v == root or n in stop or not any(
                v in getattr(u, "srcs", ()) for u in users.get(id(n), ())):
            continue
        if not _feeds(n, stop, pos):
            out[slot] = v
    return out


def _feeds(target: Node, starts: set, pos: dict) -> bool:
    """Whether any node of `starts` depends on `target` (`pos`: topological positions, sources
    first, so nodes placed before `target` are not searched)."""
    lim = pos[target]
    stack, seen = [n for n in starts if pos.get(n, -1) > lim], set()
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(s.node for s in n.srcs if pos.get(s.node, -1) >= lim)
    return False


_ELEMENTWISE = (ops.Unary, ops.Binary, ops.Compare, ops.Where, ops.Cast, ops.Reshape,
                ops.BroadcastTo, ops.Permute, ops.Slice)


def _cheap_copy(n: Node, stop: set, limit: int) -> bool:
    """True when `n` is elementwise/movement work over captured inputs and constants only, on
    at most half as many elements as the largest input (e.g. the `targets != ignore_index`
    mask that a loss spelling also counts): the fused op recomputes it for next to nothing,
    so another reader may keep its own copy."""
    stack, seen = [n], set()
    while stack:
        k = stack.pop()
        if k in seen or k in stop or not k.srcs:
            continue
        seen.add(k)
        if not isinstance(k.op, _ELEMENTWISE) or 2 * math.prod(k.shapes[0]) > limit:
            return False
        stack.extend(s.node for s in k.srcs)
    return True


def _first_difference(want: Value, got: Value) -> str:
    """The first node (depth first) where the re-traced recipe `want` and the graph `got` part."""
    stack, seen = [(want, got)], set()
    while stack:
        a, b = stack.pop()
        if a == b or (a, b) in seen:
            continue
        seen.add((a, b))
        if a.node.op != b.node.op or a.slot != b.slot or len(a.node.srcs) != len(b.node.srcs):
            return f"the recipe has {a.node.op!r} where the graph has {b.node.op!r} (%{b.node.uid})"
        stack.extend(reversed(list(zip(a.node.srcs, b.node.srcs))))
    return "different structure"


def _view_of_captures(n: Node, caps: set) -> bool:
    """True when `n` is a chain of shape-only ops (Reshape/BroadcastTo) over captured inputs or
    constants: another consumer may keep it without duplicating any computation (e.g. one
    broadcast cos table read by the RoPE of q and of k)."""
    while isinstance(n.op, _SKIPPABLE):
        n = n.srcs[0].node
        if n in caps or not n.srcs:
            return True
    return False


def _region(root: Node, stop: set) -> set:
    """Non-constant nodes strictly between `root` and the capture nodes `stop`."""
    out, stack = set(), [s.node for s in root.srcs]
    while stack:
        n = stack.pop()
        if n in stop or n in out or not n.srcs:
            continue
        out.add(n)
        stack.extend(s.node for s in n.srcs)
    return out
