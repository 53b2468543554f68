"""NumPy INPLACE_AFFINE kernel (backends/numpy/affine.py) vs torch, in place and with `out=`.
That the runtime never overwrites a buffer it may not (a read-only or user-owned input) is
checked through the API: tests/registry/test_affine.py::test_read_only_input_is_never_written."""
import numpy as np
import pytest
import torch

from fuelgraph.backends.numpy import affine

from .kernel_oracle import DTYPES, NP, TORCH, as64, rand


def _expect(x, dt, mul, add):
    t = torch.from_numpy(x.astype(np.float64)).to(torch.float64 if dt == "float64"
                                                  else torch.float32)
    return (t * mul + add).to(TORCH[dt])                       # acc-dtype mul, add, one store


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (), (5,), (3, 4, 5), (300, 1000)])
def test_inplace_affine(dt, shape, chunking):
    x = rand(np.random.default_rng(10), shape, dt, 4.0)
    mul, add = 1.37, -0.25
    expect = _expect(x, dt, mul, add)
    res = affine.inplace_affine(x, mul=mul, add=add)
    assert res is x and x.dtype == np.dtype(NP[dt]) and x.shape == shape
    np.testing.assert_array_equal(as64(x), as64(expect))


@pytest.mark.parametrize("dt", DTYPES)
def test_inplace_affine_out_only_reads_x(dt, chunking):
    """With `out=` (what the runtime passes when it may not overwrite x) a read-only x is only
    read and the result is bit-identical to the in-place one."""
    x = rand(np.random.default_rng(13), (7, 50), dt, 4.0)
    x0 = x.copy()
    x.flags.writeable = False
    out = np.empty_like(x)
    res = affine.inplace_affine(x, mul=1.37, add=-0.25, out=out)
    assert res is out
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(as64(out), as64(_expect(x0, dt, 1.37, -0.25)))
