"""NumPy FUSED_SOFTMAX_CROSS_ENTROPY kernels (backends/numpy/loss.py), forward and backward, vs
torch. The run-time check that a valid target lies in [0, V) stays here (the kernel raises it
when the graph runs); build-time errors (targets shape/dtype, reduction, ignore_index) are the
registry's: tests/registry/test_loss.py::test_build_time_errors."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fuelgraph.backends.numpy import loss
from fuelgraph.errors import FuelGraphError

from .kernel_oracle import DTYPES, check, rand, t64, tdt

CE_SHAPES = [(11,), (5, 7), (2, 3, 11), (1, 1), (64, 300)]


def _targets(rng, shape, v, ignore_index):
    t = rng.integers(0, v, shape[:-1]).astype(np.int64)
    if ignore_index is not None and t.size > 1:
        t.reshape(-1)[::3] = ignore_index
    return t


def _torch_ce(x, t, reduction, ignore_index):
    v = x.shape[-1]
    out = F.cross_entropy(x.reshape(-1, v), torch.from_numpy(t).reshape(-1), reduction=reduction,
                          ignore_index=-100 if ignore_index is None else ignore_index)
    return out.reshape(t.shape) if reduction == "none" else out


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", CE_SHAPES)
@pytest.mark.parametrize("reduction,ignore_index,scale", [
    ("mean", -100, 1.0), ("sum", None, 1.0), ("none", 2, 30.0), ("mean", 2, 30.0),
    ("none", None, 1.0)])
def test_cross_entropy(dt, shape, reduction, ignore_index, scale, chunking):
    rng = np.random.default_rng(6)
    x = rand(rng, shape, dt, scale)
    t = _targets(rng, shape, shape[-1], ignore_index)
    out = loss.fused_softmax_cross_entropy(x, t, reduction=reduction, ignore_index=ignore_index)
    out_dt = "float64" if dt == "float64" else "float32"
    assert out.shape == (t.shape if reduction == "none" else ())
    ref = _torch_ce(t64(x), t, reduction, ignore_index)
    check(out, ref, dt, _torch_ce(tdt(x, dt), t, reduction, ignore_index), out_dt=out_dt)
    # backward vs torch autograd
    g = np.asarray(rng.standard_normal(t.shape if reduction == "none" else ()), np.float32)
    dx = loss.fused_softmax_cross_entropy_backward(x, t, g, reduction=reduction,
                                                   ignore_index=ignore_index)
    xr, xs = t64(x, grad=True), tdt(x, dt, grad=True)
    ref, = torch.autograd.grad(_torch_ce(xr, t, reduction, ignore_index), xr, t64(g))
    same, = torch.autograd.grad(_torch_ce(xs, t, reduction, ignore_index), xs,
                                torch.from_numpy(g).to(xs.dtype))
    check(dx, ref, dt, same)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_all_ignored(reduction):
    x = np.random.default_rng(7).standard_normal((4, 5)).astype(np.float32)
    t = np.full(4, -100, np.int64)
    out = loss.fused_softmax_cross_entropy(x, t, reduction=reduction, ignore_index=-100)
    assert out.dtype == np.float32 and not out.any()              # mean: 0, not 0/0
    g = np.ones(4 if reduction == "none" else (), np.float32)
    dx = loss.fused_softmax_cross_entropy_backward(x, t, g, reduction=reduction, ignore_index=-100)
    assert dx.dtype == np.float32 and dx.shape == x.shape and not dx.any()


def test_cross_entropy_empty_class_axis():
    x = np.zeros((3, 0), np.float32)
    out = loss.fused_softmax_cross_entropy(x, np.full(3, -100), reduction="none", ignore_index=-100)
    assert out.shape == (3,) and not out.any()
    # run-time target check: with V = 0 every valid target is out of range
    with pytest.raises(FuelGraphError, match="'targets'"):
        loss.fused_softmax_cross_entropy(x, np.zeros(3, np.int64), reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("t,ignore_index,bad", [([0, 7, 1], -100, 7), ([0, -1, 1], -100, -1),
                                                ([0, -100, 1], None, -100), ([0, 2, 9], 2, 9)])
def test_cross_entropy_bad_target(t, ignore_index, bad):
    """The run-time out-of-range target check (values are data, not known at build time)."""
    x, t = np.zeros((3, 7), np.float32), np.array(t, np.int64)
    for fn, args in ((loss.fused_softmax_cross_entropy, ()),
                     (loss.fused_softmax_cross_entropy_backward, (np.float32(1),))):
        with pytest.raises(FuelGraphError,
                           match=rf"fused_softmax_cross_entropy.*'targets'.*(?<![\d-]){bad}(?!\d)"):
            fn(x, t, *args, reduction="mean", ignore_index=ignore_index)


# ---- one pass, and the fused linear + cross-entropy ------------------------------------------
# the one-pass cross-entropy equals the forward and the backward kernels; the fused linear +
# cross-entropy equals torch (float64 reference) for every output, never depends on the token
# chunking beyond float32 rounding, and its fwd+bwd kernel equals its forward and backward
import ml_dtypes  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

from fuelgraph.backends.numpy import loss as L  # noqa: E402

REDUCTIONS = ["mean", "sum", "none"]


def _ce_data(rng, r, v, dtype=np.float32):
    x = (rng.standard_normal((r, v)) * 3).astype(dtype)
    t = rng.integers(0, v, r)
    t[1] = -100
    return x, t


def _grad(rng, reduction, n):
    return np.asarray(rng.standard_normal(() if reduction != "none" else (n,)), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ce_fwd_bwd_is_exactly_the_pair(dtype, reduction):
    rng = np.random.default_rng(1)
    x, t = _ce_data(rng, 9, 37, dtype)
    x[3, 5] = 80.0                                   # a row outside the no-shift window
    g = _grad(rng, reduction, 9)
    kw = dict(reduction=reduction, ignore_index=-100)
    loss, dx = L.fused_softmax_cross_entropy_fwd_bwd(x, t, g, **kw)
    assert np.array_equal(loss, L.fused_softmax_cross_entropy(x, t, **kw))
    ref = L.fused_softmax_cross_entropy_backward(x, t, g, **kw)
    assert dx.dtype == ref.dtype and np.array_equal(dx.view(np.uint8), ref.view(np.uint8))


def _flce_data(rng, n, h, v, dtype=np.float32):
    x = rng.standard_normal((n, h)).astype(dtype)
    w = (rng.standard_normal((v, h)) * 0.5).astype(dtype)
    b = rng.standard_normal(v).astype(dtype)
    t = rng.integers(0, v, n)
    t[[0, n // 2]] = -100
    return x, w, b, t


def _torch(x, w, b, t, reduction, g):
    tx, tw, tb = (torch.tensor(np.asarray(a, np.float64), requires_grad=True) for a in (x, w, b))
    loss = TF.cross_entropy(TF.linear(tx, tw, tb), torch.tensor(t), reduction=reduction)
    loss.backward(torch.tensor(np.asarray(g, np.float64)))
    return [a.detach().numpy() for a in (loss, tx.grad, tw.grad, tb.grad)]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_flce_float32_matches_torch_for_any_chunking(reduction):
    rng = np.random.default_rng(2)
    n, h, v = 29, 12, 53
    x, w, b, t = _flce_data(rng, n, h, v)
    g = _grad(rng, reduction, n)
    ref = _torch(x, w, b, t, reduction, g)
    one = None
    for rows in (n, 7, 1):
        got = L._flce("op", x, w, t, b, g, reduction, -100, True, True, chunk_rows=rows)
        for a, r in zip(got, ref):
            scale = max(np.abs(r).max(), 1.0)
            np.testing.assert_allclose(a, r, rtol=0, atol=2e-6 * scale)
        if one is None:
            one = got
        else:       # BLAS may round a row's logits differently per chunk shape: float32 only
            for a, r in zip(got, one):
                np.testing.assert_allclose(a, r, rtol=0, atol=1e-6 * max(np.abs(r).max(), 1.0))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_flce_fwd_bwd_equals_forward_and_backward_kernels(dtype):
    rng = np.random.default_rng(3)
    x, w, b, t = _flce_data(rng, 10, 6, 17, dtype)
    g = np.float32(0.75)
    kw = dict(reduction="mean", ignore_index=-100)
    both = L.fused_linear_cross_entropy_fwd_bwd(x, w, t, b, g, **kw)
    assert np.array_equal(both[0], L.fused_linear_cross_entropy(x, w, t, b, **kw))
    for a, r in zip(both[1:], L.fused_linear_cross_entropy_backward(x, w, t, b, g, **kw)):
        assert a.dtype == r.dtype == np.dtype(dtype) and np.array_equal(a, r)
    nobias = L.fused_linear_cross_entropy_fwd_bwd(x, w, t, g, **kw)
    assert len(nobias) == 3 and nobias[2].shape == w.shape


def test_flce_16bit_logits_are_rounded_like_nn_linear():
    """16-bit inputs: the loss is that of the logits nn.Linear stores (rounded to bfloat16)."""
    rng = np.random.default_rng(4)
    x, w, b, t = _flce_data(rng, 8, 16, 21, ml_dtypes.bfloat16)
    tl = TF.cross_entropy(TF.linear(*(torch.tensor(np.asarray(a, np.float32)).bfloat16()
                                      for a in (x, w, b))).float(), torch.tensor(t),
                          reduction="none")
    got = L.fused_linear_cross_entropy(x, w, t, b, reduction="none", ignore_index=-100)
    np.testing.assert_allclose(got, tl.numpy(), rtol=1e-5, atol=1e-5)


def test_flce_chunk_rows_budget():
    assert L.flce_chunk_rows(1024, 32000) == (32 << 20) // (4 * 32000)
    assert L.flce_chunk_rows(3, 10) == 3 and L.flce_chunk_rows(5, 10 ** 9) == 1


def test_flce_bad_target_raises():
    rng = np.random.default_rng(5)
    x, w, b, t = _flce_data(rng, 4, 3, 5)
    t[2] = 5
    with pytest.raises(FuelGraphError, match="class index 5"):
        L.fused_linear_cross_entropy(x, w, t, reduction="mean", ignore_index=-100)
