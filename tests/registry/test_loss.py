"""FUSED_SOFTMAX_CROSS_ENTROPY (id 17) vs torch CPU `F.cross_entropy`: every reduction, with and
without ignored rows (all rows ignored, custom and None ignore_index), V = 1, rank-1 and rank-3
logits, the four float dtypes; gradients vs torch autograd (and second order); recipe vs kernel;
errors at build time and out-of-range targets at run time."""
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import fuelgraph as fg
from oracle import assert_close_dtype
import fuelgraph.functional as F
from fuelgraph import FuelGraphError, FusedOps

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
      "float16": np.float16}
TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
         "float16": torch.float16}
REDUCTIONS = ["mean", "sum", "none"]


def torch_ce(logits, targets, reduction, ignore_index, dtype="float64"):
    """torch reference on logits [..., V] / targets [...] (torch wants classes on axis 1)."""
    x = torch.tensor(np.asarray(logits, np.float64)).to(TORCH[dtype])
    t = torch.tensor(np.asarray(targets, np.int64))
    v = x.shape[-1]
    ii = -1_000_000 if ignore_index is None else ignore_index
    out = TF.cross_entropy(x.reshape(-1, v), t.reshape(-1), reduction=reduction, ignore_index=ii)
    return out.reshape(t.shape) if reduction == "none" else out


def _case(rng, shape, v, dtype, ignored=(), ignore_index=-100):
    x = (rng.standard_normal(shape + (v,)) * 3).astype(NP[dtype])
    t = rng.integers(0, v, size=shape).astype(np.int64)
    for idx in ignored:
        t[idx] = ignore_index
    return x, t


def _check(ours, ref64, same, dtype):
    # our loss is float32 accumulated in float64: tighter than a float32 op
    assert_close_dtype(ours, ref64, same, dtype, f32_rtol=2e-6)


CASES = [  # (row shape, V, ignored positions)
    ((6,), 11, ()),
    ((2, 5), 7, ((0, 1), (1, 4))),
    ((3,), 1, ()),                 # V = 1: loss 0 everywhere
    ((), 9, ()),                   # rank-1 logits, 0-d target
    ((4,), 5, ((0,), (1,), (2,), (3,))),   # every row ignored
    ((2, 2, 3), 4, ((1, 0, 2),)),
]


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape,v,ignored", CASES)
def test_forward_matches_torch(shape, v, ignored, reduction, dtype):
    rng = np.random.default_rng(zlib.crc32(repr((shape, v, reduction)).encode()))
    x, t = _case(rng, shape, v, dtype, ignored)
    out = F.fused_softmax_cross_entropy(fg.tensor(x), fg.tensor(t), reduction=reduction)
    want_dtype = "float64" if dtype == "float64" else "float32"
    assert out.dtype.name == want_dtype
    assert out.shape == (shape if reduction == "none" else ())
    got = out.numpy()
    assert got.dtype == NP[want_dtype]
    ref = torch_ce(x, t, reduction, -100).numpy()
    same = torch_ce(x, t, reduction, -100, dtype).float().numpy()
    if reduction == "mean" and len(ignored) == int(np.prod(shape)):
        assert np.isnan(ref)            # torch divides 0 by 0; ours gives 0
        assert got == 0
        assert fg.realize([out], lower_all=True)[0] == 0
        return
    _check(got, ref, same, dtype)
    _check(fg.realize([out], lower_all=True)[0], ref, same, dtype)   # the recipe


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_custom_and_none_ignore_index(reduction):
    rng = np.random.default_rng(2)
    x, t = _case(rng, (8,), 6, "float64")
    t[[1, 5]] = 3                   # ignore_index may be a valid class: those rows drop out
    for ii in (3, None, -1):
        out = F.fused_softmax_cross_entropy(fg.tensor(x), fg.tensor(t), reduction, ii)
        ref = torch_ce(x, t, reduction, ii).numpy()
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(fg.realize([out], lower_all=True)[0], ref, rtol=1e-13,
                                   atol=1e-13)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignored", [(), ((0, 1), (1, 3)), tuple((i, j) for i in range(2) for j in range(4))])
def test_gradients_match_torch(reduction, ignored):
    rng = np.random.default_rng(9)
    x, t = _case(rng, (2, 4), 5, "float64", ignored)
    xt = fg.tensor(x, requires_grad=True)
    out = F.fused_softmax_cross_entropy(xt, fg.tensor(t), reduction=reduction)
    g = rng.standard_normal(out.shape)
    (gx,) = fg.grad([out], [xt], [fg.tensor(g)])
    tx = torch.tensor(x, requires_grad=True)
    tout = torch_ce_autograd(tx, t, reduction)
    tout.backward(torch.tensor(g))
    ref = np.nan_to_num(tx.grad.numpy())   # torch's all-ignored mean is nan; ours is 0
    np.testing.assert_allclose(gx.numpy(), ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(fg.realize([gx], lower_all=True)[0], ref, rtol=1e-12, atol=1e-14)
    for r in ignored:                      # ignored rows get exactly zero
        assert not gx.numpy()[r].any()


def torch_ce_autograd(tx, t, reduction):
    v = tx.shape[-1]
    out = TF.cross_entropy(tx.reshape(-1, v), torch.tensor(t).reshape(-1), reduction=reduction)
    return out.reshape(t.shape) if reduction == "none" else out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gradients_low_precision(dtype):
    rng = np.random.default_rng(4)
    x, t = _case(rng, (3, 5), 10, dtype, ((1, 2),))
    xt = fg.tensor(x, requires_grad=True)
    F.fused_softmax_cross_entropy(xt, fg.tensor(t)).backward()
    assert xt.grad.dtype.name == dtype
    tx = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
    torch_ce_autograd(tx, t, "mean").backward()
    ref = tx.grad.numpy()
    same = torch.tensor(np.asarray(x, np.float64)).to(TORCH[dtype]).requires_grad_()
    torch_ce_autograd(same, t, "mean").backward()
    _check(xt.grad.numpy(), ref, same.grad.float().numpy(), dtype if dtype != "float32" else "float32")


def test_second_order_matches_torch():
    rng = np.random.default_rng(6)
    x, t = _case(rng, (3, 4), 6, "float64", ((2, 1),))
    xt = fg.tensor(x, requires_grad=True)
    (gx,) = fg.grad([F.fused_softmax_cross_entropy(xt, fg.tensor(t), "sum")], [xt])
    w = rng.standard_normal(x.shape)
    (hvp,) = fg.grad([(gx * fg.tensor(w)).sum()], [xt])
    tx = torch.tensor(x, requires_grad=True)
    (tg,) = torch.autograd.grad(torch_ce_autograd(tx, t, "sum"), tx, create_graph=True)
    (thvp,) = torch.autograd.grad((tg * torch.tensor(w)).sum(), tx)
    np.testing.assert_allclose(hvp.numpy(), thvp.numpy(), rtol=1e-11, atol=1e-13)


def test_gradient_vs_finite_differences():
    rng = np.random.default_rng(8)
    x, t = _case(rng, (3,), 4, "float64", ((1,),))

    def f(a):
        return float(F.fused_softmax_cross_entropy(fg.tensor(a), fg.tensor(t)).numpy())

    xt = fg.tensor(x, requires_grad=True)
    (gx,) = fg.grad([F.fused_softmax_cross_entropy(xt, fg.tensor(t))], [xt])
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        p, m = x.copy(), x.copy()
        p[idx] += 1e-6
        m[idx] -= 1e-6
        fd[idx] = (f(p) - f(m)) / 2e-6
    np.testing.assert_allclose(gx.numpy(), fd, rtol=1e-6, atol=1e-8)


def test_empty_rows():
    x = fg.tensor(np.zeros((0, 4), np.float32))
    t = fg.tensor(np.zeros((0,), np.int64))
    for red, want in (("mean", 0.0), ("sum", 0.0)):
        out = F.fused_softmax_cross_entropy(x, t, red)
        assert out.numpy() == want and fg.realize([out], lower_all=True)[0] == want
    assert F.fused_softmax_cross_entropy(x, t, "none").numpy().shape == (0,)
    for ii in (None, -100):
        out = F.fused_softmax_cross_entropy(x, t, "mean", ii)
        assert fg.realize([out], lower_all=True)[0] == 0


@pytest.mark.parametrize("lower_all", [False, True])
@pytest.mark.parametrize("bad", [5, -3, 100])
def test_out_of_range_target_raises_when_run(bad, lower_all):
    x = fg.tensor(np.zeros((3, 5), np.float32))
    tv = np.array([0, bad, -100], np.int64)
    out = F.fused_softmax_cross_entropy(x, fg.tensor(tv))    # builds fine: values are data
    with pytest.raises(FuelGraphError, match=str(bad)):
        fg.realize([out], lower_all=lower_all)


@pytest.mark.parametrize("logits,targets,kw,match", [
    (np.zeros((3, 4), np.float32), np.zeros((4,), np.int64), {}, "targets has shape"),
    (np.zeros((3, 4), np.float32), np.zeros((3, 1), np.int64), {}, "targets has shape"),
    (np.zeros((3, 4), np.float32), np.zeros((3,), np.int32), {}, "int64"),
    (np.zeros((3, 4), np.float32), np.zeros((3,), np.float32), {}, "int64"),
    (np.zeros((3, 4), np.int64), np.zeros((3,), np.int64), {}, "logits has dtype"),
    (np.zeros((), np.float32), np.zeros((), np.int64), {}, "rank >= 1"),
    (np.zeros((3, 0), np.float32), np.zeros((3,), np.int64), {}, "V >= 1"),
    (np.zeros((3, 4), np.float32), np.zeros((3,), np.int64), {"reduction": "avg"}, "reduction"),
    (np.zeros((3, 4), np.float32), np.zeros((3,), np.int64), {"ignore_index": 1.5},
     "ignore_index"),
])
def test_build_time_errors(logits, targets, kw, match):
    with pytest.raises(FuelGraphError, match=match) as ei:
        F.fused_softmax_cross_entropy(fg.tensor(logits), fg.tensor(targets), **kw)
    assert "fused_softmax_cross_entropy" in str(ei.value)


def test_entry_facets():
    e = fg.default_registry().entry(FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY)
    assert e.name == "fused_softmax_cross_entropy"
    helper = fg.default_registry().entry("fused_softmax_cross_entropy_backward")
    assert e.backward.kind == "fused" and e.backward.helper == helper.id
    # a built-in id beyond the 25 well-known ones: the same in every process
    assert helper.id == 0x100 and not helper.id.is_runtime()
    # the backward is one fused helper node (one kernel pass over the logits)
    xt = fg.tensor(np.random.default_rng(0).standard_normal((4, 6)), requires_grad=True)
    (gx,) = fg.grad([F.fused_softmax_cross_entropy(xt, fg.tensor(np.arange(4)))], [xt])
    assert fg.explain(gx).fused_ops == {"fused_softmax_cross_entropy_backward": 1}
    # and its recipe goes through the fused softmax
    assert fg.explain(gx, lower_all=True).fused_ops == {}


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape,v", [((), 6), ((4,), 1), ((2, 3), 1)])
def test_gradients_rank1_and_single_class(shape, v, reduction):
    rng = np.random.default_rng(12)
    x, t = _case(rng, shape, v, "float64")
    xt = fg.tensor(x, requires_grad=True)
    out = F.fused_softmax_cross_entropy(xt, fg.tensor(t), reduction=reduction)
    g = rng.standard_normal(out.shape)
    (gx,) = fg.grad([out], [xt], [fg.tensor(g)])
    tx = torch.tensor(x, requires_grad=True)
    torch_ce_autograd(tx, np.asarray(t), reduction).backward(torch.tensor(g))
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(fg.realize([gx], lower_all=True)[0], tx.grad.numpy(), rtol=1e-12,
                               atol=1e-14)


# ---- fused_linear_cross_entropy (0x101) and its backward (0x102) ----------------------------
from fuelgraph.registry.loss import (FUSED_LINEAR_CROSS_ENTROPY,  # noqa: E402
                                     FUSED_LINEAR_CROSS_ENTROPY_BACKWARD,
                                     FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD,
                                     FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD)


def _flce_case(rng, n, h, v, dtype, ignored=(), ignore_index=-100):
    x = rng.standard_normal((n, h)).astype(NP[dtype])
    w = (rng.standard_normal((v, h)) * 0.7).astype(NP[dtype])
    b = rng.standard_normal(v).astype(NP[dtype])
    t = rng.integers(0, v, size=n).astype(np.int64)
    for i in ignored:
        t[i] = ignore_index
    return x, w, b, t


def torch_flce(x, w, b, t, reduction, ignore_index, dtype="float64", g=None):
    """(loss, dx, dw, db) from torch: F.linear + F.cross_entropy in `dtype`."""
    tx, tw, tb = (torch.tensor(np.asarray(a, np.float64)).to(TORCH[dtype]).requires_grad_()
                  for a in (x, w, b))
    ii = -1_000_000 if ignore_index is None else ignore_index
    loss = TF.cross_entropy(TF.linear(tx, tw, None if b is None else tb), torch.tensor(t),
                            reduction=reduction, ignore_index=ii)
    gt = torch.ones(()) if g is None else torch.tensor(np.asarray(g, np.float64))
    loss.backward(gt.to(loss.dtype))
    return [np.nan_to_num(a.detach().double().numpy())
            for a in (loss, tx.grad, tw.grad, tb.grad if b is not None else tx.grad)]


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
def test_linear_ce_values_and_gradients_match_torch(dtype, reduction, has_bias):
    rng = np.random.default_rng(zlib.crc32(repr((dtype, reduction, has_bias)).encode()))
    n, h, v = 13, 7, 23                                # odd sizes
    x, w, b, t = _flce_case(rng, n, h, v, dtype, ignored=(2, 9))
    bias = b if has_bias else None
    g = None if reduction != "none" else rng.standard_normal(n)
    X, W, B = (fg.tensor(a, requires_grad=True) for a in (x, w, b))
    loss = F.fused_linear_cross_entropy(X, W, fg.tensor(t), B if has_bias else None,
                                        reduction=reduction)
    assert loss.dtype.name == ("float64" if dtype == "float64" else "float32")
    assert loss.shape == ((n,) if reduction == "none" else ())
    ins = [X, W] + ([B] if has_bias else [])
    grads = fg.grad([loss], ins, None if g is None else [fg.tensor(g.astype(np.float32) if dtype != "float64" else g)])
    assert [gr.dtype.name for gr in grads] == [dtype] * len(ins)
    ref = torch_flce(x, w, bias, t, reduction, -100, g=g)
    same = torch_flce(x, w, bias, t, reduction, -100, dtype, g=g)
    got = fg.realize([loss] + grads)                   # the kernel
    _check(got[0], ref[0], same[0], dtype)
    for k in range(1, len(got)):
        assert_close_dtype(got[k], ref[k], same[k], dtype, f32_rtol=2e-5)
    # the recipe: the idiom itself, which rounds 16-bit logits twice when a bias is added
    # (product, then sum) where nn.Linear and the kernels round once: 16-bit gets 2x slack
    rec = fg.realize([loss] + grads, lower_all=True)
    for k in range(len(rec)):
        if dtype in ("float32", "float64"):
            assert_close_dtype(rec[k], ref[k], same[k], dtype, f32_rtol=2e-5)
        else:
            assert_close_dtype(rec[k], ref[k], ref[k] + 2 * (same[k] - ref[k]), dtype)


@pytest.mark.parametrize("ignore_index", [3, None, -1])
def test_linear_ce_ignore_index_values(ignore_index):
    rng = np.random.default_rng(21)
    x, w, b, t = _flce_case(rng, 9, 4, 6, "float64")
    t[[1, 5]] = 3
    for red in REDUCTIONS:
        X, W = fg.tensor(x, requires_grad=True), fg.tensor(w, requires_grad=True)
        loss = F.fused_linear_cross_entropy(X, W, fg.tensor(t), reduction=red,
                                            ignore_index=ignore_index)
        gx, gw = fg.grad([loss.sum()], [X, W])
        ref = torch_flce(x, w, None, t, red, ignore_index,
                         g=None if red != "none" else np.ones(9))
        for got, want in zip(fg.realize([loss, gx, gw]), ref):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def test_linear_ce_all_rows_ignored_and_empty():
    rng = np.random.default_rng(5)
    x, w, b, t = _flce_case(rng, 4, 3, 5, "float32", ignored=range(4))
    X, W, B = (fg.tensor(a, requires_grad=True) for a in (x, w, b))
    loss = F.fused_linear_cross_entropy(X, W, fg.tensor(t), B)
    grads = fg.grad([loss], [X, W, B])
    for mode in (False, True):
        got = fg.realize([loss] + grads, lower_all=mode)
        assert got[0] == 0 and not any(a.any() for a in got[1:])
    e = F.fused_linear_cross_entropy(fg.tensor(np.zeros((0, 3), np.float32)), W,
                                     fg.tensor(np.zeros(0, np.int64)), reduction="sum")
    assert e.numpy() == 0 and fg.realize([e], lower_all=True)[0] == 0


def test_linear_ce_single_class_and_single_token():
    rng = np.random.default_rng(6)
    for n, v in ((1, 5), (4, 1)):
        x, w, b, t = _flce_case(rng, n, 3, v, "float64")
        X, W, B = (fg.tensor(a, requires_grad=True) for a in (x, w, b))
        loss = F.fused_linear_cross_entropy(X, W, fg.tensor(t), B, reduction="sum")
        got = fg.realize([loss] + fg.grad([loss], [X, W, B]))
        for a, r in zip(got, torch_flce(x, w, b, t, "sum", -100)):
            np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-13)


def test_linear_ce_second_order_matches_torch():
    rng = np.random.default_rng(7)
    x, w, b, t = _flce_case(rng, 5, 3, 4, "float64", ignored=(1,))
    X, W = fg.tensor(x, requires_grad=True), fg.tensor(w, requires_grad=True)
    gx, gw = fg.grad([F.fused_linear_cross_entropy(X, W, fg.tensor(t))], [X, W])
    u = rng.standard_normal(w.shape)
    (hvp,) = fg.grad([(gw * fg.tensor(u)).sum()], [X])
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tl = TF.cross_entropy(tx @ tw.T, torch.tensor(t))
    _, tgw = torch.autograd.grad(tl, [tx, tw], create_graph=True)
    (thvp,) = torch.autograd.grad((tgw * torch.tensor(u)).sum(), tx)
    np.testing.assert_allclose(hvp.numpy(), thvp.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lower_all", [False, True])
def test_linear_ce_out_of_range_target_raises_when_run(lower_all):
    x = fg.tensor(np.zeros((3, 2), np.float32))
    w = fg.tensor(np.zeros((4, 2), np.float32))
    out = F.fused_linear_cross_entropy(x, w, fg.tensor(np.array([0, 7, -100], np.int64)))
    with pytest.raises(FuelGraphError, match="7"):
        fg.realize([out], lower_all=lower_all)


_X, _W, _T, _B = (np.zeros((3, 4), np.float32), np.zeros((5, 4), np.float32),
                  np.zeros(3, np.int64), np.zeros(5, np.float32))


@pytest.mark.parametrize("args,kw,match", [
    ((np.zeros(4, np.float32), _W, _T), {}, "x has shape"),
    ((_X, np.zeros((5, 3), np.float32), _T), {}, "weight has shape"),
    ((_X, np.zeros((4, 5), np.float32), _T), {}, "weight has shape"),
    ((_X, np.zeros((0, 4), np.float32), _T), {}, "V >= 1"),
    ((_X, _W.astype(np.float64), _T), {}, "weight has dtype"),
    ((_X.astype(np.int64), _W, _T), {}, "x has dtype"),
    ((_X, _W, _T.astype(np.int32)), {}, "int64"),
    ((_X, _W, np.zeros(4, np.int64)), {}, "targets has shape"),
    ((_X, _W, _T, np.zeros(4, np.float32)), {}, "bias has shape"),
    ((_X, _W, _T, _B.astype(np.float16)), {}, "bias has dtype"),
    ((_X, _W, _T), {"reduction": "avg"}, "reduction"),
    ((_X, _W, _T), {"ignore_index": 1.5}, "ignore_index"),
])
def test_linear_ce_build_time_errors(args, kw, match):
    ts = [fg.tensor(a) for a in args]
    with pytest.raises(FuelGraphError, match=match) as ei:
        F.fused_linear_cross_entropy(*ts, **kw)
    assert "fused_linear_cross_entropy" in str(ei.value)


def test_linear_ce_entry_facets():
    reg = fg.default_registry()
    e = reg.entry(FUSED_LINEAR_CROSS_ENTROPY)
    assert (int(e.id), e.name) == (0x101, "fused_linear_cross_entropy")
    assert e.backward.kind == "fused" and e.backward.helper == FUSED_LINEAR_CROSS_ENTROPY_BACKWARD
    assert int(FUSED_LINEAR_CROSS_ENTROPY_BACKWARD) == 0x102
    assert reg.entry(FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD).name == "fused_softmax_cross_entropy_fwd_bwd"
    assert int(FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD) == 0x103
    assert reg.entry(FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD).name == "fused_linear_cross_entropy_fwd_bwd"
    assert int(FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD) == 0x104
    # the backward alone is one helper node; its recipe goes through the CE backward helper
    rng = np.random.default_rng(0)
    x, w, b, t = _flce_case(rng, 4, 3, 5, "float32")
    X, W = fg.tensor(x, requires_grad=True), fg.tensor(w, requires_grad=True)
    gx, gw = fg.grad([F.fused_linear_cross_entropy(X, W, fg.tensor(t))], [X, W])
    assert fg.explain([gx, gw]).fused_ops == {"fused_linear_cross_entropy_backward": 1}


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_fwd_bwd_op_matches_the_pair(reduction):
    """The one-pass op (built directly) gives exactly the forward and the backward helper."""
    from fuelgraph.registry.core import call_fused
    rng = np.random.default_rng(3)
    x, t = _case(rng, (3, 4), 9, "float32", ((1, 2),))
    g = rng.standard_normal(() if reduction != "none" else (3, 4)).astype(np.float32)
    X, T, G = fg.tensor(x), fg.tensor(t), fg.tensor(g)
    loss, dx = call_fused(FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD, X, T, G, reduction=reduction)
    want = fg.realize([F.fused_softmax_cross_entropy(X, T, reduction),
                       call_fused("fused_softmax_cross_entropy_backward", X, T, G,
                                  reduction=reduction, ignore_index=-100)])
    for mode in (False, True):
        got = fg.realize([loss, dx], lower_all=mode)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
