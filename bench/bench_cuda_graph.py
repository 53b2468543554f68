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
    plan, ins = compile_plan([y.value])
    bufs = [bound_data(n) for n in ins]
    ms_fg = _sync_time(lambda: plan.run(bufs))
    from fuelgraph.runtime.executor import realize_raw
    ms_fg_graph = _sync_time(lambda: realize_raw([y], cuda_graph=True))

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
            record("chain_per_node_us", "fuelgraph cuda_graph", (steps,), "float32", ms_fg_graph / steps * 1e3, "cuda"),
            record("chain_per_node_us", "torch eager", (steps,), "float32", ms_t / steps * 1e3, "cuda"),
            record("chain_per_node_us", "torch cuda graph", (steps,), "float32", ms_graph / steps * 1e3, "cuda")]


def plan_vs_kernel():
    from fuelgraph.backends.cuda.kernels import softmax as K
    t = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16)
    x = fg.from_torch(t)
    y = F.softmax_last_dim(x)
    plan, ins = compile_plan([y.value])
    bufs = [bound_data(n) for n in ins]
    return [record("softmax_via_plan", "fuelgraph", t.shape, "bfloat16", _sync_time(lambda: plan.run(bufs)), "cuda"),
            record("softmax_via_plan", "kernel direct", t.shape, "bfloat16", _sync_time(lambda: K.softmax_last_dim(t)), "cuda")]


def linear_vs_addmm():
    """FUSED_LINEAR through a fuelgraph plan vs torch.addmm, bf16 8192x4096x4096."""
    m = k = n = 4096
    m = 8192
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = F.fused_linear(fg.from_torch(a), fg.from_torch(b), fg.from_torch(bias))
    plan, ins = compile_plan([y.value])
    bufs = [bound_data(nd) for nd in ins]
    flops = 2 * m * n * k
    ms_fg = _sync_time(lambda: plan.run(bufs))
    ms_t = _sync_time(lambda: torch.addmm(bias, a, b))
    return [record("fused_linear", impl, (m, k, n), "bfloat16", ms, "cuda", tflops=flops / ms / 1e9)
            for impl, ms in (("fuelgraph", ms_fg), ("torch.addmm", ms_t))]


def cross_entropy_memory():
    """Peak GPU memory of cross-entropy forward+backward: fuelgraph (fused op + its fused
    backward helper) vs torch eager F.cross_entropy, bf16 8192x128256."""
    r, v = 8192, 128256
    logits = torch.randn(r, v, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, v, (r,), device="cuda")
    x = fg.from_torch(logits)
    x.requires_grad = True
    loss = F.fused_softmax_cross_entropy(x, fg.from_torch(t))
    (gx,) = fg.grad(loss, [x])
    plan, ins = compile_plan([loss.value, gx.value])
    bufs = [bound_data(nd) for nd in ins]
    out = []
    for impl, fn in (("fuelgraph", lambda: plan.run(bufs)),
                     ("torch eager", lambda: torch.autograd.grad(
                         torch.nn.functional.cross_entropy(lt, t), [lt]))):
        lt = logits.detach().requires_grad_()
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = _sync_time(fn, reps=5)
        peak = torch.cuda.max_memory_allocated() - base
        out.append(record("cross_entropy_fwd_bwd", impl, (r, v), "bfloat16", ms, "cuda",
                          peak_extra_mib=round(peak / 2**20, 1),
                          logits_mib=round(logits.numel() * 2 / 2**20, 1)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also copy the JSON here")
    args = ap.parse_args()
    recs = chain_overhead() + plan_vs_kernel() + linear_vs_addmm() + cross_entropy_memory()
    print_table(recs)
    path = write_results("cuda_graph", recs)
    if args.out:
        shutil.copy(path, args.out)


if __name__ == "__main__":
    main()
