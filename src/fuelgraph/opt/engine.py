"""One rewrite engine for every pass: a pass is a named list of rules (node -> replacement
values or None); the engine applies them bottom-up to a fixpoint and records what fired."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..ir import ops
from ..ir.node import Node, Value, make_node
from ..registry.core import fused_node

Rule = Callable[[Node], "Sequence[Value] | Value | None"]


@dataclass
class Pass:
    name: str
    rules: list[tuple[str, Rule]]


@dataclass
class RewriteLog:
    """Every rewrite that fired: (pass, rule, node repr)."""
    events: list[tuple[str, str, str]] = field(default_factory=list)

    def count(self, rule: str) -> int:
        return sum(1 for _, r, _ in self.events if r == rule)


def rebuild(node: Node, srcs: tuple[Value, ...]) -> Node:
    """`node`'s op applied to new sources (the same node when they are unchanged)."""
    if srcs == node.srcs:
        return node
    if isinstance(node.op, ops.Fused):
        return fused_node(node.op, srcs)
    return make_node(node.op, srcs)


def run_pass(outputs: Sequence[Value], p: Pass, log: RewriteLog | None = None,
             memo: dict | None = None) -> list[Value]:
    """Rewrite the graph under `outputs` bottom-up; a rule's result is itself rewritten until
    no rule fires (fixpoint). Returns the new outputs."""
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
        for rname, rule in p.rules:
            r = rule(n)
            if r is None:
                continue
            r = (r,) if isinstance(r, Value) else tuple(r)
            if log is not None:
                log.events.append((p.name, rname, repr(n.op)))
            visit(r)  # the replacement is rewritten too: fixpoint
            return tuple(memo[v.node][v.slot] for v in r)
        return tuple(n.out(i) for i in range(n.nout))

    visit(outputs)
    return [memo[v.node][v.slot] for v in outputs]
