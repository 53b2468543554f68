"""`fg.explain`: what fused, what was lowered, and why a pattern did not match; as text or as
an HTML page (`.to_html(path)`). `fg.plan_report`: FLOPs, bytes moved and the peak memory a
plan will allocate, predicted before running and, on request, measured by running it."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, fields

from .backends import backend_name
from .ir import ops
from .ir.node import format_site, toposort
from .ir.tensor import bound_data
from .opt.canonicalize import CANONICALIZE
from .opt.passes import optimize
from .opt.regions import FAMILY
from .registry.core import default_registry
from .runtime.executor import _device_of, _values, compile_plan
from .runtime.memory import measure_peak, predict_memory
from .viewer import html as _html
from .viewer.trace import trace


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
    outputs: list = field(default_factory=list, repr=False, compare=False)
    lower_all: bool = False

    def to_html(self, path, plan: bool = True, measure: bool = False,
                title: str = "fuelgraph explain"):
        """Write a self-contained HTML page: the graph before and after optimization side by
        side (fused ops labelled with their registry name and params and linked to the
        primitives they replaced, lowered ops marked, near misses with their first failed
        constraint, per-node shape, dtype, bytes and FLOPs, repeated layers folded, search).
        plan=True adds the plan report (measure=True also runs the graph once to measure its
        peak memory). Returns the path."""
        tr, _ = trace(self.outputs, self.backend, self.lower_all)
        after = [n for n in tr.after if n.srcs]
        summary = {"nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
                   "fused_total": sum(self.fused_ops.values()),
                   "lowered_total": sum(self.lowered.values()), "lowered": self.lowered,
                   "flops": sum(n.flops for n in after), "moved": sum(n.moved for n in after)}
        rep = self.plan_report(measure) if plan else None
        return _html.write(path, tr, summary, rep.as_dict() if rep else None, title)

    def plan_report(self, measure: bool = False) -> "PlanReport":
        """`fg.plan_report` of the explained outputs."""
        return plan_report(self.outputs, self.lower_all, measure)

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


def _describe(n) -> str:
    where = format_site(n.site)
    return f"{n.op.name}" + (f" built at {where}" if where else "")


def _name_nodes(text: str, by_uid: dict) -> str:
    """Replace internal node ids (%123) with the op's name and the user's line that built it."""
    def sub(m):
        n = by_uid.get(m.group(0))
        return f"[{_describe(n)}]" if n is not None else "an internal node"
    text = text.replace("(%output)", "(a graph output)")
    return re.sub(r"%\d+(?:\.\d+)?", sub, text)


def explain(outputs, lower_all: bool = False, min_matched: int = 3,
            min_kinds: int = 4) -> ExplainReport:
    """Optimize the graph under `outputs` as realize would and report it. Near misses are
    listed for ops whose best partial match covered at least `min_matched` pattern nodes of at
    least `min_kinds` kinds of op (or of all the pattern's kinds, for a small pattern): a
    reshape over a matrix product, which a convolution's pattern shares with every linear
    layer, is not a near miss."""
    vals = _values(outputs if isinstance(outputs, (list, tuple)) else [outputs])
    bname = backend_name(_device_of(vals))
    before = _count(vals)[0]
    res = optimize(vals, bname, lower_all)
    after, fused, inside, glue = _count(res.outputs)
    by_uid = {f"%{n.uid}": n for n in toposort(res.canonical + vals)}
    misses = {k: _name_nodes(f"{m.reason} (matched {m.matched} nodes at {m.node})", by_uid)
              for k, m in res.misses.items()
              if m.matched >= min_matched and m.kinds >= min(min_kinds, m.pattern_kinds)}
    matched = Counter(rule for p, rule, _ in res.log.events if p == "fuse")
    n_glue = sum(res.glue.values())
    dissolved = Counter(what for p, rule, what in res.log.events
                        if (p, rule) == ("glue", "dissolve"))
    return ExplainReport(fused, after - sum(fused.values()) - n_glue + inside, before, after,
                         misses, res.lowered, bname, res.log.events, dict(matched),
                         glue=glue, dissolved=dict(dissolved),
                         rules_fired=res.log.counts(CANONICALIZE.name), outputs=vals,
                         lower_all=lower_all)


@dataclass
class PlanReport:
    """What running the plan of some outputs costs. flops / bytes_moved: totals over its steps
    (a kernel reads its inputs and writes its outputs once; views move nothing; contiguous
    copies count); peak_bytes: the most memory the run holds at once beyond its inputs and
    constants, predicted before running (buffers freed after last use, views sharing storage,
    in-place reuse, temporary contiguous copies, declared kernel scratch); peak_op: the step
    where it peaks; measured_peak_bytes: the same quantity measured by running the plan once
    (None until measured; NumPy: tracemalloc, CUDA: torch's allocator statistics)."""
    backend: str
    steps: int
    flops: float
    bytes_moved: float
    peak_bytes: int
    peak_step: int
    peak_op: str
    input_bytes: int
    const_bytes: int
    output_bytes: int
    copies: int
    inplace_reused: int
    measured_peak_bytes: int | None = None
    outputs: list = field(default_factory=list, repr=False, compare=False)
    lower_all: bool = False

    def measure(self) -> "PlanReport":
        """Run the plan once (after a warm-up run on CUDA) and record its measured peak."""
        plan, inputs = compile_plan(self.outputs, self.lower_all)
        bufs = [bound_data(n) for n in inputs]
        if plan.backend.name == "cuda":
            plan.run(bufs)
        self.measured_peak_bytes, _ = measure_peak(plan, bufs)
        return self

    @property
    def agreement(self) -> float | None:
        """measured / predicted peak (None until measured)."""
        if self.measured_peak_bytes is None or not self.peak_bytes:
            return None
        return self.measured_peak_bytes / self.peak_bytes

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "outputs"}

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f} MiB"   # noqa: E731
        lines = [f"fuelgraph plan (backend {self.backend}, {self.steps} steps)",
                 f"  FLOPs        {self.flops / 1e9:.4g} G",
                 f"  bytes moved  {mib(self.bytes_moved)}",
                 f"  peak memory  {mib(self.peak_bytes)} predicted (at step {self.peak_step}, "
                 f"{self.peak_op})",
                 f"  inputs {mib(self.input_bytes)}, constants {mib(self.const_bytes)}, outputs "
                 f"{mib(self.output_bytes)}; {self.copies} contiguous copies, "
                 f"{self.inplace_reused} in-place reuses"]
        if self.measured_peak_bytes is not None:
            lines.append(f"  measured     {mib(self.measured_peak_bytes)} "
                         f"({self.agreement:.3f}x the prediction)")
        return "\n".join(lines)


def plan_report(outputs, lower_all: bool = False, measure: bool = False) -> PlanReport:
    """FLOPs, bytes moved and peak memory of the plan that `fg.realize(outputs)` would run,
    computed before running; measure=True also runs it once and records the measured peak."""
    vals = _values(outputs if isinstance(outputs, (list, tuple)) else [outputs])
    plan, inputs = compile_plan(vals, lower_all)
    mp = predict_memory(plan, [bound_data(n) for n in inputs])
    rep = PlanReport(plan.backend.name, len(plan.steps), mp.flops, mp.bytes_moved,
                     mp.peak_bytes, mp.peak_step, mp.peak_op, mp.input_bytes, mp.const_bytes,
                     mp.output_bytes, mp.copies, mp.inplace_reused, None, vals, lower_all)
    return rep.measure() if measure else rep
