#!/usr/bin/env python3
"""Compile time: optimizing and planning a graph must be linear in its size. Two cases, timed
as the first `realize` of a new structure minus a cached replay (so it is optimize + plan):

* a chain of n fusable idioms (`y = y * a + b`, each fusing to INPLACE_AFFINE), n up to 10,000;
* a deep model: n pre-norm residual blocks (RMS norm, a softmax mixing, a SiLU MLP written in
  primitives) with their gradients, n up to 100 layers.

Prints ms per op / per layer for each size: flat means linear.

    python bench/bench_compile.py [--quick]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402

import fuelgraph as fg  # noqa: E402
from common import print_table, record, write_results  # noqa: E402


def chain(n):
    y = fg.tensor(np.ones(16, np.float32))
    for i in range(n):
        y = y * (1.0 + i * 1e-4) + 0.5
    return [y]


def deep(n, d=32, seed=0):
    rng = np.random.default_rng(seed)
    x = fg.tensor(rng.standard_normal((4, d)).astype(np.float32))
    ws = [fg.tensor(rng.standard_normal((d, d)).astype(np.float32) / d ** 0.5,
                    requires_grad=True) for _ in range(2 * n)]
    h = x
    for i in range(n):
        z = h / ((h * h).mean(-1, keepdim=True) + 1e-6).sqrt()
        e = (z - z.max(-1, keepdim=True)).exp()
        z = e / e.sum(-1, keepdim=True)
        h = h + ((z @ ws[2 * i]).silu() @ ws[2 * i + 1])
    loss = (h * h).mean()
    return [loss] + fg.grad([loss], ws)


def compile_ms(build, n):
    outs = build(n)
    t = time.perf_counter()
    fg.realize(outs)
    first = time.perf_counter() - t
    t = time.perf_counter()
    fg.realize(outs)
    replay = time.perf_counter() - t
    return (first - replay) * 1e3


def main(quick=False):
    records = []
    chains = [100, 1000, 3000] if quick else [100, 1000, 3000, 10000]
    layers = [10, 25] if quick else [10, 25, 50, 100]
    for n in chains:
        ms = compile_ms(chain, n)
        records.append(record("compile_chain", "fuelgraph", (n,), "float32", ms,
                              ms_per_op=round(ms / n, 4)))
        print(f"chain of {n:6d} idioms: {ms:9.1f} ms  ({ms / n:.3f} ms per idiom)", flush=True)
    for n in layers:
        ms = compile_ms(deep, n)
        records.append(record("compile_deep_model_fwd+bwd", "fuelgraph", (n,), "float32", ms,
                              ms_per_layer=round(ms / n, 3)))
        print(f"model of {n:4d} layers (fwd+bwd): {ms:9.1f} ms  ({ms / n:.1f} ms per layer)",
              flush=True)
    print(f"wrote {write_results('compile', records)}")
    return records


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
