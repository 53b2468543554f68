"""Which operand path a Gluon GEMM launch (`quant_gluon_gemm`) takes: the decoded weight tile as
the wgmma's register A operand (`GluonGemmConfig.rega`) or through a shared-memory A buffer,
and how many ring stages then fit in shared memory.

A `wgmma.mma_async` reads its register A operand while in flight: those registers must not be
written before a `wgmma.wait_group` retires it (the PTX rule). The main loop issues a step's
wgmma, then waits with one group outstanding, so a step's tile is read until the next step's
wait. With one step an iteration the tile is one set of PTX registers that the next
iteration's decode rewrites while the wgmma still reads them: wrong results (NaN on the H200),
and no ptxas can help it (the SASS of CUDA 12.8's and 13.0's ptxas is the same). With two
steps an iteration the two tiles are distinct registers, each written only after the wait
that retired its previous wgmma: register A only then. bench/sass_wgmma_regs.py checks the
SASS: no instruction writes an HGMMA's A registers before the DEPBAR that retires it.
"""
from __future__ import annotations

#: dynamic shared memory an sm_90 block may have (227 KB)
SMEM_LIMIT = 232448


def operand_path(cfg, steps: int, wtma: bool) -> tuple[int, bool]:
    """(SUB, REGA) of a launch (`GluonGemmConfig` cfg, `steps` steps of 64 a program): two
    steps an iteration where asked and they divide the steps (wtma: only with rega, as before
    session 11 wtma launches ran one); register A (rega 1) only with two, so that the two
    steps' tiles are distinct registers (one step an iteration with register A: NaN on the
    H200; bench/sass_wgmma_regs.py compiles it to show the hazard)."""
    sub = cfg.sub if steps % cfg.sub == 0 and (not wtma or cfg.rega) else 1
    return sub, bool(cfg.rega) and sub == 2


def fit_stages(stages: int, per_stage: int, fixed: int) -> int:
    """The most stages, at most `stages` (and at least 2), whose ring (per_stage bytes each)
    fits next to `fixed` bytes: a register-A launch (no A buffer) that falls back to the
    shared A buffer (odd steps) keeps fitting."""
    while stages > 2 and fixed + 256 + stages * (per_stage + 16) > SMEM_LIMIT:
        stages -= 1
    return stages
