#!/usr/bin/env python3
"""Run every CPU benchmark (bench_<family>.py main()) in one process; results go to
bench/results/<family>_<date>.json. GPU benchmarks (bench_cuda_*.py) run on the device.

    python bench/run.py [--quick] [family ...]
"""
from __future__ import annotations

import importlib
import os
import sys

# torch's OpenMP threads otherwise busy-wait after each parallel region and steal the two
# cores from the next timed case (fuelgraph's NumPy thread pool included); must precede torch
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

CPU_FAMILIES = sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py")
                      if not p.stem.startswith("bench_cuda"))


def main(argv):
    quick = "--quick" in argv
    names = [a for a in argv if not a.startswith("-")] or CPU_FAMILIES
    for name in names:
        print(f"== bench_{name}")
        importlib.import_module(f"bench_{name}").main(quick=quick)


if __name__ == "__main__":
    main(sys.argv[1:])
