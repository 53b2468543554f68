#!/usr/bin/env python3
"""Two GPUs (2 x H200), bfloat16, one process per GPU over NCCL (NVLink multicast off):

* all_reduce of 1 GiB through a fuelgraph plan (the buffer handed over: reduced in place)
  against `torch.distributed.all_reduce` on a tensor of the same size   target >= 0.95x;
* data parallel: the training step of fuelgraph.models' Llama (forward, next-token loss,
  backward, AdamW; traced with fg.jit) on one GPU vs fuelgraph.distributed.DataParallel over
  two, the same per-GPU batch; tokens/s ratio                            target >= 1.9x;
* tensor parallel: the same step with the model split over the two GPUs (`llama_plan()`:
  column/row-parallel projections, head-parallel attention, gathered logits) vs one GPU, the
  same batch; step-time ratio                                            target >= 1.6x.

Run with torchrun (rank, world size and device come from its environment):

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 bench/bench_cuda_distributed.py --out DIR \
        [--runs 20] [--small] [--batch 1] [--seq 2048] [--skip allreduce,dp,tp]

Default configuration: the ~1B Llama of the models benchmark (hidden 2048, 16 layers, 32/8
heads, FFN 8192, vocabulary 32000), random weights, batch 1 x sequence 2048 per GPU (--batch,
--seq change it); --small: hidden 512, 4 layers, 8/4 heads, FFN 1536, vocabulary 8192.
--smoke runs a tiny configuration and a 1 MiB all_reduce on whatever is there (two CPU
processes over gloo: `torchrun --nproc_per_node 2 bench/bench_cuda_distributed.py --smoke`) to
check the script itself; its numbers mean nothing. Every timing is the median over --runs calls
of CUDA-event time (both processes make the same calls). Prints a short table last and writes
DIR/cuda_distributed_<date>.json (records: op, impl, device, shape, dtype, ms, date, GB/s or
tokens/s)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # before NCCL creates its communicator
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--skip", default="", help="comma-separated: allreduce,dp,tp")
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as tdist

    import fuelgraph as fg
    import fuelgraph.distributed as dist
    import fuelgraph.functional as F
    import fuelgraph.optim as optim
    from common import record
    import numpy as np

    from fuelgraph.ir.tensor import bound_data
    from fuelgraph.runtime.executor import compile_plan
    from fuelgraph.models import LlamaConfig, LlamaForCausalLM, init_random

    g = dist.init()
    if g.size != 2:
        raise SystemExit("run with torchrun --nproc_per_node 2")
    dev = dist.device()
    cuda = dev.startswith("cuda")
    name = torch.cuda.get_device_name() if cuda else "cpu (smoke)"
    skip = set(filter(None, args.skip.split(",")))
    if args.smoke:
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        args.runs, args.batch, args.seq = min(args.runs, 3), 2, 16
    elif args.small:
        cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                          max_position_embeddings=4096)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          max_position_embeddings=4096, rope_theta=500000.0)
    shape = (args.batch, args.seq, cfg.hidden_size)
    conf = {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.kv_heads,
            "ffn": cfg.intermediate_size, "vocab": cfg.vocab_size}

    def build():
        return init_random(LlamaForCausalLM(cfg, dtype=fg.bfloat16, device=dev), seed=0)

    def cuda_time(fn, runs, warmup=3):
        """Median ms per call: CUDA events on a GPU, the host clock in a smoke run."""
        import time
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize()
        tdist.barrier()
        ts = []
        for _ in range(runs):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    records, table, notes = [], [], {}
    # ---- 1. all_reduce of 1 GiB -------------------------------------------------------------
    if "allreduce" not in skip:
        n = (1 << (20 if args.smoke else 30)) // 2
        t_fg = torch.ones(n, dtype=torch.bfloat16, device=dev)
        x = fg.from_torch(t_fg)
        plan, ins = compile_plan([F.all_reduce(x, "avg").value], donate=[x.node])
        buf = bound_data(ins[0]) if cuda else np.array(bound_data(ins[0]))   # CPU: writable
        out = plan.run([buf])[0]
        notes["allreduce_in_place"] = plan.stats.get("inplace_copies", 0) == 0 and \
            float(out[0]) == 1.0
        ms_fg = cuda_time(lambda: plan.run([buf]), args.runs)
        t_ref = torch.ones(n, dtype=torch.bfloat16, device=dev)
        ms_t = cuda_time(lambda: tdist.all_reduce(t_ref, op=tdist.ReduceOp.AVG), args.runs)
        for impl, ms in (("fuelgraph", ms_fg), ("torch.distributed", ms_t)):
            records.append(record("all_reduce", impl, (n,), "bfloat16", ms, device=name,
                                  processes=2, GBps=round(2 * n / ms / 1e6, 1)))
        table.append((f"all_reduce {2 * n >> 20} MiB bf16, graph vs torch.distributed",
                      ms_t / ms_fg, 0.95))
        del t_fg, t_ref, x, plan, out, buf

    ids = fg.tensor(np.random.default_rng(1).integers(0, cfg.vocab_size, (args.batch, args.seq)),
                    device=dev)
    tokens = args.batch * args.seq

    def traced_step(model, opt):
        def step(i):
            loss = model(i, labels=i)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return fg.jit(step)

    # ---- one GPU (each process on its own GPU, independently) -------------------------------
    m = build()
    opt = optim.AdamW(m.parameters(), lr=1e-4)
    step = traced_step(m, opt)
    notes["loss_1gpu"] = float(step(ids).item())
    ms_1 = cuda_time(lambda: step(ids), args.runs)
    records.append(record("llama_train_step", "fuelgraph 1 GPU", shape, "bfloat16", ms_1,
                          device=name, tokens_per_s=round(tokens / ms_1 * 1e3), config=conf))
    del m, opt, step
    if cuda:
        torch.cuda.empty_cache()

    # ---- 2. data parallel -------------------------------------------------------------------
    if "dp" not in skip:
        m = build()
        dp = dist.DataParallel(m)
        opt = optim.AdamW(m.parameters(), lr=1e-4)
        step = dp.train_step(lambda i: dp(i, labels=i), opt)
        notes["loss_dp"] = float(step(ids).item())
        ms_dp = cuda_time(lambda: step(ids), args.runs)
        tps = 2 * tokens / ms_dp * 1e3
        records.append(record("llama_train_step", "fuelgraph data parallel 2 GPUs",
                              (2 * args.batch,) + shape[1:], "bfloat16", ms_dp, device=name,
                              tokens_per_s=round(tps), config=conf))
        table.append(("data parallel 2 GPUs vs 1, tokens/s", tps / (tokens / ms_1 * 1e3), 1.9))
        del m, dp, opt, step
        if cuda:
            torch.cuda.empty_cache()

    # ---- 3. tensor parallel -----------------------------------------------------------------
    if "tp" not in skip:
        m = dist.parallelize(build(), dist.llama_plan(cfg.tie_word_embeddings))
        opt = optim.AdamW(m.parameters(), lr=1e-4)
        step = traced_step(m, opt)
        notes["loss_tp"] = float(step(ids).item())
        ms_tp = cuda_time(lambda: step(ids), args.runs)
        records.append(record("llama_train_step", "fuelgraph tensor parallel 2 GPUs", shape,
                              "bfloat16", ms_tp, device=name,
                              tokens_per_s=round(tokens / ms_tp * 1e3), config=conf))
        table.append(("tensor parallel 2, training step vs 1 GPU", ms_1 / ms_tp, 1.6))
        del m, opt, step

    if g.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"cuda_distributed_{datetime.date.today().isoformat()}.json"
        path.write_text(json.dumps({"machine": name, "command": " ".join(sys.argv),
                                    "notes": notes, "records": records}, indent=1))
        print(f"notes: {notes}")
        for r in records:
            print(f"{r['op']:18s} {r['impl']:34s} {r['ms']:10.3f} ms")
        print(f"{'case':52s} {'ratio':>7s} {'target':>7s}")
        for case, ratio, target in table:
            print(f"{case:52s} {ratio:6.2f}x {target:6.2f}x {'ok' if ratio >= target else 'MISS'}")
        print(f"wrote {path}")
    dist.destroy()


if __name__ == "__main__":
    main()
