"""Collectives in plans (registry family "collective": all_reduce, all_gather, ...).

Every process of a group must issue the same collectives in the same order, or they deadlock
or mix up their data. A plan fixes that order from the structure of the optimized graph alone:
the collectives are sorted by their depth in the graph (the longest path from a leaf) and then
by their position in the graph's depth-first walk from its outputs (sources in order), and
each one is scheduled after the previous one. Both keys depend on nothing but the graph, and
every process runs the same program, so every process builds the same graph (input leaves
abstracted to position, shape and dtype: the plan-cache key) and the same order. No memory
address, hash of an object or timing enters it.

Overlap: collective kernels run asynchronously (the plan waits for a result right before the
first step that reads it). The scheduler issues each collective as early as its inputs allow:
among the steps ready to run, those on the way to the next collective go first, and steps that
read a collective's result go last. A data-parallel step thus all-reduces the gradients of
the last layers while the backward computes the first layers' gradients; a tensor-parallel
backward computes weight gradients while the input gradient is being reduced.

Check: with FUELGRAPH_CHECK_COLLECTIVES=1 the processes exchange a digest of each plan's
collective sequence (per group: op, params, shape, dtype) before every run that has
collectives, and raise FuelGraphError naming the sequence when they differ (a program that is
not the same on every process), instead of hanging or mixing data."""
from __future__ import annotations

import hashlib
import heapq
import os

from ..errors import FuelGraphError
from ..ir import ops
from ..ir.node import Node
from ..registry.collective import COMMUNICATING, group_info


def is_collective(n: Node) -> bool:
    """Whether `n` exchanges data between processes (shard and replicate do not)."""
    return isinstance(n.op, ops.Fused) and int(n.op.id) in COMMUNICATING


def schedule(order: list[Node], extra: dict) -> list[Node]:
    """`order` (a topological order obeying the ordering edges `extra`: node -> nodes that
    must run first) rescheduled so that collectives run in one structural order, each as early
    as possible, and the readers of their results as late as possible."""
    colls = [n for n in order if is_collective(n)]
    if not colls:
        return order
    pos = {n: i for i, n in enumerate(order)}
    deps = {n: {s.node for s in n.srcs} | set(extra.get(n, ())) for n in order}
    depth: dict[Node, int] = {}
    for n in order:
        depth[n] = 1 + max((depth[d] for d in deps[n]), default=-1)
    colls.sort(key=lambda n: (depth[n], pos[n]))
    for a, b in zip(colls, colls[1:]):   # depth grows along every path: no cycle is made
        deps[b].add(a)
    users: dict[Node, list] = {n: [] for n in order}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    # feeds[n]: index of the first collective n is needed for (len(colls): none)
    index = {c: i for i, c in enumerate(colls)}
    feeds: dict[Node, int] = {}
    for n in reversed(_kahn(order, deps, users, lambda n: pos[n])):
        feeds[n] = min([index.get(n, len(colls))] + [feeds[u] for u in users[n]])
    reads = {n for n in order if not is_collective(n)
             and any(s.node in index for s in n.srcs)}
    return _kahn(order, deps, users, lambda n: (n in reads, feeds[n], pos[n]))


def _kahn(nodes, deps, users, key) -> list[Node]:
    indeg = {n: len(deps[n]) for n in nodes}
    ready = [(key(n), i, n) for i, n in enumerate(nodes) if indeg[n] == 0]
    heapq.heapify(ready)
    tie = len(nodes)
    out = []
    while ready:
        _, _, n = heapq.heappop(ready)
        out.append(n)
        for u in users[n]:
            indeg[u] -= 1
            if indeg[u] == 0:
                tie += 1
                heapq.heappush(ready, (key(u), tie, u))
    if len(out) != len(nodes):
        raise FuelGraphError("ordering: collective and destructive-input constraints form a "
                             "cycle")
    return out


# ---- agreement check ---------------------------------------------------------------------------
def sequence(order: list[Node]) -> dict[str, list[str]]:
    """group name -> the plan's collectives on it, in issue order, as short descriptions."""
    seqs: dict[str, list[str]] = {}
    for n in order:
        if is_collective(n):
            p = n.op.params
            seqs.setdefault(p.group, []).append(
                f"{n.op.name}({p}) {[tuple(s.shape) for s in n.srcs]} "
                f"{[s.dtype.name for s in n.srcs]}")
    return seqs


def check_enabled() -> bool:
    return os.environ.get("FUELGRAPH_CHECK_COLLECTIVES", "0") not in ("", "0")


def agreement_check(seqs: dict[str, list[str]]):
    """A function that, when called on every process before a run, raises FuelGraphError if
    the processes would issue different collective sequences (None when nothing to check)."""
    todo = []
    for name in sorted(seqs):
        digest = int.from_bytes(hashlib.blake2b("\n".join(seqs[name]).encode(),
                                                digest_size=7).digest(), "little")
        todo.append((name, digest, seqs[name]))
    if not todo:
        return None

    def check():
        for name, digest, seq in todo:
            g = group_info(name)
            if g.size == 1:
                continue
            got = _exchange(g, digest)
            if any(d != digest for d in got):
                bad = [r for r, d in enumerate(got) if d != digest]
                raise FuelGraphError(
                    f"collectives: process {g.rank} of group {name!r} would issue "
                    f"{len(seq)} collective(s) [{'; '.join(seq)}], which differs from what "
                    f"process(es) {bad} would issue: every process must build the same graph "
                    f"(same program, same shapes)")
    return check


def _exchange(g, digest: int) -> list[int]:
    import torch
    import torch.distributed as dist
    be = str(dist.get_backend(g.handle))
    dev = "cpu" if "gloo" in be or not torch.cuda.is_available() else \
        f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([digest], dtype=torch.int64, device=dev)
    out = [torch.empty_like(t) for _ in range(g.size)]
    dist.all_gather(out, t, group=g.handle)
    return [int(o.item()) for o in out]
