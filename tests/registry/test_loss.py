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
        assert np.isnan(ref)            # torch divides 0 by 0; the spec says 0 (H.3)
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
    ref = np.nan_to_num(tx.grad.numpy())   # torch's all-ignored mean is nan; the spec gives 0
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
