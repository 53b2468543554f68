#!/usr/bin/env python3
"""Convolutions on one CUDA GPU (bf16), against the anchors of issue 11, in one process
(``triton.testing.do_bench`` medians, ms):

* conv2d 3x3, N32 C256 56x56 -> Cout 256, pad 1: anchor cuDNN channels-last (torch conv2d
  on channels-last tensors); target >= 95% of its TFLOP/s.
* conv_transpose2d 4x4 s2 p1, N32 C256 28x28 -> 56x56, Cout 256: anchor cuDNN channels-last;
  target >= 95%.
* causal_conv1d + silu, B8 C4096 L4096 W4: anchor torch eager (depthwise conv1d + silu) and,
  when importable, Dao-AILab causal_conv1d; target <= 0.15 ms (>= 3.5 TB/s effective).
* causal_conv1d + silu forward + backward (dx, dweight, dbias): anchor torch eager autograd;
  target >= 5x faster.

fuelgraph rows: "fuelgraph" = the op's plan run end to end (graph built on from_torch inputs,
which are contiguous NCHW); "fuelgraph (channels-last input)" = the same plan fed
channels-last buffers (what a CNN whose first conv already produced channels-last sees);
"fuelgraph kernel[...]" = the kernel function alone under each CHANNELS_LAST mode. Forward +
backward for the 2-D convs too (informative). ``--sweep`` times causal launch configs.

    python3 bench/bench_cuda_conv.py --out DIR [--sweep] [--only conv2d,convt,causal]

Writes JSON records {"op","impl","device","shape","dtype","ms","tflops"|"gbps","date"} to
bench/results/cuda_conv_<date>.json (and DIR), prints the table and the targets last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import traceback

import torch
import torch.nn.functional as TF
import triton
from triton.testing import do_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from fuelgraph.backends.cuda.kernels import conv as K  # noqa: E402
from fuelgraph.ir.tensor import bound_data  # noqa: E402
from fuelgraph.runtime.executor import compile_plan  # noqa: E402

try:
    from causal_conv1d import causal_conv1d_fn  # Dao-AILab package (optional anchor)
except Exception as exc:  # noqa: BLE001
    print(f"[bench] causal_conv1d not importable: {exc!r}", file=sys.stderr)
    causal_conv1d_fn = None

DEV = torch.device("cuda")
DT = torch.bfloat16
DATE = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
RECORDS: list[dict] = []
DEVICE_NAME = ""
CL = torch.channels_last


def t_ms(fn):
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def record(op, impl, shape, ms, flops=None, nbytes=None, **extra):
    rec = {"op": op, "impl": impl, "device": DEVICE_NAME, "shape": list(shape),
           "dtype": "bfloat16", "ms": round(ms, 5), "date": DATE}
    if flops:
        rec["tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
    if nbytes:
        rec["gbps"] = round(nbytes / (ms * 1e-3) / 1e9, 1)
    rec.update(extra)
    RECORDS.append(rec)
    rate = f"{rec['tflops']:7.1f} TFLOP/s" if "tflops" in rec else \
        f"{rec['gbps']:7.1f} GB/s" if "gbps" in rec else ""
    print(f"  {op:30s} {impl:40s} {ms:9.4f} ms {rate}", flush=True)
    return rec


def run(op, impl, shape, fn, flops=None, nbytes=None, **extra):
    try:
        fn()
        torch.cuda.synchronize()
        return record(op, impl, shape, t_ms(fn), flops, nbytes, **extra)
    except Exception as exc:  # noqa: BLE001
        print(f"  {op:30s} {impl:40s} FAILED: {exc!r}", flush=True)
        traceback.print_exc(limit=3)
        RECORDS.append({"op": op, "impl": impl, "device": DEVICE_NAME, "shape": list(shape),
                        "dtype": "bfloat16", "error": repr(exc)[:300], "date": DATE})
        return None


def agree(name, got, want, tol=2e-2):
    got = got if isinstance(got, (list, tuple)) else [got]
    want = want if isinstance(want, (list, tuple)) else [want]
    for g, w in zip(got, want):
        g, w = torch.as_tensor(g).float().cpu(), w.detach().float().cpu()
        err = (g - w).abs().max().item() / max(w.abs().max().item(), 1e-6)
        flag = "" if err <= tol else "   <-- MISMATCH"
        print(f"  [check] {name}: max rel-to-max error {err:.2e}{flag}", flush=True)


def plan_runner(build, tensors):
    """(run(bufs) closure factory, default bufs): the plan of build(*fg leaves) compiled once."""
    leaves = [fg.from_torch(t) for t in tensors]
    outs = build(*leaves)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    plan, ins = compile_plan([o.value for o in outs])
    bufs = [bound_data(n) for n in ins]
    return (lambda b: (lambda: plan.run(b))), bufs


def to_cl(bufs):
    return [b.contiguous(memory_format=CL) if isinstance(b, torch.Tensor) and b.dim() == 4
            else b for b in bufs]


def kernel_modes(op, shape, fn, flops):
    for mode in ("always", "auto", "never"):
        K.CHANNELS_LAST = mode
        run(op, f"fuelgraph kernel[{mode}]", shape, fn, flops)
    K.CHANNELS_LAST = "always"


# ----------------------------------------------------------------------------- 2-D convs
def bench_conv2d():
    n, c, h, w, co = 32, 256, 56, 56, 256
    op, shape = "conv2d 3x3", (n, c, h, w, co)
    flops = 2 * n * co * h * w * c * 9
    x = torch.randn(n, c, h, w, device=DEV, dtype=DT)
    wt = torch.randn(co, c, 3, 3, device=DEV, dtype=DT) * 0.05
    b = torch.randn(co, device=DEV, dtype=DT)
    xc, wc = x.contiguous(memory_format=CL), wt.contiguous(memory_format=CL)
    res = {"cudnn": run(op, "cudnn", shape, lambda: TF.conv2d(xc, wc, b, 1, 1), flops),
           "cudnn NCHW": run(op, "cudnn NCHW", shape, lambda: TF.conv2d(x, wt, b, 1, 1), flops)}
    make, bufs = plan_runner(lambda a, k, c_: F.conv2d(a, k, c_, 1, 1), [x, wt, b])
    agree(op, make(bufs)()[0], TF.conv2d(xc, wc, b, 1, 1))
    res["fuelgraph"] = run(op, "fuelgraph", shape, make(bufs), flops)
    res["fuelgraph cl"] = run(op, "fuelgraph (channels-last input)", shape, make(to_cl(bufs)),
                              flops)
    kernel_modes(op, shape, lambda: K.conv2d(x, wt, b, stride=(1, 1), padding=(1, 1, 1, 1),
                                             dilation=(1, 1), groups=1), flops)
    # forward + backward (dx via conv_transpose2d, dweight via the weight-gradient kernel)
    gy = torch.randn(n, co, h, w, device=DEV, dtype=DT)
    xg, wg, bg = (t.detach().requires_grad_(True) for t in (xc, wc, b))
    gyc = gy.contiguous(memory_format=CL)

    def torch_fb():
        y = TF.conv2d(xg, wg, bg, 1, 1)
        return torch.autograd.grad(y, (xg, wg, bg), gyc)

    def fg_fb(a, k, c_, g_):
        y = F.conv2d(a, k, c_, 1, 1)
        return fg.grad(y, [a, k, c_], [g_])

    opb = "conv2d 3x3 fwd+bwd"
    res["torch fb"] = run(opb, "torch eager", shape, torch_fb, 3 * flops)
    make, bufs = plan_runner(fg_fb, [x, wt, b, gy])
    agree(opb, make(to_cl(bufs))(), torch_fb())
    res["fuelgraph fb"] = run(opb, "fuelgraph", shape, make(bufs), 3 * flops)
    res["fuelgraph fb cl"] = run(opb, "fuelgraph (channels-last input)", shape,
                                 make(to_cl(bufs)), 3 * flops)
    return res


def bench_conv_transpose2d():
    n, c, h, w, co = 32, 256, 28, 28, 256
    op, shape = "conv_transpose2d 4x4 s2", (n, c, h, w, co)
    flops = 2 * n * c * h * w * co * 16
    x = torch.randn(n, c, h, w, device=DEV, dtype=DT)
    wt = torch.randn(c, co, 4, 4, device=DEV, dtype=DT) * 0.05
    b = torch.randn(co, device=DEV, dtype=DT)
    xc, wc = x.contiguous(memory_format=CL), wt.contiguous(memory_format=CL)
    ref = lambda: TF.conv_transpose2d(xc, wc, b, 2, 1)   # noqa: E731
    res = {"cudnn": run(op, "cudnn", shape, ref, flops),
           "cudnn NCHW": run(op, "cudnn NCHW", shape,
                             lambda: TF.conv_transpose2d(x, wt, b, 2, 1), flops)}
    make, bufs = plan_runner(lambda a, k, c_: F.conv_transpose2d(a, k, c_, 2, 1), [x, wt, b])
    agree(op, make(bufs)()[0], ref())
    res["fuelgraph"] = run(op, "fuelgraph", shape, make(bufs), flops)
    res["fuelgraph cl"] = run(op, "fuelgraph (channels-last input)", shape, make(to_cl(bufs)),
                              flops)
    kernel_modes(op, shape, lambda: K.conv_transpose2d(
        x, wt, b, stride=(2, 2), padding=(1, 1, 1, 1), output_padding=(0, 0), dilation=(1, 1),
        groups=1), flops)
    gy = torch.randn(n, co, 2 * h, 2 * w, device=DEV, dtype=DT)
    xg, wg, bg = (t.detach().requires_grad_(True) for t in (xc, wc, b))
    gyc = gy.contiguous(memory_format=CL)

    def torch_fb():
        y = TF.conv_transpose2d(xg, wg, bg, 2, 1)
        return torch.autograd.grad(y, (xg, wg, bg), gyc)

    def fg_fb(a, k, c_, g_):
        return fg.grad(F.conv_transpose2d(a, k, c_, 2, 1), [a, k, c_], [g_])

    opb = "conv_transpose2d 4x4 s2 fwd+bwd"
    res["torch fb"] = run(opb, "torch eager", shape, torch_fb, 3 * flops)
    make, bufs = plan_runner(fg_fb, [x, wt, b, gy])
    agree(opb, make(to_cl(bufs))(), torch_fb())
    res["fuelgraph fb"] = run(opb, "fuelgraph", shape, make(bufs), 3 * flops)
    res["fuelgraph fb cl"] = run(opb, "fuelgraph (channels-last input)", shape,
                                 make(to_cl(bufs)), 3 * flops)
    return res


# ----------------------------------------------------------------------------- causal conv1d
#: the causal conv1d case (B, C, L, W) of issue 11
CAUSAL_SHAPE = (8, 4096, 4096, 4)
#: causal conv1d launch configs the sweep times: (chunks of 8 positions per program, warps)
FWD_SWEEP = [(64, 2), (128, 4), (256, 4), (256, 8), (512, 4), (512, 8), (1024, 8), (1024, 16)]
BWD_SWEEP = [(64, 2), (128, 2), (128, 4), (256, 4), (256, 8), (512, 8), (512, 16)]


def sweep(op, shape, nbytes, configs, knobs, fn, want, tol=2e-2):
    """Time fn under each (rows, warps) launch config (module knobs of the kernels), check it
    against `want` first, restore the defaults; print and return the fastest."""
    best = None
    for rows, warps in configs:
        setattr(K, knobs[0], rows)
        setattr(K, knobs[1], warps)
        try:
            agree(f"{op}[R={rows},warps={warps}]", fn(), want, tol)
            r = run(op, f"fuelgraph kernel[R={rows},warps={warps}]", shape, fn, nbytes=nbytes,
                    rows=rows, warps=warps)
        finally:
            setattr(K, knobs[0], None)
            setattr(K, knobs[1], None)
        if r and (best is None or r["ms"] < best["ms"]):
            best = r
    if best:
        print(f"  [sweep] {op}: fastest {best['impl']} {best['ms']:.4f} ms "
              f"(set {knobs[0]}={best['rows']}, {knobs[1]}={best['warps']})", flush=True)
    return best


def bench_causal(args):
    bsz, c, length, k = CAUSAL_SHAPE
    shape = (bsz, c, length, k)
    x = torch.randn(bsz, c, length, device=DEV, dtype=DT)
    w = torch.randn(c, k, device=DEV, dtype=DT) * 0.5
    b = torch.randn(c, device=DEV, dtype=DT)
    g = torch.randn_like(x)
    nbytes = 2 * x.numel() * x.element_size()

    def torch_fwd(a=x, k_=w, c_=b):
        return TF.silu(TF.conv1d(TF.pad(a, (k - 1, 0)), k_[:, None, :], c_, groups=c))

    op = "causal_conv1d+silu"
    res = {"torch eager": run(op, "torch eager", shape, torch_fwd, nbytes=nbytes)}
    if causal_conv1d_fn is not None:
        res["dao"] = run(op, "causal_conv1d (Dao-AILab)", shape,
                         lambda: causal_conv1d_fn(x, w, b, activation="silu"), nbytes=nbytes)
    make, bufs = plan_runner(lambda a, k_, c_: F.causal_conv1d(a, k_, c_, True), [x, w, b])
    agree(op, make(bufs)()[0], torch_fwd())
    res["fuelgraph"] = run(op, "fuelgraph", shape, make(bufs), nbytes=nbytes)
    res["kernel"] = run(op, "fuelgraph kernel", shape,
                        lambda: K.causal_conv1d(x, w, b, use_silu=True), nbytes=nbytes)
    if args.sweep:
        res["fwd sweep"] = sweep(op, shape, nbytes, FWD_SWEEP, ("FWD_ROWS", "FWD_WARPS"),
                                 lambda: K.causal_conv1d(x, w, b, use_silu=True), torch_fwd())

    # forward + backward
    xg, wg, bg = (t.detach().requires_grad_(True) for t in (x, w, b))

    def torch_fb():
        y = torch_fwd(xg, wg, bg)
        return (y,) + torch.autograd.grad(y, (xg, wg, bg), g)

    def fg_fb(a, k_, c_, g_):
        y = F.causal_conv1d(a, k_, c_, True)
        return [y] + fg.grad(y, [a, k_, c_], [g_])

    opb = "causal_conv1d+silu fwd+bwd"
    nb_fb = 4 * x.numel() * x.element_size()     # the fewest bytes: read x and g, write y and dx
    res["torch fb"] = run(opb, "torch eager", shape, torch_fb, nbytes=nb_fb)
    if causal_conv1d_fn is not None:
        xd, wd, bd = (t.detach().requires_grad_(True) for t in (x, w, b))

        def dao_fb():
            y = causal_conv1d_fn(xd, wd, bd, activation="silu")
            return (y,) + torch.autograd.grad(y, (xd, wd, bd), g)
        res["dao fb"] = run(opb, "causal_conv1d (Dao-AILab)", shape, dao_fb, nbytes=nb_fb)
    make, bufs = plan_runner(fg_fb, [x, w, b, g])
    agree(opb, make(bufs)(), torch_fb(), tol=3e-2)
    res["fuelgraph fb"] = run(opb, "fuelgraph", shape, make(bufs), nbytes=nb_fb)
    y = K.causal_conv1d(x, w, b, use_silu=True)
    res["kernels fb"] = run(opb, "fuelgraph kernels (fwd + bwd)", shape,
                            lambda: (K.causal_conv1d(x, w, b, use_silu=True),
                                     K.causal_conv1d_backward(x, w, g, b, use_silu=True)),
                            nbytes=nb_fb)
    run("causal_conv1d_backward", "fuelgraph kernel", shape,
        lambda: K.causal_conv1d_backward(x, w, g, b, use_silu=True),
        nbytes=4 * x.numel() * x.element_size())
    del y
    if args.sweep:
        want_b = torch_fb()[1:]
        res["bwd sweep"] = sweep("causal_conv1d_backward", shape, 4 * x.numel() * x.element_size(),
                                 BWD_SWEEP, ("BWD_ROWS", "BWD_WARPS"),
                                 lambda: K.causal_conv1d_backward(x, w, g, b, use_silu=True),
                                 want_b, tol=3e-2)
    return res


def targets(c2, ct, cc):
    rows = []

    def ratio(name, ours, anchor, want, higher_better=True):
        if not ours or not anchor:
            rows.append((name, "n/a", want, "NOT MEASURED"))
            return
        v = anchor["ms"] / ours["ms"]
        ok = v >= want if higher_better else v <= want
        rows.append((name, f"{v:.3f}", f">= {want}", "MET" if ok else "MISSED"))

    for label, res in (("conv2d 3x3", c2), ("conv_transpose2d 4x4 s2", ct)):
        ratio(f"{label}: fuelgraph / cuDNN channels-last throughput", res.get("fuelgraph"),
              res.get("cudnn"), 0.95)
        ratio(f"{label}: (channels-last input) / cuDNN", res.get("fuelgraph cl"),
              res.get("cudnn"), 0.95)
    f = cc.get("fuelgraph")
    rows.append(("causal_conv1d+silu ms (<= 0.15)", f"{f['ms']:.4f}" if f else "n/a", "<= 0.15",
                 "MET" if f and f["ms"] <= 0.15 else "MISSED" if f else "NOT MEASURED"))
    ratio("causal_conv1d+silu fwd+bwd: speedup over torch eager", cc.get("fuelgraph fb"),
          cc.get("torch fb"), 5.0)
    return rows


def main():
    global DEVICE_NAME
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the JSON into this directory")
    ap.add_argument("--sweep", action="store_true", help="time causal launch configs too")
    ap.add_argument("--only", default="", help="comma list among conv2d,convt,causal")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    DEVICE_NAME = torch.cuda.get_device_name(0)
    torch.backends.cudnn.benchmark = True
    print(f"[bench] {DEVICE_NAME}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}, triton {triton.__version__}, date {DATE}",
          flush=True)
    paths = [ROOT / "bench" / "results" / f"cuda_conv_{DATE}.json"]
    if args.out:
        paths.append(pathlib.Path(args.out) / f"cuda_conv_{DATE}.json")
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    want = lambda name: not only or name in only  # noqa: E731
    c2 = bench_conv2d() if want("conv2d") else {}
    torch.cuda.empty_cache()
    ct = bench_conv_transpose2d() if want("convt") else {}
    torch.cuda.empty_cache()
    cc = bench_causal(args) if want("causal") else {}
    rows = targets(c2, ct, cc)
    for name, val, want_s, verdict in rows:
        RECORDS.append({"op": "target", "impl": name, "device": DEVICE_NAME, "value": val,
                        "want": want_s, "verdict": verdict, "date": DATE})
    for p in paths:
        p.write_text(json.dumps(RECORDS, indent=1) + "\n")
        print(f"[bench] wrote {p}")
    print("\n" + "=" * 104)
    print(f"{'op':32s} {'impl':42s} {'ms':>9s} {'rate':>16s}")
    for r in RECORDS:
        if r["op"] == "target" or "ms" not in r:
            continue
        rate = f"{r['tflops']} TFLOP/s" if "tflops" in r else f"{r.get('gbps', '')} GB/s"
        print(f"{r['op']:32s} {r['impl']:42s} {r['ms']:9.4f} {rate:>16s}")
    print("\ntargets:")
    for name, val, want_s, verdict in rows:
        print(f"  {name:62s} {str(val):>10s}  want {want_s:8s}  {verdict}")


if __name__ == "__main__":
    main()
