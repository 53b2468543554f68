"""Repeated layers: sets of disjoint, structurally identical subgraphs of one graph (the layers
of a deep model, forward or backward), so that a view can show one copy and fold the others.

Nodes get a structural hash (op, params, shapes and dtypes, refined a few times with their
inputs' hashes). A group grows from a seed class of equal-hash nodes by walking all copies in
lock step: a neighbour position (an input slot, or a consumer reading at a given slot) joins
only when every copy has a distinct, still unclaimed node there with equal hashes. The seed
whose growth hides the most nodes wins; its copies are claimed and the search repeats."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

#: smallest group worth folding (nodes per copy)
MIN_NODES = 12
#: refinement rounds of the structural hash (how far up the inputs it looks)
ROUNDS = 3
#: seed classes tried per round (largest kinds of node first)
MAX_SEEDS = 48


@dataclass
class Group:
    id: str
    copies: list[list[str]]     # node ids of each copy, in topological order

    @property
    def size(self) -> int:
        return len(self.copies[0])


def _hashes(nodes) -> dict:
    h = {n.id: hash((n.kind, n.label, n.params, tuple(map(tuple, n.shapes)), tuple(n.dtypes)))
         for n in nodes}
    for _ in range(ROUNDS):
        h = {n.id: hash((h[n.id], tuple(h[s] for s in n.srcs))) for n in nodes}
    return h


def _seed_rank(n) -> int:
    if n.kind == "fused":
        return 0
    if n.label in ("matmul", "sum", "max", "exp", "scan"):
        return 1
    return 2 if n.kind == "primitive" else 3


def _grow(seed: list[str], srcs, users, h, taken: set) -> list[list[str]]:
    """Positions (one node per copy) reachable from `seed` in lock step."""
    m = len(seed)
    positions = [list(seed)]
    owner = {n: i for i, n in enumerate(seed)}     # node -> copy index
    queue = [0]
    while queue:
        row = positions[queue.pop()]
        cands = []
        for j in range(len(srcs[row[0]])):
            cands.append([srcs[x][j] for x in row])
        # consumers: match each consumer of copy 0 (by hash and input slot) in every copy
        for (u0, slot) in users[row[0]]:
            key = (h[u0], slot)
            cand = [u0]
            for x in row[1:]:
                hit = next((u for u, s in users[x] if (h[u], s) == key and u not in cand), None)
                if hit is None:
                    break
                cand.append(hit)
            if len(cand) == m:
                cands.append(cand)
        for cand in cands:
            if len(set(cand)) != m or any(c in owner or c in taken for c in cand):
                continue
            if len({h[c] for c in cand}) != 1:
                continue
            for i, c in enumerate(cand):
                owner[c] = i
            positions.append(cand)
            queue.append(len(positions) - 1)
    return positions


def find_groups(nodes, min_nodes: int = MIN_NODES) -> list[Group]:
    """Groups of repeated subgraphs of `nodes` (NodeInfo list in topological order); sets each
    node's `group` and `copy` (copy 0 is the one shown unfolded)."""
    h = _hashes(nodes)
    srcs = {n.id: list(n.srcs) for n in nodes}
    users = defaultdict(list)
    for n in nodes:
        for j, s in enumerate(n.srcs):
            users[s].append((n.id, j))
    by_id = {n.id: n for n in nodes}
    classes = defaultdict(list)
    for n in nodes:
        if n.srcs:
            classes[h[n.id]].append(n.id)
    taken: set = set()
    groups: list[Group] = []
    while True:
        seeds = []
        for members in classes.values():
            free = [x for x in members if x not in taken]
            if len(free) >= 2:
                seeds.append(free)
        seeds.sort(key=lambda f: (_seed_rank(by_id[f[0]]), -len(f)))
        best, best_score = None, 0
        for seed in seeds[:MAX_SEEDS]:
            pos = _grow(seed, srcs, users, h, taken)
            score = len(pos) * (len(seed) - 1)
            if len(pos) >= min_nodes and score > best_score:
                best, best_score = pos, score
        if best is None:
            break
        order = {n.id: i for i, n in enumerate(nodes)}
        copies = [sorted((row[i] for row in best), key=order.get) for i in range(len(best[0]))]
        copies.sort(key=lambda c: order[c[0]])
        g = Group(f"g{len(groups)}", copies)
        for k, copy in enumerate(copies):
            for nid in copy:
                by_id[nid].group, by_id[nid].copy = g.id, k
                taken.add(nid)
        groups.append(g)
    return groups
