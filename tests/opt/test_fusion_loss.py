"""Loss rewrites: a linear head under the cross-entropy fuses into fused_linear_cross_entropy
(from every spelling, exactly once, only when the logits have no other reader), and a loss
realized together with its gradient runs as one *_fwd_bwd node (explain shows the rule), with
values and gradients equal to torch."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import fuelgraph as fg
import fuelgraph.functional as F

RNG = np.random.default_rng(0)
N, H, V = 7, 5, 11


def _data(dtype=np.float64, ignored=(2,)):
    x = RNG.standard_normal((N, H)).astype(dtype)
    w = RNG.standard_normal((V, H)).astype(dtype)
    b = RNG.standard_normal(V).astype(dtype)
    t = RNG.integers(0, V, N)
    t[list(ignored)] = -100
    return x, w, b, t


def _torch(x, w, b, t, reduction="mean", ignore_index=-100):
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tb = None if b is None else torch.tensor(b, requires_grad=True)
    loss = TF.cross_entropy(TF.linear(tx, tw, tb), torch.tensor(t),
                            reduction=reduction, ignore_index=ignore_index)
    loss.backward(torch.ones_like(loss))
    return [loss.detach().numpy(), tx.grad.numpy(), tw.grad.numpy()] + \
        ([tb.grad.numpy()] if b is not None else [])


def _rules(rep):
    return [rule for p, rule, _ in rep.rewrites if p == "loss_rules"]


def _log_softmax(z):
    s = z - z.max(-1, keepdim=True)
    return s - s.exp().sum(-1, keepdim=True).log()


# spellings of "cross-entropy of x @ w.T (+ b)": (loss builder, has bias, ignore_index)
SPELLINGS = {
    "F.ce(x @ w.mT + b)": (lambda X, W, B, T: F.fused_softmax_cross_entropy(X @ W.mT + B, T),
                           True, -100),
    "F.ce(F.fused_linear(x, w.mT, b))":
        (lambda X, W, B, T: F.fused_softmax_cross_entropy(F.fused_linear(X, W.mT, B), T),
         True, -100),
    "F.ce(x @ w.T) sum": (lambda X, W, B, T: F.fused_softmax_cross_entropy(X @ W.T, T, "sum"),
                          False, -100),
    "idiom: -(log_softmax.gather).mean()":
        (lambda X, W, B, T: -(_log_softmax(X @ W.mT + B).gather(-1, T.unsqueeze(-1))[..., 0])
         .mean(), True, None),
    "idiom: .log_softmax(-1), nll.sum()":
        (lambda X, W, B, T: (-(X @ W.mT + B).log_softmax(-1).gather(-1, T.unsqueeze(-1))
                             .squeeze(-1)).sum(), True, None),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_linear_head_spellings_fuse_once(spelling):
    build, has_bias, ii = SPELLINGS[spelling]
    x, w, b, t = _data(ignored=() if ii is None else (2,))
    X, W, B = (fg.tensor(a, requires_grad=True) for a in (x, w, b))
    loss = build(X, W, B, fg.tensor(t))
    assert fg.explain(loss).fused_ops == {"fused_linear_cross_entropy": 1}
    ins = [X, W] + ([B] if has_bias else [])
    grads = fg.grad([loss], ins)
    rep = fg.explain([loss] + grads)
    assert rep.fused_ops == {"fused_linear_cross_entropy_fwd_bwd": 1}, str(rep)
    assert "one_pass_linear_cross_entropy" in _rules(rep)
    red = "sum" if "sum" in spelling else "mean"
    ref = _torch(x, w, b if has_bias else None, t, red)
    for got, want in zip(fg.realize([loss] + grads), ref):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13)


def test_linear_head_not_fused_when_logits_are_read_elsewhere():
    x, w, b, t = _data()
    X, W = fg.tensor(x, requires_grad=True), fg.tensor(w, requires_grad=True)
    logits = X @ W.mT
    loss = F.fused_softmax_cross_entropy(logits, fg.tensor(t))
    rep = fg.explain([loss, logits.max()])
    assert "fused_linear_cross_entropy" not in rep.fused_ops
    assert rep.fused_ops.get("fused_softmax_cross_entropy") == 1
    # nor when the logits are an output
    assert "fused_linear_cross_entropy" not in fg.explain([loss, logits]).fused_ops
    # and a [K, N] weight (x @ w, not nn.Linear's layout) is not a head
    loss2 = F.fused_softmax_cross_entropy(X @ fg.tensor(w.T.copy()), fg.tensor(t))
    assert fg.explain(loss2).fused_ops == {"fused_softmax_cross_entropy": 1}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_one_pass_cross_entropy(reduction):
    z = RNG.standard_normal((6, 9))
    t = RNG.integers(0, 9, 6)
    t[1] = -100
    Z = fg.tensor(z, requires_grad=True)
    loss = F.fused_softmax_cross_entropy(Z, fg.tensor(t), reduction)
    g = RNG.standard_normal(loss.shape)
    (gz,) = fg.grad([loss], [Z], [fg.tensor(g)])
    rep = fg.explain([loss, gz])
    assert rep.fused_ops == {"fused_softmax_cross_entropy_fwd_bwd": 1}
    assert _rules(rep) == ["one_pass_cross_entropy"]
    assert "fused_softmax_cross_entropy_fwd_bwd" in str(rep)
    # the gradient alone stays the backward helper; the loss alone the forward
    assert fg.explain(gz).fused_ops == {"fused_softmax_cross_entropy_backward": 1}
    assert fg.explain(loss).fused_ops == {"fused_softmax_cross_entropy": 1}
    tz = torch.tensor(z, requires_grad=True)
    tl = TF.cross_entropy(tz, torch.tensor(t), reduction=reduction)
    tl.backward(torch.tensor(g))
    got = fg.realize([loss, gz])
    np.testing.assert_allclose(got[0], tl.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got[1], tz.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_no_merge_when_the_gradient_depends_on_the_loss():
    z = RNG.standard_normal((4, 5))
    t = RNG.integers(0, 5, 4)
    Z = fg.tensor(z, requires_grad=True)
    loss = F.fused_softmax_cross_entropy(Z, fg.tensor(t))
    (gz,) = fg.grad([loss * loss], [Z])        # d(l^2) = 2 l dl: the helper's grad reads l
    rep = fg.explain([loss, gz])
    assert "fused_softmax_cross_entropy_fwd_bwd" not in rep.fused_ops
    assert rep.fused_ops.get("fused_softmax_cross_entropy_backward") == 1
    tz = torch.tensor(z, requires_grad=True)
    tl = TF.cross_entropy(tz, torch.tensor(t))
    (tl * tl).backward()
    np.testing.assert_allclose(gz.numpy(), tz.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_float32_model_step_fuses_and_matches_torch():
    """A float32 'LM head + loss' step as a user writes it: one fused node, torch's values."""
    x, w, b, t = _data(np.float32)
    X, W, B = (fg.tensor(a, requires_grad=True) for a in (x, w, b))
    loss = F.fused_softmax_cross_entropy(X @ W.mT + B, fg.tensor(t))
    loss.backward()
    rep = fg.explain([loss, X.grad, W.grad, B.grad])
    assert rep.fused_ops == {"fused_linear_cross_entropy_fwd_bwd": 1}
    ref = _torch(*(a.astype(np.float64) for a in (x, w, b)), t)
    got = fg.realize([loss, X.grad, W.grad, B.grad])
    for a, r in zip(got, ref):
        np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-6)


def test_bfloat16_head_cast_to_float32_fuses():
    """A 16-bit head whose logits are cast to float32 for the loss (the usual mixed-precision
    spelling) is what the op computes: it fuses, values and gradients stay torch's."""
    import ml_dtypes
    x, w, b, t = _data(np.float32, ignored=())
    xb, wb, bb = (a.astype(ml_dtypes.bfloat16) for a in (x, w, b))
    X, W, B = (fg.tensor(a, requires_grad=True) for a in (xb, wb, bb))
    logits = (X @ W.mT + B).astype(fg.float32)
    loss = -(logits.log_softmax(-1).gather(-1, fg.tensor(t).unsqueeze(-1))[..., 0]).mean()
    grads = fg.grad([loss], [X, W, B])
    assert fg.explain(loss).fused_ops == {"fused_linear_cross_entropy": 1}
    assert fg.explain([loss] + grads).fused_ops == {"fused_linear_cross_entropy_fwd_bwd": 1}
    ref = _torch(*(np.asarray(a, np.float64) for a in (xb, wb, bb)), t)
    for got, want in zip(fg.realize([loss] + grads), ref):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0,
                                   atol=3e-2 * max(np.abs(want).max(), 1.0))
