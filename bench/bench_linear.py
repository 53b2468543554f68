#!/usr/bin/env python3
"""FUSED_LINEAR (a @ b + bias) on the NumPy backend: the fused kernel ("fuelgraph"), the same
graph lowered to primitives ("fuelgraph lowered": matmul, then a broadcast add) and torch CPU
eager ("torch eager": torch.addmm for 2-D a, matmul + bias otherwise), float32; forward, and
forward+backward (out and the grads of a, b, bias through fg.grad vs torch.autograd.grad).
SILU_MUL (silu(g) * u, a SwiGLU gate) the same way: its kernel and backward helper, its recipe's
primitives, torch's silu(g) * u and autograd.

    python bench/bench_linear.py [--quick]

Writes bench/results/linear_<date>.json and prints one line per case with ratios to "fuelgraph".
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from common import fg_case, run_cases  # noqa: E402

# (a shape, b shape): a square GEMM, a batched activation with a shared weight, an MLP-ish one
SHAPES = [((1024, 1024), (1024, 1024)), ((8, 256, 1024), (1024, 1024)),
          ((2048, 512), (512, 2048))]


def cases(sa, sb, rng):
    a = rng.standard_normal(sa).astype(np.float32)
    b = (rng.standard_normal(sb) / np.sqrt(sb[0])).astype(np.float32)
    c = rng.standard_normal(sb[-1]).astype(np.float32)
    g = rng.standard_normal(sa[:-1] + sb[-1:]).astype(np.float32)
    ta, tb, tc, tg = map(torch.from_numpy, (a, b, c, g))

    def t_fwd():
        if ta.ndim == 2:
            return torch.addmm(tc, ta, tb)
        return torch.matmul(ta, tb) + tc

    tvars = [t.clone().requires_grad_(True) for t in (ta, tb, tc)]

    def t_fwd_bwd():
        y = torch.matmul(tvars[0], tvars[1]) + tvars[2]
        return (y,) + torch.autograd.grad(y, tvars, tg)

    def fwd_bwd(at, bt, ct, gt):
        y = F.fused_linear(at, bt, ct)
        return [y] + fg.grad([y], [at, bt, ct], [gt])

    yield "fused_linear", fg_case(F.fused_linear, [a, b, c]), t_fwd
    yield "fused_linear+backward", fg_case(fwd_bwd, [a, b, c, g]), t_fwd_bwd


#: silu_mul shapes: the benchmark Llama's MLP (B4 x S256 tokens, FFN 1024), a wider one
SILU_SHAPES = [(1024, 1024), (4096, 2816)]


def silu_cases(shape, rng):
    g, u, gy = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    tg, tu, tgy = map(torch.from_numpy, (g, u, gy))
    tvars = [t.clone().requires_grad_(True) for t in (tg, tu)]

    def t_fwd_bwd():
        y = torch.nn.functional.silu(tvars[0]) * tvars[1]
        return (y,) + torch.autograd.grad(y, tvars, tgy)

    def fwd_bwd(gt, ut, gyt):
        y = F.silu_mul(gt, ut)
        return [y] + fg.grad([y], [gt, ut], [gyt])

    yield "silu_mul", fg_case(F.silu_mul, [g, u]), lambda: torch.nn.functional.silu(tg) * tu
    yield "silu_mul+backward", fg_case(fwd_bwd, [g, u, gy]), t_fwd_bwd


def main(quick=False):
    rng = np.random.default_rng(0)
    linear = ((name, list(sa) + [sb[-1]], make, tr) for sa, sb in SHAPES
              for name, make, tr in cases(sa, sb, rng))
    silu = ((name, list(shape), make, tr) for shape in SILU_SHAPES
            for name, make, tr in silu_cases(shape, rng))
    return run_cases("linear", list(linear) + list(silu), quick, min_time=0.5, repeat=5)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
