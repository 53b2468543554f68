#!/usr/bin/env python3
"""Quantized matmuls on one CUDA GPU: fuelgraph's Triton kernels (nf4_matmul, awq_matmul,
qmatmul Q4_0 / Q4_K / Q8_0 / Q6_K) against a dense cuBLAS bf16 matmul and bitsandbytes NF4
(when importable), N = K = 8192, bf16 activations, M = 1, 16, 256; plus a device-to-device copy
ceiling measured in the same process. One process; `triton.testing.do_bench` medians (ms) and,
with CUDA graphs (launch overhead removed), `do_bench_cudagraph`. Effective bandwidth = packed
weight bytes / time.

    python3 bench/bench_cuda_quant.py [--out DIR] [--sweep] [--quick] [--ops nf4,awq,Q4_0,...]
                                      [--ms 1,16,256]

--sweep also times launch variants of the storage-order kernels (quant_rows.RowConfig: rows,
output features, plane elements per step, warps, stages, split; NF4 code lookups) and the
dense-copy + cuBLAS path (impl "fuelgraph[...]"; CUDA-graph time only, to keep the run short),
then prints the best variant per op and M next to the default, so ROWS_TABLE / AWQ_TABLE can be
retuned from one run. --sweep packed times only the one-row GEMV on the chunk-layout weight copy
(quant_packed.PackedConfig variants, SWEEP_PACKED) next to the storage-order kernel ("rows"). Every implementation is checked against
the dense product on the same weight before it is timed. Writes JSON records
{"op","impl","device","shape","dtype","ms","ms_graph","gbps","date",...} to
bench/results/cuda_quant_<date>.json (and to --out DIR), then prints the table and the targets.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys
import traceback

import torch
import torch.nn.functional as TF
from triton.testing import do_bench, do_bench_cudagraph

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fuelgraph.backends.cuda.kernels import quant as K  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_gemm import GemmConfig  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_packed import (PACKED_FORMATS,  # noqa: E402
                                                            PackedConfig)
from fuelgraph.backends.cuda.kernels.quant_packed_dot import (DOT_FORMATS,  # noqa: E402
                                                                PackedDotConfig)
from fuelgraph.backends.cuda.kernels.quant_rows import (WORD_FORMATS,  # noqa: E402
                                                          default_rows_config, make_config)
from fuelgraph.backends.cuda.kernels.quant_tiles import AWQ, GGUF_IDS, NF4  # noqa: E402
from fuelgraph.registry.quant import NF4_CODE  # noqa: E402
from fuelgraph.registry.quant_gguf import FORMATS  # noqa: E402

try:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF
    BNB = bnb.__version__
except Exception as exc:  # noqa: BLE001
    print(f"[bench] bitsandbytes not importable: {exc!r}", file=sys.stderr)
    bnb = None
    BNB = None

DEV = torch.device("cuda")
DATE = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
RECORDS: list[dict] = []
COMPILE_ONLY = False
JSONL = None    # --out DIR: each record also appended to DIR/cuda_quant_records.jsonl
REP = 200       # ms of repetitions a timing (--sweep small: 80)
# targets (ms) from the issue: (M=1, M=16, M=256)
TARGETS = {"nf4_matmul": (0.015, 0.044, 0.064), "awq_matmul": (0.015, 0.044, 0.064),
           "qmatmul_Q4_0": (0.015, 0.044, 0.064), "qmatmul_Q4_K": (0.015, 0.044, 0.064),
           "qmatmul_Q8_0": (0.025, 0.05, 0.07), "qmatmul_Q6_K": (0.025, 0.05, 0.07)}
# sweep variants: (block_m, block_n, plane elements per step, warps, stages[, split]) by M;
# AWQ's block_n counts columns (8 per packed word)
SWEEP_ROWS = {1: [(1, 16, 4096, 4, 2), (1, 32, 4096, 4, 2), (1, 16, 8192, 8, 2),
                  (1, 8, 2048, 2, 2), (1, 32, 8192, 4, 3), (16, 64, 8192, 4, 2)],
              16: [(16, 64, 8192, 4, 2), (16, 128, 8192, 4, 2), (16, 64, 4096, 4, 3),
                   (16, 128, 16384, 8, 2), (16, 32, 4096, 4, 2)],
              256: [(128, 128, 8192, 8, 3), (128, 128, 16384, 8, 2), (256, 64, 8192, 8, 2),
                    (64, 128, 8192, 4, 3)]}
SWEEP_AWQ = {1: [(1, 256, 8192, 8, 2), (1, 128, 4096, 4, 2), (1, 256, 4096, 4, 2),
                 (1, 512, 8192, 8, 2), (1, 256, 16384, 8, 2), (16, 128, 8192, 4, 2)],
             16: [(16, 128, 8192, 4, 2), (16, 256, 8192, 4, 2), (16, 128, 16384, 8, 2),
                  (16, 256, 16384, 8, 3), (16, 128, 4096, 4, 2)],
             256: [(128, 128, 16384, 8, 3), (128, 256, 16384, 8, 3), (64, 128, 8192, 4, 3),
                   (128, 128, 8192, 4, 3)]}


# the fused dequantizing GEMM (quant_gemm.GemmConfig: block_m, block_n, block_k, split, warps,
# stages[, w_left]) by M; AWQ's block_n counts columns
SWEEP_GEMM = {1: [(16, 64, 256, 0, 4, 4), (16, 128, 128, 0, 4, 4)],
              16: [(16, 64, 256, 0, 4, 4), (16, 128, 128, 0, 4, 4), (16, 64, 128, 0, 4, 3)],
              256: [(128, 128, 64, 1, 8, 3), (256, 64, 128, 1, 8, 3), (128, 256, 64, 1, 8, 3),
                    (128, 128, 128, 1, 8, 3, 1)]}
# --sweep small: the few variants a 90-second GPU slot can afford (compiled ahead in parallel
# by --compile-only processes): the fused GEMM, the two dense-copy dequantizers
SMALL_GEMM = {1: [(16, 64, 256, 0, 4, 4)], 16: [(16, 64, 256, 0, 4, 4), (16, 128, 128, 0, 4, 4)],
              256: [(128, 128, 64, 1, 8, 3), (256, 64, 128, 1, 8, 3), (128, 256, 64, 0, 8, 3)]}
# --sweep small, one row: storage-order kernels with more bytes in flight (a bigger step, or
# the reduction split over more programs)
SMALL_ROWS = {1: [(1, 16, 8192, 4, 2), (1, 16, 4096, 4, 2, 4)]}
SMALL_AWQ = {1: [(1, 256, 16384, 8, 2), (1, 128, 8192, 4, 2)]}
# --sweep packed (and full): the one-row GEMV on the chunk-layout copy (quant_packed.PackedConfig:
# block_n, chunks a step, split, warps, prefetch, halves, fma, x32) besides its default
# (session 5, H200: 8 rows, 2 chunks, 16 words a thread (halves 4) and split 2 all lost to the
# default; next: halves 1, a full 128-byte row piece per 8 threads, and more rows a program)
SWEEP_PACKED = [(32, 4, 1, 8, 1, 2), (16, 4, 1, 4, 1, 1), (32, 4, 1, 8, 1, 1),
                (16, 8, 1, 8, 1, 2), (16, 4, 1, 4, 1, 2, 1, 0)]
# more rows on the same copy: tensor-core dots (quant_packed_dot.PackedDotConfig: block_n,
# block_m, chunks a step, split, warps, stages) by M
SWEEP_PACKED_DOT = {16: [(64, 16, 2, 0, 4, 1), (128, 16, 2, 0, 4, 1), (64, 16, 4, 0, 4, 1)],
                    256: [(128, 128, 2, 0, 8, 1), (64, 128, 2, 0, 4, 1)]}
SWEEP_KIND = "full"
PREFETCH = (GGUF_IDS["Q4_0"], GGUF_IDS["Q8_0"], NF4)


def sweep_configs(fmt, m):
    """RowConfigs / GemmConfigs to time for (format, M), plus the dense-copy paths at many
    rows."""
    packed = []
    if fmt in PACKED_FORMATS:
        packed = [PackedConfig(*v) for v in SWEEP_PACKED] if m == 1 else \
            [PackedDotConfig(*v) for v in SWEEP_PACKED_DOT.get(m, []) if fmt in DOT_FORMATS]
    if SWEEP_KIND == "packed":
        return packed + (["rows"] if m == 1 else [])
    if SWEEP_KIND == "small":
        cfgs = [make_config(fmt, *v) for v in (SMALL_AWQ if fmt == AWQ else SMALL_ROWS).get(m, [])]
        if m == 1 and fmt in PREFETCH:      # next step's bytes loaded ahead (quant_gemv)
            cfgs += [dataclasses.replace(default_rows_config(fmt, 1), prefetch=1),
                     dataclasses.replace(default_rows_config(fmt, 1), prefetch=2),
                     dataclasses.replace(make_config(fmt, 1, 32, 8192, 4), prefetch=1)]
        cfgs += [GemmConfig(*v) for v in SMALL_GEMM.get(m, [])]
        if fmt in PREFETCH[:2] and m > 1:   # Q4_0 / Q8_0 words loaded a step ahead
            cfgs.append(dataclasses.replace(GemmConfig(*SMALL_GEMM[m][0]), prefetch=1))
        if m > 16:
            cfgs += ["dequant"] + (["dequant_rows"] if fmt not in (AWQ,) else [])
        return cfgs
    table = SWEEP_AWQ if fmt == AWQ else SWEEP_ROWS
    cfgs = [make_config(fmt, *v) for v in table.get(m, [])]
    base = default_rows_config(fmt, m)
    if m == 1:      # x per element instead of one float32 copy; bytes instead of 2-byte words
        cfgs.append(dataclasses.replace(base, x32=0))
        if fmt in WORD_FORMATS:
            cfgs.append(dataclasses.replace(base, words=0))
    if m == 1 and fmt in PREFETCH:
        cfgs += [dataclasses.replace(base, prefetch=1), dataclasses.replace(base, prefetch=2),
                 dataclasses.replace(make_config(fmt, 1, 16, 8192, 4), prefetch=1)]
    if fmt == NF4 and m in (1, 16):     # the code lookup: global table, select tree
        cfgs += [dataclasses.replace(default_rows_config(NF4, m), lut=lut) for lut in (0, 1)]
    cfgs += packed + [GemmConfig(*v) for v in SWEEP_GEMM.get(m, [])]
    if fmt in PREFETCH[:2]:
        cfgs += [dataclasses.replace(GemmConfig(*v), prefetch=1) for v in SWEEP_GEMM.get(m, [])]
    if m > 16:
        cfgs += ["dequant"] + (["dequant_rows"] if fmt != AWQ else [])
    return cfgs


def t_ms(fn):
    if COMPILE_ONLY:
        fn()
        return 0.0
    return float(do_bench(fn, warmup=25, rep=REP, return_mode="median"))


def t_graph_ms(fn):
    if COMPILE_ONLY:
        return None
    try:
        return float(do_bench_cudagraph(fn, rep=REP, return_mode="median"))
    except Exception as exc:  # noqa: BLE001  (e.g. a path that cannot be captured)
        print(f"[bench] cuda graph timing failed: {exc!r}", file=sys.stderr)
        return None


def record(op, impl, m, n, k, ms, ms_graph, wbytes, **extra):
    if COMPILE_ONLY:
        return None
    best = min(x for x in (ms, ms_graph) if x is not None)
    r = {"op": op, "impl": impl, "device": torch.cuda.get_device_name(), "shape": [m, n, k],
         "dtype": "bfloat16", "ms": round(ms, 5),
         "ms_graph": None if ms_graph is None else round(ms_graph, 5),
         "gbps": round(wbytes / best / 1e6, 1) if wbytes else None, "date": DATE}
    r.update(extra)
    RECORDS.append(r)
    if JSONL:       # survives a timeout that cuts the run short
        with open(JSONL, "a") as f:
            f.write(json.dumps(r) + "\n")
    print(f"{op:14s} M={m:<4d} {impl:28s} {ms:8.4f} ms  graph {ms_graph or float('nan'):8.4f} ms"
          + (f"  {r['gbps']:7.1f} GB/s" if wbytes else ""), flush=True)
    return r


def copy_ceiling():
    """Device-to-device copy of 1 GiB: read + write bytes per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = t_ms(lambda: dst.copy_(src))
    gbps = 2 * src.numel() / ms / 1e6
    RECORDS.append({"op": "copy", "impl": "torch copy_", "device": torch.cuda.get_device_name(),
                    "shape": [src.numel()], "dtype": "uint8", "ms": round(ms, 5),
                    "gbps": round(gbps, 1), "date": DATE})
    print(f"copy ceiling: {gbps:.0f} GB/s (1 GiB d2d in {ms:.3f} ms)")
    del src, dst
    return gbps


def _close(got, want, what):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    if not err <= 3e-2 * max(scale, 1.0):
        raise AssertionError(f"{what}: max error {err} vs max |ref| {scale}")


# ---- weights (random contents: speed does not depend on them) -------------------------------
def gguf_weight(qtype, n, k, g):
    f = FORMATS[qtype]
    raw = torch.randint(0, 256, (n * k // f.block, f.type_size), dtype=torch.uint8, device=DEV,
                        generator=g)
    offs = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[qtype]
    for off in offs:
        d = (torch.rand(raw.shape[0], device=DEV, generator=g) - 0.5) * 2e-3
        raw[:, off:off + 2] = d.half().view(torch.uint8).view(-1, 2)
    return raw.reshape(-1)


def t_sweep_ms(fn):
    try:
        return float(do_bench_cudagraph(fn, rep=60, return_mode="median"))
    except Exception:  # noqa: BLE001
        return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))


def run_case(op, m, n, k, fused, dense_w, wbytes, sweep, g, fmt):
    """Check `fused(x, cfg)` against x @ dense_w.T, then time it (and config variants)."""
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
    want = TF.linear(x, dense_w)
    try:
        _close(fused(x, None), want, f"{op} M={m}")
        default_ok = True
    except Exception as exc:  # noqa: BLE001  (report, and still try the variants)
        print(f"[bench] {op} M={m} default failed: {str(exc)[:300]!r}", file=sys.stderr)
        default_ok = False
    if COMPILE_ONLY:    # warm Triton's on-disk cache for a later timed run
        for cfg in (sweep_configs(fmt, m) if sweep else ()):
            try:
                fused(x, cfg)
            except Exception as exc:  # noqa: BLE001
                print(f"[compile] {op} M={m} {cfg} failed: {str(exc)[:300]!r}", file=sys.stderr)
        return x
    if default_ok:
        record(op, "fuelgraph", m, n, k, t_ms(lambda: fused(x, None)),
               t_graph_ms(lambda: fused(x, None)), wbytes)
    if sweep:
        for cfg in sweep_configs(fmt, m):
            tag = cfg if isinstance(cfg, str) else cfg.tag()
            try:
                _close(fused(x, cfg), want, f"{op} M={m} {tag}")
                ms = t_sweep_ms(lambda: fused(x, cfg))
                record(op, f"fuelgraph[{tag}]", m, n, k, ms, None, wbytes)
            except Exception as exc:  # noqa: BLE001
                print(f"[bench] {op} M={m} {tag} failed: {str(exc)[:300]!r}", file=sys.stderr)
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", nargs="?", const="full", default=None,
                    help="time launch variants: full (default), small or packed (one row: the "
                         "chunk-layout GEMV's variants and the storage-order kernel)")
    ap.add_argument("--compile-only", action="store_true",
                    help="run every case once (no timing, no JSON): warms Triton's cache")
    ap.add_argument("--quick", action="store_true", help="N = K = 4096")
    ap.add_argument("--size", type=int, default=8192, help="N = K (default 8192)")
    ap.add_argument("--ops", default="nf4,awq,Q4_0,Q4_K,Q8_0,Q6_K")
    ap.add_argument("--ms", default="1,16,256")
    args = ap.parse_args()
    global SWEEP_KIND, COMPILE_ONLY, REP, JSONL
    SWEEP_KIND = args.sweep or "full"
    REP = 80 if SWEEP_KIND in ("small", "packed") else 200
    COMPILE_ONLY = args.compile_only
    if args.out and not COMPILE_ONLY:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        JSONL = str(pathlib.Path(args.out) / "cuda_quant_records.jsonl")
    n = k = 4096 if args.quick else args.size
    ms_list = tuple(int(v) for v in args.ms.split(","))
    ops = set(args.ops.split(","))
    g = torch.Generator(device=DEV).manual_seed(0)
    ceiling = 0.0 if COMPILE_ONLY else copy_ceiling()

    # dense cuBLAS anchor
    w_dense = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(torch.bfloat16)
    for m in ms_list:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=g)
        record("dense", "cublas bf16", m, n, k, t_ms(lambda: TF.linear(x, w_dense)),
               t_graph_ms(lambda: TF.linear(x, w_dense)), 2 * n * k)

    # NF4: bitsandbytes' own quantization, shared by both implementations
    if "nf4" not in ops:
        pass
    elif bnb is not None:
        packed_b, state = bnbF.quantize_4bit(w_dense, blocksize=64, quant_type="nf4",
                                             compress_statistics=False)
        packed = packed_b.view(n, k // 2)
        absmax = state.absmax.float().view(n, k // 64)
    else:
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV, generator=g)
        absmax = torch.rand(n, k // 64, device=DEV, generator=g) * 0.05
    code = torch.tensor(NF4_CODE, device=DEV)
    if "nf4" in ops:
        w_nf4 = K.dequantize(NF4, packed, absmax, code, 64, k, n).t().to(torch.bfloat16)
        nf4_bytes = packed.numel() + 4 * absmax.numel()
    for m in (ms_list if "nf4" in ops else ()):
        x = run_case("nf4_matmul", m, n, k,
                     lambda x, c: K.nf4_matmul(x, packed, absmax, block_size=64, config=c),
                     w_nf4, nf4_bytes, args.sweep, g, NF4)
        if bnb is not None:
            try:
                fn = lambda: bnb.matmul_4bit(x, packed_b.t(), quant_state=state)  # noqa: E731
                _close(fn(), TF.linear(x, w_nf4), f"bitsandbytes M={m}")
                record("nf4_matmul", "bitsandbytes", m, n, k, t_ms(fn), t_graph_ms(fn),
                       nf4_bytes, version=BNB)
            except Exception:  # noqa: BLE001
                traceback.print_exc()

    # AWQ (AutoAWQ GEMM layout, group 128)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8), dtype=torch.int32, device=DEV,
                          generator=g)
    zeros = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 128, n // 8), dtype=torch.int32,
                          device=DEV, generator=g)
    scales = (torch.rand(k // 128, n, device=DEV, generator=g) * 2e-3).half()
    w_awq = K.dequantize(AWQ, words, zeros, scales, 128, k, n).t().to(torch.bfloat16)
    awq_bytes = 4 * (words.numel() + zeros.numel()) + 2 * scales.numel()
    for m in (ms_list if "awq" in ops else ()):
        run_case("awq_matmul", m, n, k,
                 lambda x, c: K.awq_matmul(x, words, zeros, scales, group_size=128, config=c),
                 w_awq, awq_bytes, args.sweep, g, AWQ)

    # GGUF
    for qtype in [q for q in ("Q4_0", "Q4_K", "Q8_0", "Q6_K") if q in ops]:
        raw = gguf_weight(qtype, n, k, g)
        f = FORMATS[qtype]
        w_q = K.dequantize(GGUF_IDS[qtype], raw, raw, raw, f.row_bytes(k), k, n).t()
        w_q = w_q.to(torch.bfloat16)
        for m in ms_list:
            x = run_case(f"qmatmul_{qtype}", m, n, k,
                         lambda x, c, _q=qtype, _r=raw: K.qmatmul(x, _r, quant_type=_q, n=n,
                                                                  k=k, config=c),
                         w_q, raw.numel(), args.sweep, g, GGUF_IDS[qtype])
            # the tile kernels' dense bf16 dequantize, then cuBLAS
            if m == 256 and SWEEP_KIND != "small":
                def deq_gemm(_q=qtype, _r=raw, _x=x):
                    b = K.dequantize(GGUF_IDS[_q], _r, _r, _r, f.row_bytes(k), k, n,
                                     dtype=torch.bfloat16)
                    return _x @ b
                record(f"qmatmul_{qtype}", "fuelgraph dequant+cublas", m, n, k,
                       t_ms(deq_gemm), t_graph_ms(deq_gemm), raw.numel())

    if COMPILE_ONLY:
        print("compiled", ",".join(sorted(ops)))
        return
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "bitsandbytes": BNB, "copy_gbps": round(ceiling, 1), "records": RECORDS}
    paths = [ROOT / "bench" / "results" / f"cuda_quant_{DATE}.json"]
    if args.out:
        paths.append(pathlib.Path(args.out) / f"cuda_quant_{DATE}.json")
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(out, indent=1))
        print(f"wrote {p}")

    print(f"\ncopy ceiling {ceiling:.0f} GB/s; best of eager / CUDA-graph time, ms (GB/s)")
    print(f"{'op':16s} {'impl':28s} " + " ".join(f"{'M=' + str(m):>18s}" for m in ms_list))
    rows: dict = {}
    for r in RECORDS:
        if r["op"] == "copy":
            continue
        best = min(x for x in (r["ms"], r.get("ms_graph")) if x is not None)
        rows.setdefault((r["op"], r["impl"]), {})[r["shape"][0]] = (best, r["gbps"])
    for (op, impl), cells in rows.items():
        line = " ".join(f"{cells[m][0]:9.4f} ({cells[m][1] or 0:6.0f})" if m in cells
                        else f"{'-':>18s}" for m in ms_list)
        print(f"{op:16s} {impl:28s} {line}")
    if args.sweep:
        print("\nbest variant per op and M (ms; default in parentheses):")
        for op in sorted({r["op"] for r in RECORDS if r["op"] not in ("copy", "dense")}):
            for m in ms_list:
                mine = [r for r in RECORDS if r["op"] == op and r["shape"][0] == m
                        and r["impl"].startswith("fuelgraph")]
                if not mine:
                    continue
                best_of = lambda r: min(x for x in (r["ms"], r.get("ms_graph")) if x)  # noqa
                top = min(mine, key=best_of)
                base = [best_of(r) for r in mine if r["impl"] == "fuelgraph"]
                print(f"  {op:14s} M={m:<4d} {best_of(top):8.4f} ({base[0] if base else 0:.4f})"
                      f"  {top['impl']}")
    print("\ntargets (ms): " + ", ".join(f"{op} {t}" for op, t in TARGETS.items()))
    for op, t in TARGETS.items():
        got = rows.get((op, "fuelgraph"), {})
        marks = [f"M={m}: {got[m][0]:.4f} {'<=' if got[m][0] <= tt else '>'} {tt}"
                 for m, tt in zip(ms_list, t) if m in got]
        print(f"  {op:14s} " + "; ".join(marks))


if __name__ == "__main__":
    main()
