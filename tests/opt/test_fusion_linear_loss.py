"""Hand-written idioms re-fuse into FUSED_LINEAR (2), FUSED_SOFTMAX_CROSS_ENTROPY (17) and
INPLACE_AFFINE (16): each spelling fuses exactly once, results stay correct (vs torch), gradients
through the spelled forms match torch, and near misses are reported with their failed
constraint."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import fuelgraph as fg

RNG = np.random.default_rng(0)


def _t(shape, dtype=np.float64):
    return RNG.standard_normal(shape).astype(dtype)


# ---- FUSED_LINEAR ---------------------------------------------------------------------------
LINEAR_SPELLINGS = {
    "a @ b + bias": lambda a, b, c: a @ b + c,
    "bias + a @ b": lambda a, b, c: c + a @ b,
    "matmul(a, b) + bias": lambda a, b, c: fg.matmul(a, b) + c,
    "(a @ b).add(bias)": lambda a, b, c: (a @ b).add(c),
}


@pytest.mark.parametrize("spelling", list(LINEAR_SPELLINGS))
@pytest.mark.parametrize("sa,sb", [((5, 4), (4, 3)), ((2, 5, 4), (4, 3)), ((2, 5, 4), (2, 4, 3)),
                                   ((3, 1, 5, 4), (2, 4, 3))])
def test_linear_spellings_fuse_once(spelling, sa, sb):
    a, b, c = _t(sa), _t(sb), _t(sb[-1])
    y = LINEAR_SPELLINGS[spelling](fg.tensor(a), fg.tensor(b), fg.tensor(c))
    rep = fg.explain(y)
    assert rep.fused_ops == {"fused_linear": 1} and rep.primitive_count == 0, str(rep)
    ref = (torch.matmul(torch.tensor(a), torch.tensor(b)) + torch.tensor(c)).numpy()
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-12, atol=1e-12)


def test_nn_linear_layout_and_mlp():
    """x @ w.T + b (torch layout w [N, K]) fuses with b = the transpose; two layers fuse twice."""
    x, w1, b1, w2, b2 = _t((6, 8)), _t((16, 8)), _t(16), _t((4, 16)), _t(4)
    X, W1, B1, W2, B2 = map(fg.tensor, (x, w1, b1, w2, b2))
    y = (X @ W1.mT + B1).relu() @ W2.mT + B2
    assert fg.explain(y).fused_ops == {"fused_linear": 2}
    tx, tw1, tb1, tw2, tb2 = map(torch.tensor, (x, w1, b1, w2, b2))
    ref = TF.linear(TF.linear(tx, tw1, tb1).relu(), tw2, tb2)
    np.testing.assert_allclose(y.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)


def test_linear_gradients_through_the_spelled_form():
    x, w, b = _t((2, 5, 8)), _t((8, 3)), _t(3)
    X, W, B = (fg.tensor(v, requires_grad=True) for v in (x, w, b))
    y = (X @ W + B).tanh().sum()
    gx, gw, gb = fg.grad([y], [X, W, B])
    assert fg.explain([y, gx, gw, gb]).fused_ops.get("fused_linear") == 1
    tx, tw, tb = (torch.tensor(v, requires_grad=True) for v in (x, w, b))
    torch.addmm(tb, tx.reshape(-1, 8), tw).tanh().sum().backward()
    for ours, ref in ((gx, tx), (gw, tw), (gb, tb)):
        np.testing.assert_allclose(ours.numpy(), ref.grad.numpy(), rtol=1e-11, atol=1e-12)


def test_linear_near_misses():
    a, b = fg.tensor(_t((5, 4))), fg.tensor(_t((4, 3)))
    mm = a @ b
    # the product is needed elsewhere: fusing would compute it twice
    rep = fg.explain([mm + fg.tensor(_t(3)), mm.sum()])
    assert "fused_linear" not in rep.fused_ops
    assert "another consumer" in rep.near_misses["fused_linear"]
    # a [M, N] matrix is not a bias
    rep = fg.explain(a @ b + fg.tensor(_t((5, 3))), min_matched=0, min_kinds=0)
    assert rep.fused_ops == {} and "bias has shape" in rep.near_misses["fused_linear"]
    # mixed dtypes promote through a cast: not the op
    y = fg.tensor(_t((5, 4), np.float16)) @ fg.tensor(_t((4, 3), np.float16)) + fg.tensor(_t(3, np.float32))
    assert "fused_linear" not in fg.explain(y).fused_ops


# ---- FUSED_SOFTMAX_CROSS_ENTROPY ------------------------------------------------------------
def _ls_primitives(x):
    s = x - x.max(-1, keepdim=True)
    return s - s.exp().sum(-1, keepdim=True).log()


def _ls_method(x):
    return x.log_softmax(-1)


def _picked_squeeze(ls, t):
    return ls.gather(-1, t.unsqueeze(-1)).squeeze(-1)


def _picked_index(ls, t):
    return ls.gather(-1, t.unsqueeze(-1))[..., 0]


CE_SPELLINGS = {   # name -> (loss builder(ls, picked fn, t), reduction)
    "nll.mean()": (lambda ls, pk, t: (-pk(ls, t)).mean(), "mean"),
    "-(picked.mean())": (lambda ls, pk, t: -pk(ls, t).mean(), "mean"),
    "nll.sum()": (lambda ls, pk, t: (-pk(ls, t)).sum(), "sum"),
    "-(picked.sum())": (lambda ls, pk, t: -pk(ls, t).sum(), "sum"),
    "nll.sum() / n": (lambda ls, pk, t: (-pk(ls, t)).sum() / float(np.prod(t.shape)), "mean"),
    "-picked (none)": (lambda ls, pk, t: -pk(ls, t), "none"),
}


def torch_ce(x, t, reduction):
    v = x.shape[-1]
    out = TF.cross_entropy(x.reshape(-1, v), torch.tensor(t).reshape(-1), reduction=reduction)
    return out.reshape(t.shape) if reduction == "none" else out


@pytest.mark.parametrize("log_softmax", [_ls_primitives, _ls_method], ids=["primitives", "method"])
@pytest.mark.parametrize("picked", [_picked_squeeze, _picked_index], ids=["squeeze", "index0"])
@pytest.mark.parametrize("spelling", list(CE_SPELLINGS))
def test_cross_entropy_spellings_fuse_once(spelling, picked, log_softmax):
    x = _t((3, 4, 10))
    t = RNG.integers(0, 10, (3, 4))
    build, reduction = CE_SPELLINGS[spelling]
    loss = build(log_softmax(fg.tensor(x)), picked, fg.tensor(t))
    rep = fg.explain(loss)
    assert rep.fused_ops == {"fused_softmax_cross_entropy": 1} and rep.primitive_count == 0, str(rep)
    ref = torch_ce(torch.tensor(x), t, reduction).numpy()
    np.testing.assert_allclose(loss.numpy(), ref, rtol=1e-12, atol=1e-12)


def test_cross_entropy_language_model_shape_and_float32():
    """The LM spelling with [B, S, V] logits flattened to rows (targets fed as rows), float32.
    (Targets reshaped inside the graph, `T.reshape(-1, 1)` of a [B, S] tensor, do not fuse:
    the targets the op would need, [B*S], is not a value of that graph.)"""
    x = _t((2, 6, 50), np.float32)
    t = RNG.integers(0, 50, (2, 6))
    X, T = fg.tensor(x), fg.tensor(t.reshape(-1))
    logp = X.reshape(-1, 50).log_softmax(-1)
    loss = -logp.gather(-1, T.reshape(-1, 1)).squeeze(-1).mean()
    assert fg.explain(loss).fused_ops == {"fused_softmax_cross_entropy": 1}
    ref = torch_ce(torch.tensor(x), t, "mean").numpy()
    np.testing.assert_allclose(loss.numpy(), ref, rtol=1e-6)


def test_cross_entropy_half_logits_upcast_first():
    """bf16 logits cast to float32 in the model: the cast stays, the loss fuses."""
    import ml_dtypes
    x = _t((4, 7)).astype(ml_dtypes.bfloat16)
    t = RNG.integers(0, 7, (4,))
    loss = -(fg.tensor(x).astype(fg.float32).log_softmax(-1)
             .gather(-1, fg.tensor(t).unsqueeze(-1))[..., 0]).mean()
    assert fg.explain(loss).fused_ops == {"fused_softmax_cross_entropy": 1}
    ref = torch_ce(torch.tensor(np.asarray(x, np.float32)), t, "mean").numpy()
    np.testing.assert_allclose(loss.numpy(), ref, rtol=1e-6)


def test_cross_entropy_gradients_through_the_spelled_form():
    x = _t((5, 9))
    t = RNG.integers(0, 9, (5,))
    X = fg.tensor(x, requires_grad=True)
    loss = -_picked_squeeze(X.log_softmax(-1), fg.tensor(t)).mean()
    (gx,) = fg.grad([loss], [X])
    rep = fg.explain([loss, gx])
    # the forward and its backward helper run as one pass (tests/opt/test_fusion_loss.py)
    assert rep.fused_ops == {"fused_softmax_cross_entropy_fwd_bwd": 1}
    assert fg.explain(gx).fused_ops == {"fused_softmax_cross_entropy_backward": 1}
    tx = torch.tensor(x, requires_grad=True)
    torch_ce(tx, t, "mean").backward()
    np.testing.assert_allclose(gx.numpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_linear_then_cross_entropy_model():
    x, w, b = _t((8, 6)), _t((6, 5)), _t(5)
    t = RNG.integers(0, 5, (8,))
    X, W, B = fg.tensor(x), fg.tensor(w, requires_grad=True), fg.tensor(b, requires_grad=True)
    logits = X @ W + B
    loss = -logits.log_softmax(-1).gather(-1, fg.tensor(t).unsqueeze(-1)).squeeze(-1).mean()
    gw, gb = fg.grad([loss], [W, B])
    rep = fg.explain([loss, gw, gb])
    assert rep.fused_ops.get("fused_linear") == 1     # W is [K, N]: not an nn.Linear head
    assert rep.fused_ops.get("fused_softmax_cross_entropy_fwd_bwd") == 1
    tx, tw, tb = torch.tensor(x), torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
    tl = TF.cross_entropy(tx @ tw + tb, torch.tensor(t))
    tl.backward()
    got = fg.realize([loss, gw, gb])
    np.testing.assert_allclose(got[0], tl.item(), rtol=1e-12)
    np.testing.assert_allclose(got[1], tw.grad.numpy(), rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(got[2], tb.grad.numpy(), rtol=1e-11, atol=1e-13)


def test_cross_entropy_near_misses():
    x = fg.tensor(_t((3, 6)))
    t = fg.tensor(RNG.integers(0, 6, (3,)))
    ls = x.log_softmax(-1)
    # the log-probabilities are an output too: fusing would compute them twice
    loss = -_picked_squeeze(ls, t).mean()
    rep = fg.explain([loss, ls])
    assert "fused_softmax_cross_entropy" not in rep.fused_ops
    assert "another consumer" in rep.near_misses["fused_softmax_cross_entropy"]
    # log-softmax over the wrong axis is not cross-entropy over the classes
    s = x - x.max(0, keepdim=True)
    ls0 = s - s.exp().sum(0, keepdim=True).log()
    rep = fg.explain(-_picked_squeeze(ls0, t).mean())
    assert "fused_softmax_cross_entropy" not in rep.fused_ops
    assert "fused_softmax_cross_entropy" in rep.near_misses


# ---- INPLACE_AFFINE -------------------------------------------------------------------------
AFFINE_SPELLINGS = {
    "x * 2.5 + 0.5": (lambda x: x * 2.5 + 0.5, 2.5, 0.5),
    "2.5 * x + 0.5": (lambda x: 2.5 * x + 0.5, 2.5, 0.5),
    "0.5 + x * 2.5": (lambda x: 0.5 + x * 2.5, 2.5, 0.5),
    "x / 4 + 1": (lambda x: x / 4.0 + 1.0, 0.25, 1.0),
}


@pytest.mark.parametrize("spelling", list(AFFINE_SPELLINGS))
def test_affine_spellings_fuse_once(spelling):
    build, mul, add = AFFINE_SPELLINGS[spelling]
    x = _t((4, 5))
    # produced by a matmul: an elementwise producer would make the affine part of a glue region
    y = build(fg.tensor(x) @ fg.tensor(np.eye(5)))
    rep = fg.explain(y)
    assert rep.fused_ops == {"fused_linear": 1, "inplace_affine": 1} or \
        rep.fused_ops == {"inplace_affine": 1}, str(rep)
    node = fg.optimize([y]).outputs[0].node
    assert (node.op.params.mul, node.op.params.add) == (mul, add)
    np.testing.assert_allclose(y.numpy(), x * mul + add, rtol=1e-14)
