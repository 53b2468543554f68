"""What the sass_* tools share: the sm_90 target for compiling Triton kernels on a machine
without a GPU, and the statistics of the compiled SASS (registers, spill stack, the longest
loop's instructions and opcodes) read with the cuobjdump Triton bundles."""
from __future__ import annotations

import collections
import os
import pathlib
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)
BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def dump(cubin: bytes) -> tuple[str, str]:
    """(cuobjdump's resource usage, its SASS listing) of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        pathlib.Path(path).write_bytes(cubin)
        return tuple(subprocess.run([str(BIN / "cuobjdump"), flag, path], capture_output=True,
                                    text=True).stdout for flag in ("-res-usage", "-sass"))


def loop_stats(cubin: bytes):
    """(registers, stack, instructions of the longest loop a thread, its opcode counts); SASS
    addresses of any width (large kernels pass 0x10000)."""
    res, sass = dump(cubin)
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    loop = (0, max(addr, default=0))       # no loop: the whole kernel
    found = False
    for a, ln in zip(addr, lines):
        m = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < a:
            start = int(m.group(1), 16)
            if not found or a - start > loop[1] - loop[0]:
                loop, found = (start, a), True
    body = [ln.split("*/", 1)[1].split() for a, ln in zip(addr, lines)
            if loop[0] <= a <= loop[1]]
    ops = collections.Counter((t[1] if t[0].startswith("@") else t[0]).split(".")[0]
                              for t in body if t)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    return (int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1,
            len(body), ops)
