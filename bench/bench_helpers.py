#!/usr/bin/env python3
"""The primitives' backward helpers on the NumPy backend, float32: REDUCE_MAX_TO_BACKWARD (the
gradient of a keepdim max, torch `amax` semantics) and POWI_BACKWARD (the gradient of x ** n),
each as the fused kernel ("fuelgraph"), lowered to its recipe ("fuelgraph lowered") and torch CPU
eager autograd of the forward op ("torch eager").

    python bench/bench_helpers.py [--quick]

Writes bench/results/helpers_<date>.json and prints one line per case with ratios."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fuelgraph.functional as F  # noqa: E402
from common import fg_case, run_cases  # noqa: E402

SHAPES = [(4096, 1024), (1024, 4096)]


def _amax_grad(tx, tg):
    def run():
        x = tx.detach().requires_grad_()
        x.amax(-1, keepdim=True).backward(tg)
        return x.grad
    return run


def _pow_grad(tx, tg, n):
    def run():
        x = tx.detach().requires_grad_()
        (x ** n).backward(tg)
        return x.grad
    return run


def cases(shape, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    g_row = rng.standard_normal(shape[:-1] + (1,)).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    tx = torch.from_numpy(x)
    yield ("reduce_max_to_backward_bwd", fg_case(F.reduce_max_to_backward, [x, g_row]),
           _amax_grad(tx, torch.from_numpy(g_row)))
    yield ("powi_backward_bwd", fg_case(lambda a, b: F.powi_backward(a, b, 3), [x, g]),
           _pow_grad(tx, torch.from_numpy(g), 3))


def main(quick=False):
    rng = np.random.default_rng(0)
    return run_cases("helpers", ((name, shape, make, tr) for shape in SHAPES
                                 for name, make, tr in cases(shape, rng)),
                     quick, min_time=0.5, repeat=5)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
