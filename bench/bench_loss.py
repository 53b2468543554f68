#!/usr/bin/env python3
"""FUSED_SOFTMAX_CROSS_ENTROPY on the NumPy backend: the fused kernel ("fuelgraph"), the same
graph lowered to primitives ("fuelgraph lowered": max, sub, exp, sum, log, gather and the masked
mean) and torch CPU eager ("torch eager": F.cross_entropy), float32 logits [rows, V] with about
5% of the rows ignored (ignore_index -100), reduction "mean"; forward, and forward+backward
(loss and dlogits; ours runs the fused softmax for the backward).

    python bench/bench_loss.py [--quick]

Writes bench/results/loss_<date>.json and prints one line per case with ratios to "fuelgraph".
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

SHAPES = [(2048, 8192), (8192, 2048)]


def cases(shape, rng):
    rows, v = shape
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    t = rng.integers(0, v, rows).astype(np.int64)
    t[rng.random(rows) < 0.05] = -100
    tx, tt = torch.from_numpy(x), torch.from_numpy(t)
    txg = tx.clone().requires_grad_(True)

    def t_fwd_bwd():
        loss = TF.cross_entropy(txg, tt)
        (dx,) = torch.autograd.grad(loss, txg)
        return loss, dx

    def fwd_bwd(xt, tt_):
        loss = F.fused_softmax_cross_entropy(xt, tt_)
        return [loss] + fg.grad([loss], [xt])

    yield "fused_softmax_cross_entropy", fg_case(F.fused_softmax_cross_entropy, [x, t]), \
        lambda: TF.cross_entropy(tx, tt)
    yield "fused_softmax_cross_entropy+backward", fg_case(fwd_bwd, [x, t]), t_fwd_bwd


def main(quick=False):
    rng = np.random.default_rng(0)
    return run_cases("loss", ((name, shape, make, tr) for shape in SHAPES
                              for name, make, tr in cases(shape, rng)),
                     quick, min_time=0.5, repeat=5)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
