"""Paged attention over a block-pool KV cache, and the cache write that fills the pool.

* PAGED_ATTN (id 13)            attention of new queries over each sequence's cached keys, read
                                through a block table                     backward: not differentiable
* PAGED_CACHE_WRITE (id 0x120)  scatter new k (or v) rows into the pool, in place when safe
                                                                          backward: not differentiable
* PAGED_CACHE_WRITE_KV (0x121)  the same for k and v into their two pools at once (one launch)
                                                                          backward: not differentiable

Cache layout (the FlashAttention-2 paged layout): `k_cache`, `v_cache` `[num_blocks, block_size,
Hkv, D]`. Token `j` of sequence `b` lives at block `block_table[b, j // block_size]`, row
`j % block_size`. `context_lens[b]` counts the sequence's live tokens, the `Sq` new ones included.

Mask rules of paged_attn: query row `i` of sequence `b` sits at absolute position
`a_i = context_lens[b] - Sq + i` and sees keys `j <= a_i` (bottom-right aligned causal mask; for
Sq = 1 that is just the length mask `j < context_lens[b]`). A sequence with `context_lens[b] == 0`
outputs zeros. ALiBi as FlashAttention-2: bias `-slope[h] * |a_i - j|`; softcap
`c * tanh(s / c)` is applied to the scaled score before the bias and the mask.

Invalid lengths (`0 < context_len < Sq`, `context_len > max_blocks * block_size`, a negative
int32 length) and live block-table entries outside `[0, num_blocks)` raise FuelGraphError: while
the graph is built when the index tensors' values are known there (host constants and CPU
inputs), else when the kernel runs. Entries past a sequence's live blocks are never read (pad
them with the index type's maximum). The recipe cannot raise on data: it never reads out of range
(indices are clamped) and returns NaN rows for such a sequence instead of a wrong number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .. import dtype as dt
from ..errors import FuelGraphError
from ..ir import ops
from ..ir.tensor import _DATA, arange, full, where
from .core import BackwardKind, FusedOpEntry, FusedOpId, FusedOps, call_fused
from .rules import check_arity, check_float, real_param

PAGED_CACHE_WRITE = FusedOpId(0x120)
PAGED_CACHE_WRITE_KV = FusedOpId(0x121)
INDEX_DTYPES = (dt.int32, dt.uint32)
_ATTN = "paged_attn"
_WRITE = "paged_cache_write"


@dataclass(frozen=True)
class PagedAttnParams:
    """softmax_scale: multiplier of q.k (finite); softcap: logit cap c > 0, or None."""
    softmax_scale: float
    softcap: float | None = None


@dataclass(frozen=True)
class PagedCacheWriteParams:
    """No parameters: the slot of every new row comes from the slot_mapping input."""


# ---- data checks shared by validation and kernels ------------------------------------------
def index_max(np_dtype) -> int:
    """The padding value of an index dtype (its maximum)."""
    return int(np.iinfo(np_dtype).max)


def check_lengths(name, lens, table, sq, num_blocks, block_size, max_blocks):
    """Raise FuelGraphError for an invalid context length or a live block id outside the pool.
    lens [B], table [B, max_blocks]: NumPy integer arrays (table None: its entries unchecked)."""
    lens = np.asarray(lens).astype(np.int64)
    cap = max_blocks * block_size
    bad = (lens < 0) | ((lens > 0) & (lens < sq)) | (lens > cap)
    if bad.any():
        b = int(np.argmax(bad))
        n = int(lens[b])
        if n < 0:
            raise FuelGraphError(f"{name}: context_lens[{b}] = {n} is negative")
        if n < sq:
            raise FuelGraphError(f"{name}: context_lens[{b}] = {n} is smaller than the {sq} new "
                                 f"query tokens (Sq); it must be 0 or >= Sq")
        raise FuelGraphError(f"{name}: context_lens[{b}] = {n} exceeds max_blocks * "
                             f"block_size = {max_blocks} * {block_size} = {cap}")
    if table is None:
        return
    live = np.arange(max_blocks)[None, :] * block_size < lens[:, None]
    t = np.asarray(table).astype(np.int64)
    bad = live & ((t < 0) | (t >= num_blocks))
    if bad.any():
        b, m = (int(v) for v in np.argwhere(bad)[0])
        raise FuelGraphError(f"{name}: block_table[{b}, {m}] = {int(t[b, m])} is not a block of "
                             f"the pool (num_blocks = {num_blocks}) but holds live tokens of "
                             f"sequence {b} (context_lens[{b}] = {int(lens[b])})")


def check_slots(name, slots, capacity, check_repeats=True):
    """Raise for a slot outside [0, capacity) other than the skip value, or a repeated slot."""
    s = np.asarray(slots)
    skip = index_max(s.dtype)
    s = s.astype(np.int64)
    live = s[s != skip]
    bad = (live < 0) | (live >= capacity)
    if bad.any():
        raise FuelGraphError(f"{name}: slot_mapping holds {int(live[bad][0])}, outside the pool "
                             f"of {capacity} slots (num_blocks * block_size); use {skip} to skip "
                             f"a row")
    if check_repeats and live.size != np.unique(live).size:
        u, c = np.unique(live, return_counts=True)
        raise FuelGraphError(f"{name}: slot_mapping writes slot {int(u[c > 1][0])} more than once")


def _known(src):
    """The values of an index tensor when the graph already holds them on the host (a constant,
    a fill, or a CPU input), else None."""
    node = getattr(src, "node", None)
    op = getattr(node, "op", None)
    if isinstance(op, ops.Const):
        return op.array
    if isinstance(op, ops.Full):
        return np.full(op.shape, op.value, op.dtype.np)
    if isinstance(op, ops.Input):
        data = _DATA.get(node)
        return data if isinstance(data, np.ndarray) else None
    return None


# ---- validation -------------------------------------------------------------------------------
def _check_index(name, src, label, rank):
    if src.dtype not in INDEX_DTYPES:
        raise FuelGraphError(f"{name}: {label} has dtype {src.dtype.name}, expected int32 or uint32")
    if len(src.shape) != rank:
        raise FuelGraphError(f"{name}: {label} has shape {src.shape}, expected rank {rank}")


def _real(name, label, v, positive=False):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or \
            not math.isfinite(float(v)) or (positive and v <= 0):
        want = "a finite number > 0" if positive else "a finite number"
        raise FuelGraphError(f"{name}: {label} is {v!r}, expected {want}")


def _validate_attn(srcs, params):
    n = _ATTN
    check_arity(n, srcs, 5, 6)
    q, kc, vc, table, lens = srcs[:5]
    labels = ["q", "k_cache", "v_cache", "block_table", "context_lens", "alibi_slopes"]
    check_float(n, srcs, which=[0, 1, 2], labels=labels)
    for s, label in ((q, "q"), (kc, "k_cache"), (vc, "v_cache")):
        if len(s.shape) != 4:
            want = "[B, Hq, Sq, D]" if label == "q" else "[num_blocks, block_size, Hkv, D]"
            raise FuelGraphError(f"{n}: {label} has shape {s.shape}, expected rank 4 {want}")
    for s, label in ((kc, "k_cache"), (vc, "v_cache")):
        if s.dtype != q.dtype:
            raise FuelGraphError(f"{n}: {label} has dtype {s.dtype.name}, expected {q.dtype.name} "
                                 f"(same as q)")
    if vc.shape != kc.shape:
        raise FuelGraphError(f"{n}: v_cache has shape {vc.shape}, expected {kc.shape} (same as "
                             f"k_cache)")
    B, hq, sq, d = q.shape
    nb, bs, hkv, dk = kc.shape
    if nb < 1 or bs < 1 or hkv < 1 or d < 1:
        raise FuelGraphError(f"{n}: k_cache has shape {kc.shape} and q {q.shape}; num_blocks, "
                             f"block_size, Hkv and D must be >= 1")
    if dk != d:
        raise FuelGraphError(f"{n}: k_cache has head dim {dk}, expected {d} (q.shape[3])")
    if hq % hkv:
        raise FuelGraphError(f"{n}: q has {hq} heads, not a multiple of the cache's {hkv} kv "
                             f"heads (Hq % Hkv must be 0)")
    _check_index(n, table, "block_table", 2)
    _check_index(n, lens, "context_lens", 1)
    if table.shape[0] != B or lens.shape[0] != B:
        raise FuelGraphError(f"{n}: block_table {table.shape} and context_lens {lens.shape} must "
                             f"have B = {B} rows (q.shape[0])")
    if table.shape[1] < 1:
        raise FuelGraphError(f"{n}: block_table has shape {table.shape}, expected max_blocks >= 1")
    if len(srcs) == 6:
        a = srcs[5]
        if a.dtype not in (dt.float32, q.dtype):
            raise FuelGraphError(f"{n}: alibi_slopes has dtype {a.dtype.name}, expected float32 "
                                 f"(or {q.dtype.name}, q's dtype)")
        if tuple(a.shape) not in ((hq,), (B, hq)):
            raise FuelGraphError(f"{n}: alibi_slopes has shape {a.shape}, expected ({hq},) or "
                                 f"({B}, {hq})")
    _real(n, "softmax_scale", params.softmax_scale)
    if params.softcap is not None:
        _real(n, "softcap", params.softcap, positive=True)
    lens_v = _known(lens)
    if lens_v is not None:
        check_lengths(n, lens_v, _known(table), sq, nb, bs, table.shape[1])


def _validate_write(srcs, params):
    n = _WRITE
    check_arity(n, srcs, 3)
    cache, new, slots = srcs
    check_float(n, srcs, which=[0, 1], labels=["cache", "new", "slot_mapping"])
    if len(cache.shape) != 4 or min(cache.shape) < 1:
        raise FuelGraphError(f"{n}: cache has shape {cache.shape}, expected rank 4 "
                             f"[num_blocks, block_size, Hkv, D] with every extent >= 1")
    if new.dtype != cache.dtype:
        raise FuelGraphError(f"{n}: new has dtype {new.dtype.name}, expected {cache.dtype.name} "
                             f"(same as cache)")
    if len(new.shape) != 3 or tuple(new.shape[1:]) != tuple(cache.shape[2:]):
        raise FuelGraphError(f"{n}: new has shape {new.shape}, expected [N, {cache.shape[2]}, "
                             f"{cache.shape[3]}] (N rows of [Hkv, D])")
    _check_index(n, slots, "slot_mapping", 1)
    if slots.shape[0] != new.shape[0]:
        raise FuelGraphError(f"{n}: slot_mapping has shape {slots.shape}, expected "
                             f"({new.shape[0]},) (one slot per new row)")
    known = _known(slots)
    if known is not None:
        check_slots(n, known, cache.shape[0] * cache.shape[1])


# ---- recipes (primitives only) ------------------------------------------------------------------
def paged_attn_recipe(q, k_cache, v_cache, block_table, context_lens, *alibi, softmax_scale,
                      softcap=None):
    """Gather every table entry's block (entries past the live blocks, or outside the pool, read
    block 0 instead), then dense attention over max_blocks * block_size keys with the length +
    causal mask, in acc(T). Cost scales with the table's capacity, not the live tokens."""
    B, hq, sq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    mb = block_table.shape[1]
    g, L = hq // hkv, mb * bs
    acc, dev, i64 = q.dtype.acc, q.device, dt.int64
    lens = context_lens.astype(i64)                                   # [B]
    table = block_table.astype(i64)                                   # [B, MB]
    live = arange(0, L, bs, dtype=i64, device=dev).reshape(1, mb) < lens.reshape(B, 1)
    inside = (table >= 0) & (table < nb)
    safe = where(live & inside, table, 0)                             # never read out of range
    bad = (lens < 0) | (lens > L) | ((lens > 0) & (lens < sq)) | \
        (where(inside, 0, live.astype(i64)).sum(-1) > 0)               # [B]

    def dense(cache):                                                 # [B, Hkv, L, D] in acc
        x = cache.take(safe.reshape(B * mb), 0).reshape(B, L, hkv, d)
        return x.permute(0, 2, 1, 3).astype(acc)

    kd, vd = dense(k_cache), dense(v_cache)
    qg = q.astype(acc).reshape(B, hkv, g * sq, d)                     # GQA: q heads of one kv head
    s = (qg @ kd.transpose(-2, -1) * softmax_scale).reshape(B, hq, sq, L)
    if softcap is not None:
        s = (s / softcap).tanh() * softcap
    a = lens.reshape(B, 1) - sq + arange(sq, dtype=i64, device=dev).reshape(1, sq)   # [B, Sq]
    j = arange(L, dtype=i64, device=dev).reshape(1, 1, L)
    rel = a.reshape(B, sq, 1) - j                                     # a_i - j, [B, Sq, L]
    if alibi:
        slopes = alibi[0].astype(acc).reshape((1, hq, 1, 1) if alibi[0].ndim == 1 else (B, hq, 1, 1))
        s = s - slopes * rel.abs().astype(acc).reshape(B, 1, sq, L)
    adm = (rel >= 0).reshape(B, 1, sq, L)
    s = where(adm, s, float("-inf"))
    m = s.max(-1, keepdim=True)
    m = where(m == float("-inf"), 0.0, m)                             # fully masked row
    p = (s - m).exp()
    den = p.sum(-1, keepdim=True)
    o = (p.reshape(B, hkv, g * sq, L) @ vd).reshape(B, hq, sq, d)
    o = o / where(den > 0, den, 1.0)
    o = where(bad.reshape(B, 1, 1, 1), float("nan"), o)
    return o.astype(q.dtype)


def paged_cache_write_recipe(cache, new, slot_mapping):
    """Functional form: rows of `new` land at their slots (slot = block * block_size + row);
    rows whose slot is the index type's maximum are skipped. A slot outside the pool, or written
    twice, turns the whole result into NaN (the kernels raise)."""
    nb, bs, hkv, d = cache.shape
    n = new.shape[0]
    cap, w = nb * bs, hkv * d
    skip = index_max(slot_mapping.dtype.np)
    s = slot_mapping.astype(dt.int64)
    ok = (s != skip) & (s >= 0) & (s < cap)
    bad_slot = (s != skip) & (ok == False)                            # noqa: E712
    dst = where(ok, s, cap).reshape(n, 1)                             # row `cap` is a sink
    flat = cache.reshape(cap, w)
    rows = new.reshape(n, w)
    placed = full((cap + 1, w), 0, cache.dtype, cache.device).scatter_add(
        0, dst.broadcast_to(n, w), rows)
    hits = full((cap + 1, 1), 0, cache.dtype, cache.device).scatter_add(
        0, dst, full((n, 1), 1, cache.dtype, cache.device))[:cap]
    out = where(hits > 0, placed[:cap], flat)
    broken = (bad_slot.astype(dt.int64).sum() > 0) | ((hits > 1).astype(dt.int64).sum() > 0)
    out = where(broken, float("nan"), out)
    return out.reshape(nb, bs, hkv, d)


# ---- shape / dtype rules, samples --------------------------------------------------------------
def _attn_shape(shapes, params):
    return [tuple(shapes[0])]


def _attn_dtype(dtypes, params):
    return [dtypes[0]]


def attn_sample(rng, *, alibi=True):
    """q [2, 4, 3, 8]; pool of 7 blocks of 4 rows, 2 kv heads; shuffled tables, padded."""
    q = rng.standard_normal((2, 4, 3, 8)).astype(np.float32)
    kc = rng.standard_normal((7, 4, 2, 8)).astype(np.float32)
    vc = rng.standard_normal((7, 4, 2, 8)).astype(np.float32)
    pad = index_max(np.int32)
    table = np.array([[5, 1, 3, pad], [2, 6, pad, pad]], np.int32)
    lens = np.array([11, 7], np.int32)
    out = [q, kc, vc, table, lens]
    if alibi:
        out.append((2.0 ** -np.arange(1, 5)).astype(np.float32))
    return out


def _validate_write_kv(srcs, params):
    check_arity(_WRITE + "_kv", srcs, 5)
    kc, vc, kn, vn, slots = srcs
    if tuple(kc.shape) != tuple(vc.shape) or kc.dtype != vc.dtype:
        raise FuelGraphError(f"{_WRITE}_kv: v_cache is {vc.shape} {vc.dtype.name}, expected "
                             f"k_cache's {kc.shape} {kc.dtype.name}")
    _validate_write((kc, kn, slots), params)
    _validate_write((vc, vn, slots), params)


def paged_cache_write_kv_recipe(k_cache, v_cache, k_new, v_new, slot_mapping):
    """Both writes of paged_cache_write, sharing the slot mapping."""
    return (paged_cache_write_recipe(k_cache, k_new, slot_mapping),
            paged_cache_write_recipe(v_cache, v_new, slot_mapping))


def _write_kv_sample(rng):
    kc, kn, slots = _write_sample(rng)
    vc, vn, _ = _write_sample(rng)
    return [kc, vc, kn, vn, slots]


def _write_sample(rng):
    cache = rng.standard_normal((5, 4, 2, 8)).astype(np.float32)
    new = rng.standard_normal((3, 2, 8)).astype(np.float32)
    slots = np.array([17, 2, index_max(np.int32)], np.int32)
    return [cache, new, slots]


# ---- fusion: the recipe fuses back ---------------------------------------------------------------
# One pattern per form (with or without ALiBi slopes, with or without a softcap); softmax_scale
# is located by its sentinel, the softcap read off the constant that multiplies the tanh. Only
# the recipe's guarded form fuses: attention written plainly over the gathered blocks differs
# from paged_attn on valid inputs (a sequence with context_lens 0 is NaN in a written softmax,
# zeros in paged_attn), and whether that happens is in the data, which a plan cached by
# structure cannot see.
def _form(alibi, softcap, dtype):
    """The recipe's form with or without ALiBi and softcap, traced in `dtype` (a 16-bit recipe
    casts to float32 and back: another pattern)."""
    def recipe(*xs, **params):
        return paged_attn_recipe(*xs, **params)

    def sample(rng):
        xs = attn_sample(rng, alibi=alibi)
        return [x.astype(dtype) for x in xs[:3]] + xs[3:]
    recipe.sample = sample
    recipe.softcap = softcap
    recipe.__name__ = recipe.__qualname__ = (f"paged_attn_recipe{'_alibi' if alibi else ''}"
                                             f"{'_softcap' if softcap else ''}_{dtype.__name__}")
    return recipe, ({"softcap": 30.0} if softcap else {})


def plain_paged_attention(q, k_cache, v_cache, block_table, context_lens, softmax_scale=1.0,
                          softcap=None):
    """Attention as first written over a paged cache (Hq == Hkv): gather the table's blocks,
    mask keys past each query's position, softmax, no guard for an empty sequence. Never
    fused (see above); its pattern only lets `fg.explain` say why."""
    B, hq, sq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    L = block_table.shape[1] * bs
    idx = block_table.astype(dt.int64).reshape(-1)

    def dense(cache):
        return cache.take(idx, 0).reshape(B, L, hkv, d).permute(0, 2, 1, 3)

    s = q @ dense(k_cache).mT * softmax_scale
    pos = context_lens.astype(dt.int64).reshape(B, 1) - sq + arange(sq, device=q.device).reshape(1, sq)
    mask = arange(L, device=q.device).reshape(1, 1, L) <= pos.reshape(B, sq, 1)
    s = where(mask.reshape(B, 1, sq, L), s, float("-inf"))
    e = (s - s.max(-1, keepdim=True)).exp()
    return (e / e.sum(-1, keepdim=True)) @ dense(v_cache)


def _plain_sample(rng):
    xs = attn_sample(rng, alibi=False)
    return [xs[0][:, :2]] + xs[1:]


plain_paged_attention.sample = _plain_sample
plain_paged_attention.diagnostic = True
_FORMS = tuple(_form(alibi, cap, dtype) for dtype in (np.float32, ml_dtypes.bfloat16)
               for alibi in (False, True) for cap in (False, True)) + ((plain_paged_attention, {}),)


def _read_attn(bound):
    """The softcap: the constant multiplying the tanh of the scaled scores."""
    if getattr(bound.pattern.recipe, "diagnostic", False):
        raise ValueError(
            "attention written over gathered cache blocks is not fused into paged_attn: a "
            "sequence with context_lens 0 gives NaN rows in a written softmax and zeros in "
            "paged_attn, and the lengths are data the cached plan cannot see; call "
            "F.paged_attn, or write the guards as registry.paged.paged_attn_recipe does")
    if not getattr(bound.pattern.recipe, "softcap", False):
        return {}
    tanh = next(n for n in bound.nodes_of(ops.Unary) if n.op.kind == "tanh")
    for g in bound.bind.values():
        n = g.node
        if isinstance(n.op, ops.Binary) and n.op.kind == "mul" and \
                any(s.node is tanh for s in n.srcs):
            c = next((s.node.op for s in n.srcs if isinstance(s.node.op, ops.Full)), None)
            if c is not None:
                return {"softcap": float(c.value)}
    raise ValueError("softcap constant not found")


def paged_attn_work(shapes) -> tuple[int, int]:
    """(flops, bytes) of paged_attn for its input shapes, an upper bound from the block table's
    capacity (the live tokens are data, known only at run time); kernels' cost functions."""
    (B, hq, sq, d), (_, bs, hkv, _) = shapes[0], shapes[1]
    keys = shapes[3][1] * bs
    return 4 * B * hq * sq * keys * d, 2 * (2 * B * hkv * keys * d + 2 * B * hq * sq * d)


def declare(reg):
    reg.add(FusedOpEntry(
        id=FusedOps.PAGED_ATTN, name=_ATTN, family="attention", params=PagedAttnParams,
        shape_rule=_attn_shape, dtype_rule=_attn_dtype, validate=_validate_attn,
        decompose=paged_attn_recipe, backward=BackwardKind.NOT_DIFFERENTIABLE,
        pattern_variants=None, extra_patterns=_FORMS, read_params=_read_attn,
        pattern_needs=(ops.Take,),
        sample=attn_sample,
        doc="Paged attention. q [B, Hq, Sq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, "
            "D] (q's float dtype, Hq % Hkv == 0); block_table [B, max_blocks] and context_lens "
            "[B] int32/uint32; optional alibi_slopes [Hq] or [B, Hq] float32 -> [B, Hq, Sq, D] "
            "in q's dtype. Query i of sequence b sits at a = context_lens[b] - Sq + i and sees "
            "keys j <= a (bottom-right causal); context_lens[b] == 0 gives zeros; softcap then "
            "ALiBi -slope*|a - j|; accumulates in float32 (float64 for float64). "
            "0 < context_len < Sq, context_len > max_blocks * block_size, or a live table entry "
            "outside the pool raises. Not differentiable. Fuses from its recipe (the guarded form); "
            "attention written plainly over gathered blocks does not fuse (an empty sequence "
            "differs) and explain says so."))
    reg.add(FusedOpEntry(
        id=PAGED_CACHE_WRITE, name=_WRITE, family="forward", params=PagedCacheWriteParams,
        shape_rule=_attn_shape, dtype_rule=_attn_dtype, validate=_validate_write,
        decompose=paged_cache_write_recipe, backward=BackwardKind.NOT_DIFFERENTIABLE,
        destructive_inputs=(0,), pattern_variants=None, sample=_write_sample,
        doc="Write new k (or v) rows into a paged cache. cache [num_blocks, block_size, Hkv, D] "
            "float (destructive: overwritten when no later reader needs it), new [N, Hkv, D] "
            "same dtype, slot_mapping [N] int32/uint32 (slot = block * block_size + row; the "
            "type's maximum skips the row) -> the cache with those rows replaced. A slot outside "
            "the pool or written twice raises. Not differentiable."))
    reg.add(FusedOpEntry(
        id=PAGED_CACHE_WRITE_KV, name=_WRITE + "_kv", family="forward",
        params=PagedCacheWriteParams, shape_rule=lambda shapes, p: [shapes[0], shapes[1]],
        dtype_rule=lambda dtypes, p: [dtypes[0], dtypes[1]], validate=_validate_write_kv,
        decompose=paged_cache_write_kv_recipe, backward=BackwardKind.NOT_DIFFERENTIABLE,
        outputs=("k_cache", "v_cache"), destructive_inputs=(0, 1), pattern_variants=None,
        sample=_write_kv_sample,
        doc="paged_cache_write of a step's keys and values at once: k_cache, v_cache [num_blocks, "
            "block_size, Hkv, D] (one shape and float dtype, both destructive), k_new, v_new "
            "[N, Hkv, D], slot_mapping [N] int32/uint32 shared by both -> (k_cache, v_cache) with "
            "those rows replaced. One launch for both pools on the GPU. Not differentiable."))


# ---- public builders ----------------------------------------------------------------------------
def paged_attn(q, k_cache, v_cache, block_table, context_lens, alibi_slopes=None,
               softmax_scale=None, softcap=None):
    """Attention of new queries over a paged KV cache (decode, or chunked prefill when Sq > 1).

    q `[B, Hq, Sq, D]`: the queries of the Sq newest tokens of each of the B sequences.
    k_cache, v_cache `[num_blocks, block_size, Hkv, D]`: the block pool (q's dtype: float32,
    float64, bfloat16 or float16); `Hq % Hkv == 0` and query heads `h` use kv head
    `h // (Hq // Hkv)` (grouped-query / multi-query attention).
    block_table `[B, max_blocks]` int32 or uint32: logical block m of sequence b is pool block
    `block_table[b, m]`; entries past the live blocks are never read (pad with the type's max).
    context_lens `[B]` int32 or uint32: live tokens of each sequence, the Sq new ones included
    (their k/v must already be in the cache).
    alibi_slopes `[Hq]` or `[B, Hq]` float32, optional. softmax_scale defaults to `1/sqrt(D)`;
    softcap `c` (None or 0: off) maps scores to `c * tanh(s / c)`.

    Returns `[B, Hq, Sq, D]` in q's dtype. With `L = context_lens[b]`, query row i sits at
    position `a = L - Sq + i` and attends keys `j <= a` (causal, bottom-right aligned; for Sq = 1
    every live key); score `s = softcap(scale * q.k) - slope * |a - j|`, softmax over the
    admissible keys, accumulated in float32 (float64 for float64). `L == 0` outputs zeros.
    `0 < L < Sq`, `L > max_blocks * block_size` and a live table entry outside the pool raise
    FuelGraphError (when the graph is built if the index values are on the host, else when it
    runs). Not differentiable."""
    if softmax_scale is None and hasattr(q, "shape") and len(q.shape) == 4 and q.shape[3] > 0:
        softmax_scale = 1.0 / math.sqrt(q.shape[3])
    if softcap is not None and not isinstance(softcap, bool) and \
            isinstance(softcap, (int, float, np.integer, np.floating)) and softcap == 0:
        softcap = None
    srcs = (q, k_cache, v_cache, block_table, context_lens) + \
        (() if alibi_slopes is None else (alibi_slopes,))
    return call_fused(FusedOps.PAGED_ATTN, *srcs, softmax_scale=real_param(softmax_scale),
                      softcap=real_param(softcap))


def paged_cache_write(cache, new, slot_mapping):
    """Write rows of new keys (or values) into a paged cache; returns the updated cache.

    cache `[num_blocks, block_size, Hkv, D]` float; new `[N, Hkv, D]` in cache's dtype;
    slot_mapping `[N]` int32 or uint32, the pool slot of each row: `block * block_size + row`
    (the type's maximum value skips that row). Value semantics as usual (the input tensor keeps
    its old contents); the write happens in the cache's buffer when nothing reads the old
    contents afterwards. A slot outside `[0, num_blocks * block_size)` or written twice raises
    FuelGraphError. Not differentiable."""
    return call_fused(PAGED_CACHE_WRITE, cache, new, slot_mapping)


def paged_cache_write_kv(k_cache, v_cache, k_new, v_new, slot_mapping):
    """`paged_cache_write` of keys and values at once -> (k_cache, v_cache): k_new, v_new
    `[N, Hkv, D]` into pools `[num_blocks, block_size, Hkv, D]` at the shared slot_mapping `[N]`
    (one kernel on the GPU). Value semantics and errors as paged_cache_write."""
    return call_fused(PAGED_CACHE_WRITE_KV, k_cache, v_cache, k_new, v_new, slot_mapping)

