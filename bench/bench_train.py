#!/usr/bin/env python3
"""CPU training step, float32: the Llama-style model of bench/llama_step.py (hidden 512, 4
layers, 8 query / 4 key-value heads, FFN 1024, batch 4, sequence 256, vocabulary 2048),
forward + backward + AdamW, as one traced fuelgraph step (`fg.jit`) against torch CPU eager
(same weights, same math: explicit attention scores; torch's SDPA is timed too).

    python bench/bench_train.py [--quick] [--threads N] [--compete] [--runs N] [--profile]

Reported: the median of --runs steps (after warm-up) and the spread (max - min) of each, the
ratio to torch (the steps run interleaved, one of each implementation per round: the median of
the rounds' ratios, each taken under the same machine load), and the traced step's overhead: the time a replay spends outside its plan's
run (gathering buffers, handing them over, rebinding parameters, guards), measured inside the
timed replays themselves.

Threads are chosen on purpose, not left to each library: `--threads N` (default: the cores
this process may run on) sets fuelgraph's kernel pool (FUELGRAPH_NUM_THREADS: elementwise and
row kernels, and large GEMMs split into batches or row blocks, each a single-threaded BLAS
call), NumPy's BLAS pool (threadpoolctl; fuelgraph holds it to one thread inside its split
GEMMs) and torch's intra-op pool (torch.set_num_threads) to the same N, and
OMP_WAIT_POLICY=PASSIVE keeps idle OpenMP threads from spinning. With `--compete` a second
process keeps one core busy (a single-threaded matmul loop) while both sides are timed: static
work splits and spinning BLAS threads are what makes a step collapse under contention;
fuelgraph's pool hands out work dynamically, so it slows by the lost core and no more.

--profile: after the timing, the traced step's plan runs --runs more times with every kernel
timed, and a table gives per op kind (kernel name) the median wall ms per step, the process
CPU ms (all threads) and their ratio (how many cores the kernel kept busy), and the calls.

Writes bench/results/train_<date>.json."""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path


def _compete(stop):
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    import numpy as np
    a = np.random.default_rng(0).standard_normal((256, 256))
    while not stop.is_set():
        a = np.tanh(a @ a * 1e-3)


def _interleaved(fns: dict, runs, anchor, warmup=3):
    """Time the callables in rounds (one call of each per round, the order reversed every other
    round): ({name: (median ms, spread ms)}, {name: median of the per-round ratios to
    `anchor`}). Each ratio is taken under the machine load of its own round."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    ts = {k: [] for k in fns}
    for r in range(runs):
        for k, fn in list(fns.items())[::1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            fn()
            ts[k].append((time.perf_counter() - t0) * 1e3)
    res = {k: (statistics.median(v), max(v) - min(v)) for k, v in ts.items()}
    ratios = {k: statistics.median(a / b for a, b in zip(v, ts[anchor])) for k, v in ts.items()}
    return res, ratios


def profile_plan(step, args, runs):
    """Run the traced step's plan `runs` times with every kernel timed: rows (kernel, wall ms,
    cpu ms, calls) per step (medians over the runs), slowest first, and the median step ms."""
    from collections import defaultdict
    plan = next(iter(step.cache.values()))[0].plan
    wall, cpu, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    per_run, steps = defaultdict(list), []
    saved = [st.fn for st in plan.steps]

    def timed(fn, name):
        def run(*a, **kw):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                wall[name] += (time.perf_counter() - t0) * 1e3
                cpu[name] += (time.process_time() - c0) * 1e3
        return run
    for st in plan.steps:
        calls[st.name] += 1
        st.fn = timed(st.fn, st.name)
    try:
        for _ in range(runs):
            wall.clear()
            cpu.clear()
            t0 = time.perf_counter()
            step(*args).realize()
            steps.append((time.perf_counter() - t0) * 1e3)
            for k in wall:
                per_run[k].append((wall[k], cpu[k]))
    finally:
        for st, fn in zip(plan.steps, saved):
            st.fn = fn
    rows = [(k, statistics.median(w for w, _ in v), statistics.median(c for _, c in v), calls[k])
            for k, v in per_run.items()]
    return sorted(rows, key=lambda r: -r[1]), statistics.median(steps)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small model, few runs (proves it works)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--compete", action="store_true", help="time with a competing process")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="per-op profile of the traced step")
    args = ap.parse_args(argv)
    n = args.threads
    os.environ["FUELGRAPH_NUM_THREADS"] = str(n)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import torch
    from threadpoolctl import threadpool_limits

    from common import record, write_results
    from llama_step import Config, batch, fg_model, torch_model

    # kept alive: a discarded threadpool_limits object restores the previous limit when it is
    # collected, so `--threads 1` would leave BLAS on every core
    blas_limit = threadpool_limits(n, user_api="blas")  # noqa: F841
    torch.set_num_threads(n)
    cfg = Config(layers=2, seq=64, vocab=512) if args.quick else Config()
    runs = args.runs or (3 if args.quick else 15)

    m, fg = fg_model(cfg)
    import fuelgraph.optim as optim
    opt = optim.AdamW(m.parameters(), lr=1e-4)

    def fg_step(idx, tgt):
        loss = m(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    step = fg.jit(fg_step)
    idx_np, tgt_np = batch(cfg)
    idx, tgt = fg.tensor(idx_np), fg.tensor(tgt_np)

    tm = torch_model(cfg)
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-4)
    tmi, tmt = torch.tensor(idx_np), torch.tensor(tgt_np)

    def torch_step(model=tm, o=topt):
        loss = model(tmi, tmt)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss
    ts = torch_model(cfg, sdpa=True)
    tso = torch.optim.AdamW(ts.parameters(), lr=1e-4)

    # same model, same first loss
    a, b = float(step(idx, tgt).item()), float(torch_step().item())
    assert abs(a - b) <= 1e-4 * abs(b), (a, b)

    # the replay's overhead is what it spends outside its plan's run: measured inside the very
    # replays that are timed (two separate timings would differ by the machine's noise)
    entry = next(iter(step.cache.values()))[0]
    inside = []
    plan_run = entry.plan.run

    def timed_run(bufs):
        t0 = time.perf_counter()
        try:
            return plan_run(bufs)
        finally:
            inside.append((time.perf_counter() - t0) * 1e3)
    entry.plan.run = timed_run

    stop = mp.Event()
    proc = None
    if args.compete:
        proc = mp.Process(target=_compete, args=(stop,), daemon=True)
        proc.start()
        time.sleep(0.5)
    try:
        outside = []

        def replay():
            t0 = time.perf_counter()
            n0 = len(inside)
            step(idx, tgt).realize()
            outside.append((time.perf_counter() - t0) * 1e3 - sum(inside[n0:]))
        results, ratios = _interleaved({"fuelgraph (traced step)": replay,
                                        "torch eager": torch_step,
                                        "torch eager (sdpa)": lambda: torch_step(ts, tso)},
                                       runs, anchor="torch eager")
    finally:
        if proc is not None:
            stop.set()
            proc.join(5)
    fgt, _ = results["fuelgraph (traced step)"]
    over = statistics.median(outside[-runs:])
    shape = (cfg.batch, cfg.seq, cfg.hidden)
    records = [record("llama_train_step", impl, shape, "float32", ms, threads=n,
                      compete=args.compete, spread_ms=round(sp, 3), runs=runs,
                      config=cfg.__dict__, median_ratio_to_torch=round(ratios[impl], 3),
                      **({"overhead_ms": round(over, 3)} if impl.startswith("fuelgraph") else {}))
               for impl, (ms, sp) in results.items()]
    path = write_results("train" + ("_quick" if args.quick else ""), records)
    for impl, (ms, sp) in results.items():
        print(f"{impl:26s} median {ms:9.2f} ms  spread {sp:8.2f} ms  "
              f"({ratios[impl]:5.2f}x torch: median of the rounds' ratios)")
    print(f"traced-step overhead (replay time outside its plan's kernels): "
          f"{over / fgt * 100:.1f}% of the step ({over:.2f} ms); threads {n}; "
          f"compete {args.compete}; config {cfg}")
    print(f"wrote {path}")
    if args.profile:
        entry.plan.run = plan_run
        rows, med = profile_plan(step, (idx, tgt), runs)
        print(f"per-op profile of the traced step (median of {runs} runs; step {med:.1f} ms, "
              f"kernels {sum(r[1] for r in rows):.1f} ms):")
        print(f"{'kernel':44s} {'wall ms':>9s} {'cpu ms':>9s} {'cores':>6s} {'calls':>6s}")
        for name, w, c, k in rows:
            print(f"{name:44s} {w:9.2f} {c:9.2f} {c / max(w, 1e-9):6.2f} {k:6d}")
    return records


if __name__ == "__main__":
    main()
