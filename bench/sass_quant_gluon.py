#!/usr/bin/env python3
"""Compile the Gluon wgmma GEMM of `quant_gluon_gemm` for sm_90 on a machine without a GPU and
report per format and launch: registers, spill stack, shared memory, the main loop's SASS
instructions per weight element of the program's tile (decode + wgmma issue), its most
frequent opcodes, and whether the loop has shared-memory stores (STS) or CTA barriers (BAR)
beyond the one a step that frees the x buffer: the decoded tile must stay in registers.

    python3 bench/sass_quant_gluon.py [--fmt Q4_0,AWQ,Q4_K,Q8_0] [--cfg "4,256,4;8,128,4"]
        (warps,block_m,stages[,sub[,ws[,h2[,rot[,late[,split[,wtma[,rega]]]]]]]]])  [--ttgir]
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys

import triton

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sass_common import TARGET, dump  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from fuelgraph.backends.cuda.kernels import quant_gluon_gemm as G  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_tiles import GGUF_IDS  # noqa: E402

FMTS = {name: GGUF_IDS[name] for name in ("Q4_0", "Q4_K", "Q8_0", "Q6_K")}


def compile_one(fmt: int, cfg: G.GluonGemmConfig):
    """The compiled kernel (bf16 x and output) for this format and launch."""
    lay = G.x_layout(cfg.block_m, G.gl.bfloat16)
    xd = f"tensordesc<bf16[{cfg.block_m}, 64],{lay!r}>"
    wtma = bool(cfg.wtma)
    words, pairs = 32 * (8 if G._BITS[fmt] == 8 else 4), 8 * G._PAIRS[G._KIND[fmt]]
    qd, ad = ((f"tensordesc<i32[{cfg.num_warps}, {words}],{G.PLAIN32!r}>",
               f"tensordesc<fp32[{cfg.num_warps}, {pairs}],{G.PLAIN32!r}>") if wtma else (xd, xd))
    sig = {"x_desc": xd, "q_desc": qd, "a_desc": ad, "b_desc": ad, "q_ptr": "*i32",
           "a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "out_ptr": "*bf16",
           "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "stride_o": "i32", "magic": "i32"}
    h2 = bool(cfg.h2) and fmt in (G.Q4_0, G.AWQ)
    cons = dict(KIND=5 if h2 else G._KIND[fmt], BLOCK_M=cfg.block_m, STAGES=cfg.stages,
                SUB=cfg.sub, BFA=fmt in G._BFA, WS=bool(cfg.ws), ROT=bool(cfg.rot),
                LATE=bool(cfg.late), SPLIT=cfg.split, WTMA=wtma, REGA=bool(cfg.rega),
                num_warps=cfg.num_warps)
    attrs = {(i,): [["tt.divisibility", 16]] for i in (4, 5, 6, 7, 8, 9, 10, 13, 14)}
    src = GluonASTSource(G._gluon_gemm_kernel, sig, cons, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=cfg.num_warps))


def mma_loop(cubin: bytes):
    """(registers, the main loop: of the backward branches' spans, the one with the most
    HGMMAs and then the fewest instructions (the mbarrier waits' retry branches span more):
    its instructions and opcode counts)."""
    res, sass = dump(cubin)
    rows = []
    for ln in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            rows.append((int(m.group(1), 16), m.group(2)))
    loop, best = [], None
    for a, ins in rows:
        b = re.search(r"BRA (0x[0-9a-f]+)", ins)
        if b and int(b.group(1), 16) < a:
            body = [i for x, i in rows if int(b.group(1), 16) <= x <= a]
            key = (sum("HGMMA" in i for i in body), -len(body))
            if key[0] and (not loop or key > best):
                loop, best = body, key
    ops = collections.Counter(
        (i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0] for i in loop)
    regs = re.search(r"REG:(\d+)", res)
    ops["WAIT0"] = sass.count("DEPBAR.LE gsb0, 0x0")    # 1: only the final wait
    return int(regs.group(1)) if regs else -1, len(loop), ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="Q4_0,Q4_K,Q8_0,NF4,Q6_K")
    ap.add_argument("--cfg", default="4,256,4;8,128,4")
    ap.add_argument("--ttgir", action="store_true")
    args = ap.parse_args()
    fmts = {**FMTS, "AWQ": G.AWQ, "NF4": G.NF4}
    for name in args.fmt.split(","):
        for c in args.cfg.split(";"):
            cfg = G.GluonGemmConfig(*(int(v) for v in c.split(",")))
            k = compile_one(fmts[name], cfg)
            if args.ttgir:
                print(k.asm["ttgir"])
            regs, n, ops = mma_loop(k.asm["cubin"])
            per = n * 32 * cfg.num_warps / (cfg.block_n * 64 * cfg.sub)  # a thread's, a weight
            top = ", ".join(f"{o} {c}" for o, c in ops.most_common(13) if o != "WAIT0")
            print(f"{name:5s} {cfg.tag():28s} regs {regs} smem "
                  f"{k.metadata.shared} loop {n} instr = {per:.2f}/weight (per x tile) "
                  f"STS {ops.get('STS', 0)} BAR {ops.get('BAR', 0)} "
                  f"{'SERIALIZED wgmma ' if ops['WAIT0'] > 1 else ''}| {top}")


if __name__ == "__main__":
    main()
