"""REDUCE_MAX_TO_BACKWARD (id 10) and POWI_BACKWARD (id 15) vs torch autograd: called directly
through F.* and reached from the gradients of x.max()/x.min() and x ** n. Ties share the
gradient evenly and NaN windows give NaN (torch amax); x ** n for negative n and n = 0
(zeros, H.18); the four float dtypes; kernel vs recipe."""
import ml_dtypes
import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph import FuelGraphError

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
      "float16": np.float16}
TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
         "float16": torch.float16}


def _ties(rng, shape, dtype):
    """Small integers: many tied maxima in every window."""
    return rng.integers(-2, 3, size=shape).astype(NP[dtype])


def _torch_amax_grad(x, axes, g, dtype="float64"):
    tx = torch.tensor(np.asarray(x, np.float64)).to(TORCH[dtype]).requires_grad_()
    tx.amax(dim=axes, keepdim=True).backward(torch.tensor(np.asarray(g, np.float64)).to(TORCH[dtype]))
    return tx.grad.double().numpy()


def _close(ours, ref, dtype, same=None):
    ours = np.asarray(ours, np.float64)
    assert np.array_equal(np.isnan(ours), np.isnan(ref))
    ok = ~np.isnan(ref)
    if dtype == "float64":
        np.testing.assert_allclose(ours[ok], ref[ok], rtol=1e-14, atol=1e-15)
    elif dtype == "float32":
        np.testing.assert_allclose(ours[ok], ref[ok], rtol=1e-6, atol=1e-7)
    else:
        err = np.abs(ours[ok] - ref[ok]).max(initial=0)
        terr = np.abs(same[ok] - ref[ok]).max(initial=0)
        assert err <= 2 * terr + 1e-6 * max(np.abs(ref[ok]).max(initial=1), 1), (err, terr)


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("shape,axes", [((4, 6), (1,)), ((4, 6), (0,)), ((3, 4, 5), (0, 2)),
                                        ((2, 3, 4), (0, 1, 2)), ((5, 1, 3), (2,))])
def test_reduce_max_to_backward_matches_torch_amax(dtype, shape, axes):
    rng = np.random.default_rng(len(shape) * 10 + sum(axes))
    x = _ties(rng, shape, dtype)
    gshape = tuple(1 if i in axes else d for i, d in enumerate(shape))
    g = rng.standard_normal(gshape).astype(NP[dtype])
    out = F.reduce_max_to_backward(fg.tensor(x), fg.tensor(g))
    assert out.shape == shape and out.dtype.name == dtype
    ref = _torch_amax_grad(x, axes, g)
    same = _torch_amax_grad(x, axes, g, dtype)
    _close(out.numpy(), ref, dtype, same)
    _close(fg.realize([out], lower_all=True)[0], ref, dtype, same)     # the recipe


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reduce_max_nan_windows(dtype):
    x = np.array([[1.0, np.nan, 3.0], [2.0, 5.0, 5.0], [np.nan, np.nan, 0.0]], NP[dtype])
    g = np.array([[1.0], [2.0], [3.0]], NP[dtype])
    ref = _torch_amax_grad(x, (1,), g)
    assert np.isnan(ref[0]).all() and np.isnan(ref[2]).all()
    out = F.reduce_max_to_backward(fg.tensor(x), fg.tensor(g))
    _close(out.numpy(), ref, dtype)
    _close(fg.realize([out], lower_all=True)[0], ref, dtype)


@pytest.mark.parametrize("reduce", ["max", "min"])
@pytest.mark.parametrize("axis,keepdim", [(None, False), (-1, False), (0, True), ((0, 2), False)])
def test_reached_from_max_and_min_gradients(reduce, axis, keepdim):
    rng = np.random.default_rng(3)
    x = _ties(rng, (3, 4, 5), "float64")
    xt = fg.tensor(x, requires_grad=True)
    y = getattr(xt, reduce)(axis, keepdim)
    w = rng.standard_normal(y.shape)
    (gx,) = fg.grad([(y * fg.tensor(w)).sum()], [xt])
    assert fg.explain(gx).fused_ops.get("reduce_max_to_backward") == 1
    tx = torch.tensor(x, requires_grad=True)
    dims = tuple(range(3)) if axis is None else axis
    ty = getattr(tx, "a" + reduce)(dim=dims, keepdim=keepdim)
    (ty * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-14, atol=1e-15)


def test_reduce_max_to_backward_errors():
    x = fg.tensor(np.zeros((3, 4), np.float32))
    with pytest.raises(FuelGraphError, match="reduce_max_to_backward: grad has shape"):
        F.reduce_max_to_backward(x, fg.tensor(np.zeros((3, 2), np.float32)))
    with pytest.raises(FuelGraphError, match="reduce_max_to_backward: grad has shape"):
        F.reduce_max_to_backward(x, fg.tensor(np.zeros((3,), np.float32)))
    with pytest.raises(FuelGraphError, match="dtype"):
        F.reduce_max_to_backward(x, fg.tensor(np.zeros((3, 1), np.float64)))
    with pytest.raises(FuelGraphError, match="dtype"):
        F.reduce_max_to_backward(fg.tensor(np.zeros((3, 4), np.int64)),
                                 fg.tensor(np.zeros((3, 1), np.int64)))


# ---- POWI_BACKWARD -------------------------------------------------------------------------
EXPS = [-3, -2, -1, 0, 1, 2, 3, 5]


def _torch_pow_grad(x, n, g, dtype="float64"):
    tx = torch.tensor(np.asarray(x, np.float64)).to(TORCH[dtype]).requires_grad_()
    (tx ** n).backward(torch.tensor(np.asarray(g, np.float64)).to(TORCH[dtype]))
    return tx.grad.double().numpy()


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("n", EXPS)
def test_powi_backward_matches_torch(dtype, n):
    rng = np.random.default_rng(n + 10)
    x = (rng.uniform(0.5, 1.5, (4, 5)) * rng.choice([-1, 1], (4, 5))).astype(NP[dtype])
    g = rng.standard_normal((4, 5)).astype(NP[dtype])
    out = F.powi_backward(fg.tensor(x), fg.tensor(g), n)
    assert out.shape == x.shape and out.dtype.name == dtype
    ref = _torch_pow_grad(x, n, g)
    same = _torch_pow_grad(x, n, g, dtype)
    _close(out.numpy(), ref, dtype, same)
    _close(fg.realize([out], lower_all=True)[0], ref, dtype, same)


@pytest.mark.parametrize("n", EXPS)
def test_reached_from_integer_pow_gradient(n):
    rng = np.random.default_rng(1)
    x = rng.uniform(0.5, 2.0, (3, 4)) * rng.choice([-1, 1], (3, 4))
    xt = fg.tensor(x, requires_grad=True)
    w = rng.standard_normal((3, 4))
    (gx,) = fg.grad([((xt ** n) * fg.tensor(w)).sum()], [xt])
    # x**1, x**2, x**-1 canonicalize to x, x*x, 1/x before differentiating (autograd
    # differentiates the canonical, fused form); every other integer n uses the helper
    want = 0 if n in (1, 2, -1) else 1
    rep = fg.explain(gx)      # kept, or run inside the glue region around it
    assert rep.fused_ops.get("powi_backward", 0) + rep.dissolved.get("powi_backward", 0) == want
    tx = torch.tensor(x, requires_grad=True)
    ((tx ** n) * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-13, atol=1e-14)


def test_powi_at_zero():
    x = np.array([0.0, 1.0, -2.0])
    g = np.ones(3)
    for n in (0, 2, -2, 1):
        ours = F.powi_backward(fg.tensor(x), fg.tensor(g), n)
        ref = _torch_pow_grad(x, n, g)
        np.testing.assert_array_equal(ours.numpy(), ref)          # x**0 -> zeros, not NaN
        np.testing.assert_array_equal(fg.realize([ours], lower_all=True)[0], ref)


def test_powi_second_order():
    x = np.array([[0.7, -1.3, 2.0]])
    xt = fg.tensor(x, requires_grad=True)
    (g1,) = fg.grad([(xt ** -3).sum()], [xt])
    (g2,) = fg.grad([g1.sum()], [xt])
    tx = torch.tensor(x, requires_grad=True)
    (t1,) = torch.autograd.grad((tx ** -3).sum(), tx, create_graph=True)
    (t2,) = torch.autograd.grad(t1.sum(), tx)
    np.testing.assert_allclose(g2.numpy(), t2.numpy(), rtol=1e-13)


def test_powi_backward_errors():
    with pytest.raises(FuelGraphError, match="powi_backward"):
        F.powi_backward(fg.tensor(np.zeros((3,), np.float32)), fg.tensor(np.zeros((4,), np.float32)), 2)
    with pytest.raises(FuelGraphError, match="powi_backward"):
        F.powi_backward(fg.tensor(np.zeros((3,), np.float32)), fg.tensor(np.zeros((3,), np.float64)), 2)
