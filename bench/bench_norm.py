#!/usr/bin/env python3
"""RMS_NORM_LAST_DIM / LAYER_NORM_LAST_DIM on the NumPy backend: the fused kernel ("fuelgraph"),
the same graph lowered to primitives ("fuelgraph lowered") and torch CPU eager ("torch eager"),
forward and forward+backward (y and dx = the helper op 9 / 8 reached through fg.grad), float32.

    python bench/bench_norm.py [--quick]

Writes bench/results/norm_<date>.json and prints one line per case with ratios to "fuelgraph".
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from common import fg_case, run_cases  # noqa: E402

SHAPES = [(4096, 1024), (1024, 4096)]
EPS = {"rms_norm_last_dim": 1e-6, "layer_norm_last_dim": 1e-5}


def fg_fn(op):
    return F.rms_norm_last_dim if op == "rms_norm_last_dim" else F.layer_norm_last_dim


def torch_fn(op, n):
    eps = EPS[op]
    if op == "rms_norm_last_dim":
        return lambda t: TF.rms_norm(t, (n,), eps=eps)
    return lambda t: TF.layer_norm(t, (n,), eps=eps)


def cases(op, shape, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    f, tf_, eps = fg_fn(op), torch_fn(op, shape[-1]), EPS[op]

    def fwd(xt):
        return f(xt, eps)

    def fwd_bwd(xt, gt):
        y = f(xt, eps)
        (dx,) = fg.grad(y, [xt], [gt])
        return [y, dx]

    tx, tg = torch.from_numpy(x), torch.from_numpy(g)
    txg = tx.clone().requires_grad_(True)

    def torch_fwd_bwd():
        y = tf_(txg)
        (dx,) = torch.autograd.grad(y, txg, tg)
        return y, dx

    yield op, fg_case(fwd, [x]), lambda: tf_(tx)
    yield op + "+backward", fg_case(fwd_bwd, [x, g]), torch_fwd_bwd


def main(quick=False):
    rng = np.random.default_rng(0)
    return run_cases("norm", ((name, shape, make, tr) for op in EPS for shape in SHAPES
                              for name, make, tr in cases(op, shape, rng)), quick)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
