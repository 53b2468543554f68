"""ROPE (id 5): rotary position embedding with explicit cos/sin tables.

    y = x * cos + rot(x) * sin          x [..., S, D] (rank >= 2, D even), cos/sin [..., S, D]

* interleaved=False (rotate-half, GPT-NeoX / HF LLaMA): feature i pairs with i + D/2,
  rot(x) = cat([-x[..., D/2:], x[..., :D/2]], -1).
* interleaved=True (GPT-J): features 2i and 2i+1 pair,
  rot(x) = stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2).

The tables end in exactly [S, D] and broadcast to x's shape: [S, D] tables are shared by every
leading dim, per-batch tables such as Hugging Face's [B, 1, S, D] (built from position_ids and
unsqueezed over the heads) give each batch its own positions. Tables need not repeat their
halves. Backward emits ROPE again: dx = rope(g, cos, -swap(sin)) is the general formula (exact
for arbitrary tables, unlike the as-built `rope(g, cos, -sin)`); cos and sin get gradients too
(summed back to their own shapes). Both layouts fuse from their idioms (the recipes)."""
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
    rotate-half; swap pairs instead of halves for GPT-J). dcos/dsin sum over the dims the
    tables were broadcast along."""
    x, cos, sin = xs
    g = gs[0]
    swap = swap_pairs if p.interleaved else swap_halves
    dx = call_fused(FusedOps.ROPE, g, cos, -swap(sin), interleaved=p.interleaved)
    rot = rotate_every_two(x) if p.interleaved else rotate_half(x)
    return [dx, _sum_to(g * x, cos.shape), _sum_to(g * rot, sin.shape)]


def _sum_to(t, shape):
    """t summed over the axes that broadcasting `shape` to t's shape added or stretched."""
    lead = t.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape)
                                      if d == 1 and t.shape[lead + i] != 1)
    return t.sum(axes).reshape(shape) if axes else t


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
        t = tuple(srcs[i].shape)
        lead, t_lead = tuple(x.shape[:-2]), t[:-2]
        if t[-2:] != (s, d) or len(t_lead) > len(lead) or any(
                a not in (1, b) for a, b in zip(reversed(t_lead), reversed(lead))):
            raise FuelGraphError(f"rope: {_LABELS[i]} has shape {t}, expected [..., S, D] ending "
                                 f"in exactly [S, D] = {[s, d]} and broadcastable to x of shape "
                                 f"{tuple(x.shape)} (each leading dim 1 or x's)")
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
            "even), cos and sin [..., S, D] with x's dtype, ending in exactly [S, D] and "
            "broadcastable to x (e.g. [S, D] for every batch, or per-batch [B, 1, S, D] for x "
            "[B, H, S, D]) -> y, shape and dtype of x. interleaved=False: rotate-half (NeoX / HF), "
            "rot(x) = cat(-x[..., D/2:], x[..., :D/2]); interleaved=True: GPT-J pairs (2i, 2i+1), "
            "rot(x)[2i] = -x[2i+1], rot(x)[2i+1] = x[2i]. Differentiable in x, cos and sin."))



# ---- builders (re-exported by fuelgraph.functional) ----------------------------------------
def rope(x, cos, sin, interleaved: bool = False):
    """Rotary embedding x * cos + rot(x) * sin. x [..., S, D] (rank >= 2, D even); cos/sin
    [..., S, D] with x's dtype, ending in exactly [S, D] and broadcastable to x's shape ([S, D]
    shared by every leading dim, or per batch such as HF's [B, 1, S, D] for x [B, H, S, D])
    -> shape and dtype of x. interleaved=False: rotate-half (NeoX / HF),
    rot(x) = cat(-x[..., D/2:], x[..., :D/2]); interleaved=True: GPT-J pairs (2i, 2i+1)."""
    return call_fused(FusedOps.ROPE, x, cos, sin, interleaved=interleaved)
