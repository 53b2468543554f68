#!/usr/bin/env python3
"""Compile the storage-order quantized-matmul kernels (`quant_rows`) for sm_90 on a machine
without a GPU and report, per launch configuration, registers, spill stack, shared memory and
the SASS instructions of the main loop per weight element (with the most frequent opcodes).

The weight-bound GEMV paths are limited by instruction issue as much as by memory: N = K = 8192
at ~5 instructions per element is ~10 us of issue on an H200 (132 SMs x 4 schedulers), the
4-bit weight's ~9 us of DRAM time. Use it to compare kernel variants before a GPU session.

    python3 bench/sass_quant_rows.py [--fmt Q4_0,Q8_0,Q4_K,Q6_K,NF4,AWQ] [--ms 1,16,256]
    python3 bench/sass_quant_rows.py --fmt Q4_0,NF4 --packed "16,4,4,1,2;16,4,2,0,2,1,1,3"
        (quant_packed: block_n,chunks,warps,prefetch[,halves,fma,x32,stages,pair])
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import triton
from triton.compiler import ASTSource

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sass_common import TARGET, loop_stats  # noqa: E402
from fuelgraph.backends.cuda.kernels import quant_gemm as QG  # noqa: E402
from fuelgraph.backends.cuda.kernels import quant_rows as R  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_tiles import AWQ, GGUF_IDS, NF4, Q4_K  # noqa: E402

QK = {GGUF_IDS["Q4_0"]: 32, GGUF_IDS["Q8_0"]: 32, Q4_K: 256, GGUF_IDS["Q6_K"]: 256, NF4: 64}
ALIGNED = {(i,): [["tt.divisibility", 16]] for i in range(12)}


def rows_source(fmt, cfg):
    xdt = "fp32" if cfg.block_m == 1 and cfg.x32 else "bf16"
    sig = {"x_ptr": f"*{xdt}", "w_ptr": "*u8", "s_ptr": "*fp32", "c_ptr": "*fp32",
           "out_ptr": "*fp32", "M": "i32", "N": "i32", "row_bytes": "i32", "s_row": "i32",
           "nblk": "i32", "stride_x": "i32", "stride_o": "i32", "magic": "i32"}
    words = bool(cfg.words) and fmt in R.WORD_FORMATS
    cons = dict(STEPS=4, FMT=fmt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NB=cfg.steps, BS=64,
                USE_DOT=cfg.use_dot, PREC="tf32", ATOMIC=True, LUT=cfg.lut,
                ELEM=cfg.block_m == 1, EVEN=True, **R._plane_shape(fmt, cfg.steps, 64, words))
    attrs = {k: v for k, v in ALIGNED.items() if k[0] not in (5, 9, 12)}
    return ASTSource(R._rows_kernel, sig, cons, attrs=attrs), QK[fmt] * cfg.steps * cfg.block_n


def awq_source(cfg, group=128):
    xdt = "fp32" if cfg.block_m == 1 and cfg.x32 else "bf16"
    sig = {"x_ptr": f"*{xdt}", "qw_ptr": "*i32", "qz_ptr": "*i32", "sc_ptr": "*fp16",
           "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "group_size": "i32",
           "stride_x": "i32", "stride_o": "i32", "magic": "i32"}
    bk = min(cfg.steps, group)
    sub = cfg.sub
    while sub > 1 and group % (sub * bk):
        sub //= 2
    cons = dict(STEPS=4, BLOCK_M=cfg.block_m, BLOCK_W=cfg.block_n // 8, BLOCK_K=bk,
                USE_DOT=cfg.use_dot, PREC="tf32", ATOMIC=True, ELEM=cfg.block_m == 1,
                ACC_R=bk if cfg.block_m == 1 else cfg.block_m, SUB=sub)
    attrs = {k: v for k, v in ALIGNED.items() if k[0] not in (5, 11)}
    return ASTSource(R._awq_kernel, sig, cons, attrs=attrs), bk * sub * cfg.block_n


def gemm_source(fmt, cfg, group=128):
    """The fused dequantizing GEMM (`quant_gemm`) with bf16 x, EVEN tiles, float32 atomics."""
    if fmt == AWQ:
        sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "qz_ptr": "*i32", "sc_ptr": "*fp16",
               "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "group_size": "i32",
               "stride_x": "i32", "stride_o": "i32", "magic": "i32"}
        bk = min(cfg.block_k, group)
        cons = dict(STEPS=4, BLOCK_M=cfg.block_m, BLOCK_W=cfg.block_n // 8, BLOCK_K=bk,
                    PREC="tf32", ATOMIC=False, EVEN=True)
        attrs = {k: v for k, v in ALIGNED.items() if k[0] not in (5, 11)}
        return ASTSource(QG._awq_gemm_kernel, sig, cons, attrs=attrs), bk * cfg.block_n
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "c_ptr": "*fp32",
           "out_ptr": "*bf16", "M": "i32", "N": "i32", "row_bytes": "i32", "s_row": "i32",
           "nunit": "i32", "stride_x": "i32", "stride_o": "i32", "magic": "i32"}
    unit = 64 if fmt == NF4 else QG.UNIT[fmt]
    g = max(1, cfg.block_k // unit)
    cons = dict(STEPS=4, FMT=fmt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, G=g, BS=64,
                LUT=cfg.lut, W_LEFT=bool(cfg.w_left), PREC="tf32", ATOMIC=False, EVEN=True,
                PREFETCH=bool(cfg.prefetch))
    attrs = {k: v for k, v in ALIGNED.items() if k[0] not in (5, 9, 12)}
    return ASTSource(QG._qgemm_kernel, sig, cons, attrs=attrs), g * unit * cfg.block_n


def packed_source(fmt, cfg, x="fp32"):
    """The one-row GEMV on the chunk-layout copy (`quant_packed`), EVEN, stored in bf16."""
    from fuelgraph.backends.cuda.kernels import quant_packed as P
    q6k = GGUF_IDS["Q6_K"]
    sdt = {NF4: "*fp32", Q4_K: "*u8", q6k: "*u8"}.get(fmt, "*fp16")
    sig = {"x_ptr": f"*{x}", "q_ptr": "*i32", "s_ptr": sdt,
           "z_ptr": "*u8" if fmt in (AWQ, Q4_K) else sdt,
           "c_ptr": "*fp16" if fmt in (Q4_K, q6k) else "*fp32", "out_ptr": "*bf16", "N": "i32", "kw": "i32", "s_row": "i32",
           "nch": "i32", "magic": "i32"}
    cons = dict(STEPS=8, KIND=P._KIND[fmt], E=P.CHUNK[fmt], BS={NF4: 64, AWQ: 128, q6k: 16}.get(fmt, 32),
                BLOCK_N=cfg.block_n, C=cfg.chunks, ATOMIC=False, PREFETCH=bool(cfg.prefetch),
                EVEN=True, XB=bool(cfg.prefetch) or cfg.stages <= 1, FMA_DEQ=bool(cfg.fma),
                H=max(cfg.halves, 2) if fmt == q6k else cfg.halves, DEQ=False,
                STAGES=1 if cfg.prefetch else cfg.stages, PAIR=fmt == NF4 and bool(cfg.pair))
    attrs = {k: v for k, v in ALIGNED.items() if k[0] != 10}
    return (ASTSource(P._packed_gemv_kernel, sig, cons, attrs=attrs),
            cfg.block_n * cfg.chunks * P.CHUNK[fmt])


def report(name, src, elems, cfg, fuse=True):
    try:
        k = triton.compile(src, target=TARGET, options=dict(
            num_warps=cfg.num_warps, num_stages=getattr(cfg, "num_stages", 1),
            enable_fp_fusion=fuse))
    except Exception as exc:  # noqa: BLE001
        print(f"{name:48s} FAILED {str(exc)[:300]!r}")
        return
    regs, stack, n, ops = loop_stats(k.asm["cubin"])
    per = n * cfg.num_warps * 32 / elems
    top = " ".join(f"{op}:{c}" for op, c in ops.most_common(8))
    print(f"{name:48s} regs {regs:3d} stack {stack:4d} smem {k.metadata.shared:6d}  "
          f"{per:5.2f} instr/weight  {top}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="Q4_0,Q8_0,Q4_K,Q6_K,NF4,AWQ")
    ap.add_argument("--ms", default="1,16,256")
    ap.add_argument("--gemm", default=None,
                    help="fused GEMM configs instead: m,n,k,warps,stages[,w_left[,prefetch]];...")
    ap.add_argument("--packed", default=None,
                    help="one-row chunk-layout GEMV configs instead: "
                         "block_n,chunks,warps,prefetch,halves,fma,x32,stages,pair;...")
    args = ap.parse_args()
    ids = {**GGUF_IDS, "NF4": NF4, "AWQ": AWQ}
    if args.packed:
        from fuelgraph.backends.cuda.kernels.quant_packed import PackedConfig
        for name in args.fmt.split(","):
            if name not in ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "NF4", "AWQ"):
                continue
            for spec in args.packed.split(";"):
                given = [int(t) for t in spec.split(",")]
                v = given + [1, 2, 1, 1, 1, 1][len(given) - 3:]
                cfg = PackedConfig(v[0], v[1], 1, v[2], v[3], v[4], v[5], v[6], v[7], v[8])
                src, elems = packed_source(ids[name], cfg, "fp32" if cfg.x32 else "bf16")
                report(f"{name} {cfg.tag()}", src, elems, cfg)
        return
    if args.gemm:
        for name in args.fmt.split(","):
            for spec in args.gemm.split(";"):
                v = [int(t) for t in spec.split(",")]
                cfg = QG.GemmConfig(v[0], v[1], v[2], 1, v[3], v[4], v[5] if len(v) > 5 else 0,
                                    prefetch=v[6] if len(v) > 6 else 0)
                src, elems = gemm_source(ids[name], cfg)
                report(f"{name} {cfg.tag()}", src, elems, cfg,
                       fuse=ids[name] not in (Q4_K, AWQ))
        return
    for name in args.fmt.split(","):
        fmt = ids[name]
        for m in (int(v) for v in args.ms.split(",")):
            cfg = R.default_rows_config(fmt, m)
            src, elems = awq_source(cfg) if fmt == AWQ else rows_source(fmt, cfg)
            report(f"{name} M={m} {cfg.tag()}", src, elems, cfg, fuse=fmt != Q4_K)


if __name__ == "__main__":
    main()
