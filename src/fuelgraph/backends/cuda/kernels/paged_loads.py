"""The k/v loads of the paged decode kernel (`paged`) when it reads a key tile ahead into
registers (launch knob kv_ahead): plain loads, which keep their L2 eviction policy (Triton's
pipelined copies into shared memory drop it), and L2 prefetches of the tiles further ahead (more
bytes in flight than the registers hold)."""
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


@triton.jit
def _l2_prefetch(K, V, phys, j, hi, nb, in_page, hk, hkv, BS: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """Asks the L2 for the k and v lines of keys j (< hi; block ids phys) with no registers
    waiting on them: the plain loads of kv_ahead then hit the L2."""
    ok = (j < hi) & (phys.to(tl.uint32, bitcast=True) < tl.cast(nb, tl.uint32))
    if BLOCK_N % BS != 0:
        in_page = ((j % BS) * hkv + hk) * D
    row = tl.where(ok, phys, 0).to(tl.int64) * (BS * hkv * D) + in_page
    c = tl.arange(0, LINES) * LINE_ELEMS
    off = row[:, None] + c[None, :]
    go = (ok[:, None] & (c < D)[None, :]).to(tl.int32)
    for base in tl.static_range(2):
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [(K if base == 0 else V) + off, go], dtype=tl.int32, is_pure=False,
            pack=1)
