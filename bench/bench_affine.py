#!/usr/bin/env python3
"""INPLACE_AFFINE (mul * x + add) on the NumPy backend: the fused kernel ("fuelgraph"), the same
graph lowered to primitives ("fuelgraph lowered": a mul and an add, each allocating) and torch CPU
eager ("torch eager"), float32. Two cases:

* "inplace_affine(input)": x is a graph input, so the plan must copy it first (user data is never
  written); torch eager is `torch.mul(x, mul).add_(add)` (one allocation, as functional code must).
* "inplace_affine(-x)": the input is an intermediate (-x) with no other reader, so the kernel
  overwrites it in place (Plan.stats["inplace_reused"]); the lowered graph allocates three
  buffers (neg, mul, add); torch eager is `torch.neg(x).mul_(mul).add_(add)`.

    python bench/bench_affine.py [--quick]

Writes bench/results/affine_<date>.json and prints one line per case with ratios to "fuelgraph".
"""
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
MUL, ADD = 1.5, -0.25


def cases(shape, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    tx = torch.from_numpy(x)
    yield "inplace_affine(input)", fg_case(lambda t: F.inplace_affine(t, MUL, ADD), [x]), \
        lambda: torch.mul(tx, MUL).add_(ADD)
    yield "inplace_affine(-x)", fg_case(lambda t: F.inplace_affine(-t, MUL, ADD), [x]), \
        lambda: torch.neg(tx).mul_(MUL).add_(ADD)


def main(quick=False):
    rng = np.random.default_rng(0)
    return run_cases("affine", ((name, shape, make, tr) for shape in SHAPES
                                for name, make, tr in cases(shape, rng)),
                     quick, min_time=0.5, repeat=5)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
