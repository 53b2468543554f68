#!/usr/bin/env python3
"""Collectives on the CPU, two processes over gloo (started here as torchrun would): an
all_reduce of N float32 elements through a fuelgraph plan (the input buffer handed over, so
the reduction runs in place, as fuelgraph.distributed.DataParallel's buckets do) against
`torch.distributed.all_reduce` on a torch tensor of the same size; and an all_gather. There is
no "fuelgraph lowered" row: over two processes the recipe refuses to stand in for
communication. Values are checked first. Both processes run a fixed number of calls (timing
adaptively would let them disagree on how many collectives to issue).

    python bench/bench_collective.py [--quick]

Writes bench/results/collective_<date>.json and prints one line per case with ratios."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

SIZES = [1 << 14, 1 << 20, 1 << 23]
QUICK_SIZES = [1 << 14, 1 << 18]


def _timed(fn, calls, repeat=3) -> float:
    """Median over `repeat` batches of ms per call (every process makes the same calls)."""
    import torch.distributed as dist
    fn()
    out = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(out)


def worker(out_path, quick):
    import numpy as np
    import torch
    import torch.distributed as tdist

    import fuelgraph as fg
    import fuelgraph.distributed as dist
    import fuelgraph.functional as F
    from fuelgraph.ir.tensor import bound_data
    from fuelgraph.runtime.executor import compile_plan
    g = dist.init()
    torch.set_num_threads(1)
    records = []
    for n in (QUICK_SIZES if quick else SIZES):
        calls = 10 if quick else max(5, min(200, (1 << 24) // n))
        a = np.full(n, g.rank + 1.0, np.float32)
        x = fg.tensor(a)
        plan, ins = compile_plan([F.all_reduce(x).value], donate=[x.node])
        buf = np.array(bound_data(ins[0]))
        assert plan.run([buf])[0][0] == 3.0            # 1 + 2, in place
        assert plan.stats.get("inplace_copies", 0) == 0, plan.stats
        t = torch.from_numpy(a.copy())
        ms_fg = _timed(lambda: plan.run([buf]), calls)
        ms_t = _timed(lambda: tdist.all_reduce(t), calls)
        records.append(("all_reduce", n, ms_fg, ms_t))
        gp, gins = compile_plan([F.all_gather(x, 0).value])
        gbuf = bound_data(gins[0])
        assert gp.run([gbuf])[0].shape == (2 * n,)
        outs = torch.empty(2 * n)
        ms_fg = _timed(lambda: gp.run([gbuf]), calls)
        ms_t = _timed(lambda: tdist.all_gather_into_tensor(outs, t), calls)
        records.append(("all_gather", n, ms_fg, ms_t))
    print(f"rank {g.rank}: plan stats {plan.stats}", flush=True)
    if g.rank == 0:
        Path(out_path).write_text(json.dumps(records))
    dist.destroy()


def main(quick=False):
    from common import print_table, record, write_results
    sys.path.insert(0, str(HERE.parent))
    from tests.distributed.harness import free_port
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.json")
        port = free_port()
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--worker", out] + (["--quick"] if quick else []),
            env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                     FUELGRAPH_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
            for r in range(2)]
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            raise SystemExit(f"bench_collective workers failed: {codes}")
        rows = json.loads(Path(out).read_text())
    records = []
    for op, n, ms_fg, ms_t in rows:
        gb = 4 * n / 1e9
        records.append(record(op, "fuelgraph", (n,), "float32", ms_fg, processes=2,
                              backend="gloo", GBps=round(gb / ms_fg * 1e3, 3)))
        records.append(record(op, "torch.distributed", (n,), "float32", ms_t, processes=2,
                              backend="gloo", GBps=round(gb / ms_t * 1e3, 3)))
    path = write_results("collective", records)
    print_table(records)
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1], "--quick" in sys.argv)
    else:
        main(quick="--quick" in sys.argv)
