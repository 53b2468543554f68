#!/usr/bin/env python3
"""Few-row quantized matmuls (M = 1, 16; N = K = 8192, bf16 x) on one CUDA GPU, timed two ways
with CUDA graphs (no launch overhead from Python):

* warm: the same weight every call (`do_bench_cudagraph`, as bench_cuda_quant.py); a 4-bit
  8192 x 8192 weight (~38 MB with scales) partly stays in the H200's 50 MB L2 between calls;
* cold: one graph cycling through COPIES different weights of the format (more bytes than L2
  holds), so every call streams its weight from HBM, as a decode step through many layers does.

Per format: the default route and the one-row GEMV candidates (quant_packed.PackedConfig) of
CANDIDATES, each checked against the dense product first. Effective bandwidth = weight bytes
(codes + scales of the packed copy) / time. Records go to DIR/cuda_quant_gemv.jsonl (--out).

    python3 bench/bench_cuda_quant_gemv.py [--out DIR] [--ops Q4_0,nf4,...] [--ms 1,16]
                                           [--compile-only] [--no-cold] [--default-only]
                                           [--pick 0,2]
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

from fuelgraph.backends.cuda.kernels import quant as K  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_packed import PackedConfig  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_mma import MmaConfig  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_packed_dot import PackedDotConfig  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_tiles import AWQ, GGUF_IDS, NF4  # noqa: E402
from fuelgraph.registry.quant import NF4_CODE  # noqa: E402
from fuelgraph.registry.quant_gguf import FORMATS  # noqa: E402

from common import quant_record_names  # noqa: E402  (bench/, the script's folder)

DEV = torch.device(os.environ.get("BENCH_DEVICE", "cuda"))   # cpu: interpreter dry run
COPIES = 4
#: one-row GEMV candidates next to the default: (block_n, chunks, split, warps, prefetch,
#: halves, fma, x32, stages); stages > 1 streams the words through shared memory (cp.async).
#: 18:13 run: 16 rows x 2 warps, bf16 x, 3 stages won for NF4 / Q4_K (now their default) and
#: came second for the rest; the same with float32 x lost 2x. Around it: 2 stages, 4 and 8
#: warps, 32 rows
CANDIDATES = [(16, 4, 0, 2, 0, 2, 1, 0, 3), (16, 4, 0, 2, 0, 2, 1, 0, 2),
              (32, 4, 0, 4, 0, 2, 1, 0, 3), (16, 4, 0, 4, 0, 2, 1, 0, 3),
              (32, 4, 0, 8, 0, 2, 1, 0, 3)]
#: per format: NF4's launch with absmax per plane, and with its code table read by warp
#: shuffles (session 7: sm_90 SASS 5.21 -> 3.97 instructions a weight); Q6_K's old decode on
#: the new launch; Q4_K / AWQ with each plane's precomputed (a, b) pair (aff; Q4_K 6.73 -> 5.21
#: on its launch, 4.96 on the register-prefetch one; AWQ 4.43 -> 4.09; 0.25 bytes a weight
#: more). 20:29 run: NF4 shfl 0.0228 / 0.0234 (0.0254 / 0.0263), Q4_K aff on the register-
#: prefetch launch 0.0239 / 0.0247 (0.0270 / 0.0288; on its own launch 0.0296): both now the
#: defaults; AWQ aff 0.0267 / 0.0294 lost (0.0209 / 0.0235). pdl (the GEMV launched as a
#: programmatic dependent of x's conversion kernel) gained nothing and was removed
EXTRA = {"nf4": [PackedConfig(16, 4, 0, 2, 0, 2, 1, 0, 3, pair=0),
                 PackedConfig(16, 4, 0, 2, 0, 2, 1, 0, 3, shfl=1)],
         "Q6_K": [PackedConfig(16, 4, 0, 2, 0, 2, 0, 0, 3), MmaConfig(8, 2, 0),
                  MmaConfig(4, 2, 2), MmaConfig(8, 2, 2)],
         "Q8_0": [MmaConfig(8, 2, 1), MmaConfig(4, 2, 0)],
         "Q4_K": [PackedConfig(16, 4, 0, 2, 0, 2, 1, 0, 3, aff=1),
                  PackedConfig(16, 4, 0, 4, 1, 2, 1, 1, 1, aff=1), MmaConfig(8, 4, 0),
                  MmaConfig(8, 2, 0), MmaConfig(4, 4, 1), MmaConfig(4, 2, 2),
                  MmaConfig(4, 4, 2), MmaConfig(8, 2, 2), MmaConfig(8, 4, 0)],
         "awq": [PackedConfig(aff=1), MmaConfig(8, 4, 0), MmaConfig(8, 2, 0),
                 MmaConfig(4, 4, 1), MmaConfig(4, 4, 2), MmaConfig(4, 2, 2)],
         # session 8: the tensor-core GEMV (quant_mma.MmaConfig: ksplit, units, ahead, xahead;
         # ahead 2: byte scale fields a step ahead as words; the default route since run 1):
         # indices 6.. Q4_0 / Q8_0, 7.. AWQ / Q6_K, 8.. Q4_K. Run 1 (warm / cold ms): Q4_0
         # k4,u2 0.0107 / 0.0147 (packed 0.0183 / 0.0210), u4 0.0111 / 0.0142, k2,u4 0.0134;
         # removed: two tiles a program 0.0174 on 4 warps (0.0123 on 8), cp.async 3 stages 0.209
         "Q4_0": [MmaConfig(8, 2, 1), MmaConfig(4, 4, 1), MmaConfig(4, 2, 1, 1)]}
#: few rows: tensor-core dots on the packed copy (PackedDotConfig: block_n, block_m, chunks,
#: split, warps, stages, fma, prefetch, join, nat, aff). 18:13 run (session 6): four
#: planes a dot won for Q4_0 / Q8_0, lost for Q4_K; 3 stages and prefetch lost. Session 7: the
#: planes in K order (nat: x read with 16-byte loads, not gathered) on whole steps (the default
#: split is a divisor of the steps: 4, not 3, for 8192 x 8192, and the kernel drops its
#: masks), each plane's (a, b) float32 pair precomputed (aff: one 8-byte load, no scale
#: arithmetic); sm_90 SASS of the loop, instructions a weight: Q4_0 5.91 -> 4.72 (nat) -> 3.97
#: (aff), AWQ 7.98 -> 4.22, Q4_K 7.03 -> 5.09; NF4's code table read by warp shuffles (shfl:
#: 5.96 -> 4.46); Q6_K with a scale per half plane (7.34); early: a step's loads all before
#: its first dot (168 registers: 3 programs an SM; r128: at most 128, 4 programs, 16 bytes of
#: spill stack); fix: split K reduced by the last program of each tile (no zeroed float32
#: output, no conversion kernel: 3 graph nodes -> 1; with pdl, consecutive launches overlap:
#: programmatic dependent launch). 20:29 run (warm / cold ms): Q4_0 aff
#: 0.0368 / 0.0374, aff with prefetch 0.0369 / 0.0378, early 0.0461 / 0.0464, the session 6
#: default (Q4_0's first candidate) 0.0437 / 0.0458 and its launch on 4 splits 0.0528 / 0.0544;
#: AWQ aff 0.0372 / 0.0376 (rows 0.0526); Q4_K aff 0.0373 / 0.0378 (0.0709); NF4 nat + shfl
#: 0.0406 / 0.0433 (nat 0.0522); Q8_0 nat 0.0399 / 0.0403 (0.0463); Q6_K nat 0.0736 / 0.0739
#: (tiles 0.156): the new defaults (quant.DOT_16). early, fix and pdl lost or tied and were
#: removed from the kernel
_NAT = (64, 16, 1, 0, 4, 1, 1, 0, 4, 1)
_AFF = (64, 16, 1, 0, 4, 1, 1, 0, 4, 1, 1)
_AFF_PF = (64, 16, 1, 0, 4, 1, 1, 1, 4, 1, 1)
DOT_CANDIDATES = {"Q4_0": [(64, 16, 1, 3, 4, 1, 1, 1, 4), _AFF, _AFF_PF, _NAT],
                  "Q8_0": [_NAT],
                  "awq": [_AFF, _AFF_PF, _NAT],
                  "Q4_K": [_AFF, _AFF_PF, _NAT],
                  "nf4": [_NAT, (64, 16, 1, 0, 4, 1, 1, 1, 4, 1),
                          PackedDotConfig(64, 16, 1, 0, 4, 1, 1, 0, 4, 1, shfl=1),
                          PackedDotConfig(64, 16, 1, 0, 4, 1, 1, 1, 4, 1, shfl=1)],
                  "Q6_K": [_NAT, (64, 16, 1, 0, 4, 1, 1, 1, 4)]}
#: session 8: the tensor-core GEMV (quant_mma) at M <= 16 (two 8-row x tiles; the default
#: for 1..16 rows since run 2, quant_mma.DEFAULT_MMA_ROWS): Q4_0 indices 5.., Q4_K / AWQ 4..,
#: Q6_K 3.., Q8_0 2..; run 1: Q4_0 t1,k4,u2 0.0239 warm but 0.0431 cold (the dot 0.0366 /
#: 0.0373), x a step ahead (xa) 0.0160 / 0.0178 in run 2 (two tiles a program sharing x
#: through L1, removed: 0.0192 / 0.0328)
DOT_CANDIDATES["Q4_0"] += [MmaConfig(4, 2, 1), MmaConfig(4, 4, 1), MmaConfig(8, 2, 1),
                           MmaConfig(4, 2, 1, 1), MmaConfig(8, 2, 1, 1)]
DOT_CANDIDATES["Q4_K"] += [MmaConfig(4, 2, 0), MmaConfig(8, 2, 0), MmaConfig(4, 2, 2),
                           MmaConfig(4, 2, 2, 1)]
DOT_CANDIDATES["awq"] += [MmaConfig(4, 2, 0), MmaConfig(8, 2, 0), MmaConfig(4, 2, 2),
                          MmaConfig(4, 2, 2, 1)]
DOT_CANDIDATES["Q6_K"] += [MmaConfig(8, 2, 0), MmaConfig(4, 2, 2), MmaConfig(4, 2, 2, 1)]
DOT_CANDIDATES["Q8_0"] += [MmaConfig(4, 2, 1), MmaConfig(8, 2, 1), MmaConfig(4, 2, 1, 1)]
#: session 9: NF4 on the tensor-core GEMV (bf16 codes by prmt lookups, quant_mma_nf4): M = 1
#: indices 8.. (7: the session 7 default, shfl), M = 16 indices 5.. (3: the session 7 default).
#: Run 1 (warm / cold ms): M = 1 k4,u2 0.0180 / 0.0198, k4,u4 0.0163 / 0.0186 (now the default),
#: k4,u2,sn 0.0169 / 0.0194, k8,u2 0.0184 / 0.0216 (shfl 0.0226 / 0.0235); M = 16 k4,u2 0.0215 /
#: 0.0283, xa 0.0265 / 0.0287, k8 0.0294 / 0.0319 (dot 0.0415 / 0.0433)
EXTRA["nf4"] += [MmaConfig(4, 2, 1), MmaConfig(4, 4, 0), MmaConfig(4, 8, 1),
                 MmaConfig(4, 4, 0, 1)]
DOT_CANDIDATES["nf4"] += [MmaConfig(4, 2, 1), MmaConfig(4, 4, 1)]
#: session 9: one row of Q4_K / AWQ with a lane scaling one block (quant_mma_diag; sm_90 SASS of
#: the loop, instructions a weight: Q4_K k8,u2,sn 3.19 -> 2.17, k4,u4,sn 1.98; AWQ k4,u4,sw 1.88
#: -> k4,u4,sn 1.73): Q4_K M = 1 indices 15.., AWQ 12..
EXTRA["Q4_K"] += [MmaConfig(8, 2, 0, 0, 1), MmaConfig(4, 4, 0, 0, 1), MmaConfig(4, 2, 0, 0, 1),
                  MmaConfig(4, 4, 2, 0, 1), MmaConfig(8, 4, 0, 0, 1), MmaConfig(8, 2, 2, 0, 1)]
EXTRA["awq"] += [MmaConfig(4, 4, 0, 0, 1), MmaConfig(4, 4, 2, 0, 1)]
#: Q4_0 as a q + b in the diag launch (k4,u2 2.25 -> 1.78): M = 1 indices 9..
EXTRA["Q4_0"] += [MmaConfig(4, 2, 1, 0, 1), MmaConfig(4, 4, 1, 0, 1)]
#: session 9 added, session 10 run 1 measured and removed (warm / cold ms against the defaults in
#: the same process): two steps a loop iteration (unroll 2; also WRONG in the GPU tests at 2..3
#: steps) NF4 0.0177 / 0.0221 (default 0.0164 / 0.0187), Q4_K 0.0122 (0.0114), Q4_0 0.0109
#: (0.0101), AWQ 0.0108 (0.0102); the unpacking's shifts as IMAD.HI (mulhi) NF4 0.0167, Q4_K
#: 0.0121, Q4_0 0.0113, AWQ 0.0116; words two steps ahead (depth 2) NF4 0.0171, Q4_K 0.0130,
#: Q4_0 0.0118, AWQ 0.0120.
#: Session 10: NF4's codes by loads from a shared-memory byte table (lut: 0.5 integer-pipe
#: instructions a weight, not 2.4; sm_90 SASS of the loop k4,u4 2.93 -> 2.07 instructions a
#: weight). Run 1 (warm / cold ms): M = 1 k4,u4 0.0130 / 0.0145, k4,u2 0.0130 / 0.0153 (prmt
#: default 0.0164 / 0.0187); lost: k8,u2 0.0172, k8,u4 0.0179, k4,u8 0.0157, scales in their
#: step 0.0142, x a step ahead 0.0164 (with sn 0.0167); M = 16 k4,u2 0.0224 / 0.0227 (prmt k4,u2
#: 0.0215 / 0.0283), k4,u4 0.0337, k8,u2 0.0372. lut became the default of both. Run 2: lut
#: 0.0130 / 0.0144 (prmt 0.0166 / 0.0186), k4,u2 0.0130 / 0.0153; M = 16 0.0222 / 0.0225 (prmt
#: 0.0221 / 0.0279); removed, tied: the table's entries decoded in registers instead of loaded
#: (0.0131 / 0.0144; M = 16 0.0222 / 0.0224), the words past L1 (ld.global.cg: 0.0130 / 0.0144,
#: Q4_0 0.0100 vs 0.0103, Q4_K 0.0112 vs 0.0113, AWQ 0.0101 vs 0.0102, cold equal). Indices: nf4
#: M = 1 12 (the prmt lookups k4,u4, the session 9 default), 13 (lut k4,u2); M = 16 5 (prmt k4,u2)
EXTRA["nf4"] += [MmaConfig(4, 4, 1), MmaConfig(4, 2, 1, lut=1)]
DOT_CANDIDATES["nf4"] = DOT_CANDIDATES["nf4"][:4] + [MmaConfig(4, 2, 1)]

def weights(op, n, k, g):
    """(matmul(x, cfg), dense W [N, K] bf16, packed-copy bytes) of one random weight."""
    if op == "nf4":
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV, generator=g)
        absmax = torch.rand(n, k // 64, device=DEV, generator=g) * 0.05
        code = torch.tensor(NF4_CODE, device=DEV)
        w = K.dequantize(NF4, packed, absmax, code, 64, k, n).t()
        fn = lambda x, c: K.nf4_matmul(x, packed, absmax, block_size=64, config=c)  # noqa
        return fn, w.to(torch.bfloat16), packed.numel() + 4 * absmax.numel()
    if op == "awq":
        words = torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8), dtype=torch.int32,
                              device=DEV, generator=g)
        zeros = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 128, n // 8), dtype=torch.int32,
                              device=DEV, generator=g)
        scales = (torch.rand(k // 128, n, device=DEV, generator=g) * 2e-3).half()
        w = K.dequantize(AWQ, words, zeros, scales, 128, k, n).t()
        fn = lambda x, c: K.awq_matmul(x, words, zeros, scales, group_size=128,  # noqa: E731
                                       config=c)
        return fn, w.to(torch.bfloat16), 4 * words.numel() + 2 * scales.numel() + n * k // 128
    f = FORMATS[op]
    raw = torch.randint(0, 256, (n * k // f.block, f.type_size), dtype=torch.uint8, device=DEV,
                        generator=g)
    for off in {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[op]:
        d = (torch.rand(raw.shape[0], device=DEV, generator=g) - 0.5) * 2e-3
        raw[:, off:off + 2] = d.half().view(torch.uint8).view(-1, 2)
    raw = raw.reshape(-1)
    w = K.dequantize(GGUF_IDS[op], raw, raw, raw, f.row_bytes(k), k, n).t()
    fn = lambda x, c: K.qmatmul(x, raw, quant_type=op, n=n, k=k, config=c)  # noqa: E731
    return fn, w.to(torch.bfloat16), raw.numel()


def close(got, want):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    return err <= 3e-2 * max(scale, 1.0), err


def timings(made, x, cfg, rep):
    """(warm, cold) CUDA-graph medians (ms a call); cold None with one weight."""
    fn0 = made[0][0]
    for f, *_ in made[1:]:
        f(x, cfg)       # pack the other copies before timing
    warm = do_bench_cudagraph(lambda: fn0(x, cfg), rep=rep, return_mode="median")
    if len(made) == 1:
        return warm, None

    def cycle():
        for f, *_ in made:
            f(x, cfg)
    return warm, do_bench_cudagraph(cycle, rep=rep, return_mode="median") / len(made)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--ops", default="Q4_0,nf4,awq,Q4_K,Q8_0,Q6_K")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--rep", type=int, default=40, help="ms of repetitions a timing")
    ap.add_argument("--part", default="all", choices=("all", "a", "b", "c", "d"),
                    help="a: M = 1 default + the first 3 candidates; b: the other M = 1 "
                         "variants; c / d: M > 1, the first 3 / the rest (for a parallel "
                         "compile warm-up)")
    ap.add_argument("--default-only", action="store_true", help="time the default routes only")
    ap.add_argument("--xdtype", default="bfloat16",
                    help="x's dtype (float32 at one row: the GEMV without x's conversion kernel)")
    ap.add_argument("--pick", default=None,
                    help="indices into the configs of each (op, M): 0 = the default route, i = "
                         "the i-th candidate (one compile a process in a parallel warm-up); "
                         "per op (and M): Q4_0=0,1/awq@16=0,2")
    args = ap.parse_args()
    n = k = args.size
    xdt = getattr(torch, args.xdtype)
    g = torch.Generator(device=DEV).manual_seed(0)
    jsonl = None
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        jsonl = pathlib.Path(args.out) / "cuda_quant_gemv.jsonl"
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    copies = 1 if args.compile_only or args.no_cold else COPIES
    for op in args.ops.split(","):
        made = [weights(op, n, k, g) for _ in range(copies)]
        fn0, w0, nbytes = made[0]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g).to(xdt)
            want = TF.linear(x, w0.to(x.dtype))
            if m == 1:
                cfgs = [None] + [PackedConfig(*v) for v in CANDIDATES] + EXTRA.get(op, [])
                cut = 4
            else:
                cfgs = [None] + [PackedDotConfig(*v) if isinstance(v, tuple) else v
                                 for v in DOT_CANDIDATES.get(op, [])]
            if args.pick is not None:   # "0,2" for every op, or "Q4_0=0,1/awq@16=0,2"
                pick = dict(v.split("=") for v in args.pick.split("/")) if "=" in args.pick \
                    else {op: args.pick}
                cfgs = [cfgs[int(i)] for i in pick.get(f"{op}@{m}", pick.get(op, "")).split(",")
                        if i and int(i) < len(cfgs)]
            elif args.default_only:
                cfgs = cfgs[:1]
            elif args.part in ("c", "d"):
                cfgs = [] if m == 1 else cfgs[:3] if args.part == "c" else cfgs[3:]
            elif args.part != "all":
                cfgs = [] if m > 1 else cfgs[:cut] if args.part == "a" else cfgs[cut:]
            for cfg in cfgs:
                tag = "default" if cfg is None else cfg.tag()
                try:
                    ok, err = close(fn0(x, cfg), want)
                except Exception as exc:  # noqa: BLE001
                    print(f"{op:5s} M={m:<3d} {tag:40s} FAILED {str(exc)[:200]!r}", flush=True)
                    continue
                if not ok:
                    print(f"{op:5s} M={m:<3d} {tag:40s} WRONG max err {err:.3g}", flush=True)
                    continue
                if args.compile_only:
                    continue
                try:
                    warm, cold = timings(made, x, cfg, args.rep)
                except Exception as exc:  # noqa: BLE001
                    print(f"{op:5s} M={m:<3d} {tag:40s} FAILED timing {str(exc)[:200]!r}",
                          flush=True)
                    continue
                best = cold if cold is not None else warm
                r = {**quant_record_names(op, f"fuelgraph[{tag}]"), "device": name,
                     "shape": [m, n, k],
                     "dtype": args.xdtype, "ms_graph": round(warm, 5),
                     "ms_cold": None if cold is None else round(cold, 5),
                     "gbps_cold": None if cold is None else round(nbytes / cold / 1e6, 1),
                     "date": time.strftime("%Y-%m-%d", time.gmtime())}
                print(f"{op:5s} M={m:<3d} {tag:40s} warm {warm:.4f} ms  cold "
                      f"{cold or float('nan'):.4f} ms  {nbytes / best / 1e6:6.0f} GB/s", flush=True)
                if jsonl:
                    with open(jsonl, "a") as fh:
                        fh.write(json.dumps(r) + "\n")
        del made
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
