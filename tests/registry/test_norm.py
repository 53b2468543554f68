"""RMS_NORM_LAST_DIM (3), LAYER_NORM_LAST_DIM (4) and their backward helpers (9, 8) against torch
CPU: forward over dtypes and shapes, gradients, second order, the helpers alone, recipe vs
kernel, validation errors."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import fuelgraph as fg
from oracle import assert_flash_rule
import fuelgraph.functional as F
from fuelgraph.registry.core import BackwardKind, FusedOps

DTYPES = [fg.float32, fg.float64, fg.bfloat16, fg.float16]
# (shape, scale): n = 1, rank 1, odd and longer rows, large values
SHAPES = [((1,), 1.0), ((7,), 1.0), ((3, 1), 2.0), ((2, 3, 16), 1.0), ((4, 257), 3.0),
          ((5, 33), 1e4)]
EPS = {"rms": 1e-6, "ln": 1e-5}
LOW_ATOL = {fg.bfloat16: 4e-3, fg.float16: 5e-4}


def ours(kind, x, eps):
    return F.rms_norm_last_dim(x, eps) if kind == "rms" else F.layer_norm_last_dim(x, eps)


def ref(kind, t, eps):
    n = t.shape[-1]
    return TF.rms_norm(t, (n,), eps=eps) if kind == "rms" else TF.layer_norm(t, (n,), eps=eps)


def data(shape, dt, scale=1.0, seed=0, offset=0.5):
    """Random data exactly representable in `dt`: (array in dt, the same values in float64)."""
    a = (np.random.default_rng(seed).standard_normal(shape) * scale + offset * scale)
    a = a.astype(dt.np)
    return a, a.astype(np.float64)


def assert_close_lowp(got, ref64, torch_same, dt):
    """Ours vs float64 within 2x the same-dtype torch error (plus a small atol)."""
    assert np.isfinite(np.asarray(got, np.float64)).all()
    assert_flash_rule(got, ref64, torch_same, LOW_ATOL[dt])


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape,scale", SHAPES)
def test_forward_vs_torch(kind, dt, shape, scale):
    eps = EPS[kind]
    a, a64 = data(shape, dt, scale)
    y = ours(kind, fg.tensor(a), eps)
    assert y.shape == shape and y.dtype == dt
    got = y.numpy()
    r64 = ref(kind, torch.tensor(a64), eps).numpy()
    if dt == fg.float64:
        np.testing.assert_allclose(got, r64, rtol=1e-12, atol=1e-13)
    elif dt == fg.float32:
        np.testing.assert_allclose(got, r64, rtol=1e-5, atol=1e-6)
    else:
        same = ref(kind, torch.tensor(a64).to(dt.torch), eps).float().numpy()
        assert_close_lowp(got, r64, same, dt)


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_edge_values(kind):
    # n = 1: layer norm of one element is 0; rms of one element is x / sqrt(x^2 + eps)
    x = np.array([[3.0], [-2.0]])
    y = ours(kind, fg.tensor(x), 0.25).numpy()
    want = np.zeros_like(x) if kind == "ln" else x / np.sqrt(x * x + 0.25)
    np.testing.assert_allclose(y, want, rtol=1e-14)
    # an all-zero row with eps > 0 gives zeros; eps = 0 gives NaN (0 * inf, spec §3)
    z = fg.tensor(np.zeros((2, 4)))
    assert (ours(kind, z, 1e-6).numpy() == 0).all()
    assert np.isnan(ours(kind, z, 0.0).numpy()).all()
    # float32 values whose squares are far outside float16 range still normalize
    a = np.full((2, 8), 3e4, np.float16)
    got = ours(kind, fg.tensor(a), EPS[kind]).numpy().astype(np.float64)
    np.testing.assert_allclose(got, ref(kind, torch.tensor(a.astype(np.float64)), EPS[kind]).numpy(),
                               atol=1e-3)


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("dt", [fg.float64, fg.float32], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(1,), (3, 1), (2, 3, 9)])
def test_backward_vs_torch(kind, dt, shape):
    eps = EPS[kind]
    a, a64 = data(shape, dt, seed=1)
    w = np.random.default_rng(2).standard_normal(shape)
    x = fg.tensor(a, requires_grad=True)
    (ours(kind, x, eps) * fg.tensor(w.astype(dt.np))).sum().backward()
    t = torch.tensor(a64, requires_grad=True)
    (ref(kind, t, eps) * torch.tensor(w)).sum().backward()
    tol = dict(rtol=1e-10, atol=1e-12) if dt == fg.float64 else dict(rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), **tol)


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_backward_emits_the_fused_helper(kind):
    helper = {"rms": "rms_norm_last_dim_backward", "ln": "layer_norm_last_dim_backward"}[kind]
    x = fg.tensor(np.random.default_rng(0).standard_normal((3, 8)))
    g = fg.grad(ours(kind, x, 1e-3).sum(), [x])[0]
    assert fg.explain(g).fused_ops == {helper: 1}
    e = fg.default_registry().entry(FusedOps.RMS_NORM_LAST_DIM if kind == "rms"
                                    else FusedOps.LAYER_NORM_LAST_DIM)
    assert e.backward == BackwardKind.fused(FusedOps.RMS_NORM_LAST_DIM_BACKWARD if kind == "rms"
                                            else FusedOps.LAYER_NORM_LAST_DIM_BACKWARD)


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("shape", [(5,), (3, 2, 7)])
def test_second_order_vs_torch_double_backward(kind, shape):
    eps = 1e-3
    _, a64 = data(shape, fg.float64, seed=3)
    w = np.random.default_rng(4).standard_normal(shape)
    v = np.random.default_rng(5).standard_normal(shape)
    x = fg.tensor(a64)
    (g,) = fg.grad((ours(kind, x, eps) * fg.tensor(w)).sum(), [x])
    (gg,) = fg.grad((g * fg.tensor(v)).sum(), [x])
    t = torch.tensor(a64, requires_grad=True)
    (tg,) = torch.autograd.grad((ref(kind, t, eps) * torch.tensor(w)).sum(), t, create_graph=True)
    (tgg,) = torch.autograd.grad((tg * torch.tensor(v)).sum(), t)
    np.testing.assert_allclose(g.numpy(), tg.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gg.numpy(), tgg.numpy(), rtol=1e-9, atol=1e-11)
    # the same through the lowered recipes
    np.testing.assert_allclose(fg.realize([gg], lower_all=True)[0], tgg.numpy(), rtol=1e-9, atol=1e-11)


def _helper(kind, x, g, eps):
    return (F.rms_norm_last_dim_backward(x, g, eps) if kind == "rms"
            else F.layer_norm_last_dim_backward(x, g, eps))


def _torch_vjp(kind, x, g, eps):
    t = x.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(ref(kind, t, eps), t, g)
    return dx


@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(1,), (6,), (4, 1), (2, 3, 40)])
def test_backward_helper_vs_torch_autograd(kind, dt, shape):
    eps = EPS[kind]
    a, a64 = data(shape, dt, seed=6)
    gr, g64 = data(shape, dt, seed=7, offset=0.0)
    dx = _helper(kind, fg.tensor(a), fg.tensor(gr), eps)
    assert dx.shape == shape and dx.dtype == dt
    r64 = _torch_vjp(kind, torch.tensor(a64), torch.tensor(g64), eps).numpy()
    if dt == fg.float64:
        np.testing.assert_allclose(dx.numpy(), r64, rtol=1e-10, atol=1e-12)
    elif dt == fg.float32:
        np.testing.assert_allclose(dx.numpy(), r64, rtol=1e-4, atol=1e-5)
    else:
        same = _torch_vjp(kind, torch.tensor(a64).to(dt.torch), torch.tensor(g64).to(dt.torch),
                          eps).float().numpy()
        assert_close_lowp(dx.numpy(), r64, same, dt)


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_helper_gradients_vs_finite_differences(kind):
    """The helpers are differentiable (DECOMPOSE): d<dx, v>/dx and d<dx, v>/dgrad vs float64
    central differences."""
    eps, shape, h = 1e-2, (2, 5), 1e-6
    rng = np.random.default_rng(8)
    a, g0, v = (rng.standard_normal(shape) for _ in range(3))

    def f(xa, ga):
        return float((_helper(kind, fg.tensor(xa), fg.tensor(ga), eps).numpy() * v).sum())

    x, g = fg.tensor(a), fg.tensor(g0)
    gx, gg = fg.grad((_helper(kind, x, g, eps) * fg.tensor(v)).sum(), [x, g])
    for arr, got, which in ((a, gx.numpy(), 0), (g0, gg.numpy(), 1)):
        fd = np.zeros(shape)
        for i in np.ndindex(shape):
            p, m = arr.copy(), arr.copy()
            p[i] += h
            m[i] -= h
            fd[i] = ((f(p, g0) - f(m, g0)) if which == 0 else (f(a, p) - f(a, m))) / (2 * h)
        np.testing.assert_allclose(got, fd, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["rms", "ln", "rms_bwd", "ln_bwd"])
@pytest.mark.parametrize("shape", [(1,), (3, 1), (2, 3, 17)])
def test_recipe_matches_kernel(op, shape):
    eps = 1e-4
    a = np.random.default_rng(9).standard_normal(shape) + 0.3
    g = np.random.default_rng(10).standard_normal(shape)
    x, gt = fg.tensor(a), fg.tensor(g)
    y = {"rms": lambda: F.rms_norm_last_dim(x, eps), "ln": lambda: F.layer_norm_last_dim(x, eps),
         "rms_bwd": lambda: F.rms_norm_last_dim_backward(x, gt, eps),
         "ln_bwd": lambda: F.layer_norm_last_dim_backward(x, gt, eps)}[op]()
    lowered = fg.explain(y, lower_all=True)
    assert lowered.fused_ops == {} and sum(lowered.lowered.values()) == 1
    np.testing.assert_allclose(fg.realize([y], lower_all=True)[0], y.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("fn", [F.rms_norm_last_dim, F.layer_norm_last_dim])
def test_forward_validation_errors(fn):
    name = fn.__name__
    with pytest.raises(fg.FuelGraphError, match=f"{name}: x has dtype int64, expected one of"):
        fn(fg.tensor(np.arange(6).reshape(2, 3)))
    with pytest.raises(fg.FuelGraphError, match=f"{name}: x has shape \\(\\), expected rank >= 1"):
        fn(fg.tensor(np.float32(1.0)))
    with pytest.raises(fg.FuelGraphError, match=f"{name}: x has shape \\(3, 0\\), expected a last"):
        fn(fg.tensor(np.zeros((3, 0), np.float32)))
    for bad in (-1e-5, float("nan"), float("inf"), "x", None):
        with pytest.raises(fg.FuelGraphError, match=f"{name}: param eps"):
            fn(fg.tensor(np.ones((2, 3), np.float32)), bad)
    with pytest.raises(fg.FuelGraphError, match=f"{name}: expected 1 inputs, got 2"):
        from fuelgraph.registry.core import call_fused
        x = fg.tensor(np.ones((2, 3), np.float32))
        call_fused(fg.default_registry().entry(name).id, x, x, eps=1e-5)


@pytest.mark.parametrize("fn", [F.rms_norm_last_dim_backward, F.layer_norm_last_dim_backward])
def test_helper_validation_errors(fn):
    name = fn.__name__
    x = fg.tensor(np.ones((2, 3), np.float32))
    with pytest.raises(fg.FuelGraphError, match=f"{name}: grad has shape \\(3, 2\\), expected \\(2, 3\\)"):
        fn(x, fg.tensor(np.ones((3, 2), np.float32)), 1e-5)
    with pytest.raises(fg.FuelGraphError, match=f"{name}: grad has dtype float64, expected float32"):
        fn(x, fg.tensor(np.ones((2, 3))), 1e-5)
    with pytest.raises(fg.FuelGraphError, match=f"{name}: x has dtype int32"):
        fn(fg.tensor(np.ones((2, 3), np.int32)), fg.tensor(np.ones((2, 3), np.int32)), 1e-5)
    with pytest.raises(fg.FuelGraphError, match=f"{name}: x has shape \\(2, 0\\), expected a last"):
        fn(fg.tensor(np.ones((2, 0), np.float32)), fg.tensor(np.ones((2, 0), np.float32)), 1e-5)
    with pytest.raises(fg.FuelGraphError, match=f"{name}: param eps"):
        fn(x, x, -1.0)


def test_registry_entries():
    reg = fg.default_registry()
    for fid, name, family in ((3, "rms_norm_last_dim", "norm"), (4, "layer_norm_last_dim", "norm"),
                              (8, "layer_norm_last_dim_backward", "backward"),
                              (9, "rms_norm_last_dim_backward", "backward")):
        e = reg.entry(fid)
        assert (e.name, e.family, int(e.id)) == (name, family, fid)
        assert "[..., n]" in e.doc
    assert reg.entry(8).backward == BackwardKind.DECOMPOSE
    assert reg.entry(9).backward == BackwardKind.DECOMPOSE


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_zero_rows(kind):
    x = fg.tensor(np.ones((0, 8), np.float32))
    y = ours(kind, x, 1e-5)
    assert y.numpy().shape == (0, 8) and fg.realize([y], lower_all=True)[0].shape == (0, 8)
    (g,) = fg.grad(y, [x], [fg.tensor(np.ones((0, 8), np.float32))])
    assert g.numpy().shape == (0, 8)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
def test_add_rms_norm_vs_torch(dt):
    """add_rms_norm = a transformers Llama residual add and RMSNorm (norm in float32 for 16-bit
    inputs, rounded, times the weight in the dtype); its gradients by the recipe."""
    (xa, x64), (ra, r64), (wa, w64) = (data(s, dt, seed=i) for i, s in
                                       enumerate(((3, 4, 40), (3, 4, 40), (40,))))
    x, r, w = (fg.tensor(a, requires_grad=True) for a in (xa, ra, wa))
    s, y = F.add_rms_norm(x, r, w, 1e-5)
    tt = {fg.float64: torch.float64, fg.float32: torch.float32, fg.bfloat16: torch.bfloat16,
          fg.float16: torch.float16}[dt]
    xt, rt, wt = (torch.tensor(a, dtype=torch.float64).to(tt) for a in (x64, r64, w64))
    st = xt + rt
    acc = torch.float64 if tt == torch.float64 else torch.float32
    yt = wt * TF.rms_norm(st.to(acc), (40,), eps=1e-5).to(tt)
    np.testing.assert_array_equal(np.asarray(s.numpy(), np.float64), st.double().numpy())
    tol = 1e-12 if dt == fg.float64 else {fg.float32: 1e-5}.get(dt, 2e-2)
    np.testing.assert_allclose(np.asarray(y.numpy(), np.float64), yt.double().numpy(),
                               rtol=tol, atol=tol)
    assert fg.explain([s, y]).fused_ops == {"add_rms_norm": 1}
    if dt != fg.float64:
        return
    xg, rg, wg = (torch.tensor(a, requires_grad=True) for a in (x64, r64, w64))
    sg = xg + rg
    ((sg * 0.5).sum() + (wg * TF.rms_norm(sg, (40,), eps=1e-5)).pow(2).sum()).backward()
    loss = (s * 0.5).sum() + (y * y).sum()
    for got, want in zip(fg.grad(loss, [x, r, w]), (xg.grad, rg.grad, wg.grad)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-9, atol=1e-10)


def test_add_rms_norm_validation():
    x = fg.tensor(np.ones((2, 8), np.float32))
    with pytest.raises(fg.FuelGraphError, match="weight has shape"):
        F.add_rms_norm(x, x, fg.tensor(np.ones(4, np.float32)))
    with pytest.raises(fg.FuelGraphError):
        F.add_rms_norm(x, fg.tensor(np.ones((2, 4), np.float32)), fg.tensor(np.ones(8, np.float32)))
    with pytest.raises(fg.FuelGraphError, match="eps"):
        F.add_rms_norm(x, x, fg.tensor(np.ones(8, np.float32)), -1.0)
