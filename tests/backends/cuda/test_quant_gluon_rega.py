"""Which operand path a Gluon GEMM launch takes (`quant_gluon_rega`, no GPU needed): register A
only with two steps an iteration, the words by TMA with two steps
only with register A; how many ring stages fit in shared memory."""
from __future__ import annotations

import pytest

from fuelgraph.backends.cuda.kernels import quant_gluon_rega as R
from fuelgraph.backends.cuda.kernels.quant_gluon_gemm import GluonGemmConfig


@pytest.mark.parametrize("cfg, steps, wtma, want", [
    (GluonGemmConfig(8, 256, 6, 2, 1, split=2, rega=1), 64, False, (2, True)),
    (GluonGemmConfig(8, 256, 6, 2, 1, split=2), 64, False, (2, False)),
    (GluonGemmConfig(8, 256, 6, 2, 1, split=2, rega=1), 63, False, (1, False)),   # odd steps
    (GluonGemmConfig(8, 256, 5, 2, 1, split=2, wtma=1, rega=1), 64, True, (2, True)),
    (GluonGemmConfig(8, 256, 5, 2, 1, split=2, wtma=1), 64, True, (1, False)),
    (GluonGemmConfig(8, 256, 5, 1, 1, split=2, rega=1), 64, False, (1, False)),
    (GluonGemmConfig(8, 256, 5, 1, 1, split=2, wtma=1, rega=1), 64, True, (1, False)),
])
def test_operand_path(cfg, steps, wtma, want):
    assert R.operand_path(cfg, steps, wtma) == want


def test_fit_stages_keeps_the_ring_in_shared_memory():
    """128 x 256 tiles, Q4_0 with the words by TMA (a stage: the 32 KB x tile and 5 KB of words
    and pairs): 6 stages fit alone (register A) but not with the two 16 KB A buffers (the
    fallback for odd steps): 5 then; 7 bare x tiles fit alone, 6 with the A buffers."""
    x_tile, a_bufs = 2 * 256 * 64, 2 * 2 * 128 * 64
    assert R.fit_stages(6, x_tile + 5120, 0) == 6
    assert R.fit_stages(6, x_tile + 5120, a_bufs) == 5
    assert R.fit_stages(7, x_tile, 0) == 7 and R.fit_stages(7, x_tile, a_bufs) == 6
    assert R.fit_stages(4, x_tile, a_bufs) == 4
