#!/usr/bin/env python3
"""Where a Llama decode token's time goes on the GPU (issue 17's decode target).

    python bench/profile_cuda_decode.py --out DIR [--layers 16] [--batches 1,32] [--steps 10]
        [--variants nomerge,nofuse,plain]

The model is the bench's Llama ~1B config (hidden 2048, 32/8 heads, FFN 8192, vocabulary 32000,
bf16, random weights made on the GPU; --layers to shrink it). Per batch size it prints:
- decode tokens/s of `generate` (128-token prompt + 128 new, greedy), as bench_cuda_models
  measures it, and ms per token of the decode loop alone (prefill excluded), synchronized;
- the host time per token of the decode loop, split into the CUDA graph launches
  (`CUDAGraph.replay`) and everything else (Python, argument copies), timed with
  perf_counter while the loop queues work without waiting;
- a torch.profiler (CUDA activity) trace of --steps decode tokens: GPU kernel time per token,
  the GPU's busy span per token, kernels per token, the top kernels by time with their counts;
  and the same for one eager run of the step's plan (no graph) when the graph trace shows no
  kernels (some CUPTI versions do not report kernels inside graphs).
--model mamba2 profiles the Mamba-2 decode step instead (the bench's config; --layers to
shrink it). Writes DIR/profile_decode.json (DIR/profile_decode_mamba2.json) and a chrome trace
of batch 1."""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


DEVICE = ["cuda"]
VOCAB = [32000]


def sync():
    import torch
    if DEVICE[0] == "cuda":
        torch.cuda.synchronize()


def build(layers: int, name: str = "llama"):
    import fuelgraph as fg
    if name == "mamba2":
        from fuelgraph.models.mamba2 import Mamba2Config, Mamba2ForCausalLM
        if DEVICE[0] == "cpu":
            cfg = Mamba2Config(vocab_size=VOCAB[0], hidden_size=64, num_hidden_layers=layers,
                               state_size=16, expand=2, head_dim=16, num_heads=8, n_groups=1,
                               chunk_size=16)
            return Mamba2ForCausalLM(cfg).eval()
        cfg = Mamba2Config(vocab_size=32000, hidden_size=2048, num_hidden_layers=layers,
                           state_size=128, expand=2, head_dim=64, num_heads=64, n_groups=1,
                           chunk_size=256, tie_word_embeddings=True)
        return Mamba2ForCausalLM(cfg, dtype=fg.bfloat16, device="cuda").eval()
    from fuelgraph.models.llama import LlamaConfig, LlamaForCausalLM
    if DEVICE[0] == "cpu":                      # --smoke: the script's logic on a tiny model
        cfg = LlamaConfig(vocab_size=VOCAB[0], hidden_size=64, intermediate_size=128,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
        return LlamaForCausalLM(cfg).eval()
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=4096, rope_theta=500000.0)
    return LlamaForCausalLM(cfg, dtype=fg.bfloat16, device="cuda").eval()


class ReplayClock:
    """Host seconds spent in CUDAGraph.replay (the launch; it blocks when the GPU's queue is
    full, so a large share here means the GPU is the bottleneck)."""

    def __init__(self):
        import torch
        self.cls, self.orig, self.s, self.n = torch.cuda.CUDAGraph, torch.cuda.CUDAGraph.replay, 0.0, 0
        clock = self

        def replay(g):
            t0 = time.perf_counter()
            clock.orig(g)
            clock.s += time.perf_counter() - t0
            clock.n += 1
        try:
            self.cls.replay = replay
        except (TypeError, AttributeError):       # not patchable here: no replay split
            self.orig = None

    def close(self):
        if self.orig is not None:
            self.cls.replay = self.orig


def decode_loop(model, ids, new):
    """Prefill (synced), then the greedy decode loop as generate runs it -> (host seconds of
    queueing the loop, wall seconds until its tokens are computed, replay seconds, replays)."""
    state, out = model._prefill(ids, new, True)
    sync()
    clock = ReplayClock()
    try:
        t0 = time.perf_counter()
        steps = model._queue_greedy(state, out, new, None)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
    finally:
        clock.close()
        model._release(state)
    del steps
    return t1 - t0, t2 - t0, clock.s, clock.n


def check_tokens(model, ids, new) -> bool:
    """The queued decode loop gives the tokens of one traced-step call per token."""
    fast = model.generate(ids, max_new_tokens=new)
    state, out = model._prefill(ids, new, True)
    try:
        toks = [out]
        for _ in range(new - 1):
            toks.append(model._decode_step(state, toks[-1]))
        slow = np.concatenate([ids] + [t.numpy().reshape(-1, 1) for t in toks], 1)
    finally:
        model._release(state)
    ok = bool((fast == slow).all())
    if not ok:
        print(f"[profile] MISMATCH: queued decode differs from per-step calls "
              f"({float((fast == slow).mean()):.3f} equal)", flush=True)
    return ok


def kernel_table(prof, steps):
    """CUDA kernels (and memcpy/memset) of a profile -> summary dict per token."""
    import torch
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by = collections.defaultdict(lambda: [0.0, 0])
    spans = []
    for e in evs:
        us = e.time_range.elapsed_us()
        by[e.name][0] += us
        by[e.name][1] += 1
        spans.append((e.time_range.start, e.time_range.end))
    total = sum(v[0] for v in by.values())
    busy, end = 0.0, None
    for s, t in sorted(spans):                   # union of the kernel intervals
        if end is None or s > end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    top = sorted(by.items(), key=lambda kv: -kv[1][0])[:25]
    return {"kernels_per_token": round(len(evs) / steps, 1),
            "kernel_ms_per_token": round(total / steps / 1e3, 4),
            "busy_ms_per_token": round(busy / steps / 1e3, 4),
            "span_ms_per_token": round((max(t for _, t in spans) - min(s for s, _ in spans))
                                       / steps / 1e3, 4) if spans else 0.0,
            "top": [{"name": n[:110], "ms_per_token": round(v[0] / steps / 1e3, 4),
                     "per_token": round(v[1] / steps, 2), "us_each": round(v[0] / v[1], 2)}
                    for n, v in top]}


def profile_steps(model, ids, steps, trace_path=None, eager=True):
    """torch.profiler around `steps` decode tokens (graph replays); with `eager`, also one
    run of the step's plan without its graph (the kernels one by one)."""
    from torch.profiler import ProfilerActivity, profile
    state, out = model._prefill(ids, steps + 1, True)
    dec = getattr(state, "dec", None)
    sync()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            toks = model._queue_greedy(state, out, steps + 1, None)
            sync()
        del toks
    finally:
        model._release(state)
    if trace_path:
        prof.export_chrome_trace(str(trace_path))
    res = {"graph": kernel_table(prof, steps)}
    if eager:                       # one run of the plan without the graph, kernel by kernel
        from fuelgraph.runtime.executor import realize_raw
        step = dec.step if dec is not None else model.decoder(ids.shape[0]).step   # Mamba-2
        e = step._last

        def eager_plan(bufs):
            """The step's plan run once without the graph (on copies of the buffers it
            writes in place), profiled: its kernel table."""
            bufs = [e.plan.backend.copy(b) if k in set(e.inplace_of.values()) else b
                    for k, b in enumerate(bufs)]
            sync()
            with profile(activities=[ProfilerActivity.CUDA if DEVICE[0] == "cuda" else
                                     ProfilerActivity.CPU]) as prof2:
                e.plan.run(bufs)
                sync()
            return kernel_table(prof2, 1)

        rep = step.replayer()
        bufs = [b if b is not None else None for b in rep.bufs]
        state, out = model._prefill(ids, 2, True)
        if dec is None:                 # Mamba-2: the step's one argument is the tokens
            try:
                bufs = list(rep.bufs)
                for k in rep.arg_at[0]:
                    bufs[k] = realize_raw([out])[0]
                res["eager_plan"] = eager_plan(bufs)
            finally:
                model._release(state)
            return res
        try:
            slots, table, lens = dec.cache.extend_steps(state.seqs, 1)
            slots, lens = slots[0], lens[0]
            from fuelgraph.runtime.executor import realize_raw
            if DEVICE[0] == "cuda":         # valid by construction: no check syncs in the trace
                from fuelgraph.backends.cuda.kernels.paged import assume_valid
                from fuelgraph.backends.cuda.kernels.paged_cache import assume_valid_slots
                c = dec.cache
                n = c.context_lens(state.seqs)
                assume_valid(lens, table, 1, c.num_blocks, c.block_size, int(n.max()),
                             int(n.sum()))
                assume_valid_slots(slots, c.num_blocks * c.block_size)
            for ks, b in zip(rep.arg_at, [realize_raw([out])[0], slots, table, lens]):
                for k in ks:
                    bufs[k] = b
            res["eager_plan"] = eager_plan(bufs)
        finally:
            model._release(state)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama", choices=("llama", "mamba2"),
                    help="mamba2: hidden 2048, state 128, 64 heads of 64 (the bench's Mamba-2)")
    ap.add_argument("--layers", type=int, default=None, help="default 16 (llama), 48 (mamba2)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="decode tokens profiled")
    ap.add_argument("--variants", default="",
                    help="after the first batch size, that batch again with: nomerge (q/k/v and "
                    "gate/up as separate products, models.llama.MERGE_PROJECTIONS off), nofuse "
                    "(residual add and norm apart, FUSE_ADD_NORM off), plain (both off)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the script")
    ap.add_argument("--quick", action="store_true", help="one timed run each, no eager-plan "
                    "profile (a short verification run)")
    ap.add_argument("--budget", type=float, default=55.0,
                    help="seconds after which no further batch size is started")
    args = ap.parse_args(argv)
    import torch
    if args.smoke:
        DEVICE[0], VOCAB[0] = "cpu", 96
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layers = args.layers or (16 if args.model == "llama" else 48)
    model = build(layers, args.model)
    print(f"[profile] {args.model} built ({layers} layers) in {time.perf_counter() - t_start:.1f} s",
          flush=True)
    report = {"model": args.model, "layers": layers, "batches": {},
              "device": torch.cuda.get_device_name() if DEVICE[0] == "cuda" else "cpu"}
    import fuelgraph.models.llama as llama_mod
    runs = [(int(x), "") for x in args.batches.split(",")]
    if args.model == "llama":
        runs[1:1] = [(runs[0][0], v) for v in args.variants.split(",") if v]
    for b, variant in runs:
        llama_mod.MERGE_PROJECTIONS = variant not in ("nomerge", "plain")
        llama_mod.FUSE_ADD_NORM = variant not in ("nofuse", "plain")
        merged = not variant
        name = f"B{b}" + (f" {variant}" if variant else "")
        if time.perf_counter() - t_start > args.budget:
            print(f"[profile] {name} skipped (time budget)")
            continue
        ids = np.random.default_rng(b).integers(0, VOCAB[0], (b, args.prompt))
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=args.new)          # traces, compiles, captures
        sync()
        warm_s = time.perf_counter() - t0
        reps = 1 if args.quick else 3
        gen = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new)
            gen.append(time.perf_counter() - t0)
        gen_s = statistics.median(gen)
        same = check_tokens(model, ids, min(args.new, 32))
        loops = [decode_loop(model, ids, args.new) for _ in range(reps)]
        host, wall, rep_s, reps = (statistics.median(x) for x in zip(*loops))
        n = args.new - 1                                      # decode tokens (after prefill)
        r = {"generate_ms": round(gen_s * 1e3, 2),
             "tokens_per_s": round(b * args.new / gen_s, 1),
             "first_generate_s": round(warm_s, 2),
             "decode_ms_per_token": round(wall / n * 1e3, 4),
             "host_ms_per_token": round(host / n * 1e3, 4),
             "host_replay_ms_per_token": round(rep_s / n * 1e3, 4),
             "host_other_ms_per_token": round((host - rep_s) / n * 1e3, 4),
             "replays_per_token": round(reps / n, 2), "same_tokens_as_per_step_calls": same}
        print(f"[profile] {name}: generate {r['generate_ms']:.1f} ms = {r['tokens_per_s']:,.0f} "
              f"tok/s (first call {warm_s:.1f} s); decode loop {r['decode_ms_per_token']:.3f} "
              f"ms/token wall, host {r['host_ms_per_token']:.3f} ms/token (graph replay "
              f"{r['host_replay_ms_per_token']:.3f}, other {r['host_other_ms_per_token']:.3f}); "
              f"same tokens as per-step calls: {same}",
              flush=True)
        try:
            prof = profile_steps(model, ids, args.steps,
                                 out / f"decode_trace_{args.model}_b{b}.json"
                                 if b == 1 and merged else None,
                                 eager=merged and not args.quick)
        except Exception as e:                     # the timings above still count
            prof = {"error": f"{type(e).__name__}: {e}"}
            print(f"[profile] {name} profiler failed: {prof['error']}")
        r["profile"] = prof
        for kind, k in prof.items() if isinstance(prof, dict) else ():
            if not isinstance(k, dict):
                continue
            print(f"[profile] {name} {kind}: {k['kernels_per_token']} kernels/token, kernel time "
                  f"{k['kernel_ms_per_token']:.3f} ms/token, GPU busy {k['busy_ms_per_token']:.3f}"
                  f", span {k['span_ms_per_token']:.3f} ms/token")
            for t in k["top"][:15]:
                print(f"    {t['ms_per_token']:8.4f} ms {t['per_token']:6.1f}x "
                      f"{t['us_each']:8.2f} us  {t['name']}")
        report["batches"][name] = r
        suffix = "" if args.model == "llama" else "_" + args.model
        (out / f"profile_decode{suffix}.json").write_text(json.dumps(report, indent=1))
        model.release_decoders()
    print(f"[profile] done in {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
