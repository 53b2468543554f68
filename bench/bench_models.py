#!/usr/bin/env python3
"""Real models on the CPU (NumPy backend, float32): fuelgraph.models' Llama and Mamba-2 loaded
from the same random transformers checkpoint, against transformers on torch CPU eager.

    python bench/bench_models.py [--quick] [--threads N] [--profile] [--decode-only] [--out DIR]

Per model: the training step (forward + backward + AdamW; fuelgraph as one traced step) in
ms and tokens/s, and greedy decode tokens/s (prompt, then one token per step; batch 1 and 4).
fuelgraph and transformers runs are interleaved (one of each per round, the order
alternating) and every ratio is the median of the rounds' ratios, each taken under the same
machine load. --decode-only skips the training step.
Targets (issue 17): training step <= 1.2x torch eager, decode tokens/s >= torch eager. Where a
target is missed, or with --profile, the traced step's plan is run once more with every kernel
timed and the ops taking the most time are printed (where the time goes).

Small config (default): Llama hidden 512, 4 layers, 8/4 heads, FFN 1024, vocabulary 2048,
batch 4 x 256 tokens; Mamba-2 hidden 512, 4 layers, 16 heads of 64, state 64, 1 group.
--quick: 2 layers, hidden 128, 64 tokens, few runs (proves the script works on a shared
machine). Writes bench/results/models_<date>.json (or DIR/models_<date>.json with --out DIR:
trial runs leave the recorded results alone)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def hf_models(quick: bool, tmp: str):
    """Random transformers Llama and Mamba-2 saved to `tmp`: {name: (directory, model)}."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM
    torch.manual_seed(0)
    h = 128 if quick else 512
    layers = 2 if quick else 4
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=512 if quick else 2048, hidden_size=h, intermediate_size=2 * h,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=1024, attn_implementation="eager"))
    mamba = Mamba2ForCausalLM(Mamba2Config(
        vocab_size=512 if quick else 2048, hidden_size=h, num_hidden_layers=layers,
        state_size=32 if quick else 64, expand=2, head_dim=64 if not quick else 32,
        num_heads=2 * h // (64 if not quick else 32), n_groups=1,
        chunk_size=64, tie_word_embeddings=True))
    out = {}
    for name, m in (("llama", llama), ("mamba2", mamba)):
        d = os.path.join(tmp, name)
        m.save_pretrained(d)
        out[name] = (d, m)
    return out


def profile_plan(step, args, top=12):
    """Run the traced step's plan once with every kernel timed: [(op, ms, calls)], slowest
    first."""
    entry = next(iter(step.cache.values()))[0]
    plan = entry.plan
    totals, calls = defaultdict(float), defaultdict(int)
    saved = [st.fn for st in plan.steps]

    def timed(fn, name):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] += (time.perf_counter() - t0) * 1e3
                calls[name] += 1
        return run
    for st in plan.steps:
        st.fn = timed(st.fn, st.name or type(st.op).__name__)
    try:
        step(*args).realize()
    finally:
        for st, fn in zip(plan.steps, saved):
            st.fn = fn
    return sorted(((k, v, calls[k]) for k, v in totals.items()), key=lambda r: -r[1])[:top]


def bench_training(name, path, hf, batch, seq, runs, fg, M, optim, torch):
    import numpy as np
    ids_np = np.random.default_rng(1).integers(0, hf.config.vocab_size, (batch, seq))
    model = M.from_pretrained(path).train()
    opt = optim.AdamW(model.parameters(), lr=1e-4)

    def fg_step(x):
        loss = model(x, labels=x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    step = fg.jit(fg_step)
    ids = fg.tensor(ids_np)
    tm = type(hf)(hf.config)
    tm.load_state_dict(hf.state_dict())
    tm.train()
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-4)
    tids = torch.tensor(ids_np)

    def torch_step():
        loss = tm(tids, labels=tids).loss
        loss.backward()
        topt.step()
        topt.zero_grad()
        return loss
    a, b = step(ids).item(), torch_step().item()
    assert abs(a - b) <= 1e-3 * abs(b), (name, a, b)
    t_fg, t_torch, ratio = _interleaved(lambda: step(ids).realize(), torch_step, runs)
    return t_fg, t_torch, ratio, step, (ids,)


def _interleaved(fn_a, fn_b, runs, warmup=2):
    """(median ms of a, median ms of b, median of the per-round ratios a/b): one call of each
    per round, the order alternating, so every ratio is taken under the same machine load."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    ta, tb = [], []
    for r in range(runs):
        for fn, ts in ((fn_a, ta), (fn_b, tb))[::1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return (statistics.median(ta), statistics.median(tb),
            statistics.median(a / b for a, b in zip(ta, tb)))


def bench_decode(name, path, hf, batch, prompt, new, runs, M, torch):
    """Greedy generate of `new` tokens after a `prompt`-token prompt, fuelgraph and
    transformers interleaved (one of each per round, after a warm-up of each): (fuelgraph
    tokens/s, transformers tokens/s, median of the per-round speed ratios, fraction of equal
    tokens). The ratio of each round is taken under the same machine load."""
    import numpy as np
    ids = np.random.default_rng(2).integers(0, hf.config.vocab_size, (batch, prompt))
    model = M.from_pretrained(path)
    hf.eval()
    tids = torch.tensor(ids)
    kw = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)

    def fg_gen():
        return model.generate(ids, max_new_tokens=new)

    def hf_gen():
        with torch.no_grad():
            return hf.generate(tids, **kw)
    ours, ref = fg_gen(), hf_gen().numpy()
    same = float((ours == ref).mean())
    t_fg, t_hf, ratios = [], [], []
    for _ in range(runs):
        for fn, ts in ((fg_gen, t_fg), (hf_gen, t_hf)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        ratios.append(t_hf[-1] / t_fg[-1])
    toks = batch * new
    return (toks / statistics.median(t_fg), toks / statistics.median(t_hf),
            statistics.median(ratios), same)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--profile", action="store_true", help="always print the per-op profile")
    ap.add_argument("--models", default="llama,mamba2")
    ap.add_argument("--decode-only", action="store_true", help="skip the training step")
    ap.add_argument("--decode-runs", type=int, default=None,
                    help="interleaved rounds per decode case (default: runs // 2, >= 3)")
    ap.add_argument("--out", default=None,
                    help="folder for the JSON records (default bench/results)")
    args = ap.parse_args(argv)
    os.environ["FUELGRAPH_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "src"))
    import torch
    from threadpoolctl import threadpool_limits

    import fuelgraph as fg
    import fuelgraph.models as M
    import fuelgraph.optim as optim
    from common import record, write_results

    # kept alive: a discarded threadpool_limits object restores the previous limit when it is
    # collected, so `--threads 1` would leave BLAS on every core
    blas_limit = threadpool_limits(args.threads, user_api="blas")  # noqa: F841
    torch.set_num_threads(args.threads)
    batch, seq = (2, 64) if args.quick else (4, 256)
    runs = 3 if args.quick else 10
    prompt, new = (16, 8) if args.quick else (64, 32)
    recs, table = [], []
    with tempfile.TemporaryDirectory() as tmp:
        models = hf_models(args.quick, tmp)
        for name in args.models.split(","):
            path, hf = models[name]
            if not args.decode_only:
                t_fg, t_torch, ratio, step, step_args = bench_training(
                    name, path, hf, batch, seq, runs, fg, M, optim, torch)
                toks = batch * seq
                for impl, ms in (("fuelgraph", t_fg), ("torch eager", t_torch)):
                    recs.append(record(f"{name}_train_step", impl, (batch, seq), "float32", ms,
                                       tokens_per_s=round(toks / ms * 1e3, 1),
                                       median_time_ratio=round(ratio, 3)))
                table.append((f"{name} train step", f"{t_fg:.1f} ms", f"{t_torch:.1f} ms",
                              f"{ratio:.2f}x time", "<= 1.2x", "ok" if ratio <= 1.2 else "MISSED"))
                if ratio > 1.2 or args.profile:
                    print(f"\n{name} training step: where the time goes (one replay, per op):")
                    for op, ms, n in profile_plan(step, step_args):
                        print(f"  {op:<44} {ms:8.2f} ms  ({n} calls)")
            for b in (1, 4):
                fg_tps, hf_tps, speed, same = bench_decode(
                    name, path, hf, b, prompt, new, args.decode_runs or max(3, runs // 2), M,
                    torch)
                for impl, tps in (("fuelgraph", fg_tps), ("torch eager", hf_tps)):
                    recs.append(record(f"{name}_decode", impl, (b, prompt, new), "float32",
                                       b * new / tps * 1e3, tokens_per_s=round(tps, 1),
                                       same_tokens=same, median_speed_ratio=round(speed, 3)))
                table.append((f"{name} decode B={b}", f"{fg_tps:.0f} tok/s", f"{hf_tps:.0f} tok/s",
                              f"{speed:.2f}x speed", ">= 1x", "ok" if speed >= 1 else "MISSED"))
    path = write_results("models", recs, args.out)
    head = ("case", "fuelgraph", "transformers eager", "ratio", "target", "")
    rows = [head] + table
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print()
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"\nthreads {args.threads}; records in {path}")


if __name__ == "__main__":
    main()
