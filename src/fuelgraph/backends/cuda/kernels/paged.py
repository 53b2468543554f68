"""Triton kernels of paged attention over a block-pool KV cache: decode and short chunks here,
chunked prefill in `paged_prefill`, the split merge in `paged_merge`, the cache write in
`paged_cache`.

Decode (and short chunks, Sq < PREFILL_MIN_SQ), the grouped kernel: one program owns one kv head
of one sequence, a tile of rows = (query head of that kv head's group) x (query position), and
one key range (split). It walks the live keys of its range BLOCK_N at a time, looking each key's
pool block up in the block table, so every live k/v block is read once per (tile, split) and one
load of a kv head serves its whole group of query heads (GQA/MQA). The block ids of a tile
are read one iteration ahead: a gathered load whose address comes from a load of the same
iteration gets a single shared-memory buffer from Triton's pipeliner, whatever num_stages says;
with the ids carried over, the k/v tiles stream num_stages - 1 deep (or, knob kv_ahead, the
next tile's k/v are plain loads into registers, which keep an L2 eviction policy: `paged_loads`).
Scores are float32 (`tl.dot`; float32 inputs in IEEE precision), online softmax in base 2. Long
contexts split the keys over several programs (flash-decoding): the grid is (sequence x kv
head, tile, split) with one split length for the launch, sized from the live lengths (finer
when lengths are uneven); a split past its own sequence's length exits at once, so each
sequence runs as many programs as its length needs, with no host sync. Each split writes an
unnormalised float32 partial (max, sum, accumulator) and bumps an arrival counter; the last
split of a (sequence, kv head, tile) to arrive merges them (`paged_merge`: up to MERGE_CHUNK
splits of a row in one step whose loads are independent, one round trip per row; or, knob
merge_group, a decode tile's rows together) and resets the counter, so the split path is a
single launch.

Chunked prefill (Sq >= PREFILL_MIN_SQ) runs the FlashAttention-2 style kernel of
`paged_prefill`. Pools under 2**31 elements use int32 offsets.

Invalid index data raises FuelGraphError before the launch: the check costs one device->host
sync, done once per (context_lens, block_table) buffer version and skipped while a CUDA graph is
being captured. The kernels themselves never read outside the pool (block ids are clamped) and
write NaN rows for a sequence whose lengths or live block ids are invalid, so a captured graph
replayed on bad data yields NaN, never a plausible wrong number.

The split scratch (partials, arrival counters) is cached per device and reused by every launch:
launches on one stream are ordered, so they may share it; two paged_attn calls running
concurrently on different streams of one device would not (fuelgraph runs them on one stream).
float64 inputs and head dims above MAX_HEAD_DIM are not covered (`supports`): the planner runs
the recipe for them.
"""
from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from ....registry.core import FusedOps
from ....registry.paged import check_lengths, paged_attn_work
from ...base import Cost, kernel
from .common import (GRAPH_CAPTURE, HALF_AND_F32, INTERPRET, arrival_counters, next_pow2,
                     num_sms, stream_key)
from .paged_loads import _kv_tile
from .paged_merge import _merge_group, _merge_row, _paged_merge_kernel
from .paged_prefill import _configure_prefill

__all__ = ["paged_attn", "supports_paged_attn", "assume_valid", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634
#: a split covers at least this many keys (smaller splits cost more in the merge than they gain)
MIN_SPLIT_KEYS = 256
#: resident programs per SM assumed when sizing splits: programs that read block ids ahead
#: keep two k/v tiles in flight (~72 KB of buffers), so fewer of them fit and each is given more
#: keys (measured on the H200, B1 context 32768: 32 splits of 1024 keys 52.6 us, 64 of 512 keys
#: 64.2 us)
PROGRAMS_PER_SM, PROGRAMS_PER_SM_PREFETCH = 4, 2
#: with uneven lengths (longest > UNEVEN x mean) the longest sequence splits into at least this
#: many pieces, so that no long program starts late and forms the tail of the launch
UNEVEN, UNEVEN_SPLITS = 1.25, 8
#: splits merged per step by the fused merge (a [MERGE_CHUNK, D] float32 tile in registers);
#: up to this many splits merge in one step, whose loads are all independent (one round trip)
MERGE_CHUNK = 64
#: launch defaults of the grouped decode kernel when its (sequence, kv head, tile) triples are
#: fewer than the SMs and the longest context (the table's capacity when unknown) has at least
#: FEW_PROGRAMS_MIN_KEYS keys (B1 long contexts: a few long sequences split over many programs):
#: block_n, num_stages, programs_per_sm, kv_ahead, kv_evict, maxnreg. H200, B1 ctx 32768 under
#: do_bench (its L2 flush leaves dirty lines): k/v a tile ahead in registers with evict_first
#: 0.0464 ms against 0.0489 for the pipelined copies (which drop the policy); without
#: evict_first 0.0501 (after a reading flush: 0.0413 against 0.0397)
FEW_PROGRAMS_LAUNCH: dict = dict(kv_ahead=True, kv_evict="evict_first")
FEW_PROGRAMS_MIN_KEYS = 16384
#: the grouped kernel requests the first key tile's block ids together with the sequence length
#: (one dependent round trip less before its first k/v load; ids past the length are masked out)
#: (launch knob early_ids; H200 with merge_group, B1 ctx 32768: 0.0492 ms against 0.0537 without
#: both; B64 mixed 0.2879 against 0.2929)
EARLY_IDS = True
#: the fused merge of a decode step (Sq = 1) merges the G_T rows of a tile together (their maxima
#: as one [G_T, splits] tile, the accumulators MERGE_GROUP_TILE floats per unrolled step, all
#: loads independent) instead of row after row: one round trip in the launch's tail instead of
#: G_T (launch knob merge_group; H200 B32 ctx 4096 alone: 0.1363 ms against 0.1376)
MERGE_GROUP, MERGE_GROUP_TILE, MERGE_GROUP_STEPS = True, 4096, 8
#: knob kv_evict: L2 eviction priority of the grouped kernel's k/v loads ("", "evict_first"):
#: k/v bytes are read once; first to go, they leave the L2's other lines (activations, dirty
#: lines not yet written back) in place. Knob kv_ahead: the next key tile's k/v are plain loads
#: into registers during the current tile (num_stages 1; Triton's pipelined copies into shared
#: memory drop the policy). (L2 prefetches of the tiles further ahead, tried with kv_ahead on
#: the H200: 0.0486-0.0556 ms against 0.0464 without. Session 8, B1 in CUDA graphs, default
#: 0.0461-0.0465 ms: the pipelined copies with each used tile's lines re-marked evict_first by
#: a bulk L2 prefetch carrying the policy 0.0625 (B32: 0.166 against 0.136); the keys two tiles
#: ahead and the values one 0.0505; two adjacent kv heads per program (512-byte rows) 0.0518;
#: dynamic chunks taken by ticket 0.0473; the last split merging from its registers 0.0467;
#: the first two tiles' ids early 0.0462-0.0465; code in commits e452cd6 / e6ea34c)
#: (Session 10, H200 B1 under do_bench, default 0.0458-0.0461 ms; removed: a ring of kv_ahead
#: key tiles in flight in registers -- round 1, its 16-bit loads re-packed at the end of each
#: iteration, which waits there for all its requests: 2 x 32 keys 0.0506, 3 x 32 0.0550, 4 x 16
#: 0.0623; round 2, the tiles kept in flight across iterations as the int32 words loaded, split
#: into even and odd columns at their use, each refill requested after its slot's use: 3 x 32
#: 0.0535, 2 x 32 0.0540, 4 x 16 0.0626, 2 x 64 0.0638 -- so more bytes in flight do not help:
#: each key tile's attention step is the limit; 8-warp programs one an SM, 128-key tiles
#: 0.0515, a ring of 2 x 64 0.0610. Round 3: the softmax sum kept per (row, key slot) and
#: reduced after the loop (one cross-warp reduction less a key tile: 9 CTA barriers a tile
#: instead of 12, 596 loop instructions instead of 617) 0.04603 ms against 0.04598 (4
#: interleaved rounds; in CUDA graphs 0.04668 against 0.04645). For scale, the kernel's gather
#: with no math: 32 splits 0.0416, 64 splits (4 programs an SM) 0.0394. Code in commits c74fe45
#: (ring) and 9ae48d6 (lazy sum).)
KV_EVICT, KV_AHEAD = "", False
#: chunks of at least this many new tokens (Sq) run the FlashAttention-style prefill kernel (one
#: query head per program, tensor-core tiles); shorter ones the grouped decode kernel (the query
#: heads of one kv head share each k/v load)
PREFILL_MIN_SQ = 64
#: pools with fewer elements than this address their keys with int32 offsets (fewer
#: instructions per gathered tile); larger ones with int64
INT32_OFFSETS_BELOW = 2 ** 31
#: the grouped kernel reads the block ids of the next key tile one iteration ahead, so its k/v
#: loads depend on no load of their own iteration and the compiler pipelines them num_stages - 1
#: deep (without it, the gathered loads get one buffer whatever num_stages says) -- when its
#: programs are few (fewer (sequence, kv head, tile) triples than SMs) or their lengths uneven
#: (a tail run by few programs): each program then needs several tiles in flight. Many programs
#: of equal length hide the latency by occupancy instead, which the larger buffers would lower
#: (H200, B32 x 4096: 139.6 us without, 160.0 us with; B64 mixed lengths: 298.5 us with)
#: (_use_prefetch; the launch knob prefetch_index forces either)


@triton.jit
def _tanh(x):
    e = tl.exp(2.0 * x)                     # inf for large x: 1 - 0 = 1; 0 for very negative: -1
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _paged_attn_kernel(
        Q, K, V, BT, CL, SL, O, PO, PM, PL,
        CNT, sq, hq, hkv, mb, nb, keys_per_split, n_split, n_qt, scale, softcap, sl_stride_b,
        G: tl.constexpr, G_T: tl.constexpr, SQ_T: tl.constexpr, BS: tl.constexpr,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SPLIT: tl.constexpr,
        FUSED_MERGE: tl.constexpr, S_P2: tl.constexpr, MERGE_CHUNK: tl.constexpr,
        DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, PREFETCH_IDX: tl.constexpr,
        OFF32: tl.constexpr, EARLY_IDS: tl.constexpr, MERGE_GROUP: tl.constexpr,
        KV_EVICT: tl.constexpr, KV_AHEAD: tl.constexpr):
    BLOCK_M: tl.constexpr = G_T * SQ_T
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // hkv
    hk = pid_bh % hkv
    gt = pid_t // n_qt
    qt = pid_t % n_qt
    cap = mb * BS
    lo = pid_s * keys_per_split
    tab = BT + b * mb
    offs_n = tl.arange(0, BLOCK_N)
    if EARLY_IDS:        # the first tile's block ids requested with the length, not after it
        j = lo + offs_n                          # (one round trip less before the first k/v)
        ids_first = tl.load(tab + j // BS, mask=j < tl.minimum(lo + keys_per_split, cap),
                            other=0)
    ctx64 = tl.load(CL + b).to(tl.int64)     # uint32 lengths may exceed the int32 range
    n = tl.minimum(tl.maximum(ctx64, 0), cap).to(tl.int32)   # positions in int32 from here on
    if (lo >= n) & (lo > 0):
        return                               # empty split: the merge never reads it

    r = tl.arange(0, BLOCK_M)
    gi = gt * G_T + r % G_T                  # query head within the group
    i = qt * SQ_T + r // G_T                 # query position
    row_ok = (gi < G) & (i < sq)
    h = hk * G + gi
    row = (b * hq + h).to(tl.int64) * sq + i          # row of q / o viewed as [B*Hq*Sq, D]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + row[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)
    if DOT_F32:                              # the CPU interpreter's bfloat16 dot is wrong
        q = q.to(tl.float32)
    a = n - sq + i                           # absolute position: row sees keys j <= a
    if HAS_ALIBI:
        slope = tl.load(SL + b * sl_stride_b + h, mask=row_ok, other=0.0).to(tl.float32)
    i_last = tl.minimum(qt * SQ_T + SQ_T - 1, sq - 1)
    hi = tl.minimum(n - sq + i_last + 1, lo + keys_per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_bad = tl.zeros([BLOCK_N], tl.int32)    # live keys whose block id is outside the pool
    # tiles start at multiples of BLOCK_N (keys_per_split is one): when a tile spans whole
    # pages, a key's offset within its page is the same in every tile
    in_page = ((offs_n % BS) * hkv + hk) * D
    if PREFETCH_IDX:     # block ids one tile ahead: the k/v loads then depend on no load of
        if EARLY_IDS:                           # their own iteration and pipeline deeper
            phys_next = ids_first    # ids past the length: masked out of k/v and the id check
        else:
            j = lo + offs_n
            phys_next = tl.load(tab + j // BS, mask=j < hi, other=0)
    if KV_AHEAD:         # the k/v tiles themselves one tile ahead, in registers (plain loads,
        k_next, v_next, n_bad = _kv_tile(        # which keep their eviction policy)
            K, V, phys_next, lo + offs_n, hi, in_page, d, d_ok, nb, n_bad, hk, hkv, BS, D,
            BLOCK_N, OFF32, KV_EVICT)
        j = lo + BLOCK_N + offs_n
        phys_next = tl.load(tab + j // BS, mask=j < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        j_ok = j < hi
        if KV_AHEAD:
            k = k_next
            v = v_next
            k_next, v_next, n_bad = _kv_tile(
                K, V, phys_next, j + BLOCK_N, hi, in_page, d, d_ok, nb, n_bad, hk, hkv, BS,
                D, BLOCK_N, OFF32, KV_EVICT)
            j_next = j + 2 * BLOCK_N
            phys_next = tl.load(tab + j_next // BS, mask=j_next < hi, other=0)
        elif PREFETCH_IDX:
            phys = phys_next
            j_next = j + BLOCK_N
            phys_next = tl.load(tab + j_next // BS, mask=j_next < hi, other=0)
        else:
            phys = tl.load(tab + j // BS, mask=j_ok, other=0)
        if not KV_AHEAD:
            p_ok = phys.to(tl.uint32, bitcast=True) < tl.cast(nb, tl.uint32)   # 0 <= id < nb
            n_bad += (j_ok & (p_ok == 0)).to(tl.int32)
            phys = tl.where(p_ok, phys, 0)
            if BLOCK_N % BS != 0:
                in_page = ((j % BS) * hkv + hk) * D
            if OFF32:            # the pool's element offsets fit int32: cheaper addresses
                kv_row = phys * (BS * hkv * D) + in_page
            else:
                kv_row = phys.to(tl.int64) * (BS * hkv * D) + in_page
            kv_off = kv_row[:, None] + d[None, :]
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k = tl.load(K + kv_off, mask=kv_mask, other=0.0, eviction_policy=KV_EVICT)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if HAS_SOFTCAP or HAS_ALIBI:
            s = s * scale
            if HAS_SOFTCAP:
                s = softcap * _tanh(s / softcap)
            rel = a[:, None] - j[None, :]
            if HAS_ALIBI:
                s = s - slope[:, None] * tl.abs(rel).to(tl.float32)
            s = s * 1.4426950408889634
        else:
            rel = a[:, None] - j[None, :]
            s = s * (scale * 1.4426950408889634)
        s = tl.where((rel >= 0) & j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not KV_AHEAD:
            v = tl.load(V + kv_off, mask=kv_mask, other=0.0, eviction_policy=KV_EVICT)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    poison = tl.sum(n_bad, 0) > 0
    if SPLIT:
        prow = row * n_split + pid_s
        acc = tl.where(poison, float("nan"), acc)
        tl.store(PO + prow[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(PM + prow, m_i, mask=row_ok)
        tl.store(PL + prow, l_i, mask=row_ok)
        if FUSED_MERGE:
            # the last split of this (sequence, kv head, tile) to finish merges all of them:
            # no second launch. Every live split (lo < n, or the first) arrives exactly once.
            n_live = (tl.maximum(n, 1) + keys_per_split - 1) // keys_per_split
            tl.debug_barrier()               # all threads' partial stores precede the release
            cnt_ptr = CNT + pid_bh * tl.num_programs(1) + pid_t
            arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == n_live - 1:
                tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")   # ready for next launch
                bad = (ctx64 > cap) | ((ctx64 > 0) & (ctx64 < sq)) | (ctx64 < 0)
                if MERGE_GROUP:      # one query position (decode): its G_T consecutive rows
                    _merge_group(PO, PM, PL, O, (b * hq + hk * G + gt * G_T).to(tl.int64),
                                 tl.minimum(G - gt * G_T, G_T), n_split, n_live, bad, D,
                                 BLOCK_D, G_T, S_P2, MERGE_CHUNK)
                else:
                    for rr in range(0, BLOCK_M):
                        gi_r = gt * G_T + rr % G_T
                        i_r = qt * SQ_T + rr // G_T
                        if (gi_r < G) & (i_r < sq):
                            row_r = (b * hq + hk * G + gi_r).to(tl.int64) * sq + i_r
                            _merge_row(PO, PM, PL, O, row_r, n_split, n_live, bad, D,
                                       BLOCK_D, S_P2, MERGE_CHUNK)
    else:
        bad = (ctx64 > cap) | ((ctx64 > 0) & (ctx64 < sq)) | (ctx64 < 0) | poison
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out = tl.where(bad, float("nan"), out)
        tl.store(O + row[:, None] * D + d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


# ---- host side ---------------------------------------------------------------------------------
#: index tensors already checked: (their memory, sq, pool) -> (weakref to one tensor holding
#: that memory, its version counter, the same for the table, (longest, total context)). Views
#: and detached aliases share memory and version counter, so they hit too; while the weakref'd
#: tensor lives its memory cannot be reused, and a torch in-place write bumps the version.
_CHECKED: dict = {}


def _memo_key(lens, table, sq, nb, bs):
    return (lens.data_ptr(), tuple(lens.shape), lens.dtype, table.data_ptr(),
            tuple(table.shape), table.dtype, sq, nb, bs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)              # not triton.cdiv: a jit function, slow to call from the host


_HAS_CUDA: list = []


def _capturing() -> bool:
    if not _HAS_CUDA:
        _HAS_CUDA.append(torch.cuda.is_available())
    return _HAS_CUDA[0] and torch.cuda.is_current_stream_capturing()


def _check_and_stats(lens, table, sq, nb, bs):
    """(max context, total context) after raising FuelGraphError on invalid lengths or live block
    ids; one device->host sync per buffer version. None while capturing a CUDA graph."""
    key = _memo_key(lens, table, sq, nb, bs)
    hit = _CHECKED.get(key)
    if hit is not None and hit[0]() is not None and hit[1] == lens._version and \
            hit[2]() is not None and hit[3] == table._version:
        return hit[4]
    if _capturing():
        return None
    mb = table.shape[1]
    n = lens.long()
    t = table.long()
    live = torch.arange(mb, device=lens.device)[None, :] * bs < n[:, None]
    bad_len = (n < 0) | (n > mb * bs) | ((n > 0) & (n < sq))
    bad_blk = live & ((t < 0) | (t >= nb))
    flags = torch.stack([bad_len.any().long(), bad_blk.any().long(),
                         n.max() if n.numel() else n.new_zeros(()),
                         n.sum()]).cpu().tolist()
    if flags[0] or flags[1]:
        check_lengths("paged_attn", lens.cpu().numpy(), table.cpu().numpy(), sq, nb, bs, mb)
    stats = (int(flags[2]), int(flags[3]))
    _remember(key, lens, table, stats)
    return stats


def _remember(key, lens, table, stats):
    if len(_CHECKED) > 64:
        _CHECKED.clear()
    _CHECKED[key] = (weakref.ref(lens), lens._version, weakref.ref(table), table._version, stats)


def assume_valid(context_lens, block_table, sq, num_blocks, block_size, longest, total):
    """Record that these index tensors (as they are now) hold valid data whose longest and total
    context are `longest` and `total`, so paged_attn skips its check (one device->host sync).
    For callers that built them on the host, such as PagedKVCache."""
    _remember(_memo_key(context_lens, block_table, sq, num_blocks, block_size), context_lens,
              block_table, (int(longest), int(total)))


def _tiles(g, sq, block_m=None):
    """(G_T, SQ_T): rows of a program = G_T query heads x SQ_T positions: at least 16 rows (the
    smallest tl.dot), up to `block_m` (default 128) for prefill."""
    g_t = min(next_pow2(g), 64)
    block_m = min(max(16, next_pow2(sq * g_t)), max(block_m or 128, g_t))
    return g_t, max(1, block_m // g_t)


def _uneven(B, stats):
    """Whether the longest live length exceeds UNEVEN x the mean."""
    return stats is not None and B > 1 and stats[0] > UNEVEN * max(1, stats[1]) / B


def _use_prefetch(B, hkv, n_tiles, stats, device):
    """Read block ids a tile ahead: few programs, or uneven lengths (see PROGRAMS_PER_SM)."""
    return B * hkv * n_tiles < num_sms(device) or _uneven(B, stats)


def _splits(B, hkv, n_tiles, cap, stats, block_n, device, per_sm=PROGRAMS_PER_SM):
    """(keys per split, number of splits). Sized from the live lengths when known, so the
    programs fill the GPU and no program walks far more keys than the average; always covering
    the table's capacity, so any lengths (e.g. in a replayed CUDA graph) stay correct. Splits
    past a sequence's own length exit at once: short sequences run one program, long ones many
    (per-sequence split counts with no host sync)."""
    slots = num_sms(device) * per_sm
    longest, total = (cap, B * cap) if stats is None else stats
    longest = max(1, min(longest, cap))
    work = max(1, total) * hkv * n_tiles          # keys x (kv head, tile) pairs to walk
    kps = max(MIN_SPLIT_KEYS, -(-work // slots))
    if _uneven(B, stats):
        kps = min(kps, max(MIN_SPLIT_KEYS, -(-longest // UNEVEN_SPLITS)))
    if kps >= longest:
        return cap, 1
    pieces = max(1, longest // kps)               # the longest sequence in equal pieces
    kps = -(-(-(-longest // pieces)) // block_n) * block_n
    return kps, -(-cap // kps)


#: float32 partials reused by the eager split launches of one device and stream (stream order
#: keeps them apart, as the arrival counters of `common.arrival_counters`)
_SCRATCH: dict = {}


def _scratch(device, n_float, n_count):
    """(float32 buffer of >= n_float, int32 zeros of >= n_count). While a CUDA graph is
    captured: a fresh float buffer (the graph owns it) and counters of its own."""
    capturing = _capturing()
    c = arrival_counters(device, n_count, capturing)
    if capturing:
        return torch.empty(n_float, dtype=torch.float32, device=device), c
    key = stream_key(device)
    f = _SCRATCH.get(key)
    if f is None or f.numel() < n_float:
        f = _SCRATCH[key] = torch.empty(max(n_float, 1 << 16), dtype=torch.float32,
                                        device=device)
    return f, c


def paged_attn_cost(shapes, params=None):
    return Cost(*paged_attn_work(shapes))


def supports_paged_attn(shapes, dtypes, params=None) -> bool:
    """The Triton kernel covers float32/bfloat16/float16 and head dims up to MAX_HEAD_DIM."""
    return shapes[0][3] <= MAX_HEAD_DIM and all(d.name != "float64" for d in dtypes[:3])


@kernel(FusedOps.PAGED_ATTN, "cuda", dtypes=HALF_AND_F32, cost=paged_attn_cost,
        supports=supports_paged_attn)
def paged_attn(q, k_cache, v_cache, block_table, context_lens, *alibi, softmax_scale,
               softcap=None, block_m=None, block_n=None, num_warps=None, num_stages=None,
               n_split=None, fused_merge=True, prefill=None, merge_chunk=None,
               prefetch_index=None, group_heads=None, page_tiles=None, early_ids=None,
               merge_group=None, programs_per_sm=None, kv_evict=None, kv_ahead=None,
               maxnreg=None):
    """q [B, Hq, Sq, D]; caches [NB, BS, Hkv, D]; block_table [B, MB], context_lens [B]
    (int32/uint32); alibi [Hq] or [B, Hq] -> [B, Hq, Sq, D] in q's dtype. The keyword-only
    launch knobs are for tests and benchmarks: block_m, block_n, num_warps, num_stages (tiles;
    the prefill kernel autotunes when they are None), n_split (key splits of the grouped
    kernel), fused_merge (False: merge the splits in a second launch), prefill (True / False:
    force the prefill / grouped kernel; None: by Sq), merge_chunk (splits per step of the fused
    merge), prefetch_index (grouped kernel: read block ids one tile ahead), group_heads (prefill:
    query heads per program, sharing each k/v tile), page_tiles (prefill: the wholly admissible
    key tiles page by page, block ids one tile ahead), early_ids (grouped kernel with ids read
    ahead: the first tile's ids requested with the length), merge_group (fused merge of a
    decode step: a tile's rows together), programs_per_sm (resident programs per SM assumed
    when sizing the splits), kv_evict (grouped kernel: the k/v loads' L2 eviction policy,
    "" or "evict_first"), kv_ahead (grouped kernel: k/v tiles loaded a tile ahead into
    registers; implies prefetch_index), maxnreg (grouped kernel: register cap per thread, so
    more programs fit an SM)."""
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    stats = _check_and_stats(context_lens, block_table, q.shape[2], nb, bs)
    if GRAPH_CAPTURE[0]:      # fuelgraph's graph warm-up sizes the launch as its capture will
        stats = None
    sl = alibi[0].float().contiguous() if alibi else q
    key = (q.shape, k_cache.shape, block_table.shape[1], q.dtype, q.device,
           sl.dim() if alibi else 0, softmax_scale, softcap, stats, block_m, block_n, num_warps,
           num_stages, n_split, fused_merge, prefill, merge_chunk, prefetch_index, group_heads,
           page_tiles, early_ids, merge_group, programs_per_sm, kv_evict, kv_ahead, maxnreg)
    capturing = _capturing()          # a graph being captured gets its own scratch: no cache
    launch = None if capturing else _LAUNCHES.get(key)
    if launch is None:
        launch = _configure(q, k_cache, block_table, bool(alibi), sl.dim(), stats,
                            softmax_scale, softcap, block_m, block_n, num_warps, num_stages,
                            n_split, fused_merge, prefill, merge_chunk, prefetch_index,
                            group_heads, page_tiles, early_ids, merge_group,
                            programs_per_sm, kv_evict, kv_ahead, maxnreg)
        if not capturing:
            if len(_LAUNCHES) >= 256:
                _LAUNCHES.clear()
            _LAUNCHES[key] = launch
    launch(q, k_cache, v_cache, block_table, context_lens, sl, out)
    return out


#: launch closures by (shapes, dtype, device, flags, length stats, knobs): the host work of a
#: repeated call is one dict lookup (a decode loop's lengths change every step: a miss costs
#: what the configuration costs anyway)
_LAUNCHES: dict = {}


def _configure(q, k_cache, block_table, has_alibi, sl_dim, stats, softmax_scale, softcap,
               block_m, block_n, num_warps, num_stages, n_split, fused_merge, prefill,
               merge_chunk=None, prefetch_index=None, group_heads=None, page_tiles=None,
               early_ids=None, merge_group=None, programs_per_sm=None, kv_evict=None,
               kv_ahead=None, maxnreg=None):
    """A function (q, k_cache, v_cache, block_table, context_lens, slopes, out) -> None that
    launches the kernel(s) for this configuration."""
    B, hq, sq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    mb = block_table.shape[1]
    g = hq // hkv
    sl_stride_b = (hq if sl_dim == 2 else 0) if has_alibi else 0
    dot_f32 = INTERPRET and q.dtype == torch.bfloat16
    dot_prec = "ieee" if q.dtype == torch.float32 or dot_f32 else "tf32"
    block_d = max(16, next_pow2(d))
    if prefill if prefill is not None else sq >= PREFILL_MIN_SQ:
        return _configure_prefill(q, k_cache, block_table, sl_stride_b, softmax_scale, softcap,
                                  has_alibi, dot_prec, dot_f32, block_d, block_m, block_n,
                                  num_warps, num_stages, group_heads, page_tiles,
                                  k_cache.numel() < INT32_OFFSETS_BELOW)
    g_t, sq_t = _tiles(g, sq, block_m)
    n_qt, n_gt = _cdiv(sq, sq_t), _cdiv(g, g_t)
    decode = sq_t * g_t <= 16
    if decode and d <= 128 and B * hkv * n_gt * n_qt < num_sms(q.device) and \
            (mb * bs if stats is None else stats[0]) >= FEW_PROGRAMS_MIN_KEYS:
        block_n = block_n or FEW_PROGRAMS_LAUNCH.get("block_n")
        num_stages = num_stages or FEW_PROGRAMS_LAUNCH.get("num_stages")
        programs_per_sm = programs_per_sm or FEW_PROGRAMS_LAUNCH.get("programs_per_sm")
        kv_ahead = FEW_PROGRAMS_LAUNCH.get("kv_ahead") if kv_ahead is None else kv_ahead
        kv_evict = FEW_PROGRAMS_LAUNCH.get("kv_evict") if kv_evict is None else kv_evict
        maxnreg = maxnreg or FEW_PROGRAMS_LAUNCH.get("maxnreg")
    bn = block_n or (64 if d <= 128 else 32)
    if INTERPRET:
        bn = block_n or 16
    cap = mb * bs
    pf = _use_prefetch(B, hkv, n_gt * n_qt, stats, q.device) if prefetch_index is None \
        else bool(prefetch_index)
    ahead = pf and (KV_AHEAD if kv_ahead is None else bool(kv_ahead))
    if kv_ahead:
        pf = ahead = True
    kps, ns = _splits(B, hkv, n_gt * n_qt, cap, stats, bn, q.device, programs_per_sm or
                      (PROGRAMS_PER_SM_PREFETCH if pf else PROGRAMS_PER_SM))
    if n_split is not None:
        ns = max(1, int(n_split))
        kps = _cdiv(_cdiv(cap, ns), bn) * bn
        ns = _cdiv(cap, kps)
    s_p2 = max(2, next_pow2(ns))
    chunk = min(merge_chunk or MERGE_CHUNK, s_p2)
    # the group merge: one query position, its loop unrolled MERGE_GROUP_STEPS steps at most
    group = (MERGE_GROUP if merge_group is None else bool(merge_group)) and sq == 1 and \
        bool(fused_merge) and ns > 1
    if group:
        chunk = min(s_p2, max(1, (merge_chunk or MERGE_GROUP_TILE // (g_t * block_d))))
        group = s_p2 <= MERGE_GROUP_STEPS * chunk
        if not group:
            chunk = min(merge_chunk or MERGE_CHUNK, s_p2)
    kw = dict(G=g, G_T=g_t, SQ_T=sq_t, BS=bs, D=d, BLOCK_D=block_d, BLOCK_N=bn,
              HAS_ALIBI=has_alibi, HAS_SOFTCAP=softcap is not None, DOT_PREC=dot_prec,
              DOT_F32=dot_f32, S_P2=s_p2, MERGE_CHUNK=chunk, MERGE_GROUP=group,
              EARLY_IDS=pf and (EARLY_IDS if early_ids is None else bool(early_ids)),
              PREFETCH_IDX=pf, KV_EVICT=KV_EVICT if kv_evict is None else str(kv_evict),
              KV_AHEAD=ahead,
              OFF32=k_cache.numel() < INT32_OFFSETS_BELOW,
              num_warps=num_warps or (4 if decode or d <= 64 else 8),
              num_stages=num_stages or (1 if ahead else 3 if decode else 2))
    if maxnreg and not INTERPRET:
        kw["maxnreg"] = int(maxnreg)
    grid = (B * hkv, n_gt * n_qt, ns)
    scal = (sq, hq, hkv, mb, nb, kps, ns, n_qt, float(softmax_scale),
            float(softcap) if softcap is not None else 1.0, sl_stride_b)
    kernel_ = _paged_attn_kernel[grid]
    if ns == 1:
        def launch(q, kc, vc, bt, cl, sl, out):
            kernel_(q, kc, vc, bt, cl, sl, out, out, out, out, cl, *scal, SPLIT=False,
                    FUSED_MERGE=False, **kw)
        return launch
    rows = B * hq * sq
    buf, cnt = _scratch(q.device, rows * ns * (d + 2), grid[0] * grid[1])
    po = buf[:rows * ns * d]
    pm = buf[rows * ns * d:rows * ns * (d + 1)]
    pl = buf[rows * ns * (d + 1):rows * ns * (d + 2)]
    fused = bool(fused_merge)
    merge_ = _paged_merge_kernel[(rows,)]

    def launch(q, kc, vc, bt, cl, sl, out):
        kernel_(q, kc, vc, bt, cl, sl, out, po, pm, pl, cnt, *scal, SPLIT=True,
                FUSED_MERGE=fused, **kw)
        if not fused:
            merge_(po, pm, pl, cl, out, sq, hq, cap, kps, ns, D=d, BLOCK_D=block_d,
                   S_P2=s_p2, S_CHUNK=kw["MERGE_CHUNK"], num_warps=4)
    return launch
