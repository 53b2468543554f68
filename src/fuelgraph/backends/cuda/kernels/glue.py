"""Generated glue kernels on CUDA: the kernel factory of registry family "glue". A region's
`Program` (backends.glue) becomes Triton source (cuda.glue_codegen), written once to the disk
cache and imported from there, so a second process reuses both the source and Triton's compiled
binary (Triton's own cache, ~/.triton/cache or $TRITON_CACHE_DIR) without recompiling. Regions
the generator does not cover (float64) get no kernel and run as their
recipe (one torch op per primitive).

Cache directory: $FUELGRAPH_CACHE_DIR/glue, else ~/.cache/fuelgraph/glue; files are named by the
hash of their source (and Triton's version), written atomically."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path

import torch
import triton

from ...base import elementwise_cost, kernel_factory
from ...glue import Program, Unsupported, build_program
from ..glue_codegen import LOOP_BLOCK, MAX_ROW, generate
from ..primitives import tdtype
from .common import INTERPRET, row_config

#: elementwise kernels: elements per program and warps (1024 x 4 warps: 8 elements, two 16-byte
#: vectors of bf16, per thread)
EW_BLOCK = 1024
EW_WARPS = 4
_LOCK = threading.Lock()
#: counters for tests and benchmarks: sources written, modules imported
STATS = {"written": 0, "imported": 0}


def cache_dir() -> Path:
    root = os.environ.get("FUELGRAPH_CACHE_DIR") or str(Path.home() / ".cache" / "fuelgraph")
    return Path(root) / "glue"


def load_source(source: str):
    """The module of `source`, from the disk cache (written there first if missing)."""
    h = hashlib.sha256((triton.__version__ + "\n" + source).encode()).hexdigest()[:24]
    name = f"fuelgraph_glue_{h}"
    with _LOCK:
        mod = sys.modules.get(name)
        if mod is not None:
            return mod
        d = cache_dir()
        path = d / f"{name}.py"
        if not path.exists():
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_text(source)
            os.replace(tmp, path)
            STATS["written"] += 1
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
        STATS["imported"] += 1
        return mod


def launch_config(prog: Program) -> tuple[int, dict]:
    """(number of programs, launch keywords) of `prog`'s kernel."""
    if prog.n is None:
        return -(-prog.numel // EW_BLOCK), {"BLOCK": EW_BLOCK, "num_warps": EW_WARPS}
    if prog.n > MAX_ROW:
        return prog.rows, {"BLOCK_R": 1, "BLOCK_N": LOOP_BLOCK, "num_warps": 8}
    block_r, block_n, warps = row_config(prog.n)
    return -(-prog.rows // block_r), {"BLOCK_R": block_r, "BLOCK_N": block_n, "num_warps": warps}


class GlueLauncher:
    """kernel(*inputs) -> output tensor(s): allocates the outputs and launches the generated
    kernel (its source is generated now, compiled by Triton at the first launch)."""

    def __init__(self, prog: Program, interpret: bool = INTERPRET):
        self.prog = prog
        self.source = generate(prog, interpret)
        self._kernel = None
        self.grid, self.meta = launch_config(prog)

    @property
    def kernel(self):
        if self._kernel is None:
            self._kernel = load_source(self.source).glue_kernel
        return self._kernel

    def __call__(self, *inputs):
        p = self.prog
        dev = inputs[0].device
        outs = [torch.empty(shape, dtype=tdtype(d), device=dev) for _, shape, d in p.outputs]
        if p.numel and p.rows:
            self.kernel[(self.grid,)](*inputs, *outs, **self.meta)
        return outs[0] if len(outs) == 1 else tuple(outs)


def _cost(prog):
    def cost(shapes, params=None):
        c = elementwise_cost(shapes, itemsize=2)
        return type(c)(c.flops * max(1, len(prog.values)), c.bytes)
    return cost


@kernel_factory("glue", "cuda")
def glue_kernel(entry):
    """A generated Triton kernel for a glue region, or None where the generator does not cover
    it (the region then runs as its recipe)."""
    try:
        launcher = GlueLauncher(build_program(entry.body))
    except Unsupported:
        return None
    return {"kernel": launcher, "cost": _cost(launcher.prog), "name": f"triton.{entry.name}",
            "precision": "fp32 for 16-bit"}
