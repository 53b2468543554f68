"""NumPy last-dim norm kernels (backends/numpy/norm.py: RMS / layer norm, forward and backward)
vs torch. Shape/dtype errors are the registry's job (build time):
tests/registry/test_norm.py::test_forward_validation_errors / test_helper_validation_errors."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fuelgraph.backends.numpy import norm

from .kernel_oracle import DTYPES, check, rand, t64, tdt

NORM_CASES = [((7,), 1.0, 0.0), ((1, 1), 1.0, 0.0), ((3, 5, 64), 1.0, 0.0), ((2, 1, 300), 1.0, 0.0),
              ((33, 1024), 1e4, 0.0), ((9, 100), 0.01, 100.0)]


def _torch_norm(kind, x, n, eps):
    return F.rms_norm(x, (n,), eps=eps) if kind == "rms" else F.layer_norm(x, (n,), eps=eps)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("shape,scale,offset", NORM_CASES)
def test_norm_forward(dt, kind, shape, scale, offset, chunking):
    rng = np.random.default_rng(3)
    x, n, eps = rand(rng, shape, dt, scale, offset), shape[-1], 1e-5
    fn = norm.rms_norm_last_dim if kind == "rms" else norm.layer_norm_last_dim
    out = fn(x, eps=eps)
    check(out, _torch_norm(kind, t64(x), n, eps), dt, _torch_norm(kind, tdt(x, dt), n, eps),
          cond=kind == "ln" and offset > 100 * scale)      # mean >> spread: f32 mean limits


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("shape,scale,offset", NORM_CASES)
def test_norm_backward(dt, kind, shape, scale, offset, chunking):
    rng = np.random.default_rng(4)
    x, g, n, eps = rand(rng, shape, dt, scale, offset), rand(rng, shape, dt), shape[-1], 1e-6
    fn = norm.rms_norm_last_dim_backward if kind == "rms" else norm.layer_norm_last_dim_backward
    out = fn(x, g, eps=eps)
    xr = t64(x, grad=True)
    ref, = torch.autograd.grad(_torch_norm(kind, xr, n, eps), xr, t64(g))
    xs = tdt(x, dt, grad=True)
    same, = torch.autograd.grad(_torch_norm(kind, xs, n, eps), xs, tdt(g, dt))
    x64 = x.astype(np.float64)
    spread = x64 if kind == "rms" else x64 - x64.mean(-1, keepdims=True)
    r = 1 / np.sqrt((spread ** 2).mean(-1, keepdims=True) + eps)
    # dx = r*g - (correction): the natural scale is |g| * r even where the two terms cancel
    check(out, ref, dt, same, scale=float(np.abs(g.astype(np.float64) * r).max()),
          cond=kind == "ln" and offset > 100 * scale)


def test_norm_edge_cases():
    z = np.zeros((2, 4), np.float32)
    assert np.isnan(norm.rms_norm_last_dim(z, eps=0.0)).all()      # 0 * inf, as specified
    np.testing.assert_array_equal(norm.layer_norm_last_dim(z, eps=1e-5), z)
