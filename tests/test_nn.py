"""fuelgraph.nn: modules and parameters (traversal, state dicts, modes, dtype moves), the
layers against torch.nn (forward and gradients), and the parameter update rule."""
import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.nn as nn
import fuelgraph.nn.functional as F
from fuelgraph import FuelGraphError

RNG = np.random.default_rng(0)


def A(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8, bias=False)])
        self.norm = nn.RMSNorm(8)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.5), nn.Linear(16, 4))
        self.register_buffer("scale", np.float32(2.0))

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = h + b(h).silu()
        return self.head(self.norm(h) * self.scale)


def test_traversal_and_state_dict():
    fg.manual_seed(0)
    m = Net()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["emb.weight", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
                     "norm.weight", "head.0.weight", "head.0.bias", "head.3.weight",
                     "head.3.bias"]
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in m.parameters())
    sd = m.state_dict()
    assert list(sd) == ["scale"] + names           # torch's order: own tensors, then children
    m2 = Net()
    m2.load_state_dict(sd)
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(FuelGraphError, match="missing keys \\['scale'\\]"):
        m2.load_state_dict({k: v for k, v in sd.items() if k != "scale"})
    with pytest.raises(FuelGraphError, match="norm.weight has shape \\(3,\\)"):
        m2.load_state_dict({**sd, "norm.weight": np.ones(3, np.float32)})
    miss, extra = m2.load_state_dict({"scale": np.float32(1.0), "zzz": np.ones(1)}, strict=False)
    assert "scale" not in miss and extra == ["zzz"]
    assert "Linear(in_features=8, out_features=16, bias=True)" in repr(m)


def test_train_eval_and_dropout():
    fg.manual_seed(1)
    m = Net()
    idx = fg.tensor(RNG.integers(0, 10, (3, 5)))
    a = m(idx).numpy()
    assert m.training and m.head[2].training
    m.eval()
    assert not m.head[2].training
    b, c = m(idx).numpy(), m(idx).numpy()
    np.testing.assert_array_equal(b, c)            # no dropout in eval
    assert not np.array_equal(a, b)
    x = fg.ones((200, 100))
    y = F.dropout(x, 0.3, training=True).numpy()
    kept = (y != 0).mean()
    assert 0.65 < kept < 0.75 and np.allclose(y[y != 0], 1 / 0.7)


def test_to_dtype_keeps_parameter_identity():
    m = nn.Linear(4, 3)
    ps = list(m.parameters())
    m.to(fg.bfloat16)
    assert [id(p) for p in m.parameters()] == [id(p) for p in ps]
    assert m.weight.dtype == fg.bfloat16 and m.weight.requires_grad
    y = m(fg.ones((2, 4), fg.bfloat16))
    y.float().sum().backward()
    assert m.weight.grad.dtype == fg.bfloat16


def _copy_params(src_t: torch.nn.Module, dst: nn.Module):
    dst.load_state_dict({k: v.detach().numpy() for k, v in src_t.state_dict().items()})


@pytest.mark.parametrize("make", [
    lambda: (nn.Linear(6, 5), torch.nn.Linear(6, 5), (4, 6)),
    lambda: (nn.LayerNorm(6), torch.nn.LayerNorm(6), (3, 6)),
    lambda: (nn.RMSNorm(6, eps=1e-6), torch.nn.RMSNorm(6, eps=1e-6), (3, 6)),
    lambda: (nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.Conv2d(3, 4, 3, 2, 1), (2, 3, 7, 6)),
    lambda: (nn.Conv2d(2, 3, (2, 3), bias=False), torch.nn.Conv2d(2, 3, (2, 3), bias=False),
             (1, 2, 5, 5)),
])
def test_layers_match_torch(make):
    m, tm, shape = make()
    with torch.no_grad():
        for p in tm.parameters():
            p.copy_(torch.randn(p.shape))
    _copy_params(tm, m)
    x = A(*shape)
    xf = fg.tensor(x, requires_grad=True)
    xt = torch.tensor(x, requires_grad=True)
    y, yt = m(xf), tm(xt)
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-5, atol=1e-5)
    w = A(*yt.shape)
    (y * fg.tensor(w)).sum().backward()
    (yt * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(xf.grad.numpy(), xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    for (n, p), (_, tp) in zip(m.named_parameters(), tm.named_parameters()):
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=n)


def test_embedding_and_cross_entropy_match_torch():
    e, te = nn.Embedding(7, 4), torch.nn.Embedding(7, 4)
    _copy_params(te, e)
    idx = RNG.integers(0, 7, (3, 5))
    tgt = RNG.integers(0, 7, (3, 5))
    logits = e(fg.tensor(idx)) @ e.weight.mT
    tl = te(torch.tensor(idx)) @ te.weight.T
    loss = F.cross_entropy(logits.reshape(-1, 7), fg.tensor(tgt).reshape(-1))
    tloss = torch.nn.functional.cross_entropy(tl.reshape(-1, 7), torch.tensor(tgt).reshape(-1))
    np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-5)
    loss.backward()
    tloss.backward()
    np.testing.assert_allclose(e.weight.grad.numpy(), te.weight.grad.numpy(), rtol=1e-4,
                               atol=1e-6)


def test_sdpa_matches_torch():
    q, k, v = A(2, 3, 5, 8), A(2, 3, 5, 8), A(2, 3, 5, 8)
    got = F.scaled_dot_product_attention(fg.tensor(q), fg.tensor(k), fg.tensor(v),
                                         is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.tensor(q), torch.tensor(k), torch.tensor(v), is_causal=True)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


# ---- the parameter update rule ----------------------------------------------------------------
def test_inplace_update_keeps_the_parameter_and_the_next_backward():
    w = nn.Parameter(A(3, 2))
    x = fg.tensor(A(4, 3))
    for _ in range(3):
        loss = (x @ w).square().mean()
        loss.backward()
        g = w.grad.numpy()
        before = w.numpy()
        w -= 0.1 * w.grad                         # an update: not differentiated, same leaf
        assert w.is_leaf and w.requires_grad
        np.testing.assert_allclose(w.numpy(), before - 0.1 * g, rtol=1e-6)
        w.grad = None
    assert loss.item() >= 0


def test_rebinding_to_an_expression_does_not_detach_silently():
    w0 = w = fg.tensor(A(3, 2), requires_grad=True)
    x = fg.tensor(A(4, 3))
    (x @ w).sum().backward()
    w = w - 0.1 * w.grad                          # a new tensor, not a leaf
    (x @ w).sum().backward()                      # the gradient goes to the leaf w0
    assert w0.grad is not None
    with pytest.raises(FuelGraphError, match="not a leaf.*w -= lr \\* w.grad"):
        _ = w.grad
    del w0                                        # nothing requires grad any more
    with pytest.raises(FuelGraphError, match="backward: no leaf with requires_grad.*w -= lr"):
        (x @ w).sum().backward()


def test_parameter_copy_and_data():
    p = nn.Parameter(np.zeros(3, np.float32))
    p.copy_(fg.tensor(np.arange(3, dtype=np.float64)))
    np.testing.assert_array_equal(p.numpy(), [0, 1, 2])
    assert p.dtype == fg.float32
    p.data = fg.ones(3) * 5
    np.testing.assert_array_equal(p.numpy(), [5, 5, 5])
    with pytest.raises(FuelGraphError, match="cannot be written into a tensor of shape"):
        p.copy_(fg.ones(4))


@pytest.mark.parametrize("sq,sk,causal,gqa", [(5, 5, True, False), (3, 6, True, False),
                                              (4, 4, False, True), (6, 6, True, True)])
def test_sdpa_shapes_masks_and_gqa_match_torch(sq, sk, causal, gqa):
    hk = 2 if gqa else 4
    q, k, v = A(2, 4, sq, 8), A(2, hk, sk, 8), A(2, hk, sk, 8)
    got = F.scaled_dot_product_attention(fg.tensor(q), fg.tensor(k), fg.tensor(v),
                                         is_causal=causal, enable_gqa=gqa)
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.tensor(q), torch.tensor(k), torch.tensor(v), is_causal=causal, enable_gqa=gqa)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
