#!/usr/bin/env python3
"""Paged attention and the paged cache write on one CUDA GPU, against the anchors issue 13
names, bf16, Hq 32, Hkv 8, D 128, block 16, each sequence's blocks shuffled over the pool:

  decode B32, context 4096 each          vs SDPA on a dense cache    target >= 3.5 TB/s effective
  decode B1, context 32768               vs SDPA on a dense cache    target >= 3.0 TB/s (split-K)
  decode B64, contexts 128..8192         vs SDPA dense, padded to the longest   target >= 2x SDPA
  chunked prefill Sq 256 on 4096, B8     vs flash_attn on a dense copy          target >= 0.8x
  cache append of one token, B64         vs torch index_put_                    target <= torch

"Effective" bandwidth = live k/v bytes read / time. Impls: "fuelgraph" (the op through a cached
fuelgraph plan), "fuelgraph kernel" (the Triton kernel called directly: the plan's overhead is
the difference), "torch eager" (SDPA / index_put_), "flash" (the flash-attn package, when
importable: flash_attn_func on the dense copy and flash_attn_with_kvcache on the same paged
pool), "fuelgraph flash_attn" (fuelgraph's own dense op, when it exists). Every attention result
is checked against a reference before it is timed (field max_err).

    python3 bench/bench_cuda_paged.py [--out DIR] [--sweep] [--quick] [--only CASES]
        [--part K/N] [--clean-l2] [--graph] [--bounds] [--rounds N] [--smoke]

--sweep also times the launch candidates listed in SWEEPS as impl "fuelgraph[...]" (a few per
case: each is one compile). --warm compiles and checks every launch once and times nothing: run
one such process per case in parallel first, and the timed run then loads its kernels from
Triton's cache (--part K/N: only every N-th candidate from the K-th, so N processes compile
the candidates in parallel). --clean-l2 adds ms_clean_l2 to each decode record: the time
when the L2 was flushed by reading 256 MB instead of do_bench's writing them (do_bench leaves
up to the L2's size of dirty lines, whose write-back shares the DRAM with the kernel's reads:
a fixed cost that weighs most on the smallest case, B1). --graph adds the decode kernel (and with
--sweep each candidate) replayed from a CUDA graph, impl "... (CUDA graph)". --bounds adds, per
decode case, a plain streaming read of exactly its live k/v bytes (impl "read live k/v bytes":
the floor for any kernel reading them once, under the same timing; SDPA / read bounds the
speedup on SDPA) and SDPA's GB/s on the dense cache it reads (field gbps_padded). --rounds N
times the sweep's candidates N times, interleaved (the spread is the run's noise). --quick uses
shorter timing; --only runs some cases (decode_B1, decode_B64, prefill, decode_B32, append).
--smoke checks this script on the CPU (TRITON_INTERPRET=1, tiny cases, nothing timed). Every record also has host_us: the host time of one call (launch overhead); when it
exceeds the GPU time plus do_bench's L2 flush, the time measures the host. The append's
"fuelgraph kernel" writes k and v in one launch (what PagedKVCache.write runs); "k, v
separately" is the registry op's kernel once per pool. The prefill target compares with
flash-attn's dense kernel when it is importable, else fuelgraph's own dense flash_attn. Writes
bench/results/cuda_paged_<date>[_sweep][_<case>...].json (and the same name under DIR), prints
the records, then the targets table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys
import time
import traceback

import numpy as np
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from fuelgraph.backends.cuda.kernels import paged as K  # noqa: E402
from fuelgraph.backends.cuda.kernels import paged_cache as KC  # noqa: E402
from fuelgraph.ir.tensor import bound_data  # noqa: E402
from fuelgraph.nn import PagedKVCache  # noqa: E402
from fuelgraph.runtime.executor import compile_plan  # noqa: E402

try:
    from flash_attn import flash_attn_func, flash_attn_with_kvcache
    HAVE_FLASH = True
except Exception as exc:  # noqa: BLE001
    print(f"[bench] flash_attn not importable: {exc!r}", file=sys.stderr)
    HAVE_FLASH = False

# --smoke (a check of this script without a GPU): TRITON_INTERPRET=1 on the CPU, tiny cases
SMOKE = "--smoke" in sys.argv
DEV = torch.device("cpu" if SMOKE else "cuda")
if SMOKE:      # the interpreter workaround the CUDA tests use (Triton 3.6 with NumPy 2.4)
    sys.path.insert(0, str(ROOT / "tests" / "backends" / "cuda"))
    import conftest  # noqa: E402,F401
DT = torch.bfloat16
HQ, HKV, D, BS = 32, 8, 128, 16
DATE = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
RECORDS: list[dict] = []
REP = {"warmup": 25, "rep": 100, "part": (0, 1), "rounds": 1}
_FLUSH: list = []


def device_name() -> str:
    return "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def t_ms(fn) -> float:
    if REP.get("warm_only"):
        return float("nan")
    return float(do_bench(fn, warmup=REP["warmup"], rep=REP["rep"], return_mode="median"))


def t_ms_clean_l2(fn, n=40) -> float:
    """Median time of fn after an L2 flush that reads 256 MB (the L2 then holds only clean
    lines) instead of do_bench's zero_ (which leaves it full of dirty ones)."""
    if not _FLUSH:
        _FLUSH.append(torch.zeros(64 * 2 ** 20, dtype=torch.float32, device=DEV))
    buf = _FLUSH[0]
    fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(n)]
    for s, e in ev:
        buf.sum()                       # reads the 256 MB (a 4-byte result)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in ev)[n // 2]


def record(op, impl, case, ms, *, nbytes=None, flops=None, **extra):
    rec = {"op": op, "impl": impl, "case": case["name"], "device": device_name(),
           "shape": case["shape"], "dtype": "bfloat16", "ms": round(ms, 5), "date": DATE}
    if nbytes is not None:
        rec["gbps"] = round(nbytes / (ms * 1e-3) / 1e9, 1)
    if flops is not None:
        rec["tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
    rec.update(extra)
    RECORDS.append(rec)
    perf = f"{rec['gbps']:8.1f} GB/s" if "gbps" in rec else \
        f"{rec['tflops']:8.1f} TFLOP/s" if "tflops" in rec else ""
    err = f"  err {rec['max_err']:.2e}" if "max_err" in rec else ""
    host = f"  host {rec['host_us']:.0f} us" if "host_us" in rec else ""
    if "ms_clean_l2" in rec:
        host += f"  clean-L2 {rec['ms_clean_l2']:.4f} ms {rec.get('gbps_clean_l2', 0):.0f} GB/s"
    print(f"  {case['name']:24s} {impl:36s} {ms:9.4f} ms {perf}{err}{host}", flush=True)
    return rec


def run(op, impl, case, fn, err_fn=None, tol=2e-2, **extra):
    """Time fn after checking its result: err_fn(result) -> max abs error vs a reference."""
    try:
        out = fn()
        sync()
        if err_fn is not None:
            err = float(err_fn(out))
            extra["max_err"] = err
            if not err <= tol:
                print(f"  {case['name']:24s} {impl:36s} WRONG RESULT: max err {err:.3g}",
                      flush=True)
                extra["wrong"] = True
        if not REP.get("warm_only"):
            extra["host_us"] = round(host_us(fn), 1)
            if REP.get("clean_l2") and case["name"].startswith("decode"):
                try:                    # a diagnostic: never costs the record itself
                    extra["ms_clean_l2"] = round(t_ms_clean_l2(fn), 5)
                    if "nbytes" in extra:
                        extra["gbps_clean_l2"] = round(
                            extra["nbytes"] / extra["ms_clean_l2"] / 1e6, 1)
                except Exception as exc:  # noqa: BLE001
                    print(f"  clean-L2 timing failed: {exc!r}"[:200], flush=True)
        return record(op, impl, case, t_ms(fn), **extra)
    except Exception as exc:  # noqa: BLE001
        print(f"  {case['name']:24s} {impl:36s} FAILED: {exc!r}", flush=True)
        traceback.print_exc(limit=3)
        RECORDS.append({"op": op, "impl": impl, "case": case["name"], "shape": case["shape"],
                        "dtype": "bfloat16", "error": repr(exc)[:300], "date": DATE})
        return None


def host_us(fn, n=50) -> float:
    """Host time of one call (launch overhead, no sync): when it exceeds the GPU time (plus the
    L2 flush do_bench runs before each call) the timing measures the host, not the kernel."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def as_torch(out):
    """A result as a torch tensor: on the CPU (--smoke) a plan returns a NumPy array, bfloat16
    ones of ml_dtypes' type, which torch does not take: those through float32."""
    if isinstance(out, torch.Tensor):
        return out
    arr = np.asarray(out)
    if arr.dtype.name == "bfloat16":
        arr = arr.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr))


def max_err(ref, rows):
    return lambda out: (as_torch(out)[rows].float() - ref[rows].float()).abs().max().item()


# ---- inputs -------------------------------------------------------------------------------
def paged_inputs(lens, sq, seed=0):
    """q, shuffled pools, an int32 table padded with the int32 max, lengths; the slots of every
    sequence's tokens (to build dense copies)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int64)
    B = len(lens)
    nblk = (lens + BS - 1) // BS
    mb = int(nblk.max())
    nb = int(nblk.sum()) + 16
    perm = torch.randperm(nb, generator=g)
    table = torch.full((B, mb), 2 ** 31 - 1, dtype=torch.int64)
    c = 0
    for b in range(B):
        table[b, :nblk[b]] = perm[c:c + nblk[b]]
        c += int(nblk[b])
    gd = torch.Generator(device=DEV).manual_seed(seed)       # the pools drawn on the device:
    q = torch.randn(B, HQ, sq, D, generator=gd, device=DEV).to(DT)    # seconds less per case
    kc = torch.randn(nb, BS, HKV, D, generator=gd, device=DEV).to(DT)
    vc = torch.randn(nb, BS, HKV, D, generator=gd, device=DEV).to(DT)
    return dict(q=q, k_cache=kc, v_cache=vc, block_table=table.to(torch.int32).to(DEV),
                context_lens=lens.to(torch.int32).to(DEV), lens=lens, table64=table)


def dense(inp, b, n=None):
    """Sequence b's keys and values laid out densely, [Hkv, n, D] (n defaults to its length)."""
    n = int(inp["lens"][b]) if n is None else n
    j = torch.arange(n)
    t = inp["table64"][b]
    idx = (t[torch.clamp(j // BS, max=t.numel() - 1)].clamp(max=inp["k_cache"].shape[0] - 1)
           * BS + j % BS).to(DEV)
    return [c.reshape(-1, HKV, D)[idx].permute(1, 0, 2) for c in (inp["k_cache"], inp["v_cache"])]


def kv_bytes(inp):
    return int(inp["lens"].sum()) * HKV * D * 2 * 2


def plan_fn(inp):
    """The op through a cached fuelgraph plan (inputs are zero-copy leaves of the torch tensors)."""
    ts = [fg.from_torch(inp[k]) for k in ("q", "k_cache", "v_cache", "block_table",
                                          "context_lens")]
    out = F.paged_attn(*ts)
    plan, ins = compile_plan([out.value])
    bufs = [bound_data(n) for n in ins]
    return lambda: plan.run(bufs)[0]


def kernel_fn(inp, **kw):
    args = [inp[k] for k in ("q", "k_cache", "v_cache", "block_table", "context_lens")]
    return lambda: K.paged_attn(*args, softmax_scale=1 / math.sqrt(D), **kw)


def graph_fn(fn):
    """fn captured in a CUDA graph (after one eager call: compile, checks, memo), replayed per
    call; returns the captured output. The capture gives the split path fresh scratch, whose
    zeroing of the arrival counters is then a memset node replayed before the kernel."""
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    keep = [g, out]
    return lambda: (keep[0].replay(), keep[1])[1]


@triton.jit
def _read_kernel(X, OUT, n, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """XORs n int32 words (each program every num_programs-th pair of BLOCKs, both loads issued
    before either is used): a plain streaming read with few registers per byte in flight, the
    time any kernel needs to read that many bytes once."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * 2 * BLOCK, n, tl.num_programs(0) * 2 * BLOCK):
        o1 = start + tl.arange(0, BLOCK)
        o2 = o1 + BLOCK
        a = tl.load(X + o1, mask=o1 < n, other=0, eviction_policy=EVICT)
        b = tl.load(X + o2, mask=o2 < n, other=0, eviction_policy=EVICT)
        acc ^= a ^ b
    tl.store(OUT + pid, tl.xor_sum(acc, 0))


@triton.jit
def _paged_read_kernel(K, V, BT, OUT, n_keys, keys_per_split, hkv, BS: tl.constexpr,
                       HALF_D: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    """XORs the k and v rows (HALF_D int32 words each) of one kv head (program axis 0) over
    one key range (axis 1) of sequence 0, gathered through the block table exactly as the
    decode kernel reads them (block ids one tile ahead, one k/v tile in flight): the floor of
    that access pattern with no attention math."""
    hk = tl.program_id(0)
    lo = tl.program_id(1) * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n_keys)
    offs = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HALF_D)
    in_page = ((offs % BS) * hkv + hk) * HALF_D
    acc = tl.zeros([BLOCK_N, HALF_D], tl.int32)
    j = lo + offs
    ids = tl.load(BT + j // BS, mask=j < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs
        off = (ids * (BS * hkv * HALF_D) + in_page)[:, None] + d[None, :]
        m = (j < hi)[:, None]
        a = tl.load(K + off, mask=m, other=0, eviction_policy=EVICT)
        b = tl.load(V + off, mask=m, other=0, eviction_policy=EVICT)
        jn = j + BLOCK_N
        ids = tl.load(BT + jn // BS, mask=jn < hi, other=0)
        acc ^= a ^ b
    tl.store(OUT + (hk * tl.num_programs(1) + tl.program_id(1)) * BLOCK_N + offs,
             tl.xor_sum(acc, 1))


def paged_read_bounds(case, inp, nbytes):
    """B1 only: the decode kernel's gather pattern with no math (_paged_read_kernel), as impl
    "paged read of live k/v (S splits)": 32 splits (2 programs of 4 warps an SM, one 32 KB
    tile in flight each, as the decode kernel) and 64 (4 an SM)."""
    n = int(inp["lens"][0])
    kw_, vw = (inp[k].view(torch.int32) for k in ("k_cache", "v_cache"))
    bt = inp["block_table"][0].contiguous()
    for splits in (32, 64):
        kps = -(-n // (splits * 64)) * 64           # tiles start at page boundaries
        part = torch.empty(HKV * splits * 64, dtype=torch.int32, device=DEV)
        fn = (lambda kps=kps, part=part, splits=splits: _paged_read_kernel[(HKV, splits)](
            kw_, vw, bt, part, n, kps, HKV, BS=BS, HALF_D=D // 2, BLOCK_N=64,
            EVICT="evict_first", num_warps=4))
        run("paged_attn", f"paged read of live k/v ({splits} splits)", case, fn, nbytes=nbytes,
            note="the decode kernel's gather (block ids a tile ahead), XOR only, evict_first")


def read_bounds(case, nbytes):
    """Floors for this case's live k/v bytes under the same timing: a streaming read of exactly
    nbytes (a Triton sum over a contiguous buffer, a few grid sizes; the fastest is recorded as
    impl "read live k/v bytes"; the same with L2 evict_first loads as "... (evict_first)") and
    torch's copy_ of them (read + write, its GB/s counts both)."""
    x = torch.randn(nbytes // 2, device=DEV).to(DT)
    words = x.view(torch.int32)
    sms = K.num_sms(x.device)

    def launch(grid, block, warps, evict):
        part = torch.empty(grid, dtype=torch.int32, device=DEV)
        return lambda: _read_kernel[(grid,)](words, part, words.numel(), BLOCK=block,
                                             EVICT=evict, num_warps=warps)
    for evict in ("", "evict_first"):
        best = None
        for per_sm, block, warps in ((4, 4096, 8), (8, 2048, 4), (2, 8192, 8)):
            grid = sms * per_sm
            fn = launch(grid, block, warps, evict)
            fn()
            ms = t_ms(fn)
            if best is None or ms < best[0]:
                best = (ms, fn, dict(grid=grid, block=block, num_warps=warps))
        run("paged_attn", "read live k/v bytes" + (f" ({evict})" if evict else ""), case,
            best[1], nbytes=nbytes, launch=best[2],
            note="Triton sum of a contiguous buffer of the live k/v bytes")
    y = torch.empty_like(x)
    run("paged_attn", "copy live k/v bytes", case, lambda: y.copy_(x), nbytes=2 * nbytes,
        note="torch copy_ of the live k/v bytes (GB/s counts read + write)")
    del x, y


def reference(inp, rows=None):
    """SDPA per sequence on its exact keys (bottom-right causal when Sq > 1)."""
    q = inp["q"]
    B, _, sq, _ = q.shape
    out = torch.zeros_like(q)
    for b in (range(B) if rows is None else rows):
        k, v = dense(inp, b)
        n = k.shape[1]
        mask = None
        if sq > 1:
            mask = torch.arange(n, device=DEV)[None] <= (n - sq + torch.arange(sq, device=DEV))[:, None]
        out[b] = torch.nn.functional.scaled_dot_product_attention(
            q[b], k, v, attn_mask=mask, enable_gqa=True)
    return out


# ---- cases --------------------------------------------------------------------------------
def bench_decode(name, lens, args, pad_to_longest=False):
    inp = paged_inputs(lens, 1)
    case = {"name": name, "shape": [len(lens), HQ, 1, D, int(max(lens))]}
    nbytes = kv_bytes(inp)
    rows = list(range(min(len(lens), 8)))
    err = max_err(reference(inp, rows), rows)
    if REP["part"][0] == 0:
        run("paged_attn", "fuelgraph", case, plan_fn(inp), err, nbytes=nbytes)
        run("paged_attn", "fuelgraph kernel", case, kernel_fn(inp), err, nbytes=nbytes)
    if args.sweep:
        sweep(case, inp, err, nbytes=nbytes, decode=True)
    if args.bounds and REP["part"][0] == REP["part"][1] - 1:     # (--warm: compiles them)
        read_bounds(case, nbytes)
        if len(lens) == 1:
            paged_read_bounds(case, inp, nbytes)
    if args.no_anchors or args.warm or REP["part"][0] != 0:
        return case
    # anchor: SDPA over a dense cache (padded to the longest sequence when lengths differ, with
    # no length mask: that only makes the anchor faster; its result is then not comparable)
    L = int(max(lens))
    kd = torch.stack([dense(inp, b, L)[0] for b in range(len(lens))])
    vd = torch.stack([dense(inp, b, L)[1] for b in range(len(lens))])
    padded = kd.numel() * kd.element_size() * 2
    rec = run("paged_attn", "torch eager", case,
              lambda: torch.nn.functional.scaled_dot_product_attention(inp["q"], kd, vd,
                                                                       enable_gqa=True),
              None if pad_to_longest else err, nbytes=nbytes, padded_bytes=padded,
              anchor="SDPA dense" + (" padded to the longest, no mask" if pad_to_longest
                                     else ""))
    if rec is not None:       # SDPA's own bandwidth: the bytes of the dense cache it reads
        rec["gbps_padded"] = round(padded / (rec["ms"] * 1e-3) / 1e9, 1)
        print(f"    SDPA reads {padded / 1e6:.1f} MB (live {nbytes / 1e6:.1f} MB): "
              f"{rec['gbps_padded']:.0f} GB/s on its dense cache", flush=True)
    if HAVE_FLASH:
        fa = lambda: flash_attn_with_kvcache(   # noqa: E731
            inp["q"].transpose(1, 2), inp["k_cache"], inp["v_cache"],
            cache_seqlens=inp["context_lens"], block_table=inp["block_table"]).transpose(1, 2)
        run("paged_attn", "flash", case, fa, err, nbytes=nbytes,
            anchor="flash_attn_with_kvcache on the same paged pool")
    del kd, vd
    if args.graph:           # last: a failed capture costs no other record
        for kw in [None] + (SWEEPS.get(name, []) * REP["rounds"] if args.sweep else []):
            impl = "fuelgraph kernel" if kw is None else f"fuelgraph[{label(kw)}]"
            try:
                fn = graph_fn(kernel_fn(inp, **(kw or {})))
            except Exception as exc:  # noqa: BLE001
                print(f"  {name:24s} {impl} (CUDA graph) capture FAILED: {exc!r}"[:200],
                      flush=True)
                continue
            run("paged_attn", impl + " (CUDA graph)", case, fn, err, nbytes=nbytes, launch=kw)
    return case


def bench_prefill(args, B=8, sq=256, ctx=4096):
    name = "prefill_Sq256_ctx4096_B8" if SMOKE else f"prefill_Sq{sq}_ctx{ctx}_B{B}"
    inp = paged_inputs([ctx] * B, sq)
    case = {"name": name, "shape": [B, HQ, sq, D, ctx]}
    flops = 4.0 * B * HQ * D * sum(ctx - sq + i + 1 for i in range(sq))
    err = max_err(reference(inp, [0, B - 1]), [0, B - 1])
    if REP["part"][0] == 0:
        run("paged_attn", "fuelgraph", case, plan_fn(inp), err, flops=flops)
        run("paged_attn", "fuelgraph kernel", case, kernel_fn(inp), err, flops=flops)
    if args.sweep:
        sweep(case, inp, err, flops=flops, decode=False)
    if args.no_anchors or REP["part"][0] != 0:
        return case
    kd = torch.stack([dense(inp, b)[0] for b in range(B)])          # [B, Hkv, ctx, D]
    vd = torch.stack([dense(inp, b)[1] for b in range(B)])
    if HAVE_FLASH and not args.warm:
        qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (inp["q"], kd, vd))
        run("paged_attn", "flash", case,
            lambda: flash_attn_func(qf, kf, vf, causal=True).transpose(1, 2), err, flops=flops, anchor="flash_attn_func dense (bottom-right causal)")
    try:
        if args.warm:
            raise RuntimeError("not in --warm")
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(sq, ctx)
        kr, vr = kd.repeat_interleave(HQ // HKV, 1), vd.repeat_interleave(HQ // HKV, 1)
        run("paged_attn", "torch eager", case,
            lambda: torch.nn.functional.scaled_dot_product_attention(inp["q"], kr, vr,
                                                                     attn_mask=bias),
            err, flops=flops, anchor="SDPA dense causal_lower_right (kv repeated beforehand)")
    except Exception as exc:  # noqa: BLE001
        print(f"[bench] SDPA lower-right anchor unavailable: {exc!r}", file=sys.stderr)
    if hasattr(F, "flash_attn"):
        try:
            qt, kt, vt = fg.from_torch(inp["q"]), fg.from_torch(kd), fg.from_torch(vd)
            out = F.flash_attn(qt, kt, vt, causal=True)
            plan, ins = compile_plan([out.value])
            bufs = [bound_data(n) for n in ins]
            run("paged_attn", "fuelgraph flash_attn", case, lambda: plan.run(bufs)[0], err,
                flops=flops, anchor="fuelgraph flash_attn dense")
        except Exception as exc:  # noqa: BLE001
            print(f"[bench] fuelgraph flash_attn anchor failed: {exc!r}", file=sys.stderr)
    del kd, vd
    return case


#: launch candidates per case (kernel keyword arguments), kept few: each is one compile. Decode:
#: block ids read a tile ahead (prefetch_index) or not, pipeline depth, tile, split count and the
#: fused merge's step; prefill: query heads per program (group_heads) and explicit tiles.
SWEEPS = {
    # B1: 8 kv heads x splits. 32 splits of 1024 keys = 256 programs (2 of 71.7 KB per SM);
    # 47 / 49 splits fill 3 per SM; 32-key tiles with 5 stages keep 3 tiles in flight in the
    # same shared memory; num_stages 4 = 2 tiles ahead (104 KB: 2 per SM); early_ids (first ids
    # with the length) and merge_group (the fused merge's rows together) shorten the head and
    # the tail of the launch
    # (session 6: per_sm=3 0.0518 ms, num_stages=4 0.0508, bn=32 st=5 per_sm=3 0.0527, bn=32
    # st=4 per_sm=4 0.0512, num_warps=8 0.0514, against 0.0492 for the defaults of then, the
    # pipelined copies = ahead=0 below). Session 7: k/v a tile ahead in registers (kv_ahead,
    # plain loads, which keep kv_evict's L2 policy) with evict_first 0.0464 ms (now the
    # default from 16384 keys), without it 0.0501; L2 prefetches further ahead 0.0486-0.0556;
    # num_stages=1 evict_first per_sm=3 0.0518. Register caps (maxnreg) fit more programs
    # (bytes in flight) per SM but spill: reg=168 per_sm=3 0.0692 ms, reg=128 per_sm=4 0.1136,
    # w=8 reg=128 0.0539, bn=128 w=8 reg=128 0.1036 (default 0.0461-0.0468). 32-key tiles
    # (168 registers): 3 programs per SM 0.0647, 2 per SM 0.0515
    # (session 8, CUDA graph, median of 3, default 0.0461-0.0465 ms: the first two tiles' ids
    # with the length (early_ids=2) 0.0462-0.0465; 2 waves of 512-key splits (programs_per_sm
    # =4) 0.0511; the pipelined copies (ahead=0) 0.0496, with each used tile's L2 lines marked
    # evict_first by a bulk L2 prefetch carrying the policy 0.0625, 3 tiles ahead 0.0664, 3
    # programs per SM 0.0610; and, removed (code in commits e452cd6 / e6ea34c): the last split
    # merging from its registers when all others arrived before its last tile 0.0467; dynamic
    # chunks of 4 tiles taken by ticket 0.0473, 33 programs per kv head 0.0472; keys two tiles
    # ahead and values one 0.0505; two kv heads per program (512-byte rows) 0.0518)
    # (session 10, default 0.0458-0.0461 ms: a ring of kv_ahead key tiles in flight --
    # round 1, re-packed and so drained every iteration: 2 x 32 keys 0.0506, 3 x 32 0.0550,
    # 4 x 16 0.0623; round 2, kept in flight across iterations: 3 x 32 0.0535, 2 x 32 0.0540,
    # 4 x 16 0.0626, 2 x 64 0.0638; 8-warp programs one per SM, 128-key tiles 0.0515, a ring
    # of 2 x 64 0.0610. Round 3: the softmax sum reduced after the loop 0.04603 against
    # 0.04598, in CUDA graphs 0.04668 against 0.04645; all removed, see paged.py)
    "decode_B1_ctx32768": [
        dict(kv_ahead=False, kv_evict=""),
        dict()],
    # (session 7: kv_ahead with evict_first and L2 prefetches 0.3272 ms against 0.2872)
    "decode_B64_mixed": [],
    "decode_B32_ctx4096": [dict(merge_group=True)],
    "prefill_Sq256_ctx4096_B8": [
        dict(block_m=128, block_n=64, num_warps=8, num_stages=3, page_tiles=False),
        dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
        dict(block_m=128, block_n=64, num_warps=8, num_stages=4),
        dict(block_m=128, block_n=64, num_warps=8, num_stages=3, group_heads=4),
        dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
        dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
        dict(prefill=False)],
}


def label(kw):
    short = {"prefetch_index": "pf", "merge_chunk": "mc", "early_ids": "early",
             "merge_group": "mg", "programs_per_sm": "per_sm", "num_stages": "st", "num_warps": "w",
             "n_split": "split", "block_n": "bn", "block_m": "bm", "group_heads": "gh",
             "prefill": "prefill", "page_tiles": "pt", "kv_ahead": "ahead",
             "kv_evict": "evict", "maxnreg": "reg"}
    return ",".join(f"{short.get(k, k)}={int(v) if isinstance(v, bool) else str(v).replace('evict_', '')}"
                    for k, v in kw.items()) or "defaults"


def sweep(case, inp, err, decode, nbytes=None, flops=None):
    """The launch candidates of SWEEPS for this case, as impl "fuelgraph[...]"."""
    k, n = REP["part"]
    for kw in SWEEPS.get(case["name"], []) * (1 if REP.get("warm_only") else REP["rounds"]):
        REP["sweep_i"] = REP.get("sweep_i", -1) + 1     # numbered across cases: parts balance
        if REP["sweep_i"] % n != k:
            continue
        run("paged_attn", f"fuelgraph[{label(kw)}]", case, kernel_fn(inp, **kw), err,
            nbytes=nbytes, flops=flops, launch=kw)


def bench_append(B=64, nb=16384):
    case = {"name": "append_1tok_B64", "shape": [B, HKV, D, nb * BS]}
    g = torch.Generator(device="cpu").manual_seed(1)
    kp = torch.randn(nb, BS, HKV, D, generator=g).to(DT).to(DEV)
    vp = torch.randn(nb, BS, HKV, D, generator=g).to(DT).to(DEV)
    kn = torch.randn(B, HKV, D, generator=g).to(DT).to(DEV)
    vn = torch.randn(B, HKV, D, generator=g).to(DT).to(DEV)
    slots = (torch.randperm(nb, generator=g)[:B] * BS + torch.randint(0, BS, (B,), generator=g))
    s32, s64 = slots.to(torch.int32).to(DEV), slots.to(DEV)
    nbytes = 2 * 2 * B * HKV * D * 2                    # read + write of the new k and v rows

    kn4, vn4 = kn.reshape(B, HKV, 1, D), vn.reshape(B, HKV, 1, D)

    def ours():
        KC.paged_cache_write_kv(kp, vp, kn4, vn4, s32)
        return kp

    def ours_separately():
        KC.paged_cache_write(kp, kn, s32, check=False)
        KC.paged_cache_write(vp, vn, s32, check=False)
        return kp

    kf, vf = kp.view(-1, HKV, D), vp.view(-1, HKV, D)

    def torch_put():
        kf.index_put_((s64,), kn)
        vf.index_put_((s64,), vn)
        return kp
    ours()
    ok = torch.equal(kf[s64], kn) and torch.equal(vf[s64], vn)
    run("paged_cache_write", "fuelgraph kernel", case, ours, nbytes=nbytes, correct=bool(ok),
        note="paged_cache_write_kv: k and v in one launch")
    run("paged_cache_write", "fuelgraph kernel k, v separately", case, ours_separately,
        nbytes=nbytes, note="the registry op's kernel, once per pool")
    run("paged_cache_write", "torch eager", case, torch_put, nbytes=nbytes,
        anchor="index_put_ (k and v)")
    # the whole PagedKVCache step a decode loop runs (host bookkeeping + uploads + 2 scatters)
    cache = PagedKVCache(nb, BS, HKV, D, max_blocks_per_seq=nb // B, max_seqs=B,
                               dtype=fg.bfloat16, device=DEV.type)
    seqs = cache.add_sequences(B)
    kt = fg.from_torch(kn.reshape(B, HKV, 1, D))
    vt = fg.from_torch(vn.reshape(B, HKV, 1, D))
    steps = [0]

    def cache_step():
        if steps[0] >= BS * (nb // B) - 1:
            cache.free(seqs)
            cache.add_sequences(B)
            steps[0] = 0
        cache.extend(seqs, 1)
        cache.write(seqs, kt, vt)
        steps[0] += 1
        return kp
    run("paged_cache_write", "fuelgraph PagedKVCache.extend+write", case, cache_step,
        nbytes=nbytes)
    return case


TARGETS = [   # (case name, metric, our impl, anchor impl, rule)
    ("decode_B32_ctx4096", "gbps", "fuelgraph", "torch eager", ("abs", 3500.0)),
    ("decode_B1_ctx32768", "gbps", "fuelgraph", "torch eager", ("abs", 3000.0)),
    ("decode_B64_mixed", "ms", "fuelgraph", "torch eager", ("speedup", 2.0)),
    ("prefill_Sq256_ctx4096_B8", "ms", "fuelgraph", "flash", ("speedup", 0.8)),
    ("append_1tok_B64", "ms", "fuelgraph kernel", "torch eager", ("speedup", 1.0)),
]


def targets_table():
    def best(case, impl):
        rs = [r for r in RECORDS if r.get("case") == case and r.get("impl") == impl and "ms" in r]
        return min(rs, key=lambda r: r["ms"]) if rs else None
    print("\ncase                        ours ms   anchor ms   metric              target   ok")
    for case, metric, ours_i, anchor_i, (kind, goal) in TARGETS:
        ours = best(case, ours_i)
        anchor = best(case, anchor_i) or (
            (best(case, "fuelgraph flash_attn") or best(case, "torch eager"))
            if anchor_i == "flash" else None)
        if ours is None:
            print(f"{case:26s} (no result)")
            continue
        a_ms = f"{anchor['ms']:9.4f}" if anchor else "        -"
        if kind == "abs":
            val, ok = ours["gbps"], ours["gbps"] >= goal
            desc = f"{val:7.0f} GB/s"
            tgt = f">= {goal:.0f} GB/s"
        else:
            val = anchor["ms"] / ours["ms"] if anchor else float("nan")
            ok = anchor is not None and val >= goal
            desc = f"{val:6.2f}x vs {anchor['impl'] if anchor else '-'}"
            tgt = f">= {goal:.1f}x"
        print(f"{case:26s} {ours['ms']:8.4f} {a_ms}   {desc:19s} {tgt:10s} {'yes' if ok else 'NO'}")
        variants = [r for r in RECORDS if r.get("case") == case and "ms" in r
                    and r.get("impl", "").startswith("fuelgraph[") and not r.get("wrong")
                    and not r["impl"].endswith("(CUDA graph)")]
        if variants:
            v = min(variants, key=lambda r: r["ms"])
            vs = f"{v['gbps']:.0f} GB/s" if kind == "abs" else \
                (f"{anchor['ms'] / v['ms']:.2f}x" if anchor else "")
            print(f"  best variant {v['impl']}: {v['ms']:.4f} ms {vs}")
        floor = best(case, "read live k/v bytes")
        if floor is not None:
            sd = best(case, "torch eager")
            bound = f"; SDPA / read = {sd['ms'] / floor['ms']:.2f}x (the most any kernel that " \
                "reads the live bytes once can gain on SDPA)" if sd else ""
            print(f"  read of the live k/v bytes: {floor['ms']:.4f} ms {floor['gbps']:.0f} GB/s"
                  f"{bound}")
        graphed = [r for r in RECORDS if r.get("case") == case and "ms" in r
                   and r.get("impl", "").endswith("(CUDA graph)") and not r.get("wrong")]
        if graphed:
            v = min(graphed, key=lambda r: r["ms"])
            print(f"  best in a CUDA graph {v['impl']}: {v['ms']:.4f} ms {v['gbps']:.0f} GB/s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warm", action="store_true", help="compile and check every launch once, "
                    "time nothing (fills Triton's cache; run cases in parallel processes first)")
    ap.add_argument("--no-anchors", action="store_true", help="ours only (no SDPA, flash)")
    ap.add_argument("--part", default="0/1", help="K/N: the sweep's candidates K, K+N, ... only "
                    "(the defaults and anchors only in part 0): parallel --warm processes")
    ap.add_argument("--clean-l2", action="store_true", help="decode records also get the "
                    "time after a reading L2 flush (ms_clean_l2)")
    ap.add_argument("--graph", action="store_true", help="decode cases: also time the kernel "
                    "(and with --sweep each candidate) replayed from a CUDA graph")
    ap.add_argument("--bounds", action="store_true", help="decode cases: also time a plain "
                    "read (and a copy) of exactly the live k/v bytes: the floor for any kernel")
    ap.add_argument("--smoke", action="store_true", help="check this script without a GPU: "
                    "TRITON_INTERPRET=1, CPU tensors, tiny cases, implies --warm")
    ap.add_argument("--rounds", type=int, default=1, help="--sweep: time the candidates this "
                    "many times, interleaved (the run's noise)")
    ap.add_argument("--only", default="", help="comma-separated case names (or parts of them): "
                    "decode_B32, decode_B1, decode_B64, prefill, append")
    args = ap.parse_args()
    if args.quick:
        REP.update(warmup=5, rep=20)
    if args.smoke:
        args.warm = True
    REP["warm_only"] = args.warm
    REP["clean_l2"] = args.clean_l2
    REP["rounds"] = max(1, args.rounds)
    REP["part"] = tuple(int(x) for x in args.part.split("/"))
    print(f"device: {device_name()}  torch {torch.__version__}  flash_attn "
          f"{'yes' if HAVE_FLASH else 'no'}", flush=True)
    g = torch.Generator().manual_seed(2)
    mixed = torch.randint(128, 8193, (64,), generator=g).tolist()
    mixed[0] = 8192
    long, batch32, pre = [32768], [4096] * 32, {}
    if args.smoke:
        long, mixed, batch32, pre = [256], [v // 64 for v in mixed[:4]], [64] * 2, \
            dict(B=2, sq=64, ctx=160)
    steps = {"decode_B1": lambda: bench_decode("decode_B1_ctx32768", long, args),
             "decode_B64": lambda: bench_decode("decode_B64_mixed", mixed, args,
                                                pad_to_longest=True),
             "prefill": lambda: bench_prefill(args, **pre),
             "decode_B32": lambda: bench_decode("decode_B32_ctx4096", batch32, args),
             "append": bench_append}
    only = [c for c in (args.only or "").split(",") if c]
    tag = ("_sweep" if args.sweep else "") + "".join(f"_{c}" for c in only)
    paths = [ROOT / "bench" / "results" / f"cuda_paged_{DATE}{tag}.json"]
    if args.out:
        paths.append(args.out / f"cuda_paged_{DATE}{tag}.json")

    def write(final):
        """The records so far (after every case: a run cut short keeps what it measured)."""
        doc = {"date": DATE, "device": device_name(), "torch": torch.__version__,
               "command": " ".join(sys.argv), "records": RECORDS}
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(doc, indent=1))
            if final:
                print(f"wrote {p}")
    for name, step in steps.items():
        if only and not any(c in name for c in only):
            continue
        try:
            step()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        if not SMOKE:
            torch.cuda.empty_cache()
        if not args.warm:
            write(False)
    if args.warm:
        print(f"warm: {len(RECORDS)} launches compiled and checked")
        return
    write(True)
    targets_table()


if __name__ == "__main__":
    main()
