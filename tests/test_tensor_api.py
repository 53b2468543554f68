"""The torch-named tensor API (ir/methods.py and friends) against torch: values, dtypes and
gradients (where differentiable), torch's keywords (dim=, keepdim=), and the promotion table
shared by `@` and fused_linear."""
import math

import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph import FuelGraphError

RNG = np.random.default_rng(0)


def A(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def both(a, requires_grad=False):
    t = fg.tensor(a, requires_grad=requires_grad)
    tt = torch.tensor(a, requires_grad=requires_grad)
    return t, tt


def same(got, want, rtol=1e-6, atol=1e-6):
    w = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    g = got.numpy() if isinstance(got, fg.Tensor) else np.asarray(got)
    assert g.shape == w.shape, (g.shape, w.shape)
    if isinstance(got, fg.Tensor) and isinstance(want, torch.Tensor):
        assert got.dtype.name == str(want.dtype).replace("torch.", ""), (got.dtype, want.dtype)
    np.testing.assert_allclose(g.astype(np.float64) if g.dtype.kind != "b" else g,
                               w.astype(np.float64) if w.dtype.kind != "b" else w,
                               rtol=rtol, atol=atol)


def grads_match(f_fg, f_t, *arrays, rtol=1e-5, atol=1e-6):
    """f(*tensors) -> tensor; the gradients of sum(f * w) match torch's."""
    xs = [fg.tensor(a, requires_grad=True) for a in arrays]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    y, ty = f_fg(*xs), f_t(*ts)
    same(y, ty, rtol, atol)
    w = A(*ty.shape)
    (y * fg.tensor(w)).sum().backward()
    (ty * torch.tensor(w)).sum().backward()
    for x, t in zip(xs, ts):
        same(x.grad, t.grad, rtol, atol)


# ---- metadata ------------------------------------------------------------------------------------
def test_size_dim_numel():
    x = fg.zeros((2, 3, 4))
    assert x.size() == (2, 3, 4) and isinstance(x.size(), tuple) and x.size().numel() == 24
    assert x.size(1) == 3 and x.size(-1) == 4 and x.size(dim=0) == 2
    assert x.dim() == 3 == x.ndim and x.numel() == 24 and x.element_size() == 4


# ---- dim= / keepdim= ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sum", "mean", "prod", "amax", "amin", "var", "logsumexp",
                                  "softmax", "log_softmax", "cumsum"])
def test_dim_keyword(name):
    a = A(3, 4, 5)
    x, t = both(a)
    kw = {} if name in ("softmax", "log_softmax", "cumsum") else {"keepdim": True}
    same(getattr(x, name)(dim=1, **kw), getattr(t, name)(dim=1, **kw), rtol=1e-5)


def test_max_min_with_dim_return_values_and_indices():
    a = A(4, 6)
    a[1, 2] = a[1, 4] = 9.0          # ties: the first index, as torch
    x, t = both(a)
    for k in ("max", "min"):
        got, want = getattr(x, k)(dim=1), getattr(t, k)(dim=1)
        same(got.values, want.values)
        same(got.indices, want.indices)
        v, i = getattr(x, k)(dim=0, keepdim=True)
        same(i, getattr(t, k)(dim=0, keepdim=True).indices)
    same(x.max(), t.max())
    same(x.max(1), t.amax(1))                      # positional axis: the values (NumPy style)
    same(x.max(x * 0.5), torch.max(t, t * 0.5))    # with a tensor: elementwise


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_argmax_argmin(dim, keepdim):
    a = np.round(A(5, 7) * 2)                      # many ties
    a[2, 3] = np.nan
    x, t = both(a)
    for k in ("argmax", "argmin"):
        if dim is None and keepdim:
            continue
        same(getattr(x, k)(dim=dim, keepdim=keepdim), getattr(t, k)(dim=dim, keepdim=keepdim))


def test_clamp_values_and_grad():
    a = A(6, 5)
    a[0, 0] = np.nan
    x, t = both(a)
    same(x.clamp(-0.5, 0.7), t.clamp(-0.5, 0.7))
    same(x.clamp(min=0.1), t.clamp(min=0.1))
    same(x.clip(max=0.2), t.clip(max=0.2))
    grads_match(lambda v: v.clamp(-0.5, 0.5), lambda v: v.clamp(-0.5, 0.5), A(4, 4))
    i = fg.tensor(np.arange(-3, 4))
    same(i.clamp(-1, 2), torch.arange(-3, 4).clamp(-1, 2))
    with pytest.raises(FuelGraphError, match="clamp: at least one"):
        x.clamp()


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("shape,dim", [((9,), 0), ((3, 17), 1), ((6, 4, 2), 0), ((2, 1), 1)])
def test_sort_stable_with_nan_and_grad(shape, dim, descending):
    a = np.round(A(*shape) * 2)
    a.reshape(-1)[::5] = np.nan
    x, t = both(a)
    got = x.sort(dim=dim, descending=descending)
    want = torch.sort(t, dim=dim, descending=descending, stable=True)
    same(got.values, want.values)
    same(got.indices, want.indices)
    same(x.argsort(dim=dim, descending=descending),
         torch.argsort(t, dim=dim, descending=descending, stable=True))
    grads_match(lambda v: v.sort(dim=dim, descending=descending).values,
                lambda v: torch.sort(v, dim=dim, descending=descending, stable=True).values,
                A(*shape))


def test_sort_integers_and_bool():
    a = RNG.integers(-5, 5, (4, 9))
    same(fg.tensor(a).sort(dim=1).values, torch.sort(torch.tensor(a), dim=1, stable=True).values)
    b = a > 0
    same(fg.tensor(b).sort(dim=1).indices, torch.sort(torch.tensor(b), dim=1, stable=True).indices)


@pytest.mark.parametrize("k", [1, 3, 12])
@pytest.mark.parametrize("largest", [True, False])
def test_topk(k, largest):
    a = A(4, 13)
    x, t = both(a)
    got, want = x.topk(k, dim=1, largest=largest), t.topk(k, dim=1, largest=largest)
    same(got.values, want.values)
    same(got.indices, want.indices)
    grads_match(lambda v: v.topk(k, largest=largest).values,
                lambda v: v.topk(k, largest=largest).values, a)
    with pytest.raises(FuelGraphError, match="topk: k=14 out of range"):
        x.topk(14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.bool_])
def test_cumsum_cumprod(dtype):
    a = (A(3, 37) * 3).astype(dtype)
    x, t = both(a)
    same(x.cumsum(dim=1), torch.cumsum(t, dim=1), rtol=1e-5, atol=1e-4)
    same(fg.cumsum(x, 0), torch.cumsum(t, 0), rtol=1e-5, atol=1e-4)
    if dtype == np.float32:
        grads_match(lambda v: v.cumsum(1), lambda v: v.cumsum(1), A(3, 37), rtol=1e-5,
                    atol=1e-5)
        grads_match(lambda v: v.cumprod(0), lambda v: v.cumprod(0), A(5, 3) * 0.5 + 1)


@pytest.mark.parametrize("eq,shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij,ij->", [(3, 4), (3, 4)]), ("i,j->ij", [(3,), (4,)]), ("ii->i", [(4, 4)]),
    ("ii", [(4, 4)]), ("ij->ji", [(3, 4)]), ("...ij,...jk->...ik", [(2, 3, 4), (4, 5)]),
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 8), (2, 3, 5, 8)]), ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("ij,kj", [(3, 4), (5, 4)]), ("ijk->k", [(2, 3, 4)])])
def test_einsum(eq, shapes):
    arrays = [A(*s) for s in shapes]
    grads_match(lambda *v: fg.einsum(eq, *v), lambda *v: torch.einsum(eq, *v), *arrays,
                rtol=1e-5, atol=1e-5)


def test_einsum_errors():
    with pytest.raises(FuelGraphError, match="einsum: 2 operand specs"):
        fg.einsum("ij,jk->ik", fg.zeros((2, 2)))
    with pytest.raises(FuelGraphError, match="einsum: spec 'ij' has 2 indices"):
        fg.einsum("ij->i", fg.zeros((2, 2, 2)))


def test_split_chunk_unbind():
    a = A(7, 4)
    x, t = both(a)
    for g, w in zip(x.split(3), t.split(3)):
        same(g, w)
    for g, w in zip(x.split([2, 5], dim=0), t.split([2, 5], dim=0)):
        same(g, w)
    for g, w in zip(x.chunk(3, dim=0), t.chunk(3, dim=0)):
        same(g, w)
    assert len(x.chunk(3, 1)) == len(t.chunk(3, 1))
    for g, w in zip(x.unbind(1), t.unbind(1)):
        same(g, w)
    with pytest.raises(FuelGraphError, match="split: sections"):
        x.split([2, 2])


@pytest.mark.parametrize("diag", [-1, 0, 2])
def test_tril_triu(diag):
    a = A(2, 4, 5)
    x, t = both(a)
    same(x.tril(diag), t.tril(diag))
    same(fg.triu(x, diagonal=diag), torch.triu(t, diagonal=diag))
    grads_match(lambda v: v.tril(diag), lambda v: v.tril(diag), a)


def test_masked_fill_and_where_promotion():
    a = A(3, 4)
    x, t = both(a)
    m = a > 0
    same(x.masked_fill(fg.tensor(m), -1.0), t.masked_fill(torch.tensor(m), -1.0))
    same(x.masked_fill(fg.tensor(m[0]), 2.0), t.masked_fill(torch.tensor(m[0]), 2.0))
    grads_match(lambda v: v.masked_fill(fg.tensor(m), 0.0),
                lambda v: v.masked_fill(torch.tensor(m), 0.0), a)


def test_setitem_is_functional_and_rebinds():
    a = A(4, 5)
    x, t = both(a)
    y = x * 1.0                       # computed from the old value of x
    x[1, ::2] = 7.0
    x[x < -1.0] = 0.0
    x[:, -1] = fg.tensor(np.arange(4, dtype=np.float32))
    x[fg.tensor(np.array([0, 3]))] = -2.0
    t[1, ::2] = 7.0
    t[t < -1.0] = 0.0
    t[:, -1] = torch.arange(4, dtype=torch.float32)
    t[torch.tensor([0, 3])] = -2.0
    same(x, t)
    same(y, torch.tensor(a))          # other tensors keep the old value
    # gradients flow through the new value to the old one and to the written values
    v = fg.tensor(a, requires_grad=True)
    w = fg.tensor(np.float32(3.0), requires_grad=True)
    z = v * 2.0
    z[0] = w * 1.0
    z.sum().backward()
    g = np.full(a.shape, 2.0, np.float32)
    g[0] = 0.0
    same(v.grad, g)
    assert float(w.grad.item()) == 5.0


def test_index_put():
    a = A(5, 3)
    x, t = both(a)
    idx = np.array([0, 2, 2])
    vals = A(3, 3)
    same(x.index_put((fg.tensor(idx),), fg.tensor(vals), accumulate=True),
         t.index_put((torch.tensor(idx),), torch.tensor(vals), accumulate=True))
    idx2 = (np.array([0, 4]), np.array([1, 2]))
    same(fg.index_put(x, tuple(fg.tensor(i) for i in idx2), 9.0),
         t.index_put(tuple(torch.tensor(i) for i in idx2), torch.tensor(9.0)))


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_any_all(dim):
    a = A(3, 4) > 0.5
    a[0] = False
    x, t = both(a)
    kw = {} if dim is None else {"dim": dim}
    same(x.any(**kw), t.any(**kw))
    same(x.all(**kw), t.all(**kw))
    f = fg.tensor(np.array([0.0, 1.0]))
    assert bool(f.any()) and not bool(f.all())


def test_isnan_isinf_isfinite():
    a = np.array([0.0, np.nan, np.inf, -np.inf, 1.0], np.float32)
    x, t = both(a)
    same(x.isnan(), t.isnan())
    same(x.isinf(), t.isinf())
    same(x.isfinite(), t.isfinite())
    same(fg.tensor(np.arange(3)).isnan(), torch.arange(3).isnan())


def test_repeat_interleave_expand_outer_repeat():
    a = A(2, 3)
    x, t = both(a)
    same(x.repeat_interleave(2, dim=1), t.repeat_interleave(2, dim=1))
    same(x.repeat_interleave(3), t.repeat_interleave(3))
    same(x.repeat_interleave([1, 0, 2], dim=1), t.repeat_interleave(torch.tensor([1, 0, 2]), 1))
    same(x[:, :1].expand(-1, 4), t[:, :1].expand(-1, 4))
    same(x.expand(3, 2, 3), t.expand(3, 2, 3))
    same(x.repeat(2, 1, 2), t.repeat(2, 1, 2))
    u, v = A(3), A(4)
    grads_match(lambda p, q: p.outer(q), lambda p, q: torch.outer(p, q), u, v)
    same(fg.outer(fg.tensor(u), fg.tensor(v)), torch.outer(torch.tensor(u), torch.tensor(v)))


def test_conversions_and_small_methods():
    a = A(3, 4)
    x, t = both(a)
    same(x.double(), t.double())
    same(x.half(), t.half())
    same(x.long(), t.long())
    same(x.bool(), t.bool())
    same(x.t(), t.t())
    same(x.norm(), t.norm(), rtol=1e-5)
    same(x.std(dim=1), t.std(dim=1), rtol=1e-5)
    same(x.logsumexp(1), t.logsumexp(1), rtol=1e-5)
    same(x.narrow(1, 1, 2), t.narrow(1, 1, 2))
    same(x.reshape(12).unflatten(0, (3, -1)), t.reshape(12).unflatten(0, (3, -1)))
    same(x.to(fg.float64), t.to(torch.float64))
    same(fg.cat([x, x], dim=1), torch.cat([t, t], dim=1))
    same(fg.stack([x, x], dim=1), torch.stack([t, t], dim=1))
    c = x.clone()
    c += 1.0
    same(x, t)                                     # the clone is a separate handle


def test_inplace_operators_on_non_leaf_rebind():
    x = fg.tensor(A(3), requires_grad=True)
    y = x * 2.0
    y2 = y
    y += 1.0                                       # rebinds the handle y (y2 is the same one)
    y.mul_(3.0)
    assert y is y2
    y.sum().backward()
    same(x.grad, np.full(3, 6.0, np.float32))


@pytest.mark.parametrize("a,b", [(np.int32, np.float32), (np.float16, np.float32),
                                 (np.int64, np.float64), (np.float32, np.float64)])
def test_matmul_and_fused_linear_share_promotion(a, b):
    x, w, bias = (A(3, 4) * 3).astype(a), A(4, 5).astype(b), A(5).astype(b)
    rt = torch.promote_types(torch.tensor(x).dtype, torch.tensor(w).dtype)   # torch's table
    want = torch.tensor(x).to(rt) @ torch.tensor(w).to(rt)
    got = fg.tensor(x) @ fg.tensor(w)
    same(got, want, rtol=1e-3, atol=1e-3)
    lin = F.fused_linear(fg.tensor(x), fg.tensor(w), fg.tensor(bias))
    assert lin.dtype == got.dtype
    same(lin, want + torch.tensor(bias), rtol=1e-3, atol=1e-3)


def test_int_tensors_in_float_math_follow_torch():
    i = np.arange(1, 5, dtype=np.int64)
    x, t = both(i)
    same(x / 2, t / 2)
    same(x.sqrt(), t.sqrt())
    same(x * 0.5, t * 0.5)
    same(x.float().mean(), t.float().mean())
    same(x.sum(), t.sum())
    same(x + fg.tensor(np.float16(1.5)), t + torch.tensor(np.float16(1.5)))


def test_sigmoid_dim_softmax_math_consistency():
    a = A(2, 3)
    x, t = both(a)
    same(x.softmax(dim=0), torch.softmax(t, dim=0), rtol=1e-5)
    assert math.isclose(float(x.sum()), float(t.sum()), rel_tol=1e-5)
