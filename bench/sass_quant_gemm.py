#!/usr/bin/env python3
"""Compile the many-row GEMM on the packed weight copy (`quant_packed_gemm`) for sm_90 on a
machine without a GPU and report per launch configuration: registers, spill stack, shared
memory, the SASS instructions of the main loop per weight element of the program's tile
(decode + dot issue, per x tile) and its most frequent opcodes (HGMMA = wgmma).

    python3 bench/sass_quant_gemm.py [--fmt Q4_0,AWQ,Q4_K,NF4,Q8_0,Q6_K]
                                     [--cfg "128,128,1,8,3,2;128,128,1,8,3,0,1"]
        (block_n,block_m,split,warps,stages[,tma[,vec]])
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
from fuelgraph.backends.cuda.kernels import quant_packed_gemm as G  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_packed import _KIND, CHUNK  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_tiles import AWQ, GGUF_IDS, NF4  # noqa: E402

ALIGNED = {(i,): [["tt.divisibility", 16]] for i in range(16)}


def source(fmt, cfg, steps=32):
    """The kernel with bf16 x and output, whole tiles (tma=2, affine formats: the all-TMA
    kernel)."""
    kind = _KIND[fmt]
    aff = kind in (0, 2, 4)
    out = "*fp32" if cfg.split > 1 else "*bf16"
    d = G._DELTA.get(kind, (0,) * 8)
    if cfg.tma >= 2 and aff:
        sig = {"xd": f"tensordesc<bf16[{cfg.block_m}, 128]>",
               "qd": f"tensordesc<i32[{cfg.block_n}, 32]>",
               "sd": f"tensordesc<i64[{cfg.block_n}, 4]>", "out_ptr": out, "M": "i32",
               "N": "i32", "stride_o": "i32", "magic": "i32"}
        cons = dict(STEPS=steps, KIND=kind, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
                    STAGES=cfg.num_stages, ATOMIC=cfg.split > 1, D0=d[:4], D1=d[4:])
        return ASTSource(G._packed_gemm_tma_kernel, sig, cons,
                         attrs={(3,): [["tt.divisibility", 16]]})
    sdt = "*i64" if aff else {NF4: "*fp32", GGUF_IDS["Q6_K"]: "*u8"}.get(fmt, "*fp16")
    xsig = f"tensordesc<bf16[{cfg.block_m}, 128]>" if cfg.tma else "*bf16"
    sig = {"x_ptr": xsig, "q_ptr": "*i32", "s_ptr": sdt, "z_ptr": sdt,
           "c_ptr": "*fp16" if fmt == GGUF_IDS["Q6_K"] else "*fp32", "out_ptr": out,
           "M": "i32", "N": "i32", "kw": "i32", "s_row": "i32", "c_row": "i32",
           "stride_x": "i32", "stride_o": "i32", "magic": "i32"}
    cons = dict(STEPS=steps, KIND=kind, E=CHUNK[fmt],
                BS=32 if aff else {NF4: 64, GGUF_IDS["Q6_K"]: 16}.get(fmt, 32),
                BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, STAGES=cfg.num_stages,
                ATOMIC=cfg.split > 1, EVEN_N=True, EVEN_M=True, PREC="tf32", D0=d[:4],
                D1=d[4:], SHFL=fmt == NF4, TMA_X=bool(cfg.tma), VEC=bool(cfg.vec))
    attrs = {k: v for k, v in ALIGNED.items() if k[0] not in (10, 13)}
    return ASTSource(G._packed_gemm_kernel, sig, cons, attrs=attrs)


def mma_loop_stats(cubin: bytes):
    """(registers, stack, instructions of the innermost loop holding the HGMMAs, opcodes): the
    main loop even where TMA waits and warp specialization add other loops."""
    import collections
    import os
    import re
    import subprocess
    import tempfile
    from sass_common import BIN
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        pathlib.Path(path).write_bytes(cubin)
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", path], capture_output=True,
                              text=True).stdout
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    ops_at = {a: ln.split("*/", 1)[1].split() for a, ln in zip(addr, lines)}
    best = None
    for a, ln in zip(addr, lines):
        m = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < a:
            lo = int(m.group(1), 16)
            if any("HGMMA" in " ".join(ops_at[b][:2]) for b in addr if lo <= b <= a):
                if best is None or a - lo < best[1] - best[0]:
                    best = (lo, a)
    if best is None:
        return 0, collections.Counter()
    body = [ops_at[b] for b in addr if best[0] <= b <= best[1]]
    ops = collections.Counter((t[1] if t[0].startswith("@") else t[0]).split(".")[0]
                              for t in body if t)
    return len(body), ops


def report(name, fmt, cfg):
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    try:
        k = triton.compile(source(fmt, cfg), target=TARGET, options=opts)
    except Exception as exc:  # noqa: BLE001
        print(f"{name:52s} FAILED {str(exc)[:400]!r}", flush=True)
        return
    regs, stack, _, _ = loop_stats(k.asm["cubin"])
    n, ops = mma_loop_stats(k.asm["cubin"])
    per = n * cfg.num_warps * 32 / (cfg.block_n * 128)
    top = " ".join(f"{op}:{c}" for op, c in ops.most_common(10))
    print(f"{name:52s} regs {regs:3d} stack {stack:4d} smem {k.metadata.shared:6d}  "
          f"{per:5.2f} instr/weight  {top}", flush=True)
    return k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="Q4_0")
    ap.add_argument("--cfg", default="128,128,1,8,3,2;128,128,1,8,3,0,1")
    ap.add_argument("--ptx", default=None, help="write the first kernel's PTX here")
    args = ap.parse_args()
    ids = {**GGUF_IDS, "NF4": NF4, "AWQ": AWQ}
    for name in args.fmt.split(","):
        for spec in args.cfg.split(";"):
            v = [int(t) for t in spec.split(",")]
            cfg = G.PackedGemmConfig(*v)
            k = report(f"{name} {cfg.tag()}", ids[name], cfg)
            if args.ptx and k is not None:
                pathlib.Path(args.ptx).write_text(k.asm["ptx"])
                args.ptx = None


if __name__ == "__main__":
    main()
