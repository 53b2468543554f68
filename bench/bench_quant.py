#!/usr/bin/env python3
"""Quantized matmuls on the NumPy backend: qmatmul (Q4_0, Q8_0, Q4_K, Q6_K), nf4_matmul and
awq_matmul, float32 activations. "fuelgraph" is the tiled kernel (dequantize a tile into a
float32 scratch, then BLAS), "fuelgraph lowered" the recipe (the whole weight dequantized in
primitives, then one matmul), "torch eager" the dense float32 matmul on the already dequantized
weight -- the reference the kernel is held to (target: within 2x at M = 256).

    python bench/bench_quant.py [--quick]
    python bench/bench_quant.py --ratios [--one-thread] [--reps 7] [--nk 4096] [--m 1,16,256]
                                [--formats Q4_0,Q4_K,NF4,...]

Writes bench/results/quant_<date>.json and prints one line per case with ratios to "fuelgraph".
`--ratios` times every format (the ten GGUF types, NF4, AWQ) against the dense float32 matmul
(NumPy's `a @ W.T` on the dequantized weight, and torch's) at each M, interleaved in one process
(dense, kernel, dense, ... per repetition; the ratio of each kernel run to the mean of the dense
runs beside it; median over repetitions), so that a loaded machine slows both alike.
`--one-thread` runs everything on one thread and times thread CPU time: the steadiest numbers on
a shared machine (they leave out what the second core adds). Writes quant_ratios_<date>.json.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if "--one-thread" in sys.argv:      # before fuelgraph starts its pool
    os.environ["FUELGRAPH_NUM_THREADS"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fuelgraph.functional as F  # noqa: E402
import fuelgraph.quant as Q  # noqa: E402
from common import fg_case, record, run_cases, write_results  # noqa: E402
from fuelgraph.backends.numpy import quant as K  # noqa: E402
from fuelgraph.registry.quant_gguf import FORMATS  # noqa: E402

# f16 fields of the K-quant blocks (byte offsets): set to small finite scales
_SCALE_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def gguf_weight(rng, qtype, n, k):
    """Raw bytes of an [n, k] weight: gguf-py's quantizer where it has one, else random codes
    with finite scales."""
    if qtype in ("Q4_0", "Q8_0"):
        w = rng.standard_normal((n, k)) / np.sqrt(k)
        return Q.quantize_gguf(w.astype(np.float32), qtype).numpy()
    f = FORMATS[qtype]
    raw = rng.integers(0, 256, size=(n * k // f.block, f.type_size), dtype=np.uint8)
    for off in _SCALE_FIELDS[qtype]:
        d = (rng.uniform(-1, 1, size=raw.shape[0]) / (1000 * np.sqrt(k))).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def cases(m, n, k, rng):
    a = rng.standard_normal((m, k)).astype(np.float32)
    ta = torch.from_numpy(a)
    for qtype in ("Q4_0", "Q8_0", "Q4_K", "Q6_K"):
        raw = gguf_weight(rng, qtype, n, k).reshape(-1)
        wt = torch.from_numpy(np.ascontiguousarray(K.dequantize_gguf(raw, qtype, n, k).T))
        yield (f"qmatmul_{qtype}", [m, n, k],
               fg_case(lambda x, w, _q=qtype: F.qmatmul(x, w, _q, n, k), [a, raw]),
               lambda _w=wt: ta @ _w)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    packed, absmax = (t.numpy() for t in Q.quantize_nf4(w))
    wt = torch.from_numpy(np.ascontiguousarray(K.dequantize_nf4(packed, absmax).T))
    yield ("nf4_matmul", [m, n, k], fg_case(F.nf4_matmul, [a, packed, absmax]),
           lambda _w=wt: ta @ _w)
    qw, qz, sc = (t.numpy() for t in Q.quantize_awq(w.T.copy(), 128))
    wt = torch.from_numpy(K.dequantize_awq(qw, qz, sc, 128))
    yield ("awq_matmul", [m, n, k],
           fg_case(lambda x, q, z, s: F.awq_matmul(x, q, z, s, 128), [a, qw, qz, sc]),
           lambda _w=wt: ta @ _w)


def _ratio_ops(rng, n, k, qtypes):
    """name -> (kernel(a) on the packed weight, float32 W [n, k] it dequantizes to)."""
    ops = {}
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    for qtype in qtypes:
        if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
            raw = Q.quantize_gguf(w, qtype).numpy().reshape(-1)
        elif qtype in _SCALE_FIELDS:
            raw = gguf_weight(rng, qtype, n, k).reshape(-1)
        else:   # random K-quant bytes with finite scales (f16 fields set small)
            f = FORMATS[qtype]
            raw = rng.integers(0, 256, size=(n * k // f.block, f.type_size), dtype=np.uint8)
            for off in _K_F16_FIELDS[qtype]:
                d = (rng.uniform(-1, 1, size=raw.shape[0]) / (1000 * np.sqrt(k))).astype(np.float16)
                raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
            raw = raw.reshape(-1)
        ops[qtype] = (lambda a, _r=raw, _q=qtype: K.qmatmul(a, _r, quant_type=_q, n=n, k=k),
                      K.dequantize_gguf(raw, qtype, n, k))
    packed, absmax = (t.numpy() for t in Q.quantize_nf4(w))
    ops["NF4"] = (lambda a: K.nf4_matmul(a, packed, absmax, block_size=64),
                  K.dequantize_nf4(packed, absmax))
    qw, qz, sc = (t.numpy() for t in Q.quantize_awq(w.T.copy(), 128))
    ops["AWQ"] = (lambda a: K.awq_matmul(a, qw, qz, sc, group_size=128),
                  np.ascontiguousarray(K.dequantize_awq(qw, qz, sc, 128).T))
    return ops


_K_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q5_K": (0, 2)}


def ratios(ms=(1, 16, 256), nk=4096, reps=7, one_thread=False, only=None):
    """Median ratio of each kernel to the dense float32 matmul, interleaved (see the module
    docstring); prints a table, returns and writes the records."""
    import statistics
    import time
    clock = time.thread_time if one_thread else time.perf_counter

    def run_for(fn, budget=0.12):
        fn()
        t0 = clock()
        fn()
        one = max(clock() - t0, 1e-6)
        reps_ = max(1, int(budget / one))
        t0 = clock()
        for _ in range(reps_):
            fn()
        return (clock() - t0) / reps_ * 1e3

    rng = np.random.default_rng(0)
    qtypes = [q for q in FORMATS if only is None or q in only]
    ops = {name: op for name, op in _ratio_ops(rng, nk, nk, qtypes).items()
           if only is None or name in only}
    records = []
    for m in ms:
        a = rng.standard_normal((m, nk)).astype(np.float32)
        ta = torch.from_numpy(a)
        per = {name: [] for name in ops}
        per_torch = {name: [] for name in ops}
        dense_ms = []
        for _ in range(reps):
            for name, (op, w) in ops.items():
                wt, tw = np.ascontiguousarray(w.T), torch.from_numpy(w)
                d0 = run_for(lambda: a @ wt)
                t0 = run_for(lambda: ta @ tw.T)
                q = run_for(lambda: op(a))
                d1 = run_for(lambda: a @ wt)
                t1 = run_for(lambda: ta @ tw.T)
                per[name].append(q / ((d0 + d1) / 2))
                per_torch[name].append(q / ((t0 + t1) / 2))
                dense_ms += [d0, d1]
        dense = statistics.median(dense_ms)
        print(f"M={m}: dense float32 numpy {dense:.3f} ms (min {min(dense_ms):.3f}, "
              f"max {max(dense_ms):.3f})")
        for name in ops:
            r, rt = statistics.median(per[name]), statistics.median(per_torch[name])
            print(f"  {name:5s} x{r:5.2f} numpy dense (range {min(per[name]):.2f}-"
                  f"{max(per[name]):.2f}), x{rt:5.2f} torch dense")
            records.append(record(name, "fuelgraph / dense float32", [m, nk, nk], "float32",
                                  r * dense, ratio_numpy=round(r, 3), ratio_torch=round(rt, 3),
                                  ratio_range=[round(min(per[name]), 3), round(max(per[name]), 3)],
                                  one_thread=one_thread, reps=reps))
    print(f"wrote {write_results('quant_ratios', records)}")
    return records


def main(quick=False):
    rng = np.random.default_rng(0)
    sizes = [(256, 1024, 1024)] if quick else [(256, 4096, 4096), (1, 4096, 4096)]
    return run_cases("quant", (c for m, n, k in sizes for c in cases(m, n, k, rng)), quick=quick)


def _arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    if "--ratios" in sys.argv:
        if "--one-thread" in sys.argv:
            from threadpoolctl import threadpool_limits
            threadpool_limits(1)
            torch.set_num_threads(1)
        ratios(ms=[int(m) for m in _arg("--m", "1,16,256").split(",")], nk=int(_arg("--nk", 4096)),
               reps=int(_arg("--reps", 7)), one_thread="--one-thread" in sys.argv,
               only=_arg("--formats", None) and _arg("--formats", None).split(","))
    else:
        main(quick="--quick" in sys.argv)
