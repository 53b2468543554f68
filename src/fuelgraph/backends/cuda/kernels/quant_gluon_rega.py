"""When the Gluon GEMM (`quant_gluon_gemm`) may hand the wgmma its A operand, the decoded weight
tile, in registers (`GluonGemmConfig.rega`) instead of through a shared-memory A buffer.

A `wgmma.mma_async` reads its register A operand while in flight: those registers must not be
written before a `wgmma.wait_group` that retires it. In PTX they are virtual registers, so
keeping them is ptxas's register allocation. The ptxas of CUDA 12.8 (the one Triton 3.6 bundles)
gives an in-flight wgmma's A registers to the next step's decode (the SASS writes them between
the HGMMA and the WARPGROUP.DEPBAR that retires it; wrong results on the H200), so the register
operand is used only when the ptxas Triton compiles with is at least MIN_PTXAS (CUDA 13.0's keeps
them: bench/sass_wgmma_regs.py checks the SASS of every launch with both).

A user enables it by pointing Triton at a newer ptxas before the first compile, e.g.
`TRITON_PTXAS_PATH=/usr/local/cuda-13.0/bin/ptxas` (or the `ptxas` of the nvidia-cuda-nvcc
wheel of CUDA 13); nothing here changes Triton's settings. The version is read through
Triton's own setting (`triton.knobs.nvidia.ptxas`: that path if it runs, else the bundled one),
once a path.
"""
from __future__ import annotations

import functools
import re

#: the first ptxas (CUDA major, minor) whose SASS keeps an in-flight wgmma's A registers
MIN_PTXAS = (13, 0)


def parse_ptxas_version(text: str) -> tuple[int, int] | None:
    """(major, minor) from `ptxas --version` output or a bare "13.0"; None if there is none."""
    m = re.search(r"release (\d+)\.(\d+)", text) or re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


@functools.lru_cache(maxsize=16)
def _version_at(path: str, version: str) -> tuple[int, int] | None:
    return parse_ptxas_version(version)


def triton_ptxas_version() -> tuple[int, int] | None:
    """(major, minor) of the ptxas Triton uses for sm_90, None if Triton finds none."""
    try:
        from triton import knobs
        tool = knobs.nvidia.ptxas         # (Triton runs `--version` once a path)
    except Exception:  # noqa: BLE001  (no Triton / no ptxas: no register operand)
        return None
    return _version_at(tool.path, tool.version)


def rega_safe(version: tuple[int, int] | None = None) -> bool:
    """Whether register-A wgmmas compile correctly with this ptxas version (default: Triton's)."""
    v = triton_ptxas_version() if version is None else version
    return v is not None and v >= MIN_PTXAS


def operand_path(cfg, steps: int, wtma: bool) -> tuple[int, bool]:
    """(SUB, REGA) of a launch (`GluonGemmConfig` cfg, `steps` steps of 64 a program): two
    steps an iteration where asked and they divide the steps (wtma: only with rega, as before
    session 11 wtma launches ran one); register A (rega 1) only with two, so that the two
    steps' tiles are distinct registers; rega 2: register A whatever SUB (one tile's
    registers rewritten each iteration while its wgmma is in flight: wrong; kept to check that
    diagnosis on the GPU)."""
    sub = cfg.sub if steps % cfg.sub == 0 and (not wtma or cfg.rega) else 1
    return sub, cfg.rega == 2 or (cfg.rega == 1 and sub == 2)


#: dynamic shared memory an sm_90 block may have (227 KB)
SMEM_LIMIT = 232448


def fit_stages(stages: int, per_stage: int, fixed: int) -> int:
    """The most stages, at most `stages` (and at least 2), whose ring (per_stage bytes each)
    fits next to `fixed` bytes: a register-A launch (no A buffer) that falls back to the
    shared A buffer (odd steps) keeps fitting."""
    while stages > 2 and fixed + 256 + stages * (per_stage + 16) > SMEM_LIMIT:
        stages -= 1
    return stages
