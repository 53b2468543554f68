#!/usr/bin/env python3
"""Time fuelgraph's Triton state-space scans on one CUDA GPU against the issue's anchors, in
one process (triton.testing.do_bench medians, ms):

  ssd_chunk_scan   fwd, fwd+bwd  bf16  B4 L4096 H80 P64 N128, chunk 256  vs mamba_ssm's Triton
                                        mamba_chunk_scan_combined (B/C: one group; ours gets the
                                        same group expanded over the heads, stride 0)
  selective_scan   fwd f32   B2 L1024 D1536 N16   vs the torch reference loop (Mamba's
                                                    selective_scan_ref algorithm, on the GPU)
  selective_scan   fwd bf16  B8 L2048 D4096 N16   vs the bytes it must move at 4.2 TB/s
  selective_scan   fwd+bwd   B2 L1024 D1536 N16   vs the torch reference loop with autograd

mamba_ssm's CUDA extension does not build on the GPU machine, so only its Triton SSD modules
are imported from its Python sources: pass --mamba-src DIR (the folder that holds the
`mamba_ssm` package, e.g. an unpacked sdist) and --path for pure-Python dependencies (einops
wheel or folder). Without them the mamba rows are skipped and say so.

    python3 bench/bench_cuda_ssm.py --out DIR [--mamba-src DIR] [--path WHEEL_OR_DIR ...]
                                   [--sweep] [--quick] [--rep MS] [--no-f32] [--ssd-bwd]

--ssd-bwd runs only the SSD fwd+bwd case, the split backward against the fused one (their
gradients compared on that shape, then times; --sweep adds split launch configs).
--sweep adds each SSD kernel timed alone (ssd_chunk_scan[part] rows: where the time goes) and
a few launch configurations. Writes JSON records {"op","impl","device","shape","dtype","ms",
"date", "gbps"?} to bench/results/cuda_ssm_<date>.json and DIR/cuda_ssm_<date>.json (and to
DIR/records.jsonl as they are made, so a run cut short keeps its rows), then prints the table
and the targets. mamba_ssm's rows run last (its autotuning compiles many configurations).
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
import torch.nn.functional as TF
from triton.testing import do_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from fuelgraph.backends.cuda.kernels import ssm as KS  # noqa: E402
from fuelgraph.backends.cuda.kernels import ssm_ssd as KD  # noqa: E402

DEV = "cuda"
CEILING_TBS = 4.2
RECORDS: list[dict] = []
SS_KW = dict(delta_softplus=True, has_d=False, has_z=False, has_delta_bias=False)


def rec(op, impl, shape, dtype, ms, **extra):
    r = {"op": op, "impl": impl, "device": torch.cuda.get_device_name(), "shape": list(shape),
         "dtype": str(dtype).replace("torch.", ""), "ms": round(ms, 5),
         "date": datetime.date.today().isoformat()}
    r.update({k: v for k, v in extra.items() if v is not None})
    RECORDS.append(r)
    if JSONL[0]:
        with open(JSONL[0], "a") as f:
            f.write(json.dumps(r) + "\n")
    print(f"  {op:26s} {impl:22s} {str(shape):28s} {r['dtype']:9s} {ms:9.4f} ms"
          + (f"  {extra['gbps']:.0f} GB/s" if extra.get("gbps") else ""), flush=True)
    return ms


SS_SWEEP = [[(16, 64, 2, 0), (16, 64, 2, 2), (8, 128, 2, 1), (8, 128, 2, 2), (16, 16, 1, 0)]]
NO_BWD = [False]           # --no-bwd: the SSD forward rows only
SS_GIVEN = [False]         # --ss-configs given: the selective-scan sweep runs without --sweep
WARM = [False]             # --warm: run every case once (compiles), time nothing
# --ssd-configs: forward configs (q, bm, bk, bp, bn, warps, stages, swarps, sstages, cb)
SSD_FWD_SWEEP = [[]]
REP_MS = [None]            # --rep: do_bench's time budget per case (ms)
JSONL = [None]             # --out DIR: every record also appended to DIR/records.jsonl as made


def bench(fn, quick):
    if WARM[0]:                 # --warm: compile (fill Triton's cache), no timing
        fn()
        torch.cuda.synchronize()
        return float("nan")
    rep = REP_MS[0] or (30 if quick else 100)
    return do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median")


# ---- anchors ----------------------------------------------------------------------------------
def torch_selective_scan_ref(u, delta, A, B, C):
    """Mamba's reference algorithm (channel-major u, delta (b, d, l); B, C (b, n, l))."""
    delta = TF.softplus(delta.float())
    u, B, C = u.float(), B.float(), C.float()
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A.float()))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = dA[:, :, i] * x + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2), x


def import_mamba_ssd(src, paths):
    """mamba_ssm.ops.triton.ssd_combined from its sources, without the package __init__
    (which imports the CUDA extension)."""
    for p in paths or ():
        sys.path.insert(0, str(p))
    if src is None:
        return None, "no --mamba-src given"
    try:
        pkg_dir = pathlib.Path(src) / "mamba_ssm"
        for name, sub in (("mamba_ssm", pkg_dir), ("mamba_ssm.ops", pkg_dir / "ops"),
                          ("mamba_ssm.ops.triton", pkg_dir / "ops" / "triton"),
                          ("mamba_ssm.utils", pkg_dir / "utils")):
            m = types.ModuleType(name)
            m.__path__ = [str(sub)]
            sys.modules[name] = m
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined, None
    except Exception as exc:  # report, keep benchmarking ours
        traceback.print_exc()
        return None, f"import failed: {exc!r}"


# ---- cases ------------------------------------------------------------------------------------
def kernel_times(fn, reps=3):
    """The GPU kernels of fn in launch order with their mean times (torch profiler), printed:
    where a multi-kernel op's time goes (kernels of one name told apart by position)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
        per = len(evs) // reps
        for i in range(per):
            us = sum(getattr(evs[i + r * per], "device_time", None)
                     or getattr(evs[i + r * per], "cuda_time", 0.0) for r in range(reps)) / reps
            print(f"    kernel {i:2d} {us:9.1f} us  {evs[i].name[:70]}", flush=True)
    except Exception as exc:  # the profiler is a diagnostic: never fail the bench on it
        print(f"  kernel times failed: {exc!r}", flush=True)


def ssd_bwd_compare(quick, sweep, shape=None, fused_too=True, configs=None, parts=None):
    """--ssd-bwd: the SSD fwd+bwd target case only, the split backward (default) against the
    fused per-chunk one (split=0; not with fused_too False) in one process: their gradients
    compared on the target shape, then fwd+bwd and bwd-alone times, and (--sweep) the split
    backward's kernels and a few launch configs (configs: a list of SSDBwdConfig tuples).
    parts: which of grads, fwd, split, fused, sweep run (all by default; --parts, so that
    several --warm processes compile them in parallel)."""
    parts = set(parts or ("grads", "fwd", "split", "fused", "sweep"))
    if not fused_too:
        parts.discard("fused")
    B, L, H, P, N, Q = shape or ((1, 1024, 80, 64, 128, 256) if quick
                                 else (4, 4096, 80, 64, 128, 256))
    dt_ = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(B, L, H, P, device=DEV, generator=g).to(dt_)
    dt = (torch.rand(B, L, H, device=DEV, generator=g) * 0.1 - 4).to(dt_)
    a = -torch.exp(torch.rand(H, device=DEV, generator=g) * 2).to(dt_)
    bias = (torch.rand(H, device=DEV, generator=g) - 0.5).to(dt_)
    b1 = torch.randn(B, L, 1, N, device=DEV, generator=g).to(dt_)
    c1 = torch.randn(B, L, 1, N, device=DEV, generator=g).to(dt_)
    gy = torch.randn(B, L, H, P, device=DEV, generator=g).to(dt_)
    gl = torch.zeros(B, H, P, N, device=DEV, dtype=dt_)
    bE, cE = b1.expand(B, L, H, N), c1.expand(B, L, H, N)
    shape = (B, L, H, P, N, Q)
    kw = dict(chunk_size=Q, dt_softplus=True, has_d=False, has_z=False, has_dt_bias=True,
              has_initial_states=False)
    split = KD.ssd_bwd_config(B, L, H, P, N, dt_, split=1)
    fused = KD.ssd_bwd_config(B, L, H, P, N, dt_, split=0)
    bwd = lambda bcfg: KD.ssd_chunk_scan_backward(x, dt, a, bE, cE, bias, gy, gl, **kw,
                                                  config=bcfg)

    def fb(bcfg):
        KD.ssd_chunk_scan(x, dt, a, bE, cE, bias, **kw)
        return bwd(bcfg)
    print(f"  ssd backward configs: split {tuple(split)}, fused {tuple(fused)}", flush=True)
    if {"grads", "split", "fused"} <= parts and not WARM[0]:
        new, old = bwd(split), bwd(fused)
        for name, gn, go in zip(("x", "dt", "a", "b", "c", "dt_bias"), new, old):
            gn, go = gn.float(), go.float()
            err = ((gn - go).abs().max() / go.abs().max().clamp_min(1e-30)).item()
            print(f"  grad {name:8s} split vs fused: max |diff| / max |fused| = {err:.2e}"
                  f"  (max |fused| {go.abs().max().item():.3e})", flush=True)
        del new, old
    if "fwd" in parts:
        rec("ssd_chunk_scan", "fuelgraph", shape, dt_,
            bench(lambda: KD.ssd_chunk_scan(x, dt, a, bE, cE, bias, **kw), quick))
    for label, bcfg in (("split", split), ("fused", fused)):
        if label not in parts:
            continue
        rec("ssd_chunk_scan_fwd+bwd", f"fuelgraph[{label}]", shape, dt_,
            bench(lambda: fb(bcfg), quick))
        rec("ssd_chunk_scan_bwd", f"fuelgraph[{label}]", shape, dt_,
            bench(lambda: bwd(bcfg), quick))
    if sweep and "sweep" in parts:
        if not WARM[0]:
            kernel_times(lambda: bwd(split))
        # (q, warps, stages, split, bm, bp, bn)
        for bcfg in configs or [(256, 4, 2, 1, 64, 64, 128), (128, 4, 2, 1, 64, 64, 64),
                                (128, 4, 3, 1, 64, 64, 128)]:
            try:
                rec("ssd_chunk_scan_bwd", f"fuelgraph[bwd {bcfg}]", shape, dt_,
                    bench(lambda: bwd(bcfg), quick))
            except Exception as exc:
                print(f"  bwd cfg {bcfg} failed: {exc!r}", flush=True)
    return []


def ssd_rows(mamba, why, quick, sweep):
    B, L, H, P, N, Q = (1, 1024, 80, 64, 128, 256) if quick else (4, 4096, 80, 64, 128, 256)
    dt_ = torch.bfloat16
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(B, L, H, P, device=DEV, generator=g).to(dt_)
    dt = (torch.rand(B, L, H, device=DEV, generator=g) * 0.1 - 4).to(dt_)
    a = -torch.exp(torch.rand(H, device=DEV, generator=g) * 2).float()
    bias = (torch.rand(H, device=DEV, generator=g) - 0.5).float()
    b1 = torch.randn(B, L, 1, N, device=DEV, generator=g).to(dt_)
    c1 = torch.randn(B, L, 1, N, device=DEV, generator=g).to(dt_)
    gy = torch.randn(B, L, H, P, device=DEV, generator=g).to(dt_)
    shape = (B, L, H, P, N, Q)
    bE, cE = b1.expand(B, L, H, N), c1.expand(B, L, H, N)
    a16, bias16 = a.to(dt_), bias.to(dt_)
    kw = dict(chunk_size=Q, dt_softplus=True, has_d=False, has_z=False, has_dt_bias=True,
              has_initial_states=False)
    ours = lambda cfg=None: KD.ssd_chunk_scan(x, dt, a16, bE, cE, bias16, **kw, config=cfg)
    gl = torch.zeros(B, H, P, N, device=DEV, dtype=dt_)

    def ours_fb(cfg=None, bcfg=None):
        KD.ssd_chunk_scan(x, dt, a16, bE, cE, bias16, **kw, config=cfg)
        return KD.ssd_chunk_scan_backward(x, dt, a16, bE, cE, bias16, gy, gl, **kw, config=bcfg)

    print(f"  ssd configs: forward {tuple(KD.ssd_fwd_config(B, L, H, P, N))}, "
          f"backward {tuple(KD.ssd_bwd_config(B, L, H, P, N, dt_))}")
    ms_f = rec("ssd_chunk_scan", "fuelgraph", shape, dt_, bench(ours, quick))
    try:
        if NO_BWD[0]:
            raise LookupError("--no-bwd")
        ms_fb = rec("ssd_chunk_scan_fwd+bwd", "fuelgraph", shape, dt_, bench(ours_fb, quick))
    except LookupError:
        ms_fb = float("inf")
    except Exception:                   # keep the forward rows and the sweep
        traceback.print_exc()
        ms_fb = float("inf")
    for cfg in SSD_FWD_SWEEP[0]:
        try:
            rec("ssd_chunk_scan", f"fuelgraph[{cfg}]", shape, dt_, bench(lambda: ours(cfg), quick))
        except Exception as exc:
            print(f"  cfg {cfg} failed: {exc!r}")
    if sweep:
        # backward: (q, warps, stages, split, bm, bp, bn): the fused kernel, split configs
        for bcfg in [(32, 8, 1, 0), (256, 8, 2, 1, 64, 64, 64), (128, 4, 2, 1, 64, 64, 64)]:
            try:
                rec("ssd_chunk_scan_fwd+bwd", f"fuelgraph[bwd {bcfg}]", shape, dt_,
                    bench(lambda: ours_fb(None, bcfg), quick))
            except Exception as exc:
                print(f"  bwd cfg {bcfg} failed: {exc!r}")
        ssd_parts(x, dt, a16, bE, cE, bias16, gy, gl, kw, shape, quick)
        # forward: (q, bm, bk, bp, bn, warps, stages, state warps, state stages, cb); the cb
        # variants are compared by the parts above
        for cfg in [(256, 64, 64, 64, 64, 4, 3, 8, 3, 2), (256, 64, 64, 64, 64, 8, 2, 8, 3, 2),
                    (256, 64, 64, 64, 32, 4, 2, 4, 3, 2), (256, 128, 64, 64, 64, 8, 2, 8, 3, 2)]:
            try:
                rec("ssd_chunk_scan", f"fuelgraph[{cfg}]", shape, dt_,
                    bench(lambda: ours(cfg), quick))
            except Exception as exc:
                print(f"  cfg {cfg} failed: {exc!r}")
    rows = [["ssd_chunk_scan fwd bf16", ms_f, None, "<= 0.6 ms", ms_f <= 0.6],
            ["ssd_chunk_scan fwd+bwd bf16", ms_fb, None, "<= 3.5 ms", ms_fb <= 3.5]]

    def anchor_rows():          # run last: mamba_ssm's autotuning compiles many configs
        if mamba is None:
            print(f"  mamba_ssm rows skipped: {why}")
            return

        xm = x.clone().requires_grad_(True)
        run = lambda: mamba(x, dt, a, b1, c1, Q, dt_bias=bias, dt_softplus=True)
        rows[0][2] = rec("ssd_chunk_scan", "mamba_ssm", shape, dt_, bench(run, quick))

        def run_fb():
            out = mamba(xm, dt, a, b1, c1, Q, dt_bias=bias, dt_softplus=True)
            out.backward(gy)
        rows[1][2] = rec("ssd_chunk_scan_fwd+bwd", "mamba_ssm", shape, dt_,
                         bench(run_fb, quick))
        ym = run()
        yo, _ = ours()
        err = (ym.float() - yo.float()).abs().max().item() / ym.float().abs().max().item()
        print(f"  ours vs mamba_ssm: max |diff| / max |y| = {err:.2e}")
    return rows, anchor_rows


def ssd_parts(x, dt, a, b, c, bias, gy, gl, kw, shape, quick):
    """Each kernel of the default forward and backward timed alone (same inputs), as
    ssd_chunk_scan[part] rows: where the time goes."""
    B, L, H, P = x.shape
    N = b.shape[3]
    cfg = KD.ssd_fwd_config(B, L, H, P, N)
    parts = {}
    try:
        dtp, acum = KD._launch_dt(dt, a, bias, B, L, H, cfg.q, True, True)
        NC = -(-L // cfg.q)
        st = torch.empty((B * H, NC, P, N), dtype=x.dtype, device=DEV)
        hl = torch.empty((B, H, P, N), dtype=x.dtype, device=DEV)
        y = torch.empty_like(x)
        parts["fwd dt"] = lambda: KD._launch_dt(dt, a, bias, B, L, H, cfg.q, True, True)
        parts["fwd state"] = lambda: KD._launch_state(x, b, x, dtp, acum, x, st, hl, cfg.q,
                                                      cfg, False)
        parts["fwd cb"] = lambda: KD._launch_cb(b, c, cfg.q, cfg.bm)
        for cb in (0, 1, 2):
            parts[f"fwd scan cb={cb}"] = (lambda cb=cb: KD._launch_scan(
                x, b, c, x, x, dtp, acum, st, y, cfg.q, cfg._replace(cb=cb), False, False))
        bq = KD.ssd_bwd_config(B, L, H, P, N, x.dtype).q
        bdtp, bacum = KD._launch_dt(dt, a, bias, B, L, H, bq, True, True)
        bcfg = KD.ssd_config(B, L, H, P, N)._replace(q=bq, bm=min(64, bq), bk=min(64, bq))
        bst = torch.empty((B * H, -(-L // bq), P, N), dtype=x.dtype, device=DEV)
        hl32 = torch.empty((B, H, P, N), dtype=torch.float32, device=DEV)
        parts["bwd state"] = lambda: KD._launch_state(x, b, x, bdtp, bacum, x, bst, hl32, bq,
                                                      bcfg, False)
        parts["bwd reverse state"] = lambda: KD._launch_state(
            gy, c, x, bdtp, bacum, gl, bst, hl32, bq, bcfg, True, reverse=True)
        parts["bwd all"] = lambda: KD.ssd_chunk_scan_backward(x, dt, a, b, c, bias, gy, gl, **kw)
    except Exception:
        traceback.print_exc()
    for name, fn in parts.items():
        try:
            rec(f"ssd_chunk_scan[{name}]", "fuelgraph", shape, x.dtype, bench(fn, quick))
        except Exception as exc:
            print(f"  part {name} failed: {exc!r}")


def ss_inputs(B, L, D, N, dtype, g):
    u = torch.randn(B, L, D, device=DEV, generator=g).to(dtype)
    delta = (torch.randn(B, L, D, device=DEV, generator=g) * 0.5 - 1).to(dtype)
    a = -torch.exp(torch.randn(D, N, device=DEV, generator=g) * 0.5).to(dtype)
    b = torch.randn(B, L, N, device=DEV, generator=g).to(dtype)
    c = torch.randn(B, L, N, device=DEV, generator=g).to(dtype)
    return u, delta, a, b, c


def ss_rows(quick, sweep, f32=True):
    g = torch.Generator(device=DEV).manual_seed(1)
    rows = []
    # bf16 forward vs the bandwidth ceiling
    # (first: the reference loops below are slow)
    shape = (2, 1024, 4096, 16) if quick else (8, 2048, 4096, 16)
    B, L, D, N = shape
    ins16 = ss_inputs(*shape, torch.bfloat16, g)
    nbytes = 2 * (3 * B * L * D + 2 * B * L * N + D * N + B * D * N)
    ms16 = bench(lambda: KS.selective_scan(*ins16, **SS_KW), quick)
    gbps = nbytes / ms16 / 1e6
    print(f"  selective_scan bf16 forward config {KS.ss_fwd_config(*shape)}")
    rec("selective_scan", "fuelgraph", shape, torch.bfloat16, ms16, gbps=gbps)
    ceil_ms = nbytes / (CEILING_TBS * 1e12) * 1e3
    rec("selective_scan", f"bytes at {CEILING_TBS} TB/s", shape, torch.bfloat16, ceil_ms,
        gbps=CEILING_TBS * 1e3)
    if sweep or SS_GIVEN[0]:
        # forward (T, BD, warps, poly, pf): BD channels over warps * 32 threads, poly of the 16
        # states' exponentials on the FMA pipe
        y0 = KS.selective_scan(*ins16, **SS_KW)[0].float()
        if not WARM[0]:         # the default against the float32 reference loop
            cm = [t.transpose(1, 2).contiguous() for t in (ins16[0], ins16[1])]
            bm = [t.transpose(1, 2).contiguous() for t in (ins16[3], ins16[4])]
            y_ref = torch_selective_scan_ref(cm[0], cm[1], ins16[2], bm[0], bm[1])[0]
            y_ref = y_ref.transpose(1, 2)
            err = ((y0 - y_ref).abs().max() / y_ref.abs().max()).item()
            print(f"  selective_scan bf16 default vs float32 reference loop: "
                  f"max |diff| / max |y| = {err:.2e}")
        for cfg in SS_SWEEP[0]:
            try:
                m = bench(lambda: KS.selective_scan(*ins16, **SS_KW, config=cfg), quick)
                dy = (KS.selective_scan(*ins16, **SS_KW, config=cfg)[0].float() - y0).abs().max()
                rec("selective_scan", f"fuelgraph[{cfg}]", shape, torch.bfloat16, m,
                    gbps=nbytes / m / 1e6, max_diff_vs_default=round(dy.item(), 5))
            except Exception as exc:
                print(f"  cfg {cfg} failed: {exc!r}")
    rows.append(("selective_scan fwd bf16", ms16, ceil_ms, ">= 50% of ceiling",
                 ceil_ms / ms16 >= 0.5))
    if not f32:
        return rows
    # f32 forward vs the reference loop
    shape = (2, 1024, 1536, 16)
    ins = ss_inputs(*shape, torch.float32, g)
    cm = [t.transpose(1, 2).contiguous() for t in (ins[0], ins[1])]
    bm = [t.transpose(1, 2).contiguous() for t in (ins[3], ins[4])]
    ref = lambda: torch_selective_scan_ref(cm[0], cm[1], ins[2], bm[0], bm[1])
    ours = lambda cfg=None: KS.selective_scan(*ins, **SS_KW, config=cfg)
    y_ref = ref()[0].transpose(1, 2)
    err = ((ours()[0] - y_ref).abs().max() / y_ref.abs().max()).item()
    print(f"  selective_scan f32 vs reference loop: rel err {err:.1e}")
    ms = rec("selective_scan", "fuelgraph", shape, torch.float32, bench(ours, quick))
    ms_ref = rec("selective_scan", "torch eager", shape, torch.float32,
                 bench(ref, True), anchor="Mamba selective_scan_ref loop")
    rows.append(("selective_scan fwd f32", ms, ms_ref, "<= 0.2 ms", ms <= 0.2))
    # fwd+bwd vs the reference loop's autograd
    gy = torch.randn(*shape[:3], device=DEV, generator=g)
    gl = torch.zeros(shape[0], shape[2], shape[3], device=DEV)
    leaves = [t.clone().requires_grad_(True) for t in (cm[0], cm[1], ins[2], bm[0], bm[1])]
    gyc = gy.transpose(1, 2)

    def ref_fb():
        y, _ = torch_selective_scan_ref(*leaves)
        torch.autograd.grad(y, leaves, gyc)

    def ours_fb(cfg=None):                      # cfg: the backward's (T, BD, warps)
        KS.selective_scan(*ins, **SS_KW)
        return KS.selective_scan_backward(*ins, gy, gl, **SS_KW, config=cfg)
    ms_fb = rec("selective_scan_fwd+bwd", "fuelgraph", shape, torch.float32, bench(ours_fb, quick))
    ms_rfb = rec("selective_scan_fwd+bwd", "torch eager", shape, torch.float32,
                 bench(ref_fb, True), anchor="Mamba selective_scan_ref loop, autograd")
    rows.append(("selective_scan fwd+bwd", ms_fb, ms_rfb, ">= 200x faster",
                 ms_rfb / ms_fb >= 200))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--mamba-src", default=None)
    ap.add_argument("--path", action="append", default=[])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smaller shapes, shorter timing")
    ap.add_argument("--rep", type=int, default=None, help="timing budget per case, ms")
    ap.add_argument("--no-f32", action="store_true",
                    help="skip the float32 selective-scan rows (slow torch reference loops)")
    ap.add_argument("--cases", default="ssd,ss",
                    help="comma list of ssd (forward; + fwd+bwd unless --no-bwd), ss")
    ap.add_argument("--no-bwd", action="store_true", help="ssd: forward rows only")
    ap.add_argument("--warm", action="store_true", help="run each case once, no timing")
    ap.add_argument("--ssd-configs", default=None,
                    help="ssd forward configs 'q,bm,bk,bp,bn,warps,stages,swarps,sstages,cb;...'")
    ap.add_argument("--ss-configs", default=None,
                    help="selective-scan sweep configs 'T,BD,warps,poly[,pf];...'")
    ap.add_argument("--ssd-bwd", action="store_true",
                    help="only the SSD fwd+bwd case: split against fused backward")
    ap.add_argument("--no-fused", action="store_true", help="--ssd-bwd without the fused one")
    ap.add_argument("--bwd-configs", default=None,
                    help="--ssd-bwd --sweep configs: 'q,warps,stages,split,bm,bp,bn[,zcb];...'")
    ap.add_argument("--parts", default=None,
                    help="--ssd-bwd: comma list of grads, fwd, split, fused, sweep (default all)")
    args = ap.parse_args()
    REP_MS[0] = args.rep
    NO_BWD[0] = args.no_bwd
    WARM[0] = args.warm
    if args.ssd_configs:
        SSD_FWD_SWEEP[0] = [tuple(int(v) for v in c.split(","))
                            for c in args.ssd_configs.split(";")]
    if args.ss_configs:
        SS_GIVEN[0] = True
        SS_SWEEP[0] = [tuple(int(v) for v in c.split(",")) for c in args.ss_configs.split(";")]
    cases = set(args.cases.split(","))
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        JSONL[0] = pathlib.Path(args.out) / "records.jsonl"
    mamba, why = import_mamba_ssd(args.mamba_src, args.path)
    rows, anchor_rows = [], None
    if args.ssd_bwd:
        try:
            cfgs = args.bwd_configs and [tuple(int(v) for v in c.split(","))
                                         for c in args.bwd_configs.split(";")]
            ssd_bwd_compare(args.quick, args.sweep, fused_too=not args.no_fused, configs=cfgs,
                            parts=args.parts and args.parts.split(","))
        except Exception:
            traceback.print_exc()
    else:
        try:
            if "ssd" in cases:
                ssd, anchor_rows = ssd_rows(mamba, why, args.quick, args.sweep)
                rows += ssd
        except Exception:
            traceback.print_exc()
        ss_part = ((lambda: ss_rows(args.quick, args.sweep, not args.no_f32))
                   if "ss" in cases else None)
        for part in (ss_part, anchor_rows):
            try:
                rows += (part and part()) or []
            except Exception:
                traceback.print_exc()
    day = datetime.date.today().isoformat()
    doc = {"machine": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "records": RECORDS}
    for d in filter(None, [ROOT / "bench" / "results", args.out and pathlib.Path(args.out)]):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"cuda_ssm_{day}.json").write_text(json.dumps(doc, indent=1))
    print("\ntarget                        fuelgraph ms   anchor ms     ratio   target             met")
    for name, ms, anchor, target, ok in rows:
        ratio = f"{anchor / ms:8.2f}x" if anchor else "       -"
        a = f"{anchor:10.4f}" if anchor else "         -"
        print(f"{name:28s} {ms:12.4f} {a}  {ratio}   {target:18s} {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
