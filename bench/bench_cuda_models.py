#!/usr/bin/env python3
"""Real models on one GPU (bf16): fuelgraph.models against transformers eager and
torch.compile of the same transformers model, same config and random weights.

    python bench/bench_cuda_models.py --out DIR [--quick] [--models llama,mamba2]

Cases (issue 17):
- Llama ~1B (hidden 2048, 16 layers, 32/8 heads, FFN 8192, vocabulary 32000), sequence 2048:
  training step tokens/s (forward + backward + AdamW; fuelgraph as one traced step replayed as
  a CUDA graph) and its peak memory; prefill tokens/s (one forward of 2048 tokens); decode
  tokens/s at batch 1 and 32 (128-token prompt, 128 new tokens, greedy; fuelgraph's decode
  step traced once and replayed as a CUDA graph per token: the record says whether it was
  captured and how often it was traced).
- Mamba-2 of similar size (hidden 2048, 48 layers, head dim 64, state 128, vocabulary 32000):
  the same cases against transformers' Mamba2, which runs the mamba_ssm Triton kernels when
  mamba_ssm (and causal_conv1d) are installed ("transformers+mamba_ssm") and its torch path
  otherwise (labelled so).
Targets: training and prefill tokens/s >= torch.compile's; decode >= 1.5x transformers eager
and >= torch.compile's; training peak memory <= torch eager's.

Each case runs in a try block (a failure is printed and recorded, the rest go on); timings are
CUDA-synchronized medians. Prints a table last and writes DIR/models_cuda.json.
--quick: 2 layers, sequence 256, prompt 32 + 16 new tokens (checks the script end to end)."""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def _sync_ms(fn, runs, warmup=2):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _peak(fn):
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def hf_model(name, quick):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM
    torch.manual_seed(0)
    layers = 2 if quick else None
    if name == "llama":
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=layers or 16, num_attention_heads=32,
                          num_key_value_heads=8, max_position_embeddings=4096,
                          rope_theta=500000.0, attn_implementation="sdpa")
        m = LlamaForCausalLM(cfg)
    else:
        cfg = Mamba2Config(vocab_size=32000, hidden_size=2048, num_hidden_layers=layers or 48,
                           state_size=128, expand=2, head_dim=64, num_heads=64, n_groups=1,
                           chunk_size=256, tie_word_embeddings=True)
        m = Mamba2ForCausalLM(cfg)
    return m.to(device="cuda", dtype=torch.bfloat16)


def fg_model(name, hf):
    import fuelgraph as fg
    import fuelgraph.models as M
    cfg_cls, cls = M.ARCHITECTURES["LlamaForCausalLM" if name == "llama" else "Mamba2ForCausalLM"]
    cfg = cfg_cls.from_hf(hf.config.to_dict())
    model = cls(cfg, dtype=fg.bfloat16, device="cuda")
    model.load_hf_state({k: fg.from_torch(v.detach()) for k, v in hf.state_dict().items()})
    return model


def use_mamba_triton(src):
    """Make transformers' Mamba-2 run mamba_ssm's Triton kernels (the chunked scan and the
    one-token state update) from mamba_ssm's Python sources, before transformers imports its
    Mamba-2 module. causal_conv1d is a CUDA extension that cannot be carried here, so the
    fused conv + scan training path stays off (it needs it) and the conv runs in torch."""
    from bench_cuda_ssm import import_mamba_ssd
    scan, why = import_mamba_ssd(src, [])
    if scan is None:
        return f"transformers (torch path; mamba_ssm: {why})"
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    pkg = sys.modules["mamba_ssm"]
    pkg.mamba_chunk_scan_combined, pkg.selective_state_update = scan, selective_state_update
    pkg.mamba_split_conv1d_scan_combined = lambda *a, **k: None    # "not fused": torch conv
    return "transformers + mamba_ssm Triton"


MAMBA_ANCHOR = ["transformers (torch path; no --mamba-src)"]
SAVE_TO: list = []          # the records file, rewritten after every case


def run(name, quick, recs, table, cases=("train", "prefill", "decode")):
    import torch

    import fuelgraph as fg
    import fuelgraph.optim as optim
    seq, batch = (256, 1) if quick else (2048, 1)
    prompt, new = (32, 16) if quick else (128, 128)
    runs = 3 if quick else 10
    hf = hf_model(name, quick)
    anchor = "transformers eager" if name == "llama" else MAMBA_ANCHOR[0]
    model = fg_model(name, hf)
    ids = torch.randint(0, hf.config.vocab_size, (batch, seq), device="cuda")
    fids = fg.from_torch(ids)

    def add(case, impl, ms, toks, **extra):
        tps = toks / ms * 1e3
        shape = (int(case[8:]), prompt + new) if case.startswith("decode_b") else (batch, seq)
        recs.append({"op": f"{name}_{case}", "impl": impl, "device": torch.cuda.get_device_name(),
                     "shape": list(shape), "dtype": "bfloat16", "ms": round(ms, 4),
                     "tokens_per_s": round(tps, 1), "date": datetime.date.today().isoformat(),
                     **extra})
        table.append((f"{name} {case}", impl, f"{ms:.2f} ms", f"{tps:,.0f} tok/s",
                      ", ".join(f"{k} {v}" for k, v in extra.items())))
        print("[bench]", *table[-1], flush=True)     # a run cut short still shows what it got
        if SAVE_TO:                                  # ... and keeps the records so far
            SAVE_TO[0].write_text(json.dumps({"records": recs}, indent=1))

    def guarded(label, fn):
        try:
            fn()
        except Exception as e:                      # one failing case must not stop the rest
            traceback.print_exc()
            table.append((f"{name} {label}", "FAILED", type(e).__name__, str(e)[:60], ""))

    # ---- training step ----------------------------------------------------------------------
    def train():
        model.train()
        opt = optim.AdamW(model.parameters(), lr=1e-5)

        def step(x):
            loss = model(x, labels=x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        jstep = fg.jit(step, cuda_graph=True)
        ms = _sync_ms(lambda: jstep(fids).realize(), runs)
        add("train_step", "fuelgraph", ms, batch * seq,
            peak_gib=round(_peak(lambda: jstep(fids).realize()), 2))
        hf.train()
        topt = torch.optim.AdamW(hf.parameters(), lr=1e-5)

        def tstep(m):
            loss = m(ids, labels=ids).loss
            loss.backward()
            topt.step()
            topt.zero_grad(set_to_none=True)
        ms = _sync_ms(lambda: tstep(hf), runs)
        add("train_step", anchor, ms, batch * seq, peak_gib=round(_peak(lambda: tstep(hf)), 2))
        if name == "llama":
            comp = torch.compile(hf)
            ms = _sync_ms(lambda: tstep(comp), runs, warmup=3)
            add("train_step", "torch.compile", ms, batch * seq,
                peak_gib=round(_peak(lambda: tstep(comp)), 2))
        hf.eval()
        model.eval()
    if "train" in cases:
        guarded("train_step", train)

    # ---- prefill ----------------------------------------------------------------------------
    def prefill():
        # as a server runs it: the forward traced once and replayed (a CUDA graph), logits kept
        fwd = fg.jit(lambda x: model(x), cuda_graph=True)
        ms = _sync_ms(lambda: fwd(fids).realize(), runs)
        add("prefill", "fuelgraph", ms, batch * seq, traces=fwd.stats["traces"])
        ms = _sync_ms(lambda: model(fids).realize(), max(2, runs // 3))
        add("prefill", "fuelgraph (graph rebuilt per call)", ms, batch * seq)
        with torch.no_grad():
            ms = _sync_ms(lambda: hf(ids), runs)
            add("prefill", anchor, ms, batch * seq)
            if name == "llama":
                comp = torch.compile(hf)
                ms = _sync_ms(lambda: comp(ids), runs, warmup=3)
                add("prefill", "torch.compile", ms, batch * seq)
    if "prefill" in cases:
        guarded("prefill", prefill)

    # ---- decode -----------------------------------------------------------------------------
    def decode(b):
        p = torch.randint(0, hf.config.vocab_size, (b, prompt), device="cuda")
        pn = p.cpu().numpy()
        kw = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        ours = model.generate(pn, max_new_tokens=new)
        ms = _sync_ms(lambda: model.generate(pn, max_new_tokens=new), max(2, runs // 3), 1)
        with torch.no_grad():
            ref = hf.generate(p, **kw).cpu().numpy()
        dec = model.decoder(b, prompt + new) if name == "llama" else model.decoder(b)
        entries = [e for es in dec.step.cache.values() for e in es]

        def steps(n, sync):
            """prefill + n decode steps; sync=False feeds the same tokens back without reading
            the step's output, so the host never waits for the GPU (the step's own cost)."""
            state, out = model._prefill(pn, n, True)
            tok = out.numpy()
            try:
                for _ in range(n - 1):
                    out = model._decode_step(state, tok)
                    if sync:
                        tok = out.numpy()
                out.numpy()
            finally:
                model._release(state)
        reps = max(2, runs // 3)
        one = _sync_ms(lambda: steps(1, True), reps, 1)
        per_tok = {k: round((_sync_ms(lambda: steps(new, k == "synced"), reps, 1) - one)
                            / (new - 1), 4) for k in ("synced", "unsynced")}
        add(f"decode_b{b}", "fuelgraph", ms, b * new, same_tokens=float((ours == ref).mean()),
            decode_traces=dec.step.stats["traces"],
            cuda_graph=all(e.graphed not in (None, False) for e in entries),
            ms_per_token_synced=per_tok["synced"], ms_per_token_unsynced=per_tok["unsynced"])
        with torch.no_grad():
            ms = _sync_ms(lambda: hf.generate(p, **kw), max(2, runs // 3), 1)
            add(f"decode_b{b}", anchor, ms, b * new)
            if name == "llama":
                # transformers compiles the decode forward itself (torch.compile,
                # "reduce-overhead": CUDA graphs) when generate runs on a static cache
                hf.generation_config.cache_implementation = "static"
                try:
                    ms = _sync_ms(lambda: hf.generate(p, **kw), max(2, runs // 3), 2)
                    add(f"decode_b{b}", "torch.compile (static cache)", ms, b * new,
                        compiled=hasattr(hf, "_compiled_call"))
                finally:
                    hf.generation_config.cache_implementation = None
                    hf.__dict__.pop("_compiled_call", None)     # the next batch size compiles anew
    for b in (1, 32) if "decode" in cases else ():
        guarded(f"decode_b{b}", lambda b=b: decode(b))
    del model, hf
    torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="llama,mamba2")
    ap.add_argument("--cases", default="train,prefill,decode")
    ap.add_argument("--mamba-src", default=None, help="mamba_ssm's sources: the Mamba-2 anchor "
                    "runs its Triton kernels")
    args = ap.parse_args(argv)
    if args.mamba_src and "mamba2" in args.models:
        MAMBA_ANCHOR[0] = use_mamba_triton(args.mamba_src)
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_models: needs a CUDA GPU")
    recs, table = [], []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    SAVE_TO.append(out / "models_cuda.json")
    for name in args.models.split(","):
        run(name, args.quick, recs, table, tuple(args.cases.split(",")))
    head = ("case", "impl", "time", "throughput", "")
    rows = [head] + table
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
