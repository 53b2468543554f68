#!/usr/bin/env python3
"""SOFTMAX_LAST_DIM on the NumPy backend: fused kernel ("fuelgraph") vs the same graph lowered to
primitives ("fuelgraph lowered") vs torch CPU eager, forward and forward+backward (through the
fused backward helper), float32; plus the per-node host overhead of replaying a cached plan
(a chain of tiny elementwise nodes, vs calling the same NumPy ops directly).

    python bench/bench_softmax.py [--quick]
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
from common import fg_case, print_table, record, timeit, write_results  # noqa: E402

SHAPES = [(4096, 1024), (1024, 4096), (64, 128)]


def softmax_cases(shape, rng):
    a = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    recs = []
    fwd = fg_case(lambda x: F.softmax_last_dim(x), [a])
    xt, gt = torch.tensor(a), torch.tensor(g)
    for impl, fn in (("fuelgraph", fwd(False)), ("fuelgraph lowered", fwd(True)),
                     ("torch eager", lambda: torch.softmax(xt, -1))):
        recs.append(record("softmax_last_dim", impl, shape, "float32", timeit(fn)))

    def fb(x, gr):
        x.requires_grad = True
        y = F.softmax_last_dim(x)
        return [y] + fg.grad([y], [x], [gr])
    both = fg_case(fb, [a, g])
    xr = torch.tensor(a, requires_grad=True)

    def torch_fb():
        y = torch.softmax(xr, -1)
        return torch.autograd.grad(y, [xr], [gt])
    for impl, fn in (("fuelgraph", both(False)), ("fuelgraph lowered", both(True)),
                     ("torch eager", torch_fb)):
        recs.append(record("softmax_fwd+bwd", impl, shape, "float32", timeit(fn)))
    return recs


def overhead(n_nodes=3000):
    a = np.ones(16, np.float32)
    chain = fg_case(lambda x: _chain(x, n_nodes // 3), [a])(False)

    def direct():
        z = a
        for _ in range(n_nodes // 3):
            z = np.log(np.exp(z * np.float32(1.0001)))
        return z
    us = 1e3 / n_nodes
    return [record("plan_replay_per_node_us", "fuelgraph", (n_nodes,), "float32", timeit(chain) * us),
            record("plan_replay_per_node_us", "numpy direct", (n_nodes,), "float32", timeit(direct) * us)]


def _chain(x, k):
    for _ in range(k):
        x = (x * 1.0001).exp().log()
    return x


def main(quick=False):
    rng = np.random.default_rng(0)
    torch.set_num_threads(2)
    recs = []
    for shape in SHAPES[:1] if quick else SHAPES:
        recs += softmax_cases(shape, rng)
    recs += overhead(600 if quick else 3000)
    print_table(recs)
    path = write_results("softmax", recs)
    print(f"wrote {path}")
    return recs


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
