#!/usr/bin/env python3
"""Experiment (bench only, nothing in src uses it): the Gluon GEMM's words-by-TMA loop
(`quant_gluon_gemm._consumer_tma`, producer warp, one step an iteration) with the decode of
step s + 1 moved ahead of the wait that retires the wgmma of step s - 1.

Why: in the loop of `_consumer_tma` a step is: wait for the wgmma of step s - 2 (end of the
previous iteration), decode step s, A buffer, CTA barrier, issue the wgmma of step s. So the
decode of s runs only once s - 2 is retired, and the tensor cores idle unless decode +
barrier fit in the time of one step's wgmmas. On the H200 (M = 256) the time a step tracks
the decode's instruction count (about 3 cycles an instruction of a warp), which says the
decode is on the critical path. Here the decode of s + 1 runs right after the wgmma of s is
issued, while those of s - 1 and s are in flight; the wait that retires s - 1 comes after
it (behind a CTA barrier: else ptxas moves it above the decode), just before the A buffer of
s + 1 (the one s - 1 read) is written. Same invariants as
`_consumer_tma`: the A buffer s % 2 is rewritten after s - 2 retired in the warp, the x
buffer of s - 2 handed back after the CTA barrier of s.

    python3 bench/exp_gluon_ahead.py [--ops Q4_0,awq,Q4_K,nf4] [--rounds 3] [--rep 20]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from fuelgraph.backends.cuda.kernels import quant_gluon_gemm as G  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_packed import packed_weight  # noqa: E402


@gluon.jit
def _consumer_ahead(c_ptr, pid_n, magic, a_smem, x_smem, ready, empty, x_desc, m0, steps,
                    KIND: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                    BFA: gl.constexpr, T: gl.constexpr, wt, WTMA: gl.constexpr,
                    DEC: gl.constexpr):
    """`_consumer_tma` (WS, one step an iteration) with step s + 1 decoded before the wait
    that retires step s - 1 (module docstring). Returns (acc, all wgmmas retired,)."""
    BLOCK_N: gl.constexpr = 16 * T
    WORDS: gl.constexpr = 8 if KIND == 2 or KIND == 4 else 4
    PAIRS: gl.constexpr = 8 if KIND == 4 else 4
    dtype: gl.constexpr = x_desc.dtype
    mma_layout: gl.constexpr = G._mma_layout(T, BLOCK_M)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    w_layout: gl.constexpr = G._thread_run_layout(WORDS, T)
    s_layout: gl.constexpr = G._thread_run_layout(PAIRS, T)
    i = gl.arange(0, T * 32 * PAIRS, layout=s_layout)
    src = 4 * (((i // PAIRS) % 32) // 4) + (i % PAIRS) // (PAIRS // 4)
    if KIND == 3:
        lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r",
                                         [gl.arange(0, T * 32 * WORDS, layout=w_layout)],
                                         dtype=gl.int32, is_pure=True, pack=1)
        codes = gl.load(c_ptr + (lane & 15)).to(gl.int32, bitcast=True)
    else:
        codes = 0
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
    gl.assume(steps >= 1)
    mbarrier.wait(ready.index(0), 0)
    w, a, b = G._smem_step(wt, 0, src, T, WORDS, PAIRS, w_layout, s_layout, WTMA, DEC)
    t = G._decode(KIND, w, a, codes if KIND == 3 else b, magic, dtype, T, a_layout, BFA, DEC)
    # step 0 (peeled: the loop carries acc as the in-flight wgmma's result)
    a_smem.index(0).store(t)
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(a_smem.index(0), x_smem.index(0).permute((1, 0)), acc, is_async=True)
    nx = gl.minimum(1, steps - 1)
    mbarrier.wait(ready.index(nx % STAGES), (nx // STAGES) & 1)
    w, a, b = G._smem_step(wt, nx % STAGES, src, T, WORDS, PAIRS, w_layout, s_layout, WTMA, DEC)
    t = G._decode(KIND, w, a, codes if KIND == 3 else b, magic, dtype, T, a_layout, BFA, DEC)
    for st in range(1, steps):
        # the CTA barrier keeps ptxas from sinking the previous decode below the wait (it
        # moves a wgmma wait above independent code otherwise); the wait retires step s - 2,
        # the last reader of A buffer s % 2, and leaves s - 1 in flight
        gl.thread_barrier()
        acc, t = warpgroup_mma_wait(num_outstanding=1, deps=(acc, t))
        a_smem.index(st % 2).store(t)
        fence_async_shared()
        gl.thread_barrier()
        done = st - 2
        mbarrier.arrive(empty.index((done + STAGES) % STAGES),
                        pred=(done >= 0) & (done + STAGES < steps))
        acc = warpgroup_mma(a_smem.index(st % 2), x_smem.index(st % STAGES).permute((1, 0)),
                            acc, is_async=True)
        # step s + 1 while s - 1 and s run (the last iteration decodes its own step again:
        # its buffer is still held)
        nx = gl.minimum(st + 1, steps - 1)
        mbarrier.wait(ready.index(nx % STAGES), (nx // STAGES) & 1)
        w, a, b = G._smem_step(wt, nx % STAGES, src, T, WORDS, PAIRS, w_layout, s_layout, WTMA,
                               DEC)
        t = G._decode(KIND, w, a, codes if KIND == 3 else b, magic, dtype, T, a_layout, BFA,
                      DEC)
    return (warpgroup_mma_wait(num_outstanding=0, deps=(acc, )), )


@gluon.jit
def _ahead_kernel(x_desc, q_desc, a_desc, b_desc, c_ptr, out_ptr, part_ptr, cnt_ptr, M, K,
                  stride_o, magic, KIND: gl.constexpr, BLOCK_M: gl.constexpr,
                  STAGES: gl.constexpr, num_warps: gl.constexpr, BFA: gl.constexpr,
                  DEC: gl.constexpr):
    """`_gluon_gemm_kernel` with WS, WTMA, split K in two and `_consumer_ahead`."""
    BLOCK_N: gl.constexpr = 16 * num_warps
    dtype: gl.constexpr = x_desc.dtype
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    steps = K // 64 // 2
    k0 = gl.program_id(2) * steps
    m0 = pid_m * BLOCK_M
    x_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, 64], x_desc.layout)
    a_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, 64],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], dtype))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    tile = pid_n * num_warps
    HAS_B: gl.constexpr = (KIND < 3 or KIND == 5) and not BFA
    WT: gl.constexpr = 2 if HAS_B else 1
    q_ring = gl.allocate_shared_memory(gl.int32, [STAGES, num_warps, q_desc.block_type.shape[1]],
                                       q_desc.layout)
    sa_ring = gl.allocate_shared_memory(gl.float32, [STAGES, num_warps,
                                                     a_desc.block_type.shape[1]], a_desc.layout)
    if HAS_B:
        sb_ring = gl.allocate_shared_memory(gl.float32, [STAGES, num_warps,
                                                         b_desc.block_type.shape[1]],
                                            b_desc.layout)
    else:
        sb_ring = sa_ring
    wt = (q_desc, a_desc, b_desc, q_ring, sa_ring, sb_ring)
    for s in gl.static_range(STAGES):
        if s < steps:
            G._issue(s, True, x_smem, ready, x_desc, m0, steps, STAGES, 0, False, k0, wt, tile,
                     WT)
    acc = gl.warp_specialize([(_consumer_ahead, (c_ptr, pid_n, magic, a_smem, x_smem, ready,
                                                 empty, x_desc, m0, steps, KIND, BLOCK_M,
                                                 STAGES, BFA, num_warps, wt, WT, DEC)),
                              (G._x_producer, (x_desc, x_smem, ready, empty, m0, steps, STAGES,
                                               0, False, k0, wt, tile, WT))],
                             [1], [40])[0]
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    mma_layout: gl.constexpr = G._mma_layout(num_warps, BLOCK_M)
    G._split_epilogue(acc, out_ptr, pid_n * BLOCK_N, m0, M, stride_o, part_ptr, cnt_ptr,
                      pid_m * gl.num_programs(0) + pid_n, BLOCK_N, BLOCK_M, mma_layout)


def run_ahead(fmt: int, x, w0, w1, w2, i0: int, k: int, n: int, cfg: "G.GluonGemmConfig"):
    """x [M, K] bf16 @ W.T by `_ahead_kernel` (cfg: num_warps, block_m, stages, h2, dec)."""
    pw = packed_weight(fmt, w0, w1, w2, i0, k, n, build=G.pack_wgmma)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    desc = TensorDescriptor.from_tensor(x, [cfg.block_m, G.STEP_K],
                                        G.x_layout(cfg.block_m, G.gl.bfloat16))
    grid = (n // cfg.block_n, (m + cfg.block_m - 1) // cfg.block_m)
    h2 = bool(cfg.h2) and fmt in (G.Q4_0, G.AWQ)
    sa, sb = G.h2_scales(pw) if h2 else (pw.a, pw.b)
    wd = G.weight_descs(fmt, pw, sa, sb, cfg.num_warps)
    cnt = G._counters(x.device, grid[0] * grid[1])
    part = torch.empty(grid[0] * grid[1] * cfg.block_n * cfg.block_m, dtype=torch.float32,
                       device=x.device)
    _ahead_kernel[grid + (2, )](desc, *wd, w2 if fmt == G.NF4 else pw.a, out, part, cnt, m, k,
                                out.stride(0), G.H2_MAGIC if h2 else G.MAGIC,
                                KIND=5 if h2 else G._KIND[fmt], BLOCK_M=cfg.block_m,
                                STAGES=cfg.stages, num_warps=cfg.num_warps,
                                BFA=fmt in G._BFA and not h2, DEC=cfg.dec)
    return out


def main() -> None:
    from triton.testing import do_bench_cudagraph

    from bench_cuda_quant_gemm import OP_IDS, _variant
    from bench_cuda_quant_gemv import close, weights
    from fuelgraph.backends.cuda.kernels import quant as K
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="Q4_0,awq,Q4_K,nf4")
    ap.add_argument("--var", default="Q4_0=h2:1+dec:1/awq=h2:1+dec:1/Q4_K=1/nf4=1",
                    help="per op the launch fields over its default (bench --dec syntax)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    n = k = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    var = dict(v.split("=") for v in args.var.split("/"))
    for op in args.ops.split(","):
        fn, w, _ = weights(op, n, k, g)
        x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16, generator=g)
        want = torch.nn.functional.linear(x, w)
        cfg = _variant(K.GLUON_GEMM[OP_IDS[op]][256], var.get(op, "0"))
        pw_args = _raw_args(op, fn)
        ahead = lambda: run_ahead(*pw_args, x, cfg)  # noqa: E731
        same = lambda: fn(x, cfg)  # noqa: E731
        got = ahead()
        ok, err = close(got, want)
        same_bits = torch.equal(got, same()) and torch.equal(got, ahead())
        print(f"{op:5s} ahead {cfg.tag()} close={ok} err={err:.3g} "
              f"bit-identical to the loop's and itself: {same_bits}", flush=True)
        if not ok or args.compile_only:
            continue
        ms = {"loop": [], "ahead": []}
        for _ in range(args.rounds):
            ms["loop"].append(do_bench_cudagraph(same, rep=args.rep, return_mode="median"))
            ms["ahead"].append(do_bench_cudagraph(ahead, rep=args.rep, return_mode="median"))
        print(f"{op:5s} {cfg.tag():44s} loop " + " ".join(f"{v:.4f}" for v in ms["loop"])
              + " | ahead " + " ".join(f"{v:.4f}" for v in ms["ahead"]), flush=True)


def _raw_args(op, fn):
    """(fmt, w0, w1, w2, i0, k, n) of the weight behind bench_cuda_quant_gemv.weights' fn."""
    cl = {v: c.cell_contents for v, c in zip(fn.__code__.co_freevars, fn.__closure__)}
    from fuelgraph.backends.cuda.kernels import quant as K
    n = k = 8192
    if op == "nf4":     # (the code table tensor nf4_matmul passes: the same cached copy)
        return (K.NF4, cl["packed"], cl["absmax"], K._nf4_code("cuda:0"), 64, k, n)
    if op == "awq":
        return (K.AWQ, cl["words"], cl["zeros"], cl["scales"], 128, k, n)
    raw = cl["raw"]
    fid = K.GGUF_IDS[op]
    return (fid, raw, raw, raw, raw.numel() // n, k, n)


if __name__ == "__main__":
    main()
