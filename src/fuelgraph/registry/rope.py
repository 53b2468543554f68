"""ROPE (id 5): rotary position embedding with explicit cos/sin tables (spec fused-ops.md §5,
Appendix H.13).

    y = x * cos + rot(x) * sin          x [..., S, D] (rank >= 2, D even), cos/sin [S, D]

* interleaved=False (rotate-half, GPT-NeoX / HF LLaMA): feature i pairs with i + D/2,
  rot(x) = cat([-x[..., D/2:], x[..., :D/2]], -1).
* interleaved=True (GPT-J): features 2i and 2i+1 pair,
  rot(x) = stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2).

The tables broadcast over every leading dim of x (positions are baked into them) and need not
repeat their halves. Backward emits ROPE again: dx = rope(g, cos, -swap(sin)) is the general
formula (exact for arbitrary tables, unlike the as-built `rope(g, cos, -sin)`); cos and sin get
gradients too (summed over the leading dims). Both layouts fuse from their idioms (the recipes)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FuelGraphError
from ..ir.tensor import cat, stack
from .core import BackwardKind, FusedOpEntry, FusedOps, call_fused
from .rules import check_arity, check_float, check_rank, check_same_dtype, same_as_input0

_LABELS = ["x", "cos", "sin"]


@dataclass(frozen=True)
class RopeParams:
    """interleaved: False = rotate-half (NeoX / HF), True = GPT-J pairs (2i, 2i+1)."""
    interleaved: bool = False


def rotate_half(x):
    h = x.shape[-1] // 2
    return cat([-x[..., h:], x[..., :h]], -1)


def rotate_every_two(x):
    return stack([-x[..., 1::2], x[..., 0::2]], -1).reshape(x.shape)


def rope_recipe(x, cos, sin, interleaved=False):
    rot = rotate_every_two(x) if interleaved else rotate_half(x)
    return x * cos + rot * sin


def swap_halves(t):
    h = t.shape[-1] // 2
    return cat([t[..., h:], t[..., :h]], -1)


def swap_pairs(t):
    return stack([t[..., 1::2], t[..., 0::2]], -1).reshape(t.shape)


def _vjp(xs, ys, gs, p):
    """dx is itself a rotation of g: rope(g, cos, -swap(sin)) is exactly the general formula
    (dx[i] = g[i]cos[i] + g[i+h]sin[i+h], dx[i+h] = g[i+h]cos[i+h] - g[i]sin[i] for
    rotate-half; swap pairs instead of halves for GPT-J). dcos/dsin sum over leading dims."""
    x, cos, sin = xs
    g = gs[0]
    swap = swap_pairs if p.interleaved else swap_halves
    dx = call_fused(FusedOps.ROPE, g, cos, -swap(sin), interleaved=p.interleaved)
    lead = tuple(range(x.ndim - 2))
    rot = rotate_every_two(x) if p.interleaved else rotate_half(x)
    dcos, dsin = g * x, g * rot
    if lead:
        dcos, dsin = dcos.sum(lead), dsin.sum(lead)
    return [dx, dcos, dsin]


def _validate(srcs, params):
    name = "rope"
    check_arity(name, srcs, 3)
    check_float(name, srcs, labels=_LABELS)
    check_same_dtype(name, srcs, (0, 1, 2), _LABELS)
    x = srcs[0]
    check_rank(name, x, "x", 2)
    s, d = x.shape[-2], x.shape[-1]
    if d % 2:
        raise FuelGraphError(f"rope: x has shape {x.shape}, expected an even last dimension "
                             f"(head dim D = {d} is odd)")
    for i in (1, 2):
        if tuple(srcs[i].shape) != (s, d):
            raise FuelGraphError(f"rope: {_LABELS[i]} has shape {tuple(srcs[i].shape)}, expected "
                                 f"exactly [S, D] = {[s, d]} for x of shape {x.shape}")
    if not isinstance(params.interleaved, (bool, np.bool_)):
        raise FuelGraphError(f"rope: param interleaved must be a bool, got {params.interleaved!r}")


def _sample(rng):
    return [rng.standard_normal((2, 3, 4, 8)).astype(np.float32),
            rng.standard_normal((4, 8)).astype(np.float32),
            rng.standard_normal((4, 8)).astype(np.float32)]


def declare(reg):
    reg.add(FusedOpEntry(
        id=FusedOps.ROPE, name="rope", family="forward", params=RopeParams,
        shape_rule=same_as_input0, dtype_rule=same_as_input0, validate=_validate,
        decompose=rope_recipe, backward=BackwardKind.fused(FusedOps.ROPE), vjp=_vjp,
        pattern_variants=({"interleaved": False}, {"interleaved": True}),
        sample=_sample,
        doc="Rotary embedding y = x * cos + rot(x) * sin. x [..., S, D] float (rank >= 2, D "
            "even), cos and sin exactly [S, D] with x's dtype (broadcast over the leading "
            "dims) -> y, shape and dtype of x. interleaved=False: rotate-half (NeoX / HF), "
            "rot(x) = cat(-x[..., D/2:], x[..., :D/2]); interleaved=True: GPT-J pairs (2i, 2i+1), "
            "rot(x)[2i] = -x[2i+1], rot(x)[2i+1] = x[2i]. Differentiable in x, cos and sin."))



# ---- builders (re-exported by fuelgraph.functional) ----------------------------------------
def rope(x, cos, sin, interleaved: bool = False):
    """Rotary embedding x * cos + rot(x) * sin. x [..., S, D] (rank >= 2, D even), cos/sin
    exactly [S, D] with x's dtype (HF layout, broadcast over the leading dims) -> shape and dtype
    of x. interleaved=False: rotate-half (NeoX / HF), rot(x) = cat(-x[..., D/2:], x[..., :D/2]);
    interleaved=True: GPT-J pairs (2i, 2i+1)."""
    return call_fused(FusedOps.ROPE, x, cos, sin, interleaved=interleaved)
