"""Shared benchmark plumbing: timing, records, result files. Each bench_<family>.py builds its
cases and calls `run_cases`; `python bench/run.py` runs them all."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
#: callbacks called with every record as it is made (`fuelgraph bench` drives its progress bar)
ON_RECORD: list = []


def machine() -> str:
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if "model name" in l)
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown cpu"
    return f"{platform.node()} {cpu} x{os.cpu_count()}"


def timeit(fn, *, min_time=0.2, repeat=5, warmup=3) -> float:
    """Milliseconds per call of fn(): the best of `repeat` batches of >= min_time/repeat each,
    after `warmup` calls (steady state: the allocator has grown to the working set)."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_time / repeat / one))
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e3)
    return min(samples)  # the least-disturbed batch: this 2-core VM is shared


def record(op, impl, shape, dtype, ms, device="cpu", **extra) -> dict:
    r = {"op": op, "impl": impl, "device": device, "shape": list(shape), "dtype": str(dtype),
         "ms": round(ms, 5), "date": _dt.date.today().isoformat()}
    r.update(extra)
    for fn in ON_RECORD:
        fn(r)
    return r


def write_results(name: str, records: list[dict], directory=None) -> Path:
    """Write the records to `directory` (default bench/results) as <name>_<date>.json."""
    out = Path(directory) if directory is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_{_dt.date.today().isoformat()}.json"
    doc = {"machine": machine(), "command": " ".join([Path(sys.executable).name] + sys.argv),
           "date": _dt.datetime.now().isoformat(timespec="seconds"), "records": records}
    path.write_text(json.dumps(doc, indent=1))
    return path


def print_table(records: list[dict], base_impl="fuelgraph"):
    """One line per (op, shape, dtype): each impl's ms and its ratio to `base_impl`."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["op"], tuple(r["shape"]), r["dtype"]), []).append(r)
    for (op, shape, dtype), rs in groups.items():
        base = next((r["ms"] for r in rs if r["impl"] == base_impl), None)
        cells = ", ".join(f"{r['impl']} {r['ms']:.3f} ms" + (f" ({r['ms'] / base:.2f}x)" if base else "")
                          for r in rs)
        print(f"{op:32s} {str(shape):22s} {dtype:9s} {cells}")


def fg_case(build, inputs):
    """make(lower_all) -> a closure running the cached plan of build(*tensors) (a tensor or a
    list of tensors): the plan is compiled once, so the timed calls measure execution only."""
    import fuelgraph as fg
    from fuelgraph.runtime.executor import compile_plan
    from fuelgraph.runtime.memory import predict_memory
    from fuelgraph.ir.tensor import bound_data

    def make(lower_all):
        ts = [fg.tensor(a) for a in inputs]
        outs = build(*ts)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        plan, ins = compile_plan([o.value for o in outs], lower_all)
        bufs = [bound_data(n) for n in ins]
        run = lambda: plan.run(bufs)   # noqa: E731
        mp = predict_memory(plan, bufs)
        run.work = {"bytes": int(mp.bytes_moved), "flops": int(mp.flops)}   # the plan's own work
        return run
    return make


def check(make, torch_run, rtol=2e-4, atol=2e-4):
    """The fused and lowered plans agree with torch before they are timed."""
    import numpy as np
    want = torch_run()
    want = [w.detach().numpy() for w in (want if isinstance(want, tuple) else (want,))]
    for lower_all in (False, True):
        got = make(lower_all)()
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def run_cases(family: str, cases, quick=False, **timing):
    """Time each (name, shape, make, torch_run) case as "fuelgraph" (fused kernels),
    "fuelgraph lowered" (recipes) and "torch eager", after checking they agree; write
    results/<family>_<date>.json and print the table."""
    import torch
    kw = dict(min_time=0.05, repeat=3) if quick else timing
    records = []
    for name, shape, make, torch_run in cases:
        check(make, torch_run)
        fused = make(False)
        # the fused plan's bytes and FLOPs are the op's work, whichever implementation does it
        work = getattr(fused, "work", {})
        for impl, fn in (("fuelgraph", fused), ("fuelgraph lowered", make(True)),
                         ("torch eager", torch_run)):
            records.append(record(name, impl, shape, "float32", timeit(fn, **kw),
                                  torch_threads=torch.get_num_threads(), **work))
    path = write_results(family, records)
    print_table(records)
    print(f"wrote {path}")
    return records


#: the registry op of each quantized format's product (GGUF formats: qmatmul)
QUANT_OPS = {"nf4": "nf4_matmul", "awq": "awq_matmul", "dense": "matmul"}


def quant_record_names(fmt: str, impl: str) -> dict:
    """The naming fields of a quantized-matmul record: `op` the registry name, `format` the
    weight format, `impl` 'fuelgraph' for ours (its launch in `variant`) or the anchor's name."""
    names = {"op": QUANT_OPS.get(fmt.lower(), "qmatmul"), "format": fmt}
    if impl.startswith("fuelgraph[") and impl.endswith("]"):
        return {**names, "impl": "fuelgraph", "variant": impl[len("fuelgraph["):-1]}
    return {**names, "impl": impl}
