"""PAGED_CACHE_WRITE on the CUDA backend: rows of new keys/values scattered into a paged pool
[num_blocks, block_size, Hkv, D] at slot = block * block_size + row, one program per row; the
index type's maximum value marks a row to skip. `paged_cache_write_kv` writes k and v of a step
into both pools in one launch (what `PagedKVCache` uses)."""
from __future__ import annotations

import math
import weakref

import triton
import triton.language as tl

from ....registry.paged import PAGED_CACHE_WRITE, PAGED_CACHE_WRITE_KV, check_slots, index_max
from ...base import Cost, kernel
from .common import next_pow2
from .paged import _capturing

__all__ = ["paged_cache_write", "paged_cache_write_kv", "assume_valid_slots"]

#: slot mappings known valid (in the pool, none twice): id -> (weakref, version, pool capacity)
_VALID_SLOTS: dict = {}


def assume_valid_slots(slot_mapping, cap: int):
    """Record that `slot_mapping` (as it is now) holds distinct slots inside a pool of `cap`
    rows, so paged_cache_write skips its check (one device->host sync per call). For callers
    that built it on the host, such as PagedKVCache."""
    if len(_VALID_SLOTS) > 64:
        _VALID_SLOTS.clear()
    _VALID_SLOTS[id(slot_mapping)] = (weakref.ref(slot_mapping), slot_mapping._version, cap)


def _known_valid(slot_mapping, cap) -> bool:
    hit = _VALID_SLOTS.get(id(slot_mapping))
    return hit is not None and hit[0]() is slot_mapping and hit[1] == slot_mapping._version \
        and hit[2] == cap


@triton.jit
def _paged_write_kernel(C, NEW, S, cap, skip, W: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(S + r).to(tl.int64)
    ok = (slot != skip) & (slot >= 0) & (slot < cap)
    offs = tl.arange(0, BLOCK)
    m = offs < W
    x = tl.load(NEW + r * W + offs, mask=m)
    tl.store(C + slot * W + offs, x, mask=m & ok)


@triton.jit
def _paged_write_kv_kernel(KC, VC, KN, VN, S, cap, skip, n_new, hkv, kn_b, kn_h, kn_t, vn_b, vn_h,
                           vn_t, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token r = (b, t) of new k and v [B, Hkv, n_new, D] (any strides, unit stride in D) into
    slot S[r] of both pools: one program per token, both pools in one launch."""
    r = tl.program_id(0)
    b = (r // n_new).to(tl.int64)
    t = (r % n_new).to(tl.int64)
    slot = tl.load(S + r).to(tl.int64)
    ok = (slot != skip) & (slot >= 0) & (slot < cap)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h < hkv)[:, None] & (d < D)[None, :]
    dst = slot * hkv * D + (h * D)[:, None] + d[None, :]
    k = tl.load(KN + b * kn_b + t * kn_t + (h * kn_h)[:, None] + d[None, :], mask=m)
    v = tl.load(VN + b * vn_b + t * vn_t + (h * vn_h)[:, None] + d[None, :], mask=m)
    tl.store(KC + dst, k, mask=m & ok)
    tl.store(VC + dst, v, mask=m & ok)


def paged_cache_write_cost(shapes, params=None):
    return Cost(0, 2 * 2 * math.prod(shapes[1]))


@kernel(PAGED_CACHE_WRITE, "cuda", cost=paged_cache_write_cost)
def paged_cache_write(cache, new, slot_mapping, *, out=None, check=True):
    """cache [NB, BS, Hkv, D] <- rows of new [N, Hkv, D] at slot_mapping [N] (slot = block * BS +
    row; the index type's maximum skips a row); writes into cache (or into `out`, a fresh buffer,
    after copying cache there) and returns it. `check=False` skips the slot check (one
    device->host sync) for callers that computed the slots on the host."""
    nb, bs, hkv, d = cache.shape
    cap = nb * bs
    if check and not _capturing() and not _known_valid(slot_mapping, cap):
        check_slots("paged_cache_write", slot_mapping.cpu().numpy(), cap)
    dst = cache if out is None else out
    if out is not None:
        out.copy_(cache)
    n = new.shape[0]
    if n == 0:
        return dst
    w = hkv * d
    skip = _skip_value(slot_mapping.dtype)
    _paged_write_kernel[(n,)](dst, new, slot_mapping, cap, skip, W=w,
                              BLOCK=next_pow2(w), num_warps=4 if w >= 1024 else 1)
    return dst


def paged_cache_write_kv_cost(shapes, params=None):
    return Cost(0, 2 * 2 * (math.prod(shapes[2]) + math.prod(shapes[3])))


@kernel(PAGED_CACHE_WRITE_KV, "cuda", cost=paged_cache_write_kv_cost)
def paged_cache_write_kv_op(k_cache, v_cache, k_new, v_new, slot_mapping):
    """PAGED_CACHE_WRITE_KV: rows k_new, v_new [N, Hkv, D] into both pools in place, one
    launch (the slot check once, skipped for slots known valid) -> (k_cache, v_cache)."""
    nb, bs = k_cache.shape[:2]
    if not _capturing() and not _known_valid(slot_mapping, nb * bs):
        check_slots("paged_cache_write_kv", slot_mapping.cpu().numpy(), nb * bs)
    paged_cache_write_kv(k_cache, v_cache, k_new.unsqueeze(2), v_new.unsqueeze(2), slot_mapping)
    return k_cache, v_cache


_SKIP: dict = {}


def _skip_value(torch_dtype) -> int:
    v = _SKIP.get(torch_dtype)
    if v is None:
        v = _SKIP[torch_dtype] = index_max(str(torch_dtype).replace("torch.", ""))
    return v


def paged_cache_write_kv(k_cache, v_cache, k_new, v_new, slot_mapping):
    """k_cache, v_cache [NB, BS, Hkv, D] <- new k, v [B, Hkv, n_new, D] (token (b, t) to slot
    slot_mapping[b * n_new + t]; the index type's maximum skips it), in place, in one launch.
    The strided layout of k_new / v_new is read directly (no transposed copy). For callers that
    computed valid, distinct slots on the host (PagedKVCache): nothing is checked."""
    nb, bs, hkv, d = k_cache.shape
    B, _, n_new, _ = k_new.shape
    if B * n_new == 0:
        return
    k_new = k_new if k_new.stride(3) == 1 else k_new.contiguous()
    v_new = v_new if v_new.stride(3) == 1 else v_new.contiguous()
    _paged_write_kv_kernel[(B * n_new,)](
        k_cache, v_cache, k_new, v_new, slot_mapping, nb * bs, _skip_value(slot_mapping.dtype),
        n_new, hkv, k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0),
        v_new.stride(1), v_new.stride(2), D=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d),
        num_warps=4 if hkv * d >= 1024 else 1)
