"""Graph-level numbers on the GPU: host overhead per node of a cached plan (fuelgraph replay vs
torch eager issuing the same ops), and the cost of going through a fuelgraph plan for one
fused op vs calling its kernel directly. Run on the device: python3 bench/bench_cuda_graph.py"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from common import print_table, record, write_results  # noqa: E402
from fuelgraph.ir.tensor import bound_data  # noqa: E402
from fuelgraph.runtime.executor import compile_plan  # noqa: E402


def _sync_time(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def chain_overhead(n_ops=600):
    t = torch.randn(1024, device="cuda")
    x = fg.from_torch(t)
    y = x
    for i in range(n_ops // 3):
        y = (y * 1.0001).exp().log()
    plan, _, ins = compile_plan([y.value])
    bufs = [bound_data(n) for n in ins]
    ms_fg = _sync_time(lambda: plan.run(bufs))

    def eager():
        z = t
        for _ in range(n_ops // 3):
            z = torch.log(torch.exp(z * 1.0001))
        return z
    ms_t = _sync_time(eager)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eager()
    ms_graph = _sync_time(g.replay)
    steps = len(plan.steps)
    return [record("chain_per_node_us", "fuelgraph", (steps,), "float32", ms_fg / steps * 1e3, "cuda"),
            record("chain_per_node_us", "torch eager", (steps,), "float32", ms_t / steps * 1e3, "cuda"),
            record("chain_per_node_us", "torch cuda graph", (steps,), "float32", ms_graph / steps * 1e3, "cuda")]


def plan_vs_kernel():
    from fuelgraph.backends.cuda import kernels as K
    t = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16)
    x = fg.from_torch(t)
    y = F.softmax_last_dim(x)
    plan, _, ins = compile_plan([y.value])
    bufs = [bound_data(n) for n in ins]
    return [record("softmax_via_plan", "fuelgraph", t.shape, "bfloat16", _sync_time(lambda: plan.run(bufs)), "cuda"),
            record("softmax_via_plan", "kernel direct", t.shape, "bfloat16", _sync_time(lambda: K.softmax_last_dim(t)), "cuda")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also copy the JSON here")
    args = ap.parse_args()
    recs = chain_overhead() + plan_vs_kernel()
    print_table(recs)
    path = write_results("cuda_graph", recs)
    if args.out:
        shutil.copy(path, args.out)


if __name__ == "__main__":
    main()
