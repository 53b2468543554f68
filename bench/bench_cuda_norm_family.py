#!/usr/bin/env python3
"""Time fuelgraph's Triton softmax / norm / rope / cross-entropy kernels on one CUDA GPU against
torch eager, torch.compile and (when importable) Liger-Kernel, plus a device-to-device copy
ceiling. One process; ``triton.testing.do_bench`` medians (ms); effective bandwidth counts the
fewest bytes each op must move (every input read once, every output written once).

Writes JSON records {"op","impl","device","shape","dtype","ms","gbps","date", ...} to
``bench/results/cuda_norm_family_<date>.json`` (and to ``--out DIR`` too when given), then
prints a table and the targets (ratios) table.

    python3 bench/bench_cuda_norm_family.py [--out DIR] [--sweep] [--no-compile] [--quick]

``--sweep`` also times launch-configuration variants of our kernels (block rows, warps, chunk)
at the target shapes and records them as impl "fuelgraph[cfg]".
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import traceback
import types

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


from fuelgraph.backends.cuda.kernels import loss as _loss  # noqa: E402
from fuelgraph.backends.cuda.kernels import norm as _norm  # noqa: E402
from fuelgraph.backends.cuda.kernels import rope as _rope  # noqa: E402
from fuelgraph.backends.cuda.kernels import softmax as _softmax  # noqa: E402

# the kernels of the family modules under one name (each module registers its own)
K = types.SimpleNamespace(**{n: getattr(m, n) for m in (_loss, _norm, _rope, _softmax)
                             for n in dir(m) if not n.startswith("_") and callable(getattr(m, n))})

try:
    import liger_kernel  # noqa: F401
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.softmax import LigerSoftmaxFunction
    HAVE_LIGER = True
except Exception as exc:  # noqa: BLE001
    print(f"[bench] liger_kernel not importable: {exc!r}", file=sys.stderr)
    HAVE_LIGER = False

DEV = torch.device("cuda")
DATE = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
RECORDS: list[dict] = []
DEVICE_NAME = ""


def t_ms(fn, warmup=25, rep=100) -> float:
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def record(op, impl, shape, dtype, ms, nbytes=None, **extra):
    rec = {"op": op, "impl": impl, "device": DEVICE_NAME, "shape": list(shape),
           "dtype": str(dtype).replace("torch.", ""), "ms": round(ms, 5), "date": DATE}
    if nbytes is not None:
        rec["gbps"] = round(nbytes / (ms * 1e-3) / 1e9, 1)
        rec["bytes"] = int(nbytes)
    rec.update(extra)
    RECORDS.append(rec)
    gb = f"{rec['gbps']:8.1f}" if "gbps" in rec else "       -"
    print(f"  {op:28s} {impl:34s} {ms:9.4f} ms {gb} GB/s", flush=True)
    return rec


def run(op, impl, shape, dtype, fn, nbytes, **extra):
    try:
        fn()
        torch.cuda.synchronize()
        return record(op, impl, shape, dtype, t_ms(fn), nbytes, **extra)
    except Exception as exc:  # noqa: BLE001
        print(f"  {op:28s} {impl:34s} FAILED: {exc!r}", flush=True)
        traceback.print_exc(limit=2)
        RECORDS.append({"op": op, "impl": impl, "device": DEVICE_NAME, "shape": list(shape),
                        "dtype": str(dtype).replace("torch.", ""), "error": repr(exc)[:300],
                        "date": DATE})
        return None


def compiled(fn):
    return torch.compile(fn, dynamic=False)


def nb(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------- ops


def bench_copy():
    src = torch.randn(1 << 30, device=DEV, dtype=torch.bfloat16)        # 2 GiB
    dst = torch.empty_like(src)
    run("copy_d2d", "torch (ceiling)", src.shape, src.dtype, lambda: dst.copy_(src), 2 * nb(src))
    del src, dst


def bench_softmax(args, dtype=torch.bfloat16, shape=(32768, 4096)):
    x = torch.randn(shape, device=DEV, dtype=dtype)
    byts = 2 * nb(x)
    out = {}
    out["fuelgraph"] = run("softmax_last_dim", "fuelgraph", shape, dtype,
                           lambda: K.softmax_last_dim(x), byts)
    out["torch eager"] = run("softmax_last_dim", "torch eager", shape, dtype,
                             lambda: torch.softmax(x, -1), byts)
    if args.compile:
        f = compiled(lambda t: torch.softmax(t, -1))
        out["torch.compile"] = run("softmax_last_dim", "torch.compile", shape, dtype,
                                   lambda: f(x), byts)
    if HAVE_LIGER:
        out["liger"] = run("softmax_last_dim", "liger", shape, dtype,
                           lambda: LigerSoftmaxFunction.apply(x), byts)
    y = K.softmax_last_dim(x)
    g = torch.randn_like(x)
    run("softmax_last_dim_backward", "fuelgraph", shape, dtype,
        lambda: K.softmax_last_dim_backward(y, g), 3 * nb(x))
    if args.sweep:
        for br, nw in [(1, 4), (2, 8), (2, 16), (4, 16)]:
            run("softmax_last_dim", f"fuelgraph[br={br},w={nw}]", shape, dtype,
                lambda: _softmax._softmax_fwd(x, block_r=br, num_warps=nw), byts)
        run("softmax_last_dim", "fuelgraph[br=1,w=8,evict_first]", shape, dtype,
            lambda: _softmax._softmax_fwd(x, block_r=1, num_warps=8, evict="evict_first"), byts)
    return out


def bench_rms(args, dtype=torch.bfloat16, shape=(32768, 4096), eps=1e-6):
    x = torch.randn(shape, device=DEV, dtype=dtype)
    g = torch.randn_like(x)
    N = shape[-1]
    byts = 2 * nb(x)
    out, out_fb = {}, {}
    out["fuelgraph"] = run("rms_norm_last_dim", "fuelgraph", shape, dtype,
                           lambda: K.rms_norm_last_dim(x, eps=eps), byts)
    out["torch eager"] = run("rms_norm_last_dim", "torch eager", shape, dtype,
                             lambda: F.rms_norm(x, (N,), eps=eps), byts)
    if args.compile:
        f = compiled(lambda t: F.rms_norm(t, (N,), eps=eps))
        out["torch.compile"] = run("rms_norm_last_dim", "torch.compile", shape, dtype,
                                   lambda: f(x), byts)
    if HAVE_LIGER:
        out["liger"] = run("rms_norm_last_dim", "liger", shape, dtype,
                           lambda: LigerRMSNormFunction.apply(x, None, eps, 0.0, "llama", False),
                           byts)

    # forward + backward (x, g in; y, dx out): 5 tensor passes at least
    byts_fb = 5 * nb(x)

    def ours_fb():
        K.rms_norm_last_dim(x, eps=eps)
        return K.rms_norm_last_dim_backward(x, g, eps=eps)

    xr = x.detach().clone().requires_grad_(True)

    def eager_fb():
        y = F.rms_norm(xr, (N,), eps=eps)
        return torch.autograd.grad(y, xr, g)

    out_fb["fuelgraph"] = run("rms_norm_fwd+bwd", "fuelgraph", shape, dtype, ours_fb, byts_fb)
    out_fb["torch eager"] = run("rms_norm_fwd+bwd", "torch eager", shape, dtype, eager_fb, byts_fb)
    if HAVE_LIGER:
        def liger_fb():
            y = LigerRMSNormFunction.apply(xr, None, eps, 0.0, "llama", False)
            return torch.autograd.grad(y, xr, g)
        out_fb["liger"] = run("rms_norm_fwd+bwd", "liger", shape, dtype, liger_fb, byts_fb)
    run("rms_norm_last_dim_backward", "fuelgraph", shape, dtype,
        lambda: K.rms_norm_last_dim_backward(x, g, eps=eps), 3 * nb(x))
    if args.sweep:
        for br, nw in [(1, 4), (2, 8), (2, 16), (4, 16)]:
            run("rms_norm_last_dim", f"fuelgraph[br={br},w={nw}]", shape, dtype,
                lambda: _norm._norm_fwd("rms", x, eps, block_r=br, num_warps=nw), byts)
        for br, nw in [(1, 4), (1, 16), (2, 8)]:
            run("rms_norm_last_dim_backward", f"fuelgraph[br={br},w={nw}]", shape, dtype,
                lambda: _norm._norm_bwd("rms", x, g, eps, block_r=br, num_warps=nw), 3 * nb(x))
        run("rms_norm_last_dim_backward", "fuelgraph[br=1,w=8,evict_first]", shape, dtype,
            lambda: _norm._norm_bwd("rms", x, g, eps, evict="evict_first"), 3 * nb(x))
    return out, out_fb


def bench_ln(args, dtype=torch.bfloat16, shape=(32768, 4096), eps=1e-5):
    x = torch.randn(shape, device=DEV, dtype=dtype)
    g = torch.randn_like(x)
    N = shape[-1]
    byts = 2 * nb(x)
    out = {}
    out["fuelgraph"] = run("layer_norm_last_dim", "fuelgraph", shape, dtype,
                           lambda: K.layer_norm_last_dim(x, eps=eps), byts)
    out["torch eager"] = run("layer_norm_last_dim", "torch eager", shape, dtype,
                             lambda: F.layer_norm(x, (N,), eps=eps), byts)
    if args.compile:
        f = compiled(lambda t: F.layer_norm(t, (N,), eps=eps))
        out["torch.compile"] = run("layer_norm_last_dim", "torch.compile", shape, dtype,
                                   lambda: f(x), byts)
    if HAVE_LIGER:
        w = torch.ones(N, device=DEV, dtype=dtype)
        b = torch.zeros(N, device=DEV, dtype=dtype)
        out["liger"] = run("layer_norm_last_dim", "liger (w=1,b=0)", shape, dtype,
                           lambda: LigerLayerNormFunction.apply(x, w, b, eps), byts)
    run("layer_norm_last_dim_backward", "fuelgraph", shape, dtype,
        lambda: K.layer_norm_last_dim_backward(x, g, eps=eps), 3 * nb(x))
    if args.sweep:
        for br, nw in [(1, 4), (2, 16)]:
            run("layer_norm_last_dim", f"fuelgraph[br={br},w={nw}]", shape, dtype,
                lambda: _norm._norm_fwd("ln", x, eps, block_r=br, num_warps=nw), byts)
    return out


def _rot_half(t):
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


def bench_rope(args, dtype=torch.bfloat16, shape=(8, 32, 4096, 128)):
    q = torch.randn(shape, device=DEV, dtype=dtype)
    k = torch.randn(shape, device=DEV, dtype=dtype)
    S, D = shape[-2:]
    pos = torch.arange(S, device=DEV, dtype=torch.float64)[:, None]
    theta = 10000.0 ** (-torch.arange(D // 2, device=DEV, dtype=torch.float64) * 2 / D)
    ang = torch.cat((pos * theta, pos * theta), -1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    byts = 4 * nb(q) + 2 * nb(cos)
    out = {}

    def ours():
        return (K.rope(q, cos, sin, interleaved=False), K.rope(k, cos, sin, interleaved=False))

    def ref(q_, k_, c, s):
        return q_ * c + _rot_half(q_) * s, k_ * c + _rot_half(k_) * s

    out["fuelgraph"] = run("rope_q_and_k", "fuelgraph", shape, dtype, ours, byts)
    out["torch eager"] = run("rope_q_and_k", "torch eager", shape, dtype,
                             lambda: ref(q, k, cos, sin), byts)
    if args.compile:
        f = compiled(ref)
        out["torch.compile"] = run("rope_q_and_k", "torch.compile", shape, dtype,
                                   lambda: f(q, k, cos, sin), byts)
    if HAVE_LIGER:
        q2, k2 = q.clone(), k.clone()            # liger rotates in place
        out["liger"] = run("rope_q_and_k", "liger (in place)", shape, dtype,
                           lambda: LigerRopeFunction.apply(q2, k2, cos[None], sin[None]), byts)
        del q2, k2
    run("rope_backward_q_and_k", "fuelgraph", shape, dtype,
        lambda: (K.rope_backward(q, cos, sin, interleaved=False),
                 K.rope_backward(k, cos, sin, interleaved=False)), byts)
    run("rope_q_and_k_interleaved", "fuelgraph", shape, dtype,
        lambda: (K.rope(q, cos, sin, interleaved=True), K.rope(k, cos, sin, interleaved=True)),
        byts)
    # HF layout: per-batch tables [B, 1, S, D] (from position_ids), one block per batch
    cos_b = cos[None, None].expand(shape[0], 1, S, D).contiguous()
    sin_b = sin[None, None].expand(shape[0], 1, S, D).contiguous()
    byts_b = 4 * nb(q) + 2 * nb(cos_b)
    run("rope_q_and_k_per_batch_tables", "fuelgraph", shape, dtype,
        lambda: (_rope.rope(q, cos_b, sin_b, interleaved=False),
                 _rope.rope(k, cos_b, sin_b, interleaved=False)), byts_b)
    run("rope_q_and_k_per_batch_tables", "torch eager", shape, dtype,
        lambda: ref(q, k, cos_b, sin_b), byts_b)
    if args.sweep:
        for bs, op_, nw in [(16, 2, 4), (32, 2, 4), (32, 4, 8), (8, 4, 2), (16, 8, 4)]:
            run("rope_q_and_k", f"fuelgraph[bs={bs},op={op_},w={nw}]", shape, dtype,
                lambda: (_rope._rope_launch(q, cos, sin, False, False, block_s=bs,
                                            outer_per=op_, num_warps=nw),
                         _rope._rope_launch(k, cos, sin, False, False, block_s=bs,
                                            outer_per=op_, num_warps=nw)), byts)
    return out


def bench_ce(args, dtype=torch.bfloat16, shape=(8192, 128256)):
    logits = torch.randn(shape, device=DEV, dtype=dtype)
    R, V = shape
    t = torch.randint(0, V, (R,), device=DEV)
    t[::10] = -100
    byts = nb(logits) + nb(t) + 4
    out = {}
    out["fuelgraph"] = run("cross_entropy_fwd", "fuelgraph", shape, dtype,
                           lambda: K.fused_softmax_cross_entropy(logits, t, reduction="mean",
                                                                 ignore_index=-100), byts)

    def ref(x, tt):
        return F.cross_entropy(x.float(), tt, reduction="mean", ignore_index=-100)

    out["torch eager"] = run("cross_entropy_fwd", "torch eager (x.float())", shape, dtype,
                             lambda: ref(logits, t), byts)
    if args.compile:
        f = compiled(ref)
        out["torch.compile"] = run("cross_entropy_fwd", "torch.compile", shape, dtype,
                                   lambda: f(logits, t), byts)
    gr = torch.tensor(1.0, device=DEV)
    run("cross_entropy_bwd", "fuelgraph", shape, dtype,
        lambda: K.fused_softmax_cross_entropy_backward(logits, t, gr, reduction="mean",
                                                       ignore_index=-100),
        2 * nb(logits) + nb(t))
    if args.sweep:
        for blk, nw, st in [(4096, 4, 1), (4096, 4, 2), (4096, 2, 3), (2048, 4, 3), (8192, 4, 3),
                            (4096, 8, 3)]:
            run("cross_entropy_fwd", f"fuelgraph[blk={blk},w={nw},st={st}]", shape, dtype,
                lambda: _loss._fsce_forward(logits, t, "mean", -100, block=blk, num_warps=nw,
                                            stages=st), byts)
        for nw, st in [(8, 3), (4, 1)]:
            run("cross_entropy_bwd", f"fuelgraph[w={nw},st={st}]", shape, dtype,
                lambda: _loss._fsce_backward(logits, t, gr, "mean", -100, num_warps=nw,
                                             stages=st), 2 * nb(logits) + nb(t))
    return out


# ----------------------------------------------------------------------------- report


def _ms(rec):
    return rec["ms"] if rec else float("nan")


def targets_table(res):
    sm, rms, rms_fb, ln, rope_, ce = res
    rows = []

    def add(name, ours, other, kind, want):
        o, t = _ms(ours), _ms(other)
        if kind == "speedup>=":          # other_ms / ours_ms >= want
            ratio = t / o
            ok = ratio >= want
        else:                            # ours_ms / other_ms <= want
            ratio = o / t
            ok = ratio <= want
        rows.append((name, f"{ratio:6.2f}", f"{kind[:-2]} {kind[-2:]} {want}",
                     "PASS" if ok else "MISS"))

    def bw(name, ours, want_gbps):
        g = ours.get("gbps", float("nan")) if ours else float("nan")
        rows.append((name, f"{g:6.0f}", f"GB/s >= {want_gbps}", "PASS" if g >= want_gbps else "MISS"))

    add("softmax vs torch.compile", sm.get("fuelgraph"), sm.get("torch.compile"), "speedup>=", 2.0)
    bw("softmax effective bandwidth", sm.get("fuelgraph"), 3400)
    add("rms_norm vs liger", rms.get("fuelgraph"), rms.get("liger"), "speedup>=", 1.0)
    bw("rms_norm effective bandwidth", rms.get("fuelgraph"), 4000)
    add("rms fwd+bwd vs torch eager", rms_fb.get("fuelgraph"), rms_fb.get("torch eager"),
        "time<=", 0.75)
    add("layer_norm vs torch.compile", ln.get("fuelgraph"), ln.get("torch.compile"),
        "speedup>=", 1.2)
    add("rope q,k vs torch.compile", rope_.get("fuelgraph"), rope_.get("torch.compile"),
        "time<=", 1.0)
    add("cross-entropy fwd vs torch.compile", ce.get("fuelgraph"), ce.get("torch.compile"),
        "time<=", 0.5)
    return rows


def main():
    global DEVICE_NAME
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the JSON into this directory")
    ap.add_argument("--sweep", action="store_true", help="time launch-config variants too")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--only", default="", help="comma list among copy,softmax,rms,ln,rope,ce")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    DEVICE_NAME = torch.cuda.get_device_name(0)
    print(f"[bench] {DEVICE_NAME}, torch {torch.__version__}, triton {triton.__version__}, "
          f"liger {'yes' if HAVE_LIGER else 'no'}, date {DATE}", flush=True)
    outdir = ROOT / "bench" / "results"
    outdir.mkdir(parents=True, exist_ok=True)
    paths = [outdir / f"cuda_norm_family_{DATE}.json"]
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        paths.append(pathlib.Path(args.out) / f"cuda_norm_family_{DATE}.json")

    def flush(final=False):
        for p in paths:
            p.write_text(json.dumps(RECORDS, indent=1) + "\n")
            if final:
                print(f"[bench] wrote {p}")

    only = set(filter(None, args.only.split(",")))
    want = lambda name: not only or name in only  # noqa: E731
    res = [{}, {}, {}, {}, {}, {}]
    if want("copy"):
        bench_copy()
        flush()
    if want("softmax"):
        res[0] = bench_softmax(args)
        flush()
    if want("rms"):
        res[1], res[2] = bench_rms(args)
        flush()
    if want("ln"):
        res[3] = bench_ln(args)
        flush()
    if want("rope"):
        res[4] = bench_rope(args)
        flush()
    torch.cuda.empty_cache()
    if want("ce"):
        res[5] = bench_ce(args)
        flush()

    res = [{k: v for k, v in d.items() if v} for d in res]
    tgt = targets_table(res)
    for name, val, want_s, verdict in tgt:
        RECORDS.append({"op": "target", "impl": name, "device": DEVICE_NAME, "value": val.strip(),
                        "want": want_s, "verdict": verdict, "date": DATE})

    flush(final=True)

    print("\n" + "=" * 100)
    print(f"{'op':28s} {'impl':34s} {'shape':22s} {'ms':>9s} {'GB/s':>8s}")
    for r in RECORDS:
        if r["op"] == "target" or "ms" not in r:
            continue
        print(f"{r['op']:28s} {r['impl']:34s} {str(tuple(r['shape'])):22s} {r['ms']:9.4f} "
              f"{r.get('gbps', float('nan')):8.1f}")
    print("-" * 100)
    print(f"{'target':40s} {'value':>8s}  {'want':22s} verdict")
    for name, val, want_s, verdict in tgt:
        print(f"{name:40s} {val:>8s}  {want_s:22s} {verdict}")


if __name__ == "__main__":
    main()
