"""NumPy kernels of the primitives' backward helpers (backends/numpy/helpers.py):
REDUCE_MAX_TO_BACKWARD and POWI_BACKWARD, vs torch autograd. A grad not shaped like the keepdim
max is a build-time registry error: tests/registry/test_backward_helpers.py::
test_reduce_max_to_backward_errors."""
import numpy as np
import pytest
import torch

from fuelgraph.backends.numpy import helpers

from .kernel_oracle import DTYPES, NP, as64, check, rand, t64, tdt

# ----------------------------------------------------------------------------- reduce_max backward
RMAX_CASES = [((4, 6), (4, 1)), ((4, 6), (1, 6)), ((2, 3, 4), (2, 1, 1)), ((2, 3, 4), (1, 3, 1)),
              ((5,), (1,)), ((3, 1, 4), (3, 1, 1)), ((2, 50, 40), (2, 50, 1))]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs,gs", RMAX_CASES)
@pytest.mark.parametrize("ties", [True, False])
def test_reduce_max_backward(dt, xs, gs, ties, chunking):
    rng = np.random.default_rng(8)
    x = (rng.integers(0, 3, xs) if ties else rng.standard_normal(xs) * 1e3).astype(NP[dt])
    g = rand(rng, gs, dt)
    axes = tuple(i for i, (a, b) in enumerate(zip(gs, xs)) if a == 1 and b != 1)
    out = helpers.reduce_max_to_backward(x, g)
    xr, xh = t64(x, grad=True), tdt(x, dt, grad=True)
    ref, = torch.autograd.grad(torch.amax(xr, dim=axes, keepdim=True), xr, t64(g))
    same, = torch.autograd.grad(torch.amax(xh, dim=axes, keepdim=True), xh, tdt(g, dt))
    check(out, ref, dt, same)


@pytest.mark.parametrize("dt", DTYPES)
def test_reduce_max_backward_nan_inf(dt):
    x = np.array([[1, np.nan, 3], [2, 2, 1], [-np.inf, -np.inf, -np.inf], [np.inf, 0, np.inf]],
                 NP[dt])
    g = np.array([[5], [0], [3], [2]], NP[dt])
    out = helpers.reduce_max_to_backward(x, g)
    xr = t64(x, grad=True)
    ref, = torch.autograd.grad(torch.amax(xr, dim=1, keepdim=True), xr, t64(g))
    assert np.isnan(as64(out)[0]).all()                        # NaN window -> NaN, like torch
    np.testing.assert_array_equal(as64(out), ref.numpy())


# ----------------------------------------------------------------------------- powi backward
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("exp", [-3, -1, 0, 1, 2, 5, 8])
def test_powi_backward(dt, exp, chunking):
    rng = np.random.default_rng(9)
    x = rand(rng, (3, 67), dt, 1.5)
    x.reshape(-1)[::10] = 0                                    # x = 0: 0, +-inf or g
    g = rand(rng, (3, 67), dt)
    out = helpers.powi_backward(x, g, exp=exp)
    xr, xh = t64(x, grad=True), tdt(x, dt, grad=True)
    ref, = torch.autograd.grad(xr ** exp, xr, t64(g))
    same, = torch.autograd.grad(xh ** exp, xh, tdt(g, dt))
    check(out, ref, dt, same)


def test_powi_backward_exact_and_zero():
    x = np.array([-3, -2, -1, 0, 1, 2, 3], np.float32)
    g = np.ones_like(x)
    np.testing.assert_array_equal(helpers.powi_backward(x, g, exp=4), 4 * x.astype(np.float64) ** 3)
    z = helpers.powi_backward(np.array([0, np.nan, np.inf], np.float32), np.ones(3, np.float32),
                              exp=0)
    assert z.dtype == np.float32 and not z.any()               # H.18: zeros, not NaN
