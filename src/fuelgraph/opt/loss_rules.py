"""Graph rewrites for language-model losses, run right after fusion.

linear_head_cross_entropy
    `fused_softmax_cross_entropy(logits, t)` whose logits are a linear head -- `x @ w.T`
    (MatMul of a [N, H] x with the transpose of a 2-D w) or `fused_linear(x, w.T, bias)`, or
    such a 16-bit head cast to float32 -- and are read by nothing else becomes `fused_linear_cross_entropy(x, w, t[, bias])`, so the
    [N, V] logits are never stored. (Spelled entirely in primitives, the head and the
    cross-entropy idiom fuse directly through the op's derived pattern; this rule covers the
    forms where the cross-entropy or the head already is a fused node.)

one_pass_cross_entropy / one_pass_linear_cross_entropy
    A forward loss node and its backward helper over the same inputs (as autograd builds them
    when the loss and its gradients are realized together) become one `*_fwd_bwd` node with
    both results, provided the gradient fed to the helper does not depend on the loss itself.
    The logits are then streamed once (cross-entropy), or formed once instead of twice (fused
    linear + cross-entropy: three matrix products instead of four).

Each rewrite applies only where the target backend has a kernel for the new node (every
backend when fusing for autograd, `backend=None`), and is recorded in the rewrite log under the
rule's name, which `fuelgraph.explain` reports."""
from __future__ import annotations

from ..backends import kernels_for
from ..backends.base import accepts
from ..ir import ops
from ..ir.node import Node, Value, consumers, toposort
from ..registry.core import FusedOps, fused_node
from ..registry.loss import (FUSED_LINEAR_CROSS_ENTROPY, FUSED_LINEAR_CROSS_ENTROPY_BACKWARD,
                             FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD,
                             FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD,
                             FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD)
from .engine import rebuild

PASS = "loss_rules"
#: forward id -> (backward helper id, fused forward+backward id, rule name)
_PAIRS = {
    int(FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY): (FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD,
                                                FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD,
                                                "one_pass_cross_entropy"),
    int(FUSED_LINEAR_CROSS_ENTROPY): (FUSED_LINEAR_CROSS_ENTROPY_BACKWARD,
                                      FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD,
                                      "one_pass_linear_cross_entropy"),
}


def _is(n: Node, op_id) -> bool:
    return isinstance(n.op, ops.Fused) and int(n.op.id) == int(op_id)


def _supported(op_id, backend, srcs, params) -> bool:
    if backend is None:
        return True
    return any(accepts(k, [s.dtype for s in srcs], [s.shape for s in srcs], params)
               for k in kernels_for(int(op_id), backend))


def _linear_head(logits: Value):
    """((x, w, bias or None), nodes between the loss and x/w) when `logits` is x @ w.T (+ bias)
    with x [N, H] and w [V, H] -- or a 16-bit such head cast to float32, which is what the op
    computes anyway (its cross-entropy runs in float32)."""
    n = logits.node
    chain = [n]
    if (isinstance(n.op, ops.Cast) and n.op.dtype == n.srcs[0].dtype.acc != n.srcs[0].dtype
            and n.srcs[0].dtype.is_float):
        n = n.srcs[0].node
        chain.append(n)
    bias = None
    if _is(n, FusedOps.FUSED_LINEAR):
        a, b, bias = n.srcs
    elif isinstance(n.op, ops.MatMul):
        a, b = n.srcs
    else:
        return None
    if len(a.shape) != 2 or not isinstance(b.node.op, ops.Permute) or b.node.op.perm != (1, 0):
        return None
    return (a, b.node.srcs[0], bias), chain


def rewrite(outputs: list[Value], backend: str | None, log) -> list[Value]:
    """Apply the loss rewrites to the graph under `outputs` (after the fuse pass)."""
    nodes = toposort(outputs)
    if not any(isinstance(n.op, ops.Fused) and int(n.op.id) in _PAIRS for n in nodes):
        return outputs
    users = consumers(nodes)
    out_nodes = {v.node for v in outputs}
    repl: dict[Node, tuple] = {}     # node -> (rule, replacement values, log it)
    for n in nodes:
        if not _is(n, FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY):
            continue
        logits, t = n.srcs
        head = _linear_head(logits)
        if head is None or any(m in out_nodes or len(users.get(id(m), ())) != 1
                               for m in head[1]):
            continue                 # the logits are read elsewhere: they must exist anyway
        x, w, bias = head[0]
        srcs = (x, w, t) + (() if bias is None else (bias,))
        if _supported(FUSED_LINEAR_CROSS_ENTROPY, backend, srcs, n.op.params):
            new = fused_node(ops.Fused(FUSED_LINEAR_CROSS_ENTROPY, n.op.params), srcs)
            repl[n] = ("linear_head_cross_entropy", (new.out(0),), True)
    if repl:
        outputs = _apply(outputs, repl, log)
        nodes = toposort(outputs)
    if backend is None:
        return outputs
    return _merge_pairs(outputs, nodes, backend, log)


def _merge_pairs(outputs, nodes, backend, log):
    forwards = {}
    for n in nodes:
        if isinstance(n.op, ops.Fused) and int(n.op.id) in _PAIRS:
            forwards[(int(n.op.id), n.srcs, n.op.params)] = n
    repl = {}
    for n in nodes:
        for fid, (bid, fbid, rule) in _PAIRS.items():
            if not _is(n, bid):
                continue
            fwd = forwards.get((fid, n.srcs[:-1], n.op.params))
            if fwd is None or fwd in repl or fwd in toposort([n.srcs[-1]]):
                continue             # no forward here, or the grad is computed from the loss
            if not _supported(fbid, backend, n.srcs, n.op.params):
                continue
            both = fused_node(ops.Fused(fbid, n.op.params), n.srcs)
            repl[fwd] = (rule, (both.out(0),), True)
            repl[n] = (rule, tuple(both.out(i) for i in range(1, both.nout)), False)
    return _apply(outputs, repl, log) if repl else outputs


def _apply(outputs, repl, log):
    """The graph under `outputs` with each node of `repl` replaced by its values (readers
    rebuilt over the replacements)."""
    memo: dict = {}

    def remap(v: Value) -> Value:
        return memo[v.node][v.slot] if v.node in memo else v

    for n in toposort(outputs):
        hit = repl.get(n)
        if hit is not None:
            vals = hit[1]
            node = rebuild(vals[0].node, tuple(remap(s) for s in vals[0].node.srcs))
            memo[n] = tuple(Value(node, v.slot) for v in vals)
            if hit[2]:
                log.events.append((PASS, hit[0], repr(n)))
        else:
            new = rebuild(n, tuple(remap(s) for s in n.srcs))
            memo[n] = tuple(new.out(i) for i in range(new.nout))
    return [remap(v) for v in outputs]
