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

Writes bench/results/attention_<date>.json and prints one line per case with ratios to
"fuelgraph".
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


def main(quick=False):
    rng = np.random.default_rng(0)
    cases = [forward_case(rng, 1, 8, 8, 1024, 1024, 64, True),
             backward_case(rng, 1, 8, 1024, 64),
             forward_case(rng, 1, 32, 8, 1, 4096, 128, False),
             idiom_case(rng, 1, 8, 512, 64)]
    return run_cases("attention", cases, quick, min_time=1.0, repeat=5)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
