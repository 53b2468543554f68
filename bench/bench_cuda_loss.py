#!/usr/bin/env python3
"""The loss family on one CUDA GPU (issue: language-model loss at memory speed), one process,
``triton.testing.do_bench`` medians, peak extra memory from the caching allocator:

1. cross-entropy forward+backward, bf16 8192 x 128256: fuelgraph through a plan (the optimizer
   runs the one-pass op), the one-pass kernel called directly, the previous forward + backward
   kernel pair, torch eager, Liger's cross-entropy, a plain copy of the logits (the bytes
   floor: one read, one write); plus a sweep of the split-row one-pass kernel's launch
   settings (`split_sweep_configs`), best first;
2. linear + cross-entropy forward+backward, bf16 N 8192, H 4096, V 128256 (no bias, an LM
   head): fuelgraph through a plan (fused_linear_cross_entropy_fwd_bwd), the kernel at a few
   chunk sizes, Liger's fused linear cross-entropy, torch eager (F.linear + F.cross_entropy),
   and "our matmul + our CE" (cuBLAS products + the one-pass cross-entropy kernel).

"peak extra" = allocator high-water mark during one call, less what was allocated before it,
less the call's outputs (loss and gradients). Correctness is spot-checked against torch eager.

    python3 bench/bench_cuda_loss.py [--out DIR] [--no-sweep] [--smoke] [--ce-only] [--lean]
    python3 bench/bench_cuda_loss.py --warm K     # compile sweep config K only (-1: default)

--smoke runs tiny shapes (on the CPU under TRITON_INTERPRET=1 when there is no GPU) to check
the script itself. Records go to bench/results/cuda_loss_<date>.json (and DIR); a table last.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from common import print_table, record, write_results  # noqa: E402
from fuelgraph.backends.cuda.kernels import loss as L  # noqa: E402
from fuelgraph.backends.cuda.kernels import loss_flow as LF  # noqa: E402
from fuelgraph.backends.cuda.kernels import loss_linear as LL  # noqa: E402
from fuelgraph.backends.cuda.kernels import loss_split as LS  # noqa: E402
from fuelgraph.ir.tensor import bound_data  # noqa: E402
from fuelgraph.runtime.executor import compile_plan  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:     # --smoke under TRITON_INTERPRET=1: the interpreter's scalar-argument fix-up
    import triton.runtime.interpreter as _TI      # (see tests/backends/cuda/test_loss.py)
    _orig_patch = _TI._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    _TI._patch_lang_tensor = _patch_lang_tensor
DEVICE_NAME = torch.cuda.get_device_name() if CUDA else "cpu (triton interpreter)"
OP_CE = "fused_softmax_cross_entropy_fwd+bwd"
OP_FLCE = "fused_linear_cross_entropy_fwd+bwd"


def _liger():
    try:
        from liger_kernel.transformers import (LigerCrossEntropyLoss,
                                               LigerFusedLinearCrossEntropyLoss)
        return LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
    except Exception as exc:            # not installed on this machine
        print(f"[bench] Liger-Kernel not importable ({exc!r}); its rows are skipped")
        return None, None


def _time(fn, smoke):
    if not CUDA:
        import time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=5 if smoke else 25, rep=20 if smoke else 200,
                          return_mode="median"))


def _nbytes(out):
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (list, tuple)):
        return sum(_nbytes(o) for o in out)
    return 0


def _peak_extra_mib(fn):
    """Allocator high-water mark of one call above what was allocated before it, less the
    call's outputs."""
    if not CUDA:
        return None
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - _nbytes(out)
    del out
    return round(extra / 2 ** 20, 1)


def _f64(c):
    if isinstance(c, torch.Tensor):
        return c.detach().to("cpu", torch.float64)
    import numpy as np                  # a NumPy-backend output (--smoke without a GPU)
    return torch.from_numpy(np.asarray(c, np.float64))


def _rel(a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_cuda and \
            a.numel() > 1 << 24:        # a logits-sized gradient: float32 on the GPU, in slabs
        a2, b2 = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        num = den = 0.0
        for i in range(0, a2.shape[0], 1024):
            d = b2[i:i + 1024].float()
            num += (a2[i:i + 1024].float() - d).double().square().sum().item()
            den += d.double().square().sum().item()
        return (num / max(den, 1e-60)) ** 0.5
    a, b = _f64(a), _f64(b)
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _plan(build, tensors):
    """A cached fuelgraph plan for build(*fg tensors): (run() -> outputs, explain report)."""
    ins = [fg.from_torch(t) for t in tensors]
    outs = build(*ins)
    plan, nodes = compile_plan([o.value for o in outs])
    bufs = [bound_data(n) for n in nodes]
    return (lambda: plan.run(bufs)), fg.explain(outs)


def _measure(recs, op, impl, shape, fn, smoke, **extra):
    try:
        ms = _time(fn, smoke)
        recs.append(record(op, impl, shape, "bfloat16", ms, DEVICE_NAME,
                           peak_extra_mib=_peak_extra_mib(fn), **extra))
        print(f"[bench] {op} / {impl}: {ms:.3f} ms, peak extra "
              f"{recs[-1]['peak_extra_mib']} MiB", flush=True)
        return ms
    except Exception:
        print(f"[bench] {op} / {impl} failed:")
        traceback.print_exc()
        return None


def split_sweep_configs():
    """Launch settings of the split-row one-pass kernels the sweep times, the default first
    (`_ce_held_kernel`: each chunk held in registers across the meeting, read once): chunk
    logits, warps, register cap, what is held (pack: bf16 pairs, two exps a logit; else
    float32 exps, one), eager: the load not waiting for the target, meet: arrival counter or
    self-flagging partial words; the streamed kernel (`_ce_split_kernel`, each chunk read
    twice; fast: its leaner exps); persistent programs holding two work items
    (`loss_flow._ce_flow_kernel`, programs_per_sm of them). Programs per SM on sm_90
    (bench/sass_ce_split.py) in the comments.

    Measured on the H200 (2026-12-01 18:13, one session, bf16 8192x128256, ms; a plain copy
    0.984): held chunks of 8192, 4 warps, cap 64 1.096 (the default), uncapped 1.105; chunks
    of 16384 on 8 warps 1.184; chunks of 4096 with float32 exps 1.219 (2 warps) / 1.286,
    packed 1.386; chunks of 8192 waiting for the target, counter meeting, cap 80 1.357; flow
    1.384 / 1.417; streamed 1.515 (the previous default), with the word meeting 1.537, the
    leaner exps 1.459; rerun (18:31): the default 1.088 (1.113 through the plan), uncapped
    1.099, chunks of 16384 1.169, streamed 1.496. Earlier (streamed): chunks of 16384 per BLOCK step 1.581 (1.631 with a
    fenced meeting); chunks of 65536 1.523, of 8192 1.640 / 1.683; persistent programs (4-7
    per SM taking tickets) 1.67-2.12; persistent row kernel 2.18+; chunks in registers before
    the light meeting (8 warps of 16384 float32 logits: about one program per SM) 3.1-4.2."""
    streamed = dict(hold=False, split_chunk=16384, group=8, block=2048, num_warps=4, stages=3)
    held = dict(hold=True, maxnreg=0, pack=True, eager=False, meet="counter")
    fast = dict(held, eager=True, meet="word")
    return [dict(fast, split_chunk=8192, num_warps=4, maxnreg=64),               # 8 / SM
            streamed,                                                            # 12 / SM
            dict(fast, split_chunk=8192, num_warps=4),                           # 7 / SM
            dict(fast, split_chunk=16384, num_warps=8, maxnreg=64),              # 4 / SM
            dict(streamed, meet="word"),
            dict(streamed, fast=True),                                           # 14 / SM
            dict(held, split_chunk=8192, num_warps=4, maxnreg=80),               # 6 / SM
            dict(fast, split_chunk=4096, num_warps=4, pack=False),               # 9 / SM
            dict(fast, split_chunk=4096, num_warps=2, pack=False),               # 11 / SM
            dict(fast, split_chunk=4096, num_warps=4),                           # 9 / SM
            # persistent, two items held (loss_flow): the next one loading during the wait
            dict(flow=True, split_chunk=4096, num_warps=4, maxnreg=80, programs_per_sm=6),
            dict(flow=True, split_chunk=8192, num_warps=8, maxnreg=80, programs_per_sm=3)]


def _label(cfg):
    """A sweep config in one short line."""
    c = dict(cfg)
    kind = "flow" if c.pop("flow", False) else "held" if c.pop("hold", False) else "streamed"
    words = [f"{kind} {c.pop('split_chunk')}/{c.pop('num_warps')}w"]
    for k, a in c.items():
        words.append("f32exp" if (k, a) == ("pack", False) else k if a is True else f"{k}={a}")
    return " ".join(w for w in words if not w.endswith("=False") and w != "maxnreg=0")


def _run_split_cfg(cfg, logits, t, g32, n_valid):
    """One call of the split-row kernel with sweep config cfg: the gradient (loss rows too)."""
    r, v = logits.shape
    loss_rows = torch.empty(r, dtype=torch.float32, device=logits.device)
    dx = torch.empty_like(logits)
    if cfg.get("flow"):
        kw = {k: a for k, a in cfg.items() if k not in ("split_chunk", "flow")}
        LF.ce_flow(logits, t, LF.flow_plan(v, cfg["split_chunk"], logits.element_size()),
                   loss_rows=loss_rows, dx=dx, grad=g32, n_valid=n_valid, reduction="mean",
                   ignore_index=-100, **kw)
        return dx
    kw = {k: a for k, a in cfg.items() if k != "split_chunk"}
    plan = LS.split_plan(v, cfg["split_chunk"], hold=cfg["hold"])
    LS.ce_split(logits, t, plan, loss_rows=loss_rows, dx=dx, grad=g32, n_valid=n_valid,
                reduction="mean", ignore_index=-100, **kw)
    return dx


def warm(index):
    """Compile sweep config `index` (a few rows of the benchmark's width: the same
    specialization; at least one per SM, so that the default entry takes the one pass too),
    so that parallel processes can fill the Triton cache before timing."""
    r, v = 256, 128256
    logits = torch.randn(r, v, device=DEV, dtype=torch.bfloat16)
    t = torch.randint(0, v, (r,), device=DEV)
    one = torch.tensor(1.0, device=DEV)
    if index < 0:                       # the default one-pass entry
        L.one_pass_fwd_bwd(logits, t, one, "mean", -100)
    else:
        _run_split_cfg(split_sweep_configs()[index], logits, t, one.float().reshape(1),
                       (t != -100).sum())
    if CUDA:
        torch.cuda.synchronize()


# ---- 1. cross-entropy forward+backward --------------------------------------------------------

def bench_ce(recs, smoke, sweep, lean=False):
    r, v = (64, 1000) if smoke else (8192, 128256)
    logits = torch.randn(r, v, device=DEV, dtype=torch.bfloat16)
    t = torch.randint(0, v, (r,), device=DEV)
    one = torch.tensor(1.0, device=DEV)
    gbytes = 2 * r * v * 2 / 1e9            # read the logits once, write their gradient once
    extra = dict(logits_mib=round(r * v * 2 / 2 ** 20, 1))

    def build(x, tt):
        x.requires_grad = True
        loss = F.fused_softmax_cross_entropy(x, tt)
        return [loss] + fg.grad(loss, [x])
    if not lean:
        plan_run, rep = _plan(build, [logits, t])
        print(f"[bench] cross-entropy plan fuses to {rep.fused_ops}")
        ref_l = TF.cross_entropy(logits.float(), t)
        got_l, got_d = plan_run()
        print(f"[bench] CE check: loss rel err {_rel(got_l, ref_l):.2e}")

    def torch_eager():
        x = logits.detach().requires_grad_()
        loss = TF.cross_entropy(x, t)
        return (loss,) + torch.autograd.grad(loss, [x])

    def pair():
        return (L.fused_softmax_cross_entropy(logits, t, reduction="mean", ignore_index=-100),
                L.fused_softmax_cross_entropy_backward(logits, t, one, reduction="mean",
                                                       ignore_index=-100))

    def one_pass():
        return L.one_pass_fwd_bwd(logits, t, one, "mean", -100)
    copy_dst = torch.empty_like(logits)

    def copy_floor():                   # the bytes floor: read the logits once, write once
        return copy_dst.copy_(logits)
    impls = [("fuelgraph", plan_run), ("fuelgraph one-pass kernel", one_pass),
             ("fuelgraph fwd + bwd kernels", pair), ("torch eager", torch_eager),
             ("copy (floor: read + write once)", copy_floor)] if not lean else \
        [("fuelgraph one-pass kernel", one_pass), ("copy (floor: read + write once)", copy_floor)]
    lce, _ = _liger() if not lean else (None, None)
    if lce is not None:
        mod = lce(reduction="mean")

        def liger():
            x = logits.detach().requires_grad_()
            loss = mod(x, t)
            return (loss,) + torch.autograd.grad(loss, [x])
        impls.append(("liger", liger))
    for impl, fn in impls:
        ms = _measure(recs, OP_CE, impl, (r, v), fn, smoke, **extra)
        if ms:
            recs[-1]["gbps"] = round(gbytes / ms * 1e3, 1)
    d_ref = torch_eager()[1]
    if lean:
        got_d = one_pass()[1]
    print(f"[bench] CE check: dlogits rel err {_rel(got_d, d_ref):.2e}")
    if not sweep:
        return
    configs = split_sweep_configs()
    g32 = one.float().reshape(1)
    n_valid = (t != -100).sum()          # the mean's divisor when rows may be ignored
    results = []
    for cfg in configs[:3] if smoke else configs[:sweep if sweep is not True else None]:
        def fn(cfg=cfg):
            return _run_split_cfg(cfg, logits, t, g32, n_valid)
        try:
            err = _rel(fn(), d_ref)
            ms = _time(fn, smoke)
        except Exception as exc:
            print(f"[bench] sweep {cfg} failed: {exc!r}")
            continue
        cfg = dict(cfg, dlogits_rel_err=float(f"{err:.2e}"))
        results.append((ms, cfg))
        print(f"[bench] sweep {ms:8.3f} ms  {gbytes / ms * 1e3:7.1f} GB/s  {cfg}", flush=True)
    results.sort(key=lambda p: p[0])
    print("[bench] split-row one-pass kernel sweep, best first (chunk, block, warps, stages, "
          "statistics group):")
    for ms, cfg in results:
        print(f"    {ms:8.3f} ms  {gbytes / ms * 1e3:7.1f} GB/s  {_label(cfg)}")
        recs.append(record(OP_CE, "fuelgraph[sweep]", (r, v), "bfloat16", ms, DEVICE_NAME,
                           gbps=round(gbytes / ms * 1e3, 1), config=cfg))


# ---- 2. linear + cross-entropy forward+backward -----------------------------------------------

def bench_flce(recs, smoke, sweep):
    n, h, v = (256, 64, 1000) if smoke else (8192, 4096, 128256)
    x = (torch.randn(n, h, device=DEV) * 0.5).to(torch.bfloat16)
    w = (torch.randn(v, h, device=DEV) / h ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device=DEV)
    t[::50] = -100
    one = torch.tensor(1.0, device=DEV)
    flops = 3 * 2 * n * h * v
    extra = dict(logits_mib=round(n * v * 2 / 2 ** 20, 1))

    def build(xx, ww, tt):
        xx.requires_grad = True
        ww.requires_grad = True
        loss = F.fused_softmax_cross_entropy(xx @ ww.mT, tt)   # an LM head as users write it
        return [loss] + fg.grad(loss, [xx, ww])
    plan_run, rep = _plan(build, [x, w, t])
    print(f"[bench] linear + CE plan fuses to {rep.fused_ops}")

    def torch_eager():
        xs = [a.detach().requires_grad_() for a in (x, w)]
        loss = TF.cross_entropy(TF.linear(*xs), t)
        return (loss,) + torch.autograd.grad(loss, xs)

    def ours_composed():               # our matmul (cuBLAS) + our one-pass CE + the two grads
        z = x @ w.t()
        loss, dz = L.fused_softmax_cross_entropy_fwd_bwd(z, t, one, reduction="mean",
                                                         ignore_index=-100)
        return loss, dz @ w, dz.t() @ x

    def kernel(fraction=None):
        def run():
            step = LL.chunk_rows(n, v, 2, fraction)
            return LL._flce("op", x, w, t, None, one, "mean", -100, True, True, chunk=step)
        return run
    impls = [("fuelgraph", plan_run), ("fuelgraph matmul + CE", ours_composed),
             ("torch eager", torch_eager)]
    _, lflce = _liger()
    if lflce is not None:
        mod = lflce(reduction="mean")

        def liger():
            xs = [a.detach().requires_grad_() for a in (x, w)]
            loss = mod(xs[1], xs[0], t)
            return (loss,) + torch.autograd.grad(loss, xs)
        impls.append(("liger", liger))
    if sweep:
        for frac in (0.04, 0.08, 0.16):
            impls.append((f"fuelgraph[chunk {LL.chunk_rows(n, v, 2, frac)} rows]", kernel(frac)))
    for impl, fn in impls:
        ms = _measure(recs, OP_FLCE, impl, (n, h, v), fn, smoke, **extra)
        if ms:
            recs[-1]["tflops"] = round(flops / ms / 1e9, 1)
    ref = torch_eager()
    got = plan_run()
    print("[bench] linear + CE check vs torch eager (rel. norm error): loss "
          f"{_rel(got[0], ref[0]):.2e}, dx {_rel(got[1], ref[1]):.2e}, "
          f"dw {_rel(got[2], ref[2]):.2e}")


def _pct(a, b):
    return f"{a / b * 100:.1f}%" if a is not None and b else "n/a"


def _targets(recs):
    by = {(r["op"], r["impl"]): r for r in recs}

    def ms(op, impl):
        r = by.get((op, impl))
        return r["ms"] if r else None
    print("\ntargets:")
    ce = ms(OP_CE, "fuelgraph")
    if ce:
        print(f"  CE fwd+bwd: {ce:.3f} ms (target <= 1.1 ms), peak extra "
              f"{by[(OP_CE, 'fuelgraph')]['peak_extra_mib']} MiB (target <= one logits buffer, "
              f"{by[(OP_CE, 'fuelgraph')]['logits_mib']} MiB)")
    fl = ms(OP_FLCE, "fuelgraph")
    if fl:
        comp, lig = ms(OP_FLCE, "fuelgraph matmul + CE"), ms(OP_FLCE, "liger")
        r = by[(OP_FLCE, "fuelgraph")]
        print(f"  linear+CE fwd+bwd: {fl:.2f} ms; vs matmul + CE "
              f"{fl / comp if comp else float('nan'):.3f}x (target <= 1.15); vs Liger "
              f"{fl / lig if lig else float('nan'):.3f}x (target <= 1); peak extra "
              f"{r['peak_extra_mib']} MiB = {_pct(r['peak_extra_mib'], r['logits_mib'])} of the "
              f"logits (target <= 10%)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also copy the JSON into this folder")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script")
    ap.add_argument("--ce-only", action="store_true", help="only the cross-entropy case")
    ap.add_argument("--sweep-n", type=int, default=0, help="time only the first N sweep configs")
    ap.add_argument("--lean", action="store_true",
                    help="cross-entropy: only the one-pass kernel, the copy and the sweep")
    ap.add_argument("--warm", type=int, default=None,
                    help="only compile sweep config WARM (-1: the default one-pass entry)")
    args = ap.parse_args()
    if args.warm is not None:
        return warm(args.warm)
    recs = []
    for part in (bench_ce,) if args.ce_only else (bench_ce, bench_flce):
        try:
            kw = dict(lean=True) if args.lean and part is bench_ce else {}
            part(recs, args.smoke, args.sweep_n or not args.no_sweep, **kw)
        except Exception:
            traceback.print_exc()
        if CUDA:
            torch.cuda.empty_cache()
    path = write_results("cuda_loss" + ("_smoke" if args.smoke else ""), recs)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, args.out)
    print_table([r for r in recs if r["impl"] != "fuelgraph[sweep]"])
    _targets(recs)


if __name__ == "__main__":
    main()
