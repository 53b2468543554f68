#!/usr/bin/env python3
"""Many-row quantized matmuls (M = 256, N = K = 8192, bf16 x) on one CUDA GPU, against the dense
bf16 cuBLAS matmul (`x @ W.T`, the same weight dequantized) in the same process, all timed with
CUDA graphs (`do_bench_cudagraph`, median): the default route (before the packed GEMM: the
dense copy + cuBLAS, AWQ's fused storage-order GEMM) and the packed-copy GEMM candidates (`quant_packed_gemm`,
PackedGemmConfig) of CANDIDATES, each checked against the dense product first. TFLOP/s = 2 M N
K / time; GB/s = weight bytes (the format's own) / time. Records go to
DIR/cuda_quant_gemm.jsonl (--out).

    python3 bench/bench_cuda_quant_gemm.py [--out DIR] [--ops Q4_0,awq,...] [--ms 256]
                                           [--compile-only] [--pick 0,2] [--no-anchor]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as TF
from triton.testing import do_bench_cudagraph

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_cuda_quant_gemv import close, weights  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_packed_gemm import PackedGemmConfig  # noqa: E402

DEV = torch.device(os.environ.get("BENCH_DEVICE", "cuda"))
G = PackedGemmConfig
#: packed-copy GEMM candidates per format (block_n, block_m, split, warps, stages[, group,
#: maxnreg, tma, pair, ws]). sm_90 compile (bench/sass_quant_gemm.py; SASS of the main loop a
#: weight of the tile a step): 128 x 128 on 8 warps, 3 stages: 239 registers, 172 KB shared,
#: wgmma with the decoded weight as its register operand (one shared-memory layout conversion
#: of the tile a step), 7.61; x by TMA: 8.52; every load by TMA (ws=1): 219 registers, 7.52;
#: 64 x 256 (each weight decoded once, one wave, twice the x traffic of 128 x 128) fits 2
#: stages only (11.0); 128 x 256 split 2 (each weight decoded once, half the x traffic) only
#: all-TMA (253 registers, 7.53; with pointer loads it spills), its two programs a tile meeting
#: in the kernel (pair: 1.5 KB of spill stack in the epilogue) or adding by atomics; Triton's
#: warp-specialized loop (ws=2) fails in its data-partition pass on 128-row tiles, 64 x 128
#: compiles (168 registers, 5.66: the decoded operand through shared memory); a step's four
#: scales in one load (vec): Q4_0 7.06, AWQ 6.67, Q4_K 7.67, Q8_0 7.17 (its f16 scales were
#: not pipelined), NF4 6.62 (7.61, 7.22, 8.23, 7.89, 7.23 without); a whole chunk a step
#: (full: the words loaded once for two dots; 2 stages fit): Q4_0 5.11, AWQ 4.92, NF4 4.97;
#: all-TMA and full: Q4_0 5.72 (205 registers)
_BASE = G(128, 128, 1, 8, 3)
_VEC = G(128, 128, 1, 8, 3, vec=1)
_WIDE = G(128, 256, 2, 8, 2, ws=1)
_FULL = G(128, 128, 1, 8, 2, full=1, vec=1)
_TMA_FULL = G(128, 128, 1, 8, 2, ws=1, full=1)
CANDIDATES = {"Q4_0": [_BASE, _VEC, G(128, 128, 1, 8, 4, vec=1), G(64, 256, 1, 8, 2, vec=1),
                       _FULL, G(128, 128, 1, 8, 3, ws=1), G(64, 128, 1, 4, 3, ws=2), _WIDE,
                       G(128, 256, 2, 8, 2, ws=1, pair=1), _TMA_FULL],
              "awq": [_VEC, _FULL, _TMA_FULL, _WIDE],
              "Q4_K": [_VEC, _WIDE], "nf4": [_VEC, _FULL], "Q8_0": [_VEC], "Q6_K": [_BASE]}


def _bnb_anchor(x, n, k, g, record, m, rep):
    """bitsandbytes' NF4 matmul (its own quantization of a random dense weight, blocks of 64)
    timed as the others: the issue's NF4 anchor. Skipped where bitsandbytes is missing."""
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbF
        w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(torch.bfloat16)
        packed, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                           compress_statistics=False)
        ms = do_bench_cudagraph(lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state),
                                rep=rep, return_mode="median")
        record("nf4", f"bitsandbytes {bnb.__version__}", m, ms, n * k // 2 + 4 * n * k // 64)
    except Exception as exc:  # noqa: BLE001
        print(f"bitsandbytes anchor skipped: {str(exc)[:200]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--ops", default="Q4_0,awq,Q4_K,nf4,Q8_0,Q6_K")
    ap.add_argument("--ms", default="256")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--rep", type=int, default=30, help="ms of repetitions a timing")
    ap.add_argument("--pick", default=None,
                    help="indices into each op's configs: 0 = the default route, 1.. = the "
                         "candidates (per op: Q4_0=0,2/awq=3)")
    ap.add_argument("--no-anchor", action="store_true", help="skip the dense cuBLAS anchor")
    args = ap.parse_args()
    n = k = args.size
    g = torch.Generator(device=DEV).manual_seed(0)
    jsonl = None
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        jsonl = pathlib.Path(args.out) / "cuda_quant_gemm.jsonl"
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"

    best: dict = {}

    def record(op, impl, m, ms, nbytes):
        kind = "default" if impl.endswith("[default]") or op == "dense" else \
            "fused" if impl.startswith("fuelgraph[") else "anchor"
        key = (op, m, kind)
        if key not in best or ms < best[key][0]:
            best[key] = (ms, impl)
        tf = 2 * m * n * k / ms / 1e9
        gb = nbytes / ms / 1e6
        print(f"{op:5s} M={m:<4d} {impl:52s} {ms:.4f} ms  {tf:6.1f} TFLOP/s  {gb:6.0f} GB/s",
              flush=True)
        if jsonl:
            with open(jsonl, "a") as fh:
                fh.write(json.dumps({"op": op, "impl": impl, "device": name, "shape": [m, n, k],
                                     "dtype": "bfloat16", "ms": round(ms, 5),
                                     "TFLOP/s": round(tf, 1), "GB/s": round(gb, 1),
                                     "date": time.strftime("%Y-%m-%d", time.gmtime())}) + "\n")

    anchored = set()
    for op in args.ops.split(","):
        fn, w, nbytes = weights(op, n, k, g)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
            want = TF.linear(x, w)
            if not args.no_anchor and not args.compile_only and m not in anchored:
                anchored.add(m)
                ms = do_bench_cudagraph(lambda: TF.linear(x, w), rep=args.rep,
                                        return_mode="median")
                record("dense", "cublas_bf16", m, ms, 2 * n * k)
            cfgs = [None] + CANDIDATES.get(op, [])
            if args.pick is not None:
                pick = dict(v.split("=") for v in args.pick.split("/")) if "=" in args.pick \
                    else {op: args.pick}
                cfgs = [cfgs[int(i)] for i in pick.get(op, "").split(",")
                        if i and int(i) < len(cfgs)]
            for cfg in cfgs:
                tag = "default" if cfg is None else cfg if isinstance(cfg, str) else cfg.tag()
                try:
                    ok, err = close(fn(x, cfg), want)
                except Exception as exc:  # noqa: BLE001
                    print(f"{op:5s} M={m:<4d} {tag:52s} FAILED {str(exc)[:300]!r}", flush=True)
                    continue
                if not ok:
                    print(f"{op:5s} M={m:<4d} {tag:52s} WRONG max err {err:.3g}", flush=True)
                    continue
                if args.compile_only:
                    continue
                try:
                    ms = do_bench_cudagraph(lambda: fn(x, cfg), rep=args.rep,
                                            return_mode="median")
                except Exception as exc:  # noqa: BLE001
                    print(f"{op:5s} M={m:<4d} {tag:52s} FAILED timing {str(exc)[:200]!r}",
                          flush=True)
                    continue
                record(op, f"fuelgraph[{tag}]", m, ms, nbytes)
            if op == "nf4" and not args.compile_only and args.pick is None:
                _bnb_anchor(x, n, k, g, record, m, args.rep)
        del fn, w
        torch.cuda.empty_cache()
    print("summary (ms): op M default | best fused | dense cuBLAS")
    for (op, m, kind), (ms, impl) in best.items():
        if kind == "default" and op != "dense":
            fused = best.get((op, m, "fused"))
            dense = best.get(("dense", m, "default"))
            print(f"  {op:5s} {m:4d} {ms:.4f} | " + (f"{fused[0]:.4f} {fused[1][10:-1]}"
                  if fused else "-") + (f" | {dense[0]:.4f}" if dense else "")
                  + (f" | {best[(op, m, 'anchor')][1]} {best[(op, m, 'anchor')][0]:.4f}"
                     if (op, m, "anchor") in best else ""), flush=True)


if __name__ == "__main__":
    main()
