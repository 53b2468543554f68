#!/usr/bin/env python3
"""Compile the split-row one-pass cross-entropy kernels (`loss_split`, `loss_flow`; bf16 logits,
loss + gradient, mean with ignore_index) for sm_90 on a machine without a GPU and report, per
launch configuration of the bench sweep, registers, spill stack, shared memory and how many
programs fit on one SM (with the chunk bytes they hold, what the L2 must keep for the
second read).

    python3 bench/sass_ce_split.py ['[dict(split_chunk=8192, hold=True, num_warps=4), ...]']
"""
from __future__ import annotations

import pathlib
import sys
import time

import triton
from triton.compiler import ASTSource

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from fuelgraph.backends.cuda.kernels import loss_split as LS  # noqa: E402
from fuelgraph.backends.cuda.kernels.common import next_pow2  # noqa: E402
from sass_common import TARGET, loop_stats  # noqa: E402

V = 128256
SIG = {"x_ptr": "*bf16", "t_ptr": "*i64", "g_ptr": "*fp32", "n_ptr": "*i64",
       "loss_ptr": "*fp32", "dx_ptr": "*bf16", "pm_ptr": "*fp32", "ps_ptr": "*fp32",
       "sync_ptr": "*i32", "R": "i32", "V": "i32", "CHUNK": "i32", "N_MEAN": "fp32",
       "ignore_index": "i32"}
ALIGNED = {(i,): [["tt.divisibility", 16]] for i in range(12)}   # as the JIT specializes
SM_REGS, SM_SMEM, SM_WARPS = 65536, 228 * 1024, 64


def compile_flow(cfg):
    from fuelgraph.backends.cuda.kernels import loss_flow as LF
    S, chunk = LF.flow_plan(V, cfg["split_chunk"], 2)
    sig = {k: v for k, v in SIG.items() if k not in ("CHUNK", "ps_ptr")}
    sig["pm_ptr"] = "*i64"
    cons = dict(HAS_IGNORE=True, REDUCTION=0, STORE_LOSS=True, WRITE_GRAD=True, S=S,
                S_P2=next_pow2(S), CHUNK=chunk, PACK=True, BF16=True, ASM=True)
    opts = dict(num_warps=cfg["num_warps"])
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    src = ASTSource(LF._ce_flow_kernel, sig, cons, attrs=ALIGNED)
    return triton.compile(src, target=TARGET, options=opts)


def compile_cfg(cfg):
    if cfg.get("flow"):
        return compile_flow(cfg)
    hold = cfg.get("hold", False)
    S, chunk = LS.split_plan(V, cfg["split_chunk"], hold=hold)
    cons = dict(HAS_IGNORE=True, REDUCTION=0, STORE_LOSS=True, WRITE_GRAD=True, S=S,
                S_P2=next_pow2(S), WORD=cfg.get("meet", LS.CE_SPLIT_MEET) == "word")
    sig = dict(SIG)
    if cons["WORD"]:
        sig.update(pm_ptr="*i64", ps_ptr="*i64")
    if hold:
        sig = {k: v for k, v in sig.items() if k != "CHUNK"}
        cons.update(CHUNK=chunk, PACK=cfg.get("pack", True), ASM=True,
                    EAGER=cfg.get("eager", LS.CE_HOLD_EAGER))
        src = ASTSource(LS._ce_held_kernel, sig, cons, attrs=ALIGNED)
        opts = dict(num_warps=cfg["num_warps"])
        maxnreg = cfg.get("maxnreg", LS.CE_HOLD_MAXNREG)
        if maxnreg:
            opts["maxnreg"] = maxnreg
        return triton.compile(src, target=TARGET, options=opts)
    cons.update(BLOCK=cfg["block"], STAGES=cfg["stages"], EVICT=cfg.get("evict", "evict_last"),
                GROUP=cfg.get("group", LS.CE_SPLIT_GROUP), FAST=cfg.get("fast", False), ASM=True)
    src = ASTSource(LS._ce_split_kernel, sig, cons, attrs=ALIGNED)
    return triton.compile(src, target=TARGET, options=dict(num_warps=cfg["num_warps"],
                                                           num_stages=cfg["stages"]))


def main():
    from bench_cuda_loss import split_sweep_configs
    configs = split_sweep_configs()
    if len(sys.argv) > 1:           # e.g. '[dict(split_chunk=8192, hold=True, num_warps=4)]'
        configs = eval(sys.argv[1], {"dict": dict})
    for cfg in configs:
        t0 = time.perf_counter()
        try:
            k = compile_cfg(cfg)
        except Exception as exc:  # noqa: BLE001
            print(f"{cfg} FAILED {str(exc)[-600:]}")
            continue
        secs = time.perf_counter() - t0
        regs, stack, _, _ = loop_stats(k.asm["cubin"])
        smem = k.metadata.shared
        w = cfg["num_warps"]
        fit = min(SM_WARPS // w, SM_REGS // max(1, regs * 32 * w),
                  SM_SMEM // max(1, smem + 1024), 32)
        print(f"regs {regs:3d} stack {stack:4d} smem {smem:6d} fit/SM {fit:2d} "
              f"compile {secs:4.1f} s  {cfg}", flush=True)


if __name__ == "__main__":
    main()
