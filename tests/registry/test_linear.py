"""FUSED_LINEAR (id 2) vs torch CPU: forward over the four float dtypes and broadcast batch
shapes, gradients (grad_b summed over broadcast batches, H.14) vs torch autograd and float64
finite differences, recipe vs kernel, validation errors. SILU_MUL (silu(g) * u) and its backward
helper vs torch: forward and gradients over the float dtypes, fusion from the idiom, the kernel
against its recipe."""
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

import fuelgraph as fg
from oracle import assert_close_dtype
import fuelgraph.functional as F
from fuelgraph import FuelGraphError, FusedOps

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
      "float16": np.float16}
TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
         "float16": torch.float16}

# (a shape, b shape): plain 2-D, batched a with shared b, broadcast batches either way
SHAPES = [((5, 7), (7, 3)), ((2, 5, 7), (7, 3)), ((2, 1, 4, 6), (3, 6, 5)),
          ((4, 6), (3, 6, 5)), ((2, 3, 4, 6), (2, 3, 6, 5)), ((1, 4, 6), (2, 6, 5))]


def _inputs(rng, sa, sb, dtype):
    a = rng.standard_normal(sa).astype(NP[dtype])
    b = rng.standard_normal(sb).astype(NP[dtype])
    c = rng.standard_normal(sb[-1]).astype(NP[dtype])
    return a, b, c


def _torch_linear(a, b, c, dtype):
    ta, tb, tc = (torch.tensor(np.asarray(v, np.float64)).to(TORCH[dtype]) for v in (a, b, c))
    return torch.matmul(ta, tb) + tc




@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("sa,sb", SHAPES)
def test_forward_matches_torch(dtype, sa, sb):
    rng = np.random.default_rng(zlib.crc32(repr((sa, sb)).encode()))
    a, b, c = _inputs(rng, sa, sb, dtype)
    out = F.fused_linear(fg.tensor(a), fg.tensor(b), fg.tensor(c))
    assert out.dtype.name == dtype
    assert fg.explain(out).fused_ops == {"fused_linear": 1}
    ref64 = _torch_linear(a, b, c, "float64").numpy()
    same = _torch_linear(a, b, c, dtype).float().numpy()
    got = out.numpy()
    assert got.dtype == NP[dtype]
    assert got.shape == tuple(torch.broadcast_shapes(sa[:-2], sb[:-2])) + (sa[-2], sb[-1])
    assert_close_dtype(got, ref64, same, dtype)
    # the recipe (lower_all) runs the same math through primitives
    low = fg.realize([out], lower_all=True)[0]
    assert_close_dtype(low, ref64, same, dtype)


@pytest.mark.parametrize("sa,sb", SHAPES)
def test_gradients_match_torch_float64(sa, sb):
    rng = np.random.default_rng(7)
    a, b, c = _inputs(rng, sa, sb, "float64")
    ts = [fg.tensor(v, requires_grad=True) for v in (a, b, c)]
    out = F.fused_linear(*ts)
    g = rng.standard_normal(out.shape)
    grads = fg.grad([out], ts, [fg.tensor(g)])
    tt = [torch.tensor(v, requires_grad=True) for v in (a, b, c)]
    (torch.matmul(tt[0], tt[1]) + tt[2]).backward(torch.tensor(g))
    for ours, ref in zip(grads, tt):
        assert ours.shape == ref.shape          # grad_b summed over a's extra batches
        np.testing.assert_allclose(ours.numpy(), ref.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gradients_match_torch_low_precision(dtype):
    rng = np.random.default_rng(3)
    a, b, c = _inputs(rng, (2, 4, 6), (6, 5), dtype)
    ts = [fg.tensor(v, requires_grad=True) for v in (a, b, c)]
    loss = (F.fused_linear(*ts) * fg.tensor(np.linspace(-1, 1, 5).astype(NP[dtype]))).sum()
    loss.backward()
    tt = [torch.tensor(np.asarray(v, np.float64), requires_grad=True) for v in (a, b, c)]
    ((torch.matmul(tt[0], tt[1]) + tt[2]) * torch.linspace(-1, 1, 5, dtype=torch.float64)).sum().backward()
    for ours, ref in zip(ts, tt):
        assert ours.grad.dtype == ours.dtype
        r = ref.grad.numpy()
        tol = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 4e-3}[dtype] * max(np.abs(r).max(), 1)
        np.testing.assert_allclose(np.asarray(ours.grad.numpy(), np.float64), r, atol=tol)


def test_gradients_vs_finite_differences():
    rng = np.random.default_rng(11)
    a, b, c = _inputs(rng, (2, 1, 3, 4), (2, 4, 3), "float64")
    w = rng.standard_normal((2, 2, 3, 3))

    def f(a_, b_, c_):
        return float((F.fused_linear(fg.tensor(a_), fg.tensor(b_), fg.tensor(c_)).numpy() * w).sum())

    ts = [fg.tensor(v, requires_grad=True) for v in (a, b, c)]
    grads = fg.grad([(F.fused_linear(*ts) * fg.tensor(w)).sum()], ts)
    h = 1e-6
    for k, (arr, g) in enumerate(zip((a, b, c), grads)):
        fd = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            args = [a.copy(), b.copy(), c.copy()]
            args[k][idx] += h
            up = f(*args)
            args[k][idx] -= 2 * h
            fd[idx] = (up - f(*args)) / (2 * h)
        np.testing.assert_allclose(g.numpy(), fd, rtol=1e-6, atol=1e-7)


def test_second_order_through_linear():
    rng = np.random.default_rng(5)
    a, b, c = _inputs(rng, (3, 4), (4, 2), "float64")
    ta = fg.tensor(a, requires_grad=True)
    tb = fg.tensor(b, requires_grad=True)
    y = F.fused_linear(ta, tb, fg.tensor(c))
    (ga,) = fg.grad([(y * y).sum()], [ta])
    (gab,) = fg.grad([ga.sum()], [tb])
    xa = torch.tensor(a, requires_grad=True)
    xb = torch.tensor(b, requires_grad=True)
    ty = xa @ xb + torch.tensor(c)
    (tga,) = torch.autograd.grad((ty * ty).sum(), xa, create_graph=True)
    (tgab,) = torch.autograd.grad(tga.sum(), xb)
    np.testing.assert_allclose(gab.numpy(), tgab.numpy(), rtol=1e-12, atol=1e-12)


def test_kernel_and_recipe_agree_float64():
    rng = np.random.default_rng(1)
    for sa, sb in SHAPES:
        a, b, c = _inputs(rng, sa, sb, "float64")
        out = F.fused_linear(fg.tensor(a), fg.tensor(b), fg.tensor(c))
        k = out.numpy()
        r = fg.realize([out], lower_all=True)[0]
        np.testing.assert_allclose(k, r, rtol=1e-13, atol=1e-13)


def test_empty_dims():
    a = fg.tensor(np.zeros((0, 3), np.float32))
    b = fg.tensor(np.ones((3, 2), np.float32))
    c = fg.tensor(np.ones(2, np.float32))
    assert F.fused_linear(a, b, c).numpy().shape == (0, 2)
    a = fg.tensor(np.zeros((2, 0), np.float32))
    b = fg.tensor(np.zeros((0, 2), np.float32))
    np.testing.assert_array_equal(F.fused_linear(a, b, c).numpy(), np.ones((2, 2), np.float32))


@pytest.mark.parametrize("sa,sb,sc,dts,match", [
    ((3, 4), (5, 2), (2,), "fff", "K = 4"),
    ((3, 4), (4, 2), (3,), "fff", "bias has shape"),
    ((3, 4), (4, 2), (1, 2), "fff", "bias has shape"),
    ((4,), (4, 2), (2,), "fff", "rank >= 2"),
    ((3, 4), (4,), (2,), "fff", "rank >= 2"),
    ((2, 3, 4), (3, 4, 2), (2,), "fff", "do not broadcast"),
    ((3, 4), (4, 2), (2,), "iii", "dtype"),
    # the cases the NumPy kernel used to re-check at run time (now build-time only)
    ((4, 8), (7, 3), (3,), "fff", r"b has shape \(7, 3\), expected K = 8"),
    ((4, 8), (8, 3), (4,), "fff", r"bias has shape \(4,\), expected \(3,\)"),
    ((4, 4, 8), (2, 8, 3), (3,), "fff", "batch dims .* do not broadcast"),
    ((8,), (8, 3), (3,), "fff", r"a has shape \(8,\), expected rank >= 2"),
])
def test_validation_errors(sa, sb, sc, dts, match):
    dmap = {"f": np.float32, "d": np.float64, "h": np.float16, "i": np.int32}
    ts = [fg.tensor(np.ones(s, dmap[d])) for s, d in zip((sa, sb, sc), dts)]
    with pytest.raises(FuelGraphError, match=match) as ei:
        F.fused_linear(*ts)
    assert "fused_linear" in str(ei.value)


def test_entry_facets():
    e = fg.default_registry().entry(FusedOps.FUSED_LINEAR)
    assert e.name == "fused_linear" and e.backward.kind == "decompose"
    assert e.destructive_inputs == ()
    with pytest.raises(FuelGraphError, match="3 inputs"):
        from fuelgraph.registry.core import call_fused
        call_fused(FusedOps.FUSED_LINEAR, fg.tensor(np.ones((2, 2), np.float32)))


def test_mixed_dtypes_promote_like_matmul():
    # one promotion table for `@`, `+` and fused_linear (torch's); the op itself still takes
    # one dtype (call_fused with mixed dtypes is rejected by validation)
    a = fg.tensor(np.ones((2, 3), np.float32))
    b = fg.tensor(np.ones((3, 4), np.float64))
    c = fg.tensor(np.ones(4, np.float16))
    y = F.fused_linear(a, b, c)
    assert y.dtype == (a @ b + c).dtype == fg.float64
    np.testing.assert_array_equal(y.numpy(), np.full((2, 4), 4.0))
    from fuelgraph.registry.core import call_fused
    with pytest.raises(FuelGraphError, match="b has dtype float64, expected float32"):
        call_fused(FusedOps.FUSED_LINEAR, a, b, c.astype(fg.float32))


# ---- silu_mul ---------------------------------------------------------------------------------
SILU_SHAPES = [(5, 7), (3, 4, 9), (256, 1100)]      # the last one takes the blocked pool path


def _silu_mul_torch(g, u, dy, dtype):
    tg, tu = (torch.tensor(np.asarray(v, np.float64)).to(TORCH[dtype]).requires_grad_()
              for v in (g, u))
    y = torch.nn.functional.silu(tg) * tu
    y.backward(torch.tensor(np.asarray(dy, np.float64)).to(TORCH[dtype]))
    return y.detach().double().numpy(), tg.grad.double().numpy(), tu.grad.double().numpy()


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_silu_mul_forward_and_gradients_match_torch(dtype, shape):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{shape}".encode()))
    g, u, dy = (rng.standard_normal(shape).astype(NP[dtype]) * 3 for _ in range(3))
    tg, tu = fg.tensor(g, requires_grad=True), fg.tensor(u, requires_grad=True)
    y = tg.silu() * tu                                   # the idiom, as the MLP writes it
    (y * fg.tensor(dy)).sum().backward()
    assert fg.explain([y]).fused_ops == {"silu_mul": 1}
    assert fg.explain([tg.grad, tu.grad]).fused_ops.get("silu_mul_backward") == 1
    ref64 = _silu_mul_torch(g, u, dy, "float64")
    same = _silu_mul_torch(g, u, dy, dtype)
    for ours, r64, r in zip((y, tg.grad, tu.grad), ref64, same):
        assert ours.dtype == fg.tensor(g).dtype and ours.shape == shape
        assert_close_dtype(ours.numpy(), r64, r, dtype)


@pytest.mark.parametrize("shape", SILU_SHAPES)
def test_silu_mul_kernels_and_recipes_agree(shape):
    """float32: the kernels run the recipes' operations in order (the forward bit for bit)."""
    rng = np.random.default_rng(3)
    g, u, dy = (fg.tensor(rng.standard_normal(shape).astype(np.float32) * 4) for _ in range(3))
    y = F.silu_mul(g, u)
    np.testing.assert_array_equal(y.numpy(), fg.realize([y], lower_all=True)[0])
    grads = F.silu_mul_backward(g, u, dy)
    for got, want in zip(fg.realize(list(grads)), fg.realize(list(grads), lower_all=True)):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_silu_mul_second_order_and_validation():
    rng = np.random.default_rng(4)
    g = fg.tensor(rng.standard_normal((3, 5)), requires_grad=True)
    u = fg.tensor(rng.standard_normal((3, 5)), requires_grad=True)
    (dg,) = fg.grad((F.silu_mul(g, u) ** 2).sum(), [g])
    (ddg,) = fg.grad(dg.sum(), [u])
    tg, tu = (torch.tensor(t.numpy(), requires_grad=True) for t in (g, u))
    (tdg,) = torch.autograd.grad((torch.nn.functional.silu(tg) * tu).pow(2).sum(), [tg],
                                 create_graph=True)
    (tddg,) = torch.autograd.grad(tdg.sum(), [tu])
    np.testing.assert_allclose(ddg.numpy(), tddg.numpy(), rtol=1e-10, atol=1e-12)
    with pytest.raises(FuelGraphError, match="silu_mul: u has shape"):
        F.silu_mul(fg.tensor(np.ones((2, 3), np.float32)), fg.tensor(np.ones((3,), np.float32)))
    with pytest.raises(FuelGraphError, match="silu_mul: u has dtype"):
        F.silu_mul(fg.tensor(np.ones(3, np.float32)), fg.tensor(np.ones(3, np.float64)))


@pytest.mark.parametrize("shape", [(4, 2048), (512, 1024), (300, 2048)])
def test_silu_mul_of_strided_halves(shape):
    """A prompt's or a decode step's merged gate/up product: the halves are strided views, read
    in place (whole, or in blocks of rows over the pool); the same bits as contiguous inputs."""
    gu = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    f = shape[1] // 2
    t = fg.tensor(gu)
    y = t[:, :f].silu() * t[:, f:]
    assert fg.explain([y]).fused_ops == {"silu_mul": 1}
    want = F.silu_mul(fg.tensor(np.ascontiguousarray(gu[:, :f])),
                      fg.tensor(np.ascontiguousarray(gu[:, f:])))
    np.testing.assert_array_equal(y.numpy(), want.numpy())
