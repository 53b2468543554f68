#!/usr/bin/env python3
"""ROPE on the NumPy backend: the fused kernel ("fuelgraph"), the same graph lowered to
primitives ("fuelgraph lowered") and torch CPU eager ("torch eager", the HF / GPT-J formulas),
float32, both layouts, forward and forward+backward (dx through the DECOMPOSE backward).

    python bench/bench_rope.py [--quick]

Writes bench/results/rope_<date>.json and prints one line per case with ratios to "fuelgraph".
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

SHAPES = [(4, 8, 512, 64), (1, 32, 2048, 128)]


def torch_rope(x, cos, sin, interleaved):
    if interleaved:
        rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    else:
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


def tables(s, d, interleaved):
    inv = 10000.0 ** (-np.arange(0, d, 2) / d)
    ang = np.arange(s)[:, None] * inv[None, :]
    ang = np.repeat(ang, 2, axis=1) if interleaved else np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def cases(shape, interleaved, rng):
    s, d = shape[-2:]
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    c, sn = tables(s, d, interleaved)
    name = "rope" + ("[interleaved]" if interleaved else "")

    def fwd(xt, ct, st):
        return F.rope(xt, ct, st, interleaved=interleaved)

    def fwd_bwd(xt, ct, st, gt):
        y = F.rope(xt, ct, st, interleaved=interleaved)
        (dx,) = fg.grad(y, [xt], [gt])
        return [y, dx]

    tx, tc, ts, tg = (torch.from_numpy(a) for a in (x, c, sn, g))
    txg = tx.clone().requires_grad_(True)

    def torch_fwd_bwd():
        y = torch_rope(txg, tc, ts, interleaved)
        (dx,) = torch.autograd.grad(y, txg, tg)
        return y, dx

    yield name, fg_case(fwd, [x, c, sn]), lambda: torch_rope(tx, tc, ts, interleaved)
    yield name + "+backward", fg_case(fwd_bwd, [x, c, sn, g]), torch_fwd_bwd


def main(quick=False):
    rng = np.random.default_rng(0)
    return run_cases("rope", ((name, shape, make, tr) for shape in SHAPES
                              for interleaved in (False, True)
                              for name, make, tr in cases(shape, interleaved, rng)), quick)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
