"""One rewrite engine for every pass, with rules as data (in the manner of tinygrad's
PatternMatcher): a `Rule` is a name, a `Pat` (a small tree describing the nodes it applies to)
and a rewrite function of the pattern's named bindings. A `Pass` indexes its rules by the op
type (and kind) at the pattern's root, so each node only tries the rules that can apply to it.
`run_pass` applies a pass bottom-up to a fixpoint in one walk and logs which rules fired."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..ir import ops
from ..ir.node import Node, Value, make_node
from ..registry.core import fused_node


class Pat:
    """A pattern over graph values (data, not code).

    op: an op class or a tuple of them (None: any op); kind: an op kind or a tuple of kinds
    (matched against `op.kind`); src: one pattern per source, in order (None: sources are not
    looked at); name: bind the matched Value under this name (a name used twice must bind the
    same value); commutative: for two sources, also try them swapped."""
    __slots__ = ("ops", "kinds", "src", "name", "commutative")

    def __init__(self, op=None, kind=None, src=None, name=None, commutative=False):
        self.ops = op if op is None or isinstance(op, tuple) else (op,)
        self.kinds = (kind,) if isinstance(kind, str) else kind
        self.src = None if src is None else tuple(src)
        self.name = name
        self.commutative = commutative

    @staticmethod
    def var(name: str) -> "Pat":
        """Any value."""
        return Pat(name=name)

    @staticmethod
    def const(name: str) -> "Pat":
        """A constant filled with one scalar (a Full node); the rule reads `.op.value`."""
        return Pat(ops.Full, name=name)

    def match(self, v: Value, env: dict) -> bool:
        n = v.node
        if self.ops is not None and not isinstance(n.op, self.ops):
            return False
        if self.kinds is not None and getattr(n.op, "kind", None) not in self.kinds:
            return False
        if self.name is not None:
            if self.name in env and env[self.name] != v:
                return False
            env[self.name] = v
        if self.src is None:
            return True
        if len(self.src) != len(n.srcs):
            return False
        orders = (n.srcs, n.srcs[::-1]) if self.commutative and len(n.srcs) == 2 else (n.srcs,)
        for srcs in orders:
            trial = dict(env)
            if all(p.match(s, trial) for p, s in zip(self.src, srcs)):
                env.update(trial)
                return True
        return False

    def __repr__(self) -> str:
        what = "|".join(t.__name__ for t in self.ops) if self.ops else "any"
        if self.kinds:
            what += ":" + "|".join(self.kinds)
        inner = "" if self.src is None else "(" + ", ".join(map(repr, self.src)) + ")"
        return f"{what}{inner}" + (f" as {self.name}" if self.name else "")


@dataclass(frozen=True)
class Rule:
    """`fn(**bindings)` returns the replacement (a Value, or one per output slot) or None to
    decline. The root pattern is matched against output 0 of the node."""
    name: str
    pat: Pat
    fn: Callable

    def apply(self, n: Node):
        env: dict = {}
        if not self.pat.match(Value(n, 0), env):
            return None
        return self.fn(**env)


class Pass:
    """A named list of rules; at each node the first rule that returns a replacement wins."""

    def __init__(self, name: str, rules: Sequence[Rule]):
        self.name = name
        self.rules = list(rules)
        names = [r.name for r in self.rules]
        if len(set(names)) != len(names):
            raise ValueError(f"pass {name}: rule names must be unique, got {names}")
        self._index: dict = {}

    def rules_for(self, op) -> list[Rule]:
        key = (type(op), getattr(op, "kind", None))
        got = self._index.get(key)
        if got is None:
            got = self._index[key] = [
                r for r in self.rules
                if (r.pat.ops is None or isinstance(op, r.pat.ops))
                and (r.pat.kinds is None or key[1] in r.pat.kinds)]
        return got


@dataclass
class RewriteLog:
    """Every rewrite that fired: (pass, rule, node repr)."""
    events: list[tuple[str, str, str]] = field(default_factory=list)

    def count(self, rule: str) -> int:
        return sum(1 for _, r, _ in self.events if r == rule)

    def counts(self, pass_name: str) -> dict[str, int]:
        """{rule name: times it fired} for one pass."""
        out: dict[str, int] = {}
        for p, r, _ in self.events:
            if p == pass_name:
                out[r] = out.get(r, 0) + 1
        return out


def rebuild(node: Node, srcs: tuple[Value, ...]) -> Node:
    """`node`'s op applied to new sources (the same node when they are unchanged)."""
    if srcs == node.srcs:
        return node
    if isinstance(node.op, ops.Fused):
        return fused_node(node.op, srcs)
    return make_node(node.op, srcs)


def canonical_memo(nodes) -> dict:
    """A `run_pass` memo declaring `nodes` already rewritten (each maps to itself): passing it
    to run_pass stops the walk at them, e.g. at the inputs of a re-traced recipe."""
    return {n: tuple(n.out(i) for i in range(n.nout)) for n in nodes}


def run_pass(outputs: Sequence[Value], p: Pass, log: RewriteLog | None = None,
             memo: dict | None = None) -> list[Value]:
    """Rewrite the graph under `outputs` bottom-up; a rule's result is itself rewritten until
    no rule fires (fixpoint). Every node is visited once: results are remembered, and so are
    the nodes they consist of (a replacement built over rewritten values does not walk their
    sources again). Returns the new outputs."""
    memo = {} if memo is None else memo   # Node -> tuple[Value] (one per slot)

    def visit(root_values):
        stack = [v.node for v in root_values if v.node not in memo]
        while stack:
            n = stack[-1]
            if n in memo:
                stack.pop()
                continue
            pending = [s.node for s in n.srcs if s.node not in memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            memo[n] = finish(rebuild(n, tuple(memo[s.node][s.slot] for s in n.srcs)))

    def finish(n: Node) -> tuple[Value, ...]:
        for rule in p.rules_for(n.op):
            r = rule.apply(n)
            if r is None:
                continue
            r = (r,) if isinstance(r, Value) else tuple(r)
            if log is not None:
                log.events.append((p.name, rule.name, repr(n.op)))
            visit(r)  # the replacement is rewritten too: fixpoint
            return tuple(memo[v.node][v.slot] for v in r)
        outs = tuple(n.out(i) for i in range(n.nout))
        memo.setdefault(n, outs)   # n is final: later replacements that read it stop here
        return outs

    visit(outputs)
    return [memo[v.node][v.slot] for v in outputs]
