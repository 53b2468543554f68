#!/usr/bin/env python3
"""The loss family on the NumPy backend, float32, against torch CPU eager:

* fused_softmax_cross_entropy, logits [rows, V] with ~5% of the rows ignored (ignore_index
  -100), reduction "mean": forward, and forward+backward (loss and dlogits, which fuelgraph runs
  as one pass: fused_softmax_cross_entropy_fwd_bwd);
* fused_linear_cross_entropy, N 1024, H 512, V 32000 (+ bias), forward+backward (loss, dx,
  dweight, dbias): fuelgraph fused (one fwd+bwd node, token chunks, no [N, V] buffer),
  fuelgraph lowered (the recipe: logits materialized) and torch eager (F.linear +
  F.cross_entropy + autograd); also the peak extra memory of one call (resident set high-water
  mark above the inputs, less the outputs -- loss and gradients --, measured in a fresh process
  per implementation).

    python bench/bench_loss.py [--quick]

Writes bench/results/loss_<date>.json and prints one line per case with ratios to "fuelgraph".
"""
from __future__ import annotations

import os
import subprocess
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
from common import (check, fg_case, print_table, record, run_cases, timeit,  # noqa: E402
                    write_results)

SHAPES = [(2048, 8192), (8192, 2048)]
FLCE_SHAPE = (1024, 512, 32000)       # N, H, V


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
    yield "fused_softmax_cross_entropy_fwd+bwd", fg_case(fwd_bwd, [x, t]), t_fwd_bwd


# ---- fused linear + cross-entropy -------------------------------------------------------------

def flce_inputs(seed=0):
    n, h, v = FLCE_SHAPE
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = (rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float32)
    b = (rng.standard_normal(v) * 0.1).astype(np.float32)
    t = rng.integers(0, v, n).astype(np.int64)
    t[rng.random(n) < 0.05] = -100
    return x, w, b, t


def _flce_graph(x, w, t, b):
    loss = F.fused_linear_cross_entropy(x, w, t, b)
    return [loss] + fg.grad([loss], [x, w, b])


def flce_runners():
    """{impl: zero-argument callable running one forward+backward}."""
    x, w, b, t = flce_inputs()
    make = fg_case(_flce_graph, [x, w, t, b])
    tx, tw, tb, tt = (torch.from_numpy(a) for a in (x, w, b, t))

    def torch_run():
        xs = [a.detach().requires_grad_() for a in (tx, tw, tb)]
        loss = TF.cross_entropy(TF.linear(*xs), tt)
        return (loss,) + torch.autograd.grad(loss, xs)

    return make, torch_run


def _rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _peak_child(impl):
    """Run in a fresh process: peak extra resident memory (MiB) of one call of `impl`."""
    make, torch_run = flce_runners()
    fn = {"fuelgraph": lambda: make(False), "fuelgraph lowered": lambda: make(True),
          "torch eager": lambda: torch_run}[impl]()
    fn()                                   # plans built, allocator warmed, outputs kept alive
    try:                                   # reset the high-water mark to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = _rss_kib("VmRSS")
    out = fn()
    peak = _rss_kib("VmHWM")
    outs = sum(o.nbytes if hasattr(o, "nbytes") else o.numel() * o.element_size() for o in out)
    print(f"PEAK_MIB {(peak - base) / 1024 - outs / 2 ** 20:.1f}")


def peak_extra_mib(impl):
    res = subprocess.run([sys.executable, __file__, "--peak", impl], capture_output=True,
                         text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    for line in res.stdout.splitlines():
        if line.startswith("PEAK_MIB"):
            return float(line.split()[1])
    return None


def flce_records(quick):
    n, h, v = FLCE_SHAPE
    make, torch_run = flce_runners()
    check(make, torch_run, rtol=2e-4, atol=2e-5)
    kw = dict(min_time=0.05, repeat=2, warmup=1) if quick else dict(min_time=3.0, repeat=5)
    recs = []
    for impl, fn in (("fuelgraph", make(False)), ("fuelgraph lowered", make(True)),
                     ("torch eager", torch_run)):
        recs.append(record("fused_linear_cross_entropy_fwd+bwd", impl, (n, h, v), "float32",
                           timeit(fn, **kw), torch_threads=torch.get_num_threads(),
                           peak_extra_mib=peak_extra_mib(impl),
                           logits_mib=round(n * v * 4 / 2 ** 20, 1)))
    return recs


def main(quick=False):
    rng = np.random.default_rng(0)
    recs = run_cases("loss", ((name, shape, mk, tr) for shape in SHAPES
                              for name, mk, tr in cases(shape, rng)),
                     quick, min_time=0.5, repeat=5)
    flce = flce_records(quick)
    for r in flce:
        print(f"  {r['impl']:18s} peak extra {r['peak_extra_mib']} MiB "
              f"(logits would be {r['logits_mib']} MiB)")
    print_table(flce)
    path = write_results("loss", recs + flce)
    print(f"wrote {path}")
    return recs + flce


if __name__ == "__main__":
    if "--peak" in sys.argv:
        _peak_child(sys.argv[sys.argv.index("--peak") + 1])
    else:
        main(quick="--quick" in sys.argv)
