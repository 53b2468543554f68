"""`fg.explain`: what fused, what was lowered, and why a pattern did not match."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .backends import backend_name
from .ir import ops
from .ir.node import toposort
from .opt.canonicalize import CANONICALIZE
from .opt.passes import optimize
from .runtime.executor import _device_of, _values


@dataclass
class ExplainReport:
    """fused_ops: {registry name: count in the optimized graph}; primitive_count: primitive
    (non-leaf) nodes after optimization; nodes_before: non-leaf nodes before; near_misses:
    {op name: first failed constraint of its best partial match}; lowered: {op name: times it
    was lowered to its recipe}; backend: where it would run; rules_fired: {canonicalization
    rule name: times it fired}."""
    fused_ops: dict[str, int]
    primitive_count: int
    nodes_before: int
    nodes_after: int
    near_misses: dict[str, str]
    lowered: dict[str, int]
    backend: str
    rewrites: list = field(default_factory=list)
    matched: dict[str, int] = field(default_factory=dict)   # idioms fused (before lowering)
    rules_fired: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"fuelgraph explain (backend {self.backend})",
                 f"  nodes: {self.nodes_before} before -> {self.nodes_after} after "
                 f"({self.primitive_count} primitive, {sum(self.fused_ops.values())} fused)"]
        if self.fused_ops:
            lines.append("  fused:")
            lines += [f"    {name} x{n}" for name, n in sorted(self.fused_ops.items())]
        else:
            lines.append("  fused: nothing")
        extra = {k: n for k, n in self.matched.items() if k not in self.fused_ops}
        if extra:
            lines.append("  idioms recognized, then lowered (no kernel on this backend):")
            lines += [f"    {name} x{n}" for name, n in sorted(extra.items())]
        if self.lowered:
            lines.append("  lowered to primitives (no kernel on this backend, or lower_all):")
            lines += [f"    {name} x{n}" for name, n in sorted(self.lowered.items())]
        if self.rules_fired:
            lines.append("  canonicalization rules fired:")
            lines += [f"    {name} x{n}" for name, n in sorted(self.rules_fired.items())]
        if self.near_misses:
            lines.append("  near misses (best partial match, first failed constraint):")
            lines += [f"    {name}: {why}" for name, why in sorted(self.near_misses.items())]
        return "\n".join(lines)


def _count(vals):
    nodes = [n for n in toposort(vals) if n.srcs or isinstance(n.op, ops.Scan)]
    fused = Counter(n.op.name for n in nodes if isinstance(n.op, ops.Fused))
    return len(nodes), dict(fused)


def explain(outputs, lower_all: bool = False, min_matched: int = 3) -> ExplainReport:
    """Optimize the graph under `outputs` as realize would and report it. Near misses are
    listed for ops whose best partial match covered at least `min_matched` pattern nodes."""
    vals = _values(outputs if isinstance(outputs, (list, tuple)) else [outputs])
    bname = backend_name(_device_of(vals))
    before, _ = _count(vals)
    res = optimize(vals, bname, lower_all)
    after, fused = _count(res.outputs)
    misses = {k: f"{m.reason} (matched {m.matched} nodes at {m.node})"
              for k, m in res.misses.items() if m.matched >= min_matched}
    matched = Counter(rule for p, rule, _ in res.log.events if p == "fuse")
    return ExplainReport(fused, after - sum(fused.values()), before, after, misses, res.lowered,
                         bname, res.log.events, dict(matched),
                         res.log.counts(CANONICALIZE.name))
