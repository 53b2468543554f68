"""SOFTMAX_LAST_DIM (id 1) and SOFTMAX_LAST_DIM_BACKWARD (id 7): forward, first and second
order gradients vs torch CPU, the primitive recipe vs the fused kernel, edge cases (huge
values, -inf masks, all -inf rows, empty tensors). 16-bit dtypes follow the FlashAttention rule:
our error vs float64 torch <= 2x the error of the same-dtype torch computation + a small atol."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph.registry import FusedOps

DTYPES = {"float32": (fg.float32, np.float32, torch.float32),
          "float64": (fg.float64, np.float64, torch.float64),
          "bfloat16": (fg.bfloat16, ml_dtypes.bfloat16, torch.bfloat16),
          "float16": (fg.float16, np.float16, torch.float16)}
# (1,) and (4, 1): one-element rows; (2, 0, 3): an empty batch
SHAPES = [(1,), (7,), (3, 5), (2, 3, 17), (4, 1), (2, 0, 3)]
LOW = ("bfloat16", "float16")


def _data(shape, dtype, scale=3.0, seed=0):
    """Input already rounded to `dtype`, returned as (array of dtype, float64 copy)."""
    x = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(DTYPES[dtype][1])
    return x, x.astype(np.float64)


def _torch_same_dtype(x64, dtype, fn):
    """torch computation in `dtype` (from the rounded input), returned in float64."""
    return fn(torch.tensor(x64).to(DTYPES[dtype][2])).to(torch.float64).detach().numpy()


def _assert_close(got, ref64, same_dtype_ref, dtype, what=""):
    got = np.asarray(got, np.float64)
    assert got.shape == ref64.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref64), err_msg=f"{what}: NaN pattern")
    m = ~np.isnan(ref64)
    if not m.any():
        return
    if dtype in LOW:
        ours = np.abs(got[m] - ref64[m]).max()
        theirs = np.abs(same_dtype_ref[m] - ref64[m]).max()
        scale = max(np.abs(ref64[m]).max(), 1e-30)
        assert ours <= 2 * theirs + 1e-3 * scale, f"{what}: ours {ours} vs torch {dtype} {theirs}"
    else:
        rtol, atol = (1e-12, 1e-14) if dtype == "float64" else (2e-6, 1e-7)
        np.testing.assert_allclose(got[m], ref64[m], rtol=rtol, atol=atol, err_msg=what)


# ---- forward -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward(dtype, shape):
    x, x64 = _data(shape, dtype)
    y = F.softmax_last_dim(fg.tensor(x))
    assert y.shape == shape and y.dtype == DTYPES[dtype][0]
    got = y.numpy()
    assert got.dtype == np.dtype(DTYPES[dtype][1])
    ref = torch.softmax(torch.tensor(x64), -1).numpy()
    _assert_close(got, ref, _torch_same_dtype(x64, dtype, lambda t: torch.softmax(t, -1)), dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scale", [1e4, -1e4], ids=["big", "neg_big"])
def test_forward_large_magnitudes(dtype, scale):
    x, x64 = _data((3, 11), dtype, scale=scale, seed=1)
    if dtype == "float16":  # keep inside float16's range (max 65504)
        x, x64 = _data((3, 11), dtype, scale=scale / 2, seed=1)
    got = F.softmax_last_dim(fg.tensor(x)).numpy()
    assert np.isfinite(got.astype(np.float64)).all()
    ref = torch.softmax(torch.tensor(x64), -1).numpy()
    _assert_close(got, ref, _torch_same_dtype(x64, dtype, lambda t: torch.softmax(t, -1)), dtype)


def _masked(dtype):
    x, x64 = _data((4, 6), dtype, seed=2)
    x64 = x64.copy()
    x64[0, [1, 4]] = -np.inf          # masked entries
    x64[1, :5] = -np.inf              # one survivor
    x64[2, :] = -np.inf               # all masked: NaN, like torch
    return x64.astype(DTYPES[dtype][1]), x64


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_masked_rows(dtype):
    x, x64 = _masked(dtype)
    got = F.softmax_last_dim(fg.tensor(x)).numpy().astype(np.float64)
    ref = torch.softmax(torch.tensor(x64), -1).numpy()
    assert np.isnan(ref[2]).all() and np.isnan(got[2]).all()
    assert (got[0, [1, 4]] == 0).all() and got[1, 5] == 1.0
    _assert_close(got, ref, _torch_same_dtype(x64, dtype, lambda t: torch.softmax(t, -1)), dtype)


def test_forward_rows_with_inf_or_nan_are_nan_like_torch():
    x64 = np.array([[0.0, np.inf, 1.0], [np.nan, 0.0, 1.0], [np.inf, np.inf, -np.inf]])
    got = F.softmax_last_dim(fg.tensor(x64)).numpy()
    ref = torch.softmax(torch.tensor(x64), -1).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))


# ---- the lowered recipe vs the fused kernel -------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lowered_recipe_matches_kernel(dtype, shape):
    x, x64 = _data(shape, dtype, seed=3)
    y = F.softmax_last_dim(fg.tensor(x))
    rep = fg.explain([y])
    assert rep.fused_ops == {"softmax_last_dim": 1}
    low = fg.explain([y], lower_all=True)
    assert low.fused_ops == {} and low.lowered.get("softmax_last_dim") == 1
    fused = fg.realize([y])[0].astype(np.float64)
    lowered = fg.realize([y], lower_all=True)[0].astype(np.float64)
    ref = torch.softmax(torch.tensor(x64), -1).numpy()
    same = _torch_same_dtype(x64, dtype, lambda t: torch.softmax(t, -1))
    _assert_close(lowered, ref, same, dtype, "lowered")
    _assert_close(fused, ref, same, dtype, "fused")
    tol = {"float64": 1e-13, "float32": 1e-6, "bfloat16": 2e-2, "float16": 2e-3}[dtype]
    np.testing.assert_allclose(lowered, fused, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_lowered_recipe_masked_and_large(dtype):
    x, x64 = _masked(dtype)
    x = np.concatenate([x, (np.random.default_rng(4).standard_normal((2, 6)) * 1e4)
                        .astype(x.dtype)])
    y = F.softmax_last_dim(fg.tensor(x))
    fused, lowered = fg.realize([y])[0], fg.realize([y], lower_all=True)[0]
    ref = torch.softmax(torch.tensor(x.astype(np.float64)), -1).numpy()
    np.testing.assert_array_equal(np.isnan(lowered), np.isnan(ref))
    np.testing.assert_allclose(lowered, ref, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(fused, ref, rtol=2e-6, atol=1e-7)


def test_backward_helper_lowered_matches_kernel():
    rng = np.random.default_rng(5)
    y = F.softmax_last_dim(fg.tensor(rng.standard_normal((3, 9))))
    dx = F.softmax_last_dim_backward(y, fg.tensor(rng.standard_normal((3, 9))))
    assert fg.explain([dx]).fused_ops == {"softmax_last_dim": 1, "softmax_last_dim_backward": 1}
    np.testing.assert_allclose(fg.realize([dx])[0], fg.realize([dx], lower_all=True)[0],
                               rtol=1e-12, atol=1e-14)


# ---- gradients -----------------------------------------------------------------------------
def _torch_grad(x64, g64, dtype):
    t = torch.tensor(x64).to(DTYPES[dtype][2]).requires_grad_(True)
    y = torch.softmax(t, -1)
    y.backward(torch.tensor(g64).to(DTYPES[dtype][2]))
    return t.grad.to(torch.float64).numpy()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_first_order_gradient_via_backward(dtype, shape):
    x, x64 = _data(shape, dtype, seed=6)
    g64 = np.random.default_rng(7).standard_normal(shape).astype(DTYPES[dtype][1]).astype(np.float64)
    xt = fg.tensor(x, requires_grad=True)
    y = F.softmax_last_dim(xt)
    (y * fg.tensor(g64.astype(DTYPES[dtype][1]))).sum().backward()
    assert xt.grad.dtype == DTYPES[dtype][0] and xt.grad.shape == shape
    got = xt.grad.numpy()
    _assert_close(got, _torch_grad(x64, g64, "float64"), _torch_grad(x64, g64, dtype), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradient_masked_rows(dtype):
    x, x64 = _masked(dtype)
    g64 = np.random.default_rng(8).standard_normal(x.shape)
    xt = fg.tensor(x, requires_grad=True)
    (gx,) = fg.grad([F.softmax_last_dim(xt)], [xt], [fg.tensor(g64.astype(x.dtype))])
    ref = _torch_grad(x64, g64.astype(x.dtype).astype(np.float64), "float64")
    got = gx.numpy().astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert (got[0, [1, 4]] == 0).all()
    _assert_close(got, ref, None, dtype)


def test_gradient_via_fused_helper_and_grad_of_sum_is_zero():
    rng = np.random.default_rng(9)
    x = fg.tensor(rng.standard_normal((4, 7)), requires_grad=True)
    y = F.softmax_last_dim(x)
    (g,) = fg.grad(y.sum(), [x])
    np.testing.assert_allclose(g.numpy(), np.zeros((4, 7)), atol=1e-15)
    rep = fg.explain([g])
    assert rep.fused_ops.get("softmax_last_dim_backward") == 1


def test_gradient_float64_vs_finite_differences():
    rng = np.random.default_rng(10)
    a, w = rng.standard_normal((2, 5)), rng.standard_normal((2, 5))

    def f_np(v):
        e = np.exp(v - v.max(-1, keepdims=True))
        return np.sum((e / e.sum(-1, keepdims=True)) ** 2 * w)

    x = fg.tensor(a, requires_grad=True)
    (g,) = fg.grad((F.softmax_last_dim(x) ** 2 * fg.tensor(w)).sum(), [x])
    fd = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        e = np.zeros_like(a)
        e[i] = 1e-6
        fd[i] = (f_np(a + e) - f_np(a - e)) / 2e-6
    np.testing.assert_allclose(g.numpy(), fd, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1)], ids=str)
def test_second_order_vs_torch_double_backward(shape):
    rng = np.random.default_rng(11)
    a, w, v = (rng.standard_normal(shape) for _ in range(3))
    x = fg.tensor(a, requires_grad=True)
    (g,) = fg.grad((F.softmax_last_dim(x) * fg.tensor(w)).sum() +
                   (F.softmax_last_dim(x * 2.0) ** 3).sum(), [x])
    (h,) = fg.grad((g * fg.tensor(v)).sum(), [x])
    tx = torch.tensor(a, requires_grad=True)
    (tg,) = torch.autograd.grad((torch.softmax(tx, -1) * torch.tensor(w)).sum() +
                                (torch.softmax(tx * 2.0, -1) ** 3).sum(), [tx], create_graph=True)
    (th,) = torch.autograd.grad((tg * torch.tensor(v)).sum(), [tx])
    got = fg.realize([g, h])
    np.testing.assert_allclose(got[0], tg.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[1], th.numpy(), rtol=1e-9, atol=1e-12)
    low = fg.realize([g, h], lower_all=True)
    np.testing.assert_allclose(low[1], th.numpy(), rtol=1e-9, atol=1e-12)


def test_second_order_float32():
    rng = np.random.default_rng(12)
    a, v = rng.standard_normal((3, 6)).astype(np.float32), rng.standard_normal((3, 6))
    x = fg.tensor(a, requires_grad=True)
    (g,) = fg.grad((F.softmax_last_dim(x) ** 2).sum(), [x])
    (h,) = fg.grad((g * fg.tensor(v.astype(np.float32))).sum(), [x])
    tx = torch.tensor(a.astype(np.float64), requires_grad=True)
    (tg,) = torch.autograd.grad((torch.softmax(tx, -1) ** 2).sum(), [tx], create_graph=True)
    (th,) = torch.autograd.grad((tg * torch.tensor(v)).sum(), [tx])
    assert h.dtype == fg.float32
    np.testing.assert_allclose(h.numpy(), th.numpy(), rtol=1e-4, atol=1e-6)


# ---- the backward helper (id 7) ------------------------------------------------------------
def _torch_bw(y, g):
    return y * (g - (g * y).sum(-1, keepdim=True))


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 17), (2, 0, 3)], ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_backward_helper_vs_torch_formula(dtype, shape):
    rng = np.random.default_rng(13)
    y64 = torch.softmax(torch.tensor(rng.standard_normal(shape)), -1).numpy()
    y = y64.astype(DTYPES[dtype][1])
    g = rng.standard_normal(shape).astype(DTYPES[dtype][1])
    y64, g64 = y.astype(np.float64), g.astype(np.float64)
    out = F.softmax_last_dim_backward(fg.tensor(y), fg.tensor(g))
    assert out.shape == shape and out.dtype == DTYPES[dtype][0]
    ref = _torch_bw(torch.tensor(y64), torch.tensor(g64)).numpy()
    td = DTYPES[dtype][2]
    same = _torch_bw(torch.tensor(y64).to(td), torch.tensor(g64).to(td)).to(torch.float64).numpy()
    _assert_close(out.numpy(), ref, same, dtype)
    _assert_close(fg.realize([out], lower_all=True)[0], ref, same, dtype, "lowered")


def test_backward_helper_is_differentiable_second_order():
    """Id 7 has BackwardKind.DECOMPOSE: its gradient (w.r.t. y and grad) is the gradient of its
    recipe; compare with torch autograd through the same formula."""
    reg = fg.default_registry()
    assert reg.entry(FusedOps.SOFTMAX_LAST_DIM_BACKWARD).backward.kind == "decompose"
    assert str(reg.entry(FusedOps.SOFTMAX_LAST_DIM).backward) == "fused(softmax_last_dim_backward)"
    rng = np.random.default_rng(14)
    a, b, w = (rng.standard_normal((3, 6)) for _ in range(3))
    yt = fg.tensor(a, requires_grad=True)
    gt = fg.tensor(b, requires_grad=True)
    out = F.softmax_last_dim_backward(yt, gt)
    dy, dg = fg.grad([out], [yt, gt], [fg.tensor(w)])
    ty, tg = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    tdy, tdg = torch.autograd.grad([_torch_bw(ty, tg)], [ty, tg], [torch.tensor(w)])
    got = fg.realize([dy, dg])
    np.testing.assert_allclose(got[0], tdy.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got[1], tdg.numpy(), rtol=1e-12, atol=1e-13)


def test_third_order_through_softmax():
    """softmax -> helper 7 -> its recipe -> grads of the recipe: grad of grad of grad."""
    a = np.random.default_rng(15).standard_normal((2, 4))
    x = fg.tensor(a, requires_grad=True)
    (g,) = fg.grad((F.softmax_last_dim(x) ** 2).sum(), [x])
    (h,) = fg.grad((g ** 2).sum(), [x])
    (k,) = fg.grad(h.sin().sum(), [x])
    tx = torch.tensor(a, requires_grad=True)
    (tg,) = torch.autograd.grad((torch.softmax(tx, -1) ** 2).sum(), [tx], create_graph=True)
    (th,) = torch.autograd.grad((tg ** 2).sum(), [tx], create_graph=True)
    (tk,) = torch.autograd.grad(th.sin().sum(), [tx])
    np.testing.assert_allclose(k.numpy(), tk.numpy(), rtol=1e-9, atol=1e-12)


def test_registry_entries():
    reg = fg.default_registry()
    e1, e7 = reg.entry(1), reg.entry("softmax_last_dim_backward")
    assert e1.name == "softmax_last_dim" and e1.id == FusedOps.SOFTMAX_LAST_DIM == 1
    assert e7.id == FusedOps.SOFTMAX_LAST_DIM_BACKWARD == 7 and e7.family == "backward"
    assert e1.has_pattern and e1.family == "forward"
    assert reg.entry(FusedOps.SOFTMAX_LAST_DIM) is e1
