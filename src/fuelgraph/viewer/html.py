"""The HTML page of `fg.explain(outputs).to_html(path)`: one self-contained file (inline data,
style and script; no server, no network) with the graph before and after optimization side by
side, drawn from positions computed here (viewer/layout.py)."""
from __future__ import annotations

import html
import json
from pathlib import Path

from .layout import layout
from .repeats import find_groups
from .trace import GraphTrace, NodeInfo

CHAR_W = 6.6      # px per character of the 11px monospace font the page uses
BOX_H = 30
FUSED_H = 42
MAX_LABEL = 34


def _short_shape(n: NodeInfo) -> str:
    if not n.shapes:
        return ""
    dt = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
          "int64": "i64", "int32": "i32", "bool": "bool", "uint8": "u8", "uint32": "u32"}
    parts = ["x".join(map(str, s)) or "()" for s in n.shapes[:2]]
    return " ".join(parts) + " " + dt.get(n.dtypes[0], n.dtypes[0])


def _lines(n: NodeInfo) -> list[str]:
    lines = [n.label]
    if n.kind == "fused" and n.params:
        lines.append(n.params if len(n.params) <= MAX_LABEL else n.params[:MAX_LABEL - 1] + "…")
    lines.append(_short_shape(n))
    return [l for l in lines if l]


def _size(lines) -> tuple[float, float]:
    w = max(len(l) for l in lines) * CHAR_W + 16
    return max(w, 44.0), (FUSED_H if len(lines) > 2 else BOX_H)


def _path(pts) -> str:
    (x0, y0), (x1, y1) = pts[0], pts[-1]
    if len(pts) == 2:
        dy = max(20.0, (y1 - y0) / 2)
        return (f"M{x0:.1f},{y0:.1f}C{x0:.1f},{y0 + dy:.1f} {x1:.1f},{y1 - dy:.1f} "
                f"{x1:.1f},{y1:.1f}")
    return "M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in pts)


def _drawing(nodes: list[NodeInfo], groups, folded: bool) -> dict:
    """Positions of every box (and fold boxes standing for copies 1.. of each group)."""
    rep = {}                               # node id -> id of the box that shows it
    boxes_lines = {}
    if folded:
        for g in groups:
            for k, copy in enumerate(g.copies[1:], 1):
                fid = f"F{g.id}_{k}"
                for nid in copy:
                    rep[nid] = fid
                boxes_lines[fid] = [f"{g.id} copy {k + 1} of {len(g.copies)}",
                                    f"{g.size} nodes, same as copy 1"]
    ids, seen = [], set()
    for n in nodes:
        b = rep.get(n.id, n.id)
        if b not in seen:
            seen.add(b)
            ids.append(b)
        if b == n.id:
            boxes_lines[b] = _lines(n)
    edges = []
    for n in nodes:
        for s in n.srcs:
            a, b = rep.get(s, s), rep.get(n.id, n.id)
            if a != b:
                edges.append((a, b))
    d = layout(ids, edges, {i: _size(boxes_lines[i]) for i in ids})
    return {"boxes": {i: [round(b.x, 1), round(b.y, 1), round(b.w, 1), round(b.h, 1)]
                      for i, b in d.boxes.items()},
            "edges": [[a, b, _path(pts)] for a, b, pts in d.edges],
            "lines": {i: boxes_lines[i] for i in ids if i.startswith("F")},
            "rep": rep, "w": round(d.width, 1), "h": round(d.height + 20, 1)}


def _graph(nodes: list[NodeInfo]) -> dict:
    groups = find_groups(nodes)
    views = {"full": _drawing(nodes, groups, False)}
    if groups:
        views["folded"] = _drawing(nodes, groups, True)
    return {
        "nodes": [{"id": n.id, "uid": n.uid, "op": n.op, "label": n.label, "kind": n.kind,
                   "params": n.params, "shapes": n.shapes, "dtypes": n.dtypes,
                   "bytes": n.out_bytes, "flops": n.flops, "moved": n.moved, "srcs": n.srcs,
                   "out": n.is_output, "link": n.link, "status": n.status,
                   "replaced": n.replaced, "replaced_ops": n.replaced_ops,
                   "lowered_from": n.lowered_from, "group": n.group, "copy": n.copy,
                   "lines": _lines(n)} for n in nodes],
        "groups": [{"id": g.id, "size": g.size, "copies": len(g.copies)} for g in groups],
        "views": views,
    }


def render(trace: GraphTrace, summary: dict, plan: dict | None = None,
           title: str = "fuelgraph explain") -> str:
    """The page as a string. `summary`: counts shown in the header (fused ops, lowered ops,
    node counts); `plan`: the plan report's numbers, when computed."""
    data = {
        "title": title, "backend": trace.backend, "lower_all": trace.lower_all,
        "summary": summary, "plan": plan,
        "misses": [{"op": m.op, "reason": m.reason, "matched": m.matched, "at": m.at}
                   for m in trace.near_misses],
        "before": _graph(trace.before), "after": _graph(trace.after),
    }
    blob = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    return (_PAGE.replace("__TITLE__", html.escape(title))
            .replace("__STYLE__", _STYLE).replace("__SCRIPT__", _SCRIPT)
            .replace("__DATA__", blob))


def write(path, trace: GraphTrace, summary: dict, plan: dict | None = None,
          title: str = "fuelgraph explain") -> Path:
    p = Path(path)
    p.write_text(render(trace, summary, plan, title), encoding="utf-8")
    return p


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>__STYLE__</style></head>
<body>
<header>
  <h1 id="title"></h1>
  <div id="summary"></div>
  <div id="controls">
    <input id="search" type="search" placeholder="search nodes: op, fused-op name, %uid, shape" size="40">
    <span id="hits"></span>
    <label><input id="fold" type="checkbox" checked> fold repeated layers</label>
    <button id="zoomout" title="zoom out">&minus;</button><button id="zoomin" title="zoom in">+</button>
    <button id="zoomfit" title="fit width">fit</button>
    <span class="legend"><i class="k-fused"></i>fused <i class="k-lowered"></i>lowered
      <i class="k-primitive"></i>primitive <i class="k-view"></i>view
      <i class="k-input"></i>input/const <i class="k-fold"></i>folded copy</span>
  </div>
</header>
<main>
  <section class="pane"><h2>before optimization <small id="before-count"></small></h2>
    <div class="scroll" id="pane-before"></div></section>
  <section class="pane"><h2>after optimization <small id="after-count"></small></h2>
    <div class="scroll" id="pane-after"></div></section>
  <aside>
    <h2>selected</h2><div id="details"><p class="muted">Click a node. Fused ops show the
    primitives they replaced (highlighted on the left).</p></div>
    <h2>fused ops</h2><div id="fusedlist"></div>
    <h2>lowered to recipes</h2><div id="loweredlist"></div>
    <h2>near misses</h2><div id="misses"></div>
    <h2>plan</h2><div id="plan"></div>
  </aside>
</main>
<script id="data" type="application/json">__DATA__</script>
<script>__SCRIPT__</script>
</body></html>
"""

_STYLE = """
:root { --fused:#f6b73c; --lowered:#b98ce0; --prim:#9cc3e6; --view:#dfe7ee; --input:#cde8c4;
        --fold:#e9e3d4; --hl:#e0245e; --match:#1a7f37; }
* { box-sizing: border-box; }
body { margin:0; font:13px/1.35 system-ui, sans-serif; color:#1d2329; background:#fafbfc; }
header { padding:8px 12px; border-bottom:1px solid #d8dde3; background:#fff; }
h1 { font-size:16px; margin:0 0 4px; } h2 { font-size:13px; margin:8px 0 4px; }
h2 small { font-weight:normal; color:#66707a; }
#summary { color:#3d4750; margin-bottom:6px; }
#controls { display:flex; gap:8px; align-items:center; flex-wrap:wrap; }
#controls button { min-width:28px; }
.legend i { display:inline-block; width:12px; height:12px; margin:0 3px 0 8px;
            border:1px solid #889; vertical-align:-2px; }
.k-fused { background:var(--fused); } .k-lowered { background:var(--lowered); }
.k-primitive { background:var(--prim); } .k-view { background:var(--view); }
.k-input { background:var(--input); } .k-fold { background:var(--fold); }
main { display:grid; grid-template-columns: 1fr 1fr 340px; gap:8px; padding:8px;
       height: calc(100vh - 96px); }
.pane { display:flex; flex-direction:column; min-width:0; }
.scroll { flex:1; overflow:auto; border:1px solid #d8dde3; background:#fff; }
aside { overflow:auto; border-left:1px solid #d8dde3; padding-left:8px; }
svg text { font:11px monospace; pointer-events:none; }
svg .node rect { stroke:#56606b; stroke-width:0.8; rx:4; }
svg .node { cursor:pointer; }
svg .fused rect { fill:var(--fused); stroke:#8a5a00; stroke-width:1.4; }
svg .lowered rect { fill:var(--lowered); }
svg .primitive rect { fill:var(--prim); } svg .view rect { fill:var(--view); }
svg .input rect, svg .const rect { fill:var(--input); }
svg .fold rect { fill:var(--fold); stroke-dasharray:4 2; }
svg .output rect { stroke-width:2.4; }
svg .edge { fill:none; stroke:#9aa4ae; stroke-width:1; }
svg .hl rect { stroke:var(--hl); stroke-width:3; }
svg .sel rect { stroke:#000; stroke-width:3; }
svg .match rect { stroke:var(--match); stroke-width:3; }
svg .edge.hl { stroke:var(--hl); stroke-width:2; }
#details table { border-collapse:collapse; width:100%; }
#details td { border-top:1px solid #eee; padding:2px 4px; vertical-align:top; word-break:break-word; }
#details td:first-child { color:#66707a; white-space:nowrap; }
.muted { color:#66707a; } .miss { margin:4px 0; } .miss b { font-family:monospace; }
a.jump { color:#0b5cad; cursor:pointer; text-decoration:underline; }
"""

_SCRIPT = r"""
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const state = { fold: true, zoom: 1, sel: null, hits: [], hit: -1 };
const byId = {};
for (const g of ["before", "after"]) for (const n of D[g].nodes) byId[n.id] = n;
const fmt = (x) => {
  if (x === null || x === undefined) return "";
  const u = ["", "K", "M", "G", "T"]; let i = 0; x = Number(x);
  while (Math.abs(x) >= 1000 && i < u.length - 1) { x /= 1000; i++; }
  return (i ? x.toFixed(2) : String(Math.round(x))) + u[i];
};
const fmtB = (x) => {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0; x = Number(x);
  while (x >= 1024 && i < u.length - 1) { x /= 1024; i++; }
  return (i ? x.toFixed(2) : String(x)) + " " + u[i];
};
function el(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function h(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
function viewOf(g) {
  const v = D[g].views;
  return (state.fold && v.folded) ? v.folded : v.full;
}
function boxOf(g, id) { const v = viewOf(g); return v.rep[id] || id; }
function draw(g) {
  const v = viewOf(g), pane = document.getElementById("pane-" + g);
  pane.textContent = "";
  const svg = el("svg", { width: v.w * state.zoom, height: v.h * state.zoom,
                          viewBox: `0 0 ${v.w} ${v.h}`, id: "svg-" + g });
  const ge = el("g", { class: "edges" });
  for (const [a, b, d] of v.edges) ge.appendChild(el("path", { d: d, class: "edge",
                                                            "data-a": a, "data-b": b }));
  svg.appendChild(ge);
  const gn = el("g", { class: "nodes" });
  for (const id in v.boxes) {
    const [x, y, w, hh] = v.boxes[id];
    const n = byId[id];
    const lines = n ? n.lines : v.lines[id];
    let cls = "node " + (n ? n.kind : "fold");
    if (n && n.out) cls += " output";
    const e = el("g", { class: cls, "data-id": id, transform: `translate(${x - w / 2},${y - hh / 2})` });
    e.appendChild(el("rect", { width: w, height: hh }));
    const t = el("title", {}, n ? `${n.label} %${n.uid}\n${n.status || ""}` : lines.join("\n"));
    e.appendChild(t);
    lines.forEach((l, i) => e.appendChild(el("text", { x: 8, y: 12 + i * 12 }, l)));
    e.addEventListener("click", () => select(g, id));
    gn.appendChild(e);
  }
  svg.appendChild(gn);
  pane.appendChild(svg);
}
function mark(g, ids, cls) {
  const svg = document.getElementById("svg-" + g);
  if (!svg) return [];
  const boxes = new Set(ids.map((i) => boxOf(g, i)));
  const found = [];
  for (const e of svg.querySelectorAll(".node")) {
    if (boxes.has(e.dataset.id)) { e.classList.add(cls); found.push(e); }
  }
  return found;
}
function clear(cls) {
  for (const e of document.querySelectorAll("svg ." + cls)) e.classList.remove(cls);
}
function reveal(e) {
  if (!e) return;
  const pane = e.closest(".scroll"), r = e.getBoundingClientRect(), p = pane.getBoundingClientRect();
  pane.scrollTop += r.top - p.top - pane.clientHeight / 2 + r.height / 2;
  pane.scrollLeft += r.left - p.left - pane.clientWidth / 2 + r.width / 2;
}
function select(g, id) {
  clear("sel"); clear("hl");
  state.sel = [g, id];
  const other = g === "before" ? "after" : "before";
  mark(g, [id], "sel");
  const n = byId[id];
  const det = document.getElementById("details");
  det.textContent = "";
  if (!n) {
    det.appendChild(h("p", "A folded copy of a repeated subgraph; untick 'fold repeated layers' to see it."));
    return;
  }
  const rows = [["node", `${n.id} (%${n.uid})`], ["op", n.label + "  [" + n.op + "]"],
    ["kind", n.kind], ["params", n.params], ["shape", JSON.stringify(n.shapes)],
    ["dtype", n.dtypes.join(", ")], ["output bytes", fmtB(n.bytes)], ["FLOPs", fmt(n.flops)],
    ["bytes moved", fmtB(n.moved)], ["status", n.status], ["lowered from", n.lowered_from],
    ["graph output", n.out ? "yes" : ""],
    ["repeat group", n.group ? `${n.group} copy ${n.copy + 1}` : ""]];
  if (n.replaced && n.replaced.length) {
    rows.push(["replaced", Object.entries(n.replaced_ops).map(([k, c]) => `${k}×${c}`).join(", ")
      + ` (${n.replaced.length} nodes)`]);
  }
  const tb = h("table");
  for (const [k, v] of rows) {
    if (!v) continue;
    const tr = h("tr"); tr.appendChild(h("td", k)); tr.appendChild(h("td", String(v)));
    tb.appendChild(tr);
  }
  det.appendChild(tb);
  const links = [];
  if (n.replaced && n.replaced.length) links.push(...n.replaced);
  if (n.link) links.push(n.link);
  for (const m of D[other].nodes) if (m.link === id) links.push(m.id);
  const found = mark(other, links, "hl");
  if (found.length) reveal(found[0]);
  const svg = document.getElementById("svg-" + g);
  for (const p of svg.querySelectorAll(".edge")) {
    const b = boxOf(g, id);
    if (p.dataset.a === b || p.dataset.b === b) p.classList.add("hl");
  }
  if (n.link) {
    const a = h("a", "show the linked node", "jump");
    a.addEventListener("click", () => select(other, n.link));
    det.appendChild(a);
  }
}
function search(q, step) {
  clear("match");
  q = q.trim().toLowerCase();
  const hits = document.getElementById("hits");
  if (!q) { hits.textContent = ""; state.hits = []; return; }
  const found = [];
  for (const g of ["before", "after"]) {
    const ids = D[g].nodes.filter((n) => (n.label + " " + n.op + " %" + n.uid + " " + n.id + " " +
      n.params + " " + JSON.stringify(n.shapes) + " " + (n.lowered_from || "")).toLowerCase()
      .includes(q)).map((n) => n.id);
    for (const e of mark(g, ids, "match")) found.push(e);
  }
  state.hits = found;
  if (step) state.hit = (state.hit + 1) % Math.max(found.length, 1); else state.hit = 0;
  hits.textContent = found.length ? `${found.length} match${found.length > 1 ? "es" : ""}` +
    (found.length > 1 ? ` (Enter: next, ${state.hit + 1}/${found.length})` : "") : "no match";
  if (found.length) reveal(found[state.hit]);
}
function redraw() {
  draw("before"); draw("after");
  if (state.sel) select(state.sel[0], state.sel[1]);
  const q = document.getElementById("search").value;
  if (q) search(q, false);
}
function lists() {
  document.getElementById("title").textContent = D.title + ` (backend ${D.backend}` +
    (D.lower_all ? ", lower_all" : "") + ")";
  const s = D.summary;
  document.getElementById("summary").textContent =
    `operations: ${s.nodes_before} before → ${s.nodes_after} after; ` +
    `${s.fused_total} fused op${s.fused_total === 1 ? "" : "s"}, ${s.lowered_total} lowered; ` +
    `FLOPs ${fmt(s.flops)}, bytes moved ${fmtB(s.moved)}` +
    (D.plan ? `; predicted peak memory ${fmtB(D.plan.peak_bytes)}` +
      (D.plan.measured_peak_bytes !== null && D.plan.measured_peak_bytes !== undefined ?
        `, measured ${fmtB(D.plan.measured_peak_bytes)}` : "") : "");
  for (const g of ["before", "after"]) {
    const gr = D[g].groups;
    document.getElementById(g + "-count").textContent = `${D[g].nodes.length} nodes` +
      (gr.length ? `, ${gr.length} repeated group${gr.length > 1 ? "s" : ""} (` +
        gr.map((x) => `${x.id}: ${x.size} nodes ×${x.copies}`).join(", ") + ")" : "");
  }
  const fl = document.getElementById("fusedlist");
  const fused = D.after.nodes.filter((n) => n.kind === "fused");
  if (!fused.length) fl.appendChild(h("p", "nothing fused", "muted"));
  const kinds = new Map();               // one line per (op, params, what it replaced)
  for (const n of fused) {
    const what = n.replaced.length ? "replaced " + Object.entries(n.replaced_ops)
      .map(([k, c]) => k + "×" + c).join(", ") : n.status;
    const key = `${n.label}|${n.params}|${what}`;
    if (!kinds.has(key)) kinds.set(key, { n: n, what: what, ids: [] });
    kinds.get(key).ids.push(n.id);
  }
  for (const k of kinds.values()) {
    const p = h("div", "", "miss");
    const a = h("a", k.n.label + (k.ids.length > 1 ? ` ×${k.ids.length}` : ""), "jump");
    let i = 0;
    a.title = "click: show the next one";
    a.addEventListener("click", () => { select("after", k.ids[i % k.ids.length]); i++; });
    p.appendChild(a);
    p.appendChild(h("span", (k.n.params ? ` (${k.n.params})` : "") + " " + k.what));
    fl.appendChild(p);
  }
  const ll = document.getElementById("loweredlist");
  const low = {};
  for (const n of D.after.nodes) if (n.lowered_from) low[n.lowered_from] = (low[n.lowered_from] || 0) + 1;
  if (!Object.keys(low).length && !Object.keys(s.lowered || {}).length)
    ll.appendChild(h("p", "nothing lowered", "muted"));
  for (const k in (s.lowered || {})) ll.appendChild(h("div", `${k} ×${s.lowered[k]}` +
    (low[k] ? ` (${low[k]} primitive nodes, purple)` : ""), "miss"));
  const ml = document.getElementById("misses");
  if (!D.misses.length) ml.appendChild(h("p", "none", "muted"));
  for (const m of D.misses) {
    const p = h("div", "", "miss");
    p.appendChild(h("b", m.op));
    p.appendChild(h("span", `: ${m.reason} (matched ${m.matched} pattern nodes) `));
    if (m.at) {
      const a = h("a", "show", "jump"); a.addEventListener("click", () => select("before", m.at));
      p.appendChild(a);
    }
    ml.appendChild(p);
  }
  const pl = document.getElementById("plan");
  if (!D.plan) { pl.appendChild(h("p", "not computed", "muted")); }
  else {
    const P = D.plan, tb = h("table");
    for (const [k, v] of [["FLOPs", fmt(P.flops)], ["bytes moved", fmtB(P.bytes_moved)],
        ["predicted peak", fmtB(P.peak_bytes) + (P.peak_op ? ` (at ${P.peak_op})` : "")],
        ["measured peak", P.measured_peak_bytes === null || P.measured_peak_bytes === undefined ?
          "not run" : fmtB(P.measured_peak_bytes)],
        ["inputs", fmtB(P.input_bytes)], ["constants", fmtB(P.const_bytes)],
        ["outputs", fmtB(P.output_bytes)], ["steps", P.steps]]) {
      const tr = h("tr"); tr.appendChild(h("td", k)); tr.appendChild(h("td", String(v)));
      tb.appendChild(tr);
    }
    pl.appendChild(tb);
  }
}
function zoom(z) { state.zoom = z; redraw(); }
document.getElementById("fold").addEventListener("change", (e) => { state.fold = e.target.checked; redraw(); });
document.getElementById("zoomin").addEventListener("click", () => zoom(state.zoom * 1.25));
document.getElementById("zoomout").addEventListener("click", () => zoom(state.zoom / 1.25));
document.getElementById("zoomfit").addEventListener("click", () => {
  const w = document.getElementById("pane-after").clientWidth;
  zoom(Math.min(1, (w - 20) / Math.max(viewOf("after").w, viewOf("before").w)));
});
const si = document.getElementById("search");
si.addEventListener("input", () => search(si.value, false));
si.addEventListener("keydown", (e) => { if (e.key === "Enter") search(si.value, true); });
if (!D.before.views.folded && !D.after.views.folded) {
  document.getElementById("fold").disabled = true;
}
lists();
redraw();
document.body.dataset.ready = "1";
"""
