#!/usr/bin/env python3
"""Compile the flash_attn forward kernel for sm_90 on a machine without a GPU and report, per
case (plain causal, window, softcap, ALiBi), launch configuration and code variant
(`attention.VARIANTS`; "base" is the defaults, a variant's name flips it, "+" joins several):
registers, spill stack, shared memory, and the SASS of the longest loop (instructions,
special-function MUFU ones, tensor-core HGMMA ones). Use it to check that a variant compiles
for Hopper and what it costs before a GPU session.

    python3 bench/sass_attention.py [--configs 128,64,8,3;128,128,8,3] [--cases plain,window]
        [--variants base,MASK_ASM,MASK_ASM+EDGE_ONE_TEST] [--ws]

--ws compiles the warp-specialized forward (attention_ws.py) instead, with configs of one
consumer's warps ("128,64,4,2"): it reports whether the loop was specialized (the warps of
the compiled kernel: 12 when it was) and the longest loop of the consumers (all variants
off). --ws --ws-flips "base,EDGE_BOUND,LEAN_TILE+EDGE_BOUND" compiles it as the host
launches it (attention.VARIANTS, each listed WS_ variant flipped) and reports the SASS
instructions a consumer warp executes for a key block without mask or rescale and, for the
persistent kernel, the tile loop's instructions outside the key loop (prologue + epilogue).

    python3 bench/sass_attention.py --ws --configs 128,128,4,2 --cases plain,window \
        --ws-flips "base,EDGE_BOUND,LEAN_TILE+EDGE_BOUND"
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

import triton
from triton.compiler import ASTSource

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
sys.path.insert(0, str(ROOT))

from fuelgraph.backends.cuda.kernels import attention as A  # noqa: E402
from sass_common import TARGET, dump, loop_stats  # noqa: E402

PTRS = ["Q", "K", "V", "O", "LSE", "SLOPES", "KLEN"]
INTS = ["sqb", "sqh", "sqm", "skb", "skh", "skn", "svb", "svh", "svn", "sob", "soh", "som",
        "slb", "H", "G", "SQ", "SK", "KLEN_STATIC"]
CASES = {"full": dict(), "plain": dict(CAUSAL=True), "window": dict(CAUSAL=True, HAS_WL=True),
         "softcap": dict(CAUSAL=True, HAS_CAP=True), "alibi": dict(CAUSAL=True, HAS_ALIBI=True)}


def source(case, m, n, variant):
    """ASTSource of the forward for bfloat16, D = 128."""
    types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32",
             "SLOPES": "*fp32", "KLEN": "*i32"}
    sig = dict(types)
    sig.update({k: "i32" for k in INTS if k != "G"})
    sig.update(QK_SCALE="fp32", CAP="fp32", WL="i32", WR="i32", TUNE_Q="i32", TUNE_K="i32")
    flags = dict(CAUSAL=False, HAS_WL=False, HAS_WR=False, HAS_CAP=False, HAS_ALIBI=False,
                 DYN_KLEN=False, IEEE=False)
    flags.update(CASES[case])
    var = dict(A.VARIANTS)
    for name, on in variant.items():        # a variant's name flips it
        if on:
            var[name] = not var.get(name, False)
    cons = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=m, BLOCK_N=n, **flags,
                ALIBI_COLS=flags["HAS_ALIBI"] and var["ALIBI_COLS"],
                FMA=not flags["HAS_ALIBI"] and var["FMA_SCORES"],
                EDGE1=flags["HAS_WL"] and var.get("EDGE_ONE_TEST", False),
                ASM=var.get("MASK_ASM", False),
                ONE_LOOP=var.get("ONE_LOOP_WINDOW" if flags["HAS_WL"] else "ONE_LOOP", False))
    known = set(A._fwd_kernel.fn.arg_names)
    cons = {k: v for k, v in cons.items() if k in known}     # older kernels lack variants
    names = list(sig)
    # pointers, strides and sizes divisible by 16 as the JIT finds them for B4 H32 S4096
    aligned = {(names.index(k),): [["tt.divisibility", 16]]
               for k in PTRS[:5] + INTS if k not in ("slb", "G", "KLEN_STATIC")}
    cons["G"] = 1                 # H == Hkv: the JIT specializes an argument equal to 1
    return ASTSource(A._fwd_kernel.fn, sig, cons, attrs=aligned)


def ws_source(case, m, n, persist=False, **extra):
    """ASTSource of the warp-specialized forward for bfloat16, D = 128 (host descriptors)."""
    from fuelgraph.backends.cuda.kernels import attention_ws as W
    sig = {"Q": "*bf16", "KD": f"tensordesc<bf16[1,1,{n},128]>",
           "VD": f"tensordesc<bf16[1,1,{n},128]>", "O": "*bf16", "LSE": "*fp32",
           "SLOPES": "*fp32"}
    sig.update({k: "i32" for k in ["sqm", "sob", "soh", "som", "slb", "ROWS", "H", "SQ", "L",
                                   "WL", "WR", "TUNE_Q", "TUNE_K"]})
    sig.update(QK_SCALE="fp32", CAP="fp32")
    flags = dict(CAUSAL=False, HAS_WL=False, HAS_WR=False, HAS_CAP=False, HAS_ALIBI=False)
    flags.update(CASES[case])
    cons = dict(BLOCK_D=128, BLOCK_M=m, BLOCK_N=n, **flags,
                ALIBI_COLS=flags["HAS_ALIBI"] and A.VARIANTS["ALIBI_COLS"],
                FMA=not flags["HAS_ALIBI"] and A.VARIANTS["FMA_SCORES"], EVEN_L=True, G=1,
                PERSIST=persist, GROUP=8)
    cons.update(SKIP_MASK=False, HEADS=1, LAZY_RESCALE=False, ALIBI_HOIST=False,
                CAP_FIXED_REF=False, EDGE_BOUND=False, LEAN_TILE=False, EVEN_HEADS=True)
    cons.update(extra)
    known = set(W._fwd_ws_kernel.fn.arg_names)
    cons = {k: v for k, v in cons.items() if k in known}     # older kernels lack variants
    sig["BH"] = "i32"
    names = [a for a in W._fwd_ws_kernel.fn.arg_names if a not in cons]
    sig = {k: sig[k] for k in names}
    aligned = {(names.index(k),): [["tt.divisibility", 16]]
               for k in ["Q", "O", "LSE", "sqm", "sob", "soh", "som", "ROWS", "H", "SQ", "L"]}
    return ASTSource(W._fwd_ws_kernel.fn, sig, cons, attrs=aligned)


def _compiled(name, src, warps, stages, width):
    """The sm_90 kernel, or None (the failure printed under the case's name)."""
    try:
        return triton.compile(src, target=TARGET, options=dict(num_warps=warps,
                                                                num_stages=stages))
    except Exception as exc:  # noqa: BLE001
        print(f"{name:{width}s} FAILED {str(exc)[:400]!r}", flush=True)
        return None


def report(name, src, warps, stages):
    k = _compiled(name, src, warps, stages, 52)
    if k is None:
        return
    regs, stack, n, ops = loop_stats(k.asm["cubin"])
    top = " ".join(f"{op}:{c}" for op, c in ops.most_common(6))
    name += f" ->{k.metadata.num_warps}w"
    print(f"{name:52s} regs {regs:3d} stack {stack:4d} smem {k.metadata.shared:6d}  loop {n:5d} "
          f"MUFU {ops.get('MUFU', 0):3d} HGMMA {ops.get('HGMMA', 0):3d}  {top}", flush=True)


def ws_defaults(case, flips=()):
    """The warp-specialized kernel's variant constexprs as attention_ws._launch_ws sets them
    for `case` (B4 H32 S4096, window 1024, softcap 50) from attention.VARIANTS, each
    "WS_<NAME>" in flips flipped; (persistent, constexprs)."""
    var = dict(A.VARIANTS)
    for name in flips:
        var[name] = not var[name]
    flags = CASES[case]
    wl = flags.get("HAS_WL", False)
    persist = var["WS_PERSIST"] or (var["WS_PERSIST_WINDOW"] and wl)
    return persist, dict(
        SKIP_MASK=var["WS_SKIP_MASK_WINDOW" if wl else "WS_SKIP_MASK"],
        HEADS=int(var["WS_HEADS"]), LAZY_RESCALE=var["WS_LAZY_RESCALE"],
        ALIBI_HOIST=var["WS_ALIBI_HOIST"] and flags.get("HAS_ALIBI", False),
        CAP_FIXED_REF=var["WS_CAP_FIXED_REF"] and flags.get("HAS_CAP", False),
        EDGE_BOUND=var.get("WS_EDGE_BOUND", False) and wl,
        LEAN_TILE=var.get("WS_LEAN_TILE", False), EVEN_HEADS=True)


def _sass_lines(cubin):
    """[(address, instruction)] of a cubin's SASS."""
    lines = dump(cubin)[1].splitlines()
    return [(int(m.group(1), 16), m.group(2).strip()) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", ln) for ln in lines) if m]


def _walk(ins, at, key, mask_region, policy):
    """Instructions executed from the key loop's start to its back edge: forward branches
    inside the loop taken, except in the mask region (after the q k^T products, before the
    row max's shuffles), where `policy` decides: "skip" takes them, "first" (the diagonal
    block, or both bounds) takes none, "nested" (the window's far edge) takes a branch whose
    target lies before the pending skip branch's (_MASK_EDGE's branch to its lower bound)."""
    i, n, pending = at[key[0]], 0, None
    while ins[i][0] < key[1]:
        a, t = ins[i]
        n += 1
        m = re.search(r"BRA (0x[0-9a-f]+)", t)
        tgt = int(m.group(1), 16) if m else -1
        take = key[0] < tgt <= key[1] and tgt > a
        if take and mask_region[0] < a < mask_region[1] and t.startswith("@"):
            take = policy == "skip" or (policy == "nested" and pending is not None
                                        and tgt < pending)
            pending = tgt if pending is None or tgt >= pending else pending
        i = at[tgt] if take else i + 1
    return n + 1


def ws_paths(cubin):
    """(instructions a consumer warp executes for a key block that needs no mask and no
    rescale, for the diagonal block, for a window's far edge block (both: no rescale); the
    tile loop's instructions outside the key loop, static (persistent; None otherwise))."""
    ins = _sass_lines(cubin)
    at = {a: i for i, (a, _) in enumerate(ins)}
    backs = [(int(m.group(1), 16), a) for a, t in ins
             for m in [re.search(r"BRA (0x[0-9a-f]+)", t)] if m and int(m.group(1), 16) < a]
    mma = [a for a, t in ins if "HGMMA" in t]
    key = min((lp for lp in backs if any(lp[0] <= h <= lp[1] for h in mma)
               and not any(lp[0] < o[0] and o[1] < lp[1] for o in backs)), key=lambda x: x[0])
    body = [(a, t) for a, t in ins if key[0] <= a <= key[1]]
    first_mma = next(j for j, (_, t) in enumerate(body) if "HGMMA" in t)
    qk_end = next(a for j, (a, t) in enumerate(body) if j > first_mma and "HGMMA" in t
                  and "gsb0" in t)
    shfl = next(a for a, t in body if a > qk_end and "SHFL" in t)
    paths = [_walk(ins, at, key, (qk_end, shfl), p) for p in ("skip", "first", "nested")]
    outer = [lp for lp in backs if lp[0] < key[0] and key[1] < lp[1]]
    tile = min(outer, key=lambda x: x[1] - x[0]) if outer else None
    rest = ((tile[1] - tile[0]) - (key[1] - key[0])) // 16 if tile else None
    return (*paths, rest)


def report_ws(name, src, warps, stages):
    k = _compiled(name, src, warps, stages, 58)
    if k is None:
        return
    regs, stack, _, _ = loop_stats(k.asm["cubin"])
    block, diag, far, rest = ws_paths(k.asm["cubin"])
    print(f"{name:46s} ->{k.metadata.num_warps}w regs {regs:3d} smem {k.metadata.shared:6d}  "
          f"block: unmasked {block:4d} diagonal {diag:4d} far edge {far:4d}  tile outside the "
          f"key loop {rest if rest is not None else '-'}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="128,64,8,3;128,128,8,3")
    ap.add_argument("--cases", default="plain,window,softcap,alibi")
    ap.add_argument("--variants", default="base,ALIBI_COLS,FMA_SCORES")
    ap.add_argument("--ws", action="store_true")
    ap.add_argument("--ws-flips", default=None,
                    help='--ws with the host\'s defaults, each "+"-joined WS_ variant set '
                         'flipped: "base,EDGE_BOUND,LEAN_TILE+EDGE_BOUND"')
    args = ap.parse_args()
    if args.ws and args.ws_flips is not None:
        for cfg in args.configs.split(";"):
            m, n, w, st = (int(x) for x in cfg.split(","))
            for case in args.cases.split(","):
                for flips in args.ws_flips.split(","):
                    names = [f"WS_{x}" for x in flips.split("+") if x and x != "base"]
                    persist, cons = ws_defaults(case, names)
                    report_ws(f"ws {case:8s} {m}x{n} {flips or 'base'}{' PERSIST' * persist}",
                              ws_source(case, m, n, persist, **cons), w, st)
        return
    if args.ws:
        for cfg in args.configs.split(";"):
            m, n, w, st = (int(x) for x in cfg.split(","))
            for case in args.cases.split(","):
                for pers in (False, True) if "WS_PERSIST" in args.variants else (False,):
                    report(f"ws {case:8s} {m}x{n} w{w} s{st}{' PERSIST' if pers else ''}",
                           ws_source(case, m, n, pers), w, st)
        return
    for cfg in args.configs.split(";"):
        m, n, w, st = (int(x) for x in cfg.split(","))
        for case in args.cases.split(","):
            for var in args.variants.split(","):   # "+" joins several: PV_LAG+MASK_ASM
                variant = {} if var == "base" else {v: True for v in var.split("+")}
                if (("ALIBI_COLS" in variant) != (case == "alibi") and "ALIBI_COLS" in variant
                        or "FMA_SCORES" in variant and case == "alibi"):
                    continue        # ALiBi's own variant; FMA_SCORES does not apply to it
                report(f"{case:8s} {var:10s} {m}x{n} w{w} s{st}", source(case, m, n, variant),
                       w, st)


if __name__ == "__main__":
    main()
