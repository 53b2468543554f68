"""The k/v loads of the paged decode kernel (`paged`) when it reads a key tile ahead into
registers (launch knob kv_ahead): plain loads, which keep their L2 eviction policy (Triton's
pipelined copies into shared memory drop it); and the L2 priority mark of used tiles that the
pipelined copies cannot carry (launch knob l2_touch)."""
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
def _l2_evict_first(X, kv_row, ok, ASM: tl.constexpr):
    """Marks the k or v rows of a used key tile (X + kv_row[n], n where ok) first to be evicted
    from the L2, with a bulk L2 prefetch carrying an evict_first policy (the rows are in the
    L2: the access only changes their priority). Triton's pipelined copies into shared memory
    carry no eviction policy: marked afterwards, the tile's lines are the ones the next copies
    replace, not the lines other work left in the L2 (dirty ones cost a write-back)."""
    tl.inline_asm_elementwise(ASM, "=r,l,r", [X + kv_row, ok.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


def l2_evict_first_asm(row_bytes: int) -> str:
    """The PTX of `_l2_evict_first` for rows of row_bytes (a multiple of 16; sm_90)."""
    return ("{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_first.b64 pol, 1.0; "
            f"@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], {row_bytes}, pol; "
            "mov.u32 $0, 0; }")
