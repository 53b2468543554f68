"""Forward value and gradient of every primitive (and the Tensor builders over them) against
torch CPU in float64 (NumPy where torch has no equivalent, e.g. negative-step slicing).
Every expectation comes from torch / NumPy, never from fuelgraph itself."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import fuelgraph as fg

RTOL, ATOL = 1e-9, 1e-11


def _rng(seed=0):
    return np.random.default_rng(seed)


def _fg_in(a):
    a = np.asarray(a) if isinstance(a, (np.generic, float)) else a
    if isinstance(a, np.ndarray):
        return fg.tensor(a, requires_grad=a.dtype == np.float64)
    return a


def _t_in(a):
    a = np.asarray(a) if isinstance(a, (np.generic, float)) else a
    if isinstance(a, np.ndarray):
        return torch.tensor(a, requires_grad=a.dtype == np.float64)
    return a


def check(fg_fn, t_fn, *arrays, grad=True, rtol=RTOL, atol=ATOL, seed=1):
    """fg_fn / t_fn receive fuelgraph / torch versions of `arrays` (float64 arrays are
    differentiated). Compares the forward value and the VJP with a random cotangent."""
    arrays = [np.asarray(a) if isinstance(a, np.generic) else a for a in arrays]
    fx = [_fg_in(a) for a in arrays]
    tx = [_t_in(a) for a in arrays]
    out = fg_fn(*fx)
    ref = t_fn(*tx)
    assert out.shape == tuple(ref.shape), (out.shape, tuple(ref.shape))
    f_wrt = [x for x, a in zip(fx, arrays) if isinstance(a, np.ndarray) and a.dtype == np.float64]
    t_wrt = [x for x, a in zip(tx, arrays) if isinstance(a, np.ndarray) and a.dtype == np.float64]
    if not grad or not f_wrt or not ref.dtype.is_floating_point:
        got = out.numpy()
        np.testing.assert_allclose(np.asarray(got, np.float64) if got.dtype != bool else got,
                                   ref.detach().numpy(), rtol=rtol, atol=atol)
        return
    g = _rng(seed).standard_normal(tuple(ref.shape)).astype(out.dtype.np)
    grads = fg.grad([out], f_wrt, [fg.tensor(g)])
    got = fg.realize([out] + grads)
    np.testing.assert_allclose(got[0], ref.detach().numpy(), rtol=rtol, atol=atol)
    tg = torch.autograd.grad([ref], t_wrt, [torch.tensor(g)], allow_unused=True)
    for i, (gg, tt, x) in enumerate(zip(got[1:], tg, t_wrt)):
        exp = np.zeros(tuple(x.shape)) if tt is None else tt.numpy()
        assert gg.shape == exp.shape, (i, gg.shape, exp.shape)
        np.testing.assert_allclose(gg, exp, rtol=rtol, atol=atol, err_msg=f"grad of input {i}")


# ---- unary ---------------------------------------------------------------------------------
def _pos(shape, rng):
    return rng.uniform(0.5, 2.0, shape)


def _nonzero(shape, rng):
    return rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)


def _normal(shape, rng):
    return rng.standard_normal(shape) * 1.5


def _off_integer(shape, rng):
    x = rng.uniform(-3, 3, shape)
    return np.where(np.abs(x - np.round(x)) < 0.05, x + 0.2, x)


UNARY = {
    "neg": (lambda x: -x, torch.neg, _normal),
    "exp": (lambda x: x.exp(), torch.exp, _normal),
    "log": (lambda x: x.log(), torch.log, _pos),
    "sqrt": (lambda x: x.sqrt(), torch.sqrt, _pos),
    "rsqrt": (lambda x: x.rsqrt(), torch.rsqrt, _pos),
    "recip": (lambda x: x.reciprocal(), torch.reciprocal, _nonzero),
    "abs": (lambda x: abs(x), torch.abs, _nonzero),
    "tanh": (lambda x: x.tanh(), torch.tanh, _normal),
    "erf": (lambda x: x.erf(), torch.erf, _normal),
    "sin": (lambda x: x.sin(), torch.sin, _normal),
    "cos": (lambda x: x.cos(), torch.cos, _normal),
    "floor": (lambda x: x.floor(), torch.floor, _off_integer),
    "sign": (lambda x: x.sign(), torch.sign, _nonzero),
}


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4)])
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, shape):
    f, t, gen = UNARY[name]
    check(f, t, gen(shape, _rng(zlib.crc32(name.encode()))))


def test_unary_sugar_composites():
    x = _normal((3, 4), _rng(3))
    check(lambda a: a.sigmoid(), torch.sigmoid, x)
    check(lambda a: a.relu(), torch.relu, x)
    check(lambda a: a.silu(), torch.nn.functional.silu, x)
    check(lambda a: a.softplus(), torch.nn.functional.softplus, x)
    check(lambda a: a.gelu(), torch.nn.functional.gelu, x)
    check(lambda a: a.square(), torch.square, x)
    check(lambda a: a.log_softmax(-1), lambda a: torch.log_softmax(a, -1), x)


# ---- binary --------------------------------------------------------------------------------
def _rem_operands(sa, sb, rng):
    a = rng.uniform(-4, 4, sa)
    b = rng.uniform(0.6, 1.7, sb) * rng.choice([-1.0, 1.0], sb)
    q = np.broadcast_to(a, np.broadcast_shapes(sa, sb)) / np.broadcast_to(b, np.broadcast_shapes(sa, sb))
    # keep a/b away from integers (the remainder is discontinuous there)
    assert np.abs(q - np.round(q)).min() > 1e-4
    return a, b


BINARY = {
    "add": (lambda a, b: a + b, lambda a, b: a + b),
    "sub": (lambda a, b: a - b, lambda a, b: a - b),
    "mul": (lambda a, b: a * b, lambda a, b: a * b),
    "div": (lambda a, b: a / b, lambda a, b: a / b),
    "pow": (lambda a, b: a ** b, lambda a, b: a ** b),
    "maximum": (lambda a, b: a.maximum(b), torch.maximum),
    "minimum": (lambda a, b: a.minimum(b), torch.minimum),
    "rem": (lambda a, b: a % b, torch.remainder),  # Python floor remainder, as torch
}
SHAPE_PAIRS = [((3, 4), (3, 4)), ((3, 1), (1, 4)), ((2, 3, 4), (4,)), ((4,), (2, 3, 4)),
               ((), (3,)), ((2, 1, 4), (3, 1)), ((5,), ())]


def _binary_operands(name, sa, sb, rng):
    if name == "pow":
        return _pos(sa, rng), _normal(sb, rng)
    if name == "div":
        return _normal(sa, rng), _nonzero(sb, rng)
    if name == "rem":
        return _rem_operands(sa, sb, rng)
    return _normal(sa, rng), _normal(sb, rng)


@pytest.mark.parametrize("sa,sb", SHAPE_PAIRS, ids=lambda s: "x".join(map(str, s)) or "0d")
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_broadcast(name, sa, sb):
    f, t = BINARY[name]
    a, b = _binary_operands(name, sa, sb, _rng(7))
    check(f, t, a, b)


@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_maximum_minimum_ties_share_gradient(name):
    rng = _rng(11)
    a = np.round(rng.standard_normal((4, 6)))
    b = np.round(rng.standard_normal((4, 6)))
    assert (a == b).sum() >= 4  # the case under test: ties split the gradient evenly
    f, t = BINARY[name]
    check(f, t, a, b)
    check(f, t, a, np.round(rng.standard_normal((6,))))  # ties under broadcasting


SCALAR_CASES = [
    ("x+s", lambda x: x + 1.5, lambda x: x + 1.5),
    ("s+x", lambda x: 1.5 + x, lambda x: 1.5 + x),
    ("x-s", lambda x: x - 3, lambda x: x - 3),
    ("s-x", lambda x: 3 - x, lambda x: 3 - x),
    ("x*s", lambda x: x * -2.5, lambda x: x * -2.5),
    ("s*x", lambda x: 2 * x, lambda x: 2 * x),
    ("x/s", lambda x: x / 4.0, lambda x: x / 4.0),
    ("s/x", lambda x: 2.0 / x, lambda x: 2.0 / x),
    ("x**s", lambda x: x.abs() ** 2.5, lambda x: x.abs() ** 2.5),
    ("s**x", lambda x: 2.0 ** x, lambda x: 2.0 ** x),
    ("max(x,s)", lambda x: x.maximum(0.25), lambda x: torch.clamp_min(x, 0.25)),
    ("min(x,s)", lambda x: x.minimum(0.25), lambda x: torch.clamp_max(x, 0.25)),
    ("x%s", lambda x: x % 0.7, lambda x: torch.remainder(x, 0.7)),
    ("npscalar*x", lambda x: np.float64(3.0) * x, lambda x: 3.0 * x),
    ("x*npscalar", lambda x: x * np.float64(3.0), lambda x: x * 3.0),
]


@pytest.mark.parametrize("case", SCALAR_CASES, ids=[c[0] for c in SCALAR_CASES])
@pytest.mark.parametrize("shape", [(), (3, 4)])
def test_scalar_operands(case, shape):
    _, f, t = case
    x = _nonzero(shape, _rng(5))
    if case[0] == "x%s":
        x = np.where(np.abs(x / 0.7 - np.round(x / 0.7)) < 1e-3, x + 0.01, x)
    check(f, t, x)


def test_scalar_keeps_tensor_dtype():
    x = fg.tensor(np.ones((2, 2), np.float64))
    assert (x + 1).dtype == fg.float64 and (2.5 * x).dtype == fg.float64
    y = fg.tensor(np.ones((2, 2), np.float32))
    assert (y * 2.0).dtype == fg.float32 and (1 - y).dtype == fg.float32


# ---- compare and where ---------------------------------------------------------------------
COMPARE = {"lt": (lambda a, b: a < b), "le": (lambda a, b: a <= b), "gt": (lambda a, b: a > b),
           "ge": (lambda a, b: a >= b), "eq": (lambda a, b: a == b), "ne": (lambda a, b: a != b)}


@pytest.mark.parametrize("name", sorted(COMPARE))
def test_compare(name):
    rng = _rng(2)
    a = np.round(rng.standard_normal((3, 4)))
    b = np.round(rng.standard_normal((4,)))
    f = COMPARE[name]
    out = f(fg.tensor(a), fg.tensor(b))
    assert out.dtype == fg.bool
    np.testing.assert_array_equal(out.numpy(), f(torch.tensor(a), torch.tensor(b)).numpy())
    np.testing.assert_array_equal(f(fg.tensor(a), 0.0).numpy(), f(torch.tensor(a), 0.0).numpy())


def test_where_grads():
    rng = _rng(4)
    a, b = _normal((3, 4), rng), _normal((4,), rng)
    check(lambda x, y: fg.where(x > y, x * 2.0, y.exp()),
          lambda x, y: torch.where(x > y, x * 2.0, y.exp()), a, b)
    check(lambda x: fg.where(x > 0, x, 0.0),
          lambda x: torch.where(x > 0, x, torch.zeros((), dtype=torch.float64)), a)
    check(lambda x: fg.where(x < 0.3, 1.5, x),
          lambda x: torch.where(x < 0.3, torch.full((), 1.5, dtype=torch.float64), x), a)
    c = rng.standard_normal((3, 1)) > 0
    check(lambda cc, x, y: fg.where(cc, x, y), lambda cc, x, y: torch.where(cc, x, y), c, a, b)
    check(lambda x: x.where(x > 0.1, -x), lambda x: torch.where(x > 0.1, x, -x), a)


# ---- cast ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mid", ["float32", "bfloat16", "float16"])
def test_cast_between_floats(mid):
    x = _normal((3, 5), _rng(6))
    fmid, tmid = getattr(fg, mid), getattr(torch, mid)
    check(lambda a: (a.astype(fmid) * 3.0).astype(fg.float64) * a,
          lambda a: (a.to(tmid) * 3.0).to(torch.float64) * a, x, rtol=0, atol=0)


def test_cast_output_dtype_and_grad_dtype():
    x = fg.tensor(np.linspace(-1, 1, 6), dtype=fg.float32, requires_grad=True)
    y = x.astype(fg.float64)
    assert y.dtype == fg.float64
    (g,) = fg.grad((y * y).sum(), [x])
    assert g.dtype == fg.float32
    np.testing.assert_allclose(g.numpy(), 2 * np.linspace(-1, 1, 6).astype(np.float32), rtol=1e-6)


def test_cast_float_to_int_is_not_differentiated():
    x = _normal((4,), _rng(9)) * 3
    check(lambda a: a.astype(fg.int64).astype(fg.float64) + a,
          lambda a: a.to(torch.int64).to(torch.float64) + a, x)


# ---- reductions ----------------------------------------------------------------------------
AXES = [None, 0, -1, 1, (0, 2), (2, 0), (1,), (0, 1, 2)]


def _dims(axis, nd):
    if axis is None:
        return tuple(range(nd))
    return (axis,) if isinstance(axis, int) else tuple(axis)


def _torch_prod(x, axis, keepdim):
    dims = sorted((d % x.ndim for d in _dims(axis, x.ndim)), reverse=True)
    for d in dims:
        x = x.prod(d, keepdim=keepdim)
    return x


def _torch_reduce(kind, x, axis, keepdim):
    d = _dims(axis, x.ndim)
    if kind == "sum":
        return x.sum(dim=d, keepdim=keepdim)
    if kind == "mean":
        return x.mean(dim=d, keepdim=keepdim)
    if kind == "max":
        return torch.amax(x, dim=d, keepdim=keepdim)
    if kind == "min":
        return torch.amin(x, dim=d, keepdim=keepdim)
    return _torch_prod(x, axis, keepdim)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("kind", ["sum", "max", "min", "prod", "mean"])
def test_reductions(kind, axis, keepdim):
    rng = _rng(12)
    if kind in ("max", "min"):
        x = np.round(rng.standard_normal((2, 3, 4)))  # many ties: gradient shared evenly
    elif kind == "prod":
        x = _nonzero((2, 3, 4), rng)
    else:
        x = _normal((2, 3, 4), rng)
    check(lambda a: getattr(a, kind)(axis, keepdim=keepdim),
          lambda a: _torch_reduce(kind, a, axis, keepdim), x)


def test_reduce_max_all_equal_row_and_amax_alias():
    x = np.array([[2.0, 2.0, 2.0, 2.0], [1.0, 3.0, 3.0, -1.0]])
    check(lambda a: a.max(-1), lambda a: torch.amax(a, -1), x)
    check(lambda a: a.amin(0), lambda a: torch.amin(a, 0), x)
    check(lambda a: a.max(), lambda a: torch.amax(a), x)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)], ids=str)
def test_prod_with_zeros(axis, keepdim):
    """Windows with no zero, one zero and two zeros: the gradient is the product of the other
    elements (torch), never 0/0."""
    x = np.array([[0.0, 2.0, 3.0], [1.0, -2.0, 3.0], [0.0, 0.0, 4.0], [-1.0, 0.0, 5.0]])
    check(lambda a: a.prod(axis, keepdim=keepdim), lambda a: _torch_prod(a, axis, keepdim), x)
    check(lambda a: (a[1:] * a[:-1]).prod(axis, keepdim=keepdim),
          lambda a: _torch_prod(a[1:] * a[:-1], axis, keepdim), x)


def test_prod_with_zeros_second_order():
    a = np.array([[0.0, 2.0, 3.0], [1.0, 2.0, -3.0], [0.0, 0.0, 4.0]])
    x = fg.tensor(a, requires_grad=True)
    (g,) = fg.grad((x.prod(1) ** 2).sum(), [x])
    (h,) = fg.grad((g * g).sum(), [x])
    tx = torch.tensor(a, requires_grad=True)
    (tg,) = torch.autograd.grad((tx.prod(1) ** 2).sum(), [tx], create_graph=True)
    (th,) = torch.autograd.grad((tg * tg).sum(), [tx])
    got = fg.realize([g, h])
    np.testing.assert_allclose(got[0], tg.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(got[1], th.numpy(), rtol=1e-12)


def test_abs_and_sign_at_zero():
    x = np.array([-1.5, 0.0, 2.0, -0.0])
    check(lambda a: a.abs(), torch.abs, x)
    check(lambda a: a.sign() * a, lambda a: a.sign() * a, x)


def test_reduce_1d_and_singleton_axes():
    rng = _rng(13)
    check(lambda a: a.sum(0), lambda a: a.sum(0), _normal((7,), rng))
    check(lambda a: a.max(1, keepdim=True), lambda a: torch.amax(a, 1, keepdim=True),
          _normal((3, 1, 2), rng))
    check(lambda a: a.sum(), lambda a: a.sum(), _normal((), rng))


# ---- movement ------------------------------------------------------------------------------
MOVES = [
    ("reshape", lambda a: a.reshape(6, 4), lambda a: a.reshape(6, 4)),
    ("reshape-1", lambda a: a.reshape(-1), lambda a: a.reshape(-1)),
    ("reshape4", lambda a: a.reshape(4, -1, 2), lambda a: a.reshape(4, -1, 2)),
    ("view", lambda a: a.view((2, 12)), lambda a: a.view(2, 12)),
    ("flatten", lambda a: a.flatten(1), lambda a: a.flatten(1)),
    ("unsqueeze", lambda a: a.unsqueeze(1), lambda a: a.unsqueeze(1)),
    ("permute", lambda a: a.permute(2, 0, 1), lambda a: a.permute(2, 0, 1)),
    ("permute_neg", lambda a: a.permute(-1, 0, -2), lambda a: a.permute(-1, 0, -2)),
    ("transpose", lambda a: a.transpose(0, 2), lambda a: a.transpose(0, 2)),
    ("transpose_neg", lambda a: a.transpose(-1, -2), lambda a: a.transpose(-1, -2)),
    ("mT", lambda a: a.mT, lambda a: a.mT),
    ("T_of_2d", lambda a: a.reshape(6, 4).T, lambda a: a.reshape(6, 4).T),
    ("broadcast_mid", lambda a: a[:, :1, :].broadcast_to(2, 5, 4),
     lambda a: a[:, :1, :].broadcast_to(2, 5, 4)),
    ("broadcast_rank", lambda a: a.broadcast_to(3, 2, 3, 4), lambda a: a.broadcast_to(3, 2, 3, 4)),
    ("expand", lambda a: a[0, 0].expand((5, 4)), lambda a: a[0, 0].expand(5, 4)),
    ("squeeze", lambda a: a[:, :1].squeeze(1), lambda a: a[:, :1].squeeze(1)),
    ("flip", lambda a: a.flip((0, 2)), lambda a: a.flip((0, 2))),
    ("stack", lambda a: fg.stack([a, a * 2.0], 1), lambda a: torch.stack([a, a * 2.0], 1)),
]


@pytest.mark.parametrize("case", MOVES, ids=[m[0] for m in MOVES])
def test_movement(case):
    _, f, t = case
    check(f, t, _normal((2, 3, 4), _rng(14)))


def test_broadcast_scalar_to_shape():
    check(lambda a: a.broadcast_to(2, 3) * 1.0, lambda a: a.broadcast_to(2, 3) * 1.0,
          np.array(1.75))


GETITEMS = [
    1, -1, (slice(None), 1), (slice(None), slice(1, 3)), slice(None, None, 2),
    (slice(1, None, 2), slice(None, None, -1)), (Ellipsis, slice(None, None, -2)),
    (None, 1, Ellipsis, None), (slice(None), -1, slice(1, None)), slice(None, None, -3),
    (Ellipsis, 0), (1, 2, 3), (slice(4, 0, -2), Ellipsis, slice(-1, -6, -3)),
    (slice(2, 2),), (None,), (Ellipsis,), (0, None, slice(None, None, -1), None),
    (slice(-100, 100, 3), slice(None), slice(10, None)),
]


@pytest.mark.parametrize("idx", GETITEMS, ids=repr)
def test_getitem(idx):
    x = _normal((5, 4, 6), _rng(15))
    out = fg.tensor(x, requires_grad=True)
    y = out[idx]
    ref = x[idx]
    assert y.shape == ref.shape
    g = _rng(16).standard_normal(ref.shape)
    (gx,) = fg.grad([y], [out], [fg.tensor(g)])
    got = fg.realize([y, gx])
    np.testing.assert_array_equal(got[0], ref)
    exp = np.zeros_like(x)
    exp[idx] += g  # basic indexing: every element selected at most once
    np.testing.assert_array_equal(got[1], exp)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cat(axis):
    rng = _rng(17)
    shapes = {0: [(1, 3, 4), (2, 3, 4), (3, 3, 4)], 1: [(2, 1, 4), (2, 5, 4), (2, 2, 4)],
              -1: [(2, 3, 1), (2, 3, 3), (2, 3, 2)]}[axis]
    arrs = [_normal(s, rng) for s in shapes]
    check(lambda *ts: fg.cat(ts, axis), lambda *ts: torch.cat(ts, axis), *arrs)
    check(lambda a: fg.cat([a], axis), lambda a: torch.cat([a], axis), arrs[0])
    check(lambda a, b: fg.cat([a, b * a.sum(), a], axis),
          lambda a, b: torch.cat([a, b * a.sum(), a], axis), arrs[0], arrs[1])


PADS = [
    [(1, 2), (0, 3)],
    [(0, 0), (2, 0)],
    [(-1, 2), (1, -2)],
    [(-1, -1), (-2, 0)],
    [(3, -2), (0, 0)],
]


@pytest.mark.parametrize("value", [0.0, 2.5])
@pytest.mark.parametrize("pads", PADS, ids=str)
def test_pad(pads, value):
    x = _normal((4, 5), _rng(18))
    tp = tuple(v for lo_hi in reversed(pads) for v in lo_hi)  # torch: last axis first
    check(lambda a: a.pad(pads, value=value),
          lambda a: torch.nn.functional.pad(a, tp, value=value), x)


def test_pad_3d():
    x = _normal((2, 3, 4), _rng(19))
    pads = [(0, 1), (-1, 2), (2, -1)]
    check(lambda a: a.pad(pads), lambda a: torch.nn.functional.pad(a, (2, -1, -1, 2, 0, 1)), x)


@pytest.mark.parametrize("axis,ishape", [(1, (3, 4)), (1, (2, 7)), (0, (6, 5)), (0, (2, 3)),
                                         (-1, (3, 2))])
def test_gather(axis, ishape):
    rng = _rng(20)
    x = _normal((3, 5), rng)
    idx = rng.integers(0, x.shape[axis], ishape)  # repeated indices accumulate in the grad
    check(lambda a, i: a.gather(axis, i), lambda a, i: torch.gather(a, axis, i), x, idx)


def test_gather_3d():
    rng = _rng(21)
    x = _normal((2, 4, 3), rng)
    idx = rng.integers(0, 4, (2, 6, 3))
    check(lambda a, i: a.gather(1, i), lambda a, i: torch.gather(a, 1, i), x, idx)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_take_index_select(axis):
    rng = _rng(22)
    x = _normal((3, 4, 5), rng)
    n = x.shape[axis]
    idx = rng.integers(0, n, (7,))
    check(lambda a, i: a.take(i, axis), lambda a, i: torch.index_select(a, axis, i), x, idx)
    check(lambda a, i: a.index_select(axis, i), lambda a, i: torch.index_select(a, axis, i), x, idx)
    idx2 = rng.integers(0, n, (2, 3))
    ax = axis % 3
    check(lambda a, i: a.take(i, axis),
          lambda a, i: torch.index_select(a, axis, i.reshape(-1)).reshape(
              a.shape[:ax] + (2, 3) + a.shape[ax + 1:]), x, idx2)


def test_getitem_with_index_list():
    x = _normal((5, 3), _rng(23))
    check(lambda a: a[[4, 0, 0, 2]], lambda a: a[[4, 0, 0, 2]], x)
    check(lambda a, i: a[i], lambda a, i: a[i], x, np.array([1, 1, 3]))


@pytest.mark.parametrize("axis", [0, 1])
def test_scatter_add(axis):
    rng = _rng(24)
    base = _normal((4, 5), rng)
    src = _normal((3, 5) if axis == 0 else (4, 3), rng)
    idx = rng.integers(0, base.shape[axis], src.shape)
    check(lambda b, i, s: b.scatter_add(axis, i, s),
          lambda b, i, s: torch.scatter_add(b, axis, i, s), base, idx, src)


MATMULS = [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)),
           ((2, 1, 3, 4), (5, 4, 6)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,)), ((1, 3, 4), (2, 4, 2)),
           ((2, 3, 4), (2, 4, 5))]


@pytest.mark.parametrize("sa,sb", MATMULS, ids=str)
def test_matmul(sa, sb):
    rng = _rng(25)
    a, b = _normal(sa, rng), _normal(sb, rng)
    check(lambda x, y: x @ y, torch.matmul, a, b)
    check(lambda x, y: fg.matmul(x, y), torch.matmul, a, b)


@pytest.mark.parametrize("n", [-3, -2, -1, 0, 1, 2, 3, 5])
def test_integer_power(n):
    x = _nonzero((3, 4), _rng(26))
    check(lambda a: a ** n, lambda a: a ** n, x)
    check(lambda a: a ** float(n), lambda a: a ** float(n), x)
    check(lambda a: (a * 1.5) ** n * a, lambda a: (a * 1.5) ** n * a, x)


# ---- second order --------------------------------------------------------------------------
SECOND = [
    ("tanh*exp", lambda x, y: (x.tanh() * y.exp() * x).sum(),
     lambda x, y: (x.tanh() * y.exp() * x).sum()),
    ("pow_int+max", lambda x, y: (x ** 3).sum() + (x * y).max(-1).sum(),
     lambda x, y: (x ** 3).sum() + torch.amax(x * y, -1).sum()),
    ("max_min_ops", lambda x, y: (x.maximum(y) * x.sin() + x.minimum(y * 0.5).cos()).sum(),
     lambda x, y: (torch.maximum(x, y) * x.sin() + torch.minimum(x, y * 0.5).cos()).sum()),
    ("softmax_sugar", lambda x, y: (x.softmax(-1) * y).sum() + (x.softmax(-1) ** 2).sum(),
     lambda x, y: (torch.softmax(x, -1) * y).sum() + (torch.softmax(x, -1) ** 2).sum()),
    ("matmul", lambda x, y: ((x @ y.mT).tanh() ** 2).sum(),
     lambda x, y: ((x @ y.mT).tanh() ** 2).sum()),
    ("div_rsqrt", lambda x, y: (x / (y * y + 1.0).sqrt() + (x * x + 2.0).rsqrt()).sum(),
     lambda x, y: (x / (y * y + 1.0).sqrt() + (x * x + 2.0).rsqrt()).sum()),
    ("movement", lambda x, y: ((x[:, ::2] * y[:, 1::2]).pad([(1, 0), (0, 2)]) ** 2).sum()
     + fg.cat([x, y], 0).prod(0).sum(),
     lambda x, y: (torch.nn.functional.pad(x[:, ::2] * y[:, 1::2], (0, 2, 1, 0)) ** 2).sum()
     + torch.cat([x, y], 0).prod(0).sum()),
    ("gather_log", lambda x, y: (x.gather(1, fg.tensor(np.array([[0, 2], [3, 3], [1, 0]])))
                                 .exp() * y[:, :2]).sum() + (y * y + 1.0).log().mean(),
     lambda x, y: (torch.gather(x, 1, torch.tensor([[0, 2], [3, 3], [1, 0]])).exp()
                   * y[:, :2]).sum() + (y * y + 1.0).log().mean()),
    ("erf_recip_rem", lambda x, y: (x.erf() * (y.abs() + 1.0).reciprocal() + (x % 0.9) * y).sum(),
     lambda x, y: (x.erf() * (y.abs() + 1.0).reciprocal() + torch.remainder(x, 0.9) * y).sum()),
]


@pytest.mark.parametrize("case", SECOND, ids=[c[0] for c in SECOND])
def test_second_order(case):
    _, f, t = case
    rng = _rng(27)
    x, y = _nonzero((3, 4), rng), _nonzero((3, 4), rng)
    v = [rng.standard_normal((3, 4)) for _ in range(2)]
    fx, fy = fg.tensor(x, requires_grad=True), fg.tensor(y, requires_grad=True)
    g1 = fg.grad(f(fx, fy), [fx, fy])
    hv = fg.grad(sum(((g * fg.tensor(w)).sum() for g, w in zip(g1, v)), fg.tensor(0.0)
                     .astype(fg.float64)), [fx, fy])
    got = fg.realize(list(g1) + list(hv))
    tx, ty = torch.tensor(x, requires_grad=True), torch.tensor(y, requires_grad=True)
    tg1 = torch.autograd.grad(t(tx, ty), [tx, ty], create_graph=True)
    thv = torch.autograd.grad(sum((g * torch.tensor(w)).sum() for g, w in zip(tg1, v)),
                              [tx, ty], allow_unused=True)
    for a, b in zip(got, list(tg1) + list(thv)):
        exp = np.zeros((3, 4)) if b is None else b.detach().numpy()
        np.testing.assert_allclose(a, exp, rtol=1e-8, atol=1e-10)


def test_second_order_through_helpers_whose_inputs_depend_on_each_other():
    """Backward helpers (POWI_BACKWARD, REDUCE_MAX_TO_BACKWARD) take x and a cotangent that may
    itself be a function of x (or x itself): their partials must not be double counted."""
    a = np.array([0.3, -1.2, 2.0, 0.7])
    for f, t, go in [
        (lambda x: x ** 3, lambda x: x ** 3, lambda x: x),
        (lambda x: x ** -2, lambda x: x ** -2, lambda x: x.sin()),
        (lambda x: x.max(0, keepdim=True), lambda x: x.amax(0, keepdim=True),
         lambda x: (x * x).sum().reshape(1) * 3.0),
        (lambda x: x.reshape(2, 2).min(1), lambda x: x.reshape(2, 2).amin(1),
         lambda x: x.reshape(2, 2).sum(1)),
    ]:
        x = fg.tensor(a, requires_grad=True)
        y = f(x)
        (g,) = fg.grad([y], [x], [go(x)])
        (h,) = fg.grad((g * g).sum(), [x])
        tx = torch.tensor(a, requires_grad=True)
        ty = t(tx)
        (tg,) = torch.autograd.grad([ty], [tx], [go(tx)], create_graph=True)
        (th,) = torch.autograd.grad((tg * tg).sum(), [tx])
        got = fg.realize([g, h])
        np.testing.assert_allclose(got[0], tg.detach().numpy(), rtol=1e-10)
        np.testing.assert_allclose(got[1], th.numpy(), rtol=1e-10)


def test_third_order_scalar():
    x = fg.tensor(np.array([0.3, -1.2, 2.0]), requires_grad=True)
    (g,) = fg.grad((x.sin() * x ** 3).sum(), [x])
    (h,) = fg.grad(g.sum(), [x])
    (k,) = fg.grad(h.sum(), [x])
    tx = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    (tg,) = torch.autograd.grad((tx.sin() * tx ** 3).sum(), [tx], create_graph=True)
    (th,) = torch.autograd.grad(tg.sum(), [tx], create_graph=True)
    (tk,) = torch.autograd.grad(th.sum(), [tx])
    for a, b in zip(fg.realize([g, h, k]), (tg, th, tk)):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-9, atol=1e-12)


# ---- entry points: backward, accumulation, grad_outputs, multiple outputs ------------------
def test_backward_accumulates_over_two_calls():
    rng = _rng(28)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4,))
    x, w = fg.tensor(a, requires_grad=True), fg.tensor(b, requires_grad=True)
    loss = ((x * w).tanh() ** 2).sum()
    loss.backward()
    g_first = x.grad.numpy().copy()
    loss.backward()
    tx, tw = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    tl = ((tx * tw).tanh() ** 2).sum()
    tl.backward(retain_graph=True)
    np.testing.assert_allclose(g_first, tx.grad.numpy(), rtol=1e-10)
    tl.backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-10)
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-10)


def test_backward_with_explicit_gradient_and_unused_leaf():
    rng = _rng(29)
    a, g = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    x = fg.tensor(a, requires_grad=True)
    unused = fg.tensor(np.ones(3), requires_grad=True)
    y = x.exp() * x
    y.backward(fg.tensor(g))
    tx = torch.tensor(a, requires_grad=True)
    (tx.exp() * tx).backward(torch.tensor(g))
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-10)
    assert unused.grad is None


def test_grad_multiple_outputs_and_inputs():
    rng = _rng(30)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    g1, g2 = rng.standard_normal((3, 2)), rng.standard_normal((4,))
    x, w = fg.tensor(a, requires_grad=True), fg.tensor(b, requires_grad=True)
    y1, y2 = (x @ w).sin(), (x * x).sum(0)
    gx, gw = fg.grad([y1, y2], [x, w], [fg.tensor(g1), fg.tensor(g2)])
    tx, tw = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    tgx, tgw = torch.autograd.grad([(tx @ tw).sin(), (tx * tx).sum(0)], [tx, tw],
                                   [torch.tensor(g1), torch.tensor(g2)])
    np.testing.assert_allclose(gx.numpy(), tgx.numpy(), rtol=1e-10)
    np.testing.assert_allclose(gw.numpy(), tgw.numpy(), rtol=1e-10)


def test_grad_wrt_intermediate_and_unreached_input():
    rng = _rng(31)
    a = rng.standard_normal((3,))
    x = fg.tensor(a, requires_grad=True)
    h = x.exp()
    z = fg.tensor(np.ones(5), requires_grad=True)
    gh, gz = fg.grad((h * h).sum(), [h, z])
    np.testing.assert_allclose(gh.numpy(), 2 * np.exp(a), rtol=1e-12)
    np.testing.assert_array_equal(gz.numpy(), np.zeros(5))


def test_grad_float32_vs_float64_finite_differences():
    """An independent check of a composite gradient by float64 central differences."""
    rng = _rng(32)
    a = rng.standard_normal((2, 3))

    def f_np(v):
        return np.sum(np.tanh(v) * np.sin(v * 2.0) / (1.0 + v * v))

    x = fg.tensor(a, requires_grad=True)
    (g,) = fg.grad((x.tanh() * (x * 2.0).sin() / (1.0 + x * x)).sum(), [x])
    fd = np.zeros_like(a)
    eps = 1e-6
    for i in np.ndindex(a.shape):
        e = np.zeros_like(a)
        e[i] = eps
        fd[i] = (f_np(a + e) - f_np(a - e)) / (2 * eps)
    np.testing.assert_allclose(g.numpy(), fd, rtol=1e-6, atol=1e-8)
