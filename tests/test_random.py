"""Seeded random numbers (fuelgraph/random.py): reproducible per seed, the same numbers on
every backend build of a graph, sound distributions, and new numbers on every call."""
import math

import numpy as np
import pytest

import fuelgraph as fg
from fuelgraph import FuelGraphError


def test_seed_reproduces_and_calls_advance():
    fg.manual_seed(123)
    a, b = fg.rand(1000).numpy(), fg.rand(1000).numpy()
    fg.manual_seed(123)
    np.testing.assert_array_equal(fg.rand(1000).numpy(), a)
    assert not np.array_equal(a, b)
    fg.manual_seed(124)
    assert not np.array_equal(fg.rand(1000).numpy(), a)


def test_distributions():
    fg.manual_seed(0)
    u = fg.rand(200_000).numpy()
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005
    assert abs(u.var() - 1 / 12) < 0.002
    z = fg.randn(200_000).numpy()
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    assert abs((np.abs(z) < 1).mean() - 0.6827) < 0.005        # the normal's shape
    hist = np.bincount((u * 16).astype(int), minlength=16) / u.size
    assert np.abs(hist - 1 / 16).max() < 0.003
    r = fg.randint(3, 10, (50_000,)).numpy()
    assert r.min() == 3 and r.max() == 9 and r.dtype == np.int64
    assert np.abs(np.bincount(r - 3) / r.size - 1 / 7).max() < 0.01
    c = np.corrcoef(u[:-1], u[1:])[0, 1]
    assert abs(c) < 0.01                                      # neighbours independent


def test_dtypes_shapes_and_like():
    fg.manual_seed(1)
    x = fg.rand(2, 3, dtype=fg.bfloat16)
    assert x.shape == (2, 3) and x.dtype == fg.bfloat16
    assert fg.randn((4, 5)).shape == (4, 5)
    assert fg.rand_like(x).dtype == fg.bfloat16 and fg.randn_like(x).shape == (2, 3)
    assert fg.rand(0).shape == (0,)
    with pytest.raises(FuelGraphError, match="rand: dtype must be a float dtype"):
        fg.rand(3, dtype=fg.int32)
    with pytest.raises(FuelGraphError, match="manual_seed: seed must be an int"):
        fg.manual_seed(1.5)


def test_dropout_and_init_methods():
    fg.manual_seed(2)
    x = fg.ones((100, 100))
    y = fg.dropout(x, 0.25).numpy()
    assert abs((y == 0).mean() - 0.25) < 0.02
    np.testing.assert_allclose(y[y != 0], 1 / 0.75)
    assert fg.dropout(x, 0.5, training=False) is x
    p = fg.zeros(1000)
    p.uniform_(-2, 2)
    v = p.numpy()
    assert v.min() >= -2 and v.max() < 2 and v.std() > 1
    p.normal_(3.0, 0.5)
    assert abs(p.numpy().mean() - 3.0) < 0.1


def test_bool_mask_getitem_explains():
    x = fg.tensor(np.arange(4.0))
    with pytest.raises(FuelGraphError, match="boolean mask selects a data-dependent"):
        x[x > 1]
    x[x > 1] = 0.0
    assert x.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert not math.isnan(float(x.sum()))
