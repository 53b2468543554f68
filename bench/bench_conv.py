#!/usr/bin/env python3
"""CONV2D / CONV_TRANSPOSE2D / CAUSAL_CONV1D on the NumPy backend: the fused kernels
("fuelgraph"), the same graphs lowered to primitives ("fuelgraph lowered") and torch CPU eager
("torch eager"), float32: a ResNet-style 3x3 conv (N8 C64 56x56), a strided 3x3, a depthwise
3x3, a 4x4 stride-2 transpose conv, causal conv1d + silu (B4 C1024 L2048 W4), and forward +
backward for the 3x3 conv and the causal conv (the gradients go through conv_transpose2d /
conv2d_backward_weight / causal_conv1d_backward).

    python bench/bench_conv.py [--quick]

Writes bench/results/conv_<date>.json and prints one line per case with ratios to "fuelgraph".
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from common import (check, fg_case, print_table, record, timeit,  # noqa: E402
                    write_results)

# name: (x, weight, stride, padding, groups)
CONV2D = {
    "conv2d 3x3": ((8, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1),
    "conv2d 3x3 s2": ((8, 64, 56, 56), (128, 64, 3, 3), 2, 1, 1),
    "conv2d depthwise 3x3": ((8, 128, 56, 56), (128, 1, 3, 3), 1, 1, 128),
}
CONVT = ((8, 64, 28, 28), (64, 32, 4, 4), 2, 1)          # x, weight, stride, padding -> 56x56
CAUSAL = (4, 1024, 2048, 4)                              # B, C, L, W


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def conv2d_cases(rng):
    for name, (xs, ws, s, p, g) in CONV2D.items():
        x, w, b = _rand(rng, *xs), _rand(rng, *ws) * 0.1, _rand(rng, ws[0])
        tx, tw, tb = (torch.from_numpy(a) for a in (x, w, b))
        yield (name, xs,
               fg_case(lambda a, c, d, s=s, p=p, g=g: F.conv2d(a, c, d, s, p, 1, g), [x, w, b]),
               lambda tx=tx, tw=tw, tb=tb, s=s, p=p, g=g: TF.conv2d(tx, tw, tb, s, p, 1, g))
    xs, ws, s, p, g = CONV2D["conv2d 3x3"]
    x, w, b = _rand(rng, *xs), _rand(rng, *ws) * 0.1, _rand(rng, ws[0])
    gy = _rand(rng, *xs[:1], ws[0], *xs[2:])
    txg, twg, tbg = (torch.from_numpy(a).requires_grad_(True) for a in (x, w, b))
    tgy = torch.from_numpy(gy)

    def fwd_bwd(a, c, d, e):
        y = F.conv2d(a, c, d, s, p)
        return [y] + fg.grad(y, [a, c, d], [e])

    def torch_fwd_bwd():
        y = TF.conv2d(txg, twg, tbg, s, p)
        return (y,) + torch.autograd.grad(y, (txg, twg, tbg), tgy)

    yield "conv2d 3x3+backward", xs, fg_case(fwd_bwd, [x, w, b, gy]), torch_fwd_bwd


def conv_transpose2d_cases(rng):
    xs, ws, s, p = CONVT
    x, w, b = _rand(rng, *xs), _rand(rng, *ws) * 0.1, _rand(rng, ws[1])
    tx, tw, tb = (torch.from_numpy(a) for a in (x, w, b))
    yield ("conv_transpose2d 4x4 s2", xs,
           fg_case(lambda a, c, d: F.conv_transpose2d(a, c, d, s, p), [x, w, b]),
           lambda: TF.conv_transpose2d(tx, tw, tb, s, p))


def causal_cases(rng):
    bsz, c, length, k = CAUSAL
    x, w, b, g = _rand(rng, bsz, c, length), _rand(rng, c, k), _rand(rng, c), \
        _rand(rng, bsz, c, length)
    tx, tw, tb, tg = (torch.from_numpy(a) for a in (x, w, b, g))

    def torch_causal(a, c_, d):
        return TF.silu(TF.conv1d(TF.pad(a, (k - 1, 0)), c_[:, None, :], d, groups=c))

    yield ("causal_conv1d+silu", (bsz, c, length, k),
           fg_case(lambda a, c_, d: F.causal_conv1d(a, c_, d, True), [x, w, b]),
           lambda: torch_causal(tx, tw, tb))
    txg, twg, tbg = (t.clone().requires_grad_(True) for t in (tx, tw, tb))

    def fwd_bwd(a, c_, d, e):
        y = F.causal_conv1d(a, c_, d, True)
        return [y] + fg.grad(y, [a, c_, d], [e])

    def torch_fwd_bwd():
        y = torch_causal(txg, twg, tbg)
        return (y,) + torch.autograd.grad(y, (txg, twg, tbg), tg)

    yield ("causal_conv1d+silu+backward", (bsz, c, length, k), fg_case(fwd_bwd, [x, w, b, g]),
           torch_fwd_bwd)


def main(quick=False):
    """As common.run_cases, with an absolute tolerance for the weight gradients (float32 sums
    of 25088 products of magnitude ~100 differ from torch's by ~1e-3)."""
    rng = np.random.default_rng(0)
    cases = [*conv2d_cases(rng), *conv_transpose2d_cases(rng), *causal_cases(rng)]
    kw = dict(min_time=0.05, repeat=3) if quick else {}
    records = []
    for name, shape, make, torch_run in cases:
        check(make, torch_run, rtol=2e-4, atol=5e-3 if "backward" in name else 2e-4)
        for impl, fn in (("fuelgraph", make(False)), ("fuelgraph lowered", make(True)),
                         ("torch eager", torch_run)):
            records.append(record(name, impl, shape, "float32", timeit(fn, **kw),
                                  torch_threads=torch.get_num_threads()))
    print_table(records)
    print(f"wrote {write_results('conv', records)}")
    return records


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
