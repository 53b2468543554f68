"""Edge values where a rewrite or a builder could silently change a number: 16-bit means,
reciprocal constants, signed zeros, Python's % and relu's gradient at 0 (torch / NumPy are the
references)."""
import numpy as np
import torch

import fuelgraph as fg
import fuelgraph.functional as F


def test_float16_mean_does_not_overflow_its_sum():
    x = fg.tensor(np.ones(100000, np.float16))
    assert float(x.mean().numpy()) == 1.0
    a = (np.random.default_rng(0).standard_normal((2, 1024)) * 10).astype(np.float16)
    want = torch.nn.functional.rms_norm(torch.tensor(a, dtype=torch.float32), (1024,), eps=1e-6)
    for lower_all in (False, True):
        (got,) = fg.realize([F.rms_norm_last_dim(fg.tensor(a), 1e-6)], lower_all=lower_all)
        np.testing.assert_allclose(got.astype(np.float32), want.numpy(), rtol=2e-3, atol=2e-3)


def test_division_by_constants_whose_reciprocal_does_not_fit():
    # a Python scalar takes the tensor's dtype (JAX's weak typing): 1e-5 is a float16 subnormal,
    # and 1/that overflows float16, so x / c must stay a division
    h = np.array([1e-3], np.float16)
    want = (h.astype(np.float32) / np.float16(1e-5).astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal((fg.tensor(h) / 1e-5).numpy(), want)
    f = np.array([1e-5], np.float32)
    np.testing.assert_allclose((fg.tensor(f) / 1e-40).numpy(), f / np.float32(1e-40), rtol=1e-6)


def test_zero_minus_zero_keeps_its_sign():
    x = fg.tensor(np.array([0.0], np.float32))
    with np.errstate(divide="ignore"):
        want = 1.0 / (np.float32(0.0) - np.array([0.0], np.float32))
    np.testing.assert_array_equal((1.0 / (0.0 - x)).numpy(), want)


def test_remainder_follows_python_and_torch():
    a = np.array([-7.0, 7.0, -7.5, 2.25], np.float32)
    got = (fg.tensor(a) % 3).numpy()
    np.testing.assert_array_equal(got, torch.remainder(torch.tensor(a), 3).numpy())
    np.testing.assert_array_equal(got, np.mod(a, np.float32(3)))


def test_relu_gradient_at_zero_is_zero_and_nan_propagates():
    a = np.array([0.0, 1.0, -1.0, np.nan])
    x = fg.tensor(a, requires_grad=True)
    y = x.relu()
    y.sum().backward()
    t = torch.tensor(a, requires_grad=True)
    torch.relu(t).sum().backward()
    np.testing.assert_array_equal(y.numpy(), torch.relu(torch.tensor(a)).numpy())
    np.testing.assert_array_equal(x.grad.numpy()[:3], t.grad.numpy()[:3])


def test_numpy_results_are_read_only_values():
    y = fg.tensor(np.ones(3, np.float32)) * 2.0
    a = y.numpy()
    assert not a.flags.writeable
    np.testing.assert_array_equal(y.numpy(), np.full(3, 2.0, np.float32))
