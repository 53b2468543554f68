"""ROPE (id 5) against torch CPU: both layouts over dtypes and shapes, gradients for x, cos and
sin with tables whose halves differ (the general formula, spec Appendix H.13), the GPT-J layout
against torch's complex multiply, recipe vs kernel, validation errors."""
import numpy as np
import pytest
import torch

import fuelgraph as fg
from oracle import assert_flash_rule
import fuelgraph.functional as F
from fuelgraph.registry.core import BackwardKind, call_fused

DTYPES = [fg.float32, fg.float64, fg.bfloat16, fg.float16]
# x shapes [..., S, D]: D = 2, S = 1, rank 2, rank 3, rank 4, a longer head dim
SHAPES = [(5, 2), (1, 1, 1, 2), (1, 8), (3, 6, 4), (2, 3, 7, 16), (1, 2, 9, 64)]
LOW_ATOL = {fg.bfloat16: 4e-3, fg.float16: 5e-4}


def torch_rope(x, cos, sin, interleaved):
    """An independent torch implementation (HF `apply_rotary_pos_emb` / GPT-J `rotate_every_two`)."""
    if interleaved:
        rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    else:
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


def tables(s, d, dt=fg.float64, interleaved=False, standard=True, seed=0):
    """Standard RoPE tables (theta_i = 10000^(-2i/D), halves or pairs repeated) or random ones."""
    if standard:
        inv = 10000.0 ** (-np.arange(0, d, 2) / d)
        ang = np.arange(s)[:, None] * inv[None, :]
        ang = np.repeat(ang, 2, axis=1) if interleaved else np.concatenate([ang, ang], axis=1)
        c, sn = np.cos(ang), np.sin(ang)
    else:
        rng = np.random.default_rng(seed)
        c, sn = rng.standard_normal((s, d)), rng.standard_normal((s, d))
    return c.astype(dt.np), sn.astype(dt.np)


def lowp_ok(got, ref64, same, dt):
    assert_flash_rule(got, ref64, same, LOW_ATOL[dt])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_vs_torch(interleaved, dt, shape):
    s, d = shape[-2:]
    a = (np.random.default_rng(1).standard_normal(shape) * 2).astype(dt.np)
    c, sn = tables(s, d, dt, interleaved, standard=shape[-1] != 16)
    y = F.rope(fg.tensor(a), fg.tensor(c), fg.tensor(sn), interleaved=interleaved)
    assert y.shape == shape and y.dtype == dt
    t64 = [torch.tensor(v.astype(np.float64)) for v in (a, c, sn)]
    r64 = torch_rope(*t64, interleaved).numpy()
    if dt == fg.float64:
        np.testing.assert_allclose(y.numpy(), r64, rtol=1e-14, atol=1e-15)
    elif dt == fg.float32:
        np.testing.assert_allclose(y.numpy(), r64, rtol=1e-6, atol=1e-6)
    else:
        same = torch_rope(*(t.to(dt.torch) for t in t64), interleaved).double().numpy()
        lowp_ok(y.numpy(), r64, same, dt)


def test_large_values():
    a = np.random.default_rng(2).standard_normal((2, 4, 8)) * 1e30
    c, sn = tables(4, 8, fg.float32)
    y = F.rope(fg.tensor(a.astype(np.float32)), fg.tensor(c), fg.tensor(sn)).numpy()
    r = torch_rope(torch.tensor(a.astype(np.float32)).double(), torch.tensor(c).double(),
                   torch.tensor(sn).double(), False).numpy()
    np.testing.assert_allclose(y, r, rtol=1e-6, atol=1e24)
    assert np.isfinite(y).all()


def test_interleaved_is_the_complex_multiply():
    """GPT-J / Meta LLaMA: view pairs (2i, 2i+1) as complex numbers, multiply by e^{i*theta}."""
    b, h, s, d = 2, 3, 5, 8
    a = np.random.default_rng(3).standard_normal((b, h, s, d))
    ang = np.random.default_rng(4).standard_normal((s, d // 2))
    xc = torch.view_as_complex(torch.tensor(a).reshape(b, h, s, d // 2, 2).contiguous())
    want = torch.view_as_real(xc * torch.polar(torch.ones(s, d // 2, dtype=torch.float64),
                                               torch.tensor(ang))).reshape(b, h, s, d).numpy()
    c, sn = np.repeat(np.cos(ang), 2, axis=1), np.repeat(np.sin(ang), 2, axis=1)
    y = F.rope(fg.tensor(a), fg.tensor(c), fg.tensor(sn), interleaved=True)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dt", [fg.float64, fg.float32], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 5, 8)])
def test_gradients_for_x_cos_sin(interleaved, dt, shape):
    """Tables whose halves (pairs) differ: the as-built rope(g, cos, -sin) would be wrong here."""
    s, d = shape[-2:]
    rng = np.random.default_rng(5)
    a, g = rng.standard_normal(shape).astype(dt.np), rng.standard_normal(shape).astype(dt.np)
    c, sn = tables(s, d, dt, standard=False, seed=6)
    x, ct, st = fg.tensor(a), fg.tensor(c), fg.tensor(sn)
    gx, gc, gs = fg.grad(F.rope(x, ct, st, interleaved=interleaved), [x, ct, st], [fg.tensor(g)])
    tx, tc, ts = (torch.tensor(v.astype(np.float64), requires_grad=True) for v in (a, c, sn))
    torch_rope(tx, tc, ts, interleaved).backward(torch.tensor(g.astype(np.float64)))
    tol = dict(rtol=1e-12, atol=1e-13) if dt == fg.float64 else dict(rtol=1e-5, atol=1e-5)
    for ours, t in ((gx, tx), (gc, tc), (gs, ts)):
        assert ours.dtype == dt
        np.testing.assert_allclose(ours.numpy(), t.grad.numpy(), **tol)


def test_gradient_with_asymmetric_tables_differs_from_as_built_rule():
    """Guard: the general dx differs from rope(g, cos, -sin) when sin's halves differ."""
    rng = np.random.default_rng(7)
    a, g = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    c, sn = tables(3, 4, standard=False, seed=8)
    x = fg.tensor(a)
    (gx,) = fg.grad(F.rope(x, fg.tensor(c), fg.tensor(sn)), [x], [fg.tensor(g)])
    as_built = F.rope(fg.tensor(g), fg.tensor(c), fg.tensor(-sn)).numpy()
    assert np.abs(gx.numpy() - as_built).max() > 1e-3


def test_second_order_through_rope():
    """d/d(sin) of |dx|^2 vs torch double backward (rope's backward is the recipe's, so it is
    differentiable again)."""
    rng = np.random.default_rng(9)
    a, g = rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 3, 6))
    c, sn = tables(3, 6, standard=False, seed=10)
    x, ct, st = fg.tensor(a), fg.tensor(c), fg.tensor(sn)
    (gx,) = fg.grad(F.rope(x, ct, st), [x], [fg.tensor(g)])
    gc, gs = fg.grad((gx * gx).sum(), [ct, st])
    tx, tc, ts = (torch.tensor(v, requires_grad=True) for v in (a, c, sn))
    (tgx,) = torch.autograd.grad(torch_rope(tx, tc, ts, False), tx, torch.tensor(g), create_graph=True)
    tgc, tgs = torch.autograd.grad((tgx * tgx).sum(), [tc, ts])
    np.testing.assert_allclose(gc.numpy(), tgc.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gs.numpy(), tgs.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", [(1, 2), (3, 5, 6), (2, 2, 4, 10)])
def test_recipe_matches_kernel(interleaved, shape):
    s, d = shape[-2:]
    a = np.random.default_rng(11).standard_normal(shape)
    c, sn = tables(s, d, standard=False, seed=12)
    y = F.rope(fg.tensor(a), fg.tensor(c), fg.tensor(sn), interleaved=interleaved)
    rep = fg.explain(y, lower_all=True)
    assert rep.fused_ops == {} and rep.lowered == {"rope": 1}
    np.testing.assert_allclose(fg.realize([y], lower_all=True)[0], y.numpy(), rtol=1e-14, atol=1e-15)


# x shape, table shape: per-batch (HF [B, 1, S, D]), per-head, full, lower rank, rank 5
BROADCAST_TABLES = [((2, 3, 5, 8), (2, 1, 5, 8)), ((2, 3, 5, 8), (1, 3, 5, 8)),
                    ((2, 3, 5, 8), (2, 3, 5, 8)), ((2, 3, 5, 8), (3, 5, 8)),
                    ((2, 2, 3, 4, 6), (2, 1, 3, 4, 6)), ((3, 4, 6), (1, 4, 6))]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("xs,ts", BROADCAST_TABLES, ids=str)
def test_broadcast_tables_vs_torch(xs, ts, dt, interleaved):
    """Tables broadcastable to x (each leading sequence reads its own table block)."""
    rng = np.random.default_rng(21)
    a = rng.standard_normal(xs).astype(dt.np)
    c, sn = (rng.standard_normal(ts).astype(dt.np) for _ in range(2))
    y = F.rope(fg.tensor(a), fg.tensor(c), fg.tensor(sn), interleaved=interleaved)
    assert y.shape == xs and y.dtype == dt
    r64 = torch_rope(*(torch.tensor(v.astype(np.float64)) for v in (a, c, sn)), interleaved).numpy()
    if dt in (fg.float64, fg.float32):
        tol = 1e-14 if dt == fg.float64 else 1e-6
        np.testing.assert_allclose(y.numpy(), r64, rtol=tol, atol=tol)
        np.testing.assert_allclose(fg.realize([y], lower_all=True)[0], y.numpy(), rtol=tol,
                                   atol=tol)
    else:
        tt = torch.bfloat16 if dt == fg.bfloat16 else torch.float16
        same = torch_rope(*(torch.tensor(v.astype(np.float32)).to(tt) for v in (a, c, sn)),
                          interleaved).float().numpy()
        lowp_ok(y.numpy().astype(np.float64), r64, same, dt)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("xs,ts", BROADCAST_TABLES, ids=str)
def test_broadcast_tables_gradients(xs, ts, interleaved):
    """dcos/dsin are summed back to the tables' own shapes."""
    rng = np.random.default_rng(22)
    a, g = rng.standard_normal(xs), rng.standard_normal(xs)
    c, sn = rng.standard_normal(ts), rng.standard_normal(ts)
    x, ct, st = fg.tensor(a), fg.tensor(c), fg.tensor(sn)
    gx, gc, gs = fg.grad(F.rope(x, ct, st, interleaved=interleaved), [x, ct, st], [fg.tensor(g)])
    tx, tc, ts_ = (torch.tensor(v, requires_grad=True) for v in (a, c, sn))
    torch_rope(tx, tc, ts_, interleaved).backward(torch.tensor(g))
    for ours, t in ((gx, tx), (gc, tc), (gs, ts_)):
        assert ours.shape == tuple(t.shape)
        np.testing.assert_allclose(ours.numpy(), t.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_validation_errors():
    x = fg.tensor(np.ones((2, 4, 6), np.float32))
    c = fg.tensor(np.ones((4, 6), np.float32))
    with pytest.raises(fg.FuelGraphError, match=r"rope: x has shape \(2, 4, 5\), expected an even"):
        t = fg.tensor(np.ones((4, 5), np.float32))
        F.rope(fg.tensor(np.ones((2, 4, 5), np.float32)), t, t)
    with pytest.raises(fg.FuelGraphError, match=r"rope: x has shape \(6,\), expected rank >= 2"):
        F.rope(fg.tensor(np.ones(6, np.float32)), c, c)
    for bad in [(4, 3), (5, 6), (6,), (3, 4, 6), (1, 2, 4, 6), (2, 1, 6)]:
        b = fg.tensor(np.ones(bad, np.float32))
        with pytest.raises(fg.FuelGraphError, match=r"rope: cos has shape .*expected \[\.\.\., S, D\] "
                                                    r"ending in exactly \[S, D\] = \[4, 6\] and "
                                                    r"broadcastable to x of shape \(2, 4, 6\)"):
            F.rope(x, b, c)
        with pytest.raises(fg.FuelGraphError, match=r"rope: sin has shape .*expected \[\.\.\., S, D\]"):
            F.rope(x, c, b)
    for ok in [(1, 4, 6), (2, 4, 6)]:                # broadcastable tables are accepted
        b = fg.tensor(np.ones(ok, np.float32))
        assert F.rope(x, b, c).shape == (2, 4, 6) and F.rope(x, c, b).shape == (2, 4, 6)
    with pytest.raises(fg.FuelGraphError, match="rope: sin has dtype float64, expected float32"):
        F.rope(x, c, fg.tensor(np.ones((4, 6))))
    with pytest.raises(fg.FuelGraphError, match="rope: cos has dtype bfloat16, expected float32"):
        F.rope(x, c.astype(fg.bfloat16), c)
    with pytest.raises(fg.FuelGraphError, match="rope: x has dtype int64, expected one of"):
        F.rope(fg.tensor(np.ones((4, 6), np.int64)), c, c)
    with pytest.raises(fg.FuelGraphError, match="rope: expected 3 inputs, got 2"):
        call_fused(fg.FusedOps.ROPE, x, c, interleaved=False)


def test_registry_entry():
    e = fg.default_registry().entry("rope")
    assert int(e.id) == 5 and e.family == "forward"
    assert e.backward == BackwardKind.fused(5)  # dx is rope(g, cos, -swap(sin))
    assert "[..., S, D]" in e.doc and "[S, D]" in e.doc
    from fuelgraph.opt.pattern import patterns_of
    assert {p.fixed["interleaved"] for p in patterns_of(e)} == {False, True}


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", [(2, 0, 4), (2, 3, 0), (0, 3, 4)])
def test_empty(interleaved, shape):
    x = fg.tensor(np.ones(shape, np.float32))
    c = fg.tensor(np.ones(shape[-2:], np.float32))
    y = F.rope(x, c, c, interleaved=interleaved)
    assert y.numpy().shape == shape and fg.realize([y], lower_all=True)[0].shape == shape


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dt", [fg.float32, fg.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("bshd,ts", [((2, 256, 8, 64), (256, 64)),
                                     ((2, 128, 3, 32), (2, 1, 128, 32)),
                                     ((3, 40, 5, 16), (40, 16))], ids=str)
def test_heads_permuted_input(bshd, ts, dt, interleaved):
    """x as a model makes it: a [B, S, H, D] projection viewed heads first. The NumPy kernel
    reads that view in place (no copy first) and gives the bits it gives for a contiguous x,
    whether the tables are shared or per batch (large x: the span path, small: the whole)."""
    from fuelgraph.backends.numpy.rope import rope as rope_kernel
    rng = np.random.default_rng(31)
    a = rng.standard_normal(bshd).astype(dt.np)
    c, sn = (rng.standard_normal(ts).astype(dt.np) for _ in range(2))
    view = a.transpose(0, 2, 1, 3)
    assert not view.flags.c_contiguous
    got = rope_kernel(view, c, sn, interleaved=interleaved)
    want = rope_kernel(np.ascontiguousarray(view), c, sn, interleaved=interleaved)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    y = F.rope(fg.tensor(a).permute(0, 2, 1, 3), fg.tensor(c), fg.tensor(sn),
               interleaved=interleaved)
    t64 = [torch.tensor(v.astype(np.float64)) for v in (view, c, sn)]
    r64 = torch_rope(*t64, interleaved).numpy()
    if dt == fg.float32:
        np.testing.assert_allclose(y.numpy(), r64, rtol=1e-6, atol=1e-6)
    else:
        same = torch_rope(*(t.to(dt.torch) for t in t64), interleaved).double().numpy()
        lowp_ok(y.numpy(), r64, same, dt)
