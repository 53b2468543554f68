"""The k/v loads of the paged decode kernel (`paged`) when it reads a key tile ahead into
registers (launch knob kv_ahead): plain loads, which keep their L2 eviction policy. Triton 3.6's
asynchronous copies into shared memory drop it (cp.async and TMA loads alike, Gluon's
async_copy too: their PTX carries no L2 cache hint), and after a flush that leaves dirty lines
in the L2, evict_first reads spare most of their write-back."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kv_tile(K, V, phys, j, hi, in_page, d, d_ok, nb, n_bad, hk, hkv, BS: tl.constexpr,
             D: tl.constexpr, BLOCK_N: tl.constexpr, OFF32: tl.constexpr,
             EVICT: tl.constexpr):
    """The k and v tiles [BLOCK_N, BLOCK_D] of keys j (< hi live) whose pool block ids are phys,
    and n_bad plus the live keys whose id is outside the pool (read as block 0)."""
    j_ok = j < hi
    p_ok = phys.to(tl.uint32, bitcast=True) < tl.cast(nb, tl.uint32)     # 0 <= id < nb
    n_bad += (j_ok & (p_ok == 0)).to(tl.int32)
    phys = tl.where(p_ok, phys, 0)
    if BLOCK_N % BS != 0:
        in_page = ((j % BS) * hkv + hk) * D
    if OFF32:
        kv_row = phys * (BS * hkv * D) + in_page
    else:
        kv_row = phys.to(tl.int64) * (BS * hkv * D) + in_page
    kv_off = kv_row[:, None] + d[None, :]
    kv_mask = j_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0, eviction_policy=EVICT)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0, eviction_policy=EVICT)
    return k, v, n_bad
