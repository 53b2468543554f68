"""`fg.explain`: what fused, what was lowered, and why a pattern did not match."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .backends import backend_name
from .ir import ops
from .ir.node import toposort
from .opt.canonicalize import CANONICALIZE
from .opt.passes import optimize
from .opt.regions import FAMILY
from .registry.core import default_registry
from .runtime.executor import _device_of, _values


@dataclass
class ExplainReport:
    """fused_ops: {registry name: count in the optimized graph} (idioms; glue regions are listed
    apart in `glue`: {region name: what it runs}; `dissolved` counts fused ops lowered into a
    neighbouring region); primitive_count: primitive (non-leaf) nodes after optimization, those
    that glue regions run included; nodes_before: non-leaf nodes before; near_misses:
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
    glue: dict[str, str] = field(default_factory=dict)      # generated region -> what it runs
    dissolved: dict[str, int] = field(default_factory=dict)  # elementwise fused ops run in glue
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
        if self.glue:
            lines.append("  glue regions (primitives run as one generated kernel each):")
            lines += [f"    {name}: {what}" for name, what in sorted(self.glue.items())]
        if self.dissolved:
            lines.append("  elementwise fused ops run inside glue regions:")
            lines += [f"    {name} x{n}" for name, n in sorted(self.dissolved.items())]
        extra = {k: n for k, n in self.matched.items()
                 if k not in self.fused_ops and k not in self.dissolved}
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
    """(non-leaf nodes, {fused op name: count}, primitives that glue regions run, {glue region
    name: description}). Glue regions are not idioms: they are reported apart, and the
    primitives they run still count as primitives."""
    nodes = [n for n in toposort(vals) if n.srcs or isinstance(n.op, ops.Scan)]
    fused, glue, inside = Counter(), {}, 0
    for n in nodes:
        if not isinstance(n.op, ops.Fused):
            continue
        e = default_registry().get(n.op.id)
        if e is not None and e.family == FAMILY and e.body is not None:
            inside += sum(1 for m in toposort(e.body.outputs) if m.srcs)
            glue[e.name] = e.doc
        else:
            fused[n.op.name] += 1
    return len(nodes), dict(fused), inside, glue


def explain(outputs, lower_all: bool = False, min_matched: int = 3) -> ExplainReport:
    """Optimize the graph under `outputs` as realize would and report it. Near misses are
    listed for ops whose best partial match covered at least `min_matched` pattern nodes."""
    vals = _values(outputs if isinstance(outputs, (list, tuple)) else [outputs])
    bname = backend_name(_device_of(vals))
    before = _count(vals)[0]
    res = optimize(vals, bname, lower_all)
    after, fused, inside, glue = _count(res.outputs)
    misses = {k: f"{m.reason} (matched {m.matched} nodes at {m.node})"
              for k, m in res.misses.items() if m.matched >= min_matched}
    matched = Counter(rule for p, rule, _ in res.log.events if p == "fuse")
    n_glue = sum(res.glue.values())
    dissolved = Counter(what for p, rule, what in res.log.events
                        if (p, rule) == ("glue", "dissolve"))
    return ExplainReport(fused, after - sum(fused.values()) - n_glue + inside, before, after,
                         misses, res.lowered, bname, res.log.events, dict(matched),
                         glue=glue, dissolved=dict(dissolved),
                         rules_fired=res.log.counts(CANONICALIZE.name))
