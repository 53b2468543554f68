"""NumPy FUSED_LINEAR kernel (backends/numpy/linear.py) vs torch. Shape/dtype errors are the
registry's job (build time): tests/registry/test_linear.py::test_validation_errors."""
import numpy as np
import pytest
import torch

from fuelgraph.backends.numpy import linear

from .kernel_oracle import DTYPES, check, rand, t64, tdt


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("ash,bsh", [((4, 8), (8, 3)), ((1, 1), (1, 1)), ((2, 3, 5, 8), (8, 4)),
                                     ((2, 1, 5, 8), (3, 8, 4)), ((5, 8), (2, 8, 4)),
                                     ((2, 3, 5, 8), (2, 3, 8, 4)), ((3, 0), (0, 2)),
                                     ((2, 3, 4), (4, 0))])
def test_fused_linear(dt, ash, bsh, chunking):
    rng = np.random.default_rng(1)
    a, b, bias = rand(rng, ash, dt), rand(rng, bsh, dt), rand(rng, bsh[-1:], dt)
    out = linear.fused_linear(a, b, bias)
    ref = t64(a) @ t64(b) + t64(bias)
    same = torch.matmul(tdt(a, dt), tdt(b, dt)) + tdt(bias, dt)
    check(out, ref, dt, same, rtol=1e-5 if dt == "float32" else None)


def test_fused_linear_large_magnitude():
    rng = np.random.default_rng(2)
    a, b, bias = rand(rng, (64, 96), "float32", 1e3), rand(rng, (96, 33), "float32", 1e3), \
        rand(rng, (33,), "float32", 1e6)
    check(linear.fused_linear(a, b, bias), t64(a) @ t64(b) + t64(bias), "float32", rtol=1e-5)
