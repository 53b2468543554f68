#!/usr/bin/env python3
"""Glue regions on the NumPy backend: each case is plain tensor code whose primitives the
optimizer groups into generated kernels ("fuelgraph": the blocked evaluation of
backends/numpy/glue.py), against the same graph run one NumPy call per primitive ("fuelgraph
lowered", the reference mode) and torch CPU eager, float32:

* swiglu_residual        silu(g) * u + r
* bias_gelu_residual     gelu(x + b) + r                  (erf form)
* norm_weight_residual   x * rsqrt(mean(x^2) + eps) * w + r   (RMS norm kernel + one region)
* swiglu_fwd+bwd         silu(g) * u and its gradients for g and u (the backward is glue too)

    python bench/bench_glue.py [--quick]

Writes bench/results/glue_<date>.json and prints one line per case with ratios to "fuelgraph".
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fuelgraph as fg  # noqa: E402
from common import fg_case, run_cases  # noqa: E402

SHAPES = [(2048, 4096)]
QUICK_SHAPES = [(512, 1024)]
EPS = 1e-6


def swiglu(g, u, r):
    return g.silu() * u + r


def bias_gelu(x, b, r):
    return (x + b).gelu() + r


def norm_weight(x, w, r):
    return x * ((x * x).mean(-1, keepdim=True) + EPS).rsqrt() * w + r


def swiglu_grad(g, u, dy):
    g.requires_grad = u.requires_grad = True
    y = g.silu() * u
    dg, du = fg.grad([y], [g, u], [dy])
    return [y, dg, du]


def torch_swiglu_grad(g, u, dy):
    g = g.detach().requires_grad_()
    u = u.detach().requires_grad_()
    y = torch.nn.functional.silu(g) * u
    dg, du = torch.autograd.grad(y, [g, u], dy)
    return y, dg, du


def cases(shape, rng):
    m, n = shape
    a = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    row = rng.standard_normal(n).astype(np.float32)
    t = [torch.from_numpy(x) for x in a]
    tr = torch.from_numpy(row)
    yield "swiglu_residual", fg_case(swiglu, a), \
        lambda: torch.nn.functional.silu(t[0]) * t[1] + t[2]
    yield "bias_gelu_residual", fg_case(bias_gelu, [a[0], row, a[2]]), \
        lambda: torch.nn.functional.gelu(t[0] + tr) + t[2]
    yield "norm_weight_residual", fg_case(norm_weight, [a[0], row, a[2]]), \
        lambda: t[0] * torch.rsqrt((t[0] * t[0]).mean(-1, keepdim=True) + EPS) * tr + t[2]
    yield "swiglu_fwd+bwd", fg_case(swiglu_grad, a), lambda: torch_swiglu_grad(*t)


def main(quick=False):
    rng = np.random.default_rng(0)
    shapes = QUICK_SHAPES if quick else SHAPES
    return run_cases("glue", ((name, shape, make, tr) for shape in shapes
                              for name, make, tr in cases(shape, rng)),
                     quick, min_time=0.5, repeat=5)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
