#!/usr/bin/env python3
"""Compile the mma GEMV of `quant_mma` for sm_90 without a GPU and show what its inline PTX
assumes: the 3-d blocked layout of its loads and asm operands must be sizePerThread [1, 1, 4],
threadsPerWarp [32, 1, 1], warpsPerCTA [warps, 1, 1] (thread index = dim 0; printed, and
flagged when another appears). Prints registers, spills and the loop's SASS instructions a
weight.

    python3 bench/sass_quant_mma.py [--fmt Q4_0] [--nt 1] [--configs k,u,ahead[,xahead];...]
                                    [--ttgir]
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

import triton
from triton.compiler import ASTSource

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from sass_common import TARGET, loop_stats  # noqa: E402
from fuelgraph.backends.cuda.kernels import quant_mma as Q  # noqa: E402

ALIGNED = {(i,): [["tt.divisibility", 16]] for i in range(11)}


def source(fmt, cfg, kch=128, nt=1):
    sdt = {Q.Q4_0: "*fp16", Q.Q4_K: "*u8", Q.AWQ: "*fp16", Q.Q8_0: "*fp16", Q.Q6_K: "*i8",
           Q.NF4: "*fp32"}[fmt]
    sig = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": sdt, "z_ptr": "*u8", "t_ptr": "*fp16",
           "out_ptr": "*bf16", "N": "i32", "M": "i32", "stride_x": "i32", "stride_o": "i32",
           "kch": "i32"}
    per_warp = kch // cfg.ksplit
    units = 2 if fmt == Q.Q6_K else min(cfg.units, per_warp)
    diag = bool(getattr(cfg, "diag", 0)) and nt == 1
    lut = bool(cfg.lut) and fmt == Q.NF4
    asm, cons = Q._asm(fmt, units, nt, one_row=nt == 1, diag=diag, lut=lut)
    cons = dict(STEPS=per_warp // units, S=cfg.ksplit, U=units,
                ASM=asm, CONS=cons, FMT=fmt, NT=nt, GPC=1 if fmt == Q.NF4 else 2, AHEAD=cfg.ahead,
                XAHEAD=bool(cfg.xahead), DIAG=diag,
                FILL=Q.nf4.fill_ptx(cfg.ksplit) if lut else "")
    attrs = {k: v for k, v in ALIGNED.items() if k[0] not in (7,)}
    return ASTSource(Q._mma_gemv_kernel, sig, cons, attrs=attrs), 16 * 64 * units * cfg.ksplit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="4,2,1;4,4,1;4,2,0;4,4,2;8,2,1;4,2,1,1")
    ap.add_argument("--ttgir", action="store_true")
    ap.add_argument("--fmt", default="Q4_0", help="Q4_0, Q4_K, AWQ, Q8_0, Q6_K, NF4")
    ap.add_argument("--nt", type=int, default=1, help="x tiles of 8 rows (2: M <= 16)")
    args = ap.parse_args()
    for spec in args.configs.split(";"):
        cfg = Q.MmaConfig(*(int(v) for v in spec.split(",")))
        src, elems = source(getattr(Q, args.fmt), cfg,
                            nt=args.nt)
        try:
            kern = triton.compile(src, target=TARGET, options=dict(
                num_warps=cfg.ksplit, num_stages=1))
        except Exception as exc:  # noqa: BLE001
            print(f"{cfg.tag():28s} FAILED {str(exc)[:600]}")
            continue
        regs, stack, n, ops = loop_stats(kern.asm["cubin"])
        per = n * cfg.ksplit * 32 / elems
        ttgir = kern.asm["ttgir"]
        found = sorted(set(re.findall(r"#blocked\d* = #ttg\.blocked<\{[^}]*\}>", ttgir)))
        top = " ".join(f"{op}:{c}" for op, c in ops.most_common(8))
        print(f"{cfg.tag():28s} regs {regs:3d} stack {stack:4d} smem {kern.metadata.shared:6d} "
              f"{per:5.2f} instr/weight  {top}")
        for f in found:
            bad = "[1, 1, 4]" in f and "threadsPerWarp = [32, 1, 1]" not in f
            print("    ", "WRONG LAYOUT" if bad else "", f)
        if args.ttgir:
            print(ttgir)


if __name__ == "__main__":
    main()
