"""`scan`: the builder of the Scan primitive, in the style of `jax.lax.scan`.

    finals, ys = fg.scan(fn, init=[h0], xs=[x], consts=[a, b])
    # fn(carries: list[Tensor], x_t: list[Tensor], consts: list[Tensor])
    #     -> (new_carries: list[Tensor], y_t: list[Tensor])

`fn` is traced once on placeholder leaves (Input nodes bound to no data) shaped like one step:
carries like `init`, x_t like `xs[i][t]` (the leading axis dropped), consts like `consts`. The
traced sub-graph is a closed `ops.Body`; a tensor from outside that `fn` reads must be passed
through `consts` (a FuelGraphError says so otherwise). Every carry must keep its shape and dtype.
`reverse=True` walks t = L-1 .. 0; ys stay indexed by t. Gradients: see `fuelgraph.scan_grad`.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..errors import FuelGraphError
from . import ops
from .node import Value, make_node, toposort
from .tensor import _INPUT_UID, Tensor


def placeholder(shape, dtype, device="cpu") -> Tensor:
    """A fresh Input leaf bound to no buffer: a formal parameter of a sub-graph (scan body)."""
    op = ops.Input(next(_INPUT_UID), tuple(int(d) for d in shape), dtype, device)
    return Tensor(make_node(op, ()).out(0))


def make_body(inputs: Sequence[Value], outputs: Sequence[Value], what: str = "scan") -> ops.Body:
    """A closed Body; raises if the outputs reach an Input leaf that is not one of `inputs`."""
    inputs, outputs = tuple(inputs), tuple(outputs)
    allowed = {v.node for v in inputs}
    for n in toposort(outputs):
        if isinstance(n.op, ops.Input) and n not in allowed:
            raise FuelGraphError(
                f"{what}: the body reads a tensor from outside it (shape {n.op.shape}, dtype "
                f"{n.op.dtype.name}) that is not one of its carries, xs or consts; pass it in "
                f"consts (or build constants inside the body with fg.const / fg.full)")
    return ops.Body(inputs, outputs)


def build_scan(body: ops.Body, init: Sequence[Tensor], xs: Sequence[Tensor],
               consts: Sequence[Tensor], length: int, reverse: bool):
    """Make the Scan node; returns (final carries, ys) as lists of Tensors."""
    nc = len(init)
    srcs = tuple(t.value for t in list(init) + list(xs) + list(consts))
    n = make_node(ops.Scan(body, nc, len(xs), int(length), bool(reverse)), srcs)
    outs = [Tensor(n.out(i)) for i in range(n.nout)]
    return outs[:nc], outs[nc:]


def _tensor_list(obj, what: str) -> list[Tensor]:
    if obj is None:
        return []
    if isinstance(obj, Tensor):
        return [obj]
    try:
        items = list(obj)
    except TypeError:
        raise FuelGraphError(f"scan: {what} must be a Tensor or a sequence of Tensors, "
                             f"got {type(obj).__name__}") from None
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            raise FuelGraphError(f"scan: {what}[{i}] is a {type(t).__name__}, expected a Tensor")
    return items


def scan(fn: Callable, init, xs=(), consts=(), length: int | None = None,
         reverse: bool = False) -> tuple[list[Tensor], list[Tensor]]:
    """Run `fn` over the leading axis of `xs`, threading `init` through as carries.

    init: carries (Tensor or list); xs: per-step inputs, each [L, ...]; consts: tensors read at
    every step. fn(carries, x_t, consts) -> (new_carries, y_t) with lists of Tensors (a single
    Tensor or None is accepted for either). Returns (final carries, ys), ys[i] = stack of the
    y_t[i] over t, shape [L, ...]. `length` is required when there are no xs."""
    init = _tensor_list(init, "init")
    xs = _tensor_list(xs, "xs")
    consts = _tensor_list(consts, "consts")
    for i, x in enumerate(xs):
        if x.ndim == 0:
            raise FuelGraphError(f"scan: xs[{i}] is 0-d; xs need a leading (time) axis")
    if xs:
        L = xs[0].shape[0]
        for i, x in enumerate(xs[1:], 1):
            if x.shape[0] != L:
                raise FuelGraphError(f"scan: xs[{i}] has length {x.shape[0]} (shape {x.shape}), "
                                     f"expected {L} like xs[0]")
        if length is not None and int(length) != L:
            raise FuelGraphError(f"scan: length={length} but xs have length {L}")
    else:
        if length is None:
            raise FuelGraphError("scan: pass length= when there are no xs")
        L = int(length)
    if L < 0:
        raise FuelGraphError(f"scan: length must be >= 0, got {L}")
    devs = {t.device for t in init + xs + consts}
    if len(devs) > 1:
        raise FuelGraphError(f"scan: inputs live on different devices {sorted(devs)}")
    c_ph = [placeholder(t.shape, t.dtype, t.device) for t in init]
    x_ph = [placeholder(t.shape[1:], t.dtype, t.device) for t in xs]
    k_ph = [placeholder(t.shape, t.dtype, t.device) for t in consts]
    res = fn(list(c_ph), list(x_ph), list(k_ph))
    if not isinstance(res, (tuple, list)) or len(res) != 2:
        raise FuelGraphError("scan: fn must return a pair (new_carries, y_t)")
    new_c = _tensor_list(res[0], "new_carries (fn's first result)")
    ys = _tensor_list(res[1], "y_t (fn's second result)")
    if len(new_c) != len(init):
        raise FuelGraphError(f"scan: fn returned {len(new_c)} carries, expected {len(init)}")
    for i, (a, b) in enumerate(zip(init, new_c)):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise FuelGraphError(f"scan: carry {i} changes from {a.shape} {a.dtype.name} to "
                                 f"{b.shape} {b.dtype.name}; a carry must keep its shape and dtype")
    body = make_body([t.value for t in c_ph + x_ph + k_ph], [t.value for t in new_c + ys])
    return build_scan(body, init, xs, consts, L, reverse)
