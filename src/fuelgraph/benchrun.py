"""`fuelgraph bench`: run the benchmark suite of a source checkout with a progress bar, print
one comparison table, and write the JSON records plus a plot (each implementation's speed as a
fraction of the machine's bandwidth / FLOP ceiling, per op) next to them.

The suite (bench/) is not part of the installed package: it is found beside the sources this
module was imported from (a clone of the repository), or where FUELGRAPH_BENCH_DIR points."""
from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: nominal ceilings used when they cannot be measured (GB/s, TFLOP/s); H200: HBM3e, bf16 dense
NOMINAL = {"NVIDIA H200": (4800.0, 989.0)}


def find_bench_dir() -> Path | None:
    """bench/ of the source checkout: $FUELGRAPH_BENCH_DIR, else beside src/ of this module's
    checkout, else in the current directory or one of its parents."""
    env = os.environ.get("FUELGRAPH_BENCH_DIR")
    cands = [Path(env)] if env else []
    cands.append(Path(__file__).resolve().parents[2] / "bench")
    cwd = Path.cwd().resolve()
    cands += [p / "bench" for p in (cwd, *cwd.parents)]
    for c in cands:
        if (c / "common.py").is_file() and any(c.glob("bench_*.py")):
            return c
    return None


def families(bench: Path, device: str) -> list[str]:
    if device == "cuda":
        return sorted(p.stem[len("bench_cuda_"):] for p in bench.glob("bench_cuda_*.py"))
    return sorted(p.stem[len("bench_"):] for p in bench.glob("bench_*.py")
                  if not p.stem.startswith("bench_cuda"))


def _pick(names: list[str], known: list[str]) -> list[str]:
    out = []
    for n in names:
        hits = [k for k in known if k == n] or [k for k in known if k.startswith(n)]
        if not hits:
            raise SystemExit(f"fuelgraph bench: no benchmark family {n!r}; known: "
                             f"{', '.join(known)}")
        out += [h for h in hits if h not in out]
    return out


# ---- ceilings --------------------------------------------------------------------------------
def cpu_ceilings() -> dict:
    """Copy bandwidth (GB/s, read + write) and float32 matmul rate (TFLOP/s) of this CPU,
    best of a few short runs (a shared machine gives a lower bound of the real ceiling)."""
    a = np.ones(1 << 25, np.float32)
    b = np.empty_like(a)
    bw = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        bw = max(bw, 2 * a.nbytes / (time.perf_counter() - t0) / 1e9)
    m = np.ones((1024, 1024), np.float32)
    fl = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        m @ m
        fl = max(fl, 2 * 1024 ** 3 / (time.perf_counter() - t0) / 1e12)
    return {"device": "cpu", "gbps": round(bw, 1), "tflops": round(fl, 3), "how": "measured"}


def cuda_ceilings() -> dict:
    """Device-to-device copy bandwidth and bf16 matmul rate of GPU 0 (CUDA events)."""
    import torch
    name = torch.cuda.get_device_name(0)
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def best(fn, n=10):
        fn()
        ms = []
        for _ in range(n):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ms.append(s.elapsed_time(e))
        return min(ms)
    bw = 2 * x.numel() * 2 / (best(lambda: y.copy_(x)) * 1e-3) / 1e9
    fl = 2 * 8192 ** 3 / (best(lambda: a @ a) * 1e-3) / 1e12
    del x, y, a
    torch.cuda.empty_cache()
    return {"device": name, "gbps": round(bw, 1), "tflops": round(fl, 1), "how": "measured"}


def fraction(rec: dict, ceil: dict) -> float | None:
    """Share of the binding ceiling a record reached (bandwidth or FLOP rate, the larger)."""
    ms = rec.get("ms")
    if not ms:
        return None
    fr = []
    gbps = rec.get("gbps") or (rec["bytes"] / (ms * 1e-3) / 1e9 if rec.get("bytes") else None)
    tfl = rec.get("tflops") or (rec["flops"] / (ms * 1e-3) / 1e12 if rec.get("flops") else None)
    if gbps and ceil.get("gbps"):
        fr.append(gbps / ceil["gbps"])
    if tfl and ceil.get("tflops"):
        fr.append(tfl / ceil["tflops"])
    return max(fr) if fr else None


# ---- running -------------------------------------------------------------------------------
def _bar(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="family", file=sys.stderr, dynamic_ncols=True)


def _run_cpu(bench: Path, names: list[str], out: Path, quick: bool, log) -> list[Path]:
    sys.path[:0] = [str(bench), str(bench.parent / "src")]
    common = importlib.import_module("common")
    common.RESULTS = out
    paths: list[Path] = []
    orig_write = common.write_results

    def write(name, records):
        p = orig_write(name, records)
        paths.append(p)
        return p
    common.write_results = write
    bar = _bar(len(names), "bench cpu")
    done = 0

    def on_record(r):
        nonlocal done
        done += 1
        bar.set_postfix_str(f"{r.get('op', '')[:28]} {r.get('impl', '')} {r.get('ms', 0):.3f} ms "
                            f"({done} timings)")
    hooks = getattr(common, "ON_RECORD", None)
    if hooks is not None:
        hooks.append(on_record)
    try:
        for name in names:
            bar.set_description(f"bench cpu: {name}")
            mod = importlib.import_module(f"bench_{name}")
            if hasattr(mod, "write_results"):      # imported by name: patch it there too
                mod.write_results = write
            with contextlib.redirect_stdout(log):
                mod.main(quick=quick)
            bar.update(1)
    finally:
        bar.close()
        if hooks is not None:
            hooks.remove(on_record)
        common.write_results = orig_write
    return paths


def _run_cuda(bench: Path, names: list[str], out: Path, quick: bool, log) -> list[Path]:
    before = set(out.glob("*.json"))
    bar = _bar(len(names), "bench cuda")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(bench.parent / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    try:
        for name in names:
            bar.set_description(f"bench cuda: {name}")
            cmd = [sys.executable, str(bench / f"bench_cuda_{name}.py"), "--out", str(out)]
            if quick and "--quick" in (bench / f"bench_cuda_{name}.py").read_text():
                cmd.append("--quick")
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            if r.returncode:
                bar.write(f"bench_cuda_{name}.py failed (exit {r.returncode}); see {log.name}")
            bar.update(1)
    finally:
        bar.close()
    return sorted(set(out.glob("*.json")) - before)


def load_records(paths) -> list[dict]:
    recs = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        rs = doc["records"] if isinstance(doc, dict) else doc
        recs += [r for r in rs if isinstance(r, dict) and r.get("ms")]
    return recs


def table(recs: list[dict], ceil: dict, base="fuelgraph") -> str:
    """One line per (op, shape, dtype): each implementation's time, ratio to ours, and share of
    the machine's ceiling."""
    groups: dict = {}
    for r in recs:
        groups.setdefault((r["op"], "x".join(map(str, r.get("shape", []))), r.get("dtype", "")),
                          []).append(r)
    lines = [f"{'op':34s} {'shape':18s} {'dtype':9s} impl: ms (vs {base}) [% of ceiling]"]
    for (op, shape, dtype), rs in groups.items():
        ours = next((r["ms"] for r in rs if r["impl"] == base), None)
        cells = []
        for r in rs:
            c = f"{r['impl']}: {r['ms']:.3f}"
            if ours and r["impl"] != base:
                c += f" ({r['ms'] / ours:.2f}x)"
            f = fraction(r, ceil)
            if f is not None:
                c += f" [{100 * f:.0f}%]"
            cells.append(c)
        lines.append(f"{op[:34]:34s} {shape[:18]:18s} {dtype[:9]:9s} " + "; ".join(cells))
    return "\n".join(lines)


def plot(recs: list[dict], ceil: dict, path: Path, title: str) -> Path | None:
    """Horizontal bars: per (op, shape, dtype), each implementation's share of the ceiling."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows: dict = {}
    impls: list = []
    for r in recs:
        f = fraction(r, ceil)
        if f is None:
            continue
        key = f"{r['op']} {'x'.join(map(str, r.get('shape', [])))} {r.get('dtype', '')}"
        rows.setdefault(key, {})[r["impl"]] = f
        if r["impl"] not in impls:
            impls.append(r["impl"])
    if not rows:
        return None
    impls.sort(key=lambda i: (i != "fuelgraph", i))
    keys = list(rows)
    h = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(keys) * max(1, len(impls) / 2) + 1.5))
    for j, impl in enumerate(impls):
        ys = [i + j * h for i in range(len(keys))]
        vals = [rows[k].get(impl, 0.0) for k in keys]
        ax.barh(ys, vals, height=h, label=impl)
    ax.set_yticks([i + h * (len(impls) - 1) / 2 for i in range(len(keys))])
    ax.set_yticklabels(keys, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xlabel(f"fraction of the ceiling ({ceil.get('gbps')} GB/s, {ceil.get('tflops')} "
                  f"TFLOP/s, {ceil.get('how')}; the binding one per case)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_main(args) -> int:
    bench = find_bench_dir()
    if bench is None:
        print("fuelgraph bench: the benchmark suite (bench/) is not here. It ships with the "
              "source repository, not with the installed package: run this from a clone of "
              "the repository, or set FUELGRAPH_BENCH_DIR to its bench/ folder.", file=sys.stderr)
        return 2
    known = families(bench, args.device)
    if args.list:
        print(f"{args.device} benchmark families in {bench}: {', '.join(known)}")
        return 0
    names = _pick(args.families, known) if args.families else known
    date = _dt.date.today().isoformat()
    out = Path(args.out) if args.out else \
        bench / "results" / (f"cuda_{date}" if args.device == "cuda" else "")
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("fuelgraph bench --device cuda: no CUDA GPU here", file=sys.stderr)
            return 2
    log_path = out / f"bench_{args.device}_{date}.log"
    with open(log_path, "a") as log:
        run = _run_cuda if args.device == "cuda" else _run_cpu
        paths = run(bench, names, out, args.quick, log)
    try:
        ceil = cuda_ceilings() if args.device == "cuda" else cpu_ceilings()
    except Exception as e:          # a ceiling we cannot measure: use the nominal one if known
        ceil = {"device": args.device, "how": f"unmeasured ({e!r})"}
    recs = load_records(paths)
    dev = next((r.get("device") for r in recs if r.get("device") in NOMINAL), None)
    if dev and not ceil.get("gbps"):
        ceil.update(gbps=NOMINAL[dev][0], tflops=NOMINAL[dev][1], how="nominal")
    (out / f"ceilings_{args.device}_{date}.json").write_text(json.dumps(ceil, indent=1) + "\n")
    print(table(recs, ceil))
    png = plot(recs, ceil, out / f"bench_{args.device}_{date}.png",
               f"fuelgraph bench ({args.device}, {ceil.get('device')}, {date})")
    print(f"\nrecords: {', '.join(str(p) for p in paths) or 'none'}")
    print(f"plot: {png or 'none (no record carries bytes or FLOPs)'}; log: {log_path}")
    return 0 if paths else 1

