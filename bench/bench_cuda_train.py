#!/usr/bin/env python3
"""GPU training step, bfloat16: the Llama-style model of bench/llama_step.py (hidden 512, 4
layers, 8/4 heads, FFN 1024, batch 4, sequence 256, vocabulary 2048), forward + backward +
AdamW, in one process:

* fuelgraph traced step (`fg.jit`), replaying its plan kernel by kernel;
* fuelgraph traced step replayed as one CUDA graph (`fg.jit(..., cuda_graph=True)`);
* torch eager (same weights and math, explicit attention scores), and torch eager with SDPA
  (flash attention through torch), both with torch.optim.AdamW (foreach, the CUDA default).

Timed with CUDA events around each step (median of --runs after warm-up). A larger
configuration (--big: hidden 2048, 8 layers, 16/8 heads, FFN 5632, batch 8, sequence 1024,
vocabulary 32000) shows where kernel time, not launches, dominates.

    python bench/bench_cuda_train.py --out DIR [--runs 30] [--big]

Prints a short table last and writes DIR/cuda_train_<date>.json (records: op, impl, device,
shape, dtype, ms, spread_ms, date)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--big", action="store_true")
    args = ap.parse_args(argv)
    import torch

    import fuelgraph as fg
    import fuelgraph.optim as optim
    from common import record
    from llama_step import Config, batch, fg_model, torch_model

    cfg = Config(vocab=32000, hidden=2048, layers=8, heads=16, kv_heads=8, ffn=5632, batch=8,
                 seq=1024) if args.big else Config()
    dev = "cuda"
    name = torch.cuda.get_device_name()
    idx_np, tgt_np = batch(cfg)

    def cuda_time(fn, runs, warmup=5):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts), max(ts) - min(ts)

    results = {}
    losses = {}
    for graph in (False, True):
        m, _ = fg_model(cfg, device=dev, dtype=fg.bfloat16)
        opt = optim.AdamW(m.parameters(), lr=1e-4)

        def step_fn(idx, tgt, m=m, opt=opt):
            loss = m(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        step = fg.jit(step_fn, cuda_graph=graph)
        idx, tgt = fg.tensor(idx_np, device=dev), fg.tensor(tgt_np, device=dev)
        losses[graph] = float(step(idx, tgt).item())
        impl = "fuelgraph (traced, CUDA graph)" if graph else "fuelgraph (traced)"
        results[impl] = cuda_time(lambda: step(idx, tgt), args.runs)
        if graph:
            e = next(iter(step.cache.values()))[0]
            losses["cuda_graph_captured"] = e.graphed not in (None, False)
        m = opt = step = None          # free the device memory before the next model

    for sdpa in (False, True):
        tm = torch_model(cfg, device=dev, dtype=torch.bfloat16, sdpa=sdpa)
        topt = torch.optim.AdamW(tm.parameters(), lr=1e-4)
        ti, tt = torch.tensor(idx_np, device=dev), torch.tensor(tgt_np, device=dev)

        def tstep(tm=tm, topt=topt):
            loss = tm(ti, tt)
            loss.backward()
            topt.step()
            topt.zero_grad(set_to_none=True)
            return loss
        losses[f"torch{sdpa}"] = float(tstep().item())
        results["torch eager (sdpa)" if sdpa else "torch eager"] = cuda_time(tstep, args.runs)
        del tm, topt

    shape = (cfg.batch, cfg.seq, cfg.hidden)
    records = [record("llama_train_step", impl, shape, "bfloat16", ms, device=name,
                      spread_ms=round(sp, 4), runs=args.runs, config=cfg.__dict__)
               for impl, (ms, sp) in results.items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import datetime
    path = out / f"cuda_train{'_big' if args.big else ''}_{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps({"machine": name, "command": " ".join(sys.argv),
                                "first_losses": losses, "records": records}, indent=1))
    base = results["torch eager"][0]
    print(f"first-step losses: {losses}")
    print(f"{'impl':34s} {'median ms':>10s} {'spread':>8s} {'vs torch eager':>15s}")
    for impl, (ms, sp) in results.items():
        print(f"{impl:34s} {ms:10.3f} {sp:8.3f} {base / ms:14.2f}x")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
