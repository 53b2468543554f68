"""Property tests: shape inference and broadcasting of the Tensor builders agree with NumPy,
and shapes NumPy rejects raise FuelGraphError when the node is built (nothing is realized)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fuelgraph as fg
from fuelgraph.runtime import executor

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

small_shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)
nonempty_shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=4)


def _arr(draw, shape, kind):
    if kind == "int":
        return draw(hnp.arrays(np.int64, shape, elements=st.integers(-20, 20)))
    return draw(hnp.arrays(np.float64, shape,
                           elements=st.floats(-8, 8, allow_nan=False, width=64)))


BIN = {
    "add": (lambda a, b: a + b, np.add),
    "sub": (lambda a, b: a - b, np.subtract),
    "mul": (lambda a, b: a * b, np.multiply),
    "maximum": (lambda a, b: a.maximum(b), np.maximum),
    "minimum": (lambda a, b: a.minimum(b), np.minimum),
    "lt": (lambda a, b: a < b, np.less),
    "eq": (lambda a, b: a == b, np.equal),
    "ge": (lambda a, b: a >= b, np.greater_equal),
}


@SETTINGS
@given(data=st.data(), shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0,
                                                                  max_dims=4, max_side=4),
       kind=st.sampled_from(["int", "float"]), op=st.sampled_from(sorted(BIN)))
def test_binary_broadcast_matches_numpy(data, shapes, kind, op):
    sa, sb = shapes.input_shapes
    a, b = _arr(data.draw, sa, kind), _arr(data.draw, sb, kind)
    f, ref = BIN[op]
    out = f(fg.tensor(a), fg.tensor(b))
    exp = ref(a, b)
    assert out.shape == np.broadcast_shapes(sa, sb) == exp.shape
    got = out.numpy()
    assert got.shape == exp.shape
    assert got.dtype == exp.dtype
    np.testing.assert_array_equal(got, exp)


@SETTINGS
@given(data=st.data(), shapes=hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0,
                                                                  max_dims=3, max_side=3))
def test_where_three_way_broadcast_matches_numpy(data, shapes):
    sc, sa, sb = shapes.input_shapes
    c = data.draw(hnp.arrays(np.bool_, sc))
    a, b = _arr(data.draw, sa, "float"), _arr(data.draw, sb, "float")
    out = fg.where(fg.tensor(c), fg.tensor(a), fg.tensor(b))
    exp = np.where(c, a, b)
    assert out.shape == exp.shape == np.broadcast_shapes(sc, sa, sb)
    np.testing.assert_array_equal(out.numpy(), exp)


@SETTINGS
@given(data=st.data(), shape=small_shapes, scalar=st.integers(-5, 5),
       left=st.booleans(), kind=st.sampled_from(["int", "float"]))
def test_python_scalar_operand_either_side(data, shape, scalar, left, kind):
    a = _arr(data.draw, shape, kind)
    x = fg.tensor(a)
    got = (scalar * x + x - scalar) if left else (x * scalar - scalar + x)
    exp = (scalar * a + a - scalar) if left else (a * scalar - scalar + a)
    assert got.shape == exp.shape and got.dtype == x.dtype
    np.testing.assert_array_equal(got.numpy(), exp)


@SETTINGS
@given(sa=nonempty_shapes, sb=nonempty_shapes, op=st.sampled_from(["add", "mul", "lt", "where",
                                                                   "maximum"]))
def test_non_broadcastable_raises_at_build_time(sa, sb, op):
    try:
        np.broadcast_shapes(sa, sb)
        assume(False)
    except ValueError:
        pass
    a, b = fg.tensor(np.zeros(sa)), fg.tensor(np.ones(sb))
    before = dict(executor.STATS)
    with pytest.raises(fg.FuelGraphError) as ei:
        if op == "where":
            fg.where(a > 0, a, b)
        elif op == "add":
            a + b
        elif op == "mul":
            a * b
        elif op == "lt":
            a < b
        else:
            a.maximum(b)
    assert "broadcast" in str(ei.value)
    assert executor.STATS == before  # nothing was planned or realized


@SETTINGS
@given(shape=nonempty_shapes, target=nonempty_shapes)
def test_broadcast_to_matches_numpy(shape, target):
    a = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    try:
        exp = np.broadcast_to(a, target)
    except ValueError:
        before = dict(executor.STATS)
        with pytest.raises(fg.FuelGraphError):
            fg.tensor(a).broadcast_to(target)
        assert executor.STATS == before
        return
    out = fg.tensor(a).broadcast_to(target)
    assert out.shape == exp.shape
    np.testing.assert_array_equal(out.numpy(), exp)


@st.composite
def reshape_case(draw):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=4))
    n = math.prod(shape)
    # factor n into a random new shape, optionally replace one entry by -1
    dims, rest = [], n
    for _ in range(draw(st.integers(0, 3))):
        divs = [d for d in range(1, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divs))
        dims.append(d)
        rest //= d
    dims.append(rest)
    dims = draw(st.permutations(dims))
    if draw(st.booleans()):
        dims = list(dims)
        dims[draw(st.integers(0, len(dims) - 1))] = -1
    return shape, tuple(dims)


@SETTINGS
@given(case=reshape_case())
def test_reshape_matches_numpy(case):
    shape, new = case
    a = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    exp = a.reshape(new)
    out = fg.tensor(a).reshape(new)
    assert out.shape == exp.shape
    np.testing.assert_array_equal(out.numpy(), exp)


@SETTINGS
@given(shape=nonempty_shapes, new=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1,
                                                    max_side=5))
def test_bad_reshape_raises(shape, new):
    assume(math.prod(shape) != math.prod(new))
    with pytest.raises(fg.FuelGraphError, match="reshape"):
        fg.tensor(np.zeros(shape)).reshape(new)


@SETTINGS
@given(data=st.data(), shape=hnp.array_shapes(min_dims=1, max_dims=5, min_side=1, max_side=3))
def test_permute_matches_numpy(data, shape):
    perm = data.draw(st.permutations(range(len(shape))))
    perm = [p - len(shape) if data.draw(st.booleans()) else p for p in perm]  # negative axes
    a = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    exp = np.transpose(a, perm)
    out = fg.tensor(a).permute(*perm)
    assert out.shape == exp.shape
    np.testing.assert_array_equal(out.numpy(), exp)


@st.composite
def index_case(draw):
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5))
    idx = draw(hnp.basic_indices(shape, min_dims=0, allow_newaxis=True, allow_ellipsis=True))
    return shape, idx


@SETTINGS
@given(case=index_case())
def test_getitem_matches_numpy(case):
    shape, idx = case
    a = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    exp = a[idx]
    out = fg.tensor(a)[idx]
    assert out.shape == exp.shape
    np.testing.assert_array_equal(out.numpy(), exp)


@SETTINGS
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=2, max_dims=4,
                                                max_side=3), k=st.integers(1, 3))
def test_matmul_batch_broadcast_shapes(shapes, k):
    sa, sb = shapes.input_shapes
    sa, sb = sa[:-1] + (k,), sb[:-2] + (k,) + sb[-1:]
    a = np.arange(math.prod(sa), dtype=np.float64).reshape(sa) / 7
    b = np.arange(math.prod(sb), dtype=np.float64).reshape(sb) / 5
    exp = np.matmul(a, b)
    out = fg.tensor(a) @ fg.tensor(b)
    assert out.shape == exp.shape
    np.testing.assert_allclose(out.numpy(), exp, rtol=1e-12)


@SETTINGS
@given(shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4),
       data=st.data(), keepdim=st.booleans())
def test_reduce_shapes_match_numpy(shape, data, keepdim):
    axes = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), max_size=len(shape),
                              unique_by=lambda a: a % len(shape)))
    axes = tuple(axes) if axes else None
    a = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    for name in ("sum", "max", "min", "mean"):
        exp = getattr(np, name)(a, axis=axes, keepdims=keepdim)
        out = getattr(fg.tensor(a), name)(axes, keepdim=keepdim)
        assert out.shape == np.shape(exp), (name, axes)
        np.testing.assert_allclose(out.numpy(), exp, rtol=1e-12)


@SETTINGS
@given(data=st.data(), shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3,
                                                                  max_side=3),
       dts=st.sampled_from([(np.int32, np.int64), (np.int64, np.int32), (np.float32, np.float64),
                            (np.float64, np.float32), (np.int32, np.int32),
                            (np.float32, np.float32)]),
       op=st.sampled_from(["add", "mul", "sub", "maximum"]))
def test_same_kind_promotion_matches_torch(data, shapes, dts, op):
    """Promotion follows torch (NumPy differs when one operand is 0-d: it widens to the 0-d
    operand's dtype, torch keeps the dimensioned operand's)."""
    import torch
    sa, sb = shapes.input_shapes
    a = data.draw(hnp.arrays(dts[0], sa, elements=st.integers(-50, 50)))
    b = data.draw(hnp.arrays(dts[1], sb, elements=st.integers(-50, 50)))
    f, _ = BIN[op]
    out = f(fg.tensor(a), fg.tensor(b))
    exp = getattr(torch, op)(torch.from_numpy(np.asarray(a)), torch.from_numpy(np.asarray(b))).numpy()
    assert out.dtype.np == exp.dtype and out.shape == exp.shape
    np.testing.assert_array_equal(out.numpy(), exp)


@SETTINGS
@given(case=index_case())
def test_getitem_gradient_matches_numpy_scatter(case):
    shape, idx = case
    a = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    x = fg.tensor(a, requires_grad=True)
    y = x[idx]
    g = np.arange(math.prod(y.shape), dtype=np.float64).reshape(y.shape) + 1.0
    (gx,) = fg.grad([y], [x], [fg.tensor(g)])
    exp = np.zeros(shape)
    exp[idx] += g  # basic indexing selects each element at most once
    np.testing.assert_array_equal(gx.numpy(), exp)


@SETTINGS
@given(data=st.data(), shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0,
                                                                  max_dims=3, max_side=3))
def test_broadcast_gradient_sums_over_broadcast_axes(data, shapes):
    sa, sb = shapes.input_shapes
    a, b = _arr(data.draw, sa, "float"), _arr(data.draw, sb, "float")
    x, w = fg.tensor(a, requires_grad=True), fg.tensor(b, requires_grad=True)
    out = x * w
    g = np.ones(out.shape)
    gx, gw = fg.grad([out], [x, w], [fg.tensor(g)])
    full = np.broadcast_shapes(sa, sb)
    ga = np.broadcast_to(b, full).copy()
    gb = np.broadcast_to(a, full).copy()
    # reduce to the operand shapes like numpy broadcasting inverted
    for arr, shp, got in ((ga, sa, gx), (gb, sb, gw)):
        lead = len(full) - len(shp)
        r = arr.sum(axis=tuple(range(lead))) if lead else arr
        r = r.sum(axis=tuple(i for i, d in enumerate(shp) if d == 1 and r.shape[i] != 1),
                  keepdims=True) if r.ndim else r
        assert got.shape == shp
        np.testing.assert_allclose(got.numpy(), r.reshape(shp), rtol=1e-12, atol=1e-12)
