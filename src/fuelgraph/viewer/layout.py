"""A layered drawing of a DAG (top to bottom, inputs first), small enough to write here:

1. layers: longest path from the sources; leaves sit just above their first consumer;
2. edges spanning several layers get a chain of dummy points (edges longer than `max_span`
   are drawn as one curve instead, so that a backward pass reading early activations does not
   flood the drawing with dummies);
3. order within layers: barycenter sweeps, down then up;
4. x: nodes move toward the mean of their neighbours, overlaps resolved keeping the order.

Deterministic: the same graph gives the same picture."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

ROW = 64          # vertical distance between layers
GAP = 18          # horizontal gap between boxes
DUMMY_W = 6


@dataclass
class Box:
    id: str
    w: float
    h: float
    x: float = 0.0    # centre
    y: float = 0.0
    layer: int = 0


@dataclass
class Drawing:
    boxes: dict[str, Box]
    edges: list[tuple[str, str, list]] = field(default_factory=list)   # (src, dst, points)
    width: float = 0.0
    height: float = 0.0


def _topological(ids, preds, succs) -> tuple[list, set]:
    """Kahn's order preferring the given order; where a cycle blocks it (folding a repeated
    subgraph can close one), the earliest blocked node goes next and its unmet input edges
    are returned as back edges."""
    index = {n: i for i, n in enumerate(ids)}
    missing = {n: len(preds[n]) for n in ids}
    ready = [(index[n], n) for n in ids if not missing[n]]
    heapq.heapify(ready)
    done, order, back = set(), [], set()
    pending = sorted(ids, key=index.get)
    k = 0
    while len(order) < len(ids):
        if not ready:
            while pending[k] in done:
                k += 1
            n = pending[k]
            back |= {(p, n) for p in preds[n] if p not in done}
            heapq.heappush(ready, (index[n], n))
            missing[n] = 0
        _, n = heapq.heappop(ready)
        if n in done:
            continue
        done.add(n)
        order.append(n)
        for s in succs[n]:
            missing[s] -= 1
            if missing[s] == 0 and s not in done:
                heapq.heappush(ready, (index[s], s))
    return order, back


def _layers(ids, preds, succs) -> dict:
    layer = {}
    for n in ids:                                   # ids are in topological order
        layer[n] = 1 + max((layer[p] for p in preds[n]), default=-1)
    for n in reversed(ids):
        if not preds[n] and succs[n]:
            layer[n] = max(0, min(layer[s] for s in succs[n]) - 1)
    return layer


def layout(ids: list[str], edges: list[tuple[str, str]], size: dict[str, tuple],
           max_span: int = 6, sweeps: int = 6) -> Drawing:
    """Place `ids` (topological order) with `edges` (src, dst); `size[id] = (w, h)`."""
    preds = {n: [] for n in ids}
    succs = {n: [] for n in ids}
    seen = set()
    for a, b in edges:
        if (a, b) not in seen and a in preds and b in preds:
            seen.add((a, b))
            preds[b].append(a)
            succs[a].append(b)
    order, back = _topological(ids, preds, succs)
    for a, b in back:
        preds[b].remove(a)
        succs[a].remove(b)
    ids = order
    layer = _layers(ids, preds, succs)
    boxes = {n: Box(n, *size[n], layer=layer[n]) for n in ids}
    # dummy chains for edges of moderate span
    up = {n: list(preds[n]) for n in ids}          # adjacency including dummies
    down = {n: list(succs[n]) for n in ids}
    chains: dict[tuple, list] = {}
    long_edges = []
    for a, b in sorted(seen, key=lambda e: (layer[e[0]], e[0], e[1])):
        span = layer[b] - layer[a]
        if span <= 1:
            continue
        if span > max_span:
            long_edges.append((a, b))
            continue
        prev = a
        chain = []
        for k in range(layer[a] + 1, layer[b]):
            d = f"~{a}>{b}#{k}"
            boxes[d] = Box(d, DUMMY_W, 0, layer=k)
            up[d], down[d] = [prev], []
            down[prev].append(d)
            chain.append(d)
            prev = d
        down[prev].append(b)
        up[b].append(prev)
        down[a].remove(b)
        up[b].remove(a)
        chains[(a, b)] = chain
    for a, b in long_edges:                        # not part of the ordering sweeps (back
                                                   # edges never were)
        down[a].remove(b)
        up[b].remove(a)
    rows: dict[int, list] = {}
    for n in list(ids) + [d for c in chains.values() for d in c]:
        rows.setdefault(boxes[n].layer, []).append(n)
    nrows = max(rows) + 1 if rows else 0
    pos = {}
    for k in range(nrows):
        for i, n in enumerate(rows.get(k, [])):
            pos[n] = i
    for it in range(sweeps):
        rng = range(1, nrows) if it % 2 == 0 else range(nrows - 2, -1, -1)
        nb = up if it % 2 == 0 else down
        for k in rng:
            row = rows.get(k, [])
            key = {}
            for n in row:
                ps = [pos[p] for p in nb[n]]
                key[n] = sum(ps) / len(ps) if ps else pos[n]
            row.sort(key=lambda n: (key[n], pos[n]))
            for i, n in enumerate(row):
                pos[n] = i
    # x: pack, then relax toward neighbours
    for k, row in rows.items():
        x = 0.0
        for n in row:
            b = boxes[n]
            b.x = x + b.w / 2
            x += b.w + GAP
    for it in range(2 * sweeps):
        order = range(nrows) if it % 2 == 0 else range(nrows - 1, -1, -1)
        for k in order:
            row = rows.get(k, [])
            want = []
            for n in row:
                nbrs = up[n] + down[n]
                want.append(sum(boxes[m].x for m in nbrs) / len(nbrs) if nbrs else boxes[n].x)
            _place(row, want, boxes)
    xmin = min((b.x - b.w / 2 for b in boxes.values()), default=0.0)
    for b in boxes.values():
        b.x -= xmin - GAP
        b.y = ROW / 2 + b.layer * ROW
    out_edges = []
    for a, b in sorted(seen, key=lambda e: (e[0], e[1])):
        pts = [(boxes[a].x, boxes[a].y + boxes[a].h / 2)]
        pts += [(boxes[d].x, boxes[d].y) for d in chains.get((a, b), ())]
        pts.append((boxes[b].x, boxes[b].y - boxes[b].h / 2))
        out_edges.append((a, b, pts))
    real = {n: boxes[n] for n in ids}
    width = max((b.x + b.w / 2 for b in boxes.values()), default=0.0) + GAP
    return Drawing(real, out_edges, width, nrows * ROW)


def _place(row, want, boxes) -> None:
    """Move the boxes of one row toward `want` x positions without overlap, keeping order:
    clusters of boxes that push against each other settle at their mean wish."""
    blocks: list[list] = []     # [start index, end index, x of first box's centre]
    for i, n in enumerate(row):
        blocks.append([i, i, want[i]])
        while len(blocks) > 1:
            a, b = blocks[-2], blocks[-1]
            end_a = a[2] + _span(row, a[0], a[1], boxes)
            start_b = b[2] - boxes[row[b[0]]].w / 2
            if end_a + GAP <= start_b:
                break
            # merge: choose the block's first centre so that its boxes' mean wish is met
            lo, hi = a[0], b[1]
            offs, x = [], 0.0
            for j in range(lo, hi + 1):
                if j > lo:
                    x += boxes[row[j - 1]].w / 2 + GAP + boxes[row[j]].w / 2
                offs.append(x)
            first = sum(want[j] - offs[j - lo] for j in range(lo, hi + 1)) / (hi - lo + 1)
            blocks[-2:] = [[lo, hi, first]]
    for lo, hi, first in blocks:
        x = first
        for j in range(lo, hi + 1):
            if j > lo:
                x += boxes[row[j - 1]].w / 2 + GAP + boxes[row[j]].w / 2
            boxes[row[j]].x = x


def _span(row, lo, hi, boxes) -> float:
    """Distance from the first box's centre to the last box's right edge in a packed block."""
    x = 0.0
    for j in range(lo + 1, hi + 1):
        x += boxes[row[j - 1]].w / 2 + GAP + boxes[row[j]].w / 2
    return x + boxes[row[hi]].w / 2
