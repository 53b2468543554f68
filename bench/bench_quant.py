#!/usr/bin/env python3
"""Quantized matmuls on the NumPy backend: qmatmul (Q4_0, Q8_0, Q4_K, Q6_K), nf4_matmul and
awq_matmul, float32 activations. "fuelgraph" is the tiled kernel (dequantize a tile into a
float32 scratch, then BLAS), "fuelgraph lowered" the recipe (the whole weight dequantized in
primitives, then one matmul), "torch eager" the dense float32 matmul on the already dequantized
weight -- the reference the kernel is held to (target: within 2x at M = 256).

    python bench/bench_quant.py [--quick]

Writes bench/results/quant_<date>.json and prints one line per case with ratios to "fuelgraph".
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fuelgraph.functional as F  # noqa: E402
import fuelgraph.quant as Q  # noqa: E402
from common import fg_case, run_cases  # noqa: E402
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


def main(quick=False):
    rng = np.random.default_rng(0)
    sizes = [(256, 1024, 1024)] if quick else [(256, 4096, 4096), (1, 4096, 4096)]
    return run_cases("quant", (c for m, n, k in sizes for c in cases(m, n, k, rng)), quick=quick)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
