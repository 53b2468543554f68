#!/usr/bin/env python3
"""Does ptxas keep an in-flight wgmma's register A operand? Compiles the Gluon GEMM of
`quant_gluon_gemm` with register A (`GluonGemmConfig.rega`) for sm_90 on a machine without a
GPU, assembles the same PTX with each ptxas given, and checks the SASS: between an HGMMA that
takes registers as A (`HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[..]`: R152..R155) and the
WARPGROUP.DEPBAR that retires its group, no instruction may write those registers (the PTX
rule for `wgmma.mma_async`). Also reports ptxas's warnings (serialized wgmmas), registers and
whether every wgmma is waited for at once (`DEPBAR.LE gsb0, 0x0` in the loop).

    python3 bench/sass_wgmma_regs.py [--fmt Q4_0,...] [--cfg "8,256,5,1,1,0,0,0,2,1,1;..." |
        --defaults] [--ptxas PATH,PATH]   (default: Triton's bundled ptxas and CUDA 13.0's;
        --defaults: each format's launches of quant.GLUON_GEMM)

The check is a data-flow over the SASS control-flow graph (branches, the loop's back edge): a
state is the set of (register, groups committed after its wgmma); an HGMMA with `gsb0` commits
its group, `WARPGROUP.DEPBAR.LE gsb0, N` retires all but the N newest; a write to a register of
an unretired group is a hazard. Joins take the union (never misses one, may over-report).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from sass_common import BIN, dump  # noqa: E402

CUDA13 = "/usr/local/cuda-13.0/bin/ptxas"
#: register-A launches (compiled as given: the run-time selection `operand_path` is not
#: applied): one step an iteration (the PTX rewrites an in-flight operand, the hazard this
#: finds), two with the words by TMA, two loaded by the threads
OTHER_CFGS = "8,256,5,1,1,0,0,0,2,1,1;8,256,5,2,1,0,0,0,2,1,1;8,256,6,2,1,0,0,0,2,0,1"


def assemble(ptx: str, ptxas: str, version: str | None = None) -> tuple[bytes, str]:
    """(cubin, ptxas's log) of the PTX for sm_90a with Triton's flags; version: the PTX ISA
    written into `.version` (Triton's choice for that ptxas, e.g. "9.0" for CUDA 13.0)."""
    if version:
        ptx = re.sub(r"\.version \d+\.\d+", f".version {version}", ptx)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        pathlib.Path(src).write_text(ptx)
        r = subprocess.run([ptxas, "-lineinfo", "-v", "--gpu-name=sm_90a", src, "-o", out],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{ptxas} failed: {r.stderr[-2000:]}")
        return pathlib.Path(out).read_bytes(), r.stderr + r.stdout


def _rows(sass: str) -> list[tuple[int, str]]:
    rows = []
    for ln in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", ln)
        if m:
            rows.append((int(m.group(1), 16), m.group(2).strip()))
    return rows


def _split(ins: str) -> tuple[str, str, list[str]]:
    """(predicate guard, opcode, operands) of one SASS instruction."""
    guard = ""
    if ins.startswith("@"):
        guard, ins = ins.split(None, 1)
    parts = ins.split(None, 1)
    ops = [o.strip() for o in parts[1].split(",")] if len(parts) > 1 else []
    return guard, parts[0], ops


def written_regs(ins: str) -> set[int]:
    """General registers an instruction writes (its destination; widths from .64 / .128 /
    WIDE / LDSM .x4 / CS2R); none for stores, branches, barriers, HGMMA (its accumulator)."""
    _, op, ops = _split(ins)
    base = op.split(".")[0]
    if base in ("HGMMA", "BRA", "EXIT", "RET", "BAR", "WARPGROUP", "DEPBAR", "MEMBAR", "NOP",
                "STS", "STG", "ST", "STL", "STSM", "RED", "REDG", "UTMALDG", "UTMASTG", "FENCE",
                "ERRBAR", "CCTL", "WARPSYNC", "BSSY", "BSYNC", "CALL", "YIELD") or not ops:
        return set()
    if base in ("SHFL", "ATOMG", "ATOM", "ATOMS") and re.fullmatch(r"!?P(T|\d)", ops[0]) \
            and len(ops) > 1:
        ops = ops[1:]
    m = re.fullmatch(r"R(\d+)", ops[0])
    if not m:
        return set()
    tok = op.split(".")
    width = 1
    if "128" in tok:
        width = 4
    elif "64" in tok or "WIDE" in tok or (base == "CS2R" and "32" not in tok):
        width = 2
    if base == "LDSM":
        width = 4 if "4" in tok else 2 if "2" in tok else 1
    r = int(m.group(1))
    return set(range(r, r + width))


def _hgmma_a(ins: str) -> set[int]:
    """The A registers of an HGMMA with a register A operand (4: a 64 x 16 16-bit fragment)."""
    _, op, ops = _split(ins)
    if not op.startswith("HGMMA") or len(ops) < 2:
        return set()
    m = re.fullmatch(r"R(\d+)", ops[1])
    return set(range(int(m.group(1)), int(m.group(1)) + 4)) if m else set()


def rega_hazards(sass: str) -> tuple[int, list[str]]:
    """(HGMMAs with register A, hazards: 'addr: instruction writes Rn of the in-flight HGMMA at
    addr') over the SASS's control-flow graph."""
    rows = _rows(sass)
    index = {a: i for i, (a, _) in enumerate(rows)}
    succ = []
    for i, (a, ins) in enumerate(rows):
        guard, op, ops = _split(ins)
        nxt = [i + 1] if i + 1 < len(rows) else []
        if op.startswith("BRA"):
            t = re.search(r"(0x[0-9a-f]+)", ins)
            tgt = [index[int(t.group(1), 16)]] if t and int(t.group(1), 16) in index else []
            nxt = tgt + (nxt if guard and guard not in ("@PT",) else [])
        elif op.startswith(("EXIT", "RET")) and not guard:
            nxt = []
        succ.append(nxt)
    n_rega = sum(bool(_hgmma_a(ins)) for _, ins in rows)
    state: list[frozenset | None] = [None] * len(rows)
    state[0] = frozenset()
    work, found = [0], {}
    while work:
        i = work.pop()
        s = set(state[i])
        a, ins = rows[i]
        _, op, ops = _split(ins)
        if op.startswith("HGMMA"):
            s |= {(r, -1, a) for r in _hgmma_a(ins)}
            if "gsb0" in ops:
                s = {(r, k + 1, src) for r, k, src in s}
        elif op.startswith("WARPGROUP.DEPBAR"):
            keep = int(ops[-1], 16) if ops else 0
            s = {(r, k, src) for r, k, src in s if k < keep}
        else:
            w = written_regs(ins)
            for r, k, src in s:
                if r in w:
                    found[(a, r)] = (f"{a:#06x}: {ins} writes R{r} of the in-flight HGMMA at "
                                     f"{src:#06x}")
        for j in succ[i]:
            new = frozenset(s) if state[j] is None else state[j] | s
            if new != state[j]:
                state[j] = new
                work.append(j)
    return n_rega, [found[key] for key in sorted(found)]


def serialized(log: str) -> list[str]:
    """ptxas's lines about wgmma (e.g. C7515/C7520: 'wgmma.mma_async instructions are serialized
    due to ...')."""
    return sorted({ln.strip() for ln in log.splitlines() if "wgmma" in ln.lower()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="Q4_0,AWQ,Q4_K,NF4,Q8_0,Q6_K")
    ap.add_argument("--cfg", default=OTHER_CFGS)
    ap.add_argument("--defaults", action="store_true")
    ap.add_argument("--ptxas", default=f"{BIN / 'ptxas'},{CUDA13}")
    ap.add_argument("--show", action="store_true", help="print the hazards, not only counts")
    args = ap.parse_args()
    import sass_quant_gluon as S
    from triton.backends.nvidia.compiler import ptx_get_version
    fmts = {**S.FMTS, "AWQ": S.G.AWQ, "NF4": S.G.NF4}
    tools = []
    for path in args.ptxas.split(","):
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        v = tuple(int(x) for x in re.search(r"release (\d+)\.(\d+)", out).groups())
        isa = ptx_get_version(f"{v[0]}.{v[1]}")     # Triton's PTX ISA for that ptxas
        isa = f"{isa // 10}.{isa % 10}"
        tools.append((path, v, isa))
    bad = 0
    from fuelgraph.backends.cuda.kernels.quant import GLUON_GEMM
    for name in args.fmt.split(","):
        cfgs = list(GLUON_GEMM[fmts[name]].values()) if args.defaults else [
            S.G.GluonGemmConfig(*(int(v) for v in c.split(","))) for c in args.cfg.split(";")]
        for cfg in cfgs:
            ptx = S.compile_one(fmts[name], cfg).asm["ptx"]
            seen = []
            for path, v, isa in tools:
                cubin, log = assemble(ptx, path, isa)
                res, sass = dump(cubin)
                n, hz = rega_hazards(sass)
                regs = re.search(r"REG:(\d+)", res)
                loop = S.mma_loop(cubin)[2]
                bad += bool(hz)
                code = [ins for _, ins in _rows(sass)]
                same = next((f"{u[0]}.{u[1]}" for u, c in seen if c == code), None)
                seen.append((v, code))
                print(f"{name:5s} {cfg.tag():44s} ptxas {v[0]}.{v[1]} regs "
                      f"{regs.group(1) if regs else '?'} HGMMA(regA) {n} hazards {len(hz)}"
                      f"{' SERIALIZED' if loop['WAIT0'] > 1 else ''}"
                      f"{f' (SASS the same as ptxas {same})' if same else ''}"
                      + "".join(f"\n    ptxas: {w}" for w in serialized(log)), flush=True)
                if args.show:
                    for h in hz[:12]:
                        print("    " + h)
    print(f"launches with hazards: {bad}")


if __name__ == "__main__":
    main()
