#!/usr/bin/env python3
"""Optimizer updates on the NumPy backend, float32: one AdamW / SGD-momentum step over a
parameter of N elements, as the fused op with its buffers handed over ("fuelgraph": written in
place, as fuelgraph.optim runs it), the same graph lowered to primitives ("fuelgraph lowered"),
and torch CPU eager's optimizer step on one parameter ("torch eager", foreach=False: the
single-tensor path whose arithmetic the op follows). Values are checked against torch first.

    python bench/bench_optim.py [--quick]

Writes bench/results/optim_<date>.json and prints one line per case with ratios."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fuelgraph as fg  # noqa: E402
from common import print_table, record, timeit, write_results  # noqa: E402
from fuelgraph.ir.tensor import bound_data  # noqa: E402
from fuelgraph.registry.optim import adamw_step, sgd_step  # noqa: E402
from fuelgraph.runtime.executor import compile_plan  # noqa: E402

SIZES = [1 << 20, 1 << 23]


def _plan(outs, donate, lower_all):
    plan, ins = compile_plan([o.value for o in outs], lower_all, donate=donate)
    bufs = [np.array(bound_data(n)) for n in ins]        # writable: handed over
    return (lambda: plan.run(bufs)), bufs, ins


def adamw_case(n, rng):
    p, g, m = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    v = np.abs(rng.standard_normal(n)).astype(np.float32) * 0.01
    ts = [fg.tensor(a) for a in (p, g, m, v)]
    sc = [fg.tensor(np.float32(x)) for x in (1 - 1e-3 * 0.01, 1e-3 / 0.1, 0.0316)]
    outs = adamw_step(*ts, *sc)
    tp = torch.nn.Parameter(torch.tensor(p))
    tp.grad = torch.tensor(g)
    opt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.01, foreach=False)
    opt.step()
    makes = {lo: _plan(outs, [ts[0].node, ts[2].node, ts[3].node], lo)[0] for lo in (False, True)}
    return "adamw_step", makes, opt.step


def sgd_case(n, rng):
    p, g, b = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    ts = [fg.tensor(a) for a in (p, g)]
    lr, first = fg.tensor(np.float32(0.01)), fg.tensor(np.float32(0.0))
    bt = fg.tensor(b)
    outs = sgd_step(ts[0], ts[1], lr, bt, first, momentum=0.9)
    tp = torch.nn.Parameter(torch.tensor(p))
    tp.grad = torch.tensor(g)
    opt = torch.optim.SGD([tp], lr=0.01, momentum=0.9, foreach=False)
    opt.step()
    makes = {lo: _plan(list(outs), [ts[0].node, bt.node], lo)[0] for lo in (False, True)}
    return "sgd_step", makes, opt.step


def check(n):
    """One step of each op from the same state as torch agrees to float32 rounding."""
    rng = np.random.default_rng(1)
    p, g, m = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    tp = torch.nn.Parameter(torch.tensor(p))
    tp.grad = torch.tensor(g)
    opt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.01, foreach=False)
    opt.step()
    outs = adamw_step(fg.tensor(p), fg.tensor(g), fg.zeros(n), fg.zeros(n),
                      *[fg.tensor(np.float32(x)) for x in (1 - 1e-3 * 0.01, 1e-3 / 0.1,
                                                           (1 - 0.999) ** 0.5)])
    np.testing.assert_allclose(outs[0].numpy(), tp.detach().numpy(), rtol=1e-6, atol=1e-7)


def main(quick=False):
    import torch as _t
    check(1000)
    kw = dict(min_time=0.05, repeat=3) if quick else dict(min_time=0.5, repeat=5)
    rng = np.random.default_rng(0)
    records = []
    for n in SIZES[:1] if quick else SIZES:
        for name, makes, tstep in (adamw_case(n, rng), sgd_case(n, rng)):
            for impl, fn in (("fuelgraph", makes[False]), ("fuelgraph lowered", makes[True]),
                             ("torch eager", tstep)):
                records.append(record(name, impl, (n,), "float32", timeit(fn, **kw),
                                      torch_threads=_t.get_num_threads()))
    path = write_results("optim", records)
    print_table(records)
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
