"""Patterns derived from recipes. A pattern is the canonicalized DAG of an op's recipe traced on
placeholder inputs: placeholders are captures, Full nodes carrying a sentinel are parameter
slots. Matching is structural (op kinds, shared sub-terms bind once, commutative operands in
either order, shape-only Reshape/BroadcastTo may be skipped on either side); every match is
then re-checked exactly by re-tracing the recipe on the captured inputs with the recovered
params: the canonical result must be the very same (hash-consed) node. So lowering and fusion
cannot drift, and constants and shapes are always checked."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..dtype import round_scalar
from ..errors import FuelGraphError
from ..ir import ops
from ..ir.node import Node, Value, toposort
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


@dataclass
class Match:
    captures: list[Value]
    params: dict
    interior: set = field(default_factory=set)


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
        traced = trace_recipe(recipe, entry.sample, params)
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
        size = sum(1 for n in toposort([root]) if n not in holes and n.srcs)
        pats.append(Pattern(f"{entry.name}#{k}", root, [p.node for p in traced.inputs], slots,
                            fixed_all, recipe, _op_sig(root.node.op), size))
    return pats


class _Matcher:
    def __init__(self, pat: Pattern):
        self.pat = pat
        self.bind: dict[Node, Value] = {}
        self.params: dict = {}
        self.param_dtypes: dict = {}
        self.count = 0
        self.reason = ""

    def match(self, p: Value, g: Value) -> bool:
        pn, gn = p.node, g.node
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
        if pn in self.pat.placeholders:
            self.bind[pn] = g
            return True
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
        if _op_sig(pn.op) != _op_sig(gn.op) or p.slot != g.slot or len(pn.srcs) != len(gn.srcs):
            if isinstance(pn.op, _MATCH_SKIPPABLE):
                return self.match(pn.srcs[0], g)
            if isinstance(gn.op, _MATCH_SKIPPABLE):
                return self.match(p, gn.srcs[0])
            self.reason = f"expected {pn.op.name} at %{gn.uid}, found {gn.op.name}"
            return False
        self.count += 1
        saved = (dict(self.bind), dict(self.params), self.count)
        if self._srcs(pn.srcs, gn.srcs):
            self.bind[pn] = g
            return True
        kind = getattr(pn.op, "kind", None)
        if kind in _COMMUTATIVE and len(pn.srcs) == 2:
            why = self.reason
            self.bind, self.params, self.count = dict(saved[0]), dict(saved[1]), saved[2]
            if self._srcs(pn.srcs[::-1], gn.srcs):
                self.bind[pn] = g
                return True
            self.reason = why
        return False

    def _srcs(self, ps, gs) -> bool:
        return all(self.match(p, g) for p, g in zip(ps, gs))


def try_match(pat: Pattern, entry, root: Value, users: dict) -> "Match | Miss":
    """Match `pat` at `root`; on success the recipe is re-traced on the captures to verify."""
    m = _Matcher(pat)
    if not m.match(pat.root, root):
        return Miss(entry.name, repr(root), m.count, m.reason)
    caps = [m.bind.get(p) for p in pat.placeholders]
    if any(c is None for c in caps):
        return Miss(entry.name, repr(root), m.count, "recipe input not reached by the match")
    cap_nodes = {c.node for c in caps}
    interior = _region(root.node, cap_nodes)
    for n in interior:
        outside = [u for u in users.get(id(n), ()) if u not in interior and u is not root.node]
        if outside and not _view_of_captures(n, cap_nodes):
            return Miss(entry.name, repr(root), m.count,
                        f"intermediate %{n.uid} ({n.op.name}) has another consumer "
                        f"(%{outside[0].uid}); fusing would duplicate it")
    params = {**pat.fixed, **m.params}
    try:
        if entry.read_params is not None:
            try:
                params.update(entry.read_params(Bound(pat, m.bind, root)) or {})
            except (LookupError, ValueError, TypeError, AttributeError) as e:
                return Miss(entry.name, repr(root), m.count, f"params not readable here: {e!r}")
        p = entry.params(**params)
        entry.validate(caps, p)
        out = pat.recipe(*(Tensor(c) for c in caps), **dataclasses.asdict(p))
    except FuelGraphError as e:
        return Miss(entry.name, repr(root), m.count, f"captured inputs rejected: {e}")
    out = out[0] if isinstance(out, (tuple, list)) else out
    # the graph is canonical already: stop at the captures (a fresh walk below them would
    # make fusing a chain of n idioms cost O(n^2))
    memo = {c.node: tuple(c.node.out(i) for i in range(c.node.nout)) for c in caps}
    got = run_pass([out.value], CANONICALIZE, memo=memo)[0]
    if got != root:
        return Miss(entry.name, repr(root), m.count,
                    "structure matched but the recipe re-traced on the captured inputs differs "
                    f"(a constant, axis or shape does not fit: {_first_difference(got, root)})")
    # the fused op must compute with the constants the graph holds: a float param read off a
    # 16-bit constant is that constant's rounded value (70000.0 in float16 is inf; the
    # kernels narrow params to float32 themselves)
    for name, d in m.param_dtypes.items():
        v = params.get(name)
        if isinstance(v, float) and d.is_float and d.itemsize < 4:
            params[name] = round_scalar(v, d)
    return Match(caps, params, interior)


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
