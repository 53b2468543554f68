#!/usr/bin/env python3
"""Many-row quantized matmuls (M = 256, N = K = 8192, bf16 x) on one CUDA GPU, against the dense
bf16 cuBLAS matmul (`x @ W.T`, the same weight dequantized) in the same process, all timed with
CUDA graphs (`do_bench_cudagraph`, median): the default route (on sm_90 the Gluon wgmma GEMM of
`quant_gluon_gemm`; before it the Triton packed GEMM, the dense copy + cuBLAS, AWQ's fused
storage-order GEMM) and the candidates of CANDIDATES (previous routes, `quant_packed_gemm`'s
PackedGemmConfig, `quant_gluon_gemm`'s GluonGemmConfig launches), each checked against the
dense product first. TFLOP/s = 2 M N K / time; GB/s = weight bytes (the format's own) / time.
Records go to DIR/cuda_quant_gemm.jsonl (--out).

    python3 bench/bench_cuda_quant_gemm.py [--out DIR] [--ops Q4_0,awq,...] [--ms 256]
                                           [--compile-only] [--pick 0,2] [--no-anchor]
                                           [--dense-each] [--gluon "8,256,6,2,1,0,0,0,2,0,1;..."]
                                           [--rounds 2] [--skip-default]
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
from fuelgraph.backends.cuda.kernels import quant as K  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_gluon_gemm import GluonGemmConfig  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_packed_gemm import PackedGemmConfig  # noqa: E402

from common import quant_record_names  # noqa: E402  (bench/, the script's folder)

DEV = torch.device(os.environ.get("BENCH_DEVICE", "cuda"))
G = PackedGemmConfig
#: per format: the previous default (the dense copy + cuBLAS; AWQ's storage-order fused GEMM),
#: then packed-copy GEMM candidates (block_n, block_m, split, warps, stages[, tma, vec]).
#: Session 8, H200, M = 256 (dense cuBLAS 0.0552 / 0.0538 ms in the two runs), ms:
#: * Q4_0: every load by TMA (tma=2, 128 x 128, 8 warps, 3 stages) 0.0843 / 0.0856; cp.async
#:   loads and a step's scales in one load (vec) 0.0985, one load a plane 0.1224; 2 / 4 stages
#:   0.1373 / 0.0869; a chunk a step 0.1144 (all-TMA 0.1200); 64 x 128 on 4 warps (two programs
#:   an SM) 0.1018; 64 x 256 0.1184 (4 warps) / 0.1346 (8); 128 x 256 split 2 0.1003 (meeting
#:   in the kernel 0.1025); the pairs moved to the kernel's views once 0.0861; Triton's warp-
#:   specialized loop wrong (NaN); the loop without any decode 0.0639. Dense copy 0.1238.
#: * AWQ tma=2 0.0862, vec 0.0954 (storage-order GEMM 0.1441); Q4_K tma=2 0.0897, vec 0.1024
#:   (0.1220); Q8_0 x by TMA + vec 0.0886, vec 0.0936 (0.1234); NF4 0.1151 (dense copy 0.1050,
#:   bitsandbytes 0.1273); Q6_K 0.1757 (0.1305). M = 1024 Q4_0: 0.3480 vs 0.2588 (dense copy).
#: Round 3: Q4_0 0.0861 (defaults), AWQ 0.0854, Q4_K 0.0885, Q8_0 0.0881, NF4 dense copy 0.1046,
#: Q6_K 0.1285, dense cuBLAS 0.0549; x as the wgmma's left operand (the decoded tile its right
#: one from shared memory) lost: Q4_0 0.0927, AWQ 0.0914, Q4_K 0.0944. M = 128 Q4_0: 0.0522
#: (split 2 by atomics) vs 0.1151 (dense copy), dense cuBLAS 0.0352.
#: sm_90 SASS of the loop a weight (bench/sass_quant_gemm.py): tma=2 7.50, vec 6.88
_T2 = G(128, 128, 1, 8, 3, tma=2)
_OLD = "dequant_rows"
#: Gluon wgmma GEMM launches (num_warps, block_m, stages, sub, ws[, h2]): quant_gluon_gemm.
#: Session 9 round 2 (H200, M = 256, dense 0.0511): 64 x 256 (4, 256, 4, 2) Q4_0 0.0769, AWQ
#: 0.0760, Q4_K 0.0786, Q8_0 0.0775, NF4 0.0821, Q6_K 0.0785; 128 x 128 0.084-0.091, with a
#: TMA producer warp 0.079-0.088, 64 x 128 0.079-0.092 (quant.GLUON_GEMM lists them)
GLUON = [GluonGemmConfig(4, 256, 4, 2), GluonGemmConfig(4, 256, 4, 2, 1),
         GluonGemmConfig(4, 256, 4, 2, rot=1), GluonGemmConfig(4, 256, 4, 2, 1, rot=1),
         GluonGemmConfig(8, 128, 6, 2, 1), GluonGemmConfig(4, 128, 4, 2),
         GluonGemmConfig(4, 256, 4, 2, late=1), GluonGemmConfig(4, 256, 4, 2, 1, late=1)]
#: Q4_0's bf16x2 decode (h2) with the producer warp and late loads, and also rotated K
H2 = [GluonGemmConfig(4, 256, 4, 2, 1, 1, late=1), GluonGemmConfig(4, 256, 4, 2, 1, 1, 1, 1)]
#: split K in two (session 10): 128 x 256 tiles (two warpgroups), 128 programs that read x
#: half as often as 64 x 256 ones; then with the producer warp, 5 stages, late loads; 128 x 128
#: tiles split in two for M = 128; rotated K; the words and scales by TMA (wtma), also with the
#: producer warp; wtma for M = 128 (128 x 128 split 2, 64 x 128); 128 x 128 split 2 with the
#: producer warp, 128 x 256 split 2 with the producer warp and 5 stages.
#: H200 round 3 (dense 0.050-0.056; the launch timed first after the dense anchor, the default,
#: came out up to 30% slower than in the round before, whatever the launch, so only later
#: positions count): wtma + producer warp + 5 stages Q4_0 0.0639, AWQ 0.0637, Q4_K 0.0665, NF4
#: 0.0698; Q8_0 producer warp 6 stages 0.0675, wtma 0.0699; Q6_K producer warp 5 / 6 stages
#: 0.0710 / 0.0697. M = 128, 128 x 128 split 2 + producer warp: AWQ 0.0502, Q4_K 0.0515, Q8_0
#: 0.0513 (packed GEMM round 2: 0.0514 / 0.0534 / 0.0524); Q6_K without it 0.0545.
#: H200 round 2 (dense 0.054-0.0566): producer warp (the default then) Q4_0 0.0667, AWQ 0.0687,
#: Q4_K 0.0735, Q8_0 0.0740, NF4 0.0758, Q6_K 0.0826; wtma + producer warp 0.0655 / 0.0666 /
#: 0.0678 / 0.0711 / 0.0696 / 0.0711; producer warp, 5 stages Q4_0 0.0663, Q8_0 0.0667. M = 128
#: split 2: Q4_0 0.0503 (+ producer warp 0.0493; packed GEMM 0.0524), AWQ 0.0528 (0.0514),
#: Q4_K 0.0564 (0.0534), Q8_0 0.0541 (0.0524), NF4 0.0602 (+ producer warp 0.0533), Q6_K 0.0567
#: (64 x 128 tiles 0.0683).
#: H200 round 1 (M = 256, dense 0.055-0.0575): split 2 Q4_0 0.0668, AWQ 0.0689, Q4_K 0.0713,
#: Q8_0 0.0721, NF4 0.0748, Q6_K 0.0748; + producer warp 0.0670 / 0.0689 / 0.0717 / 0.0717 /
#: 0.0714 / 0.0719; wtma 0.0678 / 0.0711 / 0.0740 / 0.0706 / 0.0731 / 0.0736, + producer warp
#: Q4_0 0.0659, Q8_0 0.0715; late (Q4_0 / Q8_0) 0.0706 / 0.0761, rot Q4_0 0.0687; loads right
#: after each A fence 0.0708 / 0.0747 (removed). M = 128 split 2: Q4_0 0.0513, Q8_0 0.0510,
#: NF4 0.0550 (defaults then 0.0524 / 0.0595 / 0.0734)
SPLIT = [GluonGemmConfig(8, 256, 4, 2, split=2), GluonGemmConfig(8, 256, 4, 2, 1, split=2),
         GluonGemmConfig(8, 256, 5, 2, split=2), GluonGemmConfig(8, 256, 4, 2, late=1, split=2),
         GluonGemmConfig(8, 128, 4, 2, split=2), GluonGemmConfig(8, 256, 4, 2, rot=1, split=2),
         GluonGemmConfig(8, 256, 4, 1, split=2, wtma=1),
         GluonGemmConfig(8, 256, 4, 1, 1, split=2, wtma=1),
         GluonGemmConfig(8, 128, 4, 1, split=2, wtma=1), GluonGemmConfig(4, 128, 4, 1, wtma=1),
         GluonGemmConfig(8, 128, 4, 2, 1, split=2), GluonGemmConfig(8, 256, 5, 2, 1, split=2)]
#: per op: index 1.. (0 is the default route); SPLIT at the end (Q4_0: 13..24, awq / Q4_K / Q8_0
#: / nf4: 10..21, Q6_K: 9..20), then awq / Q4_K / Q8_0's packed GEMM (22: their M = 128 route
#: before session 10)
CANDIDATES = {"Q4_0": [_OLD, K.PACKED_GEMM[K.GGUF_IDS["Q4_0"]], *GLUON, *H2, *SPLIT],
              "awq": [K.AWQ_GEMM, *GLUON, *SPLIT, K.PACKED_GEMM[K.AWQ]],
              "Q4_K": [_OLD, *GLUON, *SPLIT, K.PACKED_GEMM[K.GGUF_IDS["Q4_K"]]],
              "Q8_0": [_OLD, *GLUON, *SPLIT, K.PACKED_GEMM[K.GGUF_IDS["Q8_0"]]],
              "nf4": [G(128, 128, 1, 8, 3, tma=1, vec=1), *GLUON, *SPLIT], "Q6_K": [*GLUON, *SPLIT]}
#: and last: wtma with the producer warp and 5 stages (Q4_0 25, awq / Q4_K / Q8_0 23, nf4 22,
#: Q6_K 21; Q8_0 / Q6_K: too much shared memory, skipped by the bench as FAILED), the producer
#: warp with 6 stages (Q4_0 26, awq / Q4_K / Q8_0 24, nf4 23, Q6_K 22)
for _op in CANDIDATES:
    CANDIDATES[_op] += [GluonGemmConfig(8, 256, 5, 1, 1, split=2, wtma=1),
                        GluonGemmConfig(8, 256, 6, 2, 1, split=2)]


#: session 10's defaults (the shared A buffer), the token "old" of --gluon. Session 11 round 1
#: (H200, M = 256, each launch timed twice interleaved; dense 0.0526-0.0565), register A
#: (rega: --gluon 8,256,S,2,1,0,0,0,2,W,1): Q4_0 words loaded 6 stages 0.0576 / 0.0575, wtma 5
#: stages 0.0591 / 0.0590, wtma 6 stages 0.0576 / 0.0572 (these 0.0635 / 0.0636); Q8_0 6 stages
#: 0.0605 / 0.0608, 7 0.0617 / 0.0611, wtma 5 0.0621 / 0.0629 (0.0665 / 0.0681); Q6_K 6 stages
#: 0.0643 / 0.0638, 7 0.0644 / 0.0642, wtma 5 0.0638 / 0.0662 (0.0715 / 0.0715); NF4 wtma 5
#: 0.0631 / 0.0633, 6 0.0638 / 0.0633 (0.0698 / 0.0707); AWQ wtma 5 0.0603 / 0.0595 (0.0638 /
#: 0.0637); Q4_K wtma 5 0.0624 / 0.0617 (0.0851 / 0.0672). M = 128 Q4_0 (8,128,4,2,1,...,0,1)
#: 0.0430 / 0.0430 (0.0493 / 0.0490; dense 0.0354). Register A with one step an iteration
#: (forced then; no longer selectable): NaN.
_OLD10_128 = GluonGemmConfig(8, 128, 4, 2, 1, split=2)
OLD10 = {**{op: {128: _OLD10_128, 256: GluonGemmConfig(8, 256, 5, 1, 1, split=2, wtma=1)}
            for op in ("Q4_0", "awq", "Q4_K", "nf4")},
         "Q8_0": {128: _OLD10_128, 256: GluonGemmConfig(8, 256, 5, 2, 1, split=2)},
         "Q6_K": {128: GluonGemmConfig(8, 128, 4, 2, split=2),
                  256: GluonGemmConfig(8, 256, 6, 2, 1, split=2)}}


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
                    help="indices into each op's configs: 0 = the default route, 1.. = "
                         "CANDIDATES (per op: Q4_0=0,2/awq=3)")
    ap.add_argument("--no-anchor", action="store_true", help="skip the dense cuBLAS anchor")
    ap.add_argument("--dense-each", action="store_true",
                    help="time the dense cuBLAS anchor before every format, not once a size")
    ap.add_argument("--gluon", default=None,
                    help="GluonGemmConfig tuples (';'-separated; old: session 10's default) "
                         "timed after the default instead of CANDIDATES, each at the M equal "
                         "to its block_m; per op: 'Q4_0=t;t/awq=t'")
    ap.add_argument("--skip-default", action="store_true", help="with --gluon: only those")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the default and the candidates this many times, interleaved "
                         "(the first launch timed after the dense anchor runs slow)")
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
            "fused" if "packed_gemm" in impl or "gluon_gemm" in impl else "anchor"
        key = (op, m, kind)
        if key not in best or ms < best[key][0]:
            best[key] = (ms, impl)
        tf = 2 * m * n * k / ms / 1e9
        gb = nbytes / ms / 1e6
        print(f"{op:5s} M={m:<4d} {impl:52s} {ms:.4f} ms  {tf:6.1f} TFLOP/s  {gb:6.0f} GB/s",
              flush=True)
        if jsonl:
            with open(jsonl, "a") as fh:
                fh.write(json.dumps({**quant_record_names(op, impl), "device": name,
                                     "shape": [m, n, k],
                                     "dtype": "bfloat16", "ms": round(ms, 5),
                                     "TFLOP/s": round(tf, 1), "GB/s": round(gb, 1),
                                     "date": time.strftime("%Y-%m-%d", time.gmtime())}) + "\n")

    anchored = set()
    for op in args.ops.split(","):
        fn, w, nbytes = weights(op, n, k, g)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
            want = TF.linear(x, w)
            if not args.no_anchor and not args.compile_only and \
                    (m not in anchored or args.dense_each):
                anchored.add(m)
                ms = do_bench_cudagraph(lambda: TF.linear(x, w), rep=args.rep,
                                        return_mode="median")
                record("dense", "cublas_bf16", m, ms, 2 * n * k)
            cfgs = [None] + CANDIDATES.get(op, [])
            if args.gluon:
                # (per op: "Q4_0=t;t/awq=t": the tuples of that op only)
                mine = dict(v.split("=") for v in args.gluon.split("/")).get(op, "") \
                    if "=" in args.gluon else args.gluon
                cfgs = [None] * (not args.skip_default) + [
                    c for c in (OLD10[op][m] if t == "old" else
                                GluonGemmConfig(*(int(v) for v in t.split(",")))
                                for t in mine.split(";") if t) if c.block_m == m]
            elif args.pick is not None:
                pick = dict(v.split("=") for v in args.pick.split("/")) if "=" in args.pick \
                    else {op: args.pick}
                cfgs = [cfgs[int(i)] for i in pick.get(op, "").split(",")
                        if i and int(i) < len(cfgs)]
            usable = []
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
                usable.append((cfg, tag))
                if args.compile_only:
                    print(f"{op:5s} M={m:<4d} {tag:52s} checked, max err {err:.3g}", flush=True)
            for cfg, tag in (usable * args.rounds if not args.compile_only else []):
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
        fn = w = None       # (frees the weight before the next format)
        torch.cuda.empty_cache()
    print("summary (ms): op M default | best packed GEMM | dense cuBLAS | best other")
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
