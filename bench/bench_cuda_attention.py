#!/usr/bin/env python3
"""flash_attn and its backward on one CUDA GPU against torch scaled_dot_product_attention with
the FlashAttention-2 ("flash") and cuDNN ("cudnn") backends, in one process, bf16, D 128 --
every row of issue 12's table:

  row  case                                   anchors                          target
  1    causal fwd B4 H32 S4096                flash, cudnn                     >= 450 TFLOP/s
  2    non-causal fwd B4 H32 S4096            flash, cudnn                     >= 1.3x flash
  3    causal fwd+bwd B4 H32 S4096            flash, cudnn                     <= flash time
  4    GQA 32/8 causal fwd B4 S4096           SDPA on expanded k/v (+ enable_gqa)   >= 1.3x
  5    window 1024 / softcap 50 / ALiBi       our plain causal (equal work)    <= 1.15x each
  6    long context B1 H32 S32768 causal fwd  flash                            >= flash

TFLOP/s count the multiply-adds of the admissible (query, key) pairs only: 4 * D per pair
forward, 2.5x that backward (FlashAttention's convention). Impls: "fuelgraph" (the op through a
cached fuelgraph plan; fwd+bwd = flash_attn + its three backward ops as autograd builds them,
which run as one combined node), "fuelgraph kernel" (the Triton kernels called directly; row 3
also records the backward alone), "flash" / "cudnn" (torch SDPA backends), "flash
expanded" (SDPA flash on k/v already repeated to 32 heads; the copy is not timed),
"flash_attn pkg" (the flash-attn package, when importable). Each result is checked against
SDPA before it is timed (field max_err).

    python3 bench/bench_cuda_attention.py [--out DIR] [--quick] [--rows 1,3]
        [--configs "128,64,8,3;128,128,8,3"] [--ws-configs "128,64,4,2"] [--sweep]
        [--schedules "base;FMA_SCORES=0;CONFIG=64.64.4.3"]
        [--schedule-cases "window 1024,softcap 50,alibi"] [--rounds 3] [--paired 20]
        [--ab "base;plan;WS_HEADS=1" --rounds 3 [--non-causal]] [--interleaved]
        [--row5-rounds 60] [--methods]

--warm I/N compiles (no timing) the I-th of N parts of the forward kernels that rows 1, 2, 4,
5 and 6 (with --configs and --sweep) will use, on small tensors with the same
specializations, into Triton's disk cache: N such processes in parallel take the cold
compiles off the timed run. --configs narrows the Triton forward's autotuning to these
(BLOCK_M, BLOCK_N, warps, stages) choices (each is a compile per flag set), --ws-configs the
warp-specialized forward's (causal 16-bit cases); --sweep records every tuned forward
config's time (impl "config M,N,W,S"), the config each case chose, and row 5 again with each
code variant of
`attention.VARIANTS` flipped (impl "fuelgraph kernel <VARIANT>=<value>").

--schedules times plain causal and window 1024 (row 5's shapes) under each setting of
`attention.VARIANTS` (";"-separated, each "KEY=VALUE,..." or "base"; CONFIG=M.N.W.S pins the
forward's launch config for that setting, WSCONFIG=M.N.W.S the warp-specialized forward's
(W: one consumer's warps); impl "fuelgraph kernel <setting>") and prints causal
TFLOP/s and the window's time per unit of work against plain causal's, setting by setting
(with --warm, it compiles those kernels instead). --schedule-cases adds row 5's other cases
("softcap 50,alibi"); --rounds R repeats the settings R times interleaved and prints each
setting's medians; --paired N times each case against plain causal in N alternating batches
(paired_ms: the ratio is immune to drift between two timings); --tag names its JSON
(cuda_attention_<date>_<tag>.json).

Row 5 times its four cases call by call, interleaved over 60 rounds in one process
(gpu_timing.interleaved_ms: an L2 flush before each call, as do_bench), and reports the
median of the rounds' time ratios to plain causal per unit of work; --row5-rounds N sets the
rounds (0: one do_bench timing a case, in turn, as before session 11). --schedules ...
--interleaved times every (setting, case) in the same interleaved rounds (--rounds, default
40; no CONFIG / WSCONFIG settings). --methods times row 5's cases several ways (methods_row:
host time a call, do_bench in turn, do_bench with the host ahead, interleaved, paired_ms).

--ab times row 1's case (row 2's with --non-causal) under each setting ("plan": the cached
fuelgraph plan with the defaults), the settings interleaved over --rounds rounds, and prints
each setting's median: clocks drift over a run, so a setting timed once, after another, can
lose ~5% to the drift alone (the first timed case of a process runs on the coolest GPU).

Writes bench/results/cuda_attention_<date>.json (and DIR/cuda_attention_<date>.json), prints
each record as it is measured, then the targets table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys
import time
import traceback

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from fuelgraph.backends.cuda.kernels import attention as K  # noqa: E402
from fuelgraph.backends.cuda.kernels import attention_ws as W  # noqa: E402
from fuelgraph.ir.tensor import bound_data  # noqa: E402
from fuelgraph.runtime.executor import compile_plan  # noqa: E402
from gpu_timing import (ahead_ms, host_ms, interleaved_ms, median, paired_ms,  # noqa: E402
                        ratio_stats)

try:
    from flash_attn import flash_attn_func
    HAVE_FLASH_PKG = True
except Exception as exc:  # noqa: BLE001
    print(f"[bench] flash_attn package not importable: {exc!r}", file=sys.stderr)
    HAVE_FLASH_PKG = False

DEV = torch.device("cuda")
DT = torch.bfloat16
D = 128
DATE = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
RECORDS: list[dict] = []
REP = {"warmup": 25, "rep": 100}
SWEEP = {"on": False}
SDPA = torch.nn.functional.scaled_dot_product_attention
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def t_ms(fn) -> float:
    return float(do_bench(fn, warmup=REP["warmup"], rep=REP["rep"], return_mode="median"))


def pairs(sq, sk, causal=False, wl=None):
    """Admissible (query, key) pairs of one head, bottom-right aligned."""
    off = sk - sq
    total = 0
    if not causal and wl is None:
        return sq * sk
    for i in range(sq):                   # closed forms would do; this is exact and fast enough
        a = i + off
        hi = min(sk, a + 1) if causal else sk
        lo = max(0, a - wl) if wl is not None else 0
        total += max(0, hi - lo)
    return total


def fwd_tuning():
    """{"config": the config the forward's autotuner chose for its last key} and, with --sweep,
    the time of every config it tried (the warp-specialized kernel's when WARP_SPEC is on)."""
    kern = W._fwd_ws_kernel if K.VARIANTS["WARP_SPEC"] else K._fwd_kernel
    best = getattr(kern, "best_config", None)
    if best is None:
        return {}
    tag = lambda c: "{},{},{},{}".format(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"],  # noqa: E731
                                         c.num_warps, c.num_stages)
    out = {"config": tag(best)}
    if SWEEP["on"]:
        timings = getattr(kern, "configs_timings", None) or {}
        out["sweep"] = {tag(c): round(float(t[0] if isinstance(t, (list, tuple)) else t), 5)
                        for c, t in timings.items()}
    return out


def record(row, case, impl, ms, flops, err=None, **extra):
    rec = {"op": case["op"], "impl": impl, "row": row, "case": case["name"],
           "device": torch.cuda.get_device_name(), "shape": case["shape"], "dtype": "bfloat16",
           "ms": round(ms, 5), "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "date": DATE}
    if err is not None:
        rec["max_err"] = float(err)
    rec.update(extra)
    RECORDS.append(rec)
    e = f"  err {rec['max_err']:.2e}" if err is not None else ""
    e += f"  config {rec['config']}" if "config" in rec else ""
    e += "  sweep " + " ".join(f"{k}:{v}" for k, v in rec["sweep"].items()) if "sweep" in rec \
        else ""
    print(f"  row {row} {case['name']:28s} {impl:30s} {ms:9.4f} ms {rec['tflops']:7.1f} TFLOP/s{e}",
          flush=True)
    return rec


def rand(*shape):
    return torch.randn(*shape, device=DEV, dtype=DT)


def params(causal=False, wl=None, softcap=None, alibi=False):
    return dict(softmax_scale=1 / math.sqrt(D), causal=causal, window_size_left=wl,
                window_size_right=None, softcap=softcap, k_len=None, has_alibi=alibi,
                k_len_input=False)


def sdpa(backend, q, k, v, causal, gqa=False):
    with sdpa_kernel(BACKENDS[backend]):
        return SDPA(q, k, v, is_causal=causal, enable_gqa=gqa)


def plan_of(build, tensors):
    """A closure running the cached fuelgraph plan of build(*fg tensors sharing `tensors`)."""
    ts = [fg.from_torch(t) for t in tensors]
    outs = build(*ts)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    plan, ins = compile_plan([o.value for o in outs], False)
    bufs = [bound_data(n) for n in ins]
    return lambda: plan.run(bufs)


def maxerr(a, b):
    return (a.float() - b.float()).abs().max().item()


# ---- rows ---------------------------------------------------------------------------------------
def forward_row(row, name, B, H, HKV, S, causal, anchors=("flash", "cudnn")):
    case = {"op": "flash_attn", "name": name, "shape": [B, H, HKV, S, S, D]}
    q, k, v = rand(B, H, S, D), rand(B, HKV, S, D), rand(B, HKV, S, D)
    flops = 4.0 * D * pairs(S, S, causal) * B * H
    p = params(causal)
    out, _ = K.flash_attn(q, k, v, **p)
    ref = sdpa("flash", q, k, v, causal, gqa=HKV != H)
    err = maxerr(out, ref)
    res = {"fuelgraph kernel": record(row, case, "fuelgraph kernel",
                                      t_ms(lambda: K.flash_attn(q, k, v, **p)), flops, err,
                                      **fwd_tuning())}
    run = plan_of(lambda a, b, c: F.flash_attn(a, b, c, causal=causal), [q, k, v])
    res["fuelgraph"] = record(row, case, "fuelgraph", t_ms(run), flops, maxerr(run()[0], ref))
    for name_ in anchors:
        try:
            got = sdpa(name_, q, k, v, causal, gqa=HKV != H)
            res[name_] = record(row, case, name_, t_ms(lambda: sdpa(name_, q, k, v, causal,
                                                                      gqa=HKV != H)),
                                flops, maxerr(got, ref))
        except Exception as exc:  # noqa: BLE001
            print(f"  row {row} {name_} unavailable: {exc!r}", flush=True)
    if HKV != H:
        ke, ve = (x.repeat_interleave(H // HKV, 1) for x in (k, v))
        res["flash expanded"] = record(row, case, "flash expanded",
                                       t_ms(lambda: sdpa("flash", q, ke, ve, causal)), flops,
                                       maxerr(sdpa("flash", q, ke, ve, causal), ref))
    if HAVE_FLASH_PKG:
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        res["flash_attn pkg"] = record(row, case, "flash_attn pkg",
                                       t_ms(lambda: flash_attn_func(qt, kt, vt, causal=causal)),
                                       flops)
    return res


def fwd_bwd_row(row, B, H, S):
    case = {"op": "flash_attn_fwd+bwd", "name": "causal fwd+bwd", "shape": [B, H, H, S, S, D]}
    q, k, v, g = (rand(B, H, S, D) for _ in range(4))
    flops = 3.5 * 4.0 * D * pairs(S, S, True) * B * H
    p = params(True)
    tq, tk, tv = (x.clone().requires_grad_() for x in (q, k, v))

    def anchor(name_):
        with sdpa_kernel(BACKENDS[name_]):
            o = SDPA(tq, tk, tv, is_causal=True)
            return (o,) + torch.autograd.grad(o, (tq, tk, tv), g)
    ref = anchor("flash")

    def ours():
        out, lse = K.flash_attn(q, k, v, **p)
        delta = (g.float() * out.float()).sum(-1)
        return (out,) + K.flash_attn_backward(q, k, v, g, lse, delta, **p)
    res = {"fuelgraph kernel": record(row, case, "fuelgraph kernel", t_ms(ours), flops,
                                      max(maxerr(a, b) for a, b in zip(ours(), ref)))}
    out, lse = K.flash_attn(q, k, v, **p)
    delta = (g.float() * out.float()).sum(-1)
    bcase = dict(case, op="flash_attn_bwd", name="causal bwd")
    record(row, bcase, "fuelgraph kernel", t_ms(lambda: K.flash_attn_backward(
        q, k, v, g, lse, delta, **p)), flops / 3.5 * 2.5)

    def build(a, b, c, gr):
        out = F.flash_attn(a, b, c, causal=True)
        return [out] + fg.grad([out], [a, b, c], [gr])
    run = plan_of(build, [q, k, v, g])
    res["fuelgraph"] = record(row, case, "fuelgraph", t_ms(run), flops,
                              max(maxerr(a, b) for a, b in zip(run(), ref)))
    for name_ in BACKENDS:
        try:
            got = anchor(name_)
            res[name_] = record(row, case, name_, t_ms(lambda: anchor(name_)), flops,
                                max(maxerr(a, b) for a, b in zip(got, ref)))
        except Exception as exc:  # noqa: BLE001
            print(f"  row {row} {name_} unavailable: {exc!r}", flush=True)
    return res


def variant_cases(H):
    """(name, params, optional inputs, window) of row 5."""
    slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], device=DEV)
    return (("plain causal", params(True), (), None),
            ("window 1024", params(True, wl=1024), (), 1024),
            ("softcap 50", params(True, softcap=50.0), (), None),
            ("alibi", params(True, alibi=True), (slopes,), None))


def flipped(name):
    """The code variants row 5 measures flipped for case `name` (with --sweep)."""
    return [v for v in K.VARIANTS if isinstance(K.VARIANTS[v], bool)
            and (v != "ALIBI_COLS" or name == "alibi")
            and (v != "FMA_SCORES" or name != "alibi")]


def warm(part, nparts):
    """Compile the forward kernels of rows 1, 2, 4, 5 and 6 (every flag set, each config the
    kernel that runs it tunes over: narrow them with --configs / --ws-configs; with --sweep
    each variant flipped) in this part, without timing."""
    B, H, S = 1, 16, 256      # the specializations of B4 H32 S4096: sizes divisible by 16
    q, k, v = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
    kg, vg = rand(B, H // 4, S, D), rand(B, H // 4, S, D)
    cases = [(name, p, opt, k, v) for name, p, opt, _ in variant_cases(H)] + \
        [("non-causal", params(False), (), k, v), ("gqa causal", params(True), (), kg, vg)]
    jobs = [(case, var) for case in cases
            for var in [None] + (flipped(case[0]) if SWEEP["on"] else [])]
    for n, ((name, p, opt, kk, vv), var) in enumerate(jobs):
        if n % nparts != part:
            continue
        if var:
            K.VARIANTS[var] = not K.VARIANTS[var]
        try:
            K.flash_attn(q, kk, vv, *opt, **p)
            if DEV.type == "cuda":
                torch.cuda.synchronize()
            print(f"warm {name} {var}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"warm {name} {var} failed: {exc!r}", flush=True)
        finally:
            if var:
                K.VARIANTS[var] = not K.VARIANTS[var]


def parse_schedules(text):
    """[(name, {VARIANT: value})] from "base;FMA_SCORES=0;FMA_SCORES=0,CONFIG=64.64.4.3"
    (CONFIG: the forward's launch config for that setting, M.N.warps.stages)."""
    out = []
    for spec in filter(None, (x.strip() for x in text.split(";"))):
        kv = {}
        for item in filter(None, spec.split(",")) if spec not in ("base", "plan") else ():
            key, val = item.split("=")
            kv[key] = (val if key in ("CONFIG", "WSCONFIG") else int(val)
                       if val.isdigit() and int(val) > 1 else val not in ("0", "false"))
        out.append((spec, kv))
    return out


def with_variants(kv, fn):
    """fn() with these VARIANTS (and CONFIG: the forward autotuner's configs, its cache
    cleared before and after)."""
    kv = dict(kv)
    config = kv.pop("CONFIG", None)
    ws_config = kv.pop("WSCONFIG", None)
    old = {k: K.VARIANTS[k] for k in kv}
    old_configs = K._fwd_kernel.configs
    old_ws = W._fwd_ws_kernel.configs
    K.VARIANTS.update(kv)
    if config:
        K._fwd_kernel.configs = [K.fwd_config(*map(int, config.split(".")))]
        K._fwd_kernel.cache.clear()
    if ws_config:
        W._fwd_ws_kernel.configs = [W.ws_config(*map(int, ws_config.split(".")))]
        W._fwd_ws_kernel.cache.clear()
    try:
        return fn()
    finally:
        K.VARIANTS.update(old)
        if config:
            K._fwd_kernel.configs = old_configs
            K._fwd_kernel.cache.clear()
        if ws_config:
            W._fwd_ws_kernel.configs = old_ws
            W._fwd_ws_kernel.cache.clear()


SCHEDULE_CASES = ["plain causal", "window 1024"]


def schedule_cases(H):
    """Row 5's cases that --schedules times (--schedule-cases; plain causal always first)."""
    return [c for c in variant_cases(H) if c[0] in SCHEDULE_CASES]


def warm_schedules(specs, part, nparts):
    """Compile plain causal and window 1024 under each setting."""
    B, H, S = 1, 16, 256
    q, k, v = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
    seen, jobs = set(), []
    for spec, kv in specs:
        for case in schedule_cases(H):
            key = (case[0], tuple(sorted(kv.items())))
            if key not in seen:
                seen.add(key)
                jobs.append((spec, kv, case))
    for n, (spec, kv, (name, p, opt, _)) in enumerate(jobs):
        if n % nparts == part:
            with_variants(kv, lambda: K.flash_attn(q, k, v, *opt, **p))
            torch.cuda.synchronize()
            print(f"warm {name} [{spec}]", flush=True)


PAIRED = {"batches": 0}
#: row 5's interleaved rounds (--row5-rounds; 0: one do_bench timing a case, in turn)
ROW5 = {"rounds": 60}


def schedules_row(row, specs, B, H, S, rounds=1):
    """Plain causal and row 5's other cases (SCHEDULE_CASES) under each VARIANTS setting, the
    settings interleaved over `rounds` rounds: (spec, causal TFLOP/s, each case's TFLOP/s and
    time per unit of work / plain causal's) lines a round, then with rounds > 1 each
    setting's medians. With --paired N each case's ratio comes from paired_ms against plain
    causal (N alternating batches), not from two separate do_bench timings."""
    q, k, v = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
    refs, lines = {}, []
    ratios = {spec: {} for spec, _ in specs}
    plain = schedule_cases(H)[0]
    plain_flops = 4.0 * D * pairs(S, S, True, None) * B * H
    for r in range(rounds):
        for spec, kv in specs:
            tf, rat, errs = {}, {}, []
            for name, p, opt, wl in schedule_cases(H):
                case = {"op": "flash_attn", "name": name, "shape": [B, H, H, S, S, D]}
                flops = 4.0 * D * pairs(S, S, True, wl) * B * H
                try:
                    got = with_variants(kv, lambda: K.flash_attn(q, k, v, *opt, **p)[0])
                    refs.setdefault(name, got)
                    err = maxerr(got, refs[name])
                    if PAIRED["batches"] and name != "plain causal":
                        fp = lambda: K.flash_attn(q, k, v, *plain[2], **plain[1])  # noqa: E731
                        fc = lambda: K.flash_attn(q, k, v, *opt, **p)  # noqa: E731
                        ms_p, ms, x = with_variants(kv, lambda: paired_ms(
                            fp, fc, PAIRED["batches"]))
                        rat[name] = x * plain_flops / flops
                        record(row, dict(case, name="plain causal"), f"fuelgraph kernel {spec}",
                               ms_p, plain_flops, round=r, paired_with=name)
                        record(row, case, f"fuelgraph kernel {spec}", ms, flops, err, round=r,
                               paired=True, per_work_vs_plain=round(rat[name], 4))
                    elif PAIRED["batches"]:
                        continue          # timed alongside each other case
                    else:
                        ms = with_variants(kv, lambda: t_ms(lambda: K.flash_attn(q, k, v, *opt,
                                                                                  **p)))
                        record(row, case, f"fuelgraph kernel {spec}", ms, flops, err, round=r,
                               **fwd_tuning())
                    tf[name] = flops / (ms * 1e-3) / 1e12
                    if PAIRED["batches"]:
                        tf.setdefault("plain causal", plain_flops / (ms_p * 1e-3) / 1e12)
                    errs.append(err)
                except Exception as exc:  # noqa: BLE001
                    print(f"  row {row} {name} [{spec}] failed: {exc!r}", flush=True)
            if "plain causal" in tf and len(tf) == len(SCHEDULE_CASES):
                for n in SCHEDULE_CASES:
                    rat.setdefault(n, tf["plain causal"] / tf[n])
                    ratios[spec].setdefault(n, []).append(
                        tf[n] if n == "plain causal" else rat[n])
                rest = "  ".join(f"{n.split()[0]} {tf[n]:5.1f} = {rat[n]:.3f}x"
                                 for n in SCHEDULE_CASES if n != "plain causal")
                lines.append(f"  {spec:34s} causal {tf['plain causal']:6.1f} TFLOP/s  {rest}  "
                             f"err vs first {max(errs):.1e}" + (f"  round {r}" if rounds > 1
                                                                else ""))
    if rounds > 1:
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        lines.append(f"medians over {rounds} interleaved rounds (each round's values after /)")
        for spec, by_case in ratios.items():
            if not by_case:
                continue
            parts = [f"causal {med(by_case['plain causal']):5.1f}"] + [
                f"{n.split()[0]} {med(by_case[n]):.3f}x" for n in SCHEDULE_CASES
                if n != "plain causal" and n in by_case]
            each = " / ".join(",".join(f"{by_case[n][i]:.3g}" for n in SCHEDULE_CASES
                                       if n in by_case) for i in range(len(by_case[
                                           "plain causal"])))
            lines.append(f"  {spec:34s} " + "  ".join(parts) + f"  [{each}]")
    return lines


def interleaved_row(row, specs, B, H, S, rounds):
    """Plain causal and row 5's other cases (SCHEDULE_CASES) under every setting, all timed
    call by call in the same interleaved rounds (gpu_timing.interleaved_ms): each setting's
    causal TFLOP/s, each case's time per unit of work / plain causal's under the same setting,
    and each (setting, case)'s time / the first setting's (medians of the rounds' ratios)."""
    q, k, v = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
    cases = schedule_cases(H)
    work = {name: 4.0 * D * pairs(S, S, True, wl) * B * H for name, _, _, wl in cases}
    fns, errs, refs = {}, {}, {}
    for spec, kv in specs:
        for name, p, opt, _ in cases:
            fn = (lambda kv=kv, p=p, opt=opt: with_variants(
                kv, lambda: K.flash_attn(q, k, v, *opt, **p)))
            try:
                got = fn()[0]
                refs.setdefault(name, got)
                errs[(spec, name)] = maxerr(got, refs[name])
                fns[(spec, name)] = fn
            except Exception as exc:  # noqa: BLE001
                print(f"  row {row} {name} [{spec}] failed: {exc!r}", flush=True)
    times = interleaved_ms(fns, rounds)
    lines, first = [], specs[0][0]
    for spec, _ in specs:
        if (spec, "plain causal") not in times:
            continue
        parts = []
        for name, _, _, _ in cases:
            if (spec, name) not in times:
                continue
            ms = median(times[(spec, name)])
            x = ratio_stats(times, (spec, "plain causal"), (spec, name))[0] * \
                work["plain causal"] / work[name]
            vs = ratio_stats(times, (first, name), (spec, name))[0] \
                if (first, name) in times else float("nan")
            rec = record(row, {"op": "flash_attn", "name": name, "shape": [B, H, H, S, S, D]},
                         f"fuelgraph kernel {spec}", ms, work[name], errs[(spec, name)],
                         rounds=rounds, timing="interleaved", per_work_vs_plain=round(x, 4),
                         time_vs_first=round(vs, 4))
            parts.append(f"{name.split()[0]} {rec['tflops']:5.1f}" + (
                f" = {x:.3f}x" if name != "plain causal" else "") + f" (t {vs:.3f})")
        lines.append(f"  {spec:34s} " + "  ".join(parts))
    return [f"interleaved, {rounds} rounds: TFLOP/s = time per unit of work / plain causal's "
            f"(t: time / the first setting's, median of the rounds' ratios)"] + lines


def methods_row(B, H, S, names=("window 1024", "softcap 50", "alibi")):
    """Row 5's cases timed several ways, each case's ms and time per unit of work / plain
    causal's: the host's time a call (host_ms); do_bench, one case after another; do_bench
    with every launch queued behind a GPU spin (ahead_ms: GPU time only); the four cases
    interleaved call by call (as row 5), each case interleaved with plain causal alone, and
    paired_ms (16 batches of 4 back-to-back calls: the upper median, and the medians of the
    batches where plain / the case went first)."""
    q, k, v = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
    cases = {c[0]: c for c in variant_cases(H)}
    fns = {n: (lambda p=cases[n][1], opt=cases[n][2]: K.flash_attn(q, k, v, *opt, **p))
           for n in ("plain causal",) + tuple(names)}
    work = {n: pairs(S, S, True, cases[n][3]) for n in fns}
    per = lambda n, ms: ms[n] / ms["plain causal"] * work["plain causal"] / work[n]  # noqa
    stamp = lambda what: print(f"[methods] {time.time():.3f} {what}", flush=True)  # noqa
    stamp("host")
    host = {n: host_ms(fn) for n, fn in fns.items()}
    seq = {}
    for n, fn in fns.items():          # (the stamps line up with a clock / power trace)
        stamp(f"do_bench {n}")
        seq[n] = t_ms(fn)
    ahead = {}
    for n, fn in fns.items():
        stamp(f"ahead {n}")
        ahead[n] = ahead_ms(fn)
    stamp("interleaved four")
    four = interleaved_ms(fns, 60)
    stamp("pairs")
    lines = ["  case          host ms  do_bench ms (per work)  ahead ms (per work)  "
             "interleaved 4 ms (per work)  with plain alone  paired (plain first, case first), "
             "the same with the host ahead"]
    for n in fns:
        two = pair = "-"
        if n != "plain causal":
            w = work["plain causal"] / work[n]
            alone = interleaved_ms({"plain causal": fns["plain causal"], n: fns[n]}, 60)
            two = f"{ratio_stats(alone, 'plain causal', n)[0] * w:.3f}"
            _, _, pr, pf, cf = paired_ms(fns["plain causal"], fns[n], 16, detail=True,
                                         head_start_ms=0.0)
            pair = f"{pr * w:.3f} ({median(pf) * w:.3f}, {median(cf) * w:.3f})"
            _, _, pr, pf, cf = paired_ms(fns["plain causal"], fns[n], 16, detail=True)
            pair += f" ahead {pr * w:.3f} ({median(pf) * w:.3f}, {median(cf) * w:.3f})"
        x4 = ratio_stats(four, "plain causal", n)[0] * work["plain causal"] / work[n]
        stamp(f"done {n}")
        lines.append(f"  {n:12s} {host[n]:7.3f}  {seq[n]:7.4f} ({per(n, seq):.3f})        "
                     f"{ahead[n]:7.4f} ({per(n, ahead):.3f})     {median(four[n]):7.4f} "
                     f"({x4:.3f})               {two:16s}  {pair}")
    return lines


def ab_row(row, specs, rounds, B, H, S, causal=True):
    """Plain causal (row 1's case; non-causal: row 2's) under each setting, the settings
    interleaved over `rounds` rounds (clocks and temperature drift over a run: a setting
    measured once, later than another, can lose 5% to the drift alone); the setting "plan"
    times the cached fuelgraph plan with the defaults. Returns (spec, median TFLOP/s, every
    round's) lines."""
    q, k, v = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
    case = {"op": "flash_attn", "name": "causal fwd" if causal else "non-causal fwd",
            "shape": [B, H, H, S, S, D]}
    flops = 4.0 * D * pairs(S, S, causal) * B * H
    p = params(causal)
    ref = sdpa("flash", q, k, v, causal)
    plan = plan_of(lambda a, b, c: F.flash_attn(a, b, c, causal=causal), [q, k, v])
    fns = {}
    for spec, kv in specs:
        if spec == "plan":
            fns[spec] = (plan, lambda fn: fn())
        else:
            fns[spec] = (lambda: K.flash_attn(q, k, v, **p)[0],
                         lambda fn, kv=kv: with_variants(kv, fn))
    got = {}
    for spec, (fn, wrap) in fns.items():      # compile (and check) each setting first
        try:
            out = wrap(fn)
            got[spec] = maxerr(out[0] if isinstance(out, list) else out, ref)
        except Exception as exc:  # noqa: BLE001
            print(f"  row {row} [{spec}] failed: {exc!r}", flush=True)
    tf = {spec: [] for spec in got}
    for r in range(rounds):
        for spec in got:
            fn, wrap = fns[spec]
            ms = wrap(lambda: t_ms(fn))
            rec = record(row, case, "fuelgraph" if spec == "plan" else f"fuelgraph kernel {spec}",
                         ms, flops, got[spec], round=r)
            tf[spec].append(rec["tflops"])
    return [f"  {spec:34s} median {sorted(t)[len(t) // 2]:6.1f} TFLOP/s  rounds "
            + " ".join(f"{x:.1f}" for x in t) + f"  err {got[spec]:.1e}" for spec, t in tf.items()]


def variants_row(row, B, H, S):
    """Our kernel with sliding window 1024, softcap 50, ALiBi (each with causal) vs our plain
    causal, compared per unit of work: the four cases timed call by call, interleaved over
    ROW5["rounds"] rounds (gpu_timing.interleaved_ms); each case's ms is its median, its
    per_work_vs_plain the median of the rounds' time ratios to plain causal times plain
    causal's work / the case's. ROW5["rounds"] = 0: one do_bench timing a case, in turn."""
    q, k, v = rand(B, H, S, D), rand(B, H, S, D), rand(B, H, S, D)
    res, refs = {}, {}
    cases = variant_cases(H)
    work = {name: 4.0 * D * pairs(S, S, True, wl) * B * H for name, _, _, wl in cases}
    fns = {name: (lambda p=p, opt=opt: K.flash_attn(q, k, v, *opt, **p)) for name, p, opt, _
           in cases}
    for name, fn in fns.items():
        refs[name] = fn()[0] if SWEEP["on"] else None
    times = interleaved_ms(fns, ROW5["rounds"]) if ROW5["rounds"] else None
    for name, p, opt, wl in cases:
        case = {"op": "flash_attn", "name": name, "shape": [B, H, H, S, S, D]}
        if times is None:
            res[name] = record(row, case, "fuelgraph kernel", t_ms(fns[name]), work[name],
                               **fwd_tuning())
            continue
        x, _ = ratio_stats(times, "plain causal", name)
        res[name] = record(row, case, "fuelgraph kernel", median(times[name]), work[name],
                           rounds=ROW5["rounds"], timing="interleaved",
                           per_work_vs_plain=round(x * work["plain causal"] / work[name], 4),
                           **fwd_tuning())
    for name, p, opt, wl in cases if SWEEP["on"] else ():   # then each code variant flipped
        case = {"op": "flash_attn", "name": name, "shape": [B, H, H, S, S, D]}
        flops = 4.0 * D * pairs(S, S, True, wl) * B * H
        for var in flipped(name):
            default = K.VARIANTS[var]
            K.VARIANTS[var] = not default
            try:
                got = K.flash_attn(q, k, v, *opt, **p)[0]
                res[f"{name} {var}"] = record(
                    row, case, f"fuelgraph kernel {var}={int(not default)}",
                    t_ms(lambda: K.flash_attn(q, k, v, *opt, **p)), flops,
                    maxerr(got, refs[name]), **fwd_tuning())
            except Exception as exc:  # noqa: BLE001
                print(f"  row {row} {name} {var}={int(not default)} failed: {exc!r}", flush=True)
            finally:
                K.VARIANTS[var] = default
    return res


def targets(results):
    """(row, what, ours, anchor, ratio, target, ok) lines."""
    out = []

    def line(row, what, ratio, target, ok, detail):
        out.append(f"  {row:>3}  {what:44s} {detail:38s} {target:22s} {'ok' if ok else 'MISSED'}")

    r = results
    if 1 in r:
        t = r[1]["fuelgraph kernel"]["tflops"]
        line(1, "causal fwd B4 H32 S4096", t, ">= 450 TFLOP/s", t >= 450,
             f"{t:.0f} TFLOP/s (flash {r[1].get('flash', {}).get('tflops', '-')}, cudnn "
             f"{r[1].get('cudnn', {}).get('tflops', '-')})")
    if 2 in r and "flash" in r[2]:
        x = r[2]["fuelgraph kernel"]["tflops"] / r[2]["flash"]["tflops"]
        line(2, "non-causal fwd B4 H32 S4096", x, ">= 1.3x flash", x >= 1.3, f"{x:.2f}x flash")
    if 3 in r and "flash" in r[3]:
        x = r[3]["fuelgraph"]["ms"] / r[3]["flash"]["ms"]
        line(3, "causal fwd+bwd B4 H32 S4096", x, "<= 1.0x flash time", x <= 1.0,
             f"{r[3]['fuelgraph']['ms']:.2f} ms = {x:.2f}x flash")
    if 4 in r and "flash expanded" in r[4]:
        x = r[4]["flash expanded"]["ms"] / r[4]["fuelgraph kernel"]["ms"]
        line(4, "GQA 32/8 causal fwd", x, ">= 1.3x expanded SDPA", x >= 1.3, f"{x:.2f}x")
    if 5 in r:
        base = r[5]["plain causal"]["tflops"]
        for n in ("window 1024", "softcap 50", "alibi"):
            x = r[5][n].get("per_work_vs_plain") or base / r[5][n]["tflops"]
            line(5, n, x, "<= 1.15x plain (work)", x <= 1.15, f"{x:.2f}x plain causal")
        for n in r[5]:                  # --sweep: variants against plain causal, same variant
            var = n.split(" ")[-1]
            if n.startswith("plain") or var not in K.VARIANTS:
                continue
            plain = r[5].get(f"plain causal {var}", r[5]["plain causal"])
            x = plain["tflops"] / r[5][n]["tflops"]
            line(5, n + " flipped", x, "<= 1.15x plain (work)", x <= 1.15,
                 f"{x:.2f}x {plain['impl']} ({r[5][n]['tflops']:.0f} TFLOP/s)")
    if 6 in r and "flash" in r[6]:
        x = r[6]["fuelgraph kernel"]["tflops"] / r[6]["flash"]["tflops"]
        line(6, "long context B1 H32 S32768 causal fwd", x, ">= 1.0x flash", x >= 1.0,
             f"{x:.2f}x flash")
    return out


def save(out, name, **extra):
    """The records so far (and `extra`) as bench/results/<name> and, with --out, out/<name>."""
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(sys.argv), "records": RECORDS, **extra}
    for d in [ROOT / "bench" / "results"] + ([pathlib.Path(out)] if out else []):
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(json.dumps(doc, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default="1,2,3,4,5,6")
    ap.add_argument("--configs", default=None)
    ap.add_argument("--ws-configs", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--warm", default=None)
    ap.add_argument("--schedules", default=None)
    ap.add_argument("--schedule-cases", default=None,
                    help='row 5 cases for --schedules, e.g. "window 1024,softcap 50,alibi"')
    ap.add_argument("--tag", default="schedules", help="--schedules: the JSON's name suffix")
    ap.add_argument("--paired", type=int, default=0,
                    help="--schedules: each case's ratio from N batches alternating with plain")
    ap.add_argument("--ab", default=None,
                    help='plain causal under each setting ("base;plan;KEY=VALUE"), interleaved')
    ap.add_argument("--rounds", type=int, default=None,
                    help="--ab (default 3) / --schedules (default 1): interleaved rounds")
    ap.add_argument("--non-causal", action="store_true", help="--ab: row 2's case instead")
    ap.add_argument("--interleaved", action="store_true",
                    help="--schedules: every (setting, case) interleaved call by call")
    ap.add_argument("--row5-rounds", type=int, default=None,
                    help="row 5's interleaved rounds (default 60; 0: do_bench a case in turn)")
    ap.add_argument("--methods", action="store_true",
                    help="window / softcap against plain causal timed four ways")
    args = ap.parse_args()
    if args.quick:
        REP.update(warmup=5, rep=20)
    SWEEP["on"] = args.sweep
    PAIRED["batches"] = args.paired
    if args.row5_rounds is not None:
        ROW5["rounds"] = args.row5_rounds
    if args.configs:
        K._fwd_kernel.configs = [K.fwd_config(*map(int, c.split(",")))
                                 for c in args.configs.split(";")]
    if args.ws_configs:
        W._fwd_ws_kernel.configs = [W.ws_config(*map(int, c.split(",")))
                                    for c in args.ws_configs.split(";")]
    specs = parse_schedules(args.schedules) if args.schedules else None
    if args.schedule_cases:
        SCHEDULE_CASES[:] = ["plain causal"] + [c.strip() for c in args.schedule_cases.split(",")
                                                if c.strip() != "plain causal"]
    if args.ab:
        ab_specs = parse_schedules(args.ab)
        SCHEDULE_CASES[:] = ["plain causal"]
        if args.warm:
            part, nparts = map(int, args.warm.split("/"))
            q, k, v = (rand(1, 16, 256, D) for _ in "qkv")
            for n, (spec, kv) in enumerate(x for x in ab_specs if x[0] != "plan"):
                if n % nparts == part:
                    with_variants(kv, lambda: K.flash_attn(q, k, v, **params(
                        not args.non_causal)))
                    torch.cuda.synchronize()
                    print(f"warm [{spec}]", flush=True)
            return
        rounds = args.rounds or 3
        lines = ab_row(8, ab_specs, rounds, 4, 32, 4096, not args.non_causal)
        print(f"\nA/B {'non-causal' if args.non_causal else 'plain causal'} B4 H32 S4096, "
              f"{rounds} interleaved rounds")
        print("\n".join(lines), flush=True)
        save(args.out, f"cuda_attention_{DATE}_{args.tag}.json", summary=lines)
        return
    if args.warm and specs:
        warm_schedules(specs, *map(int, args.warm.split("/")))
        return
    if args.warm:
        warm(*map(int, args.warm.split("/")))
        return
    rows = {int(x) for x in args.rows.split(",")}
    B, H, S = 4, 32, 4096
    jobs = {1: lambda: forward_row(1, "causal fwd", B, H, H, S, True),
            2: lambda: forward_row(2, "non-causal fwd", B, H, H, S, False),
            3: lambda: fwd_bwd_row(3, B, H, S),
            4: lambda: forward_row(4, "GQA 32/8 causal fwd", B, H, 8, S, True),
            5: lambda: variants_row(5, B, H, S),
            6: lambda: forward_row(6, "long context causal fwd", 1, H, H, 32768, True,
                                   anchors=("flash",))}
    results = {}
    if args.methods:
        lines = methods_row(B, H, S)
        print("\ntiming methods (time per unit of work / plain causal's)")
        print("\n".join(lines), flush=True)
        save(args.out, f"cuda_attention_{DATE}_{args.tag}.json", summary=lines)
        return
    if specs and args.interleaved:
        lines = interleaved_row(7, specs, B, H, S, args.rounds or 40)
        print("\n".join(lines), flush=True)
        save(args.out, f"cuda_attention_{DATE}_{args.tag}.json", summary=lines)
        return
    if specs:          # the schedule sweep instead of the rows
        rows = set()
        lines = schedules_row(7, specs, B, H, S, args.rounds or 1)
        print("\nschedules (plain causal target >= 450 TFLOP/s; the others: TFLOP/s and "
              "time per unit of work / plain causal's, target <= 1.15x)")
        print("\n".join(lines), flush=True)
        save(args.out, f"cuda_attention_{DATE}_{args.tag}.json", summary=lines)
        return
    for row in sorted(rows):
        print(f"row {row}", flush=True)
        try:
            results[row] = jobs[row]()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        torch.cuda.empty_cache()
        save(args.out, f"cuda_attention_{DATE}.json")   # after every row: a timeout keeps them
    print("\ntargets (issue 12)")
    for line in targets(results):
        print(line)


if __name__ == "__main__":
    main()
