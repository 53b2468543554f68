#!/usr/bin/env python3
"""The attention family on the NumPy backend, float32:

* flash_attn, causal, B1 H8 S1024 D64 (the issue's CPU target: within 1.5x of torch SDPA);
* flash_attn forward + backward (dq, dk, dv through the three backward ops), same shape (target:
  the backward within 2x of torch's);
* flash_attn, grouped-query decode: B1 Hq32 Hkv8, one query against 4096 keys, D128;
* the written idiom `softmax(q @ k^T / sqrt(D) + causal const mask) @ v`, which fuses.

Impls: "fuelgraph" (fused kernels), "fuelgraph lowered" (the recipes: scores materialized) and
"torch eager" (scaled_dot_product_attention; torch autograd for the backward).

    python bench/bench_attention.py [--quick]
    python bench/bench_attention.py --ratios [ROUNDS]

Writes bench/results/attention_<date>.json and prints one line per case with ratios to
"fuelgraph". --ratios times the two target cases (causal forward; forward + backward) as
fuelgraph / torch ratios in interleaved rounds (each round: a short batch of each, best of 3
calls) and prints the median ratio with its quartiles: on a shared machine the ratio of runs
taken side by side is steadier than either time.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from common import fg_case, run_cases  # noqa: E402

SDPA = torch.nn.functional.scaled_dot_product_attention


def qkv(rng, B, hq, hkv, sq, sk, d):
    return [rng.standard_normal(s).astype(np.float32)
            for s in ((B, hq, sq, d), (B, hkv, sk, d), (B, hkv, sk, d))]


def forward_case(rng, B, hq, hkv, sq, sk, d, causal):
    arrays = qkv(rng, B, hq, hkv, sq, sk, d)
    tq, tk, tv = (torch.from_numpy(a) for a in arrays)

    def torch_run():
        return SDPA(tq, tk, tv, is_causal=causal, enable_gqa=hq != hkv)
    return ("flash_attn", (B, hq, hkv, sq, sk, d),
            fg_case(lambda q, k, v: F.flash_attn(q, k, v, causal=causal), arrays), torch_run)


def backward_case(rng, B, h, s, d):
    arrays = qkv(rng, B, h, h, s, s, d)
    g = rng.standard_normal((B, h, s, d)).astype(np.float32)
    tg = torch.from_numpy(g)
    tt = [torch.from_numpy(a).requires_grad_() for a in arrays]

    def build(q, k, v, grad):
        out = F.flash_attn(q, k, v, causal=True)
        return [out] + fg.grad([out], [q, k, v], [grad])

    def torch_run():
        out = SDPA(*tt, is_causal=True)
        return (out,) + torch.autograd.grad(out, tt, tg)
    return ("flash_attn_fwd+bwd", (B, h, h, s, s, d), fg_case(build, arrays + [g]), torch_run)


def idiom_case(rng, B, h, s, d):
    arrays = qkv(rng, B, h, h, s, s, d)
    mask = np.triu(np.full((s, s), -np.inf, np.float32), 1)
    tq, tk, tv = (torch.from_numpy(a) for a in arrays)

    def build(q, k, v):
        sc = (q @ k.transpose(-1, -2)) / math.sqrt(d) + fg.const(mask)
        return sc.softmax(-1) @ v

    def torch_run():
        return SDPA(tq, tk, tv, is_causal=True)
    return ("flash_attn (written idiom)", (B, h, h, s, s, d), fg_case(build, arrays), torch_run)


def ratios(rounds=15):
    """Median fuelgraph / torch time ratio (and quartiles) of the two target cases."""
    import statistics
    import time

    def best(fn, n=3):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    rng = np.random.default_rng(0)
    for name, _, make, torch_run in (forward_case(rng, 1, 8, 8, 1024, 1024, 64, True),
                                     backward_case(rng, 1, 8, 1024, 64)):
        fused = make(False)
        for _ in range(3):
            fused(), torch_run()
        rs, tf, tt = [], [], []
        for _ in range(rounds):
            a, b = best(fused), best(torch_run)
            tf.append(a * 1e3), tt.append(b * 1e3), rs.append(a / b)
        q = statistics.quantiles(rs, n=4)
        print(f"{name:20s} fuelgraph/torch median {statistics.median(rs):.3f} "
              f"(quartiles {q[0]:.3f}-{q[2]:.3f}, min {min(rs):.3f} max {max(rs):.3f}); "
              f"median ms fuelgraph {statistics.median(tf):.2f} torch {statistics.median(tt):.2f}",
              flush=True)


def main(quick=False):
    rng = np.random.default_rng(0)
    cases = [forward_case(rng, 1, 8, 8, 1024, 1024, 64, True),
             backward_case(rng, 1, 8, 1024, 64),
             forward_case(rng, 1, 32, 8, 1, 4096, 128, False),
             idiom_case(rng, 1, 8, 512, 64)]
    return run_cases("attention", cases, quick, min_time=1.0, repeat=5)


if __name__ == "__main__":
    if "--ratios" in sys.argv:
        i = sys.argv.index("--ratios")
        ratios(int(sys.argv[i + 1]) if len(sys.argv) > i + 1 else 15)
    else:
        main(quick="--quick" in sys.argv)
