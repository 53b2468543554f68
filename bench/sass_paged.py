#!/usr/bin/env python3
"""Compile the paged decode kernel (`kernels/paged.py`, grouped split-K path) for sm_90 on a
machine without a GPU, as the JIT specializes it for the issue-13 B1 case (bf16, Hq 32, Hkv 8,
D 128, block 16, context 32768, Sq 1), and report per launch candidate: registers, spill stack,
shared memory and the SASS of the key loop (instructions, loads, tensor-core ops, and how many
of its 16-byte k/v loads are first read only after the loop's back-edge: the tiles a program
keeps in flight from one iteration into the next). Use it to check that a candidate compiles
for Hopper, does not spill, fits the programs per SM it assumes and keeps its tiles in flight,
before a GPU session.

    python3 bench/sass_paged.py [--cands "ahead=1,evict=evict_first;ahead=0,evict=,st=3"]
        [--ptx]
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

from sass_common import TARGET, dump, loop_stats  # noqa: E402
from fuelgraph.backends.cuda.kernels import paged as K  # noqa: E402

PTRS = ["Q", "K", "V", "BT", "CL", "SL", "O", "PO", "PM", "PL", "CNT"]
INTS = ["hq", "hkv", "mb", "nb", "keys_per_split", "n_split", "sl_stride_b"]


def source(kn, block_n=64, kv_ahead=1, kv_evict="evict_first", merge_chunk=8):
    """ASTSource of the grouped kernel for B1 ctx 32768 with these knobs (the JIT's view:
    sq = n_qt = 1 specialized, sizes divisible by 16 marked)."""
    fn = kn                                 # the JITFunction
    sig = {p: ("*bf16" if p in ("Q", "K", "V", "O") else "*i32" if p in ("BT", "CL", "CNT")
               else "*fp32") for p in PTRS}
    sig.update({k: "i32" for k in INTS})
    sig.update(scale="fp32", softcap="fp32")
    cons = dict(sq=1, n_qt=1, G=4, G_T=4, SQ_T=4, BS=16, D=128, BLOCK_D=128, BLOCK_N=block_n,
                HAS_ALIBI=False, HAS_SOFTCAP=False, SPLIT=True, FUSED_MERGE=True,
                MERGE_CHUNK=merge_chunk, DOT_PREC="tf32", DOT_F32=False, PREFETCH_IDX=True,
                OFF32=True, EARLY_IDS=True, MERGE_GROUP=True, KV_EVICT=kv_evict,
                KV_AHEAD=kv_ahead, S_P2=32)
    cons = {k: v for k, v in cons.items() if k in fn.arg_names}
    sig = {k: v for k, v in sig.items() if k in fn.arg_names and k not in cons}
    names = [a for a in fn.arg_names if a in sig]
    aligned = {(names.index(k),): [["tt.divisibility", 16]]
               for k in PTRS + ["hq", "hkv", "mb", "nb", "keys_per_split", "n_split"]
               if k in names}
    return ASTSource(fn, sig, cons, attrs=aligned)


def carried_loads(cubin: bytes):
    """(16-byte k/v loads of the longest loop, how many of them no instruction of the same
    iteration reads: their first reader comes after the back-edge)."""
    _, sass = dump(cubin)
    rows = [(int(m.group(1), 16), m.group(2).split(";")[0].strip()) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/(.*)", ln) for ln in sass.splitlines()) if m]
    addr = [a for a, _ in rows]
    loop = None
    for i, (a, ins) in enumerate(rows):
        m = re.search(r"BRA (0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in addr:
            start = addr.index(int(m.group(1), 16))
            if loop is None or i - start > loop[1] - loop[0]:
                loop = (start, i)
    if loop is None:
        return 0, 0
    body = [ins for _, ins in rows[loop[0]:loop[1] + 1]]
    loads = carried = 0
    for i, ins in enumerate(body):
        if not re.search(r"\bLDG\.E\S*\.128\b", ins):       # register loads (not LDGSTS)
            continue
        loads += 1
        r0 = int(re.search(r"\bR(\d+),", ins.split("LDG.E", 1)[1]).group(1))
        dst = {f"R{r0 + q}" for q in range(4)}
        for later in body[i + 1:]:
            regs = re.findall(r"R\d+", later)
            if any(r in dst for r in (regs if later.lstrip("@!P0123456789 ").startswith("ST")
                                      else regs[1:])):
                break
        else:
            carried += 1
    return loads, carried


def parse(spec):
    kw = {}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        kw[k] = v
    return kw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cands", default="ahead=1,evict=evict_first,bn=64,w=4;"
                    "ahead=1,evict=evict_first,bn=32;ahead=0,evict=,st=3")
    ap.add_argument("--ptx", action="store_true", help="print the PTX loads of the key loop")
    args = ap.parse_args()
    for spec in args.cands.split(";"):
        kw = parse(spec)
        ahead = int(kw.get("ahead", "1"))          # key tiles in flight in registers (0: none)
        src = source(K._paged_attn_kernel, int(kw.get("bn", 64)), ahead,
                     kw.get("evict", "evict_first"), int(kw.get("mc", 8)))
        opts = dict(num_warps=int(kw.get("w", 4)), num_stages=int(kw.get("st", 1 if ahead else 3)))
        if "reg" in kw:
            opts["maxnreg"] = int(kw["reg"])
        try:
            k = triton.compile(src, target=TARGET, options=opts)
        except Exception as exc:  # noqa: BLE001
            print(f"{spec:50s} FAILED {str(exc)[:600]!r}", flush=True)
            continue
        regs, stack, n, ops = loop_stats(k.asm["cubin"])
        loads, carried = carried_loads(k.asm["cubin"])
        top = " ".join(f"{op}:{c}" for op, c in ops.most_common(8))
        print(f"{spec:50s} regs {regs:3d} stack {stack:4d} smem {k.metadata.shared:6d} loop {n:4d} "
              f"LDG {ops.get('LDG', 0)} LDGSTS {ops.get('LDGSTS', 0)} HMMA {ops.get('HMMA', 0)} "
              f"carried {carried}/{loads}"
              f"  {top}", flush=True)
        if args.ptx:
            for ln in k.asm["ptx"].splitlines():
                if "ld.global" in ln or "createpolicy" in ln or "cp.async" in ln:
                    print("   ", ln.strip())


if __name__ == "__main__":
    main()
