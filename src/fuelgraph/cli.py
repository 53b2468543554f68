"""The `fuelgraph` command: `registry` (the 25 ids and their status), `demo` (a small model
written in primitives, optimized and run), `explain` (the optimizer's report on the demo or on
a script's graph, as text, plan report or HTML page), `bench` (the benchmark suite)."""
from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import numpy as np

import fuelgraph as fg

from .backends import available_backends
from .backends.cuda import declared_fused_ids
from .benchrun import bench_main
from .models import (LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM,
                     from_pretrained, init_random)
from .nn import TinyBlock
from .opt.passes import has_kernel
from .registry.core import FusedOps, default_registry
from .runtime.executor import realize


def _registry_rows():
    reg = default_registry()
    cuda_ids = declared_fused_ids()
    rows = []
    for const, fid in sorted(FusedOps.well_known().items(), key=lambda kv: kv[1]):
        if reg.get(fid) is None:
            rows.append((int(fid), const.lower(), "-", "no", "-", "-", "-", "-", "-"))
    for e in reg:
        kind = "yes (run time)" if e.id.is_runtime() else "yes"
        rows.append((int(e.id), e.name, e.family, kind,
                     "yes" if has_kernel(e.id, "numpy") else "recipe",
                     "yes" if int(e.id) in cuda_ids else "recipe", "yes",
                     "yes" if e.has_pattern else "no", str(e.backward)))
    return sorted(rows, key=lambda r: r[0])


def cmd_registry(args) -> int:
    head = ("id", "name", "family", "implemented", "numpy", "cuda", "decomposes", "pattern",
            "backward")
    rows = [head] + [tuple(str(c) for c in r) for r in _registry_rows()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for k, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))
    known = [r for r in rows[1:] if int(r[0]) <= 25]
    impl = sum(1 for r in known if r[3] == "yes")
    extra = [r for r in rows[1:] if 25 < int(r[0]) < 0x8000]
    print(f"\n{impl} of the {len(known)} well-known ids implemented, {len(extra)} further "
          f"built-in op(s), {len(rows) - 1 - len(known) - len(extra)} run-time op(s); kernels: 'yes' = fused kernel, 'recipe' = runs its primitive "
          f"decomposition on that backend")
    for name, why in available_backends().items():
        print(f"backend {name}: " + ("available" if why is None else f"unavailable ({why})"))
    return 0


def _demo_graph(batch=4):
    model = TinyBlock(d=256, heads=4, hidden=512, vocab=2048, seq=128)
    x, t = model.example(batch)
    logits = model(x)
    loss = model.loss(logits, t)
    grads = fg.grad(loss, model.params())
    return model, [loss] + grads


def _time(fn, n=9):
    """(median ms, spread ms, n) over n runs after one warm-up: the spread (max - min) says how
    noisy the machine was."""
    fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2], samples[-1] - samples[0], n


def _runner(outs, lower_all):
    """Run the cached plan of `outs` (no graph building, no kept values: timing execution)."""
    from .ir.tensor import bound_data
    from .runtime.executor import compile_plan
    plan, inputs = compile_plan([o.value for o in outs], lower_all)
    bufs = [bound_data(n) for n in inputs]
    return lambda: plan.run(bufs)


_DEMO_MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        rope_theta=10000.0)),
    "mamba2": lambda: Mamba2ForCausalLM(Mamba2Config(
        vocab_size=2048, hidden_size=256, num_hidden_layers=4, state_size=32, expand=2,
        head_dim=32, num_heads=16, n_groups=1, chunk_size=64)),
}


def cmd_demo_model(args) -> int:
    """A model saved as a Hugging Face checkpoint, loaded back, explained and generating."""
    import tempfile
    name = args.model
    print(f"fuelgraph demo --model {name}: a small random {name} saved as a Hugging Face "
          f"checkpoint\n(config.json + model.safetensors), loaded with "
          f"fuelgraph.models.from_pretrained, explained and generating on the CPU.\n")
    with tempfile.TemporaryDirectory() as tmp:
        init_random(_DEMO_MODELS[name](), seed=0).save_pretrained(tmp)
        t0 = time.perf_counter()
        model = from_pretrained(tmp)
        n = sum(p.numel() for p in model.parameters())
        print(f"loaded {type(model).__name__} ({n / 1e6:.1f}M parameters) in "
              f"{(time.perf_counter() - t0) * 1e3:.0f} ms\n")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, (2, 64))
    print("what fused in the forward pass and the loss, model(ids, labels=ids), B=2, S=64:")
    print(fg.explain([model(ids, labels=ids)]))
    prompt = ids[:, :16]
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=args.tokens, progress=True)
    dt = time.perf_counter() - t0
    print(f"\ngreedy decode, prefill 16 tokens then {args.tokens} steps: "
          f"{out.shape[0] * args.tokens / dt:.0f} tokens/s (batch {out.shape[0]})")
    for row in out:
        print(f"  prompt {row[:16].tolist()[:6]}... -> {row[16:].tolist()}")
    return 0


def cmd_demo(args) -> int:
    if getattr(args, "model", None):
        return cmd_demo_model(args)
    print("fuelgraph demo: a Llama-style block (RMS norm, RoPE, causal attention, SiLU MLP,")
    print("cross-entropy) written in plain tensor ops, with its backward pass, on the CPU.\n")
    _, outs = _demo_graph()
    rep = fg.explain(outs)
    print(rep)
    fused = [t.numpy().astype(np.float64) for t in realize(outs)]
    ref = [t.numpy().astype(np.float64) for t in realize(outs, lower_all=True)]
    err = max(float(np.max(np.abs(a - b) / (1.0 + np.abs(b)))) for a, b in zip(fused, ref))
    t_fused, s_fused, n = _time(_runner(outs, False))
    t_ref, s_ref, _ = _time(_runner(outs, True))
    print(f"\nloss {float(fused[0]):.6f} (fused) vs {float(ref[0]):.6f} (lower_all)")
    print(f"max relative error fused vs lower_all over loss and {len(outs) - 1} gradients: {err:.2e}")
    print(f"time per step (cached plan, median of {n} runs): fused {t_fused:.2f} ms "
          f"(spread {s_fused:.2f} ms), lower_all {t_ref:.2f} ms (spread {s_ref:.2f} ms); "
          f"{t_ref / t_fused:.2f}x")
    return 0


def _script_outputs(path: str, name: str):
    """Run `path` as a script and return its module-level `name` (a Tensor or a list of them)."""
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"fuelgraph explain: no such script {path!r}")
    argv = sys.argv
    sys.argv = [str(p)]
    try:
        scope = runpy.run_path(str(p), run_name="__main__")
    finally:
        sys.argv = argv
    outs = scope.get(name)
    if callable(outs):
        outs = outs()
    if outs is None:
        raise SystemExit(f"fuelgraph explain: {path} defines no `{name}` at module level: set it to "
                         f"the Tensor (or list of Tensors) to explain, or name another variable "
                         f"with --outputs")
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if not outs or not all(isinstance(o, fg.Tensor) for o in outs):
        raise SystemExit(f"fuelgraph explain: `{name}` in {path} must be a Tensor or a list of "
                         f"Tensors")
    return outs


def cmd_explain(args) -> int:
    outs = _script_outputs(args.script, args.outputs) if args.script else _demo_graph()[1]
    rep = fg.explain(outs, lower_all=args.lower_all)
    print(rep)
    if args.plan or args.measure:
        print()
        print(rep.plan_report(measure=args.measure))
    if args.html:
        name = Path(args.script).name if args.script else "demo (TinyBlock)"
        path = rep.to_html(args.html, measure=args.measure, title=f"fuelgraph explain: {name}")
        print(f"\nwrote {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fuelgraph", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("registry", help="table of the 25 fused-op ids and their status")
    d = sub.add_parser("demo", help="optimize and run a small model on the CPU")
    d.add_argument("--model", choices=sorted(_DEMO_MODELS), help="a real model instead: "
                   "saved as a Hugging Face checkpoint, loaded, explained and generating")
    d.add_argument("--tokens", type=int, default=32, help="tokens to generate (--model)")
    e = sub.add_parser("explain", help="show the optimizer report for the demo graph or a script's")
    e.add_argument("script", nargs="?", help="a Python script defining `outputs` (a Tensor or a "
                   "list of Tensors); default: the demo model with its backward pass")
    e.add_argument("--outputs", default="outputs", metavar="NAME",
                   help="the script's variable (or function) holding the outputs")
    e.add_argument("--lower-all", action="store_true", help="lower every fused op")
    e.add_argument("--html", metavar="OUT.html", help="also write the HTML graph view")
    e.add_argument("--plan", action="store_true",
                   help="print the plan report (FLOPs, bytes moved, predicted peak memory)")
    e.add_argument("--measure", action="store_true",
                   help="run the graph once and report the measured peak memory too")
    b = sub.add_parser("bench", help="run the benchmark suite (bench/ of a source checkout)")
    b.add_argument("families", nargs="*", help="families to run (default: all)")
    b.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    b.add_argument("--quick", action="store_true", help="short timings (proves it runs)")
    b.add_argument("--out", metavar="DIR", help="where records and plot go (default: "
                   "bench/results, or bench/results/cuda_<date> with --device cuda)")
    b.add_argument("--list", action="store_true", help="list the benchmark families and exit")
    args = p.parse_args(argv)
    return {"registry": cmd_registry, "demo": cmd_demo, "explain": cmd_explain,
            "bench": bench_main}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
