"""The graph trace behind the HTML view: fused ops linked to the primitives they replaced,
lowered ops marked, near misses located, repeated layers found, a layout without overlaps, and
a page that needs nothing from outside."""
from __future__ import annotations

import re
from collections import Counter

import numpy as np

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph.viewer.html import render
from fuelgraph.viewer.layout import GAP, layout
from fuelgraph.viewer.repeats import find_groups
from fuelgraph.viewer.trace import trace

from viewer_models import demo_graph, stacked_layers


def _trace(outs, lower_all=False):
    return trace([o.value for o in outs], "numpy", lower_all)[0]


def test_fused_ops_link_to_the_primitives_they_replaced():
    tr = _trace(demo_graph(batch=1))
    before = {n.id: n for n in tr.before}
    fused = [n for n in tr.after if n.kind == "fused"]
    by_name = Counter(n.label for n in fused)
    assert by_name["rms_norm_last_dim"] == 3 and by_name["rope"] == 4
    sm = next(n for n in fused if n.label == "softmax_last_dim")
    assert {"max", "sub", "exp", "sum", "div"} <= set(sm.replaced_ops)
    for b in sm.replaced:
        assert before[b].link == sm.id and "fused into softmax_last_dim" in before[b].status
    ce = next(n for n in fused if n.label == "fused_softmax_cross_entropy")
    assert "gather" in ce.replaced_ops and "reduction='mean'" in ce.params
    # every fused op has FLOPs and bytes; views move nothing
    assert all(n.flops > 0 and n.moved > 0 for n in fused)
    assert all(n.moved == 0 for n in tr.after if n.kind == "view")


def test_lowered_ops_are_marked():
    x = fg.tensor(np.ones((4, 8), np.float32))
    tr = _trace([F.softmax_last_dim(x) * 2.0], lower_all=True)
    low = [n for n in tr.after if n.lowered_from == "softmax_last_dim"]
    assert {n.label for n in low} >= {"exp", "sum", "div"}
    assert all(n.kind in ("lowered", "view") for n in low)
    fused_before = next(n for n in tr.before if n.kind == "fused")
    assert "lowered" in fused_before.status


def test_near_miss_names_its_place_and_reason():
    x = fg.tensor(np.ones((4, 8), np.float32))
    e = (x - x.max(-1, keepdim=True)).exp()
    tr = _trace([e / e.sum(-1, keepdim=True), e * 2.0])
    miss = next(m for m in tr.near_misses if m.op == "softmax_last_dim")
    assert "another consumer" in miss.reason
    assert miss.at is not None and tr.node(miss.at).label == "div"


def test_repeated_layers_are_folded():
    tr = _trace(stacked_layers(layers=6))
    groups = find_groups(tr.after)
    big = max(groups, key=lambda g: g.size * len(g.copies))
    assert len(big.copies) >= 4 and big.size >= 40
    seen = set()
    for copy in big.copies:                      # copies are disjoint, equally large
        assert len(copy) == big.size and not seen & set(copy)
        seen |= set(copy)


def test_layout_has_no_overlaps_and_is_deterministic():
    tr = _trace(demo_graph(batch=1))
    ids = [n.id for n in tr.after]
    edges = [(s, n.id) for n in tr.after for s in n.srcs]
    size = {i: (40 + 7 * (k % 5), 30) for k, i in enumerate(ids)}
    d = layout(ids, edges, size)
    rows: dict = {}
    for b in d.boxes.values():
        rows.setdefault(b.y, []).append(b)
    for row in rows.values():
        row.sort(key=lambda b: b.x)
        for a, b in zip(row, row[1:]):
            assert a.x + a.w / 2 + GAP - 1e-6 <= b.x - b.w / 2
    for a, b in edges:                            # inputs above their consumers
        assert d.boxes[a].y < d.boxes[b].y
    again = layout(ids, edges, size)
    assert [(b.x, b.y) for b in again.boxes.values()] == [(b.x, b.y) for b in d.boxes.values()]


def test_page_is_self_contained():
    x = fg.tensor(np.ones((4, 8), np.float32))
    tr = _trace([F.softmax_last_dim(x) + 1.0])
    page = render(tr, {"nodes_before": 2, "nodes_after": 2, "fused_total": 1,
                       "lowered_total": 0, "flops": 1, "moved": 1})
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:|//)", page)
    assert "@import" not in page and "url(" not in page
    assert "softmax_last_dim" in page
